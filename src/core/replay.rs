//! `replay`: what a candidate policy would have done with a recorded [`Trace`]: the names and
//! flows it would have refused, the flows it cannot judge from a trace, and the allow entries
//! the trace never used. Pure. `learn` asks the same judge which flows a policy lacks, so the
//! two agree by construction.
//!
//! The judge follows the table's rules in their order (see `core::plan`): loopback, ICMP a
//! process wrote, questions to the guard, DNS to the resolvers, the deny list (deny wins over
//! every allow entry), DHCP, DNS to anything else in guard mode, then the allow entries: a
//! `cidr:` covering the destination, or a `domain:` entry matching a name whose answer named
//! the destination before the flow left (in guard mode only a name the guard would have
//! forwarded gets its answer installed; in resolve mode only the policy's own names do).
//!
//! One pass over the records, each judged in time bounded by the policy's size: names are
//! judged once per distinct name, and each address keeps the allow entries its answers let
//! in, so a trace of a million lines costs a million steps, not a million squared.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use serde::Serialize;

use crate::core::explain::WhyRefused;
use crate::core::installable::{self, HostAddrs};
use crate::core::plan::{DNS_PORT, GUARDED_DNS_PORTS};
use crate::core::policy::{
    Allow, AllowPreset, DomainName, Essential, L4Proto, Policy, Scope, Target,
};
use crate::core::ruleset::{Family, dhcp_ports, dhcp_servers};
use crate::core::trace::{Record, Trace};

/// Query types the guard never forwards, whatever the name (see `guard::rules::judge`).
const NEVER_FORWARDED: [&str; 3] = ["ANY", "AXFR", "IXFR"];

/// How many of the names that explain a refused flow the report lists.
pub const MAX_NAMES_SHOWN: usize = 20;

/// Why the policy would have refused a flow.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(tag = "reason", rename_all = "kebab-case")]
pub enum FlowRefusal {
    /// A deny entry covers the destination (`preset cloud-metadata`, `network 10.0.0.0/8`):
    /// deny wins over every allow entry.
    Denied { by: String },
    /// Guard mode: DNS (53, 853) to a resolver other than the guard.
    OtherResolver { port: u16 },
    /// Guard mode: anything to one of the guard's upstream resolvers (or its NAT64 image),
    /// which only the guard's own (marked) sockets may reach, on any port.
    GuardUpstream,
    /// ICMP a process wrote (the kernel's own has no owner).
    IcmpFromProcess,
    /// A protocol other than TCP and UDP, which no allow entry names.
    Protocol,
    /// Allowed, but on other ports or protocols only.
    OtherPortsOnly,
    /// Nothing in the policy allows it.
    NotInPolicy,
}

impl FlowRefusal {
    /// Whether an allow entry would let the flow through: not for what deny entries and the
    /// guard's rules refuse whatever the policy allows.
    pub fn allow_entry_helps(&self) -> bool {
        matches!(self, FlowRefusal::OtherPortsOnly | FlowRefusal::NotInPolicy)
    }
}

impl fmt::Display for FlowRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let said = match self {
            FlowRefusal::Denied { by } => WhyRefused::Denied(by.clone()),
            FlowRefusal::OtherResolver { port } => WhyRefused::OtherResolver { port: *port },
            FlowRefusal::OtherPortsOnly => WhyRefused::OtherPortsOnly { names: vec![] },
            FlowRefusal::NotInPolicy => WhyRefused::NotInPolicy,
            FlowRefusal::GuardUpstream => {
                return f.write_str(
                    "to the guard's upstream resolver: only the guard's own (marked) \
                     sockets may reach it, on any port",
                );
            }
            FlowRefusal::IcmpFromProcess => {
                return f.write_str("ICMP written by a process: refused whatever the policy");
            }
            FlowRefusal::Protocol => {
                return f.write_str("a protocol other than TCP and UDP: no allow entry names it");
            }
        };
        said.fmt(f)
    }
}

/// Why the guard would have refused a name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(tag = "reason", rename_all = "kebab-case")]
pub enum NameRefusal {
    /// No allow entry names it (exactly or by a wildcard).
    NotInPolicy,
    /// ANY or a zone transfer: never forwarded, whatever the name.
    QueryType { qtype: String },
    /// Not a name a policy can hold (escaped dots, `*` labels, too long).
    NotAName,
}

