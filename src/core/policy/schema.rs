//! The validated policy: what the planner, the daemon and the guard read, nothing left to
//! check; and the defaults of what a policy may leave out.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ipnet::IpNet;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::includes::AllowPreset;
use super::names::{DomainName, Wildcard};
use super::presets::Preset;
use super::scope::Scope;
use super::values::{PortRange, ProbeTarget, Rate, RateUnit};

/// The schema version this build reads.
pub const SCHEMA_VERSION: u32 = 1;

/// A validated policy: everything the planner needs, nothing left to check.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Policy {
    /// What unmatched traffic gets.
    pub action: Action,
    /// The local entries, then those of `include` the policy did not already have.
    pub allow: Vec<Allow>,
    /// The allow presets the policy includes, as written (their entries are in `allow`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub include: Vec<AllowPreset>,
    pub deny: Vec<Deny>,
    pub dns: Dns,
    pub log: Log,
    /// The host essentials that stay allowed (all of them unless the policy narrows the list).
    pub essentials: BTreeSet<Essential>,
    /// What `probe` checks besides the policy's own entries.
    pub probe: ProbeSettings,
    /// Who is fenced; `None`: the whole network namespace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<Scope>,
}

impl Policy {
    /// The deny entry that covers `addr`, if any.
    pub fn denied_by(&self, addr: IpAddr) -> Option<&Deny> {
        self.deny
            .iter()
            .find(|d| d.networks.iter().any(|n| n.contains(&addr)))
    }

    /// The distinct domain names the policy allows, in a stable order.
    pub fn domains(&self) -> BTreeSet<&DomainName> {
        self.allow
            .iter()
            .filter_map(|a| match &a.target {
                Target::Domain(d) => Some(d),
                Target::Wildcard(_) | Target::Cidr(_) => None,
            })
            .collect()
    }
}

/// The `probe:` section.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProbeSettings {
    /// Destinations that must be refused (a paste site, an attacker-simulation host).
    pub blocked: Vec<ProbeTarget>,
    /// Resolvers the host must not reach (DNS over UDP and TCP).
    pub rogue_resolvers: Vec<IpAddr>,
    /// A domain whose random subnames show whether DNS can carry data out.
    pub exfil_domain: Option<DomainName>,
}

/// Well-known public resolvers: an agent told to use one would bypass the allowed resolvers.
pub const DEFAULT_ROGUE_RESOLVERS: [&str; 6] = [
    "1.1.1.1",
    "8.8.8.8",
    "9.9.9.9",
    "2606:4700:4700::1111",
    "2001:4860:4860::8888",
    "2620:fe::fe",
];

/// What unmatched traffic gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Answer: a TCP reset to this host's connections, ICMP administratively prohibited
    /// otherwise; clients fail at once.
    Reject,
    /// Silently discard: clients hang until their own timeout.
    Drop,
    /// Log what would be refused and let it through: only `egress-fence learn` runs such a
    /// policy, for a bounded time (`apply` and `run` refuse it: a table that stays open is a
    /// fail-open). What `learn`'s table refuses once its window closes is rejected.
    Audit,
}

impl Action {
    /// What the table does with a refused packet: `audit` is `reject` once its window closes.
    pub fn refusal(self) -> Action {
        match self {
            Action::Audit => Action::Reject,
            other => other,
        }
    }
}

/// One allowed destination with its ports and protocol.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Allow {
    pub target: Target,
    pub ports: Vec<PortRange>,
    pub protocol: Protocol,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    Domain(DomainName),
    /// `*.example.com` or `**.example.com`: only the DNS guard can follow these, since no
    /// timer can resolve every name they cover.
    #[serde(rename = "domain")]
    Wildcard(Wildcard),
    Cidr(IpNet),
}

impl Target {
    /// Whether a query for `name` is allowed by this entry.
    pub fn matches(&self, name: &DomainName) -> bool {
        match self {
            Target::Domain(d) => d == name,
            Target::Wildcard(w) => w.matches(name),
            Target::Cidr(_) => false,
        }
    }
}

/// Denied networks, checked before anything is allowed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Deny {
    pub networks: Vec<IpNet>,
    /// Where the networks came from, for messages ("preset cloud-metadata", "cidr 10.0.0.0/8").
    pub origin: DenyOrigin,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DenyOrigin {
    Preset(Preset),
    Cidr,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Dns {
    /// The resolvers to ask and the only DNS destinations allowed. `None` means "the
    /// nameservers of resolv.conf", read when the policy is planned.
    pub resolvers: Option<Vec<IpAddr>>,
    /// The daemon re-resolves a name after its answer's TTL, clamped to these bounds.
    pub refresh_min: Duration,
    pub refresh_max: Duration,
    /// How long an address stays allowed after it was last seen in an answer (clients cache
    /// answers), and how long the last good answer survives a failing resolver.
    pub grace: Duration,
    /// `mode: guard`: egress-fence is the host's resolver. `None`: `mode: resolve`, names are
    /// resolved on a timer.
    pub guard: Option<GuardSettings>,
}

/// The DNS guard: where it listens, where it forwards allowed names, how it refuses the rest.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GuardSettings {
    pub listen: Vec<SocketAddr>,
    /// The resolvers the guard forwards to, and that only the guard may reach.
    pub upstream: Vec<IpAddr>,
    pub refuse_with: RefuseWith,
    /// The shortest time an answered address stays allowed, whatever its TTL (before grace).
    pub floor: Duration,
    /// The socket mark (`SO_MARK`) of the guard's upstream sockets: with its uid, what the
    /// table recognises the guard by. Only a holder of CAP_NET_ADMIN (or, since Linux 5.17,
    /// CAP_NET_RAW) can set a mark.
    pub mark: u32,
}

