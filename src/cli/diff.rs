//! `diff`: what applying the policy would change in the live table.

use std::path::Path;

use egress_fence::core::diff::{CompareOptions, compare};
use egress_fence::core::ruleset::TABLE;
use egress_fence::nft::Nft;

use super::args::{NamespaceArg, Resolving};
use super::common::enter;
use super::exit::{EXIT_CHANGES, EXIT_DIFF_FAILED, EXIT_FAILURE, Failure};
use super::load::resolve_and_plan;

pub fn run(
    path: &Path,
    target: &NamespaceArg,
    resolving: &Resolving,
    json: bool,
) -> Result<u8, Failure> {
    compare_with_live(path, target, resolving, json).map_err(|f| Failure {
        // Exit code 1 means "something would change"; a failed comparison must not look
        // like one.
        code: if f.code == EXIT_FAILURE {
            EXIT_DIFF_FAILED
        } else {
            f.code
        },
        error: f.error,
    })
}

fn compare_with_live(
    path: &Path,
    target: &NamespaceArg,
    resolving: &Resolving,
    json: bool,
) -> Result<u8, Failure> {
    let resolv_conf = enter(target, Some(resolving))?;
    let planned = resolve_and_plan(path, &resolv_conf)?;
    let live = Nft::open()?.read_table()?;
    let diff = compare(&planned.ruleset, live.as_ref(), CompareOptions::default());
    if json {
        let out = serde_json::json!({ "changed": !diff.is_empty(), "differences": diff });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else if diff.is_empty() {
        println!("no changes: table inet {TABLE} matches {}", path.display());
    } else {
        println!(
            "applying {} would change table inet {TABLE} (+ adds, - removes):",
            path.display()
        );
        print!("{diff}");
    }
    Ok(if diff.is_empty() { 0 } else { EXIT_CHANGES })
}
