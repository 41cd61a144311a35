//! Red team (session 10) on `egress-fence exec`: what CMD inherits besides its standard
//! descriptors. exec started the inside with every descriptor not marked close-on-exec, and
//! the inside started CMD with them: the daemon's netfilter sockets (libmnl opens them without
//! SOCK_CLOEXEC), and whatever exec's caller left open. A socket of that caller's namespace
//! (socket activation's, or a careless parent's) sends past the fence: the fence is a table
//! of CMD's namespace, and that socket's packets never meet it.

use std::net::UdpSocket;
use std::os::fd::AsRawFd;
use std::time::Duration;

use nix::fcntl::{FcntlArg, FdFlag, fcntl};

use crate::common::exec::*;
use crate::common::*;

/// A port of a refused host that the policy never opens.
const REFUSED_PORT: u16 = 4242;

/// CMD names every open descriptor past 2 (`fd N TARGET`; fstat opens none of its own), then
/// sends `inherited` through descriptor FD to ADDR port 4242 and says `sent` or the error.
const SCRIPT: &str = r#"
python3 - <<'PY'
import os, socket
for fd in range(3, 1024):
    try:
        os.fstat(fd)
    except OSError:
        continue
    print('fd', fd, os.readlink('/proc/self/fd/%d' % fd))
try:
    s = socket.socket(fileno=$FD)
    s.sendto(b'inherited', ('$ADDR', 4242))
    print('sent')
except OSError as e:
    print('send failed:', e)
PY
exit 0"#;

/// A UDP socket of exec's own namespace (the sandbox, exec's "host" here) is left open, not
/// close-on-exec, by exec's caller. CMD must hold nothing but stdin, stdout and stderr, and
/// nothing it sends may reach the refused host.
#[test]
fn cmd_inherits_no_descriptor_but_its_standard_ones() {
    let w = World::new();
    let policy = setup(&w);
    let outside = w.listen_udp(OTHER_V4, REFUSED_PORT);
    let socket = w
        .in_sandbox_ns(|| UdpSocket::bind((SANDBOX_V4, 0)))
        .expect("a UDP socket in the sandbox");
    // As a descriptor a caller forgot is: every child of this test process inherits it
    // while it lives (a UDP socket bound to a free port: harmless to the other tests).
    fcntl(&socket, FcntlArg::F_SETFD(FdFlag::empty())).expect("clear close-on-exec");
    let script = SCRIPT
        .replace("$ADDR", &OTHER_V4.to_string())
        .replace("$FD", &socket.as_raw_fd().to_string());
    let out = exec(&w, &policy, &["--user", "nobody"], &script);
    let text = stdout_of(&out);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let arrived = outside.wait_for(1, Duration::from_secs(2));
    let held: Vec<&str> = text.lines().filter(|l| l.starts_with("fd ")).collect();
    assert!(
        held.is_empty() && !arrived,
        "CMD held {held:?}; the refused host got {} datagram(s)\n{}",
        outside.count(),
        show(&out)
    );
    drop(socket);
}
