//! The pending confirmation: a change that reverts by itself unless confirmed in time.
//!
//! One clock for every party: the deadline is a point on the kernel's `CLOCK_BOOTTIME` (which
//! no one can set, and which counts time suspended too) of one boot, recorded with that
//! boot's id. The timer waits for it, and every writer judges "due" by it, so a step of the
//! wall clock (NTP at boot, a resumed VM, an admin's `date -s`) moves no deadline. The wall
//! time is written beside it for people only. A record of another boot is void: the restart
//! ended its timer and the kernel's table with it.

use std::fs;
use std::io;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::FORMAT;
use super::dir::StateDir;
use super::error::{StateError, io_error};
use super::files::{is_not_found, read_regular};
use super::lock::WriterLock;
use super::timer::TimerLife;
use crate::core::ruleset::Ruleset;
use crate::core::time::{clock_utc, rfc3339};

pub(super) const PENDING_FILE: &str = "pending-confirm.json";

/// What time it is, on both clocks: the boot clock decides, the wall clock is shown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Now {
    pub wall: SystemTime,
    /// `/proc/sys/kernel/random/boot_id`; empty if it cannot be read.
    pub boot_id: String,
    /// `CLOCK_BOOTTIME`, in milliseconds.
    pub boot_ms: u64,
}

impl Now {
    pub fn read() -> Now {
        let boot_ms = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
            .map(|t| {
                let ms = i128::from(t.tv_sec()) * 1000 + i128::from(t.tv_nsec()) / 1_000_000;
                u64::try_from(ms).unwrap_or(0)
            })
            .unwrap_or(0);
        let boot_id = fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        Now {
            wall: SystemTime::now(),
            boot_id,
            boot_ms,
        }
    }
}

/// A change that reverts by itself unless `egress-fence confirm` runs before its deadline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingConfirm {
    pub format: u32,
    /// Names this confirmation: a revert timer acts only while the file still carries it.
    pub token: String,
    /// The generation that awaits confirmation.
    pub generation: u64,
    /// What the change reverts to: a generation; else the table in `revert_table`; else (both
    /// `None`) no table at all, because there was none before the change.
    pub revert_to: Option<u64>,
    /// The live table as the kernel held it before the change, when no generation of this
    /// state directory describes it (installed from another state directory, by hand, or
    /// changed beside egress-fence). Never a generation: it has no policy text to re-plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revert_table: Option<Ruleset>,
    /// RFC 3339, UTC, for people: the wall clock's guess at the deadline when it was armed.
    pub deadline: String,
    /// The same in milliseconds since 1970 (UTC): for display only, never to decide.
    pub deadline_unix_ms: u64,
    /// The boot the deadline belongs to (empty in records of older versions, which are
    /// judged by the wall clock).
    #[serde(default)]
    pub boot_id: String,
    /// When the change was armed, on that boot's `CLOCK_BOOTTIME` (milliseconds).
    #[serde(default)]
    pub armed_boot_ms: u64,
    /// The deadline on that boot's `CLOCK_BOOTTIME` (milliseconds): what every party obeys.
    #[serde(default)]
    pub deadline_boot_ms: u64,
    /// The systemd unit the revert timer runs in, if it was started as one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timer_unit: Option<String>,
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
    /// The generation recorded for the revert; `None` when the table was deleted or the
    /// recorded live table was put back.
    pub generation: Option<u64>,
}

/// Where a pending confirmation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Its revert was carried out.
    Reverted,
    /// Armed before the host restarted: void.
    OtherBoot,
    /// Before its deadline: this long left.
    Awaiting(Duration),
    /// The deadline passed: the revert is due, from whoever holds the lock first.
    Due,
}

impl PendingConfirm {
    pub fn new(
        generation: u64,
        revert_to: Option<u64>,
        now: &Now,
        within: Duration,
        netns_inode: u64,
    ) -> PendingConfirm {
        let since_1970 = now.wall.duration_since(UNIX_EPOCH).unwrap_or_default();
        let deadline = now.wall + within;
        let within_ms = u64::try_from(within.as_millis()).unwrap_or(u64::MAX);
        PendingConfirm {
            format: FORMAT,
            token: format!("{}-{}", std::process::id(), since_1970.as_nanos()),
            generation,
            revert_to,
            revert_table: None,
            deadline: rfc3339(deadline),
            deadline_unix_ms: deadline
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            boot_id: now.boot_id.clone(),
            armed_boot_ms: now.boot_ms,
            deadline_boot_ms: now.boot_ms.saturating_add(within_ms),
            timer_unit: None,
            netns_inode,
            reverted: None,
        }
    }

