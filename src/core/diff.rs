//! What applying a ruleset would change in the table the kernel holds: the comparison behind
//! `diff`, `apply`'s "unchanged" and `status`'s drift report.
//!
//! Pure: both sides are values. The live side is what [`crate::nft::Nft::read_table`] read
//! back over netlink, its rules decoded into the same [`Rule`] type the plan holds
//! ([`encode::decode_rule`]); a rule the decoder does not understand equals no wanted rule.
//! Counter values and element timeouts are state, not configuration, and are ignored.

use std::collections::BTreeSet;
use std::fmt;

use ipnet::IpNet;
use serde::Serialize;

use crate::core::ruleset::{
    AUDIT_WINDOW_SET, AuditWindow, BaseChain, ChainPolicy, Elements, Hook, Rule, Ruleset, SetId,
    SetRole, TABLE, Tuple, fmt_net, fmt_tuple,
};
use crate::nft::LiveTable;
use crate::nft::encode::{self, audit_window_key, key_spec, set_flags};
use crate::nft::live::{ChainDefinition, NFT_CHAIN_BASE, ReadRule, describe_table_flags};
use crate::nft::sys::{LiveSet, SetParams};

/// What to leave out of a comparison.
#[derive(Debug, Clone, Copy, Default)]
pub struct CompareOptions {
    /// Leave the contents of the resolved sets out: the daemon changes them all the time.
    pub ignore_resolved_contents: bool,
}

/// Whether an object exists on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Presence {
    Both,
    /// Wanted, not in the kernel: applying creates it.
    Missing,
    /// In the kernel, not wanted: applying removes it.
    Extra,
}

/// A property that differs: what the kernel has, and what is wanted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Changed {
    pub live: String,
    pub want: String,
}

/// The differences of one set; `added` are wanted elements the kernel lacks, `removed` live
/// ones that are not wanted (as nft writes them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SetDiff {
    pub name: String,
    pub presence: Presence,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub definition: Option<Changed>,
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

/// The differences of one chain; rules as nft writes them where they are known, else as
/// libnftnl prints their expressions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChainDiff {
    pub name: String,
    pub presence: Presence,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub definition: Option<Changed>,
    pub added_rules: Vec<String>,
    pub removed_rules: Vec<String>,
}

/// Everything that differs between a wanted ruleset and the live table; only objects with
/// differences are listed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TableDiff {
    /// The table is not installed at all.
    pub table_missing: bool,
    /// The table's flags differ (`dormant`: switched off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub table_flags: Option<Changed>,
    pub sets: Vec<SetDiff>,
    pub chains: Vec<ChainDiff>,
    /// Flowtables and stateful objects in the table ("quota q"): none is egress-fence's.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub extra_objects: Vec<String>,
}

impl TableDiff {
    pub fn is_empty(&self) -> bool {
        !self.table_missing
            && self.table_flags.is_none()
            && self.sets.is_empty()
            && self.chains.is_empty()
            && self.extra_objects.is_empty()
    }

    /// One line per changed object: "set allow4: +2 -1 elements".
    pub fn summary(&self) -> Vec<String> {
        if self.table_missing {
            return vec![format!("table inet {TABLE} is new (it was not installed)")];
        }
        let mut out = Vec::new();
        if let Some(flags) = &self.table_flags {
            out.push(format!(
                "table inet {TABLE}: flags {} (wanted: {})",
                flags.live, flags.want
            ));
        }
        for s in &self.sets {
            out.push(format!(
                "set {}: {}",
                s.name,
                describe_change(s.presence, &s.definition, &s.added, &s.removed, "elements")
            ));
        }
        for c in &self.chains {
            out.push(format!(
                "chain {}: {}",
                c.name,
                describe_change(
                    c.presence,
                    &c.definition,
                    &c.added_rules,
                    &c.removed_rules,
                    "rules"
                )
            ));
        }
        for o in &self.extra_objects {
            out.push(format!("{o}: not egress-fence's"));
        }
        out
    }
}

fn describe_change(
    presence: Presence,
    definition: &Option<Changed>,
    added: &[String],
    removed: &[String],
    what: &str,
) -> String {
    let mut parts = Vec::new();
    match presence {
        Presence::Missing => parts.push("missing".to_string()),
        Presence::Extra => parts.push("not egress-fence's".to_string()),
        Presence::Both => {}
    }
    if let Some(d) = definition {
        parts.push(format!("{} (wanted: {})", d.live, d.want));
    }
    if !added.is_empty() || !removed.is_empty() {
        parts.push(format!("+{} -{} {what}", added.len(), removed.len()));
    }
    parts.join(", ")
}

/// The full list, one object per paragraph, `+` for what applying adds and `-` for what it
/// removes.
impl fmt::Display for TableDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.table_missing {
            writeln!(f, "table inet {TABLE}: not installed")?;
        }
        if let Some(flags) = &self.table_flags {
            writeln!(
                f,
                "table inet {TABLE}: flags {} (wanted: {})",
                flags.live, flags.want
            )?;
        }
        for s in &self.sets {
            let what = describe_change(s.presence, &s.definition, &s.added, &s.removed, "elements");
            writeln!(f, "set {}: {what}", s.name)?;
            write_items(f, &s.added, &s.removed)?;
        }
        for c in &self.chains {
            let what = describe_change(
                c.presence,
                &c.definition,
                &c.added_rules,
                &c.removed_rules,
                "rules",
            );
            writeln!(f, "chain {}: {what}", c.name)?;
            write_items(f, &c.added_rules, &c.removed_rules)?;
        }
        for o in &self.extra_objects {
            writeln!(f, "{o}: not egress-fence's")?;
        }
        Ok(())
    }
}

