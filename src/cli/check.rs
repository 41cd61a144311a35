//! `check`: validate a policy without touching the network or the kernel.

use std::path::Path;

use egress_fence::core::policy::Target;

use super::exit::Failure;
use super::load::load;
use super::output::join_display;

pub fn run(path: &Path) -> Result<u8, Failure> {
    let policy = load(path)?;
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
    println!(
        "{}: valid ({} allow entries, {} names, {wildcards} wildcards, {} deny \
         entries{mode})",
        path.display(),
        policy.allow.len(),
        policy.domains().len(),
        policy.deny.len()
    );
    Ok(0)
}
