//! What has been applied, on disk: generations, the writers' lock, the pending confirmation.
//!
//! Each network namespace has a directory of its own below the state directory (default
//! [`DEFAULT_STATE_DIR`]): `host` for the namespace egress-fence runs in, `netns-NAME` for a
//! named one (`ip netns`), `netns-ino-INODE` for one given as a path. In it:
//!
//! - `gen-000042.json`: one [`Generation`] per applied policy, rollback or revert: the policy
//!   text, what its names resolved to, the [`Ruleset`] value and its nft text. Written
//!   atomically (temporary file, fsync, rename, fsync of the directory), so a crash or a full
//!   disk leaves the old record or the new one, never half of one; the last N are kept.
//! - `lock`: the writers' lock (an exclusive `flock`), with the holder's pid and command in it.
//!   The kernel releases it when its holder dies, so a dead holder's lock is simply taken.
//! - `pending-confirm.json`: a change that reverts by itself unless confirmed.
//! - `revert-timer.log`: what revert timers did.
//!
//! A file that does not read back as what was written (torn, edited, truncated) is reported
//! with its path and never used.
//!
//! Nothing found in the directory is trusted for what its name says: every file is opened
//! without following a symbolic link and without blocking (`O_NOFOLLOW | O_NONBLOCK`) and
//! used only if `fstat` says it is a regular file, so a link planted as `lock` cannot make a
//! writer truncate the file it points to, and a FIFO named like a generation cannot hang a
//! reader. The directory itself (and the state directory above it) must belong to root or to
//! the user egress-fence runs as, and must not be writable by group or others; as root, a
//! directory that only root can reach (systemd's `/var/lib/private` of `DynamicUser=`) may
//! belong to another user. Generation numbers never wrap: past `u64::MAX` is an error.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use crate::core::resolution::Resolution;
use crate::core::ruleset::Ruleset;
use crate::netns::Netns;

pub const DEFAULT_STATE_DIR: &str = "/var/lib/egress-fence";
/// How many generations are kept unless `--keep` says otherwise.
pub const DEFAULT_KEEP: usize = 10;

/// Test-only fault injection: with this variable set to `1`, the process kills itself
/// (SIGKILL: no cleanup, no core) after writing and syncing a generation's temporary file and
/// before renaming it into place, as a crash or power cut at that moment would. Only the
/// integration tests set it.
pub const CRASH_BEFORE_RENAME_ENV: &str = "EGRESS_FENCE_TEST_CRASH_BEFORE_RENAME";

/// The format of generation and pending files this build writes and reads.
const FORMAT: u32 = 1;
const LOCK_FILE: &str = "lock";
const PENDING_FILE: &str = "pending-confirm.json";
pub const REVERT_TIMER_LOG: &str = "revert-timer.log";
/// Where `ip netns add NAME` keeps its namespaces (a path there is the name).
const NETNS_RUN_DIR: &str = "/run/netns";
/// How often a waiting writer tries the lock again.
const LOCK_POLL: Duration = Duration::from_millis(50);

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

fn io_error<'a>(doing: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StateError + 'a {
    move |source| StateError::Io {
        doing,
        path: path.to_owned(),
        source,
    }
}

