//! `probe` end to end: the library's checks run from inside a sandbox namespace against a
//! boundary applied by the real binary, and must pass when the boundary is right and name the
//! check when it has a hole (a test rule that accepts a blocked target, a deny the policy
//! forgot, a service that is down, DNS to the rogue resolver).
//!
//! Every address probed belongs to the test world: each policy sets `probe.rogue_resolvers`
//! to the world's rogue resolver, so the built-in public resolvers are never contacted.

mod common;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv6Addr};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use egress_fence::core::policy::Policy;
use egress_fence::probe::{
    self, Check, KERNEL_SOCKETS_CHECK, LINK_LAYER_CHECK, Outcome, ProbeOptions, Report, TUN_CHECK,
};

/// Per attempt. Short, because under `action: drop` every refused TCP attempt waits it out
/// (concurrently, so one probe takes about this long); above one second, because over IPv6
/// the kernel reports `reject`'s ICMP error to a connecting TCP socket only when the SYN is
/// retransmitted, after one second.
const TIMEOUT: Duration = Duration::from_millis(1500);

/// Allowed names on listening hosts, a UDP service, the metadata preset, blocked targets by
/// name and by address, the world's rogue resolver. `ACTION` is replaced.
const POLICY: &str = r#"
version: 1
action: ACTION
allow:
  - domain: api.example.com        # HOST_V4 and HOST_V6, TCP 443
    ports: [443]
  - domain: ntp.example.com        # HOST2_V4, UDP 123
    ports: [123]
    protocol: udp
deny:
  - preset: cloud-metadata
dns:
  resolvers: [192.0.2.53, "2001:db8:1::53"]
probe:
  blocked: ["paste.example.com:443", "203.0.113.11:443"]
  rogue_resolvers: [192.0.2.54, "2001:db8:1::54"]
"#;

/// The policy's resolvers (every test policy lists them, so no resolv.conf is read).
fn options(policy: &Policy) -> ProbeOptions {
    let options = ProbeOptions::for_policy(policy, Path::new("/nonexistent/resolv.conf"))
        .expect("the policy lists its resolvers");
    ProbeOptions {
        timeout: TIMEOUT,
        ..options
    }
}

/// Writes `text`, applies it with `egress-fence apply` (expecting exit code `code`) and
/// returns the parsed policy.
fn apply(w: &World, text: &str, code: i32) -> Policy {
    let path = w.write_file("policy.yaml", text);
    let out = w.egress_fence(&["apply", path.to_str().expect("utf-8 path")]);
    assert_eq!(out.code(), code, "apply: {out}");
    Policy::parse(text, Path::new("policy.yaml")).expect("a valid policy")
}

/// Runs the probe from inside the sandbox and prints its lines (shown when a test fails).
fn probe(w: &World, policy: &Policy) -> Report {
    let started = Instant::now();
    let report = w
        .in_sandbox_ns(|| probe::run(policy, &options(policy)))
        .expect("the probe runs");
    for check in &report.checks {
        eprintln!("{check}");
    }
    eprintln!("{} ({:?})", report.summary(), started.elapsed());
    report
}

/// The check named exactly `name`.
fn check<'a>(report: &'a Report, name: &str) -> &'a Check {
    report
        .checks
        .iter()
        .find(|c| c.check == name)
        .unwrap_or_else(|| panic!("no check `{name}` in:\n{}", lines(report)))
}

fn failed(report: &Report) -> BTreeSet<&str> {
    report
        .checks
        .iter()
        .filter(|c| c.outcome == Outcome::Fail)
        .map(|c| c.check.as_str())
        .collect()
}

fn lines(report: &Report) -> String {
    report.checks.iter().map(|c| format!("{c}\n")).collect()
}

/// Whether `name` is one of the checks that must be refused.
fn must_be_refused(name: &str) -> bool {
    ["blocked ", "denied ", "rogue resolver "]
        .iter()
        .any(|p| name.starts_with(p))
}

/// Lets every group of the sandbox open ping sockets (`net.ipv4.ping_group_range`, which
/// covers ICMPv6 too), so the probe's echo requests are sent: a fresh namespace allows none.
fn allow_ping_sockets(w: &World) {
    let out = w.sandbox_cmd(&["sysctl", "-w", "net.ipv4.ping_group_range=0 2147483647"]);
    assert!(out.success(), "ping_group_range: {out}");
}

/// The checks of the transports besides TCP and UDP that go with the refused TCP check
/// `tcp_check` ("blocked tcp 203.0.113.11:443"): UDP-Lite, SCTP and DCCP on its port, an
/// echo request to its address.
fn other_transports(tcp_check: &str) -> Vec<String> {
    let (head, dest) = tcp_check.rsplit_once(' ').expect("a destination");
    let (host, _port) = dest.rsplit_once(':').expect("a port");
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let echo = if host.contains(':') { "icmpv6" } else { "icmp" };
    let mut out: Vec<String> = ["udplite", "sctp", "dccp"]
        .iter()
        .map(|p| format!("{} {dest}", head.replacen(" tcp", &format!(" {p}"), 1)))
        .collect();
    out.push(format!(
        "{} {host}",
        head.replacen(" tcp", &format!(" {echo}"), 1)
    ));
    out
}

/// A check of a transport this kernel lacks (SCTP and DCCP are modules): said so, skipped.
fn unavailable(c: &Check) -> bool {
    let lacks = c.outcome == Outcome::Skip && c.reason.contains("not available on this kernel");
    if lacks {
        eprintln!(
            "this kernel lacks the transport of `{}`: not checked",
            c.check
        );
    }
    lacks
}

/// GCP's IPv6 metadata server and Scaleway's, hosts of the world in the probe's main test.
const GCP_METADATA_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0xfd20, 0xce, 0, 0, 0, 0, 0, 0x254));
const SCALEWAY_METADATA_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0xfd00, 0x42, 0, 0, 0, 0, 0, 0x42));

