//! `action: reject` answers this host's refused TCP connections with a reset (issue 16): a
//! refused IPv6 connect fails at once instead of at the first SYN retransmission, which
//! ICMPv6 admin-prohibited (a soft error in SYN_SENT) left it to. And the answers, reset
//! or ICMP error, go to that source only when it is this host's: root in the fence that
//! writes a refused packet from an outside address it controls must not have the fence
//! answer that address.

use std::net::IpAddr;

use egress_fence::core::ruleset::ICMP_ANSWER_PRIORITY;

use crate::common::*;

/// Allows one port of one host; everything else is refused with `reject`.
const POLICY: &str = r#"
version: 1
action: reject
allow:
  - cidr: 192.0.2.10/32          # HOST_V4
    ports: [443]
dns:
  resolvers: [192.0.2.53]
"#;

const PORT: u16 = 443;

/// Connects to port 443 of each HOST with socket priority PRIORITY and prints `HOST WHAT` per
/// host: `connected`, the errno's name, or `timeout` (5 s). Arguments: PRIORITY HOST...
const CONNECT: &str = r#"
import errno, socket, sys
priority = int(sys.argv[1])
for host in sys.argv[2:]:
    s = socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, priority)
    s.settimeout(5)
    try:
        s.connect((host, 443))
        print(host, 'connected')
    except socket.timeout:
        print(host, 'timeout')
    except OSError as e:
        print(host, errno.errorcode.get(e.errno, str(e.errno)))
"#;

/// Writes, through a raw socket (IP_HDRINCL), three TCP segments (ACK, the acknowledgment
/// number the 4 bytes of MARKER) and three UDP datagrams (MARKER as payload) from SRC to
/// DST: the source an outside address of the writer's choice. A reset answers an ACK with
/// the acknowledgment number as its sequence number; an ICMP error quotes the packet. Run
/// after [`REFUSE_CAP_NET_ADMIN_PY`]; exits non-zero without CAP_NET_RAW (the test would
/// prove nothing). Arguments: SRC DST MARKER.
const SPOOFED_REFUSALS: &str = concat!(
    crate::inet_checksum_py!(),
    r#"
import socket, struct
src, dst, marker = sys.argv[1], sys.argv[2], sys.argv[3].encode()
if not cap_eff & (1 << 13):
    sys.exit('CAP_NET_RAW is not effective')
v6 = ':' in src
family = socket.AF_INET6 if v6 else socket.AF_INET
a, b = socket.inet_pton(family, src), socket.inet_pton(family, dst)
def packet(proto, l4):
    pseudo = a + b + (struct.pack('!IxxxB', len(l4), proto) if v6 else struct.pack('!xBH', proto, len(l4)))
    at = 16 if proto == 6 else 6
    l4 = l4[:at] + struct.pack('!H', checksum(pseudo + l4)) + l4[at + 2:]
    if v6:
        return struct.pack('!IHBB', 6 << 28, len(l4), proto, 64) + a + b + l4
    return struct.pack('!BBHHHBBH', 0x45, 0, 20 + len(l4), 1, 0, 64, proto, 0) + a + b + l4
tcp = struct.pack('!HHII', 40000, 443, 1, struct.unpack('!I', marker[:4])[0])
tcp += struct.pack('!BBHHH', 5 << 4, 0x10, 1024, 0, 0)
udp = struct.pack('!HHHH', 40000, 443, 8 + len(marker), 0) + marker
s = socket.socket(family, socket.SOCK_RAW, socket.IPPROTO_RAW)
for _ in range(3):
    for p in (packet(6, tcp), packet(17, udp)):
        try:
            s.sendto(p, (dst, 0))
        except PermissionError:
            pass
print('written')
"#
);

fn fenced_world() -> World {
    let w = World::new();
    w.apply_policy(POLICY);
    w
}

/// `HOST WHAT` lines of [`CONNECT`], as `who` with `priority`.
fn connect(w: &World, who: Adversary, priority: u32, hosts: &[IpAddr]) -> String {
    let hosts: Vec<String> = hosts.iter().map(IpAddr::to_string).collect();
    let priority = priority.to_string();
    let mut args = vec![PYTHON, "-c", CONNECT, &priority];
    args.extend(hosts.iter().map(String::as_str));
    let out = w.adversary_cmd(who, &args);
    assert!(out.success(), "{out}");
    out.stdout
}

