//! Which uid owns a local socket, and which cgroup made it, asked of the kernel
//! (`NETLINK_SOCK_DIAG`, one exact lookup by address and port): the DNS guard tells local
//! clients apart by their uid, since a local process can send from any loopback address it
//! likes; `watch` names the cgroup of the scope a refused packet's socket belongs to.

use std::net::{IpAddr, SocketAddr};

use nix::sys::socket::{MsgFlags, SockProtocol};

use super::Socket;
use super::bytes::ne32;
use super::message::{Message, NLM_F_REQUEST, Request};
use crate::core::policy::L4Proto;

/// `SOCK_DIAG_BY_FAMILY` (linux/sock_diag.h).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// Bytes of `struct inet_diag_req_v2`.
const REQ_LEN: usize = 56;
/// Where `idiag_uid` lies in a reply's payload: after the four one-byte fields, the 48-byte
/// `inet_diag_sockid` and `idiag_expires`, `idiag_rqueue`, `idiag_wqueue`.
const UID_OFFSET: usize = 4 + 48 + 12;
/// Bytes of `struct inet_diag_msg`; its attributes follow.
const MSG_LEN: usize = UID_OFFSET + 8;
/// `INET_DIAG_CGROUP_ID` (Linux 5.7): the id of the cgroup v2 the socket was made in, a u64
/// in host order, sent with every reply.
const INET_DIAG_CGROUP_ID: u16 = 21;

/// What the kernel says of one socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketInfo {
    pub uid: u32,
    /// The id of the socket's cgroup v2 (its directory's inode number); `None` before Linux
    /// 5.7.
    pub cgroup_id: Option<u64>,
}

/// A netlink socket for socket lookups, in the network namespace it was opened in.
#[derive(Debug)]
pub struct SockDiag {
    socket: Socket,
    seq: u32,
}

impl SockDiag {
    pub fn open() -> nix::Result<SockDiag> {
        let socket = Socket::open(SockProtocol::NetlinkSockDiag)?;
        Ok(SockDiag { socket, seq: 0 })
    }

    /// The uid owning the socket at `peer` that talks to `local` (ours), if the kernel
    /// knows it: a UDP client's socket as long as it is open, a TCP client's connection.
    /// Both addresses must be of one family.
    pub fn owner(&mut self, protocol: L4Proto, local: SocketAddr, peer: SocketAddr) -> Option<u32> {
        self.socket_info(protocol, local, peer).map(|info| info.uid)
    }