/// Every check the main policy produces (asserted as the exact set).
const EXPECTED_CHECKS: &[&str] = &[
    "resolver udp 192.0.2.53:53",
    "resolver tcp 192.0.2.53:53",
    "resolver udp [2001:db8:1::53]:53",
    "resolver tcp [2001:db8:1::53]:53",
    "allowed name api.example.com",
    "allowed tcp api.example.com 192.0.2.10:443",
    "allowed tcp api.example.com [2001:db8:1::10]:443",
    "allowed name ntp.example.com",
    "allowed udp ntp.example.com 192.0.2.11:123",
    "denied tcp cloud-metadata 169.254.169.254:80",
    "denied udp cloud-metadata 169.254.169.254:80",
    "denied tcp cloud-metadata [fd00:ec2::254]:80",
    "denied udp cloud-metadata [fd00:ec2::254]:80",
    "denied tcp cloud-metadata [fd20:ce::254]:80",
    "denied udp cloud-metadata [fd20:ce::254]:80",
    "denied tcp cloud-metadata [fd00:42::42]:80",
    "denied udp cloud-metadata [fd00:42::42]:80",
    "blocked tcp paste.example.com 203.0.113.10:443",
    "blocked udp paste.example.com 203.0.113.10:443",
    "blocked tcp paste.example.com [2001:db8:2::10]:443",
    "blocked udp paste.example.com [2001:db8:2::10]:443",
    "blocked tcp 203.0.113.11:443",
    "blocked udp 203.0.113.11:443",
    "rogue resolver udp 192.0.2.54:53",
    "rogue resolver tcp 192.0.2.54:53",
    "rogue resolver udp [2001:db8:1::54]:53",
    "rogue resolver tcp [2001:db8:1::54]:53",
    "dns exfiltration",
    LINK_LAYER_CHECK,
    TUN_CHECK,
    KERNEL_SOCKETS_CHECK,
];

/// Without the boundary the probe fails every refusal; with it every check passes; with a
/// hole exactly the checks of the hole fail. Listeners on every refused target prove that
/// nothing arrives while the probe passes.
fn boundary_holds_and_holes_are_named(action: &str) {
    let w = World::new();
    w.add_host(GCP_METADATA_V6);
    w.add_host(SCALEWAY_METADATA_V6);
    w.dns_set("api.example.com", &[HOST_V4, HOST_V6], DEFAULT_DNS_TTL);
    w.dns_set("ntp.example.com", &[HOST2_V4], DEFAULT_DNS_TTL);
    w.dns_set("paste.example.com", &[OTHER_V4, OTHER_V6], DEFAULT_DNS_TTL);
    let api = [w.listen_tcp(HOST_V4, 443), w.listen_tcp(HOST_V6, 443)];
    let ntp = w.listen_udp(HOST2_V4, 123);
    let mut refused = Vec::new();
    for (ip, port) in [
        (OTHER_V4, 443),
        (OTHER_V6, 443),
        (OTHER2_V4, 443),
        (METADATA_V4, 80),
        (METADATA_V6, 80),
        (GCP_METADATA_V6, 80),
        (SCALEWAY_METADATA_V6, 80),
    ] {
        refused.push(w.listen_tcp(ip, port));
        refused.push(w.listen_udp(ip, port));
    }
    allow_ping_sockets(&w);
    let text = POLICY.replace("ACTION", action);
    let policy = Policy::parse(&text, Path::new("policy.yaml")).expect("a valid policy");

    // No table yet: everything gets through, so every refusal check fails.
    let open = probe(&w, &policy);
    assert!(!open.passed(), "{}", lines(&open));
    for c in &open.checks {
        let want = if unavailable(c) {
            Outcome::Skip
        } else if must_be_refused(&c.check) {
            Outcome::Fail
        } else if c.check == "dns exfiltration" || c.check == LINK_LAYER_CHECK {
            Outcome::Skip
        } else {
            Outcome::Pass
        };
        assert_eq!(c.outcome, want, "without the boundary: {c}");
    }
    assert!(
        refused.iter().all(|l| l.count() > 0),
        "every refused target was reached without the boundary"
    );
    let reached_before: Vec<usize> = refused.iter().map(|l| l.count()).collect();

    // The boundary: every check passes, nothing reaches a refused target.
    apply(&w, &text, 0);
    let report = probe(&w, &policy);
    assert!(report.passed(), "{}", lines(&report));
    let names: BTreeSet<&str> = report.checks.iter().map(|c| c.check.as_str()).collect();
    let others: Vec<String> = EXPECTED_CHECKS
        .iter()
        .filter(|c| c.starts_with("denied tcp") || c.starts_with("blocked tcp"))
        .flat_map(|c| other_transports(c))
        .collect();
    let expected: BTreeSet<&str> = EXPECTED_CHECKS
        .iter()
        .copied()
        .chain(others.iter().map(String::as_str))
        .collect();
    assert_eq!(names, expected, "{}", lines(&report));
    let (mut lacking, mut unconfirmed) = (0, 0);
    for c in &report.checks {
        // This probe holds CAP_NET_ADMIN: the link-layer check is not its to judge.
        let want = if unavailable(c) {
            lacking += 1;
            Outcome::Skip
        } else if action == "drop" && c.check.contains(" icmpv6 ") {
            // Linux does not tell an ICMPv6 ping socket that its request was dropped.
            assert!(c.reason.contains("cannot tell `action: drop`"), "{c}");
            unconfirmed += 1;
            Outcome::Warn
        } else if c.check == "dns exfiltration" || c.check == LINK_LAYER_CHECK {
            Outcome::Skip
        } else {
            Outcome::Pass
        };
        assert_eq!(c.outcome, want, "{c}");
    }
    let reached_after: Vec<usize> = refused.iter().map(|l| l.count()).collect();
    assert_eq!(
        reached_after, reached_before,
        "a refused target was reached"
    );
    assert!(api.iter().all(|l| l.count() >= 2), "api reached twice");
    assert!(ntp.count() >= 2, "the UDP service was reached twice");

    // The reasons say how the refusal looked.
    let tcp = check(&report, "blocked tcp 203.0.113.11:443");
    let udp = check(&report, "blocked udp 203.0.113.11:443");
    let udp6 = check(
        &report,
        "blocked udp paste.example.com [2001:db8:2::10]:443",
    );
    match action {
        "reject" => {
            assert!(tcp.reason.contains("no route to host"), "{tcp}");
            assert!(udp.reason.contains("ICMP admin prohibited"), "{udp}");
            assert!(udp6.reason.contains("ICMPv6 admin prohibited"), "{udp6}");
            let tcp6 = check(
                &report,
                "blocked tcp paste.example.com [2001:db8:2::10]:443",
            );
            assert!(tcp6.reason.contains("ICMPv6 admin prohibited"), "{tcp6}");
        }
        _ => {
            assert!(tcp.reason.contains("no answer within"), "{tcp}");
            assert!(udp.reason.contains("operation not permitted"), "{udp}");
            assert!(udp6.reason.contains("operation not permitted"), "{udp6}");
        }
    }
    assert_eq!(
        check(&report, "allowed tcp api.example.com 192.0.2.10:443").to_string(),
        "PASS  allowed tcp api.example.com 192.0.2.10:443: connected"
    );
    assert!(
        check(&report, "resolver tcp 192.0.2.53:53")
            .reason
            .starts_with("answered over TCP"),
    );
    // Refused by this host, whatever the transport.
    let udplite = check(&report, "blocked udplite 203.0.113.11:443");
    assert!(udplite.reason.starts_with("refused: "), "{udplite}");
    let echo = check(&report, "blocked icmp 203.0.113.11");
    assert!(echo.reason.starts_with("refused: "), "{echo}");
    assert_eq!(
        report.summary(),
        format!(
            "probe: {} passed, 0 failed, {unconfirmed} warnings, {} skipped",
            expected.len() - 2 - lacking - unconfirmed,
            2 + lacking
        )
    );
    let json = serde_json::to_value(&report).expect("the report serialises");
    assert_eq!(json["checks"][0]["outcome"], "pass", "{json}");
    assert_eq!(json["checks"][0]["check"], "resolver udp 192.0.2.53:53");

    // Holes: a rule that accepts a blocked target, and one that lets DNS reach the rogue
    // resolver. Exactly their checks fail, each saying the boundary let it through.
    for ip in ["203.0.113.11", "192.0.2.54"] {
        let out = w.sandbox_cmd(&[
            "nft",
            "insert",
            "rule",
            "inet",
            "egress_fence",
            "output",
            "ip",
            "daddr",
            ip,
            "accept",
        ]);
        assert!(out.success(), "insert a hole: {out}");
    }
    let holed = probe(&w, &policy);
    assert!(!holed.passed());
    let hole_transports = other_transports("blocked tcp 203.0.113.11:443");
    let mut holes = BTreeSet::from([
        "blocked tcp 203.0.113.11:443",
        "blocked udp 203.0.113.11:443",
        "rogue resolver udp 192.0.2.54:53",
        "rogue resolver tcp 192.0.2.54:53",
    ]);
    holes.extend(
        hole_transports
            .iter()
            .map(String::as_str)
            .filter(|name| !unavailable(check(&holed, name))),
    );
    assert_eq!(failed(&holed), holes, "{}", lines(&holed));
    for name in failed(&holed) {
        let c = check(&holed, name);
        assert!(c.reason.contains("the boundary let it through"), "{c}");
        // The holes are test rules, not policy entries: no entry is blamed.
        assert!(!c.reason.contains("the policy allows it"), "{c}");
    }
    assert!(
        check(&holed, "rogue resolver udp 192.0.2.54:53")
            .reason
            .starts_with("answered ("),
    );
    assert!(
        holed
            .summary()
            .contains(&format!(" {} failed", holes.len())),
        "{}",
        holed.summary()
    );
}

