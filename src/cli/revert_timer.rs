//! `revert-timer` (hidden): started by `apply --confirm-within`, it waits for the deadline in
//! a session of its own, then reverts unless the change was confirmed.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::time::SystemTime;

use egress_fence::change::{self, RevertOutcome, TimerWake, Writer};
use egress_fence::core::ruleset::TABLE;
use egress_fence::nft::Nft;
use egress_fence::state::{CRASH_BEFORE_RENAME_ENV, StateDir};
use tracing::{error, info, warn};

use super::args::{LogFormat, NamespaceArg, WriterArgs};
use super::common::{enter, init_logging, state_dir};
use super::exit::Failure;

pub fn run(token: &str, target: &NamespaceArg, writer: &WriterArgs) -> Result<u8, Failure> {
    // First of all: no signal of the terminal that ran `apply` may reach us.
    change::detach_from_session()?;
    let state = state_dir(target, &writer.state)?;
    enter(target, None)?;
    init_logging(LogFormat::Text);
    wait_and_revert(&state, token, writer).inspect_err(|f| {
        error!(error = f.describe(), "the revert timer failed");
    })
}

/// The revert timer's life: armed (said on stdout, which `apply` reads), then asleep until
/// the deadline or a confirmation, then the revert under the lock. Its stderr is the state
/// directory's revert-timer.log.
fn wait_and_revert(state: &StateDir, token: &str, writer: &WriterArgs) -> Result<u8, Failure> {
    let pending = change::arm_timer(state, token)?;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "{}", change::TIMER_ARMED)
        .and_then(|()| stdout.flush())
        .map_err(|e| anyhow::anyhow!("cannot report to apply: {e}"))?;
    info!(
        pid = std::process::id(),
        "armed: {}",
        pending.describe(SystemTime::now())
    );
    if change::wait_for_deadline(state, &pending) == TimerWake::StandDown {
        info!(
            generation = pending.generation,
            "confirmed or replaced; standing down"
        );
        return Ok(0);
    }
    let lock = state.lock("revert-timer", writer.lock.lock_timeout.0, |holder| {
        warn!(holder = %holder, "the deadline came; waiting for the lock");
    })?;
    let writer_ctx = Writer {
        state,
        lock: &lock,
        keep: writer.keep,
    };
    match change::revert(&mut Nft::open()?, &writer_ctx, token)? {
        RevertOutcome::StoodDown => {
            info!(
                generation = pending.generation,
                "confirmed at the deadline; standing down"
            );
        }
        RevertOutcome::Reinstated {
            source, recorded, ..
        } => info!(
            generation = pending.generation,
            "not confirmed: reverted to generation {source}, recorded as generation {recorded}"
        ),
        RevertOutcome::Deleted => warn!(
            generation = pending.generation,
            "not confirmed and there was no earlier generation: table inet {TABLE} deleted"
        ),
    }
    Ok(0)
}

/// The command that starts a revert timer: this very binary (/proc/self/exe stays the running
/// one even if an upgrade replaced the file), with the namespace and state directory of the
/// change it guards.
pub fn command(token: &str, target: &NamespaceArg, writer: &WriterArgs) -> std::process::Command {
    let mut cmd = std::process::Command::new("/proc/self/exe");
    cmd.arg0("egress-fence")
        .args(["revert-timer", "--token", token, "--state-dir"])
        .arg(&writer.state.state_dir)
        .args(["--keep", &writer.keep.to_string()])
        .args([
            "--lock-timeout",
            &format!("{}s", writer.lock.lock_timeout.0.as_secs()),
        ]);
    if let Some(ns) = &target.netns {
        cmd.args(["--netns", ns]);
    }
    // The fault injection is for the process a test gives it to, not for its timer.
    cmd.env_remove(CRASH_BEFORE_RENAME_ENV).current_dir("/");
    cmd
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use clap::Parser;

    use super::*;
    use crate::cli::args::{Cli, Command, LockArgs, StateArgs};

    /// The command line `apply` starts a revert timer with parses back into the same options,
    /// so the two can never drift apart.
    #[test]
    fn the_revert_timer_command_line_parses_back() {
        let target = NamespaceArg {
            netns: Some("sandbox".into()),
        };
        let writer = WriterArgs {
            state: StateArgs {
                state_dir: PathBuf::from("/tmp/state dir"),
            },
            lock: LockArgs {
                lock_timeout: "2m".parse().expect("a duration"),
            },
            keep: 4,
        };
        let cmd = command("123-456", &target, &writer);
        assert_eq!(cmd.get_program(), "/proc/self/exe");
        assert!(
            cmd.get_envs()
                .any(|(k, v)| k == CRASH_BEFORE_RENAME_ENV && v.is_none()),
            "the fault injection is not passed on"
        );
        let mut argv = vec![std::ffi::OsString::from("egress-fence")];
        argv.extend(cmd.get_args().map(|a| a.to_owned()));
        let Command::RevertTimer {
            token,
            target,
            writer,
        } = Cli::try_parse_from(argv).expect("parses").command
        else {
            panic!("not the revert-timer command");
        };
        assert_eq!(token, "123-456");
        assert_eq!(target.netns.as_deref(), Some("sandbox"));
        assert_eq!(writer.state.state_dir, Path::new("/tmp/state dir"));
        assert_eq!(writer.lock.lock_timeout.0, Duration::from_secs(120));
        assert_eq!(writer.keep, 4);
    }
}
