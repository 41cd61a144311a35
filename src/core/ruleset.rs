//! The ruleset as plain data, and its rendering as nft text.
//!
//! The same [`Ruleset`] value is rendered for `plan` and encoded into a netlink batch for
//! `apply`, so what a reviewer reads is what the kernel gets. Every rule is one of a closed set
//! of shapes ([`Rule`]); the renderer and the encoder each have one arm per shape.

use std::fmt::{self, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize};

use crate::core::policy::{Action, CgroupPath, IfacePattern, L4Proto, PortRange, Rate, RateUnit};

/// The one table the tool owns, in family inet. Nothing else is ever touched.
pub const TABLE: &str = "egress_fence";
/// The fence: the rules every fenced packet meets. A base chain on the output hook when the
/// whole namespace is fenced; with a `scope:`, a regular chain the scope's chains go to.
pub const OUTPUT_CHAIN: &str = "output";
pub const REFUSED_CHAIN: &str = "refused";
/// With a `scope:`, the base chain on the output hook: sends the scope's sockets to the fence.
pub const SCOPE_OUTPUT_CHAIN: &str = "scope_output";
/// With `scope.forward`, the base chain on the forward hook: sends what the listed interfaces
/// forward to the fence.
pub const SCOPE_FORWARD_CHAIN: &str = "scope_forward";
/// With `scope.forward`, the base chain on the input hook: sends what the listed interfaces
/// bring to the host itself to [`FROM_BRIDGE_CHAIN`].
pub const SCOPE_INPUT_CHAIN: &str = "scope_input";
/// What a listed interface (a container bridge) may send the host itself: replies, neighbour
/// discovery, and questions to the DNS guard.
pub const FROM_BRIDGE_CHAIN: &str = "from_bridge";
/// With `scope.forward`, the base chain on the prerouting hook at priority `raw`: drops what a
/// listed interface sends from a source that does not route back through it, before conntrack,
/// the routing decision (and the kernel's ICMP errors it makes) or any of our chains answers it.
pub const SCOPE_PREROUTING_CHAIN: &str = "scope_prerouting";

/// The first five bytes of the IEEE 802.1 reserved group addresses (01:80:c2:00:00:xx: STP,
/// pause frames, LACP, 802.1X, LLDP): what [`Rule::DropBridgeGroupFrames`] compares a frame's
/// destination with.
pub const BRIDGE_GROUP_PREFIX: [u8; 5] = [0x01, 0x80, 0xc2, 0x00, 0x00];

/// In guard mode, the guard's own protections (they hold for every socket), entered from the
/// base chain on the output hook ([`OUTPUT_CHAIN`] without a scope, [`SCOPE_OUTPUT_CHAIN`]
/// with one) only by the packets they can concern: from the guard's listen port, or to its
/// upstream resolvers. Every other packet, the established ones among them, pays a few cheap
/// matches instead of walking them one by one.
pub const GUARD_CHAIN: &str = "guard";

/// `learn`'s audit window: a set of address families (`type nf_proto; flags timeout`) whose
/// elements the daemon renews while it audits. While the set holds a packet's family, the
/// fence logs what it would refuse and lets it through ([`Rule::AuditAccept`]); an element
/// nobody renews expires by itself, so a killed `learn` leaves a table that refuses again.
pub const AUDIT_WINDOW_SET: &str = "audit_window";
/// The prefix of what the audit window let through (NFLOG, the policy's log group).
pub const AUDIT_PREFIX: &str = "EGRESS-AUDIT: ";
/// The prefix of the first packet of every new flow, while a run records ([`Rule::RecordFlow`]).
pub const FLOW_PREFIX: &str = "EGRESS-FLOW: ";
/// The comment of [`Rule::AuditAccept`]: `nft list` says what the rule is for.
pub const AUDIT_COMMENT: &str =
    "audit: learn lets through what the policy refuses while audit_window holds its family";

/// The chains only a scoped table has.
pub const SCOPE_CHAINS: [&str; 5] = [
    FROM_BRIDGE_CHAIN,
    SCOPE_OUTPUT_CHAIN,
    SCOPE_FORWARD_CHAIN,
    SCOPE_INPUT_CHAIN,
    SCOPE_PREROUTING_CHAIN,
];

/// The netfilter hook a base chain is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hook {
    Output,
    Forward,
    Input,
    Prerouting,
}

impl Hook {
    pub fn name(self) -> &'static str {
        match self {
            Hook::Output => "output",
            Hook::Forward => "forward",
            Hook::Input => "input",
            Hook::Prerouting => "prerouting",
        }
    }

    /// The priority our base chain on this hook has: `filter` (0), except on prerouting,
    /// where `raw` (-300) comes before conntrack (-200) sees the packet.
    pub fn priority(self) -> i32 {
        match self {
            Hook::Prerouting => -300,
            Hook::Output | Hook::Forward | Hook::Input => 0,
        }
    }

    /// [`Hook::priority`] as nft writes it.
    pub fn priority_name(self) -> &'static str {
        match self {
            Hook::Prerouting => "raw",
            Hook::Output | Hook::Forward | Hook::Input => "filter",
        }
    }
}

/// What a base chain does with a packet no rule decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChainPolicy {
    Accept,
    Drop,
}

/// A base chain's hook and policy (type `filter`, at the hook's [`Hook::priority`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseChain {
    pub hook: Hook,
    pub policy: ChainPolicy,
}

/// One chain of the table as the ruleset holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainSpec<'a> {
    pub name: &'static str,
    /// `None`: a regular chain, entered only by `goto`.
    pub base: Option<BaseChain>,
    pub rules: &'a [Rule],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Family {
    #[serde(rename = "ipv4")]
    V4,
    #[serde(rename = "ipv6")]
    V6,
}

impl Family {
    pub const BOTH: [Family; 2] = [Family::V4, Family::V6];

    pub fn of(addr: IpAddr) -> Family {
        match addr {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    pub fn of_net(net: &IpNet) -> Family {
        Family::of(net.addr())
    }

    fn digit(self) -> char {
        match self {
            Family::V4 => '4',
            Family::V6 => '6',
        }
    }

    /// The nft keyword for this family's destination address (`ip daddr`, `ip6 daddr`).
    fn daddr(self) -> &'static str {
        match self {
            Family::V4 => "ip daddr",
            Family::V6 => "ip6 daddr",
        }
    }

    /// The nft keyword for this family's source address (`ip saddr`, `ip6 saddr`).
    fn saddr(self) -> &'static str {
        match self {
            Family::V4 => "ip saddr",
            Family::V6 => "ip6 saddr",
        }
    }

    fn nfproto(self) -> &'static str {
        match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }
}

/// What a set is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SetRole {
    /// Denied networks (interval set of addresses), checked first; in guard mode also the
    /// upstream resolvers, which only the guard's accept before them reaches.
    Deny,
    /// Allowed resolvers: address . protocol . port 53.
    Dns,
    /// Allowed networks and port ranges (concatenated interval set); only a full apply
    /// rewrites it.
    Allow,
    /// Resolved addresses with single ports (hash set with element timeouts), the set a
    /// refresh updates element by element.
    Resolved,
}

/// One of the eight sets of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SetId {
    pub role: SetRole,
    pub family: Family,
}

/// How a set's key is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyShape {
    /// `ipv4_addr` or `ipv6_addr`.
    Addr,
    /// `ipv4_addr . inet_proto . inet_service` (or ipv6).
    Tuple,
}

impl SetId {
    pub const ALL: [SetId; 8] = {
        const fn id(role: SetRole, family: Family) -> SetId {
            SetId { role, family }
        }
        use Family::*;
        use SetRole::*;
        [
            id(Deny, V4),
            id(Deny, V6),
            id(Dns, V4),
            id(Dns, V6),
            id(Allow, V4),
            id(Allow, V6),
            id(Resolved, V4),
            id(Resolved, V6),
        ]
    };

    pub fn new(role: SetRole, family: Family) -> SetId {
        SetId { role, family }
    }

    pub fn name(self) -> String {
        let role = match self.role {
            SetRole::Deny => "deny",
            SetRole::Dns => "dns",
            SetRole::Allow => "allow",
            SetRole::Resolved => "resolved",
        };
        format!("{role}{}", self.family.digit())
    }