impl fmt::Display for NameRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NameRefusal::NotInPolicy => f.write_str("not in the policy"),
            NameRefusal::QueryType { qtype } => {
                write!(f, "type {qtype}: the guard never forwards it")
            }
            NameRefusal::NotAName => f.write_str("not a name a policy can allow"),
        }
    }
}

/// Why a flow cannot be judged from a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CannotJudge {
    /// Under a scope of users or cgroups, a flow with neither a uid nor an interface.
    NoOwner,
    /// The uid is not among the scope's users, but the scope lists cgroups, which a trace
    /// does not record.
    MaybeInCgroup,
    /// Resolve mode without `dns.resolvers`: DNS to this address is allowed when the host's
    /// resolv.conf names it, which the trace does not record.
    ResolvConf,
}

impl fmt::Display for CannotJudge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CannotJudge::NoOwner => {
                "neither a uid nor an interface: the trace does not say whose it was, so \
                 whether the scope fences it cannot be told"
            }
            CannotJudge::MaybeInCgroup => {
                "its uid is not among the scope's users, but the scope lists cgroups, which a \
                 trace does not record"
            }
            CannotJudge::ResolvConf => {
                "DNS (port 53): allowed if the host's resolv.conf names this resolver; the \
                 policy lists no `dns.resolvers` and the trace does not record them"
            }
        })
    }
}

/// What the policy would have done with one flow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FlowVerdict {
    /// Allowed by these allow entries (indices into `Policy::allow`).
    Allowed(Vec<usize>),
    /// Let through by what the table always allows (loopback, DNS to the resolvers, DHCP,
    /// the kernel's ICMP).
    Essential(&'static str),
    /// Outside the scope: the fence never sees it.
    Untouched,
    CannotJudge(CannotJudge),
    Refused(FlowRefusal),
}

/// What the guard would have done with one name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NameVerdict {
    /// Forwarded: these allow entries name it.
    Allowed(Vec<usize>),
    /// Resolve mode: no guard refuses names; these are the policy's own entries for it
    /// (exact names), whose answers the table takes.
    NotJudged(Vec<usize>),
    Refused(NameRefusal),
}

/// One flow of the trace, judged.
#[derive(Debug, Clone)]
pub struct JudgedFlow<'t> {
    pub time: &'t str,
    pub protocol: &'t str,
    pub dst: IpAddr,
    pub dport: Option<u16>,
    pub uid: Option<u32>,
    pub iif: Option<&'t str>,
    /// The name (index into [`Judgement::domains`]) whose answer named `dst` last before the
    /// flow: the one the client most likely connected for. A name the flow's own uid asked
    /// comes first (another user's later answer for the same address, such as the sandbox's
    /// own zone answering it, does not take the flow); else the last of anyone's. Only names a
    /// policy can allow count, and only answers of addresses the table would take.
    pub latest_name: Option<usize>,
    /// How many distinct names had answered `dst` by then: they are the first that many of
    /// [`Judgement::names_of`] for `dst`.
    pub names_before: usize,
    pub verdict: FlowVerdict,
}

/// One name record of the trace, judged.
#[derive(Debug, Clone)]
pub struct JudgedName<'t> {
    pub time: &'t str,
    /// As recorded.
    pub name: &'t str,
    /// As a policy name (index into [`Judgement::domains`]); `None` when it is not one.
    pub domain: Option<usize>,
    pub qtype: &'t str,
    /// Whether the answer carried addresses.
    pub answered: bool,
    pub uid: Option<u32>,
    pub verdict: NameVerdict,
}

/// Every record of a trace judged against a policy: what [`replay`] sums up and `learn`
/// reads.
#[derive(Debug, Clone)]
pub struct Judgement<'t> {
    pub flows: Vec<JudgedFlow<'t>>,
    pub names: Vec<JudgedName<'t>>,
    /// The distinct policy names the trace asked, in the order first asked.
    pub domains: Vec<DomainName>,
    /// Per address, the distinct names (as recorded) whose answers named it, in order.
    pub names_of: HashMap<IpAddr, Vec<&'t str>>,
    /// Per allow entry, whether a name or flow used it.
    pub used: Vec<bool>,
    /// Per allow entry, the first name it allowed and whether it allowed another.
    pub names_allowed: Vec<(Option<DomainName>, bool)>,
}

