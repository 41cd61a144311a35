//! `status`: the installed table read back from the kernel, and whether it still matches the
//! newest generation.

use std::fmt;
use std::net::SocketAddr;

use serde::Serialize;

use egress_fence::change::{self, Drift};
use egress_fence::core::policy::{CgroupPath, Policy};
use egress_fence::core::ruleset::TABLE;
use egress_fence::nft::Nft;
use egress_fence::nft::live::Status;
use egress_fence::state::{Now, PendingConfirm, Stage, StateDir, TimerLife};
use egress_fence::watch::{FencedScope, Host, HostLookup};

use super::args::{NamespaceArg, StateArgs};
use super::common::{enter, state_dir};
use super::exit::{EXIT_NOT_INSTALLED, Failure};
use super::output::join_display;

pub fn run(target: &NamespaceArg, state_args: &StateArgs, json: bool) -> Result<u8, Failure> {
    let state = state_dir(target, state_args)?;
    enter(target, None)?;
    // An unreadable record is said, never taken for none: writers refuse until it is removed.
    let (pending, pending_error) = match state.pending() {
        Ok(pending) => (pending, None),
        Err(e) => (
            None,
            Some(format!(
                "cannot read the pending confirmation: {e}; a living revert timer still \
                 reverts at its deadline, and egress-fence apply, rollback and confirm refuse \
                 until the file is removed"
            )),
        ),
    };
    let mut pending_json = pending_json(&state, pending.as_ref());
    if let Some(e) = &pending_error {
        pending_json = serde_json::json!({ "error": e });
    }
    let Some(live) = Nft::open()?.read_table()? else {
        if json {
            println!(
                "{}",
                serde_json::json!({ "installed": false, "pending_confirmation": pending_json })
            );
        } else {
            println!("table inet {TABLE} is not installed");
            if let Some(p) = &pending {
                println!("{}", state.describe_pending(p));
            }
            if let Some(e) = &pending_error {
                println!("{e}");
            }
        }
        return Ok(EXIT_NOT_INSTALLED);
    };
    let status = live.status();
    let audit = audit_line(live.audit_window_open_ms());
    let drift = change::drift(&state, &live);
    let unexplained = match &drift {
        Drift::InSync(g) | Drift::Drifted(g, _) => change::unexplained(g, &live),
        Drift::NoGeneration | Drift::Unreadable(_) => Vec::new(),
    };
    // Guard mode shows in the table's DNS rule; whether a guard serves, in its socket.
    let access = live.dns_access();
    let (guard_uids, guard_marks) = (access.uids, access.marks);
    let guard_serving = !guard_uids.is_empty()
        && std::os::unix::net::UnixStream::connect(state.guard_events()).is_ok();
    let scope = FencedScope::of_live(&live).map(|live_scope| {
        let generation = match &drift {
            Drift::InSync(g) | Drift::Drifted(g, _) => Some(g),
            Drift::NoGeneration | Drift::Unreadable(_) => None,
        };
        // Scope rules not read back as egress-fence's: the generation's, which wrote them.
        let fenced = match generation.and_then(|g| FencedScope::of_ruleset(&g.ruleset)) {
            Some(recorded) if live_scope.is_empty() => recorded,
            _ => live_scope,
        };
        let listed = generation
            .and_then(|g| Policy::parse(&g.policy_text, &g.policy_path).ok())
            .and_then(|p| p.scope)
            .map(|s| s.cgroups)
            .unwrap_or_default();
        ScopeStatus::of(
            &fenced,
            &listed,
            &mut Host::default(),
            egress_fence::host::cgroup_id_now,
        )
    });
    if json {
        let mut out = serde_json::to_value(&status)?;
        out["installed"] = true.into();
        let (generation, drifted, differences) = match &drift {
            Drift::NoGeneration | Drift::Unreadable(_) => (None, None, None),
            Drift::InSync(g) => (Some(g.summary()), Some(false), None),
            Drift::Drifted(g, d) => (Some(g.summary()), Some(true), Some(d)),
        };
        out["generation"] = serde_json::to_value(generation)?;
        // Elements the policy does not explain are drift too (someone added them).
        let drifted = drifted.map(|d| d || !unexplained.is_empty());
        out["drift"] = serde_json::to_value(drifted)?;
        out["unexplained_elements"] = serde_json::to_value(&unexplained)?;
        out["differences"] = serde_json::to_value(differences)?;
        if let Drift::Unreadable(e) = &drift {
            out["generation_error"] = e.to_string().into();
        }
        out["pending_confirmation"] = pending_json;
        if let Some((_, audit)) = &audit {
            out["audit"] = audit.clone();
        }
        if let Some(scope) = &scope {
            out["scope"] = serde_json::to_value(scope)?;
        }
        if !guard_uids.is_empty() {
            out["dns_guard"] = serde_json::json!({ "uids": guard_uids, "marks": guard_marks,
                                    "serving": guard_serving });
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        if let Some((line, _)) = &audit {
            println!("{line}");
        }
        print_status(&status);
        if let Some(scope) = &scope {
            print!("{scope}");
        }
        if !guard_uids.is_empty() {
            print_dns_guard(&guard_uids, &guard_marks, guard_serving);
        }
        print_drift(&drift, &state, &unexplained);
        if let Some(p) = &pending {
            println!("{}", state.describe_pending(p));
        }
        if let Some(e) = &pending_error {
            println!("{e}");
        }
    }
    Ok(0)
}

/// `learn`'s audit window, open for `open_ms` more (see
/// [`egress_fence::nft::LiveTable::audit_window_open_ms`]): the line `status` prints first and
/// its JSON.
fn audit_line(open_ms: Option<u64>) -> Option<(String, serde_json::Value)> {
    let ms = open_ms?;
    if ms == u64::MAX {
        return Some((
            "AUDIT with no end: the audit window holds an element without a timeout (none of              learn's): what the policy refuses is let through; remove it (`nft flush set inet              egress_fence audit_window`)"
                .into(),
            serde_json::json!({ "open": true, "until": null }),
        ));
    }
    let until = std::time::SystemTime::now() + std::time::Duration::from_millis(ms);
    Some((
        format!(
            "AUDIT until {} (learn): what the policy refuses is let through and logged; the              window closes then unless learn renews it",
            egress_fence::core::time::clock_utc(until)
        ),
        serde_json::json!({
            "open": true,
            "until": egress_fence::core::time::rfc3339(until),
            "expires_in_ms": ms,
        }),
    ))
}

/// The pending confirmation as recorded, with where it stands: whether its revert timer
/// lives, and whether its revert is overdue (the deadline passed and nothing reverted it).
fn pending_json(state: &StateDir, pending: Option<&PendingConfirm>) -> serde_json::Value {
    let Some(p) = pending else {
        return serde_json::Value::Null;
    };
    let mut value = serde_json::to_value(p).unwrap_or_default();
    let timer_alive = state.timer_life(&p.token) == TimerLife::Alive;
    value["revert_timer_alive"] = timer_alive.into();
    value["revert_overdue"] = (p.stage(&Now::read()) == Stage::Due && !timer_alive).into();
    value["state"] = state.describe_pending(p).into();
    value
}

/// Guard mode, as the table's DNS rule shows it, and whether a guard serves.
fn print_dns_guard(guard_uids: &[u32], guard_marks: &[u32], guard_serving: bool) {
    let uids = join_display(guard_uids);
    let marked = match guard_marks {
        [] => " (by uid alone: a table of an older version; `egress-fence \
               run` replaces it)"
            .to_string(),
        marks => {
            let marks: Vec<String> = marks.iter().map(|m| format!("{m:#x}")).collect();
            format!(" marked {}", marks.join(", "))
        }
    };
    println!(
        "  DNS guard mode: only sockets of uid {uids}{marked} may ask the \
         resolvers; {}",
        if guard_serving {
            "a guard is serving (`egress-fence watch` shows what it refuses)"
        } else {
            "no guard is serving here, so no name is allowed until \
             `egress-fence run` answers it"
        }
    );
}

fn print_drift(drift: &Drift, state: &StateDir, unexplained: &[change::UnexplainedElement]) {
    if let (Drift::InSync(g) | Drift::Drifted(g, _), false) = (drift, unexplained.is_empty()) {
        println!(
            "DRIFT: {} resolved element(s) that the policy of generation {} does not explain \
             (added beside egress-fence, or left from an older policy):",
            unexplained.len(),
            g.generation
        );
        for u in unexplained {
            println!("  {}: {}", u.element, u.why);
        }
        if let Drift::InSync(_) = drift {
            return;
        }
    }
    match drift {
        Drift::NoGeneration => println!(
            "no generation is recorded in {} (applied by hand, or by an older egress-fence)",
            state.path().display()
        ),
        Drift::Unreadable(e) => println!("cannot check for drift: {e}"),
        Drift::InSync(g) => println!(
            "in sync with generation {} ({} at {})",
            g.generation,
            g.describe(),
            g.time
        ),
        Drift::Drifted(g, diff) => {
            println!(
                "DRIFT from generation {} ({} at {}): the live table was changed beside \
                 egress-fence; applying the generation again would change (+ adds, - removes):",
                g.generation,
                g.describe(),
                g.time
            );
            for line in diff.to_string().lines() {
                println!("  {line}");
            }
            println!(
                "  `egress-fence apply` of the policy, or `egress-fence rollback --to {}`, puts it back",
                g.generation
            );
        }
    }
}

fn print_status(status: &Status) {
    let dormant = if status.dormant { " (dormant)" } else { "" };
    println!("table {}: installed{dormant}", status.table);
    for c in &status.chains {
        match (&c.hook, c.priority, &c.policy) {
            (Some(hook), Some(prio), Some(policy)) => println!(
                "  chain {}: hook {hook} priority {prio} policy {policy}, {} rules",
                c.name, c.rules
            ),
            _ => println!("  chain {}: {} rules", c.name, c.rules),
        }
    }
    let r = status.refused;
    println!(
        "  refused so far: IPv4 {} packets ({} bytes), IPv6 {} packets ({} bytes)",
        r.ipv4.packets, r.ipv4.bytes, r.ipv6.packets, r.ipv6.bytes
    );
    for s in &status.sets {
        let mut items = match &s.contents {
            Some(elements) => elements.to_nft(),
            None => vec![format!("({} kernel elements)", s.kernel_elements)],
        };
        items.extend(s.undecodable.iter().map(|e| format!("{e} (undecodable)")));
        if items.is_empty() {
            println!("  set {}: empty", s.name);
        } else {
            println!("  set {}: {}", s.name, items.join(", "));
        }
    }
}

/// The scope of a scoped table, for `status`: who it fences (uids and gids with their names),
/// what became of the listed cgroups, the interfaces it fences forwarded traffic from and
/// where the guard answers on them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct ScopeStatus {
    users: Vec<Account>,
    groups: Vec<Account>,
    cgroups: Vec<CgroupStatus>,
    forwarded: Vec<String>,
    bridges: Vec<String>,
    guard_on_bridges: Vec<SocketAddr>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct Account {
    id: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct CgroupStatus {
    path: CgroupPath,
    /// The id the table's rule matches; none for a listed cgroup that has no rule.
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<u64>,
    state: CgroupState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "is")]
enum CgroupState {
    /// It exists, with the id of the rule.
    Found,
    /// Listed, but it did not exist when the table was planned: no rule fences it.
    Missing,
    /// The rule's cgroup is gone.
    Gone,
    /// Removed and made again: it has another id now, which the rule does not match.
    Changed { now: u64 },
}

impl ScopeStatus {
    /// From the table's scope, the cgroups the policy lists, the host's account names and
    /// the cgroups' ids now.
    fn of(
        scope: &FencedScope,
        listed: &[CgroupPath],
        names: &mut impl HostLookup,
        cgroup_now: impl Fn(&CgroupPath) -> Option<u64>,
    ) -> ScopeStatus {
        let users = scope
            .uids
            .iter()
            .map(|&id| Account {
                id,
                name: names.user_name(id),
            })
            .collect();
        let groups = scope
            .gids
            .iter()
            .map(|&id| Account {
                id,
                name: names.group_name(id),
            })
            .collect();
        let mut cgroups: Vec<CgroupStatus> = scope
            .cgroups
            .iter()
            .map(|c| CgroupStatus {
                path: c.path.clone(),
                id: Some(c.id),
                state: match cgroup_now(&c.path) {
                    Some(now) if now == c.id => CgroupState::Found,
                    Some(now) => CgroupState::Changed { now },
                    None => CgroupState::Gone,
                },
            })
            .collect();
        for path in listed {
            if !scope.cgroups.iter().any(|c| c.is_of(path)) {
                cgroups.push(CgroupStatus {
                    path: path.clone(),
                    id: None,
                    state: CgroupState::Missing,
                });
            }
        }
        let names = |patterns: &[egress_fence::core::policy::IfacePattern]| {
            patterns.iter().map(ToString::to_string).collect()
        };
        ScopeStatus {
            users,
            groups,
            cgroups,
            forwarded: names(&scope.forwarded),
            bridges: names(&scope.bridges),
            guard_on_bridges: scope.guard_on_bridges.clone(),
        }
    }
}

impl fmt::Display for Account {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.id)?;
        self.name
            .as_ref()
            .map_or(Ok(()), |name| write!(f, " ({name})"))
    }
}

