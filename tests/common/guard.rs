//! The DNS guard's side of the world: where it listens, the sandbox's resolv.conf pointed at
//! it, and a guard daemon started and serving.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use super::process::Background;
use super::world::World;

/// Where the guard listens by default (`dns.listen: [127.0.0.53:53]`), in the sandbox.
pub const GUARD_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 53));
/// The guard's default listen address and port.
pub const GUARD_ADDR: SocketAddr = SocketAddr::new(GUARD_V4, 53);

impl World {
    /// `egress-fence run POLICY` in the sandbox, once its DNS guard serves (the policy must be
    /// in guard mode). Runs as root, so the table lets uid 0 reach the upstream resolvers.
    pub fn spawn_guard(&self, policy_path: &str) -> Background {
        let mut daemon = self.spawn_egress_fence(&["run", policy_path]);
        if !daemon.wait_for_output("the DNS guard is serving", Duration::from_secs(10)) {
            let _ = daemon.terminate();
            panic!("the guard did not start:\n{}", daemon.stderr());
        }
        daemon
    }

    /// Points the sandbox's resolv.conf at the DNS guard ([`GUARD_V4`]).
    pub fn use_guard_resolver(&self) {
        self.set_sandbox_nameserver(GUARD_V4);
    }
}
