//! This host and process as the current network namespace shows them: the addresses of its
//! interfaces, which no DNS answer may make an element of (see [`crate::core::installable`]),
//! and the uid the guard runs as.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::core::guard_identity::GuardIdentity;
use crate::core::installable::HostAddrs;
use crate::core::policy::Policy;

/// The guard of `policy` as this process runs it: `None` unless the policy is in guard mode.
///
/// The one place that reads the guard's uid: this process's effective uid, the uid `run`
/// keeps (the systemd unit's `DynamicUser=` gives it one of its own). `plan` and `apply` name
/// the uid of whoever runs them, which is the service's only when that is the same user.
pub fn guard_identity(policy: &Policy) -> Option<GuardIdentity> {
    GuardIdentity::of_policy(policy, nix::unistd::geteuid().as_raw())
}

/// The interfaces' addresses now (getifaddrs).
pub fn read_addrs() -> Result<HostAddrs, nix::Error> {
    let ip = |s: Option<nix::sys::socket::SockaddrStorage>| -> Option<IpAddr> {
        let s = s?;
        if let Some(v4) = s.as_sockaddr_in() {
            return Some(IpAddr::V4(v4.ip()));
        }
        s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
    };
    let interfaces = nix::ifaddrs::getifaddrs()?.filter_map(|i| {
        let addr = ip(i.address)?;
        Some((addr, ip(i.netmask), ip(i.broadcast)))
    });
    Ok(HostAddrs::from_interfaces(interfaces.collect::<Vec<_>>()))
}

/// Reads the interfaces, or, when that fails, knows none (the address classes still apply)
/// and says so.
pub fn read_addrs_or_warn() -> HostAddrs {
    read_addrs().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot read this host's addresses; answers are checked \
                        without them");
        HostAddrs::none()
    })
}

/// How long the host's addresses are taken as read: they come and go, but reading them for
/// every answer or datagram would cost a netlink dump each.
const HOST_ADDRS_FOR: Duration = Duration::from_secs(5);

/// [`HostAddrs`] read again at most every `HOST_ADDRS_FOR`: what the guard's serving tasks
/// and the daemon check answers and clients against.
#[derive(Debug)]
pub struct HostAddrsCache {
    addrs: HostAddrs,
    read: Instant,
}

impl HostAddrsCache {
    pub fn new() -> HostAddrsCache {
        HostAddrsCache {
            addrs: read_addrs_or_warn(),
            read: Instant::now(),
        }
    }

    pub fn current(&mut self) -> &HostAddrs {
        if self.read.elapsed() >= HOST_ADDRS_FOR {
            self.read = Instant::now();
            match read_addrs() {
                Ok(addrs) => self.addrs = addrs,
                // The last ones read are still the best guess.
                Err(e) => tracing::debug!(error = %e, "reading the host's addresses"),
            }
        }
        &self.addrs
    }
}

impl Default for HostAddrsCache {
    fn default() -> Self {
        HostAddrsCache::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reading_the_interfaces_finds_loopback() {
        let host = read_addrs().expect("getifaddrs");
        assert!(host.is_own("127.0.0.1".parse().unwrap()), "{host:?}");
    }
}
