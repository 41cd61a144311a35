//! `probe`: prove the boundary from inside it.

use std::path::Path;

use egress_fence::probe::{self, ProbeOptions};

use super::args::{NamespaceArg, Resolving};
use super::common::enter;
use super::exit::{EXIT_PROBE_FAILED, Failure};
use super::load::load;

pub fn run(
    path: &Path,
    target: &NamespaceArg,
    resolving: &Resolving,
    json: bool,
) -> Result<u8, Failure> {
    let resolv_conf = enter(target, Some(resolving))?;
    let policy = load(path)?;
    let options = ProbeOptions::for_policy(&policy, &resolv_conf)?;
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
