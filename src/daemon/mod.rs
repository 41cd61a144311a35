//! `egress-fence run`: apply the policy, then follow each name's answers as they change.
//!
//! A name is re-resolved after its answer's TTL (clamped to `dns.refresh`). Addresses it
//! answers are added to, or renewed in, the resolved sets with an element timeout of that
//! interval plus `dns.grace`, in one small batch per refresh; the table is never reloaded for
//! it. An address no longer answered is simply not renewed: the kernel drops it when its
//! timeout runs out, which also bounds what a dead daemon leaves open. Deleting elements
//! instead would race that expiry (deleting an expired element fails the whole batch).
//!
//! Failures never open anything: a failing resolver leaves the last good addresses to their
//! timeouts and is retried with backoff; a policy that fails validation on SIGHUP, or whose
//! table the kernel refuses, is refused whole and the running one stays. When anyone else
//! changes the table (`nft flush ruleset`), the change notification brings it back at once.
//! A start that cannot put up the policy's table leaves a namespace without one the fixed
//! fail-closed table ([`crate::core::plan::fail_closed`]) before it exits.
//!
//! The daemon holds the namespace's writers' lock for its whole life: a CLI `apply` beside
//! it would only be undone by its healing, so such writers are told to reload the service
//! instead. It records a generation when it starts, on each reload and when its resolvers
//! appear: whenever the configuration it applies changes, never for a refresh.
//!
//! A policy with a `scope:` depends on the host as well: its listed cgroups are matched by
//! id, so one that appears, or is removed and made again (a new id, which the old rule does
//! not match), is followed with a full apply at once (inotify on the cgroup directories, and
//! a poll every 2 s for what inotify misses); one missing at start is named and fenced once
//! it appears. A scope this host opens a way past (a listed cgroup in a subtree delegated to
//! an unfenced user, a listed bridge with a port that is not a container's veth) is refused at
//! start and on reload, and whenever the poll sees one appear while running it is logged as an
//! error, each time it is seen. In guard mode the guard also listens on the listed interfaces' addresses it
//! can bind at start, for its whole life: an address that comes later is named in a warning
//! and served after a restart (a reload keeps the guard's addresses, so it is no reason to
//! refuse one).
//!
//! Its parts: `names` (what it knows of each name, and the elements that makes), `core` (its
//! decisions: `Core::on(event, now)` returns effects, writing the table through
//! [`crate::nft::Table`]) and `shell` (sockets, signals, tasks, systemd: it turns what happens
//! into events and carries out the effects). This file starts it and keeps a namespace it
//! could not start in closed.

mod core;
pub mod metrics;
mod names;
mod shell;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::{error, warn};

use crate::core::plan::Extras;
use crate::core::policy::{Policy, PolicyError};
use crate::core::ruleset::TABLE;
use crate::core::trace::Record;
use crate::dns::resolve::ResolveError;
use crate::guard::{Guard, GuardError};
use crate::nft::monitor::Monitor;
use crate::nft::{Nft, NftError, Table};
use crate::state::{StateDir, StateError, WriterLock};
use crate::trace_file::TraceSink;
use crate::watch::{Counted, DropEvent, Unlogged, WatchError, Watcher};
pub use metrics::{MetricsAddr, MetricsAddrError};
use shell::Daemon;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error(transparent)]
    Nft(#[from] NftError),
    #[error(transparent)]
    Watch(#[from] WatchError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Guard(#[from] GuardError),
    #[error(
        "--log-drops needs `log.group` in the policy: refused packets are read from that NFLOG group"
    )]
    NoLogGroup,
    /// The kernel refused the policy's table at start (where the fail-closed table can go
    /// up, only the policy is wrong: an edit fixes it, a restart does not).
    #[error(
        "the kernel refused the policy's table: {0}; no rule of this policy is in force. Fix \
         the policy (`egress-fence check` names the values the kernel refuses) and start again"
    )]
    TableRefused(#[source] NftError),
    #[error("{error}; the fail-closed table could not be put up either: {skeleton}")]
    NotEvenFailClosed {
        error: Box<DaemonError>,
        skeleton: NftError,
    },
    #[error("{doing}: {source}")]
    Io {
        doing: &'static str,
        source: std::io::Error,
    },
}