impl fmt::Display for ScopeStatus {
    /// The `status` lines, indented like the table's.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "  scope: only these are fenced; everything else passes this table"
        )?;
        if self.users.is_empty()
            && self.groups.is_empty()
            && self.cgroups.is_empty()
            && self.forwarded.is_empty()
        {
            writeln!(
                f,
                "    nobody: no rule of the scope chains reads back as one egress-fence writes"
            )?;
        }
        if !self.users.is_empty() {
            writeln!(f, "    uids: {}", join_display(&self.users))?;
        }
        if !self.groups.is_empty() {
            writeln!(f, "    gids: {}", join_display(&self.groups))?;
        }
        for c in &self.cgroups {
            let id = c.id.unwrap_or_default();
            match c.state {
                CgroupState::Found => writeln!(f, "    cgroup {}: id {id}", c.path)?,
                CgroupState::Missing => writeln!(
                    f,
                    "    cgroup {}: listed but missing, so no rule fences it (it gets one when \
                     it exists and the table is planned again)",
                    c.path
                )?,
                CgroupState::Gone => writeln!(
                    f,
                    "    cgroup {}: id {id} in the table, but the cgroup is gone",
                    c.path
                )?,
                CgroupState::Changed { now } => writeln!(
                    f,
                    "    cgroup {}: id {id} in the table, but it was made again and is id \
                     {now} now, which the table does not fence until it is planned again",
                    c.path
                )?,
            }
        }
        if !self.forwarded.is_empty() {
            writeln!(f, "    forwarded from: {}", self.forwarded.join(", "))?;
        }
        if !self.bridges.is_empty() {
            writeln!(
                f,
                "    to the host from: {} (refused, but for replies and DNS to the guard)",
                self.bridges.join(", ")
            )?;
        }
        if !self.guard_on_bridges.is_empty() {
            writeln!(
                f,
                "    guard on the bridges: {}",
                join_display(&self.guard_on_bridges)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use egress_fence::core::ruleset::{CgroupMatch, Rule, ScopeMatch};
    use egress_fence::watch::DropEvent;

    struct Names;

    impl HostLookup for Names {
        fn user_name(&mut self, uid: u32) -> Option<String> {
            (uid == 1001).then(|| "agent".into())
        }
        fn group_name(&mut self, gid: u32) -> Option<String> {
            (gid == 2000).then(|| "agents".into())
        }
        fn iface_name(&mut self, _: u32) -> Option<String> {
            None
        }
        fn socket_cgroup(&mut self, _: &DropEvent) -> Option<u64> {
            None
        }
        fn cgroup_holds(&mut self, _: &CgroupPath, _: u64) -> bool {
            false
        }
    }

    fn cgroup(path: &str, id: u64) -> Rule {
        let path: CgroupPath = path.parse().unwrap();
        Rule::Fence(ScopeMatch::Cgroup(CgroupMatch {
            level: path.level(),
            path,
            id,
        }))
    }

    #[test]
    fn the_scope_section_names_accounts_and_what_became_of_the_cgroups() {
        let rules = [
            Rule::Fence(ScopeMatch::Uid(1001)),
            Rule::Fence(ScopeMatch::Uid(1002)),
            Rule::Fence(ScopeMatch::Gid(2000)),
            cgroup("agent.slice", 40),
            cgroup("remade.slice", 41),
            cgroup("gone.slice", 42),
            Rule::Fence(ScopeMatch::Interface("br-*".parse().unwrap())),
            Rule::FromBridge("br-*".parse().unwrap()),
            Rule::AcceptGuardQuery {
                to: "198.18.0.1:53".parse().unwrap(),
                proto: egress_fence::core::policy::L4Proto::Udp,
            },
            Rule::AcceptGuardQuery {
                to: "198.18.0.1:53".parse().unwrap(),
                proto: egress_fence::core::policy::L4Proto::Tcp,
            },
        ];
        let scope = FencedScope::of_rules(&rules);
        let listed: Vec<CgroupPath> = ["agent.slice", "later.slice"]
            .iter()
            .map(|p| p.parse().unwrap())
            .collect();
        let now = |p: &CgroupPath| match p.as_str() {
            "agent.slice" => Some(40),
            "remade.slice" => Some(77),
            _ => None,
        };
        let status = ScopeStatus::of(&scope, &listed, &mut Names, now);
        let text = status.to_string();
        let expected = [
            "  scope: only these are fenced; everything else passes this table",
            "    uids: 1001 (agent), 1002",
            "    gids: 2000 (agents)",
            "    cgroup agent.slice: id 40",
            "    cgroup remade.slice: id 41 in the table, but it was made again and is id 77 \
             now, which the table does not fence until it is planned again",
            "    cgroup gone.slice: id 42 in the table, but the cgroup is gone",
            "    cgroup later.slice: listed but missing, so no rule fences it (it gets one when \
             it exists and the table is planned again)",
            "    forwarded from: br-*",
            "    to the host from: br-* (refused, but for replies and DNS to the guard)",
            "    guard on the bridges: 198.18.0.1:53",
        ];
        assert_eq!(text.lines().collect::<Vec<_>>(), expected, "{text}");

        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(
            json["users"],
            serde_json::json!([{"id": 1001, "name": "agent"}, {"id": 1002}])
        );
        assert_eq!(
            json["cgroups"][1],
            serde_json::json!({"path": "remade.slice", "id": 41, "state": {"is": "changed", "now": 77}})
        );
        assert_eq!(
            json["cgroups"][3],
            serde_json::json!({"path": "later.slice", "state": {"is": "missing"}})
        );
        assert_eq!(
            json["guard_on_bridges"],
            serde_json::json!(["198.18.0.1:53"])
        );
    }
}
