//! The policy file: YAML schema, validation and the deny presets.
//!
//! Every check that concerns a single value lives in that value's `Deserialize` impl, so that
//! serde_yaml attaches the line and column of the offending value to the error. Checks that
//! relate two parts of the policy run afterwards and locate their subject in the source text.

use std::collections::BTreeSet;
use std::fmt;
use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The schema version this build reads.
pub const SCHEMA_VERSION: u32 = 1;

/// A validated policy: everything the planner needs, nothing left to check.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Policy {
    /// What unmatched traffic gets.
    pub action: Action,
    pub allow: Vec<Allow>,
    pub deny: Vec<Deny>,
    pub dns: Dns,
    pub log: Log,
    /// The host essentials that stay allowed (all of them unless the policy narrows the list).
    pub essentials: BTreeSet<Essential>,
    /// What `probe` checks besides the policy's own entries.
    pub probe: ProbeSettings,
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

/// `HOST:PORT`: a name, an IPv4 address or a bracketed IPv6 address, and a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTarget {
    pub host: ProbeHost,
    pub port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeHost {
    Name(DomainName),
    Addr(IpAddr),
}

impl fmt::Display for ProbeTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            ProbeHost::Name(n) => write!(f, "{n}:{}", self.port),
            ProbeHost::Addr(IpAddr::V6(a)) => write!(f, "[{a}]:{}", self.port),
            ProbeHost::Addr(a) => write!(f, "{a}:{}", self.port),
        }
    }
}

impl Serialize for ProbeTarget {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl FromStr for ProbeTarget {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let hint = "write HOST:PORT, e.g. \"paste.example:443\", \"203.0.113.9:80\" or \
                    \"[2001:db8::9]:443\"";
        let (host, port) = s
            .trim()
            .rsplit_once(':')
            .ok_or_else(|| format!("`{s}` has no port; {hint}"))?;
        let port = parse_port(port).map_err(|e| format!("{e} (in `{s}`)"))?;
        let host = if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            ProbeHost::Addr(IpAddr::V6(
                v6.parse()
                    .map_err(|_| format!("`{v6}` is not an IPv6 address; {hint}"))?,
            ))
        } else if let Ok(addr) = host.parse::<std::net::Ipv4Addr>() {
            ProbeHost::Addr(IpAddr::V4(addr))
        } else if host.contains(':') {
            return Err(format!("`{s}`: put an IPv6 address in brackets; {hint}"));
        } else {
            ProbeHost::Name(host.parse()?)
        };
        Ok(ProbeTarget { host, port })
    }
}

impl<'de> Deserialize<'de> for ProbeTarget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Answer with ICMP administratively prohibited: clients fail at once.
    Reject,
    /// Silently discard: clients hang until their own timeout.
    Drop,
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

/// A name pattern: `*.SUFFIX` stands for exactly one more label, `**.SUFFIX` for one or more.
/// Neither covers SUFFIX itself.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Wildcard {
    pub suffix: DomainName,
    pub any_depth: bool,
}

impl Wildcard {
    pub fn matches(&self, name: &DomainName) -> bool {
        let head = name
            .as_str()
            .strip_suffix(self.suffix.as_str())
            .and_then(|h| h.strip_suffix('.'));
        match head {
            Some(head) if !head.is_empty() => self.any_depth || !head.contains('.'),
            _ => false,
        }
    }
}

impl fmt::Display for Wildcard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stars = if self.any_depth { "**" } else { "*" };
        write!(f, "{stars}.{}", self.suffix)
    }
}

impl Serialize for Wildcard {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Shared hosting suffixes where anyone can own a name: a wildcard over one of them lets
/// anybody's server in.
const SHARED_SUFFIXES: [&str; 30] = [
    "amazonaws.com",
    "s3.amazonaws.com",
    "cloudfront.net",
    "elasticbeanstalk.com",
    "azurewebsites.net",
    "blob.core.windows.net",
    "cloudapp.net",
    "azureedge.net",
    "appspot.com",
    "googleusercontent.com",
    "storage.googleapis.com",
    "web.app",
    "firebaseapp.com",
    "run.app",
    "herokuapp.com",
    "github.io",
    "githubusercontent.com",
    "gitlab.io",
    "vercel.app",
    "netlify.app",
    "pages.dev",
    "workers.dev",
    "r2.dev",
    "fly.dev",
    "onrender.com",
    "railway.app",
    "ngrok.io",
    "ngrok-free.app",
    "trycloudflare.com",
    "glitch.me",
];

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
    pub guard: Option<Guard>,
}

/// The DNS guard: where it listens, where it forwards allowed names, how it refuses the rest.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Guard {
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RefuseWith {
    /// REFUSED: the client knows a policy said no, and tries no other server.
    Refused,
    /// NXDOMAIN: the name "does not exist"; some clients give up faster.
    Nxdomain,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum DnsMode {
    Resolve,
    Guard,
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
const DEFAULT_RATE: Rate = Rate {
    count: 10,
    unit: RateUnit::Second,
};
const DEFAULT_BURST: u32 = 20;
/// The kernel keeps at most 127 bytes of a log prefix (NF_LOG_PREFIXLEN with its NUL); a
/// longer one is refused with ERANGE (measured: 127 bytes pass, 128 do not).
const MAX_LOG_PREFIX: usize = 127;

/// The largest policy file read. Real policies are a few KiB; the YAML parser's cost grows
/// faster than the text, and the daemon must never spend long on a file someone else wrote.
pub const MAX_POLICY_BYTES: u64 = 1024 * 1024;

/// The deepest nesting of `[` and `{` a policy may have. The schema needs three levels; the
/// YAML parser's time grows with the square of the depth (240 KB of `[` took 12 s).
pub const MAX_POLICY_NESTING: usize = 32;

/// Fault injection for tests: with this set to 1 the parser does not check the log limit
/// against the kernel's, so a test can hand the daemon a policy the kernel refuses, standing
/// for a kernel limit this build does not know (the daemon must still never adopt it).
pub const UNCHECKED_KERNEL_LIMITS_ENV: &str = "EGRESS_FENCE_TEST_UNCHECKED_KERNEL_LIMITS";

/// Whether the kernel accepts a packet limit of `rate` per `unit_seconds` with `burst`, as
/// nft_limit_init (net/netfilter/nft_limit.c) checks it: the unit in nanoseconds, the rate
/// plus the burst, and the bucket's size, nanoseconds per packet times the burst, must each
/// fit in 64 bits, or the rule is refused with EOVERFLOW. Measured on 6.18: `1/day burst
/// 213503` passes and `213504` does not; `18446744073709551595/second burst 20` passes and
/// one more does not. A burst of 0 would silently become the kernel's default of 5.
pub fn kernel_accepts_limit(rate: u64, unit_seconds: u64, burst: u32) -> bool {
    let Some(nsecs) = unit_seconds.checked_mul(1_000_000_000) else {
        return false;
    };
    rate > 0
        && burst > 0
        && rate.checked_add(u64::from(burst)).is_some()
        && (nsecs / rate).checked_mul(u64::from(burst)).is_some()
}

/// Transport protocols the allow sets distinguish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
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

/// Named lists of networks to deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// Cloud instance metadata services and their neighbours: AWS, GCP, Azure, OCI, Alibaba, ...
    CloudMetadata,
    /// RFC 1918, carrier-grade NAT and IPv6 unique local addresses.
    PrivateNetworks,
    /// Well-known public DNS-over-HTTPS (and DNS-over-TLS) resolvers; implied in guard mode.
    DnsOverHttps,
}

impl Preset {
    pub fn name(self) -> &'static str {
        match self {
            Preset::CloudMetadata => "cloud-metadata",
            Preset::PrivateNetworks => "private-networks",
            Preset::DnsOverHttps => "dns-over-https",
        }
    }

    /// What a destination in this preset is, for messages about refused packets.
    pub fn describe(self) -> &'static str {
        match self {
            Preset::CloudMetadata => "a cloud metadata service",
            Preset::PrivateNetworks => "a private network",
            Preset::DnsOverHttps => "a public DNS-over-HTTPS resolver",
        }
    }

    /// The preset whose networks hold `addr`, if any.
    pub fn containing(addr: IpAddr) -> Option<Preset> {
        [
            Preset::CloudMetadata,
            Preset::PrivateNetworks,
            Preset::DnsOverHttps,
        ]
        .into_iter()
        .find(|p| p.networks().iter().any(|n| n.contains(&addr)))
    }

    pub fn networks(self) -> Vec<IpNet> {
        let list: &[&str] = match self {
            // 169.254.0.0/16: every provider's link-local metadata (AWS, GCP, Azure, DO, ...)
            // and the AWS DNS and time endpoints beside it; fd00:ec2::/32 is its IPv6 image,
            // AWS's instance services (IMDS ::254, DNS ::253, time ::123, EKS pod identity
            // ::23; DNS to a listed resolver there is accepted before the deny list);
            // fd20:ce::254 GCP's IPv6 metadata server; fd00:42::42 Scaleway's; 100.100.100.200
            // Alibaba; 192.0.0.192 Oracle (legacy); 168.63.129.16 Azure's wireserver.
            Preset::CloudMetadata => &[
                "169.254.0.0/16",
                "fd00:ec2::/32",
                "fd20:ce::254/128",
                "fd00:42::42/128",
                "100.100.100.200/32",
                "192.0.0.192/32",
                "168.63.129.16/32",
            ],
            Preset::PrivateNetworks => &[
                "10.0.0.0/8",
                "172.16.0.0/12",
                "192.168.0.0/16",
                "100.64.0.0/10",
                "fc00::/7",
            ],
            // Answers from these would bypass the guard: HTTPS to them looks like any other
            // HTTPS. The well-known anycast addresses of public resolvers, by operator.
            Preset::DnsOverHttps => &[
                // Cloudflare (1.1.1.1, families, cloudflare-dns.com)
                "1.1.1.1/32",
                "1.0.0.1/32",
                "1.1.1.2/32",
                "1.0.0.2/32",
                "1.1.1.3/32",
                "1.0.0.3/32",
                "104.16.248.249/32",
                "104.16.249.249/32",
                "2606:4700:4700::1111/128",
                "2606:4700:4700::1001/128",
                "2606:4700:4700::1112/128",
                "2606:4700:4700::1002/128",
                "2606:4700:4700::1113/128",
                "2606:4700:4700::1003/128",
                // Google
                "8.8.8.8/32",
                "8.8.4.4/32",
                "2001:4860:4860::8888/128",
                "2001:4860:4860::8844/128",
                // Quad9
                "9.9.9.9/32",
                "9.9.9.10/32",
                "9.9.9.11/32",
                "149.112.112.112/32",
                "149.112.112.10/32",
                "149.112.112.11/32",
                "2620:fe::fe/128",
                "2620:fe::9/128",
                "2620:fe::10/128",
                "2620:fe::11/128",
                // OpenDNS / Cisco Umbrella
                "208.67.222.222/32",
                "208.67.220.220/32",
                "208.67.222.123/32",
                "208.67.220.123/32",
                "146.112.41.2/32",
                "2620:119:35::35/128",
                "2620:119:53::53/128",
                // AdGuard
                "94.140.14.14/32",
                "94.140.15.15/32",
                "94.140.14.15/32",
                "94.140.15.16/32",
                "94.140.14.140/32",
                "94.140.14.141/32",
                "2a10:50c0::ad1:ff/128",
                "2a10:50c0::ad2:ff/128",
                // CleanBrowsing
                "185.228.168.9/32",
                "185.228.169.9/32",
                "185.228.168.10/32",
                "185.228.169.11/32",
                "185.228.168.168/32",
                "185.228.169.168/32",
                // NextDNS, Control D and Mullvad serve DNS from whole networks
                "45.90.28.0/24",
                "45.90.30.0/24",
                "76.76.2.0/24",
                "76.76.10.0/24",
                "194.242.2.0/28",
                // DNS.SB, Alibaba, DNSPod, 114DNS, Comodo, Yandex
                "185.222.222.222/32",
                "45.11.45.11/32",
                "223.5.5.5/32",
                "223.6.6.6/32",
                "2400:3200::1/128",
                "2400:3200:baba::1/128",
                "119.29.29.29/32",
                "1.12.12.12/32",
                "120.53.53.53/32",
                "114.114.114.114/32",
                "114.114.115.115/32",
                "8.26.56.26/32",
                "8.20.247.20/32",
                "77.88.8.8/32",
                "77.88.8.1/32",
            ],
        };
        list.iter()
            .map(|s| s.parse().expect("preset networks are valid literals"))
            .collect()
    }
}