#[test]
fn reject_boundary_holds_and_holes_are_named() {
    boundary_holds_and_holes_are_named("reject");
}

#[test]
fn drop_boundary_holds_and_holes_are_named() {
    boundary_holds_and_holes_are_named("drop");
}

/// A deny the policy forgot (an allowed network covers a blocked host), a service that is
/// down, a name that does not resolve; a name that resolves into a denied network is refused
/// as the policy means it.
#[test]
fn policy_mistakes_fail_their_checks() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    w.dns_set("down.example.com", &[HOST3_V4], DEFAULT_DNS_TTL);
    w.dns_set("rebind.example.com", &[METADATA_V4], DEFAULT_DNS_TTL);
    let _api = w.listen_tcp(HOST_V4, 443);
    let paste = w.listen_tcp(OTHER2_V4, 443);
    let metadata = w.listen_tcp(METADATA_V4, 80);
    let policy = apply(
        &w,
        r#"
version: 1
allow:
  - domain: api.example.com
    ports: [443]
  - domain: down.example.com       # nothing listens on 192.0.2.12:443
    ports: [443]
  - domain: missing.example.com    # NXDOMAIN
    ports: [443]
  - domain: rebind.example.com     # the metadata service: deny wins
    ports: [80]
  - cidr: 203.0.113.0/24           # covers the blocked host below
    ports: [443]
deny:
  - preset: cloud-metadata
dns:
  resolvers: [192.0.2.53, "2001:db8:1::53"]
probe:
  blocked: ["203.0.113.11:443"]
  rogue_resolvers: [192.0.2.54]
"#,
        3, // missing.example.com does not resolve
    );
    let report = probe(&w, &policy);
    assert!(!report.passed());
    assert_eq!(
        failed(&report),
        BTreeSet::from([
            "allowed name missing.example.com",
            "allowed tcp down.example.com 192.0.2.12:443",
            "blocked tcp 203.0.113.11:443",
        ]),
        "{}",
        lines(&report)
    );
    let down = check(&report, "allowed tcp down.example.com 192.0.2.12:443");
    assert!(
        down.reason.contains("connection refused") && down.reason.contains("let it through"),
        "{down}"
    );
    let missing = check(&report, "allowed name missing.example.com");
    assert!(missing.reason.contains("NXDOMAIN"), "{missing}");
    let forgot = check(&report, "blocked tcp 203.0.113.11:443");
    assert!(forgot.reason.starts_with("connected"), "{forgot}");
    assert!(
        forgot
            .reason
            .ends_with("the policy allows it: allow entry cidr 203.0.113.0/24"),
        "{forgot}"
    );
    assert_eq!(paste.count(), 1, "the forgotten target was reached once");
    // Only TCP is allowed to the network, so UDP to the same host is still refused.
    assert_eq!(
        check(&report, "blocked udp 203.0.113.11:443").outcome,
        Outcome::Pass
    );
    let rebind = check(&report, "allowed tcp rebind.example.com 169.254.169.254:80");
    assert_eq!(rebind.outcome, Outcome::Pass, "{rebind}");
    assert!(rebind.reason.contains("deny wins"), "{rebind}");
    assert_eq!(metadata.count(), 0, "the metadata service was reached");
    assert_eq!(
        check(&report, "allowed network 203.0.113.0/24").outcome,
        Outcome::Skip
    );
    assert!(
        report.summary().contains(" 3 failed"),
        "{}",
        report.summary()
    );
}

