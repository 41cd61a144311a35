//! Which answered addresses may become resolved-set elements, how many of one answer (at most
//! [`MAX_ADDRS_PER_FAMILY`] per family), and for how long an answer's TTL counts. Every answer
//! is hostile input (a name under an allowed wildcard answers what its owner likes): an
//! element for 255.255.255.255, a subnet broadcast, a multicast group, 0.0.0.0, loopback, the
//! host's own addresses or the NAT64 form of any of them would let traffic out, or in circles,
//! that no allow entry meant. This module is the one owner of that decision; resolution
//! (`apply`, `plan`, `run` in resolve mode), the planner and the daemon's guard answers all ask
//! it.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

use crate::core::resolution::ResolvedAddr;

/// Why an answered address is never installed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Uninstallable {
    /// 0.0.0.0/8 or `::`: "this host" / no address.
    Unspecified,
    /// 127.0.0.0/8 or `::1`.
    Loopback,
    /// 224.0.0.0/4 or ff00::/8.
    Multicast,
    /// 255.255.255.255.
    Broadcast,
    /// 240.0.0.0/4 (reserved, never routed).
    Reserved,
    /// fe80::/10: meaningless without the interface it belongs to, which an answer cannot
    /// name. (IPv4's 169.254.0.0/16 is routed on-link; the deny list's `cloud-metadata`
    /// preset speaks for it, and warns "deny wins" when a name resolves into it.)
    LinkLocal,
    /// ::ffff:0:0/96 or ::/96: an IPv6 form of an IPv4 address, which an IPv6 rule never
    /// matches (the kernel sends such a packet as IPv4).
    Ipv4InIpv6,
    /// 64:ff9b:1::/48, the NAT64 prefix for local use (RFC 8215): where the IPv4 address
    /// sits inside depends on the operator's prefix length, so neither this module nor the
    /// deny list can tell which IPv4 address it reaches.
    Nat64LocalUse,
    /// An address of one of the host's own interfaces.
    OwnAddress,
    /// The broadcast address of one of the host's own IPv4 subnets.
    SubnetBroadcast,
}

impl Uninstallable {
    /// Why, for log lines and warnings.
    pub fn describe(self) -> &'static str {
        match self {
            Uninstallable::Unspecified => "unspecified address",
            Uninstallable::Loopback => "loopback address",
            Uninstallable::Multicast => "multicast address",
            Uninstallable::Broadcast => "the limited broadcast address",
            Uninstallable::Reserved => "reserved address (240.0.0.0/4)",
            Uninstallable::LinkLocal => "IPv6 link-local address",
            Uninstallable::Ipv4InIpv6 => "IPv4-mapped or IPv4-compatible IPv6 address",
            Uninstallable::Nat64LocalUse => "address in the local-use NAT64 prefix 64:ff9b:1::/48",
            Uninstallable::OwnAddress => "an address of this host",
            Uninstallable::SubnetBroadcast => "the broadcast address of a subnet of this host",
        }
    }
}

impl std::fmt::Display for Uninstallable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}

/// The host's own addresses and the broadcast addresses of its IPv4 subnets, read from its
/// interfaces (in the current network namespace).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostAddrs {
    own: BTreeSet<IpAddr>,
    broadcasts: BTreeSet<IpAddr>,
}

impl HostAddrs {
    /// None known: only the address itself decides (pure planning, tests).
    pub fn none() -> HostAddrs {
        HostAddrs::default()
    }

    /// From `(address, netmask, broadcast)` of each interface address.
    pub fn from_interfaces(
        interfaces: impl IntoIterator<Item = (IpAddr, Option<IpAddr>, Option<IpAddr>)>,
    ) -> HostAddrs {
        let mut out = HostAddrs::default();
        for (addr, mask, broadcast) in interfaces {
            out.own.insert(addr);
            if let Some(b) = broadcast {
                out.broadcasts.insert(b);
            }
            // A subnet's broadcast address whether or not the interface says IFF_BROADCAST.
            if let (IpAddr::V4(a), Some(IpAddr::V4(m))) = (addr, mask) {
                let (a, m) = (u32::from(a), u32::from(m));
                // /31 and /32 have no broadcast address (RFC 3021).
                if m.count_ones() < 31 {
                    out.broadcasts.insert(IpAddr::V4(Ipv4Addr::from(a | !m)));
                }
            }
        }
        out
    }

