//! `check`: validate a policy without touching the network or the kernel, and name what of
//! this host would let its scope's fenced processes past the fence.

use std::path::Path;

use egress_fence::core::policy::{Allow, HostFinding, Target};
use egress_fence::host::ThisHost;

use super::exit::{EXIT_BAD_POLICY, Failure};
use super::load::load_with_text;
use super::output::join_display;

pub fn run(path: &Path) -> Result<u8, Failure> {
    let (policy, text) = load_with_text(path)?;
    // Judged as `run` judges it (the file opened must be the one the walk judged), and as
    // for `run` as root whoever runs `check`: the owner trying a policy before installing it
    // would otherwise count as the user `run` runs as.
    if let Err(egress_fence::path_trust::Refused::Open(found)) =
        egress_fence::path_trust::open_trusted(path, 0)
    {
        eprintln!(
            "warning: {found}: `run` refuses a policy file that a user other than root (or \
             the user it runs as) could change, since it reads the file again on every reload; \
             `apply` and `exec` read it once"
        );
    }
    for w in policy.upstreams_on_this_host(&egress_fence::host::read_addrs_or_warn()) {
        eprintln!("warning: {w}");
    }
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
    // What `include:` pulled in, so that a reviewer sees every name the policy allows.
    for preset in &policy.include {
        println!("include {}:", preset.name());
        for entry in preset.entries() {
            println!("  {}", describe_entry(&entry));
        }
    }
    Ok(0)
}

/// One allow entry on one line: `registry.npmjs.org tcp 443  # the public npm registry`.
fn describe_entry(entry: &Allow) -> String {
    let comment = entry
        .comment
        .as_deref()
        .map_or(String::new(), |c| format!("  # {c}"));
    format!("{}{comment}", entry.describe())
}
