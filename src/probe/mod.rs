//! The boundary check: `egress-fence probe` tries, from inside the boundary, what the policy
//! promises, with real sockets, and says for each attempt whether the promise holds.
//!
//! - Every allowed name resolves through the allowed resolvers, and each of its address/port
//!   pairs accepts a TCP connection (UDP: is not refused by this host's rules).
//! - The metadata service (`cloud-metadata` preset) and every `probe.blocked` target are
//!   refused, over TCP and UDP, on every address they have.
//! - DNS to `probe.rogue_resolvers` is refused, over UDP and TCP.
//! - A random name under `probe.exfil_domain` does not resolve through the allowed resolvers
//!   (if it does, DNS can carry data out: a warning in resolve mode, which cannot filter
//!   names).
//!
//! In `dns.mode: guard` the guard is the resolver, and the checks follow it:
//!
//! - resolv.conf names the guard, and the guard answers on each `listen` address over UDP and
//!   TCP; allowed names are resolved by asking the guard itself (a small client here, so that
//!   REFUSED and NXDOMAIN stay apart), and their addresses then connect, since the guard added
//!   them to the table before it answered;
//! - DNS straight to each upstream resolver (UDP and TCP 53, TCP and UDP 853) is refused. The
//!   table lets through only sockets of the guard's uid that carry the guard's mark (`meta
//!   mark M meta skuid U`); the probe never marks its sockets, so it is refused whatever its
//!   uid, the guard's included. Only a table of an older version, which knows the guard by its
//!   uid alone, lets a probe of that uid through: it cannot tell, and says so (WARN) instead
//!   of trying. The uid and mark come from the installed table, or, when this probe may not
//!   read it (an unprivileged user), from the owner of the guard's listening socket and the
//!   policy;
//! - a random name under `probe.exfil_domain` (else under `egress-fence-probe.invalid`) is
//!   asked of the guard: answered REFUSED or NXDOMAIN and covered by no allow entry, it was
//!   refused without being forwarded (PASS); any address in the answer, or an allow entry (a
//!   wildcard) that covers the name, means the guard forwards such names, so DNS questions can
//!   carry data to whoever serves that zone (FAIL);
//! - the `dns-over-https` preset (implied by guard mode) is checked in the installed table's
//!   deny sets, never with traffic: its addresses are public resolvers.
//!
//! In both modes every element of the installed resolved sets must be one the policy explains
//! (an allowed name's, on that name's ports, within the lifetime cap where the service keeps
//! the table); each other one is a FAIL.
//!
//! Last, in both modes: whether this process can open a packet socket (`AF_PACKET`) or an XDP
//! socket (`AF_XDP`), both of which take CAP_NET_RAW. Frames written to them never meet the
//! output hook and nftables cannot refuse them (README, "What the fence cannot stop"), so
//! either is a FAIL for a process without CAP_NET_ADMIN, and skipped, with the reason, for
//! one that holds it.
//!
//! Everything runs in the caller's network namespace: the CLI enters `--netns` first, and the
//! probe's threads inherit the namespace of the thread that calls [`run`].
//!
//! How a refusal is recognised (Linux, observed in the integration tests):
//! - UDP: a datagram the output hook refuses fails in `send` with EPERM, for `action: drop`
//!   and `action: reject` alike (reject's verdict is a drop after the ICMP error is sent). The
//!   ICMP error of `reject` then arrives on the socket: EHOSTUNREACH over IPv4 (admin
//!   prohibited), EACCES over IPv6. A `send` that succeeds means the datagram left this host,
//!   whatever comes back afterwards.
//! - TCP: the SYN's EPERM is not reported by `connect`. With `reject` the ICMP error fails the
//!   connect (EHOSTUNREACH or EACCES; over IPv6 only at the first SYN retransmission, after
//!   about a second); with `drop` the connect times out. A timeout therefore counts as
//!   refused, a TCP reset (ECONNREFUSED) as proof that the SYN got through.

use std::collections::HashSet;
use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hickory_proto::op::Query;
use hickory_proto::rr::{Name, RecordType};
use ipnet::IpNet;
use serde::Serialize;

use crate::core::plan::{DNS_PORT, DOT_PORT};
use crate::core::policy::{
    Allow, DenyOrigin, DomainName, Guard, L4Proto, Policy, PortRange, Preset, ProbeHost, Target,
};
use crate::core::resolution::{ResolvedAddr, ResolvedHost};
use crate::core::ruleset::{Elements, Family, SetId, SetRole, TABLE, Timed};
use crate::dns::exchange;
use crate::dns::message::{self, MAX_MESSAGE};
use crate::dns::resolve::{ResolveError, resolve_names, system_resolvers};
use crate::nft::{LiveTable, Nft};

/// What [`run`] needs besides the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeOptions {
    /// Resolve mode: the allowed resolvers; names are resolved through them, and DNS to them
    /// must work. Guard mode: the guard's upstream resolvers, which only the guard may reach.
    pub resolvers: Vec<IpAddr>,
    /// How long one connection attempt may take. A UDP attempt waits for a reply at most
    /// this long, and never more than [`MAX_UDP_WAIT`]: silence is an answer for UDP.
    pub timeout: Duration,
    /// The effective uid of this probe, which its sockets carry (what `meta skuid` matches).
    pub uid: u32,
    /// What the installed table says, for the checks no traffic may settle (guard mode, the
    /// `dns-over-https` preset).
    pub table: TableView,
    /// Guard mode: the nameservers of resolv.conf, which should be the guard.
    pub system: Option<SystemResolvers>,
    /// Guard mode: the uid owning the guard's listening socket and its address, read from
    /// /proc: the guard's uid when the table cannot be read.
    pub guard_socket: Option<(u32, SocketAddr)>,
}

impl ProbeOptions {
    /// Per connection attempt: long enough for a distant service, short enough that a probe
    /// of a typical policy (whose refused TCP attempts under `action: drop` all wait this
    /// long, concurrently) takes a few seconds.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

    /// The policy's `dns.resolvers`, else the nameservers of `resolv_conf` (the resolvers
    /// `apply` allows), with the default timeout. In guard mode: the upstream resolvers, what
    /// resolv.conf names, the installed table (read from the current network namespace) and
    /// the owner of the guard's socket.
    pub fn for_policy(policy: &Policy, resolv_conf: &Path) -> Result<ProbeOptions, ProbeError> {
        // Always read: every policy's resolved elements are checked against it, and guard
        // mode and the `dns-over-https` preset need its rules and deny sets.
        let table = TableView::read();
        let uid = nix::unistd::geteuid().as_raw();
        if let Some(guard) = &policy.dns.guard {
            return Ok(ProbeOptions {
                resolvers: guard.upstream.clone(),
                timeout: Self::DEFAULT_TIMEOUT,
                uid,
                table,
                system: Some(SystemResolvers {
                    path: resolv_conf.display().to_string(),
                    nameservers: system_resolvers(resolv_conf).map_err(|e| e.to_string()),
                }),
                guard_socket: guard
                    .listen
                    .iter()
                    .find_map(|&l| socket_owner(l).map(|uid| (uid, l))),
            });
        }
        let resolvers = match &policy.dns.resolvers {
            Some(r) => r.clone(),
            None => system_resolvers(resolv_conf)?,
        };
        Ok(ProbeOptions {
            resolvers,
            timeout: Self::DEFAULT_TIMEOUT,
            uid,
            table,
            system: None,
            guard_socket: None,
        })
    }
}

/// resolv.conf as the probe found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemResolvers {
    pub path: String,
    /// Its nameservers, or why they could not be read.
    pub nameservers: Result<Vec<IpAddr>, String>,
}

/// The installed table, as far as the probe needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableView {
    /// Not read: nothing in the policy needs it.
    NotRead,
    /// Table inet egress_fence is not installed.
    NotInstalled,
    /// Reading it failed, e.g. without CAP_NET_ADMIN (a probe run as an unprivileged user).
    Unreadable(String),
    Read(TableFacts),
}

/// What the installed table says about DNS and denied networks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableFacts {
    /// The uids of the rules `meta mark M meta skuid U ... @dns4/@dns6 accept`: in guard mode
    /// only their sockets may reach the resolvers.
    pub dns_uids: Vec<u32>,
    /// The marks of those rules; none in a table that knows the guard by its uid alone.
    pub dns_marks: Vec<u32>,
    /// A rule accepts DNS to the resolvers from every uid (a resolve-mode table).
    pub dns_for_everyone: bool,
    /// The networks of the deny sets.
    pub denied: Vec<IpNet>,
    /// The elements of the resolved sets, which the policy must explain.
    pub resolved: Vec<Timed>,
}

impl TableView {
    /// Reads table inet egress_fence of the current network namespace.
    pub fn read() -> TableView {
        match Nft::open().and_then(|mut nft| nft.read_table()) {
            Ok(None) => TableView::NotInstalled,
            Ok(Some(table)) => TableView::Read(TableFacts::of(&table)),
            Err(e) if e.is_permission() => TableView::Unreadable(
                "reading nftables needs CAP_NET_ADMIN, which this user lacks".into(),
            ),
            Err(e) => TableView::Unreadable(e.to_string()),
        }
    }
}

impl TableFacts {
    pub fn of(table: &LiveTable) -> TableFacts {
        let access = table.dns_access();
        let mut facts = TableFacts {
            dns_uids: access.uids,
            dns_marks: access.marks,
            dns_for_everyone: access.everyone,
            denied: Vec::new(),
            resolved: Vec::new(),
        };
        for family in Family::BOTH {
            if let Some(Elements::Networks(nets)) =
                table.contents(SetId::new(SetRole::Deny, family))
            {
                facts.denied.extend(nets);
            }
            if let Some(Elements::Timed(elements)) =
                table.contents(SetId::new(SetRole::Resolved, family))
            {
                facts.resolved.extend(elements);
            }
        }
        facts
    }
}

/// The uid owning a socket bound to `addr` (or to the unspecified address on its port) in
/// the calling thread's network namespace, from /proc/thread-self/net (readable by anyone).
fn socket_owner(addr: SocketAddr) -> Option<u32> {
    let files: &[&str] = match addr {
        SocketAddr::V4(_) => &["udp", "tcp"],
        SocketAddr::V6(_) => &["udp6", "tcp6"],
    };
    files.iter().find_map(|f| {
        let text = std::fs::read_to_string(format!("/proc/thread-self/net/{f}")).ok()?;
        text.lines().skip(1).find_map(|line| {
            let (local, uid) = proc_net_socket(line)?;
            let matches = local.port() == addr.port()
                && (local.ip() == addr.ip() || local.ip().is_unspecified());
            matches.then_some(uid)
        })
    })
}

