//! A trace: what a run saw, as JSON lines (`run --record FILE`, `learn`), the input of
//! `replay` and of the policy `learn` writes. Pure: the codec; `core::replay` judges a trace.
//!
//! Lines are written as things happen, so their order is their time order; `time` is for
//! people and for first/last seen (RFC 3339 with milliseconds, UTC, which sorts as text).
//!
//! ```text
//! {"kind":"start","time":"2026-12-01T10:00:00.000Z","version":1,"mode":"guard","policy":"/etc/egress-fence/policy.yaml"}
//! {"kind":"name","time":"…","name":"api.github.com","qtype":"A","answer":"NOERROR","addrs":["192.0.2.7"],"ttl":60,"uid":1001}
//! {"kind":"flow","time":"…","family":"ipv4","protocol":"tcp","dst":"192.0.2.7","dport":443,"uid":1001}
//! {"kind":"end","time":"…"}                (with "lost":N if the writer dropped N records)
//! ```

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// The trace format's version, in its `start` line.
pub const VERSION: u32 = 1;

/// One line of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Record {
    /// The first line: what was recorded, under which policy.
    Start {
        time: String,
        version: u32,
        /// "guard" or "resolve".
        mode: String,
        /// The policy file the run enforced (or audited).
        policy: String,
        /// The run only audited: nothing was refused (`learn`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        audit: bool,
    },
    /// A name asked of the guard (or, in resolve mode, looked up by the daemon) and what
    /// came of it.
    Name {
        time: String,
        /// As asked, lower case, without the final dot.
        name: String,
        /// "A", "AAAA", "HTTPS", ...
        qtype: String,
        /// The response code the client got: "NOERROR", "NXDOMAIN", "REFUSED", "SERVFAIL".
        answer: String,
        /// The addresses the answer carried (those the table would take).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        addrs: Vec<IpAddr>,
        /// The smallest TTL of those addresses' records.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ttl: Option<u32>,
        /// Who asked, for a local client; absent for a remote one and for the daemon's own
        /// lookups.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uid: Option<u32>,
    },
    /// The first packet of a connection (or UDP flow) leaving, as the table saw it.
    Flow {
        time: String,
        /// "ipv4" or "ipv6".
        family: String,
        /// "tcp", "udp", "icmp", ... as `watch` names them.
        protocol: String,
        dst: IpAddr,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dport: Option<u16>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uid: Option<u32>,
        /// The interface a forwarded packet came in on (a listed bridge).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        iif: Option<String>,
    },
    /// The last line of a run that ended cleanly.
    End {
        time: String,
        /// Records the writer could not keep (its queue full, or the trace at its size cap):
        /// what they held is not in the trace.
        #[serde(default, skip_serializing_if = "is_zero")]
        lost: u64,
    },
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Record {
    /// The record as one line of JSON, without the newline.
    pub fn to_line(&self) -> String {
        // A record holds only strings, numbers and addresses: serialising cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn time(&self) -> &str {
        match self {
            Record::Start { time, .. }
            | Record::Name { time, .. }
            | Record::Flow { time, .. }
            | Record::End { time, .. } => time,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TraceError {
    #[error("line {line}, column {column}: {message}")]
    Line {
        line: usize,
        column: usize,
        message: String,
    },
    #[error(
        "the trace is version {found}; this egress-fence reads version {VERSION}: record it \
         again with this version"
    )]
    Version { found: u32 },
    #[error("the trace is empty: record one with `egress-fence run --record FILE` or `learn`")]
    Empty,
}

/// A whole trace, read.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    pub records: Vec<Record>,
}

impl Trace {
    /// Whether the trace's last line is an `end` line: a run that did not stop cleanly (a
    /// SIGKILL, a crash, a failed write) leaves none, and what its writer held is missing.
    pub fn ended(&self) -> bool {
        matches!(self.records.last(), Some(Record::End { .. }))
    }

    /// Records the run's writer could not keep (the `end` lines' `lost`): what they held is
    /// not in the trace, and nothing judged from it knows of them.
    pub fn lost(&self) -> u64 {
        self.records
            .iter()
            .map(|r| match r {
                Record::End { lost, .. } => *lost,
                _ => 0,
            })
            .sum()
    }

