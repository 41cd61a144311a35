//! Policy + resolution -> ruleset. Pure: no network, no kernel.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;

use crate::core::guard_identity::GuardIdentity;
use crate::core::installable::HostAddrs;
use crate::core::lifetime::longer_timeout;
use crate::core::policy::{
    Action, Allow, DomainName, Essential, L4Proto, Policy, PortRange, Target,
};
use crate::core::resolution::{Resolution, ResolvedHost};
use crate::core::ruleset::{
    Arrival, AuditWindow, CgroupMatch, Elements, Family, Icmpv6Type, LogSpec, Rule, Ruleset,
    ScopeChains, ScopeMatch, Set, SetId, SetRole, SourceRoute, Timed, Tuple,
};

/// DNS destinations are the resolvers on port 53, over UDP and TCP.
pub const DNS_PORT: u16 = 53;
/// DNS over TLS (TCP) and over QUIC (UDP).
pub const DOT_PORT: u16 = 853;

/// In guard mode: DNS and DNS over TLS, which only the guard may send, and only to its
/// upstream resolvers.
pub const GUARDED_DNS_PORTS: [u16; 2] = [DNS_PORT, DOT_PORT];

/// The uid a guard-mode table names when none was given: no socket has it, so nothing
/// reaches the upstream resolvers (fail closed).
pub const NO_UID: u32 = u32::MAX;

/// Builds the table for `policy` with the addresses of `resolution`, resolved elements
/// without timeouts (nothing refreshes them).
///
/// Names that did not resolve contribute nothing (fail closed). Addresses that fall into a
/// denied network still go into the allow sets: the deny rule comes first, so they stay
/// refused, and [`denied_answers`] reports them.
pub fn plan(policy: &Policy, resolution: &Resolution) -> Ruleset {
    plan_with(policy, resolution, |_, _| None)
}

/// The protocols and ports `name` is allowed on: one per port of every entry that allows it.
pub fn services_of<'a>(
    policy: &'a Policy,
    name: &'a DomainName,
) -> impl Iterator<Item = (L4Proto, u16)> + 'a {
    policy
        .allow
        .iter()
        .filter(move |a| a.target.matches(name))
        .flat_map(entry_services)
}

/// The protocols and ports of one allow entry.
fn entry_services(a: &Allow) -> impl Iterator<Item = (L4Proto, u16)> + '_ {
    a.protocol.l4protos().iter().flat_map(move |&proto| {
        a.ports
            .iter()
            .flat_map(move |range| range.ports().map(move |port| (proto, port)))
    })
}

/// The allow entries that name domains, indexed for [`services_of`] over many names: exact
/// names by map, wildcards in a list walked for each name. Asking [`services_of`] for each of
/// N names walks every entry each time, N x N name comparisons: at 1,250 names and 10,000
/// addresses that was half of `apply`'s instructions (BENCHMARKS.md).
pub struct AllowIndex<'a> {
    /// Each entry with its place in the policy, so that services come in policy order.
    exact: HashMap<&'a DomainName, Vec<(usize, &'a Allow)>>,
    wildcards: Vec<(usize, &'a Allow)>,
}

impl<'a> AllowIndex<'a> {
    pub fn new(policy: &'a Policy) -> AllowIndex<'a> {
        let mut index = AllowIndex {
            exact: HashMap::new(),
            wildcards: Vec::new(),
        };
        for (i, a) in policy.allow.iter().enumerate() {
            match &a.target {
                Target::Domain(d) => index.exact.entry(d).or_default().push((i, a)),
                Target::Wildcard(_) => index.wildcards.push((i, a)),
                Target::Cidr(_) => {}
            }
        }
        index
    }

    /// What [`services_of`] gives for `name`, in the same order.
    pub fn services(&self, name: &DomainName) -> Vec<(L4Proto, u16)> {
        let mut entries: Vec<(usize, &Allow)> = self.exact.get(name).cloned().unwrap_or_default();
        let wildcards = self
            .wildcards
            .iter()
            .filter(|(_, a)| a.target.matches(name));
        entries.extend(wildcards);
        entries.sort_unstable_by_key(|&(i, _)| i);
        entries
            .into_iter()
            .flat_map(|(_, a)| entry_services(a))
            .collect()
    }
}

/// Whether the guard's upstream `addr` goes to the deny sets (see [`plan_elements`]): every
/// upstream a resolver can answer from, unless an allow entry names its address alone
/// (`cidr: 192.0.2.53/32`: the router that is also the NTP server, on the ports it gives; a
/// network that only holds the upstream does not count) and nothing else in the policy can
/// open it (see [`upstream_opened_otherwise`]). The unspecified address, the broadcast
/// address and groups (which `check` warns about) stay out: the last two would refuse DHCP's
/// requests.
pub fn upstream_denied(policy: &Policy, addr: IpAddr) -> bool {
    let unicast = match addr {
        IpAddr::V4(v4) => !(v4.is_unspecified() || v4.is_broadcast() || v4.is_multicast()),
        IpAddr::V6(v6) => !(v6.is_unspecified() || v6.is_multicast()),
    };
    let named_alone = policy
        .allow
        .iter()
        .any(|a| a.target == Target::Cidr(IpNet::from(addr)));
    unicast && (!named_alone || upstream_opened_otherwise(policy, addr))
}

/// Whether an allow entry other than one of the upstream `addr` alone could open it, were it
/// out of the deny sets: there it is an address like any other, and every entry that holds it
/// opens that entry's ports, not the ports of the entry that names it alone. A network that
/// holds it (or its NAT64 image), and a wildcard, under which the adversary writes the
/// answers (one naming the upstream's address is installed for the wildcard's ports: DNS
/// over HTTPS to the upstream, around the guard).
pub fn upstream_opened_otherwise(policy: &Policy, addr: IpAddr) -> bool {
    let alone = IpNet::from(addr);
    let image = match addr {
        IpAddr::V4(v4) => Some(IpAddr::V6(
            crate::core::installable::nat64_image(ipnet::Ipv4Net::from(v4)).addr(),
        )),
        IpAddr::V6(_) => None,
    };
    policy.allow.iter().any(|a| match &a.target {
        Target::Cidr(net) => {
            *net != alone && (net.contains(&addr) || image.is_some_and(|i| net.contains(&i)))
        }
        Target::Wildcard(_) => true,
        Target::Domain(_) => false,
    })
}

/// The resolved-set element of `addr` for one protocol and port.
pub fn resolved_tuple(addr: IpAddr, (proto, port): (L4Proto, u16)) -> Tuple {
    Tuple {
        net: IpNet::from(addr),
        proto,
        ports: PortRange::single(port),
    }
}

/// Like [`plan`], with each resolved address's element timeout given by `timeout_of`
/// (`None`: permanent).
pub fn plan_with(
    policy: &Policy,
    resolution: &Resolution,
    timeout_of: impl Fn(&DomainName, IpAddr) -> Option<Duration>,
) -> Ruleset {
    let resolved = resolved_elements(policy, resolution, timeout_of);
    let guard = GuardIdentity::of_policy(policy, resolution.guard_uid.unwrap_or(NO_UID))
        .map(|g| g.listening_also_on(&resolution.scope.bridge_listen));
    plan_elements(
        policy,
        &resolution.resolvers,
        guard.as_ref(),
        &resolution.scope.cgroups,
        resolved.into_values(),
    )
}

/// The resolved-set elements of `resolution`'s addresses, one per address and service, each
/// with its timeout (from `timeout_of`) and the (first) name it was answered for.
fn resolved_elements(
    policy: &Policy,
    resolution: &Resolution,
    timeout_of: impl Fn(&DomainName, IpAddr) -> Option<Duration>,
) -> BTreeMap<Tuple, Timed> {
    let mut exact: BTreeMap<Tuple, (Option<u64>, &DomainName)> = BTreeMap::new();
    let index = AllowIndex::new(policy);
    for host in &resolution.hosts {
        let services = index.services(&host.name);
        // Resolution already left these out; a recorded or hand-made resolution may not
        // have (the host's own addresses are the resolver's to check: they need the host).
        let installable = host
            .addrs
            .iter()
            .filter(|a| crate::core::installable::check(a.addr, &HostAddrs::none()).is_ok());
        for a in installable {
            let timeout = timeout_of(&host.name, a.addr).map(|d| d.as_millis() as u64);
            for tuple in services.iter().map(|&s| resolved_tuple(a.addr, s)) {
                // An address shared by names lives as long as the longest-lived of them.
                let entry = exact.entry(tuple).or_insert((timeout, &host.name));
                entry.0 = longer_timeout(entry.0, timeout);
            }
        }
    }
    exact
        .into_iter()
        .map(|(tuple, (timeout_ms, name))| {
            let timed = Timed {
                tuple,
                timeout_ms,
                expires_ms: None,
                name: Some(name.to_string()),
            };
            (tuple, timed)
        })
        .collect()
}

/// Builds the table for `policy` with DNS `resolvers` and the resolved elements `resolved`
/// as they are: one per element, sorted by element (as a map by [`Tuple`] gives them); the
/// daemon's ledger gives each its remaining lifetime and name. In guard mode `guard` is the
/// policy's guard (see [`GuardIdentity::of_policy`]): only its sockets ask `resolvers`.
/// With a `scope:`, `cgroups` are its listed cgroups that exist (see
/// [`crate::core::resolution::HostScope`]).
pub fn plan_elements(
    policy: &Policy,
    resolvers: &[IpAddr],
    guard: Option<&GuardIdentity>,
    cgroups: &[CgroupMatch],
    resolved: impl IntoIterator<Item = Timed>,
) -> Ruleset {
    let mut deny: Vec<IpNet> = Vec::new();
    for d in &policy.deny {
        deny.extend(d.networks.iter().copied());
    }
    // In guard mode only the guard's own sockets reach its upstream resolvers, on every port
    // and protocol: its questions are accepted before the deny list (as a resolver's in a
    // denied network are), and everything else to them is refused with it, also where an
    // allowed network holds their address. A resolver serves more than 53 and 853 (DNS over
    // HTTPS on 443, over HTTP/3 on UDP 443): any process would ask it any name around the
    // guard. Only an allow entry of the upstream's address alone opens its ports, which
    // `check` warns about, and only where nothing else could (see [`upstream_denied`]).
    if let Some(g) = guard {
        deny.extend(
            g.upstream
                .iter()
                .filter(|a| upstream_denied(policy, **a))
                .map(|&a| IpNet::from(a)),
        );
    }
    // A denied IPv4 network is also reachable as its NAT64 image (64:ff9b::/96, RFC 6052)
    // through a NAT64 gateway on the path: deny6 holds those images too.
    let images: Vec<IpNet> = deny
        .iter()
        .filter_map(|n| match n {
            IpNet::V4(v4) => Some(IpNet::V6(crate::core::installable::nat64_image(*v4))),
            IpNet::V6(_) => None,
        })
        .collect();
    deny.extend(images);

    let dns_ports: &[u16] = match guard {
        Some(_) => &GUARDED_DNS_PORTS,
        None => &[DNS_PORT],
    };
    let dns: Vec<Tuple> = resolvers
        .iter()
        .flat_map(|r| {
            [L4Proto::Tcp, L4Proto::Udp]
                .into_iter()
                .flat_map(move |proto| {
                    dns_ports.iter().map(move |&port| Tuple {
                        net: IpNet::from(*r),
                        proto,
                        ports: PortRange::single(port),
                    })
                })
        })
        .collect();

    // Networks go to the interval sets only a full apply rewrites; resolved addresses, one
    // element per port, to the hash sets a refresh updates element by element.
    let mut ranged: Vec<Tuple> = Vec::new();
    for allow in &policy.allow {
        if let Target::Cidr(net) = allow.target {
            for &proto in allow.protocol.l4protos() {
                ranged.extend(allow.ports.iter().map(|&ports| Tuple { net, proto, ports }));
            }
        }
    }
    // Sorted by element, as `resolved` is.
    let (mut resolved4, mut resolved6): (Vec<Timed>, Vec<Timed>) = resolved
        .into_iter()
        .partition(|t| Family::of_net(&t.tuple.net) == Family::V4);
    let mut sets = Vec::with_capacity(SetId::ALL.len());
    for id in SetId::ALL {
        let of_family = |t: &&Tuple| Family::of_net(&t.net) == id.family;
        let elements = match id.role {
            SetRole::Deny => Elements::Networks(merge_networks(
                deny.iter()
                    .filter(|n| Family::of_net(n) == id.family)
                    .copied(),
            )),
            SetRole::Dns => Elements::Tuples(dns.iter().filter(of_family).copied().collect()),
            SetRole::Allow => {
                Elements::Tuples(disjoint_tuples(ranged.iter().filter(of_family).copied()))
            }
            SetRole::Resolved => Elements::Timed(std::mem::take(match id.family {
                Family::V4 => &mut resolved4,
                Family::V6 => &mut resolved6,
            })),
        };
        sets.push(Set { id, elements });
    }

    // The guard's protections hold for every socket: the base chain on the output hook (the
    // fence itself without a scope) enters them through the gates.
    let (gates, guard_chain) = guard_gates(guard);
    let (output, scope) = match policy.scope {
        None => (output_rules(policy, guard, gates), None),
        Some(_) => (
            output_rules(policy, guard, squatted_resolvers(resolvers)),
            scope_chains(policy, guard, cgroups, gates),
        ),
    };
    Ruleset {
        sets,
        output,
        guard: guard_chain,
        scope,
        audit: None,
        refused: refused_chain(policy),
    }
}

/// The refused chain: log and count, then the verdict. Under `action: reject` the answer
/// goes only to sources of this host (or, forwarded, to a listed interface's checked
/// sources), and a TCP connection of this host gets a reset ([`Rule::ResetTcp`]).
fn refused_chain(policy: &Policy) -> Vec<Rule> {
    let mut rules = vec![
        Rule::Log(LogSpec {
            prefix: policy.log.prefix.clone(),
            group: policy.log.group,
            rate: policy.log.rate,
            burst: policy.log.burst,
        }),
        Rule::CountFamily(Family::V4),
        Rule::CountFamily(Family::V6),
    ];
    if policy.action.refusal() == Action::Reject {
        rules.extend(Arrival::ALL.map(Rule::DropForeignSource));
        rules.push(Rule::ResetTcp);
    }
    rules.push(Rule::Refuse(policy.action.refusal()));
    rules
}

/// What a run adds to its table while it records or audits (`run --record`, `learn`); the
/// default adds nothing, and the table is exactly the policy's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Extras {
    /// The NFLOG group of every new flow's first packet ([`Rule::RecordFlow`]).
    pub flow_group: Option<u16>,
    /// `learn`'s audit window ([`Rule::AuditAccept`]).
    pub audit: Option<Audit>,
    /// `exec`'s run: replies leaving anywhere but loopback are refused
    /// ([`Rule::RefuseRepliesOut`]).
    pub refuse_replies: bool,
}