/// An inclusive range of ports; a single port has `first == last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    pub const ALL: PortRange = PortRange {
        first: 0,
        last: u16::MAX,
    };

    pub fn single(port: u16) -> Self {
        PortRange {
            first: port,
            last: port,
        }
    }

    pub fn is_single(self) -> bool {
        self.first == self.last
    }

    /// How many ports the range holds.
    pub fn width(self) -> u32 {
        u32::from(self.last) - u32::from(self.first) + 1
    }

    pub fn ports(self) -> impl Iterator<Item = u16> {
        self.first..=self.last
    }
}

/// Domain entries become one set element per address and port, refreshed as answers change;
/// wider ranges belong in `cidr:` entries.
pub const MAX_DOMAIN_PORT_RANGE: u32 = 256;

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_single() {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

impl Serialize for PortRange {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

const PORT_HINT: &str = "write a port from 1 to 65535, or a range such as \"8000-8080\"";

fn parse_port(s: &str) -> Result<u16, String> {
    let n: u32 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a port number; {PORT_HINT}"))?;
    if !(1..=65535).contains(&n) {
        return Err(format!("port `{n}` is out of range; {PORT_HINT}"));
    }
    Ok(n as u16)
}

impl FromStr for PortRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once('-') {
            None => parse_port(s).map(PortRange::single),
            Some((a, b)) => {
                let (first, last) = (parse_port(a)?, parse_port(b)?);
                if first > last {
                    return Err(format!(
                        "port range `{s}` runs backwards; write it as \"{last}-{first}\""
                    ));
                }
                Ok(PortRange { first, last })
            }
        }
    }
}

impl<'de> Deserialize<'de> for PortRange {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(i64),
            Text(String),
        }
        let raw = Raw::deserialize(d)
            .map_err(|_| serde::de::Error::custom(format!("expected a port; {PORT_HINT}")))?;
        let text = match raw {
            Raw::Number(n) => n.to_string(),
            Raw::Text(t) => t,
        };
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A fully qualified domain name, lower case, without the trailing dot.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DomainName(String);

impl DomainName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DomainName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for DomainName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl FromStr for DomainName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let name = s.trim().trim_end_matches('.').to_ascii_lowercase();
        if name.contains('*') {
            return Err(format!(
                "`{s}` is not a name: `*` may stand only as the whole first label, `*.example.com` \
                 (one label) or `**.example.com` (any depth), and needs `dns.mode: guard`"
            ));
        }
        if name.parse::<IpAddr>().is_ok() || name.parse::<IpNet>().is_ok() {
            return Err(format!(
                "`{s}` is an address, not a name; write it as `cidr: {s}`"
            ));
        }
        if name.is_empty() {
            return Err("the domain name is empty; write a name such as api.example.com".into());
        }
        if name.len() > 253 {
            return Err(format!(
                "`{s}` is longer than the 253 characters a DNS name may have"
            ));
        }
        for label in name.split('.') {
            let ok_chars = label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if label.is_empty() || label.len() > 63 || !ok_chars {
                return Err(format!(
                    "`{s}` is not a valid domain name: each dot-separated label must be 1 to 63 \
                     letters, digits, '-' or '_' (use punycode, xn--..., for international names)"
                ));
            }
            if label.starts_with('-') || label.ends_with('-') {
                return Err(format!(
                    "`{s}` is not a valid domain name: the label `{label}` starts or ends with '-'"
                ));
            }
        }
        Ok(DomainName(name))
    }
}

impl<'de> Deserialize<'de> for DomainName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// What `domain:` holds: a name, or in guard mode a wildcard.
struct DomainTarget(Target);

impl<'de> Deserialize<'de> for DomainTarget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let t = s.trim();
        let wildcard = |rest: &str, any_depth| -> Result<Target, String> {
            Ok(Target::Wildcard(Wildcard {
                suffix: rest.parse()?,
                any_depth,
            }))
        };
        let target = if let Some(rest) = t.strip_prefix("**.") {
            wildcard(rest, true)
        } else if let Some(rest) = t.strip_prefix("*.") {
            wildcard(rest, false)
        } else {
            t.parse().map(Target::Domain)
        };
        target.map(DomainTarget).map_err(serde::de::Error::custom)
    }
}

/// A network written as CIDR or as a single address (a /32 or /128).
fn parse_network(s: &str) -> Result<IpNet, String> {
    let s = s.trim();
    let net = if let Ok(addr) = s.parse::<IpAddr>() {
        IpNet::from(addr)
    } else {
        s.parse::<IpNet>().map_err(|_| {
            format!(
                "`{s}` is not an IP network; write an address (203.0.113.7, 2001:db8::7) or a \
                 network in CIDR form (203.0.113.0/24, 2001:db8::/32)"
            )
        })?
    };
    if net.trunc() != net {
        return Err(format!(
            "`{s}` has host bits set below its prefix; did you mean {}?",
            net.trunc()
        ));
    }
    Ok(net)
}

struct Network(IpNet);

impl<'de> Deserialize<'de> for Network {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_network(&s)
            .map(Network)
            .map_err(serde::de::Error::custom)
    }
}

struct Resolver(IpAddr);

impl<'de> Deserialize<'de> for Resolver {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.trim().parse().map(Resolver).map_err(|_| {
            serde::de::Error::custom(format!(
                "`{s}` is not an IP address; resolvers are addresses such as 192.0.2.53 \
                 (DNS always uses port 53)"
            ))
        })
    }
}

/// A log rate such as `10/second`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub count: u64,
    pub unit: RateUnit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateUnit {
    Second,
    Minute,
    Hour,
    Day,
}

impl RateUnit {
    pub fn seconds(self) -> u64 {
        match self {
            RateUnit::Second => 1,
            RateUnit::Minute => 60,
            RateUnit::Hour => 3600,
            RateUnit::Day => 86400,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RateUnit::Second => "second",
            RateUnit::Minute => "minute",
            RateUnit::Hour => "hour",
            RateUnit::Day => "day",
        }
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, self.unit.name())
    }
}

impl Serialize for Rate {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let hint = "write a rate such as \"10/second\" (units: second, minute, hour, day)";
        let (count, unit) = s
            .split_once('/')
            .ok_or_else(|| format!("`{s}` is not a rate; {hint}"))?;
        let count: u64 = count
            .trim()
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("`{count}` is not a positive count; {hint}"))?;
        let unit = match unit.trim() {
            "second" | "s" => RateUnit::Second,
            "minute" | "m" => RateUnit::Minute,
            "hour" | "h" => RateUnit::Hour,
            "day" | "d" => RateUnit::Day,
            other => return Err(format!("`{other}` is not a time unit; {hint}")),
        };
        Ok(Rate { count, unit })
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

// ---- the file as written -------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    version: u32,
    #[serde(default = "default_action")]
    action: Action,
    #[serde(default)]
    allow: Vec<RawAllow>,
    #[serde(default)]
    deny: Vec<RawDeny>,
    #[serde(default)]
    dns: RawDns,
    #[serde(default)]
    log: RawLog,
    essentials: Option<Vec<Essential>>,
    #[serde(default)]
    probe: RawProbe,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawProbe {
    #[serde(default)]
    blocked: Vec<ProbeTarget>,
    rogue_resolvers: Option<Vec<Resolver>>,
    exfil_domain: Option<DomainName>,
}