    /// Like [`SockDiag::owner`], with the socket's cgroup.
    pub fn socket_info(
        &mut self,
        protocol: L4Proto,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> Option<SocketInfo> {
        self.seq = self.seq.wrapping_add(1);
        let request = request(protocol, local, peer, self.seq)?;
        self.socket.send(&request).ok()?;
        // The kernel answers within sendto: nothing queued means no answer.
        let mut reply = [0u8; 512];
        loop {
            let len = self.socket.recv(&mut reply, MsgFlags::MSG_DONTWAIT).ok()?;
            match parse_reply(reply.get(..len).unwrap_or(&reply), self.seq) {
                Reply::Found(info) => return Some(info),
                Reply::NotFound => return None,
                Reply::Stale => continue,
            }
        }
    }
}

/// One reply message, judged.
#[derive(Debug, PartialEq, Eq)]
enum Reply {
    Found(SocketInfo),
    NotFound,
    /// A reply to an earlier request (one that was given up on).
    Stale,
}

/// The `SOCK_DIAG_BY_FAMILY` request for the socket at `peer` talking to `local`. The kernel
/// looks a UDP socket up as the receiver of a datagram from `idiag_src` to `idiag_dst`, and a
/// TCP one as the socket whose local end is `idiag_src` (net/ipv4/udp_diag.c,
/// inet_diag.c).
fn request(protocol: L4Proto, local: SocketAddr, peer: SocketAddr, seq: u32) -> Option<Vec<u8>> {
    let family = match (local.ip(), peer.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET as u8,
        (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6 as u8,
        _ => return None,
    };
    let (src, dst, proto) = match protocol {
        L4Proto::Udp => (local, peer, libc::IPPROTO_UDP as u8),
        L4Proto::Tcp => (peer, local, libc::IPPROTO_TCP as u8),
    };
    // struct inet_diag_req_v2
    let mut req = Vec::with_capacity(REQ_LEN);
    req.extend_from_slice(&[family, proto, 0, 0]);
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
    req.extend_from_slice(&src.port().to_be_bytes());
    req.extend_from_slice(&dst.port().to_be_bytes());
    for addr in [src.ip(), dst.ip()] {
        let mut field = [0u8; 16];
        match addr {
            IpAddr::V4(v4) => field[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => field.copy_from_slice(&v6.octets()),
        }
        req.extend_from_slice(&field);
    }
    req.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // INET_DIAG_NOCOOKIE
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    Request::new(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq)
        .raw(&req)
        .finish()
        .ok()
}

/// Judges the first message of a reply datagram.
fn parse_reply(reply: &[u8], seq: u32) -> Reply {
    // A sequence number readable even where the message as a whole is not.
    if ne32(reply, 8) != Some(seq) {
        return Reply::Stale;
    }
    match Message::parse(reply) {
        Ok(msg) if msg.kind == SOCK_DIAG_BY_FAMILY => match ne32(msg.payload, UID_OFFSET) {
            Some(uid) => Reply::Found(SocketInfo {
                uid,
                cgroup_id: msg.payload.get(MSG_LEN..).and_then(cgroup_id),
            }),
            None => Reply::NotFound,
        },
        // NLMSG_ERROR (ENOENT: no such socket), or anything else.
        _ => Reply::NotFound,
    }
}

/// The `INET_DIAG_CGROUP_ID` attribute among a reply's attributes (`struct nlattr`s, each
/// padded to 4 bytes), every length checked.
fn cgroup_id(mut attrs: &[u8]) -> Option<u64> {
    while attrs.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
        let kind = u16::from_ne_bytes([attrs[2], attrs[3]]) & 0x3fff;
        if len < 4 || len > attrs.len() {
            return None;
        }
        if kind == INET_DIAG_CGROUP_ID {
            let value: [u8; 8] = attrs.get(4..12)?.try_into().ok()?;
            return (len >= 12).then(|| u64::from_ne_bytes(value));
        }
        attrs = attrs.get(len.next_multiple_of(4)..).unwrap_or_default();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::message::NLMSG_HDRLEN;

    #[test]
    fn requests_are_laid_out_as_the_kernel_reads_them() {
        let local: SocketAddr = "127.0.0.53:53".parse().unwrap();
        let peer: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let udp = request(L4Proto::Udp, local, peer, 7).unwrap();
        assert_eq!(udp.len(), NLMSG_HDRLEN + REQ_LEN);
        assert_eq!(&udp[..4], &72u32.to_ne_bytes());
        assert_eq!(&udp[4..6], &SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        assert_eq!(&udp[6..8], &NLM_F_REQUEST.to_ne_bytes());
        assert_eq!(&udp[8..12], &7u32.to_ne_bytes());
        assert_eq!(
            &udp[16..18],
            &[libc::AF_INET as u8, libc::IPPROTO_UDP as u8]
        );
        // UDP: source is our end, destination the client's.
        assert_eq!(&udp[24..26], &53u16.to_be_bytes());
        assert_eq!(&udp[26..28], &40000u16.to_be_bytes());
        assert_eq!(&udp[28..32], &[127, 0, 0, 53]);
        assert_eq!(&udp[44..48], &[127, 0, 0, 1]);
        // TCP: source is the client's end.
        let tcp = request(L4Proto::Tcp, local, peer, 7).unwrap();
        assert_eq!(&tcp[24..26], &40000u16.to_be_bytes());
        assert_eq!(&tcp[28..32], &[127, 0, 0, 1]);
        let v6: SocketAddr = "[::1]:53".parse().unwrap();
        assert!(
            request(L4Proto::Udp, v6, peer, 1).is_none(),
            "mixed families"
        );
    }

    fn reply(kind: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        Request::new(kind, 0, seq).raw(payload).finish().unwrap()
    }

    #[test]
    fn replies_are_judged_without_trusting_their_lengths() {
        let mut payload = vec![0u8; UID_OFFSET];
        payload.extend_from_slice(&1000u32.to_ne_bytes());
        payload.extend_from_slice(&[0; 8]);
        let good = reply(SOCK_DIAG_BY_FAMILY, 3, &payload);
        let found = |cgroup_id| {
            Reply::Found(SocketInfo {
                uid: 1000,
                cgroup_id,
            })
        };
        assert_eq!(parse_reply(&good, 3), found(None));
        // Attributes after the message: another one, then the cgroup id.
        let mut with_cgroup = payload[..MSG_LEN].to_vec();
        with_cgroup.extend_from_slice(&5u16.to_ne_bytes());
        with_cgroup.extend_from_slice(&1u16.to_ne_bytes());
        with_cgroup.extend_from_slice(&[7, 0, 0, 0]);
        with_cgroup.extend_from_slice(&12u16.to_ne_bytes());
        with_cgroup.extend_from_slice(&INET_DIAG_CGROUP_ID.to_ne_bytes());
        with_cgroup.extend_from_slice(&4242u64.to_ne_bytes());
        let reply_with = reply(SOCK_DIAG_BY_FAMILY, 3, &with_cgroup);
        assert_eq!(parse_reply(&reply_with, 3), found(Some(4242)));
        let cut = reply(
            SOCK_DIAG_BY_FAMILY,
            3,
            &with_cgroup[..with_cgroup.len() - 4],
        );
        assert_eq!(parse_reply(&cut, 3), found(None));
        assert_eq!(parse_reply(&good, 4), Reply::Stale);
        let enoent = reply(2, 3, &(-libc::ENOENT).to_ne_bytes());
        assert_eq!(parse_reply(&enoent, 3), Reply::NotFound);
        // Cut before the uid, or a length that lies: no owner, no panic.
        for cut in 12..good.len() {
            assert_eq!(parse_reply(&good[..cut], 3), Reply::NotFound, "{cut}");
        }
        let short = reply(SOCK_DIAG_BY_FAMILY, 3, &payload[..UID_OFFSET + 2]);
        assert_eq!(parse_reply(&short, 3), Reply::NotFound);
        let mut lying = good.clone();
        lying[..4].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert_eq!(parse_reply(&lying, 3), Reply::NotFound);
        assert_eq!(parse_reply(&[], 3), Reply::Stale);
    }

    /// Real sockets of this process: a UDP socket that sent to a local one, and a TCP
    /// connection, are found with this process's uid; a closed one is not.
    #[test]
    fn the_owner_of_a_local_socket_is_found() {
        use std::net::{TcpListener, TcpStream, UdpSocket};
        let me = nix::unistd::geteuid().as_raw();
        let mut diag = SockDiag::open().expect("sock_diag");
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client.send_to(b"x", server.local_addr().unwrap()).unwrap();
        let (local, peer) = (server.local_addr().unwrap(), client.local_addr().unwrap());
        assert_eq!(diag.owner(L4Proto::Udp, local, peer), Some(me));
        drop(client);
        assert_eq!(diag.owner(L4Proto::Udp, local, peer), None);

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, from) = listener.accept().unwrap();
        let local = accepted.local_addr().unwrap();
        assert_eq!(from, stream.local_addr().unwrap());
        assert_eq!(diag.owner(L4Proto::Tcp, local, from), Some(me));
        // This process's cgroup v2, where the kernel has one to say (Linux 5.7 on).
        let info = diag.socket_info(L4Proto::Tcp, local, from).expect("found");
        if let (Some(id), Some(root)) = (info.cgroup_id, crate::host::cgroup2_root()) {
            use std::os::unix::fs::MetadataExt;
            let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
            let path = own
                .lines()
                .find_map(|l| l.strip_prefix("0::"))
                .unwrap_or("/");
            let dir = root.join(path.trim().trim_start_matches('/'));
            assert_eq!(std::fs::metadata(&dir).expect("own cgroup").ino(), id);
        }
    }
}
