//! The NFLOG listener: a netlink socket bound to one group, and the messages the kernel sends
//! on it, read with the crate's netlink codec ([`crate::netlink`]; no libnetfilter_log, no
//! `unsafe`):
//!
//! * one NFULNL_MSG_CONFIG request with NLM_F_ACK carries the bind command, the copy mode
//!   (packet, [`COPY_RANGE`] bytes), NFULNL_CFG_F_UID, a queue threshold of 1 and a short flush
//!   timeout; the kernel applies them in that order and acknowledges once, so a refused bind is
//!   an error of [`Watcher::subscribe`], not a silent listener that never hears anything;
//! * the kernel then sends NFULNL_MSG_PACKET messages (several per datagram when it batches),
//!   whose attributes are read bounds-checked, and the copied bytes are decoded
//!   ([`super::packet`]) as an IPv4/IPv6 header plus the transport ports.
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
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use nix::errno::Errno;
use nix::sys::socket::{MsgFlags, SockProtocol};

use super::packet::{decode_ip, protocol_name};
use super::{AUDITED, DropEvent, WatchError, malformed};
use crate::core::time::{rfc3339_millis, rfc3339_millis_at};
use crate::netlink::bytes::{be16, be32, be64};
use crate::netlink::message::{NFNL_SUBSYS_ULOG, NLM_F_ACK, NLM_F_REQUEST, Oversize, nfnl_type};
use crate::netlink::{Message, Request, Socket, messages};

/// Bytes of each packet the kernel copies to us: an IPv4 header with options (60) or an IPv6
/// header (40) with a few extension headers, plus the 4 bytes of ports. Copying no more keeps
/// the payload (possibly the very secret being exfiltrated) out of our buffers and logs.
pub const COPY_RANGE: u32 = 128;

/// How long [`Watcher::subscribe`] waits for the kernel's acknowledgement of the bind.
pub(super) const ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// Flush timeout of the kernel's per-group queue, in hundredths of a second. With a queue
/// threshold of 1 every packet is sent at once anyway; this bounds the delay when a rule sets
/// its own `queue-threshold`.
const FLUSH_TIMEOUT_CS: u32 = 1;

/// Room for the largest datagram nfnetlink_log sends (its buffer is at most 128 KiB, far less
/// by default); a larger one is reported as malformed rather than silently cut.
const RECV_BUF: usize = 128 * 1024 + 4096;

const MSG_PACKET: u16 = nfnl_type(NFNL_SUBSYS_ULOG, libc::NFULNL_MSG_PACKET as u8);
const MSG_CONFIG: u16 = nfnl_type(NFNL_SUBSYS_ULOG, libc::NFULNL_MSG_CONFIG as u8);

const NFULA_PACKET_HDR: u16 = libc::NFULA_PACKET_HDR as u16;
const NFULA_TIMESTAMP: u16 = libc::NFULA_TIMESTAMP as u16;
const NFULA_PAYLOAD: u16 = libc::NFULA_PAYLOAD as u16;
const NFULA_PREFIX: u16 = libc::NFULA_PREFIX as u16;
const NFULA_UID: u16 = libc::NFULA_UID as u16;
const NFULA_GID: u16 = libc::NFULA_GID as u16;
const NFULA_IFINDEX_INDEV: u16 = libc::NFULA_IFINDEX_INDEV as u16;

const NFULA_CFG_CMD: u16 = libc::NFULA_CFG_CMD as u16;
const NFULA_CFG_MODE: u16 = libc::NFULA_CFG_MODE as u16;
const NFULA_CFG_TIMEOUT: u16 = libc::NFULA_CFG_TIMEOUT as u16;
const NFULA_CFG_QTHRESH: u16 = libc::NFULA_CFG_QTHRESH as u16;
const NFULA_CFG_FLAGS: u16 = libc::NFULA_CFG_FLAGS as u16;
const NFULNL_CFG_CMD_BIND: u8 = libc::NFULNL_CFG_CMD_BIND as u8;
const NFULNL_COPY_PACKET: u8 = libc::NFULNL_COPY_PACKET as u8;
const NFULNL_CFG_F_UID: u16 = 0x0008;

/// Linux capability number of CAP_NET_ADMIN (bit in /proc/self/status CapEff).
const CAP_NET_ADMIN: u32 = 12;

