//! Printing that several commands share: the resolution's warnings, a change's summary, notes
//! about an earlier confirm-or-revert. Warnings go to stderr so that stdout stays
//! machine-readable.

use std::path::Path;

use egress_fence::change::PendingNote;
use egress_fence::core::diff::TableDiff;
use egress_fence::core::plan::denied_answers;
use egress_fence::core::policy::Policy;
use egress_fence::core::resolution::{Resolution, ResolvedHost};
use egress_fence::state::{DEFAULT_STATE_DIR, StateDir};

use super::args::{NamespaceArg, StateArgs};

pub fn join_display<T: std::fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn describe_host(host: &ResolvedHost) -> String {
    if host.addrs.is_empty() {
        return format!(
            "{}: NOT RESOLVED ({}): its allow entries are left out",
            host.name,
            host.why_unresolved()
        );
    }
    let addrs: Vec<String> = host
        .addrs
        .iter()
        .map(|a| format!("{} (ttl {})", a.addr, a.ttl))
        .collect();
    format!("{}: {}", host.name, addrs.join(", "))
}

/// Warnings about the resolution, on stderr so that stdout stays machine-readable.
pub fn report_resolution(policy: &Policy, resolution: &Resolution) {
    for host in &resolution.hosts {
        if !host.dropped.is_empty() && !host.addrs.is_empty() {
            eprintln!(
                "warning: {} answered addresses that are never allowed, left out: {}",
                host.name,
                host.describe_dropped()
            );
        }
        if host.addrs.is_empty() {
            eprintln!("warning: {}", describe_host(host));
        } else if !host.errors.is_empty() {
            eprintln!(
                "warning: {} resolved only partly: {}",
                host.name,
                host.errors.join("; ")
            );
        }
    }
    for w in denied_answers(policy, &resolution.hosts) {
        eprintln!("warning: {w}");
    }
    // Resolvers (or the guard's upstreams) on loopback or an address of this host: said here
    // unless it is what the policy's warnings said already of its own resolvers on loopback.
    let host = egress_fence::host::read_addrs_or_warn();
    let warning = policy.squattable_resolvers(&resolution.resolvers, |a| host.is_own(a));
    let said = policy
        .dns
        .resolvers
        .as_deref()
        .and_then(|r| policy.squattable_resolvers(r, |_| false));
    if let Some(w) = warning.filter(|w| said.as_ref() != Some(w)) {
        eprintln!("warning: {w}");
    }
}

pub fn print_summary(diff: &TableDiff) {
    for line in diff.summary() {
        println!("  {line}");
    }
}

/// `egress-fence confirm` with the options that find this change's state.
pub fn confirm_command(target: &NamespaceArg, state: &StateArgs) -> String {
    let mut cmd = "egress-fence confirm".to_string();
    if let Some(ns) = &target.netns {
        cmd.push_str(&format!(" --netns {ns}"));
    }
    if state.state_dir != Path::new(DEFAULT_STATE_DIR) {
        cmd.push_str(&format!(" --state-dir {}", state.state_dir.display()));
    }
    cmd
}

/// What a writer learnt about an earlier confirm-or-revert, on stderr.
pub fn report_pending_notes(note: &PendingNote, state: &StateDir, confirm_hint: &str) {
    let Some(text) = note.describe(state) else {
        return;
    };
    match note {
        PendingNote::Awaiting(_) => eprintln!(
            "warning: {text}; that revert undoes this change too (`{confirm_hint}` keeps both)"
        ),
        PendingNote::RevertedNow(..) | PendingNote::Dropped(..) => eprintln!("warning: {text}"),
        _ => eprintln!("note: {text}"),
    }
}
