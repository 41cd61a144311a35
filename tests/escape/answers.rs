//! Answers are hostile input (issue 10, items 6 and 7). Under an allowed wildcard the zone's
//! owner writes the answers: broadcast, multicast, loopback, unspecified and the sandbox's
//! own addresses must never become resolved elements (else broadcast UDP leaves the
//! sandbox), a TTL of 2^32-1 must not allow an address for 136 years, and a restart or reload
//! must not carry over elements the new policy no longer allows. `status` and `probe` must
//! name resolved elements the policy does not explain.
//!
//! The zone is served by a small hostile DNS server (python3, in the world's "net"
//! namespace at [`EVIL_DNS`]): it answers every A and AAAA question with fixed records and
//! one TTL, which dnsmasq cannot do (its `--local-ttl` stops at 2^31-1, and it would not
//! serve some of these addresses).

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::common::*;

/// Where the hostile zone's server listens (a host of the world's internet).
const EVIL_DNS: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 60));

/// The port the policies allow for the hostile names, TCP and UDP.
const PORT: u16 = 9999;

/// The sandbox subnet's broadcast address (198.51.100.0/24, see `SANDBOX_V4`).
const SUBNET_BROADCAST: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 255));

/// The addresses of item 6 that must never be installed: broadcast, the subnet's broadcast,
/// multicast, unspecified, loopback and the sandbox's own addresses, IPv4 and IPv6.
fn never_installed() -> Vec<IpAddr> {
    vec![
        IpAddr::V4(Ipv4Addr::BROADCAST),
        SUBNET_BROADCAST,
        IpAddr::V4(Ipv4Addr::new(224, 0, 0, 1)),
        IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        SANDBOX_V4,
        IpAddr::V6(Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1)),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
        SANDBOX_V6,
    ]
}

/// A DNS server that answers every A and AAAA question with `addrs` (of that family) and
/// `ttl`, over UDP, echoing the question. Killed when dropped.
struct EvilDns {
    child: Child,
}

const EVIL_DNS_SCRIPT: &str = r#"
import socket, struct, sys
listen, ttl, addrs = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((listen, 53))
print("ready", flush=True)
while True:
    data, peer = s.recvfrom(4096)
    if len(data) < 17:
        continue
    qid, flags = struct.unpack(">HH", data[:4])
    i = 12
    while i < len(data) and data[i] != 0:
        i += data[i] + 1
    qtype = struct.unpack(">H", data[i + 1:i + 3])[0]
    question = data[12:i + 5]
    answers = []
    for a in addrs:
        if qtype == 1 and ":" not in a:
            answers.append(b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, ttl, 4) + socket.inet_pton(socket.AF_INET, a))
        if qtype == 28 and ":" in a:
            answers.append(b"\xc0\x0c" + struct.pack(">HHIH", 28, 1, ttl, 16) + socket.inet_pton(socket.AF_INET6, a))
    header = struct.pack(">HHHHHH", qid, 0x8180 | (flags & 0x0100), 1, len(answers), 0, 0)
    s.sendto(header + question + b"".join(answers), peer)
"#;

impl EvilDns {
    fn start(w: &World, addrs: &[IpAddr], ttl: u32) -> EvilDns {
        w.add_host(EVIL_DNS);
        let list: Vec<String> = addrs.iter().map(ToString::to_string).collect();
        let mut child = Command::new("ip")
            .args(["netns", "exec", w.net_name(), PYTHON, "-c", EVIL_DNS_SCRIPT])
            .arg(EVIL_DNS.to_string())
            .arg(ttl.to_string())
            .arg(list.join(","))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the hostile DNS server");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let server = EvilDns { child };
        assert_eq!(line.trim(), "ready", "the hostile DNS server did not start");
        server
    }
}

