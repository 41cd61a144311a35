//! The `watch` side: listen on the policy's NFLOG group and turn every logged (refused) packet
//! into a [`DropEvent`].
//!
//! Why NFLOG and not the kernel log: the plain `log` statement writes to the kernel log only from
//! the initial network namespace (unless `net.netfilter.nf_log_all_netns=1`), and scraping
//! dmesg/journald text is fragile. `log ... group N` hands the packet to the nfnetlink_log
//! subsystem of the packet's own namespace instead, which delivers it over a netlink socket
//! (NETLINK_NETFILTER, subsystem NFNL_SUBSYS_ULOG) to the one listener bound to group N.
//!
//! The socket belongs to the network namespace the calling thread is in when
//! [`Watcher::subscribe`] runs: enter the target namespace first (see [`crate::netns`]).
//!
//! The protocol is written by hand on a plain netlink socket (no libnetfilter_log, no `unsafe`):
//!
//! * one NFULNL_MSG_CONFIG request with NLM_F_ACK carries the bind command, the copy mode
//!   (packet, [`COPY_RANGE`] bytes), NFULNL_CFG_F_UID, a queue threshold of 1 and a short flush
//!   timeout; the kernel applies them in that order and acknowledges once, so a refused bind is
//!   an error of [`Watcher::subscribe`], not a silent listener that never hears anything;
//! * the kernel then sends NFULNL_MSG_PACKET messages (several per datagram when it batches),
//!   whose attributes are parsed with bounds-checked slicing, and the copied bytes are decoded
//!   as an IPv4/IPv6 header plus the transport ports.
//!
//! Not sent: NFULNL_CFG_CMD_PF_UNBIND/PF_BIND. Old kernels (before 3.x) needed them before a
//! bind; on current kernels they do something else entirely: they make nfnetlink_log the
//! backend of the plain `log` statement for a whole address family in the namespace, which would
//! steal other tables' kernel-log lines. `log group N` selects nfnetlink_log by itself.
//!
//! No unbind on drop either: closing the socket is enough, the kernel destroys every instance
//! bound by a netlink port when the port is released (NETLINK_URELEASE), so the group is free
//! again at once (the `watch_smoke` test checks this).

use std::collections::VecDeque;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::sys::socket::{
    self, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, sockopt,
};
use nix::sys::time::TimeVal;
use serde::{Deserialize, Serialize};

/// Bytes of each packet the kernel copies to us: an IPv4 header with options (60) or an IPv6
/// header (40) with a few extension headers, plus the 4 bytes of ports. Copying no more keeps
/// the payload (possibly the very secret being exfiltrated) out of our buffers and logs.
pub const COPY_RANGE: u32 = 128;

/// How long [`Watcher::subscribe`] waits for the kernel's acknowledgement of the bind.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// Flush timeout of the kernel's per-group queue, in hundredths of a second. With a queue
/// threshold of 1 every packet is sent at once anyway; this bounds the delay when a rule sets
/// its own `queue-threshold`.
const FLUSH_TIMEOUT_CS: u32 = 1;

/// Room for the largest datagram nfnetlink_log sends (its buffer is at most 128 KiB, far less
/// by default); a larger one is reported as malformed rather than silently cut.
const RECV_BUF: usize = 128 * 1024 + 4096;

// Netlink and nfnetlink numbers. The libc crate has most of them as c_int; they are restated
// here in the widths the wire uses.
const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;
const NLA_HDRLEN: usize = 4;
/// nla_type carries NLA_F_NESTED and NLA_F_NET_BYTEORDER in its top two bits.
const NLA_TYPE_MASK: u16 = 0x3fff;
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const NLM_F_REQUEST: u16 = libc::NLM_F_REQUEST as u16;
const NLM_F_ACK: u16 = libc::NLM_F_ACK as u16;
const NFNETLINK_V0: u8 = libc::NFNETLINK_V0 as u8;
const SUBSYS_ULOG: u16 = libc::NFNL_SUBSYS_ULOG as u16;
const MSG_PACKET: u16 = (SUBSYS_ULOG << 8) | libc::NFULNL_MSG_PACKET as u16;
const MSG_CONFIG: u16 = (SUBSYS_ULOG << 8) | libc::NFULNL_MSG_CONFIG as u16;

const NFULA_PACKET_HDR: u16 = libc::NFULA_PACKET_HDR as u16;
const NFULA_TIMESTAMP: u16 = libc::NFULA_TIMESTAMP as u16;
const NFULA_PAYLOAD: u16 = libc::NFULA_PAYLOAD as u16;
const NFULA_PREFIX: u16 = libc::NFULA_PREFIX as u16;
const NFULA_UID: u16 = libc::NFULA_UID as u16;
const NFULA_GID: u16 = libc::NFULA_GID as u16;

const NFULA_CFG_CMD: u16 = libc::NFULA_CFG_CMD as u16;
const NFULA_CFG_MODE: u16 = libc::NFULA_CFG_MODE as u16;
const NFULA_CFG_TIMEOUT: u16 = libc::NFULA_CFG_TIMEOUT as u16;
const NFULA_CFG_QTHRESH: u16 = libc::NFULA_CFG_QTHRESH as u16;
const NFULA_CFG_FLAGS: u16 = libc::NFULA_CFG_FLAGS as u16;
const NFULNL_CFG_CMD_BIND: u8 = libc::NFULNL_CFG_CMD_BIND as u8;
const NFULNL_COPY_PACKET: u8 = libc::NFULNL_COPY_PACKET as u8;
const NFULNL_CFG_F_UID: u16 = 0x0008;

const NFPROTO_IPV4: u8 = libc::NFPROTO_IPV4 as u8;
const NFPROTO_IPV6: u8 = libc::NFPROTO_IPV6 as u8;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;

/// Linux capability number of CAP_NET_ADMIN (bit in /proc/self/status CapEff).
const CAP_NET_ADMIN: u32 = 12;

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("cannot open a netlink socket to netfilter: {0}")]
    Socket(#[source] Errno),
    #[error(
        "NFLOG group {group} is already bound by another listener in this network namespace \
         (another `egress-fence watch`, ulogd, ...): stop it, or log to another group"
    )]
    GroupBusy { group: u16 },
    #[error(
        "binding NFLOG group {group} needs CAP_NET_ADMIN in the network namespace: \
         run egress-fence as root"
    )]
    Permission { group: u16 },
    #[error("the kernel refused to bind NFLOG group {group}: {errno}{}", bind_hint(*errno))]
    Refused { group: u16, errno: Errno },
    #[error("no answer from the kernel to the NFLOG bind of group {group} within {ACK_TIMEOUT:?}")]
    Timeout { group: u16 },
    #[error("netlink {doing} failed: {source}")]
    Io {
        doing: &'static str,
        #[source]
        source: Errno,
    },
    #[error(
        "some refused packets were not reported: the listener fell behind and the kernel \
         dropped log messages (ENOBUFS)"
    )]
    Overrun,
    #[error("the kernel sent an NFLOG message egress-fence cannot read: {0}")]
    Malformed(String),
}