/// How long `learn`'s audit window stays open without a renewal: what a killed `learn`
/// leaves open at most.
pub const AUDIT_WINDOW: Duration = Duration::from_secs(30);
/// How often the daemon renews the window while it audits (three renewals may fail or be
/// late before it closes).
pub const AUDIT_RENEW_EVERY: Duration = Duration::from_secs(10);
/// The NFLOG group of the flow record, unless the policy logs refusals there.
pub const FLOW_GROUP: u16 = 0x6566;
/// The NFLOG group of audited packets when the policy logs refusals to none.
pub const AUDIT_GROUP: u16 = 0x6567;

impl Extras {
    /// The extras of a run of `policy` that records (`run --record`, `learn`) and audits
    /// (`learn`): the flow record in a group of its own; audited packets in the policy's log
    /// group, beside its refusals, so that `watch` shows both.
    pub fn of_run(policy: &Policy, record: bool, audit: bool) -> Extras {
        let log_group = policy.log.group;
        let flow_group = match log_group {
            Some(FLOW_GROUP) => FLOW_GROUP + 2,
            _ => FLOW_GROUP,
        };
        Extras {
            flow_group: record.then_some(flow_group),
            audit: audit.then(|| Audit {
                group: log_group.unwrap_or(AUDIT_GROUP),
                open_for_ms: Some(AUDIT_WINDOW.as_millis() as u64),
            }),
            refuse_replies: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Audit {
    /// The NFLOG group of what the window lets through (the policy's log group, so that
    /// `watch` shows it beside what is refused).
    pub group: u16,
    /// How long the window stays open without a renewal; `None`: closed (the set empty).
    pub open_for_ms: Option<u64>,
}

/// `ruleset` with `extras`: the flow record before the deny list (after loopback, neighbour
/// discovery and the guard's own DNS, which say nothing of the host's traffic), the audit
/// accept just before the fence's last `goto refused` (the deny list, the guard's
/// protections and DNS to other resolvers stay refused), and the audit window's set.
pub fn with_extras(mut ruleset: Ruleset, extras: &Extras) -> Ruleset {
    if extras.refuse_replies {
        let at = ruleset
            .output
            .iter()
            .position(|r| *r == Rule::AcceptEstablished)
            .unwrap_or(ruleset.output.len());
        ruleset.output.insert(at, Rule::RefuseRepliesOut);
    }
    if let Some(group) = extras.flow_group {
        let at = ruleset
            .output
            .iter()
            .position(|r| matches!(r, Rule::RefuseDaddrIn(_)))
            .unwrap_or(ruleset.output.len());
        ruleset.output.insert(at, Rule::RecordFlow { group });
    }
    if let Some(audit) = extras.audit {
        let at = ruleset
            .output
            .iter()
            .rposition(|r| *r == Rule::GotoRefused)
            .unwrap_or(ruleset.output.len());
        ruleset
            .output
            .insert(at, Rule::AuditAccept { group: audit.group });
        ruleset.audit = Some(AuditWindow {
            open_for_ms: audit.open_for_ms,
        });
    }
    ruleset
}

/// Whether `rule` is one that only [`with_extras`] adds.
pub fn is_extra(rule: &Rule) -> bool {
    matches!(
        rule,
        Rule::RecordFlow { .. } | Rule::AuditAccept { .. } | Rule::RefuseRepliesOut
    )
}

/// `ruleset` without what [`with_extras`] added: the policy's table, as a generation records
/// it (a generation is checked against what its policy plans, and a rollback never brings
/// back an audit).
pub fn without_extras(mut ruleset: Ruleset) -> Ruleset {
    ruleset.output.retain(|r| !is_extra(r));
    ruleset.audit = None;
    ruleset
}

/// The guard's own protections: only its marked sockets of its uid answer from where it
/// listens, and only they ask its upstream resolvers.
fn guard_protections(guard: Option<&GuardIdentity>) -> Vec<Rule> {
    let mut rules = Vec::new();
    // The guard is recognised by its sockets' mark, which takes CAP_NET_ADMIN to set (or,
    // since Linux 5.17, CAP_NET_RAW, which root in a container keeps), and by its uid:
    // either alone is not enough.
    if let Some(g) = guard {
        let (mark, uid) = (g.mark, g.uid);
        // Only the guard answers from its listen address: a process that binds it while the
        // daemon is down (ports below 1024 are no barrier in a container) answers nobody.
        // Before the replies, since a squatter's answers belong to connections the clients
        // opened.
        for &from in &g.listen {
            for proto in [L4Proto::Udp, L4Proto::Tcp] {
                rules.push(Rule::RefuseUnmarkedFromGuardPort { from, proto, mark });
                rules.push(Rule::RefuseOtherUidsFromGuardPort { from, proto, uid });
            }
        }
        // Only the guard asks the upstream resolvers, also over the flows it has closed:
        // conntrack keeps them established for a while, and a process that binds the same
        // local port would be let through by the replies' accept below.
        for family in Family::BOTH {
            let set = SetId::new(SetRole::Dns, family);
            rules.push(Rule::RefuseUpstreamFromOtherUids { set, uid });
            rules.push(Rule::RefuseUpstreamUnmarked { set, uid, mark });
        }
    }
    rules
}

/// Neighbour discovery and MLD reports (within their byte budget).
fn neighbour_discovery() -> Vec<Rule> {
    let mut rules: Vec<Rule> = [
        Icmpv6Type::NdRouterSolicit,
        Icmpv6Type::NdNeighborSolicit,
        Icmpv6Type::NdNeighborAdvert,
    ]
    .map(Rule::AcceptIcmpv6)
    .into();
    // Any process chooses the groups the kernel reports: a byte budget bounds that channel
    // while the host's own reports (solicited-node groups, so switches that snoop MLD keep
    // forwarding neighbour discovery to it) still fit.
    rules.push(Rule::AcceptMldReport);
    rules
}

/// DNS to the resolvers: in guard mode from the guard's own sockets only.
fn dns_accepts(guard: Option<&GuardIdentity>) -> Vec<Rule> {
    Family::BOTH
        .map(|family| {
            let set = SetId::new(SetRole::Dns, family);
            match guard {
                Some(g) => Rule::AcceptTupleFromGuard {
                    set,
                    mark: Some(g.mark),
                    uid: g.uid,
                },
                None => Rule::AcceptTupleIn(set),
            }
        })
        .into()
}

/// With a scope: what a fenced socket sends from a resolver's address and port 53 (UDP and
/// TCP) is refused, before the replies. A resolver on loopback is a stub of the host's
/// (systemd-resolved, dnsmasq: unfenced), and it answers the service's lookups too; so is one
/// on another address of the host's (a dnsmasq or BIND on its LAN address), whose lookups go
/// over loopback all the same. In guard mode the resolvers are the guard's upstreams, asked by
/// the guard as the service asks resolve mode's, and squatted the same way (the guard's
/// protections refuse what goes to an upstream, not what comes from its address). A fenced
/// process that may bind port 53 (root in a container on the host's network) binds the same
/// address and port with SO_REUSEADDR, which UDP grants to any owner when the resolver set it
/// too (systemd-resolved and dnsmasq do), and as the later socket it gets the questions: its
/// answers would choose the addresses of the policy's names. Refused, the lookup fails closed
/// instead. Every resolver, not only loopback ones: which addresses are the host's changes
/// while the table stands, and a socket of this host sends from a resolver's address only
/// where the resolver is the host. As the guard's protections say it, "any uid but none":
/// every socket with an owner. Without a scope the resolver is fenced as well, and is not told
/// apart.
fn squatted_resolvers(resolvers: &[IpAddr]) -> Vec<Rule> {
    let mut resolvers = resolvers.to_vec();
    resolvers.sort_unstable();
    resolvers.dedup();
    resolvers
        .into_iter()
        .flat_map(|r| {
            [L4Proto::Udp, L4Proto::Tcp].map(|proto| Rule::RefuseOtherUidsFromGuardPort {
                from: std::net::SocketAddr::new(r, DNS_PORT),
                proto,
                uid: NO_UID,
            })
        })
        .collect()
}

/// In guard mode, DNS and DNS over TLS to anywhere but the guard.
fn guarded_dns_refusals() -> Vec<Rule> {
    [L4Proto::Udp, L4Proto::Tcp]
        .into_iter()
        .flat_map(|proto| GUARDED_DNS_PORTS.map(|port| Rule::RefuseService(proto, port)))
        .collect()
}

/// Questions to the guard where it listens, over UDP and TCP.
fn guard_queries(guard: &GuardIdentity) -> Vec<Rule> {
    guard
        .listen
        .iter()
        .flat_map(|&to| {
            [L4Proto::Udp, L4Proto::Tcp].map(|proto| Rule::AcceptGuardQuery { to, proto })
        })
        .collect()
}

/// The fence: the rules every fenced packet meets (the base chain on the output hook when the
/// whole namespace is fenced, and then `gates` to the guard's protections, from
/// [`guard_gates`]).
fn output_rules(policy: &Policy, guard: Option<&GuardIdentity>, gates: Vec<Rule>) -> Vec<Rule> {
    let has = |e| policy.essentials.contains(&e);
    let scoped = policy.scope.is_some();
    // A routing header or source route option sends the packet on past the destination every
    // rule below checks, and a socket option adds one (IPV6_RTHDR for any user, IP_OPTIONS
    // with CAP_NET_RAW), also to a connection already established: refused before anything
    // is accepted.
    let mut rules: Vec<Rule> = SourceRoute::ALL.map(Rule::RefuseSourceRoute).into();
    // ICMP a process writes (CAP_NET_RAW) is accepted by nothing below but the replies and
    // loopback, and an error quoting someone else's flow counts as a reply (`related`): it
    // would carry a kilobyte to that flow's peer (the guard's upstream resolver, or anyone
    // who connected in). The kernel's own ICMP has no owner and is not refused.
    rules.extend(Family::BOTH.map(Rule::RefuseIcmpFromProcesses));
    // The guard's protections, through their gates: before the replies, since a squatter's
    // answers and a stranger's packets over the guard's old upstream flows are established
    // too. With a scope the gates are in the scope's base chain, which every socket meets.
    rules.extend(gates);
    // A packet to this host from a source that is not its own gets this host's answer (an
    // ICMP error quoting it, a reset, a service's reply) sent to that source, as `related`
    // or `established`; and written as the reply of a flow this host opened (the guard's to
    // its upstream) it is taken for that peer's reply. Refused before anything accepts it:
    // the replies, loopback, or an allow entry holding this host's address. Only loopback
    // packets pay the route lookup.
    rules.push(Rule::RefuseForeignSourceToHost);
    // Replies next: the bulk of packets leaves here after one conntrack lookup.
    if has(Essential::Established) {
        rules.push(Rule::AcceptEstablished);
    }
    // With a scope, the host's other processes are not fenced, and a resolver among them
    // (systemd-resolved, dnsmasq) would ask anything for a fenced process over loopback: in
    // guard mode fenced DNS goes to the guard alone, before loopback is accepted.
    let scoped_guard = guard.filter(|_| scoped);
    if let Some(g) = scoped_guard {
        rules.extend(dns_accepts(guard));
        rules.extend(guard_queries(g));
        rules.extend(guarded_dns_refusals());
    }
    if has(Essential::Loopback) {
        rules.push(Rule::AcceptLoopback);
    }
    // A packet a process writes to anywhere else from a source not this host's: the allowed
    // destination (a resolver, a server) answers that source, an address no allow entry
    // holds. Before the first accept a process's new flow meets (the resolvers', DHCP's, the
    // allow entries'); after the replies and loopback, so only a new flow pays the lookup (a
    // flow from a foreign source never has its replies here, and stays new).
    rules.push(Rule::RefuseForeignSource);
    if has(Essential::Icmpv6Nd) {
        rules.extend(neighbour_discovery());
    }
    // DNS to the resolvers (port 53 only) comes before the deny list: a cloud host's
    // resolver usually lives in a network the deny presets cover (AWS 169.254.169.253 or the
    // VPC's .2, GCP 169.254.169.254, Azure 168.63.129.16), and the host must keep resolving.
    // In guard mode only the guard's own sockets may ask them: every other process asks the
    // guard, which answers only the policy's names.
    if scoped_guard.is_none() {
        rules.extend(dns_accepts(guard));
    }
    // Deny wins over every allow entry: a name that resolves into a denied network (DNS
    // rebinding onto the metadata service) stays refused.
    for family in Family::BOTH {
        rules.push(Rule::RefuseDaddrIn(SetId::new(SetRole::Deny, family)));
    }
    // DHCP clients send their broadcasts over packet sockets, which never meet this hook; what
    // does is a plain socket's request to the broadcast or DHCPv6 group address, which any
    // process that binds port 68 or 546 can send too: that, rate-limited, and after the deny
    // list. A unicast renewal to the lease's server needs the server in an allow entry.
    if has(Essential::Dhcpv4) {
        rules.push(Rule::AcceptDhcpClient(Family::V4));
    }
    if has(Essential::Dhcpv6) {
        rules.push(Rule::AcceptDhcpClient(Family::V6));
    }
    // ...and in guard mode DNS to anywhere else is refused even where an allow entry covers
    // it (a `cidr:` with every port, say).
    if guard.is_some() && scoped_guard.is_none() {
        rules.extend(guarded_dns_refusals());
    }
    for role in [SetRole::Allow, SetRole::Resolved] {
        for family in Family::BOTH {
            rules.push(Rule::AcceptTupleIn(SetId::new(role, family)));
        }
    }
    rules.push(Rule::GotoRefused);
    rules
}

/// In guard mode, the jumps of the base chain on the output hook to the guard's protections
/// ([`crate::core::ruleset::GUARD_CHAIN`]), and those protections (both empty without a
/// guard). They hold for every socket, so every packet of the host meets the jumps, before
/// the replies' accept: one `th sport` match per listen port and one set lookup per family,
/// where the protections themselves are four rules per listen address and four upstream
/// rules. Each jump takes in
/// all that its protections can match (see [`Rule::JumpGuardFromPort`]).
fn guard_gates(guard: Option<&GuardIdentity>) -> (Vec<Rule>, Vec<Rule>) {
    let Some(g) = guard else {
        return (Vec::new(), Vec::new());
    };
    let ports: BTreeSet<u16> = g.listen.iter().map(|a| a.port()).collect();
    let mut gates: Vec<Rule> = ports.into_iter().map(Rule::JumpGuardFromPort).collect();
    gates.extend(
        Family::BOTH.map(|family| Rule::JumpGuardToUpstream(SetId::new(SetRole::Dns, family))),
    );
    (gates, guard_protections(guard))
}

/// With a `scope:`, the chains that send its packets through the fence: its uids, gids and
/// (existing) cgroups on the output hook, after `gates` to the guard's protections, which hold
/// for every socket; what the listed interfaces forward; and what they send the host itself, which
/// only gets replies, neighbour discovery and the guard.
fn scope_chains(
    policy: &Policy,
    guard: Option<&GuardIdentity>,
    cgroups: &[CgroupMatch],
    gates: Vec<Rule>,
) -> Option<ScopeChains> {
    let scope = policy.scope.as_ref()?;
    let mut output = gates;
    if scope.fences_local() {
        output.extend(
            scope
                .uids()
                .into_iter()
                .map(|u| Rule::Fence(ScopeMatch::Uid(u))),
        );
        output.extend(
            scope
                .gids()
                .into_iter()
                .map(|g| Rule::Fence(ScopeMatch::Gid(g))),
        );
        output.extend(
            cgroups
                .iter()
                .filter(|c| scope.cgroups.iter().any(|listed| c.is_of(listed)))
                .map(|c| Rule::Fence(ScopeMatch::Cgroup(c.clone()))),
        );
        // The kernel reports the groups a process joins (of its choice: data) from sockets
        // without an owner, which no rule above matches: every report goes through the
        // fence, as without a scope (IGMP refused, MLD within its byte budget). The host's
        // own reports with them.
        output.push(Rule::FenceIgmp);
        output.extend(Icmpv6Type::MLD_REPORTS.map(Rule::FenceIcmpv6));
    }
    let mut from_bridge = Vec::new();
    if !scope.forward.is_empty() {
        let has = |e| policy.essentials.contains(&e);
        if has(Essential::Established) {
            from_bridge.push(Rule::AcceptEstablished);
        }
        if has(Essential::Icmpv6Nd) {
            from_bridge.extend(neighbour_discovery());
        }
        // Only where a bridge can reach: a packet from one to loopback is a martian.
        if let Some(g) = guard {
            from_bridge.extend(guard_queries(g).into_iter().filter(
                |r| matches!(r, Rule::AcceptGuardQuery { to, .. } if !to.ip().is_loopback()),
            ));
        }
        from_bridge.push(Rule::GotoRefused);
    }
    let each = |rule: fn(_) -> Rule| scope.forward.iter().cloned().map(rule).collect::<Vec<_>>();
    // Link-scoped ICMPv6 is never forwarded, and the fence accepts neighbour discovery by
    // type alone (a forwarded packet has no owner for `meta skuid >= 0` to refuse): a
    // container would write it with any payload to any address.
    let mut forward = Vec::new();
    if !scope.forward.is_empty() {
        forward.extend(Icmpv6Type::LINK_SCOPED.map(Rule::RefuseIcmpv6));
    }
    forward.extend(each(|i| Rule::Fence(ScopeMatch::Interface(i))));
    // A question to the guard's address that the guard's own (marked) socket would not get,
    // because it is not bound there, reaches whatever listens on the wildcard address (a
    // resolver that recurses it out unfenced): refused for everyone, before a bridge's
    // questions are accepted in `from_bridge`.
    let mut input: Vec<Rule> = guard
        .map(|g| {
            g.listen
                .iter()
                .flat_map(|&to| {
                    [L4Proto::Udp, L4Proto::Tcp].map(|proto| Rule::RefuseGuardQueryToOtherSockets {
                        to,
                        proto,
                        mark: g.mark,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    input.extend(each(Rule::FromBridge));
    Some(ScopeChains {
        output,
        forward,
        input,
        from_bridge,
        // A listed interface's packets from a source that does not route back through it
        // are dropped before anything answers that source: the fence's reject and the
        // guard's answers would quote a container's data to an outside address it spoofed.
        prerouting: if scope.forward.is_empty() {
            Vec::new()
        } else {
            // The packets a bridge passes up on a port, not as the bridge, first: no rule
            // naming the bridge would see them.
            std::iter::once(Rule::DropBridgeGroupFrames)
                .chain(each(Rule::DropSpoofedFrom))
                .collect()
        },
    })
}

/// The longest lifetime any resolved element may have; the ledger owns it.
pub use crate::core::lifetime::lifetime_cap;

/// How much longer than [`lifetime_cap`] an element's timeout may read back from the kernel
/// (which keeps it in jiffies) before it counts as too long.
const TIMEOUT_READBACK_SLACK: Duration = Duration::from_secs(1);

/// Whether `policy` allows the element `tuple` for the name `name` (an element's comment):
/// the name is allowed and the element's protocol and port are among its services. `Err`
/// says why not.
pub fn element_allowed(policy: &Policy, name: Option<&str>, tuple: &Tuple) -> Result<(), String> {
    let Some(name) = name else {
        return Err("it names no allowed name (no comment)".into());
    };
    let Ok(domain) = name.parse::<DomainName>() else {
        return Err(format!("its comment {name:?} is not a name"));
    };
    if !policy.allow.iter().any(|a| a.target.matches(&domain)) {
        return Err(format!("the policy does not allow {domain}"));
    }
    let service = (tuple.proto, tuple.ports.first);
    if tuple.ports.first != tuple.ports.last || !services_of(policy, &domain).any(|s| s == service)
    {
        return Err(format!(
            "{domain} is not allowed on {} {}",
            tuple.proto.name(),
            tuple.ports
        ));
    }
    Ok(())
}

/// Why a resolved-set element found in a live table is not one `policy` would have put
/// there, or `None` if it is. `service_owned`: the service (`run`) keeps the table, so every
/// resolved element has a timeout and the name it was answered for; a table `apply` made
/// holds permanent elements, with names from this version on.
pub fn unexplained_element(policy: &Policy, t: &Timed, service_owned: bool) -> Option<String> {
    if let Err(why) = crate::core::installable::check(t.tuple.net.addr(), &HostAddrs::none()) {
        return Some(format!("its address is a {why}, which is never allowed"));
    }
    let cap = lifetime_cap(&policy.dns);
    match t.timeout_ms {
        None if service_owned || policy.dns.guard.is_some() => {
            return Some("it has no timeout, so it never expires".into());
        }
        Some(ms) if Duration::from_millis(ms) > cap + TIMEOUT_READBACK_SLACK => {
            return Some(format!(
                "its timeout of {}s is longer than the policy allows ({}s: dns.refresh.max \
                 plus dns.grace)",
                ms / 1000,
                cap.as_secs()
            ));
        }
        _ => {}
    }
    match (&t.name, t.timeout_ms) {
        // A permanent element of an older `apply`: its service must at least be a name's.
        (None, None) => {
            let service = (t.tuple.proto, t.tuple.ports.first);
            let any = policy
                .domains()
                .into_iter()
                .any(|d| services_of(policy, d).any(|s| s == service));
            (!any).then(|| {
                format!(
                    "no allowed name is allowed on {} {}",
                    t.tuple.proto.name(),
                    t.tuple.ports
                )
            })
        }
        (name, _) => element_allowed(policy, name.as_deref(), &t.tuple).err(),
    }
}

/// Every element of the resolved sets of `table` that `policy` does not explain, with why
/// (see [`unexplained_element`]).
pub fn unexplained_elements(
    policy: &Policy,
    table: &crate::nft::live::LiveTable,
    service_owned: bool,
) -> Vec<(Timed, String)> {
    let mut out = Vec::new();
    for family in Family::BOTH {
        if let Some(Elements::Timed(elements)) =
            table.contents(SetId::new(SetRole::Resolved, family))
        {
            for t in elements {
                if let Some(why) = unexplained_element(policy, &t, service_owned) {
                    out.push((t, why));
                }
            }
        }
    }
    out
}

/// Warnings for answers that land in a denied network.
pub fn denied_answers(policy: &Policy, hosts: &[ResolvedHost]) -> Vec<String> {
    hosts
        .iter()
        .flat_map(|host| denied_addresses(policy, &host.name, host.addrs.iter().map(|a| a.addr)))
        .collect()
}

/// Warnings for the addresses `name` answered that land in a denied network (the guard's
/// answers, which are no [`ResolvedHost`]).
pub fn denied_addresses(
    policy: &Policy,
    name: &DomainName,
    addrs: impl IntoIterator<Item = IpAddr>,
) -> Vec<String> {
    let mut out = Vec::new();
    for addr in addrs {
        // A NAT64 answer reaches the IPv4 address inside it; deny6 holds its image.
        let reaches = match addr {
            IpAddr::V6(v6) => crate::core::installable::nat64_embedded(v6).map(IpAddr::V4),
            IpAddr::V4(_) => None,
        };
        let denied = policy
            .denied_by(addr)
            .or_else(|| reaches.and_then(|v4| policy.denied_by(v4)));
        if let Some(deny) = denied {
            out.push(format!(
                "{name} resolved to {addr}, inside the denied {}: it stays refused (deny wins)",
                deny.describe()
            ));
        }
    }
    out
}

/// Overlapping and adjacent networks merged, sorted: an interval set refuses overlaps.
fn merge_networks(nets: impl Iterator<Item = IpNet>) -> Vec<IpNet> {
    let nets: Vec<IpNet> = nets.collect();
    let mut merged = IpNet::aggregate(&nets);
    merged.sort();
    merged
}

/// Rewrites (network, protocol, port range) boxes into disjoint ones covering the same
/// space: a concatenated interval set refuses overlapping elements.
///
/// Per protocol, the port axis is cut at every range boundary; each elementary port interval
/// gets the merged networks of the entries covering it, and neighbouring intervals with the
/// same networks are joined again.
fn disjoint_tuples(tuples: impl Iterator<Item = Tuple>) -> Vec<Tuple> {
    let mut by_proto: BTreeMap<L4Proto, Vec<(IpNet, PortRange)>> = BTreeMap::new();
    for t in tuples {
        by_proto.entry(t.proto).or_default().push((t.net, t.ports));
    }
    let mut out = Vec::new();
    for (proto, entries) in by_proto {
        let cuts: BTreeSet<u32> = entries
            .iter()
            .flat_map(|(_, p)| [u32::from(p.first), u32::from(p.last) + 1])
            .collect();
        let cuts: Vec<u32> = cuts.into_iter().collect();
        // (port interval, merged networks), neighbours with equal networks joined.
        let mut runs: Vec<(PortRange, Vec<IpNet>)> = Vec::new();
        for w in cuts.windows(2) {
            // Both bounds come from u16 ports (+1), so `w[1] - 1` fits in u16.
            let (first, last) = (w[0] as u16, (w[1] - 1) as u16);
            let covering = entries
                .iter()
                .filter(|(_, p)| p.first <= first && p.last >= last)
                .map(|(n, _)| *n);
            let nets = merge_networks(covering);
            if nets.is_empty() {
                continue;
            }
            match runs.last_mut() {
                Some((ports, prev))
                    if *prev == nets && ports.last.checked_add(1) == Some(first) =>
                {
                    ports.last = last;
                }
                _ => runs.push((PortRange { first, last }, nets)),
            }
        }
        for (ports, nets) in runs {
            out.extend(nets.into_iter().map(|net| Tuple { net, proto, ports }));
        }
    }
    out
}

/// The table put up when a policy's own cannot be: nothing leaves but loopback and the
/// replies of connections already open, and refusals are counted and dropped. It depends on no
/// value of any policy and uses no log or limit expression (the parts a kernel is likeliest
/// to refuse or lack), so whatever was wrong with the policy, the host is closed, not open.
/// It has the usual sets, empty, so `status` and `probe` read it like any other table.
pub fn fail_closed() -> Ruleset {
    let sets = SetId::ALL
        .into_iter()
        .map(|id| Set {
            id,
            elements: match id.role {
                SetRole::Deny => Elements::Networks(Vec::new()),
                SetRole::Dns | SetRole::Allow => Elements::Tuples(Vec::new()),
                SetRole::Resolved => Elements::Timed(Vec::new()),
            },
        })
        .collect();
    Ruleset {
        sets,
        // Source routes first, as in every planned table: an established flow may add one.
        // Then ICMP that processes write, which the replies' accept would take as related.
        output: SourceRoute::ALL
            .map(Rule::RefuseSourceRoute)
            .into_iter()
            .chain(Family::BOTH.map(Rule::RefuseIcmpFromProcesses))
            .chain([
                Rule::RefuseForeignSourceToHost,
                Rule::AcceptEstablished,
                Rule::AcceptLoopback,
                Rule::GotoRefused,
            ])
            .collect(),
        refused: vec![
            Rule::CountFamily(Family::V4),
            Rule::CountFamily(Family::V6),
            Rule::Refuse(crate::core::policy::Action::Drop),
        ],
        guard: Vec::new(),
        scope: None,
        audit: None,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::net::IpAddr;
    use std::path::Path;

    use super::*;
    use crate::core::resolution::ResolvedAddr;

    /// The networks of `rs`'s deny set of `family`.
    fn deny_networks(rs: &Ruleset, family: Family) -> &[IpNet] {
        match &rs
            .set(SetId::new(SetRole::Deny, family))
            .expect("a deny set")
            .elements
        {
            Elements::Networks(networks) => networks,
            other => panic!("the deny set holds networks, not {other:?}"),
        }
    }

    fn policy(src: &str) -> Policy {
        Policy::parse(src, Path::new("t.yaml")).expect("valid policy")
    }

    /// Names and their addresses (TTL 60), resolved by 192.0.2.53 and 2001:db8::53; a name
    /// without addresses is NXDOMAIN. Shared by the tests of other modules.
    pub(crate) fn resolution(hosts: &[(&str, &[&str])]) -> Resolution {
        Resolution {
            resolvers: vec![
                "192.0.2.53".parse().unwrap(),
                "2001:db8::53".parse().unwrap(),
            ],
            hosts: hosts
                .iter()
                .map(|(name, addrs)| ResolvedHost {
                    name: name.parse().unwrap(),
                    addrs: addrs
                        .iter()
                        .map(|a| ResolvedAddr {
                            addr: a.parse().unwrap(),
                            ttl: 60,
                        })
                        .collect(),
                    nxdomain: addrs.is_empty(),
                    dropped: Vec::new(),
                    errors: vec![],
                })
                .collect(),
            guard_uid: None,
            scope: Default::default(),
        }
    }

    /// A scoped table refuses what the scope sends from its resolvers' address and port 53
    /// (loopback or not: an address of the host's may hold one too; in guard mode the guard's
    /// upstreams); an unscoped one has no such rule.
    #[test]
    fn a_scope_may_not_answer_as_a_resolver() {
        let squat = |from: &str, proto| Rule::RefuseOtherUidsFromGuardPort {
            from: from.parse().unwrap(),
            proto,
            uid: NO_UID,
        };
        let mut res = resolution(&[]);
        res.resolvers = vec![
            "127.0.0.53".parse().unwrap(),
            "192.0.2.53".parse().unwrap(),
            "::1".parse().unwrap(),
            "127.0.0.53".parse().unwrap(),
        ];
        let scoped = plan(&policy("version: 1\nscope:\n  users: [1001]\n"), &res);
        let found: Vec<&Rule> = scoped
            .output
            .iter()
            .filter(|r| matches!(r, Rule::RefuseOtherUidsFromGuardPort { .. }))
            .collect();
        assert_eq!(
            found,
            [
                &squat("127.0.0.53:53", L4Proto::Udp),
                &squat("127.0.0.53:53", L4Proto::Tcp),
                // Not loopback, but maybe the host's (its LAN address, a dnsmasq there).
                &squat("192.0.2.53:53", L4Proto::Udp),
                &squat("192.0.2.53:53", L4Proto::Tcp),
                &squat("[::1]:53", L4Proto::Udp),
                &squat("[::1]:53", L4Proto::Tcp),
            ]
        );
        let at = |r: &Rule| scoped.output.iter().position(|x| x == r);
        assert!(
            at(found[0]) < at(&Rule::AcceptEstablished),
            "before the replies"
        );
        let unscoped = plan(&policy("version: 1\n"), &res);
        assert!(
            !unscoped
                .output
                .iter()
                .any(|r| matches!(r, Rule::RefuseOtherUidsFromGuardPort { .. }))
        );
        // Guard mode: the guard asks its upstreams, one of them on the host's LAN address.
        let mut res = resolution(&[]);
        res.resolvers = vec!["198.51.100.2".parse().unwrap()];
        let guarded = plan(
            &policy(
                "version: 1\nscope:\n  users: [1001]\ndns:\n  mode: guard\n  upstream: \
                 [198.51.100.2]\n",
            ),
            &res,
        );
        for proto in [L4Proto::Udp, L4Proto::Tcp] {
            let squatted = guarded
                .output
                .iter()
                .position(|r| *r == squat("198.51.100.2:53", proto));
            assert!(squatted.is_some(), "{proto:?}: {:?}", guarded.output);
            assert!(squatted < at_of(&guarded.output, &Rule::AcceptEstablished));
        }
    }

    fn at_of(rules: &[Rule], rule: &Rule) -> Option<usize> {
        rules.iter().position(|r| r == rule)
    }

    fn tuple(net: &str, proto: L4Proto, first: u16, last: u16) -> Tuple {
        Tuple {
            net: net.parse().unwrap(),
            proto,
            ports: PortRange { first, last },
        }
    }

    fn tuples(rs: &Ruleset, role: SetRole, family: Family) -> Vec<Tuple> {
        match &rs.set(SetId::new(role, family)).unwrap().elements {
            Elements::Tuples(t) => t.clone(),
            Elements::Timed(t) => t.iter().map(|t| t.tuple).collect(),
            Elements::Networks(_) => panic!("not a tuple set"),
        }
    }

    #[test]
    fn the_allow_index_gives_each_name_the_services_of_every_entry_in_policy_order() {
        let p = policy(
            "version: 1\nallow:\n  - domain: a.pool.example\n    ports: [8443]\n  \
             - domain: \"*.pool.example\"\n    ports: [443, \"80-81\"]\n  \
             - cidr: 203.0.113.0/28\n    ports: [22]\n  \
             - domain: a.pool.example\n    ports: [53]\n    protocol: any\n  \
             - domain: b.other.example\n    ports: [25]\ndns:\n  mode: guard\n  \
             upstream: [192.0.2.53]\n",
        );
        let index = AllowIndex::new(&p);
        for name in [
            "a.pool.example",
            "c.pool.example",
            "b.other.example",
            "x.example",
            "pool.example",
        ] {
            let name: DomainName = name.parse().unwrap();
            let walked: Vec<_> = services_of(&p, &name).collect();
            assert_eq!(index.services(&name), walked, "{name}");
        }
        let a: DomainName = "a.pool.example".parse().unwrap();
        assert_eq!(
            index.services(&a).len(),
            1 + 3 + 2,
            "exact, wildcard, exact again (tcp+udp)"
        );
    }

    const POLICY: &str = r#"
version: 1
allow:
  - domain: api.example.com
    ports: [443, "8000-8001"]
  - domain: gone.example.com
    ports: [443]
  - cidr: 203.0.113.0/28
    ports: [22]
    protocol: any
deny:
  - preset: cloud-metadata
  - cidr: 10.0.0.0/8
  - cidr: 10.1.0.0/16
log:
  group: 100
"#;

    #[test]
    fn resolved_addresses_go_to_the_hash_set_port_by_port_and_networks_to_the_interval_set() {
        let rs = plan(
            &policy(POLICY),
            &resolution(&[
                ("api.example.com", &["192.0.2.10", "2001:db8:1::10"]),
                ("gone.example.com", &[]),
            ]),
        );
        assert_eq!(
            tuples(&rs, SetRole::Resolved, Family::V4),
            vec![
                tuple("192.0.2.10/32", L4Proto::Tcp, 443, 443),
                tuple("192.0.2.10/32", L4Proto::Tcp, 8000, 8000),
                tuple("192.0.2.10/32", L4Proto::Tcp, 8001, 8001),
            ]
        );
        assert_eq!(
            tuples(&rs, SetRole::Resolved, Family::V6)[0],
            tuple("2001:db8:1::10/128", L4Proto::Tcp, 443, 443)
        );
        assert_eq!(
            tuples(&rs, SetRole::Allow, Family::V4),
            vec![
                tuple("203.0.113.0/28", L4Proto::Tcp, 22, 22),
                tuple("203.0.113.0/28", L4Proto::Udp, 22, 22),
            ]
        );
        assert_eq!(tuples(&rs, SetRole::Dns, Family::V4).len(), 2);
        assert_eq!(tuples(&rs, SetRole::Dns, Family::V6).len(), 2);
    }

    /// An included preset's name is an allow entry like any other: an answer inside a denied
    /// network is reported and its address stays behind the deny rule.
    #[test]
    fn a_preset_name_answered_with_a_denied_address_stays_refused() {
        let p = policy(
            "version: 1\ninclude: [npm]\ndeny:\n  - cidr: 198.51.100.0/24\n  - preset: \
             cloud-metadata\n",
        );
        let r = resolution(&[("registry.npmjs.org", &["198.51.100.7", "169.254.169.254"])]);
        let warnings = denied_answers(&p, &r.hosts);
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings.iter().all(|w| w.contains("registry.npmjs.org")));
        let rs = plan(&p, &r);
        let deny = deny_networks(&rs, Family::V4);
        for addr in ["198.51.100.7", "169.254.169.254"] {
            let addr: IpAddr = addr.parse().unwrap();
            assert!(deny.iter().any(|n| n.contains(&addr)), "{addr} not denied");
        }
        let first_deny = rs
            .output
            .iter()
            .position(|r| matches!(r, Rule::RefuseDaddrIn(_)))
            .unwrap();
        let first_accept = rs
            .output
            .iter()
            .position(|r| matches!(r, Rule::AcceptTupleIn(s) if s.role == SetRole::Resolved))
            .unwrap();
        assert!(
            first_deny < first_accept,
            "deny is checked before the preset's entries"
        );
    }

    #[test]
    fn deny_networks_are_merged_per_family() {
        let rs = plan(&policy(POLICY), &resolution(&[]));
        let Elements::Networks(v4) = &rs
            .set(SetId::new(SetRole::Deny, Family::V4))
            .unwrap()
            .elements
        else {
            panic!()
        };
        let want: Vec<IpNet> = [
            "10.0.0.0/8",
            "100.100.100.200/32",
            "168.63.129.16/32",
            "169.254.0.0/16",
            "192.0.0.192/32",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        assert_eq!(v4, &want);
        let Elements::Networks(v6) = &rs
            .set(SetId::new(SetRole::Deny, Family::V6))
            .unwrap()
            .elements
        else {
            panic!()
        };
        // The IPv6 networks, and the NAT64 images (64:ff9b::/96) of the IPv4 ones.
        let want6: Vec<IpNet> = [
            "64:ff9b::a00:0/104",
            "64:ff9b::6464:64c8/128",
            "64:ff9b::a83f:8110/128",
            "64:ff9b::a9fe:0/112",
            "64:ff9b::c000:c0/128",
            "fd00:42::42/128",
            "fd00:ec2::/32",
            "fd20:ce::254/128",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        assert_eq!(v6, &want6);
    }

    #[test]
    fn the_fail_closed_table_refuses_source_routes_before_accepting_anything() {
        let rs = fail_closed();
        let routes = SourceRoute::ALL.len();
        assert_eq!(
            rs.output[..routes],
            SourceRoute::ALL.map(Rule::RefuseSourceRoute)
        );
        assert_eq!(
            rs.output[routes..],
            [
                Rule::RefuseIcmpFromProcesses(Family::V4),
                Rule::RefuseIcmpFromProcesses(Family::V6),
                Rule::RefuseForeignSourceToHost,
                Rule::AcceptEstablished,
                Rule::AcceptLoopback,
                Rule::GotoRefused
            ]
        );
    }

    #[test]
    fn rules_put_established_first_dns_before_deny_and_deny_before_every_allow() {
        let rs = plan(&policy(POLICY), &resolution(&[]));
        let routes = SourceRoute::ALL.len();
        assert_eq!(
            rs.output[..routes],
            SourceRoute::ALL.map(Rule::RefuseSourceRoute)
        );
        assert_eq!(
            rs.output[routes..routes + 4],
            [
                Rule::RefuseIcmpFromProcesses(Family::V4),
                Rule::RefuseIcmpFromProcesses(Family::V6),
                Rule::RefuseForeignSourceToHost,
                Rule::AcceptEstablished
            ],
            "ICMP that processes write and a packet to this host from a source not its own \
             are refused before the replies are accepted"
        );
        let first_accept_set = rs
            .output
            .iter()
            .position(|r| matches!(r, Rule::AcceptTupleIn(s) if s.role != SetRole::Dns))
            .unwrap();
        let last_dns = rs
            .output
            .iter()
            .rposition(|r| matches!(r, Rule::AcceptTupleIn(s) if s.role == SetRole::Dns))
            .unwrap();
        let first_deny = rs
            .output
            .iter()
            .position(|r| matches!(r, Rule::RefuseDaddrIn(_)))
            .unwrap();
        assert!(
            last_dns < first_deny,
            "resolvers stay reachable behind the deny presets"
        );
        let last_deny = rs
            .output
            .iter()
            .rposition(|r| matches!(r, Rule::RefuseDaddrIn(_)))
            .unwrap();
        assert!(last_deny < first_accept_set);
        assert_eq!(rs.output.last(), Some(&Rule::GotoRefused));
        assert!(matches!(
            rs.refused[0],
            Rule::Log(LogSpec {
                group: Some(100),
                ..
            })
        ));
    }

    #[test]
    fn reject_answers_only_this_hosts_sources_and_its_tcp_with_a_reset() {
        let counted = |rs: &Ruleset| rs.refused[..3].to_vec();
        let reject = plan(&policy(POLICY), &resolution(&[]));
        assert_eq!(
            reject.refused[3..],
            [
                Rule::DropForeignSource(Arrival::Sent),
                Rule::DropForeignSource(Arrival::Loopback),
                Rule::ResetTcp,
                Rule::Refuse(Action::Reject),
            ]
        );
        // `drop` answers nobody: nothing to restrict. Logging and counting stay first.
        let drop = plan(
            &policy(&POLICY.replace("version: 1\n", "version: 1\naction: drop\n")),
            &resolution(&[]),
        );
        assert_eq!(drop.refused[3..], [Rule::Refuse(Action::Drop)]);
        assert_eq!(counted(&drop), counted(&reject));
        assert_eq!(counted(&reject)[1..], Family::BOTH.map(Rule::CountFamily));
    }

    #[test]
    fn essentials_come_after_the_deny_list_except_neighbour_discovery() {
        let rs = plan(&policy(POLICY), &resolution(&[]));
        let at = |want: &Rule| rs.output.iter().position(|r| r == want).unwrap();
        let last_deny = at(&Rule::RefuseDaddrIn(SetId::new(SetRole::Deny, Family::V6)));
        for family in Family::BOTH {
            assert!(at(&Rule::AcceptDhcpClient(family)) > last_deny);
        }
        assert!(at(&Rule::AcceptMldReport) < last_deny);
        assert!(
            at(&Rule::RefuseIcmpFromProcesses(Family::V6))
                < at(&Rule::AcceptIcmpv6(Icmpv6Type::NdRouterSolicit)),
            "ICMPv6 that processes write never meets the neighbour discovery accepts"
        );
        assert!(
            !rs.output
                .contains(&Rule::AcceptIcmpv6(Icmpv6Type::Mld2ListenerReport)),
            "MLD reports only within their byte budget"
        );
        // Even without any essential, source routes are refused first.
        let bare = plan(&policy("version: 1\nessentials: []\n"), &resolution(&[]));
        assert_eq!(
            bare.output[..SourceRoute::ALL.len()],
            SourceRoute::ALL.map(Rule::RefuseSourceRoute)
        );
        // And so is a packet to this host from a source not its own: an allow entry may
        // hold this host's address, whose answer would go to that source.
        assert!(bare.output.contains(&Rule::RefuseForeignSourceToHost));
    }

    #[test]
    fn narrowed_essentials_leave_out_their_rules() {
        let rs = plan(
            &policy("version: 1\nessentials: [established]\n"),
            &resolution(&[]),
        );
        assert!(!rs.output.contains(&Rule::AcceptLoopback));
        assert!(!rs.output.iter().any(|r| matches!(
            r,
            Rule::AcceptIcmpv6(_) | Rule::AcceptMldReport | Rule::AcceptDhcpClient(_)
        )));
    }

    #[test]
    fn planning_is_deterministic() {
        let p = policy(POLICY);
        let r = resolution(&[("api.example.com", &["192.0.2.11", "192.0.2.10"])]);
        assert_eq!(plan(&p, &r), plan(&p, &r));
        assert_eq!(plan(&p, &r).to_nft(), plan(&p, &r).to_nft());
    }

    #[test]
    fn timeouts_follow_the_longest_lived_name_of_a_shared_address() {
        let p = policy(
            "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\n  - domain: b.example\n    ports: [443]\n",
        );
        let r = resolution(&[("a.example", &["192.0.2.7"]), ("b.example", &["192.0.2.7"])]);
        let rs = plan_with(&p, &r, |name, _| {
            Some(Duration::from_secs(if name.as_str() == "a.example" {
                10
            } else {
                20
            }))
        });
        let Elements::Timed(t) = &rs
            .set(SetId::new(SetRole::Resolved, Family::V4))
            .unwrap()
            .elements
        else {
            panic!("resolved sets hold timed elements")
        };
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].timeout_ms, Some(20_000));
        let plain = plan(&p, &r);
        let Elements::Timed(t) = &plain
            .set(SetId::new(SetRole::Resolved, Family::V4))
            .unwrap()
            .elements
        else {
            panic!()
        };
        assert_eq!(t[0].timeout_ms, None, "plain plans are permanent");
    }

    #[test]
    fn answers_in_denied_networks_are_reported() {
        let p = policy(POLICY);
        let r = resolution(&[("api.example.com", &["169.254.169.254", "192.0.2.10"])]);
        let w = denied_answers(&p, &r.hosts);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("169.254.169.254") && w[0].contains("cloud-metadata"));
    }

    #[test]
    fn nat64_answers_for_denied_ipv4_addresses_are_reported_and_denied() {
        let p = policy(POLICY);
        let r = resolution(&[(
            "api.example.com",
            &["64:ff9b::a9fe:a9fe", "64:ff9b::a00:5", "64:ff9b::c000:20a"],
        )]);
        let w = denied_answers(&p, &r.hosts);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("64:ff9b::a9fe:a9fe") && w[0].contains("cloud-metadata"));
        assert!(w[1].contains("64:ff9b::a00:5") && w[1].contains("deny wins"));
        let rs = plan(&p, &r);
        let deny6 = deny_networks(&rs, Family::V6);
        for answer in ["64:ff9b::a9fe:a9fe", "64:ff9b::a00:5"] {
            let addr: IpAddr = answer.parse().unwrap();
            assert!(deny6.iter().any(|n| n.contains(&addr)), "{answer}");
        }
        let plain: IpAddr = "64:ff9b::c000:20a".parse().unwrap();
        assert!(!deny6.iter().any(|n| n.contains(&plain)));
    }

    #[test]
    fn overlapping_boxes_become_disjoint_and_cover_the_same_space() {
        let input = vec![
            tuple("10.0.0.0/8", L4Proto::Tcp, 443, 443),
            tuple("10.1.0.0/16", L4Proto::Tcp, 400, 500),
            tuple("10.1.0.0/16", L4Proto::Tcp, 501, 600),
            tuple("192.0.2.0/25", L4Proto::Tcp, 80, 80),
            tuple("192.0.2.128/25", L4Proto::Tcp, 80, 80),
            tuple("192.0.2.7/32", L4Proto::Udp, 1, 65535),
        ];
        let out = disjoint_tuples(input.clone().into_iter());
        assert_eq!(
            out,
            vec![
                tuple("192.0.2.0/24", L4Proto::Tcp, 80, 80),
                tuple("10.1.0.0/16", L4Proto::Tcp, 400, 442),
                tuple("10.0.0.0/8", L4Proto::Tcp, 443, 443),
                tuple("10.1.0.0/16", L4Proto::Tcp, 444, 600),
                tuple("192.0.2.7/32", L4Proto::Udp, 1, 65535),
            ]
        );
        // No two outputs overlap, and every probe point is covered by input iff by output.
        for (i, a) in out.iter().enumerate() {
            for b in &out[i + 1..] {
                let ports_meet = a.ports.first <= b.ports.last && b.ports.first <= a.ports.last;
                let nets_meet = a.net.contains(&b.net) || b.net.contains(&a.net);
                assert!(
                    a.proto != b.proto || !ports_meet || !nets_meet,
                    "{a:?} {b:?}"
                );
            }
        }
        let covered = |set: &[Tuple], addr: IpAddr, proto, port| {
            set.iter().any(|t| {
                t.proto == proto
                    && t.net.contains(&addr)
                    && t.ports.first <= port
                    && port <= t.ports.last
            })
        };
        for addr in [
            "10.0.0.1",
            "10.1.2.3",
            "192.0.2.5",
            "192.0.2.200",
            "192.0.2.7",
            "11.0.0.1",
        ] {
            let addr: IpAddr = addr.parse().unwrap();
            for port in [
                1, 79, 80, 81, 399, 400, 442, 443, 444, 500, 501, 600, 601, 65535,
            ] {
                for proto in [L4Proto::Tcp, L4Proto::Udp] {
                    assert_eq!(
                        covered(&input, addr, proto, port),
                        covered(&out, addr, proto, port),
                        "{addr} {proto:?} {port}"
                    );
                }
            }
        }
    }

    /// `learn`'s flow record starts after what says nothing of the agent (replies, loopback,
    /// the guard's own questions upstream: recorded, replay would call them refused DNS to
    /// the upstream), and its audit accept comes after every refusal no entry can lift (the
    /// deny list, DNS past the guard, the guard's protections).
    #[test]
    fn the_flow_record_skips_the_guards_own_dns_and_the_audit_comes_after_every_refusal() {
        let p = policy(
            "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\ndeny:\n  - preset: \
             cloud-metadata\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\nlog:\n  group: 7\n",
        );
        let mut res = resolution(&[]);
        res.resolvers = vec!["192.0.2.53".parse().unwrap()];
        res.guard_uid = Some(993);
        let rs = with_extras(plan(&p, &res), &Extras::of_run(&p, true, true));
        let at = |want: &dyn Fn(&Rule) -> bool| {
            let found: Vec<usize> = (0..rs.output.len())
                .filter(|&i| want(&rs.output[i]))
                .collect();
            assert!(!found.is_empty(), "{:?}", rs.output);
            found
        };
        let record = at(&|r| matches!(r, Rule::RecordFlow { .. }));
        let audit = at(&|r| matches!(r, Rule::AuditAccept { group: 7 }));
        assert_eq!((record.len(), audit.len()), (1, 1));
        let quiet = at(&|r| {
            matches!(
                r,
                Rule::AcceptEstablished
                    | Rule::AcceptLoopback
                    | Rule::AcceptTupleFromGuard { .. }
                    | Rule::JumpGuardFromPort(_)
                    | Rule::JumpGuardToUpstream(_)
            )
        });
        assert!(quiet.iter().all(|&q| q < record[0]), "{:?}", rs.output);
        let refusals = at(&|r| {
            matches!(
                r,
                Rule::RefuseDaddrIn(_)
                    | Rule::RefuseService(..)
                    | Rule::RefuseSourceRoute(_)
                    | Rule::RefuseIcmpFromProcesses(_)
                    | Rule::JumpGuardFromPort(_)
                    | Rule::JumpGuardToUpstream(_)
            )
        });
        assert!(refusals.iter().all(|&r| r < audit[0]), "{:?}", rs.output);
        // The guard's protections themselves are in their chain, which the audit never lifts.
        assert!(!rs.guard.is_empty());
        assert!(!rs.guard.iter().any(is_extra), "{:?}", rs.guard);
        assert_eq!(rs.output.get(audit[0] + 1), Some(&Rule::GotoRefused));
    }

    #[test]
    fn guard_mode_lets_only_the_guard_ask_upstream_and_refuses_other_dns() {
        let p = policy(
            "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [443]\n  - cidr: 0.0.0.0/0\n    ports: [53, 443]\n    protocol: any\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n",
        );
        let mut res = resolution(&[]);
        res.resolvers = vec!["192.0.2.53".parse().unwrap()];
        res.guard_uid = Some(993);
        let rs = plan(&p, &res);
        let dns4 = tuples(&rs, SetRole::Dns, Family::V4);
        assert_eq!(dns4.len(), 4, "tcp and udp, 53 and 853: {dns4:?}");
        assert!(dns4.contains(&tuple("192.0.2.53/32", L4Proto::Tcp, 853, 853)));
        let at = |want: &Rule| rs.output.iter().position(|r| r == want);
        let guard = at(&Rule::AcceptTupleFromGuard {
            set: SetId::new(SetRole::Dns, Family::V4),
            mark: Some(crate::core::policy::DEFAULT_GUARD_MARK),
            uid: 993,
        })
        .expect("the guard's rule");
        assert!(
            !rs.output
                .iter()
                .any(|r| matches!(r, Rule::AcceptTupleIn(s) if s.role == SetRole::Dns)),
            "nobody else may ask the resolvers"
        );
        let deny = at(&Rule::RefuseDaddrIn(SetId::new(SetRole::Deny, Family::V4))).unwrap();
        let refuse_dns = at(&Rule::RefuseService(L4Proto::Udp, 53)).expect("DNS refused");
        let refuse_dot = at(&Rule::RefuseService(L4Proto::Tcp, 853)).expect("DoT refused");
        let allow = at(&Rule::AcceptTupleIn(SetId::new(SetRole::Allow, Family::V4))).unwrap();
        assert!(guard < deny && deny < refuse_dns && refuse_dns.max(refuse_dot) < allow);
        // Only the guard's marked sockets answer from its listen address, before any reply
        // is accepted: in the guard's chain, entered before the replies' accept.
        let established = at(&Rule::AcceptEstablished).expect("replies");
        let gate = at(&Rule::JumpGuardFromPort(53)).expect("the jump of the guard's port");
        assert!(gate < established);
        for proto in [L4Proto::Udp, L4Proto::Tcp] {
            assert!(rs.guard.contains(&Rule::RefuseUnmarkedFromGuardPort {
                from: "127.0.0.53:53".parse().unwrap(),
                proto,
                mark: crate::core::policy::DEFAULT_GUARD_MARK,
            }));
            assert!(rs.guard.contains(&Rule::RefuseOtherUidsFromGuardPort {
                from: "127.0.0.53:53".parse().unwrap(),
                proto,
                uid: 993,
            }));
        }
        // Nobody else reaches the upstream resolvers through the guard's old flows either.
        for family in Family::BOTH {
            let set = SetId::new(SetRole::Dns, family);
            let gate = at(&Rule::JumpGuardToUpstream(set)).expect("the jump of the upstreams");
            assert!(gate < established);
            assert!(
                rs.guard
                    .contains(&Rule::RefuseUpstreamFromOtherUids { set, uid: 993 })
            );
            assert!(rs.guard.contains(&Rule::RefuseUpstreamUnmarked {
                set,
                uid: 993,
                mark: crate::core::policy::DEFAULT_GUARD_MARK,
            }));
        }
        assert_eq!(rs.guard.len(), 8, "{:?}", rs.guard);
        // DNS over HTTPS to public resolvers goes to the deny set, where no allow reaches.
        let deny4 = deny_networks(&rs, Family::V4);
        assert!(
            deny4
                .iter()
                .any(|n| n.contains(&"8.8.8.8".parse::<IpAddr>().unwrap()))
        );
        // And so does the upstream itself, with its NAT64 image: its DNS from the guard is
        // accepted above, and nothing else reaches it on any port, though the cidr entry
        // allows 443 there (DNS over HTTPS would ask it any name).
        assert!(
            deny4.contains(&"192.0.2.53/32".parse().unwrap()),
            "{deny4:?}"
        );
        let deny6 = deny_networks(&rs, Family::V6);
        assert!(
            deny6.contains(&"64:ff9b::c000:235/128".parse().unwrap()),
            "{deny6:?}"
        );
        // An allow entry of the upstream's address alone says it is meant (the router that is
        // also the NTP server): then only the entry's ports, and no deny.
        let alone = policy(
            "version: 1\nallow:\n  - cidr: 192.0.2.53/32\n    ports: [123]\n    protocol: udp\n\
             dns:\n  mode: guard\n  upstream: [192.0.2.53, 192.0.2.54]\n",
        );
        let rs_alone = plan(&alone, &res);
        let deny4 = deny_networks(&rs_alone, Family::V4);
        assert!(
            !deny4
                .iter()
                .any(|n| n.contains(&"192.0.2.53".parse::<IpAddr>().unwrap())),
            "{deny4:?}"
        );
        assert!(
            deny4.contains(&"192.0.2.54/32".parse().unwrap()),
            "{deny4:?}"
        );
        // Beside a wildcard, whose zone may answer the upstream's address (installed for the
        // wildcard's ports), or a network that holds it or its NAT64 image, the entry alone
        // does not take it out: those would open their own ports to it.
        for other in [
            "  - domain: \"*.pool.example\"\n    ports: [443]\n",
            "  - cidr: 192.0.2.0/24\n    ports: [443]\n",
            "  - cidr: 64:ff9b::/96\n    ports: [443]\n",
        ] {
            let both = policy(&format!(
                "version: 1\nallow:\n{other}  - cidr: 192.0.2.53/32\n    ports: [123]\n    \
                 protocol: udp\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n"
            ));
            let rs_both = plan(&both, &res);
            let deny4 = deny_networks(&rs_both, Family::V4);
            assert!(
                deny4.contains(&"192.0.2.53/32".parse().unwrap()),
                "{other}: {deny4:?}"
            );
        }

        // Without the guard's uid the table lets no socket reach upstream.
        res.guard_uid = None;
        let rs = plan(&p, &res);
        assert!(rs.output.contains(&Rule::AcceptTupleFromGuard {
            set: SetId::new(SetRole::Dns, Family::V6),
            mark: Some(crate::core::policy::DEFAULT_GUARD_MARK),
            uid: u32::MAX,
        }));
    }

    #[test]
    fn planned_elements_carry_their_name_and_never_an_uninstallable_address() {
        let p = policy("version: 1\nallow:\n  - domain: a.example\n    ports: [443]\n");
        let r = resolution(&[(
            "a.example",
            &[
                "192.0.2.1",
                "255.255.255.255",
                "127.0.0.1",
                "ff02::1",
                "0.0.0.0",
            ],
        )]);
        let rs = plan(&p, &r);
        let all: Vec<Timed> = Family::BOTH
            .into_iter()
            .flat_map(
                |f| match &rs.set(SetId::new(SetRole::Resolved, f)).unwrap().elements {
                    Elements::Timed(t) => t.clone(),
                    other => panic!("{other:?}"),
                },
            )
            .collect();
        assert_eq!(all.len(), 1, "{all:?}");
        assert_eq!(all[0].tuple.net, "192.0.2.1/32".parse::<IpNet>().unwrap());
        assert_eq!(all[0].name.as_deref(), Some("a.example"));
    }

    #[test]
    fn elements_the_policy_does_not_explain_are_named_with_why() {
        let p = policy(
            "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [443]\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  refresh: { max: 1h }\n  grace: 10m\n",
        );
        let tuple = |ip: &str, port| resolved_tuple(ip.parse().unwrap(), (L4Proto::Tcp, port));
        let element = |name: Option<&str>, port, timeout_s: Option<u64>| Timed {
            tuple: tuple("192.0.2.1", port),
            timeout_ms: timeout_s.map(|s| s * 1000),
            expires_ms: None,
            name: name.map(String::from),
        };
        let why = |t: &Timed| unexplained_element(&p, t, true);
        assert_eq!(why(&element(Some("a.pool.example"), 443, Some(4200))), None);
        assert_eq!(
            why(&element(Some("a.pool.example"), 443, Some(4201))),
            None,
            "readback slack"
        );
        let long = why(&element(Some("a.pool.example"), 443, Some(86_400_000))).unwrap();
        assert!(
            long.contains("longer than the policy allows (4200s"),
            "{long}"
        );
        let none = why(&element(Some("a.pool.example"), 443, None)).unwrap();
        assert!(none.contains("no timeout"), "{none}");
        let unnamed = why(&element(None, 443, Some(60))).unwrap();
        assert!(unnamed.contains("no comment"), "{unnamed}");
        let other = why(&element(Some("a.other.example"), 443, Some(60))).unwrap();
        assert!(other.contains("does not allow a.other.example"), "{other}");
        let port = why(&element(Some("a.pool.example"), 80, Some(60))).unwrap();
        assert!(port.contains("not allowed on tcp 80"), "{port}");
        let mut broadcast = element(Some("a.pool.example"), 443, Some(60));
        broadcast.tuple = tuple("255.255.255.255", 443);
        assert!(why(&broadcast).unwrap().contains("broadcast"));

        // A table `apply` made in resolve mode: permanent elements are its way.
        let r = policy("version: 1\nallow:\n  - domain: a.example\n    ports: [443]\n");
        let permanent = |name: Option<&str>, port| Timed {
            timeout_ms: None,
            ..element(name, port, None)
        };
        assert_eq!(
            unexplained_element(&r, &permanent(Some("a.example"), 443), false),
            None
        );
        assert_eq!(unexplained_element(&r, &permanent(None, 443), false), None);
        assert!(unexplained_element(&r, &permanent(None, 22), false).is_some());
        assert!(unexplained_element(&r, &permanent(Some("a.example"), 443), true).is_some());
    }

    const SCOPED: &str = "version: 1\nscope:\n  users: [1001, 1002]\n  cgroups: [agent.slice, \
                          gone.slice]\n  forward: [docker0, \"br-*\"]\ndns:\n  mode: guard\n  \
                          upstream: [192.0.2.53]\n";

    fn scoped_plan(cgroups: &[CgroupMatch], bridges: &[&str]) -> Ruleset {
        let mut r = resolution(&[]);
        r.guard_uid = Some(993);
        r.scope.cgroups = cgroups.to_vec();
        r.scope.bridge_listen = bridges.iter().map(|b| b.parse().unwrap()).collect();
        plan(&policy(SCOPED), &r)
    }

    #[test]
    fn without_a_scope_the_table_has_its_two_chains_only() {
        let rs = plan(&policy(POLICY), &resolution(&[]));
        assert_eq!(rs.scope, None);
        let names: Vec<&str> = rs.chains().iter().map(|c| c.name).collect();
        assert_eq!(names, ["output", "refused"]);
        assert!(rs.chains()[0].base.is_some());
    }

    #[test]
    fn a_scope_sends_its_uids_existing_cgroups_and_bridges_through_the_fence() {
        let agent = CgroupMatch {
            path: "agent.slice".parse().unwrap(),
            level: 1,
            id: 4242,
        };
        let rs = scoped_plan(std::slice::from_ref(&agent), &["198.18.0.1:53"]);
        let scope = rs.scope.as_ref().expect("scope chains");
        // The guard's protections hold for every socket, before anyone is sent to the fence,
        // and only there: in a chain of their own, which the packets from the guard's port
        // (one jump for both listen addresses) and to its upstream resolvers enter.
        let protections = guard_protections(
            GuardIdentity::of_policy(&policy(SCOPED), 993)
                .map(|g| g.listening_also_on(&["198.18.0.1:53".parse().unwrap()]))
                .as_ref(),
        );
        assert_eq!(protections.len(), 12);
        assert_eq!(rs.guard, protections);
        assert!(protections.iter().all(|p| !rs.output.contains(p)));
        let gates = [
            Rule::JumpGuardFromPort(53),
            Rule::JumpGuardToUpstream(SetId::new(SetRole::Dns, Family::V4)),
            Rule::JumpGuardToUpstream(SetId::new(SetRole::Dns, Family::V6)),
        ];
        assert_eq!(scope.output[..gates.len()], gates);
        assert_eq!(
            scope.output[gates.len()..gates.len() + 3],
            [
                Rule::Fence(ScopeMatch::Uid(1001)),
                Rule::Fence(ScopeMatch::Uid(1002)),
                Rule::Fence(ScopeMatch::Cgroup(agent.clone())),
            ]
        );
        // On a hybrid host the path is the one nft finds below /sys/fs/cgroup.
        let hybrid = CgroupMatch {
            path: "unified/agent.slice".parse().unwrap(),
            ..agent.clone()
        };
        assert!(hybrid.is_of(&"agent.slice".parse().unwrap()));
        assert!(!hybrid.is_of(&"unified".parse().unwrap()));
        assert!(!hybrid.is_of(&"gent.slice".parse().unwrap()));
        // A listed cgroup that does not exist has no rule: nobody is in it.
        assert!(!rs.to_nft().contains("gone.slice"));
        let docker0: crate::core::policy::IfacePattern = "docker0".parse().unwrap();
        assert!(
            scope
                .forward
                .contains(&Rule::Fence(ScopeMatch::Interface(docker0.clone())))
        );
        assert!(scope.input.contains(&Rule::FromBridge(docker0)));
        // The bridge reaches the host only for replies, neighbour discovery and the guard
        // where it listens on the bridge.
        assert_eq!(scope.from_bridge.first(), Some(&Rule::AcceptEstablished));
        assert_eq!(scope.from_bridge.last(), Some(&Rule::GotoRefused));
        let queries: Vec<&Rule> = scope
            .from_bridge
            .iter()
            .filter(|r| matches!(r, Rule::AcceptGuardQuery { .. }))
            .collect();
        assert_eq!(queries.len(), 2, "{queries:?}");
        let chains: Vec<(&str, bool)> = rs
            .chains()
            .iter()
            .map(|c| (c.name, c.base.is_some()))
            .collect();
        assert_eq!(
            chains,
            [
                ("output", false),
                ("refused", false),
                ("guard", false),
                ("from_bridge", false),
                ("scope_output", true),
                ("scope_forward", true),
                ("scope_input", true),
                ("scope_prerouting", true),
            ]
        );
    }

    #[test]
    fn the_forward_path_refuses_link_scoped_icmpv6_before_the_fence() {
        let rs = scoped_plan(&[], &[]);
        let scope = rs.scope.as_ref().expect("scope chains");
        let refused: Vec<Icmpv6Type> = scope
            .forward
            .iter()
            .map_while(|r| match r {
                Rule::RefuseIcmpv6(t) => Some(*t),
                _ => None,
            })
            .collect();
        assert_eq!(refused, Icmpv6Type::LINK_SCOPED);
        // Everything the fence accepts by ICMPv6 type alone is among them.
        for rule in &rs.output {
            if let Rule::AcceptIcmpv6(t) = rule {
                assert!(refused.contains(t), "{rule}");
            }
        }
        assert!(refused.contains(&Icmpv6Type::Mld2ListenerReport));
        assert!(matches!(
            &scope.forward[refused.len()..],
            [
                Rule::Fence(ScopeMatch::Interface(_)),
                Rule::Fence(ScopeMatch::Interface(_))
            ]
        ));
        // Without listed interfaces the scope forwards nothing to the fence: no chain.
        let mut p = policy(SCOPED);
        if let Some(scope) = p.scope.as_mut() {
            scope.forward.clear();
        }
        assert!(plan(&p, &resolution(&[])).chain("scope_forward").is_none());
    }

    #[test]
    fn every_multicast_report_goes_through_the_fence_of_a_scope_with_local_sockets() {
        let rs = scoped_plan(&[], &[]);
        let scope = rs.scope.as_ref().expect("scope chains");
        let reports = [
            Rule::FenceIgmp,
            Rule::FenceIcmpv6(Icmpv6Type::Mld2ListenerReport),
            Rule::FenceIcmpv6(Icmpv6Type::MldListenerReport),
            Rule::FenceIcmpv6(Icmpv6Type::MldListenerDone),
        ];
        assert!(scope.output.ends_with(&reports), "{:?}", scope.output);
        // The fence they go to accepts no IGMP, and MLDv2 reports only within their budget.
        assert!(rs.output.contains(&Rule::AcceptMldReport));
        assert!(!rs.output.iter().any(|r| matches!(
            r,
            Rule::AcceptIcmpv6(Icmpv6Type::MldListenerReport | Icmpv6Type::MldListenerDone)
                | Rule::AcceptIcmpv6(Icmpv6Type::Mld2ListenerReport)
        )));
        // A scope of interfaces only fences no local socket's joins: the host's reports stay
        // its own.
        let mut p = policy(SCOPED);
        if let Some(scope) = p.scope.as_mut() {
            scope.users.clear();
            scope.cgroups.clear();
        }
        let rs = plan(&p, &resolution(&[]));
        let output = &rs.scope.as_ref().expect("scope chains").output;
        assert!(reports.iter().all(|r| !output.contains(r)), "{output:?}");
    }

    #[test]
    fn only_the_guards_sockets_get_questions_to_its_addresses() {
        let rs = scoped_plan(&[], &["198.18.0.1:53"]);
        let scope = rs.scope.as_ref().expect("scope chains");
        let refusal = |to: &str, proto| Rule::RefuseGuardQueryToOtherSockets {
            to: to.parse().unwrap(),
            proto,
            mark: crate::core::policy::DEFAULT_GUARD_MARK,
        };
        // Every listen address, the bridges' included, before the bridges' questions are
        // accepted.
        assert_eq!(
            scope.input[..4],
            [
                refusal("127.0.0.53:53", L4Proto::Udp),
                refusal("127.0.0.53:53", L4Proto::Tcp),
                refusal("198.18.0.1:53", L4Proto::Udp),
                refusal("198.18.0.1:53", L4Proto::Tcp),
            ]
        );
        assert!(matches!(
            scope.input[4..],
            [Rule::FromBridge(_), Rule::FromBridge(_)]
        ));
        // A scope of users alone has the chain for them.
        let mut p = policy(SCOPED);
        if let Some(scope) = p.scope.as_mut() {
            scope.forward.clear();
        }
        let mut r = resolution(&[]);
        r.guard_uid = Some(993);
        let rs = plan(&p, &r);
        let input = rs.chain("scope_input").expect("scope_input");
        assert_eq!(input.rules.len(), 2, "{:?}", input.rules);
        // Without a guard there is nothing to protect.
        let resolve = "version: 1\nscope:\n  users: [1001]\ndns:\n  resolvers: [192.0.2.53]\n";
        let rs = plan(&policy(resolve), &resolution(&[]));
        assert!(rs.chain("scope_input").is_none());
    }

    #[test]
    fn a_listed_interface_drops_spoofed_sources_before_anything_answers_them() {
        let rs = scoped_plan(&[], &["198.18.0.1:53"]);
        let scope = rs.scope.as_ref().expect("scope chains");
        let iface = |name: &str| name.parse().unwrap();
        assert_eq!(
            scope.prerouting,
            [
                Rule::DropBridgeGroupFrames,
                Rule::DropSpoofedFrom(iface("docker0")),
                Rule::DropSpoofedFrom(iface("br-*")),
            ]
        );
        // Before conntrack (-200) and the routing decision: nothing has answered yet.
        let chain = rs.chain("scope_prerouting").expect("the chain");
        assert_eq!(
            chain
                .base
                .map(|b| (b.hook.name(), b.hook.priority(), b.policy)),
            Some((
                "prerouting",
                -300,
                crate::core::ruleset::ChainPolicy::Accept
            ))
        );
        assert!(rs.to_nft().contains(
            "\tchain scope_prerouting {\n\t\ttype filter hook prerouting priority raw; policy \
             accept;\n\t\t@ll,0,40 0x180c20000 drop\n\t\tiifname \"docker0\" fib saddr . iif \
             oif missing drop\n"
        ));
        // Without listed interfaces nothing is forwarded to check: no chain.
        let mut p = policy(SCOPED);
        if let Some(scope) = p.scope.as_mut() {
            scope.forward.clear();
        }
        let rs = plan(&p, &resolution(&[]));
        assert!(rs.chain("scope_prerouting").is_none());
    }

    /// Red team round 5: an allowed destination answers the source of what a process writes,
    /// and `IPV6_FREEBIND` lets any user write from an outside address.
    #[test]
    fn a_source_not_the_hosts_is_refused_after_loopback_and_before_every_other_accept() {
        // The scoped guard's accepts of its own upstream questions come before loopback: only
        // the guard's marked sockets meet them.
        let scoped = scoped_plan(&[], &[]);
        for (what, rs) in [
            ("plain", plan(&policy(POLICY), &resolution(&[]))),
            ("scoped guard", scoped),
        ] {
            let output = &rs.output;
            let at = |want: &Rule| output.iter().position(|r| r == want).unwrap();
            let refuse = at(&Rule::RefuseForeignSource);
            assert_eq!(refuse, at(&Rule::AcceptLoopback) + 1, "{what}: {output:#?}");
            assert!(at(&Rule::AcceptEstablished) < refuse, "{what}");
            let first_process_accept = output
                .iter()
                .position(|r| matches!(r, Rule::AcceptTupleIn(_) | Rule::AcceptDhcpClient(_)))
                .unwrap();
            assert!(refuse < first_process_accept, "{what}: {output:#?}");
        }
        // Without the loopback essential it still comes before the first accept of a
        // process's flow.
        let bare = plan(&policy("version: 1\nessentials: []\n"), &resolution(&[]));
        assert!(bare.output.contains(&Rule::RefuseForeignSource));
    }

    #[test]
    fn scoped_guard_mode_sends_fenced_dns_to_the_guard_before_loopback() {
        let rs = scoped_plan(&[], &[]);
        let at = |want: &Rule| rs.output.iter().position(|r| r == want).unwrap();
        let loopback = at(&Rule::AcceptLoopback);
        let to_guard = at(&Rule::AcceptGuardQuery {
            to: "127.0.0.53:53".parse().unwrap(),
            proto: L4Proto::Udp,
        });
        let refuse_dns = at(&Rule::RefuseService(L4Proto::Udp, 53));
        let upstream = rs
            .output
            .iter()
            .position(|r| matches!(r, Rule::AcceptTupleFromGuard { .. }))
            .unwrap();
        assert!(upstream < to_guard && to_guard < refuse_dns && refuse_dns < loopback);
        assert_eq!(
            rs.output
                .iter()
                .filter(|r| matches!(r, Rule::RefuseService(..)))
                .count(),
            4
        );
    }

    #[test]
    fn every_guard_protection_is_behind_a_jump_that_takes_in_all_it_can_match() {
        // Listen ports of their own: one jump per distinct port.
        let mut r = resolution(&[]);
        r.guard_uid = Some(993);
        r.scope.bridge_listen = vec!["198.18.0.1:5353".parse().unwrap()];
        let scoped = plan(&policy(SCOPED), &r);
        let hook = &scoped.scope.as_ref().unwrap().output;
        // Without a scope the fence itself is on the hook: the same jumps, before the replies.
        let mut unscoped_policy = policy(SCOPED);
        unscoped_policy.scope = None;
        let unscoped = plan(&unscoped_policy, &r);
        let established = unscoped
            .output
            .iter()
            .position(|r| *r == Rule::AcceptEstablished);
        let gates = |hook: &[Rule]| -> Vec<Rule> {
            hook.iter()
                .filter(|r| matches!(r, Rule::JumpGuardFromPort(_) | Rule::JumpGuardToUpstream(_)))
                .cloned()
                .collect()
        };
        assert_eq!(gates(hook), gates(&unscoped.output[..established.unwrap()]));
        assert_eq!(scoped.guard, unscoped.guard);
        for (rs, hook) in [(&scoped, hook), (&unscoped, &unscoped.output)] {
            let ports: Vec<u16> = hook
                .iter()
                .filter_map(|r| match r {
                    Rule::JumpGuardFromPort(p) => Some(*p),
                    _ => None,
                })
                .collect();
            assert!(!rs.guard.is_empty());
            for rule in &rs.guard {
                match rule {
                    Rule::RefuseUnmarkedFromGuardPort { from, .. }
                    | Rule::RefuseOtherUidsFromGuardPort { from, .. } => {
                        assert!(ports.contains(&from.port()), "{rule}: {ports:?}")
                    }
                    Rule::RefuseUpstreamFromOtherUids { set, .. }
                    | Rule::RefuseUpstreamUnmarked { set, .. } => {
                        assert!(hook.contains(&Rule::JumpGuardToUpstream(*set)), "{rule}")
                    }
                    other => panic!("not a guard protection: {other}"),
                }
            }
        }
        // Without a guard, neither jumps nor the chain.
        let rs = plan(
            &policy("version: 1\nscope:\n  users: [1001]\n"),
            &resolution(&[]),
        );
        let scope = rs.scope.as_ref().unwrap();
        assert!(rs.guard.is_empty());
        assert_eq!(scope.output[0], Rule::Fence(ScopeMatch::Uid(1001)));
        assert!(
            !scope
                .output
                .iter()
                .any(|r| matches!(r, Rule::JumpGuardFromPort(_) | Rule::JumpGuardToUpstream(_)))
        );
        assert!(rs.chain("guard").is_none());
    }

    #[test]
    fn a_generation_recorded_before_the_guard_chain_still_reads() {
        // Then the protections were scope_output's first rules, and there was no `guard`.
        let mut old = scoped_plan(&[], &[]);
        let protections = std::mem::take(&mut old.guard);
        let scope = old.scope.as_mut().unwrap();
        scope
            .output
            .retain(|r| !matches!(r, Rule::JumpGuardFromPort(_) | Rule::JumpGuardToUpstream(_)));
        scope.output.splice(0..0, protections);
        let json = serde_json::to_value(&old).unwrap();
        assert!(json.get("guard").is_none());
        let read: Ruleset = serde_json::from_value(json).unwrap();
        assert_eq!(read, old);
        assert!(read.chain("guard").is_none());
        assert_ne!(read, scoped_plan(&[], &[]), "and it is not today's plan");
    }

    #[test]
    fn a_generation_recorded_while_only_a_scope_had_the_guard_chain_reads_it_back_whole() {
        // Then the chain's rules were the scope's (`scope.guard`); a rollback to that
        // generation makes the chain its jumps need.
        let now = scoped_plan(&[], &[]);
        let mut json = serde_json::to_value(&now).unwrap();
        let guard = json
            .as_object_mut()
            .unwrap()
            .remove("guard")
            .expect("guard");
        json["scope"]
            .as_object_mut()
            .unwrap()
            .insert("guard".into(), guard);
        let read: Ruleset = serde_json::from_value(json).unwrap();
        assert_eq!(read, now);
        assert!(read.chain("guard").is_some());
    }
}
