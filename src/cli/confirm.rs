//! `confirm`: keep the change applied with `apply --confirm-within`.

use std::time::SystemTime;

use egress_fence::change::{self, ConfirmOutcome};

use super::args::{LockArgs, NamespaceArg, StateArgs};
use super::common::{lock, state_dir};
use super::exit::{EXIT_FAILURE, Failure};

pub fn run(
    target: &NamespaceArg,
    state_args: &StateArgs,
    lock_args: &LockArgs,
) -> Result<u8, Failure> {
    let state = state_dir(target, state_args)?;
    let lock = lock(&state, "confirm", lock_args)?;
    match change::confirm(&state, &lock)? {
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
        ConfirmOutcome::TooLate(p) => {
            eprintln!(
                "egress-fence: too late: {}; apply it again to retry",
                p.describe(SystemTime::now())
            );
            Ok(EXIT_FAILURE)
        }
    }
}
