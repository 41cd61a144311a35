//! The essentials block of the output chain, attacked from inside the sandbox: DHCP ports
//! bound by anyone (issue 10, item 4) and DHCP datagrams as a bulk channel (red-team
//! review), MLD reports as a channel (item 5), and IPv6 routing headers and IPv4 options
//! (malformed source routes included) that carry a packet past the destination the fence
//! checks (item 8, red-team review).

use std::net::{IpAddr, Ipv6Addr, UdpSocket};
use std::time::Duration;

use egress_fence::core::ruleset::{DHCP_CLIENT_LIMIT, MLD_REPORT_LIMIT};

use crate::common::*;

/// Allows UDP 7000 to one host per family; denies the metadata services.
const POLICY: &str = r#"
version: 1
action: reject
allow:
  - cidr: 192.0.2.10/32          # HOST_V4
    ports: [7000]
    protocol: udp
  - cidr: 2001:db8:1::10/128     # HOST_V6; OTHER_V6 is not allowed
    ports: [7000]
    protocol: udp
deny:
  - preset: cloud-metadata
dns:
  resolvers: [192.0.2.53]
"#;

const ALLOWED_PORT: u16 = 7000;

/// Sends `COUNT` datagrams to DST:DPORT from source port SPORT and prints `sent N refused M`.
/// Run after [`REFUSE_CAP_NET_ADMIN_PY`]. Exits non-zero when the port cannot be bound (then
/// the test would prove nothing).
const SEND_FROM_PORT: &str = r#"
import socket, sys
dst, dport, sport, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
v6 = ':' in dst
s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
s.bind(('::' if v6 else '0.0.0.0', sport))
scope = socket.if_nametoindex('eth0') if dst.lower().startswith('ff02') else 0
to = (dst, dport, 0, scope) if v6 else (dst, dport)
sent = refused = 0
for _ in range(count):
    try:
        s.sendto(b'DHCP-shaped datagram from the sandbox', to)
        sent += 1
    except PermissionError:
        refused += 1
print('sent', sent, 'refused', refused)
"#;

/// A world with [`POLICY`] applied, and ports below 1024 open to every user of the sandbox
/// (as inside Docker and Podman containers).
fn fenced_world() -> World {
    let w = World::new();
    let sysctl = w.sandbox_cmd(&["sysctl", "-w", "net.ipv4.ip_unprivileged_port_start=0"]);
    assert!(sysctl.success(), "{sysctl}");
    apply(&w);
    w
}

fn apply(w: &World) {
    w.apply_policy(POLICY);
}

/// `(sent, refused)` of [`SEND_FROM_PORT`].
fn send_from_port(
    w: &World,
    who: Adversary,
    dst: IpAddr,
    dport: u16,
    sport: u16,
    count: u32,
) -> (u32, u32) {
    let (dst, dport, sport, n) = (
        dst.to_string(),
        dport.to_string(),
        sport.to_string(),
        count.to_string(),
    );
    let script = format!("{REFUSE_CAP_NET_ADMIN_PY}{SEND_FROM_PORT}");
    let out = w.adversary_cmd(who, &[PYTHON, "-c", &script, &dst, &dport, &sport, &n]);
    assert!(out.success(), "{who:?} sending to {dst}:{dport}: {out}");
    let words: Vec<&str> = out.stdout.split_whitespace().collect();
    match words.as_slice() {
        ["sent", sent, "refused", refused] => (
            sent.parse().expect("a count"),
            refused.parse().expect("a count"),
        ),
        _ => panic!("unexpected output: {out}"),
    }
}

