//! `check`: validate a policy without touching the network or the kernel.

use std::path::Path;

use egress_fence::core::policy::{HostFinding, Target};
use egress_fence::host::ThisHost;

use super::exit::Failure;
use super::load::load_with_text;
use super::output::join_display;

pub fn run(path: &Path) -> Result<u8, Failure> {
    let (policy, text) = load_with_text(path)?;
    for finding in policy.scope_findings(&text, path, &ThisHost) {
        match finding {
            HostFinding::Warning(w) => eprintln!("warning: {w}"),
            HostFinding::Note(n) => eprintln!("note: {n}"),
        }
    }
    let wildcards = policy
        .allow
        .iter()
        .filter(|a| matches!(a.target, Target::Wildcard(_)))
        .count();
    let mode = match &policy.dns.guard {
        Some(g) => format!(
            "; DNS guard on {} forwarding to {}",
            join_display(&g.listen),
            join_display(&g.upstream)
        ),
        None => String::new(),
    };
    let scope = match &policy.scope {
        Some(s) => format!(
            "; scope: {} users, {} groups, {} cgroups, {} forwarded interfaces",
            s.users.len(),
            s.groups.len(),
            s.cgroups.len(),
            s.forward.len()
        ),
        None => String::new(),
    };
    println!(
        "{}: valid ({} allow entries, {} names, {wildcards} wildcards, {} deny \
         entries{mode}{scope})",
        path.display(),
        policy.allow.len(),
        policy.domains().len(),
        policy.deny.len()
    );
    Ok(0)
}