fn io(doing: &'static str) -> impl FnOnce(std::io::Error) -> DaemonError {
    move |source| DaemonError::Io { doing, source }
}

pub struct Options {
    pub policy_path: PathBuf,
    /// Where the resolvers come from when the policy names none.
    pub resolv_conf: PathBuf,
    /// Delete the table when stopped by a signal (for throwaway hosts).
    pub teardown_on_exit: bool,
    /// Log every refused packet (from the policy's NFLOG group) with what the daemon knows
    /// about its destination.
    pub log_drops: bool,
    /// The namespace's state directory: its lock, and where generations are recorded.
    pub state: StateDir,
    /// How many generations to keep.
    pub keep: usize,
    /// How long to wait for another writer's lock at start.
    pub lock_timeout: Duration,
    /// Serve metrics there (`--metrics`).
    pub metrics: Option<MetricsAddr>,
    /// `run --record` and `learn`: the trace this run writes, and whether it audits.
    pub recording: Option<Recording>,
    /// Refuse a policy file that a user other than root and this process's could change
    /// ([`crate::path_trust`]), at start and on every reload: `run`, which reads it again for
    /// as long as it runs. `exec` reads it before CMD exists and ignores SIGHUP; `learn`
    /// audits, letting everything through anyway.
    pub trusted_policy_file: bool,
    /// `exec`'s run: its table refuses replies leaving anywhere but loopback
    /// ([`crate::core::ruleset::Rule::RefuseRepliesOut`]).
    pub refuse_replies: bool,
}

/// What a recording run writes and does.
pub struct Recording {
    /// Every name the guard is asked and every new flow go here.
    pub trace: TraceSink,
    /// `learn`: the table audits (see [`crate::core::plan::Audit`]), for this long.
    pub audit: Option<AuditFor>,
}

/// How long `learn` audits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuditFor {
    /// Until this much time has passed since the table went up (or a signal stops it).
    Duration(Duration),
    /// Until SIGTERM or SIGINT.
    UntilStopped,
}

impl Options {
    fn audit(&self) -> Option<AuditFor> {
        self.recording.as_ref().and_then(|r| r.audit)
    }

    fn trace(&self) -> Option<&TraceSink> {
        self.recording.as_ref().map(|r| &r.trace)
    }
}

/// Runs the daemon until SIGTERM or SIGINT. The calling thread must already be in the
/// target network namespace; the runtime is single-threaded so every socket stays there.
///
/// Whatever keeps the daemon from putting up its policy's table (an unreadable or invalid
/// policy, a table the kernel refuses, a taken port), the namespace is not left open: without
/// a table of ours, the fail-closed table goes up ([`crate::core::plan::fail_closed`]) before the
/// error is returned; a table already in place (a restart) stays as it is.
///
/// That includes a state directory or writers' lock the daemon cannot take (a directory
/// refused as unsafe, a writer that kept the lock): the boundary matters more than its
/// record, and the fail-closed table opens nothing another writer could have meant to close.
pub fn run(options: Options) -> Result<(), DaemonError> {
    let lock = match options.state.lock("run", options.lock_timeout, |holder| {
        warn!(holder = %holder, "waiting for the lock of another egress-fence writer");
    }) {
        Ok(lock) => Arc::new(lock),
        Err(error) => return Err(fail_closed(error.into())),
    };
    drop_pending_confirmation(&options.state, &lock);
    let mut boundary_up = false;
    let result = start_and_serve(options, lock.clone(), &mut boundary_up);
    match result {
        // The lock is still held here, so no other writer's table can appear meanwhile.
        Err(error) if !boundary_up => Err(fail_closed(error)),
        other => other,
    }
}

/// Reads and validates the policy file; with `trusted`, refuses it while anyone but root and
/// this process's user could change it (see [`Options::trusted_policy_file`]).
fn load_policy(path: &Path, trusted: bool) -> Result<(Policy, String), PolicyError> {
    if !trusted {
        return Policy::load_with_text(path);
    }
    // Opened before it is judged, and read only if it is the file judged.
    let euid = nix::unistd::geteuid().as_raw();
    let file = crate::path_trust::open_trusted(path, euid).map_err(|refused| match refused {
        crate::path_trust::Refused::Io(error) => PolicyError::Read {
            path: path.to_owned(),
            error,
        },
        crate::path_trust::Refused::Open(found) => PolicyError::OpenToOthers {
            path: path.to_owned(),
            found: found.to_string(),
        },
    })?;
    Policy::read_with_text(file, path)
}

