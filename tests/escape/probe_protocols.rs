//! `probe` must see what the boundary lets out, whatever the transport and whoever refused
//! (issue 17, item 3). A hand-added UDP-Lite element opened every destination to UDP-Lite
//! while `probe` passed 17 of 17; elements of a `run` generation's resolved sets that the
//! policy does not explain must be named; and a refusal sent by the far host (a TCP reset,
//! an ICMP error from beyond this host) says nothing about the boundary: with no table at
//! all, a TCP check to a far host that rejects passed.
//!
//! SCTP and DCCP are kernel modules: where the kernel lacks one, its checks are skipped
//! (the tests say so) and the rest still runs.

use std::time::Duration;

use crate::common::*;

/// A resolve-mode policy: one allowed name, one blocked address (IPv4 and IPv6), the world's
/// rogue resolver (so no public resolver is ever asked). `refresh` and `grace` keep the
/// service's element lifetimes short.
const POLICY: &str = r#"
version: 1
allow:
  - domain: api.example.com
    ports: [443]
dns:
  resolvers: [192.0.2.53]
  refresh: { min: 1s, max: 5s }
  grace: 5s
probe:
  blocked: ["203.0.113.11:443", "[2001:db8:2::10]:443"]
  rogue_resolvers: [192.0.2.54]
"#;

/// One check of `egress-fence probe --json`: (outcome, check, reason).
type Line = (String, String, String);

/// Runs `egress-fence probe --json` in the sandbox: its exit code and its checks.
fn probe(w: &World, path: &str) -> (i32, Vec<Line>) {
    let out = w.egress_fence(&["probe", "--json", path]);
    let v: serde_json::Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("probe --json is not JSON ({e}): {out}"));
    let checks = v["checks"]
        .as_array()
        .unwrap_or_else(|| panic!("no checks: {out}"))
        .iter()
        .map(|c| {
            let field = |k: &str| c[k].as_str().unwrap_or_default().to_string();
            (field("outcome"), field("check"), field("reason"))
        })
        .collect::<Vec<Line>>();
    for (o, c, r) in &checks {
        eprintln!("{o:5} {c}: {r}");
        if o == "skip" && r.contains("not available on this kernel") {
            eprintln!("  (this kernel lacks that transport: its check is skipped)");
        }
    }
    (out.code(), checks)
}

fn find<'a>(checks: &'a [Line], name: &str) -> &'a Line {
    checks
        .iter()
        .find(|(_, c, _)| c == name)
        .unwrap_or_else(|| panic!("no check `{name}` in {checks:#?}"))
}

fn world() -> World {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    w
}

#[test]
fn probe_fails_on_a_udplite_leak_element() {
    let w = world();
    let _api = w.listen_tcp(HOST_V4, 443);
    let path = w.write_file("policy.yaml", POLICY);
    let path = path.to_str().expect("utf-8").to_string();
    let applied = w.egress_fence(&["apply", &path]);
    assert!(applied.success(), "{applied}");

    let (code, checks) = probe(&w, &path);
    assert_eq!(code, 0, "the boundary holds: {checks:#?}");
    let udplite = find(&checks, "blocked udplite 203.0.113.11:443");
    assert_eq!(udplite.0, "pass", "{udplite:?}");

    let leak = w.sandbox_cmd(&[
        "nft",
        "add element inet egress_fence allow4 { 0.0.0.0/0 . udplite . 0-65535 }",
    ]);
    assert!(leak.success(), "{leak}");
    let (code, checks) = probe(&w, &path);
    assert_eq!(code, 5, "probe must fail on the UDP-Lite leak: {checks:#?}");
    let udplite = find(&checks, "blocked udplite 203.0.113.11:443");
    assert_eq!(udplite.0, "fail", "{udplite:?}");
    assert!(
        udplite.2.contains("the boundary let it through"),
        "{udplite:?}"
    );
    // IPv6 has no such element: still refused.
    let udplite6 = find(&checks, "blocked udplite [2001:db8:2::10]:443");
    assert_eq!(udplite6.0, "pass", "{udplite6:?}");
    // The element itself is named, whatever destinations the probe happens to try.
    let element = find(&checks, "allow4 element 0.0.0.0/0 . udplite . 0-65535");
    assert_eq!(element.0, "fail", "{element:?}");
}

