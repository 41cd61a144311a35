//! Who refused a connection: the ICMP error that failed a TCP connect names its sender in
//! the socket's error queue (IP_RECVERR, IPV6_RECVERR). The fence's `reject` is answered by
//! this host's own stack, from one of its addresses; a far host or a router answers from
//! its own. Only the former is the boundary's refusal.

use std::io::IoSliceMut;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd;

use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrStorage, recvmsg};

/// The sender of the first ICMP error queued on `socket` (set up with IP_RECVERR or
/// IPV6_RECVERR before it connected to `target`), if one is queued.
pub(super) fn icmp_sender(socket: &impl AsRawFd, target: SocketAddr) -> Option<IpAddr> {
    // A few entries at most: one per ICMP error, and a connect meets one.
    for _ in 0..4 {
        let mut data = [0u8; 256];
        let mut iov = [IoSliceMut::new(&mut data)];
        let mut cmsg = match target {
            SocketAddr::V4(_) => nix::cmsg_space!(libc::sock_extended_err, libc::sockaddr_in),
            SocketAddr::V6(_) => nix::cmsg_space!(libc::sock_extended_err, libc::sockaddr_in6),
        };
        let msg = recvmsg::<SockaddrStorage>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_ERRQUEUE | MsgFlags::MSG_DONTWAIT,
        )
        .ok()?;
        let Ok(cmsgs) = msg.cmsgs() else {
            continue;
        };
        for c in cmsgs {
            let sender = match c {
                ControlMessageOwned::Ipv4RecvErr(err, Some(from))
                    if err.ee_origin == libc::SO_EE_ORIGIN_ICMP =>
                {
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(from.sin_addr.s_addr)))
                }
                ControlMessageOwned::Ipv6RecvErr(err, Some(from))
                    if err.ee_origin == libc::SO_EE_ORIGIN_ICMP6
                        || err.ee_origin == libc::SO_EE_ORIGIN_ICMP =>
                {
                    let v6 = Ipv6Addr::from(from.sin6_addr.s6_addr);
                    // A v4-mapped sender is an IPv4 host's.
                    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
                }
                _ => continue,
            };
            return Some(sender);
        }
    }
    None
}

/// Whether `addr` is an address of an interface of this network namespace (loopback
/// included): the source the local stack gives the ICMP errors it generates itself.
pub(super) fn is_this_host(addr: IpAddr) -> bool {
    let Ok(interfaces) = nix::ifaddrs::getifaddrs() else {
        return false;
    };
    interfaces
        .filter_map(|i| i.address)
        .any(|a| match (a.as_sockaddr_in(), a.as_sockaddr_in6()) {
            (Some(v4), _) => IpAddr::V4(v4.ip()) == addr,
            (_, Some(v6)) => IpAddr::V6(v6.ip()) == addr,
            _ => false,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_this_host_and_a_documentation_address_is_not() {
        // Every namespace the tests run in has lo up with 127.0.0.1 (a fresh one has it
        // down, but then it has no address at all and nothing here is said about it).
        if is_this_host(IpAddr::V4(Ipv4Addr::LOCALHOST)) {
            assert!(!is_this_host("192.0.2.200".parse().expect("an address")));
        }
    }
}
