//! `revert-timer` (hidden): started by `apply --confirm-within`, it waits for the deadline out
//! of the caller's session, then reverts unless the change was confirmed.
//!
//! Where systemd runs, `apply` starts it as a transient unit (`systemd-run --unit
//! egress-fence-revert-TOKEN --collect`): a cgroup of its own, so neither the end of an SSH
//! session under logind's `KillUserProcesses=yes` nor the end of a oneshot unit that ran
//! `apply` takes it down. Elsewhere (or when `systemd-run` fails) it is a process in two
//! stages: the first leaves the caller's session (`setsid`) and starts the second, which is no
//! session leader and so can never gain a controlling terminal, then exits; the second is
//! adopted by init. It stays in the caller's cgroup: without systemd there is no cgroup of
//! egress-fence's own to move it to, and it creates none.

use std::ffi::OsString;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use egress_fence::change::{self, RevertOutcome, TimerLaunch, TimerWake, Writer};
use egress_fence::nft::Nft;
use egress_fence::state::{CRASH_BEFORE_RENAME_ENV, StateDir, TimerRecord, current_netns_inode};
use tracing::{error, info, warn};

use super::args::{LogFormat, NamespaceArg, WriterArgs};
use super::common::{enter, init_logging, state_dir};
use super::exit::Failure;

pub fn run(
    token: &str,
    stay: bool,
    target: &NamespaceArg,
    writer: &WriterArgs,
) -> Result<u8, Failure> {
    if !stay {
        // First of all: no signal of the terminal that ran `apply` may reach us.
        change::detach_from_session()?;
        second_stage().map_err(|e| anyhow::anyhow!("cannot start the revert timer: {e}"))?;
        return Ok(0);
    }
    let state = state_dir(target, &writer.state)?;
    enter(target, None)?;
    init_logging(LogFormat::Text);
    let outcome = wait_and_revert(&state, token, writer).inspect_err(|f| {
        error!(error = f.describe(), "the revert timer failed");
    });
    // Whatever happened, this timer no longer guards anything.
    let _ = state.remove_timer_record(token);
    outcome
}

/// This command again, with `--stay`: a child in the session the first stage leads, which
/// keeps its standard output (`apply` waits for the armed line on it) and its log.
fn second_stage() -> std::io::Result<()> {
    let mut args: Vec<OsString> = std::env::args_os().skip(1).collect();
    args.push("--stay".into());
    Command::new("/proc/self/exe")
        .arg0("egress-fence")
        .args(args)
        .stdin(Stdio::null())
        .current_dir("/")
        .spawn()
        .map(drop)
}