/// A refused TCP connect fails with a reset (ECONNREFUSED) in both families, never with the
/// ICMPv6 error that IPv6 only acts on at the first SYN retransmission. A listener waits on
/// each refused destination, so a reset cannot be that host's closed port. A socket of the
/// probe's priority still gets the ICMP error (EHOSTUNREACH, EACCES), whose sender the probe
/// checks.
#[test]
fn a_refused_tcp_connect_is_reset_at_once_in_both_families() {
    let w = fenced_world();
    let refused = [w.listen_tcp(HOST3_V4, PORT), w.listen_tcp(HOST3_V6, PORT)];
    let _allowed = w.listen_tcp(HOST_V4, PORT);

    let out = connect(&w, Adversary::Nobody, 0, &[HOST3_V4, HOST3_V6, HOST_V4]);
    for (host, want) in [
        (HOST3_V4, "ECONNREFUSED"),
        (HOST3_V6, "ECONNREFUSED"),
        (HOST_V4, "connected"),
    ] {
        assert!(out.contains(&format!("{host} {want}")), "{host}: {out}");
    }
    let probes = connect(
        &w,
        Adversary::Nobody,
        ICMP_ANSWER_PRIORITY,
        &[HOST3_V4, HOST3_V6],
    );
    assert!(
        probes.contains(&format!("{HOST3_V4} EHOSTUNREACH")),
        "{probes}"
    );
    assert!(probes.contains(&format!("{HOST3_V6} EACCES")), "{probes}");
    assert!(
        refused.iter().all(|l| l.count() == 0),
        "a refused connection reached its listener"
    );
}

/// Root in the fence (CAP_NET_RAW, no CAP_NET_ADMIN) writes refused TCP and UDP from an
/// outside address it controls. Answered, the fence would send that address a reset whose
/// sequence number the writer chose, or an ICMP error quoting the packet, and either would
/// leave as `related` to the refused packet's connection: a channel out of the fence to any
/// address. Nothing marked may reach the world's side of the link.
#[test]
fn root_cannot_make_a_refusal_answer_a_spoofed_outside_source() {
    let w = fenced_world();
    let script = format!("{REFUSE_CAP_NET_ADMIN_PY}{SPOOFED_REFUSALS}");
    for (ethertype, src, dst) in [(0x0800, OTHER2_V4, HOST3_V4), (0x86dd, OTHER_V6, HOST3_V6)] {
        let (src, dst) = (src.to_string(), dst.to_string());
        let (capture, sent) = w.count_marked_frames(ethertype, "RST!", 2, || {
            w.adversary_cmd(
                Adversary::RootWithoutNetAdmin,
                &[PYTHON, "-c", &script, &src, &dst, "RST!"],
            )
        });
        assert!(sent.success(), "{sent}");
        assert!(capture.success(), "{capture}");
        assert_eq!(
            capture.stdout.trim(),
            "0",
            "the fence answered the spoofed source {src}: {sent}"
        );
    }
}

/// Sends three UDP datagrams (MARKER repeated) from SRC, an outside address, to port 9 of
/// DST, an address of this host, as any user may: `IPV6_FREEBIND` lets an unprivileged
/// socket bind an address that is not the host's, and send from it (a refusal is EPERM).
/// Arguments: SRC DST MARKER.
const FREEBOUND_UDP: &str = r#"
import socket, sys
src, dst, marker = sys.argv[1], sys.argv[2], sys.argv[3].encode()
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IPV6, 78, 1)  # IPV6_FREEBIND
s.bind((src, 40001))
for _ in range(3):
    try:
        s.sendto(marker * 16, (dst, 9))
    except PermissionError:
        pass
print('written')
"#;

/// Red team round 4: a process writes to this host itself (its own address, which
/// `oif "lo" accept` lets through) from an outside address it controls. No refusal of the
/// fence answers it, the kernel does: a closed UDP port with ICMP port unreachable quoting
/// the datagram, a closed TCP port with a reset whose sequence number is the writer's
/// acknowledgment number. The kernel's own sockets carry no uid, and the answers leave as
/// `related`/`established` to the written flow: a channel out of the fence to any address.
/// Over IPv6 any user can do it (`IPV6_FREEBIND`); over IPv4 root with CAP_NET_RAW.
/// Nothing marked may reach the world's side of the link.
#[test]
fn the_hosts_closed_ports_do_not_answer_a_source_written_from_outside() {
    let w = fenced_world();
    let raw = format!("{REFUSE_CAP_NET_ADMIN_PY}{SPOOFED_REFUSALS}");
    let (other_v4, other_v6) = (OTHER2_V4.to_string(), OTHER_V6.to_string());
    let (own_v4, own_v6) = (SANDBOX_V4.to_string(), SANDBOX_V6.to_string());
    let mut answered = Vec::new();
    // One marker per capture: each capture's ready file is named after its marker.
    for (ethertype, who, args) in [
        (
            0x86dd,
            Adversary::Nobody,
            [PYTHON, "-c", FREEBOUND_UDP, &other_v6, &own_v6, "OUT6"],
        ),
        (
            0x0800,
            Adversary::RootWithoutNetAdmin,
            [PYTHON, "-c", &raw, &other_v4, &own_v4, "OUT4"],
        ),
    ] {
        let marker = args[5];
        let (capture, sent) =
            w.count_marked_frames(ethertype, marker, 2, || w.adversary_cmd(who, &args));
        assert!(sent.success(), "{sent}");
        assert!(capture.success(), "{capture}");
        if capture.stdout.trim() != "0" {
            answered.push(format!(
                "{who:?} to {}: {} frames",
                args[4],
                capture.stdout.trim()
            ));
        }
    }
    assert!(
        answered.is_empty(),
        "this host answered a source written from outside, out of the fence: {answered:?}"
    );
}
