//! Which destinations carry live connections: one dump of the network namespace's conntrack
//! table over ctnetlink (NFNL_SUBSYS_CTNETLINK). The guard keeps an answered address allowed
//! while a connection to it lives, even past its lifetime.
//!
//! Spoken with the crate's netlink codec on a plain socket (no libnetfilter_conntrack, no
//! `unsafe`): one IPCTNL_MSG_CT_GET dump request, then the kernel's multi-part answer.

use std::collections::BTreeSet;
use std::net::IpAddr;

use nix::sys::socket::SockProtocol;

use super::Attrs;
use super::message::{
    DumpError, DumpProgress, NFNL_SUBSYS_CTNETLINK, NLM_F_DUMP, NLM_F_REQUEST, Oversize, Request,
    nfnl_type, read_dump,
};
use super::socket::{DumpFailed, DumpStep, dump};
use crate::core::policy::L4Proto;

const IPCTNL_MSG_CT_NEW: u8 = 0;
const IPCTNL_MSG_CT_GET: u8 = 1;

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

#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    #[error("conntrack dump: {0}")]
    Dump(#[from] DumpFailed),
    #[error("conntrack dump: the request does not fit a message")]
    Oversize,
}

/// A connection's destination, as it left this host.
pub type Flow = (IpAddr, L4Proto, u16);

/// The destinations of the TCP connections not yet closing and of the UDP flows conntrack
/// holds in the current network namespace.
pub fn live_flows() -> Result<BTreeSet<Flow>, ConntrackError> {
    let request = dump_request(1).map_err(|_| ConntrackError::Oversize)?;
    let mut flows = BTreeSet::new();
    dump(SockProtocol::NetlinkNetFilter, &request, |datagram| {
        parse_datagram(datagram, &mut flows)
    })?;
    Ok(flows)
}

/// IPCTNL_MSG_CT_GET with NLM_F_DUMP for every address family.
fn dump_request(seq: u32) -> Result<Vec<u8>, Oversize> {
    let kind = nfnl_type(NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_GET);
    // nfgenmsg: AF_UNSPEC dumps IPv4 and IPv6 alike.
    Request::new(kind, NLM_F_REQUEST | NLM_F_DUMP, seq)
        .nfgenmsg(libc::AF_UNSPEC as u8, 0)
        .finish()
}

fn parse_datagram(data: &[u8], flows: &mut BTreeSet<Flow>) -> DumpStep {
    let entries = |msg: super::Message<'_>| {
        if msg.kind != nfnl_type(NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_NEW) {
            return;
        }
        if let Some(flow) = msg
            .nfgenmsg()
            .ok()
            .and_then(|(_, attrs)| parse_entry(attrs))
        {
            flows.insert(flow);
        }
    };
    match read_dump(data, entries) {
        Ok(DumpProgress::More) => DumpStep::More,
        Ok(DumpProgress::Done) => DumpStep::Done,
        Err(DumpError::Refused(errno)) => DumpStep::Refused(errno),
        // What came before the malformed message counts; the rest of the datagram cannot
        // be located. The dump goes on (or times out) with the next datagram.
        Err(DumpError::Malformed(_)) => DumpStep::More,
    }
}

