//! Files exec (root, unfenced) writes where CMD's user may write: the canary's file in CMD's
//! working directory, and `--report`'s file (a CI job's workspace is the agent's). Such a
//! directory can hold what a process of that user left there (CMD of an earlier run): a
//! symbolic link on the way or at the file, a hard link, a FIFO. And while CMD runs, it can
//! remove the file exec opened, or move its directory, and leave its own at the path.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AT_FDCWD, OFlag, openat, renameat};
use nix::sys::stat::{Mode, fstat};

use super::ExecError;

/// The directory of the file at `path` (`what` it is, for messages), reached one directory at a
/// time without following a symbolic link (`O_NOFOLLOW | O_DIRECTORY` on each): a directory on
/// the way that CMD's user may write can hold a link it left, and through it this process
/// (root) would write, and at exit remove, a file of that name in any directory. Returns it
/// with the file's name.
pub(super) fn open_dir(path: &Path, what: &str) -> Result<(OwnedFd, OsString), ExecError> {
    let refused =
        |why: &str| ExecError::Refused(format!("{what} {} {why}; CMD not started", path.display()));
    let name = match path.file_name() {
        Some(name) => name.to_os_string(),
        None => return Err(refused("names no file")),
    };
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let open = |at: BorrowedFd<'_>, step: &OsStr| {
        openat(at, step, flags, Mode::empty()).map_err(|e| match e {
            Errno::ELOOP | Errno::ENOTDIR => refused(&format!(
                "is reached through {} (a symbolic link, or not a directory): give a path \
                 without symbolic links",
                Path::new(step).display()
            )),
            e => ExecError::Io {
                doing: "open a directory on the way to a file exec writes",
                source: e.into(),
            },
        })
    };
    let mut dir = open(AT_FDCWD, OsStr::new("."))?;
    for step in path.parent().into_iter().flat_map(Path::components) {
        dir = match step {
            Component::RootDir => open(AT_FDCWD, OsStr::new("/"))?,
            Component::CurDir => continue,
            Component::ParentDir => open(dir.as_fd(), OsStr::new(".."))?,
            Component::Normal(step) => open(dir.as_fd(), step)?,
            Component::Prefix(_) => return Err(refused("is not a Unix path")),
        };
    }
    Ok((dir, name))
}

/// Opens the file `name` in `dir` (`path` and `what` for messages), made if missing: never
/// through a symbolic link (`O_NOFOLLOW`), never a FIFO or device (`O_NONBLOCK`, then a
/// regular file only), never a file with another name too (a hard link), and emptied only
/// once all that is checked.
pub(super) fn open_file(
    dir: &OwnedFd,
    name: &OsStr,
    path: &Path,
    what: &str,
) -> Result<File, ExecError> {
    let refused =
        |why: &str| ExecError::Refused(format!("{what} {} {why}; CMD not started", path.display()));
    let file = openat(
        dir.as_fd(),
        name,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o644),
    )
    .map(File::from)
    .map_err(|e| match e {
        Errno::ELOOP => refused("is a symbolic link"),
        // A FIFO no one reads, opened without blocking (a device: ENODEV, ENXIO too).
        Errno::ENXIO | Errno::ENODEV => refused("is not a regular file"),
        e => ExecError::Io {
            doing: "open a file exec writes",
            source: e.into(),
        },
    })?;
    let meta = file
        .metadata()
        .map_err(ExecError::io("open a file exec writes"))?;
    if !meta.is_file() {
        return Err(refused("is not a regular file"));
    }
    if meta.nlink() != 1 {
        return Err(refused("has other names (a hard link)"));
    }
    file.set_len(0)
        .map_err(ExecError::io("empty a file exec writes"))?;
    Ok(file)
}

const REPORT: &str = "the report";

/// `--report`'s file: opened (or made) before CMD starts, as [`open_file`] opens one, so that
/// a path exec cannot write fails before CMD runs, and its directory held open. Written at the
/// end as a new file of exec's own renamed over the name, whatever CMD left there meanwhile:
/// it may have removed the file and put its own at the path, or written into a file of its
/// user's that was there before the run; what a gate reads there is exec's report.
pub struct ReportFile {
    dir: OwnedFd,
    name: OsString,
    path: PathBuf,
}

impl ReportFile {
    pub fn open(path: &Path) -> Result<ReportFile, ExecError> {
        // Made absolute now, from the working directory's path at the start: a relative path
        // walked again at the end would start from the working directory itself, which CMD
        // may have moved (it is the held directory, or on the way to it), and would lead to
        // the held directory wherever it went while a directory of CMD's holds the path.
        let path = std::path::absolute(path).map_err(ExecError::io("find the report's path"))?;
        let (dir, name) = open_dir(&path, REPORT)?;
        open_file(&dir, &name, &path, REPORT)?;
        Ok(ReportFile { dir, name, path })
    }

    /// Writes `text` as the report at its path. A directory on the way moved during the run
    /// (the path no longer leads to the directory held) is an error that says the report is
    /// not there: what is there is CMD's.
    pub fn write(self, text: &str) -> Result<(), ExecError> {
        let (reached, _) = open_dir(&self.path, REPORT).map_err(|_| {
            self.moved("its path no longer leads to a directory without symbolic links")
        })?;
        let held =
            fstat(self.dir.as_fd()).map_err(ExecError::sys("read the report's directory"))?;
        let now = fstat(reached.as_fd()).map_err(ExecError::sys("read the report's directory"))?;
        if (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino) {
            return Err(self.moved("its directory was moved during the run"));
        }
        // A name CMD cannot guess ahead: a file it put at a predictable one would make the
        // exclusive create fail, and the report would not be written.
        let mut nonce = [0u8; 8];
        getrandom::fill(&mut nonce)
            .map_err(|e| ExecError::Refused(format!("no randomness for the report: {e}")))?;
        let mut beside = OsString::from(".");
        beside.push(&self.name);
        beside.push(format!(".{:016x}.tmp", u64::from_ne_bytes(nonce)));
        let written = openat(
            self.dir.as_fd(),
            beside.as_os_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o644),
        )
        .map(File::from)
        .map_err(ExecError::sys("make the report"))
        .and_then(|mut file| {
            file.write_all(text.as_bytes())
                .map_err(ExecError::io("write the report"))?;
            renameat(
                self.dir.as_fd(),
                beside.as_os_str(),
                self.dir.as_fd(),
                self.name.as_os_str(),
            )
            .map_err(ExecError::sys("rename the report into place"))
        });
        if written.is_err() {
            let _ = nix::unistd::unlinkat(
                self.dir.as_fd(),
                beside.as_os_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
        }
        written
    }

    fn moved(&self, why: &str) -> ExecError {
        ExecError::Refused(format!(
            "the report is not at {}: {why} (CMD's user may write a directory on the way); \
             what is there now is not exec's",
            self.path.display()
        ))
    }
}
