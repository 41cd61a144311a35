//! `learn`: the policy a trace needed. Pure: the start policy (its text and its value) and a
//! trace in, policy text a person reviews out.
//!
//! What the trace needed is what [`replay`](crate::core::replay) says the start policy would
//! have refused, so the two agree by construction: every refused flow an allow entry can let
//! through becomes one, for the name whose answer last named its destination before it (the
//! name the client most likely connected for), on the ports and protocols its flows used; a
//! flow no answer explained becomes a `cidr:` entry for its one address. Sibling names fold
//! into `*.parent` (guard mode only) when there are at least [`LearnOptions::fold_at`] of
//! them and the wildcard would not be one `check` warns about (a public suffix, shared
//! hosting); the fold's comment says that it allows every name under the parent. What no
//! allow entry can let through (a denied address, DNS around the guard), what an entry would
//! let through wider than it reads (DNS to another server in resolve mode, an address the
//! table never takes from an answer, such as multicast) and names asked but never connected
//! to are written as comments, for the reviewer.
//!
//! The trace's names, flows and answers are chosen by whoever runs inside the fence: nothing
//! of it reaches the policy text but names a policy can hold, addresses and numbers, and the
//! rest (times, names that are not policy names) only as printable ASCII in comments.
//!
//! The start text is kept as written: the new entries are appended to its `allow:` list (or
//! an `allow:` is added). When its `allow:` is not a block list this module can extend (a
//! flow list `allow: [...]`), the list is rewritten in block style with the same entries;
//! when even that does not read back as the start policy plus the new entries, the text is
//! left as it is and the entries are written below it as comments, with why. Every edit is
//! checked by loading the result.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::Path;

use ipnet::IpNet;

use crate::core::installable::{self, HostAddrs};
use crate::core::plan::{DNS_PORT, GUARDED_DNS_PORTS};
use crate::core::policy::{
    Allow, DomainName, MAX_DOMAIN_PORT_RANGE, Policy, PortRange, Protocol, Target, Wildcard,
    wildcard_risk,
};
use crate::core::replay::{self, FlowVerdict, NameRefusal, NameVerdict};
use crate::core::ruleset::MAX_COMMENTED_NAME;
use crate::core::trace::Trace;

/// How `learn` writes what it found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LearnOptions {
    /// Sibling names (`a.example.com`, `b.example.com`) fold into `*.example.com` when there
    /// are at least this many (and at least two) of them.
    pub fold_at: usize,
}

impl Default for LearnOptions {
    fn default() -> Self {
        LearnOptions { fold_at: 10 }
    }
}

/// The policy `learn` wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Learned {
    /// The policy text: the start policy with the new entries.
    pub yaml: String,
    /// One line per entry added, for the summary: `api.example.com tcp 443 (12 flows, first
    /// seen ...)`.
    pub added: Vec<String>,
}

/// How many comment lines each kind of note gets before "... and N more".
const MAX_NOTES: usize = 50;

/// What some flows needed: their ports by protocol, and when and how often they were seen.
#[derive(Debug, Default, Clone)]
struct Need {
    tcp: BTreeSet<u16>,
    udp: BTreeSet<u16>,
    count: usize,
    first: String,
    last: String,
}

impl Need {
    fn add(&mut self, udp: bool, port: u16, time: &str) {
        if udp { &mut self.udp } else { &mut self.tcp }.insert(port);
        if self.count == 0 {
            self.first = time.to_string();
        }
        self.last = time.to_string();
        self.count += 1;
    }

    fn merge(&mut self, other: &Need) {
        self.tcp.extend(&other.tcp);
        self.udp.extend(&other.udp);
        if self.count == 0 || other.first < self.first {
            self.first.clone_from(&other.first);
        }
        if other.last > self.last {
            self.last.clone_from(&other.last);
        }
        self.count += other.count;
    }

    /// `first seen T, last seen T, N flows`.
    fn seen(&self) -> String {
        format!(
            "first seen {}, last seen {}, {}",
            safe(&self.first),
            safe(&self.last),
            flows(self.count)
        )
    }