    /// Whether `addr` is an address of one of the host's interfaces.
    pub fn is_own(&self, addr: IpAddr) -> bool {
        self.own.contains(&addr)
    }

    /// Whether any address was read (a failed read knows none).
    pub fn is_known(&self) -> bool {
        !self.own.is_empty()
    }

    /// Whether a source address is one the host's routing calls local or broadcast
    /// (`fib saddr type`): its own addresses, all of 127/8 (the loopback route is local), and
    /// for IPv4 0.0.0.0, 255.255.255.255 and its subnets' broadcast addresses.
    pub fn is_local_or_broadcast(&self, addr: IpAddr) -> bool {
        self.own.contains(&addr)
            || self.broadcasts.contains(&addr)
            || match addr {
                IpAddr::V4(v4) => v4.is_loopback() || v4.is_unspecified() || v4.is_broadcast(),
                IpAddr::V6(_) => false,
            }
    }
}

/// The well-known NAT64 prefix, 64:ff9b::/96 (RFC 6052): a NAT64 gateway sends a packet to
/// 64:ff9b::a.b.c.d on to the IPv4 address a.b.c.d.
pub const NAT64_WELL_KNOWN: Ipv6Addr = Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0);
const NAT64_WELL_KNOWN_LEN: u8 = 96;

/// The IPv4 address a NAT64 gateway sends `addr` to, if `addr` is in 64:ff9b::/96.
pub fn nat64_embedded(addr: Ipv6Addr) -> Option<Ipv4Addr> {
    let bits = u128::from(addr);
    let prefix = u128::from(NAT64_WELL_KNOWN);
    (bits >> 32 == prefix >> 32).then(|| Ipv4Addr::from(bits as u32))
}

/// The image of the IPv4 network `net` in 64:ff9b::/96: the IPv6 destinations a NAT64
/// gateway sends into `net`.
pub fn nat64_image(net: ipnet::Ipv4Net) -> ipnet::Ipv6Net {
    let addr = Ipv6Addr::from(u128::from(NAT64_WELL_KNOWN) | u128::from(u32::from(net.network())));
    // 96 + at most 32 is a valid IPv6 prefix length.
    ipnet::Ipv6Net::new(addr, NAT64_WELL_KNOWN_LEN + net.prefix_len())
        .unwrap_or_else(|_| ipnet::Ipv6Net::from(addr))
}

/// Whether `addr` is in 64:ff9b:1::/48, the local-use NAT64 prefix (RFC 8215).
fn in_nat64_local_use(addr: Ipv6Addr) -> bool {
    let s = addr.segments();
    s[..3] == [0x64, 0xff9b, 1]
}

/// Whether `addr`, answered for an allowed name, may become a resolved-set element: `Err`
/// says why not. An address in 64:ff9b::/96 is an IPv4 address behind a NAT64 gateway: the
/// IPv4 checks apply to the address inside it.
pub fn check(addr: IpAddr, host: &HostAddrs) -> Result<(), Uninstallable> {
    check_class(addr)?;
    check_host(addr, host)?;
    if let IpAddr::V6(v6) = addr
        && let Some(v4) = nat64_embedded(v6)
    {
        check_v4(v4)?;
        check_host(IpAddr::V4(v4), host)?;
    }
    Ok(())
}

fn check_host(addr: IpAddr, host: &HostAddrs) -> Result<(), Uninstallable> {
    if host.own.contains(&addr) {
        return Err(Uninstallable::OwnAddress);
    }
    if host.broadcasts.contains(&addr) {
        return Err(Uninstallable::SubnetBroadcast);
    }
    Ok(())
}

/// The part of [`check`] that the address alone decides.
fn check_class(addr: IpAddr) -> Result<(), Uninstallable> {
    match addr {
        IpAddr::V4(a) => check_v4(a),
        IpAddr::V6(a) => check_v6(a),
    }
}

fn check_v4(a: Ipv4Addr) -> Result<(), Uninstallable> {
    let first = a.octets()[0];
    if a.is_broadcast() {
        Err(Uninstallable::Broadcast)
    } else if first == 0 {
        Err(Uninstallable::Unspecified)
    } else if a.is_loopback() {
        Err(Uninstallable::Loopback)
    } else if a.is_multicast() {
        Err(Uninstallable::Multicast)
    } else if first >= 240 {
        Err(Uninstallable::Reserved)
    } else {
        Ok(())
    }
}