/// The original direction's destination of one conntrack entry, unless it is a TCP
/// connection that is closing or closed.
fn parse_entry(attrs: Attrs<'_>) -> Option<Flow> {
    let tuple = attrs.clone().find(CTA_TUPLE_ORIG)?.nested();
    let ip = tuple.clone().find(CTA_TUPLE_IP)?.nested();
    let dst = match (ip.clone().value(CTA_IP_V4_DST), ip.value(CTA_IP_V6_DST)) {
        (Some(v4), _) => IpAddr::from(<[u8; 4]>::try_from(v4.get(..4)?).ok()?),
        (None, Some(v6)) => IpAddr::from(<[u8; 16]>::try_from(v6.get(..16)?).ok()?),
        (None, None) => return None,
    };
    let proto = tuple.find(CTA_TUPLE_PROTO)?.nested();
    let number = *proto.clone().value(CTA_PROTO_NUM)?.first()?;
    let l4 = L4Proto::from_number(number)?;
    let port = super::bytes::be16(proto.value(CTA_PROTO_DST_PORT)?, 0)?;
    if l4 == L4Proto::Tcp {
        let state = attrs
            .find(CTA_PROTOINFO)
            .and_then(|p| p.nested().find(CTA_PROTOINFO_TCP))
            .and_then(|t| t.nested().value(CTA_PROTOINFO_TCP_STATE))
            .and_then(|s| s.first().copied());
        if state.is_some_and(|s| s >= TCP_CONNTRACK_TIME_WAIT) {
            return None;
        }
    }
    Some((dst, l4, port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::message::{NFGENMSG_LEN, NLMSG_DONE, NLMSG_ERROR, NLMSG_HDRLEN};

    /// One IPCTNL_MSG_CT_NEW message as the kernel sends it in a dump (conntrack does not
    /// mark its nested attributes, so neither does this).
    fn entry(dst: IpAddr, proto: u8, dport: u16, tcp_state: Option<u8>) -> Vec<u8> {
        let orig = Request::new(nfnl_type(NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_NEW), 2, 0)
            .nfgenmsg(0, 0)
            .nested(CTA_TUPLE_ORIG, |t| {
                t.nested(CTA_TUPLE_IP, |ip| {
                    let ip = ip.attr(1, &[198, 51, 100, 2]);
                    match dst {
                        IpAddr::V4(a) => ip.attr(CTA_IP_V4_DST, &a.octets()),
                        IpAddr::V6(a) => ip.attr(CTA_IP_V6_DST, &a.octets()),
                    }
                })
                .nested(CTA_TUPLE_PROTO, |p| {
                    p.attr(CTA_PROTO_NUM, &[proto])
                        .attr(2, &40000u16.to_be_bytes())
                        .attr(CTA_PROTO_DST_PORT, &dport.to_be_bytes())
                })
            });
        match tcp_state {
            Some(state) => orig.nested(CTA_PROTOINFO, |p| {
                p.nested(CTA_PROTOINFO_TCP, |t| {
                    t.attr(CTA_PROTOINFO_TCP_STATE, &[state])
                })
            }),
            None => orig,
        }
        .finish()
        .unwrap()
    }

    fn done() -> Vec<u8> {
        Request::new(NLMSG_DONE, 2, 0)
            .raw(&[0; 4])
            .finish()
            .unwrap()
    }

    #[test]
    fn the_request_dumps_every_family() {
        let r = dump_request(7).unwrap();
        assert_eq!(r.len(), 20);
        assert_eq!(&r[4..6], &0x0101u16.to_ne_bytes());
        assert_eq!(&r[6..8], &0x0301u16.to_ne_bytes());
        assert_eq!(&r[8..12], &7u32.to_ne_bytes());
        assert_eq!(&r[16..20], &[0, 0, 0, 0]);
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
        assert!(matches!(parse_datagram(&data, &mut flows), DumpStep::More));
        assert_eq!(
            flows,
            BTreeSet::from([(v4, L4Proto::Tcp, 443), (v6, L4Proto::Udp, 443)])
        );
        assert!(matches!(
            parse_datagram(&done(), &mut flows),
            DumpStep::Done
        ));
    }

    #[test]
    fn the_kernels_refusal_ends_the_dump() {
        let error = Request::new(NLMSG_ERROR, 0, 1)
            .raw(&(-libc::EPERM).to_ne_bytes())
            .raw(&[0; 16])
            .finish()
            .unwrap();
        let mut flows = BTreeSet::new();
        assert!(matches!(
            parse_datagram(&error, &mut flows),
            DumpStep::Refused(nix::errno::Errno::EPERM)
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
        // A nested attribute claiming more than its container holds.
        let mut bad = whole.clone();
        bad[NLMSG_HDRLEN + NFGENMSG_LEN + 4] = 0xff;
        parse_datagram(&bad, &mut flows);
        assert!(flows.is_empty());
        // Every truncation and every byte set to 0 or 0xff: no panic.
        for cut in 0..whole.len() {
            parse_datagram(&whole[..cut], &mut flows);
            for value in [0, 0xff] {
                let mut m = whole.clone();
                m[cut] = value;
                parse_datagram(&m, &mut flows);
            }
        }
    }
}