    /// The entries for `target`: one with `protocol: any` when TCP and UDP used the same
    /// ports, else one per protocol used.
    fn entries(&self, target: &Target) -> Vec<Allow> {
        let entry = |ports: &BTreeSet<u16>, protocol| Allow {
            target: target.clone(),
            ports: ranges(ports, !matches!(target, Target::Cidr(_))),
            protocol,
            comment: None,
        };
        if self.tcp == self.udp {
            return vec![entry(&self.tcp, Protocol::Any)];
        }
        let mut out = Vec::new();
        if !self.tcp.is_empty() {
            out.push(entry(&self.tcp, Protocol::Tcp));
        }
        if !self.udp.is_empty() {
            out.push(entry(&self.udp, Protocol::Udp));
        }
        out
    }
}

/// `1 flow`, `2 flows`.
fn flows(n: usize) -> String {
    match n {
        1 => "1 flow".into(),
        n => format!("{n} flows"),
    }
}

/// Sorted ports as ranges of consecutive ports; a domain entry's ranges at most
/// [`MAX_DOMAIN_PORT_RANGE`] wide (what the policy takes).
fn ranges(ports: &BTreeSet<u16>, narrow: bool) -> Vec<PortRange> {
    let mut out: Vec<PortRange> = Vec::new();
    for &p in ports {
        match out.last_mut() {
            Some(r)
                if u32::from(r.last) + 1 == u32::from(p)
                    && (!narrow || r.width() < MAX_DOMAIN_PORT_RANGE) =>
            {
                r.last = p
            }
            _ => out.push(PortRange::single(p)),
        }
    }
    out
}

/// Trace text in a comment: printable ASCII only (a time or name with a line break in it
/// would otherwise write policy lines), at most 80 characters.
fn safe(text: &str) -> String {
    text.chars()
        .take(80)
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .collect()
}

/// The name `d` is one label under: what `*.parent` matches it.
fn parent_of(d: &DomainName) -> Option<DomainName> {
    d.as_str()
        .split_once('.')
        .and_then(|(_, p)| p.parse::<DomainName>().ok())
}

/// One new entry with what it says about itself.
struct NewEntry {
    allow: Allow,
    /// The comment line above it (without `# `).
    note: String,
    /// A second comment line, for what the entry allows beyond what was seen.
    caution: Option<String>,
    /// The summary line.
    summary: String,
}

