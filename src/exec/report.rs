//! What the fence refused during a run: the packets its table logged (NFLOG, in the run's
//! namespace) and the names its guard refused (the guard's event socket), heard on threads
//! of their own from before CMD starts until it ends.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::watch::{DropEvent, Heard, QueryEvent, Watcher, hear};

use super::ExecError;
use super::pcap::Captured;

/// How long [`Listening::finish`] waits, past its linger, for the packet reader to have
/// read everything the table counted.
const DRAINED_WITHIN: Duration = Duration::from_secs(1);

/// How many refusals of each kind the report keeps (all are counted).
pub const KEPT: usize = 20;
/// How many of each kind the summary on stderr lists.
const LISTED: usize = 5;
/// How many refused packets a canary run keeps to match against the canary host's addresses
/// (learnt only at the end, from pasta's capture).
const KEPT_FOR_CANARY: usize = 10_000;

/// Refusals heard so far.
pub struct Listening {
    heard: Receiver<Heard>,
    refusals: Refusals,
    /// The canary's token and encodings, when the run has one.
    canary: Option<Vec<String>>,
    /// The refused questions' first labels, joined (a token sent in short pieces).
    joined: super::canary::Joined,
    /// How many times the packet reader found its socket empty ([`Watcher::drains`]).
    drains: Arc<AtomicU64>,
}

/// The run's canary, as [`listen`] needs it.
pub struct CanaryWatch<'a> {
    pub token: &'a str,
    pub host: &'a str,
}

/// With `--canary`: what happened to the canary's URL host.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CanaryHost {
    pub host: String,
    pub url: String,
    /// Questions for the host (or a name under it) the guard refused.
    pub refused_questions: Vec<String>,
    /// Questions for it the guard sent upstream (the policy allows the host).
    pub sent_questions: Vec<String>,
    /// The addresses those questions were answered with.
    pub addresses: Vec<IpAddr>,
    /// Refused packets to those addresses.
    pub refused_connections: Vec<DropEvent>,
}

impl CanaryHost {
    fn asked(&self) -> bool {
        !self.refused_questions.is_empty() || !self.sent_questions.is_empty()
    }
}

/// What the fence refused during the run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Refusals {
    /// Refused packets the table logged (at the policy's `log.rate`: a burst is logged short).
    pub connections: usize,
    /// Refused packets the table counted and did not log (over the log rate): none of them is
    /// listed. Absent when the table's counters could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unlogged_connections: Option<u64>,
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
    /// With `--canary`: the questions for the canary's URL host and the refused connections
    /// to its addresses.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub canary_host: Option<CanaryHost>,
    /// With `--canary`: the refused packets, to be matched with the canary host's addresses.
    #[serde(skip)]
    refused_for_canary: Vec<DropEvent>,
}

