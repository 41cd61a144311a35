//! Files and directories that may have been tampered with: nothing found in the state
//! directory is trusted for what its name says.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use super::error::{StateError, io_error};

/// What a directory entry is, for messages.
fn kind_of(file_type: fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if file_type.is_symlink() {
        "a symbolic link"
    } else if file_type.is_dir() {
        "a directory"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_socket() {
        "a socket"
    } else if file_type.is_block_device() || file_type.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// Opens `path` (in the state directory) without following a symbolic link or blocking on a
/// FIFO, and only if it is a regular file. `NotFound` stays an `io::Error` for the caller.
pub(super) fn open_regular(path: &Path, options: &mut OpenOptions) -> Result<File, StateError> {
    let file = options
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            // O_NOFOLLOW on a link: ELOOP.
            Some(libc::ELOOP) => StateError::NotAFile {
                path: path.to_owned(),
                found: "a symbolic link",
            },
            _ => io_error("open", path)(e),
        })?;
    let meta = file.metadata().map_err(io_error("inspect", path))?;
    if !meta.file_type().is_file() {
        return Err(StateError::NotAFile {
            path: path.to_owned(),
            found: kind_of(meta.file_type()),
        });
    }
    Ok(file)
}

/// Reads a whole regular file of the state directory (see [`open_regular`]).
pub(super) fn read_regular(path: &Path) -> Result<String, StateError> {
    let mut file = open_regular(path, OpenOptions::new().read(true))?;
    let mut text = String::new();
    file.read_to_string(&mut text)
        .map_err(io_error("read", path))?;
    Ok(text)
}

/// Whether `err` is "the file does not exist".
pub(super) fn is_not_found(err: &StateError) -> bool {
    matches!(err, StateError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
}

/// Why a directory with this owner and mode may not hold state for a process of `euid`, or
/// `None` when it may. `only_root_reaches` says whether an ancestor keeps everyone but root
/// out (systemd's /var/lib/private for `DynamicUser=`).
fn unsafe_dir_reason(owner: u32, mode: u32, euid: u32, only_root_reaches: bool) -> Option<String> {
    if owner != 0 && owner != euid && !(euid == 0 && only_root_reaches) {
        return Some(format!(
            "it belongs to uid {owner}, not to root or to uid {euid} (this process), so that \
             user could plant what egress-fence installs; `chown {euid}` it or use another \
             --state-dir"
        ));
    }
    if mode & 0o022 != 0 {
        return Some(format!(
            "its mode {:o} lets group or others write to it; `chmod go-w` it",
            mode & 0o7777
        ));
    }
    None
}

/// Whether some ancestor of `dir` is root's and closed to everyone else (mode without any
/// group or other bits): then only root can reach `dir`, whoever owns it.
fn only_root_reaches(dir: &Path) -> bool {
    let Ok(real) = fs::canonicalize(dir) else {
        return false;
    };
    real.ancestors()
        .skip(1)
        .any(|a| fs::metadata(a).is_ok_and(|m| m.uid() == 0 && m.mode() & 0o077 == 0))
}

/// Refuses a state directory that someone else could write to (see [`unsafe_dir_reason`]).
/// A directory that does not exist yet is fine: writers create it.
pub(super) fn check_dir(dir: &Path) -> Result<(), StateError> {
    let meta = match fs::metadata(dir) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error("inspect", dir)(e)),
    };
    if !meta.is_dir() {
        return Err(StateError::UnsafeDir {
            path: dir.to_owned(),
            reason: "it is not a directory".into(),
        });
    }
    let euid = nix::unistd::geteuid().as_raw();
    // Walking the ancestors is needed only for root looking at another user's directory.
    let foreign = meta.uid() != 0 && meta.uid() != euid;
    let only_root = euid == 0 && foreign && only_root_reaches(dir);
    match unsafe_dir_reason(meta.uid(), meta.mode(), euid, only_root) {
        Some(reason) => Err(StateError::UnsafeDir {
            path: dir.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_support::*;
    use std::os::unix::fs::PermissionsExt;
    use std::time::Duration;

    use crate::state::lock::LOCK_FILE;
    use crate::state::pending::PENDING_FILE;
    use crate::state::*;

    #[test]
    fn a_symlinked_lock_is_refused_and_its_target_left_alone() {
        let (root, state) = temp_state();
        state.create().unwrap();
        let victim = root.path().join("victim");
        fs::write(&victim, "precious\n").unwrap();
        std::os::unix::fs::symlink(&victim, state.path().join(LOCK_FILE)).unwrap();
        let err = state
            .lock("apply", Duration::from_secs(1), |_| {})
            .unwrap_err();
        assert!(
            matches!(
                &err,
                StateError::NotAFile {
                    found: "a symbolic link",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("/lock"), "{err}");
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious\n");
    }

    #[test]
    fn special_files_named_like_state_are_refused_without_blocking() {
        let (_root, state) = temp_state();
        let lock = lock(&state);
        state
            .record(&lock, new_generation(Recorder::Apply), 10)
            .unwrap();
        let fifo = state.path().join(generation_file_name(2));
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let entries = state.generations().unwrap();
        assert_eq!(entries.len(), 2);
        let why = entries[1].record.as_ref().unwrap_err();
        assert!(why.contains("a FIFO"), "{why}");
        assert!(matches!(
            state.newest(),
            Err(StateError::Corrupt { number: 2, .. })
        ));
        nix::unistd::mkfifo(
            &state.path().join(PENDING_FILE),
            nix::sys::stat::Mode::S_IRWXU,
        )
        .unwrap();
        assert!(matches!(
            state.pending(),
            Err(StateError::NotAFile {
                found: "a FIFO",
                ..
            })
        ));
    }

    #[test]
    fn directories_others_could_write_to_are_refused() {
        assert_eq!(unsafe_dir_reason(0, 0o40700, 0, false), None);
        assert_eq!(unsafe_dir_reason(1000, 0o40755, 1000, false), None);
        assert_eq!(unsafe_dir_reason(0, 0o40755, 1000, false), None);
        let other = unsafe_dir_reason(1000, 0o40700, 0, false).unwrap();
        assert!(
            other.contains("uid 1000") && other.contains("chown"),
            "{other}"
        );
        // systemd's DynamicUser= directory below /var/lib/private (root's, 0700).
        assert_eq!(unsafe_dir_reason(61234, 0o40700, 0, true), None);
        assert!(unsafe_dir_reason(61234, 0o40700, 1000, true).is_some());
        let writable = unsafe_dir_reason(0, 0o40770, 0, false).unwrap();
        assert!(
            writable.contains("770") && writable.contains("chmod go-w"),
            "{writable}"
        );
        assert!(unsafe_dir_reason(0, 0o41777, 0, false).is_some());

        let (root, state) = temp_state();
        state.create().unwrap();
        fs::set_permissions(state.path(), fs::Permissions::from_mode(0o777)).unwrap();
        let err = state.generation_numbers().unwrap_err().to_string();
        assert!(err.contains(&state.path().display().to_string()), "{err}");
        fs::set_permissions(state.path(), fs::Permissions::from_mode(0o700)).unwrap();
        fs::set_permissions(root.path(), fs::Permissions::from_mode(0o757)).unwrap();
        assert!(
            state.pending().is_err(),
            "the state directory above is checked too"
        );
    }
}
