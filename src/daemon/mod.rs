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

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tracing::{error, info, warn};

use crate::core::installable::{HostAddrsCache, retain_installable, summarise};
use crate::core::plan::{
    denied_answers, element_allowed, lifetime_cap, plan_with, resolved_tuple, services_of,
};
use crate::core::policy::{Dns, DomainName, L4Proto, Policy, PolicyError};
use crate::core::resolution::{Resolution, ResolvedAddr, ResolvedHost};
use crate::core::ruleset::{Elements, Ruleset, SetId, SetRole, TABLE, Timed, Tuple};
use crate::dns::resolve::{NameResolver, ResolveError};
use crate::guard::{Answered, Counters, Guard, GuardError, LogBudget, Rules};
use crate::nft::live::guard_dns_note;
use crate::nft::monitor::{Change, Monitor};
use crate::nft::{Nft, NftError};
use crate::state::{NewGeneration, Recorder, StateDir, StateError, WriterLock};
use crate::watch::{DropEvent, WatchError, Watcher};

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

fn start_and_serve(
    options: Options,
    lock: Arc<WriterLock>,
    boundary_up: &mut bool,
) -> Result<(), DaemonError> {
    let (policy, policy_text) = Policy::load_with_text(&options.policy_path)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(io("start the runtime"))?;
    let result = runtime.block_on(async move {
        // Subscribed before the first apply, so no change made after it goes unseen.
        let monitor = crate::nft::sys::async_monitor(Monitor::open()?)
            .map_err(io("watch for nftables changes"))?;
        let drops = match (options.log_drops, policy.log.group) {
            (false, _) => None,
            (true, Some(group)) => Some(drop_events(group)?),
            (true, None) => return Err(DaemonError::NoLogGroup),
        };
        // Bound before the table goes up, so that a taken port stops the daemon at once; the
        // queries that arrive meanwhile wait in the socket buffers.
        let guard = match &policy.dns.guard {
            Some(g) => Some(Guard::bind(&g.listen, g.mark).await?),
            None => None,
        };
        let mut daemon = Daemon::start(options, lock, policy, policy_text).await?;
        *boundary_up = true;
        let answers = guard.map(|g| daemon.start_guard(g));
        daemon.serve(monitor, drops, answers).await
    });
    // A reload may still be reading its file (a FIFO nobody writes): it must not hold up
    // the exit, as dropping the runtime would.
    runtime.shutdown_timeout(Duration::from_millis(100));
    result
}

