//! The DNS guard under attack from inside the fence: its uid is no pass to the upstream
//! resolvers (item 3), the bytes it forwards are its own (item 9), and one client cannot
//! starve the others (item 10).

use std::net::IpAddr;
use std::time::Duration;

use crate::common::*;

/// A guard-mode policy: `*.pool.example` on TCP 80, forwarding to `upstream`, answering on
/// [`GUARD_ADDR`].
fn guard_policy(upstream: &[IpAddr]) -> String {
    let upstream: Vec<String> = upstream.iter().map(ToString::to_string).collect();
    format!(
        "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [80]\ndns:\n  mode: guard\n  \
         listen: [\"{GUARD_ADDR}\"]\n  upstream: [{}]\n",
        upstream.join(", ")
    )
}

/// Root without CAP_NET_ADMIN and CAP_NET_RAW (either may set a socket mark): root in a
/// container that drops them.
const ROOT_WITHOUT_CAPS: [&str; 4] = [
    "setpriv",
    "--inh-caps=-net_admin,-net_raw",
    "--bounding-set=-net_admin,-net_raw",
    "--",
];

/// Who tries: full root (its dig sets no mark either), root without the capabilities that
/// set marks, and an unprivileged user.
#[derive(Debug, Clone, Copy)]
enum Who {
    Root,
    RootWithoutCaps,
    Nobody,
}

const EVERYONE: [Who; 3] = [Who::Root, Who::RootWithoutCaps, Who::Nobody];

fn run_as(w: &World, who: Who, args: &[&str]) -> CmdOutput {
    match who {
        Who::Root => w.sandbox_cmd(args),
        Who::RootWithoutCaps => {
            let mut full = ROOT_WITHOUT_CAPS.to_vec();
            full.extend_from_slice(args);
            w.sandbox_cmd(&full)
        }
        Who::Nobody => w.sandbox_cmd_as(NOBODY, args),
    }
}

/// `dig @server -p port name A` (`+tcp` if asked) as `who`: whether any reply came back.
fn dig_answered(w: &World, who: Who, server: IpAddr, port: u16, name: &str, tcp: bool) -> bool {
    dig_output(w, who, server, port, name, tcp).contains("->>HEADER<<-")
}

/// Whether the guard answered `name` NOERROR to `who`.
fn guard_answers(w: &World, who: Who, name: &str, tcp: bool) -> bool {
    dig_output(w, who, GUARD_ADDR.ip(), 53, name, tcp).contains("status: NOERROR")
}

fn dig_output(w: &World, who: Who, server: IpAddr, port: u16, name: &str, tcp: bool) -> String {
    let (at, port) = (format!("@{server}"), port.to_string());
    let mut args = vec!["dig", "+tries=1", "+time=2", &at, "-p", &port, name, "A"];
    if tcp {
        args.push("+tcp");
    }
    run_as(w, who, &args).stdout
}

/// The system's python3 (a user's shims, e.g. pyenv under /root, are not readable by
/// [`NOBODY`]).
const PYTHON: &str = "/usr/bin/python3";

/// Item 3: in guard mode nobody in the sandbox reaches the upstream resolvers itself, the
/// guard's uid included (the guard runs as root here, like `World::spawn_guard` does): not
/// over UDP or TCP, not on 53 or 853, not over IPv4 or IPv6, while the guard, whose upstream
/// sockets carry its mark, keeps answering over UDP and TCP, to IPv4 and IPv6 upstreams. On
/// the old main (the uid alone) every root attempt was answered.
#[test]
fn nobody_but_the_guards_marked_sockets_reaches_the_upstream() {
    let w = World::new();
    w.dns_set("direct.pool.example", &[HOST_V4], DEFAULT_DNS_TTL);
    for (i, name) in ["via-guard.pool.example", "via-guard-v6.pool.example"]
        .iter()
        .enumerate()
    {
        w.dns_set(name, &[[HOST2_V4, HOST3_V4][i]], DEFAULT_DNS_TTL);
    }
    let dot = [
        w.listen_tcp(DNS_V4, 853),
        w.listen_udp(DNS_V4, 853),
        w.listen_tcp(DNS_V6, 853),
        w.listen_udp(DNS_V6, 853),
    ];
    // Control: without a table every one of them gets through.
    for who in EVERYONE {
        assert!(
            dig_answered(&w, who, DNS_V4, 53, "direct.pool.example", false),
            "control: {who:?} cannot reach the resolver at all"
        );
    }

    let path = w.write_file("guard.yaml", &guard_policy(&[DNS_V4, DNS_V6]));
    let guard = w.spawn_guard(path.to_str().expect("utf-8 path"));
    let before = w.dns_query_log().len();
    for who in EVERYONE {
        for server in [DNS_V4, DNS_V6] {
            for port in [53, 853] {
                for tcp in [false, true] {
                    assert!(
                        !dig_answered(&w, who, server, port, "direct.pool.example", tcp),
                        "{who:?} reached {server} port {port} (tcp: {tcp}) around the guard"
                    );
                }
            }
        }
    }
    for listener in &dot {
        assert_eq!(
            listener.count(),
            0,
            "port 853 at {} was reached",
            listener.local_addr()
        );
    }

    // A mark cannot be forged without CAP_NET_ADMIN (or CAP_NET_RAW): setting the guard's
    // mark fails, so the attacker's sockets stay unmarked.
    let forge = run_as(
        &w,
        Who::RootWithoutCaps,
        &[
            PYTHON,
            "-c",
            "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
             try:\n    s.setsockopt(socket.SOL_SOCKET, 36, 0x65000000)\n    print('marked')\n\
             except PermissionError:\n    print('EPERM')\n",
        ],
    );
    assert_eq!(forge.stdout.trim(), "EPERM", "{forge}");

    // The guard itself still asks upstream, over UDP and TCP, for every one of them.
    for who in EVERYONE {
        for tcp in [false, true] {
            assert!(
                guard_answers(&w, who, "via-guard.pool.example", tcp),
                "the guard did not answer {who:?} (tcp: {tcp}):\n{}",
                guard.stderr()
            );
        }
    }
    let asked: Vec<DnsQuery> = w.dns_query_log().split_off(before);
    assert!(
        !asked
            .iter()
            .any(|q| q.name.to_ascii_lowercase().contains("direct")),
        "a client other than the guard asked the upstream resolver: {asked:?}"
    );
    assert!(
        asked
            .iter()
            .any(|q| q.name.eq_ignore_ascii_case("via-guard.pool.example"))
    );
    drop(guard);

    // An IPv6 upstream: the guard's marked IPv6 sockets get through, over UDP and TCP.
    let path = w.write_file("guard6.yaml", &guard_policy(&[DNS_V6]));
    let guard = w.spawn_guard(path.to_str().expect("utf-8 path"));
    for tcp in [false, true] {
        assert!(
            guard_answers(&w, Who::Nobody, "via-guard-v6.pool.example", tcp),
            "the guard did not answer over an IPv6 upstream (tcp: {tcp}):\n{}",
            guard.stderr()
        );
        assert!(!dig_answered(
            &w,
            Who::RootWithoutCaps,
            DNS_V6,
            53,
            "direct.pool.example",
            tcp
        ));
    }
    drop(guard);
}

