//! The daemon's decisions, apart from its sockets, signals and tasks (as boringtun keeps its
//! protocol apart from its I/O): the running policy, what the daemon knows of its names, and
//! what it told the kernel. [`Core::on`] takes one [`Event`] (the wakeup it asked for, answers,
//! a reload, a change by someone else, ...) and returns the [`Effect`]s the shell must carry out
//! (look names up, record a generation, release the guard's answers, ...).
//!
//! The table is written through the [`Table`] trait, within the event: whether the kernel took
//! a batch decides what follows at once (a refused reload keeps the running policy whole, a
//! refused batch answers the guard's clients SERVFAIL and reapplies), so its outcome is not an
//! event of its own. In unit tests the trait's in-memory double stands in for the kernel.
//! Logs are written where the decision is taken, as before the split.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;
use tracing::{error, info, warn};

use super::names::{
    AnswerChanges, Carried, Extended, MAX_FORMER_NAMES, MAX_LIVE_ADDRS_PER_NAME, MAX_LIVE_NAMES,
    MAX_RESOLVED_ELEMENTS, NameState, PRUNE_EVERY, Services, desired, forget_learned_names,
    live_resolution, may_track, owners, services, table_elements, timed,
};
use crate::core::explain::{self, WhyRefused};
use crate::core::guard_identity::GuardIdentity;
use crate::core::installable::{HostAddrs, retain_installable, summarise};
use crate::core::lifetime::{Lifetimes, renewals};
use crate::core::plan::{
    Extras, denied_addresses, denied_answers, element_allowed, plan_elements, services_of,
    with_extras, without_extras,
};
use crate::core::policy::{DomainName, Policy, PolicyError};
use crate::core::resolution::{HostScope, Resolution, ResolvedAddr, ResolvedHost};
use crate::core::ruleset::{
    CgroupMatch, Elements, Family, MAX_COMMENTED_NAME, Ruleset, SetId, SetRole, TABLE, Tuple,
};
use crate::guard::{LogBudget, Rules};
use crate::netlink::conntrack::Flow;
use crate::nft::monitor::Change;
use crate::nft::{NftError, Table};
use crate::state::{NewGeneration, Recorder};
use crate::watch::DropEvent;

/// What happens to the daemon.
pub enum Event<'a> {
    /// The time [`Core::next_wakeup`] named came: a failed apply is retried, due names are
    /// looked up.
    Wake,
    /// The resolvers appeared (resolve mode, started without them).
    ResolversFound(Vec<IpAddr>),
    /// Names were due but there are still no resolvers to ask.
    NoResolvers,
    /// A lookup's answers.
    Answers(Vec<ResolvedHost>),
    /// A lookup failed as a whole (`task`: the task running it failed).
    LookupFailed { error: String, task: bool },
    /// Guard mode: answers waiting for their addresses to be installed, with this host's
    /// addresses (which no answer may install).
    GuardAnswers {
        answers: Vec<GuardAnswer>,
        host_addrs: &'a HostAddrs,
    },
    /// Guard mode: time to look for live connections to addresses about to expire.
    Sweep,
    /// The live flows conntrack showed, for the sweep at `at`.
    LiveFlows { flows: BTreeSet<Flow>, at: Instant },
    /// SIGHUP's policy, read and parsed; for a resolve-mode policy, its resolvers; what of
    /// the host its scope lists, read with it.
    Reload {
        loaded: Box<Result<(Policy, String), PolicyError>>,
        resolvers: Option<Result<Vec<IpAddr>, String>>,
        scope: ScopeFacts,
    },
    /// What of the host the running policy's scope lists, read again (a listed cgroup came,
    /// went or was made again; a listed bridge's addresses changed): the table follows its
    /// cgroups.
    HostScope(ScopeFacts),
    /// Someone else changed the table.
    TableChanged(&'a [Change]),
    /// Change notifications were lost.
    NotificationsLost,
    /// A refused packet (`--log-drops`), with this host's addresses (to tell a refused
    /// source).
    Refused {
        event: DropEvent,
        host_addrs: &'a HostAddrs,
    },
}

/// What of the host a scope lists, as the shell read it (`crate::host`): its listed cgroups
/// that exist, with their ids, and (in guard mode) the addresses of its listed interfaces,
/// by interface.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScopeFacts {
    pub cgroups: Vec<CgroupMatch>,
    pub bridges: Vec<(String, SocketAddr)>,
}

/// One answer of the guard, as the core sees it: `id` names it in [`Effect::Release`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardAnswer {
    pub id: usize,
    pub name: DomainName,
    pub addrs: Vec<ResolvedAddr>,
}

/// What the shell carries out for the core.
#[derive(Debug)]
pub enum Effect {
    /// Look these names up; their answers come back as [`Event::Answers`].
    Lookup(Vec<DomainName>),
    /// Record the applied configuration as a generation.
    Record(Box<NewGeneration>),
    /// Read the live flows from conntrack, for [`Event::LiveFlows`].
    ReadFlows { at: Instant },
    /// Release the guard's answers: `true` once the kernel holds their addresses, `false`
    /// for SERVFAIL.
    Release(Vec<(usize, bool)>),
    /// The guard answers by these rules from now on.
    GuardRules(Rules),
    /// A reloaded policy was adopted (its resolver replaces the running one; a lookup under
    /// way asked for the old names).
    Adopted,
    /// Count a refused packet (`--log-drops`) for `run --metrics`: its family, why it was
    /// refused (one of [`WhyRefused::REASONS`]) and, when a deny entry refused it, the entry
    /// as the policy names it (bounded by the policy, never by what was refused).
    CountRefused {
        family: Family,
        reason: &'static str,
        deny_entry: Option<String>,
    },
}

/// What the core knows that `run --metrics` shows, read by the shell (at most once a
/// second). Names appear only where the policy bounds them: in resolve mode the policy's own
/// names; the names a guard learns from answers are the sandbox's to invent and are counted,
/// never listed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CoreView {
    pub guard_mode: bool,
    pub names: usize,
    pub addresses: usize,
    /// Resolve mode: each policy name and how many lookups of it failed in a row (0: its
    /// last lookup answered).
    pub lookup_failures: Vec<(String, u32)>,
    pub last_refresh: Option<SystemTime>,
    pub last_apply: Option<SystemTime>,
    /// How many times the table was put back after someone else changed it.
    pub heals: u64,
    /// Who changed it the last time.
    pub last_heal_by: Option<String>,
}

/// Addresses that answers added, by name: said ("new addresses allowed") only once the table
/// holds them, so that whoever reads the line can connect.
#[must_use]
pub struct NewAddresses(Vec<(DomainName, String)>);

impl NewAddresses {
    pub fn log(self) {
        for (name, added) in self.0 {
            info!(name = %name, added = %added, "new addresses allowed");
        }
    }
}

/// How many elements one upsert transaction carries at most. Each element is independent of
/// the others (a renewal or an addition), so a refresh that renews more is sent as several
/// transactions: the encoded batch, libnftnl's copy of the elements and the list they are
/// built from then never hold more than this many. Renewing all 10,000 addresses of 1,250
/// names at once peaked 3 MiB higher (benches/daemon.rs).
const MAX_UPSERT_BATCH: usize = 1024;

pub struct Core {
    policy: Policy,
    /// The text `policy` was read from, for the generation record.
    policy_text: String,
    /// Where it was read from (absolute), for the generation record.
    policy_path: PathBuf,
    /// The next successful full apply records a generation (the configuration changed).
    record_next_apply: bool,
    resolvers: Vec<IpAddr>,
    names: BTreeMap<DomainName, NameState>,
    services: Services,
    /// What the kernel was last told about each resolved element: its expiry.
    installed: BTreeMap<Tuple, Instant>,
    /// When expired entries are next dropped from `installed`.
    next_prune: Instant,
    /// When a failed full apply is tried again.
    retry_apply: Option<Instant>,
    last_refresh: Option<SystemTime>,
    /// When the kernel last accepted a full apply.
    last_apply: Option<SystemTime>,
    /// How many times the table was put back after someone else changed it, and who did
    /// the last time.
    heals: u64,
    last_heal_by: Option<String>,
    /// In guard mode, who the guard is (this process's uid, its mark and addresses): its
    /// sockets alone may reach the upstream resolvers. Its upstream follows reloads.
    guard: Option<GuardIdentity>,
    /// What the table has besides the policy while the run records or audits.
    extras: Extras,
    /// Elements a restarted guard found in the running table, kept until they expire (clients
    /// still hold the answers that allowed them), as long as the policy allows their names.
    carried: BTreeMap<Tuple, Carried>,
    /// Bounds the warnings about dropped answer addresses (the guard's answers are the
    /// sandbox's to provoke).
    dropped_log: LogBudget,
    /// Bounds the warnings about answered addresses in denied networks (under an allowed
    /// wildcard the sandbox writes the answers: one line each would let it flood the log).
    denied_log: LogBudget,
    /// Bounds the warnings about answers refused: past [`MAX_LIVE_NAMES`], or for a name
    /// too long to be an element's comment.
    full_log: LogBudget,
    /// Bounds the guard's "new addresses allowed" lines: every name under an allowed
    /// wildcard is new once, and the sandbox can invent them by the hundred thousand (the
    /// table's element comments and `status` still name each one).
    allowed_log: LogBudget,
    /// With a `scope:`, what of the host the table is planned with (the listed cgroups'
    /// ids, where the guard listens on the listed bridges): the shell reads it.
    /// `bridge_listen` is where the guard bound its sockets at start, for the process's life.
    host_scope: HostScope,
    /// Addresses of listed interfaces the guard does not listen on (they came after it
    /// bound its sockets), already warned about.
    unserved_bridges: BTreeSet<SocketAddr>,
}

