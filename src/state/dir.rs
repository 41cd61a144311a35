//! Where a namespace's state lives, and how a file there is replaced atomically.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::error::{StateError, io_error};
use super::files::{check_dir, open_regular};
use super::lock::WriterLock;
use crate::netns::Netns;

/// Test-only fault injection: with this variable set to `1`, the process kills itself
/// (SIGKILL: no cleanup, no core) after writing and syncing a generation's temporary file and
/// before renaming it into place, as a crash or power cut at that moment would. Only the
/// integration tests set it.
pub const CRASH_BEFORE_RENAME_ENV: &str = "EGRESS_FENCE_TEST_CRASH_BEFORE_RENAME";

pub const REVERT_TIMER_LOG: &str = "revert-timer.log";

/// The name of a namespace's directory below the state directory: `host` without `--netns`,
/// `netns-NAME` for a named namespace (also when given as /run/netns/NAME), and
/// `netns-ino-INODE` for any other path (the inode of the namespace file names the namespace
/// while it lives; a process's /proc/PID/ns/net does not outlive it).
pub fn namespace_dir_name(netns: Option<&Netns>) -> Result<String, StateError> {
    let Some(ns) = netns else {
        return Ok("host".to_string());
    };
    match ns.name() {
        Some(name) => Ok(format!("netns-{name}")),
        None => {
            let meta = fs::metadata(&ns.path).map_err(io_error("read", &ns.path))?;
            Ok(format!("netns-ino-{}", meta.ino()))
        }
    }
}

/// The inode of the network namespace the calling thread is in: what a revert timer checks
/// before it changes anything, so it never acts on another namespace than the change it guards.
pub fn current_netns_inode() -> Result<u64, StateError> {
    let path = Path::new("/proc/thread-self/ns/net");
    Ok(fs::metadata(path).map_err(io_error("read", path))?.ino())
}

/// Whether the network namespace with inode `inode` still exists, as far as this process can
/// see: a name in /run/netns holds it, or a process is in it. A namespace no one holds is
/// gone, and its table with it.
pub fn netns_exists(inode: u64) -> bool {
    let is_it = |path: &Path| fs::metadata(path).is_ok_and(|m| m.ino() == inode);
    let named = fs::read_dir("/run/netns")
        .map(|names| names.flatten().any(|e| is_it(&e.path())))
        .unwrap_or(false);
    named
        || fs::read_dir("/proc")
            .map(|procs| {
                procs.flatten().any(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
                        && is_it(&e.path().join("ns/net"))
                })
            })
            .unwrap_or(false)
}

/// One namespace's directory of generations, lock and pending confirmation.
#[derive(Debug, Clone)]
pub struct StateDir {
    pub(super) dir: PathBuf,
}

/// `.gen-000042.json.PID.tmp`: hidden, and never taken for a generation.
pub(super) fn temporary_name(name: &str) -> String {
    format!(".{name}.{}.tmp", std::process::id())
}

pub(super) fn is_temporary_name(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".tmp")
}

