//! Issue 17, items 1 and 2: every byte of the table is read back. A hand edit that switches the
//! fence off or widens it (a dormant table, a chain's type or priority, a catch-all element,
//! an element for another protocol, a range of protocols) makes `status` report drift and
//! `diff` exit 1, and one `apply` puts the table back.

use crate::common::*;

const POLICY: &str = r#"
version: 1
allow:
  - domain: api.example.com
    ports: [443]
  - cidr: 198.51.100.0/24
    ports: [22]
deny:
  - preset: cloud-metadata
dns:
  resolvers: [192.0.2.53]
"#;

pub(crate) fn world() -> (World, String) {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4, HOST_V6], DEFAULT_DNS_TTL);
    let policy = w.write_file("policy.yaml", POLICY);
    let policy = policy.to_str().expect("utf-8 path").to_owned();
    let out = w.egress_fence(&["apply", &policy]);
    assert_eq!(out.code(), 0, "the first apply: {out}");
    assert_in_sync(&w, &policy, "the first apply");
    (w, policy)
}

/// `nft ARGS` in the sandbox, which must succeed.
fn nft(w: &World, args: &[&str]) {
    let mut full = vec!["nft"];
    full.extend_from_slice(args);
    let out = w.sandbox_cmd(&full);
    assert!(out.success(), "nft {}: {out}", args.join(" "));
}

pub(crate) fn assert_in_sync(w: &World, policy: &str, after: &str) {
    let status = w.egress_fence(&["status"]);
    assert!(status.success(), "{status}");
    assert!(
        status.stdout.contains("in sync with generation"),
        "status after {after}: {status}"
    );
    let diff = w.egress_fence(&["diff", policy]);
    assert_eq!(diff.code(), 0, "diff after {after}: {diff}");
}

/// `status` reports drift naming `shown`, `diff` exits 1, and one `apply` restores the
/// table: in sync again, the allowed host reachable, a host outside the policy not.
fn assert_drift_then_restored(w: &World, policy: &str, edit: &str, shown: &str) {
    let status = w.egress_fence(&["status"]);
    assert!(status.success(), "{status}");
    assert!(
        status.stdout.contains("DRIFT from generation"),
        "status after {edit}: {status}"
    );
    assert!(
        status.stdout.contains(shown),
        "status after {edit} does not show `{shown}`: {status}"
    );
    let json = w.egress_fence(&["status", "--json"]);
    let json: serde_json::Value = serde_json::from_str(&json.stdout)
        .unwrap_or_else(|e| panic!("status --json after {edit} ({e}): {json}"));
    assert_eq!(json["drift"], true, "status --json after {edit}: {json}");
    let diff = w.egress_fence(&["diff", policy]);
    assert_eq!(diff.code(), 1, "diff after {edit}: {diff}");
    assert!(
        diff.stdout.contains(shown),
        "diff after {edit} does not show `{shown}`: {diff}"
    );

    let apply = w.egress_fence(&["apply", policy]);
    assert_eq!(apply.code(), 0, "apply after {edit}: {apply}");
    assert!(
        !apply.stdout.contains("unchanged"),
        "apply after {edit} sent nothing: {apply}"
    );
    assert_in_sync(w, policy, &format!("apply after {edit}"));
    let _api = w.listen_tcp(HOST_V4, 443);
    let _other = w.listen_tcp(OTHER_V4, 443);
    assert!(
        w.tcp_connects(HOST_V4, 443),
        "the allowed host after {edit}"
    );
    assert!(
        !w.tcp_connects(OTHER_V4, 443),
        "a host outside the policy after {edit} and apply"
    );
}

#[test]
fn a_dormant_table_is_drift_and_apply_wakes_it() {
    let (w, policy) = world();
    nft(
        &w,
        &["add", "table", "inet", "egress_fence", "{ flags dormant; }"],
    );
    {
        // The premise: a dormant table refuses nothing.
        let _other = w.listen_tcp(OTHER_V4, 443);
        assert!(
            w.tcp_connects(OTHER_V4, 443),
            "a dormant table still refused a host outside the policy"
        );
    }
    let status = w.egress_fence(&["status"]);
    assert!(
        status
            .stdout
            .contains("table inet egress_fence: installed (dormant)"),
        "{status}"
    );
    assert_drift_then_restored(&w, &policy, "flags dormant", "flags dormant (wanted: none)");
}