/// The revert timer's life: armed (its record written, then said on stdout, which `apply`
/// may read), then asleep until the deadline or a confirmation, then the revert under the
/// lock. Its stderr is the state directory's revert-timer.log.
fn wait_and_revert(state: &StateDir, token: &str, writer: &WriterArgs) -> Result<u8, Failure> {
    let pending = change::arm_timer(state, token)?;
    let record = TimerRecord::of_this_process(token)
        .ok_or_else(|| anyhow::anyhow!("cannot read this process's start time in /proc"))?;
    state.write_timer_record(&record)?;
    let mut stdout = std::io::stdout();
    // Nothing may read it (a systemd unit): the record is what counts.
    let _ = writeln!(stdout, "{}", change::TIMER_ARMED).and_then(|()| stdout.flush());
    info!(
        pid = std::process::id(),
        "armed: {}",
        state.describe_pending(&pending)
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
    let change::TimerRevert { outcome, altered } =
        change::revert(&mut Nft::open()?, &writer_ctx, &pending)?;
    let generation = pending.generation;
    if let Some(fields) = altered {
        warn!(
            generation,
            "the pending record was changed after it was armed ({fields}), not by egress-fence: \
             reverting to what it was armed with, {}",
            pending.revert_target()
        );
    }
    match &outcome {
        RevertOutcome::StoodDown => {
            info!(
                generation,
                "confirmed, or reverted by another egress-fence command, at the deadline; \
                 standing down"
            );
        }
        RevertOutcome::Reinstated {
            source, recorded, ..
        } => info!(
            generation,
            "not confirmed: reverted to generation {source}, recorded as generation {recorded}"
        ),
        RevertOutcome::Restored { .. } | RevertOutcome::Deleted => {
            warn!(generation, "not confirmed: {}", outcome.describe())
        }
    }
    Ok(0)
}

/// How to start a revert timer: as a systemd unit where systemd runs and can run it in the
/// change's namespace, else (and when `systemd-run` fails) as a process.
pub fn launch(token: &str, log: &Path, target: &NamespaceArg, writer: &WriterArgs) -> TimerLaunch {
    let unit = match (systemd_runs(target), std::env::current_exe()) {
        (true, Ok(exe)) => {
            let name = unit_name(token);
            let command = systemd_run_command(&exe, &name, log, token, target, writer);
            Some((name, command))
        }
        _ => None,
    };
    TimerLaunch {
        unit,
        process: command(token, target, writer),
    }
}

/// `egress-fence-revert-TOKEN`.
pub fn unit_name(token: &str) -> String {
    format!("egress-fence-revert-{token}")
}

/// Whether a transient unit would work: PID 1 is systemd (booted with it, not a container's
/// leftover `/run/systemd`), `systemd-run` is on the PATH, and the unit, which starts in PID
/// 1's namespace, reaches the change's: by `--netns`, or by being in it already.
fn systemd_runs(target: &NamespaceArg) -> bool {
    let pid1_is_systemd = std::fs::read_to_string("/proc/1/comm")
        .is_ok_and(|comm| comm.trim() == "systemd")
        && Path::new("/run/systemd/system").is_dir();
    if !pid1_is_systemd || find_on_path("systemd-run").is_none() {
        return false;
    }
    target.netns.is_some()
        || std::fs::metadata("/proc/1/ns/net")
            .is_ok_and(|m| current_netns_inode().is_ok_and(|here| here == m.ino()))
}

fn find_on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0)
        })
}

/// `systemd-run` starting the timer's second stage as a transient service: `exec` type (it
/// returns once the binary runs), collected when it ends whatever its exit, its stderr
/// appended to the timer log. systemd runs it without the caller's environment.
pub fn systemd_run_command(
    exe: &Path,
    unit: &str,
    log: &Path,
    token: &str,
    target: &NamespaceArg,
    writer: &WriterArgs,
) -> Command {
    let mut cmd = Command::new("systemd-run");
    cmd.arg(format!("--unit={unit}"))
        .args([
            "--collect",
            "--quiet",
            "--service-type=exec",
            "--description=egress-fence revert timer",
            "--property=StandardOutput=null",
        ])
        .arg(format!("--property=StandardError=append:{}", log.display()))
        .arg("--")
        .arg(exe)
        .args(timer_args(token, target, writer))
        .arg("--stay");
    cmd.env_remove(CRASH_BEFORE_RENAME_ENV).current_dir("/");
    cmd
}

/// The command that starts a revert timer as a process: this very binary (/proc/self/exe
/// stays the running one even if an upgrade replaced the file), with the namespace and state
/// directory of the change it guards.
pub fn command(token: &str, target: &NamespaceArg, writer: &WriterArgs) -> Command {
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg0("egress-fence")
        .args(timer_args(token, target, writer));
    // The fault injection is for the process a test gives it to, not for its timer.
    cmd.env_remove(CRASH_BEFORE_RENAME_ENV).current_dir("/");
    cmd
}

