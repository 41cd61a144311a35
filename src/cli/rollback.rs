//! `rollback`: reinstate an earlier generation exactly as it was applied.

use egress_fence::change::{self, Writer};
use egress_fence::nft::Nft;

use super::args::{NamespaceArg, WriterArgs};
use super::common::{enter, lock, state_dir};
use super::exit::Failure;
use super::output::{confirm_command, print_summary, report_pending_notes};

pub fn run(
    to: Option<u64>,
    target: &NamespaceArg,
    writer: &WriterArgs,
    json: bool,
) -> Result<u8, Failure> {
    let state = state_dir(target, &writer.state)?;
    enter(target, None)?;
    let lock = lock(&state, "rollback", &writer.lock)?;
    let writer_ctx = Writer {
        state: &state,
        lock: &lock,
        keep: writer.keep,
    };
    let outcome = change::rollback(&mut Nft::open()?, &writer_ctx, to)?;
    drop(lock);
    report_pending_notes(
        &outcome.pending,
        &state,
        &confirm_command(target, &writer.state),
    );
    if json {
        let out = serde_json::json!({
            "changed": !outcome.diff.is_empty(),
            "reinstated": outcome.source.generation,
            "generation": outcome.recorded.generation,
            "differences": outcome.diff,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        let (from, recorded) = (outcome.source.generation, outcome.recorded.generation);
        if outcome.diff.is_empty() {
            println!(
                "the table already matched generation {from}; recorded the rollback as generation {recorded}"
            );
        } else {
            println!("rolled back to generation {from}, recorded as generation {recorded}");
            print_summary(&outcome.diff);
        }
    }
    Ok(0)
}
