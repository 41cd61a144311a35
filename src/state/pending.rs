//! The pending confirmation: a change that reverts by itself unless confirmed in time.

use std::fs;
use std::io;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::FORMAT;
use super::dir::StateDir;
use super::error::{StateError, io_error};
use super::files::{is_not_found, read_regular};
use super::lock::WriterLock;
use crate::core::time::{clock_utc, rfc3339};

pub(super) const PENDING_FILE: &str = "pending-confirm.json";

/// A change that reverts by itself unless `egress-fence confirm` runs before its deadline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingConfirm {
    pub format: u32,
    /// Names this confirmation: a revert timer acts only while the file still carries it.
    pub token: String,
    /// The generation that awaits confirmation.
    pub generation: u64,
    /// What the change reverts to: a generation, or `None` for no table at all.
    pub revert_to: Option<u64>,
    /// RFC 3339, UTC, for people.
    pub deadline: String,
    /// The deadline in milliseconds since 1970 (UTC), for the timer.
    pub deadline_unix_ms: u64,
    /// The network namespace the change was applied in (its inode).
    pub netns_inode: u64,
    /// Set by the revert timer once it reverted the change: the record stays until a later
    /// `confirm`, `apply` or `rollback` takes note of it, so a late `confirm` learns it was too
    /// late even when the revert left no generation (a deleted table).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverted: Option<Reverted>,
}

/// What a revert timer did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reverted {
    /// RFC 3339, UTC.
    pub time: String,
    /// The generation recorded for the revert; `None` when the table was deleted.
    pub generation: Option<u64>,
}

/// How long past its deadline a pending confirmation is taken for abandoned (its timer died
/// with a reboot, say) rather than about to be reverted.
pub const OVERDUE_AFTER: Duration = Duration::from_secs(120);

impl PendingConfirm {
    pub fn new(
        generation: u64,
        revert_to: Option<u64>,
        deadline: SystemTime,
        netns_inode: u64,
    ) -> PendingConfirm {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        PendingConfirm {
            format: FORMAT,
            token: format!("{}-{}", std::process::id(), now.as_nanos()),
            generation,
            revert_to,
            deadline: rfc3339(deadline),
            deadline_unix_ms: deadline
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            netns_inode,
            reverted: None,
        }
    }

    /// Still waiting for `confirm` or its deadline (not reverted, not abandoned).
    pub fn is_awaiting(&self, now: SystemTime) -> bool {
        self.reverted.is_none() && !self.is_abandoned(now)
    }

    /// Whole seconds until the deadline, rounded up (0 once it passed).
    pub fn seconds_left(&self, now: SystemTime) -> u64 {
        let left = self.deadline().duration_since(now).unwrap_or_default();
        left.as_millis().div_ceil(1000) as u64
    }

    pub fn deadline(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.deadline_unix_ms)
    }

    /// Long past its deadline: its timer is gone.
    pub fn is_abandoned(&self, now: SystemTime) -> bool {
        now.duration_since(self.deadline())
            .is_ok_and(|late| late > OVERDUE_AFTER)
    }

    /// "generation 6" or "no table (the table is deleted)".
    pub fn revert_target(&self) -> String {
        match self.revert_to {
            Some(n) => format!("generation {n}"),
            None => "no table at all (the table is deleted)".to_string(),
        }
    }

    /// Where the confirmation stands, in a sentence.
    pub fn describe(&self, now: SystemTime) -> String {
        let generation = self.generation;
        if let Some(reverted) = &self.reverted {
            let what = match reverted.generation {
                Some(g) => format!(
                    "reverted to {} (recorded as generation {g})",
                    self.revert_target()
                ),
                None => "reverted: the table was deleted (there was no earlier generation)".into(),
            };
            format!(
                "generation {generation} was not confirmed by {}: {what} at {}",
                self.deadline, reverted.time
            )
        } else if self.is_abandoned(now) {
            format!(
                "generation {generation} awaited confirmation until {}, but no revert timer acted \
                 on it (was the host restarted?); it stays unless you roll back",
                self.deadline
            )
        } else {
            format!(
                "generation {generation} awaits confirmation: it reverts to {} at {} (in {} s) \
                 unless `egress-fence confirm` runs before",
                self.revert_target(),
                clock_utc(self.deadline()),
                self.seconds_left(now)
            )
        }
    }
}

impl StateDir {
    /// The pending confirmation, if any; a corrupt file is an error, never ignored.
    pub fn pending(&self) -> Result<Option<PendingConfirm>, StateError> {
        self.check()?;
        let path = self.file(PENDING_FILE);
        let text = match read_regular(&path) {
            Ok(text) => text,
            Err(e) if is_not_found(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
        let pending: PendingConfirm =
            serde_json::from_str(&text).map_err(|e| StateError::CorruptPending {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        if pending.format != FORMAT {
            return Err(StateError::CorruptPending {
                path,
                reason: format!("format {} is not {FORMAT}", pending.format),
            });
        }
        Ok(Some(pending))
    }

    pub fn write_pending(
        &self,
        _lock: &WriterLock,
        pending: &PendingConfirm,
    ) -> Result<(), StateError> {
        let json = serde_json::to_vec_pretty(pending).map_err(|e| StateError::Io {
            doing: "encode the pending confirmation for",
            path: self.dir.clone(),
            source: e.into(),
        })?;
        self.write_atomically(PENDING_FILE, &json, false)
    }

    /// Removes the pending confirmation; `false` if there was none.
    pub fn clear_pending(&self, _lock: &WriterLock) -> Result<bool, StateError> {
        let path = self.file(PENDING_FILE);
        match fs::remove_file(&path) {
            Ok(()) => {
                self.sync_dir()?;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_error("remove", &path)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_support::*;

    #[test]
    fn a_corrupt_pending_file_is_an_error() {
        let (_root, state) = temp_state();
        state.create().unwrap();
        fs::write(state.path().join(PENDING_FILE), "{").unwrap();
        let err = state.pending().unwrap_err().to_string();
        assert!(
            err.contains("pending-confirm.json") && err.contains("corrupt"),
            "{err}"
        );
    }

    #[test]
    fn pending_confirmations_know_when_they_are_abandoned() {
        let deadline = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let p = PendingConfirm::new(7, Some(6), deadline, 1);
        assert_eq!(p.deadline(), deadline);
        assert!(!p.is_abandoned(deadline));
        assert!(!p.is_abandoned(deadline + OVERDUE_AFTER));
        assert!(p.is_abandoned(deadline + OVERDUE_AFTER + Duration::from_secs(1)));
        assert_eq!(p.revert_target(), "generation 6");
        let early = deadline - Duration::from_secs(60);
        assert_eq!(
            p.describe(early),
            "generation 7 awaits confirmation: it reverts to generation 6 at 13:46:40 UTC (in 60 s) \
             unless `egress-fence confirm` runs before"
        );
        assert!(
            p.describe(deadline + OVERDUE_AFTER * 2)
                .contains("no revert timer acted")
        );
        let mut reverted = p.clone();
        reverted.reverted = Some(Reverted {
            time: "1970-01-12T13:46:41Z".into(),
            generation: Some(8),
        });
        assert!(!reverted.is_awaiting(early));
        assert_eq!(
            reverted.describe(early),
            "generation 7 was not confirmed by 1970-01-12T13:46:40Z: reverted to generation 6 \
             (recorded as generation 8) at 1970-01-12T13:46:41Z"
        );
        assert!(
            PendingConfirm::new(1, None, deadline, 1)
                .revert_target()
                .contains("deleted")
        );
    }
}
