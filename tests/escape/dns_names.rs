//! DNS names and answers as hostile input (red-team session 11, rt-dns). An answer that
//! brings records for names other than the one asked (and not on its CNAME chain) must not
//! install them under the asked name, in resolve mode as in guard mode; and no question for
//! a name the policy does not allow reaches the guard's upstream, whatever its form.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Child, Command, Stdio};

use crate::common::*;

/// Where the hostile resolver listens (a host of the world's internet).
const EVIL_DNS: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 61));

/// The port the policies allow for the names, TCP and UDP.
const PORT: u16 = 9999;

/// A resolver that logs every query it gets (one hex line each, to `argv[2]`) and answers
/// every A and AAAA question with the asked name's address (HOST_V4 / HOST_V6) and, in the
/// same answer section, a record of another name, `stranger.example`, with OTHER_V4 /
/// OTHER_V6 (and the same again in the additional section): a resolver or a zone that slips
/// records of names nobody asked into an answer. UDP and TCP.
const STRANGER_DNS: &str = r#"
import socket, struct, sys, threading
listen, log = sys.argv[1], sys.argv[2]
host4, host6, other4, other6 = sys.argv[3:7]
lock = threading.Lock()
def name(text):
    return b"".join(bytes([len(l)]) + l.encode() for l in text.split(".")) + b"\0"
STRANGER = name("stranger.example")
def rr(owner, qtype, addr):
    if qtype == 1:
        data = socket.inet_pton(socket.AF_INET, addr)
    else:
        data = socket.inet_pton(socket.AF_INET6, addr)
    return owner + struct.pack(">HHIH", qtype, 1, 60, len(data)) + data
def answer(data):
    with lock:
        with open(log, "a") as f:
            f.write(data.hex() + "\n")
    if len(data) < 17:
        return None
    qid, flags = struct.unpack(">HH", data[:4])
    i = 12
    while i < len(data) and data[i] != 0:
        i += data[i] + 1
    qtype = struct.unpack(">H", data[i + 1:i + 3])[0]
    question = data[12:i + 5]
    answers, extra = [], []
    if qtype in (1, 28):
        own = host4 if qtype == 1 else host6
        stranger = other4 if qtype == 1 else other6
        answers = [rr(b"\xc0\x0c", qtype, own), rr(STRANGER, qtype, stranger)]
        extra = [rr(STRANGER, qtype, stranger)]
    header = struct.pack(">HHHHHH", qid, 0x8180 | (flags & 0x0100), 1, len(answers), 0, len(extra))
    return header + question + b"".join(answers) + b"".join(extra)
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((listen, 53))
    while True:
        data, peer = s.recvfrom(4096)
        reply = answer(data)
        if reply:
            s.sendto(reply, peer)
def serve_tcp(c):
    try:
        while True:
            n = c.recv(2)
            if len(n) < 2:
                return
            want, data = struct.unpack(">H", n)[0], b""
            while len(data) < want:
                more = c.recv(want - len(data))
                if not more:
                    return
                data += more
            reply = answer(data)
            if reply:
                c.sendall(struct.pack(">H", len(reply)) + reply)
    finally:
        c.close()
def tcp():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((listen, 53))
    s.listen(16)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve_tcp, args=(c,), daemon=True).start()
