//! The host's own configuration fed from inside the fence (red team, session 11): files that
//! egress-fence, running as root, writes where the fenced user can reach, and what a bridged
//! container sends the host to change its routes, addresses or resolvers.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use crate::common::exec::*;
use crate::common::*;

/// `exec --canary-file PATH` is written by exec (root, unfenced) before CMD starts, by path,
/// following symlinks, in CMD's working directory (which CMD's user may write: that is where
/// the agent works). CMD of one run moves its working directory away and leaves a symlink at
/// PATH in a fresh directory of the same name; the next run started there (`cd work && sudo
/// egress-fence exec --canary --canary-file canary.env ...`) truncates and writes the symlink's
/// target as root: any file of the host (shown on a root-owned 0600 file; the fence's own
/// binary or unit would do, and the host then boots without its fence). The `--report` file
/// was closed to this in round 3 (`O_NOFOLLOW`); the canary file is the same write.
#[test]
fn the_canary_file_does_not_follow_a_symlink_cmd_planted() {
    let w = World::new();
    let policy = setup(&w);
    let top = tempfile::Builder::new()
        .prefix("ef-hostcfg-")
        .tempdir()
        .expect("the user's directory");
    std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let work = top.path().join("work");
    std::fs::create_dir(&work).expect("mkdir work");
    std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let victim = w.write_file("victim", "root's own\n");
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).expect("chmod");

    // Run 1: CMD (nobody) swaps its working directory for one holding the symlink; exec's
    // clean-up removes `canary.env` from the directory it still holds, the moved one.
    let plant = format!(
        "cd .. && mv work work.old && mkdir work && ln -s {} work/canary.env && echo planted; \
         exit 0",
        victim.display()
    );
    let mut cmd = exec_command(
        &w,
        &policy,
        &[
            "--user",
            "nobody",
            "--canary",
            "--canary-file",
            "canary.env",
        ],
        &plant,
    );
    cmd.current_dir(&work);
    let out = cmd.output().expect("run egress-fence exec");
    assert!(stdout_of(&out).contains("planted"), "{}", show(&out));
    assert!(
        std::fs::symlink_metadata(work.join("canary.env")).is_ok_and(|m| m.is_symlink()),
        "the symlink is not in place"
    );

    // Run 2, started in `work` again.
    let mut cmd = exec_command(
        &w,
        &policy,
        &[
            "--user",
            "nobody",
            "--canary",
            "--canary-file",
            "canary.env",
        ],
        "exit 0",
    );
    cmd.current_dir(&work);
    let out = cmd.output().expect("run egress-fence exec");
    let text = std::fs::read_to_string(&victim).expect("read the victim");
    assert_eq!(
        text,
        "root's own\n",
        "exec wrote the canary through CMD's symlink\n{}",
        show(&out)
    );
    assert_ne!(out.status.code(), Some(0), "CMD ran: {}", show(&out));
}

/// Root in the container (CAP_NET_RAW in its own namespace) writes, on eth0, from its
/// link-local address with hop limit 255: a Router Advertisement to ff02::1 with a prefix to
/// autoconfigure (PIO, A flag), a route (RIO) and a resolver (RDNSS), then an ICMPv6
/// redirect to the host's bridge address for DEST via fe80::dead. Arguments: TAG (the third
/// group of the prefixes: 2001:db8:aaTAG::/64, 2001:db8:bbTAG::/48, 2001:db8:ccTAG::53),
/// HOST_LL (the bridge's link-local address), DEST.
const ROUTER_TALK: &str = r#"
import socket, struct, sys
tag, host_ll, dest = sys.argv[1], sys.argv[2], sys.argv[3]
idx = socket.if_nametoindex('eth0')
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 255)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, 255)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, idx)
a = lambda t: socket.inet_pton(socket.AF_INET6, t)
pio = struct.pack('!BBBBIII', 3, 4, 64, 0xc0, 86400, 14400, 0) + a('2001:db8:aa%s::' % tag)
rio = struct.pack('!BBBBI', 24, 2, 48, 0, 86400) + a('2001:db8:bb%s::' % tag)[:8]
rdnss = struct.pack('!BBHI', 25, 3, 0, 86400) + a('2001:db8:cc%s::53' % tag)
ra = struct.pack('!BBHBBHII', 134, 0, 0, 64, 0, 0, 0, 0) + pio + rio + rdnss
redirect = struct.pack('!BBHI', 137, 0, 0, 0) + a('fe80::dead') + a(dest)
for _ in range(3):
    s.sendto(ra, ('ff02::1', 0, 0, idx))
    s.sendto(redirect, (host_ll, 0, 0, idx))
