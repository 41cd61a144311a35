//! Making the attempts: TCP connections, UDP datagrams and DNS queries (the other transports
//! are in [`super::other_protocols`]), a few threads at a
//! time, and what each one saw ([`Seen`]) in words that say what happened on the wire.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use hickory_proto::op::Query;
use hickory_proto::rr::{Name, RecordType};

use crate::core::policy::L4Proto;
use crate::core::ruleset::ICMP_ANSWER_PRIORITY;
use crate::dns::exchange;
use crate::dns::message;

use nix::sys::socket::{setsockopt, sockopt};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::judge::judge;
use super::origin;
use super::plan::{Attempt, DNS_TEST_NAME, Kind, random_u64};
use super::report::{Check, Outcome, ProbeError};

/// The longest a UDP attempt waits for a reply. UDP gives no confirmation, so silence is a
/// normal outcome; this only bounds how long the probe spends learning that.
pub const MAX_UDP_WAIT: Duration = Duration::from_secs(1);

/// How long a UDP attempt refused with EPERM waits for `reject`'s ICMP error, which only
/// makes the reason more precise (it arrives within microseconds when it comes at all).
const ICMP_WAIT: Duration = Duration::from_millis(100);

/// At most this many attempts run at once.
pub(super) const MAX_WORKERS: usize = 64;

pub(super) const QTYPE_A: RecordType = RecordType::A;
pub(super) const QTYPE_AAAA: RecordType = RecordType::AAAA;

/// The payload of a UDP attempt, so a listener's owner can tell what it saw.
const UDP_PAYLOAD: &[u8] = b"egress-fence probe\n";

pub(super) struct Ctx {
    pub(super) timeout: Duration,
    pub(super) udp_wait: Duration,
    /// See [`ProbeOptions::fence_router`](super::ProbeOptions::fence_router).
    pub(super) fence_router: Vec<IpAddr>,
}

impl Ctx {
    /// Whether an ICMP error from `sender` is the fence's refusal: sent by this host's own
    /// stack, or by the router whose fence the attempts cross (`probe --from`).
    pub(super) fn is_fence(&self, sender: IpAddr) -> bool {
        self.fence_router.contains(&sender) || origin::is_this_host(sender)
    }
}

