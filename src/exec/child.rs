//! The inside of a run: `egress-fence exec-child`, started by `exec` as the first process of a
//! new pid namespace, in the run's network namespace. It gives itself a private mount
//! namespace with the guard as its resolver, drops to the user, gives up every capability
//! for good, waits until `exec` has proved the fence, then starts CMD and waits for it,
//! passing SIGINT and SIGTERM on.
//!
//! Being the pid namespace's first process is what leaves nothing behind: when it ends (CMD
//! ended, or `exec` died and the kernel sent it SIGKILL as its parent-death signal) the
//! kernel kills every process left in the namespace, CMD's children and pasta included.

use std::ffi::OsString;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, unshare};
use nix::sys::prctl;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Pid, User, initgroups, setgid, setuid};

use super::ExecError;
use crate::core::policy::LocalResolverKind;

/// What `exec` hands the inside on its command line.
pub struct Inside {
    /// The resolv.conf naming the guard, bind-mounted over /etc/resolv.conf.
    pub resolv_conf: PathBuf,
    pub user: Option<String>,
    /// The read end of the pipe `exec` writes one byte to once the fence is proved (EOF: it
    /// refused, or died).
    pub go_fd: i32,
    /// `exec`'s pid, to notice it died before the parent-death signal was armed.
    pub parent: u32,
    pub command: Vec<OsString>,
}

/// Exit code when CMD could not be started (as a shell says for "cannot execute").
pub const EXIT_CANNOT_EXECUTE: u8 = 126;
/// Exit code when CMD was not found.
pub const EXIT_NOT_FOUND: u8 = 127;

/// Runs the inside; returns CMD's exit code (128 + signal for a signal's death).
pub fn run_inside(inside: Inside) -> Result<u8, ExecError> {
    // `exec` blocks the signals it reads from a signalfd, and its children inherit the mask:
    // this process must hear them (to pass them on, to reap), and CMD must not start with them
    // blocked.
    nix::sys::signal::sigprocmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&nix::sys::signal::SigSet::empty()),
        None,
    )
    .map_err(ExecError::sys("unblock signals"))?;
    prctl::set_pdeathsig(Signal::SIGKILL).map_err(ExecError::sys("arm the parent-death signal"))?;
    // Opened while still root: the pipe is root's.
    let go = open_go(inside.go_fd)?;
    close_inherited(&[go.as_raw_fd()])?;
    // `exec` is outside this pid namespace, so the /proc mounted below will not show it:
    // its stat file, opened now, says later whether it still lives.
    let parent = File::open(format!("/proc/{}/stat", inside.parent))
        .map_err(|_| ExecError::Refused("exec ended before CMD started".into()))?;
    private_resolv_conf(
        &inside.resolv_conf,
        &super::namespace::name_path(inside.parent),
    )?;
    own_proc()?;
    drop_bounding_set()?;
    if let Some(name) = &inside.user {
        become_user(name)?;
    }
    drop_remaining_capabilities()?;
    prctl::set_no_new_privs().map_err(ExecError::sys("set no_new_privs"))?;
    // Changing the user cleared the parent-death signal: arm it again, then make sure the
    // parent did not die before that.
    prctl::set_pdeathsig(Signal::SIGKILL).map_err(ExecError::sys("arm the parent-death signal"))?;
    if !still_alive(parent) {
        return Err(ExecError::Refused("exec ended before CMD started".into()));
    }
    if !wait_for_go(go)? {
        return Err(ExecError::Refused(
            "the fence was not proved; CMD not started".into(),
        ));
    }
    // A session of its own: CMD has no controlling terminal, so it cannot type into the
    // caller's (TIOCSTI) a command line the caller's shell runs unfenced after exec ends.
    nix::unistd::setsid().map_err(ExecError::sys("leave the caller's terminal"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ExecError::io("start the runtime"))?;
    runtime.block_on(start_and_wait(inside.command))
}