fn default_action() -> Action {
    Action::Reject
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, try_from = "RawAllowFields")]
struct RawAllow(Allow);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAllowFields {
    domain: Option<DomainTarget>,
    cidr: Option<Network>,
    ports: Option<Vec<PortRange>>,
    #[serde(default = "default_protocol")]
    protocol: Protocol,
    comment: Option<String>,
}

fn default_protocol() -> Protocol {
    Protocol::Tcp
}

impl TryFrom<RawAllowFields> for RawAllow {
    type Error = String;

    fn try_from(raw: RawAllowFields) -> Result<Self, String> {
        let target = match (raw.domain, raw.cidr) {
            (Some(DomainTarget(d)), None) => d,
            (None, Some(Network(n))) => Target::Cidr(n),
            (Some(_), Some(_)) => {
                return Err("an allow entry has either `domain:` or `cidr:`, not both; \
                            split it into two entries"
                    .into());
            }
            (None, None) => {
                return Err("an allow entry needs `domain: NAME` or `cidr: NETWORK`".into());
            }
        };
        let name = match &target {
            Target::Domain(d) => d.to_string(),
            Target::Wildcard(w) => w.to_string(),
            Target::Cidr(_) => String::new(),
        };
        let ports = match (raw.ports, &target) {
            (None, Target::Cidr(_)) => vec![PortRange::ALL],
            (None, _) => {
                return Err(format!(
                    "the entry for `{name}` needs `ports:`: a name's addresses are often shared \
                     (CDNs), so allow only the ports you use, e.g. `ports: [443]`"
                ));
            }
            (Some(p), Target::Domain(_) | Target::Wildcard(_)) => {
                if let Some(wide) = p.iter().find(|r| r.width() > MAX_DOMAIN_PORT_RANGE) {
                    return Err(format!(
                        "the port range `{wide}` of `{name}` spans more than \
                         {MAX_DOMAIN_PORT_RANGE} ports: a name's addresses are refreshed port \
                         by port, so split it, or allow the addresses with a `cidr:` entry"
                    ));
                }
                p
            }
            (Some(p), _) if p.is_empty() => {
                return Err(
                    "`ports: []` allows nothing; list ports, or leave `ports` out to \
                            allow every port"
                        .into(),
                );
            }
            (Some(p), _) => p,
        };
        Ok(RawAllow(Allow {
            target,
            ports,
            protocol: raw.protocol,
            comment: raw.comment,
        }))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, try_from = "RawDenyFields")]
struct RawDeny(Deny);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDenyFields {
    preset: Option<Preset>,
    cidr: Option<Network>,
    comment: Option<String>,
}

impl TryFrom<RawDenyFields> for RawDeny {
    type Error = String;

    fn try_from(raw: RawDenyFields) -> Result<Self, String> {
        let (networks, origin) = match (raw.preset, raw.cidr) {
            (Some(p), None) => (p.networks(), DenyOrigin::Preset(p)),
            (None, Some(Network(n))) => (vec![n], DenyOrigin::Cidr),
            (Some(_), Some(_)) => {
                return Err(
                    "a deny entry has either `preset:` or `cidr:`, not both; split it \
                            into two entries"
                        .into(),
                );
            }
            (None, None) => {
                return Err(
                    "a deny entry needs `preset: cloud-metadata` (or private-networks) or \
                     `cidr: NETWORK`"
                        .into(),
                );
            }
        };
        Ok(RawDeny(Deny {
            networks,
            origin,
            comment: raw.comment,
        }))
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDns {
    mode: Option<DnsMode>,
    resolvers: Option<Vec<Resolver>>,
    #[serde(default)]
    refresh: RawRefresh,
    grace: Option<Interval>,
    listen: Option<Vec<ListenAddr>>,
    upstream: Option<Vec<Resolver>>,
    refuse_with: Option<RefuseWith>,
    floor: Option<Interval>,
    mark: Option<u32>,
}

/// `127.0.0.53:53`, `[::1]:53`, or an address alone (port 53).
struct ListenAddr(SocketAddr);

impl<'de> Deserialize<'de> for ListenAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let t = s.trim();
        t.parse::<SocketAddr>()
            .or_else(|_| t.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 53)))
            .map(ListenAddr)
            .map_err(|_| {
                serde::de::Error::custom(format!(
                    "`{s}` is not an address to listen on; write 127.0.0.53:53, [::1]:53 or an                      address alone for port 53"
                ))
            })
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawRefresh {
    min: Option<Interval>,
    max: Option<Interval>,
}

/// Durations end up as kernel element timeouts in milliseconds and as deadlines: a year is
/// far beyond any sensible setting and far inside what either can hold.
const MAX_INTERVAL_SECS: u64 = 365 * 86_400;

/// A duration written as `30s`, `10m`, `1h` or `1d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval(pub Duration);

impl FromStr for Interval {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let hint = "write a duration such as \"30s\", \"10m\", \"1h\" or \"1d\"";
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (n, unit) = t.split_at(split);
        let n: u64 = n
            .parse()
            .map_err(|_| format!("`{s}` is not a duration; {hint}"))?;
        let secs = match unit {
            "s" => n,
            "m" => n.saturating_mul(60),
            "h" => n.saturating_mul(3600),
            "d" => n.saturating_mul(86400),
            _ => return Err(format!("`{s}` is not a duration; {hint}")),
        };
        if secs == 0 {
            return Err(format!("`{s}` is zero; {hint}"));
        }
        if secs > MAX_INTERVAL_SECS {
            return Err(format!(
                "`{s}` is longer than a year, the longest a duration here may be"
            ));
        }
        Ok(Interval(Duration::from_secs(secs)))
    }
}

impl<'de> Deserialize<'de> for Interval {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLog {
    prefix: Option<String>,
    group: Option<u16>,
    rate: Option<Rate>,
    burst: Option<u32>,
}

// ---- errors --------------------------------------------------------------------------------

/// A policy that cannot be used, with where and why.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("{path}: cannot read the policy: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: {message}", location(path, *line, *column))]
    Invalid {
        path: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
}

fn location(path: &Path, line: usize, column: usize) -> String {
    if line == 0 {
        path.display().to_string()
    } else {
        format!("{}:{line}:{column}", path.display())
    }
}

/// Where in the source text a later check should point.
fn locate(source: &str, needle: &str) -> (usize, usize) {
    source
        .lines()
        .enumerate()
        .find_map(|(i, line)| {
            let code = line.split('#').next().unwrap_or("");
            code.find(needle).map(|col| (i + 1, col + 1))
        })
        .unwrap_or((0, 0))
}

impl Policy {
    /// Reads and validates a policy file.
    pub fn load(path: &Path) -> Result<Policy, PolicyError> {
        Policy::load_with_text(path).map(|(policy, _)| policy)
    }

    /// Reads and validates a policy file; also returns the text that was validated (what a
    /// generation records: the file may change right after).
    pub fn load_with_text(path: &Path) -> Result<(Policy, String), PolicyError> {
        let read_error = |error| PolicyError::Read {
            path: path.to_owned(),
            error,
        };
        // At most one byte past the limit is read: a huge file (or /dev/zero) costs nothing.
        let mut source = String::new();
        std::fs::File::open(path)
            .map_err(read_error)?
            .take(MAX_POLICY_BYTES + 1)
            .read_to_string(&mut source)
            .map_err(read_error)?;
        let policy = Policy::parse(&source, path)?;
        Ok((policy, source))
    }