/// A random name under `probe.exfil_domain` is asked of the allowed resolver: NXDOMAIN
/// passes; once a wildcard answers every subname, the probe warns (and still passes).
#[test]
fn exfiltration_check_warns_when_random_names_resolve() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    let _api = w.listen_tcp(HOST_V4, 443);
    let policy = apply(
        &w,
        r#"
version: 1
allow:
  - domain: api.example.com
    ports: [443]
dns:
  resolvers: [192.0.2.53]
probe:
  rogue_resolvers: [192.0.2.54]
  exfil_domain: exfil.example.com
"#,
        0,
    );
    let exfil = |report: &Report| -> Check {
        let found: Vec<&Check> = report
            .checks
            .iter()
            .filter(|c| c.check.starts_with("dns exfiltration "))
            .collect();
        assert_eq!(found.len(), 1, "{}", lines(report));
        found[0].clone()
    };

    let report = probe(&w, &policy);
    assert!(report.passed(), "{}", lines(&report));
    let closed = exfil(&report);
    assert_eq!(closed.outcome, Outcome::Pass, "{closed}");
    assert!(closed.reason.contains("NXDOMAIN"), "{closed}");

    w.dns_wildcard("exfil.example.com", OTHER_V4);
    let report = probe(&w, &policy);
    assert!(report.passed(), "a warning does not fail the probe");
    let open = exfil(&report);
    assert_eq!(open.outcome, Outcome::Warn, "{open}");
    assert!(
        open.reason.contains("203.0.113.10") && open.reason.contains("carry data out"),
        "{open}"
    );
    // The link-layer check is skipped: this probe holds CAP_NET_ADMIN.
    assert!(
        report.summary().ends_with("1 warning, 1 skipped"),
        "{}",
        report.summary()
    );

    // Each probe asked a fresh random name of the allowed resolver, never the rogue one.
    let name = open.check.trim_start_matches("dns exfiltration ");
    assert!(name.starts_with("ef-probe-") && name.ends_with(".exfil.example.com"));
    let asked: BTreeSet<String> = w
        .dns_queries()
        .into_iter()
        .filter(|q| q.ends_with(".exfil.example.com"))
        .collect();
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert!(asked.contains(name), "{asked:?}");
    assert!(w.rogue_dns_query_log().iter().all(|q| q.name != name));
}

/// The CLI as a CI gate: exit 0 and a clean summary when the boundary holds, exit 5 naming
/// the failed check when it has a hole; the same in JSON.
#[test]
fn the_probe_command_gates_on_the_boundary() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4, HOST_V6], DEFAULT_DNS_TTL);
    w.dns_set("ntp.example.com", &[HOST2_V4], DEFAULT_DNS_TTL);
    w.dns_set("paste.example.com", &[OTHER_V4, OTHER_V6], DEFAULT_DNS_TTL);
    let _api = [w.listen_tcp(HOST_V4, 443), w.listen_tcp(HOST_V6, 443)];
    let _ntp = w.listen_udp(HOST2_V4, 123);
    let text = POLICY.replace("ACTION", "reject");
    apply(&w, &text, 0);
    let path = w.write_file("policy.yaml", &text);
    let path = path.to_str().expect("utf-8 path");

    let ok = w.egress_fence(&["probe", path]);
    assert_eq!(ok.code(), 0, "{ok}");
    let summary = ok.stdout.lines().last().unwrap_or_default();
    assert!(
        summary.starts_with("probe: ") && summary.contains(" 0 failed"),
        "{ok}"
    );
    assert!(ok.stdout.lines().any(|l| l.starts_with("PASS ")), "{ok}");

    let hole = ["nft", "insert", "rule", "inet", "egress_fence", "output"];
    let out = w.sandbox_cmd(&[&hole[..], &["ip", "daddr", "203.0.113.11", "accept"]].concat());
    assert!(out.success(), "{out}");
    let bad = w.egress_fence(&["probe", path]);
    assert_eq!(bad.code(), 5, "{bad}");
    assert!(
        bad.stdout
            .lines()
            .any(|l| l.starts_with("FAIL") && l.contains("203.0.113.11")),
        "{bad}"
    );
    let json = w.egress_fence(&["probe", path, "--json"]);
    assert_eq!(json.code(), 5, "{json}");
    let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("probe --json is JSON");
    assert_eq!(v["passed"], false);
    assert!(v["checks"].as_array().is_some_and(|c| !c.is_empty()));
}

// ---- scope: `probe --as USER` ----------------------------------------------------------------

/// `egress-fence probe POLICY --json [ARGS]` (as root, from the sandbox): the exit code and
/// the checks as (outcome, check, reason).
fn probe_cli(w: &World, path: &str, args: &[&str]) -> (i32, Vec<(String, String, String)>) {
    let out = w.egress_fence(&[&["probe", path, "--json"][..], args].concat());
    probe_checks(&out, &format!("probe {args:?}"))
}

/// The exit code of `probe --json` and its checks as (outcome, check, reason), each also
/// printed with `label` (the test's output shows them when it fails).
fn probe_checks(out: &CmdOutput, label: &str) -> (i32, Vec<(String, String, String)>) {
    let v: serde_json::Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("probe --json is not JSON ({e}): {out}"));
    let checks = v["checks"]
        .as_array()
        .unwrap_or_else(|| panic!("no checks: {out}"))
        .iter()
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or_default().to_string();
            (s("outcome"), s("check"), s("reason"))
        })
        .collect::<Vec<_>>();
    for (outcome, check, reason) in &checks {
        eprintln!("[{label}] {outcome} {check}: {reason}");
    }
    (out.code(), checks)
}

