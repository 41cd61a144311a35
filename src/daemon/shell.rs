//! The daemon's I/O around its [`Core`]: the netlink table, the resolver, the DNS guard's
//! tasks, signals, the change monitor, conntrack, the state directory and systemd. It turns
//! what happens into [`Event`]s and carries out the [`Effect`]s the core returns; it decides
//! nothing about names, lifetimes or the table.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{Semaphore, broadcast, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tracing::{error, info, warn};

use super::core::{Core, Effect, Event, GuardAnswer, NewAddresses, ScopeFacts};
use super::metrics::Metrics;
use super::{AuditFor, DaemonError, Options, io};
use crate::core::guard_identity::GuardIdentity;
use crate::core::lifetime::Lifetimes;
use crate::core::plan::{AUDIT_RENEW_EVERY, AUDIT_WINDOW, Extras};
use crate::core::policy::{Policy, PolicyError};
use crate::core::resolution::{HostScope, ResolvedHost};
use crate::core::ruleset::CgroupMatch;
use crate::core::ruleset::TABLE;
use crate::dns::resolve::{NameResolver, ResolveError};
use crate::guard::{Answered, Counters, Guard, Rules};
use crate::host::HostAddrsCache;
use crate::nft::Nft;
use crate::nft::monitor::Monitor;
use crate::state::WriterLock;
use crate::watch::DropEvent;
use nix::sys::inotify::Inotify;

/// How many waiting answers go into one batch.
const MAX_ANSWER_BATCH: usize = 256;

/// How often a scoped policy's host facts are read again, besides when inotify says a
/// watched cgroup directory changed: it catches what inotify cannot (a listed cgroup below a
/// parent that did not exist yet, a bridge's addresses and ports, a cgroup delegated since).
/// The longest a listed cgroup made again goes unfenced.
const SCOPE_POLL: Duration = Duration::from_secs(2);

/// A policy that parsed, with what of the host its scope lists, read right after.
type Parsed = (Result<(Policy, String), PolicyError>, ScopeFacts);

pub(super) struct Daemon {
    core: Core,
    options: Options,
    /// Held until the daemon exits.
    lock: Arc<WriterLock>,
    /// `None` until the resolvers are known (resolv.conf may not exist yet at boot), and in
    /// guard mode.
    resolver: Option<NameResolver>,
    nft: Nft,
    /// The DNS guard, once it serves.
    guard: Option<GuardLink>,
    /// This host's addresses and subnet broadcasts, which no guard answer may install.
    host_addrs: HostAddrsCache,
    /// What `--metrics` serves, when it is on.
    metrics: Option<Arc<Metrics>>,
}

/// The daemon's side of the DNS guard.
struct GuardLink {
    /// The guard's slots for forwarded queries, and how many there are: the queries in
    /// flight are those taken.
    in_flight: Arc<Semaphore>,
    slots: usize,
    rules: watch::Sender<Arc<Rules>>,
    counters: Arc<Counters>,
    events_path: PathBuf,
}

