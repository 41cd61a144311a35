//! The interfaces of the current network namespace as rtnetlink lists them (one RTM_GETLINK
//! dump): each one's name, the bridge (or other master) it is a port of, and its link type.
//! A scoped policy's listed bridges are checked by it for ports that are not a container's
//! veth (`crate::host`). Read over netlink, not /sys/class/net: sysfs shows the interfaces of
//! the namespace it was mounted in, not those of a namespace entered with `setns`.

use nix::sys::socket::SockProtocol;

use super::bytes::ne32;
use super::message::{DumpError, DumpProgress, NLM_F_DUMP, NLM_F_REQUEST, Oversize, Request};
use super::socket::{DumpFailed, DumpStep, dump};
use super::{Attrs, read_dump};

const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
/// Bytes of `struct ifinfomsg`.
const IFINFOMSG_LEN: usize = 16;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINK: u16 = 5;
const IFLA_MASTER: u16 = 10;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
/// linux/if_link.h, inside IFLA_INFO_DATA of a link of kind `tun`.
const IFLA_TUN_OWNER: u16 = 1;
const IFLA_TUN_GROUP: u16 = 2;
const IFLA_TUN_PERSIST: u16 = 6;
const IFLA_LINK_NETNSID: u16 = 37;

/// One interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// The interface index of the bridge (bond, VRF...) this one is a port of.
    pub master: Option<u32>,
    /// The interface of this namespace it is stacked on (a VLAN's or macvlan's lower
    /// device): `IFLA_LINK` when it names a device of this namespace (a veth's names its peer,
    /// which is in another namespace: `IFLA_LINK_NETNSID` says so).
    pub lower: Option<u32>,
    /// Its link type (`bridge`, `veth`, `tun`, `vxlan`, `macvlan`...); `None` for a device
    /// with no rtnetlink link type, which is what a physical NIC is.
    pub kind: Option<String>,
    /// What the tun driver says of a link of kind `tun` (tun and tap alike).
    pub tun: Option<TunInfo>,
}

/// A tun or tap device's owner, group and whether it persists (IFLA_TUN_*): whose it is to
/// attach, and whether it outlives its last descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TunInfo {
    pub owner: Option<u32>,
    pub group: Option<u32>,
    pub persist: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("interface dump: {0}")]
    Dump(#[from] DumpFailed),
    #[error("interface dump: the request does not fit a message")]
    Oversize,
    #[error("interface dump: a message of the kernel's answer could not be read")]
    Malformed,
}

/// Every interface of the network namespace of the calling thread.
pub fn links() -> Result<Vec<Link>, LinkError> {
    let request = dump_request(1).map_err(|_| LinkError::Oversize)?;
    let mut found = Vec::new();
    let mut malformed = false;
    dump(SockProtocol::NetlinkRoute, &request, |datagram| {
        match parse_datagram(datagram, &mut found) {
            Ok(DumpProgress::More) => DumpStep::More,
            Ok(DumpProgress::Done) => DumpStep::Done,
            Err(DumpError::Refused(errno)) => DumpStep::Refused(errno),
            // A link left out could be a bridge's port: a partial list is no answer.
            Err(DumpError::Malformed(_)) => {
                malformed = true;
                DumpStep::Done
            }
        }
    })?;
    match malformed {
        true => Err(LinkError::Malformed),
        false => Ok(found),
    }
}

/// RTM_GETLINK with NLM_F_DUMP and an empty `struct ifinfomsg` (every family, every link).
fn dump_request(seq: u32) -> Result<Vec<u8>, Oversize> {
    Request::new(RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, seq)
        .raw(&[0; IFINFOMSG_LEN])
        .finish()
}

fn parse_datagram(data: &[u8], found: &mut Vec<Link>) -> Result<DumpProgress, DumpError> {
    read_dump(data, |msg| {
        if msg.kind != RTM_NEWLINK {
            return;
        }
        if let Some(link) = parse_link(msg.payload) {
            found.push(link);
        }
    })
}