/// Loads the plan of the policy at `path` into the sandbox with `nft -f` (the plan text is
/// exact nft), as `apply` would install it.
fn load_plan(w: &World, path: &str) {
    let plan = w.egress_fence(&["plan", path]);
    assert_eq!(plan.code(), 0, "plan: {plan}");
    let loaded = w.sandbox_cmd_with_input(&["nft", "-f", "-"], plan.stdout.as_bytes());
    assert!(loaded.success(), "nft -f: {loaded}\n{}", plan.stdout);
}

/// The world of the `--as` tests: the main policy's names and listeners (the refused
/// targets listen too, so that an untouched attempt is answered).
fn as_world() -> (World, Vec<Listener>) {
    let w = World::new();
    w.add_host(GCP_METADATA_V6);
    w.add_host(SCALEWAY_METADATA_V6);
    w.dns_set("api.example.com", &[HOST_V4, HOST_V6], DEFAULT_DNS_TTL);
    w.dns_set("ntp.example.com", &[HOST2_V4], DEFAULT_DNS_TTL);
    w.dns_set("paste.example.com", &[OTHER_V4, OTHER_V6], DEFAULT_DNS_TTL);
    let mut listeners = vec![
        w.listen_tcp(HOST_V4, 443),
        w.listen_tcp(HOST_V6, 443),
        w.listen_udp(HOST2_V4, 123),
    ];
    for (ip, port) in [(OTHER_V4, 443), (OTHER_V6, 443), (OTHER2_V4, 443)] {
        listeners.push(w.listen_tcp(ip, port));
        listeners.push(w.listen_udp(ip, port));
    }
    (w, listeners)
}

/// Unscoped, the user is fenced like everyone: `--as nobody` gives root's verdicts (but for
/// the link-layer check, which root skips), and they all hold.
#[test]
fn probe_as_a_user_of_an_unscoped_fence_gets_roots_verdicts() {
    let (w, _listeners) = as_world();
    let text = POLICY.replace("ACTION", "reject");
    apply(&w, &text, 0);
    let path = w.write_file("policy.yaml", &text);
    let path = path.to_str().expect("utf-8 path");

    let (root_code, root) = probe_cli(&w, path, &[]);
    let (code, nobody) = probe_cli(&w, path, &["--as", "nobody"]);
    assert_eq!((root_code, code), (0, 0), "both pass");
    assert_eq!(
        root.iter().map(|c| &c.1).collect::<Vec<_>>(),
        nobody.iter().map(|c| &c.1).collect::<Vec<_>>(),
        "the same checks"
    );
    for (r, n) in root.iter().zip(&nobody) {
        if r.1 == LINK_LAYER_CHECK {
            assert_eq!(
                (r.0.as_str(), n.0.as_str()),
                ("skip", "pass"),
                "{r:?} {n:?}"
            );
        } else {
            assert_eq!(r.0, n.0, "{r:?} {n:?}");
        }
    }
    assert!(nobody.iter().all(|c| c.1 != "scope"), "{nobody:?}");
    let refused = nobody.iter().filter(|c| must_be_refused(&c.1)).count();
    assert!(refused > 0, "{nobody:?}");

    // Nobody cannot read nftables: had the child kept root's privileges, the table would
    // still be read, and the packet socket open.
    let bad = w.egress_fence(&["probe", path, "--as", "root"]);
    assert_ne!(bad.code(), 0, "{bad}");
    assert!(bad.stderr.contains("that is root"), "{bad}");
}

/// A scope that does not list the user leaves it alone: the report says so, and everything
/// the fence refuses its users goes through; a scope that lists it fences it as before.
#[test]
fn probe_as_a_user_outside_the_scope_expects_everything_to_pass() {
    let (w, _listeners) = as_world();
    let others = POLICY
        .replace("ACTION", "reject")
        .replace("version: 1\n", "version: 1\nscope:\n  users: [daemon]\n");
    let path = w.write_file("others.yaml", &others);
    let path = path.to_str().expect("utf-8 path");
    load_plan(&w, path);
    let (code, nobody) = probe_cli(&w, path, &["--as", "nobody"]);
    assert_eq!(code, 0, "{nobody:?}");
    let scope = outcome_of(&nobody, "scope");
    assert_eq!(
        scope.2, "nobody (uid 65534) is not in the scope: expect everything to pass",
        "{scope:?}"
    );
    for c in nobody.iter().filter(|c| must_be_refused(&c.1)) {
        assert!(c.0 == "pass" || c.0 == "skip", "{c:?}");
        if c.0 == "pass" {
            assert!(c.2.contains("not touched by the fence"), "{c:?}");
        }
    }
    assert!(
        nobody
            .iter()
            .any(|c| c.1 == "blocked tcp 203.0.113.11:443" && c.2.starts_with("connected")),
        "{nobody:?}"
    );

    let listed = others.replace("users: [daemon]", "users: [nobody]");
    let path = w.write_file("listed.yaml", &listed);
    let path = path.to_str().expect("utf-8 path");
    load_plan(&w, path);
    let (code, fenced) = probe_cli(&w, path, &["--as", "nobody"]);
    assert_eq!(code, 0, "{fenced:?}");
    assert!(fenced.iter().all(|c| c.1 != "scope"), "{fenced:?}");
    for c in fenced.iter().filter(|c| must_be_refused(&c.1)) {
        assert!(c.0 == "pass" || c.0 == "skip", "{c:?}");
        assert!(!c.2.contains("not touched"), "{c:?}");
    }
}

// ---- scope: `probe --from IFACE=ADDRESS` ----------------------------------------------------

/// IPv4 only: the throwaway container of `--from` gets one IPv4 address.
const FROM_POLICY: &str = r#"
version: 1
SCOPE
allow:
  - domain: api.example.com        # HOST_V4, TCP 443
    ports: [443]
deny:
  - preset: cloud-metadata
dns:
  resolvers: [192.0.2.53]
probe:
  blocked: ["203.0.113.11:443"]
  rogue_resolvers: [192.0.2.54]
"#;