/// Replaces the table with its own listing, edited by `edit`: nft writes every rule and set
/// again, so only the edit differs.
fn reload_edited(w: &World, edit: impl Fn(&str) -> String) {
    let listing = w.sandbox_cmd(&["nft", "list", "table", "inet", "egress_fence"]);
    assert!(listing.success(), "{listing}");
    let edited = edit(&listing.stdout);
    assert_ne!(edited, listing.stdout, "the edit changed nothing");
    let script = format!("delete table inet egress_fence\n{edited}");
    let out = w.sandbox_cmd_with_input(&["nft", "-f", "-"], script.as_bytes());
    assert!(out.success(), "nft -f of\n{script}\n{out}");
}

#[test]
fn the_table_reloaded_by_nft_reads_back_in_sync() {
    // nft writes every rule as egress-fence does: its own copy decodes rule for rule.
    let (w, policy) = world();
    reload_edited(&w, |listing| format!("{listing}\n"));
    assert_in_sync(&w, &policy, "nft -f of the table's own listing");
}

#[test]
fn a_chain_at_another_priority_is_drift() {
    let (w, policy) = world();
    reload_edited(&w, |listing| {
        listing.replace("priority filter;", "priority 100;")
    });
    assert_drift_then_restored(
        &w,
        &policy,
        "the output chain at priority 100",
        "hook output priority 100 policy drop (wanted: hook output priority 0 policy drop)",
    );
}

#[test]
fn a_chain_of_another_type_is_drift() {
    let (w, policy) = world();
    let listing = w.sandbox_cmd(&["nft", "list", "table", "inet", "egress_fence"]);
    let script = format!(
        "delete table inet egress_fence\n{}",
        listing
            .stdout
            .replace("type filter hook output", "type route hook output")
    );
    let out = w.sandbox_cmd_with_input(&["nft", "-f", "-"], script.as_bytes());
    if !out.success() {
        eprintln!("SKIP: this kernel has no route chains in family inet: {out}");
        return;
    }
    assert_drift_then_restored(
        &w,
        &policy,
        "the output chain as a route chain",
        "type route hook output priority 0 policy drop",
    );
}

#[test]
fn a_catch_all_element_is_drift() {
    let (w, policy) = world();
    nft(
        &w,
        &["add", "element", "inet", "egress_fence", "allow4", "{ * }"],
    );
    assert_drift_then_restored(&w, &policy, "allow4 { * }", "* (undecodable)");
}

/// Sends one UDP-Lite datagram as an unprivileged user from the sandbox to a host outside
/// the policy: `Some(true)` if it left, `Some(false)` if the output hook refused it (EPERM),
/// `None` if this kernel has no UDP-Lite.
fn udplite_leaves(w: &World) -> Option<bool> {
    const SEND: &str = r#"
import socket, sys
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, 136)
except OSError as e:
    print("unsupported", e)
    sys.exit(0)
try:
    s.sendto(b"x", (sys.argv[1], 9))
    print("sent")
except PermissionError:
    print("refused")
"#;
    let host = OTHER_V4.to_string();
    let out = w.sandbox_cmd_as(NOBODY, &[PYTHON, "-c", SEND, &host]);
    assert!(out.success(), "{out}");
    match out.stdout.trim() {
        "sent" => Some(true),
        "refused" => Some(false),
        _ => {
            eprintln!("SKIP the UDP-Lite leak check: {}", out.stdout.trim());
            None
        }
    }
}

#[test]
fn an_element_for_udplite_is_drift() {
    let (w, policy) = world();
    assert_ne!(udplite_leaves(&w), Some(true), "UDP-Lite leaves the fence");
    let element = "{ 0.0.0.0/0 . udplite . 0-65535 }";
    nft(
        &w,
        &["add", "element", "inet", "egress_fence", "allow4", element],
    );
    // The premise: the element lets unprivileged UDP-Lite out to anywhere.
    let leak_checked = udplite_leaves(&w).is_some();
    if leak_checked {
        assert_eq!(udplite_leaves(&w), Some(true), "the element opens UDP-Lite");
    }
    let status = w.egress_fence(&["status"]);
    assert!(
        status
            .stdout
            .contains("0.0.0.0/0 . udplite . 0-65535 (undecodable)"),
        "status lists the element: {status}"
    );
    assert_drift_then_restored(
        &w,
        &policy,
        "an udplite element",
        "0.0.0.0/0 . udplite . 0-65535 (undecodable)",
    );
    if leak_checked {
        assert_eq!(udplite_leaves(&w), Some(false), "UDP-Lite after apply");
    }
}

#[test]
fn a_range_of_protocols_is_drift() {
    let (w, policy) = world();
    let element = "{ 0.0.0.0/0 . 6-17 . 0-65535 }";
    nft(
        &w,
        &["add", "element", "inet", "egress_fence", "allow4", element],
    );
    assert_drift_then_restored(
        &w,
        &policy,
        "a protocol range",
        "0.0.0.0/0 . tcp-udp . 0-65535 (undecodable)",
    );
}