    pub fn from_name(name: &str) -> Option<SetId> {
        SetId::ALL.into_iter().find(|id| id.name() == name)
    }

    pub fn shape(self) -> KeyShape {
        match self.role {
            SetRole::Deny => KeyShape::Addr,
            SetRole::Dns | SetRole::Allow | SetRole::Resolved => KeyShape::Tuple,
        }
    }

    /// Interval sets hold networks and port ranges; the others exact keys.
    pub fn interval(self) -> bool {
        matches!(self.role, SetRole::Deny | SetRole::Allow)
    }

    /// Whether elements may carry their own timeout.
    pub fn timeout(self) -> bool {
        self.role == SetRole::Resolved
    }

    /// The set's flags as nft writes them.
    pub fn flag_names(self) -> Vec<&'static str> {
        [
            self.interval().then_some("interval"),
            self.timeout().then_some("timeout"),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// `type ipv4_addr; flags interval`: what nft says of the set besides its elements.
    pub fn definition(self) -> String {
        let flags = self.flag_names();
        if flags.is_empty() {
            format!("type {}", self.nft_type())
        } else {
            format!("type {}; flags {}", self.nft_type(), flags.join(","))
        }
    }

    fn nft_type(self) -> &'static str {
        match (self.shape(), self.family) {
            (KeyShape::Addr, Family::V4) => "ipv4_addr",
            (KeyShape::Addr, Family::V6) => "ipv6_addr",
            (KeyShape::Tuple, Family::V4) => "ipv4_addr . inet_proto . inet_service",
            (KeyShape::Tuple, Family::V6) => "ipv6_addr . inet_proto . inet_service",
        }
    }
}

/// Destination network, protocol and destination ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Tuple {
    pub net: IpNet,
    pub proto: L4Proto,
    #[serde(deserialize_with = "stored_ports")]
    pub ports: PortRange,
}

/// Port ranges as a stored ruleset holds them: unlike a policy's, they may start at port 0
/// (`0-65535`, every port of a `cidr:` entry).
fn stored_ports<'de, D: Deserializer<'de>>(d: D) -> Result<PortRange, D::Error> {
    let text = String::deserialize(d)?;
    let port = |s: &str| s.parse::<u16>().map_err(serde::de::Error::custom);
    let (first, last) = match text.split_once('-') {
        Some((a, b)) => (port(a)?, port(b)?),
        None => (port(&text)?, port(&text)?),
    };
    if first > last {
        return Err(serde::de::Error::custom(format!(
            "port range `{text}` runs backwards"
        )));
    }
    Ok(PortRange { first, last })
}

/// The longest name an element keeps as its comment ([`Timed::name`]): the kernel keeps at
/// most 254 bytes of an element's user data, the comment's type and length bytes, the name
/// and its NUL (see `nft::encode::MAX_ELEM_USERDATA`).
pub const MAX_COMMENTED_NAME: usize = 251;

/// An element of a resolved set: a tuple and, when the daemon keeps it fresh, how long the
/// kernel keeps it without another refresh (so a dead daemon's addresses still expire).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Timed {
    #[serde(flatten)]
    pub tuple: Tuple,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Read back from the kernel only: how long until it expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_ms: Option<u64>,
    /// The allowed name whose answer brought the element, kept in the kernel as the
    /// element's comment: a restart, a reload, `status` and `probe` check it against the
    /// policy. (An element two names share carries the first one the kernel was given.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Timed {
    pub fn permanent(tuple: Tuple) -> Timed {
        Timed {
            tuple,
            timeout_ms: None,
            expires_ms: None,
            name: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Elements {
    /// Deny sets.
    Networks(Vec<IpNet>),
    /// DNS and allow sets.
    Tuples(Vec<Tuple>),
    /// Resolved sets.
    Timed(Vec<Timed>),
}

impl Elements {
    pub fn len(&self) -> usize {
        match self {
            Elements::Networks(n) => n.len(),
            Elements::Tuples(t) => t.len(),
            Elements::Timed(t) => t.len(),
        }
    }

    /// The elements as nft writes them.
    pub fn to_nft(&self) -> Vec<String> {
        match self {
            Elements::Networks(nets) => nets.iter().map(fmt_net).collect(),
            Elements::Tuples(tuples) => tuples.iter().map(fmt_tuple).collect(),
            Elements::Timed(timed) => timed.iter().map(fmt_timed).collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Set {
    pub id: SetId,
    pub elements: Elements,
}

/// ICMPv6 messages a host must send to keep its link working, and the MLD messages that name
/// multicast groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Icmpv6Type {
    NdRouterSolicit,
    NdNeighborSolicit,
    NdNeighborAdvert,
    Mld2ListenerReport,
    /// MLDv1 (a host in MLDv1 compatibility mode): a report of one group.
    MldListenerReport,
    /// MLDv1: a group left.
    MldListenerDone,
}

impl Icmpv6Type {
    /// Every type a rule of the table names.
    pub const ALL: [Icmpv6Type; 6] = [
        Icmpv6Type::NdRouterSolicit,
        Icmpv6Type::NdNeighborSolicit,
        Icmpv6Type::NdNeighborAdvert,
        Icmpv6Type::Mld2ListenerReport,
        Icmpv6Type::MldListenerReport,
        Icmpv6Type::MldListenerDone,
    ];

    /// Link-scoped messages (neighbour discovery, MLD reports), never forwarded by a router:
    /// what the forward path refuses before the fence, which accepts some by type alone.
    pub const LINK_SCOPED: [Icmpv6Type; 5] = [
        Icmpv6Type::NdRouterSolicit,
        Icmpv6Type::NdNeighborSolicit,
        Icmpv6Type::NdNeighborAdvert,
        Icmpv6Type::Mld2ListenerReport,
        Icmpv6Type::MldListenerReport,
    ];

    /// The MLD messages the kernel sends for a socket's joins and leaves, without an owner:
    /// what a scope sends through the fence whoever joined.
    pub const MLD_REPORTS: [Icmpv6Type; 3] = [
        Icmpv6Type::Mld2ListenerReport,
        Icmpv6Type::MldListenerReport,
        Icmpv6Type::MldListenerDone,
    ];

    pub fn number(self) -> u8 {
        match self {
            Icmpv6Type::NdRouterSolicit => 133,
            Icmpv6Type::NdNeighborSolicit => 135,
            Icmpv6Type::NdNeighborAdvert => 136,
            Icmpv6Type::Mld2ListenerReport => 143,
            Icmpv6Type::MldListenerReport => 131,
            Icmpv6Type::MldListenerDone => 132,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Icmpv6Type::NdRouterSolicit => "nd-router-solicit",
            Icmpv6Type::NdNeighborSolicit => "nd-neighbor-solicit",
            Icmpv6Type::NdNeighborAdvert => "nd-neighbor-advert",
            Icmpv6Type::Mld2ListenerReport => "mld2-listener-report",
            Icmpv6Type::MldListenerReport => "mld-listener-report",
            Icmpv6Type::MldListenerDone => "mld-listener-done",
        }
    }
}

/// What a token bucket counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    Packets,
    /// Bytes of packet (network header included): bounds what a channel carries.
    Bytes,
}

/// A token bucket of the table's own (not the policy's): `count` per `per`, `burst` more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub count: u64,
    pub per: RateUnit,
    pub burst: u32,
    pub kind: LimitKind,
}

impl fmt::Display for Limit {
    /// `limit rate 10/minute burst 10 packets`, `limit rate 1 kbytes/minute burst 1500 bytes`:
    /// byte rates in the largest unit that divides them, as nft lists them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per = self.per.name();
        match self.kind {
            LimitKind::Packets => write!(
                f,
                "limit rate {}/{per} burst {} packets",
                self.count, self.burst
            ),
            LimitKind::Bytes => {
                let (mut rate, mut unit) = (self.count, 0);
                let units = ["bytes", "kbytes", "mbytes"];
                while unit + 1 < units.len() && rate >= 1024 && rate % 1024 == 0 {
                    rate /= 1024;
                    unit += 1;
                }
                write!(
                    f,
                    "limit rate {rate} {}/{per} burst {} bytes",
                    units[unit], self.burst
                )
            }
        }
    }
}

/// The DHCP client's requests that meet the output hook: 2 KiB a minute, and one full-size
/// message at once, all senders together. The output hook sees a UDP datagram before it is
/// fragmented, so a count of packets would let each "request" carry 64 KB; bytes bound the
/// channel. A client's DISCOVER or REQUEST (300-600 bytes, a few a minute while it looks for
/// a lease) fits; [`DHCP_MAX_LENGTH`] caps one datagram on its own.
pub const DHCP_CLIENT_LIMIT: Limit = Limit {
    count: 2048,
    per: RateUnit::Minute,
    burst: 1500,
    kind: LimitKind::Bytes,
};

/// The longest DHCP request accepted, IP header included (`meta length <= 1500`): an
/// Ethernet MTU, which every DHCP message fits (RFC 2131 clients send at most 576 bytes
/// unless told more).
pub const DHCP_MAX_LENGTH: u32 = 1500;

/// MLDv2 reports: 1 KiB a minute, and one full-size report at once (the answer to a general
/// query lists every group of the interface in one report). Any process can choose groups to
/// join, so the reports are a channel of 16 chosen bytes per group; this bounds it.
pub const MLD_REPORT_LIMIT: Limit = Limit {
    count: 1024,
    per: RateUnit::Minute,
    burst: 1500,
    kind: LimitKind::Bytes,
};

/// A way to route a packet past the destination its header names: the other rules check only
/// the first hop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SourceRoute {
    /// An IPv6 routing header (extension header 43): segment routing (type 4) lists the final
    /// destination inside, and any user can add one with `IPV6_RTHDR`.
    Ipv6RoutingHeader,
    /// Any IPv4 option (`ip hdrlength != 5`): a holder of CAP_NET_RAW (root in a container
    /// has it by default) writes the header itself, and nft's option match (`ip option lsrr
    /// exists`) parses options as `setsockopt(IP_OPTIONS)` does, so a loose source route with
    /// pointer 8 or an odd length counts as absent while a router honours it. Nothing the
    /// host needs sends options through this hook (IGMP's Router Alert was never allowed).
    Ipv4Options,
}

