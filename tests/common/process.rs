//! Processes the harness starts: commands run to completion ([`CmdOutput`]) or in the
//! background ([`Background`]), with a timeout, a clean environment and polling helpers.

use std::fmt;
use std::fs::{self, File};
use std::io::{ErrorKind, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::world::World;

/// Upper bound for any command the helpers run, so a hung client fails the test instead of
/// hanging it.
pub(super) const COMMAND_TIMEOUT_SECS: &str = "60";

/// What a finished command did.
#[derive(Clone, Debug)]
pub struct CmdOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl CmdOutput {
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// The exit code; 128 + N when killed by signal N. 124 means the 60 s timeout hit.
    pub fn code(&self) -> i32 {
        self.status
            .code()
            .unwrap_or_else(|| 128 + self.status.signal().unwrap_or(0))
    }
}

impl fmt::Display for CmdOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "exit code {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.code(),
            self.stdout.trim_end(),
            self.stderr.trim_end()
        )
    }
}

/// A process running in the background; killed (SIGKILL) and reaped when dropped. Its output
/// goes to files in the world's directory, so drop it before the world (declare it after).
pub struct Background {
    child: Child,
    what: String,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
}

impl Background {
    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// Sends `sig` (e.g. SIGHUP to reload a daemon).
    pub fn signal(&self, sig: Signal) {
        kill(self.pid(), sig).unwrap_or_else(|e| panic!("send {sig} to {}: {e}", self.what));
    }

    pub fn stdout(&self) -> String {
        read_lossy(&self.stdout_path)
    }

    pub fn stderr(&self) -> String {
        read_lossy(&self.stderr_path)
    }

    /// Waits until stdout or stderr contains `needle`; false after `timeout` or once the
    /// process exited without printing it.
    pub fn wait_for_output(&mut self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let exited = matches!(self.child.try_wait(), Ok(Some(_)));
            if self.stdout().contains(needle) || self.stderr().contains(needle) {
                return true;
            }
            if exited || Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// The exit status if it exits within `timeout`.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(5)),
                _ => return None,
            }
        }
    }

    /// SIGTERM, then waits up to 5 s (SIGKILL after that); returns the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        let _ = kill(self.pid(), Signal::SIGTERM);
        if let Some(status) = self.wait_timeout(Duration::from_secs(5)) {
            return status;
        }
        let _ = self.child.kill();
        self.child
            .wait()
            .unwrap_or_else(|e| panic!("wait for {}: {e}", self.what))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Polls `f` every 100 ms until it holds (true) or `timeout` passes (false): for checks that
/// run commands.
pub fn within(timeout: Duration, f: impl FnMut() -> bool) -> bool {
    poll(timeout, Duration::from_millis(100), f)
}

/// Polls `f` every 2 ms until it is true (true) or `timeout` passes (false).
pub(super) fn wait_until(timeout: Duration, f: impl FnMut() -> bool) -> bool {
    poll(timeout, Duration::from_millis(2), f)
}

fn poll(timeout: Duration, every: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(every);
    }
}

pub(super) fn clean_env(cmd: &mut Command) -> &mut Command {
    for var in [
        "http_proxy",
        "https_proxy",
        "ftp_proxy",
        "all_proxy",
        "no_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "FTP_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("LC_ALL", "C")
}

pub(super) fn ns_command(ns: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns]).args(args);
    clean_env(&mut cmd);
    cmd
}

pub(super) fn with_timeout<'a>(args: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["timeout", "-k", "5", COMMAND_TIMEOUT_SECS];
    v.extend_from_slice(args);
    v
}

/// Runs `cmd` to completion, with `input` on its stdin (else /dev/null).
pub(super) fn run(cmd: &mut Command, input: Option<&[u8]>) -> CmdOutput {
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    if let Some(input) = input {
        let mut stdin = child.stdin.take().expect("piped stdin");
        // Inputs are small (well below a pipe buffer), so this cannot deadlock.
        // A command may exit without reading its input: its output tells why.
        if let Err(e) = stdin.write_all(input)
            && e.kind() != ErrorKind::BrokenPipe
        {
            panic!("write stdin of {cmd:?}: {e}");
        }
    }
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("wait for {cmd:?}: {e}"));
    CmdOutput {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

pub(super) fn read_lossy(path: &Path) -> String {
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// SIGTERM, up to 2 s grace, then SIGKILL; always reaps.
pub(super) fn stop_child(mut child: Child, what: &str) {
    let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return,
            Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(2)),
            _ => break,
        }
    }
    let _ = child.kill();
    if let Err(e) = child.wait() {
        eprintln!("warning: could not reap {what}: {e}");
    }
}

impl World {
    pub(super) fn spawn_background(&self, mut cmd: Command, what: String) -> Background {
        let n = self.file_counter.fetch_add(1, Ordering::Relaxed);
        let stdout_path = self.dir().join(format!("bg-{n}.stdout"));
        let stderr_path = self.dir().join(format!("bg-{n}.stderr"));
        let stdout = File::create(&stdout_path).expect("create background stdout file");
        let stderr = File::create(&stderr_path).expect("create background stderr file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        Background {
            child,
            what,
            stdout_path,
            stderr_path,
        }
    }
}