/// The policy `trace` needed, written as `start_text` (the text of `start`) with what
/// `start` would have refused added.
pub fn learn(start_text: &str, start: &Policy, trace: &Trace, options: &LearnOptions) -> Learned {
    let j = replay::judge(start, trace);
    let guard = start.dns.guard.is_some();

    let mut by_name: BTreeMap<usize, Need> = BTreeMap::new();
    let mut by_addr: BTreeMap<IpAddr, Need> = BTreeMap::new();
    // What no allow entry lets through: `tcp 169.254.169.254:80: denied: ...` -> count.
    let mut refused_anyway: BTreeMap<String, usize> = BTreeMap::new();
    // What an allow entry would let through but learn leaves to a person: `udp
    // 224.0.0.251:5353: multicast address` -> count.
    let mut left_out: BTreeMap<String, usize> = BTreeMap::new();
    // What the trace cannot tell: reason -> (count, an example).
    let mut unjudged: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for f in &j.flows {
        let why = match &f.verdict {
            FlowVerdict::Refused(why) => why,
            FlowVerdict::CannotJudge(why) => {
                let example = replay::describe_flow(&safe(f.protocol), f.dst, f.dport);
                unjudged.entry(why.to_string()).or_insert((0, example)).0 += 1;
                continue;
            }
            _ => continue,
        };
        let udp = f.protocol == "udp";
        match (why.allow_entry_helps(), f.dport) {
            (true, Some(port)) if udp || f.protocol == "tcp" => {
                if let Some(why_not) = not_learned(f.dst, port, f.latest_name.is_some(), guard) {
                    let what = replay::describe_flow(&safe(f.protocol), f.dst, f.dport);
                    *left_out.entry(format!("{what}: {why_not}")).or_default() += 1;
                    continue;
                }
                // An entry the policy would refuse (the table keeps an allowed name as each
                // address's comment) would leave every learned entry unwritten.
                let long = f.latest_name.map(|n| j.domains[n].as_str().len());
                if let Some(len) = long.filter(|&len| len > MAX_COMMENTED_NAME) {
                    let what = replay::describe_flow(&safe(f.protocol), f.dst, f.dport);
                    let why_not = format!(
                        "its name has {len} characters, more than the {MAX_COMMENTED_NAME} an \
                         allowed name may have"
                    );
                    *left_out.entry(format!("{what}: {why_not}")).or_default() += 1;
                    continue;
                }
                match f.latest_name {
                    Some(name) => by_name.entry(name).or_default(),
                    None => by_addr.entry(f.dst).or_default(),
                }
                .add(udp, port, f.time);
            }
            _ => {
                let what = replay::describe_flow(&safe(f.protocol), f.dst, f.dport);
                *refused_anyway.entry(format!("{what}: {why}")).or_default() += 1;
            }
        }
    }

    // Siblings fold into `*.parent` (guard mode: only the guard can follow a wildcard).
    let mut by_parent: BTreeMap<DomainName, Vec<usize>> = BTreeMap::new();
    if guard {
        for &d in by_name.keys() {
            if let Some(parent) = parent_of(&j.domains[d]) {
                by_parent.entry(parent).or_default().push(d);
            }
        }
    }
    let mut entries: Vec<(String, NewEntry)> = Vec::new();
    let mut folded: BTreeSet<usize> = BTreeSet::new();
    let mut folded_under: BTreeSet<DomainName> = BTreeSet::new();
    for (parent, names) in by_parent {
        let wildcard = Wildcard {
            suffix: parent,
            any_depth: false,
        };
        if names.len() < options.fold_at.max(2) || wildcard_risk(&wildcard).is_some() {
            continue;
        }
        let mut need = Need::default();
        for d in &names {
            need.merge(&by_name[d]);
        }
        folded.extend(&names);
        folded_under.insert(wildcard.suffix.clone());
        let note = format!(
            "folds {} names seen under {} into a wildcard: {}",
            names.len(),
            wildcard.suffix,
            need.seen()
        );
        // The count above is what was seen, not what the entry allows: said next to it.
        let caution = format!(
            "it allows every name under {0}, not only these: whoever runs {0} answers them \
             with the addresses it likes, and the guard forwards any question under {0} to \
             its servers; list the names by hand if these are all that is needed",
            wildcard.suffix
        );
        push_entries(
            &mut entries,
            Target::Wildcard(wildcard),
            &need,
            note,
            Some(caution),
        );
    }
    for (d, need) in &by_name {
        if !folded.contains(d) {
            let name = &j.domains[*d];
            let note = format!("{name}: {}", need.seen());
            push_entries(&mut entries, Target::Domain(name.clone()), need, note, None);
        }
    }
    for (addr, need) in &by_addr {
        let note = format!("no name seen for {addr}: {}", need.seen());
        push_entries(
            &mut entries,
            Target::Cidr(IpNet::from(*addr)),
            need,
            note,
            None,
        );
    }
    // Names the guard would refuse that no flow went to: for the reviewer only. A name a new
    // entry covers is one of the names learned, or under a fold's parent (the entries'
    // only wildcards): asked of those two, not of every entry, once per name record.
    let covered = |d: usize| {
        by_name.contains_key(&d)
            || parent_of(&j.domains[d]).is_some_and(|p| folded_under.contains(&p))
    };
    let mut unconnected: BTreeMap<String, Need> = BTreeMap::new();
    for n in &j.names {
        let NameVerdict::Refused(why) = &n.verdict else {
            continue;
        };
        let shown = match (why, n.domain) {
            (NameRefusal::NotInPolicy, Some(d)) if covered(d) => continue,
            (NameRefusal::NotInPolicy, Some(d)) => j.domains[d].to_string(),
            (_, _) => format!("{} ({why})", safe(n.name)),
        };
        unconnected.entry(shown).or_default().add(false, 0, n.time);
    }

    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let entries: Vec<NewEntry> = entries.into_iter().map(|(_, e)| e).collect();

    let mut notes = Vec::new();
    let mut header = format!(
        "egress-fence learn: {} entr{} from the trace of {} to {}",
        entries.len(),
        if entries.len() == 1 { "y" } else { "ies" },
        safe(trace.records.first().map_or("", |r| r.time())),
        safe(trace.records.last().map_or("", |r| r.time())),
    );
    if entries.is_empty() {
        header.push_str(": the policy refused nothing an allow entry can let through");
    }
    notes.push(header);
    push_notes(
        &mut notes,
        "refused whatever the policy allows (not added)",
        refused_anyway
            .iter()
            .map(|(what, n)| format!("{what} ({})", flows(*n))),
    );
    push_notes(
        &mut notes,
        "an entry for these would allow more than it seems to (not added; allow them by \
         hand if they are needed)",
        left_out
            .iter()
            .map(|(what, n)| format!("{what} ({})", flows(*n))),
    );
    push_notes(
        &mut notes,
        "not judged, the trace cannot tell (not added)",
        unjudged
            .iter()
            .map(|(why, (n, example))| format!("{} such as {example}: {why}", flows(*n))),
    );
    push_notes(
        &mut notes,
        "asked but never connected to (not added; allow them by hand if they are needed)",
        unconnected.iter().map(|(name, need)| {
            let times = match need.count {
                1 => "asked once".to_string(),
                n => format!("asked {n} times"),
            };
            format!("{name} ({times}, last {})", safe(&need.last))
        }),
    );
    let (yaml, listed) = write(start_text, start, &entries, &notes);
    let added = entries.into_iter().map(|e| match listed {
        true => e.summary,
        false => format!("{} [commented out: see the end of the policy]", e.summary),
    });
    Learned {
        yaml,
        added: added.collect(),
    }
}

