//! `probe` end to end: the library's checks run from inside a sandbox namespace against a
//! boundary applied by the real binary, and must pass when the boundary is right and name the
//! check when it has a hole (a test rule that accepts a blocked target, a deny the policy
//! forgot, a service that is down, DNS to the rogue resolver).
//!
//! Every address probed belongs to the test world: each policy sets `probe.rogue_resolvers`
//! to the world's rogue resolver, so the built-in public resolvers are never contacted.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use egress_fence::policy::Policy;
use egress_fence::probe::{self, Check, Outcome, ProbeOptions, Report};

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
];

/// Without the boundary the probe fails every refusal; with it every check passes; with a
/// hole exactly the checks of the hole fail. Listeners on every refused target prove that
/// nothing arrives while the probe passes.
fn boundary_holds_and_holes_are_named(action: &str) {
    let w = World::new();
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
    ] {
        refused.push(w.listen_tcp(ip, port));
        refused.push(w.listen_udp(ip, port));
    }
    let text = POLICY.replace("ACTION", action);
    let policy = Policy::parse(&text, Path::new("policy.yaml")).expect("a valid policy");

    // No table yet: everything gets through, so every refusal check fails.
    let open = probe(&w, &policy);
    assert!(!open.passed(), "{}", lines(&open));
    for c in &open.checks {
        let want = if must_be_refused(&c.check) {
            Outcome::Fail
        } else if c.check == "dns exfiltration" {
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
    let expected: BTreeSet<&str> = EXPECTED_CHECKS.iter().copied().collect();
    assert_eq!(names, expected, "{}", lines(&report));
    for c in &report.checks {
        let want = if c.check == "dns exfiltration" {
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
    assert_eq!(
        report.summary(),
        format!(
            "probe: {} passed, 0 failed, 0 warnings, 1 skipped",
            expected.len() - 1
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
    assert_eq!(
        failed(&holed),
        BTreeSet::from([
            "blocked tcp 203.0.113.11:443",
            "blocked udp 203.0.113.11:443",
            "rogue resolver udp 192.0.2.54:53",
            "rogue resolver tcp 192.0.2.54:53",
        ]),
        "{}",
        lines(&holed)
    );
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
    assert!(holed.summary().contains(" 4 failed"), "{}", holed.summary());
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
    assert!(
        report.summary().ends_with("1 warning"),
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