#[test]
fn dhcp_client_ports_reach_neither_the_metadata_service_nor_any_host() {
    let w = fenced_world();
    let targets = [
        (METADATA_V4, 67, 68),
        (HOST_V4, 67, 68),
        (OTHER_V4, 67, 68),
        (METADATA_V6, 547, 546),
        (HOST_V6, 547, 546),
        (OTHER_V6, 547, 546),
    ];
    let listeners: Vec<Listener> = targets
        .iter()
        .map(|&(ip, port, _)| w.listen_udp(ip, port))
        .collect();
    for who in [Adversary::Nobody, Adversary::RootWithoutNetAdmin] {
        for &(dst, dport, sport) in &targets {
            let (sent, refused) = send_from_port(&w, who, dst, dport, sport, 1);
            assert_eq!(
                (sent, refused),
                (0, 1),
                "{who:?} from port {sport} to {dst}:{dport} must be refused at once"
            );
        }
    }
    for (l, (ip, port, _)) in listeners.iter().zip(targets) {
        assert!(
            !l.wait_for(1, Duration::from_millis(300)),
            "a datagram from a DHCP client port reached {ip}:{port}: {:?}",
            l.hits()
        );
    }
}

#[test]
fn a_dhcp_shaped_broadcast_leaves_within_its_rate_limit() {
    let w = fenced_world();
    // DHCPv4: the limited broadcast reaches the link (a socket bound to the broadcast address
    // in the net namespace receives it).
    let broadcast = w.listen_udp(IpAddr::V4(std::net::Ipv4Addr::BROADCAST), 67);
    let (sent, _) = send_from_port(
        &w,
        Adversary::Nobody,
        broadcast.local_addr().ip(),
        67,
        68,
        1,
    );
    assert_eq!(sent, 1);
    assert!(
        broadcast.wait_for(1, Duration::from_secs(3)),
        "the DHCP-shaped broadcast did not leave"
    );

    // DHCPv6: All_DHCP_Relay_Agents_and_Servers on the link.
    let group: Ipv6Addr = "ff02::1:2".parse().expect("an address");
    let server = w.in_net_ns(|| {
        let s = UdpSocket::bind("[::]:547").expect("bind [::]:547 in the net namespace");
        let ifindex = nix::net::if_::if_nametoindex("veth0").expect("veth0 in the net namespace");
        s.join_multicast_v6(&group, ifindex)
            .expect("join ff02::1:2 on veth0");
        s.set_read_timeout(Some(Duration::from_secs(3)))
            .expect("a read timeout");
        s
    });
    let (sent, _) = send_from_port(&w, Adversary::Nobody, IpAddr::V6(group), 547, 546, 1);
    assert_eq!(sent, 1);
    let mut buf = [0u8; 512];
    let (n, from) = server
        .recv_from(&mut buf)
        .expect("the DHCPv6-shaped datagram to ff02::1:2 did not leave");
    assert!(buf[..n].starts_with(b"DHCP-shaped"), "from {from}");
    // The byte budget all senders share: see
    // dhcp_essentials_carry_no_bulk_datagrams_and_stay_within_their_byte_budget.
}

/// Joins N groups ff0e::e5ca:I (I < N) on the sandbox's eth0 and holds them SECONDS.
const JOIN_GROUPS: &str = r#"
import socket, struct, sys, time
n, hold = int(sys.argv[1]), float(sys.argv[2])
ifindex = socket.if_nametoindex('eth0')
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
for i in range(n):
    group = socket.inet_pton(socket.AF_INET6, 'ff0e::e5ca:%x' % i)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP, group + struct.pack('@I', ifindex))
print('joined', n, flush=True)
time.sleep(hold)
"#;

