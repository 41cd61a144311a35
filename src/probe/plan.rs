//! The attempt plan: the checks in report order ([`Plan`]), each one either done already (a
//! fact of the table or of an answer) or an [`Attempt`] to make with real sockets.

use std::collections::HashSet;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::{IpAddr, SocketAddr};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::core::policy::{DomainName, L4Proto, Policy, PortRange, Target};
use crate::core::resolution::ResolvedHost;

use super::guard_lookup::GuardLookup;
use super::options::ProbeOptions;
use super::other_protocols::OtherProto;
use super::report::Check;

/// The name asked of rogue resolvers and of the allowed ones: harmless, and answered by
/// every public resolver.
pub(super) const DNS_TEST_NAME: &str = "example.com";

/// In guard mode without `probe.exfil_domain`, the random exfiltration name goes under this
/// zone: `.invalid` can never exist (RFC 6761), so no answer can be a real one.
pub const DEFAULT_EXFIL_ZONE: &str = "egress-fence-probe.invalid";

/// What an attempt is expected to show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Expect {
    /// An allowed destination. `strict`: a single allowed port, whose TCP service must accept
    /// the connection; the ends of a port range only need to get through the boundary (a
    /// service rarely listens on every port of a range).
    Reach { strict: bool },
    /// An allowed resolver: a DNS answer must come back.
    Answer,
    /// A destination the boundary must refuse.
    Refuse,
    /// A destination the fence would refuse, tried by a prober the policy's scope leaves
    /// out: this host must let it go (whatever answers beyond).
    Untouched,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Tcp,
    Udp,
    /// A DNS query over UDP or TCP.
    Dns(L4Proto),
    /// UDP-Lite, an echo request, SCTP or DCCP (only towards refused destinations).
    Other(OtherProto),
}

#[derive(Debug, Clone)]
pub(super) struct Attempt {
    pub(super) check: String,
    pub(super) kind: Kind,
    pub(super) target: SocketAddr,
    pub(super) expect: Expect,
    /// Context added to the reason ("the address lies in the denied preset ...").
    pub(super) note: Option<String>,
    /// Added only when the check fails: the allow entry that opens the hole, if one does.
    pub(super) on_fail: Option<String>,
    /// The name a DNS attempt asks ([`DNS_TEST_NAME`] when `None`).
    pub(super) dns_name: Option<String>,
}

pub(super) enum Step {
    Done(Check),
    Attempt(Attempt),
}

/// The checks in report order; an attempt's check text appears once however many entries
/// lead to it.
pub(super) struct Plan<'a> {
    pub(super) policy: &'a Policy,
    pub(super) options: &'a ProbeOptions,
    pub(super) hosts: &'a [ResolvedHost],
    /// Guard mode: how the guard answered each name (`hosts` holds the same, as addresses).
    pub(super) lookups: &'a [GuardLookup],
    pub(super) steps: Vec<Step>,
    pub(super) seen: HashSet<String>,
}

/// Single ports strictly; a range at both ends (port 0 cannot be connected to).
pub(super) fn ports_to_probe(range: PortRange) -> Vec<(u16, bool)> {
    if range.is_single() {
        return vec![(range.first, true)];
    }
    let first = range.first.max(1);
    let mut ports = vec![(first, false)];
    if range.last != first {
        ports.push((range.last, false));
    }
    ports
}

pub(super) fn join_sockets(addrs: &[SocketAddr]) -> String {
    addrs
        .iter()
        .map(SocketAddr::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn join(addrs: &[IpAddr]) -> String {
    addrs
        .iter()
        .map(IpAddr::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// A label that no resolver has cached and no wildcard-less zone holds, under `domain`.
pub(super) fn random_name_under(domain: &DomainName) -> Result<DomainName, String> {
    format!("ef-probe-{:016x}.{domain}", random_u64())
        .parse()
        .map_err(|e| format!("cannot build a random name under {domain}: {e}"))
}

/// Not cryptographic: only unlikely to repeat (DNS ids, test names).
pub(super) fn random_u64() -> u64 {
    let mut h = RandomState::new().build_hasher();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.write_u32(std::process::id());
    h.finish()
}

impl<'a> Plan<'a> {
    pub(super) fn new(
        policy: &'a Policy,
        options: &'a ProbeOptions,
        hosts: &'a [ResolvedHost],
        lookups: &'a [GuardLookup],
    ) -> Self {
        Plan {
            policy,
            options,
            hosts,
            lookups,
            steps: Vec::new(),
            seen: HashSet::new(),
        }
    }

    pub(super) fn done(&mut self, check: Check) {
        if self.seen.insert(check.check.clone()) {
            self.steps.push(Step::Done(check));
        }
    }

    pub(super) fn attempt(&mut self, attempt: Attempt) {
        if self.seen.insert(attempt.check.clone()) {
            self.steps.push(Step::Attempt(attempt));
        }
    }

    pub(super) fn host(&self, name: &DomainName) -> Option<&'a ResolvedHost> {
        self.hosts.iter().find(|h| &h.name == name)
    }

    /// Where names were resolved: "192.0.2.53", or "the guard 127.0.0.53:53".
    pub(super) fn resolver_list(&self) -> String {
        match &self.policy.dns.guard {
            Some(g) => format!("the guard {}", join_sockets(&g.listen)),
            None => join(&self.options.resolvers),
        }
    }

    /// What a destination the fence refuses must show: refused, unless the scope leaves
    /// this probe out (then the fence must not touch it).
    pub(super) fn fence_refuses(&self) -> Expect {
        match self.options.outside_scope {
            Some(_) => Expect::Untouched,
            None => Expect::Refuse,
        }
    }

    pub(super) fn lookup(&self, name: &DomainName) -> Option<&'a GuardLookup> {
        self.lookups.iter().find(|l| &l.name == name)
    }

    /// The allow entry whose name or wildcard covers `name`, as the policy writes it.
    pub(super) fn covering_entry(&self, name: &DomainName) -> Option<String> {
        self.policy.allow.iter().find_map(|a| match &a.target {
            Target::Domain(d) if d == name => Some(format!("domain {d}")),
            Target::Wildcard(w) if w.matches(name) => Some(format!("domain {w}")),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_probed_at_both_ends() {
        assert_eq!(ports_to_probe(PortRange::single(443)), vec![(443, true)]);
        let range = PortRange {
            first: 8000,
            last: 8080,
        };
        assert_eq!(ports_to_probe(range), vec![(8000, false), (8080, false)]);
        assert_eq!(
            ports_to_probe(PortRange::ALL),
            vec![(1, false), (65535, false)]
        );
    }

    #[test]
    fn random_names_differ_and_stay_under_the_domain() {
        let domain: DomainName = "exfil.example.com".parse().expect("valid");
        let a = random_name_under(&domain).expect("valid");
        let b = random_name_under(&domain).expect("valid");
        assert_ne!(a, b);
        assert!(a.as_str().ends_with(".exfil.example.com"), "{a}");
    }
}