impl Drop for EvilDns {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A guard-mode policy allowing each of `zones` (a wildcard such as `*.evil.example`) on
/// `ports` over TCP and UDP, forwarding to [`EVIL_DNS`].
fn guard_policy(zones: &[(&str, u16)]) -> String {
    let mut p = String::from("version: 1\nallow:\n");
    for (zone, port) in zones {
        p.push_str(&format!(
            "  - domain: \"{zone}\"\n    ports: [{port}]\n    protocol: any\n"
        ));
    }
    p.push_str(&format!(
        "dns:\n  mode: guard\n  listen: [\"{GUARD_ADDR}\"]\n  upstream: [{EVIL_DNS}]\n  \
         refresh: {{ min: 30s, max: 1h }}\n  grace: 10m\n"
    ));
    p
}

/// One element of a resolved set as `nft -j list set` shows it.
#[derive(Debug, Clone, PartialEq)]
struct JsonElement {
    addr: IpAddr,
    proto: String,
    port: u16,
    /// Seconds, as `nft -j` gives them.
    timeout: Option<u64>,
    comment: Option<String>,
}

/// The elements of resolved4 and resolved6 in the sandbox, read with `nft -j` (an
/// independent reader of what the kernel holds).
fn resolved_elements(w: &World) -> Vec<JsonElement> {
    let mut out = Vec::new();
    for set in ["resolved4", "resolved6"] {
        let listed = w.sandbox_cmd(&["nft", "-j", "list", "set", "inet", "egress_fence", set]);
        assert!(listed.success(), "nft -j list set {set}: {listed}");
        let v: serde_json::Value = serde_json::from_str(&listed.stdout).expect("nft -j output");
        let sets = v["nftables"].as_array().expect("nftables array");
        for elem in sets
            .iter()
            .filter_map(|o| o["set"]["elem"].as_array())
            .flatten()
        {
            // `{"elem": {"val": {"concat": [...]}, "timeout": N, ...}}` or a bare concat.
            let (val, meta) = match elem.get("elem") {
                Some(e) => (&e["val"], e),
                None => (elem, &serde_json::Value::Null),
            };
            let parts = val["concat"].as_array().expect("a concatenated element");
            out.push(JsonElement {
                addr: parts[0].as_str().expect("address").parse().expect("an IP"),
                proto: parts[1].as_str().unwrap_or("?").to_string(),
                port: parts[2].as_u64().expect("port") as u16,
                timeout: meta["timeout"].as_u64(),
                comment: meta["comment"].as_str().map(String::from),
            });
        }
    }
    out
}

/// `sendto(addr:PORT)` of one UDP datagram from the sandbox as [`NOBODY`], with SO_BROADCAST
/// set (what a process needs to send to a broadcast address): `Ok` if the kernel let it out.
fn send_broadcast(w: &World, addr: IpAddr) -> Result<(), String> {
    let script = "import socket, sys\n\
                  s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
                  s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)\n\
                  s.sendto(b'out', (sys.argv[1], int(sys.argv[2])))\n\
                  print('sent')\n";
    let out = w.sandbox_cmd_as(
        NOBODY,
        &[PYTHON, "-c", script, &addr.to_string(), &PORT.to_string()],
    );
    if out.success() && out.stdout.contains("sent") {
        Ok(())
    } else {
        Err(out.to_string())
    }
}

/// Broadcast UDP is refused before and after (the baseline proves the test can tell).
fn assert_broadcast_refused(w: &World) {
    for addr in [IpAddr::V4(Ipv4Addr::BROADCAST), SUBNET_BROADCAST] {
        let sent = send_broadcast(w, addr);
        let why = sent
            .as_ref()
            .expect_err(&format!("broadcast UDP to {addr}:{PORT} left the sandbox"));
        assert!(why.contains("Operation not permitted"), "{addr}: {why}");
    }
}

fn assert_none_installed(w: &World, context: &str) -> Vec<JsonElement> {
    let elements = resolved_elements(w);
    for bad in never_installed() {
        assert!(
            !elements.iter().any(|e| e.addr == bad),
            "{context}: {bad} was installed: {elements:#?}"
        );
    }
    elements
}