fn start_and_serve(
    options: Options,
    lock: Arc<WriterLock>,
    boundary_up: &mut bool,
) -> Result<(), DaemonError> {
    let (policy, policy_text) = load_policy(&options.policy_path, options.trusted_policy_file)?;
    // `action: audit` is learn's alone, and learn needs the guard.
    match options.audit() {
        None => policy.refuse_audit(&policy_text, &options.policy_path, "run")?,
        Some(_) => policy.refuse_learn(&policy_text, &options.policy_path)?,
    }
    // A scope this host opens a way past is refused like an invalid policy: the namespace is
    // left closed (see `run`), and an edit or the host's fix and a restart put it up.
    policy.refuse_scope_holes(&policy_text, &options.policy_path, &crate::host::ThisHost)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(io("start the runtime"))?;
    let result = runtime.block_on(async move {
        // Subscribed before the first apply, so no change made after it goes unseen.
        let monitor = crate::nft::sys::async_monitor(Monitor::open()?)
            .map_err(io("watch for nftables changes"))?;
        // Subscribed before the table logs to it, so no flow goes unrecorded.
        let extras = Extras {
            refuse_replies: options.refuse_replies,
            ..Extras::of_run(
                &policy,
                options.recording.is_some(),
                options.audit().is_some(),
            )
        };
        if let (Some(group), Some(trace)) = (extras.flow_group, options.trace()) {
            record_flows(group, trace.clone())?;
        }
        let drops = match (options.log_drops, policy.log.group) {
            (false, _) => None,
            (true, Some(group)) => Some(drop_events(group)?),
            (true, None) => return Err(DaemonError::NoLogGroup),
        };
        // Bound before the table goes up, so that a taken port stops the daemon at once; the
        // queries that arrive meanwhile wait in the socket buffers.
        let (identity, guard) = match crate::host::guard_identity(&policy) {
            Some(identity) => {
                // What the policy does not name is the listed bridges'.
                let bridges: Vec<_> = identity
                    .listen
                    .iter()
                    .filter(|a| !policy.dns.guard.iter().any(|g| g.listen.contains(a)))
                    .copied()
                    .collect();
                let (guard, bound) = Guard::bind(&identity, &bridges).await?;
                (Some(bound), Some(guard))
            }
            None => (None, None),
        };
        // Bound before the table goes up too: a taken address stops the daemon at once.
        let metrics = match &options.metrics {
            Some(addr) => Some((
                metrics::bind(addr).await?,
                addr.clone(),
                Arc::new(metrics::Metrics::new(options.log_drops)),
            )),
            None => None,
        };
        let shared = metrics.as_ref().map(|(_, _, m)| m.clone());
        // Our own transactions never reach the monitor, from the first apply on.
        let nft = Nft::open()?;
        monitor.get_ref().ignore_port(nft.portid())?;
        let mut daemon = Daemon::start(
            options,
            lock,
            nft,
            policy,
            policy_text,
            identity,
            shared,
            extras,
        )
        .await?;
        *boundary_up = true;
        let answers = guard.map(|g| daemon.start_guard(g));
        let mut socket = None;
        if let Some((listener, addr, shared)) = metrics {
            if let metrics::Listener::Unix(_, path) = &listener {
                socket = Some(path.clone());
            }
            metrics::serve(listener, shared)?;
            metrics::announce(&addr);
        }
        let served = daemon.serve(monitor, drops, answers).await;
        if let Some(path) = socket {
            metrics::remove_socket(&path);
        }
        served
    });
    // A reload may still be reading its file (a FIFO nobody writes): it must not hold up
    // the exit, as dropping the runtime would.
    runtime.shutdown_timeout(Duration::from_millis(100));
    result
}