/// What a policy sets in the daemon, taken in or given back as a whole.
struct Config {
    policy: Policy,
    policy_text: String,
    services: Services,
    names: BTreeMap<DomainName, NameState>,
    resolvers: Vec<IpAddr>,
    /// The guard of `policy`, as this process runs it.
    guard: Option<GuardIdentity>,
    /// What a restart carried over that this configuration still allows.
    carried: BTreeMap<Tuple, Carried>,
    /// The listed cgroups of `policy` that exist, with their ids.
    cgroups: Vec<CgroupMatch>,
}

impl Core {
    /// A daemon for `policy` that knows nothing yet: in resolve mode every name is due,
    /// asking `resolvers`; in guard mode (`guard` the policy's guard, as this process runs
    /// it) names are learned from the guard's answers.
    pub fn new(
        policy: Policy,
        policy_text: String,
        policy_path: PathBuf,
        resolvers: Vec<IpAddr>,
        guard: Option<GuardIdentity>,
        now: Instant,
    ) -> Core {
        let names = match policy.dns.guard.is_some() {
            true => BTreeMap::new(),
            false => policy
                .domains()
                .into_iter()
                .map(|n| (n.clone(), NameState::new(now)))
                .collect(),
        };
        Core {
            services: services(&policy),
            policy,
            policy_text,
            policy_path,
            record_next_apply: true,
            resolvers,
            names,
            installed: BTreeMap::new(),
            next_prune: now,
            retry_apply: None,
            last_refresh: None,
            last_apply: None,
            heals: 0,
            last_heal_by: None,
            guard,
            carried: BTreeMap::new(),
            dropped_log: LogBudget::default(),
            denied_log: LogBudget::default(),
            full_log: LogBudget::default(),
            allowed_log: LogBudget::default(),
            host_scope: HostScope::default(),
            unserved_bridges: BTreeSet::new(),
            extras: Extras::default(),
        }
    }

    /// What the table has besides the policy from the next apply on (`run --record`,
    /// `learn`).
    pub fn set_extras(&mut self, extras: Extras) {
        self.extras = extras;
    }

    /// Whether the table audits (`learn`'s window).
    pub fn auditing(&self) -> bool {
        self.extras.audit.is_some()
    }

    /// Keeps the audit window open a while longer. A window the kernel no longer has (the
    /// set deleted under us) is put back with the whole table.
    pub fn renew_audit(&mut self, table: &mut dyn Table, now: Instant, fx: &mut Vec<Effect>) {
        let Some(open_for_ms) = self.extras.audit.and_then(|a| a.open_for_ms) else {
            return;
        };
        if let Err(e) = table.renew_audit_window(open_for_ms) {
            warn!(error = %e, "renewing the audit window failed; restoring the table");
            self.reapply(table, now, fx);
        }
    }

    /// Ends the audit (and the recording): the table is the policy's again, nothing else, and
    /// is recorded as a generation.
    pub fn end_extras(
        &mut self,
        table: &mut dyn Table,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) -> Result<(), NftError> {
        // What the run is (exec's refusal of replies) stays; only the recording ends.
        self.extras = Extras {
            refuse_replies: self.extras.refuse_replies,
            ..Extras::default()
        };
        self.record_next_apply = true;
        self.apply_all(table, now, fx)
    }

