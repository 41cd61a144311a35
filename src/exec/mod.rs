//! `egress-fence exec`: one command in a network namespace of its own, fenced by the policy in
//! guard mode, connected to the host's network by pasta without changing anything of the
//! host's, and gone without a trace when it ends.
//!
//! The order is the guarantee. This process makes the namespace and runs the daemon (table and
//! DNS guard) for it on a thread of its own; reads the table back until it is the planned one;
//! starts the inside ([`child`], the first process of a new pid namespace, waiting); connects
//! the namespace with pasta ([`connect`]); proves the table again, and only then tells the
//! inside to start CMD. Any failure before that kills the inside, and CMD never runs.
//!
//! Nothing outlives the run: the namespace is named only while pasta attaches
//! ([`namespace`]), the pid namespace ends with the inside, which the kernel kills when this
//! process dies (its parent-death signal), SIGKILL included; the table lives and dies with
//! the namespace. SIGINT and SIGTERM are passed to CMD; its exit code is returned.

pub mod canary;
pub mod child;
mod connect;
mod namespace;
mod pcap;
mod report;
mod written;

use std::ffi::OsString;
use std::fs::{self, DirBuilder, File};
use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::fcntl::{FcntlArg, FdFlag, OFlag, fcntl};
use nix::sched::{CloneFlags, unshare};
use nix::sys::signal::{SigSet, Signal, kill};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::Pid;

use crate::core::diff::{CompareOptions, compare};
use crate::core::policy::{Policy, PolicyError};
use crate::core::ruleset::Ruleset;
use crate::daemon::{self, DaemonError};
use crate::dns::resolve::ResolveError;
use crate::nft::{Nft, NftError};
use crate::state::StateDir;

pub use namespace::NAME_PREFIX;
pub use report::{CanaryHost, Refusals};
pub use written::ReportFile;