    /// Validates policy text; `path` only labels the errors.
    pub fn parse(source: &str, path: &Path) -> Result<Policy, PolicyError> {
        let invalid = |(line, column): (usize, usize), message: String| PolicyError::Invalid {
            path: path.to_owned(),
            line,
            column,
            message,
        };
        if let Some((at, message)) = refuse_shape(source) {
            return Err(invalid(at, message));
        }
        let raw: RawPolicy = serde_yaml::from_str(source).map_err(|e| {
            let message = yaml_message(&e);
            let at = e.location().map_or((0, 0), |l| {
                refine_location(source, (l.line(), l.column()), &message)
            });
            invalid(at, message)
        })?;
        if raw.version != SCHEMA_VERSION {
            return Err(invalid(
                locate(source, "version"),
                format!(
                    "policy schema version {} is not known to this egress-fence, which reads \
                     version {SCHEMA_VERSION}; write `version: {SCHEMA_VERSION}`",
                    raw.version
                ),
            ));
        }

        let prefix = raw.log.prefix.unwrap_or_else(|| DEFAULT_LOG_PREFIX.into());
        if prefix.len() > MAX_LOG_PREFIX || prefix.contains(['"', '\0', '\n']) {
            return Err(invalid(
                locate(source, "prefix"),
                format!(
                    "the log prefix must be at most {MAX_LOG_PREFIX} bytes without quotes or \
                     line breaks"
                ),
            ));
        }

        let rate = raw.log.rate.unwrap_or(DEFAULT_RATE);
        let burst = raw.log.burst.unwrap_or(DEFAULT_BURST);
        let unchecked = std::env::var_os(UNCHECKED_KERNEL_LIMITS_ENV).is_some_and(|v| v == "1");
        if !unchecked && !kernel_accepts_limit(rate.count, rate.unit.seconds(), burst) {
            let max = max_burst(rate);
            let (key, message) = if burst == 0 {
                (
                    "burst:",
                    "`burst: 0` would silently become the kernel's default of 5; write a \
                     burst of at least 1"
                        .to_string(),
                )
            } else if max == 0 {
                (
                    "rate:",
                    format!(
                        "the kernel refuses the log rate {rate}: the rate plus the burst must \
                         fit in 64 bits; write a lower rate"
                    ),
                )
            } else {
                (
                    "burst:",
                    format!(
                        "the kernel refuses a burst of {burst} at {rate}: its token bucket would \
                         overflow 64 bits; the largest burst it takes at this rate is {max}"
                    ),
                )
            };
            let at = match locate(source, key) {
                (0, _) => locate(source, "log:"),
                at => at,
            };
            return Err(invalid(at, message));
        }

        let guard = match raw.dns.mode {
            Some(DnsMode::Guard) => {
                if raw.dns.resolvers.is_some() {
                    return Err(invalid(
                        locate(source, "resolvers"),
                        "in `dns.mode: guard` the guard forwards to `dns.upstream`, and nothing \
                         else may ask any resolver; rename `resolvers` to `upstream`"
                            .into(),
                    ));
                }
                let upstream: Vec<IpAddr> = raw
                    .dns
                    .upstream
                    .unwrap_or_default()
                    .into_iter()
                    .map(|r| r.0)
                    .collect();
                if upstream.is_empty() {
                    return Err(invalid(
                        locate(source, "mode"),
                        "`dns.mode: guard` forwards allowed names to `dns.upstream`: list at \
                         least one resolver, e.g. `upstream: [192.0.2.53]`"
                            .into(),
                    ));
                }
                let listen: Vec<SocketAddr> = match raw.dns.listen {
                    Some(l) => l.into_iter().map(|l| l.0).collect(),
                    None => vec![DEFAULT_GUARD_LISTEN.parse().expect("valid literal")],
                };
                if listen.is_empty() {
                    return Err(invalid(
                        locate(source, "listen"),
                        "`listen: []` leaves the guard deaf; list an address such as \
                         127.0.0.53:53, or leave the key out for that default"
                            .into(),
                    ));
                }
                let mark = raw.dns.mark.unwrap_or(DEFAULT_GUARD_MARK);
                if mark == 0 {
                    return Err(invalid(
                        locate(source, "mark"),
                        "`mark: 0` is the mark of every unmarked socket, so it would let \
                         any process of the guard's uid ask the upstream resolvers; choose \
                         a mark no other tool on this host uses, or leave the key out"
                            .into(),
                    ));
                }
                Some(Guard {
                    listen,
                    upstream,
                    refuse_with: raw.dns.refuse_with.unwrap_or(RefuseWith::Refused),
                    floor: raw.dns.floor.map_or(DEFAULT_FLOOR, |i| i.0),
                    mark,
                })
            }
            Some(DnsMode::Resolve) | None => {
                let guard_only = [
                    ("listen", raw.dns.listen.is_some()),
                    ("upstream", raw.dns.upstream.is_some()),
                    ("refuse_with", raw.dns.refuse_with.is_some()),
                    ("floor", raw.dns.floor.is_some()),
                    ("mark", raw.dns.mark.is_some()),
                ];
                if let Some((key, _)) = guard_only.iter().find(|(_, given)| *given) {
                    return Err(invalid(
                        locate(source, key),
                        format!(
                            "`dns.{key}` belongs to the DNS guard; add `mode: guard` to `dns:` \
                             or remove `{key}`"
                        ),
                    ));
                }
                None
            }
        };
        let mut deny: Vec<Deny> = raw.deny.into_iter().map(|d| d.0).collect();
        // The guard is only a boundary if no other resolver answers: DNS over HTTPS to the
        // public resolvers would look like any HTTPS.
        let doh = DenyOrigin::Preset(Preset::DnsOverHttps);
        if guard.is_some() && !deny.iter().any(|d| d.origin == doh) {
            deny.push(Deny {
                networks: Preset::DnsOverHttps.networks(),
                origin: doh,
                comment: Some("implied by dns.mode: guard".into()),
            });
        }

        let policy = Policy {
            action: raw.action,
            allow: raw.allow.into_iter().map(|a| a.0).collect(),
            deny,
            dns: Dns {
                resolvers: raw
                    .dns
                    .resolvers
                    .map(|r| r.into_iter().map(|r| r.0).collect()),
                refresh_min: raw.dns.refresh.min.map_or(DEFAULT_REFRESH_MIN, |i| i.0),
                refresh_max: raw.dns.refresh.max.map_or(DEFAULT_REFRESH_MAX, |i| i.0),
                grace: raw.dns.grace.map_or(DEFAULT_GRACE, |i| i.0),
                guard,
            },
            log: Log {
                prefix,
                group: raw.log.group,
                rate,
                burst,
            },
            probe: ProbeSettings {
                blocked: raw.probe.blocked,
                rogue_resolvers: raw.probe.rogue_resolvers.map_or_else(
                    || {
                        DEFAULT_ROGUE_RESOLVERS
                            .iter()
                            .map(|r| r.parse().expect("valid literal"))
                            .collect()
                    },
                    |r| r.into_iter().map(|r| r.0).collect(),
                ),
                exfil_domain: raw.probe.exfil_domain,
            },
            essentials: raw.essentials.map_or_else(
                || Essential::ALL.into_iter().collect(),
                |e| e.into_iter().collect(),
            ),
        };

        if policy.dns.guard.is_none()
            && let Some(w) = policy.allow.iter().find_map(|a| match &a.target {
                Target::Wildcard(w) => Some(w),
                _ => None,
            })
        {
            return Err(invalid(
                locate(source, &w.to_string()),
                format!(
                    "the wildcard `{w}` can only be followed by the DNS guard, which sees every \
                     name asked: set `dns.mode: guard` (with `upstream:`), or list the names"
                ),
            ));
        }
        if policy.dns.refresh_min > policy.dns.refresh_max {
            return Err(invalid(
                locate(source, "refresh"),
                "`dns.refresh.min` is longer than `dns.refresh.max`; swap them".into(),
            ));
        }
        if policy.dns.resolvers.as_ref().is_some_and(Vec::is_empty) {
            return Err(invalid(
                locate(source, "resolvers"),
                "`resolvers: []` would leave no way to resolve names; list at least one \
                 resolver or leave the key out to use /etc/resolv.conf"
                    .into(),
            ));
        }
        Ok(policy)
    }

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

    /// Things that are allowed but probably not meant; printed, never fatal.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for allow in &self.allow {
            if let Target::Cidr(net) = allow.target {
                let shadowing = self
                    .deny
                    .iter()
                    .find(|d| d.networks.iter().any(|dn| dn.contains(&net)));
                if let Some(d) = shadowing {
                    out.push(format!(
                        "allowed network {net} lies inside the denied {}: deny wins, so this \
                         entry allows nothing",
                        d.describe()
                    ));
                }
            }
        }
        for allow in &self.allow {
            let Target::Wildcard(w) = &allow.target else {
                continue;
            };
            let suffix = w.suffix.as_str();
            if !suffix.contains('.') {
                out.push(format!(
                    "`{w}` allows every name under the top-level domain `{suffix}`: anyone can \
                     register one; list the domains you use"
                ));
            } else if let Some(shared) = SHARED_SUFFIXES.iter().find(|s| {
                // `**.googleapis.com` reaches storage.googleapis.com's tenants too; a name
                // below a tenant (`*.mine.herokuapp.com`) is that tenant's own.
                suffix == **s || (w.any_depth && s.ends_with(&format!(".{suffix}")))
            }) {
                out.push(format!(
                    "`{w}` lies under `{shared}`, where anyone can own a name (shared hosting): \
                     it lets strangers' servers in; list the exact names you use"
                ));
            }
        }
        let refresh_set = (self.dns.refresh_min, self.dns.refresh_max)
            != (DEFAULT_REFRESH_MIN, DEFAULT_REFRESH_MAX);
        if self.dns.guard.is_some() && refresh_set {
            out.push(
                "`dns.refresh` has no effect in guard mode: the guard looks nothing up on a \
                 timer; `floor` and `grace` set how long answered addresses live"
                    .into(),
            );
        }
        for r in self.dns.guard.iter().flat_map(|g| &g.upstream) {
            if r.is_loopback() {
                out.push(format!(
                    "upstream {r} is on loopback, which every local process may reach: a \
                     resolver there lets them around the guard"
                ));
            }
        }
        for r in self.dns.resolvers.iter().flatten() {
            if let Some(d) = self.denied_by(*r) {
                out.push(format!(
                    "resolver {r} lies in the denied {}: DNS to it (port 53) stays allowed, \
                     everything else to it is refused",
                    d.describe()
                ));
            }
        }
        if !self.essentials.contains(&Essential::Established) {
            out.push(
                "`essentials` leaves out `established`: replies of inbound connections (SSH \
                 included) will be refused"
                    .into(),
            );
            if self.dns.guard.is_some() {
                out.push(
                    "without `established`, a connection to an answered address is cut when \
                     the address expires (the guard renews only addresses whose connections \
                     conntrack still sees)"
                        .into(),
                );
            }
        }
        if let Some(resolvers) = &self.dns.resolvers
            && resolvers.iter().all(|r| r.is_loopback())
        {
            out.push(
                "every resolver is on loopback: a local stub (systemd-resolved, dnsmasq) needs \
                 its own upstream servers allowed, or names stop resolving; list the upstream \
                 resolvers instead"
                    .into(),
            );
        }
        out
    }
}

impl Policy {
    /// Every warning: [`Policy::warnings`], then those about single values that parse but
    /// cannot do what they seem to, each located in `source` like an error
    /// (`path:line:column: ...`).
    pub fn warnings_in(&self, source: &str, path: &Path) -> Vec<String> {
        let mut out = self.warnings();
        for ((line, column), message) in self.suspicious_values(source) {
            out.push(format!("{}: {message}", location(path, line, column)));
        }
        out
    }

