//! `exec`: one command fenced in a network namespace of its own (see [`egress_fence::exec`]),
//! and `exec-child`, its inside.

use std::ffi::OsString;
use std::path::PathBuf;

use egress_fence::exec::{self, ExecError, child};

use super::args::{NamespaceArg, Resolving, StateArgs};
use super::common::enter;
use super::exit::Failure;

/// exec itself failed (CMD did not run, or its end could not be learnt), as `env` and
/// container runtimes say it.
pub const EXIT_EXEC_FAILED: u8 = 125;
/// `--canary`: the token was asked as a DNS name, or the canary URL's host was asked
/// (whatever CMD's own exit code; stderr and the report say which, see [`exit_note`]).
pub const EXIT_CANARY_TRIPPED: u8 = 99;

/// The options of `exec` (besides the namespace ones).
pub struct ExecArgs {
    pub policy: PathBuf,
    pub user: Option<String>,
    pub keep_env: Vec<String>,
    pub report: Option<PathBuf>,
    pub canary: bool,
    pub canary_file: Option<PathBuf>,
    pub canary_host: Option<egress_fence::core::policy::DomainName>,
    pub command: Vec<OsString>,
}

pub fn run(
    args: ExecArgs,
    target: &NamespaceArg,
    resolving: &Resolving,
    state: &StateArgs,
) -> Result<u8, Failure> {
    let ExecArgs {
        policy,
        user,
        keep_env,
        report,
        canary,
        canary_file,
        canary_host,
        command,
    } = args;
    let user = Some(cmd_user(user, std::env::var("SUDO_USER").ok()).map_err(failed)?);
    let resolv_conf = enter(target, Some(resolving))?;
    init_warnings();
    let self_exe = std::env::current_exe().map_err(|e| {
        failed(ExecError::Refused(format!(
            "cannot find this program to start the inside: {e}"
        )))
    })?;
    let options = exec::Options {
        policy_path: policy,
        resolv_conf,
        user,
        keep_env,
        command,
        state_root: state.state_dir.join("exec"),
        self_exe,
        canary: match canary {
            true => Some(exec::Canary {
                token: exec::canary::mint().map_err(failed)?,
                host: match canary_host {
                    Some(name) => name.as_str().to_string(),
                    None => exec::canary::mint_host().map_err(failed)?,
                },
                file: canary_file,
            }),
            false => None,
        },
    };
    // Opened before CMD starts, in its directory held open: the path may be in a directory
    // CMD's user can write, where a link CMD put would have exec (root) write over any file,
    // and where CMD may replace the file while it runs (see `ReportFile`).
    let report = match report {
        Some(path) => Some(exec::ReportFile::open(&path).map_err(failed)?),
        None => None,
    };
    let outcome = exec::run(options).map_err(failed)?;
    match &outcome.refusals {
        Some(refusals) => say(&refusals.summary()),
        None => say("refusals are not reported: the policy has no `log.group`"),
    }
    let tripped = outcome
        .refusals
        .as_ref()
        .is_some_and(|r| r.canary_tripped());
    let exit_code = if tripped {
        EXIT_CANARY_TRIPPED
    } else {
        outcome.code
    };
    if let Some(note) = exit_note(canary, tripped, outcome.code) {
        say(&note);
    }
    if let Some(report) = report {
        let json = serde_json::json!({
            "exit_code": outcome.code,
            "exec_exit_code": exit_code,
            "canary_tripped": tripped,
            "refused": outcome.refusals,
        });
        let text = serde_json::to_string_pretty(&json)?;
        if let Err(e) = report.write(&(text + "\n")) {
            say(&format!("cannot write the report: {e}"));
            // The canary's verdict comes first: CMD may have made the write fail (it can
            // fill the report's filesystem), and 99 is the one code the caller looks for.
            return Ok(if tripped {
                EXIT_CANARY_TRIPPED
            } else {
                EXIT_EXEC_FAILED.max(outcome.code)
            });
        }
    }
    Ok(exit_code)
}

/// Prints a line on stderr, ignoring a failure. CMD shares exec's stderr: it may have shut it
/// (`shutdown` of a socket, a systemd unit's stream to journald) or made it non-blocking, and
/// `eprintln!` panics when the write fails, which would end exec before its report and exit
/// code, the record of what the fence saw (a tripped canary among it).
fn say(text: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "egress-fence exec: {text}");
}

/// What a canary run's exit code means, when it could be misread: 99 is both the canary's
/// code and one CMD may exit with itself.
fn exit_note(canary: bool, tripped: bool, cmd_code: u8) -> Option<String> {
    match (canary, tripped) {
        (_, true) => Some(format!(
            "exit {EXIT_CANARY_TRIPPED}: the canary tripped (CMD's own exit code was {cmd_code})"
        )),
        (true, false) if cmd_code == EXIT_CANARY_TRIPPED => Some(format!(
            "exit {EXIT_CANARY_TRIPPED} is CMD's own: the canary did not trip"
        )),
        _ => None,
    }
}

/// Who CMD runs as: `--user`, else the user `sudo` was run by. Never root by default: root
/// without capabilities still owns every root-owned file of the host (the inside shares its
/// filesystem), and what it plants there (a cron job, a unit, the policy) runs later outside
/// the fence; `--user root` says that is meant.
fn cmd_user(user: Option<String>, sudo_user: Option<String>) -> Result<String, ExecError> {
    match (user, sudo_user) {
        (Some(user), _) => Ok(user),
        // By uid, not name: another name of uid 0 (`toor`) is root too.
        (None, Some(sudo)) if !sudo.is_empty() && !is_uid_0(&sudo) => Ok(sudo),
        (None, _) => Err(ExecError::NoUser),
    }
}

fn is_uid_0(name: &str) -> bool {
    name == "root"
        || nix::unistd::User::from_name(name).is_ok_and(|u| u.is_some_and(|u| u.uid.is_root()))
}

pub fn run_child(
    resolv_conf: PathBuf,
    go_fd: i32,
    parent: u32,
    user: Option<String>,
    command: Vec<OsString>,
) -> Result<u8, Failure> {
    child::run_inside(child::Inside {
        resolv_conf,
        user,
        go_fd,
        parent,
        command,
    })
    .map_err(failed)
}

fn failed(error: ExecError) -> Failure {
    let code = match error {
        ExecError::Policy(_) | ExecError::NotGuard | ExecError::Scoped | ExecError::NoUser => {
            super::exit::EXIT_BAD_POLICY
        }
        _ => EXIT_EXEC_FAILED,
    };
    Failure {
        code,
        error: error.into(),
    }
}

/// The daemon's warnings and errors on stderr (RUST_LOG overrides); its info lines would
/// mix with CMD's output.
fn init_warnings() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmd_runs_as_the_named_user_or_sudos_never_root_by_default() {
        let some = |s: &str| Some(s.to_string());
        assert_eq!(cmd_user(some("agent"), some("alice")).unwrap(), "agent");
        assert_eq!(cmd_user(some("root"), None).unwrap(), "root");
        assert_eq!(cmd_user(None, some("alice")).unwrap(), "alice");
        for sudo in [None, some(""), some("root")] {
            assert!(matches!(cmd_user(None, sudo), Err(ExecError::NoUser)));
        }
    }
}
