//! The run's network namespace: made fresh, named `ef-exec-<pid>` in /run/netns only while
//! pasta attaches to it (pasta opens it by path), and the leftovers of killed runs removed.
//!
//! The name is a bind mount, and a bind mount keeps a namespace alive after its processes are
//! gone: it is taken away as soon as pasta holds the namespace, so from then on the kernel
//! frees the namespace with its last process. A run killed in that short window leaves the
//! name (and its state directory) behind; the next run removes both, as their pid is dead.

use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, setns, unshare};

use super::ExecError;

/// Where `ip netns` keeps named namespaces (pasta finds the run's there).
const NETNS_RUN_DIR: &str = "/run/netns";
/// The prefix of the run's namespace name (and of its state directory's).
pub const NAME_PREFIX: &str = "ef-exec-";

/// `ef-exec-<pid>`: the run's name.
pub fn run_name(pid: u32) -> String {
    format!("{NAME_PREFIX}{pid}")
}

/// /run/netns/ef-exec-<pid>.
pub fn name_path(pid: u32) -> PathBuf {
    Path::new(NETNS_RUN_DIR).join(run_name(pid))
}

/// Every `ef-exec-*` name in /run/netns.
pub fn run_names() -> Vec<PathBuf> {
    fs::read_dir(NETNS_RUN_DIR)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_name().to_str().and_then(pid_of).is_some())
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// The pid a leftover name was made by, if it is one of ours.
fn pid_of(name: &str) -> Option<u32> {
    name.strip_prefix(NAME_PREFIX)?.parse().ok()
}

fn alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// Removes the names and state directories of runs whose process is gone. Returns what it
/// removed, for a note on stderr.
pub fn remove_leftovers(state_root: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    for dir in [Path::new(NETNS_RUN_DIR), state_root] {
        let Ok(entries) = fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(pid_of) else {
                continue;
            };
            if alive(pid) {
                continue;
            }
            let path = entry.path();
            let gone = if dir == Path::new(NETNS_RUN_DIR) {
                // As `ip netns delete` does: detach, then unlink the mount point; but never
                // through a symbolic link. /run/netns is root's, and so is CMD run as
                // `--user root`: a link it left under a dead pid's name would have this
                // process (root, every capability) detach whatever mount it names.
                let is_link = fs::symlink_metadata(&path).is_ok_and(|m| m.is_symlink());
                if !is_link {
                    let _ = umount2(&path, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW);
                }
                fs::remove_file(&path).is_ok()
            } else {
                fs::remove_dir_all(&path).is_ok()
            };
            if gone {
                removed.push(path);
            }
        }
    }
    removed
}

/// The namespace this thread was in (the "host" exec connects to).
pub fn current() -> Result<File, ExecError> {
    File::open("/proc/thread-self/ns/net")
        .map_err(ExecError::io("open the host's network namespace"))
}

/// Moves the calling thread (and the threads it starts later) into a new, empty network
/// namespace, its loopback up.
///
/// Loopback must be up before the guard binds its address there: a socket bound to
/// 127.0.0.53 while lo is down answers from 127.0.0.1, which clients drop.
pub fn enter_new() -> Result<(), ExecError> {
    unshare(CloneFlags::CLONE_NEWNET).map_err(ExecError::sys("make a network namespace"))?;
    let status = std::process::Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .env_clear()
        .status()
        .map_err(ExecError::io("run `ip link set lo up` (iproute2)"))?;
    if status.success() {
        Ok(())
    } else {
        Err(ExecError::Refused(format!(
            "`ip link set lo up` in the new namespace failed ({status})"
        )))
    }
}

/// Moves the calling thread into `ns`.
pub fn enter(ns: &File) -> Result<(), ExecError> {
    setns(ns, CloneFlags::CLONE_NEWNET).map_err(ExecError::sys("enter a network namespace"))
}

/// The calling thread's namespace bound to /run/netns/NAME; unbound when dropped.
pub struct NamedNetns {
    path: PathBuf,
}

impl NamedNetns {
    pub fn bind(name: &str) -> Result<NamedNetns, ExecError> {
        fs::create_dir_all(NETNS_RUN_DIR).map_err(ExecError::io("create /run/netns"))?;
        let path = Path::new(NETNS_RUN_DIR).join(name);
        // Never through a symbolic link (CMD of another run, as `--user root`, may write
        // /run/netns): the name is opened without following one, and the namespace is bound
        // onto the file opened, by its descriptor, not by a path that could be swapped.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
            .open(&path)
            .map_err(ExecError::io("create the namespace's name"))?;
        let named = NamedNetns { path };
        mount(
            Some("/proc/thread-self/ns/net"),
            format!("/proc/self/fd/{}", file.as_raw_fd()).as_str(),
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(ExecError::sys("name the network namespace"))?;
        Ok(named)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for NamedNetns {
    fn drop(&mut self) {
        let _ = umount2(&self.path, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW);
        let _ = fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_names_carry_a_pid() {
        assert_eq!(pid_of(&run_name(42)), Some(42));
        assert_eq!(pid_of("ef-exec-x"), None);
        assert_eq!(pid_of("sandbox"), None);
    }
}