    /// Values that allow far more than anyone means, or nothing at all, with where each is
    /// written in `source`.
    fn suspicious_values(&self, source: &str) -> Vec<((usize, usize), String)> {
        let mut out = Vec::new();
        let at_network = |key: &str, net: &IpNet| {
            locate_value(source, key, |t| parse_network(t).is_ok_and(|n| n == *net))
        };
        for allow in &self.allow {
            let Target::Cidr(net) = &allow.target else {
                continue;
            };
            if net.prefix_len() == 0 {
                let family = if net.addr().is_ipv4() { "IPv4" } else { "IPv6" };
                out.push((
                    at_network("allow", net),
                    format!(
                        "`{net}` allows every {family} address: only the deny list still \
                         fences those ports; list the networks you need"
                    ),
                ));
            }
            if let Some(v4) = ipv4_mapped(net) {
                out.push((at_network("allow", net), mapped_message(net, &v4)));
            }
        }
        for deny in self.deny.iter().filter(|d| d.origin == DenyOrigin::Cidr) {
            for net in &deny.networks {
                if let Some(v4) = ipv4_mapped(net) {
                    out.push((at_network("deny", net), mapped_message(net, &v4)));
                }
            }
        }
        let servers = [
            (
                "resolvers",
                "resolver",
                self.dns.resolvers.clone().unwrap_or_default(),
            ),
            (
                "upstream",
                "upstream",
                self.dns
                    .guard
                    .iter()
                    .flat_map(|g| g.upstream.clone())
                    .collect(),
            ),
        ];
        for (key, what, addrs) in servers {
            for addr in addrs {
                let Some(kind) = not_a_server(addr) else {
                    continue;
                };
                out.push((
                    locate_value(source, key, |t| {
                        t.parse::<IpAddr>().is_ok_and(|a| a == addr)
                    }),
                    format!(
                        "{what} {addr} is {kind}: no resolver answers from there, so DNS \
                         through it fails; list the resolver's own unicast address"
                    ),
                ));
            }
        }
        for listen in self.dns.guard.iter().flat_map(|g| &g.listen) {
            if listen.port() == 0 {
                out.push((
                    locate_value(source, "listen", |t| {
                        t.parse::<SocketAddr>().is_ok_and(|a| a == *listen)
                    }),
                    format!(
                        "the guard's listen address {listen} has port 0: the kernel picks a \
                         random port that no client asks; write port 53"
                    ),
                ));
            }
        }
        out
    }
}

/// The IPv4 network an IPv4-mapped IPv6 network (`::ffff:0:0/96` and below) stands for.
fn ipv4_mapped(net: &IpNet) -> Option<ipnet::Ipv4Net> {
    let IpNet::V6(v6) = net else {
        return None;
    };
    let v4 = v6.addr().to_ipv4_mapped()?;
    let prefix = v6.prefix_len().checked_sub(96)?;
    ipnet::Ipv4Net::new(v4, prefix).ok()
}

fn mapped_message(net: &IpNet, v4: &ipnet::Ipv4Net) -> String {
    format!(
        "`{net}` is an IPv4-mapped IPv6 network: no packet on the wire carries such an \
         address (IPv4 goes out as IPv4), so it matches nothing; write `{v4}`"
    )
}

/// What a resolver address is when it cannot be one: unspecified, broadcast or multicast.
fn not_a_server(addr: IpAddr) -> Option<&'static str> {
    if addr.is_unspecified() {
        Some("the unspecified address")
    } else if addr.is_multicast() {
        Some("a multicast address")
    } else if matches!(addr, IpAddr::V4(v4) if v4.is_broadcast()) {
        Some("the broadcast address")
    } else {
        None
    }
}

/// Where a value is written: the first token at or after the line that holds `key:` for
/// which `is_it` holds (a token is text between blanks, commas, quotes and braces, with
/// list brackets around it taken off), else where `key` is.
fn locate_value(source: &str, key: &str, is_it: impl Fn(&str) -> bool) -> (usize, usize) {
    let key_colon = format!("{key}:");
    let start = source
        .lines()
        .position(|line| line.split('#').next().unwrap_or("").contains(&key_colon));
    let Some(start) = start else {
        return locate(source, key);
    };
    for (i, line) in source.lines().enumerate().skip(start) {
        let code = line.split('#').next().unwrap_or("");
        let mut from = 0;
        for token in code.split(|c: char| c.is_whitespace() || ",\"'{}".contains(c)) {
            let column = from;
            from += token.len() + 1;
            let candidates = [
                token,
                token.trim_start_matches('['),
                token.trim_end_matches(']'),
                token.trim_start_matches('[').trim_end_matches(']'),
            ];
            if !token.is_empty() && candidates.iter().any(|c| is_it(c)) {
                let lead = token.len() - token.trim_start_matches('[').len();
                let column = if is_it(token) { column } else { column + lead };
                return (i + 1, column + 1);
            }
        }
    }
    locate(source, key)
}

impl Deny {
    pub fn describe(&self) -> String {
        match self.origin {
            DenyOrigin::Preset(p) => format!("preset {}", p.name()),
            DenyOrigin::Cidr => format!("network {}", self.networks[0]),
        }
    }
}

/// The largest burst the kernel accepts at `rate` (0 when none does).
fn max_burst(rate: Rate) -> u64 {
    let nsecs = rate.unit.seconds() * 1_000_000_000;
    let by_bucket = u64::MAX / (nsecs / rate.count).max(1);
    let by_sum = u64::MAX - rate.count;
    by_bucket.min(by_sum).min(u64::from(u32::MAX))
}

/// Refuses, before the YAML parser sees it, text that would cost it too much or that it
/// would misreport: more than [`MAX_POLICY_BYTES`], `[`/`{` nested deeper than
/// [`MAX_POLICY_NESTING`], or several YAML documents. Returns where and why.
fn refuse_shape(source: &str) -> Option<((usize, usize), String)> {
    if source.len() as u64 > MAX_POLICY_BYTES {
        return Some((
            (0, 0),
            format!(
                "the policy is larger than {} KiB, the most egress-fence reads; a policy that \
                 large is not one anyone reviews",
                MAX_POLICY_BYTES / 1024
            ),
        ));
    }
    if let Some(at) = too_deep(source, MAX_POLICY_NESTING) {
        return Some((
            at,
            format!(
                "brackets are nested more than {MAX_POLICY_NESTING} deep here; a policy needs \
                 three levels at most"
            ),
        ));
    }
    second_document(source).map(|line| {
        (
            (line, 1),
            "this line starts a second YAML document; a policy is one document: remove the \
             `---` (or `...`) line, or merge what follows it into the first document"
                .to_string(),
        )
    })
}

/// Where `[` and `{` first nest deeper than `max`, counted everywhere but in comments. It
/// over-counts brackets in quoted and block scalars, which only a strange policy has; it
/// never under-counts: text after ` #` is a comment or part of a scalar, never a flow
/// indicator. (Following quotes instead would let a lone `'` in a block scalar hide what
/// comes after it.)
fn too_deep(source: &str, max: usize) -> Option<(usize, usize)> {
    let mut depth = 0usize;
    for (line_no, line) in source.split('\n').enumerate() {
        // A `#` starts a comment at the start of a line or after white space.
        let mut previous = ' ';
        for (column, c) in line.chars().enumerate() {
            match c {
                '#' if previous.is_whitespace() => break,
                '[' | '{' => {
                    depth += 1;
                    if depth > max {
                        return Some((line_no + 1, column + 1));
                    }
                }
                ']' | '}' => depth = depth.saturating_sub(1),
                _ => {}
            }
            previous = c;
        }
    }
    None
}

/// The line of a document marker (`---`, or `...` followed by more) that starts a second
/// document. serde_yaml reports several documents only as a missing `version` or not at all.
fn second_document(source: &str) -> Option<usize> {
    let is_marker = |line: &str, marker: &str| {
        line.strip_prefix(marker)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r']))
    };
    // Whether a document has begun: a marker or content was seen.
    let mut begun = false;
    let mut ended = false;
    for (i, line) in source.lines().enumerate() {
        let code = line.split('#').next().unwrap_or("").trim();
        if is_marker(line, "---") {
            if begun || ended {
                return Some(i + 1);
            }
            begun = true;
        } else if is_marker(line, "...") {
            ended = true;
        } else if !code.is_empty() && !code.starts_with('%') {
            if ended {
                return Some(i + 1);
            }
            begun = true;
        }
    }
    None
}

/// serde_yaml places errors raised by a value's own `Deserialize` at the start of the
/// enclosing mapping or sequence. Our messages quote the offending text in backticks, so the
/// first occurrence of it from there on is the value itself.
fn refine_location(source: &str, at: (usize, usize), message: &str) -> (usize, usize) {
    let Some(quoted) = message.split('`').nth(1).filter(|q| !q.is_empty()) else {
        return at;
    };
    let (line, column) = at;
    for (i, text) in source.lines().enumerate().skip(line.saturating_sub(1)) {
        let from = if i + 1 == line {
            column.saturating_sub(1)
        } else {
            0
        };
        if let Some(found) = text.get(from..).and_then(|rest| rest.find(quoted)) {
            return (i + 1, from + found + 1);
        }
    }
    at
}