/// A netlink socket bound to one NFLOG group in one network namespace. Dropping it closes the
/// socket, which releases the group.
pub struct Watcher {
    socket: Socket,
    group: u16,
    buf: Vec<u8>,
    /// Messages already received but not yet handed out (the kernel may batch several packets
    /// in one datagram, and packets may arrive before the bind's acknowledgement).
    pending: VecDeque<Result<DropEvent, WatchError>>,
    /// The receive timeout currently set on the socket, to avoid a syscall per call.
    rcv_timeout: Option<Duration>,
    /// Refused packets handed out so far (not audited ones), as they are read: what a reader
    /// on another thread compares with the table's counters ([`super::Unlogged`]).
    refused_read: Arc<AtomicU64>,
    /// How many times a wait found the socket empty with nothing queued (a timeout): once it
    /// has moved past a moment, every message the kernel sent before it has been handed out.
    drains: Arc<AtomicU64>,
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
        let socket = Socket::open(SockProtocol::NetlinkNetFilter).map_err(WatchError::Socket)?;
        socket.bind(0).map_err(WatchError::Socket)?;
        let mut watcher = Watcher {
            socket,
            group,
            buf: vec![0; RECV_BUF],
            pending: VecDeque::new(),
            rcv_timeout: None,
            refused_read: Arc::new(AtomicU64::new(0)),
            drains: Arc::new(AtomicU64::new(0)),
        };
        const SEQ: u32 = 1;
        let request = bind_request(group, SEQ).map_err(|_| WatchError::Io {
            doing: "bind request",
            source: Errno::EMSGSIZE,
        })?;
        watcher
            .socket
            .send(&request)
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
            match watcher.receive(Receive::Within(Some(left))) {
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

    /// How many refused packets this watcher has handed out, counted as they are read (also
    /// once the watcher has moved to a thread of its own).
    pub fn refused_read(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.refused_read)
    }

    /// How many times a wait found nothing to hand out, nothing queued and the socket empty
    /// (looked at without waiting before every wait, and when a wait times out): read after a
    /// moment, a larger value says everything the kernel sent before that moment has been
    /// handed out (and counted in [`Watcher::refused_read`]).
    pub fn drains(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.drains)
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
                if next.as_ref().is_ok_and(|e| e.verdict != AUDITED) {
                    self.refused_read.fetch_add(1, Ordering::Relaxed);
                }
                return next.map(Some);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Ok(None);
            }
            // First without waiting: the socket found empty now is a drain, also when the next
            // message comes before the wait below would time out (a sandbox that keeps one
            // logged refusal within every wait would otherwise never let a drain be seen, and
            // the table's counters would never be read again).
            // Acknowledgements are not expected after the bind; they are ignored.
            if self.receive(Receive::Now)?.is_some() {
                continue;
            }
            if self.receive(Receive::Within(left))?.is_none() {
                return Ok(None);
            }
        }
    }

    /// Reads one datagram, queues its packets (decoded) and returns its acknowledgements as
    /// (sequence, errno). `None` on timeout (at once for [`Receive::Now`] when
    /// nothing is there) or interruption.
    fn receive(&mut self, how: Receive) -> Result<Option<Vec<Ack>>, WatchError> {
        // MSG_TRUNC makes recv return the datagram's real length, so a cut one is detected.
        let flags = match how {
            Receive::Now => MsgFlags::MSG_TRUNC | MsgFlags::MSG_DONTWAIT,
            Receive::Within(timeout) => {
                self.set_timeout(timeout)?;
                MsgFlags::MSG_TRUNC
            }
        };
        let n = match self.socket.recv(&mut self.buf, flags) {
            Ok(n) => n,
            Err(Errno::EAGAIN) => {
                // Nothing on the socket, nothing queued: every message sent before now has
                // been handed out (and counted).
                if self.pending.is_empty() {
                    self.drains.fetch_add(1, Ordering::Relaxed);
                }
                return Ok(None);
            }
            Err(Errno::EINTR) => return Ok(None),
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
        self.socket
            .set_recv_timeout(timeout)
            .map_err(|source| WatchError::Io {
                doing: "receive timeout setup",
                source,
            })?;
        self.rcv_timeout = timeout;
        Ok(())
    }
}