/// Captures MLDv2 reports arriving on veth0 for SECONDS, one JSON line per report: its length
/// (IPv6 header included, as the kernel's byte limit counts it) and its groups. Creates
/// READY_FILE once the capture socket is bound.
const CAPTURE_MLD: &str = r#"
import json, socket, sys, time
seconds, ready = float(sys.argv[1]), sys.argv[2]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x86dd))
s.bind(('veth0', 0))
s.settimeout(0.2)
open(ready, 'w').close()
end = time.time() + seconds
while time.time() < end:
    try:
        frame, addr = s.recvfrom(65535)
    except socket.timeout:
        continue
    if addr[2] == socket.PACKET_OUTGOING:
        continue
    ip = frame[14:]
    if len(ip) < 40:
        continue
    length, nh, off = 40 + int.from_bytes(ip[4:6], 'big'), ip[6], 40
    while nh in (0, 43, 60) and off + 2 <= len(ip):
        nh, off = ip[off], off + (ip[off + 1] + 1) * 8
    if nh != 58 or off >= len(ip) or ip[off] != 143:
        continue
    icmp = ip[off:]
    p, groups = 8, []
    for _ in range(int.from_bytes(icmp[6:8], 'big')):
        if p + 20 > len(icmp):
            break
        groups.append(icmp[p + 4:p + 20].hex())
        p += 20 + int.from_bytes(icmp[p + 2:p + 4], 'big') * 16 + icmp[p + 1] * 4
    print(json.dumps({'len': length, 'groups': groups}), flush=True)
"#;

#[test]
fn mld_reports_of_chosen_groups_stay_within_their_byte_budget() {
    let w = fenced_world();
    const GROUPS: u32 = 300;
    const CAPTURE_SECS: u64 = 8;
    let ready = w.dir().join("mld-capture-ready");
    let ready_arg = ready.to_str().expect("utf-8 path").to_string();
    let secs = CAPTURE_SECS.to_string();
    let started = std::time::Instant::now();
    let (capture, joined) = std::thread::scope(|scope| {
        let capture = scope.spawn(|| w.net_cmd(&[PYTHON, "-c", CAPTURE_MLD, &secs, &ready_arg]));
        assert!(
            within(Duration::from_secs(5), || ready.exists()),
            "the capture did not start"
        );
        let n = GROUPS.to_string();
        let joined = w.sandbox_cmd_as(NOBODY, &[PYTHON, "-c", JOIN_GROUPS, &n, "4"]);
        (capture.join().expect("the capture thread"), joined)
    });
    assert!(joined.success(), "join: {joined}");
    assert!(capture.success(), "capture: {capture}");

    let mut bytes = 0u64;
    let mut chosen = 0u64;
    let mut reports = 0u64;
    for line in capture.stdout.lines() {
        let report: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        reports += 1;
        bytes += report["len"].as_u64().expect("a length");
        chosen += report["groups"]
            .as_array()
            .expect("groups")
            .iter()
            .filter(|g| {
                g.as_str()
                    .is_some_and(|g| g.starts_with("ff0e00000000000000000000e5ca"))
            })
            .count() as u64;
    }
    // The table's budget: a bucket of rate + burst bytes, refilled at the rate (1 KiB a
    // minute on top of 1 KiB + 1500 bytes) for as long as the reports could be sent: the
    // capture's time, longer than CAPTURE_SECS on a loaded machine.
    let limit = MLD_REPORT_LIMIT;
    let per_second = limit.count / limit.per.seconds();
    let secs_sent = started.elapsed().as_secs().max(CAPTURE_SECS) + 1;
    let budget = limit.count + u64::from(limit.burst) + per_second * secs_sent + 1;
    eprintln!("{reports} MLD reports, {bytes} bytes, {chosen} records of chosen groups left");
    assert!(
        reports >= 1,
        "the first report fits the budget and must leave (switches that snoop MLD need it)"
    );
    assert!(
        bytes <= budget,
        "{bytes} bytes of MLD reports left, more than the budget of {budget}"
    );
    // Each record is 20 bytes: the chosen groups that left are bounded by the budget too.
    assert!(chosen * 20 <= budget, "{chosen} chosen groups left");
    assert!(chosen < u64::from(GROUPS) * 2);
}

/// Sends one datagram to FIRST:PORT without a routing header (and waits for its echo, so the
/// flow is established), then from the same socket one to FINAL:PORT whose segment routing
/// header lists FIRST as the first segment, then the same from a fresh socket. Prints what
/// the kernel let through, e.g. `plain sent established refused new refused`.
const SEND_WITH_ROUTING_HEADER: &str = r#"
import socket, struct, sys
first, final, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def srh():
    # Segment routing header (RFC 8754), type 4: segments[0] is the final destination (the
    # kernel writes the address given to sendto there), the packet goes first to
    # segments[segments_left].
    segments = [final, first]
    head = struct.pack('!BBBBBBH', 0, 2 * len(segments), 4, len(segments) - 1,
                       len(segments) - 1, 0, 0)
    return head + b''.join(socket.inet_pton(socket.AF_INET6, a) for a in segments)