    /// Reads a trace: one record per line, blank lines skipped. A trace cut short (a run
    /// killed while writing) loses only its last, unfinished line.
    pub fn parse(text: &str) -> Result<Trace, TraceError> {
        let mut records = Vec::new();
        let lines: Vec<&str> = text.lines().collect();
        let last = lines.len();
        for (i, line) in lines.iter().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<Record>(line) {
                Ok(r) => records.push(r),
                // The writer was stopped mid-line: what it wrote before still stands.
                Err(e) if i + 1 == last && !text.ends_with('\n') && e.is_eof() => {}
                Err(e) => {
                    return Err(TraceError::Line {
                        line: i + 1,
                        column: e.column(),
                        message: e.to_string(),
                    });
                }
            }
        }
        match records.iter().find_map(|r| match r {
            Record::Start { version, .. } => Some(*version),
            _ => None,
        }) {
            Some(v) if v != VERSION => Err(TraceError::Version { found: v }),
            _ if records.is_empty() => Err(TraceError::Empty),
            _ => Ok(Trace { records }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(t: &str, n: &str, addrs: &[&str]) -> Record {
        Record::Name {
            time: t.into(),
            name: n.into(),
            qtype: "A".into(),
            answer: "NOERROR".into(),
            addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
            ttl: Some(60),
            uid: Some(1001),
        }
    }

    fn flow(t: &str, dst: &str, dport: u16) -> Record {
        Record::Flow {
            time: t.into(),
            family: "ipv4".into(),
            protocol: "tcp".into(),
            dst: dst.parse().unwrap(),
            dport: Some(dport),
            uid: Some(1001),
            iif: None,
        }
    }

    fn start() -> Record {
        Record::Start {
            time: "2026-12-01T10:00:00.000Z".into(),
            version: VERSION,
            mode: "guard".into(),
            policy: "p.yaml".into(),
            audit: true,
        }
    }

    fn text(records: &[Record]) -> String {
        records.iter().map(|r| r.to_line() + "\n").collect()
    }

    #[test]
    fn records_round_trip_through_their_lines() {
        let records = vec![
            start(),
            name("2026-12-01T10:00:01.000Z", "a.example", &["192.0.2.1"]),
            flow("2026-12-01T10:00:02.000Z", "192.0.2.1", 443),
            Record::End {
                time: "2026-12-01T10:00:03.000Z".into(),
                lost: 0,
            },
            Record::End {
                time: "2026-12-01T10:00:04.000Z".into(),
                lost: 7,
            },
        ];
        let t = Trace::parse(&text(&records)).unwrap();
        assert_eq!(t.records, records);
        assert!(records[1].to_line().starts_with(r#"{"kind":"name","#));
        // Nothing lost is written as before; a loss is said.
        assert!(!records[3].to_line().contains("lost"));
        assert!(records[4].to_line().ends_with(r#","lost":7}"#));
        assert_eq!(t.lost(), 7);
    }

    #[test]
    fn a_bad_line_is_named_and_a_cut_last_line_is_dropped() {
        let good = text(&[start()]);
        let bad = format!("{good}{{\"kind\":\"flow\",\"time\":\"x\"}}\n");
        assert!(matches!(
            Trace::parse(&bad),
            Err(TraceError::Line { line: 2, .. })
        ));
        let cut = format!("{good}{{\"kind\":\"na");
        assert_eq!(Trace::parse(&cut).unwrap().records, vec![start()]);
        let unknown = format!("{good}{{\"kind\":\"other\",\"time\":\"x\"}}\n");
        assert!(Trace::parse(&unknown).is_err());
        assert_eq!(Trace::parse("\n").unwrap_err(), TraceError::Empty);
        let newer = text(&[start()]).replace("\"version\":1", "\"version\":2");
        assert_eq!(
            Trace::parse(&newer).unwrap_err(),
            TraceError::Version { found: 2 }
        );
    }
}
