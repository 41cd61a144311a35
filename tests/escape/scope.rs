//! Ways around a scope (issue 11), tried by what the scope fences: a listed user asking DNS of
//! someone other than the guard, a listed user changing its groups, ICMP and routing headers
//! from a listed user, and a container on a listed bridge reaching for its host. Tables are
//! put up by [`put_up`] as [`SCOPE_LOAD`] says.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::time::Duration;

use crate::common::*;

/// Guard mode; uid 1001 is fenced and may reach HOST_V4:443 and HOST_V6 on UDP 7000.
const POLICY: &str = r#"
version: 1
action: reject
scope:
  users: [1001]
allow:
  - cidr: 192.0.2.10/32          # HOST_V4
    ports: [443]
  - cidr: 2001:db8:1::10/128     # HOST_V6
    ports: [7000]
    protocol: udp
dns:
  mode: guard
  upstream: [192.0.2.53]
"#;

const SCOPED: Adversary = Adversary::User(1001);
const UDP_PORT: u16 = 7000;
/// A resolver on loopback that is not the guard (a stub, a cache, Docker's 127.0.0.11).
const LOOPBACK_RESOLVER: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));

fn scoped_world() -> World {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    let policy = w.write_file("scope.yaml", POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    w
}

/// `echo -n PAYLOAD > /dev/udp/HOST/PORT` as `who` in the sandbox (root: `None`).
fn udp_as(w: &World, who: Option<Adversary>, host: IpAddr, port: u16, payload: &str) -> CmdOutput {
    let (host, port) = (host.to_string(), port.to_string());
    let args = [
        "bash",
        "-c",
        r#"echo -n "$2" > "/dev/udp/$0/$1""#,
        &host,
        &port,
        payload,
    ];
    match who {
        Some(who) => w.adversary_cmd(who, &args),
        None => w.sandbox_cmd(&args),
    }
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

#[test]
fn a_scoped_user_cannot_ask_a_loopback_resolver_that_is_not_the_guard() {
    let w = scoped_world();
    let resolver = sandbox_udp(&w, SocketAddr::new(LOOPBACK_RESOLVER, 53));
    let tcp_resolver = w
        .in_sandbox_ns(|| TcpListener::bind(SocketAddr::new(LOOPBACK_RESOLVER, 53)))
        .expect("listen on 127.0.0.2:53 in the sandbox");

    let sent = udp_as(&w, Some(SCOPED), LOOPBACK_RESOLVER, 53, "scoped");
    assert!(!sent.success(), "the datagram left the socket: {sent}");
    let tcp = w.adversary_cmd(SCOPED, &["nc", "-z", "-v", "-w", "2", "127.0.0.2", "53"]);
    assert!(!tcp.success(), "a TCP connection to 127.0.0.2:53: {tcp}");
    // The host's own processes are not in the scope: the resolver is there and answers them.
    let control = udp_as(&w, None, LOOPBACK_RESOLVER, 53, "root");
    assert!(control.success(), "{control}");
    assert_eq!(received(&resolver), vec!["root".to_string()]);
    drop(tcp_resolver);
}

#[test]
fn a_scoped_user_cannot_ask_the_upstream_resolver_directly() {
    let w = scoped_world();
    for extra in [&[][..], &["+tcp"][..]] {
        let answer = w.dig_as(Some(1001), Some(DNS_V4), "api.example.com", "A", extra);
        assert!(
            !answer.answered(),
            "uid 1001 asked the upstream resolver past the guard ({extra:?}): {}",
            answer.output
        );
    }
    assert!(
        !w.dns_queries()
            .iter()
            .any(|q| q.contains("api.example.com")),
        "the upstream resolver saw the scoped user's question: {:?}",
        w.dns_queries()
    );
}

#[test]
fn a_scoped_user_stays_fenced_whatever_groups_it_switches_to() {
    let w = scoped_world();
    let refused = w.listen_tcp(OTHER_V4, 443);
    // A listed uid as primary group 0 (root's), 3000, with root's group as a supplementary
    // one, or with none: the uid is what the scope lists.
    for (gid, groups) in [(0, vec![]), (3000, vec![0u32]), (3000, vec![3001, 3002])] {
        let who = as_ids(1001, gid, &groups);
        let mut prefix: Vec<&str> = who.iter().map(String::as_str).collect();
        prefix.extend(["nc", "-z", "-v", "-w", "2", "203.0.113.10", "443"]);
        let out = w.sandbox_cmd(&prefix);
        assert!(
            !out.success(),
            "uid 1001 as gid {gid} groups {groups:?} left the scope: {out}"
        );
    }
    assert_eq!(refused.count(), 0);
    assert!(w.tcp_connects(OTHER_V4, 443), "root is not in the scope");
}

/// Sends one ICMP echo request to ARGV[1] from a ping socket (no privilege needed where
/// net.ipv4.ping_group_range allows) and prints `refused`, `answered` or `silent`.
const PING_SOCKET: &str = r#"
import socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
s.settimeout(2)
try:
    s.sendto(struct.pack('!BBHHH', 8, 0, 0, 0, 1) + b'scoped-echo', (sys.argv[1], 0))
except PermissionError:
    print('refused')
    sys.exit()
try:
    s.recv(100)
    print('answered')
except socket.timeout:
    print('silent')
"#;

/// Sends a datagram to FINAL:PORT with a segment routing header whose first segment is FIRST,
/// and one without; prints `routed R plain P` with `sent` or `refused` for each.
const ROUTED_AND_PLAIN: &str = r#"
import socket, struct, sys
first, final, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
segments = [final, first]
srh = struct.pack('!BBBBBBH', 0, 2 * len(segments), 4, len(segments) - 1,
                  len(segments) - 1, 0, 0)
srh += b''.join(socket.inet_pton(socket.AF_INET6, a) for a in segments)
def send(s, payload):
    try:
        s.sendto(payload, (final, port))
        return 'sent'
    except PermissionError:
        return 'refused'
routed = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
routed.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RTHDR, srh)
plain = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
print('routed', send(routed, b'routed'), 'plain', send(plain, b'plain'))
"#;

#[test]
fn a_scoped_user_sends_neither_icmp_nor_a_routing_header() {
    let w = scoped_world();
    let everyone = w.sandbox_cmd(&["sysctl", "-q", "-w", "net.ipv4.ping_group_range=0 65535"]);
    assert!(everyone.success(), "{everyone}");
    let host = HOST_V4.to_string();
    let scoped = w.adversary_cmd(SCOPED, &[PYTHON, "-c", PING_SOCKET, &host]);
    assert_eq!(scoped.stdout.trim(), "refused", "uid 1001 pinged: {scoped}");
    let unscoped = w.adversary_cmd(Adversary::User(1002), &[PYTHON, "-c", PING_SOCKET, &host]);
    assert_eq!(
        unscoped.stdout.trim(),
        "answered",
        "uid 1002 is not in the scope: {unscoped}"
    );

    let listener = w.listen_udp(HOST_V6, UDP_PORT);
    let (first, last) = (OTHER_V6.to_string(), HOST_V6.to_string());
    let port = UDP_PORT.to_string();
    let out = w.adversary_cmd(
        SCOPED,
        &[PYTHON, "-c", ROUTED_AND_PLAIN, &first, &last, &port],
    );
    assert_eq!(out.stdout.trim(), "routed refused plain sent", "{out}");
    assert!(listener.wait_for(1, Duration::from_secs(2)));
    let payloads: Vec<Vec<u8>> = listener.hits().into_iter().map(|h| h.data).collect();
    assert_eq!(
        payloads,
        vec![b"plain".to_vec()],
        "only the plain datagram arrived"
    );
}

/// Writes, on the container's eth0, IPv4/UDP frames to the bridge's MAC from the container's
/// address to DST:PORT with payload MARKER (a raw socket: root in a container keeps
/// CAP_NET_RAW), 3 times. Arguments: DST_MAC SRC DST PORT MARKER.
const FRAME_TO_HOST: &str = concat!(
    crate::inet_checksum_py!(),
    r#"
import socket, struct, sys
dst_mac, src, dst, port, marker = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(('eth0', 0))
src_mac = s.getsockname()[4]
payload = marker.encode()
udp = struct.pack('!HHHH', 40000, port, 8 + len(payload), 0) + payload
ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                 socket.inet_aton(src), socket.inet_aton(dst))
ip = ip[:10] + struct.pack('!H', checksum(ip)) + ip[12:]
frame = bytes.fromhex(dst_mac.replace(':', '')) + src_mac + b'\x08\x00' + ip + udp
for _ in range(3):
    s.send(frame)
print('written')
"#
);