/// An allow element no `cidr:` entry writes (TCP to a network the policy never names) is
/// named even though no probe target lies in it.
#[test]
fn probe_names_an_allow_element_the_policy_does_not_explain() {
    let w = world();
    let _api = w.listen_tcp(HOST_V4, 443);
    let path = w.write_file("policy.yaml", POLICY);
    let path = path.to_str().expect("utf-8").to_string();
    let applied = w.egress_fence(&["apply", &path]);
    assert!(applied.success(), "{applied}");
    let hole = w.sandbox_cmd(&[
        "nft",
        "add element inet egress_fence allow4 { 198.18.0.0/15 . tcp . 1-65535 }",
    ]);
    assert!(hole.success(), "{hole}");
    let (code, checks) = probe(&w, &path);
    assert_eq!(code, 5, "{checks:#?}");
    let (outcome, name, reason) = checks
        .iter()
        .find(|(_, c, _)| c.starts_with("allow4 element 198.18.0.0/15 . tcp"))
        .unwrap_or_else(|| panic!("the element is not named: {checks:#?}"));
    assert_eq!(outcome, "fail", "{name}: {reason}");
    assert!(reason.contains("no cidr entry"), "{name}: {reason}");

    // DNS to a resolver the policy does not name.
    let rogue = w.sandbox_cmd(&[
        "nft",
        "add element inet egress_fence dns4 { 192.0.2.54 . udp . 53 }",
    ]);
    assert!(rogue.success(), "{rogue}");
    let (code, checks) = probe(&w, &path);
    assert_eq!(code, 5, "{checks:#?}");
    let element = find(&checks, "dns4 element 192.0.2.54 . udp . 53");
    assert_eq!(element.0, "fail", "{element:?}");
    assert!(
        element.2.contains("not DNS to one of the resolvers"),
        "{element:?}"
    );
}

#[test]
fn probe_names_unexplained_elements_of_a_run_generation() {
    let w = world();
    let path = w.write_file("policy.yaml", POLICY);
    let path = path.to_str().expect("utf-8").to_string();
    let mut daemon = w.spawn_egress_fence(&["run", &path]);
    assert!(
        daemon.wait_for_output("new addresses allowed", Duration::from_secs(15)),
        "the daemon did not start:\n{}",
        daemon.stderr()
    );
    // Stopped, the service leaves its table as it was (as after a crash); a running one
    // would heal it before the probe reads it. Its own elements gone (expired), nothing in
    // the sets shows a timeout: only the state directory says the table is the service's.
    daemon.terminate();
    for set in ["resolved4", "resolved6"] {
        let out = w.sandbox_cmd(&["nft", &format!("flush set inet egress_fence {set}")]);
        assert!(out.success(), "{out}");
    }
    let add = |element: &str| {
        let out = w.sandbox_cmd(&[
            "nft",
            &format!("add element inet egress_fence resolved4 {{ {element} }}"),
        ]);
        assert!(out.success(), "{out}");
    };
    // No timeout, on an allowed name's service: it never expires, which the service never
    // writes (a permanent element of `apply` would look the same).
    add("192.0.2.12 . tcp . 443");
    let (code, checks) = probe(&w, &path);
    assert_eq!(code, 5, "{checks:#?}");
    let no_timeout = find(&checks, "resolved element 192.0.2.12 . tcp . 443");
    assert_eq!(no_timeout.0, "fail", "{no_timeout:?}");
    assert!(no_timeout.2.contains("no timeout"), "{no_timeout:?}");

    // A name the policy lacks, with a timeout like the service's.
    add("192.0.2.13 . tcp . 443 timeout 9s comment \"paste.example.com\"");
    let (code, checks) = probe(&w, &path);
    assert_eq!(code, 5, "{checks:#?}");
    let foreign = find(&checks, "resolved element 192.0.2.13 . tcp . 443");
    assert_eq!(foreign.0, "fail", "{foreign:?}");
    assert!(foreign.2.contains("paste.example.com"), "{foreign:?}");
}

/// No egress-fence table; the far host rejects the blocked targets itself (ICMP admin
/// prohibited, from its own address, as a remote firewall does). Those refusals are not the
/// boundary's: the checks fail, saying so.
#[test]
fn a_refusal_from_the_far_side_is_not_the_boundarys() {
    let w = world();
    let _api = w.listen_tcp(HOST_V4, 443);
    for cmd in [
        "add table inet far",
        "add chain inet far input { type filter hook input priority 0; policy accept; }",
        "add rule inet far input ip daddr 203.0.113.11 reject with icmpx admin-prohibited",
        "add rule inet far input ip6 daddr 2001:db8:2::10 reject with icmpx admin-prohibited",
    ] {
        let out = w.net_cmd(&["nft", cmd]);
        assert!(out.success(), "in the far namespace: nft {cmd}: {out}");
    }
    let path = w.write_file("policy.yaml", POLICY);
    let path = path.to_str().expect("utf-8").to_string();
    assert!(w.table_handle().is_none(), "no egress-fence table");

    let (code, checks) = probe(&w, &path);
    assert_eq!(code, 5, "{checks:#?}");
    for name in [
        "blocked tcp 203.0.113.11:443",
        "blocked udp 203.0.113.11:443",
        "blocked udplite 203.0.113.11:443",
        "blocked tcp [2001:db8:2::10]:443",
        "blocked udp [2001:db8:2::10]:443",
        "blocked udplite [2001:db8:2::10]:443",
    ] {
        let (outcome, _, reason) = find(&checks, name);
        assert_eq!(outcome, "fail", "{name}: {reason}");
        assert!(reason.contains("beyond this host"), "{name}: {reason}");
    }
}