/// What an address's answers have let in so far.
#[derive(Default)]
struct AddrState<'t> {
    names: Vec<&'t str>,
    seen: HashSet<&'t str>,
    /// Allow entries of names whose answers the table would have taken for it.
    entries: BTreeSet<usize>,
    latest: Option<usize>,
    /// The latest per uid that asked (`None`: asked with no uid, as what crosses a bridge).
    /// A flow whose uid asked none goes to `latest` only when one uid asked them all: with
    /// several askers, the last could be the fenced process's, asked to take the flow.
    latest_of: HashMap<Option<u32>, usize>,
}

struct Judge<'p> {
    policy: &'p Policy,
    guard: bool,
    scope_uids: Option<Vec<u32>>,
}

impl Judge<'_> {
    /// The allow entries that name `domain` (exactly, or by a wildcard in guard mode).
    fn entries_naming(&self, domain: &DomainName) -> Vec<usize> {
        self.policy
            .allow
            .iter()
            .enumerate()
            .filter(|(_, a)| match &a.target {
                Target::Domain(d) => d == domain,
                Target::Wildcard(w) => self.guard && w.matches(domain),
                Target::Cidr(_) => false,
            })
            .map(|(i, _)| i)
            .collect()
    }

    /// Whether the scope leaves the flow alone or it cannot be told; `None`: it is fenced.
    fn scope_verdict(
        &self,
        scope: &Scope,
        uid: Option<u32>,
        iif: Option<&str>,
    ) -> Option<FlowVerdict> {
        if let Some(iif) = iif {
            return (!scope.forward.iter().any(|p| p.matches(iif)))
                .then_some(FlowVerdict::Untouched);
        }
        if !scope.fences_local() {
            return Some(FlowVerdict::Untouched);
        }
        let uids = self.scope_uids.as_deref().unwrap_or_default();
        match uid {
            Some(u) if uids.binary_search(&u).is_ok() => None,
            Some(_) if !scope.cgroups.is_empty() => {
                Some(FlowVerdict::CannotJudge(CannotJudge::MaybeInCgroup))
            }
            Some(_) => Some(FlowVerdict::Untouched),
            None => Some(FlowVerdict::CannotJudge(CannotJudge::NoOwner)),
        }
    }

    fn flow(
        &self,
        protocol: &str,
        dst: IpAddr,
        dport: Option<u16>,
        uid: Option<u32>,
        iif: Option<&str>,
        addr: Option<&AddrState>,
    ) -> FlowVerdict {
        let policy = self.policy;
        let has = |e| policy.essentials.contains(&e);
        if let Some(scope) = &policy.scope
            && let Some(v) = self.scope_verdict(scope, uid, iif)
        {
            return v;
        }
        if dst.is_loopback() && iif.is_none() && has(Essential::Loopback) {
            return FlowVerdict::Essential("loopback");
        }
        let proto = match protocol {
            "tcp" => L4Proto::Tcp,
            "udp" => L4Proto::Udp,
            "icmp" | "icmpv6" | "ipv6-icmp" if uid.is_none() => {
                return FlowVerdict::Essential(
                    "the kernel's own ICMP (neighbour discovery, errors)",
                );
            }
            "icmp" | "icmpv6" | "ipv6-icmp" => {
                return FlowVerdict::Refused(FlowRefusal::IcmpFromProcess);
            }
            _ if to_guard_upstream(policy, dst) => {
                return FlowVerdict::Refused(FlowRefusal::GuardUpstream);
            }
            _ => {
                return FlowVerdict::Refused(match denied(policy, dst) {
                    Some(by) => FlowRefusal::Denied { by },
                    None => FlowRefusal::Protocol,
                });
            }
        };
        let dns_port = dport.filter(|p| GUARDED_DNS_PORTS.contains(p));
        if let Some(g) = &policy.dns.guard {
            if g.listen
                .iter()
                .any(|l| l.ip() == dst && Some(l.port()) == dport)
            {
                return FlowVerdict::Essential("a question to the DNS guard");
            }
            if dns_port.is_some() && g.upstream.contains(&dst) || to_guard_upstream(policy, dst) {
                return FlowVerdict::Refused(FlowRefusal::GuardUpstream);
            }
        } else if dport == Some(DNS_PORT) {
            match &policy.dns.resolvers {
                Some(r) if r.contains(&dst) => return FlowVerdict::Essential("DNS to a resolver"),
                None => return FlowVerdict::CannotJudge(CannotJudge::ResolvConf),
                Some(_) => {}
            }
        }
        if let Some(by) = denied(policy, dst) {
            return FlowVerdict::Refused(FlowRefusal::Denied { by });
        }
        for (family, essential) in [
            (Family::V4, Essential::Dhcpv4),
            (Family::V6, Essential::Dhcpv6),
        ] {
            if proto == L4Proto::Udp
                && dst == dhcp_servers(family)
                && dport == Some(dhcp_ports(family).1)
                && has(essential)
            {
                return FlowVerdict::Essential("a DHCP client's request");
            }
        }
        if let (true, Some(port)) = (self.guard, dns_port) {
            return FlowVerdict::Refused(FlowRefusal::OtherResolver { port });
        }
        let names_it = |i: usize, a: &Allow| match a.target {
            Target::Cidr(net) => net.contains(&dst),
            _ => addr.is_some_and(|s| s.entries.contains(&i)),
        };
        let Some(port) = dport else {
            return FlowVerdict::Refused(FlowRefusal::NotInPolicy);
        };
        let allowing: Vec<usize> = policy
            .allow
            .iter()
            .enumerate()
            .filter(|&(i, a)| {
                names_it(i, a)
                    && a.protocol.l4protos().contains(&proto)
                    && a.ports.iter().any(|r| r.first <= port && port <= r.last)
            })
            .map(|(i, _)| i)
            .collect();
        if !allowing.is_empty() {
            FlowVerdict::Allowed(allowing)
        } else if policy.allow.iter().enumerate().any(|(i, a)| names_it(i, a)) {
            FlowVerdict::Refused(FlowRefusal::OtherPortsOnly)
        } else {
            FlowVerdict::Refused(FlowRefusal::NotInPolicy)
        }
    }
}