#[test]
fn a_container_reaches_neither_the_hosts_other_addresses_nor_its_loopback() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    // A misconfigured host (Docker sets this for published 127.0.0.1 ports): packets for
    // 127.0.0.0/8 arriving on the bridge are routed to the host's loopback services.
    let localnet = w.sandbox_cmd(&[
        "sysctl",
        "-q",
        "-w",
        &format!("net.ipv4.conf.{BRIDGE}.route_localnet=1"),
    ]);
    assert!(localnet.success(), "{localnet}");
    let mac = w.sandbox_cmd(&["cat", &format!("/sys/class/net/{BRIDGE}/address")]);
    assert!(mac.success(), "{mac}");
    let mac = mac.stdout.trim().to_string();
    let loopback = sandbox_udp(&w, SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 5300));
    let on_bridge = sandbox_udp(&w, SocketAddr::new(BRIDGE_V4, 53));
    let on_uplink = sandbox_udp(&w, SocketAddr::new(SANDBOX_V4, 5300));
    let send_all = |marker: &str| {
        let frame = container.cmd(&[
            PYTHON,
            "-c",
            FRAME_TO_HOST,
            &mac,
            &CONTAINER_V4.to_string(),
            "127.0.0.1",
            "5300",
            marker,
        ]);
        assert!(frame.success(), "{frame}");
        for (to, port) in [(BRIDGE_V4, 53), (SANDBOX_V4, 5300)] {
            let script = format!("echo -n {marker} > /dev/udp/{to}/{port}");
            let _ = container.cmd(&["bash", "-c", &script]);
        }
    };

    // Without the table every path is open: the test can see a packet arrive.
    send_all("before");
    for (socket, what) in [
        (&loopback, "127.0.0.1 via the bridge"),
        (&on_bridge, "the bridge address's port 53"),
        (&on_uplink, "the uplink address"),
    ] {
        assert!(
            received(socket).contains(&"before".to_string()),
            "without a table the container does not reach {what}: the test proves nothing"
        );
    }

    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    send_all("after");
    for (socket, what) in [
        (&loopback, "127.0.0.1 via the bridge"),
        (
            &on_bridge,
            "a resolver on the bridge address that is not the guard",
        ),
        (&on_uplink, "the uplink address"),
    ] {
        assert_eq!(
            received(socket),
            Vec::<String>::new(),
            "the container reached {what} through the scope"
        );
    }
    let tcp = container.tcp_connect(SANDBOX_V4, 22);
    assert!(!tcp.success(), "{tcp}");
}

