//! Where `run --record FILE` and `learn` write their trace ([`crate::core::trace`]): a file
//! opened once, without following a symbolic link, readable by root alone (it names hosts and
//! uids), appended to by a thread of its own so that neither the guard nor the daemon's loop
//! ever waits for the disk.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, SystemTime};

use tracing::error;

use crate::core::time::rfc3339_millis_at;
use crate::core::trace::{Record, VERSION};

#[derive(Debug, thiserror::Error)]
pub enum TraceFileError {
    #[error("cannot open the trace {}: {source}{}", path.display(), hint(source))]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the trace {} is not a regular file: give a file's path", path.display())]
    NotAFile { path: PathBuf },
    #[error(
        "{} belongs to uid {uid}, not to this user: its owner could read it, change its mode \
         and write into it; give a path of your own (or remove the file)",
        path.display()
    )]
    NotOurs { path: PathBuf, uid: u32 },
    #[error(
        "the trace {} has {links} names (hard links): appending to it, or making it 0600, would \
         change another file too; give a path of your own (or remove the file)",
        path.display()
    )]
    Linked { path: PathBuf, links: u64 },
    #[error("cannot start the trace writer: {0}")]
    Thread(std::io::Error),
}

fn hint(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::ELOOP) => " (it is a symbolic link: the trace is never written through one)",
        _ => "",
    }
}

/// Opens `path` for appending (made with mode 0600 if missing; an existing file is made 0600
/// too): never through a symbolic link, never a FIFO or device, never a file of another
/// user's (see [`refuse_foreign`]). Open for reading too: `learn` reads back what it wrote
/// through this file (a clone of it), not through the path, which whoever can write in the
/// directory could point at another file meanwhile.
pub fn open_append(path: &Path) -> Result<File, TraceFileError> {
    let open = |e| TraceFileError::Open {
        path: path.to_owned(),
        source: e,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(open)?;
    let meta = file.metadata().map_err(open)?;
    if !meta.is_file() {
        return Err(TraceFileError::NotAFile {
            path: path.to_owned(),
        });
    }
    refuse_foreign(&meta, path)?;
    // A second name (a hard link made at the path, which `fs.protected_hardlinks=0` lets
    // anyone make to a file they do not own): the records and the chmod would land in that
    // file, the host's policy for one.
    if meta.nlink() != 1 {
        return Err(TraceFileError::Linked {
            path: path.to_owned(),
            links: meta.nlink(),
        });
    }
    if meta.permissions().mode() & 0o077 != 0 {
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(open)?;
    }
    Ok(file)
}

/// Refuses a file (`meta`, of `path`) that belongs to another user than this process's
/// effective one. Whoever made the file (an agent that could write in the directory, before
/// the run) owns it whatever mode it is given, and may hold it open: it could read the trace,
/// write records into it, or edit a learned policy after it is written and before it is
/// reviewed.
pub fn refuse_foreign(meta: &std::fs::Metadata, path: &Path) -> Result<(), TraceFileError> {
    let me = nix::unistd::geteuid().as_raw();
    match meta.uid() {
        uid if uid == me => Ok(()),
        uid => Err(TraceFileError::NotOurs {
            path: path.to_owned(),
            uid,
        }),
    }
}

enum Message {
    Line(String),
    Close(mpsc::SyncSender<()>),
}

/// The records waiting for the writer at most: a disk slower than what an agent makes the
/// run record loses records (counted), never grows the daemon (a name line with 64 addresses
/// is some 3 KB: 50 MB at most). The writer drains it every 50 ms: 300,000 records a second.
const QUEUE: usize = 16_384;
/// A run's trace grows by at most this much (what an agent can make it write is unbounded:
/// every flow it opens and every name it asks); past it records are counted, not written.
/// About 800,000 records: `learn` and `replay` read a whole trace into memory.
pub const MAX_TRACE_BYTES: u64 = 128 << 20;

/// A handle on the trace: cheap to clone, each record sent to the writer thread. Records
/// sent after [`TraceSink::finish`] are dropped.
#[derive(Clone)]
pub struct TraceSink {
    tx: mpsc::SyncSender<Message>,
    lost: Arc<AtomicU64>,
}

impl std::fmt::Debug for TraceSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TraceSink")
    }
}

impl TraceSink {
    /// Starts the writer on `file` and writes the `start` line.
    pub fn start(
        file: File,
        mode: &str,
        policy: &Path,
        audit: bool,
    ) -> Result<TraceSink, TraceFileError> {
        TraceSink::start_capped(file, mode, policy, audit, MAX_TRACE_BYTES)
    }