impl SourceRoute {
    /// The refusals the plan puts first, in this order.
    pub const ALL: [SourceRoute; 2] = [SourceRoute::Ipv4Options, SourceRoute::Ipv6RoutingHeader];

    pub fn family(self) -> Family {
        match self {
            SourceRoute::Ipv6RoutingHeader => Family::V6,
            SourceRoute::Ipv4Options => Family::V4,
        }
    }

    /// nft's words for "the packet has one".
    fn nft_match(self) -> &'static str {
        match self {
            SourceRoute::Ipv6RoutingHeader => "exthdr rt exists",
            SourceRoute::Ipv4Options => "ip hdrlength != 5",
        }
    }
}

/// How refused packets are logged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogSpec {
    pub prefix: String,
    pub group: Option<u16>,
    pub rate: Rate,
    pub burst: u32,
}

/// Which packets a [`Rule::Fence`] sends through the fence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScopeMatch {
    /// `meta skuid 1001`: sockets a process of this uid made.
    Uid(u32),
    /// `meta skgid 2000`: sockets made while this was the process's group.
    Gid(u32),
    /// `socket cgroupv2 level 1 "agent.slice"`: sockets of processes in the subtree.
    Cgroup(CgroupMatch),
    /// `iifname "br-*"`: packets forwarded from the interface (or any it prefixes).
    Interface(IfacePattern),
}

impl fmt::Display for ScopeMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScopeMatch::Uid(uid) => write!(f, "meta skuid {uid}"),
            ScopeMatch::Gid(gid) => write!(f, "meta skgid {gid}"),
            ScopeMatch::Cgroup(c) => write!(f, "socket cgroupv2 level {} \"{}\"", c.level, c.path),
            ScopeMatch::Interface(iface) => write!(f, "iifname \"{iface}\""),
        }
    }
}

/// A cgroup v2 subtree as the kernel matches it: the id (inode number) of the cgroup at
/// `level` below the root among a socket's cgroup's ancestors. The id is the cgroup's as it
/// was when planned: a cgroup removed and made again has a new one, and the daemon plans
/// again (the path rides along in the rule's comment, so a table read back names it).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CgroupMatch {
    /// The path as nft finds it below /sys/fs/cgroup: the policy's, or on a hybrid host
    /// (cgroup v2 mounted at /sys/fs/cgroup/unified) `unified/` and the policy's.
    pub path: CgroupPath,
    /// The level of the policy's path below the v2 root.
    pub level: u32,
    pub id: u64,
}

impl CgroupMatch {
    /// Whether this is the policy's `listed` cgroup.
    pub fn is_of(&self, listed: &CgroupPath) -> bool {
        let (path, listed) = (self.path.as_str(), listed.as_str());
        self.level == listed.split('/').count() as u32
            && (path == listed || path.ends_with(&format!("/{listed}")))
    }
}

