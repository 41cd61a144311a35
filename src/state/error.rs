//! What can go wrong with the state on disk, each naming the file or directory.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::lock::{LockHolder, busy_message};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot {doing} {path}: {source}")]
    Io {
        doing: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "generation {number} ({path}) is corrupt: {reason}; it is never used (`egress-fence history` lists the generations)"
    )]
    Corrupt {
        number: u64,
        path: PathBuf,
        reason: String,
    },
    #[error("{path} is corrupt: {reason}; it is never used")]
    CorruptPending { path: PathBuf, reason: String },
    #[error("there is no generation {number} in {dir}{}", available(.oldest_newest))]
    NoSuchGeneration {
        number: u64,
        dir: PathBuf,
        oldest_newest: Option<(u64, u64)>,
    },
    #[error("there is no generation before generation {newest} in {dir} to go back to")]
    NothingBefore { newest: u64, dir: PathBuf },
    #[error("no generation is recorded in {dir}")]
    NoGenerations { dir: PathBuf },
    #[error(
        "refusing {path}: it is {found}, not a regular file; egress-fence never follows links \
         or opens special files in its state directory: remove it (`rm {path}`) and try again"
    )]
    NotAFile { path: PathBuf, found: &'static str },
    #[error("refusing the state directory {path}: {reason}")]
    UnsafeDir { path: PathBuf, reason: String },
    #[error(
        "generation numbers in {dir} are used up (the newest is {newest}); move the \
         generation files elsewhere to start again from 1"
    )]
    NumbersExhausted { dir: PathBuf, newest: u64 },
    #[error("{}", busy_message(.path, .holder, *.waited))]
    LockBusy {
        path: PathBuf,
        holder: LockHolder,
        waited: Duration,
    },
}

fn available(range: &Option<(u64, u64)>) -> String {
    match range {
        Some((oldest, newest)) if oldest == newest => format!(" (it holds generation {oldest})"),
        Some((oldest, newest)) => format!(" (it holds generations {oldest} to {newest})"),
        None => " (it holds none)".to_string(),
    }
}

pub(super) fn io_error<'a>(
    doing: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> StateError + 'a {
    move |source| StateError::Io {
        doing,
        path: path.to_owned(),
        source,
    }
}