/// serde_yaml's message without its own " at line L column C" tail (we print the location
/// first, as compilers do).
fn yaml_message(e: &serde_yaml::Error) -> String {
    let text = e.to_string();
    let mut text = match text.rsplit_once(" at line ") {
        Some((head, _)) if e.location().is_some() => head.to_string(),
        _ => text,
    };
    // serde quotes the offending value whole: a megabyte-long string must not become a
    // megabyte-long log line.
    const MAX_MESSAGE: usize = 500;
    if text.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    if text.contains("unknown field") {
        format!("{text} (check the spelling; see `egress-fence check --help` for the schema)")
    } else if text.contains("missing field `version`") {
        format!("{text}: every policy starts with `version: {SCHEMA_VERSION}`")
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(src: &str) -> Result<Policy, PolicyError> {
        Policy::parse(src, Path::new("p.yaml"))
    }

    fn err(src: &str) -> (usize, usize, String) {
        match parse(src) {
            Err(PolicyError::Invalid {
                line,
                column,
                message,
                ..
            }) => (line, column, message),
            other => panic!("expected an invalid policy, got {other:?}"),
        }
    }

    const FULL: &str = r#"
version: 1
action: drop
allow:
  - domain: API.Example.com.
    ports: [443, "8000-8080"]
    protocol: any
    comment: model API
  - cidr: 203.0.113.0/28
    ports: [22]
deny:
  - preset: cloud-metadata
  - cidr: 10.0.0.0/8
dns:
  resolvers: [192.0.2.53, "2001:db8::53"]
log:
  prefix: "EF: "
  group: 100
  rate: 5/minute
essentials: [loopback, established]
"#;

    #[test]
    fn full_policy_parses_with_every_field() {
        let p = parse(FULL).expect("valid");
        assert_eq!(p.action, Action::Drop);
        assert_eq!(
            p.allow[0].target,
            Target::Domain("api.example.com".parse().unwrap())
        );
        assert_eq!(
            p.allow[0].ports,
            vec![
                PortRange::single(443),
                PortRange {
                    first: 8000,
                    last: 8080
                }
            ]
        );
        assert_eq!(p.allow[0].protocol, Protocol::Any);
        assert_eq!(p.allow[0].comment.as_deref(), Some("model API"));
        assert_eq!(p.allow[1].protocol, Protocol::Tcp);
        assert_eq!(p.deny[0].origin, DenyOrigin::Preset(Preset::CloudMetadata));
        assert!(
            p.deny[0]
                .networks
                .contains(&"169.254.0.0/16".parse().unwrap())
        );
        assert_eq!(p.dns.resolvers.as_ref().map(Vec::len), Some(2));
        assert_eq!(p.log.group, Some(100));
        assert_eq!(p.log.rate.to_string(), "5/minute");
        assert_eq!(p.essentials.len(), 2);
    }

    #[test]
    fn defaults_are_applied() {
        let p = parse("version: 1\nallow:\n  - cidr: 192.0.2.1\n").expect("valid");
        assert_eq!(p.action, Action::Reject);
        assert_eq!(p.allow[0].ports, vec![PortRange::ALL]);
        assert_eq!(
            p.allow[0].target,
            Target::Cidr("192.0.2.1/32".parse().unwrap())
        );
        assert_eq!(p.log.prefix, DEFAULT_LOG_PREFIX);
        assert_eq!(p.log.rate, DEFAULT_RATE);
        assert_eq!(p.log.group, None);
        assert_eq!(p.dns.resolvers, None);
        assert_eq!(p.essentials.len(), Essential::ALL.len());
    }

    #[test]
    fn unknown_key_is_refused_with_its_position() {
        let (line, col, msg) = err("version: 1\nallow:\n  - domain: a.example\n    prots: [1]\n");
        assert_eq!((line, col), (4, 5), "{msg}");
        assert!(msg.contains("unknown field `prots`"), "{msg}");
    }

    #[test]
    fn unknown_top_level_key_is_refused() {
        let (line, _, msg) = err("version: 1\nalow: []\n");
        assert_eq!(line, 2);
        assert!(msg.contains("unknown field `alow`"), "{msg}");
    }

    #[test]
    fn bad_cidr_points_at_the_value() {
        let (line, col, msg) = err("version: 1\ndeny:\n  - cidr: 10.0.0.0/33\n");
        assert_eq!((line, col), (3, 11), "{msg}");
        assert!(msg.contains("not an IP network"), "{msg}");
    }

    #[test]
    fn host_bits_are_refused_with_a_suggestion() {
        let (_, _, msg) = err("version: 1\nallow:\n  - cidr: 203.0.113.9/24\n");
        assert!(msg.contains("did you mean 203.0.113.0/24"), "{msg}");
    }

    #[test]
    fn port_out_of_range_is_refused() {
        let (line, col, msg) =
            err("version: 1\nallow:\n  - domain: a.example\n    ports: [443, 70000]\n");
        assert_eq!((line, col), (4, 18), "{msg}");
        assert!(msg.contains("port `70000` is out of range"), "{msg}");
        let (_, _, msg) = err("version: 1\nallow:\n  - cidr: 192.0.2.0/24\n    ports: [0]\n");
        assert!(msg.contains("port `0` is out of range"), "{msg}");
    }

    #[test]
    fn backwards_and_malformed_ranges_are_refused() {
        let (_, _, msg) =
            err("version: 1\nallow:\n  - cidr: 192.0.2.0/24\n    ports: [\"90-80\"]\n");
        assert!(msg.contains("runs backwards"), "{msg}");
        let (_, _, msg) =
            err("version: 1\nallow:\n  - cidr: 192.0.2.0/24\n    ports: [\"http\"]\n");
        assert!(msg.contains("not a port number"), "{msg}");
    }

    #[test]
    fn malformed_domains_are_refused() {
        for bad in ["bad..example", "-a.example", "a_b c.example", "a.example-"] {
            let (line, _, msg) = err(&format!("version: 1\nallow:\n  - domain: \"{bad}\"\n"));
            assert_eq!(line, 3, "{bad}: {msg}");
            assert!(msg.contains("not a valid domain name"), "{bad}: {msg}");
        }
        let long = format!("{}.example", "a".repeat(64));
        let (_, _, msg) = err(&format!("version: 1\nallow:\n  - domain: {long}\n"));
        assert!(msg.contains("not a valid domain name"), "{msg}");
    }

    #[test]
    fn address_as_domain_points_to_cidr() {
        let (_, _, msg) = err("version: 1\nallow:\n  - domain: 192.0.2.1\n");
        assert!(msg.contains("cidr: 192.0.2.1"), "{msg}");
    }

    #[test]
    fn entry_needs_exactly_one_target() {
        let (line, _, msg) =
            err("version: 1\nallow:\n  - domain: a.example\n    cidr: 192.0.2.0/24\n");
        assert!(line >= 3, "{msg}");
        assert!(msg.contains("not both"), "{msg}");
        let (_, _, msg) = err("version: 1\nallow:\n  - ports: [1]\n");
        assert!(msg.contains("needs `domain: NAME`"), "{msg}");
    }

    #[test]
    fn yaml_syntax_errors_carry_a_position() {
        let (line, col, msg) = err("version: 1\nallow:\n  - domain: [a\n");
        assert!(line >= 3 && col > 0, "{line}:{col} {msg}");
    }

    #[test]
    fn wrong_version_and_missing_version_are_refused() {
        let (line, _, msg) = err("version: 2\n");
        assert_eq!(line, 1);
        assert!(msg.contains("version 2 is not known"), "{msg}");
        let (_, _, msg) = err("allow: []\n");
        assert!(msg.contains("version: 1"), "{msg}");
    }

    #[test]
    fn the_cloud_metadata_preset_holds_the_ipv6_instance_services() {
        for addr in [
            "169.254.169.254",
            "fd00:ec2::254", // AWS IMDS
            "fd00:ec2::253", // AWS DNS
            "fd00:ec2::123", // AWS time
            "fd00:ec2::23",  // EKS pod identity
            "fd20:ce::254",  // GCP
            "fd00:42::42",   // Scaleway
        ] {
            let ip: IpAddr = addr.parse().unwrap();
            assert_eq!(
                Preset::containing(ip),
                Some(Preset::CloudMetadata),
                "{addr}"
            );
        }
        let ip: IpAddr = "fd20:ce::253".parse().unwrap();
        assert_ne!(Preset::containing(ip), Some(Preset::CloudMetadata));
    }

    #[test]
    fn unknown_preset_protocol_action_and_essential_are_refused() {
        for src in [
            "version: 1\ndeny:\n  - preset: cloud\n",
            "version: 1\nallow:\n  - cidr: 192.0.2.1\n    protocol: icmp\n",
            "version: 1\naction: allow\n",
            "version: 1\nessentials: [ssh]\n",
            "version: 1\nlog:\n  rate: 10/fortnight\n",
            "version: 1\ndns:\n  resolvers: [dns.example]\n",
        ] {
            let (line, col, msg) = err(src);
            assert!(line >= 2 && col > 0, "{src}: {line}:{col} {msg}");
        }
    }

    #[test]
    fn resolver_inside_a_denied_network_is_warned_about() {
        let p = parse(
            "version: 1\ndeny:\n  - preset: cloud-metadata\ndns:\n  resolvers: [169.254.169.253]\n",
        )
        .expect("valid: DNS to a resolver is allowed before the deny list");
        let w = p.warnings();
        assert!(
            w.iter()
                .any(|w| w.contains("169.254.169.253") && w.contains("cloud-metadata")),
            "{w:?}"
        );
    }

    #[test]
    fn empty_resolver_and_port_lists_are_refused() {
        let (_, _, msg) = err("version: 1\ndns:\n  resolvers: []\n");
        assert!(msg.contains("at least one"), "{msg}");
        let (_, _, msg) = err("version: 1\nallow:\n  - cidr: 192.0.2.1\n    ports: []\n");
        assert!(msg.contains("allows nothing"), "{msg}");
    }

    fn located_warnings(src: &str) -> Vec<String> {
        parse(src)
            .expect("valid: these are warnings, not errors")
            .warnings_in(src, Path::new("p.yaml"))
    }

    #[test]
    fn allowing_every_address_is_warned_with_its_line() {
        let w = located_warnings(
            "version: 1\nallow:\n  - cidr: 192.0.2.0/24\n  - cidr: 0.0.0.0/0\n    ports: [443]\n  \
             - cidr: \"::/0\"\n",
        );
        assert!(
            w.iter()
                .any(|w| w.starts_with("p.yaml:4:11: `0.0.0.0/0` allows every IPv4 address")),
            "{w:?}"
        );
        assert!(
            w.iter()
                .any(|w| w.starts_with("p.yaml:6:12: `::/0` allows every IPv6 address")),
            "{w:?}"
        );
        assert!(located_warnings(FULL).is_empty());
    }

    #[test]
    fn resolvers_and_upstreams_that_cannot_answer_are_warned() {
        let w = located_warnings(
            "version: 1\ndns:\n  resolvers: [192.0.2.53, 0.0.0.0, 255.255.255.255,\n    \
             \"ff02::fb\", \"::\"]\n",
        );
        let found = |addr: &str, kind: &str, at: &str| {
            w.iter()
                .any(|w| w.starts_with(&format!("p.yaml:{at}: resolver {addr} is {kind}")))
        };
        assert!(found("0.0.0.0", "the unspecified address", "3:27"), "{w:?}");
        assert!(
            found("255.255.255.255", "the broadcast address", "3:36"),
            "{w:?}"
        );
        assert!(found("ff02::fb", "a multicast address", "4:6"), "{w:?}");
        assert!(found("::", "the unspecified address", "4:18"), "{w:?}");
        assert_eq!(w.len(), 4, "192.0.2.53 is fine: {w:?}");

        let w = located_warnings(
            "version: 1\ndns:\n  mode: guard\n  upstream: [224.0.0.251]\n  \
             listen: [\"127.0.0.53:0\", \"[::1]:53\"]\n",
        );
        assert!(
            w.iter()
                .any(|w| w.starts_with("p.yaml:4:14: upstream 224.0.0.251 is a multicast")),
            "{w:?}"
        );
        assert!(
            w.iter().any(|w| w
                .starts_with("p.yaml:5:13: the guard's listen address 127.0.0.53:0 has port 0")),
            "{w:?}"
        );
        assert!(!w.iter().any(|w| w.contains("[::1]:53")), "{w:?}");
    }

    #[test]
    fn ipv4_mapped_networks_are_warned_with_the_ipv4_network() {
        let w = located_warnings(
            "version: 1\ndeny:\n  - cidr: \"::ffff:10.0.0.0/104\"\nallow:\n  - cidr: \
             \"::ffff:192.0.2.7\"\n    ports: [443]\n  - cidr: \"2001:db8::/32\"\n",
        );
        assert!(
            w.iter()
                .any(|w| w.starts_with("p.yaml:3:12: `::ffff:10.0.0.0/104`")
                    && w.ends_with("write `10.0.0.0/8`")),
            "{w:?}"
        );
        assert!(
            w.iter()
                .any(|w| w.starts_with("p.yaml:5:12: `::ffff:192.0.2.7/128`")
                    && w.ends_with("write `192.0.2.7/32`")),
            "{w:?}"
        );
        assert_eq!(w.len(), 2, "{w:?}");
        assert_eq!(
            ipv4_mapped(&"::ffff:0:0/96".parse().unwrap()),
            Some("0.0.0.0/0".parse().unwrap())
        );
        assert_eq!(ipv4_mapped(&"::/0".parse().unwrap()), None);
        assert_eq!(ipv4_mapped(&"::/95".parse().unwrap()), None);
    }

    #[test]
    fn shadowed_allow_and_missing_established_are_warned() {
        let p = parse(
            "version: 1\nallow:\n  - cidr: 10.1.0.0/16\ndeny:\n  - cidr: 10.0.0.0/8\nessentials: [loopback]\n",
        )
        .expect("valid");
        let w = p.warnings();
        assert!(w.iter().any(|w| w.contains("10.1.0.0/16")), "{w:?}");
        assert!(w.iter().any(|w| w.contains("established")), "{w:?}");
        assert!(parse(FULL).unwrap().warnings().is_empty());
    }

    #[test]
    fn domain_entries_need_ports_and_narrow_ranges() {
        let (line, col, msg) = err("version: 1\nallow:\n  - domain: api.example.com\n");
        assert_eq!((line, col), (3, 13), "{msg}");
        assert!(msg.contains("needs `ports:`"), "{msg}");
        let (line, col, msg) =
            err("version: 1\nallow:\n  - domain: api.example.com\n    ports: [\"1000-2000\"]\n");
        assert_eq!((line, col), (4, 14), "{msg}");
        assert!(msg.contains("spans more than 256 ports"), "{msg}");
        let p = parse("version: 1\nallow:\n  - domain: a.example\n    ports: [\"8000-8255\"]\n");
        assert!(p.is_ok(), "{p:?}");
    }

    #[test]
    fn refresh_and_grace_durations() {
        let p = parse("version: 1\ndns:\n  refresh: { min: 5s, max: 2h }\n  grace: 1m\n")
            .expect("valid");
        assert_eq!(p.dns.refresh_min, Duration::from_secs(5));
        assert_eq!(p.dns.refresh_max, Duration::from_secs(7200));
        assert_eq!(p.dns.grace, Duration::from_secs(60));
        let d = parse("version: 1\n").expect("valid");
        assert_eq!(
            (d.dns.refresh_min, d.dns.refresh_max, d.dns.grace),
            (DEFAULT_REFRESH_MIN, DEFAULT_REFRESH_MAX, DEFAULT_GRACE)
        );
        let (line, col, msg) = err("version: 1\ndns:\n  grace: 10 minutes\n");
        assert_eq!((line, col), (3, 10), "{msg}");
        assert!(msg.contains("not a duration"), "{msg}");
        let (_, _, msg) = err("version: 1\ndns:\n  refresh: { min: 2h, max: 1h }\n");
        assert!(msg.contains("swap them"), "{msg}");
        let (_, _, msg) = err("version: 1\ndns:\n  grace: 0s\n");
        assert!(msg.contains("is zero"), "{msg}");
        // Would overflow a deadline (and a kernel timeout in milliseconds).
        let (line, _, msg) = err("version: 1\ndns:\n  grace: 99999999999999999d\n");
        assert_eq!(line, 3);
        assert!(msg.contains("longer than a year"), "{msg}");
        assert!(parse("version: 1\ndns:\n  grace: 365d\n").is_ok());
    }

    #[test]
    fn probe_section_parses_targets_and_defaults() {
        let p = parse(
            "version: 1\nprobe:\n  blocked: [\"paste.example:443\", \"203.0.113.9:80\", \"[2001:db8::9]:443\"]\n  rogue_resolvers: [198.51.100.53]\n  exfil_domain: exfil.example.com\n",
        )
        .expect("valid");
        let shown: Vec<String> = p.probe.blocked.iter().map(|t| t.to_string()).collect();
        assert_eq!(
            shown,
            ["paste.example:443", "203.0.113.9:80", "[2001:db8::9]:443"]
        );
        assert_eq!(
            p.probe.rogue_resolvers,
            vec!["198.51.100.53".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(p.probe.exfil_domain.unwrap().as_str(), "exfil.example.com");
        let d = parse("version: 1\n").expect("valid");
        assert!(d.probe.blocked.is_empty());
        assert_eq!(d.probe.rogue_resolvers.len(), DEFAULT_ROGUE_RESOLVERS.len());
        assert_eq!(d.probe.exfil_domain, None);
        for bad in [
            "\"paste.example\"",
            "\"2001:db8::9:443\"",
            "\"a.example:0\"",
            "\"[zz]:1\"",
        ] {
            let (line, _, msg) = err(&format!("version: 1\nprobe:\n  blocked: [{bad}]\n"));
            assert_eq!(line, 3, "{bad}: {msg}");
        }
    }

    #[test]
    fn error_display_starts_with_file_line_column() {
        let e = parse("version: 1\nbogus: 1\n").unwrap_err();
        assert!(e.to_string().starts_with("p.yaml:2:1: "), "{e}");
    }

    const GUARD: &str = "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [443]\n  - domain: \"**.cdn.example\"\n    ports: [80, 443]\n  - domain: api.example\n    ports: [443]\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n";

    #[test]
    fn guard_mode_reads_its_settings_with_defaults() {
        let p = parse(GUARD).expect("valid");
        let g = p.dns.guard.as_ref().expect("guard mode");
        assert_eq!(g.listen, vec!["127.0.0.53:53".parse().unwrap()]);
        assert_eq!(g.upstream, vec!["192.0.2.53".parse::<IpAddr>().unwrap()]);
        assert_eq!(g.refuse_with, RefuseWith::Refused);
        assert_eq!(g.floor, DEFAULT_FLOOR);
        assert_eq!(g.mark, DEFAULT_GUARD_MARK);
        // DNS over HTTPS to public resolvers is denied without being asked for.
        let doh = p.denied_by("1.1.1.1".parse().unwrap()).expect("denied");
        assert_eq!(doh.origin, DenyOrigin::Preset(Preset::DnsOverHttps));

        let p = parse(&GUARD.replace(
            "  upstream: [192.0.2.53]\n",
            "  upstream: [192.0.2.53]\n  listen: [\"[::1]:5353\", 127.0.0.1]\n  refuse_with: nxdomain\n  floor: 2m\n  mark: 0x1e00\n",
        ))
        .expect("valid");
        let g = p.dns.guard.expect("guard mode");
        assert_eq!(g.mark, 0x1e00);
        assert_eq!(
            g.listen,
            vec![
                "[::1]:5353".parse().unwrap(),
                "127.0.0.1:53".parse().unwrap()
            ]
        );
        assert_eq!(g.refuse_with, RefuseWith::Nxdomain);
        assert_eq!(g.floor, Duration::from_secs(120));
        assert!(parse(FULL).expect("valid").dns.guard.is_none());
    }

    #[test]
    fn guard_mode_settings_are_checked() {
        let (line, _, msg) = err("version: 1\ndns:\n  mode: guard\n");
        assert_eq!(line, 3);
        assert!(msg.contains("upstream: [192.0.2.53]"), "{msg}");
        let (line, _, msg) = err(
            "version: 1\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  resolvers: [192.0.2.53]\n",
        );
        assert_eq!(line, 5);
        assert!(msg.contains("rename `resolvers` to `upstream`"), "{msg}");
        let (line, _, msg) = err("version: 1\ndns:\n  upstream: [192.0.2.53]\n");
        assert_eq!(line, 3);
        assert!(msg.contains("add `mode: guard`"), "{msg}");
        let (line, col, msg) = err(
            "version: 1\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  listen: [localhost]\n",
        );
        assert_eq!((line, col), (5, 12), "{msg}");
        assert!(msg.contains("127.0.0.53:53"), "{msg}");
        let (line, _, msg) = err("version: 1\ndns:\n  mode: proxy\n");
        assert_eq!(line, 3, "{msg}");
        let (line, _, msg) =
            err("version: 1\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  mark: 0\n");
        assert_eq!(line, 5, "{msg}");
        assert!(msg.contains("unmarked socket"), "{msg}");
    }

    #[test]
    fn wildcards_need_guard_mode_and_match_by_depth() {
        let (line, col, msg) = err(
            "version: 1\nallow:\n  - domain: api.example\n    ports: [443]\n  - domain: \"*.pool.example\"\n    ports: [443]\n",
        );
        assert_eq!((line, col), (5, 14), "{msg}");
        assert!(msg.contains("dns.mode: guard"), "{msg}");
        let (_, _, msg) = err(&GUARD.replace("*.pool", "a.*.pool"));
        assert!(msg.contains("whole first label"), "{msg}");

        let p = parse(GUARD).expect("valid");
        let allowed = |name: &str| {
            let name: DomainName = name.parse().unwrap();
            p.allow.iter().any(|a| a.target.matches(&name))
        };
        assert!(allowed("a.pool.example"));
        assert!(!allowed("a.b.pool.example"), "`*` is one label");
        assert!(
            !allowed("pool.example"),
            "a wildcard never covers its suffix"
        );
        assert!(!allowed("xpool.example"));
        assert!(allowed("a.cdn.example"));
        assert!(allowed("a.b.c.cdn.example"), "`**` is any depth");
        assert!(!allowed("cdn.example"));
        assert!(allowed("api.example"));
        assert!(
            !allowed("x.api.example"),
            "an exact name covers no subdomain"
        );
        assert!(p.domains().iter().all(|d| d.as_str() == "api.example"));
    }

    #[test]
    fn wildcards_over_shared_suffixes_warn() {
        let with = |pattern: &str| {
            parse(&GUARD.replace("*.pool.example", pattern))
                .expect("valid")
                .warnings()
        };
        let w = with("*.herokuapp.com");
        assert!(
            w.iter().any(|w| w.contains("under `herokuapp.com`")),
            "{w:?}"
        );
        let w = with("**.googleapis.com");
        assert!(
            w.iter().any(|w| w.contains("storage.googleapis.com")),
            "{w:?}"
        );
        let w = with("*.com");
        assert!(
            w.iter().any(|w| w.contains("top-level domain `com`")),
            "{w:?}"
        );
        assert!(with("*.mine.herokuapp.com").is_empty());
        let refresh =
            parse(&GUARD.replace("  mode: guard\n", "  mode: guard\n  refresh: { min: 5s }\n"))
                .expect("valid")
                .warnings();
        assert!(
            refresh
                .iter()
                .any(|w| w.contains("no effect in guard mode")),
            "{refresh:?}"
        );
        assert!(with("*.pool.example").is_empty());
    }

    /// A policy with a log section of `log`, e.g. "rate: 1/day\n  burst: 9".
    fn with_log(log: &str) -> String {
        format!("version: 1\nallow:\n  - cidr: 192.0.2.0/24\nlog:\n  {log}\n")
    }

    #[test]
    fn log_limits_mirror_nft_limit_init_at_and_past_the_boundary() {
        // Measured with nft on 6.18: each first value is taken, each second refused.
        for (ok, refused, key) in [
            (
                "rate: 1/day\n  burst: 213503",
                "rate: 1/day\n  burst: 213504",
                "burst",
            ),
            (
                "rate: 18446744073709551595/second\n  burst: 20",
                "rate: 18446744073709551596/second\n  burst: 20",
                "burst",
            ),
            (
                "rate: 18446744073709551594/second",
                "rate: 18446744073709551615/second",
                "rate",
            ),
            (
                "rate: 1/second\n  burst: 4294967295",
                "rate: 1/day\n  burst: 4294967295",
                "burst",
            ),
            ("burst: 1", "burst: 0", "burst"),
        ] {
            let p = parse(&with_log(ok)).unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert!(kernel_accepts_limit(
                p.log.rate.count,
                p.log.rate.unit.seconds(),
                p.log.burst
            ));
            let (line, column, message) = err(&with_log(refused));
            let want_line = if key == "rate" {
                5
            } else {
                with_log(refused).lines().count()
            };
            assert_eq!((line, column), (want_line, 3), "{refused}: {message}");
            assert!(message.contains("kernel"), "{message}");
        }
        let (_, _, message) = err(&with_log("rate: 1/day\n  burst: 213504"));
        assert!(message.contains("213503"), "{message}");
        assert!(!kernel_accepts_limit(1, 1, 0));
        assert!(kernel_accepts_limit(10, 1, 20));
    }

    #[test]
    fn log_prefix_and_group_limits_are_the_kernels() {
        let prefix = |n: usize| with_log(&format!("prefix: \"{}\"", "a".repeat(n)));
        assert_eq!(parse(&prefix(127)).expect("valid").log.prefix.len(), 127);
        let (line, column, message) = err(&prefix(128));
        assert_eq!((line, column), (5, 3));
        assert!(message.contains("127 bytes"), "{message}");
        assert!(parse(&with_log("prefix: \"\"")).is_ok());
        // NFLOG groups are 16-bit; every one of them is taken.
        assert_eq!(
            parse(&with_log("group: 65535")).expect("valid").log.group,
            Some(65535)
        );
        assert_eq!(
            parse(&with_log("group: 0")).expect("valid").log.group,
            Some(0)
        );
        let (line, _, _) = err(&with_log("group: 65536"));
        assert_eq!(line, 5);
    }

    #[test]
    fn oversized_policies_are_refused_before_parsing() {
        let padding = |n: usize| format!("version: 1\n{}", "#\n".repeat(n));
        let limit = MAX_POLICY_BYTES as usize;
        let at_limit = padding((limit - 11) / 2);
        assert!(at_limit.len() <= limit && at_limit.len() > limit - 2);
        assert!(parse(&at_limit).is_ok());
        let over = format!("{at_limit}##");
        let (line, _, message) = err(&over);
        assert_eq!(line, 0);
        assert!(message.contains("1024 KiB"), "{message}");

        // What the file holds past the limit is never read.
        let dir = std::env::temp_dir().join(format!("ef-policy-size-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("big.yaml");
        std::fs::write(&file, padding(limit)).expect("write");
        let e = Policy::load(&file).expect_err("too big");
        std::fs::remove_dir_all(&dir).expect("clean up");
        assert!(e.to_string().contains("larger than"), "{e}");
    }

    #[test]
    fn deep_nesting_is_refused_at_the_bracket_that_goes_too_deep() {
        let nested = |n: usize| {
            format!(
                "version: 1\nallow:\n  - cidr: 192.0.2.0/24\n    ports: {}{}\n",
                "[".repeat(n),
                "]".repeat(n)
            )
        };
        // Within the limit the text reaches serde, which refuses it as the wrong shape.
        let (_, _, message) = err(&nested(MAX_POLICY_NESTING));
        assert!(!message.contains("nested"), "{message}");
        let (line, column, message) = err(&nested(MAX_POLICY_NESTING + 1));
        assert_eq!((line, column), (4, 11 + MAX_POLICY_NESTING + 1));
        assert!(message.contains("nested more than 32"), "{message}");
        // The issue's 240 KB of `[` is refused by the scan, before the YAML parser.
        let (line, column, _) = err(&"[".repeat(240_000));
        assert_eq!((line, column), (1, MAX_POLICY_NESTING + 1));
        // Brackets in comments do not count; in a quoted or block scalar they do, so that no
        // quote can hide the brackets after it.
        let commented = format!(
            "version: 1\n# {}\nlog:  # {}\n",
            "[".repeat(40),
            "{".repeat(40)
        );
        assert!(parse(&commented).is_ok());
        let (line, _, _) = err(&format!(
            "version: 1\nlog:\n  prefix: \"{}\"\n",
            "[".repeat(40)
        ));
        assert_eq!(line, 3);
        let hidden = format!(
            "version: 1\nprobe:\n  exfil_domain: |\n    '\nallow: [x', {}\n",
            "[".repeat(40)
        );
        assert_eq!(err(&hidden).0, 5);
        // The schema's own flow style is far inside the limit.
        assert!(parse(FULL).is_ok());
    }

    #[test]
    fn a_long_value_is_not_quoted_whole() {
        let (_, _, message) = err(&format!("version: 1\nallow: {}\n", "\u{e9}".repeat(5000)));
        assert!(message.len() < 520, "{} bytes", message.len());
        assert!(message.ends_with("..."), "{message}");
    }

    #[test]
    fn several_documents_are_named_as_such() {
        for (src, line) in [
            ("version: 1\n---\nallow: []\n", 2),
            ("---\nversion: 1\n---\nversion: 1\n", 3),
            ("--- {version: 1}\n--- {version: 1}\n", 2),
            ("---\n---\nversion: 1\n", 2),
            ("version: 1\n...\nallow: []\n", 3),
        ] {
            let (l, column, message) = err(src);
            assert_eq!((l, column), (line, 1), "{src:?}");
            assert!(message.contains("second YAML document"), "{message}");
        }
        // One document, with its optional markers, is fine.
        assert!(parse("---\nversion: 1\n...\n").is_ok());
        assert!(parse("# comment\n---\nversion: 1\n").is_ok());
        assert!(parse("--- # policy\nversion: 1\n").is_ok());
    }
}