fn check_v6(a: Ipv6Addr) -> Result<(), Uninstallable> {
    let s = a.segments();
    if a.is_unspecified() {
        Err(Uninstallable::Unspecified)
    } else if a.is_loopback() {
        Err(Uninstallable::Loopback)
    } else if a.is_multicast() {
        Err(Uninstallable::Multicast)
    } else if s[0] & 0xffc0 == 0xfe80 {
        Err(Uninstallable::LinkLocal)
    } else if a.to_ipv4_mapped().is_some() || s[..6] == [0; 6] {
        // ::ffff:a.b.c.d, and the deprecated ::a.b.c.d (`::` and `::1` are caught above).
        Err(Uninstallable::Ipv4InIpv6)
    } else if in_nat64_local_use(a) {
        Err(Uninstallable::Nat64LocalUse)
    } else {
        Ok(())
    }
}

/// The TTL an answer's record counts with: RFC 2181 section 8 says a TTL with the top bit set
/// is to be treated as zero (it would otherwise allow an address for 136 years).
pub fn effective_ttl(ttl: u32) -> u32 {
    if ttl & 0x8000_0000 != 0 { 0 } else { ttl }
}

/// One answered address that was not installed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Dropped {
    pub addr: IpAddr,
    pub why: Uninstallable,
}

/// Removes from `addrs` every address [`check`] refuses; returns those, with why.
pub fn retain_installable<T>(
    addrs: &mut Vec<T>,
    addr_of: impl Fn(&T) -> IpAddr,
    host: &HostAddrs,
) -> Vec<Dropped> {
    let mut dropped = Vec::new();
    addrs.retain(|a| match check(addr_of(a), host) {
        Ok(()) => true,
        Err(why) => {
            dropped.push(Dropped {
                addr: addr_of(a),
                why,
            });
            false
        }
    });
    dropped
}

/// How many addresses of one family one answer may install at most. An answer is hostile
/// input: one name under an allowed wildcard answering thousands of addresses would install
/// an element per address and port. The largest round-robin pools answer a few dozen, and a
/// client connects to one of the first few it gets.
pub const MAX_ADDRS_PER_FAMILY: usize = 32;

/// Keeps the first [`MAX_ADDRS_PER_FAMILY`] addresses of each family of `addrs`, in their
/// order (the answer's: clients try the first ones), and returns how many it left out.
pub fn cap_per_family<T>(addrs: &mut Vec<T>, addr_of: impl Fn(&T) -> IpAddr) -> usize {
    let (mut v4, mut v6) = (0usize, 0usize);
    let before = addrs.len();
    addrs.retain(|a| {
        let taken = if addr_of(a).is_ipv4() {
            &mut v4
        } else {
            &mut v6
        };
        *taken += 1;
        *taken <= MAX_ADDRS_PER_FAMILY
    });
    before - addrs.len()
}

/// The addresses of an answer's records, given as (address, TTL) in the answer's order: each
/// distinct address once, with the lowest TTL any record gives it (a TTL with the top bit set
/// counts as 0), at most [`MAX_ADDRS_PER_FAMILY`] of each family (the first ones), sorted.
/// The second value counts the addresses left out.
pub fn answered_addrs(
    records: impl IntoIterator<Item = (IpAddr, u32)>,
) -> (Vec<ResolvedAddr>, usize) {
    let mut order: Vec<IpAddr> = Vec::new();
    let mut ttls: HashMap<IpAddr, u32> = HashMap::new();
    for (addr, ttl) in records {
        let ttl = effective_ttl(ttl);
        ttls.entry(addr)
            .and_modify(|t| *t = (*t).min(ttl))
            .or_insert_with(|| {
                order.push(addr);
                ttl
            });
    }
    let left_out = cap_per_family(&mut order, |a| *a);
    let mut addrs: Vec<ResolvedAddr> = order
        .into_iter()
        .map(|addr| ResolvedAddr {
            addr,
            ttl: ttls.get(&addr).copied().unwrap_or(0),
        })
        .collect();
    addrs.sort();
    (addrs, left_out)
}