impl Daemon {
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn start(
        options: Options,
        lock: Arc<WriterLock>,
        nft: Nft,
        policy: Policy,
        policy_text: String,
        guard: Option<GuardIdentity>,
        metrics: Option<Arc<Metrics>>,
        extras: Extras,
    ) -> Result<Daemon, DaemonError> {
        let guard_mode = guard.is_some();
        let (resolvers, resolver) = match (&guard, resolver_for(&policy, &options)) {
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
        let policy_path = std::path::absolute(&options.policy_path)
            .unwrap_or_else(|_| options.policy_path.clone());
        // The guard bound its sockets a moment ago: the bridge addresses it listens on are
        // those, for its whole life.
        let bridge_listen = match (&guard, &policy.dns.guard) {
            (Some(identity), Some(settings)) => identity
                .listen
                .iter()
                .filter(|a| !settings.listen.contains(a))
                .copied()
                .collect(),
            _ => Vec::new(),
        };
        let cgroups = crate::host::listed_cgroups(&policy);
        warn_missing_cgroups(&policy, &cgroups);
        let host_scope = HostScope {
            cgroups,
            bridge_listen,
        };
        let mut core = Core::new(
            policy,
            policy_text,
            policy_path,
            resolvers,
            guard,
            Instant::now(),
        );
        core.set_host_scope(host_scope);
        core.set_extras(extras);
        let mut daemon = Daemon {
            core,
            options,
            lock,
            resolver,
            nft,
            guard: None,
            host_addrs: HostAddrsCache::new(),
            metrics,
        };
        // A running boundary (a restart) is replaced only once its names are resolved, so
        // that nothing allowed goes missing for a moment. Without one (boot), the
        // deny-by-default skeleton goes up at once: it needs no DNS, and names follow as they
        // resolve.
        let mut added = None;
        if daemon.nft.table_exists()? {
            match guard_mode {
                true => daemon.core.carry_over(&mut daemon.nft, Instant::now()),
                false => added = daemon.resolve_all().await,
            }
        }
        // The first apply must work: a daemon that cannot install its boundary exits (run()
        // leaves the fail-closed table). A refusal is the policy's fault: only an edit fixes
        // it, so it is not retried; anything else is, by systemd's Restart=.
        let mut effects = Vec::new();
        daemon
            .core
            .apply_all(&mut daemon.nft, Instant::now(), &mut effects)
            .map_err(|e| match e.is_refusal_of_content() {
                true => DaemonError::TableRefused(e),
                false => DaemonError::Nft(e),
            })?;
        if let Some(added) = added {
            added.log();
        }
        daemon.carry_out(effects, &mut BTreeMap::new());
        daemon.publish_metrics();
        Ok(daemon)
    }

    /// Starts serving DNS, now that the table is up; returns where answers wait for their
    /// addresses to be installed.
    pub(super) fn start_guard(&mut self, guard: Guard) -> mpsc::Receiver<Answered> {
        let rules = self
            .core
            .guard()
            .and_then(|identity| Rules::of(self.core.policy(), identity))
            .expect("the policy is in guard mode")
            .auditing(self.core.auditing());
        let (rules_tx, rules_rx) = watch::channel(Arc::new(rules));
        let (answered_tx, answered_rx) = mpsc::channel(1024);
        let (events, _) = broadcast::channel(1024);
        let counters = Arc::new(Counters::default());
        if let Some(metrics) = &self.metrics {
            metrics.guard_counters(counters.clone());
        }
        let events_path = self.options.state.guard_events();
        // Without it `watch` misses refused queries; the log still has them.
        if let Err(e) = crate::guard::serve_events(events_path.clone(), events.clone()) {
            warn!(error = %e, "refused queries will be in the log only");
        }
        let in_flight = guard.in_flight_limit();
        let slots = in_flight.available_permits();
        guard.serve(crate::guard::Context {
            in_flight: in_flight.clone(),
            log_budget: Default::default(),
            rules: rules_rx,
            answered: answered_tx,
            events,
            counters: counters.clone(),
            trace: self.options.trace().cloned(),
            upstream_sockets: Default::default(),
        });
        // The policy's addresses and, with `scope.forward`, the listed bridges' it bound.
        let listen: Vec<SocketAddr> = self
            .core
            .guard()
            .map(|g| g.listen.clone())
            .unwrap_or_default();
        info!(listen = ?listen, upstream = ?self.core.resolvers(), "the DNS guard is serving");
        for w in self
            .core
            .policy()
            .upstreams_on_this_host(&crate::host::read_addrs_or_warn())
        {
            warn!("{w}");
        }
        self.guard = Some(GuardLink {
            in_flight,
            slots,
            rules: rules_tx,
            counters,
            events_path,
        });
        answered_rx
    }

    /// Hands `event` to the core and carries out what it asks.
    fn handle(&mut self, event: Event<'_>, releases: &mut BTreeMap<usize, oneshot::Sender<bool>>) {
        let effects = self.core.on(event, Instant::now(), &mut self.nft);
        self.carry_out(effects, releases);
    }

    fn carry_out(
        &mut self,
        effects: Vec<Effect>,
        releases: &mut BTreeMap<usize, oneshot::Sender<bool>>,
    ) {
        for effect in effects {
            match effect {
                Effect::Record(new) => {
                    self.record(*new);
                    // The full table's plan, batch and record are gone: give their pages back.
                    crate::nft::sys::release_free_memory();
                }
                Effect::Release(verdicts) => {
                    for (id, ok) in verdicts {
                        if let Some(done) = releases.remove(&id) {
                            let _ = done.send(ok);
                        }
                    }
                }
                Effect::ReadFlows { at } => match crate::netlink::conntrack::live_flows() {
                    Ok(flows) => {
                        let effects =
                            self.core
                                .on(Event::LiveFlows { flows, at }, at, &mut self.nft);
                        self.carry_out(effects, releases);
                    }
                    Err(e) => warn!(error = %e, "cannot read conntrack; addresses expire on time"),
                },
                Effect::GuardRules(rules) => {
                    if let Some(link) = &self.guard {
                        let rules = rules.auditing(self.core.auditing());
                        link.rules.send_replace(Arc::new(rules));
                    }
                }
                Effect::CountRefused {
                    family,
                    reason,
                    deny_entry,
                } => {
                    if let Some(metrics) = &self.metrics {
                        metrics.count_refused(family, reason, deny_entry);
                    }
                }
                // Only a wakeup asks for lookups and only a reload adopts: the event loop and
                // `reload`, which own the lookup task and the resolver, take them first.
                Effect::Lookup(_) | Effect::Adopted => {
                    debug_assert!(false, "a lookup or adoption reached carry_out")
                }
            }
        }
    }

    /// Records the applied configuration as a generation. A failure is logged, never fatal:
    /// the boundary matters more than its record.
    fn record(&mut self, new: crate::state::NewGeneration) {
        match self
            .options
            .state
            .record(&self.lock, new, self.options.keep)
        {
            Ok(g) => {
                info!(
                    generation = g.generation,
                    "recorded generation {}", g.generation
                );
                if let Some(metrics) = &self.metrics {
                    metrics.recorded(g.generation);
                }
            }
            Err(e) => error!(error = %e, "the applied table could not be recorded as a generation"),
        }
    }

    /// Looks every name up before the first apply; what the answers added is said once the
    /// table holds it.
    async fn resolve_all(&mut self) -> Option<NewAddresses> {
        let resolver = self.resolver.clone()?;
        match resolver.lookup_all(self.core.names()).await {
            Ok(hosts) => Some(self.core.take_answers(&hosts, Instant::now())),
            Err(e) => {
                error!(error = %e, "resolver failure");
                None
            }
        }
    }

    /// The resolver, looking for the resolvers again if they were not known; when they
    /// appear, the DNS sets change, so the table is applied anew.
    fn resolver(&mut self) -> Option<NameResolver> {
        if self.resolver.is_none() {
            match resolver_for(self.core.policy(), &self.options) {
                Ok((resolvers, resolver)) => {
                    self.resolver = Some(resolver);
                    self.handle(Event::ResolversFound(resolvers), &mut BTreeMap::new());
                }
                Err(e) => warn!(error = %e, "still no resolvers"),
            }
        }
        self.resolver.clone()
    }

    /// Reads and validates the policy file on a thread of the blocking pool, and what of the
    /// host its scope lists: the event loop goes on healing and answering meanwhile.
    fn parse_policy(&self) -> JoinHandle<Parsed> {
        let path = self.options.policy_path.clone();
        let auditing = self.options.audit().is_some();
        let trusted = self.options.trusted_policy_file;
        tokio::task::spawn_blocking(move || {
            let loaded = super::load_policy(&path, trusted).and_then(|(policy, text)| {
                if !auditing {
                    policy.refuse_audit(&text, &path, "run")?;
                }
                policy.refuse_scope_holes(&text, &path, &crate::host::ThisHost)?;
                Ok((policy, text))
            });
            let facts = match &loaded {
                Ok((policy, _)) => scope_facts(policy),
                Err(_) => ScopeFacts::default(),
            };
            (loaded, facts)
        })
    }

    /// What of the host the running policy's scope lists, read again: the core has the table
    /// follow its cgroups.
    fn follow_host_scope(&mut self) {
        // The table has no rule for these (refusing forwarding from a bridge that gained a
        // port to the LAN needs one): each is said loudly, every time it is seen.
        for hole in crate::host::scope_holes(self.core.policy()) {
            error!("{hole}; this scope is NOT fenced as its policy says until the host is fixed");
        }
        let facts = scope_facts(self.core.policy());
        self.handle(Event::HostScope(facts), &mut BTreeMap::new());
    }

    /// A reloaded policy, parsed: its resolvers are looked for here (they may be
    /// resolv.conf's), then the core decides. Returns whether it was adopted.
    fn reload(&mut self, (loaded, scope): Parsed) -> bool {
        let mut fresh = None;
        let resolvers = match &loaded {
            Ok((policy, _)) if policy.dns.guard.is_none() => {
                Some(match resolver_for(policy, &self.options) {
                    Ok((resolvers, resolver)) => {
                        fresh = Some(resolver);
                        Ok(resolvers)
                    }
                    Err(e) => Err(e.to_string()),
                })
            }
            _ => None,
        };
        let effects = self.core.on(
            Event::Reload {
                loaded: Box::new(loaded),
                resolvers,
                scope,
            },
            Instant::now(),
            &mut self.nft,
        );
        let adopted = effects.iter().any(|e| matches!(e, Effect::Adopted));
        if adopted {
            // A guard-mode policy has no resolver of its own: the guard forwards.
            self.resolver = fresh;
            warn_missing_cgroups(self.core.policy(), &self.core.host_scope().cgroups);
        }
        self.carry_out(
            effects
                .into_iter()
                .filter(|e| !matches!(e, Effect::Adopted))
                .collect(),
            &mut BTreeMap::new(),
        );
        adopted
    }

    /// Whether more forwarded queries are in flight than the `at_hand` answers: others wait
    /// for their upstream, whose answers may be arriving now.
    fn more_answers_due(&self, at_hand: usize) -> bool {
        self.guard.as_ref().is_some_and(|link| {
            link.slots
                .saturating_sub(link.in_flight.available_permits())
                > at_hand
        })
    }

    /// Installs the addresses of guard answers, this one and whatever else is waiting, in one
    /// batch, then releases them all.
    fn install_answers(&mut self, first: Answered, waiting: &mut mpsc::Receiver<Answered>) {
        let mut batch = vec![first];
        while batch.len() < MAX_ANSWER_BATCH {
            match waiting.try_recv() {
                Ok(a) => batch.push(a),
                Err(_) => break,
            }
        }
        let mut releases = BTreeMap::new();
        let answers = batch
            .into_iter()
            .enumerate()
            .map(|(id, a)| {
                releases.insert(id, a.done);
                GuardAnswer {
                    id,
                    name: a.name,
                    addrs: a.addrs,
                }
            })
            .collect();
        let host_addrs = self.host_addrs.current();
        let effects = self.core.on(
            Event::GuardAnswers {
                answers,
                host_addrs,
            },
            Instant::now(),
            &mut self.nft,
        );
        self.carry_out(effects, &mut releases);
    }

    /// Logs a refused packet, judged against this host's addresses.
    fn refused(&mut self, event: DropEvent) {
        let host_addrs = self.host_addrs.current();
        let effects = self.core.on(
            Event::Refused { event, host_addrs },
            Instant::now(),
            &mut self.nft,
        );
        self.carry_out(effects, &mut BTreeMap::new());
    }

    /// Hands what the core knows to the metrics server (at most once a second: it walks
    /// the names).
    fn publish_metrics(&self) {
        if let Some(metrics) = &self.metrics {
            metrics.publish(self.core.view(Instant::now()));
        }
    }

    fn status_line(&self) -> String {
        let guard = self.guard.as_ref().map(|link| {
            let count = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
            let c = &link.counters;
            (count(&c.answered), count(&c.refused), count(&c.failed))
        });
        self.core.status_line(Instant::now(), guard)
    }

    pub(super) async fn serve(
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
        let sweep = Lifetimes::of(&self.core.policy().dns).sweep_every();
        let mut sweep_tick = tokio::time::interval(sweep.unwrap_or(Duration::from_secs(3600)));
        let _ = sd_notify::notify(&[
            sd_notify::NotifyState::Ready,
            sd_notify::NotifyState::Status(&last_status),
        ]);
        info!(status = %self.status_line(), "running");

        // Lookups run beside the loop, so a slow resolver never delays healing or signals.
        let mut lookup: Option<JoinHandle<Result<Vec<ResolvedHost>, ResolveError>>> = None;
        // So does reading a reloaded policy: its text is anyone's, and the loop heals.
        let mut parsing: Option<JoinHandle<Parsed>> = None;
        // Where listed cgroups come and go; polled as well.
        let mut cgroup_watch = CgroupWatch::new();
        cgroup_watch.watch(self.core.policy());
        let mut scope_tick = tokio::time::interval(SCOPE_POLL);
        scope_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut parse_again = false;
        let mut no_releases = BTreeMap::new();
        // `learn`: the window is renewed while the daemon runs, and closes at the deadline.
        let mut renew_tick = tokio::time::interval(AUDIT_RENEW_EVERY);
        let audit_ends = match self.options.audit() {
            Some(AuditFor::Duration(d)) => Some(Instant::now() + d),
            _ => None,
        };
        loop {
            tokio::select! {
                _ = renew_tick.tick(), if self.core.auditing() => {
                    let mut fx = Vec::new();
                    self.core.renew_audit(&mut self.nft, Instant::now(), &mut fx);
                    self.carry_out(fx, &mut no_releases);
                }
                _ = sleep_until(audit_ends.unwrap_or_else(Instant::now)), if audit_ends.is_some() => {
                    info!("the audit's duration is over");
                    break;
                }
                _ = sleep_until(self.core.next_wakeup(Instant::now())), if lookup.is_none() => {
                    let effects = self.core.on(Event::Wake, Instant::now(), &mut self.nft);
                    for effect in effects {
                        match effect {
                            Effect::Lookup(due) => match self.resolver() {
                                Some(resolver) => {
                                    lookup = Some(tokio::spawn(async move {
                                        resolver.lookup_all(due).await
                                    }));
                                }
                                None => self.handle(Event::NoResolvers, &mut no_releases),
                            },
                            other => self.carry_out(vec![other], &mut no_releases),
                        }
                    }
                }
                done = async { lookup.as_mut().expect("guarded").await }, if lookup.is_some() => {
                    lookup = None;
                    let event = match done {
                        Ok(Ok(hosts)) => Event::Answers(hosts),
                        Ok(Err(e)) => Event::LookupFailed { error: e.to_string(), task: false },
                        Err(e) => Event::LookupFailed { error: e.to_string(), task: true },
                    };
                    self.handle(event, &mut no_releases);
                    // A round of lookups and its renewals leave the heap's high-water mark at
                    // twice what stays live until the next round.
                    crate::nft::sys::release_free_memory();
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
                        let parsed = parsed.unwrap_or_else(|e| {
                            let error = PolicyError::Read {
                                path: self.options.policy_path.clone(),
                                error: std::io::Error::other(e),
                            };
                            (Err(error), ScopeFacts::default())
                        });
                        if self.reload(parsed) {
                            cgroup_watch.watch(self.core.policy());
                            // The lookup under way asked for the old names; the new ones are due.
                            if let Some(pending) = lookup.take() {
                                pending.abort();
                            }
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
                        let event = match drained.changes.is_empty() {
                            false => Event::TableChanged(&drained.changes),
                            true => Event::NotificationsLost,
                        };
                        self.handle(event, &mut no_releases);
                    }
                }
                Some(event) = async { drops.as_mut().expect("guarded").recv().await }, if drops.is_some() => {
                    self.refused(event);
                }
                Some(answer) = async { answers.as_mut().expect("guarded").recv().await }, if answers.is_some() => {
                    let waiting = answers.as_mut().expect("guarded");
                    if self.more_answers_due(1 + waiting.len()) {
                        // Upstream answers that arrived while this one was handled join its
                        // batch: one commit for them all. The first turn of the runtime
                        // polls the sockets, the second runs the tasks they woke, which pass
                        // their answers on. A query alone is installed at once.
                        tokio::task::yield_now().await;
                        tokio::task::yield_now().await;
                    }
                    self.install_answers(answer, waiting);
                }
                changed = cgroup_watch.changed(), if cgroup_watch.watching() => {
                    match changed {
                        // A parent made just now is watched from now on.
                        true => cgroup_watch.watch(self.core.policy()),
                        false => cgroup_watch.stop(),
                    }
                    self.follow_host_scope();
                }
                _ = scope_tick.tick(), if follows_host(self.core.policy()) => {
                    // A parent made since is watched from now on.
                    cgroup_watch.watch(self.core.policy());
                    self.follow_host_scope();
                }
                // Brings the status line below up to date even when nothing else happens.
                _ = status_tick.tick() => {}
                _ = sweep_tick.tick(), if sweep.is_some() => self.handle(Event::Sweep, &mut no_releases),
                _ = watchdog_tick.tick(), if watchdog.is_some() => {
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
                }
            }
            // Only changes, at most once a second: the notify socket is a datagram queue
            // that a slow reader fills, and counting addresses is not free.
            if status_at.elapsed() >= Duration::from_secs(1) {
                status_at = Instant::now();
                self.publish_metrics();
                let status = self.status_line();
                if status != last_status {
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(&status)]);
                    last_status = status;
                }
            }
        }

        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        if self.options.recording.is_some() {
            // The window closes and the flow record stops: the table is the policy's again.
            let mut fx = Vec::new();
            match self.core.end_extras(&mut self.nft, Instant::now(), &mut fx) {
                Ok(()) => info!(
                    policy = %self.options.policy_path.display(),
                    "recording stopped{}; the table enforces the policy again",
                    if self.options.audit().is_some() { " and the audit window closed" } else { "" }
                ),
                // The window still closes by itself within its timeout.
                Err(e) => {
                    error!(error = %e, "the table could not be put back without the audit;                                   its window closes by itself within {} s", AUDIT_WINDOW.as_secs())
                }
            }
            self.carry_out(fx, &mut no_releases);
        }
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
    // Said at start, on each reload and when resolv.conf appears: whichever names them.
    let host = crate::host::read_addrs_or_warn();
    if let Some(w) = policy.squattable_resolvers(&resolvers, |a| host.is_own(a)) {
        warn!("{w}");
    }
    let resolver = NameResolver::new(&resolvers)?;
    Ok((resolvers, resolver))
}