/// A bridge in the sandbox, as a container host has one: efbr0 with 198.18.0.1/24, IPv4
/// forwarding, and NAT of the bridge's network out of the sandbox (in a table of the test's
/// own, in the sandbox).
fn bridge_in_the_sandbox(w: &World) {
    for cmd in [
        &["ip", "link", "add", "efbr0", "type", "bridge"][..],
        &["ip", "addr", "add", "198.18.0.1/24", "dev", "efbr0"],
        &["ip", "link", "set", "efbr0", "up"],
        &["sysctl", "-w", "net.ipv4.ip_forward=1"],
        // Every refusal's ICMP error, not one a second per container.
        &["sysctl", "-w", "net.ipv4.icmp_ratelimit=0"],
    ] {
        let out = w.sandbox_cmd(cmd);
        assert!(out.success(), "{cmd:?}: {out}");
    }
    let nat = "table ip eft_nat {\n chain post {\n  type nat hook postrouting priority srcnat;\n  \
               ip saddr 198.18.0.0/24 oifname != \"efbr0\" masquerade\n }\n}\n";
    let out = w.sandbox_cmd_with_input(&["nft", "-f", "-"], nat.as_bytes());
    assert!(out.success(), "nat: {out}");
}

/// What `--from` leaves behind in the sandbox: namespaces named like its own, and veths on
/// the bridge.
fn from_leftovers(w: &World) -> Vec<String> {
    let mut left: Vec<String> = w
        .sandbox_cmd(&["ip", "netns", "list"])
        .stdout
        .lines()
        .filter(|l| l.starts_with("ef-probe-"))
        .map(String::from)
        .collect();
    let links = w.sandbox_cmd(&["ip", "-o", "link", "show", "master", "efbr0"]);
    left.extend(links.stdout.lines().map(String::from));
    left
}

/// `--from efbr0=198.18.0.250/24` proves the forward path: a bridge the scope leaves out is
/// not fenced (the report says so and everything passes); one it lists is fenced like a
/// local user; the throwaway namespace is gone afterwards.
#[test]
fn probe_from_a_bridge_proves_the_forward_path() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    let mut _listeners = vec![w.listen_tcp(HOST_V4, 443)];
    _listeners.push(w.listen_tcp(OTHER2_V4, 443));
    _listeners.push(w.listen_udp(OTHER2_V4, 443));
    bridge_in_the_sandbox(&w);

    let unscoped = FROM_POLICY.replace("SCOPE\n", "");
    let path = w.write_file("unscoped.yaml", &unscoped);
    let path = path.to_str().expect("utf-8 path");
    load_plan(&w, path);
    let (code, open) = probe_cli(&w, path, &["--from", "efbr0=198.18.0.250/24"]);
    assert_eq!(code, 0, "{open:?}");
    let scope = outcome_of(&open, "scope");
    assert_eq!(
        scope.2, "198.18.0.250 behind efbr0 is not in the scope: expect everything to pass",
        "{scope:?}"
    );
    assert!(
        open.iter()
            .any(|c| c.1 == "blocked tcp 203.0.113.11:443" && c.2.starts_with("connected")),
        "{open:?}"
    );
    assert_eq!(from_leftovers(&w), Vec::<String>::new());

    let scoped = FROM_POLICY.replace("SCOPE\n", "scope:\n  forward: [efbr0]\n");
    let path = w.write_file("scoped.yaml", &scoped);
    let path = path.to_str().expect("utf-8 path");
    load_plan(&w, path);
    let (code, fenced) = probe_cli(&w, path, &["--from", "efbr0=198.18.0.250/24"]);
    assert!(fenced.iter().all(|c| c.1 != "scope"), "{fenced:?}");
    let blocked = outcome_of(&fenced, "blocked tcp 203.0.113.11:443");
    assert_eq!(blocked.0, "pass", "{blocked:?}");
    assert!(blocked.2.starts_with("refused"), "{blocked:?}");
    let allowed = outcome_of(&fenced, "allowed tcp api.example.com 192.0.2.10:443");
    assert_eq!(allowed.0, "pass", "{allowed:?}");
    assert_eq!(code, 0, "{fenced:?}");
    assert_eq!(from_leftovers(&w), Vec::<String>::new());

    // Ended by a signal while its attempts run: the namespace goes all the same. Unscoped,
    // where its unanswered datagrams wait a second each (fenced, every attempt is refused at
    // once, and the run may be over before the namespace is seen).
    let unscoped = w.write_file("unscoped-again.yaml", &unscoped);
    let path = unscoped.to_str().expect("utf-8 path");
    load_plan(&w, path);
    let mut probe = w.spawn_egress_fence(&["probe", path, "--from", "efbr0=198.18.0.250/24"]);
    let started = Instant::now();
    while from_leftovers(&w).is_empty() && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    if from_leftovers(&w).is_empty() {
        probe.wait_timeout(Duration::from_secs(5));
        panic!(
            "the namespace never appeared: {}\n{}",
            probe.stdout(),
            probe.stderr()
        );
    }
    nix::sys::signal::kill(probe.pid(), nix::sys::signal::Signal::SIGTERM).expect("signal");
    assert!(
        probe.wait_timeout(Duration::from_secs(10)).is_some(),
        "the probe did not end on SIGTERM"
    );
    assert_eq!(from_leftovers(&w), Vec::<String>::new());
}

// ---- guard mode --------------------------------------------------------------------------------

/// Guard mode: the guard on 127.0.0.53 forwards to the world's resolver. One exact name with
/// listeners, one wildcard (not probed), the metadata preset (the dns-over-https one is
/// implied), the world's rogue resolver and an exfiltration zone. `EXTRA_ALLOW` is replaced.
const GUARD_POLICY: &str = r#"
version: 1
allow:
  - domain: api.example.com        # HOST_V4 and HOST_V6, TCP 443
    ports: [443]
  - domain: "*.cdn.example.com"
    ports: [443]
EXTRA_ALLOW
deny:
  - preset: cloud-metadata
dns:
  mode: guard
  listen: [127.0.0.53:53]
  upstream: [192.0.2.53]
log:
  group: 100
probe:
  rogue_resolvers: [192.0.2.54]
  exfil_domain: exfil.example.com
"#;