/// Item 6, guard mode: a wildcard zone answers broadcast, multicast, unspecified, loopback
/// and the sandbox's own addresses beside a real host; only the real host is installed, and
/// broadcast UDP stays refused.
#[test]
fn guard_answers_never_install_broadcast_multicast_loopback_or_own_addresses() {
    let w = World::new();
    let mut answers = never_installed();
    answers.extend([HOST_V4, HOST_V6]);
    let _dns = EvilDns::start(&w, &answers, 60);
    let path = w.write_file("guard.yaml", &guard_policy(&[("*.evil.example", PORT)]));
    let mut daemon = w.spawn_guard(path.to_str().expect("utf-8"));

    for rtype in ["A", "AAAA"] {
        let asked = w.dig_as(Some(NOBODY), Some(GUARD_V4), "x1.evil.example", rtype, &[]);
        assert!(asked.answered(), "{rtype}: {}", asked.output);
    }
    assert_broadcast_refused(&w);
    let elements = assert_none_installed(&w, "guard");
    for real in [HOST_V4, HOST_V6] {
        assert!(
            elements.iter().any(|e| e.addr == real && e.port == PORT),
            "the real host {real} must still be installed: {elements:#?}"
        );
    }
    let log = daemon.stderr();
    assert!(
        log.contains("an answered address is never allowed") && log.contains("255.255.255.255"),
        "each dropped address is logged with its name and why:\n{log}"
    );
    daemon.terminate();
}

/// Item 6, resolve mode: `apply` resolves a name whose answers hold the same addresses.
#[test]
fn resolved_names_never_install_broadcast_multicast_loopback_or_own_addresses() {
    let w = World::new();
    let mut answers = never_installed();
    answers.extend([HOST_V4, HOST_V6]);
    let _dns = EvilDns::start(&w, &answers, 60);
    let policy = format!(
        "version: 1\nallow:\n  - domain: bad.example\n    ports: [{PORT}]\n    protocol: any\n\
         dns:\n  resolvers: [{EVIL_DNS}]\n"
    );
    let path = w.write_file("resolve.yaml", &policy);
    let out = w.egress_fence(&["apply", path.to_str().expect("utf-8")]);
    assert!(out.success(), "{out}");
    assert_broadcast_refused(&w);
    let elements = assert_none_installed(&w, "apply");
    assert!(elements.iter().any(|e| e.addr == HOST_V4), "{elements:#?}");
    assert!(
        out.stderr
            .contains("bad.example answered addresses that are never allowed")
            && out
                .stderr
                .contains("255.255.255.255 (the limited broadcast address)")
            && out
                .stderr
                .contains("198.51.100.2 (an address of this host)"),
        "each dropped address is named with why: {out}"
    );
}

/// Item 7: a TTL of 2^32-1 or 2^31 counts as 0 (RFC 2181), and no element outlives
/// `dns.refresh.max` + grace.
#[test]
fn huge_ttls_never_outlive_refresh_max_plus_grace() {
    for ttl in [u32::MAX, 0x8000_0000] {
        let w = World::new();
        let _dns = EvilDns::start(&w, &[HOST_V4], ttl);
        let path = w.write_file("guard.yaml", &guard_policy(&[("*.evil.example", PORT)]));
        let mut daemon = w.spawn_guard(path.to_str().expect("utf-8"));
        let asked = w.dig_as(Some(NOBODY), Some(GUARD_V4), "ttl.evil.example", "A", &[]);
        assert!(asked.answered(), "{}", asked.output);
        let elements = resolved_elements(&w);
        let mine: Vec<&JsonElement> = elements.iter().filter(|e| e.addr == HOST_V4).collect();
        assert!(!mine.is_empty(), "ttl {ttl}: {elements:#?}");
        for e in mine {
            let timeout = e.timeout.expect("a guard element has a timeout");
            assert!(
                timeout <= 3600 + 600,
                "ttl {ttl}: timeout {timeout}s is longer than refresh.max + grace: {e:?}"
            );
            assert_eq!(e.comment.as_deref(), Some("ttl.evil.example"), "{e:?}");
        }
        daemon.terminate();
    }
}

/// Asks the guard for a name under each zone, so each has its elements.
fn ask(w: &World, names: &[&str]) {
    for name in names {
        let asked = w.dig_as(Some(NOBODY), Some(GUARD_V4), name, "A", &[]);
        assert!(asked.answered(), "{name}: {}", asked.output);
    }
}

fn has(elements: &[JsonElement], port: u16) -> bool {
    elements.iter().any(|e| e.addr == HOST_V4 && e.port == port)
}