/// The guard's protections hold for every socket, in scope or not, behind the scope chain's
/// jumps (`th sport 53 jump guard`, `... @dns4 jump guard`): a process outside the scope
/// neither asks the upstream resolver nor answers from the guard's address and port while
/// the daemon is down.
#[test]
fn outside_the_scope_nobody_asks_the_upstream_or_answers_for_the_guard() {
    let w = scoped_world();
    for uid in [Some(1002), None] {
        for extra in [&[][..], &["+tcp"][..]] {
            let answer = w.dig_as(uid, Some(DNS_V4), "api.example.com", "A", extra);
            assert!(
                !answer.answered(),
                "{uid:?} (not in scope) asked the upstream past the guard ({extra:?}): {}",
                answer.output
            );
        }
    }
    assert!(
        !w.dns_queries()
            .iter()
            .any(|q| q.contains("api.example.com")),
        "the upstream resolver saw a question: {:?}",
        w.dns_queries()
    );

    // A squatter on the guard's address (root, unmarked: the daemon is not running) and one
    // beside it on another port, each asked by a client on loopback (the question: whether
    // it arrives) and each sending the client an answer unasked (what arrives of it).
    let exchange = |port: u16| {
        let squatter = sandbox_udp(
            &w,
            SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 53)), port),
        );
        let client = sandbox_udp(&w, SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0));
        client
            .send_to(b"question", squatter.local_addr().expect("bound"))
            .expect("the question leaves");
        let heard = received(&squatter);
        let _ = squatter.send_to(b"answer", client.local_addr().expect("bound"));
        (heard, received(&client))
    };
    assert_eq!(
        exchange(5300),
        (vec!["question".to_string()], vec!["answer".to_string()]),
        "the control exchange"
    );
    assert_eq!(
        exchange(53),
        (Vec::<String>::new(), Vec::<String>::new()),
        "an unmarked socket on the guard's address and port heard or answered a client"
    );
}