fn bind_hint(errno: Errno) -> &'static str {
    match errno {
        Errno::EINVAL | Errno::EOPNOTSUPP | Errno::ENOENT => {
            "; the kernel may lack nfnetlink_log (CONFIG_NETFILTER_NETLINK_LOG)"
        }
        _ => "",
    }
}

impl WatchError {
    /// Whether the [`Watcher`] is still usable after this error: one unreadable message or a
    /// lost burst is worth a warning, not the end of the listener.
    pub fn is_transient(&self) -> bool {
        matches!(self, WatchError::Overrun | WatchError::Malformed(_))
    }
}

fn malformed(what: impl Into<String>) -> WatchError {
    WatchError::Malformed(what.into())
}

/// One refused packet, as read from NFLOG. Serialises (serde_json) to one JSON object per event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DropEvent {
    /// RFC 3339, UTC, milliseconds. The kernel's packet timestamp when it sends one (it does
    /// only on the input side: prerouting, input, forward), else the time the message was read:
    /// the kernel sends each message at once, so for outgoing packets this is the time of the
    /// refusal as long as the listener keeps up.
    pub time: String,
    /// The rule's log prefix exactly as configured (e.g. "EGRESS-DROP: " with its trailing
    /// space), without the kernel's NUL terminator, so it can be matched against the policy.
    /// Empty when the rule has none.
    pub prefix: String,
    /// "ipv4" or "ipv6".
    pub family: &'static str,
    /// "tcp", "udp", "icmp", "icmpv6", "sctp", "udplite", else the protocol / next-header
    /// number. For IPv6 the common extension headers are skipped first.
    pub protocol: String,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// Ports, for tcp, udp, sctp and udplite when the header was captured (not in later
    /// fragments).
    pub sport: Option<u16>,
    pub dport: Option<u16>,
    /// Owner of the sending socket, as seen from the listener's user namespace; absent for
    /// packets without a full socket (forwarded packets, TCP resets, time-wait).
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// Always "refused": egress-fence logs only packets it refuses.
    pub verdict: &'static str,
    /// What egress-fence knows about the destination ("the cloud metadata service", "was
    /// api.example.com until 4 minutes ago"), filled in by the caller.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl fmt::Display for DropEvent {
    /// `TIME REFUSED PROTO SRC[:PORT] -> DST[:PORT] [uid=U] [gid=G] [PREFIX]`, with IPv6
    /// addresses bracketed when a port follows.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {} {} -> {}",
            self.time,
            self.verdict.to_uppercase(),
            self.protocol,
            Endpoint(self.src, self.sport),
            Endpoint(self.dst, self.dport),
        )?;
        if let Some(uid) = self.uid {
            write!(f, " uid={uid}")?;
        }
        if let Some(gid) = self.gid {
            write!(f, " gid={gid}")?;
        }
        let prefix = self.prefix.trim();
        if !prefix.is_empty() {
            write!(f, " {prefix}")?;
        }
        if let Some(note) = &self.note {
            write!(f, " [{note}]")?;
        }
        Ok(())
    }
}

/// A DNS query the guard refused: its name never left the host. The guard streams these, one
/// JSON object per line, on [`crate::state::StateDir::guard_events`]; `watch` prints them
/// beside refused packets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueryEvent {
    /// RFC 3339, UTC, milliseconds: when the query was answered.
    pub time: String,
    /// Always "refused".
    pub verdict: String,
    /// Always "dns", which tells these lines from refused packets.
    pub protocol: String,
    /// The name asked, lower case, without the trailing dot.
    pub name: String,
    /// "A", "AAAA", "TXT", ... ("TYPE65534" for unknown types).
    pub qtype: String,
    /// Who asked: the address and port the query came from.
    pub client: SocketAddr,
    /// "udp" or "tcp".
    pub transport: String,
    /// The response code the client got: "REFUSED" or "NXDOMAIN".
    pub answer: String,
    /// Why: "not in the policy", or what the question is ("class CH: the guard answers
    /// class IN only", "type ANY: ...").
    pub note: String,
}

impl QueryEvent {
    pub fn refused(
        name: String,
        qtype: String,
        client: SocketAddr,
        transport: &str,
        answer: &str,
        note: String,
    ) -> QueryEvent {
        QueryEvent {
            time: system_time_rfc3339(SystemTime::now()),
            verdict: "refused".into(),
            protocol: "dns".into(),
            name,
            qtype,
            client,
            transport: transport.into(),
            answer: answer.into(),
            note,
        }
    }
}

impl fmt::Display for QueryEvent {
    /// `TIME REFUSED dns query NAME TYPE from CLIENT (TRANSPORT), answered ANSWER [NOTE]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {} query {} {} from {} ({}), answered {} [{}]",
            self.time,
            self.verdict.to_uppercase(),
            self.protocol,
            self.name,
            self.qtype,
            self.client,
            self.transport,
            self.answer,
            self.note
        )
    }
}

/// What `watch` hears: a refused packet (or the error reading one), a query the DNS guard
/// refused, or a note about the sources themselves (for stderr).
pub enum Heard {
    Packet(Result<DropEvent, WatchError>),
    Query(QueryEvent),
    Note(String),
}

/// Reads refused packets from `watcher` and, whenever a DNS guard serves them, its refused
/// queries from the Unix socket `guard_events`, each on a thread of its own; everything comes
/// out of the one receiver, so a single printer never mixes lines. The guard's socket is
/// tried again every second while there is none (the guard not started yet, restarting, or
/// resolve mode), quietly.
pub fn hear(
    mut watcher: Watcher,
    guard_events: std::path::PathBuf,
) -> std::io::Result<std::sync::mpsc::Receiver<Heard>> {
    let (tx, rx) = std::sync::mpsc::channel::<Heard>();
    let packets = tx.clone();
    std::thread::Builder::new()
        .name("nflog".into())
        .spawn(move || {
            loop {
                let event = watcher.next_event();
                let fatal = matches!(&event, Err(e) if !e.is_transient());
                if packets.send(Heard::Packet(event)).is_err() || fatal {
                    return;
                }
            }
        })?;
    std::thread::Builder::new()
        .name("guard-events".into())
        .spawn(move || follow_guard(&guard_events, &tx))?;
    Ok(rx)
}