    fn start_capped(
        file: File,
        mode: &str,
        policy: &Path,
        audit: bool,
        max_bytes: u64,
    ) -> Result<TraceSink, TraceFileError> {
        let (tx, rx) = mpsc::sync_channel::<Message>(QUEUE);
        let lost = Arc::new(AtomicU64::new(0));
        let writer = Writer {
            out: BufWriter::new(file),
            room: max_bytes,
            lost: lost.clone(),
            broken: false,
            unflushed: 0,
        };
        std::thread::Builder::new()
            .name("trace-writer".into())
            .spawn(move || writer.run(rx))
            .map_err(TraceFileError::Thread)?;
        let sink = TraceSink { tx, lost };
        sink.record(Record::Start {
            time: now(),
            version: VERSION,
            mode: mode.into(),
            policy: policy.display().to_string(),
            audit,
        });
        Ok(sink)
    }

    /// Queues `record` without waiting: the guard and the daemon never wait for the disk.
    pub fn record(&self, record: Record) {
        match self.tx.try_send(Message::Line(record.to_line())) {
            Ok(()) => {}
            Err(mpsc::TrySendError::Full(_)) => {
                self.lost.fetch_add(1, Ordering::Relaxed);
            }
            // The writer gone (the trace finished, or its thread died) loses the line.
            Err(mpsc::TrySendError::Disconnected(_)) => {}
        }
    }

    /// Counts a record that never reached the sink (the kernel dropped log messages when
    /// the reader fell behind: at least one): the `end` line says so.
    pub fn lost_one(&self) {
        self.lost.fetch_add(1, Ordering::Relaxed);
    }

    /// Has the writer write the `end` line (with what was lost), and returns once everything
    /// sent before is on disk.
    pub fn finish(&self) {
        let (done_tx, done_rx) = mpsc::sync_channel(1);
        if self.tx.send(Message::Close(done_tx)).is_ok() {
            let _ = done_rx.recv();
        }
    }
}

/// The time of a record, as the trace writes it.
pub fn now() -> String {
    rfc3339_millis_at(SystemTime::now())
}

/// How long the writer lets lines gather once it has written some: while records keep coming,
/// a send finds the writer asleep, not waiting, and wakes nobody (a wake-up per answer was
/// most of what `learn` added to an answer's latency). A killed run loses at most this much.
const GATHER: Duration = Duration::from_millis(50);

