//! `confirm`: keep the change applied with `apply --confirm-within`.

use egress_fence::change::{self, ConfirmOutcome, PendingNote, Writer};
use egress_fence::nft::Nft;

use super::args::{LockArgs, NamespaceArg, StateArgs};
use super::common::{enter, lock, state_dir};
use super::exit::{EXIT_FAILURE, Failure};

pub fn run(
    target: &NamespaceArg,
    state_args: &StateArgs,
    lock_args: &LockArgs,
) -> Result<u8, Failure> {
    let state = state_dir(target, state_args)?;
    // A revert that is due is carried out here, in the namespace of the change.
    enter(target, None)?;
    let lock = lock(&state, "confirm", lock_args)?;
    let writer = Writer {
        state: &state,
        lock: &lock,
        keep: egress_fence::state::DEFAULT_KEEP,
    };
    match change::confirm(&mut Nft::open()?, &writer)? {
        ConfirmOutcome::Confirmed(p) => {
            println!(
                "confirmed generation {}: it stays, its revert timer stands down",
                p.generation
            );
            Ok(0)
        }
        ConfirmOutcome::NothingPending => {
            println!("nothing awaits confirmation");
            Ok(0)
        }
        // Void before its deadline, maybe (a restart, a namespace that is gone): not "too
        // late", but nothing to confirm either.
        ConfirmOutcome::TooLate(note @ PendingNote::Dropped(..)) => {
            eprintln!(
                "egress-fence: nothing to confirm: {}",
                note.describe(&state).unwrap_or_default()
            );
            Ok(EXIT_FAILURE)
        }
        ConfirmOutcome::TooLate(note) => {
            eprintln!(
                "egress-fence: too late, the deadline passed: {}; apply it again to retry",
                note.describe(&state).unwrap_or_default()
            );
            Ok(EXIT_FAILURE)
        }
    }
}
