//! Reading the policy a command is given, warning on stderr about what parses but is probably
//! not meant, and resolving and planning it.

use std::path::Path;

use egress_fence::change::Planned;
use egress_fence::core::plan::plan;
use egress_fence::core::policy::Policy;
use egress_fence::dns::resolve::resolve_policy;

use super::exit::Failure;
use super::output::report_resolution;

pub fn load(path: &Path) -> Result<Policy, Failure> {
    load_with_text(path).map(|(policy, _)| policy)
}

pub fn load_with_text(path: &Path) -> Result<(Policy, String), Failure> {
    let (policy, text) = Policy::load_with_text(path)?;
    for w in policy.warnings_in(&text, path) {
        eprintln!("warning: {w}");
    }
    Ok((policy, text))
}

/// Refuses a policy whose scope this host opens a way past (see
/// [`Policy::refuse_scope_holes`]), and one that says `action: audit` (learn's alone): what
/// `apply` checks before it changes anything.
pub fn refuse_scope_holes(policy: &Policy, planned: &Planned) -> Result<(), Failure> {
    policy.refuse_audit(&planned.policy_text, &planned.policy_path, "apply")?;
    policy
        .refuse_scope_holes(
            &planned.policy_text,
            &planned.policy_path,
            &egress_fence::host::ThisHost,
        )
        .map_err(Failure::from)
}

/// Resolves and plans `path`, warning about names on stderr.
pub fn resolve_and_plan(path: &Path, resolv_conf: &Path) -> Result<Planned, Failure> {
    let (policy, planned) = resolve_and_plan_quietly(path, resolv_conf)?;
    report_resolution(&policy, &planned.resolution);
    Ok(planned)
}

/// Like [`resolve_and_plan`], leaving the warnings about the resolution to the caller.
pub fn resolve_and_plan_quietly(
    path: &Path,
    resolv_conf: &Path,
) -> Result<(Policy, Planned), Failure> {
    let (policy, policy_text) = load_with_text(path)?;
    let resolution = resolve_policy(&policy, resolv_conf)?;
    let ruleset = plan(&policy, &resolution);
    let planned = Planned {
        policy_path: std::path::absolute(path).unwrap_or_else(|_| path.to_owned()),
        policy_text,
        resolution,
        ruleset,
    };
    Ok((policy, planned))
}