/// How [`Watcher::receive`] waits for a datagram.
#[derive(Debug, Clone, Copy)]
enum Receive {
    /// Not at all: only what is on the socket now.
    Now,
    /// At most this long (`None`: until one comes or a signal).
    Within(Option<Duration>),
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

/// The NFULNL_MSG_CONFIG request that binds `group` and configures it, with NLM_F_ACK.
/// NFULA values are big-endian; the netlink headers are in host order.
fn bind_request(group: u16, seq: u32) -> Result<Vec<u8>, Oversize> {
    // struct nfulnl_msg_config_mode { be32 copy_range; u8 copy_mode; u8 _pad; } (packed, 6)
    let mut mode = [0u8; 6];
    mode[..4].copy_from_slice(&COPY_RANGE.to_be_bytes());
    mode[4] = NFULNL_COPY_PACKET;
    Request::new(MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, seq)
        // nfgenmsg: the family is irrelevant to a group bind (AF_UNSPEC), res_id is the group.
        .nfgenmsg(libc::AF_UNSPEC as u8, group)
        // struct nfulnl_msg_config_cmd { u8 command; }
        .attr(NFULA_CFG_CMD, &[NFULNL_CFG_CMD_BIND])
        .attr(NFULA_CFG_MODE, &mode)
        .attr(NFULA_CFG_TIMEOUT, &FLUSH_TIMEOUT_CS.to_be_bytes())
        .attr(NFULA_CFG_QTHRESH, &1u32.to_be_bytes())
        .attr(NFULA_CFG_FLAGS, &NFULNL_CFG_F_UID.to_be_bytes())
        .finish()
}

/// A netlink acknowledgement: the request's sequence number and the errno, if it failed.
type Ack = (u32, Option<Errno>);

/// Splits one datagram into netlink messages: NFLOG packets become events (or per-message
/// errors), NLMSG_ERROR becomes an acknowledgement (sequence, errno if any); the rest
/// (NLMSG_DONE closing a batch, NOOP, other types) is skipped. A header that does not fit stops
/// the walk with one error, since nothing after it can be located.
#[allow(clippy::type_complexity)]
fn split_datagram(data: &[u8], now: SystemTime) -> (Vec<Result<DropEvent, WatchError>>, Vec<Ack>) {
    let mut events = Vec::new();
    let mut acks = Vec::new();
    for msg in messages(data) {
        let msg = match msg {
            Ok(msg) => msg,
            Err(e) => {
                events.push(Err(malformed(e.to_string())));
                break;
            }
        };
        if msg.kind == MSG_PACKET {
            events.push(decode_packet(&msg, now));
            continue;
        }
        match msg.error() {
            Some(Ok(errno)) => acks.push((msg.seq, errno)),
            Some(Err(e)) => events.push(Err(malformed(e.to_string()))),
            // NLMSG_DONE (closing a batch), NLMSG_NOOP and anything newer are not for us.
            None => {}
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
    indev: Option<u32>,
}

/// Decodes one NFULNL_MSG_PACKET message.
fn decode_packet(msg: &Message<'_>, now: SystemTime) -> Result<DropEvent, WatchError> {
    let (nfgen, all) = msg
        .nfgenmsg()
        .map_err(|_| malformed("packet message without nfgenmsg"))?;
    let family = nfgen.family;
    let mut attrs = PacketAttrs::default();
    for attr in all {
        let attr = attr.map_err(|e| malformed(e.to_string()))?;
        let (kind, value) = (attr.kind, attr.value);
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
            NFULA_IFINDEX_INDEV => attrs.indev = Some(be32(value, 0).ok_or_else(short)?),
            _ => {}
        }
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
    .unwrap_or_else(|| rfc3339_millis_at(now));
    let prefix = prefix.unwrap_or_default();
    // What learn's audit window let through is logged to the same group as refusals.
    let verdict = match prefix.as_str() {
        crate::core::ruleset::AUDIT_PREFIX => AUDITED,
        _ => "refused",
    };
    Ok(DropEvent {
        time,
        prefix,
        family: ip.family,
        protocol: protocol_name(ip.protocol),
        src: ip.src,
        dst: ip.dst,
        sport: ip.ports.map(|p| p.0),
        dport: ip.ports.map(|p| p.1),
        uid: attrs.uid,
        gid: attrs.gid,
        verdict,
        note: None,
        in_ifindex: attrs.indev,
        scope: None,
    })
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv6Addr};
    use std::time::UNIX_EPOCH;

    use super::*;
    use crate::netlink::bytes::{ne16, ne32};
    use crate::netlink::message::{NLMSG_DONE, NLMSG_ERROR};
    use crate::watch::packet::{NFPROTO_IPV4, NFPROTO_IPV6};

    /// Builds an NFULNL_MSG_PACKET message as the kernel does.
    struct Msg(Request);

    impl Msg {
        fn new(family: u8, group: u16) -> Msg {
            Msg(Request::new(MSG_PACKET, 0, 0).nfgenmsg(family, group))
        }
        fn attr(self, kind: u16, value: &[u8]) -> Msg {
            Msg(self.0.attr(kind, value))
        }
        fn bytes(self) -> Vec<u8> {
            self.0.finish().unwrap()
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
        let msg = Message::parse(msg).map_err(|e| malformed(e.to_string()))?;
        decode_packet(&msg, UNIX_EPOCH + NOW)
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
                in_ifindex: None,
                scope: None,
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

    /// A forwarded packet: no socket, so no uid, but the interface it came in on.
    #[test]
    fn a_forwarded_packet_carries_its_input_interface() {
        let msg = Msg::new(NFPROTO_IPV4, 100)
            .attr(NFULA_IFINDEX_INDEV, &7u32.to_be_bytes())
            .attr(NFULA_PAYLOAD, &ipv4_tcp(40001, 443))
            .bytes();
        let e = decode(&msg).unwrap();
        assert_eq!((e.in_ifindex, e.uid), (Some(7), None));
        let json = serde_json::to_value(&e).unwrap();
        assert!(json.get("in_ifindex").is_none(), "{json}");
        assert!(json.get("scope").is_none(), "{json}");
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
        let r = bind_request(100, 1).unwrap();
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
    fn absurd_kernel_timestamps_fall_back_to_now() {
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
