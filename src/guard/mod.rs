//! The DNS guard (`dns.mode: guard`): the sandbox's resolver, and the only way out for DNS.
//!
//! A query for a name the policy allows is forwarded to an upstream resolver as a query the
//! guard rebuilds from the checked question alone (see [`upstream_query`]). The addresses of
//! the answer (A, AAAA and the hints of HTTPS/SVCB records, along the CNAME chain from the
//! asked name; at most 32 of each family, and only those [`crate::core::installable`] accepts) go
//! to the daemon, which adds them to the table in one batch; the answer is released only once
//! the kernel has acknowledged that batch, so a client connecting right after its answer is
//! never refused. If the kernel refuses, the client gets SERVFAIL: never an answer it cannot
//! use.
//!
//! A query for any other name is answered REFUSED (or NXDOMAIN) here and never leaves the
//! host: `<secret>.attacker.example` is a question nobody else hears. Each one is streamed to
//! `watch` as a [`QueryEvent`] and logged (at the policy's log rate).
//!
//! One client cannot starve the others: what can never be answered (oversize datagrams,
//! responses) is dropped at once and refusals are answered at once, without a slot; a
//! forwarded query takes one of 1,024 slots, at most 128 per client (a local one by the uid
//! of its socket, another by its address: see [`client_key`]); TCP connections are capped per
//! client too, and must bring their first query within 2 s.
//!
//! The table lets only this process's upstream sockets reach the upstream resolvers (see
//! `plan`): they carry the policy's `dns.mark` (`SO_MARK`, which takes CAP_NET_ADMIN, or
//! CAP_NET_RAW since Linux 5.17, to set; set on UDP sockets before sending and on TCP sockets
//! before connecting) and this process's uid. So the guard is the one path for names, even for
//! root without CAP_NET_ADMIN, as long as it runs under a uid of its own. Its listening
//! sockets carry the mark too, and the table refuses what leaves a listen address without it
//! or from another uid: only the guard answers there. Each upstream exchange uses a fresh
//! socket (a random source port) and a random query id, and an answer is taken only if it
//! carries that id and the question that was asked.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::svcb::SvcParamValue;
use hickory_proto::rr::{DNSClass, Name, RData, RecordType};
use nix::sys::socket::{setsockopt, sockopt};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket, UnixListener};
use tokio::sync::{Semaphore, broadcast, mpsc, oneshot, watch};
use tokio::time::timeout;
use tracing::{debug, info, warn};

use crate::core::installable::{HostAddrs, HostAddrsCache, MAX_ADDRS_PER_FAMILY, answered_addrs};
use crate::core::plan::DNS_PORT;
use crate::core::policy::{DomainName, Policy, Rate, RefuseWith, Target};
use crate::core::resolution::ResolvedAddr;
use crate::dns::message::{self, EdnsOffer, MAX_MESSAGE};
use crate::dns::{exchange, frame};
use crate::netlink::sockdiag::{self, SockDiag};
use crate::watch::QueryEvent;

/// How long one upstream resolver has to answer before the next is asked.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a TCP client may stay idle between queries.
const TCP_IDLE: Duration = Duration::from_secs(10);
/// How long a new TCP client has to send its first whole query: a connection that sends
/// nothing (or one byte) must not hold a slot for long.
const TCP_FIRST_QUERY: Duration = Duration::from_secs(2);
/// The largest query taken: a question (a name of at most 255 bytes) with an OPT record,
/// cookies and padding stays far below this, the payload size that avoids fragmentation.
/// Anything longer is no query and is dropped unread, without a reply or a slot.
const MAX_QUERY: usize = 1232;
/// Queries forwarded upstream at once, over all listeners (each holds an upstream socket):
/// beyond this a UDP query is dropped (the client asks again) and a TCP client waits for a
/// slot. Lowered to what the limit of open files allows (see [`Limits::fit`]).
const MAX_IN_FLIGHT: usize = 1024;
/// TCP clients served at once per listener; one more is closed at once (it retries, or uses
/// UDP), so idle connections cannot use up the daemon's descriptors. Lowered like
/// [`MAX_IN_FLIGHT`].
const MAX_TCP_CLIENTS: usize = 256;
/// Descriptors left for the daemon's own use (its listening sockets, netlink sockets, state
/// and log files, `watch` clients) when the guard's limits are fitted to RLIMIT_NOFILE.
const RESERVED_FDS: u64 = 256;
/// Below these the guard would serve too few clients to be of use: it refuses to start.
const MIN_IN_FLIGHT: usize = 64;
const MIN_TCP_CLIENTS: usize = 8;
/// CNAME hops followed from the asked name, as resolvers bound them.
const MAX_CHAIN: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error(
        "the DNS guard cannot listen on {addr} ({transport}): {source}{}{}",
        holder.map(|uid| format!(" (held by a socket of uid {uid})")).unwrap_or_default(),
        bind_hint(source)
    )]
    Bind {
        addr: SocketAddr,
        transport: &'static str,
        source: io::Error,
        /// The uid owning the UDP socket bound there, when the address is in use.
        holder: Option<u32>,
    },
    #[error("the DNS guard cannot serve its events on {}: {source}", path.display())]
    Events { path: PathBuf, source: io::Error },
    #[error(
        "the DNS guard needs at least {need} open files, and this process may open only \
         {nofile} (RLIMIT_NOFILE, hard limit {hard}): raise LimitNOFILE= in the service, or \
         `ulimit -n` for a shell"
    )]
    TooFewFiles { nofile: u64, hard: u64, need: u64 },
    #[error("the DNS guard cannot mark its socket on {addr} ({transport}): {source}")]
    Mark {
        addr: SocketAddr,
        transport: &'static str,
        source: io::Error,
    },
}

fn bind_hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::AddrInUse => {
            "; another process holds it (systemd-resolved's stub, dnsmasq, or one that took it \
             while the daemon was down: the table still refuses every answer it sends without \
             the guard's mark, so it answers nobody): find it with `ss -lunp` and `ss -ltnp`, \
             stop it, or choose another `dns.listen`"
        }
        io::ErrorKind::PermissionDenied => {
            "; ports below 1024 need CAP_NET_BIND_SERVICE (the drop-in systemd/guard.conf grants \
             it to the service)"
        }
        io::ErrorKind::AddrNotAvailable => "; no interface of this host has that address",
        _ => "",
    }
}

/// What the guard answers, from the policy; the daemon replaces it on reload.
#[derive(Debug, Clone)]
pub struct Rules {
    allow: Vec<Target>,
    upstream: Vec<SocketAddr>,
    refuse_with: RefuseWith,
    /// The mark of every upstream socket, by which (with the uid) the table knows the guard.
    mark: u32,
    /// How many refused queries the log takes: the policy's `log.rate` and `log.burst`, as
    /// for refused packets (`watch` still gets every one).
    log_rate: Rate,
    log_burst: u32,
}

impl Rules {
    /// `None` unless the policy is in guard mode.
    pub fn of(policy: &Policy) -> Option<Rules> {
        let guard = policy.dns.guard.as_ref()?;
        Some(Rules {
            allow: policy
                .allow
                .iter()
                .filter(|a| !matches!(a.target, Target::Cidr(_)))
                .map(|a| a.target.clone())
                .collect(),
            upstream: guard
                .upstream
                .iter()
                .map(|&ip| SocketAddr::new(ip, DNS_PORT))
                .collect(),
            refuse_with: guard.refuse_with,
            mark: guard.mark,
            log_rate: policy.log.rate,
            log_burst: policy.log.burst,
        })
    }

    pub fn allows(&self, name: &DomainName) -> bool {
        self.allow.iter().any(|t| t.matches(name))
    }
}

/// An answer for an allowed name, waiting for its addresses to be in the table. `done`
/// carries whether the kernel took them.
#[derive(Debug)]
pub struct Answered {
    pub name: DomainName,
    pub addrs: Vec<ResolvedAddr>,
    pub done: oneshot::Sender<bool>,
}

/// What the guard has done since it started, for the status line.
#[derive(Debug, Default)]
pub struct Counters {
    pub answered: AtomicU64,
    pub refused: AtomicU64,
    pub failed: AtomicU64,
}

/// A token bucket for log lines: an agent asking thousands of random names a second must not
/// flood the journal.
#[derive(Debug)]
pub struct LogBudget {
    tokens: f64,
    last: Instant,
    /// Lines not written since the last one that was.
    suppressed: u64,
}

impl Default for LogBudget {
    fn default() -> Self {
        LogBudget {
            tokens: f64::MAX,
            last: Instant::now(),
            suppressed: 0,
        }
    }
}