/// The local address and owner uid of one line of /proc/net/{udp,tcp}{,6}: `sl local_address
/// rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...`, addresses as hex words in
/// host byte order.
fn proc_net_socket(line: &str) -> Option<(SocketAddr, u32)> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let (addr, port) = fields.get(1)?.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let uid = fields.get(7)?.parse().ok()?;
    let mut bytes = Vec::with_capacity(16);
    for i in (0..addr.len()).step_by(8) {
        let word = u32::from_str_radix(addr.get(i..i + 8)?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    let ip = match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    Some((SocketAddr::new(ip, port), uid))
}

/// The longest a UDP attempt waits for a reply. UDP gives no confirmation, so silence is a
/// normal outcome; this only bounds how long the probe spends learning that.
pub const MAX_UDP_WAIT: Duration = Duration::from_secs(1);

/// How long a UDP attempt refused with EPERM waits for `reject`'s ICMP error, which only
/// makes the reason more precise (it arrives within microseconds when it comes at all).
const ICMP_WAIT: Duration = Duration::from_millis(100);

/// At most this many attempts run at once.
const MAX_WORKERS: usize = 64;

/// The name asked of rogue resolvers and of the allowed ones: harmless, and answered by
/// every public resolver.
const DNS_TEST_NAME: &str = "example.com";

/// In guard mode without `probe.exfil_domain`, the random exfiltration name goes under this
/// zone: `.invalid` can never exist (RFC 6761), so no answer can be a real one.
pub const DEFAULT_EXFIL_ZONE: &str = "egress-fence-probe.invalid";

const QTYPE_A: RecordType = RecordType::A;
const QTYPE_AAAA: RecordType = RecordType::AAAA;

/// The payload of a UDP attempt, so a listener's owner can tell what it saw.
const UDP_PAYLOAD: &[u8] = b"egress-fence probe\n";

/// The well-known metadata endpoints probed for the `cloud-metadata` preset: AWS/GCP/Azure's
/// link-local address and the IPv6 ones of AWS, GCP and Scaleway, on the HTTP port they serve.
/// Where one does not exist the attempt cannot leave the host, which passes too.
const METADATA_TARGETS: [SocketAddr; 4] = [
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)), 80),
    SocketAddr::new(
        IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
        80,
    ),
    SocketAddr::new(
        IpAddr::V6(Ipv6Addr::new(0xfd20, 0xce, 0, 0, 0, 0, 0, 0x254)),
        80,
    ),
    SocketAddr::new(
        IpAddr::V6(Ipv6Addr::new(0xfd00, 0x42, 0, 0, 0, 0, 0, 0x42)),
        80,
    ),
];

/// Why the probe could not run at all. A check that fails is never an error: it is a
/// [`Check`] with [`Outcome::Fail`].
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(
        "no resolvers to probe with: set `dns.resolvers` in the policy or list a nameserver \
         in resolv.conf"
    )]
    NoResolvers,
    #[error("the probe timeout must be longer than zero")]
    ZeroTimeout,
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error("cannot start a probe thread: {0}")]
    Thread(io::Error),
}

/// The verdict of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// The boundary does what the policy says.
    Pass,
    /// It does not: `passed()` is false and the CLI exits non-zero.
    Fail,
    /// Worth a look, but not a broken promise (an open DNS exfiltration channel, a check
    /// that could not be carried out).
    Warn,
    /// Not checked, and why.
    Skip,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::Warn => "WARN",
            Outcome::Skip => "SKIP",
        })
    }
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    pub outcome: Outcome,
    /// What was tried, e.g. "allowed tcp api.example.com 192.0.2.10:443".
    pub check: String,
    /// Why the outcome, for a human: "connected", "refused: no route to host (ICMP admin
    /// prohibited)".
    pub reason: String,
}

impl Check {
    fn new(outcome: Outcome, check: impl Into<String>, reason: impl Into<String>) -> Check {
        Check {
            outcome,
            check: check.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}  {}: {}", self.outcome, self.check, self.reason)
    }
}

/// Every check, in a stable order: resolvers, allowed entries, denied presets, blocked
/// targets, rogue resolvers, DNS exfiltration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// True when no check failed (warnings and skips do not fail a probe).
    pub fn passed(&self) -> bool {
        self.count(Outcome::Fail) == 0
    }

    /// How many checks ended with `outcome`.
    pub fn count(&self, outcome: Outcome) -> usize {
        self.checks.iter().filter(|c| c.outcome == outcome).count()
    }

    /// "probe: 12 passed, 1 failed, 1 warning" (", 2 skipped" when some were).
    pub fn summary(&self) -> String {
        let warnings = self.count(Outcome::Warn);
        let mut s = format!(
            "probe: {} passed, {} failed, {warnings} warning{}",
            self.count(Outcome::Pass),
            self.count(Outcome::Fail),
            if warnings == 1 { "" } else { "s" }
        );
        let skipped = self.count(Outcome::Skip);
        if skipped > 0 {
            s.push_str(&format!(", {skipped} skipped"));
        }
        s
    }
}

/// Runs every check of `policy` from the current network namespace.
pub fn run(policy: &Policy, options: &ProbeOptions) -> Result<Report, ProbeError> {
    if options.resolvers.is_empty() {
        return Err(ProbeError::NoResolvers);
    }
    if options.timeout.is_zero() {
        return Err(ProbeError::ZeroTimeout);
    }
    let ctx = Ctx {
        timeout: options.timeout,
        udp_wait: options.timeout.min(MAX_UDP_WAIT),
    };
    let guard = policy.dns.guard.as_ref();
    // The guard refuses every name outside the policy, so it can always be checked: under a
    // zone that cannot exist when the policy names none.
    let exfil_name = match (&policy.probe.exfil_domain, guard) {
        (Some(domain), _) => Some(random_name_under(domain)),
        (None, Some(_)) => Some(
            DEFAULT_EXFIL_ZONE
                .parse::<DomainName>()
                .and_then(|zone| random_name_under(&zone)),
        ),
        (None, None) => None,
    };

    // Every name at once: allowed, blocked and the exfiltration test name.
    let mut names: Vec<&DomainName> = policy.domains().into_iter().collect();
    names.extend(policy.probe.blocked.iter().filter_map(|t| match &t.host {
        ProbeHost::Name(n) => Some(n),
        ProbeHost::Addr(_) => None,
    }));
    if let Some(Ok(name)) = &exfil_name {
        names.push(name);
    }
    names.sort();
    names.dedup();
    let (hosts, lookups) = match guard {
        None => (resolve_names(names, &options.resolvers)?, Vec::new()),
        Some(g) => {
            let lookups = guard_lookups(&names, &g.listen, &ctx)?;
            (lookups.iter().map(GuardLookup::host).collect(), lookups)
        }
    };

    let mut plan = Plan::new(policy, options, &hosts, &lookups);
    match guard {
        None => {
            plan.resolvers();
            plan.allowed();
            plan.denied();
            plan.blocked();
            plan.rogue_resolvers();
            plan.exfiltration(exfil_name);
            plan.resolved_elements();
            plan.link_layer();
        }
        Some(g) => {
            plan.system_resolver(g);
            plan.guard_servers(g);
            plan.upstream();
            plan.allowed();
            plan.denied();
            plan.blocked();
            plan.rogue_resolvers();
            plan.guarded_exfiltration(exfil_name);
            plan.resolved_elements();
            plan.link_layer();
        }
    }

    let attempts: Vec<&Attempt> = plan
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::Attempt(a) => Some(a),
            Step::Done(_) => None,
        })
        .collect();
    let mut results = run_concurrently(&attempts, &ctx)?.into_iter();
    let checks = plan
        .steps
        .into_iter()
        .filter_map(|s| match s {
            Step::Done(c) => Some(c),
            Step::Attempt(_) => results.next(),
        })
        .collect();
    Ok(Report { checks })
}

// ---- link-layer frames ---------------------------------------------------------------------

/// The check's name in the report.
pub const LINK_LAYER_CHECK: &str = "link-layer frames (packet and XDP sockets)";

/// Capability numbers (linux/capability.h).
const CAP_NET_ADMIN: u32 = 12;

/// Whether capability `cap` is in this process's effective set (`CapEff` of
/// /proc/self/status); `None` when that cannot be read.
fn capability_effective(cap: u32) -> Option<bool> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    let mask = u64::from_str_radix(hex.trim(), 16).ok()?;
    Some(mask & (1 << cap) != 0)
}

/// The socket families that write frames below the output hook, each tried once: opened (and
/// closed at once; protocol 0, so nothing is received) or the reason it could not be.
fn link_layer_access() -> Vec<(&'static str, Result<(), nix::errno::Errno>)> {
    [("AF_PACKET", libc::AF_PACKET), ("AF_XDP", libc::AF_XDP)]
        .into_iter()
        .map(|(name, family)| {
            let opened = crate::nft::sys::open_socket(family, libc::SOCK_RAW).map(drop);
            (name, opened)
        })
        .collect()
}

/// A frame written to a packet socket (`AF_PACKET`) or an XDP socket (`AF_XDP`), both opened
/// with CAP_NET_RAW (root in a Docker container has it by default), goes straight to the
/// device: it never meets the output hook, so no rule of the table sees it, and it can carry
/// any packet to any address. nftables cannot refuse it at the device either (README, "What
/// the fence cannot stop"): only taking CAP_NET_RAW from the fenced processes closes it, so the
/// probe reports whether this process could open either.
fn link_layer_check(
    access: &[(&'static str, Result<(), nix::errno::Errno>)],
    net_admin: Option<bool>,
) -> Check {
    use nix::errno::Errno;
    let remedy = "drop CAP_NET_RAW for the fenced processes (docker run --cap-drop NET_RAW; \
                  Kubernetes securityContext.capabilities.drop [NET_RAW]; systemd \
                  CapabilityBoundingSet=~CAP_NET_RAW)";
    let opened: Vec<&str> = access
        .iter()
        .filter(|(_, r)| r.is_ok())
        .map(|(name, _)| *name)
        .collect();
    let unclear: Vec<String> = access
        .iter()
        .filter_map(|(name, r)| match r {
            Ok(()) | Err(Errno::EPERM | Errno::EACCES | Errno::EAFNOSUPPORT) => None,
            Err(e) => Some(format!("{name}: {e}")),
        })
        .collect();
    let refused: Vec<String> = access
        .iter()
        .filter_map(|(name, r)| r.err().map(|e| format!("{name}: {e}")))
        .collect();
    let (outcome, reason) = if !opened.is_empty() {
        let which = opened.join(" and ");
        if net_admin == Some(true) {
            (
                Outcome::Skip,
                format!(
                    "this probe holds CAP_NET_ADMIN, so it is not what the fence confines (it \
                     could remove the table); it opened {which}, as any process with \
                     CAP_NET_RAW can, and frames written there never meet nftables' output \
                     hook: run the probe as the fenced user (root in a container: setpriv \
                     --bounding-set=-net_admin) to check them, and {remedy}"
                ),
            )
        } else {
            (
                Outcome::Fail,
                format!(
                    "opened {which} (this process has CAP_NET_RAW): frames written there never \
                     meet nftables' output hook, so it can send any packet to any address past \
                     the fence; {remedy}"
                ),
            )
        }
    } else if !unclear.is_empty() {
        (
            Outcome::Warn,
            format!("could not tell: {}", unclear.join(", ")),
        )
    } else {
        (
            Outcome::Pass,
            format!(
                "cannot open a packet or XDP socket ({}): every packet it sends meets the \
                 output hook",
                refused.join(", ")
            ),
        )
    };
    Check::new(outcome, LINK_LAYER_CHECK, reason)
}

// ---- what to try ---------------------------------------------------------------------------

/// What an attempt is expected to show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// An allowed destination. `strict`: a single allowed port, whose TCP service must accept
    /// the connection; the ends of a port range only need to get through the boundary (a
    /// service rarely listens on every port of a range).
    Reach { strict: bool },
    /// An allowed resolver: a DNS answer must come back.
    Answer,
    /// A destination the boundary must refuse.
    Refuse,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Tcp,
    Udp,
    /// A DNS query over UDP or TCP.
    Dns(L4Proto),
}

#[derive(Debug, Clone)]
struct Attempt {
    check: String,
    kind: Kind,
    target: SocketAddr,
    expect: Expect,
    /// Context added to the reason ("the address lies in the denied preset ...").
    note: Option<String>,
    /// Added only when the check fails: the allow entry that opens the hole, if one does.
    on_fail: Option<String>,
    /// The name a DNS attempt asks ([`DNS_TEST_NAME`] when `None`).
    dns_name: Option<String>,
}

enum Step {
    Done(Check),
    Attempt(Attempt),
}

/// The checks in report order; an attempt's check text appears once however many entries
/// lead to it.
struct Plan<'a> {
    policy: &'a Policy,
    options: &'a ProbeOptions,
    hosts: &'a [ResolvedHost],
    /// Guard mode: how the guard answered each name (`hosts` holds the same, as addresses).
    lookups: &'a [GuardLookup],
    steps: Vec<Step>,
    seen: HashSet<String>,
}