/// The daemon could not put up its boundary: unless a table of ours is in place, put up the
/// fail-closed one. Returns the error to exit with.
fn fail_closed(error: DaemonError) -> DaemonError {
    match Nft::open() {
        Ok(mut nft) => fail_closed_in(&mut nft, error),
        Err(skeleton) => DaemonError::NotEvenFailClosed {
            error: Box::new(error),
            skeleton,
        },
    }
}

/// [`fail_closed`] on `table`.
fn fail_closed_in(table: &mut dyn Table, error: DaemonError) -> DaemonError {
    let skeleton = table.table_exists().and_then(|exists| match exists {
        true => Ok(false),
        false => table
            .apply(&crate::core::plan::fail_closed())
            .map(|()| true),
    });
    match skeleton {
        Ok(true) => error!(
            error = %error,
            "the policy's table is not up; the fail-closed table is: nothing leaves but loopback \
             and established connections until a policy the kernel accepts is applied"
        ),
        Ok(false) => error!(
            error = %error,
            "the policy's table is not up; table inet {TABLE} stays as it was"
        ),
        Err(skeleton) => {
            return DaemonError::NotEvenFailClosed {
                error: Box::new(error),
                skeleton,
            };
        }
    }
    error
}

/// The service's policy replaces whatever a CLI `apply --confirm-within` left awaiting
/// confirmation: from now on the service owns the table, and a revert timer acting later would
/// fight it. The timer finds its record gone and stands down.
fn drop_pending_confirmation(state: &StateDir, lock: &WriterLock) {
    match state.pending() {
        Ok(Some(p)) if p.reverted.is_none() => warn!(
            generation = p.generation,
            "generation {} awaited confirmation; the service's policy replaces it and it will \
             not be reverted",
            p.generation
        ),
        Ok(_) => {}
        Err(e) => warn!(error = %e, "removing an unreadable pending confirmation"),
    }
    if let Err(e) = state.clear_pending(lock) {
        error!(error = %e, "cannot remove the pending confirmation");
    }
}

/// The first packet of every new flow, from NFLOG `group` ([`Rule::RecordFlow`]), written to
/// the trace by a thread of its own.
///
/// [`Rule::RecordFlow`]: crate::core::ruleset::Rule::RecordFlow
fn record_flows(group: u16, trace: TraceSink) -> Result<(), DaemonError> {
    let mut watcher = Watcher::subscribe(group)?;
    std::thread::Builder::new()
        .name("flow-record".into())
        .spawn(move || {
            loop {
                match watcher.next_event() {
                    Ok(event) => trace.record(flow_record(&event)),
                    // Flows the kernel could not queue (an overrun) or that did not parse
                    // are missing from the trace: counted, so that learn and replay say so.
                    Err(e) if e.is_transient() => {
                        warn!(error = %e, "reading new flows");
                        trace.lost_one();
                    }
                    Err(e) => {
                        error!(error = %e, "new flows are no longer recorded");
                        return;
                    }
                }
            }
        })
        .map_err(io("start the flow recorder"))?;
    Ok(())
}

/// A logged first packet as a trace's `flow` line.
fn flow_record(event: &DropEvent) -> Record {
    Record::Flow {
        time: event.time.clone(),
        family: event.family.to_string(),
        protocol: event.protocol.clone(),
        dst: event.dst,
        dport: event.dport,
        uid: event.uid,
        iif: event
            .in_ifindex
            .and_then(|i| nix::net::if_::if_indextoname(i).ok())
            .map(|name| name.to_string_lossy().into_owned()),
    }
}