impl LogBudget {
    /// `Some(n)` if a line may be written now, `n` being how many were held back before it.
    pub fn take(&mut self, rate: Rate, burst: u32, now: Instant) -> Option<u64> {
        let per_second = rate.count as f64 / rate.unit.seconds() as f64;
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        let cap = f64::from(burst.max(1));
        self.tokens = (self.tokens.min(cap) + elapsed * per_second).min(cap);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed += 1;
            None
        }
    }
}

/// What the serving tasks share.
pub struct Context {
    pub in_flight: Arc<Semaphore>,
    pub log_budget: std::sync::Mutex<LogBudget>,
    pub rules: watch::Receiver<Arc<Rules>>,
    pub answered: mpsc::Sender<Answered>,
    pub events: broadcast::Sender<QueryEvent>,
    pub counters: Arc<Counters>,
}

/// The uid owning the UDP socket that a datagram to `addr` would reach: who holds the
/// guard's address (a process that took it while the daemon was down, say).
fn udp_holder(addr: SocketAddr) -> Option<u32> {
    if addr.ip().is_unspecified() {
        return None;
    }
    // The lookup takes a sender; any will do for an unconnected socket.
    let sender = SocketAddr::new(addr.ip(), 1);
    SockDiag::open()
        .ok()?
        .owner(sockdiag::Protocol::Udp, sender, addr)
}

/// The limit of queries in flight at the design size, for tests; a serving guard takes
/// [`Guard::in_flight_limit`].
#[cfg(test)]
pub fn in_flight_limit() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(MAX_IN_FLIGHT))
}

/// How much the guard serves at once, fitted to the descriptors the process may open: each
/// query in flight holds an upstream socket, each TCP client its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Queries forwarded at once, over all listeners.
    pub in_flight: usize,
    /// TCP clients at once, per listener.
    pub tcp_clients: usize,
}

impl Limits {
    pub const DESIGN: Limits = Limits {
        in_flight: MAX_IN_FLIGHT,
        tcp_clients: MAX_TCP_CLIENTS,
    };

    /// The design limits if they fit in `nofile` descriptors besides [`RESERVED_FDS`] with
    /// `listeners` TCP listeners; else half of what is left for queries in flight and half
    /// for TCP clients; `None` if that is below the minimum a guard needs.
    pub fn fit(nofile: u64, listeners: usize) -> Option<Limits> {
        let listeners = listeners.max(1);
        let budget = usize::try_from(nofile.saturating_sub(RESERVED_FDS)).unwrap_or(usize::MAX);
        if budget >= MAX_IN_FLIGHT.saturating_add(MAX_TCP_CLIENTS.saturating_mul(listeners)) {
            return Some(Limits::DESIGN);
        }
        let in_flight = (budget / 2).min(MAX_IN_FLIGHT);
        let tcp_clients = ((budget - in_flight) / listeners).min(MAX_TCP_CLIENTS);
        (in_flight >= MIN_IN_FLIGHT && tcp_clients >= MIN_TCP_CLIENTS).then_some(Limits {
            in_flight,
            tcp_clients,
        })
    }

    /// The fewest descriptors [`Limits::fit`] takes for `listeners` listeners.
    pub fn min_nofile(listeners: usize) -> u64 {
        let listeners = listeners.max(1);
        let budget = (2 * MIN_IN_FLIGHT).max(2 * MIN_TCP_CLIENTS * listeners);
        RESERVED_FDS + budget as u64
    }

    /// Queries of one client (see [`client_key`]) forwarded at once: one client holds at
    /// most an eighth of the slots, so it cannot starve the others even when its questions
    /// go to a server that never answers. Beyond it a UDP query is dropped, a TCP query gets
    /// SERVFAIL.
    fn in_flight_per_client(self) -> usize {
        self.in_flight / 8
    }

    /// TCP connections of one client at once, over all listeners.
    fn tcp_per_client(self) -> usize {
        self.tcp_clients / 4
    }
}

/// Raises the soft limit of open files to the hard one (systemd starts services with a soft
/// limit of 1,024 and a hard one far above): the guard's design limits need more than 1,024
/// descriptors. Returns the soft and hard limits in force.
fn raise_nofile() -> (u64, u64) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => {
                info!(from = soft, to = hard, "raised the limit of open files");
                (hard, hard)
            }
            Err(e) => {
                warn!(error = %e, soft, hard, "cannot raise the limit of open files");
                (soft, hard)
            }
        },
        Ok(limits) => limits,
        Err(e) => {
            // Assume the usual default: the limits then fit it.
            warn!(error = %e, "cannot read the limit of open files; assuming 1024");
            (1024, 1024)
        }
    }
}

/// The guard's listening sockets, bound before the table goes up so that a port already taken
/// stops the daemon at once.
pub struct Guard {
    udp: Vec<UdpSocket>,
    tcp: Vec<TcpListener>,
    limits: Limits,
}

impl Guard {
    /// Must be called inside the runtime, in the target network namespace. Every listening
    /// socket carries `mark` (the policy's `dns.mark`), and so does all it sends: replies,
    /// accepted connections (which inherit it) and their SYN-ACKs. The table refuses what
    /// leaves the listen addresses without it, so a process that takes the address while
    /// the daemon is down answers nobody.
    pub async fn bind(listen: &[SocketAddr], mark: u32) -> Result<Guard, GuardError> {
        let (nofile, hard) = raise_nofile();
        let limits = Limits::fit(nofile, listen.len()).ok_or(GuardError::TooFewFiles {
            nofile,
            hard,
            need: Limits::min_nofile(listen.len()),
        })?;
        if limits != Limits::DESIGN {
            warn!(
                nofile,
                in_flight = limits.in_flight,
                tcp_clients = limits.tcp_clients,
                "the limit of open files is low: the DNS guard serves fewer clients at once"
            );
        }
        let mut guard = Guard {
            udp: Vec::new(),
            tcp: Vec::new(),
            limits,
        };
        for &addr in listen {
            let bind = |transport| {
                move |source| GuardError::Bind {
                    addr,
                    transport,
                    source,
                    holder: None,
                }
            };
            let marked = |transport| {
                move |source| GuardError::Mark {
                    addr,
                    transport,
                    source,
                }
            };
            let udp = UdpSocket::bind(addr).await.map_err(|source| {
                let holder = (source.kind() == io::ErrorKind::AddrInUse)
                    .then(|| udp_holder(addr))
                    .flatten();
                GuardError::Bind {
                    addr,
                    transport: "udp",
                    source,
                    holder,
                }
            })?;
            // Nothing was sent from it yet: every reply carries the mark.
            mark_socket(&udp, mark).map_err(marked("udp"))?;
            guard.udp.push(udp);
            // Marked before it listens: no SYN-ACK or accepted connection goes without it.
            let tcp = match addr {
                SocketAddr::V4(_) => TcpSocket::new_v4(),
                SocketAddr::V6(_) => TcpSocket::new_v6(),
            }
            .map_err(bind("tcp"))?;
            tcp.set_reuseaddr(true).map_err(bind("tcp"))?;
            mark_socket(&tcp, mark).map_err(marked("tcp"))?;
            tcp.bind(addr).map_err(bind("tcp"))?;
            guard.tcp.push(tcp.listen(1024).map_err(bind("tcp"))?);
        }
        Ok(guard)
    }

    /// The limit of queries in flight this guard's [`Context`] takes.
    pub fn in_flight_limit(&self) -> Arc<Semaphore> {
        Arc::new(Semaphore::new(self.limits.in_flight))
    }

    /// Serves every socket on tasks of the current runtime.
    pub fn serve(self, context: Context) {
        let context = Arc::new(context);
        let forwarding = ClientLimits::new(self.limits.in_flight_per_client());
        let connected = ClientLimits::new(self.limits.tcp_per_client());
        for socket in self.udp {
            tokio::spawn(serve_udp(
                Arc::new(socket),
                context.clone(),
                forwarding.clone(),
            ));
        }
        for listener in self.tcp {
            tokio::spawn(serve_tcp(
                listener,
                self.limits.tcp_clients,
                context.clone(),
                forwarding.clone(),
                connected.clone(),
            ));
        }
    }
}

/// Who a client is, for its share of the guard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientKey {
    /// A local client by the uid owning its socket, whatever address it sends from (any
    /// loopback address, or one of the host's own): a local process may choose its source
    /// address, but not its uid.
    LocalUser(u32),
    /// A client from a local address whose socket was gone before the guard asked (a sender
    /// that does not wait for its answer, or a raw socket's forged datagram): all of them
    /// share one share.
    LocalUnknown,
    /// Any other client by its address; an IPv4-mapped one as IPv4, an IPv6 one by its /64,
    /// which one host usually holds whole. A source address is easy to forge (root in a
    /// container keeps CAP_NET_RAW), so all of these together also have one share of their
    /// own (see [`ClientLimits`]): forged sources cannot starve local clients.
    Address(IpAddr),
}