def send(s, to):
    try:
        s.sendto(b'routed past the fence', (to, port))
        return 'sent'
    except PermissionError:
        return 'refused'
out = []
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.settimeout(2)
if sys.argv[4] == 'with-flow':
    out += ['plain', send(s, first)]
    s.recv(100)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RTHDR, srh())
out += ['established' if sys.argv[4] == 'with-flow' else 'routed', send(s, final)]
fresh = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
fresh.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RTHDR, srh())
out += ['new', send(fresh, final)]
print(' '.join(out))
"#;

#[test]
fn a_routing_header_cannot_carry_a_packet_past_the_checked_destination() {
    let w = World::new();
    // The net side follows segment routing headers, as a router on the path may.
    for key in ["all", "veth0"] {
        let sysctl = w.net_cmd(&[
            "sysctl",
            "-w",
            &format!("net.ipv6.conf.{key}.seg6_enabled=1"),
        ]);
        assert!(sysctl.success(), "{sysctl}");
    }
    let first_hop = w.listen_udp(HOST_V6, ALLOWED_PORT);
    let hidden = w.listen_udp(OTHER_V6, ALLOWED_PORT);
    let (first, final_, port) = (
        HOST_V6.to_string(),
        OTHER_V6.to_string(),
        ALLOWED_PORT.to_string(),
    );
    let send = |mode: &str| {
        let out = w.sandbox_cmd_as(
            NOBODY,
            &[
                PYTHON,
                "-c",
                SEND_WITH_ROUTING_HEADER,
                &first,
                &final_,
                &port,
                mode,
            ],
        );
        assert!(out.success(), "{out}");
        out.stdout.trim().to_string()
    };

    // Without the fence the path works: both routed datagrams reach the final destination.
    assert_eq!(send("no-flow"), "routed sent new sent");
    assert!(
        hidden.wait_for(2, Duration::from_secs(3)),
        "the routed datagrams did not arrive unfenced: the test proves nothing"
    );
    assert_eq!(first_hop.count(), 0, "the first hop passed them on");

    apply(&w);
    let before = hidden.count();
    assert_eq!(
        send("with-flow"),
        "plain sent established refused new refused"
    );
    assert!(
        first_hop.wait_for(1, Duration::from_secs(2)),
        "the plain datagram"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        hidden.count(),
        before,
        "a routing header carried a datagram to a destination the policy does not allow"
    );
    assert_eq!(
        first_hop.count(),
        1,
        "only the plain datagram reaches the first hop"
    );
    // nft, as an independent reader, shows the refusal first in the chain.
    let list = w.sandbox_cmd(&["nft", "list", "chain", "inet", "egress_fence", "output"]);
    let rules: Vec<&str> = list
        .stdout
        .lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty()
                && !l.starts_with("table")
                && !l.starts_with("chain")
                && !l.starts_with("type")
        })
        .collect();
    assert_eq!(
        rules[..2],
        [
            "ip hdrlength != 5 goto refused",
            "exthdr rt exists goto refused"
        ],
        "{list}"
    );
}

/// The IPv4 twin of [`SEND_WITH_ROUTING_HEADER`]: a loose source route option (IP_OPTIONS,
/// which needs CAP_NET_RAW: root in a container has it by default) lists FIRST as the first
/// hop of a datagram to FINAL.
const SEND_WITH_SOURCE_ROUTE: &str = r#"
import socket, sys
first, final, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
# NOP, then LSRR (131) of length 7 with pointer 4 and one hop; the kernel appends FINAL.
lsrr = bytes([1, 131, 7, 4]) + socket.inet_aton(first)
def send(s, to):
    try:
        s.sendto(b'routed past the fence', (to, port))
        return 'sent'
    except PermissionError:
        return 'refused'