/// Whether anything of the host `policy`'s table, guard or fence depends on can change:
/// listed cgroups (their ids, who may write them), listed interfaces (a bridge's ports, and in
/// guard mode their addresses).
fn follows_host(policy: &Policy) -> bool {
    policy
        .scope
        .as_ref()
        .is_some_and(|s| !s.cgroups.is_empty() || !s.forward.is_empty())
}

/// What of the host `policy`'s scope lists, as it is now.
fn scope_facts(policy: &Policy) -> ScopeFacts {
    if policy.scope.is_none() {
        return ScopeFacts::default();
    }
    ScopeFacts {
        cgroups: crate::host::listed_cgroups(policy),
        bridges: crate::host::listed_bridge_addrs(policy),
    }
}

/// Names each listed cgroup that does not exist (`found` are those that do): nobody is in it
/// yet, and it is fenced once it appears.
fn warn_missing_cgroups(policy: &Policy, found: &[CgroupMatch]) {
    for path in policy.scope.iter().flat_map(|s| &s.cgroups) {
        if found.iter().any(|c| c.is_of(path)) {
            continue;
        }
        let why =
            crate::host::why_cgroup_missing(path).unwrap_or_else(|| "it appeared just now".into());
        warn!(
            cgroup = %path,
            "listed cgroup {path} is not fenced yet ({why}): nobody is in it; it is fenced from \
             the moment it appears (within {}s)",
            SCOPE_POLL.as_secs()
        );
    }
}

