//! The writers' lock: an exclusive `flock` on a file that names its holder.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use super::dir::StateDir;
use super::error::{StateError, io_error};
use super::files::open_regular;

pub(super) const LOCK_FILE: &str = "lock";

/// How often a waiting writer tries the lock again.
const LOCK_POLL: Duration = Duration::from_millis(50);

/// Who holds the lock, as its holder wrote it: "PID COMMAND".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockHolder {
    pub pid: Option<u32>,
    pub command: Option<String>,
}

impl LockHolder {
    pub fn parse(text: &str) -> LockHolder {
        let mut words = text.split_whitespace();
        let pid = words.next().and_then(|p| p.parse().ok());
        let command = pid.and(words.next()).map(str::to_string);
        LockHolder { pid, command }
    }

    /// Whether the holder is the service, which keeps the lock for its whole life.
    pub fn is_daemon(&self) -> bool {
        self.command.as_deref() == Some("run")
    }
}

impl std::fmt::Display for LockHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.pid, &self.command) {
            (Some(pid), Some(cmd)) => write!(f, "pid {pid} ({cmd})"),
            (Some(pid), None) => write!(f, "pid {pid}"),
            _ => f.write_str("another process"),
        }
    }
}

/// Why a writer gave up on the lock, and what to do instead.
pub fn busy_message(path: &Path, holder: &LockHolder, waited: Duration) -> String {
    let mut msg = format!(
        "another writer holds the lock {} ({holder}); gave up after {} s",
        path.display(),
        waited.as_secs()
    );
    if holder.is_daemon() {
        msg.push_str(
            ": the egress-fence service (`egress-fence run`) owns this table and puts back \
             any change made beside it; edit its policy file and reload it \
             (`systemctl reload egress-fence`) instead",
        );
    } else {
        msg.push_str("; try again when it is done, or give --lock-timeout a longer wait");
    }
    msg
}

/// The writers' lock of one namespace, held until dropped (or the process dies).
#[derive(Debug)]
pub struct WriterLock {
    _file: Flock<File>,
}

fn read_holder(file: &mut File) -> LockHolder {
    let mut text = String::new();
    let _ = file.rewind().and_then(|()| file.read_to_string(&mut text));
    LockHolder::parse(&text)
}

impl StateDir {
    /// Takes the writers' lock, waiting up to `timeout` for another holder; `on_wait` is
    /// called once, with the holder, if it has to wait. Records `command` as the holder.
    pub fn lock(
        &self,
        command: &str,
        timeout: Duration,
        mut on_wait: impl FnMut(&LockHolder),
    ) -> Result<WriterLock, StateError> {
        self.create()?;
        let path = self.file(LOCK_FILE);
        // Never truncated on open: the holder's line is only rewritten by the next holder,
        // and only once the file is known to be a regular file of its own (not a link).
        let mut file = open_regular(
            &path,
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600),
        )?;
        let started = Instant::now();
        let mut waiting = false;
        let mut locked = loop {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(locked) => break locked,
                Err((f, Errno::EWOULDBLOCK)) => {
                    file = f;
                    let holder = read_holder(&mut file);
                    if started.elapsed() >= timeout {
                        return Err(StateError::LockBusy {
                            path,
                            holder,
                            waited: started.elapsed(),
                        });
                    }
                    if !waiting {
                        waiting = true;
                        on_wait(&holder);
                    }
                    std::thread::sleep(LOCK_POLL);
                }
                Err((_, errno)) => {
                    return Err(StateError::Io {
                        doing: "lock",
                        path,
                        source: errno.into(),
                    });
                }
            }
        };
        let holder = format!("{} {command}\n", std::process::id());
        locked
            .set_len(0)
            .and_then(|()| locked.rewind())
            .and_then(|()| locked.write_all(holder.as_bytes()))
            .map_err(io_error("write the lock holder into", &path))?;
        Ok(WriterLock { _file: locked })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_support::*;

    #[test]
    fn a_second_writer_waits_then_names_the_holder() {
        let (_root, state) = temp_state();
        let _held = state.lock("run", Duration::from_secs(1), |_| {}).unwrap();
        let mut waited_for = Vec::new();
        let err = state
            .lock("apply", Duration::from_millis(200), |h| {
                waited_for.push(h.clone())
            })
            .unwrap_err();
        let me = LockHolder {
            pid: Some(std::process::id()),
            command: Some("run".into()),
        };
        assert_eq!(waited_for, vec![me.clone()], "told once, with the holder");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("pid {} (run)", std::process::id())),
            "{msg}"
        );
        assert!(msg.contains("systemctl reload egress-fence"), "{msg}");
    }

    #[test]
    fn a_released_lock_is_taken_at_once() {
        let (_root, state) = temp_state();
        drop(state.lock("apply", Duration::from_secs(1), |_| {}).unwrap());
        let mut waited = false;
        state
            .lock("apply", Duration::from_secs(1), |_| waited = true)
            .expect("free again");
        assert!(!waited);
    }

    #[test]
    fn lock_holder_messages() {
        let h = LockHolder::parse("1234 apply\n");
        assert_eq!(h.to_string(), "pid 1234 (apply)");
        assert!(!h.is_daemon());
        let busy = busy_message(Path::new("/s/lock"), &h, Duration::from_secs(30));
        assert!(
            busy.contains("/s/lock (pid 1234 (apply)); gave up after 30 s"),
            "{busy}"
        );
        assert!(busy.contains("--lock-timeout"), "{busy}");
        assert!(LockHolder::parse("77 run").is_daemon());
        assert_eq!(LockHolder::parse("").to_string(), "another process");
        assert_eq!(
            LockHolder::parse("garbage words").to_string(),
            "another process"
        );
    }
}