out = []
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
if sys.argv[4] == 'with-flow':
    out += ['plain', send(s, first)]
    s.recv(100)
s.setsockopt(socket.IPPROTO_IP, socket.IP_OPTIONS, lsrr)
out += ['established' if sys.argv[4] == 'with-flow' else 'routed', send(s, final)]
fresh = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
fresh.setsockopt(socket.IPPROTO_IP, socket.IP_OPTIONS, lsrr)
out += ['new', send(fresh, final)]
print(' '.join(out))
"#;

/// A world (no table yet) whose net side follows IPv4 source routes, as a misconfigured
/// router on the path may.
fn world_following_source_routes() -> World {
    let w = World::new();
    for key in ["all", "lo", "veth0"] {
        let sysctl = w.net_cmd(&[
            "sysctl",
            "-w",
            &format!("net.ipv4.conf.{key}.accept_source_route=1"),
        ]);
        assert!(sysctl.success(), "{sysctl}");
    }
    w
}

#[test]
fn an_ipv4_source_route_cannot_carry_a_packet_past_the_checked_destination() {
    let w = world_following_source_routes();
    let first_hop = w.listen_udp(HOST_V4, ALLOWED_PORT);
    let hidden = w.listen_udp(OTHER_V4, ALLOWED_PORT);
    let (first, final_, port) = (
        HOST_V4.to_string(),
        OTHER_V4.to_string(),
        ALLOWED_PORT.to_string(),
    );
    let send = |mode: &str| {
        let out = w.adversary_cmd(
            Adversary::RootWithoutNetAdmin,
            &[
                PYTHON,
                "-c",
                SEND_WITH_SOURCE_ROUTE,
                &first,
                &final_,
                &port,
                mode,
            ],
        );
        assert!(out.success(), "{out}");
        out.stdout.trim().to_string()
    };

    assert_eq!(send("no-flow"), "routed sent new sent");
    assert!(
        hidden.wait_for(2, Duration::from_secs(3)),
        "the source-routed datagrams did not arrive unfenced: the test proves nothing"
    );

    apply(&w);
    let (before_hidden, before_first) = (hidden.count(), first_hop.count());
    assert_eq!(
        send("with-flow"),
        "plain sent established refused new refused"
    );
    assert!(
        first_hop.wait_for(before_first + 1, Duration::from_secs(2)),
        "the plain datagram"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        hidden.count(),
        before_hidden,
        "a source route carried a datagram to a destination the policy does not allow"
    );
    assert_eq!(first_hop.count(), before_first + 1);
}

/// Writes ICMPv6 messages of the neighbour discovery and MLD types (RS, NS, NA, MLDv2 report)
/// carrying a marker, from a raw socket, to each DST; prints `sent N refused M`. Run after
/// [`REFUSE_CAP_NET_ADMIN_PY`]; exits non-zero unless CAP_NET_RAW is effective and
/// CAP_NET_ADMIN is not (root in a container).
const WRITE_ICMPV6: &str = r#"
import socket, sys
if not cap_eff & (1 << 13):
    sys.exit('want CAP_NET_RAW without CAP_NET_ADMIN, have %x' % cap_eff)
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
scope = socket.if_nametoindex('eth0')
sent = refused = 0
for dst in sys.argv[1:]:
    for kind in (133, 135, 136, 143):
        message = bytes([kind, 0, 0, 0, 0, 0, 0, 0]) + b'written-by-a-process ' * 40
        try:
            s.sendto(message, (dst, 0, 0, scope if dst.startswith('ff02') else 0))
            sent += 1
        except PermissionError:
            refused += 1
print('sent', sent, 'refused', refused)
"#;

