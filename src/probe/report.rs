//! What the probe reports: one [`Check`] per line with its [`Outcome`], gathered in a
//! [`Report`]; and why it could not run at all ([`ProbeError`]).

use std::fmt;
use std::io;

use serde::Serialize;

use crate::dns::resolve::ResolveError;

/// Why the probe could not run at all. A check that fails is never an error: it is a
/// [`Check`] with [`Outcome::Fail`].
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(
        "no resolvers to probe with: set `dns.resolvers` in the policy or list a nameserver \
         in resolv.conf"
    )]
    NoResolvers,
    #[error("the probe timeout must be longer than zero")]
    ZeroTimeout,
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error("cannot start a probe thread: {0}")]
    Thread(io::Error),
}

/// The verdict of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// The boundary does what the policy says.
    Pass,
    /// It does not: `passed()` is false and the CLI exits non-zero.
    Fail,
    /// Worth a look, but not a broken promise (an open DNS exfiltration channel, a check
    /// that could not be carried out).
    Warn,
    /// Not checked, and why.
    Skip,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::Warn => "WARN",
            Outcome::Skip => "SKIP",
        })
    }
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    pub outcome: Outcome,
    /// What was tried, e.g. "allowed tcp api.example.com 192.0.2.10:443".
    pub check: String,
    /// Why the outcome, for a human: "connected", "refused: no route to host (ICMP admin
    /// prohibited)".
    pub reason: String,
}

impl Check {
    pub(super) fn new(
        outcome: Outcome,
        check: impl Into<String>,
        reason: impl Into<String>,
    ) -> Check {
        Check {
            outcome,
            check: check.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}  {}: {}", self.outcome, self.check, self.reason)
    }
}

/// Every check, in a stable order: resolvers, allowed entries, denied presets, blocked
/// targets, rogue resolvers, DNS exfiltration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// True when no check failed (warnings and skips do not fail a probe).
    pub fn passed(&self) -> bool {
        self.count(Outcome::Fail) == 0
    }

    /// How many checks ended with `outcome`.
    pub fn count(&self, outcome: Outcome) -> usize {
        self.checks.iter().filter(|c| c.outcome == outcome).count()
    }

    /// "probe: 12 passed, 1 failed, 1 warning" (", 2 skipped" when some were).
    pub fn summary(&self) -> String {
        let warnings = self.count(Outcome::Warn);
        let mut s = format!(
            "probe: {} passed, {} failed, {warnings} warning{}",
            self.count(Outcome::Pass),
            self.count(Outcome::Fail),
            if warnings == 1 { "" } else { "s" }
        );
        let skipped = self.count(Outcome::Skip);
        if skipped > 0 {
            s.push_str(&format!(", {skipped} skipped"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_lines_and_summary() {
        let report = Report {
            checks: vec![
                Check::new(
                    Outcome::Pass,
                    "allowed tcp a.example 192.0.2.10:443",
                    "connected",
                ),
                Check::new(Outcome::Fail, "blocked tcp 203.0.113.11:443", "connected"),
                Check::new(Outcome::Warn, "dns exfiltration x.example", "resolved"),
                Check::new(
                    Outcome::Skip,
                    "allowed network 203.0.113.0/24",
                    "not probed",
                ),
            ],
        };
        assert_eq!(
            report.checks[0].to_string(),
            "PASS  allowed tcp a.example 192.0.2.10:443: connected"
        );
        assert!(!report.passed());
        assert_eq!(
            report.summary(),
            "probe: 1 passed, 1 failed, 1 warning, 1 skipped"
        );
        let json = serde_json::to_value(&report).expect("serialises");
        assert_eq!(json["checks"][1]["outcome"], "fail");
        let passing = Report {
            checks: report.checks[2..].to_vec(),
        };
        assert!(passing.passed(), "warnings and skips do not fail");
    }
}