/// Whether `dst` is one of the guard's upstream resolvers, or the NAT64 image of one: the
/// table refuses it to every socket but the guard's, on every port (the deny set holds it).
fn to_guard_upstream(policy: &Policy, dst: IpAddr) -> bool {
    let Some(g) = &policy.dns.guard else {
        return false;
    };
    let embedded = match dst {
        IpAddr::V6(v6) => installable::nat64_embedded(v6).map(IpAddr::V4),
        IpAddr::V4(_) => None,
    };
    let upstream =
        |a: IpAddr| g.upstream.contains(&a) && crate::core::plan::upstream_denied(policy, a);
    upstream(dst) || embedded.is_some_and(upstream)
}

/// The deny entry that covers `dst`, also as the NAT64 image of a denied IPv4 address (the
/// table's deny set holds those images too), described.
fn denied(policy: &Policy, dst: IpAddr) -> Option<String> {
    let embedded = match dst {
        IpAddr::V6(v6) => installable::nat64_embedded(v6).map(IpAddr::V4),
        IpAddr::V4(_) => None,
    };
    policy
        .denied_by(dst)
        .or_else(|| embedded.and_then(|v4| policy.denied_by(v4)))
        .map(|d| d.describe())
}

/// Judges every record of `trace` against `policy`, in one pass.
pub fn judge<'t>(policy: &Policy, trace: &'t Trace) -> Judgement<'t> {
    let judge = Judge {
        policy,
        guard: policy.dns.guard.is_some(),
        scope_uids: policy.scope.as_ref().map(Scope::uids),
    };
    let mut out = Judgement {
        flows: Vec::new(),
        names: Vec::new(),
        domains: Vec::new(),
        names_of: HashMap::new(),
        used: vec![false; policy.allow.len()],
        names_allowed: vec![(None, false); policy.allow.len()],
    };
    // Per distinct name as recorded: its policy name and the entries naming it.
    let mut known: HashMap<&str, Option<(usize, Vec<usize>)>> = HashMap::new();
    let mut index_of: HashMap<DomainName, usize> = HashMap::new();
    let mut addrs: HashMap<IpAddr, AddrState<'t>> = HashMap::new();
    for r in &trace.records {
        match r {
            Record::Name {
                time,
                name,
                qtype,
                addrs: answer,
                uid,
                ..
            } => {
                let info: &Option<(usize, Vec<usize>)> =
                    known.entry(name.as_str()).or_insert_with(|| {
                        let domain: DomainName = policy_name(name)?;
                        let entries = judge.entries_naming(&domain);
                        for &i in &entries {
                            let (first, more) = &mut out.names_allowed[i];
                            match first {
                                None => *first = Some(domain.clone()),
                                Some(f) if *f != domain => *more = true,
                                Some(_) => {}
                            }
                        }
                        let next = index_of.len();
                        let index = *index_of.entry(domain.clone()).or_insert_with(|| {
                            out.domains.push(domain);
                            next
                        });
                        Some((index, entries))
                    });
                let never = NEVER_FORWARDED.contains(&qtype.to_ascii_uppercase().as_str());
                let verdict = match (info, judge.guard) {
                    (_, true) if never => NameVerdict::Refused(NameRefusal::QueryType {
                        qtype: qtype.to_ascii_uppercase(),
                    }),
                    (None, true) => NameVerdict::Refused(NameRefusal::NotAName),
                    (Some((_, e)), true) if e.is_empty() => {
                        NameVerdict::Refused(NameRefusal::NotInPolicy)
                    }
                    (Some((_, e)), true) => NameVerdict::Allowed(e.clone()),
                    (Some((_, e)), false) => NameVerdict::NotJudged(e.clone()),
                    (None, false) => NameVerdict::NotJudged(Vec::new()),
                };
                let (takes, entries): (bool, &[usize]) = match &verdict {
                    NameVerdict::Allowed(e) | NameVerdict::NotJudged(e) => (!e.is_empty(), e),
                    NameVerdict::Refused(_) => (false, &[]),
                };
                for &i in entries {
                    out.used[i] = true;
                }
                let domain = info.as_ref().map(|(d, _)| *d);
                // What the table takes of an answer: each address once, the first
                // MAX_ADDRS_PER_FAMILY of each family, none it never takes (whoever answers).
                let mut taken: Vec<IpAddr> = Vec::with_capacity(answer.len());
                let mut once = HashSet::new();
                taken.extend(answer.iter().filter(|a| once.insert(**a)));
                installable::cap_per_family(&mut taken, |a| *a);
                taken.retain(|a| installable::check(*a, &HostAddrs::none()).is_ok());
                for a in taken {
                    let state = addrs.entry(a).or_default();
                    if state.seen.insert(name) {
                        state.names.push(name);
                    }
                    if takes {
                        state.entries.extend(entries.iter().copied());
                    }
                    if let Some(d) = domain.filter(|_| !never) {
                        state.latest = Some(d);
                        state.latest_of.insert(*uid, d);
                    }
                }
                out.names.push(JudgedName {
                    time,
                    name,
                    domain,
                    qtype,
                    answered: !answer.is_empty(),
                    uid: *uid,
                    verdict,
                });
            }
            Record::Flow {
                time,
                protocol,
                dst,
                dport,
                uid,
                iif,
                ..
            } => {
                let state = addrs.get(dst);
                let verdict = judge.flow(protocol, *dst, *dport, *uid, iif.as_deref(), state);
                if let FlowVerdict::Allowed(entries) = &verdict {
                    for &i in entries {
                        out.used[i] = true;
                    }
                }
                out.flows.push(JudgedFlow {
                    time,
                    protocol,
                    dst: *dst,
                    dport: *dport,
                    uid: *uid,
                    iif: iif.as_deref(),
                    latest_name: state.and_then(|s| {
                        s.latest_of
                            .get(uid)
                            .copied()
                            .or(s.latest.filter(|_| s.latest_of.len() == 1))
                    }),
                    names_before: state.map_or(0, |s| s.names.len()),
                    verdict,
                });
            }
            Record::Start { .. } | Record::End { .. } => {}
        }
    }
    out.names_of = addrs.into_iter().map(|(a, s)| (a, s.names)).collect();
    out
}