/// Sends a query for `name` to the guard that smuggles `secret` in an EDNS option (code
/// 65001), an answer record, an additional record and trailing bytes, over UDP or TCP, and
/// prints the reply's rcode (or "none").
const SMUGGLE: &str = r#"
import socket, struct, sys
name, secret, tcp = sys.argv[1], sys.argv[2].encode(), sys.argv[3] == "tcp"
qname = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
txt = bytes([len(secret)]) + secret
rr = b"\xc0\x0c" + struct.pack(">HHIH", 16, 1, 60, len(txt)) + txt
opt = b"\0" + struct.pack(">HHIH", 41, 4096, 0, 4 + len(secret)) + struct.pack(">HH", 65001, len(secret)) + secret
msg = struct.pack(">HHHHHH", 0x4242, 0x0100, 1, 1, 0, 2) + qname + struct.pack(">HH", 1, 1) + rr + rr + opt + secret
if tcp:
    s = socket.create_connection(("127.0.0.53", 53), timeout=8)
    s.sendall(struct.pack(">H", len(msg)) + msg)
    try:
        reply = s.recv(65535)[2:]
    except OSError:
        reply = b""
else:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(8)
    s.sendto(msg, ("127.0.0.53", 53))
    try:
        reply = s.recv(65535)
    except OSError:
        reply = b""
print(reply[3] & 15 if len(reply) >= 4 and reply[:2] == b"\x42\x42" else "none")
"#;

/// Item 9: what reaches the upstream is a query the guard built from the question it
/// checked: not the client's EDNS option, records or trailing bytes (on the old main the
/// whole datagram went upstream as it came, id aside), over UDP and over TCP.
#[test]
fn the_guard_forwards_only_the_checked_question() {
    let w = World::new();
    // A capturing upstream: records what it gets and never answers a DNS message.
    let udp = w.listen_udp(HOST3_V4, 53);
    let tcp = w.listen_tcp(HOST3_V4, 53);
    let path = w.write_file("guard.yaml", &guard_policy(&[HOST3_V4]));
    let guard = w.spawn_guard(path.to_str().expect("utf-8 path"));
    const SECRET: &str = "exfiltrated-0123456789-abcdefghij";
    for (transport, listener) in [("udp", &udp), ("tcp", &tcp)] {
        let name = format!("smuggle-{transport}.pool.example");
        let out = w.sandbox_cmd_as(NOBODY, &[PYTHON, "-c", SMUGGLE, &name, SECRET, transport]);
        assert!(out.success(), "{out}");
        assert!(
            listener.wait_for(1, Duration::from_secs(5)),
            "nothing reached the upstream over {transport}:\n{}",
            guard.stderr()
        );
        let hit = &listener.hits()[0];
        let sent = &hit.data;
        let contains = |needle: &[u8]| sent.windows(needle.len()).any(|window| window == needle);
        assert!(
            contains(b"smuggle-".as_slice()),
            "the question went upstream over {transport}: {sent:?}"
        );
        assert!(
            !contains(SECRET.as_bytes()),
            "the client's bytes went upstream over {transport}: {sent:?}"
        );
    }
    drop(guard);
}