/// Why a refused flow to `dst` on `port`, which an allow entry would let through, is not
/// learned: DNS to a server that is not one of `dns.resolvers` (resolve mode; in guard mode
/// the table refuses it whatever the entries say), which would carry questions for any name
/// past the policy; or, for an address no answer named, one the table never takes from an
/// answer ([`installable::check`]: multicast, broadcast, loopback, link-local, an IPv6 form
/// of an IPv4 address, the local-use NAT64 prefix), whose `cidr:` entry would let out
/// something other than the one host it seems to name.
fn not_learned(dst: IpAddr, port: u16, named: bool, guard: bool) -> Option<String> {
    if !guard && GUARDED_DNS_PORTS.contains(&port) {
        // Port 53 to a listed resolver is essential, never refused; 853 to one is not.
        return Some(match port {
            DNS_PORT => "DNS to a server that is not one of `dns.resolvers`: it would answer \
                         any name, around the policy's"
                .into(),
            _ => "DNS over TLS: it would carry questions for any name, around the policy's".into(),
        });
    }
    match installable::check(dst, &HostAddrs::none()) {
        Err(why) if !named => Some(why.to_string()),
        _ => None,
    }
}

/// The entries for `target` and `need`, each with its sort key; `caution`, a second
/// comment line.
fn push_entries(
    out: &mut Vec<(String, NewEntry)>,
    target: Target,
    need: &Need,
    note: String,
    caution: Option<String>,
) {
    // Names (wildcards first, as `*` sorts before letters), then addresses in order.
    let key = match &target {
        Target::Domain(d) => format!("0 {d}"),
        Target::Wildcard(w) => format!("0 {w}"),
        Target::Cidr(n) => match n.addr() {
            IpAddr::V4(a) => format!("1 {:08x}", u32::from(a)),
            IpAddr::V6(a) => format!("2 {:032x}", u128::from(a)),
        },
    };
    for allow in need.entries(&target) {
        let summary = format!("{} ({note})", allow.describe());
        out.push((
            format!("{key} {:?}", allow.protocol),
            NewEntry {
                allow,
                note: note.clone(),
                caution: caution.clone(),
                summary,
            },
        ));
    }
}