/// `name` as a policy name (lower case, no final dot); `None` for what no policy can name,
/// as the guard refuses it (escaped dots and the like).
pub fn policy_name(name: &str) -> Option<DomainName> {
    if name.contains('\\') {
        return None;
    }
    name.parse().ok()
}

/// A name the policy would have refused, with how often and when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RefusedName {
    /// As a policy name when it is one, else as recorded.
    pub name: String,
    pub why: NameRefusal,
    pub count: usize,
    pub first: String,
    pub last: String,
    /// The query types asked.
    pub qtypes: Vec<String>,
    pub uids: Vec<u32>,
}

/// Flows to one destination, protocol and port the policy would have refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RefusedFlow {
    pub dst: IpAddr,
    pub protocol: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dport: Option<u16>,
    pub why: FlowRefusal,
    pub count: usize,
    pub first: String,
    pub last: String,
    /// The names whose answers named `dst` before these flows (at most
    /// [`MAX_NAMES_SHOWN`]; `more_names` says how many more); empty: a bare address. Shared
    /// between the groups of an address: one address and its names make as many groups as
    /// ports and protocols were tried, and each group holding copies would cost the names
    /// that many times over.
    pub names: Vec<Arc<str>>,
    pub more_names: usize,
    pub uids: Vec<u32>,
    /// The listed interfaces forwarded flows came in on.
    pub interfaces: Vec<String>,
}