/// Item 7: a restart with a policy that no longer allows a name drops that name's elements
/// and keeps those still allowed; so does a reload after a restart (the carried elements).
#[test]
fn restart_and_reload_carry_over_only_what_the_new_policy_allows() {
    const KEEP: u16 = 9443;
    const DROP: u16 = 9444;
    let w = World::new();
    let _dns = EvilDns::start(&w, &[HOST_V4], 300);
    let both = guard_policy(&[("*.keep.example", KEEP), ("*.drop.example", DROP)]);
    let only_keep = guard_policy(&[("*.keep.example", KEEP)]);
    let path = w.write_file("guard.yaml", &both);
    let path = path.to_str().expect("utf-8").to_string();

    // Restart: the new policy no longer allows *.drop.example.
    let mut daemon = w.spawn_guard(&path);
    ask(&w, &["a.keep.example", "a.drop.example"]);
    let before = resolved_elements(&w);
    assert!(has(&before, KEEP) && has(&before, DROP), "{before:#?}");
    daemon.terminate();
    w.write_file("guard.yaml", &only_keep);
    let mut daemon = w.spawn_guard(&path);
    let after = resolved_elements(&w);
    assert!(has(&after, KEEP), "still allowed, kept: {after:#?}");
    assert!(!has(&after, DROP), "no longer allowed, dropped: {after:#?}");
    daemon.terminate();

    // Reload: carried elements (from a restart with the same policy) follow the new one.
    w.write_file("guard.yaml", &both);
    let mut daemon = w.spawn_guard(&path);
    ask(&w, &["b.keep.example", "b.drop.example"]);
    daemon.terminate();
    let mut daemon = w.spawn_guard(&path);
    let carried = resolved_elements(&w);
    assert!(has(&carried, KEEP) && has(&carried, DROP), "{carried:#?}");
    w.write_file("guard.yaml", &only_keep);
    daemon.signal(Signal::SIGHUP);
    let dropped = within(Duration::from_secs(5), || {
        let now = resolved_elements(&w);
        has(&now, KEEP) && !has(&now, DROP)
    });
    assert!(
        dropped,
        "after the reload: {:#?}\n{}",
        resolved_elements(&w),
        daemon.stderr()
    );
    daemon.terminate();
}