#[test]
fn icmpv6_written_by_a_process_does_not_pass_as_neighbour_discovery() {
    let w = fenced_world();
    let (host, all_nodes, routers) = (HOST_V6.to_string(), "ff02::1", "ff02::16");
    let write_icmpv6 = format!("{REFUSE_CAP_NET_ADMIN_PY}{WRITE_ICMPV6}");
    let (capture, written) = w.count_marked_frames(0x86dd, "written-by-a-process", 3, || {
        w.adversary_cmd(
            Adversary::RootWithoutNetAdmin,
            &[PYTHON, "-c", &write_icmpv6, &host, all_nodes, routers],
        )
    });
    assert!(written.success(), "{written}");
    assert_eq!(written.stdout.trim(), "sent 0 refused 12", "{written}");
    assert!(capture.success(), "{capture}");
    assert_eq!(
        capture.stdout.trim(),
        "0",
        "ICMPv6 written by a process left the sandbox"
    );

    // The kernel's own neighbour discovery still works: with the neighbour cache emptied,
    // reaching an allowed host needs the gateway's address resolved again.
    let flush = w.sandbox_cmd(&["ip", "-6", "neigh", "flush", "dev", "eth0"]);
    assert!(flush.success(), "{flush}");
    let listener = w.listen_udp(HOST_V6, ALLOWED_PORT);
    let sent = w.udp_send(HOST_V6, ALLOWED_PORT, b"after neighbour discovery");
    assert!(sent.success(), "{sent}");
    assert!(
        listener.wait_for(1, Duration::from_secs(3)),
        "the kernel's neighbour solicitation for the gateway was refused"
    );
}

/// Writes whole IPv4 datagrams on a raw socket (root in a container keeps CAP_NET_RAW): a UDP
/// datagram from SRC to FIRST:PORT carrying the source route option MODE names, whose route
/// ends at FINAL; the payload is MODE. Prints `MODE sent` or `MODE refused` per mode.
/// - `plain`: no option at all (must still pass);
/// - `lsrr4`: loose source route, pointer 4, as the kernel writes it;
/// - `lsrr8`: pointer 8, FIRST listed as "already visited": nft's option parser (the one
///   `setsockopt(IP_OPTIONS)` uses) demands pointer 4 and sees no option;
/// - `lsrr-len10`: a length that is not 4n+3, for the same effect;
/// - `ssrr4`, `ssrr8`: the strict source route, likewise.
///
/// Run after [`REFUSE_CAP_NET_ADMIN_PY`]; exits non-zero unless CAP_NET_RAW is effective and
/// CAP_NET_ADMIN is not.
const WRITE_IPV4_SOURCE_ROUTE: &str = r#"
import socket, struct, sys
if not cap_eff & (1 << 13):
    sys.exit('want CAP_NET_RAW without CAP_NET_ADMIN, have %x' % cap_eff)
src, first, final, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
a, f, b = socket.inet_aton(first), socket.inet_aton(final), socket.inet_aton(src)
def option(mode):
    if mode == 'plain':
        return b''
    kind = 131 if mode.startswith('lsrr') else 137
    if mode.endswith('len10'):
        return bytes([kind, 10, 8]) + a + f[:3] + bytes([0, 0])
    if mode.endswith('8'):
        return bytes([kind, 11, 8]) + a + f + bytes([0])
    return bytes([kind, 7, 4]) + f + bytes([0])
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
out = []
for mode in sys.argv[5:]:
    opt, payload = option(mode), mode.encode()
    udp = struct.pack('>HHHH', 40000, port, 8 + len(payload), 0) + payload
    ihl = 5 + len(opt) // 4
    ip = struct.pack('>BBHHHBBH4s4s', 0x40 | ihl, 0, 4 * ihl + len(udp), 0, 0, 64, 17, 0,
                     b, a) + opt
    try:
        s.sendto(ip + udp, (first, 0))
        out += [mode, 'sent']
    except PermissionError:
        out += [mode, 'refused']
print(' '.join(out))
"#;