fn write_items(f: &mut fmt::Formatter<'_>, added: &[String], removed: &[String]) -> fmt::Result {
    for a in added {
        writeln!(f, "  + {a}")?;
    }
    for r in removed {
        writeln!(f, "  - {r}")?;
    }
    Ok(())
}

/// Compares `want` with the live table (`None`: not installed).
pub fn compare(want: &Ruleset, live: Option<&LiveTable>, options: CompareOptions) -> TableDiff {
    let empty = LiveTable {
        flags: 0,
        chains: Vec::new(),
        rules: Vec::new(),
        sets: Vec::new(),
        objects: Vec::new(),
    };
    let table_missing = live.is_none();
    let live = live.unwrap_or(&empty);
    TableDiff {
        table_missing,
        table_flags: (live.flags != 0).then(|| Changed {
            live: describe_table_flags(live.flags),
            want: describe_table_flags(0),
        }),
        sets: compare_sets(want, live, options),
        chains: compare_chains(want, live),
        extra_objects: live
            .objects
            .iter()
            .map(|o| format!("{} {}", o.kind, o.name))
            .collect(),
    }
}

fn compare_sets(want: &Ruleset, live: &LiveTable, options: CompareOptions) -> Vec<SetDiff> {
    let mut out = Vec::new();
    for set in &want.sets {
        let name = set.id.name();
        let ignore_contents = options.ignore_resolved_contents && set.id.role == SetRole::Resolved;
        let wanted_keys = element_keys(&set.elements);
        let Some((live_set, _)) = live.sets.iter().find(|(s, _)| s.name == name) else {
            out.push(SetDiff {
                name,
                presence: Presence::Missing,
                definition: None,
                added: if ignore_contents {
                    Vec::new()
                } else {
                    render(&wanted_keys)
                },
                removed: Vec::new(),
            });
            continue;
        };
        let live_definition = definition_of(live_set);
        let definition = (live_definition != set.id.definition()).then(|| Changed {
            live: live_definition,
            want: set.id.definition(),
        });
        let held = live.read_set(set.id);
        let (added, mut removed) = if ignore_contents {
            (Vec::new(), Vec::new())
        } else {
            let live_keys = held
                .as_ref()
                .map(|c| element_keys(&c.elements))
                .unwrap_or_default();
            (
                render(&wanted_keys.difference(&live_keys).cloned().collect()),
                render(&live_keys.difference(&wanted_keys).cloned().collect()),
            )
        };
        // Elements no ruleset has are drift even where the contents are the daemon's.
        removed.extend(
            held.into_iter()
                .flat_map(|c| c.undecodable)
                .map(|e| format!("{e} (undecodable)")),
        );
        if definition.is_some() || !added.is_empty() || !removed.is_empty() {
            out.push(SetDiff {
                name,
                presence: Presence::Both,
                definition,
                added,
                removed,
            });
        }
    }
    // The audit window's elements are state (the daemon renews them, they expire): only the
    // set itself is compared.
    if want.audit.is_some() {
        match live.sets.iter().find(|(s, _)| s.name == AUDIT_WINDOW_SET) {
            None => out.push(SetDiff {
                name: AUDIT_WINDOW_SET.to_string(),
                presence: Presence::Missing,
                definition: None,
                added: Vec::new(),
                removed: Vec::new(),
            }),
            Some((live_set, _)) => {
                let live_definition = definition_of(live_set);
                if live_definition != AuditWindow::DEFINITION {
                    out.push(SetDiff {
                        name: AUDIT_WINDOW_SET.to_string(),
                        presence: Presence::Both,
                        definition: Some(Changed {
                            live: live_definition,
                            want: AuditWindow::DEFINITION.to_string(),
                        }),
                        added: Vec::new(),
                        removed: Vec::new(),
                    });
                }
            }
        }
    }
    let mut wanted: BTreeSet<String> = want.sets.iter().map(|s| s.id.name()).collect();
    if want.audit.is_some() {
        wanted.insert(AUDIT_WINDOW_SET.to_string());
    }
    for (live_set, _) in &live.sets {
        if !wanted.contains(&live_set.name) {
            out.push(SetDiff {
                name: live_set.name.clone(),
                presence: Presence::Extra,
                definition: None,
                added: Vec::new(),
                removed: Vec::new(),
            });
        }
    }
    out
}

/// A set's type and flags as nft writes them, when they are those of one of ours, else the
/// kernel's numbers; then whatever else it declares (none of ours declares anything else).
fn definition_of(set: &LiveSet) -> String {
    let (flags, key_type, key_len) = (set.flags, set.key_type, set.key_len);
    let (audit_key, audit_flags) = audit_window_key();
    let is_audit_window = audit_key.datatype == key_type
        && audit_key.len == key_len
        && audit_flags == flags
        && set.key_fields.is_empty();
    let mut out = SetId::ALL
        .into_iter()
        .find(|id| {
            let key = key_spec(*id);
            // A hash set matches the key whole; a set of intervals field by field.
            let fields_match = !id.interval() || key.concat_fields == set.key_fields;
            set_flags(*id) == flags
                && key.datatype == key_type
                && key.len == key_len
                && fields_match
        })
        .map_or_else(
            || {
                let mut raw = format!("key type {key_type:#x} of {key_len} bytes");
                if !set.key_fields.is_empty() {
                    let fields: Vec<String> = set.key_fields.iter().map(u8::to_string).collect();
                    raw.push_str(&format!(", fields {}", fields.join(",")));
                }
                raw.push_str(&format!(", flags {flags:#x}"));
                raw
            },
            SetId::definition,
        );
    if is_audit_window {
        out = AuditWindow::DEFINITION.to_string();
    }
    for param in describe_params(&set.params) {
        out.push_str("; ");
        out.push_str(&param);
    }
    out
}