fn push_notes(notes: &mut Vec<String>, title: &str, items: impl ExactSizeIterator<Item = String>) {
    let total = items.len();
    if total == 0 {
        return;
    }
    notes.push(format!("{title}:"));
    notes.extend(items.take(MAX_NOTES).map(|i| format!("  {i}")));
    if total > MAX_NOTES {
        notes.push(format!("  ... and {} more", total - MAX_NOTES));
    }
}

/// An allow entry as block YAML, its `- ` at `indent`; every string double-quoted (a name
/// such as `null` or `1e3` must stay a string).
fn entry_text(a: &Allow, indent: usize) -> String {
    let pad = " ".repeat(indent);
    let quoted = |s: &str| serde_json::to_string(s).unwrap_or_default();
    let target = match &a.target {
        Target::Domain(d) => format!("domain: {}", quoted(d.as_str())),
        Target::Wildcard(w) => format!("domain: {}", quoted(&w.to_string())),
        Target::Cidr(n) => format!("cidr: {}", quoted(&n.to_string())),
    };
    let mut out = format!("{pad}- {target}\n");
    if !(matches!(a.target, Target::Cidr(_)) && a.ports == [PortRange::ALL]) {
        let ports: Vec<String> = a
            .ports
            .iter()
            .map(|p| match p.is_single() {
                true => p.to_string(),
                false => quoted(&p.to_string()),
            })
            .collect();
        let _ = writeln!(out, "{pad}  ports: [{}]", ports.join(", "));
    }
    let protocol = match a.protocol {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Any => "any",
    };
    let _ = writeln!(out, "{pad}  protocol: {protocol}");
    if let Some(c) = &a.comment {
        let _ = writeln!(out, "{pad}  comment: {}", quoted(c));
    }
    out
}

/// The notes as comment lines, then each entry under its comment line.
fn block(notes: &[String], entries: &[NewEntry], indent: usize) -> String {
    let pad = " ".repeat(indent);
    let mut out = String::new();
    for n in notes {
        let _ = writeln!(out, "{pad}# {n}");
    }
    for e in entries {
        let _ = writeln!(out, "{pad}# {}", e.note);
        if let Some(c) = &e.caution {
            let _ = writeln!(out, "{pad}# {c}");
        }
        out.push_str(&entry_text(&e.allow, indent));
    }
    out
}

/// Where the top-level `allow:` is and what follows its colon, if the text has exactly one.
fn allow_key(lines: &[&str]) -> Result<Option<(usize, String)>, &'static str> {
    let mut found = None;
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.strip_prefix("allow") else {
            continue;
        };
        let Some(value) = rest.trim_start_matches([' ', '\t']).strip_prefix(':') else {
            continue;
        };
        if found.is_some() {
            return Err("it has `allow:` twice");
        }
        // A comment starts at `#` after a blank (or at the start of the value).
        let value = match value.find(" #") {
            Some(at) => &value[..at],
            None if value.trim_start().starts_with('#') => "",
            None => value,
        };
        found = Some((i, value.trim().to_string()));
    }
    Ok(found)
}

