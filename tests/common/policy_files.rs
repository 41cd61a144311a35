//! Policy files for the tests of what `run` reads again on a reload (`path_trust`, the policy
//! file's owner and mode): two names with a listener each, one allowed at the start and one a
//! fenced user would put in its place, and root's directories under the world's one.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::Duration;

use super::{Background, DEFAULT_DNS_TTL, HOST_V4, HOST2_V4, Listener, World, path_arg};

/// A policy allowing `name` on port 443 (resolvers: the world's dnsmasq).
pub fn policy_allowing(name: &str) -> String {
    format!(
        "version: 1\nallow:\n  - domain: {name}\n    ports: [443]\ndns:\n  resolvers: [192.0.2.53]\n"
    )
}

/// `old.example.com` (HOST_V4, the policy's at the start) and `new.example.com` (HOST2_V4,
/// the one a fenced user would put there), each with a listener on port 443. Keep the
/// listeners for the test.
pub fn old_and_new_names_listened_on(w: &World) -> [Listener; 2] {
    w.dns_set("old.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    w.dns_set("new.example.com", &[HOST2_V4], DEFAULT_DNS_TTL);
    [w.listen_tcp(HOST_V4, 443), w.listen_tcp(HOST2_V4, 443)]
}

/// A directory `name` of root's with `mode` under the world's directory, which `nobody` may
/// now pass through (0711) but not write.
pub fn roots_dir_nobody_may_reach(w: &World, name: &str, mode: u32) -> PathBuf {
    std::fs::set_permissions(w.dir(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let dir = w.dir().join(name);
    std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {name}: {e}"));
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).expect("chmod");
    dir
}

/// `egress-fence run POLICY`, once its policy's addresses are allowed.
pub fn run_started(w: &World, policy: &std::path::Path) -> Background {
    let mut daemon = w.spawn_egress_fence(&["run", path_arg(policy)]);
    assert!(
        daemon.wait_for_output("new addresses allowed", Duration::from_secs(15)),
        "the daemon did not start:\n{}",
        daemon.stderr()
    );
    daemon
}
