//! Whether a revert timer lives: each timer, once armed, writes `revert-timer-TOKEN.json`
//! with its pid and its start time (field 22 of `/proc/PID/stat`, clock ticks since boot),
//! so that any other process can tell the timer from a dead one, or from an unrelated
//! process that was given the same pid later.

use std::fs;
use std::io;

use serde::{Deserialize, Serialize};

use super::dir::StateDir;
use super::error::{StateError, io_error};
use super::files::{is_not_found, read_regular};

const TIMER_FILE_PREFIX: &str = "revert-timer-";

/// What identifies a running revert timer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimerRecord {
    /// The pending confirmation it guards.
    pub token: String,
    pub pid: u32,
    /// Its start time, in clock ticks since boot, as `/proc/PID/stat` says.
    pub start_ticks: u64,
}

impl TimerRecord {
    /// This very process as a revert timer for `token`.
    pub fn of_this_process(token: &str) -> Option<TimerRecord> {
        let pid = std::process::id();
        Some(TimerRecord {
            token: token.to_string(),
            pid,
            start_ticks: process_start_ticks(pid)?,
        })
    }

    /// Whether the process it names is still this timer (alive, not a zombie, same start).
    pub fn is_alive(&self) -> bool {
        self.life() == TimerLife::Alive
    }

    /// Whether the process it names is still this timer, and whether it runs.
    pub fn life(&self) -> TimerLife {
        match process_run_state(self.pid) {
            Some((ticks, stopped)) if ticks == self.start_ticks => {
                if stopped {
                    TimerLife::Stopped
                } else {
                    TimerLife::Alive
                }
            }
            _ => TimerLife::Gone,
        }
    }
}

/// Whether the revert timer of a pending confirmation lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimerLife {
    Alive,
    /// Stopped (SIGSTOP, or held by a tracer): it lives, but acts no more until resumed, so
    /// it is no timer anyone can count on; the first writer after the deadline reverts.
    Stopped,
    /// Killed, died with its session or cgroup, or never started.
    Gone,
}

/// The start time of a living process (`None` for no such process, or a zombie).
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    process_run_state(pid).map(|(ticks, _)| ticks)
}

/// The start time of a living process, and whether it is stopped.
fn process_run_state(pid: u32) -> Option<(u64, bool)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    run_state_of_stat(&stat)
}

/// Field 22 (starttime) of a `/proc/PID/stat` line, and whether the process is stopped (`T`)
/// or stopped by a tracer (`t`); `None` if it is dead (a zombie `Z` or `X`). The command name
/// (field 2) is in parentheses and may hold spaces and `)`, so the fields are counted after
/// its last `)`.
fn run_state_of_stat(stat: &str) -> Option<(u64, bool)> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace();
    // Field 3 is the state; starttime is field 22, 19 fields later.
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    let ticks = fields.nth(18)?.parse().ok()?;
    Some((ticks, state == "T" || state == "t"))
}

/// A token names a file: only what `PendingConfirm::new` makes (digits and dashes) is taken.
fn timer_file_name(token: &str) -> Option<String> {
    (!token.is_empty() && token.bytes().all(|b| b.is_ascii_digit() || b == b'-'))
        .then(|| format!("{TIMER_FILE_PREFIX}{token}.json"))
}

fn bad_token(state: &StateDir, token: &str) -> StateError {
    StateError::CorruptPending {
        path: state.path().to_path_buf(),
        reason: format!("{token:?} is not a confirmation token"),
    }
}

impl StateDir {
    /// Written by the timer itself once armed (it holds no lock: the file is its own).
    pub fn write_timer_record(&self, record: &TimerRecord) -> Result<(), StateError> {
        let name = timer_file_name(&record.token).ok_or_else(|| bad_token(self, &record.token))?;
        let json = serde_json::to_vec_pretty(record).map_err(|e| StateError::Io {
            doing: "encode the revert timer's record for",
            path: self.path().to_path_buf(),
            source: e.into(),
        })?;
        self.write_atomically(&name, &json, false)
    }

    /// The record of the timer for `token`, if it wrote one; an unreadable one counts as none.
    pub fn timer_record(&self, token: &str) -> Option<TimerRecord> {
        let name = timer_file_name(token)?;
        let text = match read_regular(&self.file(&name)) {
            Ok(text) => text,
            Err(e) if is_not_found(&e) => return None,
            Err(_) => return None,
        };
        serde_json::from_str::<TimerRecord>(&text)
            .ok()
            .filter(|r| r.token == token)
    }

    /// Whether the timer for `token` lives (and runs).
    pub fn timer_life(&self, token: &str) -> TimerLife {
        self.timer_record(token)
            .map_or(TimerLife::Gone, |r| r.life())
    }

    /// Removes the record of the timer for `token` (it stood down, reverted, or is gone).
    pub fn remove_timer_record(&self, token: &str) -> Result<(), StateError> {
        let Some(name) = timer_file_name(token) else {
            return Ok(());
        };
        let path = self.file(&name);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_error("remove", &path)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_support::*;

    #[test]
    fn the_start_time_is_read_after_the_command_name() {
        let stat = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \
                    987654 1000 100";
        assert_eq!(run_state_of_stat(stat), Some((987654, false)));
        let zombie = stat.replace(")) S ", ")) Z ");
        assert_eq!(run_state_of_stat(&zombie), None);
        for stopped in [")) T ", ")) t "] {
            let stopped = stat.replace(")) S ", stopped);
            assert_eq!(run_state_of_stat(&stopped), Some((987654, true)));
        }
        assert_eq!(run_state_of_stat("4242 (short) S 1 2"), None);
        assert_eq!(run_state_of_stat("garbage"), None);
    }

    #[test]
    fn this_process_lives_and_a_record_with_another_start_does_not() {
        let me = TimerRecord::of_this_process("1-2").expect("this process");
        assert!(me.is_alive());
        let reused = TimerRecord {
            start_ticks: me.start_ticks + 1,
            ..me.clone()
        };
        assert!(!reused.is_alive(), "a pid given to another process");
    }

    #[test]
    fn timer_records_are_found_by_token() {
        let (_root, state) = temp_state();
        state.create().unwrap();
        assert_eq!(state.timer_life("1-2"), TimerLife::Gone, "never started");
        let me = TimerRecord::of_this_process("1-2").expect("this process");
        state.write_timer_record(&me).unwrap();
        assert_eq!(state.timer_record("1-2"), Some(me.clone()));
        assert_eq!(state.timer_life("1-2"), TimerLife::Alive);
        assert_eq!(state.timer_life("1-3"), TimerLife::Gone, "another token");
        state.remove_timer_record("1-2").unwrap();
        assert_eq!(state.timer_life("1-2"), TimerLife::Gone);
        state.remove_timer_record("1-2").unwrap();
        let planted = TimerRecord {
            token: "../x".into(),
            ..me
        };
        assert!(state.write_timer_record(&planted).is_err());
    }
}
