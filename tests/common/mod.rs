//! The integration-test "world": a throwaway pair of network namespaces that plays a sandbox host
//! and the internet it talks to.
//!
//! ```text
//!   sandbox netns (policies are applied here)          net netns ("the internet")
//!   eth0 198.51.100.2/24, 2001:db8:ffff::2/64  <veth>  veth0 198.51.100.1/24, 2001:db8:ffff::1/64
//!   default routes via the net side                    lo: test hosts (192.0.2.x, 203.0.113.x,
//!   /etc/netns/<sandbox>/resolv.conf -> 192.0.2.53         2001:db8:1::x, 2001:db8:2::x,
//!                                                          169.254.169.254, fd00:ec2::254)
//!                                                      dnsmasq on 192.0.2.53 + 2001:db8:1::53
//!                                                      rogue dnsmasq on 192.0.2.54 + 2001:db8:1::54
//!                                                      TCP/UDP listeners (threads of the test)
//! ```
//!
//! Everything is created inside namespaces this module makes and is removed by [`World`]'s
//! `Drop`, even when the test panics. Nothing is ever configured in the root network namespace.
//! The host addresses live on `lo` of the net namespace (this kernel has no `dummy` driver).
//!
//! Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and the tools `ip` (iproute2), `dnsmasq`
//! (dnsmasq-base), `dig` (dnsutils), `nc` (netcat-openbsd), `curl`, `nft` (nftables), `bash`,
//! `timeout` and `stdbuf` (coreutils) and `setpriv` (util-linux). Worlds are independent, so
//! tests using them may run in parallel.
//!
//! For the DNS guard (its tests are in tests/guard.rs) a world also has: a rotating pool of
//! test addresses served as many names at once ([`World::rotating_pool`]), a listener on every
//! address ([`World::listen_tcp_any`]), CNAMEs ([`World::dns_cname`]), the sandbox's
//! resolv.conf pointed at the guard ([`World::use_guard_resolver`]), clients as another uid
//! ([`World::sandbox_cmd_as`], [`World::dig_as`]), the resolved sets' elements with their
//! timeouts ([`World::set_elements`]) and a DNS client for the sandbox ([`dns_ask`]).
//!
//! One file per concern: `world` (namespaces, veth, hosts, cleanup), `addrs`, `resolvers`
//! (dnsmasq), `listener`, `clients` (commands, nc, dig, curl in the sandbox), `process`
//! (running commands, background processes, polling), `adversary`, `guard`, `pool`, `nft`
//! (reading the ruleset back), `egress_fence` (running the binary, the notify socket),
//! `policy_files` (policies `run` reloads, root's directories) and `dns_client`. Everything public is re-exported here: tests `use common::*`.
#![allow(dead_code)]

mod addrs;
mod adversary;
mod clients;
mod dns_client;
mod egress_fence;
pub mod exec;
mod guard;
mod listener;
mod nft;
mod policy_files;
mod pool;
mod process;
mod resolvers;
mod scope;
mod world;

// Each test binary uses a part of the harness.
#[allow(unused_imports)]
pub use {
    addrs::*, adversary::*, clients::*, dns_client::*, egress_fence::*, guard::*, listener::*,
    nft::*, policy_files::*, pool::*, process::*, resolvers::*, scope::*, world::*,
};