/// Flows the trace cannot say enough about to judge, by reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Unjudged {
    pub why: CannotJudge,
    pub count: usize,
    pub first: String,
    pub last: String,
    /// One of them, as `tcp 192.0.2.7:443`.
    pub example: String,
}

/// An allow entry nothing in the trace used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnusedEntry {
    /// As `check` shows it: `api.example.com tcp 443`.
    pub entry: String,
    /// The preset it came from (`include:`); `None`: the policy's own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preset: Option<String>,
}

/// A wildcard that allowed a single name of the trace: it could be that name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NarrowableWildcard {
    pub wildcard: String,
    pub name: String,
}

/// What a candidate policy would have done with a trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplayReport {
    /// "guard" or "resolve": the policy's.
    pub mode: String,
    pub names: usize,
    pub flows: usize,
    pub allowed_flows: usize,
    pub essential_flows: usize,
    /// Outside the scope.
    pub untouched_flows: usize,
    pub refused_names: Vec<RefusedName>,
    pub refused_flows: Vec<RefusedFlow>,
    pub unjudged: Vec<Unjudged>,
    pub unused: Vec<UnusedEntry>,
    pub narrowable: Vec<NarrowableWildcard>,
    /// What the trace cannot tell about this policy.
    pub notes: Vec<String>,
    /// Records the run could not keep (its `end` lines' `lost`): not judged.
    pub lost: u64,
    /// Whether the trace's last line is an `end` line: a run that did not stop cleanly (a
    /// SIGKILL, a crash, a failed write) leaves none, and what its writer held is missing.
    pub ended: bool,
}

impl ReplayReport {
    /// Whether the policy would have refused any name or flow of the trace.
    pub fn refuses_anything(&self) -> bool {
        !self.refused_names.is_empty() || !self.refused_flows.is_empty()
    }

    /// Whether the trace holds all its run saw: nothing lost, and an `end` line.
    pub fn complete(&self) -> bool {
        self.lost == 0 && self.ended
    }
}

/// `tcp 192.0.2.7:443`, `icmp 192.0.2.7`.
pub fn describe_flow(protocol: &str, dst: IpAddr, dport: Option<u16>) -> String {
    match (dst, dport) {
        (IpAddr::V6(a), Some(p)) => format!("{protocol} [{a}]:{p}"),
        (a, Some(p)) => format!("{protocol} {a}:{p}"),
        (a, None) => format!("{protocol} {a}"),
    }
}

/// The preset each allow entry came from (`include:`), `None` for the policy's own: the
/// included entries follow the policy's own (see `Policy::allow`), so they are the entries at
/// the end that are a preset's, comment included.
pub fn entry_presets(policy: &Policy) -> Vec<Option<AllowPreset>> {
    let shipped: Vec<(AllowPreset, Allow)> = policy
        .include
        .iter()
        .flat_map(|&p| p.entries().into_iter().map(move |e| (p, e)))
        .collect();
    let mut out = vec![None; policy.allow.len()];
    for (i, a) in policy.allow.iter().enumerate().rev() {
        match shipped.iter().find(|(_, e)| e == a) {
            Some((p, _)) => out[i] = Some(*p),
            None => break,
        }
    }
    out
}

