//! Running the egress-fence binary against the sandbox (to completion or in the background),
//! and the systemd notify socket it reports readiness to.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::process::{Background, COMMAND_TIMEOUT_SECS, CmdOutput, clean_env, run};
use super::world::World;

/// The egress-fence binary built by cargo for these tests.
pub const EGRESS_FENCE_BIN: &str = env!("CARGO_BIN_EXE_egress-fence");

/// The variable egress-fence takes its state directory from when `--state-dir` is not given.
/// The harness sets it for every process it starts, to [`World::state_dir`], so no test ever
/// writes generations or locks to the machine's /var/lib.
pub const STATE_DIR_ENV: &str = "EGRESS_FENCE_STATE_DIR";

/// A systemd-style notify socket (`NOTIFY_SOCKET`) in the world's directory, drained
/// continuously by a thread as systemd does, for waiting on `READY=1`.
pub struct NotifySocket {
    path: String,
    received: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
}

impl NotifySocket {
    /// Binds `name` (e.g. "notify.sock") inside [`World::dir`].
    pub fn new(w: &World, name: &str) -> NotifySocket {
        let path = w.dir().join(name);
        let socket = std::os::unix::net::UnixDatagram::bind(&path)
            .unwrap_or_else(|e| panic!("bind the notify socket {}: {e}", path.display()));
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .expect("set a read timeout");
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (sink, done) = (received.clone(), stop.clone());
        thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while !done.load(Ordering::Relaxed) {
                if let Ok(n) = socket.recv(&mut buf) {
                    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                    sink.lock().unwrap_or_else(|e| e.into_inner()).push(msg);
                }
            }
        });
        NotifySocket {
            path: path.to_str().expect("utf-8 path").to_string(),
            received,
            stop,
        }
    }

    /// The value for `NOTIFY_SOCKET`.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Waits for a datagram containing `needle`, taking the datagrams up to it; returns it.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut got = self.received.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(i) = got.iter().position(|m| m.contains(needle)) {
                    return got.drain(..=i).next_back();
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for NotifySocket {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl World {
    /// Runs the egress-fence binary (from the root namespace) with `args` followed by
    /// `--netns <sandbox>`, and waits for it (killed after 60 s).
    pub fn egress_fence(&self, args: &[&str]) -> CmdOutput {
        self.egress_fence_with_env(args, &[])
    }

    /// Like [`World::egress_fence`], with extra environment variables (fault injection).
    pub fn egress_fence_with_env(&self, args: &[&str], env: &[(&str, &str)]) -> CmdOutput {
        let mut cmd = Command::new("timeout");
        cmd.args(["-k", "5", COMMAND_TIMEOUT_SECS, EGRESS_FENCE_BIN])
            .args(args)
            .args(["--netns", &self.sandbox]);
        clean_env(&mut cmd)
            .env(STATE_DIR_ENV, self.state_dir())
            .envs(env.iter().copied());
        run(&mut cmd, None)
    }

    /// Writes `policy` as policy.yaml and applies it to the sandbox; panics with the output
    /// if `apply` fails.
    pub fn apply_policy(&self, policy: &str) {
        let path = self.write_file("policy.yaml", policy);
        egress_fence_ok(self, &["apply", path_arg(&path)]);
    }

    /// Starts the egress-fence binary with `args` + `--netns <sandbox>` in the background
    /// (daemon, watch); it is killed when the handle drops.
    pub fn spawn_egress_fence(&self, args: &[&str]) -> Background {
        self.spawn_egress_fence_with_env(args, &[])
    }

    /// Like [`World::spawn_egress_fence`], with extra environment variables (NOTIFY_SOCKET).
    pub fn spawn_egress_fence_with_env(&self, args: &[&str], env: &[(&str, &str)]) -> Background {
        let mut cmd = Command::new(EGRESS_FENCE_BIN);
        cmd.args(args).args(["--netns", &self.sandbox]);
        clean_env(&mut cmd)
            .env(STATE_DIR_ENV, self.state_dir())
            .envs(env.iter().copied());
        self.spawn_background(cmd, format!("egress-fence {}", args.join(" ")))
    }
}

/// `path` as a command-line argument.
pub fn path_arg(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// Runs egress-fence in the sandbox and asserts that it succeeded.
pub fn egress_fence_ok(w: &World, args: &[&str]) -> CmdOutput {
    let out = w.egress_fence(args);
    assert!(out.success(), "egress-fence {args:?}: {out}");
    out
}

/// The JSON a command printed.
pub fn stdout_json(out: &CmdOutput) -> serde_json::Value {
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// What the revert timers of this world's sandbox logged.
pub fn revert_timer_log(w: &World) -> String {
    std::fs::read_to_string(w.sandbox_state_dir().join("revert-timer.log")).unwrap_or_default()
}

/// The revert timers guarding this world's sandbox (their command lines name it).
pub fn revert_timers(w: &World) -> Vec<u32> {
    revert_timers_naming(w.sandbox_name())
}

/// The pid of the one revert timer guarding the sandbox, once its first stage has gone.
pub fn the_revert_timer(w: &World) -> u32 {
    let mut timers = Vec::new();
    assert!(
        super::process::within(Duration::from_secs(3), || {
            timers = revert_timers(w);
            timers.len() == 1
        }),
        "one revert timer: {timers:?}"
    );
    timers[0]
}

/// Whether the live table is what `policy` plans (`diff` exits 0; 1 is "it differs").
pub fn live_is(w: &World, policy: &Path) -> bool {
    let out = w.egress_fence(&["diff", path_arg(policy)]);
    assert!(matches!(out.code(), 0 | 1), "diff failed: {out}");
    out.code() == 0
}

/// The revert timers started with the state directory `dir` (their command lines name it).
pub fn revert_timers_of(dir: &Path) -> Vec<u32> {
    revert_timers_naming(&dir.to_string_lossy())
}

/// The revert-timer processes with `arg` among their arguments.
fn revert_timers_naming(arg: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("list /proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.iter().any(|a| a == "revert-timer") && args.iter().any(|a| a == arg) {
            pids.push(pid);
        }
    }
    pids
}
