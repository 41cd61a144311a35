//! What the daemon knows of each name: its addresses and until when each stays allowed, when
//! it is asked again, and the caps on what one name (and, in guard mode, all of them) may
//! hold; and the resolved elements those addresses make. Pure: the lifetimes come from the
//! ledger ([`crate::core::lifetime`]), the time from the caller.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use tokio::time::Instant;

use crate::core::lifetime::{Lifetimes, keep_longest, timeout_ms};
use crate::core::plan::{resolved_tuple, services_of};
use crate::core::policy::{DomainName, L4Proto, Policy};
use crate::core::resolution::{HostScope, Resolution, ResolvedAddr, ResolvedHost};
use crate::core::ruleset::{Timed, Tuple};

/// What the daemon knows of one name.
#[derive(Debug, Clone)]
pub(super) struct NameState {
    /// Each address and when it stops being allowed unless an answer renews it (expired
    /// ones are remembered for an hour).
    pub(super) addrs: BTreeMap<IpAddr, Instant>,
    /// The addresses of the last successful answer.
    pub(super) answered: BTreeSet<IpAddr>,
    pub(super) next_due: Instant,
    pub(super) failures: u32,
    pub(super) last_error: Option<String>,
}

impl NameState {
    pub(super) fn new(now: Instant) -> NameState {
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
    pub(super) fn extend(
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
            keep_longest(&mut self.addrs, a.addr, expires);
        }
        out
    }

    /// Takes in an answer received at `now`; returns the addresses it brought and, for a
    /// successful answer, those the previous one had and this one lacks.
    pub(super) fn answer(
        &mut self,
        host: &ResolvedHost,
        now: Instant,
        life: &Lifetimes,
    ) -> AnswerChanges {
        let mut changes = AnswerChanges {
            added: self
                .extend(&host.addrs, now, |ttl| life.resolved(ttl), true)
                .added,
            gone: Vec::new(),
        };
        if host.errors.is_empty() {
            let answered: BTreeSet<IpAddr> = host.addrs.iter().map(|a| a.addr).collect();
            changes.gone = self.answered.difference(&answered).copied().collect();
            self.answered = answered;
            self.failures = 0;
            self.last_error = None;
            self.next_due = now + life.next_refresh(host.addrs.iter().map(|a| a.ttl));
        } else {
            // A partial answer still renews what it named; the rest keeps its expiry.
            self.failures += 1;
            self.last_error = Some(host.errors.join("; "));
            self.next_due = now + life.retry_after(self.failures);
        }
        changes
    }

    /// Addresses allowed at `now`.
    pub(super) fn live(&self, now: Instant) -> impl Iterator<Item = (&IpAddr, &Instant)> {
        self.addrs.iter().filter(move |(_, e)| **e > now)
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct AnswerChanges {
    pub(super) added: Vec<IpAddr>,
    pub(super) gone: Vec<IpAddr>,
}

/// What [`NameState::extend`] took in.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Extended {
    /// Addresses not allowed before.
    pub(super) added: Vec<IpAddr>,
    /// New addresses left out: past the caps.
    pub(super) left_out: usize,
}

/// Live addresses of one family one name may hold at once. A name under an allowed wildcard
/// answers what its zone's owner likes, fresh addresses every time if it wants: without a cap
/// one name grows the sets by everything it answers within `floor` + `grace`. Eight times
/// what one answer may bring, so a CDN that rotates its addresses keeps working.
pub(super) const MAX_LIVE_ADDRS_PER_NAME: usize = 256;

/// In guard mode, how many resolved elements the daemon installs at most (all names, ports
/// and families together): past it, answers only renew what is live, and new addresses wait
/// until others expire. About 60 MB of kernel and daemon memory.
pub(super) const MAX_RESOLVED_ELEMENTS: usize = 262_144;

/// How often expired elements are dropped from the record of what the kernel holds.
pub(super) const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// How long an expired address is remembered, to explain refusals of it.
pub(super) const REMEMBER_EXPIRED: Duration = Duration::from_secs(3600);

/// In guard mode, how many names without a live address are remembered at most.
pub(super) const MAX_FORMER_NAMES: usize = 10_000;

/// In guard mode, how many names may hold live addresses at once. Names under an allowed
/// wildcard are the sandbox's to invent (each costs the daemon about a kilobyte and the
/// kernel its elements); past the cap an answer for one more name is not installed and its
/// client gets SERVFAIL. No live name is evicted to make room: its clients still hold its
/// answer, and its elements must stay explained by a name. Room comes back as names expire
/// (at most `dns.refresh.max` plus the grace after their last answer).
pub(super) const MAX_LIVE_NAMES: usize = 50_000;

/// Whether an answer for `name` may be installed while at most `cap` names hold live
/// addresses: a name that has live ones already may always renew them. `live_names` counts
/// the names with live addresses; it is counted only when `names` holds `cap` names or more
/// (below that, fewer are live), once, and kept up to date by the caller's admissions.
pub(super) fn may_track(
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
pub(super) type Services = BTreeMap<DomainName, Vec<(L4Proto, u16)>>;

pub(super) fn services(policy: &Policy) -> Services {
    policy
        .domains()
        .into_iter()
        .map(|n| (n.clone(), services_of(policy, n).collect()))
        .collect()
}

/// The resolved elements the live addresses of `names` need, each with the latest expiry
/// any of them gives it.
pub(super) fn desired<'a>(
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
                keep_longest(&mut out, resolved_tuple(addr, service), expires);
            }
        }
    }
    out
}