/// Item 7: an element added by hand (`nft add element ... timeout 1000d`) to the service's
/// table is named by `status` (as drift) and fails `probe`.
#[test]
fn status_and_probe_name_a_hand_added_resolved_element() {
    let w = World::new();
    let _dns = EvilDns::start(&w, &[HOST_V4], 60);
    let path = w.write_file("guard.yaml", &guard_policy(&[("*.evil.example", PORT)]));
    let path = path.to_str().expect("utf-8").to_string();
    w.use_guard_resolver();
    let mut daemon = w.spawn_guard(&path);
    ask(&w, &["ok.evil.example"]);

    let status = w.egress_fence(&["status"]);
    assert!(status.success(), "{status}");
    assert!(!status.stdout.contains("DRIFT"), "{status}");

    // A running service heals its table at once (the element would vanish before `status`
    // reads it): stopped, it leaves the table in place, as after a crash.
    daemon.terminate();
    let added = w.sandbox_cmd(&[
        "nft",
        "add element inet egress_fence resolved4 { 192.0.2.11 . tcp . 443 timeout 1000d }",
    ]);
    assert!(added.success(), "{added}");

    let status = w.egress_fence(&["status"]);
    assert!(status.success(), "{status}");
    assert!(
        status
            .stdout
            .lines()
            .any(|l| l.contains("192.0.2.11 . tcp . 443")
                && l.contains("longer than the policy allows")),
        "status does not name the element and why:\n{status}"
    );
    assert!(status.stdout.contains("DRIFT"), "{status}");
    assert!(!status.stdout.contains("in sync"), "{status}");
    let json = w.egress_fence(&["status", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("status --json");
    assert_eq!(v["drift"], true, "{json}");
    assert!(
        v["unexplained_elements"]
            .as_array()
            .is_some_and(|a| !a.is_empty()),
        "{json}"
    );

    let probe = w.egress_fence(&["probe", &path]);
    assert_eq!(probe.code(), 5, "{probe}");
    let fail = probe
        .stdout
        .lines()
        .find(|l| l.starts_with("FAIL") && l.contains("resolved element 192.0.2.11"))
        .unwrap_or_else(|| panic!("probe does not name the element:\n{probe}"));
    assert!(fail.contains("longer than the policy allows"), "{fail}");
}

/// The deny set `set` as nft lists it (an independent reader): its elements' text.
fn deny_elements(w: &World, set: &str) -> String {
    let listed = w.sandbox_cmd(&["nft", "list", "set", "inet", "egress_fence", set]);
    assert!(listed.success(), "nft list set {set}: {listed}");
    listed.stdout
}

/// Red-team review: behind a NAT64 gateway (RFC 6052) 64:ff9b::a9fe:a9fe is 169.254.169.254
/// and 64:ff9b::a00:5 is 10.0.0.5. An answer with those addresses was installed and passed
/// the deny list, which held only IPv6 networks in deny6. Now deny6 holds the NAT64 image of
/// every denied IPv4 network; answers whose embedded address is never installable
/// (loopback, broadcast, the sandbox's own) and answers in the local-use prefix
/// 64:ff9b:1::/48 are not installed at all.
#[test]
fn nat64_forms_of_denied_or_uninstallable_ipv4_addresses_stay_refused() {
    let w = World::new();
    let v6 = |s: &str| IpAddr::V6(s.parse::<Ipv6Addr>().expect("an IPv6 address"));
    // 169.254.169.254 and 10.0.0.5 in the well-known NAT64 prefix: reachable hosts here.
    let (meta64, priv64) = (v6("64:ff9b::a9fe:a9fe"), v6("64:ff9b::a00:5"));
    w.add_host(meta64);
    w.add_host(priv64);
    let uninstallable = [
        v6("64:ff9b::7f00:1"),      // 127.0.0.1
        v6("64:ff9b::ffff:ffff"),   // 255.255.255.255
        v6("64:ff9b::c633:6402"),   // 198.51.100.2, the sandbox's own
        v6("64:ff9b:1::a9fe:a9fe"), // the local-use prefix
    ];
    let mut answers = vec![meta64, priv64, HOST_V6];
    answers.extend(uninstallable);
    w.dns_set("svc.example", &answers, DEFAULT_DNS_TTL);
    let listeners = [w.listen_tcp(meta64, 80), w.listen_tcp(priv64, 80)];
    let policy = w.write_file(
        "nat64.yaml",
        "version: 1\nallow:\n  - domain: svc.example\n    ports: [80]\ndeny:\n  - preset: cloud-metadata\n  - preset: private-networks\ndns:\n  resolvers: [192.0.2.53]\n",
    );
    // Unfenced, the NAT64 forms are reachable: the test can tell.
    for ip in [meta64, priv64] {
        assert!(
            w.tcp_connects(ip, 80),
            "[{ip}]:80 unfenced: the test proves nothing"
        );
    }

    let out = w.egress_fence(&["apply", policy.to_str().expect("utf-8 path")]);
    assert!(out.success(), "{out}");

    let deny6 = deny_elements(&w, "deny6");
    for image in ["64:ff9b::a9fe:0/112", "64:ff9b::a00:0/104"] {
        assert!(deny6.contains(image), "deny6 lacks {image}: {deny6}");
    }
    let elements = resolved_elements(&w);
    for bad in uninstallable {
        assert!(
            !elements.iter().any(|e| e.addr == bad),
            "{bad} was installed: {elements:#?}"
        );
    }
    assert!(
        elements.iter().any(|e| e.addr == HOST_V6),
        "the plain answer was not installed: {elements:#?}"
    );
    for ip in [meta64, priv64] {
        let c = w.sandbox_cmd_as(
            NOBODY,
            &[
                PYTHON,
                "-c",
                "import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], 80), timeout=2)\n    print('connected')\nexcept OSError as e:\n    print('refused', e)\n",
                &ip.to_string(),
            ],
        );
        assert!(
            !c.stdout.contains("connected"),
            "the NAT64 form {ip} of a denied IPv4 address was reachable: {c}"
        );
    }
    for l in &listeners {
        assert_eq!(
            l.count(),
            1,
            "only the unfenced connection arrived: {:?}",
            l.hits()
        );
    }
    // `plan` warns: the answer stays refused (deny wins).
    let planned = w.egress_fence(&["plan", policy.to_str().expect("utf-8 path")]);
    assert!(
        planned.stderr.contains("64:ff9b::a9fe:a9fe") && planned.stderr.contains("deny wins"),
        "{planned}"
    );
}

/// 3,000 addresses in 198.18.0.0/15, in the order a server would answer them.
fn three_thousand_addresses() -> Vec<IpAddr> {
    (0..3000usize)
        .map(|i| IpAddr::V4(Ipv4Addr::new(198, 18, (i / 250) as u8, (i % 250 + 1) as u8)))
        .collect()
}

/// The most addresses of one family one answer installs (src/core/installable.rs).
const MAX_ADDRS_PER_FAMILY: usize = 32;

/// Red-team review 2, F3: one name under an allowed wildcard answering 3,000 A records,
/// asked once over TCP by nobody, installed 6,000 elements (3,000 x 2 ports) and wrote one
/// ~45 KB log line. Now the answer installs at most the cap per family and port, the log
/// says how many were left out, and no log line grows with the answer.
#[test]
fn one_guard_answer_installs_at_most_the_cap_and_logs_short_lines() {
    let w = World::new();
    w.dns_set(
        "big.pool.example",
        &three_thousand_addresses(),
        DEFAULT_DNS_TTL,
    );
    let policy = format!(
        "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [80, 443]\n    \
         protocol: tcp\ndns:\n  mode: guard\n  listen: [\"{GUARD_ADDR}\"]\n  upstream: [{DNS_V4}]\n"
    );
    let path = w.write_file("guard.yaml", &policy);
    let guard = w.spawn_guard(path.to_str().expect("utf-8"));
    let out = w.adversary_cmd(
        Adversary::Nobody,
        &[
            "dig",
            "+tcp",
            "+tries=1",
            "+time=5",
            "@127.0.0.53",
            "big.pool.example",
            "A",
        ],
    );
    let answered = out.stdout.lines().filter(|l| l.contains("\tA\t")).count();
    assert!(
        answered > 1000,
        "the client gets the upstream's answer: {answered} records"
    );
    let elements = w.set_elements("resolved4");
    let log = guard.stderr();
    drop(guard);
    assert!(
        !elements.is_empty() && elements.len() <= 2 * MAX_ADDRS_PER_FAMILY,
        "one answer installed {} elements",
        elements.len()
    );
    assert!(
        log.contains("left_out=2968"),
        "the log says how many addresses were left out: {log}"
    );
    let longest = log.lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 2000, "a log line of {longest} bytes");
}

/// F3 in resolve mode: a name of the policy answering 3,000 addresses installs at most the
/// cap, with `apply` and with the daemon (which says how many it left out).
#[test]
fn one_resolved_name_installs_at_most_the_cap() {
    let w = World::new();
    w.dns_set("big.example", &three_thousand_addresses(), DEFAULT_DNS_TTL);
    let policy = format!(
        "version: 1\nallow:\n  - domain: big.example\n    ports: [443]\n    protocol: tcp\n\
         dns:\n  resolvers: [{DNS_V4}]\n"
    );
    let path = w.write_file("resolve.yaml", &policy);
    let path = path.to_str().expect("utf-8");
    let out = w.egress_fence(&["apply", path]);
    assert!(out.success(), "{out}");
    let count = |w: &World| w.set_elements("resolved4").len();
    let applied = count(&w);
    assert!(
        applied > 0 && applied <= MAX_ADDRS_PER_FAMILY,
        "apply installed {applied} elements for one name"
    );
    let mut daemon = w.spawn_egress_fence(&["run", path]);
    let said = daemon.wait_for_output("left_out=2968", Duration::from_secs(20));
    let log = daemon.stderr();
    let running = count(&w);
    let _ = daemon.terminate();
    assert!(
        said,
        "the daemon says how many addresses it left out: {log}"
    );
    assert!(
        running > 0 && running <= MAX_ADDRS_PER_FAMILY,
        "the daemon installed {running} elements for one name"
    );
    let longest = log.lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 2000, "a log line of {longest} bytes");
}