impl StateDir {
    /// The directory of namespace `ns_dir_name` below `root` (not created).
    pub fn new(root: &Path, ns_dir_name: &str) -> StateDir {
        StateDir {
            dir: root.join(ns_dir_name),
        }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Creates the directory (and the state directory) if needed: writers only.
    pub fn create(&self) -> Result<(), StateError> {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(io_error("create the state directory", &self.dir))?;
        self.check()
    }

    /// Refuses the directory, and the state directory it is in, if someone other than root
    /// or this process's user could write to them.
    pub fn check(&self) -> Result<(), StateError> {
        if let Some(root) = self.dir.parent() {
            check_dir(root)?;
        }
        check_dir(&self.dir)
    }

    /// Opens the revert timers' log for appending (created if missing), refusing links and
    /// special files like every other file here.
    pub fn open_revert_timer_log(&self) -> Result<File, StateError> {
        let path = self.revert_timer_log();
        open_regular(
            &path,
            OpenOptions::new().create(true).append(true).mode(0o600),
        )
    }

    pub(super) fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The Unix socket where a running DNS guard streams the queries it refuses (one
    /// [`crate::watch::QueryEvent`] JSON object per line) to `watch`.
    pub fn guard_events(&self) -> PathBuf {
        self.file("guard-events.sock")
    }

    /// Where revert timers write what they do.
    pub fn revert_timer_log(&self) -> PathBuf {
        self.file(REVERT_TIMER_LOG)
    }

    /// Writes `name` so that it holds the old contents or the new ones, whatever happens:
    /// a temporary file in the same directory, written and synced, renamed over it, and the
    /// directory synced so the rename itself is durable.
    pub(super) fn write_atomically(
        &self,
        name: &str,
        bytes: &[u8],
        crash_point: bool,
    ) -> Result<(), StateError> {
        self.write_atomically_with(name, crash_point, |f| f.write_all(bytes))
    }

    /// [`StateDir::write_atomically`] of what `write` writes into the file.
    pub(super) fn write_atomically_with(
        &self,
        name: &str,
        crash_point: bool,
        write: impl FnOnce(&mut File) -> io::Result<()>,
    ) -> Result<(), StateError> {
        let tmp = self.file(&temporary_name(name));
        let written = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| {
                write(&mut f)?;
                f.sync_all()
            });
        if let Err(e) = written {
            // A full disk: no torn file may stay behind; the old one is untouched.
            let _ = fs::remove_file(&tmp);
            return Err(io_error("write", &tmp)(e));
        }
        if crash_point && std::env::var_os(CRASH_BEFORE_RENAME_ENV).is_some_and(|v| v == "1") {
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        }
        let target = self.file(name);
        fs::rename(&tmp, &target).map_err(io_error("rename into place", &target))?;
        self.sync_dir()
    }

    pub(super) fn sync_dir(&self) -> Result<(), StateError> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io_error("sync", &self.dir))
    }

    /// Removes temporary files of writers that died before renaming them. Only under the
    /// lock: a live writer's temporary file is never touched.
    pub(super) fn remove_leftovers(&self, _lock: &WriterLock) -> Result<(), StateError> {
        let listing = match fs::read_dir(&self.dir) {
            Ok(listing) => listing,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_error("list", &self.dir)(e)),
        };
        for entry in listing.flatten() {
            if entry.file_name().to_str().is_some_and(is_temporary_name) {
                let path = entry.path();
                fs::remove_file(&path).map_err(io_error("remove the leftover", &path))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::lock::LOCK_FILE;
    use crate::state::test_support::*;
    use crate::state::*;

    #[test]
    fn this_processs_namespace_exists_and_a_made_up_one_does_not() {
        assert!(netns_exists(current_netns_inode().expect("a namespace")));
        assert!(!netns_exists(1));
    }

    #[test]
    fn namespace_directories_are_named_after_the_namespace() {
        assert_eq!(namespace_dir_name(None).unwrap(), "host");
        let named = Netns::parse("sandbox");
        assert_eq!(namespace_dir_name(Some(&named)).unwrap(), "netns-sandbox");
        let as_path = Netns::parse("/run/netns/sandbox");
        assert_eq!(namespace_dir_name(Some(&as_path)).unwrap(), "netns-sandbox");
        let own = Netns::parse("/proc/self/ns/net");
        let ino = fs::metadata("/proc/self/ns/net").unwrap().ino();
        assert_eq!(
            namespace_dir_name(Some(&own)).unwrap(),
            format!("netns-ino-{ino}")
        );
        let missing = Netns::parse("/proc/no-such-process/ns/net");
        assert!(namespace_dir_name(Some(&missing)).is_err());
    }

    #[test]
    fn atomic_writes_leave_no_torn_file_and_leftovers_are_cleaned() {
        let (_root, state) = temp_state();
        let lock = lock(&state);
        state
            .record(&lock, new_generation(Recorder::Apply), 10)
            .unwrap();
        // What a writer killed between write and rename leaves: a complete temporary file.
        let leftover = state.path().join(".gen-000002.json.999999.tmp");
        fs::write(&leftover, b"{\"half\": ").unwrap();
        assert_eq!(
            state.generation_numbers().unwrap(),
            vec![1],
            "ignored by readers"
        );
        assert_eq!(state.next_number(&lock).unwrap(), 2);
        state
            .record(&lock, new_generation(Recorder::Apply), 10)
            .unwrap();
        assert!(!leftover.exists(), "cleaned by the next writer");
        let names: Vec<String> = fs::read_dir(state.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != LOCK_FILE)
            .collect();
        let mut names = names;
        names.sort();
        assert_eq!(names, vec!["gen-000001.json", "gen-000002.json"]);
    }
}