/// Forwards the guard's events until the receiver is gone, reconnecting as the guard comes
/// and goes.
fn follow_guard(path: &std::path::Path, tx: &std::sync::mpsc::Sender<Heard>) {
    use std::io::BufRead;
    let mut said: Option<String> = None;
    loop {
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(stream) => {
                said = None;
                let note = format!(
                    "watching the DNS guard for refused queries ({})",
                    path.display()
                );
                if tx.send(Heard::Note(note)).is_err() {
                    return;
                }
                for line in std::io::BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    if line.trim().is_empty() {
                        continue;
                    }
                    let heard = match serde_json::from_str::<QueryEvent>(&line) {
                        Ok(q) => Heard::Query(q),
                        Err(e) => Heard::Note(format!(
                            "warning: unreadable event from the DNS guard ({e}): {line}"
                        )),
                    };
                    if tx.send(heard).is_err() {
                        return;
                    }
                }
                let note = "the DNS guard went away; reconnecting when it is back";
                if tx.send(Heard::Note(note.into())).is_err() {
                    return;
                }
            }
            // No guard (yet): nothing to say.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) => {}
            // Anything else once, until it changes.
            Err(e) => {
                let note = format!(
                    "warning: cannot read the DNS guard's events from {}: {e}",
                    path.display()
                );
                if said.as_ref() != Some(&note) {
                    said = Some(note.clone());
                    if tx.send(Heard::Note(note)).is_err() {
                        return;
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

struct Endpoint(IpAddr, Option<u16>);

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.1 {
            Some(port) => SocketAddr::new(self.0, port).fmt(f),
            None => self.0.fmt(f),
        }
    }
}

/// A netlink socket bound to one NFLOG group in one network namespace. Dropping it closes the
/// socket, which releases the group.
pub struct Watcher {
    fd: OwnedFd,
    group: u16,
    buf: Vec<u8>,
    /// Messages already received but not yet handed out (the kernel may batch several packets
    /// in one datagram, and packets may arrive before the bind's acknowledgement).
    pending: VecDeque<Result<DropEvent, WatchError>>,
    /// The receive timeout currently set on the socket, to avoid a syscall per call.
    rcv_timeout: Option<Duration>,
}

impl fmt::Debug for Watcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watcher")
            .field("group", &self.group)
            .field("pending", &self.pending.len())
            .finish()
    }
}

impl Watcher {
    /// Binds NFLOG group `group` in the current network namespace: copy mode packet
    /// ([`COPY_RANGE`] bytes, enough for the IP and transport headers), the sending socket's
    /// uid/gid (NFULNL_CFG_F_UID), each packet sent at once. Fails if the kernel refuses, e.g.
    /// when another listener holds the group ([`WatchError::GroupBusy`]) or without
    /// CAP_NET_ADMIN ([`WatchError::Permission`]).
    pub fn subscribe(group: u16) -> Result<Watcher, WatchError> {
        let fd = socket::socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkNetFilter,
        )
        .map_err(WatchError::Socket)?;
        socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).map_err(WatchError::Socket)?;
        let mut watcher = Watcher {
            fd,
            group,
            buf: vec![0; RECV_BUF],
            pending: VecDeque::new(),
            rcv_timeout: None,
        };
        const SEQ: u32 = 1;
        let request = bind_request(group, SEQ);
        socket::sendto(
            watcher.fd.as_raw_fd(),
            &request,
            &NetlinkAddr::new(0, 0),
            MsgFlags::empty(),
        )
        .map_err(|source| WatchError::Io {
            doing: "bind request",
            source,
        })?;

        let deadline = Instant::now() + ACK_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(WatchError::Timeout { group });
            }
            match watcher.receive(Some(left)) {
                Ok(Some(acks)) => {
                    if let Some(&(_, errno)) = acks.iter().find(|(seq, _)| *seq == SEQ) {
                        return match errno {
                            None => Ok(watcher),
                            Some(errno) => Err(refusal(group, errno)),
                        };
                    }
                }
                Ok(None) => {}
                // Packets of ours were lost before the ack: report it with the first event.
                Err(WatchError::Overrun) => watcher.pending.push_back(Err(WatchError::Overrun)),
                Err(e) => return Err(e),
            }
        }
    }

    /// The group this watcher is bound to.
    pub fn group(&self) -> u16 {
        self.group
    }

    /// Blocks until the next logged packet and returns it decoded. After an error for which
    /// [`WatchError::is_transient`] holds, call again for the following packets.
    pub fn next_event(&mut self) -> Result<DropEvent, WatchError> {
        loop {
            if let Some(event) = self.wait(None)? {
                return Ok(event);
            }
        }
    }

    /// Like [`Watcher::next_event`], waiting at most `timeout`. `Ok(None)` when nothing arrived
    /// in time, or earlier when a signal interrupted the wait, so that a caller which stops on a
    /// signal flag gets the chance to look at it.
    pub fn next_event_timeout(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<DropEvent>, WatchError> {
        self.wait(Some(timeout))
    }

    /// The next queued or received event, waiting at most `timeout` (`None`: until a packet or
    /// a signal arrives).
    fn wait(&mut self, timeout: Option<Duration>) -> Result<Option<DropEvent>, WatchError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(next) = self.pending.pop_front() {
                return next.map(Some);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Ok(None);
            }
            // Acknowledgements are not expected after the bind; they are ignored.
            if self.receive(left)?.is_none() {
                return Ok(None);
            }
        }
    }

    /// Reads one datagram, queues its packets (decoded) and returns its acknowledgements as
    /// (sequence, errno). `None` on timeout or interruption.
    fn receive(&mut self, timeout: Option<Duration>) -> Result<Option<Vec<Ack>>, WatchError> {
        self.set_timeout(timeout)?;
        // MSG_TRUNC makes recv return the datagram's real length, so a cut one is detected.
        let n = match socket::recv(self.fd.as_raw_fd(), &mut self.buf, MsgFlags::MSG_TRUNC) {
            Ok(n) => n,
            Err(Errno::EAGAIN | Errno::EINTR) => return Ok(None),
            Err(Errno::ENOBUFS) => return Err(WatchError::Overrun),
            Err(source) => {
                return Err(WatchError::Io {
                    doing: "receive",
                    source,
                });
            }
        };
        let data = self
            .buf
            .get(..n)
            .ok_or_else(|| malformed(format!("{n} byte datagram exceeds the buffer")))?;
        let (events, acks) = split_datagram(data, SystemTime::now());
        self.pending.extend(events);
        Ok(Some(acks))
    }

    fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<(), WatchError> {
        // A zero SO_RCVTIMEO means "forever", so the shortest real wait is one microsecond.
        let timeout = timeout.map(|t| t.max(Duration::from_micros(1)));
        if self.rcv_timeout == timeout {
            return Ok(());
        }
        let tv = match timeout {
            None => TimeVal::new(0, 0),
            Some(t) => TimeVal::new(
                t.as_secs().try_into().unwrap_or(i64::MAX as _),
                t.subsec_micros().into(),
            ),
        };
        socket::setsockopt(&self.fd, sockopt::ReceiveTimeout, &tv).map_err(|source| {
            WatchError::Io {
                doing: "receive timeout setup",
                source,
            }
        })?;
        self.rcv_timeout = timeout;
        Ok(())
    }
}