/// What CMD's environment keeps of the caller's besides `--keep-env` names.
pub const KEPT_ENV: [&str; 5] = ["PATH", "HOME", "LANG", "TERM", "TZ"];
/// How long the daemon may take to put the policy's table up.
const TABLE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the guard may take to open its event socket once the table is up.
const GUARD_SOCKET_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error(
        "exec needs a policy with `dns.mode: guard` (and a `dns.listen` on port 53): CMD's \
         names resolve only through the guard, so DNS cannot carry data out"
    )]
    NotGuard,
    #[error(
        "exec fences its whole namespace, CMD and all it starts: a policy with a `scope:` would \
         fence only the sockets of the users, groups or cgroups it lists (CMD as another user, \
         or a set-uid program it runs, would not be fenced at all); remove the scope"
    )]
    Scoped,
    #[error(
        "name the user CMD runs as with --user USER (--user nobody for none of the host's): as \
         root, even without capabilities, CMD could rewrite the host's root-owned files (a cron \
         job, a unit) that run later outside the fence; --user root if that is meant"
    )]
    NoUser,
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error(transparent)]
    Nft(#[from] NftError),
    #[error("the fence's daemon failed: {0}")]
    Daemon(#[source] DaemonError),
    #[error("the fence's daemon ended before CMD started")]
    DaemonEnded,
    #[error("the table in the namespace is not the planned one, CMD not started: {0}")]
    NotProved(String),
    #[error("cannot connect the namespace: {reason}")]
    Pasta { reason: String },
    #[error("cannot drop capabilities: {0}")]
    Caps(String),
    #[error("{0}")]
    Refused(String),
    #[error("{doing}: {source}")]
    Io {
        doing: &'static str,
        source: std::io::Error,
    },
    #[error("{doing}: {source}")]
    Sys {
        doing: &'static str,
        source: nix::Error,
    },
}

impl ExecError {
    fn io(doing: &'static str) -> impl FnOnce(std::io::Error) -> ExecError {
        move |source| ExecError::Io { doing, source }
    }
    fn sys(doing: &'static str) -> impl FnOnce(nix::Error) -> ExecError {
        move |source| ExecError::Sys { doing, source }
    }
    fn caps(e: caps::errors::CapsError) -> ExecError {
        ExecError::Caps(e.to_string())
    }
}

pub struct Options {
    pub policy_path: PathBuf,
    /// The host's resolv.conf (the upstream resolvers of a guard that names none).
    pub resolv_conf: PathBuf,
    pub user: Option<String>,
    pub keep_env: Vec<String>,
    pub command: Vec<OsString>,
    /// Where each run keeps its daemon's state and its resolv.conf, in `ef-exec-<pid>`.
    pub state_root: PathBuf,
    /// This program, started again as the inside (`exec-child`).
    pub self_exe: PathBuf,
    /// `--canary`: the token put in CMD's environment, and the file it is also written to.
    pub canary: Option<Canary>,
}

/// A run's canary.
pub struct Canary {
    pub token: String,
    /// The host of the canary's URL ([`canary::url`]).
    pub host: String,
    /// Written before CMD starts (`CANARY_API_KEY=...`), removed when the run ends.
    pub file: Option<PathBuf>,
}

/// How a run ended.
pub struct Outcome {
    /// CMD's exit code (128 + N for a death by signal N).
    pub code: u8,
    /// What the fence refused; `None` when the policy logs no refusals (no `log.group`).
    pub refusals: Option<Refusals>,
}

/// Runs CMD fenced. Call it before any thread exists, in the host's network namespace.
///
/// Its steps are logged at debug level (`RUST_LOG=egress_fence::exec=debug`), each with its
/// time: `benches/exec.rs` reads them to say where the start-up time goes.
pub fn run(options: Options) -> Result<Outcome, ExecError> {
    tracing::debug!("exec: started");
    let policy = Policy::load(&options.policy_path)?;
    let nameserver = guard_nameserver(&policy)?;
    // With a scope the table fences only the scope's sockets (`meta skuid`, `meta skgid`,
    // `socket cgroupv2`), and pasta connects everything else in the namespace to the host's
    // network: CMD as a user the scope does not list would be unfenced.
    if policy.scope.is_some() {
        return Err(ExecError::Scoped);
    }
    for path in namespace::remove_leftovers(&options.state_root) {
        eprintln!(
            "egress-fence exec: removed {} (left by a killed run)",
            path.display()
        );
    }
    // Blocked in every thread (the daemon's inherits this mask): they are read here, from a
    // signalfd, and passed to CMD. SIGHUP too, and dropped: the daemon would re-read the
    // policy's file, which CMD may have rewritten, and nothing proves the table after.
    let mut signals = SigSet::empty();
    for s in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGCHLD,
        Signal::SIGHUP,
    ] {
        signals.add(s);
    }
    signals
        .thread_block()
        .map_err(ExecError::sys("block signals"))?;
    let signal_fd = SignalFd::with_flags(&signals, SfdFlags::SFD_CLOEXEC)
        .map_err(ExecError::sys("read signals"))?;

    // The host's addresses, kept fresh by a thread that stays in the host's namespace
    // (started with the signals blocked, before the pid namespace): the run's guard must not
    // install an answer naming one, which pasta would connect to the host itself.
    follow_host_addrs()?;
    let host = namespace::current()?;
    namespace::enter_new()?;
    let fenced = namespace::current()?;
    let name = namespace::run_name(std::process::id());
    let named = namespace::NamedNetns::bind(&name)?;
    let run_dir = RunDir::create(&options.state_root, &name)?;
    let resolv_conf = run_dir.write_resolv_conf(&nameserver)?;

    let resolution = crate::dns::resolve::resolve_policy(&policy, &options.resolv_conf)?;
    // As the daemon plans it for exec's run: replies leaving on pasta's device refused (no
    // flow an outside host starts is CMD's to answer).
    let planned = crate::core::plan::with_extras(
        crate::core::plan::plan(&policy, &resolution),
        &crate::core::plan::Extras {
            refuse_replies: true,
            ..crate::core::plan::Extras::default()
        },
    );
    let mut nft = Nft::open()?;
    tracing::debug!("exec: namespace made, starting the fence");
    let state = StateDir::new(&options.state_root, &name);
    let daemon_ended = start_daemon(&options, state.clone())?;
    wait_for_table(&mut nft, &planned, &daemon_ended)?;
    tracing::debug!("exec: the table is the planned one");
    // Threads can be started only until the pid namespace is made, below.
    let listening = match policy.log.group {
        Some(group) => {
            let canary = options.canary.as_ref().map(|c| report::CanaryWatch {
                token: &c.token,
                host: &c.host,
            });
            // The follower tries a missing socket again only a second later: wait for it.
            wait_for_socket(&state.guard_events(), GUARD_SOCKET_TIMEOUT);
            let mut listening = report::listen(group, state.guard_events(), canary)?;
            if !listening.wait_for_guard(Duration::from_secs(2)) {
                return Err(ExecError::Refused(
                    "the guard's refusals cannot be followed; CMD not started".into(),
                ));
            }
            tracing::debug!("exec: the guard's refusals are followed");
            Some(listening)
        }
        None if options.canary.is_some() => {
            return Err(ExecError::Refused(
                "--canary needs `log.group` in the policy: the guard's refusals are read \
                 with the refused packets"
                    .into(),
            ));
        }
        None => None,
    };
    let _canary_file = match &options.canary {
        Some(
            canary @ Canary {
                file: Some(path), ..
            },
        ) => Some(CanaryFile::write(path, canary)?),
        _ => None,
    };

    // From here this thread's children are in a new pid namespace, the inside its first
    // process (no thread may be started from this thread any more).
    let (go_read, go_write) =
        nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(ExecError::sys("make a pipe"))?;
    fcntl(&go_read, FcntlArg::F_SETFD(FdFlag::empty()))
        .map_err(ExecError::sys("pass the pipe on"))?;
    unshare(CloneFlags::CLONE_NEWPID).map_err(ExecError::sys("make a pid namespace"))?;
    let mut inside = Killed(start_inside(&options, &resolv_conf, &go_read)?);
    drop(go_read);
    tracing::debug!("exec: the inside started, starting pasta");

    namespace::enter(&host)?;
    let pasta_pid_file = run_dir.path.join("pasta.pid");
    let capture = options
        .canary
        .as_ref()
        .map(|_| run_dir.path.join("pasta.pcap"));
    let pasta = connect::start_pasta(named.path(), &pasta_pid_file, capture.as_deref());
    namespace::enter(&fenced)?;
    let mut pasta = Killed(pasta?);
    if let Err(e) = connect::wait_until_connected(&mut pasta.0, &pasta_pid_file) {
        // The inside's end takes pasta with it: then the inside's error (above) is the cause.
        return Err(match inside.0.try_wait() {
            Ok(Some(_)) => ExecError::Refused("the inside ended before CMD started".into()),
            _ => e,
        });
    }
    tracing::debug!("exec: pasta connected the namespace");
    drop(named);
    prove(&mut nft, &planned)?;
    if daemon_ended.try_recv().is_ok() {
        return Err(ExecError::DaemonEnded);
    }
    // The table CMD starts under: one applied anew during the run (the daemon heals, or
    // restores a set) counted from 0 again, and its counters say nothing of the whole run.
    let table_at_start = nft
        .refused_counters()
        .ok()
        .flatten()
        .map(|(table, _)| table);
    File::from(go_write)
        .write_all(b"g")
        .map_err(ExecError::io("start CMD"))?;

    tracing::debug!("exec: fence proved, CMD starts");
    let code = wait_for_inside(inside, &mut pasta, &signal_fd)?;
    // CMD has ended: what the table counted now is all it will count of CMD's.
    let counted = match nft.refused_counters() {
        Ok(Some((table, refused))) if Some(table) == table_at_start => Some(refused.packets()),
        _ => None,
    };
    let mut refusals = listening.map(|l| l.finish(Duration::from_millis(100), counted));
    if let (Some(canary), Some(capture), Some(refusals)) =
        (&options.canary, &capture, &mut refusals)
    {
        match pcap::read(capture) {
            Ok(captured) => refusals.add_capture(&captured, &canary.token),
            Err(e) => refusals
                .errors
                .push(format!("reading pasta's capture for the canary: {e}")),
        }
    }
    drop(run_dir);
    Ok(Outcome { code, refusals })
}