impl ClientKey {
    /// Whether the key is one of the [`ClientKey::Address`] keys, which share a group cap.
    fn by_address(self) -> bool {
        matches!(self, ClientKey::Address(_))
    }
}

/// The key of the client at `peer` that reached our socket at `local`. A peer on a local
/// path (a loopback address, or one of `host`'s own addresses, which the kernel never takes
/// from outside) is a local client: `diag` (when it could be opened) tells the uid of its
/// socket. Any other peer is its address, whatever socket shares its port: a forged
/// datagram from elsewhere cannot be charged to a local user's share.
pub fn client_key(
    diag: Option<&mut SockDiag>,
    host: &HostAddrs,
    protocol: sockdiag::Protocol,
    local: SocketAddr,
    peer: SocketAddr,
) -> ClientKey {
    let unmapped = |a: SocketAddr| match a.ip() {
        IpAddr::V6(v6) => SocketAddr::new(
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            a.port(),
        ),
        IpAddr::V4(_) => a,
    };
    let (peer, local) = (unmapped(peer), unmapped(local));
    let ip = peer.ip();
    if ip.is_loopback() || host.is_own(ip) {
        return match diag.and_then(|d| d.owner(protocol, local, peer)) {
            Some(uid) => ClientKey::LocalUser(uid),
            None => ClientKey::LocalUnknown,
        };
    }
    ClientKey::Address(match ip {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::from([s[0], s[1], s[2], s[3], 0, 0, 0, 0])
        }
        v4 => v4,
    })
}

/// How many of something (queries in flight, connections) each client holds, against a cap;
/// and all [`ClientKey::Address`] clients together, against twice that: forged source
/// addresses are free, so however many there are they hold no more than two clients would.
#[derive(Debug)]
pub struct ClientLimits {
    cap: usize,
    held: std::sync::Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    by_client: std::collections::HashMap<ClientKey, usize>,
    /// The sum over the [`ClientKey::Address`] keys.
    by_address: usize,
}

/// One unit a client holds; given back when dropped.
#[derive(Debug)]
pub struct ClientSlot {
    limits: Arc<ClientLimits>,
    key: ClientKey,
}

impl ClientLimits {
    pub fn new(cap: usize) -> Arc<ClientLimits> {
        Arc::new(ClientLimits {
            cap,
            held: Default::default(),
        })
    }

    /// What all [`ClientKey::Address`] clients together may hold.
    fn address_cap(&self) -> usize {
        self.cap.saturating_mul(2)
    }

    /// A slot for the client `key`, unless it already holds its cap (or it is known by its
    /// address only and those clients together hold theirs).
    pub fn try_take(self: &Arc<Self>, key: ClientKey) -> Option<ClientSlot> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if key.by_address() && held.by_address >= self.address_cap() {
            return None;
        }
        let count = held.by_client.entry(key).or_default();
        if *count >= self.cap {
            return None;
        }
        *count += 1;
        if key.by_address() {
            held.by_address += 1;
        }
        Some(ClientSlot {
            limits: self.clone(),
            key,
        })
    }

    /// Slots held by the client `key`.
    pub fn held(&self, key: ClientKey) -> usize {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.by_client.get(&key).copied().unwrap_or(0)
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut held = self.limits.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = held.by_client.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                // Forgotten at once: a flood of spoofed sources leaves no table behind.
                held.by_client.remove(&self.key);
            }
            if self.key.by_address() {
                held.by_address -= 1;
            }
        }
    }
}

/// Opens the lookup of local clients' uids; without it (no netlink, say) every local client
/// shares one share.
fn open_sock_diag() -> Option<SockDiag> {
    SockDiag::open()
        .inspect_err(|e| warn!(error = %e, "local DNS clients cannot be told apart by uid"))
        .ok()
}

/// What the receiving loop does with one UDP datagram or TCP message, decided at once: only
/// a query that must be forwarded takes a slot and a task.
enum Prepared {
    Drop,
    Reply(Vec<u8>),
    Forward(Forward),
}

/// A checked query for an allowed name, waiting to be forwarded.
struct Forward {
    query: Message,
    name: DomainName,
    rules: Arc<Rules>,
}

async fn serve_udp(socket: Arc<UdpSocket>, context: Arc<Context>, forwarding: Arc<ClientLimits>) {
    // One byte more than a query may be: a datagram that fills it is oversize.
    let mut buf = vec![0u8; MAX_QUERY + 1];
    let mut diag = open_sock_diag();
    let mut host = HostAddrsCache::new();
    let Ok(local) = socket.local_addr() else {
        return;
    };
    loop {
        let (len, client) = match socket.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                // ICMP errors of earlier replies surface here; the socket itself is fine.
                debug!(error = %e, "receiving a DNS query");
                continue;
            }
        };
        if len > MAX_QUERY {
            debug!(client = %client, "dropping a datagram too long to be a query");
            continue;
        }
        let forward = match prepare(&context, &buf[..len], client, Transport::Udp) {
            Prepared::Drop => continue,
            Prepared::Reply(reply) => {
                if let Err(e) = socket.send_to(&reply, client).await {
                    debug!(error = %e, client = %client, "sending a DNS answer");
                }
                continue;
            }
            Prepared::Forward(forward) => forward,
        };
        // Never wait here: the loop serves every client, and a client over its share (or a
        // guard out of slots) loses this query, which it asks again.
        let key = client_key(
            diag.as_mut(),
            host.current(),
            sockdiag::Protocol::Udp,
            local,
            client,
        );
        let Some(slot) = forwarding.try_take(key) else {
            debug!(client = %client, "this client has too many queries in flight; dropping one");
            continue;
        };
        let Ok(permit) = context.in_flight.clone().try_acquire_owned() else {
            debug!(client = %client, "too many queries in flight; dropping one");
            continue;
        };
        let (socket, context) = (socket.clone(), context.clone());
        tokio::spawn(async move {
            let _held = (permit, slot);
            if let Some(reply) = forward_reply(&context, forward, client, Transport::Udp).await
                && let Err(e) = socket.send_to(&reply, client).await
            {
                debug!(error = %e, client = %client, "sending a DNS answer");
            }
        });
    }
}

