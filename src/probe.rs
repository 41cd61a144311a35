//! The boundary check: `egress-fence probe` tries, from inside the boundary, what the policy
//! promises, with real sockets, and says for each attempt whether the promise holds.
//!
//! - Every allowed name resolves through the allowed resolvers, and each of its address/port
//!   pairs accepts a TCP connection (UDP: is not refused by this host's rules).
//! - The metadata service (`cloud-metadata` preset) and every `probe.blocked` target are
//!   refused, over TCP and UDP, on every address they have.
//! - DNS to `probe.rogue_resolvers` is refused, over UDP and TCP.
//! - A random name under `probe.exfil_domain` does not resolve through the allowed resolvers
//!   (if it does, DNS can carry data out: a warning until DNS filtering exists).
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
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::policy::{
    Allow, DenyOrigin, DomainName, L4Proto, Policy, PortRange, Preset, ProbeHost, Target,
};
use crate::resolve::{ResolveError, ResolvedHost, resolve_names, system_resolvers};

/// What [`run`] needs besides the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeOptions {
    /// The allowed resolvers: names are resolved through them, and DNS to them must work.
    pub resolvers: Vec<IpAddr>,
    /// How long one connection attempt may take. A UDP attempt waits for a reply at most
    /// this long, and never more than [`MAX_UDP_WAIT`]: silence is an answer for UDP.
    pub timeout: Duration,
}

impl ProbeOptions {
    /// Per connection attempt: long enough for a distant service, short enough that a probe
    /// of a typical policy (whose refused TCP attempts under `action: drop` all wait this
    /// long, concurrently) takes a few seconds.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

    /// The policy's `dns.resolvers`, else the nameservers of `resolv_conf` (the resolvers
    /// `apply` allows), with the default timeout.
    pub fn for_policy(policy: &Policy, resolv_conf: &Path) -> Result<ProbeOptions, ProbeError> {
        let resolvers = match &policy.dns.resolvers {
            Some(r) => r.clone(),
            None => system_resolvers(resolv_conf)?,
        };
        Ok(ProbeOptions {
            resolvers,
            timeout: Self::DEFAULT_TIMEOUT,
        })
    }
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

const DNS_PORT: u16 = 53;

/// The payload of a UDP attempt, so a listener's owner can tell what it saw.
const UDP_PAYLOAD: &[u8] = b"egress-fence probe\n";

/// The well-known metadata endpoints probed for the `cloud-metadata` preset: AWS/GCP/Azure's
/// link-local address and AWS's IPv6 one, on the HTTP port they serve.
const METADATA_TARGETS: [SocketAddr; 2] = [
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)), 80),
    SocketAddr::new(
        IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
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
    let exfil_name = policy.probe.exfil_domain.as_ref().map(random_name_under);

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
    let hosts = resolve_names(names, &options.resolvers)?;

    let mut plan = Plan::new(policy, options, &hosts);
    plan.resolvers();
    plan.allowed();
    plan.denied();
    plan.blocked();
    plan.rogue_resolvers();
    plan.exfiltration(exfil_name);

    let ctx = Ctx {
        timeout: options.timeout,
        udp_wait: options.timeout.min(MAX_UDP_WAIT),
    };
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
    steps: Vec<Step>,
    seen: HashSet<String>,
}

impl<'a> Plan<'a> {
    fn new(policy: &'a Policy, options: &'a ProbeOptions, hosts: &'a [ResolvedHost]) -> Self {
        Plan {
            policy,
            options,
            hosts,
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

    fn resolver_list(&self) -> String {
        join(&self.options.resolvers)
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
                self.done(Check::new(
                    Outcome::Warn,
                    format!("rogue resolver {server}"),
                    "not probed: it is one of the allowed resolvers",
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
                                 data out (a warning until DNS filtering exists)",
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
            Kind::Dns(L4Proto::Udp) => dns_udp_attempt(self.target, ctx),
            Kind::Dns(L4Proto::Tcp) => dns_tcp_attempt(self.target, ctx),
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

fn dns_udp_attempt(target: SocketAddr, ctx: &Ctx) -> Seen {
    let id = random_u64() as u16;
    let query = dns_query(id, DNS_TEST_NAME);
    udp_attempt(target, &query, ctx, |reply| {
        dns_rcode(id, reply).map(|rcode| format!("answered ({rcode})"))
    })
}

fn dns_tcp_attempt(target: SocketAddr, ctx: &Ctx) -> Seen {
    let mut stream = match tcp_connect(target, ctx) {
        Ok(s) => s,
        Err(seen) => return seen,
    };
    let id = random_u64() as u16;
    let query = dns_query(id, DNS_TEST_NAME);
    let Ok(len) = u16::try_from(query.len()) else {
        return Seen::Connected;
    };
    let mut framed = len.to_be_bytes().to_vec();
    framed.extend_from_slice(&query);
    let exchange = (|| -> io::Result<Option<&'static str>> {
        stream.set_read_timeout(Some(ctx.timeout))?;
        stream.set_write_timeout(Some(ctx.timeout))?;
        stream.write_all(&framed)?;
        let mut len = [0u8; 2];
        stream.read_exact(&mut len)?;
        let mut reply = vec![0u8; usize::from(u16::from_be_bytes(len))];
        stream.read_exact(&mut reply)?;
        Ok(dns_rcode(id, &reply))
    })();
    match exchange {
        Ok(Some(rcode)) => Seen::Answered(format!("answered over TCP ({rcode})")),
        _ => Seen::Connected,
    }
}

/// A standard query for the A record of `name`, recursion desired.
fn dns_query(id: u16, name: &str) -> Vec<u8> {
    let mut q = Vec::with_capacity(18 + name.len());
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]); // RD; one question
    for label in name.split('.').filter(|l| !l.is_empty()) {
        q.push(label.len() as u8); // DNS_TEST_NAME's labels are short literals
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]); // root; type A; class IN
    q
}

/// The response code of `reply` if it is a DNS response to query `id`.
fn dns_rcode(id: u16, reply: &[u8]) -> Option<&'static str> {
    let header = reply.get(..12)?;
    if header[..2] != id.to_be_bytes() || header[2] & 0x80 == 0 {
        return None;
    }
    Some(match header[3] & 0x0f {
        0 => "NOERROR",
        1 => "FORMERR",
        2 => "SERVFAIL",
        3 => "NXDOMAIN",
        4 => "NOTIMP",
        5 => "REFUSED",
        _ => "other response code",
    })
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
        let q = dns_query(0x1234, "example.com");
        assert_eq!(&q[..4], &[0x12, 0x34, 0x01, 0x00]);
        assert_eq!(&q[12..], b"\x07example\x03com\x00\x00\x01\x00\x01");
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
        let none = ProbeOptions {
            resolvers: vec![],
            timeout: Duration::from_secs(1),
        };
        assert!(matches!(run(&p, &none), Err(ProbeError::NoResolvers)));
        let zero = ProbeOptions {
            resolvers: vec!["192.0.2.53".parse().unwrap()],
            timeout: Duration::ZERO,
        };
        assert!(matches!(run(&p, &zero), Err(ProbeError::ZeroTimeout)));
    }
}