/// Folds one more occurrence at `time` into a first/last/count triple.
fn seen_at(first: &mut String, last: &mut String, count: &mut usize, time: &str) {
    if *count == 0 {
        *first = time.to_string();
    }
    *last = time.to_string();
    *count += 1;
}

/// Refused flows are grouped by destination, protocol, port and reason.
type FlowKey<'t> = (IpAddr, &'t str, Option<u16>, FlowRefusal);

/// A group of refused flows as it is gathered.
struct FlowGroup<'t> {
    group: RefusedFlow,
    /// The most names any of its flows had to explain it (see [`JudgedFlow::names_before`]).
    names_before: usize,
    uids: BTreeSet<u32>,
    interfaces: BTreeSet<&'t str>,
}

/// The refused names, by name (as a policy name when it is one) and reason.
fn refused_names(j: &Judgement) -> Vec<RefusedName> {
    struct Group {
        group: RefusedName,
        qtypes: BTreeSet<String>,
        uids: BTreeSet<u32>,
    }
    let mut groups: BTreeMap<(String, NameRefusal), Group> = BTreeMap::new();
    for n in &j.names {
        let NameVerdict::Refused(why) = &n.verdict else {
            continue;
        };
        let shown = n
            .domain
            .map_or_else(|| n.name.to_string(), |d| j.domains[d].to_string());
        let g = groups
            .entry((shown.clone(), why.clone()))
            .or_insert_with(|| Group {
                group: RefusedName {
                    name: shown,
                    why: why.clone(),
                    count: 0,
                    first: String::new(),
                    last: String::new(),
                    qtypes: Vec::new(),
                    uids: Vec::new(),
                },
                qtypes: BTreeSet::new(),
                uids: BTreeSet::new(),
            });
        let r = &mut g.group;
        seen_at(&mut r.first, &mut r.last, &mut r.count, n.time);
        g.qtypes.insert(n.qtype.to_ascii_uppercase());
        g.uids.extend(n.uid);
    }
    groups
        .into_values()
        .map(|g| RefusedName {
            qtypes: g.qtypes.into_iter().collect(),
            uids: g.uids.into_iter().collect(),
            ..g.group
        })
        .collect()
}

/// For each `(address, n)` of `wanted`: the first [`MAX_NAMES_SHOWN`] in sort order of the
/// first `n` names that answered the address, and how many more there were. The groups of an
/// address are taken in order of `n`, each adding only the names the one before had not
/// seen, so a trace whose refused flows make many groups of one much-answered address (a
/// port each) costs the names once, not once per group.
fn names_shown(
    wanted: &[(IpAddr, usize)],
    names_of: &HashMap<IpAddr, Vec<&str>>,
) -> Vec<(Vec<Arc<str>>, usize)> {
    let mut order: Vec<usize> = (0..wanted.len()).collect();
    order.sort_by_key(|&i| wanted[i]);
    let mut out = vec![(Vec::new(), 0); wanted.len()];
    let mut at = None;
    let mut taken = 0;
    // The smallest names seen so far, at most MAX_NAMES_SHOWN (the names are distinct).
    let mut smallest: BTreeSet<&str> = BTreeSet::new();
    // Each name shown is made once, and shared by every group that shows it.
    let mut made: HashMap<&str, Arc<str>> = HashMap::new();
    for i in order {
        let (dst, before) = wanted[i];
        if at != Some(dst) {
            (at, taken) = (Some(dst), 0);
            smallest.clear();
        }
        let names = names_of
            .get(&dst)
            .map_or(&[][..], |n| &n[..before.min(n.len())]);
        for name in names.get(taken..).unwrap_or_default() {
            smallest.insert(name);
            if smallest.len() > MAX_NAMES_SHOWN {
                smallest.pop_last();
            }
        }
        taken = taken.max(names.len());
        out[i] = (
            smallest
                .iter()
                .map(|n| made.entry(n).or_insert_with(|| Arc::from(*n)).clone())
                .collect(),
            names.len().saturating_sub(MAX_NAMES_SHOWN),
        );
    }
    out
}

