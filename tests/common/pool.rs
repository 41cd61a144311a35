//! The rotating pool: many names over many test addresses at once, CDN-like (for the guard).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::world::World;

/// How many distinct IPv4 addresses the rotating pool has ([`pool_v4`]).
pub const POOL_V4_LEN: usize = 2 * 187;

/// The `i`-th address of the rotating IPv4 pool: even `i` in 192.0.2.64-192.0.2.250, odd `i`
/// in 203.0.113.64-203.0.113.250 (clear of the world's fixed hosts), repeating after
/// [`POOL_V4_LEN`]. Not a host until added ([`World::add_hosts`], [`World::rotating_pool`]).
pub fn pool_v4(i: usize) -> IpAddr {
    let k = i % POOL_V4_LEN;
    let host = 64 + (k / 2) as u8;
    if k.is_multiple_of(2) {
        IpAddr::V4(Ipv4Addr::new(192, 0, 2, host))
    } else {
        IpAddr::V4(Ipv4Addr::new(203, 0, 113, host))
    }
}

/// The `i`-th address of the IPv6 pool, 2001:db8:3::/64 (`i + 1` as the interface id): a
/// distinct address for every `i` below 2^32.
pub fn pool_v6(i: usize) -> IpAddr {
    let n = i as u32 + 1;
    IpAddr::V6(Ipv6Addr::new(
        0x2001,
        0xdb8,
        3,
        0,
        0,
        0,
        (n >> 16) as u16,
        n as u16,
    ))
}

/// One name of [`World::rotating_pool`] and the addresses its A and AAAA records hold.
#[derive(Clone, Debug)]
pub struct PoolName {
    pub name: String,
    pub addrs: Vec<IpAddr>,
}

impl PoolName {
    /// The IPv4 addresses (its A records).
    pub fn v4(&self) -> Vec<IpAddr> {
        self.addrs.iter().copied().filter(IpAddr::is_ipv4).collect()
    }

    /// The IPv6 addresses (its AAAA records).
    pub fn v6(&self) -> Vec<IpAddr> {
        self.addrs.iter().copied().filter(IpAddr::is_ipv6).collect()
    }
}

impl World {
    /// A CDN-like zone: `count` names `r0.DOMAIN` .. `r{count-1}.DOMAIN`, name `i` answering
    /// the A records `pool_v4(i * v4_per_name + j)` for `j < v4_per_name` (so consecutive
    /// names rotate through the pool and it wraps after [`POOL_V4_LEN`] addresses) and, with
    /// `v6`, the AAAA record `pool_v6(i)` (distinct for every name). All addresses become
    /// hosts in one `ip -batch` and both resolvers serve the names after one reload, with the
    /// current TTL. Listen with [`World::listen_tcp_any`] to accept on all of them.
    pub fn rotating_pool(
        &self,
        domain: &str,
        count: usize,
        v4_per_name: usize,
        v6: bool,
    ) -> Vec<PoolName> {
        assert!(v4_per_name > 0 || v6, "a pool name needs an address");
        let pool: Vec<PoolName> = (0..count)
            .map(|i| {
                let mut addrs: Vec<IpAddr> = (0..v4_per_name)
                    .map(|j| pool_v4(i * v4_per_name + j))
                    .collect();
                if v6 {
                    addrs.push(pool_v6(i));
                }
                PoolName {
                    name: format!("r{i}.{domain}"),
                    addrs,
                }
            })
            .collect();
        let mut hosts: Vec<IpAddr> = pool.iter().flat_map(|p| p.addrs.clone()).collect();
        hosts.sort();
        hosts.dedup();
        self.add_hosts(&hosts);
        let records: Vec<(String, Vec<IpAddr>)> = pool
            .iter()
            .map(|p| (p.name.clone(), p.addrs.clone()))
            .collect();
        self.dns_set_many(&records, self.dns_ttl());
        pool
    }
}