/// Starts hearing: the calling thread must be in the run's namespace; threads are started.
pub fn listen(
    group: u16,
    guard_events: PathBuf,
    canary: Option<CanaryWatch>,
) -> Result<Listening, ExecError> {
    let watcher = Watcher::subscribe(group)
        .map_err(|e| ExecError::Refused(format!("cannot read refused packets: {e}")))?;
    let drains = watcher.drains();
    let heard = hear(watcher, guard_events).map_err(ExecError::io("start the refusal log"))?;
    Ok(Listening {
        heard,
        refusals: Refusals {
            canary_in: canary.as_ref().map(|_| Vec::new()),
            canary_host: canary.as_ref().map(|c| CanaryHost {
                host: c.host.to_string(),
                url: super::canary::url(c.host, c.token),
                ..CanaryHost::default()
            }),
            ..Refusals::default()
        },
        canary: canary.map(|c| super::canary::needles(c.token)),
        joined: super::canary::Joined::default(),
        drains,
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

    /// Everything heard until now, after `linger` for the last packets to arrive, with how
    /// many refused packets the table counted and never logged: `counted` is its refused
    /// counter read once CMD ended (`None`: unreadable). Every message of a packet it counted
    /// was on the socket when it was read (the log rule comes before the counter), so the
    /// comparison waits, at most [`DRAINED_WITHIN`] more, for the reader to find its socket
    /// empty after that; if it does not, the count is left out rather than made too large.
    pub fn finish(mut self, linger: Duration, counted: Option<u64>) -> Refusals {
        let drains_at_count = self.drains.load(Ordering::Relaxed);
        self.receive_until(Instant::now() + linger);
        let give_up = Instant::now() + DRAINED_WITHIN;
        while self.drains.load(Ordering::Relaxed) <= drains_at_count && Instant::now() < give_up {
            self.receive_until(Instant::now() + Duration::from_millis(20));
        }
        // What the reader handed out before it found the socket empty may still be in the
        // channel.
        self.receive_until(Instant::now());
        if self.drains.load(Ordering::Relaxed) > drains_at_count {
            self.refusals.unlogged_connections =
                counted.map(|c| c.saturating_sub(self.refusals.connections as u64));
        }
        self.refusals
    }

    /// Takes in what is heard until `until` (what is already queued, when it has passed).
    fn receive_until(&mut self, until: Instant) {
        while let Ok(heard) = self
            .heard
            .recv_timeout(until.saturating_duration_since(Instant::now()))
        {
            self.take(heard);
        }
    }

    fn take(&mut self, heard: Heard) {
        let r = &mut self.refusals;
        match heard {
            Heard::Packet(Ok(event)) => {
                r.connections += 1;
                if r.canary_host.is_some() && r.refused_for_canary.len() < KEPT_FOR_CANARY {
                    r.refused_for_canary.push(event.clone());
                }
                if r.first_connections.len() < KEPT {
                    r.first_connections.push(event);
                }
            }
            Heard::Packet(Err(e)) => r.errors.push(e.to_string()),
            Heard::Query(query) => {
                r.queries += 1;
                if let (Some(needles), Some(found)) = (&self.canary, &mut r.canary_in) {
                    let whole = super::canary::carries(&query.name, needles);
                    let joined = self.joined.push(&query.name, needles);
                    if (whole || joined) && found.len() < KEPT {
                        found.push(query.name.clone());
                    }
                }
                if let Some(host) = &mut r.canary_host
                    && super::canary::asks_host(&query.name, &host.host)
                    && host.refused_questions.len() < KEPT
                {
                    host.refused_questions.push(query.name.clone());
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
    /// Whether the canary's token was seen in a question, refused or sent, or its URL host
    /// was asked.
    pub fn canary_tripped(&self) -> bool {
        [&self.canary_in, &self.canary_sent]
            .iter()
            .any(|found| found.as_ref().is_some_and(|f| !f.is_empty()))
            || self.canary_host.as_ref().is_some_and(CanaryHost::asked)
    }

    /// Adds what left the namespace (pasta's capture) to a canary run's findings: the
    /// questions that carried the token, those for the canary host, the addresses it was
    /// answered with and the refused packets to them.
    pub fn add_capture(&mut self, captured: &Captured, token: &str) {
        let needles = super::canary::needles(token);
        // Joined in the order they left, as the refused ones are: a token sent in pieces
        // shorter than a fragment under an allowed wildcard left the host whole.
        let mut joined = super::canary::Joined::default();
        let mut sent: Vec<String> = captured
            .questions
            .iter()
            .filter(|n| {
                let whole = super::canary::carries(n, &needles);
                joined.push(n, &needles) || whole
            })
            .cloned()
            .collect();
        sent.dedup();
        self.canary_sent = Some(sent);
        let Some(host) = &mut self.canary_host else {
            return;
        };
        for name in &captured.questions {
            if super::canary::asks_host(name, &host.host)
                && !host.sent_questions.contains(name)
                && host.sent_questions.len() < KEPT
            {
                host.sent_questions.push(name.clone());
            }
        }
        for (name, address) in &captured.answers {
            if super::canary::asks_host(name, &host.host) && !host.addresses.contains(address) {
                host.addresses.push(*address);
            }
        }
        host.refused_connections = self
            .refused_for_canary
            .iter()
            .filter(|e| host.addresses.contains(&e.dst))
            .take(KEPT)
            .cloned()
            .collect();
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
        let host = match &self.canary_host {
            None => String::new(),
            Some(h) if !h.asked() => format!("\nthe canary's URL host {} was never asked", h.host),
            Some(h) => {
                let mut out = format!(
                    "\nCANARY TRIPPED: the canary's URL host {} was asked: {}",
                    h.host,
                    h.refused_questions
                        .iter()
                        .map(|n| format!("{n} (refused)"))
                        .chain(h.sent_questions.iter().map(|n| format!("{n} (SENT)")))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                if !h.addresses.is_empty() {
                    let addresses: Vec<String> =
                        h.addresses.iter().map(ToString::to_string).collect();
                    out.push_str(&format!("\n  answered with {}", addresses.join(", ")));
                }
                for event in &h.refused_connections {
                    out.push_str(&format!("\n  refused: {event}"));
                }
                out
            }
        };
        self.counts_and_lists() + &canary + &host
    }

    fn counts_and_lists(&self) -> String {
        let unlogged = self.unlogged_connections.unwrap_or(0);
        let packets = (self.connections as u64).saturating_add(unlogged);
        if packets == 0 && self.queries == 0 {
            return "the fence refused nothing during the run".into();
        }
        let mut out = format!(
            "the fence refused {packets} packet(s) and {} DNS quer(ies) during the run",
            self.queries
        );
        if unlogged > 0 {
            out.push_str(&format!(
                "\n  {unlogged} refused packet(s) over the policy's log.rate were counted, not \
                 logged: they are not listed"
            ));
        }
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
    fn the_canary_host_gathers_its_questions_addresses_and_refused_connections() {
        let host = "hooks.example.test";
        let mut r = Refusals {
            canary_in: Some(Vec::new()),
            canary_host: Some(CanaryHost {
                host: host.into(),
                url: super::super::canary::url(host, "ck_live_0"),
                ..CanaryHost::default()
            }),
            refused_for_canary: vec![
                DropEvent::refused_to("192.0.2.11", 9090),
                DropEvent::refused_to("192.0.2.12", 9090),
            ],
            ..Refusals::default()
        };
        assert!(!r.canary_tripped());
        assert!(r.summary().contains("hooks.example.test was never asked"));
        let captured = Captured {
            questions: vec![
                "registry.example.test.".into(),
                "Hooks.Example.Test.".into(),
            ],
            answers: vec![
                (
                    "hooks.example.test.".into(),
                    "192.0.2.11".parse().expect("an address"),
                ),
                (
                    "registry.example.test.".into(),
                    "192.0.2.12".parse().expect("an address"),
                ),
            ],
        };
        r.add_capture(&captured, "ck_live_0");
        assert!(r.canary_tripped());
        let h = r.canary_host.as_ref().expect("a canary host");
        assert_eq!(h.sent_questions, vec!["Hooks.Example.Test.".to_string()]);
        assert_eq!(
            h.addresses,
            vec!["192.0.2.11".parse::<IpAddr>().expect("an address")]
        );
        assert_eq!(
            h.refused_connections,
            vec![DropEvent::refused_to("192.0.2.11", 9090)]
        );
        let summary = r.summary();
        assert!(summary.contains("CANARY TRIPPED: the canary's URL host hooks.example.test was asked: Hooks.Example.Test. (SENT)"), "{summary}");
        assert!(summary.contains("answered with 192.0.2.11"), "{summary}");
    }

    /// Pieces shorter than a fragment, sent one a question: joined, they carry the token.
    #[test]
    fn a_token_sent_in_short_pieces_trips() {
        let token = "ck_live_0123456789abcdef0123456789abcdef";
        let questions: Vec<String> = token.as_bytes()["ck_live_".len()..]
            .chunks(11)
            .map(|c| format!("{}.exfil.test.", String::from_utf8_lossy(c)))
            .collect();
        let needles = super::super::canary::needles(token);
        assert!(
            !questions
                .iter()
                .any(|q| super::super::canary::carries(q, &needles))
        );
        let mut r = Refusals {
            canary_in: Some(Vec::new()),
            ..Refusals::default()
        };
        r.add_capture(
            &Captured {
                questions,
                answers: Vec::new(),
            },
            token,
        );
        assert!(r.canary_tripped());
    }

    #[test]
    fn nothing_refused_says_so() {
        assert_eq!(
            Refusals::default().summary(),
            "the fence refused nothing during the run"
        );
    }
}