/// The shapes of rule the table uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// `ip hdrlength != 5 goto refused`, `exthdr rt exists goto refused`: a packet that
    /// names its own route goes on past the destination the other rules check.
    RefuseSourceRoute(SourceRoute),
    /// `meta l4proto icmp meta skuid >= 0 oif != "lo" goto refused` (`ipv6-icmp` for
    /// IPv6): ICMP that a process wrote (a raw socket, which root in a container may open)
    /// leaves only over loopback, before `ct state established,related accept`. An error that
    /// quotes a flow in conntrack is `related` to it (a reply is `established`), so it would
    /// carry a kilobyte of the writer's choice to that flow's peer: the guard's upstream
    /// resolver, or anyone who connected in. The policy never accepts ICMP from processes
    /// otherwise, and the kernel's own (errors, echo replies, neighbour discovery) come from
    /// its sockets without an owner, where `meta skuid` matches nothing.
    RefuseIcmpFromProcesses(Family),
    /// `ip saddr 127.0.0.53 udp sport 53 meta mark != M goto refused`: what
    /// leaves from the DNS guard's listen address and port without the guard's mark (its
    /// listening sockets carry it, and so do its replies, TCP connections and SYN-ACKs) is
    /// refused, so a process that binds the guard's address while the daemon is down answers
    /// nobody. Before `ct state established,related accept`: a squatter's replies belong to
    /// connections the clients opened. An unspecified address (`0.0.0.0`, `::`) matches any
    /// source address of either family.
    RefuseUnmarkedFromGuardPort {
        from: SocketAddr,
        proto: L4Proto,
        mark: u32,
    },
    /// `ip saddr 127.0.0.53 udp sport 53 meta skuid != U goto refused`: what leaves the
    /// guard's listen address and port from a socket of another uid is refused. The mark
    /// alone is not enough since Linux 5.17, where CAP_NET_RAW (root in a container keeps it)
    /// sets `SO_MARK` too. The guard's SYN-ACKs come from request sockets, whose owner is the
    /// listener's; the kernel's own resets have no owner, where `meta skuid` matches nothing.
    /// Before `ct state established,related accept`, like the mark rule.
    RefuseOtherUidsFromGuardPort {
        from: SocketAddr,
        proto: L4Proto,
        uid: u32,
    },
    /// `meta skuid != U ip daddr . meta l4proto . th dport @dns4 goto refused`: DNS to the
    /// guard's upstream resolvers from a socket of another uid, refused before `ct state
    /// established,related accept`: the guard's closed upstream flows stay established in
    /// conntrack for a while, and any process that binds the same port would otherwise
    /// reuse (and renew) them. Packets without an owning socket (the kernel's resets, a
    /// TIME_WAIT socket's ACKs) match nothing here.
    RefuseUpstreamFromOtherUids { set: SetId, uid: u32 },
    /// `meta skuid U meta mark != M ip daddr . meta l4proto . th dport @dns4 goto refused`:
    /// the same for sockets of the guard's uid without its mark (root in a container when
    /// the guard runs as root).
    RefuseUpstreamUnmarked { set: SetId, uid: u32, mark: u32 },
    /// `meta skuid 1001 goto output`, `socket cgroupv2 level 1 "agent.slice" goto output`,
    /// `iifname "docker0" goto output`: the scope's packets go through the fence.
    Fence(ScopeMatch),
    /// `iifname "docker0" goto from_bridge`: what a listed interface sends the host itself.
    FromBridge(IfacePattern),
    /// `th sport 53 jump guard`: a packet from the DNS guard's listen port meets the guard's
    /// protections of [`GUARD_CHAIN`]. `th` (no protocol match) takes in every packet their
    /// `udp sport`/`tcp sport` rules can match, and the rules there check the rest (another
    /// protocol whose first two bytes read 53 just walks them).
    JumpGuardFromPort(u16),
    /// `ip daddr . meta l4proto . th dport @dns4 jump guard`: a packet to the guard's upstream
    /// resolvers meets its protections, the same lookup as their upstream rules make.
    JumpGuardToUpstream(SetId),
    /// `ip daddr 198.18.0.1 udp dport 53 accept`: a question to the DNS guard where it
    /// listens (with a scope, other resolvers on this host are not the fence's).
    AcceptGuardQuery { to: SocketAddr, proto: L4Proto },
    /// `iifname "docker0" fib saddr . iif oif missing drop`: what a listed interface sends
    /// from a source that does not route back through it (an outside address a container
    /// spoofs) is dropped on the prerouting hook, before anything can answer that source
    /// with the packet's data: the fence's reject, the guard, the kernel's ICMP errors.
    DropSpoofedFrom(IfacePattern),
    /// `@ll,0,40 0x180c20000 drop` (the frame's destination is 01:80:c2:00:00:xx): an IP
    /// packet in a frame to an IEEE 802.1 reserved group address is dropped on the
    /// prerouting hook, whatever interface it came in by. A bridge never forwards such a
    /// frame: it passes it up on the port it came in by (a container's veth), so the packet
    /// reaches this host with the port as its input interface, past every rule that names
    /// the bridge (`iifname "docker0"`): a container would reach every UDP service of the
    /// host, from any source address it writes. No IP packet is sent to these addresses.
    DropBridgeGroupFrames,
    /// `icmpv6 type nd-neighbor-solicit goto refused`: link-scoped messages are never
    /// forwarded, and the fence accepts some by type alone.
    RefuseIcmpv6(Icmpv6Type),
    /// `meta l4proto igmp goto output`: the kernel's IGMP reports name the groups a process
    /// joined (any, of its choice) and have no owner for a scope rule to match.
    FenceIgmp,
    /// `icmpv6 type mld2-listener-report goto output`: the same for MLD.
    FenceIcmpv6(Icmpv6Type),
    /// `ip daddr 127.0.0.53 udp dport 53 socket mark != M goto refused`: a question to the
    /// guard's listen address that the guard's (marked) socket would not get, because a
    /// wildcard listener gets it while the guard is not bound there. A packet that no socket
    /// would get matches nothing (nft's `socket` breaks), and goes nowhere. An unspecified
    /// address (`0.0.0.0`, `::`) matches any destination of either family.
    RefuseGuardQueryToOtherSockets {
        to: SocketAddr,
        proto: L4Proto,
        mark: u32,
    },
    /// `ct direction reply oif != "lo" goto refused`, before `ct state established,related
    /// accept`, in `exec`'s run only (an extra, [`crate::core::plan::Extras`]): nothing in
    /// its namespace serves the outside, so a reply leaving it answers a flow an outside host
    /// started, which pasta let in (its UDP is a full-cone NAT: any host reaches the port a
    /// datagram of CMD's came from), and would carry CMD's bytes to that host as
    /// `established`. Loopback (the guard's answers) is not the outside.
    RefuseRepliesOut,
    /// `ct state established,related accept`
    AcceptEstablished,
    /// `oif "lo" meta skuid >= 0 fib saddr type != local goto refused`: a packet a process
    /// writes to this host from a source that is not this host's. Only a writer that chose its
    /// source sends one (any user over IPv6 with `IPV6_FREEBIND`, root with a raw socket), and
    /// this host answers that source,
    /// not the writer: a closed port with ICMP port unreachable quoting the packet or a reset
    /// carrying its ports and sequence number, a service with its reply; each leaves as
    /// `related` or `established` to the written flow, a channel to any address. Refused in
    /// every table, whatever the essentials: an allow entry may hold this host's address.
    /// Before the replies: written as the reply of a flow this host opened (the guard's query
    /// to its upstream), it is `established` and would pass for that peer's answer. The
    /// kernel's own packets have no owner and pass: the fence's reset of a refused connect
    /// comes to this host from the refused destination.
    RefuseForeignSourceToHost,
    /// `meta skuid >= 0 fib saddr type != local fib saddr type != broadcast goto refused`: a
    /// packet a process writes, to anywhere, from a source that is not this host's. The fence
    /// judges a packet by its destination, and an allowed destination answers the source: a
    /// resolver its question, a TCP server its SYN-ACK (the chosen port and sequence number),
    /// to an address of the writer's choice that no allow entry holds. Any user can over IPv6
    /// (`IPV6_FREEBIND`), root with CAP_NET_RAW over IPv4 (`IP_TRANSPARENT`, a raw socket).
    /// After the replies (a flow from a foreign source has its replies go elsewhere, so it
    /// stays new and meets this rule with every packet) and loopback (the rule above covers
    /// it), before the first accept a process's new flow can meet. A broadcast source passes:
    /// a DHCPv4 client's plain socket sends from 0.0.0.0 before it has an address, and no
    /// reply comes back to a broadcast address. Only a source that is not local pays the
    /// second lookup.
    RefuseForeignSource,
    /// `oif "lo" accept`
    AcceptLoopback,
    /// `icmpv6 type T accept`
    AcceptIcmpv6(Icmpv6Type),
    /// `icmpv6 type mld2-listener-report limit rate 1 kbytes/minute burst 1500 bytes accept`
    /// ([`MLD_REPORT_LIMIT`]).
    AcceptMldReport,
    /// The DHCP client's requests from a plain UDP socket: UDP 68 -> 67 to 255.255.255.255,
    /// or 546 -> 547 to ff02::1:2 for IPv6, at most [`DHCP_MAX_LENGTH`] bytes each, within
    /// [`DHCP_CLIENT_LIMIT`].
    AcceptDhcpClient(Family),
    /// `ip daddr @deny4 counter goto refused`: counted, so that what the deny entries refused
    /// is told apart from the rest, exactly and at no cost to other packets (`run --metrics`).
    RefuseDaddrIn(SetId),
    /// `ip daddr . meta l4proto . th dport @set accept`
    AcceptTupleIn(SetId),
    /// `meta mark M meta skuid U ip daddr . meta l4proto . th dport @set accept`: the DNS
    /// guard's own sockets to its upstream resolvers, and nobody else's. The guard marks its
    /// upstream sockets (`SO_MARK`, which takes CAP_NET_ADMIN to set): the uid alone is shared
    /// by every process of that user, root in a container included. `mark: None` is a rule
    /// of a generation recorded before marks (the uid alone); the plan always sets one.
    #[serde(alias = "accept_tuple_from_uid")]
    AcceptTupleFromGuard {
        set: SetId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mark: Option<u32>,
        uid: u32,
    },
    /// `meta l4proto udp th dport 53 goto refused`: a service refused whatever the allow
    /// entries say (DNS and DNS over TLS, in guard mode).
    RefuseService(L4Proto, u16),
    /// `goto refused`
    GotoRefused,
    /// `limit rate R burst B packets log prefix P [group G]`
    Log(LogSpec),
    /// `meta nfproto ipv4 counter`: refusals counted per family.
    CountFamily(Family),
    /// `iif 0 fib saddr type != local drop` (sent by this host), `iif "lo" fib saddr type !=
    /// local drop` (looped back to it): under `action: reject`, a refused packet whose source
    /// is no address of this host gets no answer. Either answer goes to that source: root in
    /// the fence (CAP_NET_RAW) that writes a packet from an outside address it controls would
    /// have the fence send that address an ICMP error quoting the packet, or a reset whose
    /// ports and sequence number it chose, and both leave as `related` to the refused
    /// packet's connection. What a listed interface forwards or brings in comes with an input
    /// interface, whose sources [`Rule::DropSpoofedFrom`] has already checked.
    DropForeignSource(Arrival),
    /// `iif 0 meta l4proto tcp meta priority != 0:5 reject with tcp reset`: under `action:
    /// reject`, a TCP connection this host opens is refused with a reset, which fails the
    /// connect at once in both families (ICMPv6 admin-prohibited is a soft error in SYN_SENT:
    /// the connect fails only at the first SYN retransmission, a second later). Sockets of
    /// [`ICMP_ANSWER_PRIORITY`] (the probe's) get the ICMP error instead, whose sender the
    /// socket's error queue names: a reset looks the same from the fence and from a closed
    /// port beyond it. What is forwarded keeps the ICMP error (`probe --from` tells the
    /// router's refusal by its sender).
    ResetTcp,
    /// `reject with icmpx admin-prohibited`, or `drop`
    Refuse(Action),
    /// `meta nfproto @audit_window log prefix "EGRESS-AUDIT: " group G accept comment
    /// "audit: ..."`: while `learn` holds the window open, what would be refused is logged
    /// (with its uid) and let through. Just before the fence's last `goto refused`: the deny
    /// list, the guard's protections and DNS to other resolvers stay refused.
    AuditAccept { group: u16 },
    /// `ct state new log prefix "EGRESS-FLOW: " group G`: the first packet of every new flow
    /// is logged for the trace of `run --record` and `learn` (no verdict: the rules below
    /// decide). Only while a run records.
    RecordFlow { group: u16 },
}