fn guard_policy(extra_allow: &str) -> String {
    GUARD_POLICY.replace("EXTRA_ALLOW\n", extra_allow)
}

/// The sandbox's resolv.conf (what `ip netns exec` shows as /etc/resolv.conf, and what
/// `--netns` reads): after [`use_the_guard`], the guard.
fn resolv_conf(w: &World) -> std::path::PathBuf {
    Path::new("/etc/netns")
        .join(w.sandbox_name())
        .join("resolv.conf")
}

/// Points the sandbox's resolv.conf at the guard, as a guard-mode host is set up.
fn use_the_guard(w: &World) {
    std::fs::write(
        resolv_conf(w),
        "nameserver 127.0.0.53\noptions timeout:2 attempts:1\n",
    )
    .expect("write the sandbox's resolv.conf");
}

/// Writes `text` where an unprivileged probe can read it (the world's directory is private).
fn readable_policy(w: &World, name: &str, text: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(w.dir(), std::fs::Permissions::from_mode(0o755))
        .expect("open the world's directory to other users");
    let path = w.write_file(name, text);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))
        .expect("make the policy readable");
    path.to_str().expect("utf-8 path").to_string()
}

/// The library's probe from inside the sandbox, as root, with the options the CLI would
/// build there (the table is read, resolv.conf is the sandbox's).
fn guard_probe(w: &World, policy: &Policy) -> Report {
    let conf = resolv_conf(w);
    let started = Instant::now();
    let report = w
        .in_sandbox_ns(|| {
            let options = ProbeOptions {
                timeout: TIMEOUT,
                ..ProbeOptions::for_policy(policy, &conf).expect("options")
            };
            probe::run(policy, &options)
        })
        .expect("the probe runs");
    for check in &report.checks {
        eprintln!("{check}");
    }
    eprintln!("{} ({:?})", report.summary(), started.elapsed());
    report
}

/// `egress-fence probe POLICY --json` inside the sandbox as uid/gid 65534 (the agent's user
/// stands in), through `ip netns exec`, so resolv.conf is the sandbox's. Returns the exit code
/// and the checks as (outcome, check, reason).
fn probe_as_nobody(w: &World, policy_path: &str) -> (i32, Vec<(String, String, String)>) {
    let out = w.sandbox_cmd_as(NOBODY, &[EGRESS_FENCE_BIN, "probe", policy_path, "--json"]);
    probe_checks(&out, "nobody")
}

fn outcome_of<'a>(
    checks: &'a [(String, String, String)],
    name: &str,
) -> &'a (String, String, String) {
    checks
        .iter()
        .find(|c| c.1 == name)
        .unwrap_or_else(|| panic!("no check `{name}` in {checks:#?}"))
}

/// The exfiltration check of a report (its name carries the random label).
fn exfil_check(report: &Report) -> Check {
    let found: Vec<&Check> = report
        .checks
        .iter()
        .filter(|c| c.check.starts_with("dns exfiltration "))
        .collect();
    assert_eq!(found.len(), 1, "{}", lines(report));
    found[0].clone()
}

/// A correct guard passes: allowed names resolve through it and connect, the random name is
/// refused by the guard and never reaches the upstream resolver, and DNS straight to the
/// upstream is refused for the agent's user. As root (the guard's uid) too: the table also
/// asks for the guard's socket mark, which the probe's sockets do not carry.
#[test]
fn a_correct_guard_passes_the_probe() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4, HOST_V6], DEFAULT_DNS_TTL);
    let api = [w.listen_tcp(HOST_V4, 443), w.listen_tcp(HOST_V6, 443)];
    use_the_guard(&w);
    let text = guard_policy("");
    let path = readable_policy(&w, "guard.yaml", &text);
    let _daemon = w.spawn_guard(&path);
    let policy = Policy::parse(&text, Path::new("guard.yaml")).expect("a valid policy");

    // As root, the guard's own uid.
    let report = guard_probe(&w, &policy);
    assert!(report.passed(), "{}", lines(&report));
    for name in ["guard udp 127.0.0.53:53", "guard tcp 127.0.0.53:53"] {
        let c = check(&report, name);
        assert_eq!(c.outcome, Outcome::Pass, "{c}");
        assert!(c.reason.contains("NOERROR"), "asked an allowed name: {c}");
    }
    assert_eq!(check(&report, "system resolver").outcome, Outcome::Pass);
    let allowed = check(&report, "allowed name api.example.com");
    assert_eq!(allowed.outcome, Outcome::Pass, "{allowed}");
    assert!(
        allowed.reason.contains("through the guard 127.0.0.53:53"),
        "{allowed}"
    );
    for name in [
        "allowed tcp api.example.com 192.0.2.10:443",
        "allowed tcp api.example.com [2001:db8:1::10]:443",
        "denied preset dns-over-https",
        "rogue resolver udp 192.0.2.54:53",
        "rogue resolver tcp 192.0.2.54:53",
    ] {
        assert_eq!(check(&report, name).outcome, Outcome::Pass, "{name}");
    }
    assert!(api.iter().all(|l| l.count() > 0), "api was reached");
    assert_eq!(
        check(&report, "allowed names *.cdn.example.com").outcome,
        Outcome::Skip
    );
    for name in [
        "upstream udp 192.0.2.53:53",
        "upstream tcp 192.0.2.53:53",
        "upstream tcp 192.0.2.53:853",
        "upstream udp 192.0.2.53:853",
    ] {
        let c = check(&report, name);
        assert_eq!(c.outcome, Outcome::Pass, "{c}");
    }
    let exfil = exfil_check(&report);
    assert_eq!(exfil.outcome, Outcome::Pass, "{exfil}");
    let name = exfil
        .check
        .trim_start_matches("dns exfiltration ")
        .to_string();
    assert!(name.ends_with(".exfil.example.com"), "{name}");
    assert!(
        exfil.reason.starts_with(&format!(
            "DNS exfiltration closed: the guard refused {name} without forwarding it (REFUSED)"
        )),
        "{exfil}"
    );

    // As the agent's user: the upstream checks are carried out, and refused.
    let (code, checks) = probe_as_nobody(&w, &path);
    assert_eq!(code, 0, "{checks:#?}");
    for name in [
        "upstream udp 192.0.2.53:53",
        "upstream tcp 192.0.2.53:53",
        "upstream tcp 192.0.2.53:853",
        "upstream udp 192.0.2.53:853",
    ] {
        let c = outcome_of(&checks, name);
        assert_eq!(c.0, "pass", "{c:?}");
        assert!(c.2.starts_with("refused: "), "{c:?}");
    }
    assert_eq!(
        outcome_of(&checks, "allowed name api.example.com").0,
        "pass"
    );
    // Its table is out of an unprivileged user's reach: the DoH preset is not checked.
    assert_eq!(
        outcome_of(&checks, "denied preset dns-over-https").0,
        "skip"
    );
    let nobody_exfil = checks
        .iter()
        .find(|c| c.1.starts_with("dns exfiltration "))
        .expect("an exfiltration check");
    assert_eq!(nobody_exfil.0, "pass", "{nobody_exfil:?}");

    // Neither random name ever reached the upstream resolver; the allowed name did.
    let asked = w.dns_queries();
    assert!(
        !asked.iter().any(|q| q.ends_with(".exfil.example.com")),
        "an exfiltration name was forwarded: {asked:?}"
    );
    assert!(asked.iter().any(|q| q == "api.example.com"), "{asked:?}");
    assert!(w.rogue_dns_query_log().iter().all(|q| q.name != name));
}