/// Asks `n` unique names under pool.example over UDP, 100 at a time, and prints how many
/// answers came with each rcode ("rcode 0 50000", "rcode 2 5000").
const MANY_NAMES: &str = r#"
import socket, struct, sys
n = int(sys.argv[1])
def q(name, qid):
    qname = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
rcodes = {}
for b in range(0, n, 100):
    for i in range(b, min(n, b + 100)):
        s.sendto(q("n%07d.pool.example" % i, i & 0xffff), ("127.0.0.53", 53))
    for i in range(b, min(n, b + 100)):
        try:
            data = s.recv(2000)
        except OSError:
            break
        rcode = data[3] & 0xf
        rcodes[rcode] = rcodes.get(rcode, 0) + 1
for rcode, count in sorted(rcodes.items()):
    print("rcode", rcode, count)
"#;

/// Red-team review 2, F3: 100,000 names invented under an allowed wildcard grew the daemon by
/// ~860 bytes each and its log by 10 MB. Now at most 50,000 names hold live addresses (the
/// next ones get SERVFAIL, logged at the policy's log rate), and the "new addresses allowed"
/// lines are rate-bounded too. 55,000 names take a few seconds.
#[test]
fn invented_names_past_the_cap_get_servfail_and_the_log_stays_small() {
    const CAP: usize = 50_000;
    const ASKED: usize = 55_000;
    let w = World::new();
    w.dns_wildcard("pool.example", HOST2_V4);
    let policy = format!(
        "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [80]\ndns:\n  mode: guard\n  \
         listen: [\"{GUARD_ADDR}\"]\n  upstream: [{DNS_V4}]\n"
    );
    let path = w.write_file("guard.yaml", &policy);
    let guard = w.spawn_guard(path.to_str().expect("utf-8"));
    let asked = ASKED.to_string();
    let out = w.adversary_cmd(Adversary::Nobody, &[PYTHON, "-c", MANY_NAMES, &asked]);
    let log = guard.stderr();
    let status = w.egress_fence(&["status"]);
    drop(guard);
    assert!(out.success(), "{out}");
    let count = |rcode: u8| -> usize {
        out.stdout
            .lines()
            .find_map(|l| l.strip_prefix(&format!("rcode {rcode} "))?.parse().ok())
            .unwrap_or(0)
    };
    let (answered, servfail) = (count(0), count(2));
    assert!(
        answered <= CAP,
        "{answered} names answered past the cap of {CAP}: {out}"
    );
    assert!(
        answered + servfail >= ASKED * 9 / 10 && servfail >= (ASKED - CAP) / 2,
        "the names past the cap get SERVFAIL: {out}"
    );
    assert!(
        log.contains("names hold live addresses"),
        "the refusal is logged: {}",
        log.lines().rev().take(20).collect::<Vec<_>>().join("\n")
    );
    assert!(log.len() < 500_000, "the daemon logged {} bytes", log.len());
    eprintln!("{out}\n{status}");
}