/// How a refused packet came to the hook: what [`Rule::DropForeignSource`] looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arrival {
    /// Sent by this host (output hook): no input interface, `iif 0`.
    Sent,
    /// Looped back to this host (input hook from `lo`, whose index is 1 in every network
    /// namespace).
    Loopback,
}

impl Arrival {
    pub const ALL: [Arrival; 2] = [Arrival::Sent, Arrival::Loopback];

    /// The input interface's index, as `meta iif` loads it.
    pub fn iif(self) -> u32 {
        match self {
            Arrival::Sent => 0,
            Arrival::Loopback => 1,
        }
    }

    fn nft_match(self) -> &'static str {
        match self {
            Arrival::Sent => "iif 0",
            Arrival::Loopback => "iif \"lo\"",
        }
    }
}

/// The socket priority (`SO_PRIORITY`; any process may set 0 to 6, and no type of service
/// maps to 5) whose refused TCP connections get ICMP admin-prohibited instead of a reset
/// ([`Rule::ResetTcp`]). The probe sets it: the error queue names the ICMP error's sender,
/// so the probe tells the fence's refusal from a refusal beyond it. Any other process that
/// sets it only chooses the slower form of its own refusal.
pub const ICMP_ANSWER_PRIORITY: u32 = 5;

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rule::RefuseSourceRoute(route) => {
                write!(f, "{} goto {REFUSED_CHAIN}", route.nft_match())
            }
            Rule::RefuseUnmarkedFromGuardPort { from, proto, mark } => {
                if !from.ip().is_unspecified() {
                    let family = Family::of(from.ip());
                    write!(f, "{} {} ", family.saddr(), from.ip())?;
                }
                write!(
                    f,
                    "{} sport {} meta mark != {mark:#010x} goto {REFUSED_CHAIN}",
                    proto.name(),
                    from.port()
                )
            }
            Rule::RefuseOtherUidsFromGuardPort { from, proto, uid } => {
                if !from.ip().is_unspecified() {
                    let family = Family::of(from.ip());
                    write!(f, "{} {} ", family.saddr(), from.ip())?;
                }
                write!(
                    f,
                    "{} sport {} meta skuid != {uid} goto {REFUSED_CHAIN}",
                    proto.name(),
                    from.port()
                )
            }
            Rule::RefuseUpstreamFromOtherUids { set, uid } => {
                let (daddr, name) = (set.family.daddr(), set.name());
                write!(
                    f,
                    "meta skuid != {uid} {daddr} . meta l4proto . th dport @{name} \
                     goto {REFUSED_CHAIN}"
                )
            }
            Rule::RefuseUpstreamUnmarked { set, uid, mark } => {
                let (daddr, name) = (set.family.daddr(), set.name());
                write!(
                    f,
                    "meta skuid {uid} meta mark != {mark:#010x} {daddr} . meta l4proto . th \
                     dport @{name} goto {REFUSED_CHAIN}"
                )
            }
            Rule::RefuseIcmpFromProcesses(family) => write!(
                f,
                "meta l4proto {} meta skuid >= 0 oif != \"lo\" goto {REFUSED_CHAIN}",
                match family {
                    Family::V4 => "icmp",
                    Family::V6 => "ipv6-icmp",
                }
            ),
            Rule::Fence(ScopeMatch::Cgroup(c)) => write!(
                f,
                "socket cgroupv2 level {} \"{}\" goto {OUTPUT_CHAIN} comment \"{}\"",
                c.level, c.path, c.path
            ),
            Rule::Fence(m) => write!(f, "{m} goto {OUTPUT_CHAIN}"),
            Rule::FromBridge(iface) => write!(f, "iifname \"{iface}\" goto {FROM_BRIDGE_CHAIN}"),
            Rule::JumpGuardFromPort(port) => write!(f, "th sport {port} jump {GUARD_CHAIN}"),
            Rule::JumpGuardToUpstream(set) => {
                let (daddr, name) = (set.family.daddr(), set.name());
                write!(
                    f,
                    "{daddr} . meta l4proto . th dport @{name} jump {GUARD_CHAIN}"
                )
            }
            Rule::AcceptGuardQuery { to, proto } => write!(
                f,
                "{} {} {} dport {} accept",
                Family::of(to.ip()).daddr(),
                to.ip(),
                proto.name(),
                to.port()
            ),
            Rule::DropSpoofedFrom(iface) => {
                write!(f, "iifname \"{iface}\" fib saddr . iif oif missing drop")
            }
            // As nft lists it (the address's leading zero dropped).
            Rule::DropBridgeGroupFrames => f.write_str("@ll,0,40 0x180c20000 drop"),
            Rule::RefuseIcmpv6(t) => write!(f, "icmpv6 type {} goto {REFUSED_CHAIN}", t.name()),
            Rule::FenceIgmp => write!(f, "meta l4proto igmp goto {OUTPUT_CHAIN}"),
            Rule::FenceIcmpv6(t) => write!(f, "icmpv6 type {} goto {OUTPUT_CHAIN}", t.name()),
            Rule::RefuseGuardQueryToOtherSockets { to, proto, mark } => {
                if !to.ip().is_unspecified() {
                    write!(f, "{} {} ", Family::of(to.ip()).daddr(), to.ip())?;
                }
                write!(
                    f,
                    "{} dport {} socket mark != {mark:#010x} goto {REFUSED_CHAIN}",
                    proto.name(),
                    to.port()
                )
            }
            Rule::RefuseRepliesOut => {
                write!(f, "ct direction reply oif != \"lo\" goto {REFUSED_CHAIN}")
            }
            Rule::AcceptEstablished => f.write_str("ct state established,related accept"),
            Rule::AcceptLoopback => f.write_str("oif \"lo\" accept"),
            Rule::RefuseForeignSourceToHost => {
                write!(
                    f,
                    "oif \"lo\" meta skuid >= 0 fib saddr type != local goto {REFUSED_CHAIN}"
                )
            }
            Rule::RefuseForeignSource => write!(
                f,
                "meta skuid >= 0 fib saddr type != local fib saddr type != broadcast \
                 goto {REFUSED_CHAIN}"
            ),
            Rule::AcceptIcmpv6(t) => write!(f, "icmpv6 type {} accept", t.name()),
            Rule::AcceptMldReport => write!(
                f,
                "icmpv6 type {} {MLD_REPORT_LIMIT} accept",
                Icmpv6Type::Mld2ListenerReport.name()
            ),
            Rule::AcceptDhcpClient(family) => {
                let (sport, dport) = dhcp_ports(*family);
                let (daddr, server) = (family.daddr(), dhcp_servers(*family));
                write!(
                    f,
                    "{daddr} {server} udp sport {sport} udp dport {dport} \
                     meta length <= {DHCP_MAX_LENGTH} {DHCP_CLIENT_LIMIT} accept"
                )
            }
            Rule::RefuseDaddrIn(set) => {
                let (daddr, name) = (set.family.daddr(), set.name());
                write!(f, "{daddr} @{name} counter goto {REFUSED_CHAIN}")
            }
            Rule::AcceptTupleIn(set) => {
                let (daddr, name) = (set.family.daddr(), set.name());
                write!(f, "{daddr} . meta l4proto . th dport @{name} accept")
            }
            Rule::AcceptTupleFromGuard { set, mark, uid } => {
                let (daddr, name) = (set.family.daddr(), set.name());
                if let Some(mark) = mark {
                    write!(f, "meta mark {mark:#010x} ")?;
                }
                write!(
                    f,
                    "meta skuid {uid} {daddr} . meta l4proto . th dport @{name} accept"
                )
            }
            Rule::RefuseService(proto, port) => write!(
                f,
                "meta l4proto {} th dport {port} goto {REFUSED_CHAIN}",
                proto.name()
            ),
            Rule::GotoRefused => write!(f, "goto {REFUSED_CHAIN}"),
            Rule::Log(log) => {
                write!(
                    f,
                    "limit rate {} burst {} packets log prefix \"{}\"",
                    log.rate, log.burst, log.prefix
                )?;
                match log.group {
                    Some(group) => write!(f, " group {group}"),
                    None => Ok(()),
                }
            }
            Rule::CountFamily(family) => write!(f, "meta nfproto {} counter", family.nfproto()),
            Rule::DropForeignSource(arrival) => {
                write!(f, "{} fib saddr type != local drop", arrival.nft_match())
            }
            Rule::ResetTcp => write!(
                f,
                "{} meta l4proto tcp meta priority != 0:{ICMP_ANSWER_PRIORITY:x} reject with tcp reset",
                Arrival::Sent.nft_match()
            ),
            Rule::Refuse(Action::Reject | Action::Audit) => {
                f.write_str("reject with icmpx admin-prohibited")
            }
            Rule::Refuse(Action::Drop) => f.write_str("drop"),
            Rule::AuditAccept { group } => write!(
                f,
                "meta nfproto @{AUDIT_WINDOW_SET} log prefix \"{AUDIT_PREFIX}\" group {group} \
                 accept comment \"{AUDIT_COMMENT}\""
            ),
            Rule::RecordFlow { group } => {
                write!(f, "ct state new log prefix \"{FLOW_PREFIX}\" group {group}")
            }
        }
    }
}

