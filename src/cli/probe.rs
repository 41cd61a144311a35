//! `probe`: prove the boundary from inside it.

use std::path::Path;

use egress_fence::probe::{self, ProbeOptions};
use egress_fence::state::Recorder;

use super::args::{NamespaceArg, Resolving, StateArgs};
use super::common::{enter, state_dir};
use super::exit::{EXIT_PROBE_FAILED, Failure};
use super::load::load;

pub fn run(
    path: &Path,
    target: &NamespaceArg,
    resolving: &Resolving,
    state_args: &StateArgs,
    json: bool,
) -> Result<u8, Failure> {
    // Whether the service wrote the table. A state directory this user cannot read leaves
    // the probe to judge by the elements' timeouts alone.
    let service_table = state_dir(target, state_args)
        .ok()
        .and_then(|state| state.newest().ok().flatten())
        .is_some_and(|g| g.command == Recorder::Run);
    let resolv_conf = enter(target, Some(resolving))?;
    let policy = load(path)?;
    let options = ProbeOptions {
        service_table,
        ..ProbeOptions::for_policy(&policy, &resolv_conf)?
    };
    let report = probe::run(&policy, &options)?;
    if json {
        let out = serde_json::json!({
            "passed": report.passed(),
            "summary": report.summary(),
            "checks": report.checks,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        for check in &report.checks {
            println!("{check}");
        }
        println!("{}", report.summary());
    }
    Ok(if report.passed() {
        0
    } else {
        EXIT_PROBE_FAILED
    })
}
