//! The transports besides TCP and UDP that a process without privileges can send over:
//! UDP-Lite, ICMP and ICMPv6 echo through ping sockets, SCTP and DCCP. Each one to a
//! destination the policy refuses must be refused by this host; a kernel without the
//! protocol, or a ping socket this group may not open, is said as such ([`Seen::Unavailable`]).

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::time::Instant;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use nix::sys::socket::{setsockopt, sockopt};

use super::attempt::{Ctx, Seen, datagram_exchange, describe};
use super::origin;

/// A transport the probe tries only towards destinations that must be refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OtherProto {
    /// UDP-Lite datagrams (IPPROTO_UDPLITE), to the target's port.
    UdpLite,
    /// An ICMP or ICMPv6 echo request through a ping socket (the port is not used).
    Echo,
    /// An SCTP association (IPPROTO_SCTP), to the target's port.
    Sctp,
    /// A DCCP connection (SOCK_DCCP), to the target's port.
    Dccp,
}

impl OtherProto {
    pub(super) const ALL: [OtherProto; 4] = [
        OtherProto::UdpLite,
        OtherProto::Echo,
        OtherProto::Sctp,
        OtherProto::Dccp,
    ];

    /// As nft names it for the target's family.
    pub(super) fn name(self, target: SocketAddr) -> &'static str {
        match (self, target) {
            (OtherProto::UdpLite, _) => "udplite",
            (OtherProto::Echo, SocketAddr::V4(_)) => "icmp",
            (OtherProto::Echo, SocketAddr::V6(_)) => "icmpv6",
            (OtherProto::Sctp, _) => "sctp",
            (OtherProto::Dccp, _) => "dccp",
        }
    }

    /// Whether the port belongs in the check's name (an echo has none).
    pub(super) fn has_ports(self) -> bool {
        self != OtherProto::Echo
    }

    fn socket_kind(self, target: SocketAddr) -> (Type, Protocol) {
        match (self, target) {
            (OtherProto::UdpLite, _) => (Type::DGRAM, Protocol::from(libc::IPPROTO_UDPLITE)),
            (OtherProto::Echo, SocketAddr::V4(_)) => (Type::DGRAM, Protocol::ICMPV4),
            (OtherProto::Echo, SocketAddr::V6(_)) => (Type::DGRAM, Protocol::ICMPV6),
            (OtherProto::Sctp, _) => (Type::STREAM, Protocol::from(libc::IPPROTO_SCTP)),
            (OtherProto::Dccp, _) => (
                Type::from(libc::SOCK_DCCP),
                Protocol::from(libc::IPPROTO_DCCP),
            ),
        }
    }

    /// Tries to send over this transport to `target`.
    pub(super) fn attempt(self, target: SocketAddr, ctx: &Ctx) -> Seen {
        let socket = match self.open(target) {
            Ok(s) => s,
            Err(seen) => return seen,
        };
        match self {
            OtherProto::UdpLite => datagram(socket, target, b"egress-fence probe\n", ctx, |_| {
                Some("answered".into())
            }),
            OtherProto::Echo => {
                // Type, code, checksum, identifier (the kernel fills in the last three), a
                // sequence number and a payload.
                let request_type = if target.is_ipv4() { 8 } else { 128 };
                let reply_type = if target.is_ipv4() { 0 } else { 129 };
                let mut request = vec![request_type, 0, 0, 0, 0, 0, 0, 1];
                request.extend_from_slice(b"egress-fence probe");
                let echo_target = SocketAddr::new(target.ip(), 0);
                let seen = datagram(socket, echo_target, &request, ctx, move |reply| {
                    (reply.first() == Some(&reply_type)).then(|| "echo reply".to_string())
                });
                match seen {
                    // The IPv6 ping socket ignores the error of its output (Linux's
                    // ping_v6_sendmsg), so `action: drop` leaves no trace on it: silence is
                    // either a drop here or a request that left. `reject` is told apart.
                    Seen::Silent if target.is_ipv6() => Seen::Unconfirmed(format!(
                        "sent, no reply within {}: an ICMPv6 ping socket is not told when \
                         this host drops its request, so the probe cannot tell `action: \
                         drop` from a request that left (under `action: reject` it can)",
                        super::attempt::fmt_duration(ctx.udp_wait)
                    )),
                    other => other,
                }
            }
            OtherProto::Sctp | OtherProto::Dccp => stream(socket, target, ctx),
        }
    }

    fn open(self, target: SocketAddr) -> Result<Socket, Seen> {
        let (ty, proto) = self.socket_kind(target);
        Socket::new(Domain::for_address(target), ty, Some(proto)).map_err(|e| {
            match (self, e.raw_os_error()) {
                (
                    _,
                    Some(
                        libc::EPROTONOSUPPORT
                        | libc::ESOCKTNOSUPPORT
                        | libc::EAFNOSUPPORT
                        | libc::EPROTOTYPE,
                    ),
                ) => Seen::Unavailable(format!(
                    "not available on this kernel ({}): nothing here can send it",
                    describe(&e)
                )),
                (OtherProto::Echo, Some(libc::EACCES | libc::EPERM)) => Seen::Unavailable(
                    "not sendable: the kernel refuses this process a ping socket (its group \
                     is outside net.ipv4.ping_group_range)"
                        .into(),
                ),
                _ => Seen::NotSent(describe(&e)),
            }
        })
    }
}