/// Answers every A question with 28 addresses it never gave before (from 198.18.0.0/15, TTL
/// 0): a zone under an allowed wildcard that hands out fresh addresses every time.
const ROTATING_DNS_SCRIPT: &str = r#"
import socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 53))
print("ready", flush=True)
n = 0
while True:
    q, peer = s.recvfrom(4096)
    end = 12
    while end < len(q) and q[end] != 0:
        end += q[end] + 1
    if struct.unpack(">H", q[end + 1:end + 3])[0] != 1:
        s.sendto(q[:2] + struct.pack(">HHHHH", 0x8180, 1, 0, 0, 0) + q[12:end + 5], peer)
        continue
    records = b""
    for i in range(28):
        n += 1
        ip = bytes([198, 18 + (n >> 16 & 1), n >> 8 & 255, n & 255])
        records += b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 0, 4) + ip
    s.sendto(q[:2] + struct.pack(">HHHHH", 0x8180, 1, 28, 0, 0) + q[12:end + 5] + records, peer)
"#;

/// Third review: one name whose zone answers fresh addresses every time grew the resolved
/// sets by everything it answered within `floor` + `grace`. Now one name holds at most 256
/// live addresses of a family; the log says so; another name still gets its addresses.
#[test]
fn one_name_answering_fresh_addresses_every_time_holds_at_most_its_cap() {
    const CAP: usize = 256;
    let w = World::new();
    w.add_host(EVIL_DNS);
    let mut server = w
        .net_command(&[PYTHON, "-c", ROTATING_DNS_SCRIPT])
        .arg(EVIL_DNS.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the rotating DNS server");
    let mut line = String::new();
    let _ = BufReader::new(server.stdout.take().expect("piped stdout")).read_line(&mut line);
    let server = EvilDns { child: server };
    assert_eq!(
        line.trim(),
        "ready",
        "the rotating DNS server did not start"
    );

    let path = w.write_file("guard.yaml", &guard_policy(&[("*.evil.example", PORT)]));
    let guard = w.spawn_guard(path.to_str().expect("utf-8"));
    // 15 answers of 28 fresh addresses: 420 for one name.
    for _ in 0..15 {
        let out = w.adversary_cmd(
            Adversary::Nobody,
            &[
                "dig",
                "+tries=1",
                "+time=5",
                "@127.0.0.53",
                "x.evil.example",
                "A",
            ],
        );
        assert!(out.stdout.contains("NOERROR"), "{out}");
    }
    let for_x = |elements: &[JsonElement]| {
        elements
            .iter()
            .filter(|e| e.comment.as_deref() == Some("x.evil.example") && e.proto == "udp")
            .count()
    };
    let elements = resolved_elements(&w);
    assert_eq!(for_x(&elements), CAP, "one name's live addresses");
    // Another name is not held back by it.
    let out = w.adversary_cmd(
        Adversary::Nobody,
        &[
            "dig",
            "+tries=1",
            "+time=5",
            "@127.0.0.53",
            "y.evil.example",
            "A",
        ],
    );
    assert!(out.stdout.contains("NOERROR"), "{out}");
    let elements = resolved_elements(&w);
    let y = elements
        .iter()
        .filter(|e| e.comment.as_deref() == Some("y.evil.example"))
        .count();
    let log = guard.stderr();
    drop(guard);
    drop(server);
    assert_eq!(y, 2 * 28, "the other name's addresses, tcp and udp");
    assert!(log.contains("live addresses of a family"), "{log}");
}

/// Red team (session 9): a name of 252 characters, which a client may ask under an allowed
/// `**.` wildcard, carried a comment the kernel refuses (EINVAL): its batch was refused, every
/// other answer in it with it, and so was every full apply of the table while the name lived.
/// Now it gets SERVFAIL and leaves nothing in the table; the longest name a comment holds (251
/// characters) is installed with it, and `probe` finds every element explained.
#[test]
fn a_name_too_long_to_be_a_comment_gets_servfail_and_breaks_nothing() {
    let w = World::new();
    w.dns_wildcard("pool.example", HOST2_V4);
    let policy = format!(
        "version: 1\nallow:\n  - domain: \"**.pool.example\"\n    ports: [80]\ndns:\n  mode: guard\n  \
         listen: [\"{GUARD_ADDR}\"]\n  upstream: [{DNS_V4}]\n"
    );
    let path = w.write_file("guard.yaml", &policy);
    let guard = w.spawn_guard(path.to_str().expect("utf-8"));
    let too_long = name_of_length("x", "pool.example", 252);
    let kept = name_of_length("y", "pool.example", 251);

    let refused = w.dig_as(Some(NOBODY), Some(GUARD_V4), &too_long, "A", &[]);
    assert_eq!(
        refused.status.as_deref(),
        Some("SERVFAIL"),
        "{}",
        refused.output
    );
    let held = resolved_elements(&w);
    assert!(
        held.iter().all(|e| e.addr != HOST2_V4),
        "installed for a name no comment holds: {held:?}"
    );

    let answered = w.dig_as(Some(NOBODY), Some(GUARD_V4), &kept, "A", &[]);
    assert!(answered.answered(), "{}", answered.output);
    let held = resolved_elements(&w);
    let element = held
        .iter()
        .find(|e| e.addr == HOST2_V4 && e.port == 80)
        .unwrap_or_else(|| panic!("not installed: {held:?}"));
    assert_eq!(element.comment.as_deref(), Some(kept.as_str()));
    let probe = w.egress_fence(&["probe", path.to_str().expect("utf-8")]);
    let log = guard.stderr();
    drop(guard);
    assert!(
        log.contains("cannot name its addresses in the table"),
        "the refusal is logged: {log}"
    );
    assert!(!log.contains("EINVAL"), "a batch was refused: {log}");
    assert!(!probe.stdout.contains("does not explain"), "probe: {probe}");
}