/// How often the host's addresses are read again for the run's guard (as the guard reads
/// its own namespace's: [`crate::host::HostAddrsCache`]).
const HOST_ADDRS_EVERY: Duration = Duration::from_secs(5);

/// Reads the host's addresses now (in the calling thread's namespace, the host's), and again
/// every [`HOST_ADDRS_EVERY`] on a thread that stays there, for the guard of the run's
/// namespace ([`crate::host::set_addrs_elsewhere`]).
fn follow_host_addrs() -> Result<(), ExecError> {
    let read = || {
        crate::host::read_interfaces()
            .map(crate::host::set_addrs_elsewhere)
            .map_err(ExecError::sys("read the host's addresses"))
    };
    read()?;
    std::thread::Builder::new()
        .name("host-addrs".into())
        .spawn(move || {
            loop {
                std::thread::sleep(HOST_ADDRS_EVERY);
                // The last ones read are still the best guess.
                let _ = read();
            }
        })
        .map_err(ExecError::io("follow the host's addresses"))?;
    Ok(())
}

/// The guard's address for CMD's resolv.conf: its first listen address, which must be on
/// port 53 (resolv.conf names no port).
fn guard_nameserver(policy: &Policy) -> Result<std::net::IpAddr, ExecError> {
    let guard = policy.dns.guard.as_ref().ok_or(ExecError::NotGuard)?;
    guard
        .listen
        .iter()
        .find(|a| a.port() == 53)
        .map(|a| a.ip())
        .ok_or(ExecError::NotGuard)
}