/// A wildcard over the exfiltration zone makes the guard forward every name under it: the
/// upstream answers a random one, and the probe fails on it (and on nothing else).
#[test]
fn an_open_exfiltration_channel_fails_the_probe() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4, HOST_V6], DEFAULT_DNS_TTL);
    let _api = [w.listen_tcp(HOST_V4, 443), w.listen_tcp(HOST_V6, 443)];
    w.dns_wildcard("exfil.example.com", OTHER_V4);
    use_the_guard(&w);
    let text = guard_policy("  - domain: \"**.exfil.example.com\"\n    ports: [443]\n");
    let path = readable_policy(&w, "guard.yaml", &text);
    let _daemon = w.spawn_guard(&path);
    let policy = Policy::parse(&text, Path::new("guard.yaml")).expect("a valid policy");

    let report = guard_probe(&w, &policy);
    assert!(!report.passed(), "{}", lines(&report));
    let exfil = exfil_check(&report);
    assert_eq!(failed(&report), BTreeSet::from([exfil.check.as_str()]));
    assert!(
        exfil.reason.contains("203.0.113.10")
            && exfil
                .reason
                .contains("the allow entry domain **.exfil.example.com covers it")
            && exfil.reason.contains("carry data out"),
        "{exfil}"
    );
    let name = exfil.check.trim_start_matches("dns exfiltration ");
    assert!(
        w.dns_queries().iter().any(|q| q == name),
        "the guard forwarded the random name upstream"
    );

    let (code, checks) = probe_as_nobody(&w, &path);
    assert_eq!(code, 5, "{checks:#?}");
    let failed: Vec<&str> = checks
        .iter()
        .filter(|c| c.0 == "fail")
        .map(|c| c.1.as_str())
        .collect();
    assert_eq!(failed.len(), 1, "{checks:#?}");
    assert!(failed[0].starts_with("dns exfiltration "), "{checks:#?}");
}

/// DNS straight to the upstream resolver must be refused to everyone but the guard. Under a
/// table applied in resolve mode (no guard, resolvers open to every uid) the probe fails
/// exactly on DNS to port 53 there, saying which table lets it through; DNS over TLS (853),
/// which that table never allowed, is still refused. No guard runs, so its own checks fail
/// too.
#[test]
fn direct_dns_to_the_upstream_fails_the_probe() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4, HOST_V6], DEFAULT_DNS_TTL);
    use_the_guard(&w);
    let resolve_mode = "version: 1\nallow:\n  - domain: api.example.com\n    ports: [443]\ndns:\n  resolvers: [192.0.2.53]\n";
    let applied = w.egress_fence(&[
        "apply",
        w.write_file("resolve.yaml", resolve_mode)
            .to_str()
            .expect("utf-8"),
    ]);
    assert!(applied.success(), "{applied}");
    let text = guard_policy("");
    let path = readable_policy(&w, "guard.yaml", &text);
    let policy = Policy::parse(&text, Path::new("guard.yaml")).expect("a valid policy");

    let report = guard_probe(&w, &policy);
    assert!(!report.passed(), "{}", lines(&report));
    for name in ["upstream udp 192.0.2.53:53", "upstream tcp 192.0.2.53:53"] {
        let c = check(&report, name);
        assert_eq!(c.outcome, Outcome::Fail, "{c}");
        assert!(
            c.reason.contains("the boundary let it through")
                && c.reason.contains("lets every uid reach the resolvers")
                && c.reason.contains("resolve mode"),
            "{c}"
        );
    }
    for name in ["upstream tcp 192.0.2.53:853", "upstream udp 192.0.2.53:853"] {
        let dot = check(&report, name);
        assert_eq!(dot.outcome, Outcome::Pass, "{dot}");
    }
    // The table lacks the implied deny preset, and nothing serves on 127.0.0.53.
    assert_eq!(
        check(&report, "denied preset dns-over-https").outcome,
        Outcome::Fail
    );
    assert_eq!(
        check(&report, "guard udp 127.0.0.53:53").outcome,
        Outcome::Fail
    );

    // The agent's user gets through as well; it cannot read the table, so it says that its
    // uid could not be compared with the guard's.
    let (code, checks) = probe_as_nobody(&w, &path);
    assert_eq!(code, 5, "{checks:#?}");
    for name in ["upstream udp 192.0.2.53:53", "upstream tcp 192.0.2.53:53"] {
        let c = outcome_of(&checks, name);
        assert_eq!(c.0, "fail", "{c:?}");
        assert!(
            c.2.contains("the boundary let it through") && c.2.contains("could not be compared"),
            "{c:?}"
        );
    }
    assert_eq!(outcome_of(&checks, "upstream tcp 192.0.2.53:853").0, "pass");
    assert_eq!(outcome_of(&checks, "upstream udp 192.0.2.53:853").0, "pass");
}
