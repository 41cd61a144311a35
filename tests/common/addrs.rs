//! The world's fixed addresses: the sandbox, its gateway, the resolvers and the test hosts.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The sandbox's IPv4 address (source of everything the sandbox sends over IPv4).
pub const SANDBOX_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 2));
/// The sandbox's IPv6 address.
pub const SANDBOX_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 2));
/// The net side of the veth pair: the sandbox's IPv4 default gateway.
pub const GATEWAY_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1));
/// The net side of the veth pair: the sandbox's IPv6 default gateway.
pub const GATEWAY_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 1));

/// The "allowed" resolver (in the sandbox's resolv.conf), IPv4.
pub const DNS_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 53));
/// The "allowed" resolver, IPv6.
pub const DNS_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x53));
/// A second resolver with the same records that a policy should not allow, IPv4.
pub const ROGUE_DNS_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 54));
/// The rogue resolver, IPv6.
pub const ROGUE_DNS_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x54));

/// The cloud metadata service address (IPv4), a host of every world.
pub const METADATA_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254));
/// The AWS IPv6 metadata address, a host of every world.
pub const METADATA_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254));

/// Test hosts in 192.0.2.0/24.
pub const HOST_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 10));
pub const HOST2_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 11));
pub const HOST3_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 12));
/// Test hosts in 203.0.113.0/24 (a second, separate range, e.g. for deny lists).
pub const OTHER_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 10));
pub const OTHER2_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 11));
/// Test hosts in 2001:db8:1::/64.
pub const HOST_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10));
pub const HOST2_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x11));
pub const HOST3_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x12));
/// A test host in 2001:db8:2::/64 (the IPv6 counterpart of [`OTHER_V4`]).
pub const OTHER_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x10));

/// Every address the net namespace answers on when a world is created (more: [`World::add_host`]).
pub const DEFAULT_HOSTS: [IpAddr; 15] = [
    HOST_V4,
    HOST2_V4,
    HOST3_V4,
    OTHER_V4,
    OTHER2_V4,
    HOST_V6,
    HOST2_V6,
    HOST3_V6,
    OTHER_V6,
    METADATA_V4,
    METADATA_V6,
    DNS_V4,
    DNS_V6,
    ROGUE_DNS_V4,
    ROGUE_DNS_V6,
];

/// Source addresses of the harness's own health probes (never used by tests).
pub(super) const PROBE_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 252));
pub(super) const PROBE_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x252));