impl<'a> Plan<'a> {
    fn new(
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

    fn done(&mut self, check: Check) {
        if self.seen.insert(check.check.clone()) {
            self.steps.push(Step::Done(check));
        }
    }

    fn attempt(&mut self, attempt: Attempt) {
        if self.seen.insert(attempt.check.clone()) {
            self.steps.push(Step::Attempt(attempt));
        }
    }

    fn host(&self, name: &DomainName) -> Option<&'a ResolvedHost> {
        self.hosts.iter().find(|h| &h.name == name)
    }

    /// Where names were resolved: "192.0.2.53", or "the guard 127.0.0.53:53".
    fn resolver_list(&self) -> String {
        match &self.policy.dns.guard {
            Some(g) => format!("the guard {}", join_sockets(&g.listen)),
            None => join(&self.options.resolvers),
        }
    }

    fn lookup(&self, name: &DomainName) -> Option<&'a GuardLookup> {
        self.lookups.iter().find(|l| &l.name == name)
    }

    /// The allow entry whose name or wildcard covers `name`, as the policy writes it.
    fn covering_entry(&self, name: &DomainName) -> Option<String> {
        self.policy.allow.iter().find_map(|a| match &a.target {
            Target::Domain(d) if d == name => Some(format!("domain {d}")),
            Target::Wildcard(w) if w.matches(name) => Some(format!("domain {w}")),
            _ => None,
        })
    }

    /// Guard mode: resolv.conf should name the guard, or programs here resolve nothing.
    fn system_resolver(&mut self, guard: &Guard) {
        let Some(system) = &self.options.system else {
            return;
        };
        let label = "system resolver";
        let guard_ips: Vec<IpAddr> = guard
            .listen
            .iter()
            .filter(|l| l.port() == DNS_PORT)
            .map(SocketAddr::ip)
            .collect();
        let serves = |ns: &IpAddr| {
            guard_ips
                .iter()
                .any(|g| g == ns || (g.is_unspecified() && g.is_ipv4() == ns.is_ipv4()))
        };
        let check = match &system.nameservers {
            Err(e) => Check::new(
                Outcome::Warn,
                label,
                format!("cannot tell whether programs here ask the guard: {e}"),
            ),
            Ok(ns) => {
                let others: Vec<IpAddr> = ns.iter().filter(|n| !serves(n)).copied().collect();
                if others.is_empty() {
                    Check::new(
                        Outcome::Pass,
                        label,
                        format!("{} names only the guard ({})", system.path, join(ns)),
                    )
                } else {
                    let fix = if guard_ips.is_empty() {
                        format!(
                            "the guard listens on {} only, and resolv.conf can name port 53 \
                             only",
                            join_sockets(&guard.listen)
                        )
                    } else {
                        format!("list only {} there", join(&guard_ips))
                    };
                    Check::new(
                        Outcome::Warn,
                        label,
                        format!(
                            "{} names {}, which is not the guard: programs here that ask it get \
                             no answer (only the guard may reach resolvers); {fix}",
                            system.path,
                            join(&others)
                        ),
                    )
                }
            }
        };
        self.done(check);
    }

    /// Guard mode: the guard answers on each listen address, over UDP and TCP. It is asked an
    /// allowed name when the policy has one (else [`DNS_TEST_NAME`], which it refuses: any
    /// answer shows that it serves).
    fn guard_servers(&mut self, guard: &Guard) {
        let name = self
            .policy
            .domains()
            .into_iter()
            .next()
            .map(|n| n.to_string());
        for &target in &guard.listen {
            for proto in [L4Proto::Udp, L4Proto::Tcp] {
                self.attempt(Attempt {
                    check: format!("guard {} {target}", proto.name()),
                    kind: Kind::Dns(proto),
                    target,
                    expect: Expect::Answer,
                    note: None,
                    on_fail: Some(
                        "the guard does not serve there: is `egress-fence run` running with \
                         this policy?"
                            .into(),
                    ),
                    dns_name: name.clone(),
                });
            }
        }
    }

    /// Who the table lets reach the upstream resolvers.
    fn upstream_access(&self) -> UpstreamAccess {
        // A guard of this version marks its sockets with the policy's mark, and its table
        // asks for it.
        let policy_mark = self.policy.dns.guard.as_ref().map(|g| g.mark);
        let from_socket = |why: String| match self.options.guard_socket {
            Some((uid, addr)) => UpstreamAccess::Uids {
                uids: vec![uid],
                marks: policy_mark.into_iter().collect(),
                source: format!(
                    "the owner of the guard's socket on {addr} and the policy, since the table \
                     {why}"
                ),
            },
            None => UpstreamAccess::Unknown(why),
        };
        match &self.options.table {
            TableView::Read(facts) if facts.dns_for_everyone => UpstreamAccess::Everyone,
            TableView::Read(facts) => UpstreamAccess::Uids {
                uids: facts.dns_uids.clone(),
                marks: facts.dns_marks.clone(),
                source: "the installed table's `meta mark`/`meta skuid` rule".into(),
            },
            TableView::NotInstalled => UpstreamAccess::NoTable,
            TableView::Unreadable(e) => from_socket(format!("cannot be read here: {e}")),
            TableView::NotRead => from_socket("was not read".into()),
        }
    }

    /// Guard mode: DNS (UDP and TCP 53), DNS over TLS (TCP 853) and over QUIC (UDP 853)
    /// straight to each upstream resolver are refused for this probe's unmarked sockets,
    /// whatever its uid (unless an older table knows the guard by this uid alone).
    fn upstream(&mut self) {
        let access = self.upstream_access();
        let uid = self.options.uid;
        let servers = self.options.resolvers.clone();
        for server in servers {
            for (kind, proto, port) in [
                (Kind::Dns(L4Proto::Udp), L4Proto::Udp, DNS_PORT),
                (Kind::Dns(L4Proto::Tcp), L4Proto::Tcp, DNS_PORT),
                (Kind::Tcp, L4Proto::Tcp, DOT_PORT),
                // DNS over QUIC (and over DTLS) use UDP 853.
                (Kind::Udp, L4Proto::Udp, DOT_PORT),
            ] {
                let target = SocketAddr::new(server, port);
                let check = format!("upstream {} {target}", proto.name());
                if let UpstreamAccess::Uids {
                    uids,
                    marks,
                    source,
                } = &access
                    && marks.is_empty()
                    && uids.contains(&uid)
                {
                    self.done(Check::new(
                        Outcome::Warn,
                        check,
                        format!(
                            "not probed: this probe runs as uid {uid}, the guard's uid, which \
                             alone may reach the upstream resolvers (learned from {source}: a \
                             table of an older version, without the guard's socket mark; any \
                             process of that uid, root in a container included, gets through \
                             until `egress-fence run` installs its table), so it cannot tell \
                             whether anyone else is refused; run the probe as the agent's user \
                             (e.g. `setpriv --reuid=USER --regid=GROUP --clear-groups \
                             egress-fence probe ...`)"
                        ),
                    ));
                    continue;
                }
                self.attempt(Attempt {
                    check,
                    kind,
                    target,
                    expect: Expect::Refuse,
                    note: None,
                    on_fail: Some(access.why_through(uid)),
                    dns_name: None,
                });
            }
        }
    }

    /// DNS to each allowed resolver works over UDP and TCP (TCP carries large answers).
    fn resolvers(&mut self) {
        for &server in &self.options.resolvers {
            for proto in [L4Proto::Udp, L4Proto::Tcp] {
                let target = SocketAddr::new(server, DNS_PORT);
                self.attempt(Attempt {
                    check: format!("resolver {} {target}", proto.name()),
                    kind: Kind::Dns(proto),
                    target,
                    expect: Expect::Answer,
                    note: None,
                    on_fail: None,
                    dns_name: None,
                });
            }
        }
    }

    fn allowed(&mut self) {
        let policy = self.policy;
        for allow in &policy.allow {
            match &allow.target {
                Target::Domain(name) => {
                    let Some(host) = self.host(name) else {
                        continue; // every allowed name was resolved
                    };
                    let label = format!("allowed name {name}");
                    if host.addrs.is_empty() {
                        let reason = format!(
                            "did not resolve through {}: {}",
                            self.resolver_list(),
                            host.why_unresolved()
                        );
                        self.done(Check::new(Outcome::Fail, label, reason));
                        continue;
                    }
                    let addrs: Vec<IpAddr> = host.addrs.iter().map(|a| a.addr).collect();
                    let mut reason = format!(
                        "resolved to {} through {}",
                        join(&addrs),
                        self.resolver_list()
                    );
                    let outcome = if host.errors.is_empty() {
                        Outcome::Pass
                    } else {
                        reason.push_str(&format!(", only partly: {}", host.errors.join("; ")));
                        Outcome::Warn
                    };
                    self.done(Check::new(outcome, label, reason));
                    for addr in addrs {
                        self.allowed_addr(allow, &format!("{name} "), addr);
                    }
                }
                Target::Cidr(net) if net.prefix_len() == net.max_prefix_len() => {
                    self.allowed_addr(allow, "", net.addr());
                }
                Target::Cidr(net) => self.done(Check::new(
                    Outcome::Skip,
                    format!("allowed network {net}"),
                    "not probed: the probe tries names and single addresses, not networks",
                )),
                Target::Wildcard(w) => self.done(Check::new(
                    Outcome::Skip,
                    format!("allowed names {w}"),
                    "not probed: a wildcard names no single host",
                )),
            }
        }
    }

    /// The attempts for one allowed address: each protocol, each single port, and both ends
    /// of each range (where an off-by-one in an interval would show).
    fn allowed_addr(&mut self, allow: &Allow, name: &str, addr: IpAddr) {
        let denied = self.policy.denied_by(addr).map(|d| {
            format!(
                "expected: the address lies in the denied {} (deny wins)",
                d.describe()
            )
        });
        for &proto in allow.protocol.l4protos() {
            for range in &allow.ports {
                for (port, strict) in ports_to_probe(*range) {
                    let target = SocketAddr::new(addr, port);
                    let mut check = format!("allowed {} {name}{target}", proto.name());
                    if !range.is_single() {
                        check.push_str(&format!(" (end of {range})"));
                    }
                    self.attempt(Attempt {
                        check,
                        kind: match proto {
                            L4Proto::Tcp => Kind::Tcp,
                            L4Proto::Udp => Kind::Udp,
                        },
                        target,
                        expect: if denied.is_some() {
                            Expect::Refuse
                        } else {
                            Expect::Reach { strict }
                        },
                        note: denied.clone(),
                        on_fail: None,
                        dns_name: None,
                    });
                }
            }
        }
    }

    /// TCP and UDP attempts that must be refused: "denied tcp cloud-metadata 169.254.169.254:80".
    fn refused_pair(&mut self, what: &str, name: Option<&str>, target: SocketAddr) {
        let name = name.map(|n| format!("{n} ")).unwrap_or_default();
        for (kind, proto) in [(Kind::Tcp, L4Proto::Tcp), (Kind::Udp, L4Proto::Udp)] {
            self.attempt(Attempt {
                check: format!("{what} {} {name}{target}", proto.name()),
                kind,
                target,
                expect: Expect::Refuse,
                note: None,
                on_fail: self.allowed_by(target, proto),
                dns_name: None,
            });
        }
    }

    /// The allow entry that lets `target` through, for a refusal check that fails: a deny
    /// the policy forgot. `None` when the policy denies it or no entry covers it (then the
    /// hole is not the policy's: a changed table, or a bug).
    fn allowed_by(&self, target: SocketAddr, proto: L4Proto) -> Option<String> {
        let addr = target.ip();
        if self.policy.denied_by(addr).is_some() {
            return None;
        }
        self.policy.allow.iter().find_map(|allow| {
            let port_ok = allow.protocol.l4protos().contains(&proto)
                && allow
                    .ports
                    .iter()
                    .any(|r| (r.first..=r.last).contains(&target.port()));
            let entry = match &allow.target {
                Target::Cidr(net) if net.contains(&addr) => format!("cidr {net}"),
                Target::Domain(name)
                    if self
                        .host(name)
                        .is_some_and(|h| h.addrs.iter().any(|a| a.addr == addr)) =>
                {
                    format!("domain {name}")
                }
                // The guard allows the addresses it answers for any name the wildcard covers.
                Target::Wildcard(w)
                    if self
                        .hosts
                        .iter()
                        .any(|h| w.matches(&h.name) && h.addrs.iter().any(|a| a.addr == addr)) =>
                {
                    format!("domain {w}")
                }
                _ => return None,
            };
            port_ok.then(|| format!("the policy allows it: allow entry {entry}"))
        })
    }

    fn denied(&mut self) {
        let policy = self.policy;
        for deny in &policy.deny {
            match deny.origin {
                DenyOrigin::Preset(Preset::CloudMetadata) => {
                    for target in METADATA_TARGETS {
                        self.refused_pair("denied", Some("cloud-metadata"), target);
                    }
                }
                DenyOrigin::Preset(Preset::DnsOverHttps) => self.doh_preset(),
                DenyOrigin::Preset(preset) => self.done(Check::new(
                    Outcome::Skip,
                    format!("denied preset {}", preset.name()),
                    "not probed: it has no well-known address; list one under probe.blocked \
                     to check it",
                )),
                DenyOrigin::Cidr => self.done(Check::new(
                    Outcome::Skip,
                    format!("denied {}", deny.describe()),
                    "not probed: list an address of it under probe.blocked to check it",
                )),
            }
        }
    }

    /// Every element of the installed table's resolved sets must be one the policy explains:
    /// an allowed name's, on its ports, with a timeout within the policy's cap where the
    /// service keeps the table. Each one that is not fails, named (a PASS would add nothing
    /// a human reads; a table that cannot be read is checked by the other checks).
    fn resolved_elements(&mut self) {
        let TableView::Read(facts) = &self.options.table else {
            return;
        };
        // Only the service gives elements timeouts (and in guard mode only it adds any).
        let service_owned = self.policy.dns.guard.is_some()
            || facts.resolved.iter().any(|t| t.timeout_ms.is_some());
        let failed: Vec<Check> = facts
            .resolved
            .iter()
            .filter_map(|t| {
                let why = crate::core::plan::unexplained_element(self.policy, t, service_owned)?;
                Some(Check::new(
                    Outcome::Fail,
                    format!(
                        "resolved element {}",
                        crate::core::ruleset::fmt_tuple(&t.tuple)
                    ),
                    format!(
                        "the policy does not explain it: {why} ({})",
                        crate::core::ruleset::fmt_timed(t)
                    ),
                ))
            })
            .collect();
        for check in failed {
            self.done(check);
        }
    }

    /// Whether this process can write link-layer frames (see [`link_layer_check`]).
    fn link_layer(&mut self) {
        self.done(link_layer_check(
            &link_layer_access(),
            capability_effective(CAP_NET_ADMIN),
        ));
    }

    /// The public DNS-over-HTTPS resolvers are never contacted: the installed table's deny
    /// sets must hold every network of the preset.
    fn doh_preset(&mut self) {
        let preset = Preset::DnsOverHttps;
        let label = format!("denied preset {}", preset.name());
        let not_probed = "not probed: its addresses are public resolvers, which the probe never \
                          contacts";
        let check = match &self.options.table {
            TableView::Read(facts) => {
                let networks = preset.networks();
                let missing: Vec<&IpNet> = networks
                    .iter()
                    .filter(|n| !facts.denied.iter().any(|d| d.contains(*n)))
                    .collect();
                if missing.is_empty() {
                    Check::new(
                        Outcome::Pass,
                        label,
                        format!(
                            "the installed table denies all {} of its networks ({not_probed})",
                            networks.len()
                        ),
                    )
                } else {
                    Check::new(
                        Outcome::Fail,
                        label,
                        format!(
                            "the installed table does not deny {} of its {} networks ({}{}): \
                             DNS over HTTPS to them gets around the guard",
                            missing.len(),
                            networks.len(),
                            missing
                                .iter()
                                .take(4)
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                                .join(", "),
                            if missing.len() > 4 { ", ..." } else { "" }
                        ),
                    )
                }
            }
            TableView::NotInstalled => Check::new(
                Outcome::Fail,
                label,
                format!("table inet {TABLE} is not installed, so nothing denies it"),
            ),
            TableView::Unreadable(e) => Check::new(
                Outcome::Skip,
                label,
                format!(
                    "{not_probed}, and the table that denies them cannot be read here ({e}); run \
                     the probe as root once to check the table"
                ),
            ),
            TableView::NotRead => Check::new(
                Outcome::Skip,
                label,
                format!("{not_probed}; the table was not read"),
            ),
        };
        self.done(check);
    }

    fn blocked(&mut self) {
        let policy = self.policy;
        for blocked in &policy.probe.blocked {
            match &blocked.host {
                ProbeHost::Addr(addr) => {
                    self.refused_pair("blocked", None, SocketAddr::new(*addr, blocked.port))
                }
                ProbeHost::Name(name) => {
                    let Some(host) = self.host(name) else {
                        continue;
                    };
                    let refused = self.lookup(name).and_then(GuardLookup::refusal);
                    if let Some(rcode) = refused.filter(|_| self.covering_entry(name).is_none()) {
                        let reason = format!(
                            "{} refused it ({rcode}): nothing here can look it up; list its \
                             addresses as HOST:PORT to check them too",
                            self.resolver_list()
                        );
                        self.done(Check::new(
                            Outcome::Pass,
                            format!("blocked name {name}"),
                            reason,
                        ));
                        continue;
                    }
                    if host.addrs.is_empty() {
                        let reason = format!(
                            "did not resolve through {} ({}): nothing to probe; list its \
                             addresses as HOST:PORT to check them",
                            self.resolver_list(),
                            host.why_unresolved()
                        );
                        self.done(Check::new(
                            Outcome::Warn,
                            format!("blocked name {name}"),
                            reason,
                        ));
                        continue;
                    }
                    for a in &host.addrs {
                        let target = SocketAddr::new(a.addr, blocked.port);
                        self.refused_pair("blocked", Some(name.as_str()), target);
                    }
                }
            }
        }
    }

    fn rogue_resolvers(&mut self) {
        let policy = self.policy;
        for &server in &policy.probe.rogue_resolvers {
            if self.options.resolvers.contains(&server) {
                let which = match policy.dns.guard {
                    Some(_) => "the guard's upstream resolvers (checked above)",
                    None => "the allowed resolvers",
                };
                self.done(Check::new(
                    Outcome::Warn,
                    format!("rogue resolver {server}"),
                    format!("not probed: it is one of {which}"),
                ));
                continue;
            }
            for proto in [L4Proto::Udp, L4Proto::Tcp] {
                let target = SocketAddr::new(server, DNS_PORT);
                self.attempt(Attempt {
                    check: format!("rogue resolver {} {target}", proto.name()),
                    kind: Kind::Dns(proto),
                    target,
                    expect: Expect::Refuse,
                    note: None,
                    on_fail: None,
                    dns_name: None,
                });
            }
        }
    }

    fn exfiltration(&mut self, name: Option<Result<DomainName, String>>) {
        let check = match name {
            None => Check::new(
                Outcome::Skip,
                "dns exfiltration",
                "no probe.exfil_domain: set it to a domain with a wildcard record to check \
                 whether DNS can carry data out",
            ),
            Some(Err(e)) => Check::new(Outcome::Warn, "dns exfiltration", e),
            Some(Ok(name)) => {
                let label = format!("dns exfiltration {name}");
                match self.host(&name) {
                    None => Check::new(Outcome::Warn, label, "the name was not looked up"),
                    Some(host) if !host.addrs.is_empty() => {
                        let addrs: Vec<IpAddr> = host.addrs.iter().map(|a| a.addr).collect();
                        Check::new(
                            Outcome::Warn,
                            label,
                            format!(
                                "a random name resolved to {} through {}: the allowed \
                                 resolvers answer arbitrary names, so DNS queries can carry \
                                 data out (a warning in resolve mode; `dns.mode: guard` \
                                 closes it)",
                                join(&addrs),
                                self.resolver_list()
                            ),
                        )
                    }
                    Some(host) if !host.errors.is_empty() => Check::new(
                        Outcome::Warn,
                        label,
                        format!("inconclusive: {}", host.errors.join("; ")),
                    ),
                    Some(host) => Check::new(
                        Outcome::Pass,
                        label,
                        format!(
                            "a random name under it did not resolve through {}: {}",
                            self.resolver_list(),
                            host.why_unresolved()
                        ),
                    ),
                }
            }
        };
        self.done(check);
    }

    /// Guard mode: a random name outside the policy must be refused by the guard itself,
    /// never forwarded. An answer with addresses, or an allow entry covering the name (the
    /// guard forwards what the policy allows, so the zone's servers hear every question under
    /// it), is an open channel.
    fn guarded_exfiltration(&mut self, name: Option<Result<DomainName, String>>) {
        let check = match name {
            None => return,
            Some(Err(e)) => Check::new(Outcome::Warn, "dns exfiltration", e),
            Some(Ok(name)) => {
                let label = format!("dns exfiltration {name}");
                let via = self.resolver_list();
                let covered = self.covering_entry(&name);
                let default_zone = match &self.policy.probe.exfil_domain {
                    Some(_) => String::new(),
                    None => format!(
                        " (no probe.exfil_domain: a name under the reserved {DEFAULT_EXFIL_ZONE})"
                    ),
                };
                match (self.lookup(&name), self.host(&name)) {
                    (Some(_), Some(host)) if !host.addrs.is_empty() => {
                        let addrs: Vec<IpAddr> = host.addrs.iter().map(|a| a.addr).collect();
                        let why = match &covered {
                            Some(entry) => format!("the allow entry {entry} covers it"),
                            None => "no allow entry covers it".into(),
                        };
                        Check::new(
                            Outcome::Fail,
                            label,
                            format!(
                                "a random name resolved to {} through {via} ({why}): the guard \
                                 forwarded it, so DNS queries can carry data out",
                                join(&addrs)
                            ),
                        )
                    }
                    (Some(lookup), _) if covered.is_some() => Check::new(
                        Outcome::Fail,
                        label,
                        format!(
                            "the allow entry {} covers it, so {via} forwards it upstream ({}): \
                             every question under it carries data to that zone's name servers",
                            covered.unwrap_or_default(),
                            lookup.outcome()
                        ),
                    ),
                    (Some(lookup), _) => match lookup.refusal() {
                        Some(rcode) => Check::new(
                            Outcome::Pass,
                            label,
                            format!(
                                "DNS exfiltration closed: the guard refused {name} without \
                                 forwarding it ({rcode}){default_zone}"
                            ),
                        ),
                        None => Check::new(
                            Outcome::Warn,
                            label,
                            format!("inconclusive: {}", lookup.outcome()),
                        ),
                    },
                    (None, _) => Check::new(Outcome::Warn, label, "the name was not looked up"),
                }
            }
        };
        self.done(check);
    }
}