threading.Thread(target=tcp, daemon=True).start()
threading.Thread(target=udp, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"#;

/// [`STRANGER_DNS`] on [`EVIL_DNS`] in the world's net namespace; killed when dropped.
struct StrangerDns {
    child: Child,
    log: std::path::PathBuf,
}

impl StrangerDns {
    fn start(w: &World) -> StrangerDns {
        w.add_host(EVIL_DNS);
        let log = w.dir().join("stranger-dns.log");
        std::fs::write(&log, "").expect("the query log");
        let mut child = Command::new("ip")
            .args(["netns", "exec", w.net_name(), PYTHON, "-c", STRANGER_DNS])
            .arg(EVIL_DNS.to_string())
            .arg(&log)
            .args([HOST_V4, HOST_V6, OTHER_V4, OTHER_V6].map(|a| a.to_string()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the hostile DNS server");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let server = StrangerDns { child, log };
        assert_eq!(line.trim(), "ready", "the hostile DNS server did not start");
        server
    }

    /// Every query the server got, as bytes.
    fn queries(&self) -> Vec<Vec<u8>> {
        std::fs::read_to_string(&self.log)
            .expect("the query log")
            .lines()
            .map(|l| {
                (0..l.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&l[i..i + 2], 16).expect("hex"))
                    .collect()
            })
            .collect()
    }
}

impl Drop for StrangerDns {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The addresses of resolved4 and resolved6 in the sandbox (`nft -j`, an independent
/// reader of what the kernel holds).
fn resolved_addrs(w: &World) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for set in ["resolved4", "resolved6"] {
        let listed = w.sandbox_cmd(&["nft", "-j", "list", "set", "inet", "egress_fence", set]);
        assert!(listed.success(), "nft -j list set {set}: {listed}");
        let v: serde_json::Value = serde_json::from_str(&listed.stdout).expect("nft -j output");
        for elem in v["nftables"]
            .as_array()
            .expect("nftables array")
            .iter()
            .filter_map(|o| o["set"]["elem"].as_array())
            .flatten()
        {
            let val = elem.get("elem").map_or(elem, |e| &e["val"]);
            let addr = val["concat"][0].as_str().expect("an address");
            out.push(addr.parse().expect("an IP"));
        }
    }
    out
}

/// Resolve mode: the policy's resolver answers `good.example` with its address and, in the
/// same answer section, an address of `stranger.example`, a name the policy does not hold.
/// hickory hands such an answer over whole (it filters only answers that follow a CNAME), and
/// every A and AAAA record of it was installed under good.example's ports: the stranger's
/// 203.0.113.10 and 2001:db8:2::10 became reachable on 9999. The guard already ignored
/// records off the asked name's CNAME chain; now resolve mode does too.
#[test]
fn resolve_mode_installs_no_records_of_names_not_asked() {
    let w = World::new();
    let _dns = StrangerDns::start(&w);
    let policy = format!(
        "version: 1\nallow:\n  - domain: good.example\n    ports: [{PORT}]\n    protocol: any\n\
         dns:\n  resolvers: [{EVIL_DNS}]\n"
    );
    let path = w.write_file("resolve.yaml", &policy);
    let out = w.egress_fence(&["apply", path.to_str().expect("utf-8")]);
    assert!(out.success(), "{out}");
    let installed = resolved_addrs(&w);
    assert!(
        installed.contains(&HOST_V4) && installed.contains(&HOST_V6),
        "good.example's own addresses are installed: {installed:?}"
    );
    for stranger in [OTHER_V4, OTHER_V6] {
        assert!(
            !installed.contains(&stranger),
            "apply installed {stranger}, an address of stranger.example, under good.example: \
             {installed:?}"
        );
    }
}

/// Sends the guard (argv[1], port 53) every odd form of a question for a name the policy does
/// not allow, over UDP and TCP, each query once, and prints one line per query: its label and
/// the reply's rcode ("none" when no reply came). Allowed names: `api.good.example` and
/// `*.pool.example`; every other question carries the bytes "secret".
const ODD_QUESTIONS: &str = r#"
import socket, struct, sys
guard = sys.argv[1]
def labels(ls):
    return b"".join(bytes([len(l)]) + l for l in ls) + b"\0"
def msg(qname, qtype=1, qclass=1, opcode=0, qd=1, tail=b"", an=0, ns=0, ar=0, flags=0x0100, qid=0x4242):
    header = struct.pack(">HHHHHH", qid, flags | (opcode << 11), qd, an, ns, ar)
    body = (qname + struct.pack(">HH", qtype, qclass)) if qname is not None else b""
    return header + body + tail
GOOD = [b"api", b"good", b"example"]
SECRET = [b"secret", b"attacker", b"example"]
opt_secret = b"\0" + struct.pack(">HHIH", 41, 1232, 0, 10) + struct.pack(">HH", 65001, 6) + b"secret"
cases = [
    ("control allowed", msg(labels(GOOD))),
    ("control wildcard", msg(labels([b"x", b"pool", b"example"]))),
    ("plain secret", msg(labels(SECRET))),
    ("escaped dot under exact", msg(labels([b"secret.api", b"good", b"example"]))),
    ("one label equal as text", msg(labels([b"api.good.example"]))),
    ("two labels equal as text", msg(labels([b"api", b"good.example"]))),
    ("escaped dot under wildcard", msg(labels([b"secret.x", b"pool", b"example"]))),
    ("nul byte", msg(labels([b"secret\0", b"pool", b"example"]))),
    ("ansi escape", msg(labels([b"secret\x1b[2J\n", b"pool", b"example"]))),
    ("utf-8", msg(labels([b"secr\xc3\xa9t", b"pool", b"example"]))),
    ("wildcard base", msg(labels([b"pool", b"example"]))),
    ("star label", msg(labels([b"*", b"pool", b"example"]))),
    ("too deep", msg(labels([b"secret", b"x", b"pool", b"example"]))),
    ("allowed as suffix", msg(labels([b"secret", b"api", b"good", b"example"]))),
    ("class CH", msg(labels(GOOD), qclass=3)),
    ("class ANY", msg(labels(GOOD), qclass=255)),
    ("type ANY", msg(labels(GOOD), qtype=255)),
    ("type AXFR", msg(labels(GOOD), qtype=252)),
    ("notify", msg(labels(GOOD), opcode=4, flags=0, tail=labels(SECRET) + struct.pack(">HHIH", 16, 1, 0, 7) + b"\x06secret", an=1)),
    ("update", msg(labels(GOOD), qtype=6, opcode=5, flags=0, tail=labels(SECRET) + struct.pack(">HHIH", 16, 1, 0, 7) + b"\x06secret", ns=1)),
    ("status opcode", msg(labels(GOOD), opcode=2)),
    ("two questions", msg(labels(GOOD), qd=2, tail=labels(SECRET) + struct.pack(">HH", 1, 1))),
    ("zero questions", msg(None, qd=0, tail=labels(SECRET))),
    ("pointer loop", msg(b"\xc0\x0c")),
    ("forward pointer to secret", msg(b"\xc0\x11", tail=labels(SECRET))),
    ("edns option secret", msg(labels(SECRET), ar=1, tail=opt_secret)),
    ("response bit", msg(labels(SECRET), flags=0x8100)),
    ("long name", msg(labels([b"secret" + b"a" * 57] * 4 + [b"pool", b"example"]))),
]
for label, query in cases:
    for transport in ("udp", "tcp"):
        try:
            if transport == "udp":
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.settimeout(1.5)
                s.sendto(query, (guard, 53))
                reply = s.recv(4096)
            else:
                s = socket.create_connection((guard, 53), timeout=1.5)
                s.sendall(struct.pack(">H", len(query)) + query)
                n = s.recv(2)
                reply = s.recv(struct.unpack(">H", n)[0]) if len(n) == 2 else b""
            s.close()
            rcode = str(reply[3] & 0x0f) if len(reply) >= 4 else "none"
        except OSError as e:
            rcode = "none"
        print(f"{label} {transport} rcode {rcode}", flush=True)
"#;

/// The question labels of a query the upstream got (the guard writes them uncompressed).
fn question_labels(query: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut i = 12;
    while let Some(&len) = query.get(i) {
        if len == 0 {
            break;
        }
        let len = usize::from(len);
        out.push(query[i + 1..i + 1 + len].to_vec());
        i += len + 1;
    }
    out
}

/// Guard mode: every odd form of a question for a name the policy does not allow (an escaped
/// dot, one label that reads like the allowed name, a NUL, an escape sequence, UTF-8, the
/// wildcard's base, a `*` label, one label too deep, class CH or ANY, type ANY or AXFR,
/// NOTIFY, UPDATE and STATUS carrying records, two questions, none, compression loops and
/// forward pointers, an EDNS option, a long name), over UDP and TCP: the upstream gets only
/// the questions of the two allowed names, as asked (class IN, opcode QUERY, no "secret"
/// anywhere). And an answer's record of a name nobody asked installs nothing.
#[test]
fn the_guard_forwards_no_odd_form_of_a_refused_question() {
    let w = World::new();
    let dns = StrangerDns::start(&w);
    let policy = format!(
        "version: 1\nallow:\n  - domain: api.good.example\n    ports: [{PORT}]\n    protocol: any\n\
         \x20 - domain: \"*.pool.example\"\n    ports: [{PORT}]\n    protocol: any\n\
         dns:\n  mode: guard\n  listen: [\"{GUARD_ADDR}\"]\n  upstream: [{EVIL_DNS}]\n\
         log:\n  rate: 1000/second\n  burst: 1000\n"
    );
    let path = w.write_file("guard.yaml", &policy);
    let mut daemon = w.spawn_guard(path.to_str().expect("utf-8"));
    let out = w.adversary_cmd(
        Adversary::Nobody,
        &[PYTHON, "-c", ODD_QUESTIONS, &GUARD_V4.to_string()],
    );
    assert!(out.success(), "{out}");
    for line in out.stdout.lines().filter(|l| l.starts_with("control")) {
        assert!(
            line.ends_with("rcode 0"),
            "an allowed name is answered: {line}"
        );
    }
    let queries = dns.queries();
    eprintln!("{}\nthe upstream got {} queries", out.stdout, queries.len());
    assert_eq!(queries.len(), 4, "the two allowed names, over UDP and TCP");
    for q in &queries {
        let asked: Vec<String> = question_labels(q)
            .iter()
            .map(|l| String::from_utf8_lossy(l).to_ascii_lowercase())
            .collect();
        assert!(
            asked == ["api", "good", "example"] || asked == ["x", "pool", "example"],
            "the upstream was asked {asked:?}: {q:02x?}"
        );
        assert!(!q.windows(6).any(|w| w == b"secret"), "{q:02x?}");
        assert_eq!(q[2] & 0x78, 0, "opcode QUERY: {q:02x?}");
    }
    let installed = resolved_addrs(&w);
    assert!(installed.contains(&HOST_V4), "{installed:?}");
    assert!(
        !installed.contains(&OTHER_V4),
        "the guard installed stranger.example's address: {installed:?}"
    );
    let log = daemon.stderr();
    assert!(
        log.contains(r"name=secret\027[2J\010.pool.example "),
        "the refused name is logged in presentation form:\n{log}"
    );
    for line in log.lines() {
        assert!(
            !line.contains('\x1b') && !line.contains('\0'),
            "a log line carries the client's control bytes: {line:?}"
        );
    }
    daemon.terminate();
}

/// Resolve mode still takes what a CNAME chain (one hop or two, as the world's resolver
/// answers them in one message) reaches from a policy name: only records of names off the
/// chain are left out.
#[test]
fn resolve_mode_still_follows_cname_chains() {
    let w = World::new();
    let (edge4, edge6, edge2) = (HOST_V4, HOST_V6, HOST2_V4);
    w.dns_set("edge.cdn-other.example", &[edge4, edge6], DEFAULT_DNS_TTL);
    w.dns_set("edge2.cdn-other.example", &[edge2], DEFAULT_DNS_TTL);
    w.dns_cname("www.cname.example", "edge.cdn-other.example");
    w.dns_cname("www2.cname.example", "mid.cdn-other.example");
    w.dns_cname("mid.cdn-other.example", "edge2.cdn-other.example");
    let policy = format!(
        "version: 1\nallow:\n  - domain: www.cname.example\n    ports: [{PORT}]\n\
         \x20 - domain: www2.cname.example\n    ports: [{PORT}]\n\
         dns:\n  resolvers: [{DNS_V4}]\n"
    );
    let path = w.write_file("resolve.yaml", &policy);
    let out = w.egress_fence(&["apply", path.to_str().expect("utf-8")]);
    assert!(out.success(), "{out}");
    let installed = resolved_addrs(&w);
    for addr in [edge4, edge6, edge2] {
        assert!(installed.contains(&addr), "{addr}: {installed:?}\n{out}");
    }
}

/// A resolver with fixed answers (A questions; any other type gets the CNAMEs alone), UDP:
/// chains split over several answers (hickory asks again for the target), owner names in
/// other case than asked, CNAMEs out of order, a loop and a CNAME to a name without records.
const CHAIN_FORMS_DNS: &str = r#"
import socket, struct, sys
listen = sys.argv[1]
def name(text):
    return b"".join(bytes([len(l)]) + l.encode() for l in text.split(".")) + b"\0"
def a(owner, addr):
    return name(owner) + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_pton(socket.AF_INET, addr)
def cname(owner, target):
    data = name(target)
    return name(owner) + struct.pack(">HHIH", 5, 1, 60, len(data)) + data
Z = {
 "split.example": [cname("split.example", "TARGET.Other.Example")],
 "target.other.example": [a("Target.other.EXAMPLE", "192.0.2.20")],
 "case.example": [a("CASE.EXAMPLE", "192.0.2.21")],
 "loop.example": [cname("loop.example", "loop2.example"), cname("loop2.example", "loop.example")],
 "loop2.example": [cname("loop2.example", "loop.example"), cname("loop.example", "loop2.example")],
 "dangling.example": [cname("dangling.example", "nowhere.example")],
 "rev.example": [cname("b.rev2.example", "c.rev2.example"), a("c.rev2.example", "192.0.2.23"), cname("rev.example", "b.rev2.example")],
 "b.rev2.example": [a("c.rev2.example", "192.0.2.23"), cname("b.rev2.example", "c.rev2.example")],
 "c.rev2.example": [a("c.rev2.example", "192.0.2.23")],
 "split2.example": [cname("split2.example", "mid.example")],
 "mid.example": [cname("mid.example", "end.example"), a("end.example", "192.0.2.24"), a("stranger.example", "203.0.113.99")],
 "end.example": [a("end.example", "192.0.2.24"), a("stranger.example", "203.0.113.98")],
}
def answer(data):
    qid, flags = struct.unpack(">HH", data[:4])
    i, labels = 12, []
    while data[i] != 0:
        labels.append(data[i + 1:i + 1 + data[i]].decode())
        i += data[i] + 1
    qtype = struct.unpack(">H", data[i + 1:i + 3])[0]
    records = Z.get(".".join(labels).lower(), [])
    if qtype != 1:
        records = [r for r in records if b"\x00\x05\x00\x01" in r]
    header = struct.pack(">HHHHHH", qid, 0x8180 | (flags & 0x0100), 1, len(records), 0, 0)
    return header + data[12:i + 5] + b"".join(records)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((listen, 53))
print("ready", flush=True)
while True:
    data, peer = s.recvfrom(4096)
    s.sendto(answer(data), peer)
"#;

/// Resolve mode takes a chain's records however the resolver hands them (hickory's
/// fully-qualified names against the asked one, owner names in any case, CNAMEs in any
/// order, over several answers), never a stranger's, and a loop or a CNAME to nothing
/// installs nothing and stops nothing else.
#[test]
fn resolve_mode_follows_chains_in_any_form_and_takes_nothing_else() {
    let w = World::new();
    w.add_host(EVIL_DNS);
    let mut child = Command::new("ip")
        .args(["netns", "exec", w.net_name(), PYTHON, "-c", CHAIN_FORMS_DNS])
        .arg(EVIL_DNS.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the scripted DNS server");
    let mut line = String::new();
    let _ = BufReader::new(child.stdout.take().expect("piped stdout")).read_line(&mut line);
    assert_eq!(line.trim(), "ready");
    let mut policy = "version: 1\nallow:\n".to_string();
    for name in [
        "split.example",
        "case.example",
        "loop.example",
        "dangling.example",
        "rev.example",
        "split2.example",
    ] {
        policy += &format!("  - domain: {name}\n    ports: [{PORT}]\n");
    }
    policy += &format!("dns:\n  resolvers: [{EVIL_DNS}]\n");
    let path = w.write_file("resolve.yaml", &policy);
    let out = w.egress_fence(&["apply", path.to_str().expect("utf-8")]);
    let mut installed = resolved_addrs(&w);
    let _ = child.kill();
    let _ = child.wait();
    installed.sort();
    let want: Vec<IpAddr> = ["192.0.2.20", "192.0.2.21", "192.0.2.23", "192.0.2.24"]
        .map(|a| a.parse().expect("an address"))
        .to_vec();
    assert_eq!(installed, want, "{out}");
    for unresolved in ["loop.example", "dangling.example"] {
        assert!(
            out.stderr.contains(&format!("{unresolved}: NOT RESOLVED")),
            "{out}"
        );
    }
}