/// Refused packets from NFLOG `group`, read on a thread of their own (the kernel's log rule
/// already limits their rate). The same thread reads the table's refused counters every
/// [`COUNT_UNLOGGED_EVERY`] and logs how many refused packets the table counted and never
/// logged: a sandbox that spends the log rate on decoys must not have its next refusals left
/// out of the journal in silence.
fn drop_events(group: u16) -> Result<mpsc::Receiver<DropEvent>, DaemonError> {
    let mut watcher = Watcher::subscribe(group)?;
    let refused_read = watcher.refused_read();
    let drains = watcher.drains();
    let (tx, rx) = mpsc::channel(1024);
    std::thread::Builder::new()
        .name("refused-packets".into())
        .spawn(move || {
            // A thread starts in the namespace of the one that made it: the daemon's.
            let mut counters = Nft::open()
                .inspect_err(
                    |e| warn!(error = %e, "refused packets over the log rate go uncounted"),
                )
                .ok();
            let mut unlogged = Unlogged::default();
            let mut failing = None;
            let mut next_count = Instant::now();
            // The drains when the last reading was taken: the next is taken only once this
            // thread has since found the socket empty (see `Unlogged`); a send that waited
            // on a slow event loop leaves messages of counted packets unread meanwhile.
            let mut drains_at_reading: Option<u64> = None;
            loop {
                let drained = drains_at_reading.is_none_or(|d| drains.load(Ordering::Relaxed) > d);
                if Instant::now() >= next_count && drained {
                    next_count = Instant::now() + COUNT_UNLOGGED_EVERY;
                    if let Some(nft) = counters.as_mut() {
                        let heard = refused_read.load(Ordering::Relaxed);
                        count_unlogged(nft, &mut unlogged, heard, &mut failing);
                        drains_at_reading = Some(drains.load(Ordering::Relaxed));
                    }
                }
                // At least a millisecond: a wait of none would not look at the socket, and
                // only a wait that finds it empty counts as a drain.
                let left = next_count
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                match watcher.next_event_timeout(left) {
                    Ok(Some(event)) => {
                        if tx.blocking_send(event).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {}
                    Err(e) if e.is_transient() => warn!(error = %e, "reading refused packets"),
                    Err(e) => {
                        error!(error = %e, "refused packets are no longer logged");
                        return;
                    }
                }
            }
        })
        .map_err(io("start the refused-packet reader"))?;
    Ok(rx)
}

/// How often `run --log-drops` compares the table's refused counters with what it logged.
const COUNT_UNLOGGED_EVERY: Duration = Duration::from_secs(1);

/// One reading of the table's refused counters against the `heard` refused packets: logs
/// the refused packets counted and never logged since the last such line, if any. A reading
/// that fails judges nothing (it is not taken for "no table"), and is logged when its error
/// is not the one `failing` holds, the last one logged.
fn count_unlogged(
    nft: &mut Nft,
    unlogged: &mut Unlogged,
    heard: u64,
    failing: &mut Option<String>,
) {
    match nft.refused_counters() {
        Ok(counted) => {
            *failing = None;
            let counted = counted.map(|(table, r)| Counted::new(table, r.packets()));
            if let Some(packets) = unlogged.reading(counted, heard) {
                warn!(
                    packets,
                    "refused packets not logged: the table counted them over the policy's \
                     log.rate (or logged them to another NFLOG group)"
                );
            }
        }
        Err(e) => {
            let error = e.to_string();
            if failing.as_ref() != Some(&error) {
                warn!(error = %error, "cannot read the table's refused counters");
                *failing = Some(error);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nft::table::memory::MemoryTable;

    fn refused() -> DaemonError {
        DaemonError::TableRefused(NftError::Malformed("test".into()))
    }

    #[test]
    fn a_namespace_the_daemon_could_not_start_in_is_left_closed() {
        let mut table = MemoryTable::new();
        let error = fail_closed_in(&mut table, refused());
        assert!(
            matches!(error, DaemonError::TableRefused(_)),
            "the error to exit with"
        );
        assert_eq!(table.table, Some(crate::core::plan::fail_closed()));
    }

    #[test]
    fn a_table_already_in_place_stays_as_it_was() {
        let mut running = crate::core::plan::fail_closed();
        running.refused.clear();
        let mut table = MemoryTable::holding(running);
        let before = table.table.clone();
        fail_closed_in(&mut table, refused());
        assert_eq!(table.table, before);
        assert!(table.applied.is_empty());
    }

    #[test]
    fn a_refused_fail_closed_table_is_said_so() {
        let mut table = MemoryTable::new();
        table.refuse_apply = true;
        let error = fail_closed_in(&mut table, refused());
        assert!(matches!(error, DaemonError::NotEvenFailClosed { .. }));
        assert_eq!(table.table, None);
    }
}
