//! The DNS guard (`dns.mode: guard`, issue 6): `egress-fence run` is the sandbox's resolver.
//! It forwards only the policy's names upstream, allows exactly the addresses it answered
//! (before the client sees the answer), refuses every other name without asking anyone, and
//! is the only process that may reach a resolver at all.
//!
//! The guard runs as root (the tests' user), so its uid is 0: clients that must not pass as
//! the guard run as [`NOBODY`]. Clients in the test process itself (`dns_ask` and connects
//! inside `in_sandbox_ns`) run as root; they only ask the guard and connect to answered
//! addresses, which the boundary treats the same for every uid.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::sync::{Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;

/// The port every allow entry of these policies opens.
const PORT: u16 = 8080;
/// A port no allow entry opens (a listener there proves an address is reachable at all).
const OTHER_PORT: u16 = 9090;

/// How long a client waits for the guard's answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a client waits for a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A guard-mode policy: each of `domains` allowed on TCP [`PORT`], then `extra` as YAML
/// (more allow entries, or a top-level section such as `deny:`), `dns_extra` appended to
/// `dns:` (lines indented by two spaces).
fn policy(domains: &[&str], extra: &str, dns_extra: &[&str]) -> String {
    let mut p = String::from("version: 1\nallow:\n");
    for d in domains {
        p.push_str(&format!("  - domain: \"{d}\"\n    ports: [{PORT}]\n"));
    }
    p.push_str(extra);
    p.push_str(&format!(
        "dns:\n  mode: guard\n  listen: [\"{GUARD_ADDR}\"]\n  upstream: [{DNS_V4}]\n"
    ));
    for line in dns_extra {
        p.push_str(&format!("  {line}\n"));
    }
    // Every refusal in the log: the tests look for each one (the default rate would hold
    // back a burst; see `refused_queries_are_logged_at_the_policys_rate`).
    p.push_str("log:\n  group: 100\n  rate: 1000/second\n  burst: 1000\n");
    p
}

/// A running guard; drop it before its world (declare it after).
struct Guard {
    daemon: Background,
    _notify: NotifySocket,
}

/// Writes `policy_text`, points the sandbox's resolv.conf at the guard, starts `egress-fence
/// run` in the sandbox and returns once it said READY=1 (panics with its output otherwise).
fn start_guard(w: &World, policy_text: &str) -> Guard {
    let path = w.write_file("guard.yaml", policy_text);
    w.use_guard_resolver();
    let notify = NotifySocket::new(w, "notify.sock");
    let mut daemon = w.spawn_egress_fence_with_env(
        &["run", path.to_str().expect("utf-8 path")],
        &[("NOTIFY_SOCKET", notify.path())],
    );
    if notify
        .wait_for("READY=1", Duration::from_secs(15))
        .is_none()
    {
        let _ = daemon.terminate();
        panic!(
            "the guard never said READY=1\npolicy:\n{policy_text}\nstderr:\n{}",
            daemon.stderr()
        );
    }
    Guard {
        daemon,
        _notify: notify,
    }
}

/// Asks the guard from the sandbox (as root; see the module comment).
fn ask(w: &World, name: &str, rtype: u16, transport: Transport) -> Result<DnsReply, String> {
    w.in_sandbox_ns(|| dns_ask(GUARD_ADDR, name, rtype, transport, ASK_TIMEOUT))
}

/// Asks the guard and insists on NOERROR; returns the answer's addresses.
fn resolve(w: &World, g: &Guard, name: &str, rtype: u16) -> Vec<IpAddr> {
    let reply = ask(w, name, rtype, Transport::Udp)
        .unwrap_or_else(|e| panic!("no answer for {name}: {e}\n{}", g.daemon.stderr()));
    assert_eq!(
        reply.rcode,
        RCODE_NOERROR,
        "{name} {rtype}: {} {reply:?}\n{}",
        reply.rcode_name(),
        g.daemon.stderr()
    );
    reply.addrs()
}

/// A TCP connection from the current thread's namespace.
fn connect_here(addr: IpAddr, port: u16) -> Result<TcpStream, String> {
    TcpStream::connect_timeout(&SocketAddr::new(addr, port), CONNECT_TIMEOUT)
        .map_err(|e| format!("connect to {}: {e}", SocketAddr::new(addr, port)))
}

/// Whether a TCP connection from the sandbox to `addr:port` succeeds.
fn connects(w: &World, addr: IpAddr, port: u16) -> bool {
    w.in_sandbox_ns(|| connect_here(addr, port).is_ok())
}

fn sorted(mut v: Vec<IpAddr>) -> Vec<IpAddr> {
    v.sort();
    v
}

