//! What has been applied, on disk: generations, the writers' lock, the pending confirmation.
//!
//! Each network namespace has a directory of its own below the state directory (default
//! [`DEFAULT_STATE_DIR`]): `host` for the namespace egress-fence runs in, `netns-NAME` for a
//! named one (`ip netns`), `netns-ino-INODE` for one given as a path. In it:
//!
//! - `gen-000042.json`: one [`Generation`] per applied policy, rollback or revert: the policy
//!   text, what its names resolved to, the [`Ruleset`](crate::core::ruleset::Ruleset) value
//!   and its nft text. Written atomically (temporary file, fsync, rename, fsync of the
//!   directory), so a crash or a full disk leaves the old record or the new one, never half of
//!   one; the last N are kept.
//! - `lock`: the writers' lock (an exclusive `flock`), with the holder's pid and command in it.
//!   The kernel releases it when its holder dies, so a dead holder's lock is simply taken.
//! - `pending-confirm.json`: a change that reverts by itself unless confirmed.
//! - `revert-timer.log`: what revert timers did.
//! - `revert-timer-TOKEN.json`: the pid and start time of the living revert timer for a
//!   pending confirmation, written by the timer itself (see `timer`).
//!
//! A file that does not read back as what was written (torn, edited, truncated) is reported
//! with its path and never used; so is a generation whose ruleset is not what its policy text
//! plans with its recorded resolution ([`crate::core::replan`]): a rollback installs only a
//! ruleset its policy explains.
//!
//! Nothing found in the directory is trusted for what its name says: every file is opened
//! without following a symbolic link and without blocking (`O_NOFOLLOW | O_NONBLOCK`) and
//! used only if `fstat` says it is a regular file, so a link planted as `lock` cannot make a
//! writer truncate the file it points to, and a FIFO named like a generation cannot hang a
//! reader. The directory itself (and the state directory above it) must belong to root or to
//! the user egress-fence runs as, and must not be writable by group or others; as root, a
//! directory that only root can reach (systemd's `/var/lib/private` of `DynamicUser=`) may
//! belong to another user. Generation numbers never wrap: past `u64::MAX` is an error.
//!
//! One file per concern: `dir` (where a namespace's state lives, atomic writes), `files` (the
//! checks on what is found there), `generations`, `lock` (the writers' lock), `pending` (the
//! pending confirmation) and `error`. Times are written by [`crate::core::time`].

mod dir;
mod error;
mod files;
mod generations;
mod lock;
mod pending;
mod timer;

pub use dir::{
    CRASH_BEFORE_RENAME_ENV, REVERT_TIMER_LOG, StateDir, current_netns_inode, namespace_dir_name,
    netns_exists,
};
pub use error::StateError;
pub use generations::{
    DEFAULT_KEEP, Generation, GenerationEntry, GenerationSummary, NewGeneration, Recorder,
    generation_file_name, generations_to_prune, parse_generation_file_name,
};
pub use lock::{LockHolder, WriterLock, busy_message};
pub use pending::{Now, PendingConfirm, Reverted, Stage};
pub use timer::{TimerLife, TimerRecord, process_start_ticks};

/// Kept here for the callers that reach them through `state::`; they belong to
/// [`crate::core::time`].
pub use crate::core::time::{clock_utc, rfc3339};

pub const DEFAULT_STATE_DIR: &str = "/var/lib/egress-fence";

/// The format of generation and pending files this build writes and reads.
const FORMAT: u32 = 1;

#[cfg(test)]
mod test_support;