/// A datagram on a connected socket of any datagram transport, judged as UDP's: EPERM on
/// send is this host's refusal, a send that succeeds left it.
fn datagram(
    socket: Socket,
    target: SocketAddr,
    payload: &[u8],
    ctx: &Ctx,
    accept: impl Fn(&[u8]) -> Option<String>,
) -> Seen {
    if let Err(e) = socket.connect(&SockAddr::from(target)) {
        return Seen::NotSent(describe(&e));
    }
    datagram_exchange(UdpSocket::from(socket), target, payload, ctx, accept)
}

/// A connection of a stream transport (SCTP, DCCP). As for TCP, a timeout is a refusal
/// (`action: drop`; and `reject` for SCTP, which treats the ICMP error as transient), a reset
/// or an ABORT proof that it got through, EPERM this host's refusal. An ICMP error that
/// fails the connect (DCCP) is traced to its sender where the kernel queues it; where it
/// does not, it cannot be told from a far host's, and says so (a WARN).
fn stream(socket: Socket, target: SocketAddr, ctx: &Ctx) -> Seen {
    if let Err(e) = socket.set_nonblocking(true) {
        return Seen::NotSent(describe(&e));
    }
    // Where the transport queues its ICMP errors, they name their sender.
    let _ = match target {
        SocketAddr::V4(_) => setsockopt(&socket, sockopt::Ipv4RecvErr, &true),
        SocketAddr::V6(_) => setsockopt(&socket, sockopt::Ipv6RecvErr, &true),
    };
    let started = Instant::now();
    match socket.connect(&SockAddr::from(target)) {
        Ok(()) => return Seen::Connected,
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return stream_error(&socket, target, &e, ctx),
    }
    loop {
        let left = ctx.timeout.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Seen::TimedOut;
        }
        let millis = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(socket.as_fd(), PollFlags::POLLOUT)];
        match poll(&mut fds, PollTimeout::from(millis)) {
            Ok(0) => continue,
            Ok(_) => break,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Seen::NotSent(describe(&io::Error::from(e))),
        }
    }
    match socket.take_error() {
        Ok(None) => Seen::Connected,
        Ok(Some(e)) | Err(e) => stream_error(&socket, target, &e, ctx),
    }
}

fn stream_error(socket: &Socket, target: SocketAddr, e: &io::Error, ctx: &Ctx) -> Seen {
    match e.raw_os_error() {
        Some(libc::EPERM) => Seen::RefusedHere(describe(e)),
        Some(libc::ECONNREFUSED | libc::ECONNRESET) => {
            Seen::RefusedRemotely("connection refused (reset or ABORT from the host)".into())
        }
        Some(libc::ETIMEDOUT) => Seen::TimedOut,
        Some(libc::EHOSTUNREACH | libc::EACCES) => match origin::icmp_sender(socket, target) {
            Some(sender) if ctx.is_fence(sender) => Seen::RefusedHere(describe(e)),
            Some(sender) => Seen::RefusedRemotely(format!(
                "{}, sent by {sender} beyond this host, not by the boundary",
                describe(e)
            )),
            None => Seen::Unconfirmed(format!(
                "{}: this transport does not report who sent the ICMP error, so the probe \
                 cannot tell the boundary's refusal from a far host's",
                describe(e)
            )),
        },
        _ => Seen::NotSent(describe(e)),
    }
}