/// One RTM_NEWLINK payload: `struct ifinfomsg` (family, pad, type, index, flags, change),
/// then attributes.
fn parse_link(payload: &[u8]) -> Option<Link> {
    let index = ne32(payload, 4)?;
    let attrs = Attrs::new(payload.get(IFINFOMSG_LEN..)?);
    let name = attrs.clone().find(IFLA_IFNAME)?.string();
    let master = attrs
        .clone()
        .value(IFLA_MASTER)
        .and_then(|m| ne32(m, 0))
        .filter(|&m| m != 0);
    let lower = attrs
        .clone()
        .value(IFLA_LINK)
        .and_then(|l| ne32(l, 0))
        .filter(|&l| l != 0 && l != index && attrs.clone().find(IFLA_LINK_NETNSID).is_none());
    let info = attrs.find(IFLA_LINKINFO).map(|info| info.nested());
    let kind = info
        .clone()
        .and_then(|info| info.find(IFLA_INFO_KIND))
        .map(|k| k.string());
    let tun = match (kind.as_deref(), info) {
        (Some("tun"), Some(info)) => Some(
            info.value(IFLA_INFO_DATA)
                .map(|data| tun_info(Attrs::new(data)))
                .unwrap_or_default(),
        ),
        _ => None,
    };
    Some(Link {
        index,
        name,
        master,
        lower,
        kind,
        tun,
    })
}