/// The start text with the new entries, in its own `allow:` list when that can be done
/// safely (then `true`); see the module's documentation.
fn write(
    start_text: &str,
    start: &Policy,
    entries: &[NewEntry],
    notes: &[String],
) -> (String, bool) {
    let local: Vec<Allow> = start
        .allow
        .iter()
        .zip(replay::entry_presets(start))
        .filter(|(_, preset)| preset.is_none())
        .map(|(a, _)| a.clone())
        .collect();
    let mut expected = local.clone();
    expected.extend(entries.iter().map(|e| e.allow.clone()));
    let reads_back = |text: &str| -> Result<(), String> {
        let differs = "the edited text did not read back as the start policy plus the new \
                       entries";
        let mut got = Policy::parse(text, Path::new("learned.yaml")).map_err(|e| {
            // Said in a comment line: its first line, printable.
            let said = e.to_string();
            let first = said.lines().next().unwrap_or_default();
            format!(
                "the edited text does not load: {}",
                first
                    .chars()
                    .map(|c| if c.is_ascii_graphic() || c == ' ' {
                        c
                    } else {
                        '?'
                    })
                    .collect::<String>()
            )
        })?;
        let mut want = start.clone();
        if got.allow.len() < expected.len() || got.allow[..expected.len()] != expected[..] {
            return Err(differs.into());
        }
        got.allow.clear();
        want.allow.clear();
        if got != want {
            return Err(differs.into());
        }
        Ok(())
    };

    let lines: Vec<&str> = start_text.lines().collect();
    let why_not = match allow_key(&lines) {
        Err(why) => why.to_string(),
        Ok(found) => {
            let text = match found {
                None => with_new_allow(start_text, notes, entries),
                Some((at, value)) if value.is_empty() => appended(&lines, at, notes, entries),
                Some((at, value)) if value == "[]" => rewritten(&lines, at, &[], notes, entries),
                // A flow list: the same entries in block style, then the new ones.
                Some((at, _)) => rewritten(&lines, at, &local, notes, entries),
            };
            match reads_back(&text) {
                Ok(()) => return (text, true),
                Err(why) => why,
            }
        }
    };
    // Left as it is; the entries below it, commented out, with why.
    let mut out = start_text.to_string();
    if !out.ends_with('\n') && !out.is_empty() {
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "\n# egress-fence learn could not add these entries to this policy's `allow:` \
         list ({why_not}): move them there by hand."
    );
    for line in block(notes, entries, 2).lines() {
        let _ = writeln!(out, "#{line}");
    }
    (out, entries.is_empty())
}

/// The text with `allow:` and the entries appended (it had no `allow:`).
fn with_new_allow(text: &str, notes: &[String], entries: &[NewEntry]) -> String {
    let mut out = text.to_string();
    if !out.ends_with('\n') && !out.is_empty() {
        out.push('\n');
    }
    out.push_str("allow:\n");
    out.push_str(&block(notes, entries, 2));
    out
}

/// The lines of the `allow:` value that begins after line `at`: up to the next top-level key
/// (a line at column 0 that is neither blank, a comment nor a list item). Returns the index
/// one past its last line of content (trailing blank lines and column-0 comments belong to
/// what follows).
fn section_end(lines: &[&str], at: usize) -> usize {
    let mut end = at + 1;
    for (i, line) in lines.iter().enumerate().skip(at + 1) {
        let top = !line.starts_with([' ', '\t', '#', '-']) && !line.trim().is_empty();
        if top {
            break;
        }
        if !line.trim().is_empty() && !line.starts_with('#') {
            end = i + 1;
        }
    }
    end
}

/// The text with the entries appended to the block list that follows line `at`, at its
/// items' indentation.
fn appended(lines: &[&str], at: usize, notes: &[String], entries: &[NewEntry]) -> String {
    let end = section_end(lines, at);
    let indent = lines[at + 1..end]
        .iter()
        .find(|l| l.trim_start().starts_with('-'))
        .map_or(2, |l| l.len() - l.trim_start().len());
    let mut out = String::new();
    for line in &lines[..end] {
        out.push_str(line);
        out.push('\n');
    }
    out.push_str(&block(notes, entries, indent));
    for line in &lines[end..] {
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The text with the `allow:` value at line `at` replaced by a block list of `keep` and the
/// entries.
fn rewritten(
    lines: &[&str],
    at: usize,
    keep: &[Allow],
    notes: &[String],
    entries: &[NewEntry],
) -> String {
    let end = section_end(lines, at);
    let mut out = String::new();
    for line in &lines[..at] {
        out.push_str(line);
        out.push('\n');
    }
    out.push_str("allow:\n");
    if !keep.is_empty() {
        out.push_str(
            "  # egress-fence learn rewrote this list in block style: its entries are the \
             policy's own, unchanged\n",
        );
    }
    for a in keep {
        out.push_str(&entry_text(a, 2));
    }
    out.push_str(&block(notes, entries, 2));
    for line in &lines[end..] {
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests;