/// A mount namespace of our own where /etc/resolv.conf is the guard's, as `ip netns exec`
/// does for /etc/netns/NAME/resolv.conf. Private, not a slave: mounts made here do not
/// propagate back, and the host's later mounts (other runs' names) do not come in.
fn private_resolv_conf(resolv_conf: &Path, name: &Path) -> Result<(), ExecError> {
    unshare(CloneFlags::CLONE_NEWNS).map_err(ExecError::sys("make a mount namespace"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(ExecError::sys("keep mounts private"))?;
    // The names of runs starting now (this one's included) were copied into this mount
    // namespace: let go of them here, or they could not be removed while CMD runs (and a
    // recursive remount of / by a cage inside, bwrap's, would trip on them).
    let _ = nix::mount::umount2(name, nix::mount::MntFlags::MNT_DETACH);
    for other in super::namespace::run_names() {
        let _ = nix::mount::umount2(&other, nix::mount::MntFlags::MNT_DETACH);
    }
    // Before the guard's resolv.conf is bound: /etc/resolv.conf may name a file in a hidden
    // directory (systemd-resolved's stub-resolv.conf), which the bind must land on.
    hide_local_resolvers()?;
    mount(
        Some(resolv_conf),
        "/etc/resolv.conf",
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(ExecError::sys(
        "bind the guard's resolv.conf over /etc/resolv.conf",
    ))
}

/// The host's resolvers that answer any local user over a Unix socket (systemd-resolved's
/// varlink, nscd, avahi-daemon; see [`LocalResolverKind::ALL`]) ask their servers from the
/// host's namespace, past the fence, the guard and the canary; and glibc asks them on its
/// own (nscd before resolv.conf's server, nss-resolve instead of it), so an ordinary lookup
/// in CMD would leave that way. An empty tmpfs is mounted over each socket's directory there
/// is: connecting finds no socket, and glibc falls back to resolv.conf, the guard. The
/// directory, not the socket's file: a daemon that restarts during the run removes its
/// socket and binds a new one, and removing a name that is a mount point in another mount
/// namespace detaches that namespace's mount (a /dev/null bound over the file was gone, the
/// new socket in CMD's /run). The directory's other files are there again, empty, so that
/// the bind of the guard's resolv.conf lands where /etc/resolv.conf names one of them
/// (`stub-resolv.conf`). CMD cannot take the mounts away (no CAP_SYS_ADMIN; a user
/// namespace of its own gets them locked).
fn hide_local_resolvers() -> Result<(), ExecError> {
    for (_, socket, _) in LocalResolverKind::ALL {
        let Some(dir) = Path::new(socket).parent() else {
            continue;
        };
        // No directory: no daemon of that kind to hide.
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let files: Vec<OsString> = entries
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .map(|e| e.file_name())
            .collect();
        mount(
            Some("tmpfs"),
            dir,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            Some("mode=0755,size=64k"),
        )
        .map_err(ExecError::sys("hide a local resolver's directory from CMD"))?;
        for name in files {
            File::create(dir.join(name)).map_err(ExecError::io(
                "keep a hidden resolver directory's file names",
            ))?;
        }
    }
    Ok(())
}

/// A /proc of this pid namespace over the host's: CMD sees its own processes only, not the
/// host's, whose environments and memory (`/proc/PID/environ`, `/proc/PID/mem`) a process of
/// the same user could otherwise read and write, unfenced ones included.
///
/// /sys is a fresh one of the run's network namespace, read-only: a /sys file checks only its
/// mode against uid 0, no capability. /proc/sys stays as procfs makes it (a read-only mount
/// over it would leave /proc not "fully visible", and a cage inside, bwrap, could no longer
/// mount a /proc of its own): its sysctls are root's to write by mode, which is one reason
/// CMD runs as root only when told `--user root`.
fn own_proc() -> Result<(), ExecError> {
    let hidden = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(Some("proc"), "/proc", Some("proc"), hidden, None::<&str>)
        .map_err(ExecError::sys("mount a /proc of CMD's own pid namespace"))?;
    mount(
        Some("sysfs"),
        "/sys",
        Some("sysfs"),
        MsFlags::MS_RDONLY | hidden,
        None::<&str>,
    )
    .map_err(ExecError::sys("mount a read-only /sys"))
}

/// Whether the process whose /proc stat file `stat` is still runs: reading a dead process's
/// stat fails.
fn still_alive(mut stat: File) -> bool {
    let mut text = String::new();
    stat.read_to_string(&mut text).is_ok() && !text.is_empty()
}

/// Empties the bounding set (needs CAP_SETPCAP, so before the user changes): no later
/// execve, of a setuid or file-capability binary or as root, can gain a capability.
fn drop_bounding_set() -> Result<(), ExecError> {
    for cap in caps::all() {
        caps::drop(None, caps::CapSet::Bounding, cap).map_err(ExecError::caps)?;
    }
    Ok(())
}

fn become_user(name: &str) -> Result<(), ExecError> {
    let user = User::from_name(name)
        .map_err(ExecError::sys("look up the user"))?
        .ok_or_else(|| ExecError::Refused(format!("no user named {name}")))?;
    let cname = std::ffi::CString::new(name)
        .map_err(|_| ExecError::Refused(format!("bad user name {name:?}")))?;
    initgroups(&cname, user.gid).map_err(ExecError::sys("set the user's groups"))?;
    setgid(user.gid).map_err(ExecError::sys("set the user's group"))?;
    setuid(user.uid).map_err(ExecError::sys("set the user"))
}

/// Clears the ambient, inheritable, permitted and effective sets: with the bounding set
/// empty, CMD starts without any capability even as root.
fn drop_remaining_capabilities() -> Result<(), ExecError> {
    caps::clear(None, caps::CapSet::Ambient).map_err(ExecError::caps)?;
    caps::clear(None, caps::CapSet::Inheritable).map_err(ExecError::caps)?;
    caps::clear(None, caps::CapSet::Effective).map_err(ExecError::caps)?;
    caps::clear(None, caps::CapSet::Permitted).map_err(ExecError::caps)
}

/// Takes the start signal's pipe; closes the inherited descriptor so CMD does not get it.
fn open_go(fd: i32) -> Result<File, ExecError> {
    let pipe = File::open(format!("/proc/self/fd/{fd}"))
        .map_err(ExecError::io("open the start signal"))?;
    nix::unistd::close(fd).map_err(ExecError::sys("close the start signal"))?;
    Ok(pipe)
}

/// Closes every descriptor past stderr but `keep`. This process was started with every
/// descriptor of exec's that is not close-on-exec: the daemon's netfilter sockets (libmnl
/// opens them without SOCK_CLOEXEC) and whatever exec's caller left open, a socket of the
/// caller's network namespace among them (socket activation's, a careless parent's), which
/// sends past the fence: the fence is a table of CMD's namespace. CMD gets stdin, stdout and
/// stderr only. Runs before any thread or runtime of this process opens a descriptor.
fn close_inherited(keep: &[RawFd]) -> Result<(), ExecError> {
    let open: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")
        .map_err(ExecError::io("list the inherited descriptors"))?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    // The listing's own descriptor is among them, closed with the listing: EBADF.
    for fd in open.into_iter().filter(|fd| *fd > 2 && !keep.contains(fd)) {
        match nix::unistd::close(fd) {
            Ok(()) | Err(nix::errno::Errno::EBADF) => {}
            Err(e) => return Err(ExecError::sys("close an inherited descriptor")(e)),
        }
    }
    Ok(())
}

/// Reads the go byte: false at EOF (exec refused, or died).
fn wait_for_go(mut pipe: File) -> Result<bool, ExecError> {
    let mut byte = [0u8; 1];
    let n = pipe
        .read(&mut byte)
        .map_err(ExecError::io("read the start signal"))?;
    Ok(n == 1)
}

async fn start_and_wait(command: Vec<OsString>) -> Result<u8, ExecError> {
    use tokio::signal::unix::{SignalKind, signal};
    // Listening before CMD exists, so none of its signals is missed.
    let mut interrupt = signal(SignalKind::interrupt()).map_err(ExecError::io("catch SIGINT"))?;
    let mut terminate = signal(SignalKind::terminate()).map_err(ExecError::io("catch SIGTERM"))?;
    let mut child_ended = signal(SignalKind::child()).map_err(ExecError::io("catch SIGCHLD"))?;
    let Some((program, args)) = command.split_first() else {
        return Err(ExecError::Refused("no command given".into()));
    };
    let child = match Command::new(program).args(args).spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!(
                "egress-fence exec: cannot run {}: {e}",
                program.to_string_lossy()
            );
            return Ok(match e.kind() {
                std::io::ErrorKind::NotFound => EXIT_NOT_FOUND,
                _ => EXIT_CANNOT_EXECUTE,
            });
        }
    };
    let cmd = Pid::from_raw(child.id() as i32);
    loop {
        // Reap everything (orphans are ours as the namespace's first process) until CMD is.
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) if pid == cmd => return Ok(code as u8),
                Ok(WaitStatus::Signaled(pid, sig, _)) if pid == cmd => {
                    return Ok(128u8.saturating_add(sig as u8));
                }
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(_) => continue,
            }
        }
        tokio::select! {
            _ = interrupt.recv() => { let _ = kill(cmd, Signal::SIGINT); }
            _ = terminate.recv() => { let _ = kill(cmd, Signal::SIGTERM); }
            _ = child_ended.recv() => {}
        }
    }
}

/// The exit code a shell gives for `status` (128 + signal for a signal's death).
pub fn exit_code(status: std::process::ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(sig)) => 128u8.saturating_add(sig as u8),
        (None, None) => 1,
    }
}