/// A set's parameters other than the defaults, as nft about writes them.
fn describe_params(p: &SetParams) -> Vec<String> {
    let mut out = Vec::new();
    if p.data_type != 0 || p.data_len != 0 {
        out.push(format!(
            "maps to data type {:#x} of {} bytes",
            p.data_type, p.data_len
        ));
    }
    if p.object_type != 0 {
        out.push(format!("maps to objects of type {}", p.object_type));
    }
    if p.timeout_ms != 0 {
        out.push(format!("timeout {}ms", p.timeout_ms));
    }
    if p.gc_interval_ms != 0 {
        out.push(format!("gc-interval {}ms", p.gc_interval_ms));
    }
    if p.size != 0 {
        out.push(format!("size {}", p.size));
    }
    if p.policy != 0 {
        out.push(match p.policy {
            1 => "policy memory".to_string(),
            other => format!("policy {other}"),
        });
    }
    if p.expressions {
        out.push("expressions given to every new element".to_string());
    }
    out
}

/// An element, without what is state rather than configuration (timeouts).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum ElementKey {
    Net(IpNet),
    Tuple(Tuple),
}

fn element_keys(elements: &Elements) -> BTreeSet<ElementKey> {
    match elements {
        // Adjacent networks may be stored merged or apart: compare the space they cover.
        Elements::Networks(nets) => IpNet::aggregate(nets)
            .into_iter()
            .map(ElementKey::Net)
            .collect(),
        Elements::Tuples(tuples) => tuples.iter().copied().map(ElementKey::Tuple).collect(),
        Elements::Timed(timed) => timed.iter().map(|t| ElementKey::Tuple(t.tuple)).collect(),
    }
}

fn render(keys: &BTreeSet<ElementKey>) -> Vec<String> {
    keys.iter()
        .map(|k| match k {
            ElementKey::Net(n) => fmt_net(n),
            ElementKey::Tuple(t) => fmt_tuple(t),
        })
        .collect()
}

/// The type, hook, priority, policy and flags a chain of ours has: a base chain (see
/// [`Ruleset::chains`]) is a filter chain on its hook at the hook's priority (see
/// [`Hook::priority`]) with its policy; any other is a regular chain.
pub(crate) fn wanted_chain(base: Option<BaseChain>) -> ChainDefinition {
    let hook = base.map(|b| {
        let hook = match b.hook {
            Hook::Output => libc::NF_INET_LOCAL_OUT,
            Hook::Forward => libc::NF_INET_FORWARD,
            Hook::Input => libc::NF_INET_LOCAL_IN,
            Hook::Prerouting => libc::NF_INET_PRE_ROUTING,
        };
        let policy = match b.policy {
            ChainPolicy::Accept => libc::NF_ACCEPT,
            ChainPolicy::Drop => libc::NF_DROP,
        };
        (hook as u32, b.hook.priority(), policy as u32)
    });
    ChainDefinition {
        kind: base.map(|_| "filter".to_string()),
        hook,
        flags: if base.is_some() { NFT_CHAIN_BASE } else { 0 },
    }
}

fn compare_chains(want: &Ruleset, live: &LiveTable) -> Vec<ChainDiff> {
    let mut out = Vec::new();
    let wanted_chains = want.chains();
    for chain in &wanted_chains {
        let (name, rules) = (chain.name, chain.rules);
        let Some(live_chain) = live.chains.iter().find(|c| c.name == name) else {
            out.push(ChainDiff {
                name: name.to_string(),
                presence: Presence::Missing,
                definition: None,
                added_rules: rules.iter().map(Rule::to_string).collect(),
                removed_rules: Vec::new(),
            });
            continue;
        };
        let (held_definition, wanted_definition) =
            (ChainDefinition::of(live_chain), wanted_chain(chain.base));
        let definition = (held_definition != wanted_definition).then(|| Changed {
            live: held_definition.describe(),
            want: wanted_definition.describe(),
        });
        // Each wanted rule as the kernel would report it back, beside the rules it holds.
        let wanted: Vec<ReadRule> = rules
            .iter()
            .map(|r| ReadRule::Known(encode::as_read_back(r)))
            .collect();
        let held: Vec<&ReadRule> = live
            .rules
            .iter()
            .filter(|r| r.chain == name)
            .map(|r| &r.rule)
            .collect();
        let wanted_refs: Vec<&ReadRule> = wanted.iter().collect();
        let (added, removed) = unmatched(&wanted_refs, &held);
        let added_rules: Vec<String> = added.iter().map(|&i| rules[i].to_string()).collect();
        let removed_rules: Vec<String> = removed.iter().map(|&i| held[i].to_string()).collect();
        if definition.is_some() || !added_rules.is_empty() || !removed_rules.is_empty() {
            out.push(ChainDiff {
                name: name.to_string(),
                presence: Presence::Both,
                definition,
                added_rules,
                removed_rules,
            });
        }
    }
    for chain in &live.chains {
        if !wanted_chains.iter().any(|c| c.name == chain.name) {
            out.push(ChainDiff {
                name: chain.name.clone(),
                presence: Presence::Extra,
                definition: None,
                added_rules: Vec::new(),
                removed_rules: live
                    .rules
                    .iter()
                    .filter(|r| r.chain == chain.name)
                    .map(|r| r.rule.to_string())
                    .collect(),
            });
        }
    }
    out
}