/// Source and destination port of the DHCP client's requests.
pub fn dhcp_ports(family: Family) -> (u16, u16) {
    match family {
        Family::V4 => (68, 67),
        Family::V6 => (546, 547),
    }
}

/// Where a DHCP client sends what meets the output hook: the limited broadcast address, and
/// All_DHCP_Relay_Agents_and_Servers for DHCPv6. Unicast renewals are not among them: they
/// need the server's address in the policy (README, "essentials").
pub fn dhcp_servers(family: Family) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::BROADCAST),
        Family::V6 => IpAddr::V6(Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 1, 2)),
    }
}

/// The whole table as a value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "RulesetRecord")]
pub struct Ruleset {
    /// All eight sets, in [`SetId::ALL`] order.
    pub sets: Vec<Set>,
    /// The base chain on the output hook (policy drop).
    pub output: Vec<Rule>,
    /// Where refused packets are logged, counted and rejected or dropped.
    pub refused: Vec<Rule>,
    /// [`GUARD_CHAIN`]: in guard mode the guard's own protections; empty (no chain) otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub guard: Vec<Rule>,
    /// With a `scope:`, the chains that send the scope's packets to `output` (then a regular
    /// chain); `None`: `output` is on the hook and fences everything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<ScopeChains>,
    /// `learn`'s audit window ([`AUDIT_WINDOW_SET`]); `None` in every other table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditWindow>,
}

/// The audit window's set as a table holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditWindow {
    /// How long the window stays open without a renewal: the elements' timeout. `None`: the
    /// set is empty (the window closed).
    pub open_for_ms: Option<u64>,
}

impl AuditWindow {
    /// `type nf_proto; flags timeout`: what nft says of the set besides its elements.
    pub const DEFINITION: &'static str = "type nf_proto; flags timeout";
}

impl fmt::Display for AuditWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "\tset {AUDIT_WINDOW_SET} {{")?;
        writeln!(f, "\t\ttype nf_proto")?;
        writeln!(f, "\t\tflags timeout")?;
        if let Some(ms) = self.open_for_ms {
            writeln!(
                f,
                "\t\telements = {{ ipv4 timeout {ms}ms expires {ms}ms,\n\t\t\t\
                 ipv6 timeout {ms}ms expires {ms}ms }}"
            )?;
        }
        writeln!(f, "\t}}\n")
    }
}

/// The chains of a scoped table besides the fence. Those without rules are left out of the
/// table (an empty base chain would cost every packet of its hook a traversal for nothing).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScopeChains {
    /// [`SCOPE_OUTPUT_CHAIN`]: in guard mode the jumps to [`GUARD_CHAIN`], then one
    /// [`Rule::Fence`] per uid, gid and cgroup of the scope, then [`Rule::FenceIgmp`] and a
    /// [`Rule::FenceIcmpv6`] per MLD report type. (A generation recorded before
    /// [`GUARD_CHAIN`] holds the guard's protections here, first.)
    #[serde(default)]
    pub output: Vec<Rule>,
    /// [`SCOPE_FORWARD_CHAIN`]: a [`Rule::RefuseIcmpv6`] per link-scoped type, then one
    /// [`Rule::Fence`] per listed interface.
    #[serde(default)]
    pub forward: Vec<Rule>,
    /// [`SCOPE_INPUT_CHAIN`]: in guard mode a [`Rule::RefuseGuardQueryToOtherSockets`] per
    /// listen address and protocol, then one [`Rule::FromBridge`] per listed interface.
    #[serde(default)]
    pub input: Vec<Rule>,
    /// [`FROM_BRIDGE_CHAIN`].
    #[serde(default)]
    pub from_bridge: Vec<Rule>,
    /// [`SCOPE_PREROUTING_CHAIN`]: one [`Rule::DropSpoofedFrom`] per listed interface.
    #[serde(default)]
    pub prerouting: Vec<Rule>,
}

/// A [`Ruleset`] as a generation records it. A generation recorded while only a scoped table
/// had [`GUARD_CHAIN`] holds that chain's rules in its scope (`scope.guard`): read into
/// [`Ruleset::guard`], where they are now, so that its rollback makes the chain its jumps need.
#[derive(Deserialize)]
struct RulesetRecord {
    sets: Vec<Set>,
    output: Vec<Rule>,
    refused: Vec<Rule>,
    #[serde(default)]
    guard: Vec<Rule>,
    #[serde(default)]
    scope: Option<ScopeRecord>,
    #[serde(default)]
    audit: Option<AuditWindow>,
}

#[derive(Deserialize)]
struct ScopeRecord {
    #[serde(flatten)]
    chains: ScopeChains,
    #[serde(default)]
    guard: Vec<Rule>,
}

impl From<RulesetRecord> for Ruleset {
    fn from(r: RulesetRecord) -> Ruleset {
        let (scope, mut guard) = match r.scope {
            Some(s) => (Some(s.chains), s.guard),
            None => (None, Vec::new()),
        };
        if !r.guard.is_empty() {
            guard = r.guard;
        }
        Ruleset {
            sets: r.sets,
            output: r.output,
            refused: r.refused,
            guard,
            scope,
            audit: r.audit,
        }
    }
}

impl Ruleset {
    pub fn set(&self, id: SetId) -> Option<&Set> {
        self.sets.iter().find(|s| s.id == id)
    }

    pub fn element_count(&self) -> usize {
        self.sets.iter().map(|s| s.elements.len()).sum()
    }