/// The DNS answer to a name outside the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RefuseWith {
    /// REFUSED: the client knows a policy said no, and tries no other server.
    Refused,
    /// NXDOMAIN: the name "does not exist"; some clients give up faster.
    Nxdomain,
}

pub const DEFAULT_GUARD_LISTEN: &str = "127.0.0.53:53";
pub const DEFAULT_FLOOR: Duration = Duration::from_secs(30);
/// `dns.mark` unless the policy says otherwise: bits no common tool uses (kube-proxy takes
/// 0x4000 and 0x8000, Cilium 0x0f00, Tailscale 0xff0000, Calico allocates upwards from
/// 0x10000, wg-quick and Istio match whole values), so that the guard's packets take the
/// routes and firewall paths of unmarked ones.
pub const DEFAULT_GUARD_MARK: u32 = 0x6500_0000;

pub const DEFAULT_REFRESH_MIN: Duration = Duration::from_secs(30);
pub const DEFAULT_REFRESH_MAX: Duration = Duration::from_secs(3600);
pub const DEFAULT_GRACE: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Log {
    pub prefix: String,
    /// NFLOG group of refused packets; without one, refusals go to the kernel log.
    pub group: Option<u16>,
    pub rate: Rate,
    pub burst: u32,
}

pub const DEFAULT_LOG_PREFIX: &str = "EGRESS-DROP: ";
pub(super) const DEFAULT_RATE: Rate = Rate {
    count: 10,
    unit: RateUnit::Second,
};
pub(super) const DEFAULT_BURST: u32 = 20;

/// Transport protocols the allow sets distinguish.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Tcp,
    Udp,
    /// Both TCP and UDP.
    Any,
}

/// A single IP protocol number as the kernel sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum L4Proto {
    Tcp,
    Udp,
}

impl L4Proto {
    pub fn number(self) -> u8 {
        match self {
            L4Proto::Tcp => 6,
            L4Proto::Udp => 17,
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            6 => Some(L4Proto::Tcp),
            17 => Some(L4Proto::Udp),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            L4Proto::Tcp => "tcp",
            L4Proto::Udp => "udp",
        }
    }
}

impl Protocol {
    pub fn l4protos(self) -> &'static [L4Proto] {
        match self {
            Protocol::Tcp => &[L4Proto::Tcp],
            Protocol::Udp => &[L4Proto::Udp],
            Protocol::Any => &[L4Proto::Tcp, L4Proto::Udp],
        }
    }
}

/// The essentials a host needs to keep working behind the boundary.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum Essential {
    /// Traffic to the loopback interface.
    Loopback,
    /// Replies and related traffic (ICMP errors) of connections already accepted.
    Established,
    /// ICMPv6 neighbour discovery, router solicitation and MLD reports (within a byte
    /// budget: any process chooses the groups they report).
    Icmpv6Nd,
    /// The DHCPv4 client's broadcasts from a plain socket (UDP 68 -> 255.255.255.255:67),
    /// rate-limited; not unicast renewals.
    Dhcpv4,
    /// The DHCPv6 client (UDP 546 -> ff02::1:2 port 547), rate-limited.
    Dhcpv6,
}

impl Essential {
    pub const ALL: [Essential; 5] = [
        Essential::Loopback,
        Essential::Established,
        Essential::Icmpv6Nd,
        Essential::Dhcpv4,
        Essential::Dhcpv6,
    ];
}

impl Allow {
    /// The entry on one line, as `check` lists an include's entries and `replay` the unused
    /// ones: `registry.npmjs.org tcp 443`, `192.0.2.0/24 tcp+udp 53, 8000-8080`.
    pub fn describe(&self) -> String {
        let target = match &self.target {
            Target::Domain(d) => d.to_string(),
            Target::Wildcard(w) => w.to_string(),
            Target::Cidr(n) => n.to_string(),
        };
        let protocol = match self.protocol {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Any => "tcp+udp",
        };
        let ports: Vec<String> = self.ports.iter().map(|p| p.to_string()).collect();
        format!("{target} {protocol} {}", ports.join(", "))
    }
}

impl Deny {
    pub fn describe(&self) -> String {
        match self.origin {
            DenyOrigin::Preset(p) => format!("preset {}", p.name()),
            DenyOrigin::Cidr => format!("network {}", self.networks[0]),
        }
    }
}