/// inotify on the directories where the listed cgroups come and go
/// ([`crate::host::cgroup_watch_dirs`]), so that the table follows at once; [`SCOPE_POLL`]
/// catches the rest, and all of it when inotify is not to be had. One instance for the
/// daemon's life, read on a thread of its own (blocking reads keep `unsafe` out of here);
/// a reload only adds the new policy's directories (a stale watch wakes the daemon for
/// nothing: its facts are unchanged).
struct CgroupWatch {
    inotify: Option<(Arc<Inotify>, mpsc::Receiver<()>)>,
    /// inotify failed once: polling only from then on.
    failed: bool,
}

impl CgroupWatch {
    fn new() -> CgroupWatch {
        CgroupWatch {
            inotify: None,
            failed: false,
        }
    }

    fn stop(&mut self) {
        self.inotify = None;
        self.failed = true;
    }

    fn watching(&self) -> bool {
        self.inotify.is_some()
    }

    /// Watches the directories of `policy`'s listed cgroups that exist now (one already
    /// watched keeps its watch; a removed one lost it), starting inotify at the first.
    fn watch(&mut self, policy: &Policy) {
        use nix::sys::inotify::AddWatchFlags as F;
        let dirs = crate::host::cgroup_watch_dirs(policy);
        if dirs.is_empty() || self.failed {
            return;
        }
        if self.inotify.is_none() {
            self.inotify = match start_inotify() {
                Ok(started) => Some(started),
                Err(e) => {
                    warn!(error = %e, "cannot watch the cgroup hierarchy; listed cgroups are \
                                       looked for every {}s", SCOPE_POLL.as_secs());
                    self.failed = true;
                    return;
                }
            };
        }
        let Some((inotify, _)) = &self.inotify else {
            return;
        };
        let events = F::IN_CREATE
            | F::IN_DELETE
            | F::IN_DELETE_SELF
            | F::IN_MOVED_FROM
            | F::IN_MOVED_TO
            | F::IN_ONLYDIR;
        for dir in dirs {
            // Not there yet: the poll finds it.
            let _ = inotify.add_watch(&dir, events);
        }
    }