/// The names the upstream resolver was asked, lower case (the guard may vary the case).
fn upstream_names(w: &World) -> Vec<String> {
    w.dns_queries()
        .into_iter()
        .map(|n| n.to_ascii_lowercase())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// 1. Fresh names, connected at once
// ---------------------------------------------------------------------------------------------

/// 1,000 names never asked before, each looked up (A and AAAA) and every address of each
/// answer connected to at once, by one client in the sandbox: not one connection may be
/// refused. Every name's AAAA answer is an address no earlier answer carried (the pool's IPv6
/// addresses are distinct per name), and the A answers rotate through a pool of 374 IPv4
/// addresses (fresh for the first 187 names). Then 100 more names through the sandbox's
/// resolv.conf with curl as an unprivileged user, which must not fail over to a second address
/// either.
#[test]
fn a_thousand_fresh_names_each_connect_at_once() {
    let w = World::new();
    let pool = w.rotating_pool("pool.example", 1100, 2, true);
    let listener = w.listen_tcp_any(PORT);
    let g = start_guard(&w, &policy(&["*.pool.example"], "", &[]));
    let (first, rest) = pool.split_at(1000);

    let started = Instant::now();
    let (problems, connected) = w.in_sandbox_ns(|| {
        let mut problems: Vec<String> = Vec::new();
        let mut connected = 0usize;
        for p in first {
            for (rtype, want) in [(RTYPE_A, p.v4()), (RTYPE_AAAA, p.v6())] {
                let reply = match dns_ask(GUARD_ADDR, &p.name, rtype, Transport::Udp, ASK_TIMEOUT) {
                    Ok(r) if r.rcode == RCODE_NOERROR => r,
                    Ok(r) => {
                        problems.push(format!("{} {rtype}: {}", p.name, r.rcode_name()));
                        continue;
                    }
                    Err(e) => {
                        problems.push(format!("no answer: {e}"));
                        continue;
                    }
                };
                let got = reply.addrs();
                if sorted(got.clone()) != sorted(want.clone()) {
                    problems.push(format!(
                        "{} {rtype}: answered {got:?}, want {want:?}",
                        p.name
                    ));
                }
                for addr in got {
                    match connect_here(addr, PORT) {
                        Ok(_) => connected += 1,
                        Err(e) => problems.push(format!("{}: {e}", p.name)),
                    }
                }
            }
            if problems.len() >= 20 {
                break; // enough to see what is wrong, and a hung guard must not hang the test
            }
        }
        (problems, connected)
    });
    let took = started.elapsed();
    assert!(
        problems.is_empty(),
        "{} problems (first ones):\n{}\nguard stderr:\n{}",
        problems.len(),
        problems.join("\n"),
        g.daemon.stderr()
    );
    assert_eq!(connected, 3000, "2 IPv4 and 1 IPv6 address per name");
    eprintln!("1000 names: 2000 lookups and 3000 connects in {took:?}");
    // Every connection arrived at the address it was made to (not somewhere else).
    assert!(listener.wait_for(3000, Duration::from_secs(10)));
    let mut reached: Vec<IpAddr> = listener.hits().iter().map(|h| h.local.ip()).collect();
    reached.sort();
    reached.dedup();
    let mut want: Vec<IpAddr> = first.iter().flat_map(|p| p.addrs.clone()).collect();
    want.sort();
    want.dedup();
    assert_eq!(reached, want);

    // glibc's resolver (through resolv.conf) and curl, as a user other than the guard's. curl
    // tries the next address when one fails, so a failed attempt shows only in its -v output.
    let script = r#"
        fails=0
        for name in "$@"; do
            out=$(curl -v -sS --noproxy '*' --max-time 3 "http://$name:8080/" 2>&1)
            if [ $? -ne 0 ] || ! printf '%s' "$out" | grep -q 'hello from' \
                || printf '%s' "$out" | grep -qiE 'failed|refused|unreachable|not permitted'; then
                fails=$((fails + 1))
                printf 'FAILED %s:\n%s\n' "$name" "$out"
            fi
        done
        echo "failures: $fails"
    "#;
    let mut args = vec!["bash", "-c", script, "curl-loop"];
    args.extend(rest.iter().map(|p| p.name.as_str()));
    let out = w.sandbox_cmd_as(NOBODY, &args);
    assert!(
        out.success() && out.stdout.contains("failures: 0"),
        "{out}\nguard stderr:\n{}",
        g.daemon.stderr()
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Names outside the policy
// ---------------------------------------------------------------------------------------------

/// Names the upstream resolver knows but the policy does not allow, each with the address
/// [`OTHER_V4`].
const OUTSIDE: [&str; 8] = [
    "c2VjcmV0LXRva2Vu.attacker.example", // what an exfiltrating agent asks
    "pool.example",                      // the wildcard's suffix itself
    "two.levels.pool.example",           // deeper than `*.` reaches
    "evilpool.example",                  // the suffix without its dot
    "exact.example.attacker.example",    // an allowed name as a prefix
    "sub.exact.example",                 // below an exact name
    "notexact.example",
    "pool.example.attacker.example",
];

fn serve_outside_and_allowed(w: &World) {
    for name in OUTSIDE {
        w.dns_set(name, &[OTHER_V4], DEFAULT_DNS_TTL);
    }
    w.dns_set("a.pool.example", &[HOST_V4], DEFAULT_DNS_TTL);
    w.dns_set("exact.example", &[HOST2_V4], DEFAULT_DNS_TTL);
}

/// Asks for every name of [`OUTSIDE`] (A, AAAA, TXT, MX; UDP and TCP) and checks the rcode;
/// then the allowed names; then that the upstream resolver saw the allowed names and none of
/// the others, and that nothing was added for them.
fn check_outside_names(w: &World, g: &mut Guard, want_rcode: u8) {
    let _other = w.listen_tcp(OTHER_V4, PORT);
    for name in OUTSIDE {
        for rtype in [RTYPE_A, RTYPE_AAAA, RTYPE_TXT, RTYPE_MX] {
            for transport in [Transport::Udp, Transport::Tcp] {
                let reply = ask(w, name, rtype, transport)
                    .unwrap_or_else(|e| panic!("no answer for {name}: {e}\n{}", g.daemon.stderr()));
                assert_eq!(
                    (reply.rcode, reply.answers.len()),
                    (want_rcode, 0),
                    "{name} type {rtype} over {transport:?}: {reply:?}"
                );
            }
        }
    }
    // The same through the sandbox's resolv.conf with a real client, as another user.
    let dig = w.dig_as(Some(NOBODY), None, OUTSIDE[0], "A", &[]);
    let want_status = if want_rcode == RCODE_REFUSED {
        "REFUSED"
    } else {
        "NXDOMAIN"
    };
    assert_eq!(dig.status.as_deref(), Some(want_status), "{}", dig.output);

    // Allowed names, asked after all of those, are forwarded.
    assert_eq!(resolve(w, g, "a.pool.example", RTYPE_A), vec![HOST_V4]);
    assert_eq!(resolve(w, g, "exact.example", RTYPE_A), vec![HOST2_V4]);
    assert!(
        within(Duration::from_secs(5), || {
            let asked = upstream_names(w);
            asked.iter().any(|n| n == "a.pool.example")
                && asked.iter().any(|n| n == "exact.example")
        }),
        "the allowed names never reached the upstream resolver: {:?}",
        w.dns_queries()
    );
    let asked = upstream_names(w);
    for name in OUTSIDE {
        let n = asked.iter().filter(|q| *q == name).count();
        assert_eq!(n, 0, "{name} was asked upstream {n} times: {asked:?}");
    }
    assert!(
        w.rogue_dns_query_log().is_empty(),
        "{:?}",
        w.rogue_dns_query_log()
    );
    // Nothing was allowed for them.
    assert!(!connects(w, OTHER_V4, PORT));
    let elements = w.set_elements("resolved4");
    assert!(elements.iter().all(|e| e.addr != OTHER_V4), "{elements:?}");
    // And each refusal was logged with its name.
    for name in OUTSIDE {
        // Logged as asked: case preserved (RFC 1035 presentation form).
        assert!(
            g.daemon.wait_for_output(name, Duration::from_secs(5)),
            "no log line names {name}:\n{}",
            g.daemon.stderr()
        );
    }
    let stderr = g.daemon.stderr();
    let line = stderr
        .lines()
        .find(|l| l.contains(OUTSIDE[0]))
        .expect("checked above");
    assert!(line.contains("refused DNS query"), "{line}");
}

/// Names outside the policy get REFUSED and are never asked upstream (the resolver's query
/// log has not one line for them, while the allowed names asked after them are there).
#[test]
fn names_outside_the_policy_are_refused_and_never_forwarded() {
    let w = World::new();
    serve_outside_and_allowed(&w);
    let mut g = start_guard(&w, &policy(&["*.pool.example", "exact.example"], "", &[]));
    check_outside_names(&w, &mut g, RCODE_REFUSED);
}

/// `refuse_with: nxdomain` answers NXDOMAIN instead, with the same guarantees.
#[test]
fn refuse_with_nxdomain_answers_nxdomain_and_never_forwards() {
    let w = World::new();
    serve_outside_and_allowed(&w);
    let mut g = start_guard(
        &w,
        &policy(
            &["*.pool.example", "exact.example"],
            "",
            &["refuse_with: nxdomain"],
        ),
    );
    check_outside_names(&w, &mut g, RCODE_NXDOMAIN);
}

// ---------------------------------------------------------------------------------------------
// 3. Only the guard reaches a resolver
// ---------------------------------------------------------------------------------------------

/// A sandbox process other than the guard reaches no resolver: not the upstream one (UDP,
/// TCP, IPv6), not another one, not DNS over TLS (853) anywhere, even where an allow entry
/// covers those ports; DNS to anywhere but the upstream is refused for the guard's uid too.
/// Through the guard the same user resolves and connects.
#[test]
fn only_the_guard_reaches_a_resolver() {
    let w = World::new();
    for name in [
        "control.pool.example",
        "udp-direct.pool.example",
        "tcp-direct.pool.example",
        "v6-direct.pool.example",
        "rogue-udp.pool.example",
        "rogue-tcp.pool.example",
        "root-rogue.pool.example",
    ] {
        w.dns_set(name, &[HOST_V4], DEFAULT_DNS_TTL);
    }
    w.dns_set("via-guard.pool.example", &[HOST2_V4], DEFAULT_DNS_TTL);
    w.dns_set("via-guard-tcp.pool.example", &[HOST3_V4], DEFAULT_DNS_TTL);
    let dot_upstream = w.listen_tcp(DNS_V4, 853);
    let dot_elsewhere = w.listen_tcp(HOST_V4, 853);
    let dns_elsewhere = w.listen_udp(HOST_V4, 53);
    let allowed_by_cidr = w.listen_tcp(HOST_V4, 7070);
    let _web = w.listen_tcp(HOST2_V4, PORT);
    let _web3 = w.listen_tcp(HOST3_V4, PORT);

    // Controls without a boundary: the unprivileged client reaches all of it.
    let control = w.dig_as(Some(NOBODY), Some(DNS_V4), "control.pool.example", "A", &[]);
    assert_eq!(control.addrs(), vec![HOST_V4], "{}", control.output);
    let nc = w.sandbox_cmd_as(NOBODY, &["nc", "-z", "-w", "2", &DNS_V4.to_string(), "853"]);
    assert!(nc.success(), "{nc}");
    assert!(dot_upstream.wait_for(1, Duration::from_secs(2)));

    // An allow entry that covers DNS and DoT ports on HOST_V4 (and 7070).
    let cidr = format!("  - cidr: {HOST_V4}/32\n    ports: [53, 853, 7070]\n    protocol: any\n");
    let g = start_guard(&w, &policy(&["*.pool.example"], &cidr, &[]));

    let refused = |uid: Option<u32>, server: IpAddr, name: &str, extra: &[&str]| {
        let r = w.dig_as(uid, Some(server), name, "A", extra);
        assert!(
            !r.answered(),
            "{name} @{server} {extra:?} as {uid:?} was answered:\n{}",
            r.output
        );
    };
    refused(Some(NOBODY), DNS_V4, "udp-direct.pool.example", &[]);
    refused(Some(NOBODY), DNS_V4, "tcp-direct.pool.example", &["+tcp"]);
    refused(Some(NOBODY), DNS_V6, "v6-direct.pool.example", &[]);
    refused(Some(NOBODY), ROGUE_DNS_V4, "rogue-udp.pool.example", &[]);
    refused(
        Some(NOBODY),
        ROGUE_DNS_V4,
        "rogue-tcp.pool.example",
        &["+tcp"],
    );
    // The guard's own uid may ask the upstream resolvers only.
    refused(None, ROGUE_DNS_V4, "root-rogue.pool.example", &[]);

    // DNS over TLS: to the upstream resolver and elsewhere; DNS to an address an allow entry
    // covers; while the same allow entry's other port works.
    for (uid, addr) in [
        (Some(NOBODY), DNS_V4),
        (Some(NOBODY), HOST_V4),
        (None, HOST_V4),
    ] {
        let args = ["nc", "-z", "-w", "2", &addr.to_string(), "853"];
        let out = match uid {
            Some(uid) => w.sandbox_cmd_as(uid, &args),
            None => w.sandbox_cmd(&args),
        };
        assert!(
            !out.success(),
            "port 853 on {addr} as {uid:?} connected: {out}"
        );
    }
    let sent = w.udp_send(HOST_V4, 53, b"not really a query");
    assert!(!sent.success(), "udp to {HOST_V4}:53 left: {sent}");
    assert!(
        w.tcp_connects(HOST_V4, 7070),
        "the cidr allow entry itself works"
    );
    assert!(allowed_by_cidr.wait_for(1, Duration::from_secs(2)));
    assert_eq!(dot_upstream.count(), 1, "only the control connected to 853");
    assert_eq!(dot_elsewhere.count(), 0);
    assert_eq!(dns_elsewhere.count(), 0);

    // Through the guard, the same user resolves (UDP and TCP) and connects by name.
    let via = w.dig_as(Some(NOBODY), None, "via-guard.pool.example", "A", &[]);
    assert_eq!(via.addrs(), vec![HOST2_V4], "{}", via.output);
    let via_tcp = w.dig_as(
        Some(NOBODY),
        None,
        "via-guard-tcp.pool.example",
        "A",
        &["+tcp"],
    );
    assert_eq!(via_tcp.addrs(), vec![HOST3_V4], "{}", via_tcp.output);
    let curl = w.sandbox_cmd_as(
        NOBODY,
        &[
            "curl",
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "5",
            &format!("http://via-guard.pool.example:{PORT}/"),
        ],
    );
    assert!(curl.stdout.contains("hello from"), "{curl}");

    // The resolvers saw only the guard's questions.
    assert!(within(Duration::from_secs(5), || {
        upstream_names(&w)
            .iter()
            .any(|n| n == "via-guard-tcp.pool.example")
    }));
    let asked = upstream_names(&w);
    assert!(
        !asked
            .iter()
            .any(|n| n.contains("direct") || n.contains("rogue")),
        "a client other than the guard asked the upstream resolver: {asked:?}"
    );
    assert!(
        w.rogue_dns_query_log().is_empty(),
        "{:?}",
        w.rogue_dns_query_log()
    );

    // Public DNS-over-HTTPS resolvers are denied (read from the table; nothing is sent).
    for doh in ["8.8.8.8", "1.1.1.1", "9.9.9.9"] {
        let out = w.sandbox_cmd(&[
            "nft",
            "get",
            "element",
            "inet",
            "egress_fence",
            "deny4",
            &format!("{{ {doh} }}"),
        ]);
        assert!(out.success(), "{doh} is not in deny4: {out}");
    }
    drop(g);
}

// ---------------------------------------------------------------------------------------------
// 4. Wildcards, CNAME chains, AAAA, truncation
// ---------------------------------------------------------------------------------------------

/// `*.x` covers one label, `**.x` any depth, neither covers `x`; names match whatever their
/// case. An answered address connects; the address of a refused name stays closed.
#[test]
fn wildcard_depth_and_exact_names() {
    let w = World::new();
    let cases: [(&str, bool); 11] = [
        ("one.pool.example", true),
        ("two.levels.pool.example", false),
        ("pool.example", false),
        ("a.deep.example", true),
        ("a.b.c.deep.example", true),
        ("deep.example", false),
        ("exact.example", true),
        ("sub.exact.example", false),
        // Names match whatever their case (resolvers using 0x20 randomisation vary it).
        ("MiXeD.pOOl.ExAmple", true),
        ("x.deep.example.evil.example", false),
        ("xdeep.example", false),
    ];
    let mut hosts = Vec::new();
    for (i, (name, _)) in cases.iter().enumerate() {
        w.dns_set(name, &[pool_v4(i)], DEFAULT_DNS_TTL);
        hosts.push(pool_v4(i));
    }
    w.add_hosts(&hosts);
    let _l = w.listen_tcp_any(PORT);
    let g = start_guard(
        &w,
        &policy(
            &["*.pool.example", "**.deep.example", "exact.example"],
            "",
            &[],
        ),
    );
    for (i, (asked, allowed)) in cases.iter().enumerate() {
        let reply = ask(&w, asked, RTYPE_A, Transport::Udp).expect("an answer");
        if *allowed {
            assert_eq!(
                (reply.rcode, reply.addrs()),
                (RCODE_NOERROR, vec![pool_v4(i)]),
                "{asked}: {reply:?}\n{}",
                g.daemon.stderr()
            );
            assert!(connects(&w, pool_v4(i), PORT), "{asked}");
        } else {
            assert_eq!(reply.rcode, RCODE_REFUSED, "{asked}: {reply:?}");
            assert!(!connects(&w, pool_v4(i), PORT), "{asked} was refused");
        }
    }
}

/// An allowed alias whose CNAME chain (one or two hops) ends at a name outside the policy:
/// the target's A and AAAA addresses become reachable on the alias's ports (not others),
/// while the target asked directly is refused.
#[test]
fn cname_chains_allow_the_targets_addresses_on_the_aliases_ports() {
    let w = World::new();
    let (edge4, edge6, edge2) = (pool_v4(10), pool_v6(10), pool_v4(11));
    w.add_hosts(&[edge4, edge6, edge2]);
    w.dns_set("edge.cdn-other.example", &[edge4, edge6], DEFAULT_DNS_TTL);
    w.dns_set("edge2.cdn-other.example", &[edge2], DEFAULT_DNS_TTL);
    w.dns_cname("www.cname.example", "edge.cdn-other.example");
    w.dns_cname("www2.cname.example", "mid.cdn-other.example");
    w.dns_cname("mid.cdn-other.example", "edge2.cdn-other.example");
    let _l = w.listen_tcp_any(PORT);
    let _other = w.listen_tcp_any(OTHER_PORT);
    let g = start_guard(&w, &policy(&["*.cname.example"], "", &[]));

    // The world serves what the test means (asked straight from the net namespace).
    let direct = w.in_net_ns(|| {
        dns_ask(
            SocketAddr::new(DNS_V4, 53),
            "www2.cname.example",
            RTYPE_A,
            Transport::Udp,
            ASK_TIMEOUT,
        )
    });
    let direct = direct.expect("the upstream resolver answers");
    assert_eq!(direct.addrs(), vec![edge2], "{direct:?}");
    assert_eq!(direct.answers.len(), 3, "two CNAMEs and an A: {direct:?}");

    assert!(!connects(&w, edge4, PORT), "closed before the answer");
    let reply = ask(&w, "www.cname.example", RTYPE_A, Transport::Udp).expect("an answer");
    assert_eq!(
        reply.rcode,
        RCODE_NOERROR,
        "{reply:?}\n{}",
        g.daemon.stderr()
    );
    assert!(
        reply
            .answers
            .iter()
            .any(|a| a.data == RData::Name("edge.cdn-other.example".into())),
        "the chain reaches the client: {reply:?}"
    );
    assert_eq!(reply.addrs(), vec![edge4]);
    assert!(
        connects(&w, edge4, PORT),
        "the target's address, on the alias's port"
    );
    assert!(
        !connects(&w, edge4, OTHER_PORT),
        "only on the alias's ports"
    );

    let reply = ask(&w, "www.cname.example", RTYPE_AAAA, Transport::Udp).expect("an answer");
    assert_eq!(reply.addrs(), vec![edge6], "{reply:?}");
    assert!(connects(&w, edge6, PORT), "the target's IPv6 address");

    let reply = ask(&w, "www2.cname.example", RTYPE_A, Transport::Tcp).expect("an answer");
    assert_eq!(
        reply.addrs(),
        vec![edge2],
        "{reply:?}\n{}",
        g.daemon.stderr()
    );
    assert!(connects(&w, edge2, PORT), "the end of a two-hop chain");

    for target in ["edge.cdn-other.example", "mid.cdn-other.example"] {
        let reply = ask(&w, target, RTYPE_A, Transport::Udp).expect("an answer");
        assert_eq!(reply.rcode, RCODE_REFUSED, "{target}: {reply:?}");
    }
    let elements = w.set_elements("resolved4");
    assert!(
        elements.iter().all(|e| e.port == PORT && e.proto == "tcp"),
        "{elements:?}"
    );
}

/// AAAA answers allow IPv6 connections (and only to the answered address).
#[test]
fn aaaa_answers_allow_ipv6() {
    let w = World::new();
    let (v6, v6_other) = (pool_v6(20), pool_v6(21));
    w.add_hosts(&[v6, v6_other]);
    w.dns_set("six.pool.example", &[v6], DEFAULT_DNS_TTL);
    w.dns_set(
        "dual.pool.example",
        &[pool_v4(20), v6_other],
        DEFAULT_DNS_TTL,
    );
    w.add_hosts(&[pool_v4(20)]);
    let _l = w.listen_tcp_any(PORT);
    let g = start_guard(&w, &policy(&["*.pool.example"], "", &[]));

    assert!(!connects(&w, v6, PORT));
    assert_eq!(resolve(&w, &g, "six.pool.example", RTYPE_AAAA), vec![v6]);
    assert!(connects(&w, v6, PORT));
    // An A question allows the A answer only.
    assert_eq!(
        resolve(&w, &g, "dual.pool.example", RTYPE_A),
        vec![pool_v4(20)]
    );
    assert!(connects(&w, pool_v4(20), PORT));
    assert!(!connects(&w, v6_other, PORT), "not answered yet");
    assert_eq!(
        resolve(&w, &g, "dual.pool.example", RTYPE_AAAA),
        vec![v6_other]
    );
    assert!(connects(&w, v6_other, PORT));
    let elements = w.set_elements("resolved6");
    assert!(
        elements.iter().any(|e| e.addr == v6 && e.port == PORT),
        "{elements:?}"
    );
}

/// An answer too big for UDP without EDNS: the guard's UDP answer is truncated (TC), dig
/// retries over TCP through the guard and gets all 32 addresses, and every one of them
/// connects, including those the truncated answer did not carry.
#[test]
fn a_truncated_answer_falls_back_to_tcp_and_every_address_connects() {
    let w = World::new();
    // 32 A records, as many as one answer installs of a family (src/core/installable.rs): 512
    // bytes of answers, more than a UDP answer without EDNS may carry.
    let big: Vec<IpAddr> = sorted((100..132).map(pool_v4).collect());
    w.add_hosts(&big);
    w.dns_set("big.pool.example", &big, DEFAULT_DNS_TTL);
    w.dns_set("big2.pool.example", &big, DEFAULT_DNS_TTL);
    let _l = w.listen_tcp_any(PORT);
    let g = start_guard(&w, &policy(&["*.pool.example"], "", &[]));

    // dig without EDNS over UDP to the guard (resolv.conf), falling back to TCP.
    let full = w.dig_as(None, None, "big.pool.example", "A", &["+noedns", "+stats"]);
    assert_eq!(full.status.as_deref(), Some("NOERROR"), "{}", full.output);
    assert!(
        full.output
            .stdout
            .contains("Truncated, retrying in TCP mode")
            && full.output.stdout.contains("(TCP)"),
        "dig did not fall back to TCP:\n{}",
        full.output
    );
    assert_eq!(full.sorted_addrs(), big, "{}", full.output);
    let unreachable: Vec<IpAddr> = w.in_sandbox_ns(|| {
        big.iter()
            .copied()
            .filter(|a| connect_here(*a, PORT).is_err())
            .collect()
    });
    assert!(
        unreachable.is_empty(),
        "not allowed after the TCP answer: {unreachable:?}\n{}",
        g.daemon.stderr()
    );

    // The guard's UDP answer to that question is indeed truncated (kept with +ignore) and
    // carries only some of the addresses: the others came with the TCP answer.
    let truncated = w.dig_as(
        None,
        None,
        "big2.pool.example",
        "A",
        &["+noedns", "+ignore"],
    );
    assert!(
        truncated.flags.iter().any(|f| f == "tc"),
        "no TC flag:\n{}",
        truncated.output
    );
    assert!(truncated.addrs().len() < big.len(), "{}", truncated.output);

    // The in-process client over TCP straight away, too.
    let reply = ask(&w, "big2.pool.example", RTYPE_A, Transport::Tcp).expect("a TCP answer");
    assert!(!reply.truncated);
    assert_eq!(sorted(reply.addrs()), big);
}

/// Deny wins in guard mode too: an allowed name answering an address in a denied network
/// (DNS rebinding) is answered, but the address stays refused, and the guard says why.
#[test]
fn an_allowed_name_answering_a_denied_address_stays_refused() {
    let w = World::new();
    w.dns_set("rebind.pool.example", &[OTHER_V4], DEFAULT_DNS_TTL);
    w.dns_set("fine.pool.example", &[HOST_V4], DEFAULT_DNS_TTL);
    let denied = w.listen_tcp(OTHER_V4, PORT);
    let _fine = w.listen_tcp(HOST_V4, PORT);
    let deny = "deny:\n  - cidr: 203.0.113.0/24\n";
    let mut g = start_guard(&w, &policy(&["*.pool.example"], deny, &[]));

    let _ = ask(&w, "rebind.pool.example", RTYPE_A, Transport::Udp).expect("an answer");
    assert!(
        !connects(&w, OTHER_V4, PORT),
        "deny must win over the answer"
    );
    assert_eq!(denied.count(), 0);
    assert!(
        g.daemon
            .wait_for_output("stays refused (deny wins)", Duration::from_secs(5)),
        "{}",
        g.daemon.stderr()
    );
    assert_eq!(resolve(&w, &g, "fine.pool.example", RTYPE_A), vec![HOST_V4]);
    assert!(connects(&w, HOST_V4, PORT), "the control");
}

/// With the upstream resolver down, an allowed name gets SERVFAIL (UDP and TCP), promptly
/// and never an address, and nothing is added; once it is back, the name resolves.
#[test]
fn an_unreachable_upstream_gives_servfail() {
    let w = World::new();
    w.dns_set("down.pool.example", &[HOST_V4], DEFAULT_DNS_TTL);
    let _l = w.listen_tcp(HOST_V4, PORT);
    let g = start_guard(&w, &policy(&["*.pool.example"], "", &[]));
    w.dns_stop();
    for transport in [Transport::Udp, Transport::Tcp] {
        let reply = w
            .in_sandbox_ns(|| {
                dns_ask(
                    GUARD_ADDR,
                    "down.pool.example",
                    RTYPE_A,
                    transport,
                    Duration::from_secs(10),
                )
            })
            .unwrap_or_else(|e| panic!("no answer over {transport:?}: {e}"));
        assert_eq!(
            (reply.rcode, reply.answers.len()),
            (RCODE_SERVFAIL, 0),
            "{transport:?}: {reply:?}"
        );
    }
    assert!(!connects(&w, HOST_V4, PORT));
    w.dns_start();
    assert_eq!(resolve(&w, &g, "down.pool.example", RTYPE_A), vec![HOST_V4]);
    assert!(connects(&w, HOST_V4, PORT));
}

// ---------------------------------------------------------------------------------------------
// 5. Concurrency
// ---------------------------------------------------------------------------------------------

/// 50 clients asking 50 fresh names at the same moment (half over TCP), then 20 rounds of
/// two clients racing for the same fresh name (one over UDP, one over TCP): every client is
/// answered and connects to every address it got, at once.
#[test]
fn concurrent_clients_and_raced_names_are_all_answered_and_connect() {
    let w = World::new();
    let pool = w.rotating_pool("conc.example", 90, 1, true);
    let _l = w.listen_tcp_any(PORT);
    let g = start_guard(&w, &policy(&["*.conc.example"], "", &[]));
    let (parallel, raced) = pool.split_at(50);

    let problems = Mutex::new(Vec::<String>::new());
    let client = |p: &PoolName, rtype: u16, transport: Transport| {
        let want = if rtype == RTYPE_A { p.v4() } else { p.v6() };
        match dns_ask(GUARD_ADDR, &p.name, rtype, transport, ASK_TIMEOUT) {
            Ok(r) if r.rcode == RCODE_NOERROR && sorted(r.addrs()) == want => {
                for a in r.addrs() {
                    if let Err(e) = connect_here(a, PORT) {
                        problems
                            .lock()
                            .unwrap()
                            .push(format!("{} {transport:?}: {e}", p.name));
                    }
                }
            }
            other => problems
                .lock()
                .unwrap()
                .push(format!("{} {rtype} {transport:?}: {other:?}", p.name)),
        }
    };
    w.in_sandbox_ns(|| {
        // Threads made here are in the sandbox namespace too (they inherit this thread's).
        let barrier = Barrier::new(parallel.len());
        thread::scope(|s| {
            for (i, p) in parallel.iter().enumerate() {
                let (barrier, client) = (&barrier, &client);
                s.spawn(move || {
                    let transport = if i.is_multiple_of(2) {
                        Transport::Udp
                    } else {
                        Transport::Tcp
                    };
                    barrier.wait();
                    client(p, RTYPE_A, transport);
                    client(p, RTYPE_AAAA, transport);
                });
            }
        });
        for (round, p) in raced.iter().enumerate() {
            let rtype = if round.is_multiple_of(2) {
                RTYPE_A
            } else {
                RTYPE_AAAA
            };
            let barrier = Barrier::new(2);
            thread::scope(|s| {
                for transport in [Transport::Udp, Transport::Tcp] {
                    let (barrier, client) = (&barrier, &client);
                    s.spawn(move || {
                        barrier.wait();
                        client(p, rtype, transport);
                    });
                }
            });
        }
    });
    let problems = problems.into_inner().unwrap();
    assert!(
        problems.is_empty(),
        "{} problems:\n{}\nguard stderr:\n{}",
        problems.len(),
        problems.join("\n"),
        g.daemon.stderr()
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Cold start
// ---------------------------------------------------------------------------------------------

/// The very first question, asked the moment the guard says READY=1, is answered (once, no
/// retry) and its address connects: nothing waits for a timer.
#[test]
fn the_first_query_after_ready_is_answered_and_connects() {
    let w = World::new();
    w.dns_set("cold.pool.example", &[HOST_V4], DEFAULT_DNS_TTL);
    w.dns_set("cold6.pool.example", &[HOST_V6], DEFAULT_DNS_TTL);
    let _l = w.listen_tcp_any(PORT);
    let g = start_guard(&w, &policy(&["*.pool.example"], "", &[]));
    let (v4, v6) = w.in_sandbox_ns(|| {
        let v4 = dns_ask(
            GUARD_ADDR,
            "cold.pool.example",
            RTYPE_A,
            Transport::Udp,
            ASK_TIMEOUT,
        )
        .map(|r| (r.rcode, r.addrs(), connect_here(HOST_V4, PORT).map(|_| ())));
        let v6 = dns_ask(
            GUARD_ADDR,
            "cold6.pool.example",
            RTYPE_AAAA,
            Transport::Tcp,
            ASK_TIMEOUT,
        )
        .map(|r| (r.rcode, r.addrs(), connect_here(HOST_V6, PORT).map(|_| ())));
        (v4, v6)
    });
    assert_eq!(
        v4,
        Ok((RCODE_NOERROR, vec![HOST_V4], Ok(()))),
        "{}",
        g.daemon.stderr()
    );
    assert_eq!(
        v6,
        Ok((RCODE_NOERROR, vec![HOST_V6], Ok(()))),
        "{}",
        g.daemon.stderr()
    );
}

// ---------------------------------------------------------------------------------------------
// 7. Element lifetime
// ---------------------------------------------------------------------------------------------

/// TTL 1 s, floor 1 s, grace 2 s: an element lives max(TTL, floor) + grace = 3 s.
const LIFETIME: Duration = Duration::from_secs(3);

/// A world serving life.pool.example (HOST_V4) with TTL 1, a listener on every address and a
/// guard with floor 1s and grace 2s.
fn lifetime_world() -> (World, Listener) {
    let w = World::new();
    w.dns_set_ttl(1);
    w.dns_set("life.pool.example", &[HOST_V4], 1);
    let l = w.listen_tcp_any(PORT);
    (w, l)
}

fn lifetime_guard(w: &World) -> Guard {
    start_guard(
        w,
        &policy(&["*.pool.example"], "", &["floor: 1s", "grace: 2s"]),
    )
}

/// Sends `line` on `conn` and reads the echo.
fn echo(conn: &mut BufReader<TcpStream>, line: &str) -> Result<(), String> {
    conn.get_mut()
        .write_all(format!("{line}\n").as_bytes())
        .map_err(|e| format!("send {line}: {e}"))?;
    let mut got = String::new();
    conn.read_line(&mut got)
        .map_err(|e| format!("echo of {line}: {e}"))?;
    if got.trim_end() == line {
        Ok(())
    } else {
        Err(format!("echo of {line}: got {got:?}"))
    }
}

/// A long-lived connection from the sandbox to the echo listener.
fn open_echo(w: &World, addr: IpAddr) -> BufReader<TcpStream> {
    let stream = w
        .in_sandbox_ns(|| connect_here(addr, PORT))
        .expect("connects while the element exists");
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("read timeout");
    BufReader::new(stream)
}

/// The element appears, with its timeout, before the client has the answer; it disappears
/// once that ran out (new connections are refused then); the next answer adds it again.
#[test]
fn an_element_lives_ttl_or_floor_plus_grace_then_expires_and_the_next_answer_adds_it_again() {
    let (w, _l) = lifetime_world();
    let g = lifetime_guard(&w);
    let element = || w.resolved_element(HOST_V4, PORT);

    assert_eq!(resolve(&w, &g, "life.pool.example", RTYPE_A), vec![HOST_V4]);
    let e = element().expect("the answered address is in resolved4 when the answer arrives");
    let timeout = e.timeout.expect("the element has a timeout");
    assert!(
        timeout >= LIFETIME - Duration::from_millis(200) && timeout <= LIFETIME,
        "timeout {timeout:?}, want max(TTL 1s, floor 1s) + grace 2s = 3s: {e:?}"
    );
    assert!(connects(&w, HOST_V4, PORT));

    assert!(
        within(LIFETIME + Duration::from_secs(3), || element().is_none()),
        "the element never expired: {:?}\n{}",
        element(),
        g.daemon.stderr()
    );
    assert!(
        !connects(&w, HOST_V4, PORT),
        "a new connection after expiry"
    );

    assert_eq!(resolve(&w, &g, "life.pool.example", RTYPE_A), vec![HOST_V4]);
    let e = element().expect("added again by the next answer");
    assert!(e.timeout.is_some_and(|t| t > LIFETIME / 2), "{e:?}");
    assert!(connects(&w, HOST_V4, PORT));
}

/// An answer served again halfway through the element's life renews its timeout in place:
/// `expires` grows back, the element is present at every look (also beyond its first
/// lifetime), and the kernel never reports it deleted.
#[test]
fn a_repeated_answer_refreshes_the_element_in_place() {
    let (w, _l) = lifetime_world();
    let g = lifetime_guard(&w);
    let element = || w.resolved_element(HOST_V4, PORT);
    // Every change to the table from here on.
    let monitor = w.spawn_in_sandbox(&["stdbuf", "-oL", "nft", "monitor"]);
    thread::sleep(Duration::from_millis(300));

    assert_eq!(resolve(&w, &g, "life.pool.example", RTYPE_A), vec![HOST_V4]);
    let added_at = Instant::now();
    let mut samples: Vec<(Duration, Option<Duration>)> = Vec::new();
    let mut asked_again_at = None;
    while added_at.elapsed() < Duration::from_millis(3500) {
        // Asked again when half its life is left: the guard renews an element whose expiry
        // would move later by more than half the grace (1 s here), and this moves it 1.5 s.
        if asked_again_at.is_none() && added_at.elapsed() >= Duration::from_millis(1500) {
            assert_eq!(resolve(&w, &g, "life.pool.example", RTYPE_A), vec![HOST_V4]);
            asked_again_at = Some(samples.len());
        }
        samples.push((added_at.elapsed(), element().and_then(|e| e.expires)));
        thread::sleep(Duration::from_millis(50));
    }
    let asked_again_at = asked_again_at.expect("asked again");
    assert!(
        samples.iter().all(|(_, expires)| expires.is_some()),
        "the element disappeared although it was answered again before expiry: {samples:?}"
    );
    let before = samples[asked_again_at - 1].1.expect("present");
    let after = samples[asked_again_at].1.expect("present");
    assert!(
        after > before + Duration::from_millis(800) && after <= LIFETIME,
        "the repeated answer did not renew the timeout (expires {before:?} -> {after:?}): \
         {samples:?}"
    );
    // 3.5 s after it was added, beyond its first lifetime, it still lets connections through.
    assert!(connects(&w, HOST_V4, PORT));

    let events = monitor.stdout();
    assert!(
        events.contains(&format!(
            "add element inet egress_fence resolved4 {{ {HOST_V4} "
        )),
        "the monitor did not see the element added:\n{events}"
    );
    let deleted: Vec<&str> = events
        .lines()
        .filter(|l| l.contains("delete element") && l.contains(&HOST_V4.to_string()))
        .collect();
    assert!(
        deleted.is_empty(),
        "renewed by deleting and adding: {deleted:?}"
    );
}

/// A connection opened while the element existed keeps working after the element expired
/// (`ct state established` comes first), while new connections are refused. The guard is
/// stopped (SIGSTOP) meanwhile, so that nothing renews the element: this isolates the rule.
#[test]
fn an_established_connection_outlives_its_element() {
    let (w, _l) = lifetime_world();
    let g = lifetime_guard(&w);
    let element = || w.resolved_element(HOST_V4, PORT);
    assert_eq!(resolve(&w, &g, "life.pool.example", RTYPE_A), vec![HOST_V4]);
    let mut conn = open_echo(&w, HOST_V4);
    echo(&mut conn, "while allowed").expect("the connection works");

    g.daemon.signal(Signal::SIGSTOP);
    let expired = within(LIFETIME + Duration::from_secs(3), || element().is_none());
    let new_refused = !connects(&w, HOST_V4, PORT);
    let old_works = echo(&mut conn, "after expiry");
    g.daemon.signal(Signal::SIGCONT);
    assert!(expired, "the element never expired: {:?}", element());
    assert!(new_refused, "a new connection after expiry");
    old_works.expect("the established connection survives its element");
    let _ = conn.get_mut().shutdown(Shutdown::Both);
}

/// An address still carrying a live connection is not expired under it (issue 6): while the
/// connection lives the element stays, beyond its lifetime, so the client can also open new
/// connections to it; once the connection is closed, the element expires.
#[test]
fn a_live_connection_keeps_its_address_allowed() {
    let (w, _l) = lifetime_world();
    let g = lifetime_guard(&w);
    let element = || w.resolved_element(HOST_V4, PORT);
    assert_eq!(resolve(&w, &g, "life.pool.example", RTYPE_A), vec![HOST_V4]);
    let mut conn = open_echo(&w, HOST_V4);
    let opened = Instant::now();
    let mut missing = Vec::new();
    while opened.elapsed() < LIFETIME + Duration::from_secs(3) {
        if element().is_none() {
            missing.push(opened.elapsed());
        }
        echo(&mut conn, "still here").expect("the live connection works");
        thread::sleep(Duration::from_millis(200));
    }
    assert!(
        missing.is_empty(),
        "the element of a live connection expired (absent at {missing:?})\n{}",
        g.daemon.stderr()
    );
    assert!(
        connects(&w, HOST_V4, PORT),
        "a second connection beside the live one"
    );

    conn.get_mut()
        .shutdown(Shutdown::Both)
        .expect("close the connection");
    drop(conn);
    assert!(
        within(Duration::from_secs(15), || element().is_none()),
        "the element outlived its connection: {:?}",
        element()
    );
}

// ---------------------------------------------------------------------------------------------
// 8. Restart and reload
// ---------------------------------------------------------------------------------------------

/// Stops `g` with SIGTERM (the table stays) and frees its notify socket's name for the next.
fn stop_guard(w: &World, mut g: Guard) {
    let status = g.daemon.terminate();
    assert!(status.success(), "{status:?}\n{}", g.daemon.stderr());
    drop(g);
    std::fs::remove_file(w.dir().join("notify.sock")).expect("remove the notify socket");
}

/// A restarted guard cannot know what its clients cached, so it keeps what the running table
/// allows until it expires: a client that asked the old guard still connects, and nobody had
/// to ask upstream again.
#[test]
fn a_restarted_guard_keeps_the_addresses_its_clients_hold() {
    let w = World::new();
    w.dns_set("app.pool.example", &[HOST_V4], 300);
    let _listener = w.listen_tcp(HOST_V4, PORT);
    let text = policy(&["*.pool.example"], "", &[]);
    let g = start_guard(&w, &text);
    assert_eq!(resolve(&w, &g, "app.pool.example", RTYPE_A), [HOST_V4]);
    assert!(connects(&w, HOST_V4, PORT));
    stop_guard(&w, g);
    assert!(
        connects(&w, HOST_V4, PORT),
        "the stopped guard's table stays"
    );

    let g = start_guard(&w, &text);
    assert!(
        connects(&w, HOST_V4, PORT),
        "the restart dropped an address a client holds:\n{}",
        g.daemon.stderr()
    );
    assert!(
        g.daemon
            .stderr()
            .contains("keeping the addresses the running table allows"),
        "{}",
        g.daemon.stderr()
    );
    let asked = upstream_names(&w)
        .iter()
        .filter(|n| n.as_str() == "app.pool.example")
        .count();
    assert_eq!(asked, 1, "asked upstream once, by the first guard");
    // Nothing else came back with it.
    assert!(!connects(&w, HOST2_V4, PORT));
}

/// SIGHUP: the guard answers by the new policy at once, keeps the addresses of names the new
/// policy still allows, and refuses a change of `dns.listen` or `dns.mark`, which take a
/// restart.
#[test]
fn a_reload_answers_by_the_new_policy_and_keeps_what_it_still_allows() {
    let w = World::new();
    w.dns_set("app.pool.example", &[HOST_V4], 300);
    w.dns_set("api.new.example", &[HOST2_V4], 300);
    let _l1 = w.listen_tcp(HOST_V4, PORT);
    let _l2 = w.listen_tcp(HOST2_V4, PORT);
    let mut g = start_guard(&w, &policy(&["*.pool.example"], "", &[]));
    assert_eq!(resolve(&w, &g, "app.pool.example", RTYPE_A), [HOST_V4]);
    let refused = ask(&w, "api.new.example", RTYPE_A, Transport::Udp).expect("an answer");
    assert_eq!(refused.rcode, RCODE_REFUSED);

    w.write_file(
        "guard.yaml",
        &policy(&["*.pool.example", "*.new.example"], "", &[]),
    );
    g.daemon.signal(Signal::SIGHUP);
    let answered = within(Duration::from_secs(5), || {
        ask(&w, "api.new.example", RTYPE_A, Transport::Udp).is_ok_and(|r| r.rcode == RCODE_NOERROR)
    });
    assert!(
        answered,
        "the new name is still refused:\n{}",
        g.daemon.stderr()
    );
    assert!(connects(&w, HOST2_V4, PORT));
    assert!(
        connects(&w, HOST_V4, PORT),
        "the reload dropped a name it still allows"
    );

    // Another listen address: refused, the running guard goes on where it was.
    w.write_file(
        "guard.yaml",
        &policy(&["*.pool.example"], "", &[]).replace(&GUARD_ADDR.to_string(), "127.0.0.54:53"),
    );
    g.daemon.signal(Signal::SIGHUP);
    assert!(
        g.daemon
            .wait_for_output("takes a restart", Duration::from_secs(5)),
        "{}",
        g.daemon.stderr()
    );
    let still = ask(&w, "api.new.example", RTYPE_A, Transport::Udp).expect("an answer");
    assert_eq!(still.rcode, RCODE_NOERROR, "the running policy stays");

    // Another mark: the listening sockets keep the one they were bound with, so the new
    // table would refuse the guard's own replies; refused too, and the guard goes on.
    w.write_file(
        "guard.yaml",
        &policy(
            &["*.pool.example", "*.new.example"],
            "",
            &["mark: 0x66000000"],
        ),
    );
    g.daemon.signal(Signal::SIGHUP);
    assert!(
        within(Duration::from_secs(5), || g
            .daemon
            .stderr()
            .contains("`dns.mark`")),
        "{}",
        g.daemon.stderr()
    );
    let still = ask(&w, "api.new.example", RTYPE_A, Transport::Udp).expect("an answer");
    assert_eq!(still.rcode, RCODE_NOERROR, "the guard still answers");
}

/// An agent asking thousands of random names must not flood the journal: refused queries are
/// logged at the policy's `log.rate` (the first line after a pause says how many it held
/// back), while `watch`'s event stream still carries every one.
#[test]
fn refused_queries_are_logged_at_the_policys_rate() {
    let w = World::new();
    let text = policy(&["*.pool.example"], "", &[])
        .replace("rate: 1000/second", "rate: 1/minute")
        .replace("burst: 1000", "burst: 2");
    let g = start_guard(&w, &text);
    let events =
        std::os::unix::net::UnixStream::connect(w.sandbox_state_dir().join("guard-events.sock"))
            .expect("connect to the guard's events");
    events
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("a read timeout");
    // The guard subscribes a client when it accepts it: give it that moment.
    thread::sleep(Duration::from_millis(200));
    for i in 0..10 {
        let reply = ask(
            &w,
            &format!("s{i}.attacker.example"),
            RTYPE_A,
            Transport::Udp,
        )
        .expect("an answer");
        assert_eq!(reply.rcode, RCODE_REFUSED);
    }
    let mut lines = BufReader::new(events).lines();
    for i in 0..10 {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("event {i} missing"))
            .expect("an event line");
        assert!(
            line.contains(&format!("\"s{i}.attacker.example\"")),
            "{line}"
        );
    }
    let log = g.daemon.stderr();
    assert_eq!(log.matches("refused DNS query").count(), 2, "{log}");
}

/// `status` tells a guard-mode table from a resolve-mode one, and whether a guard serves it.
#[test]
fn status_says_whether_a_guard_serves_the_table() {
    let w = World::new();
    let g = start_guard(&w, &policy(&["*.pool.example"], "", &[]));
    let out = w.egress_fence(&["status"]);
    assert!(
        out.stdout.contains(
            "DNS guard mode: only sockets of uid 0 marked 0x65000000 may ask the \
                       resolvers; a guard is serving"
        ),
        "{out}"
    );
    let json = w.egress_fence(&["status", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("json");
    assert_eq!(
        v["dns_guard"],
        serde_json::json!({ "uids": [0], "marks": [0x6500_0000], "serving": true })
    );

    stop_guard(&w, g);
    let out = w.egress_fence(&["status"]);
    assert!(out.stdout.contains("no guard is serving here"), "{out}");
}