/// Maps the kernel's answer to a bind. Another listener on the group and a missing capability
/// both come back as EPERM; our own capabilities tell them apart.
fn refusal(group: u16, errno: Errno) -> WatchError {
    match errno {
        Errno::EBUSY => WatchError::GroupBusy { group },
        Errno::EPERM if has_net_admin() == Some(true) => WatchError::GroupBusy { group },
        Errno::EPERM => WatchError::Permission { group },
        errno => WatchError::Refused { group, errno },
    }
}

/// Whether this process holds CAP_NET_ADMIN (effective set), from /proc/self/status.
fn has_net_admin() -> Option<bool> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    let caps = u64::from_str_radix(hex.trim(), 16).ok()?;
    Some(caps & (1 << CAP_NET_ADMIN) != 0)
}

// ---------------------------------------------------------------------------------------------
// Building the config request
// ---------------------------------------------------------------------------------------------

/// Appends one netlink attribute, padded to 4 bytes.
fn put_attr(msg: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = u16::try_from(NLA_HDRLEN + payload.len()).expect("attributes here are tiny");
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(payload);
    msg.resize(align4(msg.len()), 0);
}

/// The NFULNL_MSG_CONFIG request that binds `group` and configures it, with NLM_F_ACK.
/// NFULA values are big-endian; the netlink headers are in host order.
fn bind_request(group: u16, seq: u32) -> Vec<u8> {
    let mut msg = Vec::with_capacity(64);
    msg.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_len, set below
    msg.extend_from_slice(&MSG_CONFIG.to_ne_bytes());
    msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_pid: the kernel fills in ours
    // nfgenmsg: the family is irrelevant to a group bind (AF_UNSPEC), res_id is the group.
    msg.push(libc::AF_UNSPEC as u8);
    msg.push(NFNETLINK_V0);
    msg.extend_from_slice(&group.to_be_bytes());
    // struct nfulnl_msg_config_cmd { u8 command; }
    put_attr(&mut msg, NFULA_CFG_CMD, &[NFULNL_CFG_CMD_BIND]);
    // struct nfulnl_msg_config_mode { be32 copy_range; u8 copy_mode; u8 _pad; } (packed, 6)
    let mut mode = COPY_RANGE.to_be_bytes().to_vec();
    mode.extend_from_slice(&[NFULNL_COPY_PACKET, 0]);
    put_attr(&mut msg, NFULA_CFG_MODE, &mode);
    put_attr(&mut msg, NFULA_CFG_TIMEOUT, &FLUSH_TIMEOUT_CS.to_be_bytes());
    put_attr(&mut msg, NFULA_CFG_QTHRESH, &1u32.to_be_bytes());
    put_attr(&mut msg, NFULA_CFG_FLAGS, &NFULNL_CFG_F_UID.to_be_bytes());
    let len = u32::try_from(msg.len()).expect("the request is tiny");
    msg[..4].copy_from_slice(&len.to_ne_bytes());
    msg
}

// ---------------------------------------------------------------------------------------------
// Parsing what the kernel sends
// ---------------------------------------------------------------------------------------------

pub(crate) fn align4(n: usize) -> usize {
    n.saturating_add(3) & !3
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn be64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

pub(crate) fn ne16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

pub(crate) fn ne32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// A netlink acknowledgement: the request's sequence number and the errno, if it failed.
type Ack = (u32, Option<Errno>);

/// Splits one datagram into netlink messages: NFLOG packets become events (or per-message
/// errors), NLMSG_ERROR becomes an acknowledgement (sequence, errno if any); the rest
/// (NLMSG_DONE closing a batch, NOOP, other types) is skipped. A header that does not fit stops
/// the walk with one error, since nothing after it can be located.
#[allow(clippy::type_complexity)]
fn split_datagram(
    mut data: &[u8],
    now: SystemTime,
) -> (
    Vec<Result<DropEvent, WatchError>>,
    Vec<(u32, Option<Errno>)>,
) {
    let mut events = Vec::new();
    let mut acks = Vec::new();
    while !data.is_empty() {
        let len = ne32(data, 0).map(|l| l as usize);
        let Some(len) = len.filter(|&l| l >= NLMSG_HDRLEN && l <= data.len()) else {
            events.push(Err(malformed(format!(
                "netlink header of {len:?} bytes in {} remaining bytes",
                data.len()
            ))));
            break;
        };
        let (msg, rest) = data.split_at(len);
        data = rest.get(align4(len) - len..).unwrap_or(&[]);
        let kind = ne16(msg, 4).unwrap_or(0);
        match kind {
            MSG_PACKET => events.push(decode_packet(msg, now)),
            NLMSG_ERROR => {
                let seq = ne32(msg, 8).unwrap_or(0);
                match ne32(msg, NLMSG_HDRLEN) {
                    Some(0) => acks.push((seq, None)),
                    Some(e) => acks.push((seq, Some(Errno::from_raw((e as i32).wrapping_neg())))),
                    None => events.push(Err(malformed("short netlink error message"))),
                }
            }
            // NLMSG_DONE (closing a batch), NLMSG_NOOP and anything newer are not for us.
            _ => {}
        }
    }
    (events, acks)
}

/// The attributes of an NFULNL_MSG_PACKET that egress-fence uses.
#[derive(Default)]
struct PacketAttrs<'a> {
    hw_protocol: Option<u16>,
    timestamp: Option<(u64, u64)>,
    payload: Option<&'a [u8]>,
    prefix: Option<&'a [u8]>,
    uid: Option<u32>,
    gid: Option<u32>,
}

