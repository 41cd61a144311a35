//! Refused packets the table counted but `watch` never heard of: the table logs at the
//! policy's `log.rate`, one limit for every process, so a sandbox that spends it on decoys
//! has its next refusals counted and never logged. `watch` cannot show those packets; it
//! says how many there were, from the refused chain's counters (which count every refusal).
//!
//! The comparison is made one reading late: the kernel logs a packet (and, with a queue
//! threshold of 1, puts the message on the socket) before the counter after the log rule
//! counts it, so every message of the packets a reading counted is on the socket when the
//! reading is made, and read by the next one, which callers take only once the reader has
//! since found its socket empty ([`super::Watcher::drains`]); the packets heard are sampled
//! before the counters. Packets heard since then make the count smaller, never larger: what
//! is said to be unshown was never shown.

use std::fmt;

use serde::Serialize;

/// One reading of the table's refused counters: the packets of both families, and the
/// table's handle, which a table applied anew changes (its counters start at 0 again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counted {
    pub table: u64,
    pub packets: u64,
}

impl Counted {
    pub fn new(table: u64, packets: u64) -> Counted {
        Counted { table, packets }
    }
}

/// The bookkeeping: readings of the table's refused counter against the refused packets heard.
#[derive(Debug, Default)]
pub struct Unlogged {
    /// The counter when the count started: what it had counted by then is not judged (0 for
    /// a table made since the reading before, whose counter started at 0).
    base: u64,
    /// Refused packets heard when the count started.
    heard_at_base: u64,
    /// The previous reading, judged at the next one; `None` before the first and while no
    /// table is installed.
    last: Option<Counted>,
    /// Refused packets heard at the previous reading, table or not; `None` before the first.
    heard_before: Option<u64>,
    /// Unshown packets said so far, since `base`.
    said: u64,
}

impl Unlogged {
    /// Takes a reading of the counter (`None`: no table) with the number of refused packets
    /// heard so far, and returns how many more refused packets went unshown since the last
    /// report, if any.
    pub fn reading(&mut self, counted: Option<Counted>, heard: u64) -> Option<u64> {
        let heard_before = self.heard_before.replace(heard);
        let Some(counted) = counted else {
            self.last = None;
            return None;
        };
        let previous = match self.last.replace(counted) {
            Some(previous)
                if previous.table == counted.table && counted.packets >= previous.packets =>
            {
                previous.packets
            }
            // The first reading, a table made since the last one, or one applied whole (a
            // reload, a heal: its counter starts at 0 again, under another handle; told by
            // the handle, since by now it may have counted past the old one): start over.
            _ => {
                (self.base, self.heard_at_base) = match heard_before {
                    // What the table counted before anyone listened is not judged.
                    None => (counted.packets, heard),
                    // The new table counted from 0, and all it logged was heard after the
                    // last reading (with, at worst, the old table's last packets: a count
                    // too small, never too large).
                    Some(heard_before) => (0, heard_before),
                };
                self.said = 0;
                return None;
            }
        };
        let unshown =
            (previous - self.base).saturating_sub(heard.saturating_sub(self.heard_at_base));
        let more = unshown.checked_sub(self.said).filter(|&m| m > 0)?;
        self.said = unshown;
        Some(more)
    }
}

/// `watch`'s report of refused packets it could not show. Serialises (serde_json) to one JSON
/// object, `{"time": ..., "verdict": "unlogged", "packets": N, "note": ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnloggedEvent {
    /// RFC 3339, UTC, milliseconds: when the count was made.
    pub time: String,
    /// Always "unlogged", which tells these lines from refused packets.
    pub verdict: &'static str,
    /// How many refused packets, since the last such line, were counted and never logged.
    pub packets: u64,
    pub note: &'static str,
}

const NOTE: &str = "counted by the table, not logged: over the policy's log.rate, \
                    or logged to another NFLOG group";

impl UnloggedEvent {
    pub fn new(time: String, packets: u64) -> UnloggedEvent {
        UnloggedEvent {
            time,
            verdict: "unlogged",
            packets,
            note: NOTE,
        }
    }
}