// ---- files and directories that may have been tampered with -------------------------------

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
fn open_regular(path: &Path, options: &mut OpenOptions) -> Result<File, StateError> {
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
fn read_regular(path: &Path) -> Result<String, StateError> {
    let mut file = open_regular(path, OpenOptions::new().read(true))?;
    let mut text = String::new();
    file.read_to_string(&mut text)
        .map_err(io_error("read", path))?;
    Ok(text)
}

/// Whether `err` is "the file does not exist".
fn is_not_found(err: &StateError) -> bool {
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
fn check_dir(dir: &Path) -> Result<(), StateError> {
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

// ---- where ----------------------------------------------------------------------------------

/// The name of a namespace's directory below the state directory: `host` without `--netns`,
/// `netns-NAME` for a named namespace (also when given as /run/netns/NAME), and
/// `netns-ino-INODE` for any other path (the inode of the namespace file names the namespace
/// while it lives; a process's /proc/PID/ns/net does not outlive it).
pub fn namespace_dir_name(netns: Option<&Netns>) -> Result<String, StateError> {
    let Some(ns) = netns else {
        return Ok("host".to_string());
    };
    let name = ns.name.clone().or_else(|| {
        (ns.path.parent() == Some(Path::new(NETNS_RUN_DIR)))
            .then(|| ns.path.file_name()?.to_str().map(str::to_string))
            .flatten()
    });
    match name {
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

/// One namespace's directory of generations, lock and pending confirmation.
#[derive(Debug, Clone)]
pub struct StateDir {
    dir: PathBuf,
}

// ---- generations ----------------------------------------------------------------------------

/// The command that recorded a generation (the `command` field of its file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recorder {
    /// `egress-fence apply`.
    Apply,
    /// `egress-fence rollback`: an earlier generation reinstated.
    Rollback,
    /// A revert timer: an unconfirmed change undone.
    Revert,
    /// `egress-fence run`, at start and on each reload (its resolved sets change all the time).
    Run,
}

impl Recorder {
    pub fn name(self) -> &'static str {
        match self {
            Recorder::Apply => "apply",
            Recorder::Rollback => "rollback",
            Recorder::Revert => "revert",
            Recorder::Run => "run",
        }
    }
}

/// What a generation is made of, before it has a number.
#[derive(Debug, Clone)]
pub struct NewGeneration {
    pub command: Recorder,
    /// For a rollback or revert: the generation it reinstated.
    pub source_generation: Option<u64>,
    pub policy_path: PathBuf,
    pub policy_text: String,
    pub resolution: Resolution,
    pub ruleset: Ruleset,
}

impl NewGeneration {
    /// `generation` reinstated by `command`: the same policy, resolution and ruleset.
    pub fn reinstating(generation: &Generation, command: Recorder) -> NewGeneration {
        NewGeneration {
            command,
            source_generation: Some(generation.generation),
            policy_path: generation.policy_path.clone(),
            policy_text: generation.policy_text.clone(),
            resolution: generation.resolution.clone(),
            ruleset: generation.ruleset.clone(),
        }
    }
}

/// One applied table, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Generation {
    pub format: u32,
    pub generation: u64,
    /// RFC 3339, UTC.
    pub time: String,
    pub uid: u32,
    pub command: Recorder,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_generation: Option<u64>,
    pub policy_path: PathBuf,
    pub policy_text: String,
    pub resolution: Resolution,
    pub ruleset: Ruleset,
    /// The ruleset as nft text, for reading; it must be the rendering of `ruleset`.
    pub nft: String,
}

impl Generation {
    /// What the generation is, for lists: "apply", "rollback to 3", "revert to 6".
    pub fn describe(&self) -> String {
        match self.source_generation {
            Some(from) => format!("{} to {from}", self.command.name()),
            None => self.command.name().to_string(),
        }
    }

    pub fn rule_count(&self) -> usize {
        self.ruleset.output.len() + self.ruleset.refused.len()
    }

    /// The generation without its contents, for lists and JSON.
    pub fn summary(&self) -> GenerationSummary {
        GenerationSummary {
            generation: self.generation,
            time: self.time.clone(),
            uid: self.uid,
            command: self.command,
            source_generation: self.source_generation,
            policy_path: self.policy_path.clone(),
            rules: self.rule_count(),
            elements: self.ruleset.element_count(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GenerationSummary {
    pub generation: u64,
    pub time: String,
    pub uid: u32,
    pub command: Recorder,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_generation: Option<u64>,
    pub policy_path: PathBuf,
    pub rules: usize,
    pub elements: usize,
}

/// The file name of generation `n`.
pub fn generation_file_name(n: u64) -> String {
    format!("gen-{n:06}.json")
}

/// The generation number of a file name, if it names a generation.
pub fn parse_generation_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("gen-")?.strip_suffix(".json")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Reads a generation file's text, refusing anything that is not exactly what was written.
fn parse_generation(number: u64, text: &str) -> Result<Generation, String> {
    let generation: Generation =
        serde_json::from_str(text).map_err(|e| format!("it is not a generation record ({e})"))?;
    if generation.format != FORMAT {
        return Err(format!(
            "it has format {}, this egress-fence reads format {FORMAT}",
            generation.format
        ));
    }
    if generation.generation != number {
        return Err(format!(
            "it says it is generation {}, its name says {number}",
            generation.generation
        ));
    }
    // The text is what a reviewer reads; the value is what a rollback installs. They must
    // agree, so an edit to either one is caught.
    if generation.nft != generation.ruleset.to_nft() {
        return Err("its nft text is not the rendering of its ruleset".to_string());
    }
    Ok(generation)
}

/// One entry of the generation list: the record, or why it cannot be used.
#[derive(Debug, Clone)]
pub struct GenerationEntry {
    pub number: u64,
    pub path: PathBuf,
    pub record: Result<Generation, String>,
}

impl GenerationEntry {
    fn into_result(self) -> Result<Generation, StateError> {
        self.record.map_err(|reason| StateError::Corrupt {
            number: self.number,
            path: self.path,
            reason,
        })
    }
}

/// The generations to delete so that the `keep` newest remain, plus `protect` (the
/// generation a pending confirmation reverts to) whatever its age.
pub fn generations_to_prune(numbers: &[u64], keep: usize, protect: Option<u64>) -> Vec<u64> {
    let mut sorted = numbers.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let cut = sorted.len().saturating_sub(keep.max(1));
    sorted[..cut]
        .iter()
        .copied()
        .filter(|n| Some(*n) != protect)
        .collect()
}

// ---- the pending confirmation ---------------------------------------------------------------

/// A change that reverts by itself unless `egress-fence confirm` runs before its deadline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingConfirm {
    pub format: u32,
    /// Names this confirmation: a revert timer acts only while the file still carries it.
    pub token: String,
    /// The generation that awaits confirmation.
    pub generation: u64,
    /// What the change reverts to: a generation, or `None` for no table at all.
    pub revert_to: Option<u64>,
    /// RFC 3339, UTC, for people.
    pub deadline: String,
    /// The deadline in milliseconds since 1970 (UTC), for the timer.
    pub deadline_unix_ms: u64,
    /// The network namespace the change was applied in (its inode).
    pub netns_inode: u64,
    /// Set by the revert timer once it reverted the change: the record stays until a later
    /// `confirm`, `apply` or `rollback` takes note of it, so a late `confirm` learns it was too
    /// late even when the revert left no generation (a deleted table).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverted: Option<Reverted>,
}

/// What a revert timer did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reverted {
    /// RFC 3339, UTC.
    pub time: String,
    /// The generation recorded for the revert; `None` when the table was deleted.
    pub generation: Option<u64>,
}

/// How long past its deadline a pending confirmation is taken for abandoned (its timer died
/// with a reboot, say) rather than about to be reverted.
pub const OVERDUE_AFTER: Duration = Duration::from_secs(120);

impl PendingConfirm {
    pub fn new(
        generation: u64,
        revert_to: Option<u64>,
        deadline: SystemTime,
        netns_inode: u64,
    ) -> PendingConfirm {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        PendingConfirm {
            format: FORMAT,
            token: format!("{}-{}", std::process::id(), now.as_nanos()),
            generation,
            revert_to,
            deadline: rfc3339(deadline),
            deadline_unix_ms: deadline
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            netns_inode,
            reverted: None,
        }
    }

    /// Still waiting for `confirm` or its deadline (not reverted, not abandoned).
    pub fn is_awaiting(&self, now: SystemTime) -> bool {
        self.reverted.is_none() && !self.is_abandoned(now)
    }

    /// Whole seconds until the deadline, rounded up (0 once it passed).
    pub fn seconds_left(&self, now: SystemTime) -> u64 {
        let left = self.deadline().duration_since(now).unwrap_or_default();
        left.as_millis().div_ceil(1000) as u64
    }

    pub fn deadline(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.deadline_unix_ms)
    }

    /// Long past its deadline: its timer is gone.
    pub fn is_abandoned(&self, now: SystemTime) -> bool {
        now.duration_since(self.deadline())
            .is_ok_and(|late| late > OVERDUE_AFTER)
    }

    /// "generation 6" or "no table (the table is deleted)".
    pub fn revert_target(&self) -> String {
        match self.revert_to {
            Some(n) => format!("generation {n}"),
            None => "no table at all (the table is deleted)".to_string(),
        }
    }

    /// Where the confirmation stands, in a sentence.
    pub fn describe(&self, now: SystemTime) -> String {
        let generation = self.generation;
        if let Some(reverted) = &self.reverted {
            let what = match reverted.generation {
                Some(g) => format!(
                    "reverted to {} (recorded as generation {g})",
                    self.revert_target()
                ),
                None => "reverted: the table was deleted (there was no earlier generation)".into(),
            };
            format!(
                "generation {generation} was not confirmed by {}: {what} at {}",
                self.deadline, reverted.time
            )
        } else if self.is_abandoned(now) {
            format!(
                "generation {generation} awaited confirmation until {}, but no revert timer acted \
                 on it (was the host restarted?); it stays unless you roll back",
                self.deadline
            )
        } else {
            format!(
                "generation {generation} awaits confirmation: it reverts to {} at {} (in {} s) \
                 unless `egress-fence confirm` runs before",
                self.revert_target(),
                clock_utc(self.deadline()),
                self.seconds_left(now)
            )
        }
    }
}

// ---- the lock -------------------------------------------------------------------------------

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

// ---- the directory --------------------------------------------------------------------------

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

    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The Unix socket where a running DNS guard streams the queries it refuses (one
    /// [`crate::watch::QueryEvent`] JSON object per line) to `watch`.
    pub fn guard_events(&self) -> PathBuf {
        self.file("guard-events.sock")
    }

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

    /// Every generation file, oldest first, each read and checked.
    pub fn generations(&self) -> Result<Vec<GenerationEntry>, StateError> {
        let mut entries: Vec<GenerationEntry> = self
            .generation_numbers()?
            .into_iter()
            .map(|number| self.entry(number))
            .collect();
        entries.sort_by_key(|e| e.number);
        Ok(entries)
    }

    /// The numbers of the generation files, ascending (the files are not read).
    pub fn generation_numbers(&self) -> Result<Vec<u64>, StateError> {
        self.check()?;
        let listing = match fs::read_dir(&self.dir) {
            Ok(listing) => listing,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_error("list", &self.dir)(e)),
        };
        let mut numbers = Vec::new();
        for entry in listing {
            let entry = entry.map_err(io_error("list", &self.dir))?;
            if let Some(n) = entry
                .file_name()
                .to_str()
                .and_then(parse_generation_file_name)
            {
                numbers.push(n);
            }
        }
        numbers.sort_unstable();
        Ok(numbers)
    }

    fn entry(&self, number: u64) -> GenerationEntry {
        let path = self.file(&generation_file_name(number));
        let record = read_regular(&path)
            .map_err(|e| match e {
                StateError::Io { source, .. } => format!("cannot read it ({source})"),
                other => format!("cannot read it: {other}"),
            })
            .and_then(|text| parse_generation(number, &text));
        GenerationEntry {
            number,
            path,
            record,
        }
    }

    /// Generation `number`, checked; a corrupt one is an error naming its file.
    pub fn load(&self, number: u64) -> Result<Generation, StateError> {
        let numbers = self.generation_numbers()?;
        if !numbers.contains(&number) {
            return Err(StateError::NoSuchGeneration {
                number,
                dir: self.dir.clone(),
                oldest_newest: numbers.first().zip(numbers.last()).map(|(a, b)| (*a, *b)),
            });
        }
        self.entry(number).into_result()
    }

    /// The newest generation, checked (`None` when there is none).
    pub fn newest(&self) -> Result<Option<Generation>, StateError> {
        match self.generation_numbers()?.last() {
            Some(&n) => self.entry(n).into_result().map(Some),
            None => Ok(None),
        }
    }

    /// The generation before the newest one: what a plain `rollback` reinstates.
    pub fn before_newest(&self) -> Result<Generation, StateError> {
        let numbers = self.generation_numbers()?;
        match numbers.as_slice() {
            [] => Err(StateError::NoGenerations {
                dir: self.dir.clone(),
            }),
            [only] => Err(StateError::NothingBefore {
                newest: *only,
                dir: self.dir.clone(),
            }),
            [.., previous, _] => self.entry(*previous).into_result(),
        }
    }

    /// The number the next generation gets. Stable while the lock is held. A number a
    /// pending confirmation names is taken even if its generation was never recorded (its
    /// writer died after applying): the revert must not reuse it.
    pub fn next_number(&self, _lock: &WriterLock) -> Result<u64, StateError> {
        let recorded = self.generation_numbers()?.last().copied();
        let reserved = self.pending().ok().flatten().map(|p| p.generation);
        match recorded.max(reserved) {
            None => Ok(1),
            // Never wraps: 0 would be handed out again and again, each record overwriting the last.
            Some(newest) => newest
                .checked_add(1)
                .ok_or_else(|| StateError::NumbersExhausted {
                    dir: self.dir.clone(),
                    newest,
                }),
        }
    }

    /// Records a generation under the next number, then keeps only the `keep` newest (and the
    /// one a pending confirmation reverts to) and removes temporary files crashed writers left.
    pub fn record(
        &self,
        lock: &WriterLock,
        new: NewGeneration,
        keep: usize,
    ) -> Result<Generation, StateError> {
        let number = self.next_number(lock)?;
        self.record_as(lock, number, new, keep)
    }

    /// Like [`StateDir::record`], under a number taken earlier with [`StateDir::next_number`]
    /// (the one a pending confirmation reserved for this very change).
    pub fn record_as(
        &self,
        lock: &WriterLock,
        number: u64,
        new: NewGeneration,
        keep: usize,
    ) -> Result<Generation, StateError> {
        self.create()?;
        self.remove_leftovers(lock)?;
        let now = SystemTime::now();
        let nft = new.ruleset.to_nft();
        let generation = Generation {
            format: FORMAT,
            generation: number,
            time: rfc3339(now),
            uid: nix::unistd::getuid().as_raw(),
            command: new.command,
            source_generation: new.source_generation,
            policy_path: new.policy_path,
            policy_text: new.policy_text,
            resolution: new.resolution,
            ruleset: new.ruleset,
            nft,
        };
        // Written as it is encoded: a generation of 10,000 addresses is 4 MB of JSON, which
        // the daemon would otherwise hold at once on top of the ruleset (benches/daemon.rs).
        self.write_atomically_with(&generation_file_name(number), true, |file| {
            let mut out = io::BufWriter::new(file);
            serde_json::to_writer_pretty(&mut out, &generation).map_err(io::Error::from)?;
            out.flush()
        })?;
        let protect = self
            .pending()
            .ok()
            .flatten()
            .filter(|p| p.reverted.is_none())
            .and_then(|p| p.revert_to);
        for old in generations_to_prune(&self.generation_numbers()?, keep, protect) {
            let path = self.file(&generation_file_name(old));
            fs::remove_file(&path).map_err(io_error("remove the old generation", &path))?;
        }
        Ok(generation)
    }

    /// The pending confirmation, if any; a corrupt file is an error, never ignored.
    pub fn pending(&self) -> Result<Option<PendingConfirm>, StateError> {
        self.check()?;
        let path = self.file(PENDING_FILE);
        let text = match read_regular(&path) {
            Ok(text) => text,
            Err(e) if is_not_found(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
        let pending: PendingConfirm =
            serde_json::from_str(&text).map_err(|e| StateError::CorruptPending {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        if pending.format != FORMAT {
            return Err(StateError::CorruptPending {
                path,
                reason: format!("format {} is not {FORMAT}", pending.format),
            });
        }
        Ok(Some(pending))
    }

    pub fn write_pending(
        &self,
        _lock: &WriterLock,
        pending: &PendingConfirm,
    ) -> Result<(), StateError> {
        let json = serde_json::to_vec_pretty(pending).map_err(|e| StateError::Io {
            doing: "encode the pending confirmation for",
            path: self.dir.clone(),
            source: e.into(),
        })?;
        self.write_atomically(PENDING_FILE, &json, false)
    }

    /// Removes the pending confirmation; `false` if there was none.
    pub fn clear_pending(&self, _lock: &WriterLock) -> Result<bool, StateError> {
        let path = self.file(PENDING_FILE);
        match fs::remove_file(&path) {
            Ok(()) => {
                self.sync_dir()?;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_error("remove", &path)(e)),
        }
    }

    /// Where revert timers write what they do.
    pub fn revert_timer_log(&self) -> PathBuf {
        self.file(REVERT_TIMER_LOG)
    }

    /// Writes `name` so that it holds the old contents or the new ones, whatever happens:
    /// a temporary file in the same directory, written and synced, renamed over it, and the
    /// directory synced so the rename itself is durable.
    fn write_atomically(
        &self,
        name: &str,
        bytes: &[u8],
        crash_point: bool,
    ) -> Result<(), StateError> {
        self.write_atomically_with(name, crash_point, |f| f.write_all(bytes))
    }

    /// [`StateDir::write_atomically`] of what `write` writes into the file.
    fn write_atomically_with(
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

    fn sync_dir(&self) -> Result<(), StateError> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io_error("sync", &self.dir))
    }

    /// Removes temporary files of writers that died before renaming them. Only under the
    /// lock: a live writer's temporary file is never touched.
    fn remove_leftovers(&self, _lock: &WriterLock) -> Result<(), StateError> {
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

fn read_holder(file: &mut File) -> LockHolder {
    let mut text = String::new();
    let _ = file.rewind().and_then(|()| file.read_to_string(&mut text));
    LockHolder::parse(&text)
}

/// `.gen-000042.json.PID.tmp`: hidden, and never taken for a generation.
fn temporary_name(name: &str) -> String {
    format!(".{name}.{}.tmp", std::process::id())
}

fn is_temporary_name(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".tmp")
}

// ---- time -----------------------------------------------------------------------------------

fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Year, month, day of the proleptic Gregorian calendar for days since 1970-01-01 (Howard
/// Hinnant's civil_from_days).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `2026-01-31T12:34:56Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let secs = unix_seconds(t);
    let (year, month, day) = civil_from_days((secs / 86_400) as i64);
    format!("{year:04}-{month:02}-{day:02}T{}Z", time_of_day(secs))
}

/// `12:34:56 UTC`.
pub fn clock_utc(t: SystemTime) -> String {
    format!("{} UTC", time_of_day(unix_seconds(t)))
}

fn time_of_day(secs: u64) -> String {
    let s = secs % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    use super::*;
    use crate::core::plan::plan;
    use crate::core::policy::Policy;

    fn ruleset() -> Ruleset {
        let policy = Policy::parse(
            "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\n  - cidr: 203.0.113.0/28\n",
            Path::new("p.yaml"),
        )
        .expect("valid");
        let resolution = crate::core::plan::tests::resolution(&[("a.example", &["192.0.2.10"])]);
        plan(&policy, &resolution)
    }

    fn new_generation(command: Recorder) -> NewGeneration {
        NewGeneration {
            command,
            source_generation: None,
            policy_path: PathBuf::from("/etc/egress-fence/policy.yaml"),
            policy_text: "version: 1\n".into(),
            resolution: Resolution {
                resolvers: vec![],
                hosts: vec![],
                guard_uid: None,
            },
            ruleset: ruleset(),
        }
    }

    fn temp_state() -> (tempfile::TempDir, StateDir) {
        let root = tempfile::tempdir().expect("tempdir");
        let state = StateDir::new(root.path(), "host");
        (root, state)
    }

    fn lock(state: &StateDir) -> WriterLock {
        state
            .lock("test", Duration::from_secs(1), |_| {})
            .expect("lock")
    }

    #[test]
    fn generation_file_names_round_trip_and_reject_lookalikes() {
        assert_eq!(generation_file_name(42), "gen-000042.json");
        assert_eq!(generation_file_name(1_234_567), "gen-1234567.json");
        assert_eq!(parse_generation_file_name("gen-000042.json"), Some(42));
        assert_eq!(
            parse_generation_file_name("gen-1234567.json"),
            Some(1_234_567)
        );
        for other in [
            "gen-.json",
            "gen-12a.json",
            "gen-000042.json.tmp",
            ".gen-000042.json.77.tmp",
            "gen-+1.json",
            "lock",
            "pending-confirm.json",
        ] {
            assert_eq!(parse_generation_file_name(other), None, "{other}");
        }
        assert!(is_temporary_name(&temporary_name("gen-000001.json")));
        assert!(parse_generation_file_name(&temporary_name("gen-000001.json")).is_none());
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
    fn pruning_keeps_the_newest_and_the_revert_target() {
        assert_eq!(
            generations_to_prune(&[1, 2, 3], 10, None),
            Vec::<u64>::new()
        );
        assert_eq!(
            generations_to_prune(&[3, 1, 2, 5, 4], 2, None),
            vec![1, 2, 3]
        );
        assert_eq!(
            generations_to_prune(&[1, 2, 3, 4, 5], 2, Some(2)),
            vec![1, 3]
        );
        assert_eq!(
            generations_to_prune(&[1, 2], 0, None),
            vec![1],
            "at least one stays"
        );
    }

    #[test]
    fn records_round_trip_number_upwards_and_prune_to_keep() {
        let (_root, state) = temp_state();
        let lock = lock(&state);
        assert_eq!(state.next_number(&lock).unwrap(), 1);
        for _ in 0..4 {
            state
                .record(&lock, new_generation(Recorder::Apply), 3)
                .expect("record");
        }
        assert_eq!(state.generation_numbers().unwrap(), vec![2, 3, 4]);
        let newest = state.newest().unwrap().expect("a generation");
        assert_eq!(newest.generation, 4);
        assert_eq!(
            newest.ruleset,
            ruleset(),
            "the ruleset reads back as it was"
        );
        assert_eq!(newest.nft, ruleset().to_nft());
        assert!(newest.time.ends_with('Z'), "{}", newest.time);
        assert_eq!(state.before_newest().unwrap().generation, 3);
        assert!(matches!(
            state.load(1),
            Err(StateError::NoSuchGeneration {
                number: 1,
                oldest_newest: Some((2, 4)),
                ..
            })
        ));
        let mode = fs::metadata(state.path()).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700);
    }

    #[test]
    fn the_generation_a_pending_confirmation_reverts_to_is_never_pruned() {
        let (_root, state) = temp_state();
        let lock = lock(&state);
        state
            .record(&lock, new_generation(Recorder::Apply), 1)
            .unwrap();
        let pending = PendingConfirm::new(2, Some(1), SystemTime::now(), 7);
        state.write_pending(&lock, &pending).unwrap();
        // Generation 2 is never recorded (its writer died): its number stays taken.
        assert_eq!(state.next_number(&lock).unwrap(), 3);
        state
            .record(&lock, new_generation(Recorder::Apply), 1)
            .unwrap();
        state
            .record(&lock, new_generation(Recorder::Apply), 1)
            .unwrap();
        assert_eq!(state.generation_numbers().unwrap(), vec![1, 4]);
        assert_eq!(state.pending().unwrap(), Some(pending));
        assert!(state.clear_pending(&lock).unwrap());
        assert!(!state.clear_pending(&lock).unwrap());
        assert_eq!(state.pending().unwrap(), None);
    }

    #[test]
    fn corrupt_generations_are_reported_and_never_used() {
        let (_root, state) = temp_state();
        let lock = lock(&state);
        for _ in 0..3 {
            state
                .record(&lock, new_generation(Recorder::Apply), 10)
                .unwrap();
        }
        let path = |n| state.path().join(generation_file_name(n));
        // Torn: half a file.
        let text = fs::read_to_string(path(2)).unwrap();
        fs::write(path(2), &text[..text.len() / 2]).unwrap();
        // Edited: the ruleset no longer matches its text.
        let edited = fs::read_to_string(path(3))
            .unwrap()
            .replace("\"203.0.113.0/28\"", "\"0.0.0.0/0\"");
        fs::write(path(3), edited).unwrap();
        // Renamed: a record under another number.
        fs::copy(path(1), path(4)).unwrap();

        let entries = state.generations().unwrap();
        let verdicts: Vec<(u64, bool)> = entries
            .iter()
            .map(|e| (e.number, e.record.is_ok()))
            .collect();
        assert_eq!(
            verdicts,
            vec![(1, true), (2, false), (3, false), (4, false)]
        );
        assert!(
            entries[1]
                .record
                .as_ref()
                .unwrap_err()
                .contains("not a generation record")
        );
        assert!(
            entries[2]
                .record
                .as_ref()
                .unwrap_err()
                .contains("not the rendering")
        );
        assert!(
            entries[3]
                .record
                .as_ref()
                .unwrap_err()
                .contains("says it is generation 1")
        );

        let err = state.load(3).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("generation 3") && msg.contains("gen-000003.json"),
            "{msg}"
        );
        assert!(matches!(
            state.newest(),
            Err(StateError::Corrupt { number: 4, .. })
        ));
        assert!(matches!(
            state.before_newest(),
            Err(StateError::Corrupt { number: 3, .. })
        ));
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

    #[test]
    fn a_corrupt_pending_file_is_an_error() {
        let (_root, state) = temp_state();
        state.create().unwrap();
        fs::write(state.path().join(PENDING_FILE), "{").unwrap();
        let err = state.pending().unwrap_err().to_string();
        assert!(
            err.contains("pending-confirm.json") && err.contains("corrupt"),
            "{err}"
        );
    }

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

    #[test]
    fn pending_confirmations_know_when_they_are_abandoned() {
        let deadline = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let p = PendingConfirm::new(7, Some(6), deadline, 1);
        assert_eq!(p.deadline(), deadline);
        assert!(!p.is_abandoned(deadline));
        assert!(!p.is_abandoned(deadline + OVERDUE_AFTER));
        assert!(p.is_abandoned(deadline + OVERDUE_AFTER + Duration::from_secs(1)));
        assert_eq!(p.revert_target(), "generation 6");
        let early = deadline - Duration::from_secs(60);
        assert_eq!(
            p.describe(early),
            "generation 7 awaits confirmation: it reverts to generation 6 at 13:46:40 UTC (in 60 s) \
             unless `egress-fence confirm` runs before"
        );
        assert!(
            p.describe(deadline + OVERDUE_AFTER * 2)
                .contains("no revert timer acted")
        );
        let mut reverted = p.clone();
        reverted.reverted = Some(Reverted {
            time: "1970-01-12T13:46:41Z".into(),
            generation: Some(8),
        });
        assert!(!reverted.is_awaiting(early));
        assert_eq!(
            reverted.describe(early),
            "generation 7 was not confirmed by 1970-01-12T13:46:40Z: reverted to generation 6 \
             (recorded as generation 8) at 1970-01-12T13:46:41Z"
        );
        assert!(
            PendingConfirm::new(1, None, deadline, 1)
                .revert_target()
                .contains("deleted")
        );
    }

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
    fn generation_numbers_never_wrap() {
        let (_root, state) = temp_state();
        let lock = lock(&state);
        fs::write(state.path().join(generation_file_name(u64::MAX)), "{}").unwrap();
        let err = state.next_number(&lock).unwrap_err();
        assert!(
            matches!(
                err,
                StateError::NumbersExhausted {
                    newest: u64::MAX,
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            state
                .record(&lock, new_generation(Recorder::Apply), 10)
                .is_err()
        );
        assert!(!state.path().join(generation_file_name(0)).exists());
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

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400 + 3_723); // 2000-02-29 01:02:03
        assert_eq!(rfc3339(t), "2000-02-29T01:02:03Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_767_225_599); // last second of 2025
        assert_eq!(rfc3339(t), "2025-12-31T23:59:59Z");
        assert_eq!(clock_utc(t), "23:59:59 UTC");
    }
}