    /// Every chain of the table, in the order they are made (a chain exists before any rule
    /// goes to it: the batch makes all of them before the first rule).
    pub fn chains(&self) -> Vec<ChainSpec<'_>> {
        let base = |hook, policy| Some(BaseChain { hook, policy });
        let mut chains = vec![
            ChainSpec {
                name: OUTPUT_CHAIN,
                base: match self.scope {
                    None => base(Hook::Output, ChainPolicy::Drop),
                    Some(_) => None,
                },
                rules: &self.output,
            },
            ChainSpec {
                name: REFUSED_CHAIN,
                base: None,
                rules: &self.refused,
            },
        ];
        if !self.guard.is_empty() {
            chains.push(ChainSpec {
                name: GUARD_CHAIN,
                base: None,
                rules: &self.guard,
            });
        }
        if let Some(scope) = &self.scope {
            let scoped = [
                (FROM_BRIDGE_CHAIN, None, &scope.from_bridge),
                (
                    SCOPE_OUTPUT_CHAIN,
                    base(Hook::Output, ChainPolicy::Accept),
                    &scope.output,
                ),
                (
                    SCOPE_FORWARD_CHAIN,
                    base(Hook::Forward, ChainPolicy::Accept),
                    &scope.forward,
                ),
                (
                    SCOPE_INPUT_CHAIN,
                    base(Hook::Input, ChainPolicy::Accept),
                    &scope.input,
                ),
                (
                    SCOPE_PREROUTING_CHAIN,
                    base(Hook::Prerouting, ChainPolicy::Accept),
                    &scope.prerouting,
                ),
            ];
            chains.extend(
                scoped
                    .into_iter()
                    .filter(|(_, _, rules)| !rules.is_empty())
                    .map(|(name, base, rules)| ChainSpec { name, base, rules }),
            );
        }
        chains
    }

    /// The chain called `name`, if the table has it.
    pub fn chain(&self, name: &str) -> Option<ChainSpec<'_>> {
        self.chains().into_iter().find(|c| c.name == name)
    }

    /// How many rules the table has, all chains together.
    pub fn rule_count(&self) -> usize {
        self.chains().iter().map(|c| c.rules.len()).sum()
    }

    /// nft text that replaces the table atomically when loaded with `nft -f` (the same
    /// transaction `apply` sends): create-if-missing, delete, then the new table.
    pub fn to_nft(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Ruleset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "table inet {TABLE}")?;
        writeln!(f, "delete table inet {TABLE}")?;
        writeln!(f, "table inet {TABLE} {{")?;
        for set in &self.sets {
            write!(f, "{set}")?;
        }
        if let Some(window) = &self.audit {
            write!(f, "{window}")?;
        }
        let chains = self.chains();
        for (i, chain) in chains.iter().enumerate() {
            writeln!(f, "\tchain {} {{", chain.name)?;
            if let Some(base) = chain.base {
                let policy = match base.policy {
                    ChainPolicy::Accept => "accept",
                    ChainPolicy::Drop => "drop",
                };
                writeln!(
                    f,
                    "\t\ttype filter hook {} priority {}; policy {policy};",
                    base.hook.name(),
                    base.hook.priority_name()
                )?;
            }
            for rule in chain.rules {
                writeln!(f, "\t\t{rule}")?;
            }
            if i + 1 < chains.len() {
                writeln!(f, "\t}}\n")?;
            } else {
                writeln!(f, "\t}}")?;
            }
        }
        writeln!(f, "}}")
    }
}

impl fmt::Display for Set {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "\tset {} {{", self.id.name())?;
        writeln!(f, "\t\ttype {}", self.id.nft_type())?;
        let flags = self.id.flag_names();
        if !flags.is_empty() {
            writeln!(f, "\t\tflags {}", flags.join(","))?;
        }
        if !self.elements.is_empty() {
            // Element by element into the formatter: a generation records the text of sets
            // of 10,000 elements, which a String per element made a fifth of its cost.
            f.write_str("\t\telements = { ")?;
            let mut separator = "";
            let mut item = |f: &mut fmt::Formatter<'_>, text: &dyn fmt::Display| {
                write!(f, "{separator}{text}")?;
                separator = ",\n\t\t\t";
                Ok::<(), fmt::Error>(())
            };
            match &self.elements {
                Elements::Networks(nets) => nets.iter().try_for_each(|n| item(f, &NetText(n)))?,
                Elements::Tuples(ts) => ts.iter().try_for_each(|t| item(f, &TupleText(t)))?,
                Elements::Timed(ts) => ts.iter().try_for_each(|t| item(f, &TimedText(t)))?,
            }
            f.write_str(" }\n")?;
        }
        writeln!(f, "\t}}\n")
    }
}

/// A host network prints as its address, as nft itself does.
pub fn fmt_net(net: &IpNet) -> String {
    NetText(net).to_string()
}

pub fn fmt_tuple(t: &Tuple) -> String {
    TupleText(t).to_string()
}

/// `tuple timeout 610s expires 610s`: nft resets an element's expiry only when told both.
pub fn fmt_timed(t: &Timed) -> String {
    TimedText(t).to_string()
}

/// [`fmt_net`]'s text, written where it goes.
struct NetText<'a>(&'a IpNet);

impl fmt::Display for NetText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let net = self.0;
        if net.prefix_len() == net.max_prefix_len() {
            write!(f, "{}", net.addr())
        } else {
            write!(f, "{net}")
        }
    }
}

/// [`fmt_tuple`]'s text, written where it goes.
struct TupleText<'a>(&'a Tuple);

impl fmt::Display for TupleText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.0;
        write!(f, "{} . {} . {}", NetText(&t.net), t.proto.name(), t.ports)
    }
}

/// [`fmt_timed`]'s text, written where it goes.
struct TimedText<'a>(&'a Timed);