print('written')
"#;

/// The host's IPv6 configuration from a bridged container: Router Advertisements (prefixes,
/// routes and resolvers, which the host's network manager would write to resolv.conf, the
/// daemon's resolvers when the policy names none) and redirects. The host is set to take
/// them on the bridge (`accept_ra=2`, routes up to /64, redirects); without the table it does,
/// which shows the packets are right. With the bridge listed, `from_bridge` refuses types 134
/// and 137 (only RS, NS, NA and MLD reports pass): nothing changes. Held on main.
#[test]
fn a_container_does_not_configure_its_hosts_routes_addresses_or_resolvers() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    for setting in [
        "accept_ra=2",
        "accept_ra_rt_info_max_plen=64",
        "accept_redirects=1",
        "autoconf=1",
    ] {
        let key = format!("net.ipv6.conf.{BRIDGE}.{setting}");
        let out = w.sandbox_cmd(&["sysctl", "-q", "-w", &key]);
        assert!(out.success(), "{out}");
    }
    // Both ends' link-local addresses, past duplicate address detection.
    let mut host_ll = String::new();
    let ready = within(Duration::from_secs(10), || {
        let host = w.sandbox_cmd(&[
            "ip", "-6", "-o", "addr", "show", "dev", BRIDGE, "scope", "link",
        ]);
        let ct = container.cmd(&[
            "ip", "-6", "-o", "addr", "show", "dev", "eth0", "scope", "link",
        ]);
        let ok = |o: &CmdOutput| o.stdout.contains("fe80::") && !o.stdout.contains("tentative");
        if ok(&host) && ok(&ct) {
            host_ll = host
                .stdout
                .split_whitespace()
                .skip_while(|w| *w != "inet6")
                .nth(1)
                .and_then(|a| a.split('/').next())
                .unwrap_or_default()
                .to_string();
            true
        } else {
            false
        }
    });
    assert!(
        ready && !host_ll.is_empty(),
        "no link-local addresses on the bridge"
    );
    let talk = |tag: &str, dest: &str| {
        let out = container.cmd(&[PYTHON, "-c", ROUTER_TALK, tag, &host_ll, dest]);
        assert!(out.success(), "{out}");
    };
    let addrs = || {
        w.sandbox_cmd(&["ip", "-6", "addr", "show", "dev", BRIDGE])
            .stdout
    };
    let routes = || {
        w.sandbox_cmd(&["ip", "-6", "route", "show", "table", "all"])
            .stdout
    };
    let via = |dest: &str| w.sandbox_cmd(&["ip", "-6", "route", "get", dest]).stdout;

    // Without the table the host takes all of it: the packets are right.
    talk("01", "2001:db8:bb01::1");
    let taken = within(Duration::from_secs(5), || {
        addrs().contains("2001:db8:aa01:") && routes().contains("2001:db8:bb01::/48")
    });
    assert!(
        taken,
        "without a table the host took no prefix or route: the test proves nothing\n{}\n{}",
        addrs(),
        routes()
    );
    talk("01", "2001:db8:bb01::1");
    assert!(
        within(Duration::from_secs(3), || via("2001:db8:bb01::1")
            .contains("fe80::dead")),
        "without a table the host took no redirect: the test proves nothing\n{}",
        via("2001:db8:bb01::1")
    );

    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    talk("02", "2001:db8:bb01::2");
    std::thread::sleep(Duration::from_secs(1));
    let (a, r, v) = (addrs(), routes(), via("2001:db8:bb01::2"));
    assert!(
        !a.contains("2001:db8:aa02:"),
        "the container gave its host a prefix:\n{a}"
    );
    assert!(
        !r.contains("2001:db8:bb02::/48"),
        "the container gave its host a route:\n{r}"
    );
    assert!(
        !v.contains("fe80::dead"),
        "the container redirected its host:\n{v}"
    );
}