/// The positions in `want` and in `live` outside a longest common subsequence: the rules to
/// add and to remove, order respected (a moved rule is one of each).
fn unmatched<T: PartialEq>(want: &[T], live: &[T]) -> (Vec<usize>, Vec<usize>) {
    let (n, m) = (want.len(), live.len());
    // lcs[i][j]: the longest common subsequence of want[i..] and live[j..].
    let mut lcs = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if want[i] == live[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut added, mut removed) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < n && j < m {
        if want[i] == live[j] {
            i += 1;
            j += 1;
        } else if lcs[i + 1][j] >= lcs[i][j + 1] {
            added.push(i);
            i += 1;
        } else {
            removed.push(j);
            j += 1;
        }
    }
    added.extend(i..n);
    removed.extend(j..m);
    (added, removed)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::*;
    use crate::core::plan::{plan, plan_with};
    use crate::core::policy::{L4Proto, Policy, PortRange};
    use crate::core::resolution::Resolution;
    use crate::core::ruleset::Family;
    use crate::core::ruleset::Timed;
    use crate::nft::encode::set_elements;
    use crate::nft::live::LiveRule;
    use crate::nft::sys::{LiveChain, LiveElem, LiveExpr};

    const POLICY: &str = "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\n  - cidr: 203.0.113.0/28\n    ports: [22]\ndeny:\n  - preset: cloud-metadata\ndns:\n  resolvers: [192.0.2.53]\nlog:\n  group: 100\n";

    fn resolution(addrs: &[&str]) -> Resolution {
        crate::core::plan::tests::resolution(&[("a.example", addrs)])
    }

    fn ruleset_for(policy: &str, addrs: &[&str]) -> Ruleset {
        let policy = Policy::parse(policy, Path::new("p.yaml")).expect("valid");
        plan(&policy, &resolution(addrs))
    }

    /// `rule` in chain `chain` as the kernel reports it.
    fn live_rule(chain: &str, rule: &Rule) -> LiveRule {
        let mut dumped = encode::dumped_rule(rule).unwrap();
        dumped.chain = chain.into();
        LiveRule::decode(dumped)
    }

    /// The table as the kernel would report `rs` some time after an apply: elements half
    /// way to expiry, counters that have counted something.
    fn live_of(rs: &Ruleset) -> LiveTable {
        let mut live = crate::nft::table::memory::live_of(rs);
        for rule in &mut live.rules {
            if let Some(counter) = &mut rule.counter {
                (counter.packets, counter.bytes) = (12, 960);
            }
        }
        for (_, elems) in &mut live.sets {
            for e in elems {
                e.expires_ms = e.timeout_ms.map(|t| t / 2);
            }
        }
        live
    }

    #[test]
    fn an_applied_ruleset_compares_equal_counters_and_timeouts_aside() {
        let rs = ruleset_for(POLICY, &["192.0.2.10", "2001:db8:1::10"]);
        let diff = compare(&rs, Some(&live_of(&rs)), CompareOptions::default());
        assert!(diff.is_empty(), "{diff}");
        assert!(diff.summary().is_empty());

        // Timeouts and expiry are state: a daemon's timed elements equal the plain plan's.
        let policy = Policy::parse(POLICY, Path::new("p.yaml")).unwrap();
        let timed = plan_with(&policy, &resolution(&["192.0.2.10"]), |_, _| {
            Some(std::time::Duration::from_secs(600))
        });
        let plain = ruleset_for(POLICY, &["192.0.2.10"]);
        assert!(compare(&plain, Some(&live_of(&timed)), CompareOptions::default()).is_empty());
    }

    #[test]
    fn kernel_defaults_and_counts_are_not_differences() {
        for policy in [
            POLICY.to_string(),
            POLICY.replace("log:\n  group: 100\n", ""),
        ] {
            let rs = ruleset_for(&policy, &["192.0.2.10"]);
            let diff = compare(&rs, Some(&live_of(&rs)), CompareOptions::default());
            assert!(diff.is_empty(), "{diff}");
        }
    }

    #[test]
    fn a_missing_table_is_all_new() {
        let rs = ruleset_for(POLICY, &["192.0.2.10"]);
        let diff = compare(&rs, None, CompareOptions::default());
        assert!(diff.table_missing && !diff.is_empty());
        assert_eq!(diff.sets.len(), 8);
        assert!(diff.sets.iter().all(|s| s.presence == Presence::Missing));
        let resolved4 = diff.sets.iter().find(|s| s.name == "resolved4").unwrap();
        assert_eq!(resolved4.added, vec!["192.0.2.10 . tcp . 443"]);
        let output = diff.chains.iter().find(|c| c.name == "output").unwrap();
        assert_eq!(output.added_rules.len(), rs.output.len());
        assert_eq!(output.added_rules[0], "ip hdrlength != 5 goto refused");
        assert_eq!(output.added_rules[1], "exthdr rt exists goto refused");
        assert_eq!(
            output.added_rules[2],
            "meta l4proto icmp meta skuid >= 0 oif != \"lo\" goto refused"
        );
        assert_eq!(
            output.added_rules[4],
            "oif \"lo\" meta skuid >= 0 fib saddr type != local goto refused"
        );
        assert_eq!(output.added_rules[5], "ct state established,related accept");
        assert_eq!(
            diff.summary(),
            vec!["table inet egress_fence is new (it was not installed)"]
        );
        assert!(
            diff.to_string()
                .starts_with("table inet egress_fence: not installed\n")
        );
    }

    #[test]
    fn changed_addresses_and_ports_show_as_added_and_removed_elements() {
        let before = ruleset_for(POLICY, &["192.0.2.10"]);
        let after = ruleset_for(
            &POLICY.replace("ports: [22]", "ports: [22, 2222]"),
            &["192.0.2.11"],
        );
        let diff = compare(&after, Some(&live_of(&before)), CompareOptions::default());
        let by_name: BTreeMap<&str, &SetDiff> =
            diff.sets.iter().map(|s| (s.name.as_str(), s)).collect();
        assert_eq!(by_name.len(), 2, "{diff}");
        assert_eq!(by_name["resolved4"].added, vec!["192.0.2.11 . tcp . 443"]);
        assert_eq!(by_name["resolved4"].removed, vec!["192.0.2.10 . tcp . 443"]);
        assert_eq!(by_name["allow4"].added, vec!["203.0.113.0/28 . tcp . 2222"]);
        assert!(by_name["allow4"].removed.is_empty());
        assert!(diff.chains.is_empty());
        assert_eq!(
            diff.summary(),
            vec![
                "set allow4: +1 -0 elements",
                "set resolved4: +1 -1 elements"
            ]
        );
        let text = diff.to_string();
        assert!(
            text.contains("set resolved4: +1 -1 elements\n  + 192.0.2.11 . tcp . 443\n  - 192.0.2.10 . tcp . 443\n"),
            "{text}"
        );

        // The daemon's view: resolved contents are its business.
        let ignoring = CompareOptions {
            ignore_resolved_contents: true,
        };
        let diff = compare(&after, Some(&live_of(&before)), ignoring);
        assert_eq!(diff.sets.len(), 1);
        assert_eq!(diff.sets[0].name, "allow4");
    }

    #[test]
    fn changed_rules_show_as_nft_writes_them() {
        let before = ruleset_for(POLICY, &[]);
        let after = ruleset_for(
            &POLICY
                .replace("group: 100", "group: 7")
                .replace("version: 1\n", "version: 1\naction: drop\n"),
            &[],
        );
        let diff = compare(&after, Some(&live_of(&before)), CompareOptions::default());
        assert!(diff.sets.is_empty(), "{diff}");
        assert_eq!(diff.chains.len(), 1, "{diff}");
        let refused = &diff.chains[0];
        assert_eq!(refused.name, "refused");
        assert_eq!(
            refused.added_rules,
            vec![
                "limit rate 10/second burst 20 packets log prefix \"EGRESS-DROP: \" group 7",
                "drop"
            ]
        );
        // The old rules, read back into rules as nft writes them: the log rule and reject's
        // answers.
        assert_eq!(
            refused.removed_rules,
            [
                "limit rate 10/second burst 20 packets log prefix \"EGRESS-DROP: \" group 100",
                "iif 0 fib saddr type != local drop",
                "iif \"lo\" fib saddr type != local drop",
                "iif 0 meta l4proto tcp meta priority != 0:5 reject with tcp reset",
                "reject with icmpx admin-prohibited"
            ]
        );
    }

    #[test]
    fn hand_edits_are_found() {
        let rs = ruleset_for(POLICY, &["192.0.2.10"]);
        let mut live = live_of(&rs);
        // `nft add element inet egress_fence allow4 { 198.51.100.9 . tcp . 80 }`
        let extra = Elements::Tuples(vec![Tuple {
            net: "198.51.100.9/32".parse().unwrap(),
            proto: L4Proto::Tcp,
            ports: PortRange::single(80),
        }]);
        let allow4 = SetId::new(SetRole::Allow, Family::V4);
        let (_, elems) = live
            .sets
            .iter_mut()
            .find(|(s, _)| s.name == "allow4")
            .unwrap();
        elems.extend(set_elements(allow4, &extra).map(|e| LiveElem {
            key: e.key,
            key_end: e.key_end,
            flags: e.flags,
            timeout_ms: None,
            expires_ms: None,
            userdata: None,
            unread: Vec::new(),
        }));
        // `nft delete rule ...` of the deny4 lookup, and a policy flipped to accept.
        let deny4 = Rule::RefuseDaddrIn(SetId::new(SetRole::Deny, Family::V4));
        live.rules
            .retain(|r| r.rule != ReadRule::Known(deny4.clone()));
        live.chains[0].hook = Some((libc::NF_INET_LOCAL_OUT as u32, 0, libc::NF_ACCEPT as u32));
        // A chain and a set of someone else's inside our table.
        live.chains.push(LiveChain {
            table: TABLE.into(),
            name: "mine".into(),
            kind: None,
            flags: 0,
            hook: None,
        });
        live.rules.push(live_rule("mine", &Rule::AcceptLoopback));
        live.sets.push((
            LiveSet {
                table: TABLE.into(),
                name: "theirs".into(),
                flags: 0,
                key_type: 7,
                key_len: 4,
                key_fields: Vec::new(),
                params: SetParams::default(),
            },
            Vec::new(),
        ));

        let diff = compare(&rs, Some(&live), CompareOptions::default());
        let text = diff.to_string();
        assert!(
            text.contains("set allow4: +0 -1 elements\n  - 198.51.100.9 . tcp . 80\n"),
            "{text}"
        );
        assert!(text.contains("set theirs: not egress-fence's\n"), "{text}");
        assert!(
            text.contains("chain output: hook output priority 0 policy accept (wanted: hook output priority 0 policy drop), +1 -0 rules\n  + ip daddr @deny4 counter goto refused\n"),
            "{text}"
        );
        assert!(
            text.contains("chain mine: not egress-fence's, +0 -1 rules\n  - oif \"lo\" accept\n"),
            "{text}"
        );
        let json = serde_json::to_value(&diff).unwrap();
        assert_eq!(json["table_missing"], false);
        assert_eq!(json["sets"][0]["removed"][0], "198.51.100.9 . tcp . 80");
        assert_eq!(json["chains"][1]["presence"], "extra");
    }

    #[test]
    fn a_dormant_table_and_a_chains_type_or_priority_are_drift() {
        let rs = ruleset_for(POLICY, &["192.0.2.10"]);
        // `nft add table inet egress_fence '{ flags dormant; }'`
        let mut live = live_of(&rs);
        live.flags = crate::nft::live::TABLE_F_DORMANT;
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert!(!diff.is_empty());
        assert_eq!(
            diff.summary(),
            vec!["table inet egress_fence: flags dormant (wanted: none)"]
        );
        assert_eq!(
            serde_json::to_value(&diff).unwrap()["table_flags"]["live"],
            "dormant"
        );
        assert_eq!(
            compare(&rs, Some(&live_of(&rs)), CompareOptions::default()).table_flags,
            None
        );

        // The output chain recreated as a route chain, or at another priority.
        let mut live = live_of(&rs);
        live.chains[0].kind = Some("route".into());
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(
            diff.summary(),
            vec![
                "chain output: type route hook output priority 0 policy drop (wanted: hook \
                 output priority 0 policy drop)"
            ]
        );
        let mut live = live_of(&rs);
        live.chains[0].hook = Some((libc::NF_INET_LOCAL_OUT as u32, 100, libc::NF_DROP as u32));
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(
            diff.summary(),
            vec![
                "chain output: hook output priority 100 policy drop (wanted: hook output \
                 priority 0 policy drop)"
            ]
        );
        // The refused chain made a base chain.
        let mut live = live_of(&rs);
        live.chains[1].kind = Some("filter".into());
        live.chains[1].hook = Some((libc::NF_INET_LOCAL_OUT as u32, 0, libc::NF_ACCEPT as u32));
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(diff.chains.len(), 1);
        assert_eq!(diff.chains[0].name, "refused");
    }

    /// A guard-mode policy with every kind of scope but groups (whose names the host's
    /// accounts would have to know), and what it resolved: `agent.slice` is cgroup 4242, the
    /// guard listens on 198.18.0.1 too. Shared by the tests of other modules.
    pub(crate) fn scoped() -> (Policy, Resolution) {
        let policy = Policy::parse(
            "version: 1\nscope:\n  users: [1001, 1002]\n  cgroups: [agent.slice, a/b]\n  \
             forward: [docker0, \"br-*\"]\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n\
             allow:\n  - domain: a.example\n    ports: [443]\n",
            Path::new("p.yaml"),
        )
        .expect("valid");
        let mut resolution = resolution(&["192.0.2.10"]);
        resolution.resolvers = vec!["192.0.2.53".parse().unwrap()];
        resolution.guard_uid = Some(993);
        resolution.scope.cgroups = vec![
            crate::core::ruleset::CgroupMatch {
                path: "agent.slice".parse().unwrap(),
                level: 1,
                id: 4242,
            },
            crate::core::ruleset::CgroupMatch {
                path: "a/b".parse().unwrap(),
                level: 2,
                id: u64::MAX,
            },
        ];
        resolution.scope.bridge_listen = vec!["198.18.0.1:53".parse().unwrap()];
        (policy, resolution)
    }

    pub(crate) fn scoped_ruleset() -> Ruleset {
        let (policy, resolution) = scoped();
        plan(&policy, &resolution)
    }

    #[test]
    fn a_scoped_table_compares_equal_chain_by_chain() {
        let rs = scoped_ruleset();
        let names: Vec<&str> = rs.chains().iter().map(|c| c.name).collect();
        assert_eq!(
            names,
            [
                "output",
                "refused",
                "guard",
                "from_bridge",
                "scope_output",
                "scope_forward",
                "scope_input",
                "scope_prerouting"
            ]
        );
        let live = live_of(&rs);
        assert!(
            live.rules
                .iter()
                .all(|r| matches!(r.rule, ReadRule::Known(_))),
            "every rule of a scoped plan reads back as itself"
        );
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert!(diff.is_empty(), "{diff}");
        // The cgroup rules are there, with their ids and paths.
        assert!(live.rules.iter().any(|r| r.chain == "scope_output"
            && r.rule.to_string()
                == "socket cgroupv2 level 2 \"a/b\" goto output comment \"a/b\""));
    }

    #[test]
    fn a_scoped_tables_hooks_and_policies_are_drift() {
        let rs = scoped_ruleset();
        let at =
            |live: &LiveTable, name: &str| live.chains.iter().position(|c| c.name == name).unwrap();
        // The fence on the output hook again: it would fence every process.
        let mut live = live_of(&rs);
        let output = at(&live, "output");
        live.chains[output].kind = Some("filter".into());
        live.chains[output].flags = NFT_CHAIN_BASE;
        live.chains[output].hook = Some((libc::NF_INET_LOCAL_OUT as u32, 0, libc::NF_DROP as u32));
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(
            diff.summary(),
            vec!["chain output: hook output priority 0 policy drop (wanted: no hook)"]
        );
        // scope_output dropping what the scope does not name.
        let mut live = live_of(&rs);
        let scope_output = at(&live, "scope_output");
        live.chains[scope_output].hook =
            Some((libc::NF_INET_LOCAL_OUT as u32, 0, libc::NF_DROP as u32));
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(
            diff.summary(),
            vec![
                "chain scope_output: hook output priority 0 policy drop (wanted: hook output \
                 priority 0 policy accept)"
            ]
        );
        // scope_forward on the input hook, scope_input a regular chain.
        let mut live = live_of(&rs);
        let forward = at(&live, "scope_forward");
        live.chains[forward].hook = Some((libc::NF_INET_LOCAL_IN as u32, 0, 1));
        let input = at(&live, "scope_input");
        (
            live.chains[input].kind,
            live.chains[input].hook,
            live.chains[input].flags,
        ) = (None, None, 0);
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        let names: Vec<&str> = diff.chains.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["scope_forward", "scope_input"], "{diff}");

        // The spoof check after conntrack (priority filter): an ICMP error about a spoofed
        // packet could be made before it.
        let mut live = live_of(&rs);
        let prerouting = at(&live, "scope_prerouting");
        live.chains[prerouting].hook =
            Some((libc::NF_INET_PRE_ROUTING as u32, 0, libc::NF_ACCEPT as u32));
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(
            diff.summary(),
            vec![
                "chain scope_prerouting: hook prerouting priority 0 policy accept (wanted: hook \
                 prerouting priority -300 policy accept)"
            ]
        );

        // A scope chain missing, and one the plan has no more.
        let mut live = live_of(&rs);
        live.chains.retain(|c| c.name != "scope_input");
        live.rules.retain(|r| r.chain != "scope_input");
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(diff.chains.len(), 1);
        assert_eq!(diff.chains[0].presence, Presence::Missing);
        assert_eq!(
            diff.chains[0].added_rules.len(),
            rs.chain("scope_input").unwrap().rules.len()
        );
        let unscoped = ruleset_for(POLICY, &["192.0.2.10"]);
        let diff = compare(&unscoped, Some(&live_of(&rs)), CompareOptions::default());
        let extra: Vec<&str> = diff
            .chains
            .iter()
            .filter(|c| c.presence == Presence::Extra)
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(
            extra,
            [
                "guard",
                "from_bridge",
                "scope_output",
                "scope_forward",
                "scope_input",
                "scope_prerouting"
            ]
        );
        let output = diff.chains.iter().find(|c| c.name == "output").unwrap();
        assert_eq!(
            output.definition.as_ref().map(|d| d.want.as_str()),
            Some("hook output priority 0 policy drop")
        );
    }

    #[test]
    fn a_scope_rule_changed_by_hand_is_drift() {
        let rs = scoped_ruleset();
        // The cgroup made again (another id), an interface renamed, the comment dropped.
        let mut live = live_of(&rs);
        let scope = rs.scope.as_ref().unwrap();
        let agent = scope
            .output
            .iter()
            .find(|r| matches!(r, Rule::Fence(crate::core::ruleset::ScopeMatch::Cgroup(_))))
            .unwrap();
        let at = live
            .rules
            .iter()
            .position(|r| r.rule == ReadRule::Known(agent.clone()))
            .unwrap();
        let mut moved = agent.clone();
        if let Rule::Fence(crate::core::ruleset::ScopeMatch::Cgroup(c)) = &mut moved {
            c.id += 1;
        }
        live.rules[at] = live_rule("scope_output", &moved);
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(
            diff.summary(),
            vec!["chain scope_output: +1 -1 rules"],
            "{diff}"
        );

        let mut dumped = encode::dumped_rule(agent).unwrap();
        dumped.chain = "scope_output".into();
        dumped.userdata = None;
        live.rules[at] = LiveRule::decode(dumped);
        assert!(matches!(live.rules[at].rule, ReadRule::Unknown(_)));
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(
            diff.summary(),
            vec!["chain scope_output: +1 -1 rules"],
            "{diff}"
        );
    }

    #[test]
    fn undecodable_elements_are_drift_even_in_the_daemons_sets() {
        let rs = ruleset_for(POLICY, &["192.0.2.10"]);
        let mut live = live_of(&rs);
        // `nft add element inet egress_fence resolved4 { 0.0.0.0 . udplite . 53 }`
        let (_, elems) = live
            .sets
            .iter_mut()
            .find(|(s, _)| s.name == "resolved4")
            .unwrap();
        elems.push(LiveElem {
            key: encode::tuple_key("0.0.0.0".parse().unwrap(), 136, 53),
            key_end: None,
            flags: 0,
            timeout_ms: None,
            expires_ms: None,
            userdata: None,
            unread: Vec::new(),
        });
        for ignore_resolved_contents in [false, true] {
            let options = CompareOptions {
                ignore_resolved_contents,
            };
            let diff = compare(&rs, Some(&live), options);
            assert_eq!(
                diff.to_string(),
                "set resolved4: +0 -1 elements\n  - 0.0.0.0 . udplite . 53 (undecodable)\n"
            );
        }
    }

    #[test]
    fn a_rule_the_decoder_does_not_understand_is_drift() {
        let rs = ruleset_for(POLICY, &["192.0.2.10"]);
        let mut live = live_of(&rs);
        // `ip6 daddr != @deny6 goto refused`: one flag of one expression changed.
        let deny6 = Rule::RefuseDaddrIn(SetId::new(SetRole::Deny, Family::V6));
        let mut dumped = encode::dumped_rule(&deny6).unwrap();
        for e in &mut dumped.exprs {
            if let LiveExpr::Lookup { flags, .. } = e {
                *flags = 1;
            }
        }
        dumped.text = vec!["lookup reg 1 set deny6 0x1".into()];
        let at = live
            .rules
            .iter()
            .position(|r| r.rule == ReadRule::Known(deny6.clone()))
            .unwrap();
        live.rules[at] = LiveRule::decode(dumped);
        assert!(matches!(live.rules[at].rule, ReadRule::Unknown(_)));
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(
            diff.to_string(),
            "chain output: +1 -1 rules\n  + ip6 daddr @deny6 counter goto refused\n  - [lookup reg 1 set deny6 0x1]\n"
        );
    }

    #[test]
    fn adjacent_networks_compare_by_the_space_they_cover() {
        let nets =
            |list: &[&str]| Elements::Networks(list.iter().map(|n| n.parse().unwrap()).collect());
        assert_eq!(
            element_keys(&nets(&["10.0.0.0/8", "11.0.0.0/8"])),
            element_keys(&nets(&["10.0.0.0/7"]))
        );
        let timed = Elements::Timed(vec![Timed {
            tuple: Tuple {
                net: "192.0.2.1/32".parse().unwrap(),
                proto: L4Proto::Udp,
                ports: PortRange::single(53),
            },
            timeout_ms: Some(1),
            expires_ms: Some(1),
            name: None,
        }]);
        assert_eq!(render(&element_keys(&timed)), vec!["192.0.2.1 . udp . 53"]);
    }

    #[test]
    fn a_changed_set_definition_is_reported() {
        let rs = ruleset_for(POLICY, &[]);
        let mut live = live_of(&rs);
        let (deny4, _) = live
            .sets
            .iter_mut()
            .find(|(s, _)| s.name == "deny4")
            .unwrap();
        deny4.flags = 0;
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(
            diff.sets[0].definition,
            Some(Changed {
                live: "key type 0x7 of 4 bytes, flags 0x0".into(),
                want: "type ipv4_addr; flags interval".into(),
            })
        );
    }

    #[test]
    fn a_sets_other_parameters_are_part_of_its_definition() {
        let rs = ruleset_for(POLICY, &[]);
        let mut live = live_of(&rs);
        let (resolved4, _) = live
            .sets
            .iter_mut()
            .find(|(s, _)| s.name == "resolved4")
            .unwrap();
        // `timeout 1h; size 2; counter`: no element shows any of it while the set is empty.
        resolved4.params = SetParams {
            timeout_ms: 3_600_000,
            size: 2,
            expressions: true,
            ..SetParams::default()
        };
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(
            diff.summary(),
            vec![
                "set resolved4: type ipv4_addr . inet_proto . inet_service; flags timeout; \
                 timeout 3600000ms; size 2; expressions given to every new element (wanted: \
                 type ipv4_addr . inet_proto . inet_service; flags timeout)"
            ]
        );
    }

    #[test]
    fn an_interval_sets_fields_are_part_of_its_definition() {
        let rs = ruleset_for(POLICY, &["192.0.2.10"]);
        let fields_of = |live: &mut LiveTable, name: &str, fields: Vec<u8>| {
            let (set, _) = live.sets.iter_mut().find(|(s, _)| s.name == name).unwrap();
            set.key_fields = fields;
        };
        // Address and protocol as one field of 8 bytes: every protocol matches inside the
        // element's address range.
        let mut live = live_of(&rs);
        fields_of(&mut live, "allow4", vec![8, 4]);
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert_eq!(
            diff.summary(),
            vec![
                "set allow4: key type 0x730d of 12 bytes, fields 8,4, flags 0x84 (wanted: type \
                 ipv4_addr . inet_proto . inet_service; flags interval)"
            ]
        );
        // No fields at all: the key matched as one range.
        let mut live = live_of(&rs);
        fields_of(&mut live, "allow4", Vec::new());
        assert!(!compare(&rs, Some(&live), CompareOptions::default()).is_empty());
        // A hash set matches whole keys, however they are described.
        let mut live = live_of(&rs);
        fields_of(&mut live, "resolved4", vec![8, 4]);
        fields_of(&mut live, "dns4", Vec::new());
        assert!(compare(&rs, Some(&live), CompareOptions::default()).is_empty());
    }

    #[test]
    fn flowtables_and_stateful_objects_are_drift() {
        let rs = ruleset_for(POLICY, &[]);
        let mut live = live_of(&rs);
        live.objects.push(crate::nft::sys::LiveObject {
            table: TABLE.into(),
            name: "q".into(),
            kind: "quota".into(),
        });
        let diff = compare(&rs, Some(&live), CompareOptions::default());
        assert!(!diff.is_empty());
        assert_eq!(diff.summary(), vec!["quota q: not egress-fence's"]);
        assert_eq!(diff.to_string(), "quota q: not egress-fence's\n");
        assert_eq!(
            serde_json::to_value(&diff).unwrap()["extra_objects"][0],
            "quota q"
        );
        let in_sync = compare(&rs, Some(&live_of(&rs)), CompareOptions::default());
        assert!(
            serde_json::to_value(&in_sync)
                .unwrap()
                .get("extra_objects")
                .is_none()
        );
    }

    #[test]
    fn unmatched_positions_follow_a_longest_common_subsequence() {
        let (a, r) = unmatched(&["a", "b", "c"], &["a", "b", "c"]);
        assert!(a.is_empty() && r.is_empty());
        assert_eq!(
            unmatched(&["a", "x", "c"], &["a", "b", "c"]),
            (vec![1], vec![1])
        );
        // A swap keeps one of the two in place and moves the other.
        assert_eq!(unmatched(&["a", "b"], &["b", "a"]), (vec![0], vec![1]));
        assert_eq!(unmatched::<&str>(&[], &["a"]), (vec![], vec![0]));
        assert_eq!(unmatched(&["a", "b", "c"], &[]), (vec![0, 1, 2], vec![]));
    }
}
