//! The threat model's adversary (a process in the sandbox without CAP_NET_ADMIN), and a
//! capture of the frames that reach the world's side of the sandbox's link.

use std::time::Duration;

use super::process::{Background, CmdOutput, within};
use super::world::World;

/// The uid (and gid) of sandbox clients that must not pass as the guard: the guard runs as
/// root in the tests, and the table lets the guard's uid alone reach the upstream resolvers.
pub const NOBODY: u32 = 65534;

/// The system's python3, for scripts run in the namespaces: a user's shims (e.g. pyenv under
/// /root) are not readable by [`NOBODY`] or another user.
pub const PYTHON: &str = "/usr/bin/python3";

/// Counts the frames of ETHERTYPE arriving on veth0 (the sandbox's link, seen from the
/// world's network) that carry MARKER, for SECONDS; creates READY_FILE once bound. Prints the
/// count. Arguments: SECONDS READY_FILE MARKER ETHERTYPE.
const COUNT_MARKED_FRAMES: &str = r#"
import socket, sys, time
seconds, ready, marker = float(sys.argv[1]), sys.argv[2], sys.argv[3].encode()
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(int(sys.argv[4], 0)))
s.bind(('veth0', 0))
s.settimeout(0.2)
open(ready, 'w').close()
end, count = time.time() + seconds, 0
while time.time() < end:
    try:
        frame, addr = s.recvfrom(65535)
    except socket.timeout:
        continue
    if addr[2] != socket.PACKET_OUTGOING and marker in frame:
        count += 1
print(count)
"#;

impl World {
    /// Runs `during` while counting, for `seconds`, the frames of `ethertype` (0x0800 for
    /// IPv4, 0x86dd for IPv6) that reach the world's side of the sandbox's link carrying
    /// `marker`; returns the capture's output (the count on stdout) and what `during` gave.
    pub fn count_marked_frames<T: Send>(
        &self,
        ethertype: u16,
        marker: &str,
        seconds: u32,
        during: impl FnOnce() -> T + Send,
    ) -> (CmdOutput, T) {
        let ready = self.dir().join(format!("capture-ready-{marker}"));
        // A capture of the same marker before left its file: waiting on that one would send
        // before this capture is bound, and count nothing.
        match std::fs::remove_file(&ready) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("removing {}: {e}", ready.display()),
        }
        let ready_arg = ready.to_str().expect("utf-8 path").to_string();
        let (seconds, ethertype) = (seconds.to_string(), format!("{ethertype:#x}"));
        std::thread::scope(|scope| {
            let capture = scope.spawn(|| {
                self.net_cmd(&[
                    PYTHON,
                    "-c",
                    COUNT_MARKED_FRAMES,
                    &seconds,
                    &ready_arg,
                    marker,
                    &ethertype,
                ])
            });
            assert!(
                within(Duration::from_secs(5), || ready.exists()),
                "the capture did not start"
            );
            let during = during();
            (capture.join().expect("the capture thread"), during)
        })
    }
}

/// The first lines of a `python3 -c` script run as an [`Adversary`]: it exits non-zero when
/// CAP_NET_ADMIN is effective (then it is not the threat model's adversary and the test would
/// prove nothing). Imports `sys` and leaves the effective set in `cap_eff` for further checks
/// (CAP_NET_RAW is bit 13). Prepend it: `format!("{REFUSE_CAP_NET_ADMIN_PY}{SCRIPT}")`.
pub const REFUSE_CAP_NET_ADMIN_PY: &str = r#"
import sys
status = open('/proc/self/status').read().split('\n')
cap_eff = int([l for l in status if l.startswith('CapEff:')][0].split()[1], 16)
if cap_eff & (1 << 12):
    sys.exit('CAP_NET_ADMIN is effective')
"#;

/// The Internet checksum (RFC 1071, an odd length padded) for `python3 -c` scripts that
/// write packets by hand; imports `struct`. Put it first:
/// `const SCRIPT: &str = concat!(crate::inet_checksum_py!(), r#"..."#);`.
#[macro_export]
macro_rules! inet_checksum_py {
    () => {
        r#"
import struct
def checksum(data):
    data += b'\0' * (len(data) % 2)
    s = sum(struct.unpack('!%dH' % (len(data) // 2), data))
    while s >> 16:
        s = (s & 0xffff) + (s >> 16)
    return ~s & 0xffff
"#
    };
}

/// A process inside the fence as the threat model has it: it lacks CAP_NET_ADMIN. Tests start
/// it as root in the sandbox and `setpriv` makes it the adversary before it execs
/// ([`World::adversary_cmd`], [`World::spawn_adversary`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adversary {
    /// An unprivileged user: uid and gid [`NOBODY`], no supplementary groups.
    Nobody,
    /// An unprivileged user with uid and gid N, no supplementary groups (another client than
    /// [`Adversary::Nobody`]).
    User(u32),
    /// uid 0 without CAP_NET_ADMIN that keeps CAP_NET_RAW: root in a container by Docker's
    /// default.
    RootWithoutNetAdmin,
    /// uid 0 without CAP_NET_ADMIN and CAP_NET_RAW (either may set a socket mark): root in a
    /// container that drops both, as the README advises.
    RootWithoutNetAdminOrNetRaw,
}

impl Adversary {
    /// `args` prefixed with the `setpriv` command that turns a root process into this
    /// adversary before it execs them.
    pub fn command(self, args: &[&str]) -> Vec<String> {
        let user = |uid: u32| {
            vec![
                format!("--reuid={uid}"),
                format!("--regid={uid}"),
                "--clear-groups".to_string(),
            ]
        };
        let without = |caps: &str| {
            vec![
                format!("--inh-caps={caps}"),
                format!("--bounding-set={caps}"),
            ]
        };
        let mut full = vec!["setpriv".to_string()];
        full.extend(match self {
            Adversary::Nobody => user(NOBODY),
            Adversary::User(uid) => user(uid),
            Adversary::RootWithoutNetAdmin => without("-net_admin"),
            Adversary::RootWithoutNetAdminOrNetRaw => without("-net_admin,-net_raw"),
        });
        full.push("--".into());
        full.extend(args.iter().map(|a| a.to_string()));
        full
    }
}

impl World {
    /// Runs `args` inside the sandbox as `who`, and waits for it (killed after 60 s).
    pub fn adversary_cmd(&self, who: Adversary, args: &[&str]) -> CmdOutput {
        let full = who.command(args);
        self.sandbox_cmd(&full.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// Starts `args` inside the sandbox as `who` in the background; killed when the handle
    /// drops.
    pub fn spawn_adversary(&self, who: Adversary, args: &[&str]) -> Background {
        let full = who.command(args);
        self.spawn_in_sandbox(&full.iter().map(String::as_str).collect::<Vec<_>>())
    }
}