/// Writes, on the container's eth0, IPv4/UDP frames to DST_MAC from SRC:SPORT to DST:DPORT
/// with payload MARKER (a packet socket: root in a container keeps CAP_NET_RAW in its own
/// namespace), 3 times. Arguments: DST_MAC SRC SPORT DST DPORT MARKER.
const FRAME: &str = concat!(
    crate::inet_checksum_py!(),
    r#"
import socket, struct, sys
dst_mac, src, sport, dst, dport, marker = sys.argv[1:7]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(('eth0', 0))
src_mac = s.getsockname()[4]
payload = marker.encode()
udp = struct.pack('!HHHH', int(sport), int(dport), 8 + len(payload), 0) + payload
ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                 socket.inet_aton(src), socket.inet_aton(dst))
ip = ip[:10] + struct.pack('!H', checksum(ip)) + ip[12:]
frame = bytes.fromhex(dst_mac.replace(':', '')) + src_mac + b'\x08\x00' + ip + udp
for _ in range(3):
    s.send(frame)
print('written')
"#
);

/// The LLDP group address. A bridge never forwards frames to 01:80:c2:00:00:0X (IEEE 802.1D
/// reserved group addresses; 0E is LLDP): it passes them up on the port they came in by
/// (`RX_HANDLER_PASS`), and an IP packet in one reaches the host's IP stack with the port
/// (`ct0`) as its input interface, not the bridge.
const LLDP_MAC: &str = "01:80:c2:00:00:0e";

/// A host service on the uplink address that answers each question (a resolver, NTP, SNMP:
/// a UDP service answers whoever asked): `q:X` is answered `a:X`, anything else ignored.
fn answering_service(
    w: &World,
    addr: SocketAddr,
) -> (std::thread::JoinHandle<Vec<String>>, SocketAddr) {
    let socket = w
        .in_sandbox_ns(|| UdpSocket::bind(addr))
        .unwrap_or_else(|e| panic!("bind {addr} in the sandbox: {e}"));
    socket
        .set_read_timeout(Some(Duration::from_millis(1500)))
        .expect("a read timeout");
    let local = socket.local_addr().expect("bound");
    let thread = std::thread::spawn(move || {
        let mut heard = Vec::new();
        let mut buf = [0u8; 2048];
        while let Ok((n, from)) = socket.recv_from(&mut buf) {
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            if let Some(q) = text.strip_prefix("q:") {
                let _ = socket.send_to(format!("a:{q}").as_bytes(), from);
            }
            heard.push(text);
        }
        heard
    });
    (thread, local)
}

/// What a listed bridge sends the host itself is refused (`iifname "efbr0" goto
/// from_bridge`), and its sources are checked (`iifname "efbr0" fib saddr . iif oif missing
/// drop`). Both match the bridge's name; an IP packet in a frame to an IEEE 802.1 reserved
/// group address (LLDP's) is passed up by the bridge on its port `ct0` and matches neither.
/// Root in the container reaches every UDP service of the host that way, from any source
/// address it writes: the host's answer, from a process outside the scope, carries the
/// container's bytes to any address outside (here OTHER_V4, which the policy does not allow).
/// TCP and the kernel's ICMP errors are not had this way (both refuse a packet that came in a
/// link-layer multicast), UDP is.
#[test]
fn a_container_reaches_no_host_service_through_its_bridge_port() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    let outside = w.listen_udp(OTHER_V4, 5301);
    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    let (service, at) = answering_service(&w, SocketAddr::new(SANDBOX_V4, 5300));
    let mac = w.sandbox_cmd(&["cat", &format!("/sys/class/net/{BRIDGE}/address")]);
    assert!(mac.success(), "{mac}");
    let bridge_mac = mac.stdout.trim().to_string();
    let send = |dst_mac: &str, src: IpAddr, sport: u16, marker: &str| {
        let (src, sport, dst, dport) = (
            src.to_string(),
            sport.to_string(),
            at.ip().to_string(),
            at.port().to_string(),
        );
        let out = container.cmd(&[
            PYTHON, "-c", FRAME, dst_mac, &src, &sport, &dst, &dport, marker,
        ]);
        assert!(out.success(), "{out}");
    };
    // To the bridge's address as a container sends it: refused (as on main).
    send(&bridge_mac, CONTAINER_V4, 40000, "q:bridge");
    // The same through the port, from the container's address and from an outside one.
    send(LLDP_MAC, CONTAINER_V4, 40000, "q:port");
    send(LLDP_MAC, OTHER_V4, 5301, "q:port-spoofed");
    let heard = service.join().expect("the service");
    outside.wait_for(1, Duration::from_secs(1));
    let out: Vec<String> = outside.hits().iter().map(|h| format!("{h:?}")).collect();
    assert!(
        heard.is_empty() && out.is_empty(),
        "the container reached a host service through its bridge port: the service heard \
         {heard:?}; its answers reached {OTHER_V4}: {out:?}"
    );
}