/// Forgets the guard's learned names nothing has been remembered of for an hour, and, past
/// `max_former` names without a live address, all of those: names asked under an allowed
/// wildcard are the sandbox's to invent, and must not grow the daemon without bound.
pub(super) fn forget_learned_names(
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
pub(super) struct Carried {
    pub(super) expires: Instant,
    pub(super) name: String,
}

/// For each element the live addresses of `names` need, the first of them that gives it
/// (the name its comment carries). Walks what [`desired`] walks, once.
pub(super) fn owners<'a>(
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

/// The resolved elements the table holds: the live addresses of `names` on their services
/// and what a restart carried over, each until the latest expiry any of them gives it and
/// named after the first name that gives it (else the name it was carried for).
pub(super) fn table_elements<'a>(
    names: impl Iterator<Item = (&'a DomainName, &'a NameState)>,
    services: &Services,
    carried: &BTreeMap<Tuple, Carried>,
    now: Instant,
) -> BTreeMap<Tuple, Instant> {
    let mut out = desired(names, services, now);
    for (t, c) in carried {
        keep_longest(&mut out, *t, c.expires);
    }
    out
}

/// `elements` as the kernel takes them: each with what is left of its lifetime and the name
/// `name_of` gives it.
pub(super) fn timed(
    elements: impl IntoIterator<Item = (Tuple, Instant)>,
    now: Instant,
    name_of: impl Fn(&Tuple) -> Option<String>,
) -> Vec<Timed> {
    elements
        .into_iter()
        .map(|(tuple, expires)| Timed {
            tuple,
            timeout_ms: Some(timeout_ms(expires.saturating_duration_since(now))),
            expires_ms: None,
            name: name_of(&tuple),
        })
        .collect()
}

/// The live addresses of `names` as a resolution: what a generation records of what the
/// daemon holds (their lifetimes are in the ruleset's elements, so the TTL says nothing).
pub(super) fn live_resolution(
    names: &BTreeMap<DomainName, NameState>,
    resolvers: Vec<IpAddr>,
    guard_uid: Option<u32>,
    scope: HostScope,
    now: Instant,
) -> Resolution {
    Resolution {
        resolvers,
        hosts: names
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
        guard_uid,
        scope,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::core::lifetime::renewals;
    use crate::core::plan::plan_elements;
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
    fn an_answer_sets_expiry_and_schedule() {
        let dns = Lifetimes::of(&policy().dns);
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
        let dns = Lifetimes::of(&policy().dns);
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
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let mut a = NameState::new(now);
        a.addrs.insert(ip, now + Duration::from_secs(100));
        let names = BTreeMap::from([("a.example".parse::<DomainName>().unwrap(), a)]);
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
        let got = table_elements(names.iter(), &services(&p), &carried, now);
        let secs = |t: &str| got[&tuple(t)].saturating_duration_since(now).as_secs();
        assert_eq!(secs("192.0.2.1/32"), 100, "the later expiry wins");
        assert_eq!(secs("192.0.2.2/32"), 70);
        assert_eq!(secs("2001:db8::2/128"), 70);
        assert_eq!(got.len(), 3);
        let t = timed(got, now, |_| None);
        assert_eq!(t[0].timeout_ms, Some(100_000));
    }

    #[test]
    fn the_table_holds_what_planning_the_live_addresses_gave() {
        // What `apply_all` sends equals what it sent when it planned a resolution of the live
        // addresses with their remaining lifetimes: the same elements, names and timeouts.
        let p = policy();
        let now = Instant::now();
        let (ip, other): (IpAddr, IpAddr) =
            ("192.0.2.9".parse().unwrap(), "2001:db8::9".parse().unwrap());
        let mut a = NameState::new(now);
        a.addrs.insert(ip, now + Duration::from_secs(100));
        a.addrs.insert(other, now + Duration::from_millis(1500));
        let mut b = NameState::new(now);
        b.addrs.insert(ip, now + Duration::from_secs(200));
        b.addrs
            .insert("192.0.2.7".parse().unwrap(), now - Duration::from_secs(1));
        let names = BTreeMap::from([
            ("a.example".parse::<DomainName>().unwrap(), a),
            ("b.example".parse::<DomainName>().unwrap(), b),
        ]);
        let resolution = live_resolution(
            &names,
            vec!["192.0.2.53".parse().unwrap()],
            None,
            Default::default(),
            now,
        );
        let before = crate::core::plan::plan_with(&p, &resolution, |name, addr| {
            let expires = names.get(name)?.addrs.get(&addr)?;
            Some(
                expires
                    .saturating_duration_since(now)
                    .max(Duration::from_millis(1)),
            )
        });
        let svc = services(&p);
        let elements = table_elements(names.iter(), &svc, &BTreeMap::new(), now);
        let owners = owners(names.iter(), &svc, now);
        let named = timed(elements, now, |t| owners.get(t).map(|n| n.to_string()));
        let after = plan_elements(&p, &resolution.resolvers, None, &[], named);
        assert_eq!(before, after);
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