    /// Waits until a watched directory changed; `false` when the watch ended (polling goes
    /// on).
    async fn changed(&mut self) -> bool {
        match &mut self.inotify {
            Some((_, changes)) => changes.recv().await.is_some(),
            None => std::future::pending().await,
        }
    }
}

/// An inotify instance, and a thread that reads it and says when something changed (many
/// events at once are one change: a new cgroup comes with its files).
fn start_inotify() -> Result<(Arc<Inotify>, mpsc::Receiver<()>), DaemonError> {
    use nix::sys::inotify::InitFlags;
    let inotify = Inotify::init(InitFlags::IN_CLOEXEC)
        .map(Arc::new)
        .map_err(|e| DaemonError::Io {
            doing: "start inotify",
            source: e.into(),
        })?;
    let (tx, rx) = mpsc::channel(1);
    let reader = inotify.clone();
    std::thread::Builder::new()
        .name("cgroup-watch".into())
        .spawn(move || {
            loop {
                match reader.read_events() {
                    Ok(_) => {
                        if let Err(mpsc::error::TrySendError::Closed(())) = tx.try_send(()) {
                            return;
                        }
                    }
                    Err(nix::errno::Errno::EINTR) => {}
                    Err(e) => {
                        warn!(error = %e, "watching the cgroup hierarchy failed; polling only");
                        return;
                    }
                }
            }
        })
        .map_err(io("start the cgroup watch"))?;
    Ok((inotify, rx))
}