/// What `policy` would have refused of `trace`, what it cannot judge, and what it allows
/// that the trace never used.
pub fn replay(policy: &Policy, trace: &Trace) -> ReplayReport {
    let j = judge(policy, trace);
    let mut report = ReplayReport {
        mode: if policy.dns.guard.is_some() {
            "guard"
        } else {
            "resolve"
        }
        .into(),
        names: j.names.len(),
        flows: j.flows.len(),
        allowed_flows: 0,
        essential_flows: 0,
        untouched_flows: 0,
        refused_names: Vec::new(),
        refused_flows: Vec::new(),
        unjudged: Vec::new(),
        unused: Vec::new(),
        narrowable: Vec::new(),
        notes: Vec::new(),
        lost: trace.lost(),
        ended: trace.ended(),
    };

    report.refused_names = refused_names(&j);
    let mut flows: BTreeMap<FlowKey, FlowGroup> = BTreeMap::new();
    let mut unjudged: BTreeMap<CannotJudge, Unjudged> = BTreeMap::new();
    for f in &j.flows {
        match &f.verdict {
            FlowVerdict::Allowed(_) => report.allowed_flows += 1,
            FlowVerdict::Essential(_) => report.essential_flows += 1,
            FlowVerdict::Untouched => report.untouched_flows += 1,
            FlowVerdict::CannotJudge(why) => {
                let u = unjudged.entry(*why).or_insert_with(|| Unjudged {
                    why: *why,
                    count: 0,
                    first: String::new(),
                    last: String::new(),
                    example: describe_flow(f.protocol, f.dst, f.dport),
                });
                seen_at(&mut u.first, &mut u.last, &mut u.count, f.time);
            }
            FlowVerdict::Refused(why) => {
                let key = (f.dst, f.protocol, f.dport, why.clone());
                let g = flows.entry(key).or_insert_with(|| FlowGroup {
                    group: RefusedFlow {
                        dst: f.dst,
                        protocol: f.protocol.to_string(),
                        dport: f.dport,
                        why: why.clone(),
                        count: 0,
                        first: String::new(),
                        last: String::new(),
                        names: Vec::new(),
                        more_names: 0,
                        uids: Vec::new(),
                        interfaces: Vec::new(),
                    },
                    names_before: 0,
                    uids: BTreeSet::new(),
                    interfaces: BTreeSet::new(),
                });
                let r = &mut g.group;
                seen_at(&mut r.first, &mut r.last, &mut r.count, f.time);
                g.names_before = g.names_before.max(f.names_before);
                g.uids.extend(f.uid);
                g.interfaces.extend(f.iif);
            }
        }
    }
    let groups: Vec<FlowGroup> = flows.into_values().collect();
    let wanted: Vec<(IpAddr, usize)> = groups
        .iter()
        .map(|g| (g.group.dst, g.names_before))
        .collect();
    report.refused_flows = groups
        .into_iter()
        .zip(names_shown(&wanted, &j.names_of))
        .map(
            |(
                FlowGroup {
                    mut group,
                    uids,
                    interfaces,
                    ..
                },
                (names, more_names),
            )| {
                group.names = names;
                group.more_names = more_names;
                group.uids = uids.into_iter().collect();
                group.interfaces = interfaces.into_iter().map(str::to_string).collect();
                group
            },
        )
        .collect();
    report.unjudged = unjudged.into_values().collect();

    let presets = entry_presets(policy);
    for (i, entry) in policy.allow.iter().enumerate() {
        if !j.used[i] {
            report.unused.push(UnusedEntry {
                entry: entry.describe(),
                preset: presets[i].map(|p| p.name().to_string()),
            });
        }
        if let (Target::Wildcard(w), (Some(name), false)) = (&entry.target, &j.names_allowed[i]) {
            report.narrowable.push(NarrowableWildcard {
                wildcard: w.to_string(),
                name: name.to_string(),
            });
        }
    }
    if trace.lost() > 0 {
        report.notes.push(format!(
            "the run lost {} records (its writer's queue was full, or the trace reached its \
             size cap): what they held is not judged",
            trace.lost()
        ));
    }
    if !report.ended {
        report.notes.push(
            "the trace has no end line: its run did not stop cleanly, and what its writer \
             had not written yet is not judged"
                .into(),
        );
    }
    if let Some(scope) = &policy.scope
        && !scope.cgroups.is_empty()
    {
        report.notes.push(
            "the scope lists cgroups, which a trace does not record: flows of uids outside \
             the scope's users are not judged"
                .into(),
        );
    }
    report
}

#[cfg(test)]
pub(crate) mod tests;