/// The run's directory (the daemon's state, CMD's resolv.conf); removed when dropped.
struct RunDir {
    path: PathBuf,
}

impl RunDir {
    fn create(root: &Path, name: &str) -> Result<RunDir, ExecError> {
        let path = root.join(name);
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&path)
            .map_err(ExecError::io("create the run's directory"))?;
        Ok(RunDir { path })
    }

    fn write_resolv_conf(&self, nameserver: &std::net::IpAddr) -> Result<PathBuf, ExecError> {
        let path = self.path.join("resolv.conf");
        fs::write(&path, format!("nameserver {nameserver}\n"))
            .map_err(ExecError::io("write CMD's resolv.conf"))?;
        Ok(path)
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

const CANARY_FILE: &str = "the canary file";

/// The canary's file; removed when dropped, from the directory it was made in (held open:
/// CMD may rename that directory or put a link in its place while it runs).
struct CanaryFile {
    dir: std::os::fd::OwnedFd,
    name: OsString,
}

impl CanaryFile {
    fn write(path: &Path, canary: &Canary) -> Result<CanaryFile, ExecError> {
        let text = format!(
            "{}={}\n{}={}\n",
            canary::VARIABLE,
            canary.token,
            canary::URL_VARIABLE,
            canary::url(&canary.host, &canary.token)
        );
        let (dir, name) = written::open_dir(path, CANARY_FILE)?;
        let mut file = written::open_file(&dir, &name, path, CANARY_FILE)?;
        file.write_all(text.as_bytes())
            .map_err(ExecError::io("write the canary file"))?;
        Ok(CanaryFile { dir, name })
    }
}

impl Drop for CanaryFile {
    fn drop(&mut self) {
        let _ = nix::unistd::unlinkat(
            &self.dir,
            self.name.as_os_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
    }
}

/// A child killed (and reaped) when dropped, unless it already ended.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Runs the daemon (the table and the DNS guard) on a thread in the calling thread's
/// namespace; the receiver hears when it ended.
fn start_daemon(options: &Options, state: StateDir) -> Result<mpsc::Receiver<()>, ExecError> {
    state
        .create()
        .map_err(|e| ExecError::Daemon(DaemonError::State(e)))?;
    let daemon_options = daemon::Options {
        policy_path: options.policy_path.clone(),
        resolv_conf: options.resolv_conf.clone(),
        teardown_on_exit: false,
        log_drops: false,
        state,
        keep: 1,
        lock_timeout: Duration::from_secs(1),
        metrics: None,
        recording: None,
        trusted_policy_file: false,
        refuse_replies: true,
    };
    let (ended_tx, ended_rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("fence".into())
        .spawn(move || {
            if let Err(e) = daemon::run(daemon_options) {
                // Not `eprintln!`: CMD shares this stderr and may have shut it (a panic here
                // would skip telling exec the daemon ended).
                let _ = std::io::Write::write_fmt(
                    &mut std::io::stderr(),
                    format_args!("egress-fence exec: {}\n", ExecError::Daemon(e)),
                );
            }
            let _ = ended_tx.send(());
        })
        .map_err(ExecError::io("start the fence's daemon"))?;
    Ok(ended_rx)
}

/// Waits until the daemon's table is the planned one.
fn wait_for_table(
    nft: &mut Nft,
    planned: &Ruleset,
    daemon_ended: &mpsc::Receiver<()>,
) -> Result<(), ExecError> {
    let deadline = Instant::now() + TABLE_TIMEOUT;
    loop {
        match prove(nft, planned) {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => {}
        }
        if daemon_ended.try_recv().is_ok() {
            return Err(ExecError::DaemonEnded);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits until `path` exists or `timeout` passed (the caller's own wait then says whether
/// what it needs came).
fn wait_for_socket(path: &Path, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !path.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Reads the namespace's table back and compares it with the plan (the guard's answers left
/// out: they come and go).
fn prove(nft: &mut Nft, planned: &Ruleset) -> Result<(), ExecError> {
    let live = nft.read_table()?;
    let diff = compare(
        planned,
        live.as_ref(),
        CompareOptions {
            ignore_resolved_contents: true,
        },
    );
    if diff.is_empty() {
        Ok(())
    } else {
        Err(ExecError::NotProved(diff.summary().join("; ")))
    }
}

fn start_inside(
    options: &Options,
    resolv_conf: &Path,
    go_read: &std::os::fd::OwnedFd,
) -> Result<Child, ExecError> {
    use std::os::fd::AsRawFd;
    let mut command = Command::new(&options.self_exe);
    command
        .arg("exec-child")
        .arg("--resolv-conf")
        .arg(resolv_conf)
        .arg("--go-fd")
        .arg(go_read.as_raw_fd().to_string())
        .arg("--parent")
        .arg(std::process::id().to_string());
    if let Some(user) = &options.user {
        command.arg("--user").arg(user);
    }
    command.arg("--").args(&options.command);
    command.env_clear();
    for name in KEPT_ENV
        .iter()
        .copied()
        .chain(options.keep_env.iter().map(String::as_str))
    {
        if let Some(value) = std::env::var_os(name) {
            command.env(name, value);
        }
    }
    if let Some(canary) = &options.canary {
        command.env(canary::VARIABLE, &canary.token);
        command.env(
            canary::URL_VARIABLE,
            canary::url(&canary.host, &canary.token),
        );
    }
    command
        .stdin(Stdio::inherit())
        .spawn()
        .map_err(ExecError::io("start the inside"))
}

/// Passes SIGINT and SIGTERM to the inside (which passes them to CMD) until it ends.
///
/// pasta's first process (it forks) is reaped here as soon as it ends: the pid namespace's
/// end waits for every zombie of its processes, and this process is that one's parent.
fn wait_for_inside(
    mut inside: Killed,
    pasta: &mut Killed,
    signal_fd: &SignalFd,
) -> Result<u8, ExecError> {
    loop {
        let _ = pasta.0.try_wait();
        if let Some(status) = inside.0.try_wait().map_err(ExecError::io("wait for CMD"))? {
            return Ok(child::exit_code(status));
        }
        let Some(info) = signal_fd
            .read_signal()
            .map_err(ExecError::sys("read signals"))?
        else {
            continue;
        };
        let signo = info.ssi_signo as i32;
        if let Ok(sig @ (Signal::SIGINT | Signal::SIGTERM)) = Signal::try_from(signo) {
            let _ = kill(Pid::from_raw(inside.0.id() as i32), sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canary() -> Canary {
        Canary {
            token: "ck_live_test".into(),
            host: "hooks-x.canary.invalid".into(),
            file: None,
        }
    }

    #[test]
    fn the_canary_file_is_written_fresh_and_over_a_file_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("canary.env");
        drop(CanaryFile::write(&path, &canary()).unwrap());
        assert!(!path.exists(), "removed when dropped");
        fs::write(
            &path,
            "an older and much longer canary file left by a killed run\n",
        )
        .unwrap();
        let kept = CanaryFile::write(&path, &canary()).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("CANARY_API_KEY=ck_live_test\n"), "{text}");
        assert!(!text.contains("killed run"), "{text}");
        drop(kept);
    }

    #[test]
    fn the_canary_file_is_never_written_through_a_link_or_into_a_fifo() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, "root's own\n").unwrap();
        let path = dir.path().join("canary.env");

        std::os::unix::fs::symlink(&victim, &path).unwrap();
        let err = CanaryFile::write(&path, &canary()).err().expect("refused");
        assert!(err.to_string().contains("symbolic link"), "{err}");
        fs::remove_file(&path).unwrap();

        fs::hard_link(&victim, &path).unwrap();
        let err = CanaryFile::write(&path, &canary()).err().expect("refused");
        assert!(err.to_string().contains("hard link"), "{err}");
        fs::remove_file(&path).unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "root's own\n");

        // A FIFO nobody reads: refused at once, not waited on.
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(CanaryFile::write(&path, &canary()).is_err());
    }

    /// A directory on the way to PATH that CMD's user may write may be a symbolic link it
    /// left there (`sub -> /root/app`): the file is then another directory's, root's. And
    /// while CMD runs it may swap the directory for such a link: the removal at exit must
    /// still remove the canary's file, not one of the same name wherever the link points.
    #[test]
    fn the_canary_file_is_never_written_or_removed_through_a_linked_directory() {
        let dir = tempfile::tempdir().unwrap();
        let victims = dir.path().join("victims");
        fs::create_dir(&victims).unwrap();
        let victim = victims.join("canary.env");
        fs::write(&victim, "root's own\n").unwrap();
        let sub = dir.path().join("sub");
        std::os::unix::fs::symlink(&victims, &sub).unwrap();
        let path = sub.join("canary.env");
        let err = CanaryFile::write(&path, &canary()).err().expect("refused");
        assert!(err.to_string().contains("symbolic link"), "{err}");
        assert_eq!(fs::read_to_string(&victim).unwrap(), "root's own\n");

        fs::remove_file(&sub).unwrap();
        fs::create_dir(&sub).unwrap();
        let kept = CanaryFile::write(&path, &canary()).unwrap();
        fs::rename(&sub, dir.path().join("moved")).unwrap();
        std::os::unix::fs::symlink(&victims, &sub).unwrap();
        drop(kept);
        assert_eq!(fs::read_to_string(&victim).unwrap(), "root's own\n");
        assert!(
            !dir.path().join("moved/canary.env").exists(),
            "its own file removed"
        );
    }
}