/// Runs the attempts on a few threads (they inherit the caller's network namespace) and
/// returns their checks in order.
pub(super) fn run_concurrently(attempts: &[&Attempt], ctx: &Ctx) -> Result<Vec<Check>, ProbeError> {
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
pub(super) enum Seen {
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
    /// It was sent and nothing came back, on a socket that is not told when this host
    /// drops what it sends (an ICMPv6 ping socket): why it cannot be judged.
    Unconfirmed(String),
    /// This process cannot send it at all: the kernel lacks the protocol, or refuses this
    /// process a ping socket.
    Unavailable(String),
}

impl Attempt {
    fn run(&self, ctx: &Ctx) -> Check {
        let seen = match self.kind {
            Kind::Tcp => tcp_attempt(self.target, ctx),
            Kind::Udp => udp_attempt(self.target, UDP_PAYLOAD, ctx, |_| Some("answered".into())),
            Kind::Other(proto) => proto.attempt(self.target, ctx),
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

pub(super) fn fmt_duration(d: Duration) -> String {
    format!("{d:?}")
}

/// A TCP connection to `target`. An ICMP error that fails it counts as this host's refusal
/// only when this host sent it (the fence's `reject`): the socket's error queue
/// (IP_RECVERR) names the sender, and a far host's or a router's error is a refusal beyond
/// this host, which says nothing about the boundary.
///
/// The socket asks the fence for that ICMP error ([`ICMP_ANSWER_PRIORITY`]): under `action:
/// reject` the fence answers other TCP connections of this host with a reset, which names no
/// sender and looks the same as a closed port's beyond the boundary. So a reset here is
/// always from beyond it.
pub(super) fn tcp_connect(target: SocketAddr, ctx: &Ctx) -> Result<TcpStream, Seen> {
    let socket = Socket::new(
        Domain::for_address(target),
        Type::STREAM,
        Some(Protocol::TCP),
    )
    .map_err(|e| Seen::NotSent(describe(&e)))?;
    let recverr = match target {
        SocketAddr::V4(_) => setsockopt(&socket, sockopt::Ipv4RecvErr, &true),
        SocketAddr::V6(_) => setsockopt(&socket, sockopt::Ipv6RecvErr, &true),
    };
    recverr.map_err(|e| Seen::NotSent(describe(&io::Error::from(e))))?;
    // Any process may set a priority up to 6 (`ICMP_ANSWER_PRIORITY` is 5).
    setsockopt(
        &socket,
        sockopt::Priority,
        &(ICMP_ANSWER_PRIORITY as libc::c_int),
    )
    .map_err(|e| Seen::NotSent(describe(&io::Error::from(e))))?;
    let connected = socket.connect_timeout(&SockAddr::from(target), ctx.timeout);
    let error = match connected {
        Ok(()) => {
            return socket
                .set_nonblocking(false)
                .map(|()| TcpStream::from(socket))
                .map_err(|e| Seen::NotSent(describe(&e)));
        }
        Err(e) => e,
    };
    Err(match error.raw_os_error() {
        Some(libc::ECONNREFUSED) => Seen::RefusedRemotely("connection refused (TCP reset)".into()),
        // Never a far host's: only this host's own rules fail a connect with EPERM.
        Some(libc::EPERM) => Seen::RefusedHere(describe(&error)),
        Some(libc::EHOSTUNREACH | libc::EACCES) => match origin::icmp_sender(&socket, target) {
            Some(sender) if ctx.is_fence(sender) => Seen::RefusedHere(describe(&error)),
            Some(sender) => Seen::RefusedRemotely(format!(
                "{}, sent by {sender} beyond this host, not by the boundary",
                describe(&error)
            )),
            None => Seen::RefusedRemotely(format!(
                "{}, from no ICMP error the probe can trace to this host",
                describe(&error)
            )),
        },
        _ if matches!(
            error.kind(),
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
        ) =>
        {
            Seen::TimedOut
        }
        _ => Seen::NotSent(describe(&error)),
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
    datagram_exchange(socket, target, payload, ctx, accept)
}

/// Sends `payload` on `socket`, connected, of any datagram transport (UDP, UDP-Lite, a
/// ping socket) and waits as [`udp_attempt`] does.
pub(super) fn datagram_exchange(
    socket: UdpSocket,
    target: SocketAddr,
    payload: &[u8],
    ctx: &Ctx,
    accept: impl Fn(&[u8]) -> Option<String>,
) -> Seen {
    // The ICMP errors that come back name their sender (see `after_send_error`); without
    // the option none is traced to this host, which fails closed.
    let _ = match target {
        SocketAddr::V4(_) => setsockopt(&socket, sockopt::Ipv4RecvErr, &true),
        SocketAddr::V6(_) => setsockopt(&socket, sockopt::Ipv6RecvErr, &true),
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
            Err(e) => return after_send_error(&socket, target, &e, ctx),
        }
    }
}

/// An error reported to a datagram socket whose send succeeded. Some transports do not
/// fail the send when the output hook refuses it (an ICMPv6 ping socket reports only the
/// ICMP error of `reject`): an error this host sent is the boundary's refusal, any other
/// was sent beyond this host.
fn after_send_error(socket: &UdpSocket, target: SocketAddr, e: &io::Error, ctx: &Ctx) -> Seen {
    match origin::icmp_sender(socket, target) {
        Some(sender) if ctx.is_fence(sender) => Seen::RefusedHere(describe(e)),
        _ if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
            Seen::RefusedRemotely("port unreachable (ICMP from the host)".into())
        }
        Some(sender) => Seen::RefusedRemotely(format!(
            "refused beyond this host, by {sender}: {}",
            describe(e)
        )),
        None => Seen::RefusedRemotely(format!("refused beyond this host: {}", describe(e))),
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
pub(super) fn dns_query(id: u16, name: &str, qtype: RecordType) -> Vec<u8> {
    let question = Name::from_ascii(name).ok().map(|n| Query::query(n, qtype));
    message::query(id, question, true, None)
        .to_vec()
        .unwrap_or_default()
}

/// The response code of `reply` if it is a DNS response to query `id`.
pub(super) fn dns_rcode(id: u16, reply: &[u8]) -> Option<&'static str> {
    message::response_code(reply, id).map(message::rcode_name)
}

/// The errors a probe meets, in words that say what happened on the wire.
pub(super) fn describe(e: &io::Error) -> String {
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
}