/// Decodes one NFULNL_MSG_PACKET message (netlink header included).
fn decode_packet(msg: &[u8], now: SystemTime) -> Result<DropEvent, WatchError> {
    let family = *msg
        .get(NLMSG_HDRLEN)
        .ok_or_else(|| malformed("packet message without nfgenmsg"))?;
    let mut attrs = PacketAttrs::default();
    let mut rest = msg.get(NLMSG_HDRLEN + NFGENMSG_LEN..).unwrap_or(&[]);
    while rest.len() >= NLA_HDRLEN {
        let len = ne16(rest, 0).unwrap_or(0) as usize;
        let kind = ne16(rest, 2).unwrap_or(0) & NLA_TYPE_MASK;
        if len < NLA_HDRLEN || len > rest.len() {
            return Err(malformed(format!(
                "attribute {kind} of {len} bytes in {} remaining bytes",
                rest.len()
            )));
        }
        let value = &rest[NLA_HDRLEN..len];
        let short = || malformed(format!("attribute {kind} of only {} bytes", value.len()));
        match kind {
            NFULA_PACKET_HDR => attrs.hw_protocol = Some(be16(value, 0).ok_or_else(short)?),
            NFULA_TIMESTAMP => {
                let sec = be64(value, 0).ok_or_else(short)?;
                let usec = be64(value, 8).ok_or_else(short)?;
                attrs.timestamp = Some((sec, usec));
            }
            NFULA_PAYLOAD => attrs.payload = Some(value),
            NFULA_PREFIX => attrs.prefix = Some(value),
            NFULA_UID => attrs.uid = Some(be32(value, 0).ok_or_else(short)?),
            NFULA_GID => attrs.gid = Some(be32(value, 0).ok_or_else(short)?),
            _ => {}
        }
        rest = rest.get(align4(len)..).unwrap_or(&[]);
    }

    let payload = attrs
        .payload
        .ok_or_else(|| malformed("packet message without payload (copy mode not packet?)"))?;
    let ip = decode_ip(family, attrs.hw_protocol, payload)?;
    let prefix = attrs.prefix.map(|p| {
        let end = p.iter().position(|&b| b == 0).unwrap_or(p.len());
        String::from_utf8_lossy(&p[..end]).into_owned()
    });
    let time = match attrs.timestamp {
        // Absurd kernel values fall back to now rather than failing the event.
        Some((sec, usec)) if sec > 0 && usec < 1_000_000 => i64::try_from(sec)
            .ok()
            .and_then(|s| rfc3339_millis(s, (usec / 1000) as u32)),
        _ => None,
    }
    .unwrap_or_else(|| system_time_rfc3339(now));
    Ok(DropEvent {
        time,
        prefix: prefix.unwrap_or_default(),
        family: ip.family,
        protocol: protocol_name(ip.protocol),
        src: ip.src,
        dst: ip.dst,
        sport: ip.ports.map(|p| p.0),
        dport: ip.ports.map(|p| p.1),
        uid: attrs.uid,
        gid: attrs.gid,
        verdict: "refused",
        note: None,
    })
}

/// What the IP and transport headers say.
#[derive(Debug, PartialEq, Eq)]
struct IpInfo {
    family: &'static str,
    protocol: u8,
    src: IpAddr,
    dst: IpAddr,
    ports: Option<(u16, u16)>,
}

/// Decodes the copied packet. The nfgenmsg family says which IP version it is for ip/ip6/inet
/// tables; for others (bridge, netdev) the hardware protocol or the version nibble does.
fn decode_ip(family: u8, hw_protocol: Option<u16>, p: &[u8]) -> Result<IpInfo, WatchError> {
    let version = match (family, hw_protocol) {
        (NFPROTO_IPV4, _) | (_, Some(ETH_P_IP)) => 4,
        (NFPROTO_IPV6, _) | (_, Some(ETH_P_IPV6)) => 6,
        _ => p.first().map_or(0, |b| b >> 4),
    };
    match version {
        4 => decode_ipv4(p),
        6 => decode_ipv6(p),
        _ => Err(malformed(format!(
            "not an IP packet (family {family}, hardware protocol {hw_protocol:#06x?})"
        ))),
    }
}

fn decode_ipv4(p: &[u8]) -> Result<IpInfo, WatchError> {
    let first = *p.first().ok_or_else(|| malformed("empty IPv4 payload"))?;
    let header_len = usize::from(first & 0x0f) * 4;
    if first >> 4 != 4 || header_len < 20 {
        return Err(malformed(format!("bad IPv4 header start {first:#04x}")));
    }
    let header = p
        .get(..header_len)
        .ok_or_else(|| malformed(format!("IPv4 header cut at {} bytes", p.len())))?;
    let octets =
        |at: usize| -> [u8; 4] { [header[at], header[at + 1], header[at + 2], header[at + 3]] };
    let protocol = header[9];
    let fragment_offset = u16::from_be_bytes([header[6], header[7]]) & 0x1fff;
    let ports = if fragment_offset == 0 {
        ports(protocol, &p[header_len..])
    } else {
        None
    };
    Ok(IpInfo {
        family: "ipv4",
        protocol,
        src: IpAddr::V4(Ipv4Addr::from(octets(12))),
        dst: IpAddr::V4(Ipv4Addr::from(octets(16))),
        ports,
    })
}

fn decode_ipv6(p: &[u8]) -> Result<IpInfo, WatchError> {
    let header = p
        .get(..40)
        .ok_or_else(|| malformed(format!("IPv6 header cut at {} bytes", p.len())))?;
    if header[0] >> 4 != 6 {
        return Err(malformed(format!(
            "bad IPv6 header start {:#04x}",
            header[0]
        )));
    }
    let addr = |at: usize| -> Result<Ipv6Addr, WatchError> {
        let octets: [u8; 16] = header[at..at + 16]
            .try_into()
            .map_err(|_| malformed("IPv6 address"))?;
        Ok(Ipv6Addr::from(octets))
    };
    let (src, dst) = (addr(8)?, addr(24)?);

    // Walk the extension headers to the transport header; when the chain leaves the copied
    // bytes (or hits ESP), the protocol is the last next-header value reached, without ports.
    let mut protocol = header[6];
    let mut at = 40;
    let mut first_fragment = true;
    let mut ports_known = true;
    loop {
        let len = match protocol {
            // hop-by-hop, routing, destination options: (hdr ext len + 1) * 8
            0 | 43 | 60 => p.get(at + 1).map(|&l| (usize::from(l) + 1) * 8),
            // fragment: 8 bytes; only the first fragment carries the ports
            44 => {
                if let Some(off) = be16(p, at + 2) {
                    first_fragment = off & 0xfff8 == 0;
                }
                Some(8)
            }
            // authentication header: (payload len + 2) * 4
            51 => p.get(at + 1).map(|&l| (usize::from(l) + 2) * 4),
            _ => break,
        };
        match (p.get(at), len) {
            (Some(&next), Some(len)) if at + len <= p.len() => {
                protocol = next;
                at += len;
            }
            _ => {
                ports_known = false;
                break;
            }
        }
    }
    let ports = if ports_known && first_fragment {
        ports(protocol, &p[at..])
    } else {
        None
    };
    Ok(IpInfo {
        family: "ipv6",
        protocol,
        src: IpAddr::V6(src),
        dst: IpAddr::V6(dst),
        ports,
    })
}

