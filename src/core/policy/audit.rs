//! `action: audit`: what only `learn` runs. A table that lets everything through for as long
//! as it stands is a fail-open, so `apply` and `run` refuse such a policy, and `learn` bounds
//! it with a window the daemon keeps open (see [`crate::core::plan::Audit`]).

use std::path::Path;

use super::errors::{PolicyError, locate_value};
use super::schema::{Action, Policy};

/// What `check` says of `action: audit`.
pub const AUDIT_WARNING: &str = "`action: audit` lets everything out while it runs: only \
     `egress-fence learn` runs it (for a --duration), and `apply` and `run` refuse it";

impl Policy {
    /// `action: audit` outside `learn` (`command` names the command refusing it).
    pub fn refuse_audit(
        &self,
        source: &str,
        path: &Path,
        command: &str,
    ) -> Result<(), PolicyError> {
        if self.action != Action::Audit {
            return Ok(());
        }
        let (line, column) = locate_value(source, "action", |t| t == "audit");
        Err(PolicyError::Invalid {
            path: path.to_owned(),
            line,
            column,
            message: format!(
                "`action: audit` lets everything out: `{command}` never runs it (a table \
                 that stays open is a fail-open). Run `egress-fence learn {} --duration 10m` \
                 to audit for a bounded time, or set `action: reject`",
                path.display()
            ),
        })
    }

    /// What `learn` needs of a policy: guard mode, where every name a client asks passes
    /// through the guard and can be recorded.
    pub fn refuse_learn(&self, source: &str, path: &Path) -> Result<(), PolicyError> {
        if self.dns.guard.is_some() {
            return Ok(());
        }
        let (line, column) = locate_value(source, "mode", |t| t == "resolve");
        Err(PolicyError::Invalid {
            path: path.to_owned(),
            line,
            column,
            message: "`learn` needs `dns.mode: guard`: only the guard sees every name a \
                      client asks (in resolve mode names are looked up on a timer, and what a \
                      client asks elsewhere is never seen). Add `dns: {mode: guard}`"
                .into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Policy {
        Policy::parse(text, Path::new("p.yaml")).expect("valid")
    }

    #[test]
    fn audit_is_refused_outside_learn_with_where_it_is_written() {
        let text = "version: 1\naction: audit\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n";
        let p = parse(text);
        assert_eq!(p.action, Action::Audit);
        assert!(p.warnings().iter().any(|w| w == AUDIT_WARNING));
        let e = p
            .refuse_audit(text, Path::new("p.yaml"), "apply")
            .unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("p.yaml:2:9: "), "{msg}");
        assert!(
            msg.contains("egress-fence learn p.yaml --duration"),
            "{msg}"
        );
        assert!(p.refuse_learn(text, Path::new("p.yaml")).is_ok());

        let reject = "version: 1\n";
        let p = parse(reject);
        assert!(p.refuse_audit(reject, Path::new("p.yaml"), "run").is_ok());
        assert!(!p.warnings().iter().any(|w| w == AUDIT_WARNING));
        let msg = p
            .refuse_learn(reject, Path::new("p.yaml"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("needs `dns.mode: guard`"), "{msg}");
    }
}