/// Who the installed table lets reach the upstream resolvers.
#[derive(Debug, Clone, PartialEq, Eq)]
enum UpstreamAccess {
    /// Only sockets of these uids (`meta skuid`) that carry one of these marks (`meta
    /// mark`; none: the uid alone); `source` says where that was learned.
    Uids {
        uids: Vec<u32>,
        marks: Vec<u32>,
        source: String,
    },
    /// Every uid: the table is a resolve-mode one.
    Everyone,
    /// No table: nothing is refused.
    NoTable,
    /// Not known, and why.
    Unknown(String),
}

impl UpstreamAccess {
    /// Said when an attempt of `uid` got through.
    fn why_through(&self, uid: u32) -> String {
        match self {
            UpstreamAccess::Uids { uids, source, .. } if uids.is_empty() => {
                format!("no uid may reach it (learned from {source}), yet uid {uid} did")
            }
            UpstreamAccess::Uids {
                uids,
                marks,
                source,
            } => format!(
                "only sockets of uid {}{} may reach it (learned from {source}), yet this probe \
                 (uid {uid}, its sockets unmarked) got through: another rule lets it",
                uids.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                if marks.is_empty() {
                    String::new()
                } else {
                    format!(
                        " marked {}",
                        marks
                            .iter()
                            .map(|m| format!("{m:#x}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
            ),
            UpstreamAccess::Everyone => "the installed table lets every uid reach the \
                 resolvers: it is not the guard's table (applied in resolve mode?); \
                 `egress-fence run` in guard mode installs it"
                .into(),
            UpstreamAccess::NoTable => format!("table inet {TABLE} is not installed"),
            UpstreamAccess::Unknown(why) => format!(
                "this probe's uid {uid} could not be compared with the guard's: the table {why}"
            ),
        }
    }
}

/// Single ports strictly; a range at both ends (port 0 cannot be connected to).
fn ports_to_probe(range: PortRange) -> Vec<(u16, bool)> {
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

fn join_sockets(addrs: &[SocketAddr]) -> String {
    addrs
        .iter()
        .map(SocketAddr::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn join(addrs: &[IpAddr]) -> String {
    addrs
        .iter()
        .map(IpAddr::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// A label that no resolver has cached and no wildcard-less zone holds, under `domain`.
fn random_name_under(domain: &DomainName) -> Result<DomainName, String> {
    format!("ef-probe-{:016x}.{domain}", random_u64())
        .parse()
        .map_err(|e| format!("cannot build a random name under {domain}: {e}"))
}

/// Not cryptographic: only unlikely to repeat (DNS ids, test names).
fn random_u64() -> u64 {
    let mut h = RandomState::new().build_hasher();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.write_u32(std::process::id());
    h.finish()
}

// ---- trying ---------------------------------------------------------------------------------

struct Ctx {
    timeout: Duration,
    udp_wait: Duration,
}

/// Runs the attempts on a few threads (they inherit the caller's network namespace) and
/// returns their checks in order.
fn run_concurrently(attempts: &[&Attempt], ctx: &Ctx) -> Result<Vec<Check>, ProbeError> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Check>>> = Mutex::new(vec![None; attempts.len()]);
    let workers = attempts.len().min(MAX_WORKERS);
    thread::scope(|s| {
        for i in 0..workers {
            let spawned = thread::Builder::new()
                .name(format!("probe-{i}"))
                .spawn_scoped(s, || {
                    loop {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        let Some(attempt) = attempts.get(n) else {
                            break;
                        };
                        let check = attempt.run(ctx);
                        results.lock().unwrap_or_else(|e| e.into_inner())[n] = Some(check);
                    }
                });
            // The threads that did start take every attempt; only none at all is an error.
            if let Err(e) = spawned {
                if i == 0 {
                    return Err(ProbeError::Thread(e));
                }
                break;
            }
        }
        Ok(())
    })?;
    Ok(results
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .zip(attempts)
        .map(|(c, a)| {
            c.unwrap_or_else(|| Check::new(Outcome::Fail, a.check.clone(), "was not run"))
        })
        .collect())
}

/// What one attempt saw.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    /// The TCP handshake completed (for DNS: but no answer came).
    Connected,
    /// A reply came back: a UDP datagram, or a DNS answer ("answered (NOERROR)").
    Answered(String),
    /// It left this host and was refused beyond it: a TCP reset, ICMP port unreachable.
    RefusedRemotely(String),
    /// A UDP datagram left this host and nothing came back.
    Silent,
    /// This host refused it: EPERM on send, or the ICMP error of `action: reject`.
    RefusedHere(String),
    /// TCP: no answer to the SYN within the timeout (`action: drop`, or lost beyond).
    TimedOut,
    /// It could not be sent for another local reason (no route, no address of the family).
    NotSent(String),
}

impl Attempt {
    fn run(&self, ctx: &Ctx) -> Check {
        let seen = match self.kind {
            Kind::Tcp => tcp_attempt(self.target, ctx),
            Kind::Udp => udp_attempt(self.target, UDP_PAYLOAD, ctx, |_| Some("answered".into())),
            Kind::Dns(proto) => {
                let name = self.dns_name.as_deref().unwrap_or(DNS_TEST_NAME);
                match proto {
                    L4Proto::Udp => dns_udp_attempt(self.target, name, ctx),
                    L4Proto::Tcp => dns_tcp_attempt(self.target, name, ctx),
                }
            }
        };
        let (outcome, mut reason) = judge(&seen, self.expect, self.kind, ctx);
        let fail_note = self.on_fail.as_ref().filter(|_| outcome == Outcome::Fail);
        for note in self.note.iter().chain(fail_note) {
            reason.push_str("; ");
            reason.push_str(note);
        }
        Check::new(outcome, self.check.clone(), reason)
    }
}

/// Turns what was seen into a verdict and a reason a human understands.
fn judge(seen: &Seen, expect: Expect, kind: Kind, ctx: &Ctx) -> (Outcome, String) {
    use Outcome::{Fail, Pass};
    let through = "the boundary let it through";
    let (t, w) = (fmt_duration(ctx.timeout), fmt_duration(ctx.udp_wait));
    match expect {
        Expect::Refuse => match seen {
            Seen::RefusedHere(d) => (Pass, format!("refused: {d}")),
            Seen::TimedOut => (Pass, format!("no answer within {t} (dropped)")),
            Seen::NotSent(d) => (Pass, format!("cannot leave this host: {d}")),
            Seen::Connected => (Fail, format!("connected: {through}")),
            Seen::Answered(d) => (Fail, format!("{d}: {through}")),
            Seen::RefusedRemotely(d) => (Fail, format!("{d}: {through}")),
            Seen::Silent => (
                Fail,
                format!(
                    "not refused: the datagram left this host (no answer within {w}); {through}"
                ),
            ),
        },
        Expect::Reach { strict } => match seen {
            Seen::Connected => (Pass, "connected".into()),
            Seen::Answered(d) => (Pass, d.clone()),
            Seen::Silent => (
                Pass,
                format!(
                    "sent, no answer within {w}: not refused by the boundary (UDP confirms \
                     nothing more)"
                ),
            ),
            Seen::RefusedRemotely(d) if kind == Kind::Udp || !strict => {
                (Pass, format!("{d}: {through}"))
            }
            Seen::RefusedRemotely(d) => (
                Fail,
                format!("{d}: {through}, but nothing accepts connections there (service down?)"),
            ),
            Seen::RefusedHere(d) => (Fail, format!("refused: {d}")),
            Seen::TimedOut => (
                Fail,
                format!(
                    "timed out after {t}: dropped by the boundary, or the host does not answer"
                ),
            ),
            Seen::NotSent(d) => (Fail, d.clone()),
        },
        Expect::Answer => match seen {
            Seen::Answered(d) => (Pass, d.clone()),
            Seen::Connected => (Fail, format!("connected, but no DNS answer within {t}")),
            Seen::Silent => (Fail, format!("no answer within {w}")),
            other => judge(other, Expect::Reach { strict: true }, kind, ctx),
        },
    }
}

fn fmt_duration(d: Duration) -> String {
    format!("{d:?}")
}

fn tcp_connect(target: SocketAddr, ctx: &Ctx) -> Result<TcpStream, Seen> {
    TcpStream::connect_timeout(&target, ctx.timeout).map_err(|e| match e.raw_os_error() {
        Some(libc::ECONNREFUSED) => Seen::RefusedRemotely("connection refused (TCP reset)".into()),
        Some(libc::EHOSTUNREACH | libc::EACCES | libc::EPERM) => Seen::RefusedHere(describe(&e)),
        _ if matches!(
            e.kind(),
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
        ) =>
        {
            Seen::TimedOut
        }
        _ => Seen::NotSent(describe(&e)),
    })
}

fn tcp_attempt(target: SocketAddr, ctx: &Ctx) -> Seen {
    match tcp_connect(target, ctx) {
        Ok(_) => Seen::Connected,
        Err(seen) => seen,
    }
}

/// Sends `payload` on a connected UDP socket and waits for a datagram that `accept` takes
/// (returning the reason to report), an error, or silence.
fn udp_attempt(
    target: SocketAddr,
    payload: &[u8],
    ctx: &Ctx,
    accept: impl Fn(&[u8]) -> Option<String>,
) -> Seen {
    let bind = match target {
        SocketAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        SocketAddr::V6(_) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
    };
    let socket = match UdpSocket::bind(bind).and_then(|s| s.connect(target).map(|()| s)) {
        Ok(s) => s,
        Err(e) => return Seen::NotSent(describe(&e)),
    };
    if let Err(send_error) = socket.send(payload) {
        if send_error.raw_os_error() != Some(libc::EPERM) {
            return Seen::NotSent(describe(&send_error));
        }
        // Refused here. With `reject` the ICMP error follows at once and says more.
        let mut buf = [0u8; 16];
        let icmp = socket
            .set_read_timeout(Some(ICMP_WAIT.min(ctx.udp_wait)))
            .and_then(|()| socket.recv(&mut buf));
        return Seen::RefusedHere(match icmp {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EHOSTUNREACH | libc::EACCES)) => {
                describe(&e)
            }
            _ => describe(&send_error),
        });
    }
    let deadline = Instant::now() + ctx.udp_wait;
    let mut buf = vec![0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Seen::Silent;
        }
        if let Err(e) = socket.set_read_timeout(Some(left)) {
            return Seen::NotSent(describe(&e));
        }
        match socket.recv(&mut buf) {
            Ok(n) => {
                if let Some(reason) = accept(&buf[..n]) {
                    return Seen::Answered(reason);
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Seen::Silent;
            }
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
                return Seen::RefusedRemotely("port unreachable (ICMP from the host)".into());
            }
            // The send succeeded, so whatever refused it sits beyond this host.
            Err(e) => {
                return Seen::RefusedRemotely(format!(
                    "refused beyond this host: {}",
                    describe(&e)
                ));
            }
        }
    }
}

fn dns_udp_attempt(target: SocketAddr, name: &str, ctx: &Ctx) -> Seen {
    let id = random_u64() as u16;
    let query = dns_query(id, name, QTYPE_A);
    udp_attempt(target, &query, ctx, |reply| {
        dns_rcode(id, reply).map(|rcode| format!("answered ({rcode})"))
    })
}

fn dns_tcp_attempt(target: SocketAddr, name: &str, ctx: &Ctx) -> Seen {
    let mut stream = match tcp_connect(target, ctx) {
        Ok(s) => s,
        Err(seen) => return seen,
    };
    let id = random_u64() as u16;
    let query = dns_query(id, name, QTYPE_A);
    let reply = exchange::tcp_blocking(&mut stream, &query, ctx.timeout);
    match reply.ok().as_deref().and_then(|r| dns_rcode(id, r)) {
        Some(rcode) => Seen::Answered(format!("answered over TCP ({rcode})")),
        None => Seen::Connected,
    }
}

/// A standard query for the `qtype` records of `name`, recursion desired. A name hickory
/// cannot write (none the probe asks) leaves the question out, which no server answers as
/// a lookup.
fn dns_query(id: u16, name: &str, qtype: RecordType) -> Vec<u8> {
    let question = Name::from_ascii(name).ok().map(|n| Query::query(n, qtype));
    message::query(id, question, true, None)
        .to_vec()
        .unwrap_or_default()
}

/// The response code of `reply` if it is a DNS response to query `id`.
fn dns_rcode(id: u16, reply: &[u8]) -> Option<&'static str> {
    message::response_code(reply, id).map(message::rcode_name)
}

// ---- asking the guard ----------------------------------------------------------------------

/// How one question to the guard ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Asked {
    /// A response: its code ("NOERROR", "REFUSED", ...) and the A/AAAA addresses it carries.
    Answered {
        rcode: &'static str,
        addrs: Vec<ResolvedAddr>,
    },
    /// No response from any listen address, and why.
    Failed(String),
}

/// A name asked of the guard, A and AAAA.
#[derive(Debug, Clone, PartialEq, Eq)]
struct GuardLookup {
    name: DomainName,
    a: Asked,
    aaaa: Asked,
}

impl GuardLookup {
    fn asked(&self) -> [(&'static str, &Asked); 2] {
        [("A", &self.a), ("AAAA", &self.aaaa)]
    }

    /// The lookup as the rest of the probe reads names: addresses, NXDOMAIN, and as errors
    /// every question that got no response or another refusal.
    fn host(&self) -> ResolvedHost {
        let mut host = ResolvedHost {
            name: self.name.clone(),
            addrs: Vec::new(),
            nxdomain: false,
            dropped: Vec::new(),
            errors: Vec::new(),
        };
        for (qtype, asked) in self.asked() {
            match asked {
                Asked::Answered { rcode, addrs } => {
                    host.addrs.extend(addrs);
                    match *rcode {
                        "NOERROR" => {}
                        "NXDOMAIN" => host.nxdomain = true,
                        other => host.errors.push(format!("{qtype}: answered {other}")),
                    }
                }
                Asked::Failed(e) => host.errors.push(format!("{qtype}: {e}")),
            }
        }
        host.addrs.sort();
        host.addrs.dedup_by_key(|a| a.addr);
        host
    }

    /// The guard's refusal: both questions answered REFUSED or NXDOMAIN, without addresses.
    fn refusal(&self) -> Option<&'static str> {
        let mut code = None;
        for (_, asked) in self.asked() {
            match asked {
                Asked::Answered { rcode, addrs }
                    if addrs.is_empty() && matches!(*rcode, "REFUSED" | "NXDOMAIN") =>
                {
                    code = Some(*rcode);
                }
                _ => return None,
            }
        }
        code
    }

    /// "A: REFUSED, AAAA: no answer within 2s", for reasons.
    fn outcome(&self) -> String {
        self.asked()
            .iter()
            .map(|(qtype, asked)| match asked {
                Asked::Answered { rcode, .. } => format!("{qtype}: answered {rcode}"),
                Asked::Failed(e) => format!("{qtype}: {e}"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Asks the guard for the A and AAAA records of every name, a few names at a time.
fn guard_lookups(
    names: &[&DomainName],
    listen: &[SocketAddr],
    ctx: &Ctx,
) -> Result<Vec<GuardLookup>, ProbeError> {
    let mut lookups = Vec::with_capacity(names.len());
    for chunk in names.chunks(MAX_WORKERS) {
        let done: Vec<GuardLookup> = thread::scope(|s| {
            let mut handles = Vec::with_capacity(chunk.len());
            for &name in chunk {
                let handle = thread::Builder::new()
                    .name("probe-dns".into())
                    .spawn_scoped(s, move || guard_lookup(name, listen, ctx))
                    .map_err(ProbeError::Thread)?;
                handles.push(handle);
            }
            Ok::<_, ProbeError>(
                handles
                    .into_iter()
                    .zip(chunk)
                    .map(|(h, &name)| {
                        h.join().unwrap_or_else(|_| GuardLookup {
                            name: name.clone(),
                            a: Asked::Failed("the lookup thread panicked".into()),
                            aaaa: Asked::Failed("the lookup thread panicked".into()),
                        })
                    })
                    .collect(),
            )
        })?;
        lookups.extend(done);
    }
    Ok(lookups)
}

fn guard_lookup(name: &DomainName, listen: &[SocketAddr], ctx: &Ctx) -> GuardLookup {
    let (server, a) = ask_guard(listen, name.as_str(), QTYPE_A, ctx);
    // The AAAA question goes first to the address that answered the A question.
    let order: Vec<SocketAddr> = server
        .into_iter()
        .chain(listen.iter().copied().filter(|l| Some(*l) != server))
        .collect();
    let (_, aaaa) = ask_guard(&order, name.as_str(), QTYPE_AAAA, ctx);
    GuardLookup {
        name: name.clone(),
        a,
        aaaa,
    }
}

/// One question to the first listen address that responds.
fn ask_guard(
    listen: &[SocketAddr],
    name: &str,
    qtype: RecordType,
    ctx: &Ctx,
) -> (Option<SocketAddr>, Asked) {
    let mut failures = Vec::new();
    for &server in listen {
        match dns_exchange(server, name, qtype, ctx) {
            Ok(asked) => return (Some(server), asked),
            Err(e) => failures.push(format!("{server}: {e}")),
        }
    }
    (None, Asked::Failed(failures.join("; ")))
}

/// Asks `server` over UDP, and again over TCP when the response is truncated.
fn dns_exchange(
    server: SocketAddr,
    name: &str,
    qtype: RecordType,
    ctx: &Ctx,
) -> Result<Asked, String> {
    let id = random_u64() as u16;
    let query = dns_query(id, name, qtype);
    let mut reply = udp_exchange(server, &query, id, ctx.timeout)?;
    if message::peek_is_truncated(&reply) {
        reply = tcp_exchange(server, &query, id, ctx)?;
    }
    let rcode = dns_rcode(id, &reply).ok_or("the response does not match the query")?;
    let response =
        message::parse(&reply, MAX_MESSAGE).map_err(|e| format!("an unreadable response ({e})"))?;
    let addrs = response
        .answers
        .iter()
        .filter_map(|r| {
            Some(ResolvedAddr {
                addr: r.data.ip_addr()?,
                ttl: r.ttl,
            })
        })
        .collect();
    Ok(Asked::Answered { rcode, addrs })
}

fn udp_exchange(
    server: SocketAddr,
    query: &[u8],
    id: u16,
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    let bind = match server {
        SocketAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        SocketAddr::V6(_) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
    };
    let socket = UdpSocket::bind(bind)
        .and_then(|s| s.connect(server).map(|()| s))
        .map_err(|e| describe(&e))?;
    exchange::udp_blocking(&socket, query, id, timeout).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            format!("no answer within {}", fmt_duration(timeout))
        }
        _ if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
            "nothing answers there (port unreachable)".into()
        }
        _ => describe(&e),
    })
}

fn tcp_exchange(server: SocketAddr, query: &[u8], id: u16, ctx: &Ctx) -> Result<Vec<u8>, String> {
    let mut stream = tcp_connect(server, ctx).map_err(|seen| match seen {
        Seen::RefusedRemotely(d) | Seen::RefusedHere(d) | Seen::NotSent(d) => d,
        _ => format!("no TCP connection within {}", fmt_duration(ctx.timeout)),
    })?;
    let reply = exchange::tcp_blocking(&mut stream, query, ctx.timeout)
        .map_err(|e| format!("over TCP: {}", describe(&e)))?;
    match dns_rcode(id, &reply) {
        Some(_) => Ok(reply),
        None => Err("the TCP response does not match the query".into()),
    }
}

/// The errors a probe meets, in words that say what happened on the wire.
fn describe(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EHOSTUNREACH) => "no route to host (ICMP admin prohibited)".into(),
        Some(libc::EACCES) => "permission denied (ICMPv6 admin prohibited)".into(),
        Some(libc::EPERM) => {
            "operation not permitted (dropped on send by a firewall rule on this host)".into()
        }
        Some(libc::ENETUNREACH) => "network unreachable (no route)".into(),
        Some(libc::EADDRNOTAVAIL) => "no source address of this family".into(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_layer_socket_fails_the_probe_only_without_cap_net_admin() {
        use nix::errno::Errno;
        let denied = [
            ("AF_PACKET", Err(Errno::EPERM)),
            ("AF_XDP", Err(Errno::EPERM)),
        ];
        let packet = [("AF_PACKET", Ok(())), ("AF_XDP", Err(Errno::EPERM))];
        let xdp = [("AF_PACKET", Err(Errno::EAFNOSUPPORT)), ("AF_XDP", Ok(()))];

        let fail = link_layer_check(&packet, Some(false));
        assert_eq!(fail.outcome, Outcome::Fail, "{fail}");
        assert_eq!(fail.check, LINK_LAYER_CHECK);
        assert!(fail.reason.starts_with("opened AF_PACKET "), "{fail}");
        assert!(fail.reason.contains("--cap-drop NET_RAW"), "{fail}");
        // Either family is a way out; capabilities unreadable: opening is what counts.
        let fail = link_layer_check(&xdp, None);
        assert_eq!(fail.outcome, Outcome::Fail, "{fail}");
        assert!(fail.reason.starts_with("opened AF_XDP "), "{fail}");
        // The administrator is outside the threat model: told, not failed.
        let admin = link_layer_check(&packet, Some(true));
        assert_eq!(admin.outcome, Outcome::Skip, "{admin}");

        let pass = link_layer_check(&denied, Some(false));
        assert_eq!(pass.outcome, Outcome::Pass, "{pass}");
        assert!(pass.reason.contains("AF_PACKET: EPERM"), "{pass}");
        let absent = [
            ("AF_PACKET", Err(Errno::EAFNOSUPPORT)),
            ("AF_XDP", Err(Errno::EAFNOSUPPORT)),
        ];
        assert_eq!(link_layer_check(&absent, None).outcome, Outcome::Pass);
        let odd = [
            ("AF_PACKET", Err(Errno::EMFILE)),
            ("AF_XDP", Err(Errno::EPERM)),
        ];
        assert_eq!(link_layer_check(&odd, Some(false)).outcome, Outcome::Warn);
    }

    fn ctx() -> Ctx {
        Ctx {
            timeout: Duration::from_secs(2),
            udp_wait: Duration::from_secs(1),
        }
    }

    fn policy(text: &str) -> Policy {
        Policy::parse(text, Path::new("p.yaml")).expect("valid")
    }

    #[test]
    fn dns_query_is_well_formed_and_answers_are_matched_by_id() {
        let q = dns_query(0x1234, "example.com", QTYPE_A);
        assert_eq!(&q[..4], &[0x12, 0x34, 0x01, 0x00]);
        assert_eq!(&q[12..], b"\x07example\x03com\x00\x00\x01\x00\x01");
        let aaaa = dns_query(1, "a.example", QTYPE_AAAA);
        assert_eq!(&aaaa[12..], b"\x01a\x07example\x00\x00\x1c\x00\x01");
        // What the probe sends, hickory reads as the same question.
        let parsed = hickory_proto::op::Message::from_vec(&aaaa).expect("a valid message");
        assert_eq!(parsed.queries[0].name().to_string(), "a.example.");
        // The query itself is not an answer (QR clear); a response with another id is not ours.
        assert_eq!(dns_rcode(0x1234, &q), None);
        let mut reply = q.clone();
        reply[2] |= 0x80;
        reply[3] = 0x83;
        assert_eq!(dns_rcode(0x1234, &reply), Some("NXDOMAIN"));
        assert_eq!(dns_rcode(0x4321, &reply), None);
        assert_eq!(dns_rcode(0x1234, &reply[..11]), None);
    }

    #[test]
    fn refusals_pass_only_when_this_host_refused() {
        let refuse = |seen| judge(&seen, Expect::Refuse, Kind::Udp, &ctx()).0;
        assert_eq!(refuse(Seen::RefusedHere("x".into())), Outcome::Pass);
        assert_eq!(refuse(Seen::TimedOut), Outcome::Pass);
        assert_eq!(refuse(Seen::NotSent("no route".into())), Outcome::Pass);
        assert_eq!(refuse(Seen::Connected), Outcome::Fail);
        assert_eq!(refuse(Seen::Answered("answered".into())), Outcome::Fail);
        assert_eq!(refuse(Seen::RefusedRemotely("reset".into())), Outcome::Fail);
        // Our rules fail the send itself, so a datagram that left unanswered got through.
        let (outcome, reason) = judge(&Seen::Silent, Expect::Refuse, Kind::Udp, &ctx());
        assert_eq!(outcome, Outcome::Fail);
        assert!(reason.contains("left this host"), "{reason}");
    }

    #[test]
    fn a_reset_fails_a_single_allowed_port_but_not_a_range_end_or_udp() {
        let reset = Seen::RefusedRemotely("connection refused (TCP reset)".into());
        let (o, reason) = judge(&reset, Expect::Reach { strict: true }, Kind::Tcp, &ctx());
        assert_eq!(o, Outcome::Fail);
        assert!(reason.contains("the boundary let it through"), "{reason}");
        let lenient = Expect::Reach { strict: false };
        assert_eq!(judge(&reset, lenient, Kind::Tcp, &ctx()).0, Outcome::Pass);
        let strict = Expect::Reach { strict: true };
        assert_eq!(judge(&reset, strict, Kind::Udp, &ctx()).0, Outcome::Pass);
        assert_eq!(
            judge(&Seen::Silent, strict, Kind::Udp, &ctx()).0,
            Outcome::Pass
        );
        assert_eq!(
            judge(&Seen::TimedOut, strict, Kind::Tcp, &ctx()).0,
            Outcome::Fail
        );
        let dns = Kind::Dns(L4Proto::Tcp);
        assert_eq!(
            judge(&Seen::Connected, Expect::Answer, dns, &ctx()).0,
            Outcome::Fail
        );
    }

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
    fn report_lines_and_summary() {
        let report = Report {
            checks: vec![
                Check::new(
                    Outcome::Pass,
                    "allowed tcp a.example 192.0.2.10:443",
                    "connected",
                ),
                Check::new(Outcome::Fail, "blocked tcp 203.0.113.11:443", "connected"),
                Check::new(Outcome::Warn, "dns exfiltration x.example", "resolved"),
                Check::new(
                    Outcome::Skip,
                    "allowed network 203.0.113.0/24",
                    "not probed",
                ),
            ],
        };
        assert_eq!(
            report.checks[0].to_string(),
            "PASS  allowed tcp a.example 192.0.2.10:443: connected"
        );
        assert!(!report.passed());
        assert_eq!(
            report.summary(),
            "probe: 1 passed, 1 failed, 1 warning, 1 skipped"
        );
        let json = serde_json::to_value(&report).expect("serialises");
        assert_eq!(json["checks"][1]["outcome"], "fail");
        let passing = Report {
            checks: report.checks[2..].to_vec(),
        };
        assert!(passing.passed(), "warnings and skips do not fail");
    }

    #[test]
    fn random_names_differ_and_stay_under_the_domain() {
        let domain: DomainName = "exfil.example.com".parse().expect("valid");
        let a = random_name_under(&domain).expect("valid");
        let b = random_name_under(&domain).expect("valid");
        assert_ne!(a, b);
        assert!(a.as_str().ends_with(".exfil.example.com"), "{a}");
    }

    #[test]
    fn options_take_the_policy_resolvers_else_resolv_conf() {
        let dir = tempfile::tempdir().expect("tempdir");
        let conf = dir.path().join("resolv.conf");
        std::fs::write(&conf, "nameserver 192.0.2.53\n").expect("write");
        let own = policy("version: 1\ndns:\n  resolvers: [198.51.100.53]\n");
        let o = ProbeOptions::for_policy(&own, &conf).expect("options");
        assert_eq!(
            o.resolvers,
            vec!["198.51.100.53".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(o.timeout, ProbeOptions::DEFAULT_TIMEOUT);
        let system = ProbeOptions::for_policy(&policy("version: 1\n"), &conf).expect("options");
        assert_eq!(
            system.resolvers,
            vec!["192.0.2.53".parse::<IpAddr>().unwrap()]
        );
    }

    #[test]
    fn setup_errors_come_before_any_traffic() {
        let p = policy("version: 1\n");
        let none = options(&[], TableView::NotRead);
        assert!(matches!(run(&p, &none), Err(ProbeError::NoResolvers)));
        let zero = ProbeOptions {
            timeout: Duration::ZERO,
            ..options(&["192.0.2.53"], TableView::NotRead)
        };
        assert!(matches!(run(&p, &zero), Err(ProbeError::ZeroTimeout)));
    }

    fn options(resolvers: &[&str], table: TableView) -> ProbeOptions {
        ProbeOptions {
            resolvers: resolvers.iter().map(|r| r.parse().unwrap()).collect(),
            timeout: Duration::from_secs(1),
            uid: 65534,
            table,
            system: None,
            guard_socket: None,
        }
    }

    const GUARD_POLICY: &str = "version: 1\nallow:\n  - domain: api.example.com\n    ports: [443]\n  - domain: \"*.cdn.example.com\"\n    ports: [443]\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\nprobe:\n  rogue_resolvers: [192.0.2.54]\n  blocked: [\"paste.example.com:443\"]\n";

    fn guard_options(table: TableView) -> ProbeOptions {
        ProbeOptions {
            system: Some(SystemResolvers {
                path: "/etc/resolv.conf".into(),
                nameservers: Ok(vec!["127.0.0.53".parse().unwrap()]),
            }),
            ..options(&["192.0.2.53"], table)
        }
    }

    fn table_with_uid(uid: u32) -> TableView {
        TableView::Read(TableFacts {
            dns_uids: vec![uid],
            dns_marks: vec![crate::core::policy::DEFAULT_GUARD_MARK],
            dns_for_everyone: false,
            denied: Preset::DnsOverHttps.networks(),
            resolved: Vec::new(),
        })
    }

    fn answered(rcode: &'static str, addrs: &[&str]) -> Asked {
        Asked::Answered {
            rcode,
            addrs: addrs
                .iter()
                .map(|a| ResolvedAddr {
                    addr: a.parse().unwrap(),
                    ttl: 60,
                })
                .collect(),
        }
    }

    fn lookup(name: &str, a: Asked, aaaa: Asked) -> GuardLookup {
        GuardLookup {
            name: name.parse().unwrap(),
            a,
            aaaa,
        }
    }

    /// The guard-mode plan's checks: (outcome or "attempt", check, reason or on_fail note).
    fn guard_plan(
        p: &Policy,
        options: &ProbeOptions,
        lookups: &[GuardLookup],
        exfil: &str,
    ) -> Vec<(String, String, String)> {
        let hosts: Vec<ResolvedHost> = lookups.iter().map(GuardLookup::host).collect();
        let mut plan = Plan::new(p, options, &hosts, lookups);
        let guard = p.dns.guard.as_ref().expect("guard mode");
        plan.system_resolver(guard);
        plan.guard_servers(guard);
        plan.upstream();
        plan.allowed();
        plan.denied();
        plan.blocked();
        plan.rogue_resolvers();
        plan.guarded_exfiltration(Some(Ok(exfil.parse().unwrap())));
        plan.steps
            .into_iter()
            .map(|s| match s {
                Step::Done(c) => (c.outcome.to_string(), c.check, c.reason),
                Step::Attempt(a) => ("attempt".into(), a.check, a.on_fail.unwrap_or_default()),
            })
            .collect()
    }

    fn find<'a>(
        checks: &'a [(String, String, String)],
        name: &str,
    ) -> &'a (String, String, String) {
        checks
            .iter()
            .find(|c| c.1 == name)
            .unwrap_or_else(|| panic!("no check {name} in {checks:#?}"))
    }

    #[test]
    fn guard_mode_checks_the_guard_its_upstream_and_the_exfiltration_channel() {
        let p = policy(GUARD_POLICY);
        let exfil = "ef-probe-1.egress-fence-probe.invalid";
        let lookups = [
            lookup(
                "api.example.com",
                answered("NOERROR", &["192.0.2.10"]),
                answered("NOERROR", &[]),
            ),
            lookup(
                "paste.example.com",
                answered("REFUSED", &[]),
                answered("REFUSED", &[]),
            ),
            lookup(exfil, answered("REFUSED", &[]), answered("REFUSED", &[])),
        ];
        let checks = guard_plan(&p, &guard_options(table_with_uid(0)), &lookups, exfil);
        let names: Vec<&str> = checks.iter().map(|c| c.1.as_str()).collect();
        assert_eq!(
            names,
            [
                "system resolver",
                "guard udp 127.0.0.53:53",
                "guard tcp 127.0.0.53:53",
                "upstream udp 192.0.2.53:53",
                "upstream tcp 192.0.2.53:53",
                "upstream tcp 192.0.2.53:853",
                "upstream udp 192.0.2.53:853",
                "allowed name api.example.com",
                "allowed tcp api.example.com 192.0.2.10:443",
                "allowed names *.cdn.example.com",
                "denied preset dns-over-https",
                "blocked name paste.example.com",
                "rogue resolver udp 192.0.2.54:53",
                "rogue resolver tcp 192.0.2.54:53",
                "dns exfiltration ef-probe-1.egress-fence-probe.invalid",
            ]
        );
        assert_eq!(find(&checks, "system resolver").0, "PASS");
        let allowed = find(&checks, "allowed name api.example.com");
        assert_eq!(allowed.0, "PASS");
        assert!(
            allowed.2.contains("through the guard 127.0.0.53:53"),
            "{allowed:?}"
        );
        // Another uid than the guard's: the upstream is tried, and must be refused.
        assert_eq!(find(&checks, "upstream tcp 192.0.2.53:853").0, "attempt");
        assert_eq!(find(&checks, "upstream udp 192.0.2.53:853").0, "attempt");
        let blocked = find(&checks, "blocked name paste.example.com");
        assert_eq!(blocked.0, "PASS", "{blocked:?}");
        let doh = find(&checks, "denied preset dns-over-https");
        assert_eq!(doh.0, "PASS", "{doh:?}");
        let exfil_check = checks.last().expect("checks");
        assert_eq!(exfil_check.0, "PASS", "{exfil_check:?}");
        assert!(
            exfil_check.2.starts_with(
                "DNS exfiltration closed: the guard refused \
                 ef-probe-1.egress-fence-probe.invalid without forwarding it (REFUSED)"
            ),
            "{exfil_check:?}"
        );
    }

    #[test]
    fn the_guards_own_uid_is_probed_unless_the_table_knows_the_guard_by_uid_alone() {
        let p = policy(GUARD_POLICY);
        let exfil = "ef-probe-1.egress-fence-probe.invalid";
        let refused = || lookup(exfil, answered("NXDOMAIN", &[]), answered("NXDOMAIN", &[]));
        // The table asks for the guard's mark too: the probe's unmarked sockets must be
        // refused, the guard's uid included.
        let same_uid = ProbeOptions {
            uid: 0,
            ..guard_options(table_with_uid(0))
        };
        let checks = guard_plan(&p, &same_uid, &[refused()], exfil);
        let up = find(&checks, "upstream udp 192.0.2.53:53");
        assert_eq!(up.0, "attempt", "{up:?}");
        assert!(up.2.contains("marked 0x65000000"), "{up:?}");
        // A table of an older version: the uid alone lets the probe through unchecked.
        let uid_only = TableView::Read(TableFacts {
            dns_uids: vec![0],
            ..TableFacts::default()
        });
        let same_uid = ProbeOptions {
            uid: 0,
            ..guard_options(uid_only)
        };
        let checks = guard_plan(&p, &same_uid, &[refused()], exfil);
        let up = find(&checks, "upstream udp 192.0.2.53:53");
        assert_eq!(up.0, "WARN", "{up:?}");
        assert!(up.2.contains("runs as uid 0, the guard's uid"), "{up:?}");
        assert!(up.2.contains("without the guard's socket mark"), "{up:?}");

        // A resolve-mode table lets everyone through: said when the attempt fails.
        let everyone = TableView::Read(TableFacts {
            dns_for_everyone: true,
            ..TableFacts::default()
        });
        let checks = guard_plan(&p, &guard_options(everyone), &[refused()], exfil);
        let up = find(&checks, "upstream tcp 192.0.2.53:53");
        assert_eq!(up.0, "attempt");
        assert!(up.2.contains("resolve mode"), "{up:?}");
        let doh = find(&checks, "denied preset dns-over-https");
        assert_eq!(doh.0, "FAIL", "{doh:?}");
        assert!(doh.2.contains("1.1.1.1/32"), "{doh:?}");

        // An unprivileged probe: the guard's socket owner stands in for the table.
        let unreadable = ProbeOptions {
            uid: 1000,
            guard_socket: Some((1000, "127.0.0.53:53".parse().unwrap())),
            ..guard_options(TableView::Unreadable("EPERM".into()))
        };
        let checks = guard_plan(&p, &unreadable, &[refused()], exfil);
        let up = find(&checks, "upstream tcp 192.0.2.53:853");
        assert_eq!(up.0, "attempt", "{up:?}");
        assert!(up.2.contains("guard's socket on 127.0.0.53:53"), "{up:?}");
        assert_eq!(find(&checks, "denied preset dns-over-https").0, "SKIP");
        let unknown = ProbeOptions {
            guard_socket: None,
            ..unreadable
        };
        let checks = guard_plan(&p, &unknown, &[refused()], exfil);
        let up = find(&checks, "upstream udp 192.0.2.53:53");
        assert_eq!(up.0, "attempt");
        assert!(up.2.contains("could not be compared"), "{up:?}");
    }

    #[test]
    fn a_forwarded_exfiltration_name_fails() {
        let exfil = "ef-probe-2.exfil.example.com";
        let covering = policy(&GUARD_POLICY.replace(
            "  - domain: api.example.com\n",
            "  - domain: \"**.exfil.example.com\"\n    ports: [443]\n  - domain: api.example.com\n",
        ));
        let opts = guard_options(table_with_uid(0));
        // Resolved: the name went out and came back with an address.
        let resolved = lookup(
            exfil,
            answered("NOERROR", &["203.0.113.10"]),
            answered("NOERROR", &[]),
        );
        let checks = guard_plan(&covering, &opts, &[resolved], exfil);
        let c = checks.last().expect("checks");
        assert_eq!(c.0, "FAIL", "{c:?}");
        assert!(c.2.contains("203.0.113.10"), "{c:?}");
        assert!(
            c.2.contains("domain **.exfil.example.com covers it"),
            "{c:?}"
        );
        // Covered but NXDOMAIN upstream: it was still forwarded.
        let nx = lookup(exfil, answered("NXDOMAIN", &[]), answered("NXDOMAIN", &[]));
        let checks = guard_plan(&covering, &opts, &[nx], exfil);
        let c = checks.last().expect("checks");
        assert_eq!(c.0, "FAIL", "{c:?}");
        assert!(c.2.contains("forwards it upstream"), "{c:?}");
        // Not covered, yet answered with an address: something else answers arbitrary names.
        let p = policy(GUARD_POLICY);
        let rogue = lookup(
            exfil,
            answered("NOERROR", &["203.0.113.10"]),
            answered("NOERROR", &[]),
        );
        let checks = guard_plan(&p, &opts, &[rogue], exfil);
        assert_eq!(checks.last().expect("checks").0, "FAIL");
        // No answer at all: inconclusive.
        let silent = lookup(
            exfil,
            Asked::Failed("no answer within 1s".into()),
            Asked::Failed("no answer within 1s".into()),
        );
        let checks = guard_plan(&p, &opts, &[silent], exfil);
        let c = checks.last().expect("checks");
        assert_eq!(c.0, "WARN", "{c:?}");
        assert!(c.2.contains("inconclusive"), "{c:?}");
    }

    #[test]
    fn resolv_conf_must_name_the_guard() {
        let p = policy(GUARD_POLICY);
        let exfil = "ef-probe-1.egress-fence-probe.invalid";
        let elsewhere = ProbeOptions {
            system: Some(SystemResolvers {
                path: "/etc/resolv.conf".into(),
                nameservers: Ok(vec!["192.0.2.53".parse().unwrap()]),
            }),
            ..guard_options(table_with_uid(0))
        };
        let checks = guard_plan(&p, &elsewhere, &[], exfil);
        let c = find(&checks, "system resolver");
        assert_eq!(c.0, "WARN", "{c:?}");
        assert!(
            c.2.contains("names 192.0.2.53") && c.2.contains("127.0.0.53"),
            "{c:?}"
        );
    }

    #[test]
    fn proc_net_lines_give_the_socket_owner() {
        let v4 = format!(
            "   0: {:08X}:0035 00000000:0000 07 00000000:00000000 00:00000000 00000000   993        0 4242 2 0000000000000000 0",
            u32::from_ne_bytes([127, 0, 0, 53])
        );
        assert_eq!(
            proc_net_socket(&v4),
            Some(("127.0.0.53:53".parse().unwrap(), 993))
        );
        let loopback6: String = Ipv6Addr::LOCALHOST
            .octets()
            .chunks(4)
            .map(|w| format!("{:08X}", u32::from_ne_bytes(w.try_into().unwrap())))
            .collect();
        let v6 = format!(
            "   1: {loopback6}:14E9 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4243 1 0000000000000000 100 0 0 10 0"
        );
        assert_eq!(
            proc_net_socket(&v6),
            Some(("[::1]:5353".parse().unwrap(), 0))
        );
        assert_eq!(
            proc_net_socket("  sl  local_address rem_address   st"),
            None
        );
    }
}