/// Source and destination ports, which tcp, udp, sctp and udplite all keep in the first 4
/// bytes of their header.
fn ports(protocol: u8, transport: &[u8]) -> Option<(u16, u16)> {
    match protocol {
        6 | 17 | 132 | 136 => Some((be16(transport, 0)?, be16(transport, 2)?)),
        _ => None,
    }
}

fn protocol_name(protocol: u8) -> String {
    match protocol {
        1 => "icmp".into(),
        6 => "tcp".into(),
        17 => "udp".into(),
        58 => "icmpv6".into(),
        132 => "sctp".into(),
        136 => "udplite".into(),
        n => n.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Time
// ---------------------------------------------------------------------------------------------

fn system_time_rfc3339(t: SystemTime) -> String {
    let (secs, millis) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (
            i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            d.subsec_millis(),
        ),
        Err(_) => (0, 0),
    };
    rfc3339_millis(secs, millis).unwrap_or_else(|| "1970-01-01T00:00:00.000Z".into())
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` for a Unix time (civil-from-days, proleptic Gregorian); `None`
/// past year 9999, which RFC 3339 cannot write.
fn rfc3339_millis(secs: i64, millis: u32) -> Option<String> {
    let days = secs.div_euclid(86_400);
    let of_day = secs.rem_euclid(86_400);
    let z = days.checked_add(719_468)?;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    if !(0..=9999).contains(&year) || millis > 999 {
        return None;
    }
    Some(format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;

    /// Builds an NFULNL_MSG_PACKET message as the kernel does.
    struct Msg(Vec<u8>);

    impl Msg {
        fn new(family: u8, group: u16) -> Msg {
            let mut b = Vec::new();
            b.extend_from_slice(&0u32.to_ne_bytes());
            b.extend_from_slice(&MSG_PACKET.to_ne_bytes());
            b.extend_from_slice(&0u16.to_ne_bytes());
            b.extend_from_slice(&0u32.to_ne_bytes());
            b.extend_from_slice(&0u32.to_ne_bytes());
            b.push(family);
            b.push(NFNETLINK_V0);
            b.extend_from_slice(&group.to_be_bytes());
            Msg(b)
        }
        fn attr(mut self, kind: u16, value: &[u8]) -> Msg {
            put_attr(&mut self.0, kind, value);
            self
        }
        fn bytes(mut self) -> Vec<u8> {
            let len = self.0.len() as u32;
            self.0[..4].copy_from_slice(&len.to_ne_bytes());
            self.0
        }
    }

    fn ipv4_tcp(sport: u16, dport: u16) -> Vec<u8> {
        let mut p = vec![
            0x45, 0, 0, 60, 0x12, 0x34, 0x40, 0, 64, 6, 0, 0, 198, 51, 100, 2, 203, 0, 113, 9,
        ];
        p.extend_from_slice(&sport.to_be_bytes());
        p.extend_from_slice(&dport.to_be_bytes());
        p.extend_from_slice(&[0; 16]);
        p
    }

    fn ipv6(next: u8, rest: &[u8]) -> Vec<u8> {
        let mut p = vec![0x60, 0, 0, 0];
        p.extend_from_slice(&(rest.len() as u16).to_be_bytes());
        p.extend_from_slice(&[next, 64]);
        p.extend_from_slice(&"2001:db8::2".parse::<Ipv6Addr>().unwrap().octets());
        p.extend_from_slice(&"2001:db8::9".parse::<Ipv6Addr>().unwrap().octets());
        p.extend_from_slice(rest);
        p
    }

    fn udp(sport: u16, dport: u16) -> Vec<u8> {
        let mut u = sport.to_be_bytes().to_vec();
        u.extend_from_slice(&dport.to_be_bytes());
        u.extend_from_slice(&[0, 8, 0, 0]);
        u
    }

    const PREFIX: &[u8] = b"EGRESS-DROP: \0";
    const NOW: Duration = Duration::from_millis(1_764_432_062_123);

    fn decode(msg: &[u8]) -> Result<DropEvent, WatchError> {
        decode_packet(msg, UNIX_EPOCH + NOW)
    }

    #[test]
    fn ipv4_tcp_with_uid() {
        let msg = Msg::new(NFPROTO_IPV4, 100)
            .attr(NFULA_PACKET_HDR, &[0x08, 0x00, 3, 0])
            .attr(NFULA_PREFIX, PREFIX)
            .attr(NFULA_UID, &1000u32.to_be_bytes())
            .attr(NFULA_GID, &1001u32.to_be_bytes())
            .attr(NFULA_PAYLOAD, &ipv4_tcp(40001, 443))
            .bytes();
        let e = decode(&msg).unwrap();
        assert_eq!(
            e,
            DropEvent {
                time: "2025-11-29T16:01:02.123Z".into(),
                prefix: "EGRESS-DROP: ".into(),
                family: "ipv4",
                protocol: "tcp".into(),
                src: "198.51.100.2".parse().unwrap(),
                dst: "203.0.113.9".parse().unwrap(),
                sport: Some(40001),
                dport: Some(443),
                uid: Some(1000),
                gid: Some(1001),
                verdict: "refused",
                note: None,
            }
        );
        assert_eq!(
            e.to_string(),
            "2025-11-29T16:01:02.123Z REFUSED tcp 198.51.100.2:40001 -> 203.0.113.9:443 \
             uid=1000 gid=1001 EGRESS-DROP:"
        );
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["dst"], "203.0.113.9");
        assert_eq!(json["dport"], 443);
        assert_eq!(json["prefix"], "EGRESS-DROP: ");
        assert_eq!(json["verdict"], "refused");
    }

    #[test]
    fn ipv6_udp_without_uid_and_with_kernel_timestamp() {
        let mut ts = 1_700_000_000u64.to_be_bytes().to_vec();
        ts.extend_from_slice(&456_789u64.to_be_bytes());
        let msg = Msg::new(NFPROTO_IPV6, 100)
            .attr(NFULA_TIMESTAMP, &ts)
            .attr(NFULA_PAYLOAD, &ipv6(17, &udp(5353, 53)))
            .bytes();
        let e = decode(&msg).unwrap();
        assert_eq!(e.time, "2023-11-14T22:13:20.456Z");
        assert_eq!(e.family, "ipv6");
        assert_eq!(e.protocol, "udp");
        assert_eq!(e.src, "2001:db8::2".parse::<IpAddr>().unwrap());
        assert_eq!((e.sport, e.dport), (Some(5353), Some(53)));
        assert_eq!((e.uid, e.gid), (None, None));
        assert_eq!(e.prefix, "");
        assert_eq!(
            e.to_string(),
            "2023-11-14T22:13:20.456Z REFUSED udp [2001:db8::2]:5353 -> [2001:db8::9]:53"
        );
        let json = serde_json::to_value(&e).unwrap();
        assert!(json["uid"].is_null());
        assert_eq!(json["src"], "2001:db8::2");
    }

    #[test]
    fn ipv6_extension_headers_are_skipped() {
        // hop-by-hop (8 bytes) then a first fragment (offset 0) then TCP
        let mut rest = vec![44, 0, 0, 0, 0, 0, 0, 0];
        rest.extend_from_slice(&[6, 0, 0, 1, 0, 0, 0, 1]);
        rest.extend_from_slice(&udp(40000, 443));
        let msg = Msg::new(NFPROTO_IPV6, 1)
            .attr(NFULA_PAYLOAD, &ipv6(0, &rest))
            .bytes();
        let e = decode(&msg).unwrap();
        assert_eq!(e.protocol, "tcp");
        assert_eq!(e.dport, Some(443));

        // a later fragment carries no ports
        let mut rest = vec![6, 0, 0x05, 0x00, 0, 0, 0, 1];
        rest.extend_from_slice(&[0; 8]);
        let msg = Msg::new(NFPROTO_IPV6, 1)
            .attr(NFULA_PAYLOAD, &ipv6(44, &rest))
            .bytes();
        let e = decode(&msg).unwrap();
        assert_eq!((e.protocol.as_str(), e.dport), ("tcp", None));

        // a chain that leaves the copied bytes reports where it stopped
        let msg = Msg::new(NFPROTO_IPV6, 1)
            .attr(NFULA_PAYLOAD, &ipv6(60, &[6, 4]))
            .bytes();
        let e = decode(&msg).unwrap();
        assert_eq!((e.protocol.as_str(), e.dport), ("60", None));
    }

    #[test]
    fn icmp_and_unknown_protocols_have_no_ports() {
        let mut p = ipv4_tcp(0, 0);
        p[9] = 1;
        let e = decode(&Msg::new(NFPROTO_IPV4, 1).attr(NFULA_PAYLOAD, &p).bytes()).unwrap();
        assert_eq!(
            (e.protocol.as_str(), e.sport, e.dport),
            ("icmp", None, None)
        );
        assert_eq!(
            e.to_string(),
            "2025-11-29T16:01:02.123Z REFUSED icmp 198.51.100.2 -> 203.0.113.9"
        );
        p[9] = 47;
        let e = decode(&Msg::new(NFPROTO_IPV4, 1).attr(NFULA_PAYLOAD, &p).bytes()).unwrap();
        assert_eq!(e.protocol, "47");
        let e = decode(
            &Msg::new(NFPROTO_IPV6, 1)
                .attr(NFULA_PAYLOAD, &ipv6(58, &[128, 0, 0, 0]))
                .bytes(),
        )
        .unwrap();
        assert_eq!((e.protocol.as_str(), e.dport), ("icmpv6", None));
    }

    #[test]
    fn family_from_hardware_protocol_or_version() {
        // a bridge-family table (NFPROTO_BRIDGE = 7) logging an IPv4 packet
        let msg = Msg::new(7, 1)
            .attr(NFULA_PACKET_HDR, &[0x08, 0x00, 0, 0])
            .attr(NFULA_PAYLOAD, &ipv4_tcp(1, 2))
            .bytes();
        assert_eq!(decode(&msg).unwrap().family, "ipv4");
        let msg = Msg::new(5, 1)
            .attr(NFULA_PAYLOAD, &ipv6(17, &udp(1, 2)))
            .bytes();
        assert_eq!(decode(&msg).unwrap().family, "ipv6");
        // ARP through a netdev table is not an IP packet
        let msg = Msg::new(5, 1)
            .attr(NFULA_PACKET_HDR, &[0x08, 0x06, 0, 0])
            .attr(NFULA_PAYLOAD, &[0, 1, 8, 0, 6, 4, 0, 1])
            .bytes();
        assert!(matches!(decode(&msg), Err(WatchError::Malformed(_))));
    }

    #[test]
    fn truncated_payloads() {
        // transport header cut: the event stands, without ports
        let mut p = ipv4_tcp(40001, 443);
        p.truncate(22);
        let e = decode(&Msg::new(NFPROTO_IPV4, 1).attr(NFULA_PAYLOAD, &p).bytes()).unwrap();
        assert_eq!((e.protocol.as_str(), e.sport, e.dport), ("tcp", None, None));
        // IP header cut: an error
        for cut in [0, 1, 19] {
            let mut p = ipv4_tcp(40001, 443);
            p.truncate(cut);
            let msg = Msg::new(NFPROTO_IPV4, 1).attr(NFULA_PAYLOAD, &p).bytes();
            assert!(
                matches!(decode(&msg), Err(WatchError::Malformed(_))),
                "{cut}"
            );
        }
        let mut p = ipv6(17, &udp(1, 2));
        p.truncate(39);
        let msg = Msg::new(NFPROTO_IPV6, 1).attr(NFULA_PAYLOAD, &p).bytes();
        assert!(matches!(decode(&msg), Err(WatchError::Malformed(_))));
        // IPv4 options announced but not copied
        let mut p = ipv4_tcp(1, 2);
        p[0] = 0x4f;
        p.truncate(40);
        let msg = Msg::new(NFPROTO_IPV4, 1).attr(NFULA_PAYLOAD, &p).bytes();
        assert!(matches!(decode(&msg), Err(WatchError::Malformed(_))));
    }

    #[test]
    fn missing_payload_and_short_attributes_are_errors() {
        let msg = Msg::new(NFPROTO_IPV4, 1).attr(NFULA_PREFIX, PREFIX).bytes();
        let err = decode(&msg).unwrap_err();
        assert!(err.to_string().contains("without payload"), "{err}");
        assert!(err.is_transient());
        let msg = Msg::new(NFPROTO_IPV4, 1)
            .attr(NFULA_UID, &[0, 0])
            .attr(NFULA_PAYLOAD, &ipv4_tcp(1, 2))
            .bytes();
        assert!(matches!(decode(&msg), Err(WatchError::Malformed(_))));
        let msg = Msg::new(NFPROTO_IPV4, 1)
            .attr(NFULA_TIMESTAMP, &[0; 8])
            .attr(NFULA_PAYLOAD, &ipv4_tcp(1, 2))
            .bytes();
        assert!(matches!(decode(&msg), Err(WatchError::Malformed(_))));
    }

    #[test]
    fn attribute_type_flag_bits_are_ignored() {
        // NLA_F_NET_BYTEORDER (0x4000) set on the payload attribute
        let msg = Msg::new(NFPROTO_IPV4, 1)
            .attr(NFULA_PAYLOAD | 0x4000, &ipv4_tcp(1, 2))
            .bytes();
        assert_eq!(decode(&msg).unwrap().dport, Some(2));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let good = Msg::new(NFPROTO_IPV4, 100)
            .attr(NFULA_PREFIX, PREFIX)
            .attr(NFULA_UID, &0u32.to_be_bytes())
            .attr(
                NFULA_PAYLOAD,
                &ipv6(0, &[6, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]),
            )
            .bytes();
        // every truncation and every single-byte corruption of a valid message, through the
        // datagram splitter as the kernel's bytes would go
        for cut in 0..good.len() {
            let _ = split_datagram(&good[..cut], UNIX_EPOCH);
            let mut m = good.clone();
            m.truncate(cut);
            let _ = decode(&m);
        }
        for at in 0..good.len() {
            for value in [0u8, 1, 3, 4, 0x7f, 0x80, 0xff] {
                let mut m = good.clone();
                m[at] = value;
                let _ = split_datagram(&m, UNIX_EPOCH);
                let _ = decode(&m);
            }
        }
        // a deterministic pseudo-random soup
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            let len = (x % 300) as usize;
            let soup: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = split_datagram(&soup, UNIX_EPOCH);
            let _ = decode(&soup);
        }
        let (events, acks) = split_datagram(&[1, 2, 3], UNIX_EPOCH);
        assert!(matches!(events.as_slice(), [Err(WatchError::Malformed(_))]));
        assert!(acks.is_empty());
    }

    #[test]
    fn datagrams_with_several_messages_acks_and_done() {
        let packet = Msg::new(NFPROTO_IPV4, 1)
            .attr(NFULA_PAYLOAD, &ipv4_tcp(1, 2))
            .bytes();
        let mut ack = Vec::new();
        ack.extend_from_slice(&36u32.to_ne_bytes());
        ack.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        ack.extend_from_slice(&0u16.to_ne_bytes());
        ack.extend_from_slice(&7u32.to_ne_bytes());
        ack.extend_from_slice(&0u32.to_ne_bytes());
        ack.extend_from_slice(&(-libc::EPERM).to_ne_bytes());
        ack.extend_from_slice(&[0; 16]); // the request's header, echoed
        let mut done = Vec::new();
        done.extend_from_slice(&20u32.to_ne_bytes());
        done.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
        done.extend_from_slice(&[0; 14]);

        let mut datagram = packet.clone();
        datagram.extend_from_slice(&ack);
        datagram.extend_from_slice(&packet);
        datagram.extend_from_slice(&done);
        let (events, acks) = split_datagram(&datagram, UNIX_EPOCH);
        assert_eq!(events.len(), 2);
        assert!(events.iter().all(|e| e.is_ok()));
        assert_eq!(acks, vec![(7, Some(Errno::EPERM))]);
    }

    #[test]
    fn the_bind_request_bytes() {
        let r = bind_request(100, 1);
        assert_eq!(r.len() % 4, 0);
        assert_eq!(ne32(&r, 0), Some(r.len() as u32));
        assert_eq!(ne16(&r, 4), Some(0x0401));
        assert_eq!(ne16(&r, 6), Some(NLM_F_REQUEST | NLM_F_ACK));
        assert_eq!(&r[16..20], &[0, 0, 0, 100]);
        // cmd (8) + mode (12) + timeout (8) + qthresh (8) + flags (8)
        assert_eq!(r.len(), 20 + 8 + 12 + 8 + 8 + 8);
        assert_eq!(&r[20..25], &[5, 0, 1, 0, NFULNL_CFG_CMD_BIND]);
        assert_eq!(
            &r[28..38],
            &[10, 0, 2, 0, 0, 0, 0, 128, NFULNL_COPY_PACKET, 0]
        );
        assert_eq!(&r[r.len() - 8..r.len() - 2], &[6, 0, 6, 0, 0, 0x08]);
    }

    #[test]
    fn rfc3339() {
        assert_eq!(rfc3339_millis(0, 0).unwrap(), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339_millis(951_782_400, 7).unwrap(),
            "2000-02-29T00:00:00.007Z"
        );
        assert_eq!(
            rfc3339_millis(253_402_300_799, 999).unwrap(),
            "9999-12-31T23:59:59.999Z"
        );
        assert_eq!(rfc3339_millis(253_402_300_800, 0), None);
        assert_eq!(rfc3339_millis(i64::MAX, 0), None);
        assert_eq!(rfc3339_millis(-1, 0).unwrap(), "1969-12-31T23:59:59.000Z");
        // absurd kernel timestamps fall back to "now"
        let mut ts = u64::MAX.to_be_bytes().to_vec();
        ts.extend_from_slice(&0u64.to_be_bytes());
        let msg = Msg::new(NFPROTO_IPV4, 1)
            .attr(NFULA_TIMESTAMP, &ts)
            .attr(NFULA_PAYLOAD, &ipv4_tcp(1, 2))
            .bytes();
        assert_eq!(decode(&msg).unwrap().time, "2025-11-29T16:01:02.123Z");
    }

    #[test]
    fn refusals_are_explained() {
        assert!(matches!(
            refusal(5, Errno::EBUSY),
            WatchError::GroupBusy { group: 5 }
        ));
        let msg = refusal(5, Errno::EINVAL).to_string();
        assert!(msg.contains("nfnetlink_log"), "{msg}");
        let msg = WatchError::Permission { group: 5 }.to_string();
        assert!(msg.contains("CAP_NET_ADMIN"), "{msg}");
    }
}
