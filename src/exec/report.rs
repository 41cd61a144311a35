//! What the fence refused during a run: the packets its table logged (NFLOG, in the run's
//! namespace) and the names its guard refused (the guard's event socket), heard on threads
//! of their own from before CMD starts until it ends.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::watch::{DropEvent, Heard, QueryEvent, Watcher, hear};

use super::ExecError;

/// How many refusals of each kind the report keeps (all are counted).
pub const KEPT: usize = 20;
/// How many of each kind the summary on stderr lists.
const LISTED: usize = 5;

/// Refusals heard so far.
pub struct Listening {
    heard: Receiver<Heard>,
    refusals: Refusals,
    /// The canary's token and encodings, when the run has one.
    canary: Option<Vec<String>>,
}

/// What the fence refused during the run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Refusals {
    /// Refused packets the table logged (at the policy's `log.rate`: a burst may be counted
    /// short, never as zero).
    pub connections: usize,
    pub first_connections: Vec<DropEvent>,
    /// Refused DNS queries, and the distinct names they asked.
    pub queries: usize,
    pub names: Vec<String>,
    pub first_queries: Vec<QueryEvent>,
    /// Errors reading the log (a report with any is incomplete).
    pub errors: Vec<String>,
    /// With `--canary`: the refused questions that carried the token (raw or encoded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub canary_in: Option<Vec<String>>,
    /// With `--canary`: the questions that left the namespace (the guard forwarded them, read
    /// from pasta's capture) and carried the token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub canary_sent: Option<Vec<String>>,
}

/// Starts hearing: the calling thread must be in the run's namespace; threads are started.
pub fn listen(
    group: u16,
    guard_events: PathBuf,
    canary_token: Option<&str>,
) -> Result<Listening, ExecError> {
    let watcher = Watcher::subscribe(group)
        .map_err(|e| ExecError::Refused(format!("cannot read refused packets: {e}")))?;
    let heard = hear(watcher, guard_events).map_err(ExecError::io("start the refusal log"))?;
    Ok(Listening {
        heard,
        refusals: Refusals {
            canary_in: canary_token.map(|_| Vec::new()),
            ..Refusals::default()
        },
        canary: canary_token.map(super::canary::needles),
    })
}

impl Listening {
    /// Waits until the guard's event socket is followed (its refusals before that would be
    /// missed); false on timeout.
    pub fn wait_for_guard(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.heard.recv_timeout(left) {
                Ok(Heard::Note(note)) if note.starts_with("watching the DNS guard") => {
                    return true;
                }
                Ok(other) => self.take(other),
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => return false,
            }
        }
    }

    /// Everything heard until now, after `linger` for the last packets to arrive.
    pub fn finish(mut self, linger: Duration) -> Refusals {
        let deadline = Instant::now() + linger;
        while let Ok(heard) = self
            .heard
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.take(heard);
        }
        self.refusals
    }

    fn take(&mut self, heard: Heard) {
        let r = &mut self.refusals;
        match heard {
            Heard::Packet(Ok(event)) => {
                r.connections += 1;
                if r.first_connections.len() < KEPT {
                    r.first_connections.push(event);
                }
            }
            Heard::Packet(Err(e)) => r.errors.push(e.to_string()),
            Heard::Query(query) => {
                r.queries += 1;
                if let (Some(needles), Some(found)) = (&self.canary, &mut r.canary_in)
                    && super::canary::carries(&query.name, needles)
                    && found.len() < KEPT
                {
                    found.push(query.name.clone());
                }
                let name = query.name.to_ascii_lowercase();
                if !r.names.contains(&name) && r.names.len() < KEPT {
                    r.names.push(name);
                }
                if r.first_queries.len() < KEPT {
                    r.first_queries.push(query);
                }
            }
            Heard::Note(_) => {}
        }
    }
}

impl Refusals {
    /// Whether the canary's token was seen in a question, refused or sent.
    pub fn canary_tripped(&self) -> bool {
        [&self.canary_in, &self.canary_sent]
            .iter()
            .any(|found| found.as_ref().is_some_and(|f| !f.is_empty()))
    }

    /// The summary for stderr: counts, then the first few of each.
    pub fn summary(&self) -> String {
        let found: Vec<String> = [(&self.canary_in, "refused"), (&self.canary_sent, "SENT")]
            .iter()
            .filter_map(|(found, how)| Some((found.as_ref()?, how)))
            .flat_map(|(found, how)| found.iter().map(move |n| format!("{n} ({how})")))
            .collect();
        let canary = match (&self.canary_in, found.is_empty()) {
            (None, _) => String::new(),
            (Some(_), false) => format!(
                "\nCANARY TRIPPED: the canary's token was asked as a DNS name: {}",
                found.join(", ")
            ),
            (Some(_), true) => "\nthe canary's token was in no DNS question".into(),
        };
        self.counts_and_lists() + &canary
    }

    fn counts_and_lists(&self) -> String {
        if self.connections == 0 && self.queries == 0 {
            return "the fence refused nothing during the run".into();
        }
        let mut out = format!(
            "the fence refused {} packet(s) and {} DNS quer(ies) during the run",
            self.connections, self.queries
        );
        for event in self.first_connections.iter().take(LISTED) {
            out.push_str(&format!("\n  {event}"));
        }
        if self.connections > LISTED {
            out.push_str(&format!("\n  ... {} more", self.connections - LISTED));
        }
        if !self.names.is_empty() {
            out.push_str(&format!("\n  names refused: {}", self.names.join(", ")));
        }
        for e in &self.errors {
            out.push_str(&format!("\n  (reading the log failed: {e})"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_refused_says_so() {
        assert_eq!(
            Refusals::default().summary(),
            "the fence refused nothing during the run"
        );
    }
}