struct Writer {
    out: BufWriter<File>,
    /// Bytes the trace may still grow by.
    room: u64,
    /// Records not written: dropped by a full queue (counted by the senders), past the cap,
    /// or after a write failed.
    lost: Arc<AtomicU64>,
    /// A write failed: nothing more is written but the `end` line.
    broken: bool,
    /// Lines written into the buffer since it was last written out.
    unflushed: u64,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Message>) {
        // Idle, the writer waits for the next record (its send wakes it).
        while let Ok(first) = rx.recv() {
            let mut next = Some(first);
            loop {
                while let Some(message) = next.take().or_else(|| rx.try_recv().ok()) {
                    match message {
                        Message::Line(line) => self.line(&line),
                        Message::Close(done) => {
                            self.end();
                            let _ = done.send(());
                            return;
                        }
                    }
                }
                self.flush();
                std::thread::sleep(GATHER);
                match rx.try_recv() {
                    Ok(message) => next = Some(message),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            }
        }
        let _ = self.out.flush();
    }

    fn line(&mut self, line: &str) {
        let len = line.len() as u64 + 1;
        if self.broken || len > self.room {
            self.lost.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.room -= len;
        match writeln!(self.out, "{line}") {
            Ok(()) => self.unflushed += 1,
            Err(e) => {
                self.lost.fetch_add(1, Ordering::Relaxed);
                self.fail(e);
            }
        }
    }

    /// Writes out what the buffer holds; if that fails, its lines are lost too.
    fn flush(&mut self) {
        if self.broken {
            return;
        }
        match self.out.flush() {
            Ok(()) => self.unflushed = 0,
            Err(e) => self.fail(e),
        }
    }

    /// A write failed (a full disk): from now on every record is counted as lost, and the
    /// `end` line is still tried, since the disk may have room again by then.
    fn fail(&mut self, e: std::io::Error) {
        error!(error = %e, "the trace can no longer be written; records are counted as lost");
        self.broken = true;
        // What the buffer held may or may not have reached the file: counted as lost.
        self.lost.fetch_add(self.unflushed, Ordering::Relaxed);
        self.unflushed = 0;
    }

    /// The `end` line, past the cap too: it says how many records were lost.
    fn end(&mut self) {
        let end = Record::End {
            time: now(),
            lost: self.lost.load(Ordering::Relaxed),
        };
        if let Err(e) = writeln!(self.out, "{}", end.to_line()).and_then(|()| self.out.flush()) {
            error!(error = %e, "the trace's end line could not be written");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::trace::Trace;

    fn flow(dport: u16) -> Record {
        Record::Flow {
            time: now(),
            family: "ipv4".into(),
            protocol: "tcp".into(),
            dst: "192.0.2.1".parse().unwrap(),
            dport: Some(dport),
            uid: Some(1001),
            iif: None,
        }
    }

    #[test]
    fn a_trace_is_written_whole_with_mode_0600_and_never_through_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        let sink = TraceSink::start(
            open_append(&path).unwrap(),
            "guard",
            Path::new("p.yaml"),
            true,
        )
        .unwrap();
        for i in 0..100u16 {
            sink.record(flow(i));
        }
        sink.finish();
        sink.record(Record::End {
            time: now(),
            lost: 0,
        });
        let text = std::fs::read_to_string(&path).unwrap();
        let trace = Trace::parse(&text).unwrap();
        assert_eq!(
            trace.records.len(),
            102,
            "start, 100 flows, end; nothing after"
        );
        assert!(matches!(
            trace.records[0],
            Record::Start { audit: true, .. }
        ));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);

        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let e = open_append(&link).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        let e = open_append(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("cannot open") || e.contains("not a regular"),
            "{e}"
        );
        // A hard link to another file: refused, that file untouched (neither its text nor
        // its mode).
        let other = dir.path().join("policy.yaml");
        std::fs::write(&other, "version: 1\n").unwrap();
        std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o644)).unwrap();
        let hard = dir.path().join("hard.jsonl");
        std::fs::hard_link(&other, &hard).unwrap();
        let e = open_append(&hard).unwrap_err().to_string();
        assert!(e.contains("hard links"), "{e}");
        assert_eq!(std::fs::read_to_string(&other).unwrap(), "version: 1\n");
        let mode = std::fs::metadata(&other).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644);
    }

    #[test]
    fn a_trace_made_by_another_user_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        // Made by someone else, open for writing, before the run.
        let theirs = std::fs::File::create(&path).unwrap();
        let other = nix::unistd::geteuid().as_raw().wrapping_add(1);
        if let Err(e) = std::os::unix::fs::fchown(&theirs, Some(other), None) {
            // Only root can give a file away; the refusal is the same either way.
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
            return;
        }
        let e = open_append(&path).unwrap_err().to_string();
        assert!(e.contains(&format!("belongs to uid {other}")), "{e}");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    }

    #[test]
    fn past_its_cap_a_trace_counts_what_it_loses_and_still_ends() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("capped.jsonl");
        let sink = TraceSink::start_capped(
            open_append(&path).unwrap(),
            "guard",
            Path::new("p.yaml"),
            false,
            1000,
        )
        .unwrap();
        for i in 0..100u16 {
            sink.record(flow(i));
        }
        // Two the kernel dropped before the reader saw them.
        sink.lost_one();
        sink.lost_one();
        sink.finish();
        let text = std::fs::read_to_string(&path).unwrap();
        let trace = Trace::parse(&text).unwrap();
        let flows = trace.records.len() - 2;
        assert!(flows > 0 && flows < 100, "{text}");
        assert!(matches!(trace.records.last(), Some(Record::End { .. })));
        assert_eq!(trace.lost(), 100 - flows as u64 + 2, "{text}");
        // The cap bounds all but the end line.
        let before_end = text.len() - text.lines().last().unwrap().len() - 1;
        assert!(before_end <= 1000, "{before_end}");
    }

    #[test]
    fn a_failing_disk_counts_every_record_it_did_not_take() {
        // /dev/full takes nothing: whatever reached the buffer and all that follows is lost.
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let lost = Arc::new(AtomicU64::new(0));
        let mut writer = Writer {
            out: BufWriter::new(full),
            room: MAX_TRACE_BYTES,
            lost: lost.clone(),
            broken: false,
            unflushed: 0,
        };
        for _ in 0..5 {
            writer.line("{\"kind\":\"end\",\"time\":\"t\"}");
        }
        writer.flush();
        assert!(writer.broken);
        for _ in 0..3 {
            writer.line("{\"kind\":\"end\",\"time\":\"t\"}");
        }
        assert_eq!(lost.load(Ordering::Relaxed), 8);
    }
}
