//! Which destinations carry live connections: one dump of the network namespace's conntrack
//! table over ctnetlink (NFNL_SUBSYS_CTNETLINK). The guard keeps an answered address allowed
//! while a connection to it lives, even past its lifetime.
//!
//! Written by hand on a plain netlink socket, as NFLOG is in `watch` (no
//! libnetfilter_conntrack, no `unsafe`): one IPCTNL_MSG_CT_GET dump request, then the kernel's
//! multi-part answer, parsed with bounds-checked slicing.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::socket::{
    self, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, sockopt,
};
use nix::sys::time::TimeVal;

use crate::core::policy::L4Proto;
// The byte helpers of the NFLOG reader, which parses netlink the same way.
use crate::watch::{align4, ne16, ne32};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_GET: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;
const NLA_HDRLEN: usize = 4;
const NLA_TYPE_MASK: u16 = 0x3fff;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_PROTOINFO: u16 = 4;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
/// TCP_CONNTRACK_TIME_WAIT and later (CLOSE, LISTEN...) carry no live connection.
const TCP_CONNTRACK_TIME_WAIT: u8 = 7;

/// A dump that takes longer than this is abandoned (the caller tries again later).
const DUMP_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    #[error("conntrack dump: {doing}: {source}")]
    Io { doing: &'static str, source: Errno },
    #[error("conntrack dump refused by the kernel: {0}")]
    Refused(Errno),
}

/// A connection's destination, as it left this host.
pub type Flow = (IpAddr, L4Proto, u16);

/// The destinations of the TCP connections not yet closing and of the UDP flows conntrack
/// holds in the current network namespace.
pub fn live_flows() -> Result<BTreeSet<Flow>, ConntrackError> {
    let io = |doing| move |source| ConntrackError::Io { doing, source };
    let fd = socket::socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkNetFilter,
    )
    .map_err(io("socket"))?;
    socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).map_err(io("bind"))?;
    let timeout = TimeVal::new(DUMP_TIMEOUT.as_secs() as _, 0);
    socket::setsockopt(&fd, sockopt::ReceiveTimeout, &timeout).map_err(io("timeout"))?;
    socket::sendto(
        fd.as_raw_fd(),
        &dump_request(1),
        &NetlinkAddr::new(0, 0),
        MsgFlags::empty(),
    )
    .map_err(io("send"))?;

    let mut flows = BTreeSet::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(io("receive"))?;
        match parse_datagram(&buf[..n.min(buf.len())], &mut flows) {
            Datagram::More => {}
            Datagram::Done => return Ok(flows),
            Datagram::Error(errno) => return Err(ConntrackError::Refused(errno)),
        }
    }
}