/// Issue 10 red-team review: a source route the option match cannot parse (pointer 8, a
/// length that is not 4n+3) counted as no source route, so a datagram whose first hop is
/// allowed went on to a destination the policy does not allow. Every IPv4 packet with options
/// is refused now; plain IPv4 still passes.
#[test]
fn ipv4_packets_with_any_options_are_refused_even_malformed_source_routes() {
    let w = world_following_source_routes();
    let first_hop = w.listen_udp(HOST_V4, ALLOWED_PORT);
    let hidden = w.listen_udp(OTHER_V4, ALLOWED_PORT);
    let (src, first, final_, port) = (
        SANDBOX_V4.to_string(),
        HOST_V4.to_string(),
        OTHER_V4.to_string(),
        ALLOWED_PORT.to_string(),
    );
    let script = format!("{REFUSE_CAP_NET_ADMIN_PY}{WRITE_IPV4_SOURCE_ROUTE}");
    let write = |modes: &[&str]| {
        let mut args = vec![PYTHON, "-c", &script, &src, &first, &final_, &port];
        args.extend_from_slice(modes);
        let out = w.adversary_cmd(Adversary::RootWithoutNetAdmin, &args);
        assert!(out.success(), "{out}");
        out.stdout.trim().to_string()
    };
    let routes = ["lsrr4", "lsrr8", "lsrr-len10", "ssrr4", "ssrr8"];

    // Unfenced, the pointer-8 route works: the datagram reaches the hidden destination.
    assert_eq!(write(&["lsrr8"]), "lsrr8 sent");
    assert!(
        hidden.wait_for(1, Duration::from_secs(3)),
        "the source-routed datagram did not arrive unfenced: the test proves nothing"
    );
    let before = hidden.count();

    apply(&w);
    let want: Vec<String> = routes.iter().map(|m| format!("{m} refused")).collect();
    assert_eq!(write(&routes), want.join(" "));
    assert_eq!(write(&["plain"]), "plain sent");
    assert!(
        first_hop.wait_for(1, Duration::from_secs(2)),
        "the plain datagram to the allowed host"
    );
    std::thread::sleep(Duration::from_millis(500));
    let hits = hidden.hits();
    assert_eq!(
        hits.len(),
        before,
        "a source route carried a datagram to a destination the policy does not allow: {hits:?}"
    );
    let first_hits: Vec<Vec<u8>> = first_hop.hits().into_iter().map(|h| h.data).collect();
    assert_eq!(
        first_hits,
        vec![b"plain".to_vec()],
        "only the plain datagram reaches the first hop"
    );
}

/// Sends COUNT datagrams of SIZE bytes of payload from port SPORT to DST:DPORT (broadcast
/// allowed; ff02::1:2 on eth0) and prints `sent N refused M`.
const SEND_SIZED: &str = r#"
import os, socket, sys
dst, dport, sport, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
v6 = ':' in dst
s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
s.bind(('::' if v6 else '0.0.0.0', sport))
to = (dst, dport, 0, socket.if_nametoindex('eth0')) if v6 else (dst, dport)
sent = refused = 0
for _ in range(count):
    try:
        s.sendto(os.urandom(size), to)
        sent += 1
    except PermissionError:
        refused += 1
print('sent', sent, 'refused', refused)
"#;

/// `(sent, refused)` of [`SEND_SIZED`], as uid nobody.
fn send_sized(
    w: &World,
    dst: IpAddr,
    (dport, sport): (u16, u16),
    count: u32,
    size: usize,
) -> (u32, u32) {
    let args = [
        dst.to_string(),
        dport.to_string(),
        sport.to_string(),
        count.to_string(),
        size.to_string(),
    ];
    let mut full = vec![PYTHON, "-c", SEND_SIZED];
    full.extend(args.iter().map(String::as_str));
    let out = w.sandbox_cmd_as(NOBODY, &full);
    assert!(out.success(), "sending to {dst}: {out}");
    let words: Vec<&str> = out.stdout.split_whitespace().collect();
    match words.as_slice() {
        ["sent", sent, "refused", refused] => (
            sent.parse().expect("a count"),
            refused.parse().expect("a count"),
        ),
        _ => panic!("unexpected output: {out}"),
    }
}