/// IFLA_INFO_DATA of a tun link: the owner and group only when set (u32 each), persist a u8.
fn tun_info(data: Attrs<'_>) -> TunInfo {
    TunInfo {
        owner: data.clone().value(IFLA_TUN_OWNER).and_then(|v| ne32(v, 0)),
        group: data.clone().value(IFLA_TUN_GROUP).and_then(|v| ne32(v, 0)),
        persist: data
            .value(IFLA_TUN_PERSIST)
            .and_then(|v| v.first())
            .is_some_and(|&p| p != 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link_message(index: u32, name: &str, master: Option<u32>, kind: Option<&str>) -> Vec<u8> {
        link_message_on(index, name, master, None, kind)
    }

    /// `lower`: IFLA_LINK, and whether IFLA_LINK_NETNSID says it is in another namespace.
    fn link_message_on(
        index: u32,
        name: &str,
        master: Option<u32>,
        lower: Option<(u32, bool)>,
        kind: Option<&str>,
    ) -> Vec<u8> {
        let mut name_z = name.as_bytes().to_vec();
        name_z.push(0);
        let mut ifinfo = [0u8; IFINFOMSG_LEN];
        ifinfo[4..8].copy_from_slice(&index.to_ne_bytes());
        let mut request = Request::new(RTM_NEWLINK, 2, 1)
            .raw(&ifinfo)
            .attr(IFLA_IFNAME, &name_z);
        if let Some(m) = master {
            request = request.attr(IFLA_MASTER, &m.to_ne_bytes());
        }
        if let Some((l, elsewhere)) = lower {
            request = request.attr(IFLA_LINK, &l.to_ne_bytes());
            if elsewhere {
                request = request.attr(IFLA_LINK_NETNSID, &0i32.to_ne_bytes());
            }
        }
        if let Some(k) = kind {
            request = request.nested(IFLA_LINKINFO, |r| r.attr(IFLA_INFO_KIND, k.as_bytes()));
        }
        request.finish().expect("small")
    }

    fn done() -> Vec<u8> {
        Request::new(super::super::message::NLMSG_DONE, 2, 1)
            .raw(&0u32.to_ne_bytes())
            .finish()
            .expect("small")
    }

    #[test]
    fn the_request_is_a_dump_of_every_link() {
        let request = dump_request(7).expect("small");
        assert_eq!(request.len(), 16 + IFINFOMSG_LEN);
        assert_eq!(u16::from_ne_bytes([request[4], request[5]]), RTM_GETLINK);
    }

    #[test]
    fn links_are_read_with_their_master_lower_device_and_kind() {
        let mut datagram = link_message(1, "eth0", Some(3), None);
        datagram.extend(link_message(3, "br0", None, Some("bridge")));
        datagram.extend(link_message_on(
            4,
            "veth1",
            Some(3),
            Some((3, true)),
            Some("veth"),
        ));
        datagram.extend(link_message_on(
            5,
            "mv0",
            None,
            Some((3, false)),
            Some("macvlan"),
        ));
        let mut found = Vec::new();
        assert_eq!(
            parse_datagram(&datagram, &mut found),
            Ok(DumpProgress::More)
        );
        assert_eq!(
            found,
            vec![
                Link {
                    index: 1,
                    name: "eth0".into(),
                    master: Some(3),
                    lower: None,
                    kind: None,
                    tun: None
                },
                Link {
                    index: 3,
                    name: "br0".into(),
                    master: None,
                    lower: None,
                    kind: Some("bridge".into()),
                    tun: None
                },
                Link {
                    index: 4,
                    name: "veth1".into(),
                    master: Some(3),
                    lower: None,
                    kind: Some("veth".into()),
                    tun: None
                },
                Link {
                    index: 5,
                    name: "mv0".into(),
                    master: None,
                    lower: Some(3),
                    kind: Some("macvlan".into()),
                    tun: None
                },
            ]
        );
        assert_eq!(parse_datagram(&done(), &mut found), Ok(DumpProgress::Done));
    }

    /// A tun link's IFLA_INFO_DATA: owner and group when set, and whether it persists.
    #[test]
    fn a_tun_links_owner_group_and_persistence_are_read() {
        let tun_message = |index: u32, data: &[(u16, Vec<u8>)]| {
            let mut ifinfo = [0u8; IFINFOMSG_LEN];
            ifinfo[4..8].copy_from_slice(&index.to_ne_bytes());
            Request::new(RTM_NEWLINK, 2, 1)
                .raw(&ifinfo)
                .attr(IFLA_IFNAME, format!("tun{index}\0").as_bytes())
                .nested(IFLA_LINKINFO, |r| {
                    r.attr(IFLA_INFO_KIND, b"tun")
                        .nested(IFLA_INFO_DATA, |mut r| {
                            for (kind, value) in data {
                                r = r.attr(*kind, value);
                            }
                            r
                        })
                })
                .finish()
                .expect("small")
        };
        let mut datagram = tun_message(
            1,
            &[
                (3, vec![1]), // IFLA_TUN_TYPE: tun
                (IFLA_TUN_PERSIST, vec![1]),
            ],
        );
        datagram.extend(tun_message(
            2,
            &[
                (IFLA_TUN_OWNER, 4242u32.to_ne_bytes().to_vec()),
                (IFLA_TUN_GROUP, 4243u32.to_ne_bytes().to_vec()),
                (IFLA_TUN_PERSIST, vec![0]),
            ],
        ));
        let mut found = Vec::new();
        parse_datagram(&datagram, &mut found).expect("readable");
        let tun: Vec<_> = found.iter().map(|l| (l.name.as_str(), l.tun)).collect();
        assert_eq!(
            tun,
            [
                (
                    "tun1",
                    Some(TunInfo {
                        owner: None,
                        group: None,
                        persist: true
                    })
                ),
                (
                    "tun2",
                    Some(TunInfo {
                        owner: Some(4242),
                        group: Some(4243),
                        persist: false
                    })
                ),
            ]
        );
    }

    #[test]
    fn a_truncated_dump_is_no_answer() {
        let message = link_message(1, "eth0", Some(3), None);
        let mut found = Vec::new();
        let cut = &message[..message.len() - 3];
        assert!(matches!(
            parse_datagram(cut, &mut found),
            Err(DumpError::Malformed(_))
        ));
    }

    #[test]
    fn this_namespace_has_loopback() {
        let links = links().expect("an interface dump");
        assert!(links.iter().any(|l| l.name == "lo"), "{links:?}");
    }
}