async fn serve_tcp(
    listener: TcpListener,
    max_clients: usize,
    context: Arc<Context>,
    forwarding: Arc<ClientLimits>,
    connected: Arc<ClientLimits>,
) {
    let clients = Arc::new(Semaphore::new(max_clients));
    let mut diag = open_sock_diag();
    let mut host = HostAddrsCache::new();
    loop {
        match listener.accept().await {
            Ok((stream, client)) => {
                let Ok(local) = stream.local_addr() else {
                    continue;
                };
                // The connection's client, once: its uid stays while it is connected.
                let key = client_key(
                    diag.as_mut(),
                    host.current(),
                    sockdiag::Protocol::Tcp,
                    local,
                    client,
                );
                let Some(slot) = connected.try_take(key) else {
                    debug!(client = %client, "this client has too many DNS connections; closing this one");
                    continue;
                };
                let Ok(permit) = clients.clone().try_acquire_owned() else {
                    debug!(client = %client, "too many DNS connections; closing this one");
                    continue;
                };
                let (context, forwarding) = (context.clone(), forwarding.clone());
                tokio::spawn(async move {
                    serve_tcp_client(stream, client, key, context, forwarding).await;
                    drop((permit, slot));
                });
            }
            Err(e) => {
                // Out of descriptors, say: keep serving UDP and try again shortly.
                warn!(error = %e, "accepting a DNS connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Queries on one connection are answered in turn (RFC 7766 allows pipelining; clients that
/// pipeline still get every answer, in order). The first query must arrive whole within
/// [`TCP_FIRST_QUERY`], each later one within [`TCP_IDLE`]; a message longer than a query
/// may be ends the connection.
async fn serve_tcp_client(
    mut stream: TcpStream,
    client: SocketAddr,
    key: ClientKey,
    context: Arc<Context>,
    forwarding: Arc<ClientLimits>,
) {
    let mut wait = TCP_FIRST_QUERY;
    while let Ok(Ok(query)) = timeout(wait, frame::read(&mut stream, MAX_QUERY)).await {
        wait = TCP_IDLE;
        let reply = match prepare(&context, &query, client, Transport::Tcp) {
            Prepared::Drop => continue,
            Prepared::Reply(reply) => reply,
            Prepared::Forward(forward) => {
                let Some(_slot) = forwarding.try_take(key) else {
                    debug!(client = %client, "this client has too many queries in flight");
                    match encode(&reply_to(&forward.query, ResponseCode::ServFail)) {
                        Some(reply) if frame::write(&mut stream, &reply).await.is_ok() => {
                            continue;
                        }
                        _ => return,
                    }
                };
                let Ok(_permit) = context.in_flight.acquire().await else {
                    return;
                };
                match forward_reply(&context, forward, client, Transport::Tcp).await {
                    Some(reply) => reply,
                    None => return,
                }
            }
        };
        if frame::write(&mut stream, &reply).await.is_err() {
            return;
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Udp => "udp",
            Transport::Tcp => "tcp",
        }
    }
}

/// The asked name as a policy name: lower case, no trailing dot. `None` for what no policy
/// can name (the root, escaped dots, wildcard labels): such names are refused.
pub fn policy_name(name: &Name) -> Option<DomainName> {
    let text = name.to_ascii().to_ascii_lowercase();
    if text.contains('\\') {
        return None;
    }
    text.parse().ok()
}

/// What to do with one query, decided from the message alone.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not a query we answer (a response, or not even a header): no reply.
    Ignore,
    /// Answer at once with this code.
    Reply(ResponseCode),
    /// A name outside the policy, or a question the guard does not forward: refuse, and
    /// report it with why.
    Refuse {
        name: String,
        qtype: String,
        why: Refusal,
    },
    /// An allowed name: forward it.
    Forward(DomainName),
}

pub fn judge(query: &Message, rules: &Rules) -> Verdict {
    if query.metadata.message_type != MessageType::Query {
        return Verdict::Ignore;
    }
    if query.metadata.op_code != OpCode::Query {
        return Verdict::Reply(ResponseCode::NotImp);
    }
    let [question] = query.queries.as_slice() else {
        return Verdict::Reply(ResponseCode::FormErr);
    };
    let refuse = |why| Verdict::Refuse {
        name: question
            .name()
            .to_ascii()
            .trim_end_matches('.')
            .to_ascii_lowercase(),
        qtype: question.query_type().to_string(),
        why,
    };
    // What a question is comes before whether its name is allowed: `version.bind CH TXT` is
    // a server fingerprint, not a name someone forgot in the policy.
    if question.query_class() != DNSClass::IN {
        return refuse(Refusal::Class(question.query_class()));
    }
    if matches!(
        question.query_type(),
        RecordType::ANY | RecordType::AXFR | RecordType::IXFR
    ) {
        return refuse(Refusal::Type(question.query_type()));
    }
    match policy_name(question.name()) {
        Some(name) if rules.allows(&name) => Verdict::Forward(name),
        _ => refuse(Refusal::NotInPolicy),
    }
}

/// Why a question was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The name is not one the policy allows.
    NotInPolicy,
    /// A class other than IN (CH: server identity and version; ANY; HS): the policy allows
    /// names of the internet class only.
    Class(DNSClass),
    /// ANY (RFC 8482 lets a server decline it) or a zone transfer (AXFR, IXFR): never
    /// forwarded, whatever the name.
    Type(RecordType),
}

impl Refusal {
    /// What `watch` and the log say.
    pub fn note(self) -> String {
        match self {
            Refusal::NotInPolicy => "not in the policy".into(),
            Refusal::Class(class) => {
                let class = match class {
                    DNSClass::OPT(_) | DNSClass::Unknown(_) => format!("CLASS{}", u16::from(class)),
                    known => known.to_string(),
                };
                format!("class {class}: the guard answers class IN only")
            }
            Refusal::Type(RecordType::ANY) => {
                "type ANY: the guard forwards no ANY queries (RFC 8482)".into()
            }
            Refusal::Type(rtype) => format!("type {rtype}: the guard forwards no zone transfers"),
        }
    }

    /// The answer: the policy's `refuse_with` for names it does not allow; REFUSED for the
    /// rest, since NXDOMAIN would tell caches that an allowed name does not exist.
    fn code(self, refuse_with: RefuseWith) -> (ResponseCode, &'static str) {
        match (self, refuse_with) {
            (Refusal::NotInPolicy, RefuseWith::Nxdomain) => (ResponseCode::NXDomain, "NXDOMAIN"),
            _ => (ResponseCode::Refused, "REFUSED"),
        }
    }
}

/// The reply to `raw` (`None`: send nothing).
#[cfg(test)]
async fn answer(
    context: &Context,
    raw: &[u8],
    client: SocketAddr,
    transport: Transport,
) -> Option<Vec<u8>> {
    match prepare(context, raw, client, transport) {
        Prepared::Drop => None,
        Prepared::Reply(reply) => Some(reply),
        Prepared::Forward(forward) => forward_reply(context, forward, client, transport).await,
    }
}

/// What to do with `raw`, decided without waiting for anything: refusals and errors are
/// answered here (and reported), and only an allowed name is left to forward.
fn prepare(context: &Context, raw: &[u8], client: SocketAddr, transport: Transport) -> Prepared {
    let reply = |msg: &Message| encode(msg).map_or(Prepared::Drop, Prepared::Reply);
    let Ok(query) = message::parse(raw, MAX_QUERY) else {
        // Answer FORMERR only when there is a header to answer, and never a response: two
        // servers could answer each other's errors forever.
        let Some(id) = message::peek_id(raw) else {
            return Prepared::Drop;
        };
        if message::peek_is_response(raw) {
            return Prepared::Drop;
        }
        return reply(&Message::error_msg(
            id,
            OpCode::Query,
            ResponseCode::FormErr,
        ));
    };
    let rules = context.rules.borrow().clone();
    match judge(&query, &rules) {
        Verdict::Ignore => Prepared::Drop,
        Verdict::Reply(code) => reply(&reply_to(&query, code)),
        Verdict::Refuse { name, qtype, why } => {
            context.counters.refused.fetch_add(1, Ordering::Relaxed);
            let (code, answer) = why.code(rules.refuse_with);
            let note = why.note();
            if let Some(held_back) = may_log(context, &rules) {
                info!(name = %name, qtype = %qtype, client = %client, transport = transport.name(),
                      answer = answer, not_logged_before = held_back,
                      "refused DNS query: {note}");
            }
            // Nobody listening is fine.
            let _ = context.events.send(QueryEvent::refused(
                name,
                qtype,
                client,
                transport.name(),
                answer,
                note,
            ));
            reply(&reply_to(&query, code))
        }
        Verdict::Forward(name) => Prepared::Forward(Forward { query, name, rules }),
    }
}

/// Forwards a checked query and returns the reply for the client (`None`: send nothing).
async fn forward_reply(
    context: &Context,
    Forward { query, name, rules }: Forward,
    client: SocketAddr,
    transport: Transport,
) -> Option<Vec<u8>> {
    match forward(context, &rules, &query, name, transport).await {
        Ok(reply) => {
            context.counters.answered.fetch_add(1, Ordering::Relaxed);
            Some(reply)
        }
        Err(why) => {
            context.counters.failed.fetch_add(1, Ordering::Relaxed);
            if let Some(held_back) = may_log(context, &rules) {
                warn!(client = %client, not_logged_before = held_back,
                      "answering SERVFAIL: {why}");
            }
            encode(&reply_to(&query, ResponseCode::ServFail))
        }
    }
}

/// Whether a line about one query may be logged now (see [`LogBudget::take`]).
fn may_log(context: &Context, rules: &Rules) -> Option<u64> {
    context
        .log_budget
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take(rules.log_rate, rules.log_burst, Instant::now())
}

/// Asks upstream, has the answer's addresses installed, and returns the answer with the
/// client's id.
async fn forward(
    context: &Context,
    rules: &Rules,
    query: &Message,
    name: DomainName,
    transport: Transport,
) -> Result<Vec<u8>, String> {
    let (mut reply, parsed) = ask_upstream(&rules.upstream, rules.mark, query, transport).await?;
    let arrived = Instant::now();
    let (addrs, left_out) = answer_addresses(query, &parsed);
    if left_out > 0
        && let Some(held_back) = may_log(context, rules)
    {
        warn!(name = %name, installed = addrs.len(), left_out, not_logged_before = held_back,
              "an answer brought more than {MAX_ADDRS_PER_FAMILY} addresses of a family; \
               only the first ones are allowed");
    }
    let count = addrs.len();
    if !addrs.is_empty() {
        let (done, installed) = oneshot::channel();
        let request = Answered {
            name: name.clone(),
            addrs,
            done,
        };
        if context.answered.send(request).await.is_err() {
            return Err("the daemon is stopping".into());
        }
        match installed.await {
            Ok(true) => {}
            Ok(false) => {
                return Err(format!(
                    "the addresses of {name} were not installed (the kernel refused them, or \
                     too many names hold live addresses); the client would be refused"
                ));
            }
            Err(_) => return Err("the daemon dropped the request".into()),
        }
    }
    reply[..2].copy_from_slice(&query.metadata.id.to_be_bytes());
    // What the guard adds to an answer's latency (benches/guard.rs reads it).
    debug!(name = %name, addresses = count, held_us = arrived.elapsed().as_micros() as u64,
           "answer released");
    Ok(reply)
}

/// The first upstream answer that matches the question, raw and parsed.
async fn ask_upstream(
    upstream: &[SocketAddr],
    mark: u32,
    query: &Message,
    transport: Transport,
) -> Result<(Vec<u8>, Message), String> {
    let mut errors = Vec::new();
    for &server in upstream {
        let id = random_id();
        let ours = upstream_query(query, id)
            .to_vec()
            .map_err(|e| format!("encoding the upstream query: {e}"))?;
        let exchange = async {
            match transport {
                Transport::Udp => ask_udp(server, mark, &ours, id).await,
                Transport::Tcp => ask_tcp(server, mark, &ours).await,
            }
        };
        let reply = match timeout(UPSTREAM_TIMEOUT, exchange).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(e)) => {
                errors.push(format!("{server}: {e}"));
                continue;
            }
            Err(_) => {
                errors.push(format!("{server}: no answer in {UPSTREAM_TIMEOUT:?}"));
                continue;
            }
        };
        match message::parse_reply(&reply, MAX_MESSAGE, id, &query.queries) {
            Ok(parsed) => return Ok((reply, parsed)),
            Err(e) => errors.push(format!("{server}: {e}")),
        }
    }
    Err(format!("no upstream answered: {}", errors.join("; ")))
}

/// Sets the socket mark the table knows the guard's sockets by. Fails without
/// CAP_NET_ADMIN: an upstream exchange fails with it, since an unmarked socket would be
/// refused, and so does binding the listeners, whose unmarked replies would be.
fn mark_socket(socket: &impl AsFd, mark: u32) -> io::Result<()> {
    setsockopt(socket, sockopt::Mark, &mark).map_err(|errno| {
        io::Error::new(
            io::Error::from(errno).kind(),
            format!("cannot mark the socket (SO_MARK needs CAP_NET_ADMIN): {errno}"),
        )
    })
}

/// The EDNS payload size the guard offers upstream: the size that avoids IP fragmentation
/// (DNS flag day 2020), at most, and never less than the 512 bytes of plain DNS.
const UPSTREAM_PAYLOAD: u16 = 1232;

/// The query the guard sends upstream for a checked `query`, rebuilt from what the guard
/// checked and nothing else: the question (name, type, class), the RD flag, the fresh `id`,
/// and EDNS only if the client used it, with the guard's own fields (version 0, the DO bit,
/// a payload size the guard bounds, no options). The client's other bits, EDNS options,
/// answer, authority and additional records and any trailing bytes are not forwarded: a
/// client could otherwise carry data to the upstream (and past it) in them.
pub fn upstream_query(query: &Message, id: u16) -> Message {
    let questions = query.queries.iter().map(|q| {
        let mut question = Query::query(q.name().clone(), q.query_type());
        question.set_query_class(q.query_class());
        question
    });
    let edns = query.edns.as_ref().map(|client| EdnsOffer {
        // The client's buffer bounds what it can take over UDP; the guard passes the answer
        // on as it came, so it asks for no more than that.
        max_payload: client.max_payload().clamp(512, UPSTREAM_PAYLOAD),
        dnssec_ok: client.flags().dnssec_ok,
    });
    message::query(id, questions, query.metadata.recursion_desired, edns)
}

/// One exchange over UDP from a fresh marked socket (a random source port), connected so
/// that datagrams from any other address never reach it.
async fn ask_udp(server: SocketAddr, mark: u32, query: &[u8], id: u16) -> io::Result<Vec<u8>> {
    let local: SocketAddr = match server {
        SocketAddr::V4(_) => (IpAddr::from([0u8; 4]), 0).into(),
        SocketAddr::V6(_) => (IpAddr::from([0u16; 8]), 0).into(),
    };
    let socket = UdpSocket::bind(local).await?;
    mark_socket(&socket, mark)?;
    socket.connect(server).await?;
    exchange::udp(&socket, query, id).await
}

async fn ask_tcp(server: SocketAddr, mark: u32, query: &[u8]) -> io::Result<Vec<u8>> {
    let socket = match server {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    // Before connect: the SYN is the packet the table judges.
    mark_socket(&socket, mark)?;
    let mut stream = socket.connect(server).await?;
    exchange::tcp(&mut stream, query).await
}

fn random_id() -> u16 {
    // A failing getrandom (no entropy at early boot) still yields an id; the fresh random
    // source port of each exchange keeps guessing hard.
    getrandom::u32().map_or(0x5a5a, |r| r as u16)
}

/// The addresses that answer the question: A and AAAA records, and the address hints of
/// HTTPS and SVCB records (clients may connect to those without asking A or AAAA), owned by
/// the asked name or by a name the CNAME chain from it reaches. Records for unrelated names
/// are ignored. At most [`MAX_ADDRS_PER_FAMILY`] addresses of each family are taken, the
/// first ones of the answer; the second value counts those left out.
pub fn answer_addresses(query: &Message, answer: &Message) -> (Vec<ResolvedAddr>, usize) {
    let Some(question) = query.queries.first() else {
        return (Vec::new(), 0);
    };
    let mut chain: Vec<&Name> = vec![question.name()];
    for _ in 0..MAX_CHAIN {
        let next = answer.answers.iter().find_map(|r| match &r.data {
            RData::CNAME(target) if chain.iter().any(|n| **n == r.name) => {
                (!chain.contains(&&target.0)).then_some(&target.0)
            }
            _ => None,
        });
        match next {
            Some(target) => chain.push(target),
            None => break,
        }
    }
    let records = answer
        .answers
        .iter()
        .filter(|r| chain.contains(&&r.name))
        .flat_map(|r| {
            record_addresses(&r.data)
                .into_iter()
                .map(move |a| (a, r.ttl))
        });
    answered_addrs(records)
}

fn record_addresses(data: &RData) -> Vec<IpAddr> {
    let svcb = match data {
        RData::HTTPS(https) => &https.0,
        RData::SVCB(svcb) => svcb,
        other => return other.ip_addr().into_iter().collect(),
    };
    svcb.svc_params
        .iter()
        .flat_map(|(_, value)| match value {
            SvcParamValue::Ipv4Hint(hint) => hint.0.iter().map(|a| IpAddr::from(a.0)).collect(),
            SvcParamValue::Ipv6Hint(hint) => hint.0.iter().map(|a| IpAddr::from(a.0)).collect(),
            _ => Vec::new(),
        })
        .collect()
}

/// A reply to `query` with `code`, the question echoed and no records.
fn reply_to(query: &Message, code: ResponseCode) -> Message {
    let mut reply = Message::error_msg(query.metadata.id, query.metadata.op_code, code);
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    reply.add_queries(query.queries.iter().cloned());
    reply
}

fn encode(msg: &Message) -> Option<Vec<u8>> {
    msg.to_vec()
        .inspect_err(|e| warn!(error = %e, "encoding a DNS reply"))
        .ok()
}

/// Streams refused queries, one JSON line each, to every client of the Unix socket at `path`
/// (`watch`). A client too slow to keep up misses events rather than slowing the guard.
pub fn serve_events(
    path: PathBuf,
    events: broadcast::Sender<QueryEvent>,
) -> Result<(), GuardError> {
    // A socket file left by an earlier daemon would make bind fail.
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|source| GuardError::Events {
        path: path.clone(),
        source,
    })?;
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let mut rx = events.subscribe();
            tokio::spawn(async move {
                loop {
                    let event = match rx.recv().await {
                        Ok(e) => e,
                        Err(broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(broadcast::error::RecvError::Closed) => return,
                    };
                    let Ok(mut line) = serde_json::to_vec(&event) else {
                        continue;
                    };
                    line.push(b'\n');
                    if stream.write_all(&line).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::str::FromStr;

    use hickory_proto::op::Query;
    use hickory_proto::rr::rdata::{A, AAAA, CNAME};
    use hickory_proto::rr::{Record, RecordType};

    use super::*;

    fn rules() -> Rules {
        let policy = Policy::parse(
            "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [443]\n  - domain: api.example\n    ports: [443]\n  - cidr: 192.0.2.0/24\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n",
            Path::new("p.yaml"),
        )
        .expect("valid");
        Rules::of(&policy).expect("guard mode")
    }

    fn query(name: &str, rtype: RecordType) -> Message {
        let mut m = Message::query();
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_str(name).unwrap(), rtype));
        m
    }

    #[test]
    fn allowed_names_are_forwarded_and_others_refused_with_their_name() {
        let r = rules();
        assert_eq!(
            judge(&query("API.Example.", RecordType::A), &r),
            Verdict::Forward("api.example".parse().unwrap())
        );
        assert_eq!(
            judge(&query("x.pool.example.", RecordType::AAAA), &r),
            Verdict::Forward("x.pool.example".parse().unwrap())
        );
        assert_eq!(
            judge(&query("c2VjcmV0.attacker.example.", RecordType::TXT), &r),
            Verdict::Refuse {
                name: "c2vjcmv0.attacker.example".into(),
                qtype: "TXT".into(),
                why: Refusal::NotInPolicy,
            }
        );
        // Deeper than the one label `*` stands for, and the suffix itself.
        for name in ["a.b.pool.example.", "pool.example."] {
            assert!(matches!(
                judge(&query(name, RecordType::A), &r),
                Verdict::Refuse { .. }
            ));
        }
        // A CIDR entry allows no name, reverse lookups included.
        assert!(matches!(
            judge(&query("1.2.0.192.in-addr.arpa.", RecordType::PTR), &r),
            Verdict::Refuse { .. }
        ));
    }

    #[test]
    fn odd_messages_are_not_forwarded() {
        let r = rules();
        let mut two = query("api.example.", RecordType::A);
        two.add_query(Query::query(
            Name::from_str("api.example.").unwrap(),
            RecordType::AAAA,
        ));
        assert_eq!(judge(&two, &r), Verdict::Reply(ResponseCode::FormErr));
        let mut notify = query("api.example.", RecordType::A);
        notify.metadata.op_code = OpCode::Notify;
        assert_eq!(judge(&notify, &r), Verdict::Reply(ResponseCode::NotImp));
        let mut response = query("api.example.", RecordType::A);
        response.metadata.message_type = MessageType::Response;
        assert_eq!(judge(&response, &r), Verdict::Ignore);
        let mut chaos = query("api.example.", RecordType::TXT);
        chaos.queries[0].set_query_class(DNSClass::CH);
        assert!(matches!(judge(&chaos, &r), Verdict::Refuse { .. }));
        // A label with an escaped dot is no name a policy can hold.
        let escaped = Name::from_labels(vec![&b"a.b"[..], b"pool", b"example"]).unwrap();
        assert_eq!(policy_name(&escaped), None);
    }

    /// Class CH or ANY, type ANY and zone transfers are refused as what they are, for
    /// allowed names too, and never answered NXDOMAIN (which would deny an allowed name).
    #[test]
    fn odd_classes_and_types_are_refused_as_what_they_are() {
        let r = rules();
        let why = |name: &str, rtype, class| {
            let mut q = query(name, rtype);
            q.queries[0].set_query_class(class);
            match judge(&q, &r) {
                Verdict::Refuse { why, .. } => why,
                other => panic!("{name} {rtype} {class}: {other:?}"),
            }
        };
        let version = why("version.bind.", RecordType::TXT, DNSClass::CH);
        assert_eq!(version, Refusal::Class(DNSClass::CH));
        assert_eq!(version.note(), "class CH: the guard answers class IN only");
        let any_class = why("api.example.", RecordType::A, DNSClass::ANY);
        assert_eq!(
            any_class.note(),
            "class ANY: the guard answers class IN only"
        );
        let odd = why("api.example.", RecordType::A, DNSClass::Unknown(77));
        assert_eq!(odd.note(), "class CLASS77: the guard answers class IN only");
        let any = why("api.example.", RecordType::ANY, DNSClass::IN);
        assert_eq!(
            any.note(),
            "type ANY: the guard forwards no ANY queries (RFC 8482)"
        );
        let axfr = why("x.pool.example.", RecordType::AXFR, DNSClass::IN);
        assert_eq!(
            axfr.note(),
            "type AXFR: the guard forwards no zone transfers"
        );
        let outside = why("secret.attacker.example.", RecordType::A, DNSClass::IN);
        assert_eq!(outside.note(), "not in the policy");
        assert_eq!(
            outside.code(RefuseWith::Nxdomain),
            (ResponseCode::NXDomain, "NXDOMAIN")
        );
        for refusal in [version, any_class, any, axfr] {
            assert_eq!(
                refusal.code(RefuseWith::Nxdomain),
                (ResponseCode::Refused, "REFUSED")
            );
        }
    }

    fn record(name: &str, ttl: u32, data: RData) -> Record {
        Record::from_rdata(Name::from_str(name).unwrap(), ttl, data)
    }

    #[test]
    fn addresses_follow_the_cname_chain_and_ignore_strangers() {
        let q = query("www.pool.example.", RecordType::A);
        let mut a = q.clone();
        a.metadata.message_type = MessageType::Response;
        let name = |s: &str| Name::from_str(s).unwrap();
        a.add_answer(record(
            "www.pool.example.",
            300,
            RData::CNAME(CNAME(name("edge.cdn.example."))),
        ));
        a.add_answer(record(
            "edge.cdn.example.",
            60,
            RData::CNAME(CNAME(name("e1.cdn.example."))),
        ));
        a.add_answer(record(
            "e1.cdn.example.",
            20,
            RData::A(A::new(192, 0, 2, 7)),
        ));
        a.add_answer(record(
            "E1.CDN.example.",
            20,
            RData::AAAA(AAAA::from_str("2001:db8::7").unwrap()),
        ));
        // Not on the chain: an injected record for a name the client never asked.
        a.add_answer(record(
            "evil.example.",
            20,
            RData::A(A::new(203, 0, 113, 66)),
        ));
        let (got, _) = answer_addresses(&q, &a);
        let want: Vec<ResolvedAddr> = [("192.0.2.7", 20), ("2001:db8::7", 20)]
            .iter()
            .map(|(ip, ttl)| ResolvedAddr {
                addr: ip.parse().unwrap(),
                ttl: *ttl,
            })
            .collect();
        assert_eq!(got, want);

        // A CNAME loop ends.
        let mut looped = q.clone();
        looped.add_answer(record(
            "www.pool.example.",
            5,
            RData::CNAME(CNAME(name("x.example."))),
        ));
        looped.add_answer(record(
            "x.example.",
            5,
            RData::CNAME(CNAME(name("www.pool.example."))),
        ));
        assert!(answer_addresses(&q, &looped).0.is_empty());
    }

    #[test]
    fn an_answer_installs_at_most_its_first_addresses_of_each_family() {
        let q = query("big.pool.example.", RecordType::A);
        let mut a = q.clone();
        a.metadata.message_type = MessageType::Response;
        for i in 0..3000u32 {
            let addr = std::net::Ipv4Addr::from(0xc612_0000 + i);
            a.add_answer(record("big.pool.example.", 60, RData::A(A(addr))));
        }
        // The same address again counts once, with its lowest TTL.
        a.add_answer(record(
            "big.pool.example.",
            5,
            RData::A(A::new(198, 18, 0, 0)),
        ));
        a.add_answer(record(
            "big.pool.example.",
            60,
            RData::AAAA(AAAA::from_str("2001:db8::1").unwrap()),
        ));
        let (got, left_out) = answer_addresses(&q, &a);
        assert_eq!(left_out, 3000 - MAX_ADDRS_PER_FAMILY);
        assert_eq!(got.len(), MAX_ADDRS_PER_FAMILY + 1);
        let first = got.iter().find(|r| r.addr == IpAddr::from([198, 18, 0, 0]));
        assert_eq!(first.map(|r| r.ttl), Some(5));
        assert!(
            got.iter()
                .filter(|r| r.addr.is_ipv4())
                .all(|r| r.addr < IpAddr::from([198, 18, 0, MAX_ADDRS_PER_FAMILY as u8])),
            "the answer's first addresses are the ones taken: {got:?}"
        );
    }

    #[test]
    fn refusals_echo_the_question_and_the_flags() {
        let q = query("secret.attacker.example.", RecordType::A);
        let bytes = encode(&reply_to(&q, ResponseCode::Refused)).expect("encodes");
        let back = Message::from_vec(&bytes).expect("parses");
        assert_eq!(back.metadata.id, q.metadata.id);
        assert_eq!(back.metadata.message_type, MessageType::Response);
        assert_eq!(back.metadata.response_code, ResponseCode::Refused);
        assert!(back.metadata.recursion_desired && back.metadata.recursion_available);
        assert_eq!(back.queries, q.queries);
        assert!(back.answers.is_empty());
    }

    /// An upstream on loopback that answers every A question with 192.0.2.7, TTL 60.
    async fn fake_upstream() -> SocketAddr {
        fake_upstream_with(|a| a).await
    }

    /// Like [`fake_upstream`], with `tamper` applied to each answer before it is sent.
    async fn fake_upstream_with(tamper: fn(Message) -> Message) -> SocketAddr {
        let socket = UdpSocket::bind("127.0.0.1:0").await.expect("bind loopback");
        let addr = socket.local_addr().expect("local address");
        tokio::spawn(async move {
            let mut buf = vec![0u8; 512];
            while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                let Ok(q) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let mut a = q.clone();
                a.metadata.message_type = MessageType::Response;
                let name = q.queries[0].name().clone();
                a.add_answer(Record::from_rdata(name, 60, RData::A(A::new(192, 0, 2, 7))));
                let _ = socket.send_to(&tamper(a).to_vec().unwrap(), from).await;
            }
        });
        addr
    }

    #[tokio::test]
    async fn an_answer_waits_for_the_kernel_and_a_refusal_becomes_servfail() {
        let mut rules = rules();
        rules.upstream = vec![fake_upstream().await];
        let (_keep, rules_rx) = watch::channel(Arc::new(rules));
        let (answered, mut daemon) = mpsc::channel(8);
        let context = Arc::new(Context {
            in_flight: in_flight_limit(),
            log_budget: Default::default(),
            rules: rules_rx,
            answered,
            events: broadcast::channel(8).0,
            counters: Arc::new(Counters::default()),
        });
        let client: SocketAddr = "127.0.0.1:5353".parse().unwrap();
        let ask = |name: &str| {
            let q = query(name, RecordType::A);
            let raw = q.to_vec().unwrap();
            let context = context.clone();
            (
                q,
                tokio::spawn(async move { answer(&context, &raw, client, Transport::Udp).await }),
            )
        };

        let (q, pending) = ask("a.pool.example.");
        let request = daemon.recv().await.expect("the daemon is asked to install");
        assert_eq!(request.name.as_str(), "a.pool.example");
        assert_eq!(
            request.addrs,
            [ResolvedAddr {
                addr: "192.0.2.7".parse().unwrap(),
                ttl: 60
            }]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !pending.is_finished(),
            "released before the kernel acknowledged"
        );
        request.done.send(true).unwrap();
        let reply = Message::from_vec(&pending.await.unwrap().expect("a reply")).unwrap();
        assert_eq!(reply.metadata.id, q.metadata.id, "the client's own id");
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert_eq!(reply.answers.len(), 1);

        let (_, pending) = ask("b.pool.example.");
        let request = daemon.recv().await.expect("the daemon is asked to install");
        request.done.send(false).unwrap();
        let reply = Message::from_vec(&pending.await.unwrap().expect("a reply")).unwrap();
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
        assert!(
            reply.answers.is_empty(),
            "no answer the client could not use"
        );
        assert_eq!(context.counters.failed.load(Ordering::Relaxed), 1);
        assert_eq!(context.counters.answered.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn https_records_bring_their_address_hints() {
        use hickory_proto::rr::rdata::HTTPS;
        use hickory_proto::rr::rdata::svcb::{IpHint, SVCB, SvcParamKey};
        let q = query("a.pool.example.", RecordType::HTTPS);
        let mut a = q.clone();
        a.metadata.message_type = MessageType::Response;
        let svcb = SVCB::new(
            1,
            Name::root(),
            vec![
                (
                    SvcParamKey::Ipv4Hint,
                    SvcParamValue::Ipv4Hint(IpHint(vec![A::new(192, 0, 2, 8)])),
                ),
                (
                    SvcParamKey::Ipv6Hint,
                    SvcParamValue::Ipv6Hint(IpHint(vec![AAAA::from_str("2001:db8::8").unwrap()])),
                ),
            ],
        );
        a.add_answer(record("a.pool.example.", 300, RData::HTTPS(HTTPS(svcb))));
        let got: Vec<IpAddr> = answer_addresses(&q, &a).0.iter().map(|r| r.addr).collect();
        assert_eq!(
            got,
            [
                "192.0.2.8".parse::<IpAddr>().unwrap(),
                "2001:db8::8".parse().unwrap()
            ]
        );
    }

    #[tokio::test]
    async fn garbage_gets_formerr_unless_it_is_a_response_or_headless() {
        let (_keep, rules_rx) = watch::channel(Arc::new(rules()));
        let context = Context {
            in_flight: in_flight_limit(),
            log_budget: Default::default(),
            rules: rules_rx,
            answered: mpsc::channel(1).0,
            events: broadcast::channel(1).0,
            counters: Arc::new(Counters::default()),
        };
        let client: SocketAddr = "127.0.0.1:5353".parse().unwrap();
        // A header claiming a question the message does not hold.
        let query = [0x12, 0x34, 0x01, 0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0, 0x03];
        let reply = answer(&context, &query, client, Transport::Udp)
            .await
            .expect("a reply");
        let reply = Message::from_vec(&reply).expect("parses");
        assert_eq!(reply.metadata.id, 0x1234);
        assert_eq!(reply.metadata.response_code, ResponseCode::FormErr);
        let mut response = query;
        response[2] |= 0x80;
        assert!(
            answer(&context, &response, client, Transport::Udp)
                .await
                .is_none()
        );
        assert!(
            answer(&context, &[0x12], client, Transport::Udp)
                .await
                .is_none()
        );
    }

    /// A client's query carrying an EDNS option of its own, an answer and an additional
    /// record and trailing bytes: upstream gets the question, RD and the guard's EDNS only.
    #[test]
    fn the_upstream_query_is_rebuilt_from_the_checked_question_alone() {
        use hickory_proto::op::Edns;
        use hickory_proto::rr::rdata::TXT;
        use hickory_proto::rr::rdata::opt::EdnsOption;
        const SECRET: &[u8] = b"SECRET-BYTES-0123456789";
        let secret = String::from_utf8(SECRET.to_vec()).unwrap();
        let mut client = query("API.example.", RecordType::AAAA);
        client.metadata.checking_disabled = true;
        let mut edns = Edns::new();
        edns.set_max_payload(4096);
        edns.set_dnssec_ok(true);
        edns.options_mut()
            .insert(EdnsOption::Unknown(65001, SECRET.to_vec()));
        client.set_edns(edns);
        client.add_answer(record(
            "x.example.",
            60,
            RData::TXT(TXT::new(vec![secret.clone()])),
        ));
        client.add_additional(record("y.example.", 60, RData::TXT(TXT::new(vec![secret]))));
        let mut raw = client.to_vec().unwrap();
        raw.extend_from_slice(SECRET);
        let contains = |hay: &[u8]| hay.windows(SECRET.len()).any(|w| w == SECRET);
        assert!(contains(&raw));
        // The guard parses what it got (trailing bytes and all), checks the question, and
        // sends this:
        let parsed = Message::from_vec(&raw).expect("parses despite the trailing bytes");
        assert!(matches!(judge(&parsed, &rules()), Verdict::Forward(_)));
        let ours = upstream_query(&parsed, 0xbeef);
        let bytes = ours.to_vec().unwrap();
        assert!(!contains(&bytes), "the client's bytes went upstream");
        let back = Message::from_vec(&bytes).unwrap();
        assert_eq!(back.metadata.id, 0xbeef);
        assert_eq!(back.metadata.message_type, MessageType::Query);
        assert!(back.metadata.recursion_desired);
        assert!(!back.metadata.checking_disabled);
        assert_eq!(back.queries, parsed.queries, "the question, case and all");
        assert!(back.answers.is_empty() && back.authorities.is_empty());
        assert!(back.additionals.is_empty());
        let edns = back.edns.expect("EDNS, since the client used it");
        assert_eq!(edns.max_payload(), UPSTREAM_PAYLOAD);
        assert!(edns.flags().dnssec_ok);
        assert_eq!(edns.options().as_ref().len(), 0, "no client options");
        // Without EDNS from the client, none upstream (plain DNS, 512 bytes over UDP).
        let plain = query("api.example.", RecordType::A);
        assert!(upstream_query(&plain, 1).edns.is_none());
        assert_eq!(
            upstream_query(&plain, 1).to_vec().unwrap().len(),
            12 + 13 + 4
        );
    }

    /// One client holds at most its cap; others are not affected; a slot given back can be
    /// taken again, and a client holding nothing leaves nothing behind.
    #[test]
    fn each_client_holds_at_most_its_share() {
        let limits = ClientLimits::new(2);
        let flood = ClientKey::LocalUser(4242);
        let other = ClientKey::LocalUser(65534);
        let a = limits.try_take(flood).expect("first");
        let _b = limits.try_take(flood).expect("second");
        assert!(limits.try_take(flood).is_none(), "over the cap");
        let c = limits
            .try_take(other)
            .expect("another client is not affected");
        drop(a);
        let _again = limits.try_take(flood).expect("a slot given back");
        drop(c);
        assert_eq!(limits.held(other), 0);
        assert!(!limits.held.lock().unwrap().by_client.contains_key(&other));
    }

    /// Clients known by their address only (any of which may be forged) hold at most twice
    /// a client's cap together, however many addresses they use; local clients keep theirs.
    #[test]
    fn clients_known_by_address_share_one_group_cap() {
        let limits = ClientLimits::new(2);
        let forged = |i: u8| ClientKey::Address(IpAddr::from([203, 0, 113, i]));
        let held: Vec<ClientSlot> = (1..=64)
            .filter_map(|i| limits.try_take(forged(i)))
            .collect();
        assert_eq!(held.len(), 4, "two clients' worth, over 64 addresses");
        let _local = limits
            .try_take(ClientKey::LocalUser(65534))
            .expect("a local client is not affected");
        let _unknown = limits
            .try_take(ClientKey::LocalUnknown)
            .expect("nor are local clients whose socket is gone");
        drop(held);
        assert_eq!(limits.held.lock().unwrap().by_address, 0);
        assert!(limits.try_take(forged(9)).is_some(), "slots given back");
    }

    /// The design limits when the descriptors allow them; under systemd's 1,024 (as a hard
    /// limit too) the in-flight and TCP limits together stay below it with room for the
    /// daemon's own; too few descriptors, no limits (the guard refuses to start).
    #[test]
    fn limits_fit_the_open_files_allowed() {
        assert_eq!(Limits::fit(1 << 20, 2), Some(Limits::DESIGN));
        assert_eq!(Limits::fit(u64::MAX, 1), Some(Limits::DESIGN));
        for listeners in 1..=4 {
            let fit = Limits::fit(1024, listeners).expect("1024 is enough");
            assert!(fit.in_flight < MAX_IN_FLIGHT);
            let used = fit.in_flight + fit.tcp_clients * listeners;
            assert!(used as u64 + RESERVED_FDS <= 1024, "{listeners}: {fit:?}");
            assert!(fit.in_flight_per_client() >= 8 && fit.tcp_per_client() >= 2);
            let need = Limits::min_nofile(listeners);
            assert!(
                Limits::fit(need, listeners).is_some(),
                "{listeners}: {need}"
            );
            assert!(
                Limits::fit(need - 1, listeners).is_none(),
                "{listeners}: {need}"
            );
        }
        assert_eq!(Limits::fit(100, 1), None);
    }

    /// A local client is its socket's uid, whatever loopback or own address it sends from;
    /// any other one its address (even when a local socket has its port), an IPv6 one by
    /// its /64.
    #[test]
    fn clients_are_told_apart_by_uid_when_local_and_by_address_otherwise() {
        let me = nix::unistd::geteuid().as_raw();
        let mut diag = SockDiag::open().expect("sock_diag");
        let server = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let local = server.local_addr().unwrap();
        let udp = sockdiag::Protocol::Udp;
        let none = HostAddrs::none();
        for from in ["127.0.0.1:0", "127.0.0.2:0", "127.9.8.7:0"] {
            let client = std::net::UdpSocket::bind(from).unwrap();
            client.send_to(b"q", local).unwrap();
            let peer = client.local_addr().unwrap();
            assert_eq!(
                client_key(Some(&mut diag), &none, udp, local, peer),
                ClientKey::LocalUser(me),
                "{from}"
            );
        }
        // Gone before the guard asked: the local clients' shared key.
        let gone: SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert_eq!(
            client_key(Some(&mut diag), &none, udp, local, gone),
            ClientKey::LocalUnknown
        );
        // A socket on every address (an unconnected client's usual one) takes datagrams to
        // its port from any source: from the host's own address it is its uid, from an
        // address that is not the host's (a forged one, say) the address, not that uid.
        let wildcard = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        wildcard.send_to(b"q", local).unwrap();
        let port = wildcard.local_addr().unwrap().port();
        let own = HostAddrs::from_interfaces([("203.0.113.7".parse().unwrap(), None, None)]);
        let from_own = SocketAddr::new("203.0.113.7".parse().unwrap(), port);
        assert_eq!(
            client_key(Some(&mut diag), &own, udp, local, from_own),
            ClientKey::LocalUser(me)
        );
        assert_eq!(
            client_key(Some(&mut diag), &none, udp, local, from_own),
            ClientKey::Address("203.0.113.7".parse().unwrap())
        );
        let gone_own: SocketAddr = "203.0.113.7:9".parse().unwrap();
        assert_eq!(
            client_key(Some(&mut diag), &own, udp, local, gone_own),
            ClientKey::LocalUnknown
        );
        let key = |peer: &str| client_key(None, &none, udp, local, peer.parse().unwrap());
        assert_eq!(key("127.0.0.1:5353"), ClientKey::LocalUnknown);
        assert_eq!(
            key("[::ffff:192.0.2.7]:5353"),
            ClientKey::Address("192.0.2.7".parse().unwrap())
        );
        assert_eq!(
            key("[2001:db8:1:2::1]:53"),
            key("[2001:db8:1:2:ffff::9]:53")
        );
        assert_ne!(key("[2001:db8:1:2::1]:53"), key("[2001:db8:1:3::1]:53"));
    }

    /// Who holds an address the guard cannot bind: the uid of the socket there.
    #[test]
    fn the_holder_of_a_taken_address_is_named() {
        let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        assert_eq!(udp_holder(addr), Some(nix::unistd::geteuid().as_raw()));
        drop(taken);
        assert_eq!(udp_holder(addr), None);
    }

    #[test]
    fn the_log_budget_keeps_the_policys_rate_and_counts_what_it_held_back() {
        let rate: Rate = "10/second".parse().unwrap();
        let mut budget = LogBudget::default();
        let t0 = Instant::now();
        let burst: Vec<Option<u64>> = (0..5).map(|_| budget.take(rate, 3, t0)).collect();
        assert_eq!(burst, [Some(0), Some(0), Some(0), None, None]);
        // A tenth of a second brings one line back, which says how many were held back.
        let t1 = t0 + Duration::from_millis(100);
        assert_eq!(budget.take(rate, 3, t1), Some(2));
        assert_eq!(budget.take(rate, 3, t1), None);
        // A long pause refills no more than the burst.
        let t2 = t1 + Duration::from_secs(60);
        let refilled = (0..5)
            .filter(|_| budget.take(rate, 3, t2).is_some())
            .count();
        assert_eq!(refilled, 3);
    }

    /// An answer with another id or to another question (spoofed, or a confused server) is
    /// never taken: the next upstream is asked, and its addresses are the ones installed.
    #[tokio::test]
    async fn answers_that_do_not_match_the_question_are_not_taken() {
        let other_id: fn(Message) -> Message = |mut a| {
            a.metadata.id = a.metadata.id.wrapping_add(1);
            a
        };
        let other_question: fn(Message) -> Message = |mut a| {
            a.queries[0].set_name(Name::from_str("evil.example.").unwrap());
            a.answers[0].data = RData::A(A::new(203, 0, 113, 66));
            a
        };
        let mut rules = rules();
        rules.upstream = vec![
            fake_upstream_with(other_question).await,
            fake_upstream_with(other_id).await,
            fake_upstream().await,
        ];
        let (_keep, rules_rx) = watch::channel(Arc::new(rules));
        let (answered, mut daemon) = mpsc::channel(8);
        let context = Arc::new(Context {
            in_flight: in_flight_limit(),
            log_budget: Default::default(),
            rules: rules_rx,
            answered,
            events: broadcast::channel(8).0,
            counters: Arc::new(Counters::default()),
        });
        let raw = query("a.pool.example.", RecordType::A).to_vec().unwrap();
        let client: SocketAddr = "127.0.0.1:5353".parse().unwrap();
        let asking = context.clone();
        let pending =
            tokio::spawn(async move { answer(&asking, &raw, client, Transport::Udp).await });
        // The mismatched id is skipped until the first upstream's time runs out; the wrong
        // question is refused at once. Either way the third upstream answers.
        let request = daemon.recv().await.expect("the daemon is asked to install");
        let addrs: Vec<IpAddr> = request.addrs.iter().map(|a| a.addr).collect();
        assert_eq!(addrs, ["192.0.2.7".parse::<IpAddr>().unwrap()]);
        request.done.send(true).unwrap();
        let reply = Message::from_vec(&pending.await.unwrap().expect("a reply")).unwrap();
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert_eq!(reply.queries[0].name().to_ascii(), "a.pool.example.");
    }
}