    /// What of the host the table is planned with from now on (the shell reads it at start,
    /// on a reload, and when a listed cgroup comes, goes or is made again).
    pub fn set_host_scope(&mut self, host_scope: HostScope) {
        self.host_scope = host_scope;
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// What of the host the table is planned with.
    pub fn host_scope(&self) -> &HostScope {
        &self.host_scope
    }

    /// In guard mode, who the guard is.
    pub fn guard(&self) -> Option<&GuardIdentity> {
        self.guard.as_ref()
    }

    pub fn resolvers(&self) -> &[IpAddr] {
        &self.resolvers
    }

    /// Every name the daemon follows (resolve mode: the policy's).
    pub fn names(&self) -> Vec<DomainName> {
        self.names.keys().cloned().collect()
    }

    /// Takes in one event; returns what the shell must do about it.
    pub fn on(&mut self, event: Event<'_>, now: Instant, table: &mut dyn Table) -> Vec<Effect> {
        let mut fx = Vec::new();
        match event {
            Event::Wake => {
                if self.retry_apply.is_some_and(|t| t <= now) {
                    self.reapply(table, now, &mut fx);
                }
                let due = self.take_due(now);
                if !due.is_empty() {
                    fx.push(Effect::Lookup(due));
                }
            }
            Event::ResolversFound(resolvers) => {
                info!(resolvers = ?resolvers, "resolvers found");
                self.resolvers = resolvers;
                // The DNS sets change with them: a new configuration.
                self.record_next_apply = true;
                self.reapply(table, now, &mut fx);
            }
            Event::NoResolvers => self.retry_lookups(now),
            Event::Answers(hosts) => {
                let added = self.take_answers(&hosts, now);
                let answered: BTreeSet<DomainName> = hosts.into_iter().map(|h| h.name).collect();
                // The cost follows the answers, not the size of the table.
                if self.install(table, &answered, now, Duration::ZERO, &mut fx) {
                    added.log();
                }
            }
            Event::LookupFailed { error, task } => {
                match task {
                    false => error!(error = %error, "resolver failure; retrying"),
                    true => error!(error = %error, "lookup task failed; retrying"),
                }
                self.retry_lookups(now);
            }
            Event::GuardAnswers {
                answers,
                host_addrs,
            } => self.install_answers(table, answers, host_addrs, now, &mut fx),
            Event::Sweep => {
                if !self.expiring_soon(now).is_empty() {
                    fx.push(Effect::ReadFlows { at: now });
                }
            }
            Event::LiveFlows { flows, at } => self.keep_connected(table, &flows, at),
            Event::Reload {
                loaded,
                resolvers,
                scope,
            } => {
                if self.reload(table, *loaded, resolvers, scope.cgroups, now, &mut fx) {
                    fx.push(Effect::Adopted);
                    self.warn_unserved_bridges(&scope.bridges);
                }
            }
            Event::HostScope(facts) => {
                self.warn_unserved_bridges(&facts.bridges);
                self.follow_cgroups(table, facts.cgroups, now, &mut fx);
            }
            Event::TableChanged(changes) => self.heal(table, changes, now, &mut fx),
            Event::NotificationsLost => self.check_after_overrun(table, now, &mut fx),
            Event::Refused { event, host_addrs } => {
                fx.push(self.log_drop(event, host_addrs, now));
            }
        }
        fx
    }

    /// Installs the addresses of guard answers in one batch, then releases them all: with the
    /// kernel's acknowledgement, or as failures (SERVFAIL) if it refused.
    fn install_answers(
        &mut self,
        table: &mut dyn Table,
        mut batch: Vec<GuardAnswer>,
        host_addrs: &HostAddrs,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        let mut release = Vec::with_capacity(batch.len());
        if self.policy.dns.guard.is_none() {
            // Only a reload could end guard mode, and reload refuses to.
            release.extend(batch.iter().map(|a| (a.id, false)));
            fx.push(Effect::Release(release));
            return;
        }
        let life = Lifetimes::of(&self.policy.dns);
        let mut names = BTreeSet::new();
        let mut live_names = None;
        let mut i = 0;
        while i < batch.len() {
            let a = &batch[i];
            // Every element keeps the name it was answered for as its comment, by which a
            // restart, a reload, `status` and `probe` explain it; the kernel keeps no longer
            // one (a client may ask one under a `**.` wildcard). Its answer gets SERVFAIL: no
            // address the fence could not explain.
            let commented = a.name.as_str().len() <= MAX_COMMENTED_NAME;
            if a.addrs.is_empty()
                || commented
                    && may_track(&self.names, &a.name, now, MAX_LIVE_NAMES, &mut live_names)
            {
                i += 1;
                continue;
            }
            if let Some(held_back) =
                self.full_log
                    .take(self.policy.log.rate, self.policy.log.burst, now.into_std())
            {
                match commented {
                    true => warn!(name = %a.name, held_back,
                                  "{MAX_LIVE_NAMES} names hold live addresses; this answer is \
                                   not installed and its client gets SERVFAIL until some expire"),
                    false => warn!(name = %a.name, held_back,
                                   "a name longer than {MAX_COMMENTED_NAME} characters cannot \
                                    name its addresses in the table; this answer is not \
                                    installed and its client gets SERVFAIL"),
                }
            }
            release.push((batch.swap_remove(i).id, false));
        }
        for a in &mut batch {
            let dropped = retain_installable(&mut a.addrs, |r| r.addr, host_addrs);
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
                state.extend(&a.addrs, now, |ttl| life.guarded(ttl), room);
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
        for a in &batch {
            for w in denied_addresses(&self.policy, &a.name, a.addrs.iter().map(|r| r.addr)) {
                if let Some(held_back) = self.denied_log.take(
                    self.policy.log.rate,
                    self.policy.log.burst,
                    now.into_std(),
                ) {
                    warn!(not_logged_before = held_back, "{w}");
                }
            }
        }
        let ok = self.install(table, &names, now, life.renew_slack(), fx);
        release.extend(batch.iter().map(|a| (a.id, ok)));
        fx.push(Effect::Release(release));
    }

    /// Sends, as one batch, the elements of `names` that are new or live longer now by more
    /// than `slack`; `false` if the kernel refused (the table is then applied anew).
    fn install(
        &mut self,
        table: &mut dyn Table,
        names: &BTreeSet<DomainName>,
        now: Instant,
        slack: Duration,
        fx: &mut Vec<Effect>,
    ) -> bool {
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
        match self.upsert(table, &send, now, |t| owners.get(t).cloned()) {
            Ok(()) => true,
            Err(e) => {
                // Someone may have removed our set under us: the full apply puts it back.
                error!(error = %e, "adding addresses refused; reapplying the table");
                self.reapply(table, now, fx);
                false
            }
        }
    }

    /// Sends `elements` with their expiries (and the name `name_of` gives each) as one batch
    /// and records them as installed.
    fn upsert(
        &mut self,
        table: &mut dyn Table,
        elements: &[(Tuple, Instant)],
        now: Instant,
        name_of: impl Fn(&Tuple) -> Option<String>,
    ) -> Result<(), NftError> {
        for chunk in elements.chunks(MAX_UPSERT_BATCH) {
            let batch = timed(chunk.iter().copied(), now, &name_of);
            table.upsert_resolved(&batch)?;
            self.installed.extend(chunk.iter().copied());
        }
        Ok(())
    }

    /// Installed elements that expire within two sweeps.
    fn expiring_soon(&self, now: Instant) -> Vec<Tuple> {
        let Some(every) = Lifetimes::of(&self.policy.dns).sweep_every() else {
            return Vec::new();
        };
        self.installed
            .iter()
            .filter(|(_, e)| **e > now && **e <= now + 2 * every)
            .map(|(t, _)| *t)
            .collect()
    }

    /// In guard mode an address stays allowed while a connection to it lives, even past its
    /// lifetime: elements about to expire (within two sweeps) that conntrack shows a live flow
    /// to are renewed for three sweeps. `ct state established` already carries the
    /// connection's own packets; this keeps a client that reconnects to the address it still
    /// uses (a pool, a retry) from being refused under it.
    fn keep_connected(&mut self, table: &mut dyn Table, flows: &BTreeSet<Flow>, now: Instant) {
        let life = Lifetimes::of(&self.policy.dns);
        let Some(every) = life.sweep_every() else {
            return;
        };
        let until = now + life.kept_connected(every);
        let keep: Vec<(Tuple, Instant)> = self
            .expiring_soon(now)
            .into_iter()
            .filter(|t| flows.contains(&(t.net.addr(), t.proto, t.ports.first)))
            .map(|t| (t, until))
            .collect();
        if keep.is_empty() {
            return;
        }
        match self.upsert(table, &keep, now, |_| None) {
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
        if self.policy.dns.guard.is_some() {
            forget_learned_names(&mut self.names, now, MAX_FORMER_NAMES);
            let names = &self.names;
            self.services.retain(|n, _| names.contains_key(n));
        }
        self.next_prune = now + PRUNE_EVERY;
    }

    /// A restarted guard keeps what the running table allows until it expires: clients still
    /// hold the answers behind it, and the guard has no way to ask them.
    pub fn carry_over(&mut self, table: &mut dyn Table, now: Instant) {
        let life = Lifetimes::of(&self.policy.dns);
        let table = match table.read_table() {
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
                let left = life.carried(t.expires_ms);
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

    /// Records answers, logging what changed but the new addresses: those are said once the
    /// table holds them ([`NewAddresses::log`]).
    pub fn take_answers(&mut self, hosts: &[ResolvedHost], now: Instant) -> NewAddresses {
        let mut new = NewAddresses(Vec::new());
        let life = Lifetimes::of(&self.policy.dns);
        self.last_refresh = Some(SystemTime::now());
        for host in hosts {
            let Some(state) = self.names.get_mut(&host.name) else {
                continue;
            };
            let AnswerChanges { added, gone } = state.answer(host, now, &life);
            if let Some(err) = &state.last_error {
                warn!(name = %host.name, error = %err, failures = state.failures,
                      retry_in_s = state.next_due.saturating_duration_since(now).as_secs(),
                      "lookup failed; the last good addresses stay until their grace ends");
            }
            if !added.is_empty() {
                new.0.push((host.name.clone(), summarise(&added)));
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
        new
    }

    /// The live addresses as a resolution, for the generation record.
    fn resolution(&self, now: Instant) -> Resolution {
        live_resolution(
            &self.names,
            self.resolvers.clone(),
            self.guard.as_ref().map(|g| g.uid),
            self.host_scope.clone(),
            now,
        )
    }

    /// The table of the running configuration: the policy with the live addresses and what
    /// was carried over, each resolved element with its remaining lifetime. A reload may have
    /// lowered the cap: nothing known lives past the policy's.
    fn table(&mut self, now: Instant) -> (Ruleset, BTreeMap<Tuple, Instant>) {
        let cap = now + Lifetimes::of(&self.policy.dns).cap();
        for state in self.names.values_mut() {
            for expires in state.addrs.values_mut() {
                *expires = (*expires).min(cap);
            }
        }
        self.carried.retain(|_, c| c.expires > now);
        let elements = table_elements(self.names.iter(), &self.services, &self.carried, now);
        let owners = owners(self.names.iter(), &self.services, now);
        let named = timed(
            elements.iter().map(|(t, e)| (*t, *e)),
            now,
            |t| match owners.get(t) {
                Some(name) => Some(name.to_string()),
                None => self.carried.get(t).map(|c| c.name.clone()),
            },
        );
        let ruleset = plan_elements(
            &self.policy,
            &self.resolvers,
            self.guard.as_ref(),
            &self.host_scope.cgroups,
            named,
        );
        (with_extras(ruleset, &self.extras), elements)
    }

    /// Replaces the whole table with the current policy and addresses.
    pub fn apply_all(
        &mut self,
        table: &mut dyn Table,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) -> Result<(), NftError> {
        let (ruleset, elements) = self.table(now);
        match table.apply(&ruleset) {
            Ok(()) => {
                self.installed = elements;
                self.retry_apply = None;
                self.last_apply = Some(SystemTime::now());
                info!(
                    table = %format!("inet {TABLE}"),
                    names = self.names.len(),
                    elements = ruleset.element_count(),
                    "applied the table"
                );
                if std::mem::take(&mut self.record_next_apply) {
                    fx.push(Effect::Record(Box::new(NewGeneration {
                        command: Recorder::Run,
                        source_generation: None,
                        policy_path: self.policy_path.clone(),
                        policy_text: self.policy_text.clone(),
                        resolution: self.resolution(now),
                        // What the policy plans: the audit and the flow record are the run's.
                        ruleset: without_extras(ruleset),
                    })));
                }
                Ok(())
            }
            Err(e) => {
                self.retry_apply = Some(now + Duration::from_secs(1));
                Err(e)
            }
        }
    }

    /// The names whose refresh is due, now marked as being looked up.
    fn take_due(&mut self, now: Instant) -> Vec<DomainName> {
        if self.policy.dns.guard.is_some() {
            return Vec::new();
        }
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
    fn retry_lookups(&mut self, now: Instant) {
        let retry = now + Lifetimes::of(&self.policy.dns).retry_after(1);
        for state in self.names.values_mut() {
            state.next_due = state.next_due.min(retry);
        }
    }

    fn reapply(&mut self, table: &mut dyn Table, now: Instant, fx: &mut Vec<Effect>) {
        if let Err(e) = self.apply_all(table, now, fx) {
            error!(error = %e, "applying the table failed; retrying in 1 s");
        }
    }

    /// SIGHUP, once the new policy is parsed (off the event loop): a valid new policy replaces
    /// the running one once the kernel has accepted its table (with the addresses known for
    /// the names it keeps; its new names follow as their answers arrive); an invalid one, or
    /// one the kernel refuses, changes nothing. Returns whether the new policy was adopted.
    fn reload(
        &mut self,
        table: &mut dyn Table,
        loaded: Result<(Policy, String), PolicyError>,
        resolvers: Option<Result<Vec<IpAddr>, String>>,
        cgroups: Vec<CgroupMatch>,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) -> bool {
        let (policy, policy_text) = match loaded {
            Ok(p) => p,
            Err(e) => {
                error!(error = %e, "the new policy is invalid; the running one stays");
                return false;
            }
        };
        // The guard's sockets and the table's uid rule are set up once; the new policy's
        // guard runs as the running one, listening where it bound its sockets on the listed
        // bridges at start (a bridge address that came since is served after a restart).
        let new_guard =
            policy
                .dns
                .guard
                .as_ref()
                .zip(self.guard.as_ref())
                .map(|(settings, running)| {
                    GuardIdentity::of(settings, running.uid)
                        .listening_also_on(&self.host_scope.bridge_listen)
                });
        let restart = match (&self.guard, &policy.dns.guard, &new_guard) {
            (Some(_), None, _) | (None, Some(_), _) => Some("`dns.mode`"),
            (Some(old), _, Some(new)) => old.change_needing_restart(new),
            _ => None,
        };
        if let Some(what) = restart {
            error!(
                "the new policy changes {what}, which takes a restart (`systemctl restart \
                 egress-fence`); the running policy stays"
            );
            return false;
        }
        if let Some(guard) = new_guard {
            return self.reload_guard(table, (policy, policy_text), guard, cgroups, now, fx);
        }
        let resolvers = match resolvers {
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                error!(error = %e, "the new policy's resolvers are unusable; the running one stays");
                return false;
            }
            None => {
                error!(
                    error = "not looked for",
                    "the new policy's resolvers are unusable; the running one stays"
                );
                return false;
            }
        };
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
        self.adopt(
            table,
            Config {
                services: services(&policy),
                policy,
                policy_text,
                resolvers,
                guard: None,
                names,
                carried: self.carried.clone(),
                cgroups,
            },
            now,
            fx,
        )
    }

    /// A reload in guard mode: learned names the new policy still allows keep their addresses,
    /// on the ports it now gives them; the others go with the old table. What a restart
    /// carried over goes the same way: only for names and ports the new policy allows, and no
    /// longer than it allows an answer. Once the kernel has accepted the new table, the guard
    /// answers by the new rules.
    fn reload_guard(
        &mut self,
        table: &mut dyn Table,
        (policy, policy_text): (Policy, String),
        guard: GuardIdentity,
        cgroups: Vec<CgroupMatch>,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) -> bool {
        let cap = now + Lifetimes::of(&policy.dns).cap();
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
        let rules = Rules::of(&policy, &guard);
        let adopted = self.adopt(
            table,
            Config {
                policy,
                policy_text,
                services,
                names,
                resolvers: guard.upstream.clone(),
                guard: Some(guard),
                carried,
                cgroups,
            },
            now,
            fx,
        );
        if adopted && let Some(rules) = rules {
            fx.push(Effect::GuardRules(rules));
        }
        adopted
    }

    /// Applies the table of `new` and keeps `new` only if the kernel accepted it. Otherwise
    /// the running configuration stays whole, so that healing and answers go on building the
    /// table the kernel last accepted, never one it refused.
    fn adopt(
        &mut self,
        table: &mut dyn Table,
        mut new: Config,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) -> bool {
        self.swap_config(&mut new);
        let record = std::mem::replace(&mut self.record_next_apply, true);
        match self.apply_all(table, now, fx) {
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
        std::mem::swap(&mut self.guard, &mut other.guard);
        std::mem::swap(&mut self.carried, &mut other.carried);
        std::mem::swap(&mut self.host_scope.cgroups, &mut other.cgroups);
    }

    /// The listed cgroups as the host has them now: when one appeared, went, or was removed
    /// and made again (a new id, which the old rule does not match: new processes in it would
    /// go unfenced), the table is applied anew with their rules, and recorded (its
    /// configuration changed).
    fn follow_cgroups(
        &mut self,
        table: &mut dyn Table,
        cgroups: Vec<CgroupMatch>,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        if cgroups == self.host_scope.cgroups {
            return;
        }
        let listed = self.policy.scope.iter().flat_map(|s| &s.cgroups);
        for path in listed {
            let find = |of: &[CgroupMatch]| of.iter().find(|c| c.is_of(path)).map(|c| c.id);
            match (find(&self.host_scope.cgroups), find(&cgroups)) {
                (None, Some(id)) => {
                    info!(cgroup = %path, id, "cgroup {path} appeared: fenced from now on")
                }
                (Some(was), Some(id)) if was != id => warn!(
                    cgroup = %path, id, was,
                    "cgroup {path} changed (removed and made again): fenced from now on"
                ),
                (Some(_), None) => info!(
                    cgroup = %path,
                    "cgroup {path} is gone: nobody is in it; it is fenced again from the moment \
                     it reappears"
                ),
                _ => {}
            }
        }
        self.host_scope.cgroups = cgroups;
        self.record_next_apply = true;
        self.reapply(table, now, fx);
    }

    /// Warns, once each, about addresses of listed interfaces the guard does not listen on:
    /// its sockets are bound at start, so containers asking there get no answer until a
    /// restart.
    fn warn_unserved_bridges(&mut self, bridges: &[(String, SocketAddr)]) {
        let Some(guard) = &self.guard else {
            return;
        };
        let mut unserved = BTreeSet::new();
        for (interface, addr) in bridges {
            if guard.listen.contains(addr) {
                continue;
            }
            if !self.unserved_bridges.contains(addr) {
                warn!(
                    interface = %interface, address = %addr,
                    "listed interface {interface} has {addr}, where the DNS guard does not \
                     listen (it was not there, or not usable, when the guard started): its \
                     containers get no DNS answer there until a restart (`systemctl restart \
                     egress-fence`)"
                );
            }
            unserved.insert(*addr);
        }
        self.unserved_bridges = unserved;
    }

    /// Someone else changed the table: put it back.
    fn heal(
        &mut self,
        table: &mut dyn Table,
        changes: &[Change],
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        // One culprit per netlink port, named if any of its changes could name it (the
        // process may be looked up in time for one change and not for another).
        let mut ports: Vec<(u32, Option<&str>)> = Vec::new();
        for c in changes {
            match ports.iter_mut().find(|(port, _)| *port == c.portid) {
                Some((_, name)) => *name = name.or(c.process.as_deref()),
                None => ports.push((c.portid, c.process.as_deref())),
            }
        }
        let who: Vec<String> = ports
            .iter()
            .map(|(port, process)| match process {
                Some(p) => format!("{p} (netlink port {port})"),
                None => format!("netlink port {port}"),
            })
            .collect();
        let first = changes.first().map_or("changes lost", |c| c.what);
        warn!(
            first = first,
            changes = changes.len(),
            by = %who.join(", "),
            "table inet {TABLE} was changed by someone else; restoring it"
        );
        self.heals += 1;
        self.last_heal_by = Some(who.join(", "));
        self.reapply(table, now, fx);
    }

    /// Notifications were lost. Ours never reach the monitor, so someone else's burst
    /// overflowed it, and whether that touched our table is unknown: it is put back.
    ///
    /// (The ruleset generation cannot tell: it moves with anyone's transaction, and one
    /// of ours after a lost change to our table would have read as ours.)
    fn check_after_overrun(&mut self, table: &mut dyn Table, now: Instant, fx: &mut Vec<Effect>) {
        warn!(
            "nftables notifications were lost in someone else's burst of changes; restoring the table"
        );
        self.heals += 1;
        self.last_heal_by = Some("unknown (notifications lost)".into());
        self.reapply(table, now, fx);
    }

    /// When the core wants [`Event::Wake`] next.
    pub fn next_wakeup(&self, now: Instant) -> Instant {
        let far = now + Duration::from_secs(3600);
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

    /// The status line systemd shows; `guard`: what the guard answered, refused and failed.
    pub fn status_line(&self, now: Instant, guard: Option<(u64, u64, u64)>) -> String {
        let addresses: usize = self.names.values().map(|s| s.live(now).count()).sum();
        let failing = self.names.values().filter(|s| s.failures > 0).count();
        let last = self
            .last_refresh
            .map_or("never".to_string(), crate::core::time::clock_utc);
        if let Some((answered, refused, failed)) = guard {
            return format!(
                "guard: {} names, {addresses} addresses; {answered} answered, {refused} refused, \
                 {failed} failed; last answer {last}",
                self.names.len(),
            );
        }
        format!(
            "{} names, {addresses} addresses, {failing} failing, last refresh {last}",
            self.names.len()
        )
    }

    /// Why `event` was refused, with what the daemon knows: its source (judged first, as the
    /// table does), the policy's deny entries, and which name answered the address and until
    /// when.
    fn why_refused(&self, event: &DropEvent, host_addrs: &HostAddrs, now: Instant) -> WhyRefused {
        explain::foreign_source(event.src, event.uid.is_some(), host_addrs)
            .unwrap_or_else(|| self.why_refused_to(event.dst, event.dport, now))
    }

    /// Why a packet to `dst`:`dport` was refused, as far as its destination tells.
    fn why_refused_to(&self, dst: IpAddr, dport: Option<u16>, now: Instant) -> WhyRefused {
        if let Some(why) = self
            .guard
            .as_ref()
            .and_then(|g| g.why_dns_refused(dst, dport))
        {
            return why;
        }
        if let Some(deny) = self.policy.denied_by(dst) {
            return WhyRefused::Denied(deny.describe());
        }
        let mut live = Vec::new();
        let mut former: Option<(&DomainName, Instant)> = None;
        for (name, state) in &self.names {
            match state.addrs.get(&dst) {
                Some(&e) if e > now => live.push(name.to_string()),
                Some(&e) if former.is_none_or(|(_, f)| e > f) => former = Some((name, e)),
                _ => {}
            }
        }
        if !live.is_empty() {
            WhyRefused::OtherPortsOnly { names: live }
        } else if let Some((name, expired)) = former {
            WhyRefused::LifetimeEnded {
                name: name.to_string(),
                ago: now.saturating_duration_since(expired),
            }
        } else {
            WhyRefused::NotInPolicy
        }
    }

    /// Logs a refused packet with why it was refused; returns the count of it for metrics.
    fn log_drop(&self, mut event: DropEvent, host_addrs: &HostAddrs, now: Instant) -> Effect {
        let why = self.why_refused(&event, host_addrs, now);
        let count = Effect::CountRefused {
            family: Family::of(event.dst),
            reason: why.reason(),
            deny_entry: match &why {
                WhyRefused::Denied(entry) => Some(entry.clone()),
                _ => None,
            },
        };
        event.note = Some(why.to_string());
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
        count
    }

    /// What `run --metrics` shows of the core (see [`CoreView`]).
    pub fn view(&self, now: Instant) -> CoreView {
        let guard_mode = self.policy.dns.guard.is_some();
        let lookup_failures = match guard_mode {
            true => Vec::new(),
            // Only the policy's names: `names` holds nothing else in resolve mode.
            false => self
                .policy
                .domains()
                .into_iter()
                .map(|n| {
                    let failures = self.names.get(n).map_or(0, |s| s.failures);
                    (n.to_string(), failures)
                })
                .collect(),
        };
        CoreView {
            guard_mode,
            names: self.names.len(),
            addresses: self.names.values().map(|s| s.live(now).count()).sum(),
            lookup_failures,
            last_refresh: self.last_refresh,
            last_apply: self.last_apply,
            heals: self.heals,
            last_heal_by: self.last_heal_by.clone(),
        }
    }
}

/// The daemon's behaviours as the README describes them for `run`, one decision at a time:
/// events in, table writes (to the in-memory double) and effects out.
#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::core::policy::{L4Proto, PortRange};
    use crate::core::ruleset::{Rule, ScopeMatch, Timed};
    use crate::nft::table::memory::MemoryTable;

    const RESOLVE: &str = "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\n  - domain: b.example\n    ports: [443, 80]\ndns:\n  resolvers: [192.0.2.53]\n  refresh: { min: 30s, max: 1h }\n  grace: 10m\n";
    const GUARD: &str = "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [443]\n  - domain: other.example\n    ports: [443]\ndeny:\n  - cidr: 198.51.100.0/24\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  floor: 30s\n  grace: 10m\n  refresh: { min: 30s, max: 1h }\n";

    fn policy(text: &str) -> Policy {
        Policy::parse(text, Path::new("p.yaml")).expect("valid")
    }

    fn resolvers() -> Vec<IpAddr> {
        vec!["192.0.2.53".parse().unwrap()]
    }

    fn core(text: &str, now: Instant) -> Core {
        let p = policy(text);
        let guard = GuardIdentity::of_policy(&p, 990);
        Core::new(
            p,
            text.into(),
            "/etc/p.yaml".into(),
            resolvers(),
            guard,
            now,
        )
    }

    /// A daemon started on a namespace without a table: the skeleton is up.
    fn started(text: &str, now: Instant) -> (Core, MemoryTable) {
        let mut c = core(text, now);
        let mut table = MemoryTable::new();
        let mut fx = Vec::new();
        c.apply_all(&mut table, now, &mut fx).expect("applied");
        (c, table)
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
            nxdomain: false,
            dropped: Vec::new(),
            errors: errors.iter().map(|e| e.to_string()).collect(),
        }
    }

    fn tuple(addr: &str, port: u16) -> Tuple {
        Tuple {
            net: addr.parse::<IpAddr>().unwrap().into(),
            proto: L4Proto::Tcp,
            ports: PortRange::single(port),
        }
    }

    fn held(table: &MemoryTable, t: Tuple) -> Option<Timed> {
        table.resolved().into_iter().find(|e| e.tuple == t)
    }

    fn answer(id: usize, name: &str, addrs: &[(&str, u32)]) -> GuardAnswer {
        GuardAnswer {
            id,
            name: name.parse().unwrap(),
            addrs: host(name, addrs, &[]).addrs,
        }
    }

    fn guard_answers<'a>(answers: Vec<GuardAnswer>, host_addrs: &'a HostAddrs) -> Event<'a> {
        Event::GuardAnswers {
            answers,
            host_addrs,
        }
    }

    fn records(fx: &[Effect]) -> usize {
        fx.iter().filter(|e| matches!(e, Effect::Record(_))).count()
    }

    fn released(fx: &[Effect]) -> Vec<(usize, bool)> {
        fx.iter()
            .flat_map(|e| match e {
                Effect::Release(r) => r.clone(),
                _ => Vec::new(),
            })
            .collect()
    }

    #[test]
    fn at_boot_the_skeleton_goes_up_at_once_and_is_recorded() {
        let now = Instant::now();
        let mut c = core(RESOLVE, now);
        let mut table = MemoryTable::new();
        let mut fx = Vec::new();
        c.apply_all(&mut table, now, &mut fx).expect("applied");
        assert!(table.table.is_some());
        assert!(table.resolved().is_empty(), "no names yet, no DNS needed");
        assert_eq!(records(&fx), 1, "the start is a generation");
        // A second full apply (healing) is no new configuration.
        let mut fx = Vec::new();
        c.apply_all(&mut table, now, &mut fx).expect("applied");
        assert_eq!(records(&fx), 0);
    }

    #[test]
    fn due_names_are_looked_up_and_answers_go_out_as_one_small_batch() {
        let now = Instant::now();
        let (mut c, mut table) = started(RESOLVE, now);
        assert_eq!(c.next_wakeup(now), now, "every name is due at start");
        let fx = c.on(Event::Wake, now, &mut table);
        let [Effect::Lookup(due)] = fx.as_slice() else {
            panic!("{fx:?}")
        };
        assert_eq!(due.len(), 2);
        // Nothing is due again while the lookup runs.
        assert!(c.on(Event::Wake, now, &mut table).is_empty());

        let answers = vec![
            host("a.example", &[("192.0.2.1", 300)], &[]),
            host("b.example", &[("192.0.2.2", 60)], &[]),
        ];
        let fx = c.on(Event::Answers(answers), now, &mut table);
        assert!(fx.is_empty(), "{fx:?}");
        assert_eq!(
            table.applied.len(),
            1,
            "the table is never reloaded for answers"
        );
        assert_eq!(table.upserted.len(), 1, "one batch");
        assert_eq!(table.upserted[0].len(), 3, "a:443, b:443, b:80");
        // Each element lives its refresh interval plus the grace, and names its name.
        let a = held(&table, tuple("192.0.2.1", 443)).expect("installed");
        assert_eq!(a.timeout_ms, Some((300 + 600) * 1000));
        assert_eq!(a.name.as_deref(), Some("a.example"));
        let b = held(&table, tuple("192.0.2.2", 80)).expect("installed");
        assert_eq!(
            b.timeout_ms,
            Some((60 + 600) * 1000),
            "60 s is within the bounds"
        );
        // Asked again after the shortest TTL.
        assert_eq!(c.next_wakeup(now), now + Duration::from_secs(60));
    }

    #[test]
    fn a_refresh_renews_what_is_still_answered_and_lets_the_rest_expire() {
        let now = Instant::now();
        let (mut c, mut table) = started(RESOLVE, now);
        c.on(Event::Wake, now, &mut table);
        let first = vec![host(
            "a.example",
            &[("192.0.2.1", 300), ("192.0.2.9", 300)],
            &[],
        )];
        c.on(Event::Answers(first), now, &mut table);
        let later = now + Duration::from_secs(300);
        c.on(Event::Wake, later, &mut table);
        let second = vec![host("a.example", &[("192.0.2.1", 300)], &[])];
        c.on(Event::Answers(second), later, &mut table);
        let renewal = table.upserted.last().expect("a batch");
        assert_eq!(renewal.len(), 1, "only the answered address: {renewal:?}");
        assert_eq!(renewal[0].tuple, tuple("192.0.2.1", 443));
        assert_eq!(renewal[0].timeout_ms, Some(900_000));
        // The other stays until its grace ends: nothing deletes it.
        let ip: IpAddr = "192.0.2.9".parse().unwrap();
        let state = &c.names[&"a.example".parse::<DomainName>().unwrap()];
        assert_eq!(state.addrs[&ip], now + Duration::from_secs(900));
        assert!(held(&table, tuple("192.0.2.9", 443)).is_some());
    }

    #[test]
    fn a_failing_resolver_keeps_the_last_good_addresses_and_retries_with_backoff() {
        let now = Instant::now();
        let (mut c, mut table) = started(RESOLVE, now);
        c.on(Event::Wake, now, &mut table);
        c.on(
            Event::Answers(vec![host("a.example", &[("192.0.2.1", 300)], &[])]),
            now,
            &mut table,
        );
        let batches = table.upserted.len();
        // The whole lookup failed: every name is due again in a second.
        let t = now + Duration::from_secs(300);
        c.on(Event::Wake, t, &mut table);
        let failed = Event::LookupFailed {
            error: "timed out".into(),
            task: false,
        };
        assert!(c.on(failed, t, &mut table).is_empty());
        assert_eq!(c.next_wakeup(t), t + Duration::from_secs(1));
        // One name failed: it backs off 1, 2, 4 s; its addresses stay as they were.
        for (n, wait) in [(1, 1), (2, 2), (3, 4)] {
            c.on(
                Event::Answers(vec![host("a.example", &[], &["A: timed out"])]),
                t,
                &mut table,
            );
            let state = &c.names[&"a.example".parse::<DomainName>().unwrap()];
            assert_eq!(state.failures, n);
            assert_eq!(state.next_due, t + Duration::from_secs(wait));
        }
        assert_eq!(table.upserted.len(), batches, "a failure renews nothing");
        assert!(
            held(&table, tuple("192.0.2.1", 443)).is_some(),
            "and removes nothing"
        );
    }

    #[test]
    fn without_resolvers_names_wait_and_the_table_follows_when_they_appear() {
        let now = Instant::now();
        let p = policy(RESOLVE);
        let mut c = Core::new(p, RESOLVE.into(), "/p".into(), Vec::new(), None, now);
        let mut table = MemoryTable::new();
        c.apply_all(&mut table, now, &mut Vec::new())
            .expect("applied");
        c.on(Event::Wake, now, &mut table);
        c.on(Event::NoResolvers, now, &mut table);
        assert_eq!(c.next_wakeup(now), now + Duration::from_secs(1));
        let fx = c.on(Event::ResolversFound(resolvers()), now, &mut table);
        assert_eq!(records(&fx), 1, "new DNS sets: a new configuration");
        assert_eq!(table.applied.len(), 2);
        let dns4 = table
            .table
            .as_ref()
            .unwrap()
            .set(SetId::new(SetRole::Dns, crate::core::ruleset::Family::V4));
        assert!(matches!(dns4.map(|s| &s.elements), Some(Elements::Tuples(t)) if !t.is_empty()));
    }

    #[test]
    fn a_table_changed_by_someone_else_is_put_back() {
        let now = Instant::now();
        let (mut c, mut table) = started(RESOLVE, now);
        c.on(Event::Wake, now, &mut table);
        c.on(
            Event::Answers(vec![host("a.example", &[("192.0.2.1", 300)], &[])]),
            now,
            &mut table,
        );
        table.lose_table();
        // The same port twice, named only the second time, and another port never named.
        let changes = [
            Change {
                what: "rule deleted",
                portid: 4242,
                process: None,
            },
            Change {
                what: "table deleted",
                portid: 4242,
                process: Some("nft".into()),
            },
            Change {
                what: "set deleted",
                portid: 77,
                process: None,
            },
        ];
        let later = now + Duration::from_secs(10);
        let fx = c.on(Event::TableChanged(&changes), later, &mut table);
        assert_eq!(records(&fx), 0, "healing is no new configuration");
        assert_eq!(
            c.last_heal_by.as_deref(),
            Some("nft (netlink port 4242), netlink port 77"),
            "one culprit per port, named if any change named it"
        );
        let back = held(&table, tuple("192.0.2.1", 443)).expect("restored with its addresses");
        assert_eq!(
            back.timeout_ms,
            Some(890_000),
            "with what is left of its lifetime"
        );
    }

    #[test]
    fn an_audit_is_renewed_healed_and_ended_with_the_policys_table() {
        use crate::core::plan::Audit;
        let now = Instant::now();
        let mut c = core(GUARD, now);
        c.set_extras(Extras {
            flow_group: Some(8),
            audit: Some(Audit {
                group: 7,
                open_for_ms: Some(30_000),
            }),
            refuse_replies: false,
        });
        let mut table = MemoryTable::new();
        let mut fx = Vec::new();
        c.apply_all(&mut table, now, &mut fx).expect("applied");
        let has = |t: &MemoryTable, r: &Rule| t.table.as_ref().unwrap().output.contains(r);
        assert!(has(&table, &Rule::AuditAccept { group: 7 }));
        assert!(has(&table, &Rule::RecordFlow { group: 8 }));
        let recorded = fx.iter().find_map(|e| match e {
            Effect::Record(new) => Some(new.ruleset.clone()),
            _ => None,
        });
        assert_eq!(
            recorded,
            Some(without_extras(table.table.clone().unwrap())),
            "the generation is the policy's table"
        );
        let before = table.generation;
        c.renew_audit(&mut table, now, &mut fx);
        assert_eq!(table.generation, before + 1, "one small transaction");
        assert_eq!(table.applied.len(), 1, "no full apply for a renewal");
        // The set gone under us: the whole table comes back, window and all.
        table.table.as_mut().unwrap().audit = None;
        c.renew_audit(&mut table, now, &mut fx);
        assert_eq!(table.applied.len(), 2);
        assert!(table.table.as_ref().unwrap().audit.is_some());
        fx.clear();
        c.end_extras(&mut table, now, &mut fx).expect("applied");
        let last = table.table.as_ref().unwrap();
        assert_eq!(last.audit, None);
        assert!(!has(&table, &Rule::AuditAccept { group: 7 }));
        assert!(!has(&table, &Rule::RecordFlow { group: 8 }));
        assert_eq!(records(&fx), 1, "the policy's table, recorded");
        assert!(!c.auditing());
        let renewals = table.generation;
        c.renew_audit(&mut table, now, &mut fx);
        assert_eq!(table.generation, renewals, "nothing to renew after the end");
    }

    /// Lost notifications are someone else's (ours never reach the monitor): whatever the
    /// ruleset generation says, the table is put back, and the heal is counted.
    #[test]
    fn lost_notifications_always_heal() {
        let now = Instant::now();
        let (mut c, mut table) = started(RESOLVE, now);
        c.on(Event::NotificationsLost, now, &mut table);
        assert_eq!(table.applied.len(), 2);
        c.on(Event::NotificationsLost, now, &mut table);
        assert_eq!(table.applied.len(), 3);
        assert_eq!(c.heals, 2);
        assert_eq!(
            c.last_heal_by.as_deref(),
            Some("unknown (notifications lost)")
        );
    }

    #[test]
    fn a_failed_apply_is_retried_a_second_later() {
        let now = Instant::now();
        let (mut c, mut table) = started(RESOLVE, now);
        c.on(Event::Wake, now, &mut table);
        c.on(Event::Answers(vec![]), now, &mut table);
        table.refuse_apply = true;
        table.lose_table();
        c.on(Event::NotificationsLost, now, &mut table);
        assert_eq!(c.next_wakeup(now), now + Duration::from_secs(1));
        table.refuse_apply = false;
        let later = now + Duration::from_secs(1);
        c.on(Event::Wake, later, &mut table);
        assert!(table.table.is_some());
        assert_eq!(c.retry_apply, None);
    }

    #[test]
    fn a_refused_batch_reapplies_the_table() {
        let now = Instant::now();
        let (mut c, mut table) = started(RESOLVE, now);
        c.on(Event::Wake, now, &mut table);
        table.refuse_upsert = true;
        c.on(
            Event::Answers(vec![host("a.example", &[("192.0.2.1", 300)], &[])]),
            now,
            &mut table,
        );
        assert_eq!(table.applied.len(), 2, "the full apply puts the set back");
        assert!(held(&table, tuple("192.0.2.1", 443)).is_some());
    }

    fn reload(c: &mut Core, table: &mut MemoryTable, text: &str, now: Instant) -> Vec<Effect> {
        reload_on(c, table, text, ScopeFacts::default(), now)
    }

    /// A reload of `text`, whose scope's host facts the shell read as `scope`.
    fn reload_on(
        c: &mut Core,
        table: &mut MemoryTable,
        text: &str,
        scope: ScopeFacts,
        now: Instant,
    ) -> Vec<Effect> {
        let loaded = Policy::parse(text, Path::new("p.yaml")).map(|p| (p, text.to_string()));
        let resolvers = match &loaded {
            Ok((p, _)) if p.dns.guard.is_none() => Some(Ok(resolvers())),
            _ => None,
        };
        c.on(
            Event::Reload {
                loaded: Box::new(loaded),
                resolvers,
                scope,
            },
            now,
            table,
        )
    }

    #[test]
    fn a_reload_adopts_a_valid_policy_keeping_the_addresses_of_its_names() {
        let now = Instant::now();
        let (mut c, mut table) = started(RESOLVE, now);
        c.on(Event::Wake, now, &mut table);
        c.on(
            Event::Answers(vec![
                host("a.example", &[("192.0.2.1", 300)], &[]),
                host("b.example", &[("192.0.2.2", 300)], &[]),
            ]),
            now,
            &mut table,
        );
        let new = RESOLVE.replace(
            "  - domain: b.example\n    ports: [443, 80]\n",
            "  - domain: c.example\n    ports: [443]\n",
        );
        let fx = reload(&mut c, &mut table, &new, now);
        assert!(fx.iter().any(|e| matches!(e, Effect::Adopted)));
        assert_eq!(records(&fx), 1, "a reload that applies is a generation");
        assert!(
            held(&table, tuple("192.0.2.1", 443)).is_some(),
            "a.example kept"
        );
        assert!(
            held(&table, tuple("192.0.2.2", 443)).is_none(),
            "b.example gone"
        );
        // Its names are due at once, the new one too.
        let fx = c.on(Event::Wake, now, &mut table);
        let [Effect::Lookup(due)] = fx.as_slice() else {
            panic!("{fx:?}")
        };
        assert_eq!(due.len(), 2);
    }

    #[test]
    fn an_invalid_or_refused_policy_changes_nothing() {
        let now = Instant::now();
        let (mut c, mut table) = started(RESOLVE, now);
        let before = c.policy().clone();
        let fx = reload(&mut c, &mut table, "version: 1\nallow: nonsense\n", now);
        assert!(fx.is_empty());
        assert_eq!(table.applied.len(), 1);

        table.refuse_apply = true;
        let new = RESOLVE.replace("ports: [443]", "ports: [8443]");
        let fx = reload(&mut c, &mut table, &new, now);
        assert!(fx.is_empty(), "not adopted, not recorded: {fx:?}");
        assert_eq!(c.policy(), &before, "the running policy stays whole");
        assert_eq!(c.names.len(), 2);
        // Healing goes on building the table the kernel last accepted, and the next apply
        // of a new policy is still recorded.
        table.refuse_apply = false;
        c.on(Event::NotificationsLost, now, &mut table);
        table.generation += 1;
        c.on(Event::NotificationsLost, now, &mut table);
        assert_eq!(table.table, Some(table.applied[0].clone()));
        let fx = reload(&mut c, &mut table, &new, now);
        assert_eq!(records(&fx), 1);
    }

    #[test]
    fn a_reload_with_unusable_resolvers_changes_nothing() {
        let now = Instant::now();
        let (mut c, mut table) = started(RESOLVE, now);
        let loaded = Ok((policy(RESOLVE), RESOLVE.to_string()));
        let fx = c.on(
            Event::Reload {
                loaded: Box::new(loaded),
                resolvers: Some(Err("no nameserver in resolv.conf".into())),
                scope: ScopeFacts::default(),
            },
            now,
            &mut table,
        );
        assert!(fx.is_empty());
        assert_eq!(table.applied.len(), 1);
    }

    #[test]
    fn changing_the_dns_mode_listen_or_mark_takes_a_restart() {
        let now = Instant::now();
        let (mut c, mut table) = started(GUARD, now);
        for new in [
            RESOLVE.to_string(),
            GUARD.replace(
                "  floor: 30s\n",
                "  floor: 30s\n  listen: [127.0.0.54:53]\n",
            ),
            GUARD.replace("  floor: 30s\n", "  floor: 30s\n  mark: 0x1234\n"),
        ] {
            assert!(reload(&mut c, &mut table, &new, now).is_empty(), "{new}");
        }
        assert_eq!(table.applied.len(), 1);
    }

    #[test]
    fn guard_answers_are_released_once_the_kernel_holds_their_addresses() {
        let now = Instant::now();
        let (mut c, mut table) = started(GUARD, now);
        assert_eq!(
            c.next_wakeup(now),
            now + Duration::from_secs(3600),
            "no timer"
        );
        let none = HostAddrs::none();
        let batch = vec![
            answer(0, "a.pool.example", &[("192.0.2.1", 5)]),
            answer(1, "b.pool.example", &[("192.0.2.2", 86_400)]),
        ];
        let fx = c.on(guard_answers(batch, &none), now, &mut table);
        let mut r = released(&fx);
        r.sort();
        assert_eq!(r, vec![(0, true), (1, true)]);
        assert_eq!(table.upserted.len(), 1, "several answers share one batch");
        let short = held(&table, tuple("192.0.2.1", 443)).unwrap();
        assert_eq!(
            short.timeout_ms,
            Some((30 + 600) * 1000),
            "the floor, plus the grace"
        );
        assert_eq!(short.name.as_deref(), Some("a.pool.example"));
        let long = held(&table, tuple("192.0.2.2", 443)).unwrap();
        assert_eq!(
            long.timeout_ms,
            Some((3600 + 600) * 1000),
            "never past the cap"
        );

        // Asked again a minute later: no batch (less than half the grace would be gained).
        let later = now + Duration::from_secs(60);
        let again = vec![answer(2, "a.pool.example", &[("192.0.2.1", 5)])];
        let fx = c.on(guard_answers(again, &none), later, &mut table);
        assert_eq!(released(&fx), vec![(2, true)]);
        assert_eq!(table.upserted.len(), 1);
        // After six minutes it renews.
        let much_later = now + Duration::from_secs(360);
        let again = vec![answer(3, "a.pool.example", &[("192.0.2.1", 5)])];
        c.on(guard_answers(again, &none), much_later, &mut table);
        assert_eq!(table.upserted.len(), 2);
    }

    /// The longest name an element keeps as its comment is installed with it; a longer one (a
    /// client may ask one under `**.`: the kernel refused its comment, and with it the batch
    /// of every answer in it) gets SERVFAIL, leaves nothing in the table and takes no other
    /// answer with it.
    #[test]
    fn a_name_too_long_to_be_a_comment_gets_servfail_alone() {
        let now = Instant::now();
        let text = GUARD.replace("\"*.pool.example\"", "\"**.pool.example\"");
        let (mut c, mut table) = started(&text, now);
        let name = |len| crate::core::policy::name_of_length("pool.example", len);
        let (kept, too_long) = (name(MAX_COMMENTED_NAME), name(MAX_COMMENTED_NAME + 1));
        let none = HostAddrs::none();
        let batch = vec![
            answer(0, &kept, &[("192.0.2.1", 60)]),
            answer(1, &too_long, &[("192.0.2.2", 60)]),
            answer(2, "a.pool.example", &[("192.0.2.3", 60)]),
        ];
        let fx = c.on(guard_answers(batch, &none), now, &mut table);
        let mut r = released(&fx);
        r.sort();
        assert_eq!(r, vec![(0, true), (1, false), (2, true)]);
        let held_kept = held(&table, tuple("192.0.2.1", 443)).expect("installed");
        assert_eq!(held_kept.name.as_deref(), Some(kept.as_str()));
        assert_eq!(held(&table, tuple("192.0.2.2", 443)), None);
        assert!(held(&table, tuple("192.0.2.3", 443)).is_some());
        assert_eq!(table.applied.len(), 1, "nothing refused, nothing reapplied");
    }

    #[test]
    fn a_refused_guard_batch_answers_servfail_and_reapplies() {
        let now = Instant::now();
        let (mut c, mut table) = started(GUARD, now);
        table.refuse_upsert = true;
        let none = HostAddrs::none();
        let batch = vec![answer(7, "a.pool.example", &[("192.0.2.1", 60)])];
        let fx = c.on(guard_answers(batch, &none), now, &mut table);
        assert_eq!(released(&fx), vec![(7, false)]);
        assert_eq!(table.applied.len(), 2);
    }

    #[test]
    fn guard_answers_never_install_refused_addresses_and_still_report_denied_ones() {
        let now = Instant::now();
        let (mut c, mut table) = started(GUARD, now);
        let none = HostAddrs::none();
        // Loopback is never installed; with nothing else the name is not even remembered.
        let batch = vec![answer(0, "x.pool.example", &[("127.0.0.1", 60)])];
        let fx = c.on(guard_answers(batch, &none), now, &mut table);
        assert_eq!(released(&fx), vec![(0, true)]);
        assert!(table.resolved().is_empty());
        assert!(c.names.is_empty());
        // A denied address goes in the set (the deny rule comes first) and is reported.
        let batch = vec![answer(1, "y.pool.example", &[("198.51.100.7", 60)])];
        c.on(guard_answers(batch, &none), now, &mut table);
        assert!(held(&table, tuple("198.51.100.7", 443)).is_some());
    }

    #[test]
    fn connections_that_live_keep_their_addresses_past_their_lifetime() {
        let now = Instant::now();
        let (mut c, mut table) = started(GUARD, now);
        let none = HostAddrs::none();
        let batch = vec![answer(
            0,
            "a.pool.example",
            &[("192.0.2.1", 5), ("192.0.2.2", 5)],
        )];
        c.on(guard_answers(batch, &none), now, &mut table);
        // Nothing expires soon: no need to read conntrack.
        assert!(c.on(Event::Sweep, now, &mut table).is_empty());
        // 15 s before the end (sweeps every 10 s): look.
        let t = now + Duration::from_secs(630 - 15);
        let fx = c.on(Event::Sweep, t, &mut table);
        assert!(matches!(fx.as_slice(), [Effect::ReadFlows { at }] if *at == t));
        let flows = BTreeSet::from([("192.0.2.1".parse().unwrap(), L4Proto::Tcp, 443)]);
        c.on(Event::LiveFlows { flows, at: t }, t, &mut table);
        let batch = table.upserted.last().unwrap();
        assert_eq!(batch.len(), 1, "only the connected address");
        assert_eq!(batch[0].tuple, tuple("192.0.2.1", 443));
        assert_eq!(batch[0].timeout_ms, Some(30_000), "three sweeps");
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let state = &c.names[&"a.pool.example".parse::<DomainName>().unwrap()];
        assert_eq!(state.addrs[&ip], t + Duration::from_secs(30));
    }

    /// A guard-mode table a previous daemon left, with `elements` (name, address, port, ms left).
    fn running_table(elements: &[(Option<&str>, &str, u16, Option<u64>)]) -> MemoryTable {
        let p = policy(GUARD);
        let resolved: BTreeMap<Tuple, Timed> = elements
            .iter()
            .map(|(name, addr, port, ms)| {
                let t = tuple(addr, *port);
                let timed = Timed {
                    tuple: t,
                    timeout_ms: *ms,
                    expires_ms: None,
                    name: name.map(str::to_string),
                };
                (t, timed)
            })
            .collect();
        MemoryTable::holding(plan_elements(
            &p,
            &resolvers(),
            GuardIdentity::of_policy(&p, 990).as_ref(),
            &[],
            resolved.into_values(),
        ))
    }

    #[test]
    fn a_restarted_guard_keeps_what_the_policy_still_allows_until_it_expires() {
        let now = Instant::now();
        let mut table = running_table(&[
            (Some("a.pool.example"), "192.0.2.1", 443, Some(120_000)),
            (Some("a.pool.example"), "192.0.2.2", 80, Some(120_000)),
            (Some("gone.example"), "192.0.2.3", 443, Some(120_000)),
            (None, "192.0.2.4", 443, Some(120_000)),
            (Some("other.example"), "192.0.2.5", 443, Some(999_999_999)),
            (Some("other.example"), "192.0.2.6", 443, None),
        ]);
        let mut c = core(GUARD, now);
        c.carry_over(&mut table, now);
        let kept: Vec<Tuple> = c.carried.keys().copied().collect();
        assert_eq!(
            kept,
            vec![
                tuple("192.0.2.1", 443),
                tuple("192.0.2.5", 443),
                tuple("192.0.2.6", 443)
            ],
            "not another port, not a name the policy dropped, not one without a name"
        );
        assert_eq!(
            c.carried[&tuple("192.0.2.5", 443)].expires,
            now + Duration::from_secs(4200),
            "the cap"
        );
        assert_eq!(
            c.carried[&tuple("192.0.2.6", 443)].expires,
            now + Duration::from_secs(600),
            "the grace"
        );
        let fx = &mut Vec::new();
        c.apply_all(&mut table, now, fx).expect("applied");
        let e = held(&table, tuple("192.0.2.1", 443)).expect("carried into the new table");
        assert_eq!(
            (e.timeout_ms, e.name.as_deref()),
            (Some(120_000), Some("a.pool.example"))
        );
        assert!(held(&table, tuple("192.0.2.3", 443)).is_none());

        // A reload keeps only what the new policy allows, no longer than it allows.
        let new = GUARD
            .replace("  - domain: other.example\n    ports: [443]\n", "")
            .replace("max: 1h", "max: 1m");
        let fx = reload(&mut c, &mut table, &new, now);
        assert!(fx.iter().any(|e| matches!(e, Effect::GuardRules(_))));
        assert_eq!(
            c.carried.keys().copied().collect::<Vec<_>>(),
            vec![tuple("192.0.2.1", 443)]
        );
        assert_eq!(
            held(&table, tuple("192.0.2.1", 443)).unwrap().timeout_ms,
            Some(120_000)
        );
        assert!(held(&table, tuple("192.0.2.5", 443)).is_none());
    }

    #[test]
    fn a_guard_reload_keeps_the_learned_names_it_still_allows() {
        let now = Instant::now();
        let (mut c, mut table) = started(GUARD, now);
        let none = HostAddrs::none();
        let batch = vec![
            answer(0, "a.pool.example", &[("192.0.2.1", 60)]),
            answer(1, "other.example", &[("192.0.2.2", 60)]),
        ];
        c.on(guard_answers(batch, &none), now, &mut table);
        let new = GUARD.replace("  - domain: other.example\n    ports: [443]\n", "");
        reload(&mut c, &mut table, &new, now);
        assert_eq!(
            c.names(),
            vec!["a.pool.example".parse::<DomainName>().unwrap()]
        );
        assert!(held(&table, tuple("192.0.2.1", 443)).is_some());
        assert!(held(&table, tuple("192.0.2.2", 443)).is_none());
    }

    #[test]
    fn refused_packets_are_explained_with_what_the_daemon_knows() {
        let now = Instant::now();
        let (mut c, mut table) = started(RESOLVE, now);
        c.on(Event::Wake, now, &mut table);
        c.on(
            Event::Answers(vec![host("a.example", &[("192.0.2.1", 300)], &[])]),
            now,
            &mut table,
        );
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            c.why_refused_to(ip("192.0.2.1"), Some(22), now).to_string(),
            "an address of a.example, allowed on other ports or protocols only"
        );
        assert_eq!(
            c.why_refused_to(ip("203.0.113.1"), Some(443), now)
                .to_string(),
            "not in the policy"
        );
        let later = now + Duration::from_secs(900 + 250);
        assert_eq!(
            c.why_refused_to(ip("192.0.2.1"), Some(443), later)
                .to_string(),
            "was an address of a.example until 4m10s ago (its grace ended)"
        );
        // A packet a process sent from an address not the host's is refused for its source,
        // before any rule looks at its destination, even an allowed one; the log and the
        // metrics say so.
        let host_addrs = HostAddrs::from_interfaces([(ip("10.0.0.2"), None, None)]);
        let mut explained = |src: &str, uid: Option<u32>| {
            let mut event = DropEvent::refused_to("192.0.2.1", 443);
            event.src = ip(src);
            event.uid = uid;
            let fx = c.on(
                Event::Refused {
                    event,
                    host_addrs: &host_addrs,
                },
                now,
                &mut table,
            );
            match &fx[..] {
                [Effect::CountRefused { reason, .. }] => *reason,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(explained("198.51.100.9", Some(65534)), "foreign_source");
        assert_eq!(explained("10.0.0.2", Some(65534)), "other_port");
        assert_eq!(
            explained("198.51.100.9", None),
            "other_port",
            "the kernel's own"
        );
    }

    #[test]
    fn the_status_line_says_names_addresses_failures_and_the_last_refresh() {
        let now = Instant::now();
        let (c, _) = started(RESOLVE, now);
        assert_eq!(
            c.status_line(now, None),
            "2 names, 0 addresses, 0 failing, last refresh never"
        );
        let (g, _) = started(GUARD, now);
        assert_eq!(
            g.status_line(now, Some((5, 2, 1))),
            "guard: 0 names, 0 addresses; 5 answered, 2 refused, 1 failed; last answer never"
        );
    }

    const SCOPED: &str = "version: 1\nscope:\n  users: [1001]\n  cgroups: [agent.slice]\nallow:\n  - domain: a.example\n    ports: [443]\ndns:\n  resolvers: [192.0.2.53]\n";

    fn agent_slice(id: u64) -> CgroupMatch {
        CgroupMatch {
            path: "agent.slice".parse().unwrap(),
            level: 1,
            id,
        }
    }

    fn cgroups_found(ids: &[u64]) -> ScopeFacts {
        ScopeFacts {
            cgroups: ids.iter().map(|&id| agent_slice(id)).collect(),
            bridges: Vec::new(),
        }
    }

    /// The cgroups the table in force fences.
    fn fenced_cgroups(table: &MemoryTable) -> Vec<CgroupMatch> {
        let ruleset = table.table.as_ref().expect("a table");
        let scope = ruleset.scope.as_ref().expect("scope chains");
        scope
            .output
            .iter()
            .filter_map(|r| match r {
                Rule::Fence(ScopeMatch::Cgroup(c)) => Some(c.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_listed_cgroup_that_appears_is_made_again_or_goes_is_followed_at_once() {
        let now = Instant::now();
        let (mut c, mut table) = started(SCOPED, now);
        assert!(
            fenced_cgroups(&table).is_empty(),
            "missing at start: no rule"
        );

        let fx = c.on(Event::HostScope(cgroups_found(&[7])), now, &mut table);
        assert_eq!(table.applied.len(), 2, "a full apply");
        assert_eq!(fenced_cgroups(&table), vec![agent_slice(7)]);
        assert_eq!(records(&fx), 1, "the table's configuration changed");

        let fx = c.on(Event::HostScope(cgroups_found(&[7])), now, &mut table);
        assert!(fx.is_empty(), "{fx:?}");
        assert_eq!(table.applied.len(), 2, "unchanged: nothing");

        // Removed and made again: a new id, which the old rule would not match.
        c.on(Event::HostScope(cgroups_found(&[9])), now, &mut table);
        assert_eq!(table.applied.len(), 3);
        assert_eq!(fenced_cgroups(&table), vec![agent_slice(9)]);

        c.on(Event::HostScope(cgroups_found(&[])), now, &mut table);
        assert_eq!(table.applied.len(), 4);
        assert!(fenced_cgroups(&table).is_empty());
        // The generation records what the table was planned with.
        let fx = c.on(Event::HostScope(cgroups_found(&[11])), now, &mut table);
        let Some(Effect::Record(new)) = fx.first() else {
            panic!("{fx:?}")
        };
        assert_eq!(new.resolution.scope.cgroups, vec![agent_slice(11)]);
    }

    #[test]
    fn a_refused_apply_after_a_cgroup_change_is_retried_with_the_new_cgroup() {
        let now = Instant::now();
        let (mut c, mut table) = started(SCOPED, now);
        table.refuse_apply = true;
        c.on(Event::HostScope(cgroups_found(&[7])), now, &mut table);
        assert_eq!(table.applied.len(), 1);
        table.refuse_apply = false;
        c.on(Event::Wake, now + Duration::from_secs(1), &mut table);
        assert_eq!(table.applied.len(), 2);
        assert_eq!(fenced_cgroups(&table), vec![agent_slice(7)]);
    }

    #[test]
    fn a_reload_plans_with_the_cgroups_read_for_the_new_policy_and_a_refused_one_keeps_the_old() {
        let now = Instant::now();
        let (mut c, mut table) = started(SCOPED, now);
        c.on(Event::HostScope(cgroups_found(&[7])), now, &mut table);
        let new = SCOPED.replace("ports: [443]", "ports: [8443]");
        table.refuse_apply = true;
        let fx = reload_on(&mut c, &mut table, &new, cgroups_found(&[9]), now);
        assert!(fx.is_empty(), "{fx:?}");
        table.refuse_apply = false;
        c.on(Event::NotificationsLost, now, &mut table);
        table.generation += 1;
        c.on(Event::NotificationsLost, now, &mut table);
        assert_eq!(fenced_cgroups(&table), vec![agent_slice(7)], "the old ids");

        let fx = reload_on(&mut c, &mut table, &new, cgroups_found(&[9]), now);
        assert!(fx.iter().any(|e| matches!(e, Effect::Adopted)));
        assert_eq!(fenced_cgroups(&table), vec![agent_slice(9)]);
        // Nothing changed since the reload read them.
        let applied = table.applied.len();
        c.on(Event::HostScope(cgroups_found(&[9])), now, &mut table);
        assert_eq!(table.applied.len(), applied);
    }

    #[test]
    fn the_guard_keeps_its_bridge_addresses_across_reloads_and_names_ones_it_does_not_serve() {
        let now = Instant::now();
        let text = GUARD.replace(
            "version: 1\n",
            "version: 1\nscope:\n  forward: [\"br-*\"]\n",
        );
        let p = policy(&text);
        let bound: SocketAddr = "198.18.0.1:53".parse().unwrap();
        let guard = GuardIdentity::of_policy(&p, 990).map(|g| g.listening_also_on(&[bound]));
        let mut c = Core::new(
            p,
            text.clone(),
            "/etc/p.yaml".into(),
            resolvers(),
            guard,
            now,
        );
        c.set_host_scope(HostScope {
            cgroups: Vec::new(),
            bridge_listen: vec![bound],
        });
        let mut table = MemoryTable::new();
        c.apply_all(&mut table, now, &mut Vec::new())
            .expect("applied");

        // A bridge that got an address after start takes no restart to reload the policy,
        // and the guard keeps listening where it bound.
        let later: SocketAddr = "198.18.1.1:53".parse().unwrap();
        let bridges = vec![("br-a".to_string(), bound), ("br-b".to_string(), later)];
        let facts = ScopeFacts {
            cgroups: Vec::new(),
            bridges: bridges.clone(),
        };
        let fx = reload_on(&mut c, &mut table, &text, facts.clone(), now);
        assert!(fx.iter().any(|e| matches!(e, Effect::Adopted)), "{fx:?}");
        assert_eq!(c.guard().unwrap().listen.last(), Some(&bound));
        assert_eq!(c.unserved_bridges, BTreeSet::from([later]));
        // Seen again by the poll: no new apply (and the warning is not repeated).
        let applied = table.applied.len();
        let fx = c.on(Event::HostScope(facts), now, &mut table);
        assert!(fx.is_empty());
        assert_eq!(table.applied.len(), applied);
        assert_eq!(c.unserved_bridges, BTreeSet::from([later]));
        // A changed `dns.listen` still takes a restart.
        let moved = text.replace(
            "  floor: 30s\n",
            "  floor: 30s\n  listen: [127.0.0.54:53]\n",
        );
        assert!(reload(&mut c, &mut table, &moved, now).is_empty());
    }
}
