//! `check`: validate a policy without touching the network or the kernel, and name what of
//! this host would let its scope's fenced processes past the fence.

use std::path::Path;

use egress_fence::core::policy::{HostFinding, Target};
use egress_fence::host::ThisHost;

use super::exit::{EXIT_BAD_POLICY, Failure};
use super::load::load_with_text;
use super::output::join_display;

pub fn run(path: &Path) -> Result<u8, Failure> {
    let (policy, text) = load_with_text(path)?;
    let mut errors = 0;
    for finding in policy.scope_findings(&text, path, &ThisHost) {
        match finding {
            HostFinding::Error(e) => {
                errors += 1;
                eprintln!("error: {e}");
            }
            HostFinding::Warning(w) => eprintln!("warning: {w}"),
            HostFinding::Note(n) => eprintln!("note: {n}"),
        }
    }
    // Valid, but `apply` and `run` refuse it on this host.
    if errors > 0 {
        eprintln!(
            "{}: this host opens {errors} way(s) past the scope's fence; `apply` and `run` \
             refuse this policy here",
            path.display()
        );
        return Ok(EXIT_BAD_POLICY);
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