/// A DHCP server's socket in the net namespace: the limited broadcast on port 67, or
/// ff02::1:2 port 547 joined on veth0. Large receive buffer, so nothing that left is lost.
fn dhcp_listener(w: &World, family_v6: bool) -> UdpSocket {
    w.in_net_ns(|| {
        let s = if family_v6 {
            let s = UdpSocket::bind("[::]:547").expect("bind [::]:547 in the net namespace");
            let group: Ipv6Addr = "ff02::1:2".parse().expect("an address");
            let ifindex =
                nix::net::if_::if_nametoindex("veth0").expect("veth0 in the net namespace");
            s.join_multicast_v6(&group, ifindex)
                .expect("join ff02::1:2 on veth0");
            s
        } else {
            UdpSocket::bind("255.255.255.255:67").expect("bind the broadcast address, port 67")
        };
        nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::RcvBuf, &(8 << 20))
            .expect("SO_RCVBUF");
        s.set_read_timeout(Some(Duration::from_millis(700)))
            .expect("a read timeout");
        s
    })
}

/// Datagrams and payload bytes waiting on `socket`, read until it stays quiet.
fn drain(socket: &UdpSocket) -> (usize, usize) {
    let mut buf = vec![0u8; 70_000];
    let (mut datagrams, mut bytes) = (0, 0);
    while let Ok(n) = socket.recv(&mut buf) {
        datagrams += 1;
        bytes += n;
    }
    (datagrams, bytes)
}

/// Issue 10 red-team review: the DHCP essentials counted datagrams, and the output hook sees
/// a UDP datagram before it is fragmented, so each accepted "request" could carry 64 KB
/// (1.3 MB a minute for both families). Now one datagram is at most 1,500 bytes and all of
/// them share a byte budget; a DHCP-sized broadcast still leaves.
#[test]
fn dhcp_essentials_carry_no_bulk_datagrams_and_stay_within_their_byte_budget() {
    let w = fenced_world();
    let budget = DHCP_CLIENT_LIMIT.count + u64::from(DHCP_CLIENT_LIMIT.burst);
    let cases = [
        (
            false,
            IpAddr::V4(std::net::Ipv4Addr::BROADCAST),
            (67, 68),
            65_507,
            28,
        ),
        (
            true,
            "ff02::1:2".parse().expect("an address"),
            (547, 546),
            65_487,
            48,
        ),
    ];
    for (v6, dst, ports, huge, headers) in cases {
        let server = dhcp_listener(&w, v6);
        let (sent, refused) = send_sized(&w, dst, ports, 30, huge);
        let (datagrams, bytes) = drain(&server);
        assert_eq!(
            (datagrams, bytes, sent),
            (0, 0, 0),
            "{dst}: datagrams of {huge} bytes left the sandbox (sent {sent}, refused {refused})"
        );

        // A DHCP message's size leaves.
        let (sent, _) = send_sized(&w, dst, ports, 1, 300);
        assert_eq!(sent, 1, "{dst}: a 300-byte DHCP-shaped datagram");
        assert_eq!(
            drain(&server),
            (1, 300),
            "{dst}: the 300-byte datagram did not arrive"
        );

        // A flood of datagrams just under the size bound gets the budget's bytes, no more
        // (what the budget refills meanwhile, 34 bytes a second, adds no whole datagram).
        let (sent, refused) = send_sized(&w, dst, ports, 30, 1_400);
        let (datagrams, bytes) = drain(&server);
        let on_wire = (datagrams * (1_400 + headers)) as u64;
        assert!(
            datagrams == sent as usize && on_wire + 300 + headers as u64 <= budget,
            "{dst}: {datagrams} datagrams ({bytes} bytes of payload, {on_wire} on the wire) of \
             {sent} sent, {refused} refused; budget {budget} bytes"
        );
        assert!(datagrams >= 1, "{dst}: the budget let no datagram through");
    }
}