/// Writes, on the container's eth0, a Router Advertisement to ff02::1 in a frame to DST_MAC,
/// from the link-local address of eth0's MAC with hop limit 255: router lifetime LIFETIME,
/// a prefix to autoconfigure (2001:db8:aaTAG::/64) and a resolver (RDNSS), 3 times (a
/// packet socket: the kernel would put it in a frame to 33:33:00:00:00:01). Arguments:
/// DST_MAC TAG LIFETIME.
const PORT_RA: &str = concat!(
    crate::inet_checksum_py!(),
    r#"
import socket, struct, sys
dst_mac, tag, lifetime = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(('eth0', 0))
src_mac = s.getsockname()[4]
a = lambda t: socket.inet_pton(socket.AF_INET6, t)
m = bytearray(src_mac); m[0] ^= 2
src = b'\xfe\x80' + bytes(6) + bytes(m[:3]) + b'\xff\xfe' + bytes(m[3:])
dst = a('ff02::1')
pio = struct.pack('!BBBBIII', 3, 4, 64, 0xc0, 86400, 14400, 0) + a('2001:db8:aa%s::' % tag)
rdnss = struct.pack('!BBHI', 25, 3, 0, 86400) + a('2001:db8:cc%s::53' % tag)
ra = struct.pack('!BBHBBHII', 134, 0, 0, 64, 0, lifetime, 0, 0) + pio + rdnss
c = checksum(src + dst + struct.pack('!I3xB', len(ra), 58) + ra)
ra = ra[:2] + struct.pack('!H', c) + ra[4:]
ip6 = struct.pack('!IHBB', 6 << 28, len(ra), 58, 255) + src + dst
frame = bytes.fromhex(dst_mac.replace(':', '')) + src_mac + b'\x86\xdd' + ip6 + ra
for _ in range(3):
    s.send(frame)
print('written')
"#
);

/// The same bridge port, for the host's IPv6 configuration: a Router Advertisement in a frame
/// to LLDP's group address is handed to the host on the port `ct0`, whose defaults take it
/// (`accept_ra=1` where IPv6 forwarding is off, as on a host whose containers have IPv4
/// only): the host autoconfigures the container's prefix on ct0 and makes the container its
/// IPv6 default router, so the host's own IPv6 traffic (to allowed destinations too) goes to
/// the container. Shown without the table (router lifetime 0, a prefix only), then refused
/// with it.
#[test]
fn a_container_is_not_its_hosts_router_through_its_bridge_port() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    let ready = within(Duration::from_secs(10), || {
        let ct = container.cmd(&[
            "ip", "-6", "-o", "addr", "show", "dev", "eth0", "scope", "link",
        ]);
        let port = w.sandbox_cmd(&[
            "ip", "-6", "-o", "addr", "show", "dev", "ct0", "scope", "link",
        ]);
        [ct, port]
            .iter()
            .all(|o| o.stdout.contains("fe80::") && !o.stdout.contains("tentative"))
    });
    assert!(ready, "no link-local addresses on the container's link");
    let ra = |tag: &str, lifetime: &str| {
        let out = container.cmd(&[PYTHON, "-c", PORT_RA, LLDP_MAC, tag, lifetime]);
        assert!(out.success(), "{out}");
    };
    let addrs = || w.sandbox_cmd(&["ip", "-6", "addr", "show"]).stdout;
    let default = || {
        w.sandbox_cmd(&["ip", "-6", "route", "show", "default"])
            .stdout
    };

    ra("03", "0");
    assert!(
        within(Duration::from_secs(5), || addrs()
            .contains("2001:db8:aa03:")),
        "without a table the host took no prefix through the port: the test proves nothing\n{}",
        addrs()
    );

    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);
    ra("04", "1800");
    std::thread::sleep(Duration::from_secs(1));
    let (a, d) = (addrs(), default());
    assert!(
        !a.contains("2001:db8:aa04:"),
        "the container gave its host a prefix through its port:\n{a}"
    );
    assert!(
        !d.contains("dev ct0"),
        "the container made itself its host's default router through its port:\n{d}"
    );
}