    pub fn stage(&self, now: &Now) -> Stage {
        if self.reverted.is_some() {
            return Stage::Reverted;
        }
        let left = if self.boot_id.is_empty() || now.boot_id.is_empty() {
            // A record of an older version: the wall clock is all there is.
            self.deadline().duration_since(now.wall).ok()
        } else if self.boot_id != now.boot_id {
            return Stage::OtherBoot;
        } else {
            self.deadline_boot_ms
                .checked_sub(now.boot_ms)
                .filter(|&ms| ms > 0)
                .map(Duration::from_millis)
        };
        match left {
            Some(left) if !left.is_zero() => Stage::Awaiting(left),
            _ => Stage::Due,
        }
    }

    /// Still waiting for `confirm` or its deadline.
    pub fn is_awaiting(&self, now: &Now) -> bool {
        matches!(self.stage(now), Stage::Awaiting(_))
    }

    /// Whole seconds until the deadline, rounded up (0 once it passed).
    pub fn seconds_left(&self, now: &Now) -> u64 {
        match self.stage(now) {
            Stage::Awaiting(left) => left.as_millis().div_ceil(1000) as u64,
            _ => 0,
        }
    }

    /// The deadline on the wall clock, for display.
    pub fn deadline(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.deadline_unix_ms)
    }

    /// How long since the change was armed (its recorded live table aged this much).
    pub fn since_armed(&self, now: &Now) -> Duration {
        Duration::from_millis(now.boot_ms.saturating_sub(self.armed_boot_ms))
    }

    /// "generation 6", "the table that was live before it", "no table at all".
    pub fn revert_target(&self) -> String {
        match (self.revert_to, &self.revert_table) {
            (Some(n), _) => format!("generation {n}"),
            (None, Some(_)) => "the table that was live before it (recorded when it was \
                                applied; no generation here describes it)"
                .to_string(),
            (None, None) => "no table at all (the table is deleted)".to_string(),
        }
    }

    /// Where the confirmation stands, in a sentence, given whether its timer lives.
    pub fn describe(&self, now: &Now, timer: TimerLife) -> String {
        let generation = self.generation;
        let unit = match &self.timer_unit {
            Some(unit) => format!(" (systemd unit {unit})"),
            None => String::new(),
        };
        match (self.stage(now), timer) {
            (Stage::Reverted, _) => {
                let reverted = self.reverted.as_ref().map(|r| (r.generation, &r.time));
                let (recorded, time) = reverted.unwrap_or((None, &self.deadline));
                let what = match (recorded, self.revert_to, &self.revert_table) {
                    (Some(g), _, _) => format!(
                        "reverted to {} (recorded as generation {g})",
                        self.revert_target()
                    ),
                    (None, None, None) => {
                        "reverted: the table was deleted (there was no table before it)".into()
                    }
                    _ => format!("reverted to {}", self.revert_target()),
                };
                format!(
                    "generation {generation} was not confirmed by {}: {what} at {time}",
                    self.deadline
                )
            }
            (Stage::OtherBoot, _) => format!(
                "generation {generation} awaited confirmation until {} of an earlier boot; \
                 the restart ended its revert timer and the kernel's table with it, so \
                 nothing is reverted",
                self.deadline
            ),
            (Stage::Awaiting(_), TimerLife::Alive) => format!(
                "generation {generation} awaits confirmation: it reverts to {} at {} (in {} s) \
                 unless `egress-fence confirm` runs before",
                self.revert_target(),
                clock_utc(self.deadline()),
                self.seconds_left(now)
            ),
            (Stage::Awaiting(_), TimerLife::Gone | TimerLife::Stopped) => format!(
                "generation {generation} awaits confirmation until {} (in {} s), but the revert \
                 timer{unit} {}: unless `egress-fence confirm` runs before, the next \
                 egress-fence apply, rollback or confirm after the deadline reverts it to {}",
                clock_utc(self.deadline()),
                self.seconds_left(now),
                timer_not_running(timer),
                self.revert_target()
            ),
            (Stage::Due, TimerLife::Alive) => format!(
                "generation {generation} was not confirmed by {}: its revert timer{unit} is \
                 reverting it to {} now",
                self.deadline,
                self.revert_target()
            ),
            (Stage::Due, TimerLife::Gone | TimerLife::Stopped) => format!(
                "generation {generation} was not confirmed by {} and the revert timer{unit} {}; \
                 the revert is overdue: the next egress-fence apply, rollback or confirm \
                 reverts it to {}",
                self.deadline,
                timer_not_running(timer),
                self.revert_target()
            ),
        }
    }
}

/// "is gone", "is stopped (...)": a timer that will not revert by itself.
fn timer_not_running(timer: TimerLife) -> &'static str {
    match timer {
        TimerLife::Stopped => "is stopped (it reverts nothing unless it is resumed)",
        TimerLife::Alive | TimerLife::Gone => "is gone",
    }
}

impl StateDir {
    /// Where `pending` stands now, with whether its timer lives.
    pub fn describe_pending(&self, pending: &PendingConfirm) -> String {
        pending.describe(&Now::read(), self.timer_life(&pending.token))
    }

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