/// The daemon could not put up its boundary: unless a table of ours is in place, put up the
/// fail-closed one. Returns the error to exit with.
fn fail_closed(error: DaemonError) -> DaemonError {
    let skeleton = Nft::open().and_then(|mut nft| {
        if nft.table_exists()? {
            return Ok(false);
        }
        nft.apply(&crate::core::plan::fail_closed()).map(|()| true)
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

/// Refused packets from NFLOG `group`, read on a thread of their own (the kernel's log rule
/// already limits their rate).
fn drop_events(group: u16) -> Result<mpsc::Receiver<DropEvent>, DaemonError> {
    let mut watcher = Watcher::subscribe(group)?;
    let (tx, rx) = mpsc::channel(1024);
    std::thread::Builder::new()
        .name("refused-packets".into())
        .spawn(move || {
            loop {
                match watcher.next_event() {
                    Ok(event) => {
                        if tx.blocking_send(event).is_err() {
                            return;
                        }
                    }
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

/// "4m10s", "12s".
fn ago(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{}m{}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// How long after an answer a name is asked again.
fn interval(ttl: u32, dns: &Dns) -> Duration {
    Duration::from_secs(ttl.into()).clamp(dns.refresh_min, dns.refresh_max)
}

/// How long an address in a guard's answer stays allowed: at least as long as the client may
/// cache it (its TTL), at least the floor, then the grace; but never longer than
/// `dns.refresh.max` (or the floor, if higher) plus the grace ([`lifetime_cap`]): an answer
/// under an allowed wildcard is its owner's to write, TTL included. A client that caches
/// longer than that asks again and renews the element.
fn guard_lifetime(ttl: u32, guard: &crate::core::policy::Guard, dns: &Dns) -> Duration {
    let ttl = Duration::from_secs(crate::core::installable::effective_ttl(ttl).into());
    ttl.max(guard.floor).min(dns.refresh_max.max(guard.floor)) + dns.grace
}

/// A guard's answer renews an element only when the element would otherwise expire within
/// this fraction of the grace: a name asked a thousand times a second costs one batch, not a
/// thousand, and every released answer still outlives its TTL by half the grace or more.
fn renew_slack(grace: Duration) -> Duration {
    grace / 2
}

/// How many waiting answers go into one batch.
const MAX_ANSWER_BATCH: usize = 256;

/// How many elements one upsert transaction carries at most. Each element is independent of
/// the others (a renewal or an addition), so a refresh that renews more is sent as several
/// transactions: the encoded batch, libnftnl's copy of the elements and the list they are
/// built from then never hold more than this many. Renewing all 10,000 addresses of 1,250
/// names at once peaked 3 MiB higher (benches/daemon.rs).
const MAX_UPSERT_BATCH: usize = 1024;

/// How often the guard looks for live connections to addresses about to expire: a third of
/// the shortest lifetime, between 1 and 10 seconds.
fn sweep_every(guard: &crate::core::policy::Guard, grace: Duration) -> Duration {
    ((guard.floor + grace) / 3).clamp(Duration::from_secs(1), Duration::from_secs(10))
}

/// Retry delay after `failures` failed lookups in a row: 1 s, 2 s, 4 s, 8 s, then every 10 s
/// (or `cap`, the refresh floor, if shorter): a host that boots before its network resolves
/// its names soon after the resolver answers.
fn backoff(failures: u32, cap: Duration) -> Duration {
    const MAX_BACKOFF: Duration = Duration::from_secs(10);
    Duration::from_secs(1u64 << failures.clamp(1, 16).saturating_sub(1))
        .min(cap)
        .min(MAX_BACKOFF)
}

/// What the daemon knows of one name.
#[derive(Debug, Clone)]
struct NameState {
    /// Each address and when it stops being allowed unless an answer renews it (expired
    /// ones are remembered for an hour).
    addrs: BTreeMap<IpAddr, Instant>,
    /// The addresses of the last successful answer.
    answered: BTreeSet<IpAddr>,
    next_due: Instant,
    failures: u32,
    last_error: Option<String>,
}

impl NameState {
    fn new(now: Instant) -> NameState {
        NameState {
            addrs: BTreeMap::new(),
            answered: BTreeSet::new(),
            next_due: now,
            failures: 0,
            last_error: None,
        }
    }

    /// Takes in addresses answered at `now`, each allowed for `life(ttl)` from now (or longer,
    /// if it already was); returns those that were not allowed before, and how many new ones
    /// it left out: past [`MAX_LIVE_ADDRS_PER_NAME`] live addresses of a family, or any new
    /// one when `room` is false (the resolved sets are full). Live addresses always renew.
    fn extend(
        &mut self,
        addrs: &[ResolvedAddr],
        now: Instant,
        life: impl Fn(u32) -> Duration,
        room: bool,
    ) -> Extended {
        // Expired addresses are kept a while to explain refusals ("was NAME until ..."), but
        // no more of them than a name may have live ones.
        self.addrs
            .retain(|_, expires| now.saturating_duration_since(*expires) < REMEMBER_EXPIRED);
        if self.addrs.len() > 2 * 2 * MAX_LIVE_ADDRS_PER_NAME {
            self.addrs.retain(|_, expires| *expires > now);
        }
        let (mut live4, mut live6) =
            self.live(now)
                .fold((0, 0), |(v4, v6), (a, _)| match a.is_ipv4() {
                    true => (v4 + 1, v6),
                    false => (v4, v6 + 1),
                });
        let mut out = Extended::default();
        for a in addrs {
            let expires = now + life(a.ttl);
            let live = self.addrs.get(&a.addr).is_some_and(|e| *e > now);
            if !live {
                let count = if a.addr.is_ipv4() {
                    &mut live4
                } else {
                    &mut live6
                };
                if !room || *count >= MAX_LIVE_ADDRS_PER_NAME {
                    out.left_out += 1;
                    continue;
                }
                *count += 1;
                out.added.push(a.addr);
            }
            let entry = self.addrs.entry(a.addr).or_insert(now);
            *entry = (*entry).max(expires);
        }
        out
    }

    /// Takes in an answer received at `now`; returns the addresses it brought and, for a
    /// successful answer, those the previous one had and this one lacks.
    fn answer(&mut self, host: &ResolvedHost, now: Instant, dns: &Dns) -> AnswerChanges {
        let mut changes = AnswerChanges {
            added: self
                .extend(&host.addrs, now, |ttl| interval(ttl, dns) + dns.grace, true)
                .added,
            gone: Vec::new(),
        };
        if host.errors.is_empty() {
            let answered: BTreeSet<IpAddr> = host.addrs.iter().map(|a| a.addr).collect();
            changes.gone = self.answered.difference(&answered).copied().collect();
            self.answered = answered;
            self.failures = 0;
            self.last_error = None;
            let ttl = host.addrs.iter().map(|a| a.ttl).min();
            self.next_due = now + ttl.map_or(dns.refresh_min, |t| interval(t, dns));
        } else {
            // A partial answer still renews what it named; the rest keeps its expiry.
            self.failures += 1;
            self.last_error = Some(host.errors.join("; "));
            self.next_due = now + backoff(self.failures, dns.refresh_min);
        }
        changes
    }

    /// Addresses allowed at `now`.
    fn live(&self, now: Instant) -> impl Iterator<Item = (&IpAddr, &Instant)> {
        self.addrs.iter().filter(move |(_, e)| **e > now)
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
struct AnswerChanges {
    added: Vec<IpAddr>,
    gone: Vec<IpAddr>,
}

/// What [`NameState::extend`] took in.
#[derive(Debug, Default, PartialEq, Eq)]
struct Extended {
    /// Addresses not allowed before.
    added: Vec<IpAddr>,
    /// New addresses left out: past the caps.
    left_out: usize,
}

/// Live addresses of one family one name may hold at once. A name under an allowed wildcard
/// answers what its zone's owner likes, fresh addresses every time if it wants: without a cap
/// one name grows the sets by everything it answers within `floor` + `grace`. Eight times
/// what one answer may bring, so a CDN that rotates its addresses keeps working.
const MAX_LIVE_ADDRS_PER_NAME: usize = 256;

/// In guard mode, how many resolved elements the daemon installs at most (all names, ports
/// and families together): past it, answers only renew what is live, and new addresses wait
/// until others expire. About 60 MB of kernel and daemon memory.
const MAX_RESOLVED_ELEMENTS: usize = 262_144;

/// How often expired elements are dropped from the record of what the kernel holds.
const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// How long an expired address is remembered, to explain refusals of it.
const REMEMBER_EXPIRED: Duration = Duration::from_secs(3600);

/// In guard mode, how many names without a live address are remembered at most.
const MAX_FORMER_NAMES: usize = 10_000;

/// In guard mode, how many names may hold live addresses at once. Names under an allowed
/// wildcard are the sandbox's to invent (each costs the daemon about a kilobyte and the
/// kernel its elements); past the cap an answer for one more name is not installed and its
/// client gets SERVFAIL. No live name is evicted to make room: its clients still hold its
/// answer, and its elements must stay explained by a name. Room comes back as names expire
/// (at most `dns.refresh.max` plus the grace after their last answer).
const MAX_LIVE_NAMES: usize = 50_000;

/// Whether an answer for `name` may be installed while at most `cap` names hold live
/// addresses: a name that has live ones already may always renew them. `live_names` counts
/// the names with live addresses; it is counted only when `names` holds `cap` names or more
/// (below that, fewer are live), once, and kept up to date by the caller's admissions.
fn may_track(
    names: &BTreeMap<DomainName, NameState>,
    name: &DomainName,
    now: Instant,
    cap: usize,
    live_names: &mut Option<usize>,
) -> bool {
    if names
        .get(name)
        .is_some_and(|s| s.live(now).next().is_some())
    {
        return true;
    }
    if live_names.is_none() && names.len() < cap {
        return true;
    }
    let live = live_names.get_or_insert_with(|| {
        names
            .values()
            .filter(|s| s.live(now).next().is_some())
            .count()
    });
    if *live < cap {
        *live += 1;
        true
    } else {
        false
    }
}

/// The protocols and ports of every allowed name, indexed once per policy.
type Services = BTreeMap<DomainName, Vec<(L4Proto, u16)>>;

fn services(policy: &Policy) -> Services {
    policy
        .domains()
        .into_iter()
        .map(|n| (n.clone(), services_of(policy, n).collect()))
        .collect()
}

/// The resolved elements the live addresses of `names` need, each with the latest expiry
/// any of them gives it.
fn desired<'a>(
    names: impl Iterator<Item = (&'a DomainName, &'a NameState)>,
    services: &Services,
    now: Instant,
) -> BTreeMap<Tuple, Instant> {
    let mut out: BTreeMap<Tuple, Instant> = BTreeMap::new();
    for (name, state) in names {
        let Some(ports) = services.get(name) else {
            continue;
        };
        for (&addr, &expires) in state.live(now) {
            for &service in ports {
                let e = out.entry(resolved_tuple(addr, service)).or_insert(expires);
                *e = (*e).max(expires);
            }
        }
    }
    out
}

/// The elements to send so the kernel holds every desired element at least until its
/// desired expiry: new ones, and those whose expiry moved later. An element shared with
/// names not in `desired` is never shortened: the kernel already holds their later expiry.
/// With `slack`, an element is renewed only if its expiry would move later by more than that.
fn renewals(
    desired: &BTreeMap<Tuple, Instant>,
    installed: &BTreeMap<Tuple, Instant>,
    slack: Duration,
) -> Vec<(Tuple, Instant)> {
    desired
        .iter()
        .filter(|(t, e)| installed.get(t).is_none_or(|i| **e > *i + slack))
        .map(|(t, e)| (*t, *e))
        .collect()
}

/// Forgets the guard's learned names nothing has been remembered of for an hour, and, past
/// `max_former` names without a live address, all of those: names asked under an allowed
/// wildcard are the sandbox's to invent, and must not grow the daemon without bound.
fn forget_learned_names(
    names: &mut BTreeMap<DomainName, NameState>,
    now: Instant,
    max_former: usize,
) {
    names.retain(|_, s| {
        s.addrs
            .values()
            .any(|e| now.saturating_duration_since(*e) < REMEMBER_EXPIRED)
    });
    let former = names.values().filter(|s| s.live(now).next().is_none());
    if former.count() > max_former {
        names.retain(|_, s| s.live(now).next().is_some());
    }
}

/// An element a restarted guard found in the running table: until when, and for which name
/// (its comment) it stays.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Carried {
    expires: Instant,
    name: String,
}

/// For each element the live addresses of `names` need, the first of them that gives it
/// (the name its comment carries). Walks what [`desired`] walks, once.
fn owners<'a>(
    names: impl Iterator<Item = (&'a DomainName, &'a NameState)>,
    services: &Services,
    now: Instant,
) -> BTreeMap<Tuple, &'a DomainName> {
    let mut out = BTreeMap::new();
    for (name, state) in names {
        let Some(ports) = services.get(name) else {
            continue;
        };
        for (&addr, _) in state.live(now) {
            for &service in ports {
                out.entry(resolved_tuple(addr, service)).or_insert(name);
            }
        }
    }
    out
}

/// Puts carried elements into the resolved sets of `ruleset`; an element both have lives as
/// long as the later of the two says.
fn add_carried(ruleset: &mut Ruleset, carried: &BTreeMap<Tuple, Carried>, now: Instant) {
    if carried.is_empty() {
        return;
    }
    for set in &mut ruleset.sets {
        let Elements::Timed(elements) = &mut set.elements else {
            continue;
        };
        let family = set.id.family;
        let mut merged: BTreeMap<Tuple, Timed> = elements.drain(..).map(|t| (t.tuple, t)).collect();
        for (&tuple, c) in carried {
            if crate::core::ruleset::Family::of_net(&tuple.net) != family {
                continue;
            }
            let new = Timed {
                name: Some(c.name.clone()),
                ..timed(tuple, c.expires, now)
            };
            merged
                .entry(tuple)
                .and_modify(|t| {
                    // `None` is permanent, which no carried element shortens.
                    if let (Some(a), Some(b)) = (t.timeout_ms, new.timeout_ms) {
                        t.timeout_ms = Some(a.max(b));
                    }
                })
                .or_insert(new);
        }
        elements.extend(merged.into_values());
    }
}

fn timed(tuple: Tuple, expires: Instant, now: Instant) -> Timed {
    Timed {
        tuple,
        timeout_ms: Some(expires.saturating_duration_since(now).as_millis().max(1) as u64),
        expires_ms: None,
        name: None,
    }
}

struct Daemon {
    options: Options,
    /// Held until the daemon exits.
    lock: Arc<WriterLock>,
    policy: Policy,
    /// The text `policy` was read from, for the generation record.
    policy_text: String,
    /// The next successful full apply records a generation (the configuration changed).
    record_next_apply: bool,
    resolvers: Vec<IpAddr>,
    /// `None` until the resolvers are known (resolv.conf may not exist yet at boot).
    resolver: Option<NameResolver>,
    names: BTreeMap<DomainName, NameState>,
    services: Services,
    /// What the kernel was last told about each resolved element: its expiry.
    installed: BTreeMap<Tuple, Instant>,
    /// When expired entries are next dropped from `installed`.
    next_prune: Instant,
    nft: Nft,
    /// When a failed full apply is tried again.
    retry_apply: Option<Instant>,
    /// The ruleset generation right after our last transaction: when change notifications
    /// were lost, a different current generation means someone else committed since.
    our_generation: Option<u32>,
    last_refresh: Option<SystemTime>,
    /// In guard mode, this process's uid: its sockets alone may reach the upstream resolvers.
    guard_uid: Option<u32>,
    /// The DNS guard, once it serves.
    guard: Option<GuardLink>,
    /// Elements a restarted guard found in the running table, kept until they expire (clients
    /// still hold the answers that allowed them), as long as the policy allows their names.
    carried: BTreeMap<Tuple, Carried>,
    /// This host's addresses and subnet broadcasts, which no guard answer may install.
    host_addrs: HostAddrsCache,
    /// Bounds the warnings about dropped answer addresses (the guard's answers are the
    /// sandbox's to provoke).
    dropped_log: LogBudget,
    /// Bounds the warnings about answers refused past [`MAX_LIVE_NAMES`].
    full_log: LogBudget,
    /// Bounds the guard's "new addresses allowed" lines: every name under an allowed
    /// wildcard is new once, and the sandbox can invent them by the hundred thousand (the
    /// table's element comments and `status` still name each one).
    allowed_log: LogBudget,
}

/// What a policy sets in the daemon, taken in or given back as a whole.
struct Config {
    policy: Policy,
    policy_text: String,
    services: Services,
    names: BTreeMap<DomainName, NameState>,
    resolvers: Vec<IpAddr>,
    resolver: Option<NameResolver>,
    /// What a restart carried over that this configuration still allows.
    carried: BTreeMap<Tuple, Carried>,
}

/// The daemon's side of the DNS guard.
struct GuardLink {
    rules: watch::Sender<Arc<Rules>>,
    counters: Arc<Counters>,
    events_path: PathBuf,
}

impl Daemon {
    async fn start(
        options: Options,
        lock: Arc<WriterLock>,
        policy: Policy,
        policy_text: String,
    ) -> Result<Daemon, DaemonError> {
        let guard_mode = policy.dns.guard.is_some();
        let (resolvers, resolver) = match (&policy.dns.guard, resolver_for(&policy, &options)) {
            // The guard learns names from the questions it forwards; it never looks any up.
            (Some(guard), _) => (guard.upstream.clone(), None),
            (None, Ok((r, resolver))) => (r, Some(resolver)),
            // At boot resolv.conf may not be written yet: the boundary goes up without names
            // and the resolvers are looked for again.
            (None, Err(e)) => {
                warn!(error = %e, "no resolvers yet; applying the boundary without names");
                (Vec::new(), None)
            }
        };
        let now = Instant::now();
        let names = match guard_mode {
            true => BTreeMap::new(),
            false => policy
                .domains()
                .into_iter()
                .map(|n| (n.clone(), NameState::new(now)))
                .collect(),
        };
        let mut daemon = Daemon {
            options,
            lock,
            services: services(&policy),
            policy,
            policy_text,
            record_next_apply: true,
            resolvers,
            resolver,
            names,
            installed: BTreeMap::new(),
            next_prune: now,
            nft: Nft::open()?,
            retry_apply: None,
            our_generation: None,
            last_refresh: None,
            guard_uid: guard_mode.then(|| nix::unistd::geteuid().as_raw()),
            guard: None,
            carried: BTreeMap::new(),
            host_addrs: HostAddrsCache::new(),
            dropped_log: LogBudget::default(),
            full_log: LogBudget::default(),
            allowed_log: LogBudget::default(),
        };
        // A running boundary (a restart) is replaced only once its names are resolved, so
        // that nothing allowed goes missing for a moment. Without one (boot), the
        // deny-by-default skeleton goes up at once: it needs no DNS, and names follow as they
        // resolve.
        if daemon.nft.table_exists()? {
            match guard_mode {
                true => daemon.carry_over(),
                false => daemon.resolve_all().await,
            }
        }
        // The first apply must work: a daemon that cannot install its boundary exits (run()
        // leaves the fail-closed table). A refusal is the policy's fault: only an edit fixes
        // it, so it is not retried; anything else is, by systemd's Restart=.
        daemon
            .apply_all()
            .map_err(|e| match e.is_refusal_of_content() {
                true => DaemonError::TableRefused(e),
                false => DaemonError::Nft(e),
            })?;
        Ok(daemon)
    }

    /// Starts serving DNS, now that the table is up; returns where answers wait for their
    /// addresses to be installed.
    fn start_guard(&mut self, guard: Guard) -> mpsc::Receiver<Answered> {
        let rules = Rules::of(&self.policy).expect("the policy is in guard mode");
        let (rules_tx, rules_rx) = watch::channel(Arc::new(rules));
        let (answered_tx, answered_rx) = mpsc::channel(1024);
        let (events, _) = broadcast::channel(1024);
        let counters = Arc::new(Counters::default());
        let events_path = self.options.state.guard_events();
        // Without it `watch` misses refused queries; the log still has them.
        if let Err(e) = crate::guard::serve_events(events_path.clone(), events.clone()) {
            warn!(error = %e, "refused queries will be in the log only");
        }
        let in_flight = guard.in_flight_limit();
        guard.serve(crate::guard::Context {
            in_flight,
            log_budget: Default::default(),
            rules: rules_rx,
            answered: answered_tx,
            events,
            counters: counters.clone(),
        });
        let listen: Vec<SocketAddr> = self
            .policy
            .dns
            .guard
            .iter()
            .flat_map(|g| g.listen.clone())
            .collect();
        info!(listen = ?listen, upstream = ?self.resolvers, "the DNS guard is serving");
        self.guard = Some(GuardLink {
            rules: rules_tx,
            counters,
            events_path,
        });
        answered_rx
    }

    /// Installs the addresses of guard answers, this one and whatever else is waiting, in one
    /// batch, then releases them all: with the kernel's acknowledgement, or as failures
    /// (SERVFAIL) if it refused.
    fn install_answers(&mut self, first: Answered, waiting: &mut mpsc::Receiver<Answered>) {
        let mut batch = vec![first];
        while batch.len() < MAX_ANSWER_BATCH {
            match waiting.try_recv() {
                Ok(a) => batch.push(a),
                Err(_) => break,
            }
        }
        let Some(guard) = self.policy.dns.guard.clone() else {
            // Only a reload could end guard mode, and reload refuses to.
            for a in batch {
                let _ = a.done.send(false);
            }
            return;
        };
        let now = Instant::now();
        let grace = self.policy.dns.grace;
        let dns = self.policy.dns.clone();
        let mut names = BTreeSet::new();
        let mut live_names = None;
        let mut refused = Vec::new();
        let mut i = 0;
        while i < batch.len() {
            let a = &batch[i];
            if a.addrs.is_empty()
                || may_track(&self.names, &a.name, now, MAX_LIVE_NAMES, &mut live_names)
            {
                i += 1;
                continue;
            }
            if let Some(held_back) =
                self.full_log
                    .take(self.policy.log.rate, self.policy.log.burst, now.into_std())
            {
                warn!(name = %a.name, held_back,
                      "{MAX_LIVE_NAMES} names hold live addresses; this answer is not installed \
                       and its client gets SERVFAIL until some expire");
            }
            refused.push(batch.swap_remove(i));
        }
        for a in refused {
            let _ = a.done.send(false);
        }
        for a in &mut batch {
            let dropped = retain_installable(&mut a.addrs, |r| r.addr, self.host_addrs.current());
            for d in dropped {
                if let Some(held_back) = self.dropped_log.take(
                    self.policy.log.rate,
                    self.policy.log.burst,
                    now.into_std(),
                ) {
                    warn!(name = %a.name, address = %d.addr, why = %d.why, held_back,
                          "an answered address is never allowed; not installed");
                }
            }
        }
        for a in &batch {
            // Nothing to install: no record of the name either (a sandbox answering only
            // refused addresses for invented names must not grow the daemon).
            if a.addrs.is_empty() {
                continue;
            }
            if !self.services.contains_key(&a.name) {
                let services = services_of(&self.policy, &a.name).collect();
                self.services.insert(a.name.clone(), services);
            }
            let state = self
                .names
                .entry(a.name.clone())
                .or_insert_with(|| NameState::new(now));
            let room = self.installed.len() < MAX_RESOLVED_ELEMENTS;
            let Extended { added, left_out } =
                state.extend(&a.addrs, now, |ttl| guard_lifetime(ttl, &guard, &dns), room);
            if left_out > 0
                && let Some(held_back) =
                    self.full_log
                        .take(self.policy.log.rate, self.policy.log.burst, now.into_std())
            {
                warn!(name = %a.name, left_out, held_back, room,
                      "past {MAX_LIVE_ADDRS_PER_NAME} live addresses of a family for this name, \
                       or {MAX_RESOLVED_ELEMENTS} resolved elements in all: new addresses are \
                       not installed until others expire");
            }
            if !added.is_empty()
                && let Some(held_back) = self.allowed_log.take(
                    self.policy.log.rate,
                    self.policy.log.burst,
                    now.into_std(),
                )
            {
                info!(name = %a.name, added = %summarise(&added), not_logged_before = held_back,
                      "new addresses allowed");
            }
            names.insert(a.name.clone());
        }
        self.last_refresh = Some(SystemTime::now());
        let hosts: Vec<ResolvedHost> = batch
            .iter()
            .map(|a| ResolvedHost {
                name: a.name.clone(),
                addrs: a.addrs.clone(),
                nxdomain: false,
                dropped: Vec::new(),
                errors: Vec::new(),
            })
            .collect();
        for w in denied_answers(&self.policy, &hosts) {
            warn!("{w}");
        }
        let ok = self.install(&names, now, renew_slack(grace));
        for a in batch {
            let _ = a.done.send(ok);
        }
    }

    /// Sends, as one batch, the elements of `names` that are new or live longer now by more
    /// than `slack`; `false` if the kernel refused (the table is then applied anew).
    fn install(&mut self, names: &BTreeSet<DomainName>, now: Instant, slack: Duration) -> bool {
        if now >= self.next_prune {
            self.prune(now);
        }
        let states: Vec<(&DomainName, &NameState)> = names
            .iter()
            .filter_map(|n| self.names.get_key_value(n))
            .collect();
        let want = desired(states.iter().copied(), &self.services, now);
        let send = renewals(&want, &self.installed, slack);
        if send.is_empty() {
            return true;
        }
        // Each new element carries the name it was answered for (the kernel keeps the
        // comment of an element it already holds).
        let owners = owners(states.iter().copied(), &self.services, now);
        let owners: BTreeMap<Tuple, String> = send
            .iter()
            .filter_map(|(t, _)| Some((*t, owners.get(t)?.to_string())))
            .collect();
        match self.upsert(&send, now, |t| owners.get(t).cloned()) {
            Ok(()) => true,
            Err(e) => {
                // Someone may have removed our set under us: the full apply puts it back.
                error!(error = %e, "adding addresses refused; reapplying the table");
                self.reapply();
                false
            }
        }
    }

    /// Sends `elements` with their expiries (and the name `name_of` gives each) as one batch,
    /// or one per [`MAX_UPSERT_BATCH`] of them, and records them as installed.
    fn upsert(
        &mut self,
        elements: &[(Tuple, Instant)],
        now: Instant,
        name_of: impl Fn(&Tuple) -> Option<String>,
    ) -> Result<(), NftError> {
        for chunk in elements.chunks(MAX_UPSERT_BATCH) {
            let batch: Vec<Timed> = chunk
                .iter()
                .map(|&(t, e)| Timed {
                    name: name_of(&t),
                    ..timed(t, e, now)
                })
                .collect();
            self.nft.upsert_resolved(&batch)?;
            self.our_generation = self.nft.generation().ok();
            self.installed.extend(chunk.iter().copied());
        }
        Ok(())
    }

    /// In guard mode an address stays allowed while a connection to it lives, even past its
    /// lifetime: elements about to expire (within two sweeps) that conntrack shows a live flow
    /// to are renewed for three sweeps. `ct state established` already carries the
    /// connection's own packets; this keeps a client that reconnects to the address it still
    /// uses (a pool, a retry) from being refused under it.
    fn keep_connected(&mut self) {
        let Some(guard) = &self.policy.dns.guard else {
            return;
        };
        let every = sweep_every(guard, self.policy.dns.grace);
        let now = Instant::now();
        let soon: Vec<Tuple> = self
            .installed
            .iter()
            .filter(|(_, e)| **e > now && **e <= now + 2 * every)
            .map(|(t, _)| *t)
            .collect();
        if soon.is_empty() {
            return;
        }
        let flows = match crate::netlink::conntrack::live_flows() {
            Ok(f) => f,
            Err(e) => {
                warn!(error = %e, "cannot read conntrack; addresses expire on time");
                return;
            }
        };
        // Never past the policy's cap, though: a sweep cannot outlive what an answer may.
        let until = now + (3 * every).min(lifetime_cap(&self.policy.dns));
        let keep: Vec<(Tuple, Instant)> = soon
            .into_iter()
            .filter(|t| flows.contains(&(t.net.addr(), t.proto, t.ports.first)))
            .map(|t| (t, until))
            .collect();
        if keep.is_empty() {
            return;
        }
        match self.upsert(&keep, now, |_| None) {
            Ok(()) => {
                let addrs: BTreeSet<IpAddr> = keep.iter().map(|(t, _)| t.net.addr()).collect();
                info!(addresses = ?addrs, "kept addresses with live connections past their lifetime");
                for state in self.names.values_mut() {
                    for (addr, expires) in state.addrs.iter_mut() {
                        if addrs.contains(addr) {
                            *expires = (*expires).max(until);
                        }
                    }
                }
                for (t, e) in keep {
                    if let Some(c) = self.carried.get_mut(&t) {
                        c.expires = c.expires.max(e);
                    }
                }
            }
            Err(e) => error!(error = %e, "renewing addresses with live connections failed"),
        }
    }

    /// Forgets expired elements, and in guard mode the names nothing is remembered of.
    fn prune(&mut self, now: Instant) {
        self.installed.retain(|_, e| *e > now);
        self.carried.retain(|_, c| c.expires > now);
        if self.guard.is_some() {
            forget_learned_names(&mut self.names, now, MAX_FORMER_NAMES);
            let names = &self.names;
            self.services.retain(|n, _| names.contains_key(n));
        }
        self.next_prune = now + PRUNE_EVERY;
    }

    /// A restarted guard keeps what the running table allows until it expires: clients still
    /// hold the answers behind it, and the guard has no way to ask them.
    fn carry_over(&mut self) {
        let now = Instant::now();
        let table = match self.nft.read_table() {
            Ok(Some(t)) => t,
            Ok(None) => return,
            Err(e) => {
                warn!(error = %e, "cannot read the running table; its resolved addresses are dropped");
                return;
            }
        };
        let mut dropped = 0usize;
        for family in crate::core::ruleset::Family::BOTH {
            let id = SetId::new(SetRole::Resolved, family);
            let Some(Elements::Timed(elements)) = table.contents(id) else {
                continue;
            };
            for t in elements {
                // Only what this policy allows, for the name the element was answered for
                // and on its port: a restart must not keep what the new policy dropped.
                let name = match element_allowed(&self.policy, t.name.as_deref(), &t.tuple) {
                    Ok(()) => t.name.clone().unwrap_or_default(),
                    Err(why) => {
                        dropped += 1;
                        info!(element = %crate::core::ruleset::fmt_timed(&t), why = %why,
                              "not keeping an element of the running table");
                        continue;
                    }
                };
                // Permanent elements (a CLI apply) get the grace, no more, and none outlives
                // what the policy allows an answer.
                let left = t
                    .expires_ms
                    .map_or(self.policy.dns.grace, Duration::from_millis)
                    .min(lifetime_cap(&self.policy.dns));
                self.carried.insert(
                    t.tuple,
                    Carried {
                        expires: now + left,
                        name,
                    },
                );
            }
        }
        if !self.carried.is_empty() || dropped > 0 {
            info!(
                elements = self.carried.len(),
                dropped, "keeping the addresses the running table allows until they expire"
            );
        }
    }

    async fn resolve_all(&mut self) {
        let Some(resolver) = self.resolver.clone() else {
            return;
        };
        let names: Vec<DomainName> = self.names.keys().cloned().collect();
        match resolver.lookup_all(names).await {
            Ok(hosts) => self.take_answers(&hosts),
            Err(e) => error!(error = %e, "resolver failure"),
        }
    }

    /// The resolver, looking for the resolvers again if they were not known; when they
    /// appear, the DNS sets change, so the table is applied anew.
    fn resolver(&mut self) -> Option<NameResolver> {
        if self.resolver.is_none() {
            match resolver_for(&self.policy, &self.options) {
                Ok((resolvers, resolver)) => {
                    info!(resolvers = ?resolvers, "resolvers found");
                    self.resolvers = resolvers;
                    self.resolver = Some(resolver);
                    // The DNS sets change with them: a new configuration.
                    self.record_next_apply = true;
                    self.reapply();
                }
                Err(e) => warn!(error = %e, "still no resolvers"),
            }
        }
        self.resolver.clone()
    }

    /// Records answers, logging what changed.
    fn take_answers(&mut self, hosts: &[ResolvedHost]) {
        let now = Instant::now();
        self.last_refresh = Some(SystemTime::now());
        for host in hosts {
            let Some(state) = self.names.get_mut(&host.name) else {
                continue;
            };
            let AnswerChanges { added, gone } = state.answer(host, now, &self.policy.dns);
            if let Some(err) = &state.last_error {
                warn!(name = %host.name, error = %err, failures = state.failures,
                      retry_in_s = state.next_due.saturating_duration_since(now).as_secs(),
                      "lookup failed; the last good addresses stay until their grace ends");
            }
            if !added.is_empty() {
                info!(name = %host.name, added = %summarise(&added), "new addresses allowed");
            }
            // Once per lookup of the name, so at most once per `dns.refresh.min`.
            for d in &host.dropped {
                warn!(name = %host.name, address = %d.addr, why = %d.why,
                      "an answered address is never allowed; not installed");
            }
            if !gone.is_empty() {
                info!(name = %host.name, gone = %summarise(&gone), grace_s = self.policy.dns.grace.as_secs(),
                      "addresses no longer answered stay allowed until their grace ends");
            }
        }
        for w in denied_answers(&self.policy, hosts) {
            warn!("{w}");
        }
    }

    /// The live addresses as a resolution, for planning.
    fn resolution(&self, now: Instant) -> Resolution {
        Resolution {
            resolvers: self.resolvers.clone(),
            hosts: self
                .names
                .iter()
                .map(|(name, state)| ResolvedHost {
                    name: name.clone(),
                    addrs: state
                        .live(now)
                        .map(|(&addr, _)| ResolvedAddr { addr, ttl: 0 })
                        .collect(),
                    nxdomain: false,
                    dropped: Vec::new(),
                    errors: Vec::new(),
                })
                .collect(),
            guard_uid: self.guard_uid,
        }
    }

    /// Replaces the whole table with the current policy and addresses, each resolved element
    /// with its remaining lifetime.
    fn apply_all(&mut self) -> Result<(), NftError> {
        let now = Instant::now();
        // A reload may have lowered the cap: nothing known lives past the policy's.
        let cap = now + lifetime_cap(&self.policy.dns);
        for state in self.names.values_mut() {
            for expires in state.addrs.values_mut() {
                *expires = (*expires).min(cap);
            }
        }
        let names = &self.names;
        let mut ruleset = plan_with(&self.policy, &self.resolution(now), |name, addr| {
            let expires = names.get(name)?.addrs.get(&addr)?;
            Some(
                expires
                    .saturating_duration_since(now)
                    .max(Duration::from_millis(1)),
            )
        });
        self.carried.retain(|_, c| c.expires > now);
        add_carried(&mut ruleset, &self.carried, now);
        match self.nft.apply(&ruleset) {
            Ok(()) => {
                self.our_generation = self.nft.generation().ok();
                self.installed = desired(self.names.iter(), &self.services, now);
                for (t, c) in &self.carried {
                    let i = self.installed.entry(*t).or_insert(c.expires);
                    *i = (*i).max(c.expires);
                }
                self.retry_apply = None;
                info!(
                    table = %format!("inet {TABLE}"),
                    names = self.names.len(),
                    elements = ruleset.element_count(),
                    "applied the table"
                );
                if std::mem::take(&mut self.record_next_apply) {
                    self.record(ruleset, now);
                }
                // The full table's plan, batch and record are gone: give their pages back.
                crate::nft::sys::release_free_memory();
                Ok(())
            }
            Err(e) => {
                self.retry_apply = Some(now + Duration::from_secs(1));
                Err(e)
            }
        }
    }

    /// Records the applied configuration as a generation. A failure is logged, never fatal:
    /// the boundary matters more than its record.
    fn record(&mut self, ruleset: Ruleset, now: Instant) {
        let new = NewGeneration {
            command: Recorder::Run,
            source_generation: None,
            policy_path: std::path::absolute(&self.options.policy_path)
                .unwrap_or_else(|_| self.options.policy_path.clone()),
            policy_text: self.policy_text.clone(),
            resolution: self.resolution(now),
            ruleset,
        };
        match self
            .options
            .state
            .record(&self.lock, new, self.options.keep)
        {
            Ok(g) => info!(
                generation = g.generation,
                "recorded generation {}", g.generation
            ),
            Err(e) => error!(error = %e, "the applied table could not be recorded as a generation"),
        }
    }

    /// The names whose refresh is due, now marked as being looked up.
    fn take_due(&mut self) -> Vec<DomainName> {
        if self.policy.dns.guard.is_some() {
            return Vec::new();
        }
        let now = Instant::now();
        let mut due = Vec::new();
        for (name, state) in self.names.iter_mut().filter(|(_, s)| s.next_due <= now) {
            // Rescheduled when the answer arrives; until then nothing is due again.
            state.next_due = now + self.policy.dns.refresh_max;
            due.push(name.clone());
        }
        due
    }

    /// A lookup that produced no answers at all: the names it took are due again soon
    /// (take_due pushed them a whole refresh_max away while they were being looked up).
    fn retry_lookups(&mut self) {
        let retry = Instant::now() + backoff(1, self.policy.dns.refresh_min);
        for state in self.names.values_mut() {
            state.next_due = state.next_due.min(retry);
        }
    }

    /// Sends, as one batch, the elements of `answered` that are new or live longer now. The
    /// cost follows the answers, not the size of the table.
    fn renew(&mut self, answered: &[DomainName]) {
        let names: BTreeSet<DomainName> = answered.iter().cloned().collect();
        self.install(&names, Instant::now(), Duration::ZERO);
    }

    fn reapply(&mut self) {
        if let Err(e) = self.apply_all() {
            error!(error = %e, "applying the table failed; retrying in 1 s");
        }
    }

    /// SIGHUP, once the new policy is parsed (off the event loop): a valid new policy replaces
    /// the running one once the kernel has accepted its table (with the addresses known for
    /// the names it keeps; its new names follow as their answers arrive); an invalid one, or
    /// one the kernel refuses, changes nothing. Returns whether the new policy was adopted.
    fn reload(&mut self, loaded: Result<(Policy, String), PolicyError>) -> bool {
        let (policy, policy_text) = match loaded {
            Ok(p) => p,
            Err(e) => {
                error!(error = %e, "the new policy is invalid; the running one stays");
                return false;
            }
        };
        // The guard's sockets and the table's uid rule are set up once.
        let (old, new) = (&self.policy.dns.guard, &policy.dns.guard);
        let restart = match (old, new) {
            (Some(_), None) | (None, Some(_)) => Some("`dns.mode`"),
            (Some(o), Some(n)) if o.listen != n.listen => Some("`dns.listen`"),
            // The listening sockets keep the mark they were bound with: the new table would
            // refuse their replies.
            (Some(o), Some(n)) if o.mark != n.mark => Some("`dns.mark`"),
            _ => None,
        };
        if let Some(what) = restart {
            error!(
                "the new policy changes {what}, which takes a restart (`systemctl restart \
                 egress-fence`); the running policy stays"
            );
            return false;
        }
        if let Some(guard) = &policy.dns.guard {
            let upstream = guard.upstream.clone();
            return self.reload_guard(policy, policy_text, upstream);
        }
        let (resolvers, resolver) = match resolver_for(&policy, &self.options) {
            Ok(r) => r,
            Err(e) => {
                error!(error = %e, "the new policy's resolvers are unusable; the running one stays");
                return false;
            }
        };
        let now = Instant::now();
        let mut names: BTreeMap<DomainName, NameState> = BTreeMap::new();
        for name in policy.domains() {
            let mut state = self
                .names
                .get(name)
                .cloned()
                .unwrap_or_else(|| NameState::new(now));
            state.next_due = now;
            names.insert(name.clone(), state);
        }
        self.adopt(Config {
            services: services(&policy),
            policy,
            policy_text,
            resolvers,
            resolver: Some(resolver),
            names,
            carried: self.carried.clone(),
        })
    }

    /// A reload in guard mode: learned names the new policy still allows keep their addresses,
    /// on the ports it now gives them; the others go with the old table. What a restart
    /// carried over goes the same way: only for names and ports the new policy allows, and no
    /// longer than it allows an answer. Once the kernel has accepted the new table, the guard
    /// answers by the new rules.
    fn reload_guard(&mut self, policy: Policy, policy_text: String, upstream: Vec<IpAddr>) -> bool {
        let cap = Instant::now() + lifetime_cap(&policy.dns);
        let carried = self
            .carried
            .iter()
            .filter(|(t, c)| element_allowed(&policy, Some(&c.name), t).is_ok())
            .map(|(t, c)| {
                let expires = c.expires.min(cap);
                (
                    *t,
                    Carried {
                        expires,
                        name: c.name.clone(),
                    },
                )
            })
            .collect();
        let names: BTreeMap<DomainName, NameState> = self
            .names
            .iter()
            .filter(|(name, _)| policy.allow.iter().any(|a| a.target.matches(name)))
            .map(|(n, s)| (n.clone(), s.clone()))
            .collect();
        let services = names
            .keys()
            .map(|n| (n.clone(), services_of(&policy, n).collect()))
            .collect();
        let rules = Rules::of(&policy);
        let adopted = self.adopt(Config {
            policy,
            policy_text,
            services,
            names,
            resolvers: upstream,
            resolver: None,
            carried,
        });
        if adopted && let (Some(link), Some(rules)) = (&self.guard, rules) {
            link.rules.send_replace(Arc::new(rules));
        }
        adopted
    }

    /// Applies the table of `new` and keeps `new` only if the kernel accepted it. Otherwise
    /// the running configuration stays whole, so that healing and answers go on building the
    /// table the kernel last accepted, never one it refused.
    fn adopt(&mut self, mut new: Config) -> bool {
        self.swap_config(&mut new);
        let record = std::mem::replace(&mut self.record_next_apply, true);
        match self.apply_all() {
            Ok(()) => true,
            Err(e) => {
                self.swap_config(&mut new);
                self.record_next_apply = record;
                error!(
                    error = %e,
                    "the kernel refused the new policy's table; the running policy stays in force"
                );
                false
            }
        }
    }

    fn swap_config(&mut self, other: &mut Config) {
        std::mem::swap(&mut self.policy, &mut other.policy);
        std::mem::swap(&mut self.policy_text, &mut other.policy_text);
        std::mem::swap(&mut self.services, &mut other.services);
        std::mem::swap(&mut self.names, &mut other.names);
        std::mem::swap(&mut self.resolvers, &mut other.resolvers);
        std::mem::swap(&mut self.resolver, &mut other.resolver);
        std::mem::swap(&mut self.carried, &mut other.carried);
    }

    /// Reads and validates the policy file on a thread of the blocking pool: the event loop
    /// goes on healing and answering meanwhile.
    fn parse_policy(&self) -> JoinHandle<Result<(Policy, String), PolicyError>> {
        let path = self.options.policy_path.clone();
        tokio::task::spawn_blocking(move || Policy::load_with_text(&path))
    }

    /// Someone else changed the table: put it back.
    fn heal(&mut self, changes: &[Change]) {
        let mut who: Vec<String> = changes
            .iter()
            .map(|c| match &c.process {
                Some(p) => format!("{p} (netlink port {})", c.portid),
                None => format!("netlink port {}", c.portid),
            })
            .collect();
        who.dedup();
        let first = changes.first().map_or("changes lost", |c| c.what);
        warn!(
            first = first,
            changes = changes.len(),
            by = %who.join(", "),
            "table inet {TABLE} was changed by someone else; restoring it"
        );
        self.reapply();
    }

    /// Notifications were lost: heal only if the ruleset moved on since our last transaction.
    fn check_after_overrun(&mut self) {
        match self.nft.generation() {
            Ok(g) if Some(g) == self.our_generation => {
                info!(
                    "nftables notifications overran; the ruleset generation shows only our own transactions since"
                );
            }
            Ok(_) | Err(_) => {
                warn!(
                    "nftables notifications were lost and the ruleset changed since our last transaction; restoring the table"
                );
                self.reapply();
            }
        }
    }

    fn next_wakeup(&self) -> Instant {
        let far = Instant::now() + Duration::from_secs(3600);
        // Guard answers come as they come; nothing is looked up on a timer. This runs on
        // every pass of the event loop, once per answer at least: it must not walk the
        // learned names (benches/guard.rs measured 66% of the daemon's time there at 20,000).
        if self.policy.dns.guard.is_some() {
            return self.retry_apply.unwrap_or(far).min(far);
        }
        self.names
            .values()
            .map(|s| s.next_due)
            .chain(self.retry_apply)
            .min()
            .unwrap_or(far)
            .min(far)
    }

    fn status_line(&self) -> String {
        let now = Instant::now();
        let addresses: usize = self.names.values().map(|s| s.live(now).count()).sum();
        let failing = self.names.values().filter(|s| s.failures > 0).count();
        let last = self
            .last_refresh
            .map_or("never".to_string(), crate::state::clock_utc);
        if let Some(link) = &self.guard {
            let count = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
            let c = &link.counters;
            return format!(
                "guard: {} names, {addresses} addresses; {} answered, {} refused, {} failed; \
                 last answer {last}",
                self.names.len(),
                count(&c.answered),
                count(&c.refused),
                count(&c.failed)
            );
        }
        format!(
            "{} names, {addresses} addresses, {failing} failing, last refresh {last}",
            self.names.len()
        )
    }

    /// What the daemon knows of a refused packet's destination.
    fn describe_destination(&self, dst: IpAddr, dport: Option<u16>) -> String {
        let now = Instant::now();
        if let Some(note) = self
            .guard_uid
            .and_then(|uid| guard_dns_note(uid, dport, self.resolvers.contains(&dst)))
        {
            return note;
        }
        if let Some(deny) = self.policy.denied_by(dst) {
            return format!("denied: {}", deny.describe());
        }
        let mut live = Vec::new();
        let mut former: Option<(&DomainName, Instant)> = None;
        for (name, state) in &self.names {
            match state.addrs.get(&dst) {
                Some(&e) if e > now => live.push(name.as_str()),
                Some(&e) if former.is_none_or(|(_, f)| e > f) => former = Some((name, e)),
                _ => {}
            }
        }
        if !live.is_empty() {
            format!(
                "an address of {}, allowed on other ports or protocols only",
                live.join(", ")
            )
        } else if let Some((name, expired)) = former {
            format!(
                "was an address of {name} until {} ago (its grace ended)",
                ago(now.saturating_duration_since(expired))
            )
        } else {
            "not in the policy".to_string()
        }
    }

    fn log_drop(&self, mut event: DropEvent) {
        event.note = Some(self.describe_destination(event.dst, event.dport));
        info!(
            protocol = %event.protocol,
            src = %event.src,
            sport = ?event.sport,
            dst = %event.dst,
            dport = ?event.dport,
            uid = ?event.uid,
            note = event.note.as_deref().unwrap_or(""),
            "refused packet"
        );
    }

    async fn serve(
        mut self,
        mut monitor: AsyncFd<Monitor>,
        mut drops: Option<mpsc::Receiver<DropEvent>>,
        mut answers: Option<mpsc::Receiver<Answered>>,
    ) -> Result<(), DaemonError> {
        let mut hangup = signal(SignalKind::hangup()).map_err(io("install SIGHUP handler"))?;
        let mut terminate =
            signal(SignalKind::terminate()).map_err(io("install SIGTERM handler"))?;
        let mut interrupt =
            signal(SignalKind::interrupt()).map_err(io("install SIGINT handler"))?;
        let watchdog = sd_notify::watchdog_enabled().map(|d| d / 2);
        let mut watchdog_tick =
            tokio::time::interval(watchdog.unwrap_or(Duration::from_secs(3600)));
        let mut last_status = self.status_line();
        let mut status_at = Instant::now();
        let mut status_tick = tokio::time::interval(Duration::from_secs(1));
        let sweep = self
            .policy
            .dns
            .guard
            .as_ref()
            .map(|g| sweep_every(g, self.policy.dns.grace));
        let mut sweep_tick = tokio::time::interval(sweep.unwrap_or(Duration::from_secs(3600)));
        let _ = sd_notify::notify(&[
            sd_notify::NotifyState::Ready,
            sd_notify::NotifyState::Status(&last_status),
        ]);
        info!(status = %self.status_line(), "running");

        // Lookups run beside the loop, so a slow resolver never delays healing or signals.
        let mut lookup: Option<JoinHandle<Result<Vec<ResolvedHost>, ResolveError>>> = None;
        // So does reading a reloaded policy: its text is anyone's, and the loop heals.
        let mut parsing: Option<JoinHandle<Result<(Policy, String), PolicyError>>> = None;
        let mut parse_again = false;
        loop {
            tokio::select! {
                _ = sleep_until(self.next_wakeup()), if lookup.is_none() => {
                    if self.retry_apply.is_some_and(|t| t <= Instant::now()) {
                        self.reapply();
                    }
                    let due = self.take_due();
                    if due.is_empty() {
                        // Only a retried apply woke us.
                    } else if let Some(resolver) = self.resolver() {
                        lookup = Some(tokio::spawn(async move { resolver.lookup_all(due).await }));
                    } else {
                        self.retry_lookups();
                    }
                }
                done = async { lookup.as_mut().expect("guarded").await }, if lookup.is_some() => {
                    lookup = None;
                    match done {
                        Ok(Ok(hosts)) => {
                            self.take_answers(&hosts);
                            let answered: Vec<DomainName> =
                                hosts.into_iter().map(|h| h.name).collect();
                            self.renew(&answered);
                            // A round of lookups and its renewals leave the heap's high-water
                            // mark at twice what stays live until the next round.
                            crate::nft::sys::release_free_memory();
                        }
                        Ok(Err(e)) => {
                            error!(error = %e, "resolver failure; retrying");
                            self.retry_lookups();
                        }
                        Err(e) => {
                            error!(error = %e, "lookup task failed; retrying");
                            self.retry_lookups();
                        }
                    }
                }
                _ = hangup.recv() => {
                    // Lets `systemctl reload` wait for the reload (Type=notify-reload).
                    let mut reloading = vec![sd_notify::NotifyState::Reloading];
                    reloading.extend(sd_notify::NotifyState::monotonic_usec_now().ok());
                    let _ = sd_notify::notify(&reloading);
                    info!(policy = %self.options.policy_path.display(), "reloading the policy");
                    // A file changed again while it is read is read again after.
                    match parsing {
                        Some(_) => parse_again = true,
                        None => parsing = Some(self.parse_policy()),
                    }
                }
                parsed = async { parsing.as_mut().expect("guarded").await }, if parsing.is_some() => {
                    parsing = None;
                    if std::mem::take(&mut parse_again) {
                        parsing = Some(self.parse_policy());
                    } else {
                        let loaded = parsed.unwrap_or_else(|e| {
                            Err(PolicyError::Read {
                                path: self.options.policy_path.clone(),
                                error: std::io::Error::other(e),
                            })
                        });
                        // The lookup under way asked for the old names; the new ones are due.
                        if self.reload(loaded) && let Some(pending) = lookup.take() {
                            pending.abort();
                        }
                        let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
                    }
                }
                _ = terminate.recv() => break,
                _ = interrupt.recv() => break,
                ready = monitor.readable_mut() => {
                    let mut guard = ready.map_err(io("wait for nftables changes"))?;
                    let ours = self.nft.portid();
                    let mut drained = guard.get_inner_mut().drain(ours)?;
                    guard.clear_ready();
                    drop(guard);
                    if !drained.changes.is_empty() || drained.overrun {
                        // A flush or a script's reset arrives as a burst: take it whole.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        let more = monitor.get_mut().drain(ours)?;
                        drained.changes.extend(more.changes);
                        drained.overrun |= more.overrun;
                        if !drained.changes.is_empty() {
                            self.heal(&drained.changes);
                        } else {
                            self.check_after_overrun();
                        }
                    }
                }
                Some(event) = async { drops.as_mut().expect("guarded").recv().await }, if drops.is_some() => {
                    self.log_drop(event);
                }
                Some(answer) = async { answers.as_mut().expect("guarded").recv().await }, if answers.is_some() => {
                    let waiting = answers.as_mut().expect("guarded");
                    self.install_answers(answer, waiting);
                }
                // Brings the status line below up to date even when nothing else happens.
                _ = status_tick.tick() => {}
                _ = sweep_tick.tick(), if sweep.is_some() => self.keep_connected(),
                _ = watchdog_tick.tick(), if watchdog.is_some() => {
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
                }
            }
            // Only changes, at most once a second: the notify socket is a datagram queue
            // that a slow reader fills, and counting addresses is not free.
            if status_at.elapsed() >= Duration::from_secs(1) {
                status_at = Instant::now();
                let status = self.status_line();
                if status != last_status {
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(&status)]);
                    last_status = status;
                }
            }
        }

        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        if let Some(link) = &self.guard {
            let _ = std::fs::remove_file(&link.events_path);
        }
        if self.options.teardown_on_exit {
            self.nft.teardown()?;
            info!("stopped; table inet {TABLE} deleted (--teardown-on-exit)");
        } else {
            info!("stopped; table inet {TABLE} stays in place");
        }
        Ok(())
    }
}

fn resolver_for(
    policy: &Policy,
    options: &Options,
) -> Result<(Vec<IpAddr>, NameResolver), ResolveError> {
    let resolvers = match &policy.dns.resolvers {
        Some(r) => r.clone(),
        None => crate::dns::resolve::system_resolvers(&options.resolv_conf)?,
    };
    let resolver = NameResolver::new(&resolvers)?;
    Ok((resolvers, resolver))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::core::policy::{L4Proto, PortRange};

    fn policy() -> Policy {
        Policy::parse(
            "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\n  - domain: b.example\n    ports: [443, 80]\ndns:\n  refresh: { min: 30s, max: 1h }\n  grace: 10m\n",
            Path::new("p.yaml"),
        )
        .expect("valid")
    }

    fn host(name: &str, addrs: &[(&str, u32)], errors: &[&str]) -> ResolvedHost {
        ResolvedHost {
            name: name.parse().unwrap(),
            addrs: addrs
                .iter()
                .map(|(a, ttl)| ResolvedAddr {
                    addr: a.parse().unwrap(),
                    ttl: *ttl,
                })
                .collect(),
            nxdomain: addrs.is_empty() && errors.is_empty(),
            dropped: Vec::new(),
            errors: errors.iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn intervals_follow_the_ttl_within_bounds() {
        let dns = policy().dns;
        assert_eq!(interval(5, &dns), Duration::from_secs(30));
        assert_eq!(interval(300, &dns), Duration::from_secs(300));
        assert_eq!(interval(86_400, &dns), Duration::from_secs(3600));
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let cap = Duration::from_secs(30);
        let got: Vec<u64> = (1..=6).map(|f| backoff(f, cap).as_secs()).collect();
        assert_eq!(got, vec![1, 2, 4, 8, 10, 10]);
        assert_eq!(backoff(100, cap), Duration::from_secs(10));
        assert_eq!(backoff(4, Duration::from_secs(3)), Duration::from_secs(3));
    }

    #[test]
    fn an_answer_sets_expiry_and_schedule() {
        let dns = policy().dns;
        let now = Instant::now();
        let mut s = NameState::new(now);
        let changes = s.answer(&host("a.example", &[("192.0.2.1", 300)], &[]), now, &dns);
        assert_eq!(changes.added, vec!["192.0.2.1".parse::<IpAddr>().unwrap()]);
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        assert_eq!(s.addrs[&ip], now + Duration::from_secs(300) + dns.grace);
        assert_eq!(s.next_due, now + Duration::from_secs(300));

        // The address leaves the answer: it keeps its expiry, nothing renews it.
        let later = now + Duration::from_secs(300);
        let changes = s.answer(&host("a.example", &[("192.0.2.2", 300)], &[]), later, &dns);
        assert_eq!(changes.added.len(), 1);
        assert_eq!(changes.gone, vec![ip]);
        assert_eq!(s.addrs[&ip], now + Duration::from_secs(300) + dns.grace);
        // ...stops being live once that has passed, is remembered an hour, then forgotten.
        let expired = now + Duration::from_secs(300) + dns.grace + Duration::from_secs(1);
        let again = host("a.example", &[("192.0.2.2", 300)], &[]);
        let changes = s.answer(&again, expired, &dns);
        assert!(
            changes.gone.is_empty(),
            "reported once, not on every answer"
        );
        assert!(!s.live(expired).any(|(a, _)| *a == ip));
        assert!(s.addrs.contains_key(&ip));
        s.answer(&again, expired + REMEMBER_EXPIRED, &dns);
        assert!(!s.addrs.contains_key(&ip));
    }

    #[test]
    fn failures_keep_the_last_good_addresses_and_back_off() {
        let dns = policy().dns;
        let now = Instant::now();
        let mut s = NameState::new(now);
        s.answer(&host("a.example", &[("192.0.2.1", 60)], &[]), now, &dns);
        let kept = s.addrs.clone();
        let t = now + Duration::from_secs(60);
        s.answer(&host("a.example", &[], &["A: timed out"]), t, &dns);
        assert_eq!(
            s.addrs, kept,
            "a failure renews nothing and removes nothing"
        );
        assert_eq!(s.failures, 1);
        assert_eq!(s.next_due, t + Duration::from_secs(1));
        s.answer(&host("a.example", &[], &["A: timed out"]), t, &dns);
        assert_eq!(s.next_due, t + Duration::from_secs(2));
        // NXDOMAIN is an answer: no backoff.
        s.answer(&host("a.example", &[], &[]), t, &dns);
        assert_eq!(s.failures, 0);
        assert_eq!(s.next_due, t + dns.refresh_min);
    }

    #[test]
    fn desired_elements_take_the_latest_expiry_and_renewals_only_move_forward() {
        let p = policy();
        let now = Instant::now();
        let ip: IpAddr = "192.0.2.9".parse().unwrap();
        let mut names = BTreeMap::new();
        let mut a = NameState::new(now);
        a.addrs.insert(ip, now + Duration::from_secs(100));
        let mut b = NameState::new(now);
        b.addrs.insert(ip, now + Duration::from_secs(200));
        names.insert("a.example".parse().unwrap(), a);
        names.insert("b.example".parse().unwrap(), b);

        let svc = services(&p);
        let want = desired(names.iter(), &svc, now);
        let t443 = Tuple {
            net: ip.into(),
            proto: L4Proto::Tcp,
            ports: PortRange::single(443),
        };
        let t80 = Tuple {
            ports: PortRange::single(80),
            ..t443
        };
        assert_eq!(want.len(), 2);
        assert_eq!(want[&t443], now + Duration::from_secs(200));
        assert_eq!(want[&t80], now + Duration::from_secs(200));

        let mut installed = BTreeMap::new();
        assert_eq!(
            renewals(&want, &installed, Duration::ZERO).len(),
            2,
            "new elements are sent"
        );
        installed.extend(want.clone());
        assert!(
            renewals(&want, &installed, Duration::ZERO).is_empty(),
            "nothing changed, nothing sent"
        );
        installed.insert(t80, now + Duration::from_secs(250));
        assert!(
            renewals(&want, &installed, Duration::ZERO).is_empty(),
            "a later expiry in the kernel is never shortened"
        );
        installed.insert(t443, now + Duration::from_secs(150));
        assert_eq!(
            renewals(&want, &installed, Duration::ZERO),
            vec![(t443, now + Duration::from_secs(200))]
        );

        // Expired addresses want nothing.
        let much_later = now + Duration::from_secs(201);
        assert!(desired(names.iter(), &svc, much_later).is_empty());
        // A refresh of name a alone cannot shorten what b gave the shared element.
        let only_a = desired(
            names.iter().filter(|(n, _)| n.as_str() == "a.example"),
            &svc,
            now,
        );
        let mut kernel = BTreeMap::from([(t443, now + Duration::from_secs(200))]);
        kernel.insert(t80, now + Duration::from_secs(200));
        assert!(renewals(&only_a, &kernel, Duration::ZERO).is_empty());
    }

    #[test]
    fn timed_elements_carry_the_remaining_lifetime() {
        let now = Instant::now();
        let t = Tuple {
            net: "192.0.2.9/32".parse().unwrap(),
            proto: L4Proto::Tcp,
            ports: PortRange::single(443),
        };
        assert_eq!(
            timed(t, now + Duration::from_secs(90), now).timeout_ms,
            Some(90_000)
        );
        assert_eq!(
            timed(t, now, now).timeout_ms,
            Some(1),
            "never zero: zero means none"
        );
    }

    #[test]
    fn guard_answers_live_for_their_ttl_or_the_floor_plus_grace_and_renew_with_slack() {
        let p = Policy::parse(
            "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [443]\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  floor: 30s\n  grace: 10m\n",
            Path::new("p.yaml"),
        )
        .expect("valid");
        let guard = p.dns.guard.as_ref().unwrap();
        let grace = p.dns.grace;
        assert_eq!(
            guard_lifetime(5, guard, &p.dns),
            Duration::from_secs(30 + 600)
        );
        assert_eq!(
            guard_lifetime(3600, guard, &p.dns),
            Duration::from_secs(3600 + 600)
        );

        let now = Instant::now();
        let t = Tuple {
            net: "192.0.2.9/32".parse().unwrap(),
            proto: L4Proto::Tcp,
            ports: PortRange::single(443),
        };
        let installed = BTreeMap::from([(t, now + Duration::from_secs(630))]);
        let slack = renew_slack(grace);
        // Asked again a minute later: the element still outlives the new TTL by far.
        let later = BTreeMap::from([(t, now + Duration::from_secs(690))]);
        assert!(renewals(&later, &installed, slack).is_empty());
        // Asked again after six minutes: less than half the grace would be left.
        let much_later = BTreeMap::from([(t, now + Duration::from_secs(630 + 301))]);
        assert_eq!(renewals(&much_later, &installed, slack).len(), 1);
    }

    #[test]
    fn no_answer_lives_past_refresh_max_plus_grace_whatever_its_ttl() {
        let p = Policy::parse(
            "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [443]\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  floor: 30s\n  grace: 10m\n  refresh: { min: 30s, max: 1h }\n",
            Path::new("p.yaml"),
        )
        .expect("valid");
        let guard = p.dns.guard.as_ref().unwrap();
        let cap = Duration::from_secs(3600 + 600);
        assert_eq!(lifetime_cap(&p.dns), cap);
        assert_eq!(guard_lifetime(86_400, guard, &p.dns), cap);
        assert_eq!(guard_lifetime(0x7fff_ffff, guard, &p.dns), cap);
        // RFC 2181: the top bit set means zero, so the floor.
        let floor = Duration::from_secs(30 + 600);
        assert_eq!(guard_lifetime(u32::MAX, guard, &p.dns), floor);
        assert_eq!(guard_lifetime(0x8000_0000, guard, &p.dns), floor);
        // A floor above refresh.max is the policy's explicit wish: it is the cap then.
        let mut dns = p.dns.clone();
        dns.refresh_max = Duration::from_secs(10);
        let g = dns.guard.as_ref().unwrap();
        assert_eq!(guard_lifetime(86_400, g, &dns), floor);
        assert_eq!(lifetime_cap(&dns), floor);
        // Resolve mode: the refresh interval is clamped to refresh.max.
        let dns = policy().dns;
        assert_eq!(
            interval(u32::MAX >> 1, &dns) + dns.grace,
            lifetime_cap(&dns)
        );
    }

    #[test]
    fn a_batch_names_each_element_after_a_name_that_gives_it() {
        let p = policy();
        let now = Instant::now();
        let ip: IpAddr = "192.0.2.9".parse().unwrap();
        let mut a = NameState::new(now);
        a.addrs.insert(ip, now + Duration::from_secs(100));
        let mut b = NameState::new(now);
        b.addrs.insert(ip, now + Duration::from_secs(100));
        let (na, nb): (DomainName, DomainName) =
            ("a.example".parse().unwrap(), "b.example".parse().unwrap());
        let svc = services(&p);
        let t80 = resolved_tuple(ip, (L4Proto::Tcp, 80));
        let t443 = resolved_tuple(ip, (L4Proto::Tcp, 443));
        let names = [(&na, &a), (&nb, &b)];
        let got = owners(names.iter().copied(), &svc, now);
        assert_eq!(got.get(&t443), Some(&&na));
        assert_eq!(
            got.get(&t80),
            Some(&&nb),
            "only b.example is allowed on port 80"
        );
        let later = now + Duration::from_secs(101);
        assert!(owners(names.iter().copied(), &svc, later).is_empty());
    }

    #[test]
    fn carried_elements_join_the_resolved_sets_without_shortening_any() {
        let p = policy();
        let now = Instant::now();
        let mut rs = plan_with(
            &p,
            &crate::core::plan::tests::resolution(&[("a.example", &["192.0.2.1"])]),
            |_, _| Some(Duration::from_secs(100)),
        );
        let tuple = |ip: &str| Tuple {
            net: ip.parse().unwrap(),
            proto: L4Proto::Tcp,
            ports: PortRange::single(443),
        };
        let carry = |secs| Carried {
            expires: now + Duration::from_secs(secs),
            name: "a.example".into(),
        };
        let carried = BTreeMap::from([
            (tuple("192.0.2.1/32"), carry(50)),
            (tuple("192.0.2.2/32"), carry(70)),
            (tuple("2001:db8::2/128"), carry(70)),
        ]);
        add_carried(&mut rs, &carried, now);
        let timed_in = |family| match &rs
            .set(SetId::new(SetRole::Resolved, family))
            .unwrap()
            .elements
        {
            Elements::Timed(t) => t.clone(),
            other => panic!("{other:?}"),
        };
        let v4 = timed_in(crate::core::ruleset::Family::V4);
        let of = |ip: &str| {
            v4.iter()
                .find(|t| t.tuple == tuple(ip))
                .map(|t| t.timeout_ms)
        };
        assert_eq!(
            of("192.0.2.1/32"),
            Some(Some(100_000)),
            "the later expiry wins"
        );
        assert_eq!(of("192.0.2.2/32"), Some(Some(70_000)));
        assert_eq!(timed_in(crate::core::ruleset::Family::V6).len(), 1);
    }

    #[test]
    fn learned_names_are_forgotten_after_an_hour_or_at_once_past_the_cap() {
        let now = Instant::now();
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let state = |expires: Instant| {
            let mut s = NameState::new(now);
            s.addrs.insert(ip, expires);
            s
        };
        let name = |n: &str| -> DomainName { n.parse().unwrap() };
        let mut names = BTreeMap::from([
            (
                name("live.pool.example"),
                state(now + Duration::from_secs(60)),
            ),
            (
                name("recent.pool.example"),
                state(now - Duration::from_secs(60)),
            ),
            (
                name("old.pool.example"),
                state(now - REMEMBER_EXPIRED - Duration::from_secs(1)),
            ),
        ]);
        forget_learned_names(&mut names, now, 10);
        let kept: Vec<&str> = names.keys().map(|n| n.as_str()).collect();
        assert_eq!(kept, ["live.pool.example", "recent.pool.example"]);
        forget_learned_names(&mut names, now, 1);
        assert_eq!(names.len(), 2, "one former name is within the cap");
        forget_learned_names(&mut names, now, 0);
        let kept: Vec<&str> = names.keys().map(|n| n.as_str()).collect();
        assert_eq!(
            kept,
            ["live.pool.example"],
            "live names are never forgotten"
        );
    }

    #[test]
    fn one_name_holds_at_most_its_cap_of_live_addresses_and_always_renews_them() {
        let now = Instant::now();
        let life = |_| Duration::from_secs(60);
        let answer = |first: u32, n: u32| -> Vec<ResolvedAddr> {
            (first..first + n)
                .map(|i| ResolvedAddr {
                    addr: IpAddr::from(std::net::Ipv4Addr::from(0xc612_0000 + i)),
                    ttl: 0,
                })
                .collect()
        };
        let mut state = NameState::new(now);
        // A zone that answers fresh addresses every time: 28 at a time, 20 times.
        let mut left_out = 0;
        for k in 0..20 {
            left_out += state.extend(&answer(k * 28, 28), now, life, true).left_out;
        }
        let cap = MAX_LIVE_ADDRS_PER_NAME;
        assert_eq!(state.live(now).count(), cap);
        assert_eq!(left_out, 20 * 28 - cap);
        // What is live renews, also at the cap; an IPv6 address has a cap of its own.
        let later = now + Duration::from_secs(30);
        let renewed = state.extend(&answer(0, 28), later, life, true);
        assert_eq!(renewed, Extended::default());
        assert_eq!(state.addrs[&IpAddr::from([198, 18, 0, 0])], later + life(0));
        let v6 = ResolvedAddr {
            addr: "2001:db8::1".parse().unwrap(),
            ttl: 0,
        };
        assert_eq!(state.extend(&[v6], later, life, true).added.len(), 1);
        // Without room in the sets, nothing new, but renewals still.
        let mut other = NameState::new(now);
        assert_eq!(other.extend(&answer(0, 3), now, life, false).left_out, 3);
        assert_eq!(other.live(now).count(), 0);
        // Once they expire, room comes back.
        let after = now + Duration::from_secs(61);
        assert_eq!(
            state
                .extend(&answer(9_000, 1), after, life, true)
                .added
                .len(),
            1
        );
    }

    #[test]
    fn past_the_cap_only_names_with_live_addresses_take_answers() {
        let now = Instant::now();
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let state = |expires: Instant| {
            let mut s = NameState::new(now);
            s.addrs.insert(ip, expires);
            s
        };
        let name = |n: &str| -> DomainName { n.parse().unwrap() };
        let names = BTreeMap::from([
            (name("a.pool.example"), state(now + Duration::from_secs(60))),
            (name("b.pool.example"), state(now + Duration::from_secs(60))),
            (
                name("gone.pool.example"),
                state(now - Duration::from_secs(1)),
            ),
        ]);
        // Below the cap nothing is counted.
        let mut live = None;
        assert!(may_track(
            &names,
            &name("new.pool.example"),
            now,
            4,
            &mut live
        ));
        assert_eq!(live, None);
        // At the cap: a live name renews, a new one and a former one are refused.
        let mut live = None;
        assert!(may_track(
            &names,
            &name("a.pool.example"),
            now,
            2,
            &mut live
        ));
        assert!(!may_track(
            &names,
            &name("new.pool.example"),
            now,
            2,
            &mut live
        ));
        assert!(!may_track(
            &names,
            &name("gone.pool.example"),
            now,
            2,
            &mut live
        ));
        assert_eq!(live, Some(2));
        // One place left is taken once, by the first answer of the batch.
        let mut live = None;
        assert!(may_track(
            &names,
            &name("new.pool.example"),
            now,
            3,
            &mut live
        ));
        assert!(!may_track(
            &names,
            &name("other.pool.example"),
            now,
            3,
            &mut live
        ));
        assert_eq!(live, Some(3));
    }
}
