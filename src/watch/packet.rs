//! The copied bytes of a refused packet: its IPv4 or IPv6 header (IPv6 extension headers
//! walked) and the transport ports. Every length is checked against what was copied: the
//! kernel copies at most [`super::COPY_RANGE`] bytes, and the packet is the fenced process's.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::{WatchError, malformed};
use crate::netlink::bytes::be16;

pub(super) const NFPROTO_IPV4: u8 = libc::NFPROTO_IPV4 as u8;
pub(super) const NFPROTO_IPV6: u8 = libc::NFPROTO_IPV6 as u8;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;

/// What the IP and transport headers say.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct IpInfo {
    pub family: &'static str,
    pub protocol: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub ports: Option<(u16, u16)>,
}

/// Decodes the copied packet. The nfgenmsg family says which IP version it is for ip/ip6/inet
/// tables; for others (bridge, netdev) the hardware protocol or the version nibble does.
pub(super) fn decode_ip(
    family: u8,
    hw_protocol: Option<u16>,
    p: &[u8],
) -> Result<IpInfo, WatchError> {
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

pub(super) fn protocol_name(protocol: u8) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ipv4(protocol: u8, rest: &[u8]) -> Vec<u8> {
        let mut p = vec![
            0x45, 0, 0, 60, 0x12, 0x34, 0x40, 0, 64, protocol, 0, 0, 198, 51, 100, 2, 203, 0, 113,
            9,
        ];
        p.extend_from_slice(rest);
        p
    }

    fn ipv6(next: u8, rest: &[u8]) -> Vec<u8> {
        let mut p = vec![0x60, 0, 0, 0];
        p.extend_from_slice(&(rest.len() as u16).to_be_bytes());
        p.extend_from_slice(&[next, 64]);
        p.extend_from_slice(&[0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        p.extend_from_slice(&[0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9]);
        p.extend_from_slice(rest);
        p
    }

    const PORTS: [u8; 4] = [0x9c, 0x40, 0x01, 0xbb]; // 40000 -> 443

    #[test]
    fn ports_of_the_transports_that_have_them() {
        for (protocol, ports) in [(6, true), (17, true), (132, true), (136, true), (1, false)] {
            let info = decode_ip(NFPROTO_IPV4, None, &ipv4(protocol, &PORTS)).unwrap();
            assert_eq!(info.ports.is_some(), ports, "{protocol}");
        }
        let info = decode_ip(NFPROTO_IPV4, None, &ipv4(6, &PORTS)).unwrap();
        assert_eq!(info.ports, Some((40000, 443)));
        assert_eq!(info.dst, IpAddr::from([203, 0, 113, 9]));
        assert_eq!(protocol_name(info.protocol), "tcp");
        assert_eq!(protocol_name(250), "250");
    }

    #[test]
    fn ipv4_headers_that_lie_about_their_length() {
        // IHL below the minimum of 5 words
        let mut p = ipv4(6, &PORTS);
        p[0] = 0x44;
        assert!(decode_ip(NFPROTO_IPV4, None, &p).is_err());
        // IHL of 15 words with only 24 bytes copied
        p[0] = 0x4f;
        assert!(decode_ip(NFPROTO_IPV4, None, &p).is_err());
        // a version nibble that is not 4 under an ipv4 family
        let mut p = ipv4(6, &PORTS);
        p[0] = 0x65;
        assert!(decode_ip(NFPROTO_IPV4, None, &p).is_err());
        // a later fragment: no ports even though bytes follow
        let mut p = ipv4(6, &PORTS);
        p[7] = 1;
        assert_eq!(decode_ip(NFPROTO_IPV4, None, &p).unwrap().ports, None);
    }

    #[test]
    fn ipv6_extension_chains_that_leave_the_copied_bytes() {
        // hop-by-hop claiming 255 * 8 more bytes than were copied
        let p = ipv6(0, &[6, 255, 0, 0, 0, 0, 0, 0]);
        let info = decode_ip(NFPROTO_IPV6, None, &p).unwrap();
        assert_eq!((info.protocol, info.ports), (0, None));
        // an extension header cut before its length byte
        let p = ipv6(60, &[6]);
        assert_eq!(decode_ip(NFPROTO_IPV6, None, &p).unwrap().ports, None);
        // a long chain of empty destination options ends at the copied bytes
        let mut rest = Vec::new();
        for _ in 0..20 {
            rest.extend_from_slice(&[60, 0, 0, 0, 0, 0, 0, 0]);
        }
        let info = decode_ip(NFPROTO_IPV6, None, &ipv6(60, &rest)).unwrap();
        assert_eq!((info.protocol, info.ports), (60, None));
        // an authentication header, then UDP
        let mut rest = vec![17, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        rest.extend_from_slice(&PORTS);
        let info = decode_ip(NFPROTO_IPV6, None, &ipv6(51, &rest)).unwrap();
        assert_eq!((info.protocol, info.ports), (17, Some((40000, 443))));
    }

    #[test]
    fn every_truncation_and_corruption_is_an_answer_not_a_panic() {
        let mut chain = vec![44, 0, 0, 0, 0, 0, 0, 0, 6, 0, 0, 1, 0, 0, 0, 1];
        chain.extend_from_slice(&PORTS);
        let packets = [ipv4(6, &PORTS), ipv6(0, &chain)];
        for p in &packets {
            for family in [NFPROTO_IPV4, NFPROTO_IPV6, 7] {
                for cut in 0..=p.len() {
                    let _ = decode_ip(family, None, &p[..cut]);
                    for value in [0, 0x0f, 0x45, 0x60, 0xff] {
                        let mut q = p[..cut].to_vec();
                        if let Some(b) = q.get_mut(cut.saturating_sub(1)) {
                            *b = value;
                        }
                        let _ = decode_ip(family, Some(ETH_P_IPV6), &q);
                    }
                }
            }
        }
        for cut in 0..20 {
            assert!(decode_ip(NFPROTO_IPV4, None, &packets[0][..cut]).is_err());
        }
        for cut in 0..40 {
            assert!(decode_ip(NFPROTO_IPV6, None, &packets[1][..cut]).is_err());
        }
    }
}
