//! Item 2: one `apply` restores the whole boundary, every allowed name included, whatever
//! state the tool's own table is in (absent, flushed, edited), and opens nothing else.

use crate::common::*;

const POLICY: &str = r#"
version: 1
allow:
  - domain: api.example.com
    ports: [443]
  - domain: cdn.example.com
    ports: [443]
deny:
  - preset: cloud-metadata
dns:
  resolvers: [192.0.2.53]
"#;

fn world() -> (World, String) {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4, HOST_V6], DEFAULT_DNS_TTL);
    w.dns_set("cdn.example.com", &[HOST2_V4], DEFAULT_DNS_TTL);
    let policy = w.write_file("policy.yaml", POLICY);
    let policy = policy.to_str().expect("utf-8 path").to_owned();
    (w, policy)
}

/// Every name's address is in the resolved sets, the allowed host connects and a host outside
/// the policy and the metadata service do not.
fn assert_whole_boundary(w: &World) {
    for (addr, name) in [
        (HOST_V4, "api.example.com"),
        (HOST_V6, "api.example.com"),
        (HOST2_V4, "cdn.example.com"),
    ] {
        assert!(
            w.resolved_element(addr, 443).is_some(),
            "{name}'s address {addr} is missing from the resolved sets"
        );
    }
    let _api = w.listen_tcp(HOST_V4, 443);
    let _other = w.listen_tcp(OTHER_V4, 443);
    let _metadata = w.listen_tcp(METADATA_V4, 80);
    assert!(w.tcp_connects(HOST_V4, 443), "the allowed name's host");
    assert!(!w.tcp_connects(OTHER_V4, 443), "a host outside the policy");
    assert!(!w.tcp_connects(METADATA_V4, 80), "the metadata service");
}

/// Applies and expects the whole boundary, with exit code 0 (every name resolved).
fn apply_restores(w: &World, policy: &str, what: &str) {
    let out = w.egress_fence(&["apply", policy]);
    assert_eq!(out.code(), 0, "apply after {what}: {out}");
    assert_whole_boundary(w);
}

#[test]
fn apply_restores_a_flushed_table_with_every_name() {
    let (w, policy) = world();
    apply_restores(&w, &policy, "a first apply");
    // An admin or a reset script: the chains keep `policy drop` with no rules, so even the
    // tool's own DNS to the resolvers is dropped.
    let out = w.sandbox_cmd(&["nft", "flush", "table", "inet", "egress_fence"]);
    assert!(out.success(), "{out}");
    assert!(
        w.dig(Some(DNS_V4), "api.example.com", "A", false)
            .status
            .is_none(),
        "a flushed table still drops DNS (the premise of the attack)"
    );
    apply_restores(&w, &policy, "nft flush table");
}

#[test]
fn apply_restores_a_table_whose_dns_rule_was_deleted() {
    let (w, policy) = world();
    apply_restores(&w, &policy, "a first apply");
    let listing = w.sandbox_cmd(&[
        "nft",
        "-a",
        "list",
        "chain",
        "inet",
        "egress_fence",
        "output",
    ]);
    assert!(listing.success(), "{listing}");
    let handle = listing
        .stdout
        .lines()
        .find(|l| l.contains("@dns4"))
        .and_then(|l| l.rsplit("# handle ").next())
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|| panic!("no rule for @dns4 in\n{listing}"));
    let out = w.sandbox_cmd(&[
        "nft",
        "delete",
        "rule",
        "inet",
        "egress_fence",
        "output",
        "handle",
        &handle,
    ]);
    assert!(out.success(), "{out}");
    // The resolved elements go too, as after a crash that lost them.
    for set in ["resolved4", "resolved6"] {
        let out = w.sandbox_cmd(&["nft", "flush", "set", "inet", "egress_fence", set]);
        assert!(out.success(), "{out}");
    }
    apply_restores(&w, &policy, "deleting the DNS rule");
}

#[test]
fn apply_installs_an_absent_table_and_a_second_apply_changes_nothing() {
    let (w, policy) = world();
    apply_restores(&w, &policy, "nothing (no table)");
    let out = w.egress_fence(&["apply", &policy]);
    assert_eq!(out.code(), 0, "{out}");
    assert!(out.stdout.contains("unchanged"), "{out}");
    assert!(
        !out.stderr.contains("resolving again"),
        "a healthy table is not replaced twice: {out}"
    );
}