/// IPCTNL_MSG_CT_GET with NLM_F_DUMP for every address family.
fn dump_request(seq: u32) -> Vec<u8> {
    let mut msg = Vec::with_capacity(NLMSG_HDRLEN + NFGENMSG_LEN);
    let len = (NLMSG_HDRLEN + NFGENMSG_LEN) as u32;
    msg.extend_from_slice(&len.to_ne_bytes());
    let kind = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET;
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    // nfgenmsg: AF_UNSPEC dumps IPv4 and IPv6 alike.
    msg.extend_from_slice(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
    msg
}

enum Datagram {
    More,
    Done,
    Error(Errno),
}

fn parse_datagram(mut data: &[u8], flows: &mut BTreeSet<Flow>) -> Datagram {
    while data.len() >= NLMSG_HDRLEN {
        let len = ne32(data, 0).unwrap_or(0) as usize;
        let kind = ne16(data, 4).unwrap_or(0);
        if len < NLMSG_HDRLEN || len > data.len() {
            break;
        }
        let body = &data[NLMSG_HDRLEN..len];
        match kind {
            NLMSG_DONE => return Datagram::Done,
            NLMSG_ERROR => {
                let code = body
                    .get(..4)
                    .map_or(0, |b| i32::from_ne_bytes(b.try_into().unwrap_or_default()));
                if code != 0 {
                    return Datagram::Error(Errno::from_raw(-code));
                }
            }
            k if k == (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW => {
                if let Some(flow) = body.get(NFGENMSG_LEN..).and_then(parse_entry) {
                    flows.insert(flow);
                }
            }
            _ => {}
        }
        data = data.get(align4(len)..).unwrap_or_default();
    }
    Datagram::More
}

/// The original direction's destination of one conntrack entry, unless it is a TCP
/// connection that is closing or closed.
fn parse_entry(attrs: &[u8]) -> Option<Flow> {
    let tuple = attr(attrs, CTA_TUPLE_ORIG)?;
    let ip = attr(tuple, CTA_TUPLE_IP)?;
    let dst = match (attr(ip, CTA_IP_V4_DST), attr(ip, CTA_IP_V6_DST)) {
        (Some(v4), _) => IpAddr::from(<[u8; 4]>::try_from(v4.get(..4)?).ok()?),
        (None, Some(v6)) => IpAddr::from(<[u8; 16]>::try_from(v6.get(..16)?).ok()?),
        (None, None) => return None,
    };
    let proto = attr(tuple, CTA_TUPLE_PROTO)?;
    let number = *attr(proto, CTA_PROTO_NUM)?.first()?;
    let l4 = L4Proto::from_number(number)?;
    let port = u16::from_be_bytes(attr(proto, CTA_PROTO_DST_PORT)?.get(..2)?.try_into().ok()?);
    if l4 == L4Proto::Tcp {
        let state = attr(attrs, CTA_PROTOINFO)
            .and_then(|p| attr(p, CTA_PROTOINFO_TCP))
            .and_then(|t| attr(t, CTA_PROTOINFO_TCP_STATE))
            .and_then(|s| s.first().copied());
        if state.is_some_and(|s| s >= TCP_CONNTRACK_TIME_WAIT) {
            return None;
        }
    }
    Some((dst, l4, port))
}

/// The payload of the first attribute of `kind` among `attrs`.
fn attr(mut attrs: &[u8], kind: u16) -> Option<&[u8]> {
    while attrs.len() >= NLA_HDRLEN {
        let len = ne16(attrs, 0)? as usize;
        let t = ne16(attrs, 2)? & NLA_TYPE_MASK;
        if len < NLA_HDRLEN || len > attrs.len() {
            return None;
        }
        if t == kind {
            return attrs.get(NLA_HDRLEN..len);
        }
        attrs = attrs.get(align4(len)..).unwrap_or_default();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nla(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut out = ((NLA_HDRLEN + payload.len()) as u16).to_ne_bytes().to_vec();
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(payload);
        out.resize(align4(out.len()), 0);
        out
    }

    fn nested(kind: u16, parts: &[Vec<u8>]) -> Vec<u8> {
        nla(kind | 0x8000, &parts.concat())
    }

    /// One IPCTNL_MSG_CT_NEW message as the kernel sends it in a dump.
    fn entry(dst: IpAddr, proto: u8, dport: u16, tcp_state: Option<u8>) -> Vec<u8> {
        let ip = match dst {
            IpAddr::V4(a) => nla(CTA_IP_V4_DST, &a.octets()),
            IpAddr::V6(a) => nla(CTA_IP_V6_DST, &a.octets()),
        };
        let tuple = nested(
            CTA_TUPLE_ORIG,
            &[
                nested(CTA_TUPLE_IP, &[nla(1, &[198, 51, 100, 2]), ip]),
                nested(
                    CTA_TUPLE_PROTO,
                    &[
                        nla(CTA_PROTO_NUM, &[proto]),
                        nla(2, &40000u16.to_be_bytes()),
                        nla(CTA_PROTO_DST_PORT, &dport.to_be_bytes()),
                    ],
                ),
            ],
        );
        let mut attrs = vec![0u8, 0, 0, 0]; // nfgenmsg
        attrs.extend(tuple);
        if let Some(state) = tcp_state {
            attrs.extend(nested(
                CTA_PROTOINFO,
                &[nested(
                    CTA_PROTOINFO_TCP,
                    &[nla(CTA_PROTOINFO_TCP_STATE, &[state])],
                )],
            ));
        }
        let mut msg = ((NLMSG_HDRLEN + attrs.len()) as u32).to_ne_bytes().to_vec();
        msg.extend_from_slice(&(NFNL_SUBSYS_CTNETLINK << 8).to_ne_bytes());
        msg.extend_from_slice(&[0; 10]);
        msg.extend(attrs);
        msg
    }

    fn done() -> Vec<u8> {
        let mut msg = 20u32.to_ne_bytes().to_vec();
        msg.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
        msg.extend_from_slice(&[0; 14]);
        msg
    }

    #[test]
    fn a_dump_yields_live_destinations_only() {
        let v4: IpAddr = "192.0.2.7".parse().unwrap();
        let v6: IpAddr = "2001:db8::7".parse().unwrap();
        let data = [
            entry(v4, 6, 443, Some(3)), // established
            entry(v4, 6, 80, Some(7)),  // time-wait: over
            entry(v6, 17, 443, None),   // a UDP flow (QUIC)
            entry(v4, 1, 0, None),      // ICMP: no ports, not ours to keep
        ]
        .concat();
        let mut flows = BTreeSet::new();
        assert!(matches!(parse_datagram(&data, &mut flows), Datagram::More));
        assert_eq!(
            flows,
            BTreeSet::from([(v4, L4Proto::Tcp, 443), (v6, L4Proto::Udp, 443)])
        );
        assert!(matches!(
            parse_datagram(&done(), &mut flows),
            Datagram::Done
        ));
    }

    #[test]
    fn truncated_messages_are_skipped_not_misread() {
        let v4: IpAddr = "192.0.2.7".parse().unwrap();
        let whole = entry(v4, 6, 443, Some(3));
        let mut flows = BTreeSet::new();
        parse_datagram(&whole[..whole.len() - 6], &mut flows);
        assert!(flows.is_empty());
        // An attribute claiming more than the message holds.
        let mut bad = whole.clone();
        bad[NLMSG_HDRLEN + NFGENMSG_LEN] = 0xff;
        parse_datagram(&bad, &mut flows);
        assert!(flows.is_empty());
    }
}