impl fmt::Display for TimedText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.0;
        write!(f, "{}", TupleText(&t.tuple))?;
        if let Some(ms) = t.timeout_ms {
            let expires = t.expires_ms.unwrap_or(ms);
            write!(f, " timeout {ms}ms expires {expires}ms")?;
        }
        if let Some(name) = &t.name {
            // Names are DNS names; a hand-added comment read back may hold anything.
            f.write_str(" comment \"")?;
            for c in name.chars() {
                f.write_char(if matches!(c, '"' | '\\') { '_' } else { c })?;
            }
            f.write_str("\"")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_ids_are_distinct_and_named() {
        let names: std::collections::BTreeSet<String> =
            SetId::ALL.iter().map(|s| s.name()).collect();
        assert_eq!(names.len(), 8);
        for id in SetId::ALL {
            assert_eq!(SetId::from_name(&id.name()), Some(id));
        }
        assert_eq!(
            SetId::new(SetRole::Resolved, Family::V6).name(),
            "resolved6"
        );
        assert_eq!(SetId::from_name("nope"), None);
    }

    #[test]
    fn renders_every_rule_shape_as_nft_writes_it() {
        let v4 = |role| SetId::new(role, Family::V4);
        let cases = [
            (
                Rule::AcceptEstablished,
                "ct state established,related accept",
            ),
            (Rule::AcceptLoopback, "oif \"lo\" accept"),
            (
                Rule::RefuseForeignSourceToHost,
                "oif \"lo\" meta skuid >= 0 fib saddr type != local goto refused",
            ),
            (
                Rule::RefuseForeignSource,
                "meta skuid >= 0 fib saddr type != local fib saddr type != broadcast goto refused",
            ),
            (
                Rule::RefuseUnmarkedFromGuardPort {
                    from: "127.0.0.53:53".parse().unwrap(),
                    proto: L4Proto::Udp,
                    mark: 0x6500_0000,
                },
                "ip saddr 127.0.0.53 udp sport 53 meta mark != 0x65000000 goto refused",
            ),
            (
                Rule::RefuseUnmarkedFromGuardPort {
                    from: "[::1]:5353".parse().unwrap(),
                    proto: L4Proto::Tcp,
                    mark: 0x1e00,
                },
                "ip6 saddr ::1 tcp sport 5353 meta mark != 0x00001e00 goto refused",
            ),
            (
                Rule::RefuseUnmarkedFromGuardPort {
                    from: "0.0.0.0:53".parse().unwrap(),
                    proto: L4Proto::Udp,
                    mark: 0x1e00,
                },
                "udp sport 53 meta mark != 0x00001e00 goto refused",
            ),
            (
                Rule::RefuseIcmpFromProcesses(Family::V4),
                "meta l4proto icmp meta skuid >= 0 oif != \"lo\" goto refused",
            ),
            (
                Rule::RefuseIcmpFromProcesses(Family::V6),
                "meta l4proto ipv6-icmp meta skuid >= 0 oif != \"lo\" goto refused",
            ),
            (
                Rule::RefuseOtherUidsFromGuardPort {
                    from: "127.0.0.53:53".parse().unwrap(),
                    proto: L4Proto::Tcp,
                    uid: 993,
                },
                "ip saddr 127.0.0.53 tcp sport 53 meta skuid != 993 goto refused",
            ),
            (
                Rule::RefuseOtherUidsFromGuardPort {
                    from: "[::]:53".parse().unwrap(),
                    proto: L4Proto::Udp,
                    uid: 0,
                },
                "udp sport 53 meta skuid != 0 goto refused",
            ),
            (
                Rule::RefuseUpstreamFromOtherUids {
                    set: v4(SetRole::Dns),
                    uid: 993,
                },
                "meta skuid != 993 ip daddr . meta l4proto . th dport @dns4 goto refused",
            ),
            (
                Rule::RefuseUpstreamUnmarked {
                    set: SetId::new(SetRole::Dns, Family::V6),
                    uid: 993,
                    mark: 0x6500_0000,
                },
                "meta skuid 993 meta mark != 0x65000000 ip6 daddr . meta l4proto . th dport @dns6 goto refused",
            ),
            (
                Rule::AcceptIcmpv6(Icmpv6Type::NdNeighborSolicit),
                "icmpv6 type nd-neighbor-solicit accept",
            ),
            (
                Rule::RefuseSourceRoute(SourceRoute::Ipv6RoutingHeader),
                "exthdr rt exists goto refused",
            ),
            (
                Rule::RefuseSourceRoute(SourceRoute::Ipv4Options),
                "ip hdrlength != 5 goto refused",
            ),
            (
                Rule::AcceptMldReport,
                "icmpv6 type mld2-listener-report limit rate 1 kbytes/minute burst 1500 bytes accept",
            ),
            (
                Rule::AcceptDhcpClient(Family::V4),
                "ip daddr 255.255.255.255 udp sport 68 udp dport 67 meta length <= 1500 limit rate 2 kbytes/minute burst 1500 bytes accept",
            ),
            (
                Rule::AcceptDhcpClient(Family::V6),
                "ip6 daddr ff02::1:2 udp sport 546 udp dport 547 meta length <= 1500 limit rate 2 kbytes/minute burst 1500 bytes accept",
            ),
            (
                Rule::RefuseDaddrIn(SetId::new(SetRole::Deny, Family::V6)),
                "ip6 daddr @deny6 counter goto refused",
            ),
            (
                Rule::AcceptTupleIn(v4(SetRole::Dns)),
                "ip daddr . meta l4proto . th dport @dns4 accept",
            ),
            (
                Rule::AcceptTupleFromGuard {
                    set: SetId::new(SetRole::Dns, Family::V6),
                    mark: Some(0x6500_0000),
                    uid: 993,
                },
                "meta mark 0x65000000 meta skuid 993 ip6 daddr . meta l4proto . th dport @dns6 accept",
            ),
            (
                Rule::AcceptTupleFromGuard {
                    set: SetId::new(SetRole::Dns, Family::V4),
                    mark: None,
                    uid: 993,
                },
                "meta skuid 993 ip daddr . meta l4proto . th dport @dns4 accept",
            ),
            (
                Rule::RefuseService(L4Proto::Udp, 853),
                "meta l4proto udp th dport 853 goto refused",
            ),
            (Rule::GotoRefused, "goto refused"),
            (Rule::JumpGuardFromPort(53), "th sport 53 jump guard"),
            (
                Rule::JumpGuardToUpstream(SetId::new(SetRole::Dns, Family::V6)),
                "ip6 daddr . meta l4proto . th dport @dns6 jump guard",
            ),
            (
                Rule::Log(LogSpec {
                    prefix: "X: ".into(),
                    group: Some(7),
                    rate: "3/minute".parse().unwrap(),
                    burst: 5,
                }),
                "limit rate 3/minute burst 5 packets log prefix \"X: \" group 7",
            ),
            (Rule::CountFamily(Family::V6), "meta nfproto ipv6 counter"),
            (
                Rule::Refuse(Action::Reject),
                "reject with icmpx admin-prohibited",
            ),
            (Rule::Refuse(Action::Drop), "drop"),
            (
                Rule::DropForeignSource(Arrival::Sent),
                "iif 0 fib saddr type != local drop",
            ),
            (
                Rule::DropForeignSource(Arrival::Loopback),
                "iif \"lo\" fib saddr type != local drop",
            ),
            (
                Rule::ResetTcp,
                "iif 0 meta l4proto tcp meta priority != 0:5 reject with tcp reset",
            ),
            (
                Rule::AuditAccept { group: 7 },
                "meta nfproto @audit_window log prefix \"EGRESS-AUDIT: \" group 7 accept comment \
                 \"audit: learn lets through what the policy refuses while audit_window holds its \
                 family\"",
            ),
            (
                Rule::RecordFlow { group: 8 },
                "ct state new log prefix \"EGRESS-FLOW: \" group 8",
            ),
            (Rule::DropBridgeGroupFrames, "@ll,0,40 0x180c20000 drop"),
            (
                Rule::RefuseRepliesOut,
                "ct direction reply oif != \"lo\" goto refused",
            ),
            (
                Rule::DropSpoofedFrom("docker0".parse().unwrap()),
                "iifname \"docker0\" fib saddr . iif oif missing drop",
            ),
            (
                Rule::DropSpoofedFrom("br-*".parse().unwrap()),
                "iifname \"br-*\" fib saddr . iif oif missing drop",
            ),
            (
                Rule::RefuseIcmpv6(Icmpv6Type::MldListenerReport),
                "icmpv6 type mld-listener-report goto refused",
            ),
            (Rule::FenceIgmp, "meta l4proto igmp goto output"),
            (
                Rule::FenceIcmpv6(Icmpv6Type::MldListenerDone),
                "icmpv6 type mld-listener-done goto output",
            ),
            (
                Rule::RefuseGuardQueryToOtherSockets {
                    to: "127.0.0.53:53".parse().unwrap(),
                    proto: L4Proto::Udp,
                    mark: 0x6500_0000,
                },
                "ip daddr 127.0.0.53 udp dport 53 socket mark != 0x65000000 goto refused",
            ),
            (
                Rule::RefuseGuardQueryToOtherSockets {
                    to: "[fd00::1]:5353".parse().unwrap(),
                    proto: L4Proto::Tcp,
                    mark: 0x1e00,
                },
                "ip6 daddr fd00::1 tcp dport 5353 socket mark != 0x00001e00 goto refused",
            ),
            (
                Rule::RefuseGuardQueryToOtherSockets {
                    to: "0.0.0.0:53".parse().unwrap(),
                    proto: L4Proto::Udp,
                    mark: 0x1e00,
                },
                "udp dport 53 socket mark != 0x00001e00 goto refused",
            ),
        ];
        for (rule, want) in cases {
            assert_eq!(rule.to_string(), want);
        }
    }

    #[test]
    fn renders_sets_with_flags_and_elements() {
        let set = Set {
            id: SetId::new(SetRole::Allow, Family::V4),
            elements: Elements::Tuples(vec![
                Tuple {
                    net: "203.0.113.0/28".parse().unwrap(),
                    proto: L4Proto::Tcp,
                    ports: PortRange::single(22),
                },
                Tuple {
                    net: "198.51.100.7/32".parse().unwrap(),
                    proto: L4Proto::Udp,
                    ports: PortRange {
                        first: 8000,
                        last: 8080,
                    },
                },
            ]),
        };
        let out = set.to_string();
        assert!(
            out.contains("type ipv4_addr . inet_proto . inet_service\n"),
            "{out}"
        );
        assert!(out.contains("flags interval\n"), "{out}");
        assert!(
            out.contains("203.0.113.0/28 . tcp . 22,\n\t\t\t198.51.100.7 . udp . 8000-8080 }"),
            "{out}"
        );

        let out = Set {
            id: SetId::new(SetRole::Resolved, Family::V6),
            elements: Elements::Tuples(vec![]),
        }
        .to_string();
        assert!(out.contains("flags timeout\n"), "{out}");
        assert!(!out.contains("elements"), "{out}");
    }
}