/// "192.0.2.1, 192.0.2.2, 192.0.2.3, 192.0.2.4 and 28 more": a list of addresses for a log
/// line, whose length does not grow with the list's.
pub fn summarise(addrs: &[IpAddr]) -> String {
    const SHOWN: usize = 4;
    let mut text = addrs
        .iter()
        .take(SHOWN)
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    if addrs.len() > SHOWN {
        text.push_str(&format!(" and {} more", addrs.len() - SHOWN));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn non_unicast_unspecified_loopback_and_link_local_are_refused() {
        let none = HostAddrs::none();
        let cases = [
            ("255.255.255.255", Uninstallable::Broadcast),
            ("0.0.0.0", Uninstallable::Unspecified),
            ("0.1.2.3", Uninstallable::Unspecified),
            ("127.0.0.1", Uninstallable::Loopback),
            ("127.255.0.9", Uninstallable::Loopback),
            ("224.0.0.1", Uninstallable::Multicast),
            ("239.255.255.250", Uninstallable::Multicast),
            ("240.0.0.1", Uninstallable::Reserved),
            ("::", Uninstallable::Unspecified),
            ("::1", Uninstallable::Loopback),
            ("ff02::1", Uninstallable::Multicast),
            ("ff05::1:3", Uninstallable::Multicast),
            ("fe80::1", Uninstallable::LinkLocal),
            ("febf::1", Uninstallable::LinkLocal),
            ("::ffff:192.0.2.1", Uninstallable::Ipv4InIpv6),
            ("::ffff:255.255.255.255", Uninstallable::Ipv4InIpv6),
            ("::192.0.2.1", Uninstallable::Ipv4InIpv6),
        ];
        for (addr, why) in cases {
            assert_eq!(check(ip(addr), &none), Err(why), "{addr}");
        }
    }

    #[test]
    fn unicast_addresses_pass() {
        let none = HostAddrs::none();
        for addr in [
            "192.0.2.10",
            "198.51.100.254",
            "203.0.113.0",
            "1.1.1.1",
            "223.255.255.254",
            "169.254.169.254", // the deny list's, not this module's
            "2001:db8::1",
            "fec0::1",
            "64:ff9b::192.0.2.1",
            "fd00::1",
        ] {
            assert_eq!(check(ip(addr), &none), Ok(()), "{addr}");
        }
    }

    #[test]
    fn the_hosts_own_addresses_and_subnet_broadcasts_are_refused() {
        let host = HostAddrs::from_interfaces([
            (
                ip("198.51.100.2"),
                Some(ip("255.255.255.0")),
                Some(ip("198.51.100.255")),
            ),
            // No IFF_BROADCAST: the broadcast address still follows from the mask.
            (ip("192.0.2.129"), Some(ip("255.255.255.192")), None),
            // A /31 has none.
            (ip("203.0.113.8"), Some(ip("255.255.255.254")), None),
            (
                ip("2001:db8:ffff::2"),
                Some(ip("ffff:ffff:ffff:ffff::")),
                None,
            ),
        ]);
        assert_eq!(
            check(ip("198.51.100.2"), &host),
            Err(Uninstallable::OwnAddress)
        );
        assert_eq!(
            check(ip("2001:db8:ffff::2"), &host),
            Err(Uninstallable::OwnAddress)
        );
        assert_eq!(
            check(ip("198.51.100.255"), &host),
            Err(Uninstallable::SubnetBroadcast)
        );
        assert_eq!(
            check(ip("192.0.2.191"), &host),
            Err(Uninstallable::SubnetBroadcast)
        );
        assert_eq!(check(ip("203.0.113.9"), &host), Ok(()));
        assert_eq!(check(ip("198.51.100.3"), &host), Ok(()));
    }

    #[test]
    fn nat64_answers_are_checked_as_the_ipv4_address_inside() {
        let host = HostAddrs::from_interfaces([(
            ip("198.51.100.2"),
            Some(ip("255.255.255.0")),
            Some(ip("198.51.100.255")),
        )]);
        let cases = [
            ("64:ff9b::ffff:ffff", Err(Uninstallable::Broadcast)),
            ("64:ff9b::7f00:1", Err(Uninstallable::Loopback)),
            ("64:ff9b::", Err(Uninstallable::Unspecified)),
            ("64:ff9b::e000:1", Err(Uninstallable::Multicast)),
            ("64:ff9b::f000:1", Err(Uninstallable::Reserved)),
            ("64:ff9b::198.51.100.2", Err(Uninstallable::OwnAddress)),
            (
                "64:ff9b::198.51.100.255",
                Err(Uninstallable::SubnetBroadcast),
            ),
            ("64:ff9b:1::c000:20a", Err(Uninstallable::Nat64LocalUse)),
            ("64:ff9b:1:ffff::1", Err(Uninstallable::Nat64LocalUse)),
            ("64:ff9b::192.0.2.10", Ok(())),
            // Outside /96: not the well-known prefix, an ordinary address.
            ("64:ff9b:0:1::7f00:1", Ok(())),
            ("64:ff9b:2::1", Ok(())),
        ];
        for (addr, want) in cases {
            assert_eq!(check(ip(addr), &host), want, "{addr}");
        }
    }

    #[test]
    fn nat64_images_and_embedded_addresses_agree() {
        let v4 = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        assert_eq!(
            nat64_embedded("64:ff9b::a9fe:a9fe".parse().unwrap()),
            Some(v4("169.254.169.254"))
        );
        assert_eq!(
            nat64_embedded("64:ff9b:1::a9fe:a9fe".parse().unwrap()),
            None
        );
        assert_eq!(nat64_embedded("2001:db8::1".parse().unwrap()), None);
        let image = |s: &str| nat64_image(s.parse().unwrap()).to_string();
        assert_eq!(image("10.0.0.0/8"), "64:ff9b::a00:0/104");
        assert_eq!(image("169.254.169.254/32"), "64:ff9b::a9fe:a9fe/128");
        assert_eq!(image("0.0.0.0/0"), "64:ff9b::/96");
        let net = nat64_image("172.16.0.0/12".parse().unwrap());
        assert!(net.contains(&"64:ff9b::172.31.255.255".parse::<Ipv6Addr>().unwrap()));
        assert!(!net.contains(&"64:ff9b::172.32.0.0".parse::<Ipv6Addr>().unwrap()));
    }

    #[test]
    fn ttls_with_the_top_bit_set_count_as_zero() {
        assert_eq!(effective_ttl(0), 0);
        assert_eq!(effective_ttl(300), 300);
        assert_eq!(effective_ttl(0x7fff_ffff), 0x7fff_ffff);
        assert_eq!(effective_ttl(0x8000_0000), 0);
        assert_eq!(effective_ttl(u32::MAX), 0);
    }

    #[test]
    fn retain_keeps_the_installable_and_reports_the_rest() {
        let mut addrs = vec![ip("192.0.2.1"), ip("255.255.255.255"), ip("::1")];
        let dropped = retain_installable(&mut addrs, |a| *a, &HostAddrs::none());
        assert_eq!(addrs, vec![ip("192.0.2.1")]);
        assert_eq!(
            dropped,
            vec![
                Dropped {
                    addr: ip("255.255.255.255"),
                    why: Uninstallable::Broadcast
                },
                Dropped {
                    addr: ip("::1"),
                    why: Uninstallable::Loopback
                },
            ]
        );
    }

    #[test]
    fn an_answer_keeps_its_first_addresses_of_each_family_up_to_the_cap() {
        let mut addrs: Vec<IpAddr> = (0..100u32)
            .map(|i| IpAddr::V4(Ipv4Addr::from(0xc612_0000 + i)))
            .chain((0..5u16).map(|i| IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, i))))
            .chain((100..200u32).map(|i| IpAddr::V4(Ipv4Addr::from(0xc612_0000 + i))))
            .collect();
        let left_out = cap_per_family(&mut addrs, |a| *a);
        assert_eq!(left_out, 200 - MAX_ADDRS_PER_FAMILY);
        assert_eq!(
            addrs.len(),
            MAX_ADDRS_PER_FAMILY + 5,
            "every IPv6 address stays"
        );
        assert_eq!(addrs[0], ip("198.18.0.0"), "the answer's order is kept");
        assert_eq!(
            addrs.iter().filter(|a| a.is_ipv4()).count(),
            MAX_ADDRS_PER_FAMILY
        );
        let mut few = vec![ip("192.0.2.1"), ip("2001:db8::1")];
        assert_eq!(cap_per_family(&mut few, |a| *a), 0);
        assert_eq!(few.len(), 2);
    }

    #[test]
    fn long_address_lists_are_summarised() {
        let addrs: Vec<IpAddr> = (1..=40u8)
            .map(|i| IpAddr::V4(Ipv4Addr::new(192, 0, 2, i)))
            .collect();
        assert_eq!(
            summarise(&addrs),
            "192.0.2.1, 192.0.2.2, 192.0.2.3, 192.0.2.4 and 36 more"
        );
        assert_eq!(summarise(&addrs[..2]), "192.0.2.1, 192.0.2.2");
        assert_eq!(summarise(&[]), "");
    }
}