    /// Removes the pending confirmation (and its timer's record); `false` if there was none.
    pub fn clear_pending(&self, _lock: &WriterLock) -> Result<bool, StateError> {
        if let Ok(Some(pending)) = self.pending() {
            self.remove_timer_record(&pending.token)?;
        }
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

    fn at(wall_secs: u64, boot_ms: u64) -> Now {
        Now {
            wall: UNIX_EPOCH + Duration::from_secs(wall_secs),
            boot_id: "boot-a".into(),
            boot_ms,
        }
    }

    #[test]
    fn the_boot_clock_decides_and_the_wall_clock_is_only_shown() {
        let armed = at(1_000_000, 50_000);
        let p = PendingConfirm::new(7, Some(6), &armed, Duration::from_secs(60), 1);
        assert_eq!(p.deadline(), armed.wall + Duration::from_secs(60));
        assert_eq!(p.deadline_boot_ms, 110_000);
        assert_eq!(
            p.stage(&at(1_000_000, 50_000)),
            Stage::Awaiting(Duration::from_secs(60))
        );
        // The wall clock jumps a day ahead (or back): nothing moves.
        assert_eq!(
            p.stage(&at(1_086_400, 80_000)),
            Stage::Awaiting(Duration::from_secs(30))
        );
        assert_eq!(
            p.stage(&at(900_000, 80_000)),
            Stage::Awaiting(Duration::from_secs(30))
        );
        assert_eq!(p.seconds_left(&at(0, 109_001)), 1);
        // The boot clock reaches the deadline, whatever the wall clock says.
        assert_eq!(p.stage(&at(0, 110_000)), Stage::Due);
        assert_eq!(p.seconds_left(&at(0, 110_000)), 0);
        assert_eq!(p.since_armed(&at(0, 80_000)), Duration::from_secs(30));
        // Another boot: void.
        let rebooted = Now {
            boot_id: "boot-b".into(),
            ..at(1_000_010, 1_000)
        };
        assert_eq!(p.stage(&rebooted), Stage::OtherBoot);
        // A record of an older version has no boot clock: the wall clock decides.
        let old = PendingConfirm {
            boot_id: String::new(),
            ..p.clone()
        };
        assert!(old.is_awaiting(&at(1_000_059, 0)));
        assert_eq!(old.stage(&at(1_000_061, 0)), Stage::Due);
    }

    #[test]
    fn pending_confirmations_say_where_they_stand() {
        let armed = at(1_000_000, 50_000);
        let p = PendingConfirm::new(7, Some(6), &armed, Duration::from_secs(60), 1);
        assert_eq!(p.revert_target(), "generation 6");
        assert_eq!(
            p.describe(&armed, TimerLife::Alive),
            "generation 7 awaits confirmation: it reverts to generation 6 at 13:47:40 UTC (in 60 s) \
             unless `egress-fence confirm` runs before"
        );
        let gone = p.describe(&armed, TimerLife::Gone);
        assert!(gone.contains("the revert timer is gone"), "{gone}");
        let due = at(1_000_061, 110_001);
        assert!(
            p.describe(&due, TimerLife::Alive)
                .contains("reverting it to generation 6 now"),
            "{}",
            p.describe(&due, TimerLife::Alive)
        );
        let overdue = p.describe(&due, TimerLife::Gone);
        assert!(
            overdue.contains("the revert timer is gone; the revert is overdue"),
            "{overdue}"
        );
        assert!(!overdue.contains("in 0 s"), "{overdue}");
        let stopped = p.describe(&due, TimerLife::Stopped);
        assert!(
            stopped.contains("the revert timer is stopped") && stopped.contains("overdue"),
            "{stopped}"
        );
        let mut reverted = p.clone();
        reverted.reverted = Some(Reverted {
            time: "1970-01-12T13:47:41Z".into(),
            generation: Some(8),
        });
        assert!(!reverted.is_awaiting(&armed));
        assert_eq!(
            reverted.describe(&armed, TimerLife::Gone),
            "generation 7 was not confirmed by 1970-01-12T13:47:40Z: reverted to generation 6 \
             (recorded as generation 8) at 1970-01-12T13:47:41Z"
        );
        let nothing = PendingConfirm::new(1, None, &armed, Duration::from_secs(1), 1);
        assert!(nothing.revert_target().contains("deleted"));
        let foreign = PendingConfirm {
            revert_table: Some(ruleset()),
            ..nothing
        };
        assert!(foreign.revert_target().contains("live before it"));
    }

    #[test]
    fn a_recorded_live_table_reads_back() {
        let (_root, state) = temp_state();
        let lock = lock(&state);
        let mut p = PendingConfirm::new(1, None, &Now::read(), Duration::from_secs(1), 1);
        p.revert_table = Some(ruleset());
        state.write_pending(&lock, &p).unwrap();
        assert_eq!(state.pending().unwrap(), Some(p));
    }
}