fn timer_args(token: &str, target: &NamespaceArg, writer: &WriterArgs) -> Vec<OsString> {
    let mut args: Vec<OsString> = ["revert-timer", "--token", token, "--state-dir"]
        .into_iter()
        .map(OsString::from)
        .collect();
    args.push(writer.state.state_dir.clone().into_os_string());
    args.extend(
        [
            "--keep".to_string(),
            writer.keep.to_string(),
            "--lock-timeout".to_string(),
            format!("{}s", writer.lock.lock_timeout.0.as_secs()),
        ]
        .map(OsString::from),
    );
    if let Some(ns) = &target.netns {
        args.extend(["--netns", ns].map(OsString::from));
    }
    args
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use clap::Parser;

    use super::*;
    use crate::cli::args::{Cli, Command as CliCommand, LockArgs, StateArgs};

    fn target_and_writer() -> (NamespaceArg, WriterArgs) {
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
        (target, writer)
    }

    /// Parses `args` (after the program) as egress-fence's command line, and checks that it
    /// is the revert timer for the options [`target_and_writer`] gives; returns `--stay`.
    fn parses_back(args: &[OsString]) -> bool {
        let mut argv = vec![OsString::from("egress-fence")];
        argv.extend(args.iter().cloned());
        let CliCommand::RevertTimer {
            token,
            stay,
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
        stay
    }

    /// The command line `apply` starts a revert timer with parses back into the same options,
    /// so the two can never drift apart; its first stage leaves the session (no `--stay`).
    #[test]
    fn the_revert_timer_command_line_parses_back() {
        let (target, writer) = target_and_writer();
        let cmd = command("123-456", &target, &writer);
        assert_eq!(cmd.get_program(), "/proc/self/exe");
        assert!(
            cmd.get_envs()
                .any(|(k, v)| k == CRASH_BEFORE_RENAME_ENV && v.is_none()),
            "the fault injection is not passed on"
        );
        let args: Vec<OsString> = cmd.get_args().map(|a| a.to_owned()).collect();
        assert!(!parses_back(&args), "the first stage leaves the session");
        let mut second = args;
        second.push("--stay".into());
        assert!(parses_back(&second));
    }

    /// The transient unit: named after the token, collected whatever its exit, `exec` type so
    /// `systemd-run` returns once the timer runs, its stderr appended to the timer log, and
    /// the timer's own command line (the binary's real path: /proc/self/exe would be systemd's
    /// in the unit) with `--stay`: systemd already gave it a session and cgroup of its own.
    #[test]
    fn the_systemd_unit_runs_the_second_stage_in_a_unit_of_its_own() {
        let (target, writer) = target_and_writer();
        let unit = unit_name("123-456");
        assert_eq!(unit, "egress-fence-revert-123-456");
        let cmd = systemd_run_command(
            Path::new("/usr/bin/egress-fence"),
            &unit,
            Path::new("/var/lib/egress-fence/netns-sandbox/revert-timer.log"),
            "123-456",
            &target,
            &writer,
        );
        assert_eq!(cmd.get_program(), "systemd-run");
        let args: Vec<OsString> = cmd.get_args().map(|a| a.to_owned()).collect();
        let split = args.iter().position(|a| a == "--").expect("a `--`");
        let options: Vec<&str> = args[..split].iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(
            options,
            [
                "--unit=egress-fence-revert-123-456",
                "--collect",
                "--quiet",
                "--service-type=exec",
                "--description=egress-fence revert timer",
                "--property=StandardOutput=null",
                "--property=StandardError=append:/var/lib/egress-fence/netns-sandbox/revert-timer.log",
            ]
        );
        assert_eq!(args[split + 1], "/usr/bin/egress-fence");
        assert!(parses_back(&args[split + 2..]), "the unit runs with --stay");
    }

    #[test]
    fn without_systemd_as_pid_1_the_timer_is_a_process() {
        let pid1 = std::fs::read_to_string("/proc/1/comm").unwrap_or_default();
        let (target, writer) = target_and_writer();
        let launch = launch("1-2", Path::new("/tmp/log"), &target, &writer);
        if pid1.trim() != "systemd" {
            assert!(launch.unit.is_none());
        }
        assert_eq!(launch.process.get_program(), "/proc/self/exe");
    }
}