impl fmt::Display for UnloggedEvent {
    /// `TIME UNLOGGED N refused packet(s) not shown [NOTE]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} UNLOGGED {} refused packet(s) not shown [{}]",
            self.time, self.packets, self.note
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reading of `packets` from the table of handle `table`.
    fn c(table: u64, packets: u64) -> Option<Counted> {
        Some(Counted::new(table, packets))
    }

    #[test]
    fn a_table_applied_anew_is_told_by_its_handle_though_it_counted_past_the_old_one() {
        let mut u = Unlogged::default();
        assert_eq!(u.reading(c(1, 0), 0), None);
        // 100 counted and heard.
        assert_eq!(u.reading(c(1, 100), 100), None);
        assert_eq!(u.reading(c(1, 100), 100), None);
        // Applied anew: the new table counted 150 in its first second, none heard.
        assert_eq!(u.reading(c(2, 150), 100), None);
        assert_eq!(u.reading(c(2, 150), 100), Some(150));
    }

    #[test]
    fn what_was_counted_and_not_heard_is_said_once_a_reading_later() {
        let mut u = Unlogged::default();
        // Started with 7 refusals counted and 2 heard: none of them is judged.
        assert_eq!(u.reading(c(1, 7), 2), None);
        // 20 logged and heard, 81 more counted: judged at the next reading.
        assert_eq!(u.reading(c(1, 108), 22), None);
        assert_eq!(u.reading(c(1, 108), 22), Some(81));
        // Said once.
        assert_eq!(u.reading(c(1, 108), 22), None);
        // 3 more, all heard: nothing.
        assert_eq!(u.reading(c(1, 111), 25), None);
        assert_eq!(u.reading(c(1, 111), 25), None);
        // 5 more, 1 heard.
        assert_eq!(u.reading(c(1, 116), 26), None);
        assert_eq!(u.reading(c(1, 116), 26), Some(4));
    }

    #[test]
    fn packets_heard_after_a_reading_count_for_it_and_nothing_is_said_early() {
        let mut u = Unlogged::default();
        assert_eq!(u.reading(c(1, 0), 0), None);
        // 10 counted at this reading, their messages read only after it.
        assert_eq!(u.reading(c(1, 10), 0), None);
        assert_eq!(u.reading(c(1, 12), 12), None);
        assert_eq!(u.reading(c(1, 12), 12), None);
    }

    #[test]
    fn a_new_table_is_judged_from_its_start() {
        let mut u = Unlogged::default();
        assert_eq!(u.reading(c(1, 100), 0), None);
        assert_eq!(u.reading(c(1, 150), 0), None);
        // Replaced (a reload): its counter started at 0 and counted 3, none heard.
        assert_eq!(u.reading(c(2, 3), 0), None);
        assert_eq!(u.reading(c(2, 3), 0), Some(3));
        assert_eq!(u.reading(c(2, 13), 0), None);
        assert_eq!(u.reading(c(2, 13), 0), Some(10));
        // Gone, then made again: 50 counted, 20 of them heard, all since the last reading.
        assert_eq!(u.reading(None, 0), None);
        assert_eq!(u.reading(c(3, 50), 20), None);
        assert_eq!(u.reading(c(3, 50), 20), Some(30));
    }

    #[test]
    fn a_table_made_after_the_first_reading_is_judged_whole() {
        // The service reads before its table is applied: the refusals of the table's first
        // second count too.
        let mut u = Unlogged::default();
        assert_eq!(u.reading(None, 0), None);
        assert_eq!(u.reading(c(1, 201), 20), None);
        assert_eq!(u.reading(c(1, 201), 20), Some(181));
    }

    #[test]
    fn the_line_says_how_many_and_why() {
        let e = UnloggedEvent::new("2026-12-02T13:46:16.868Z".into(), 181);
        assert_eq!(
            e.to_string(),
            "2026-12-02T13:46:16.868Z UNLOGGED 181 refused packet(s) not shown [counted by \
             the table, not logged: over the policy's log.rate, or logged to another NFLOG group]"
        );
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["verdict"], "unlogged");
        assert_eq!(json["packets"], 181);
    }
}
