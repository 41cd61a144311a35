//! An outside review of the typed read-back (issue 17, items 1 and 2): hand edits of the
//! table by root with `nft`, each either reported as drift and undone by one `apply`, or
//! shown to leave the boundary as it was.

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

const TABLE: &str = "inet egress_fence";

fn world() -> (World, String) {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4, HOST_V6], DEFAULT_DNS_TTL);
    let policy = w.write_file("policy.yaml", POLICY);
    let policy = policy.to_str().expect("utf-8 path").to_owned();
    let out = w.egress_fence(&["apply", &policy]);
    assert_eq!(out.code(), 0, "the first apply: {out}");
    assert_in_sync(&w, &policy, "the first apply");
    (w, policy)
}

/// Runs an nft script in the sandbox; `Err` with nft's complaint if it refuses it.
fn nft_script(w: &World, script: &str) -> Result<(), String> {
    let out = w.sandbox_cmd_with_input(&["nft", "-f", "-"], script.as_bytes());
    if out.success() {
        Ok(())
    } else {
        Err(format!("nft -f of\n{script}\n{out}"))
    }
}

fn listing(w: &World) -> String {
    let out = w.sandbox_cmd(&["nft", "list", "table", "inet", "egress_fence"]);
    assert!(out.success(), "{out}");
    out.stdout
}

/// The script that replaces the table with its own listing, edited by `edit`: nft writes
/// every rule and set again, so only the edit differs.
fn reloaded(w: &World, edit: impl Fn(&str) -> String) -> String {
    let before = listing(w);
    let edited = edit(&before);
    assert_ne!(edited, before, "the edit changed nothing");
    format!("delete table {TABLE}\n{edited}")
}

fn assert_in_sync(w: &World, policy: &str, after: &str) {
    let status = w.egress_fence(&["status"]);
    assert!(
        status.success() && status.stdout.contains("in sync with generation"),
        "status after {after}: {status}"
    );
    let diff = w.egress_fence(&["diff", policy]);
    assert_eq!(diff.code(), 0, "diff after {after}: {diff}");
}

/// `status` reports drift naming `shown`, `diff` exits 1 naming it, and one `apply` sends the
/// table again: in sync after, and nothing of the edit (`gone`) left in nft's listing.
fn assert_drift_then_repaired(w: &World, policy: &str, edit: &str, shown: &str, gone: &str) {
    let status = w.egress_fence(&["status"]);
    assert!(
        status.success() && status.stdout.contains("DRIFT from generation"),
        "status after {edit}: {status}"
    );
    assert!(
        status.stdout.contains(shown),
        "status after {edit} does not show `{shown}`: {status}"
    );
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
    let after = listing(w);
    assert!(
        !after.contains(gone),
        "`{gone}` is left after apply after {edit}:\n{after}"
    );
}

/// The boundary as the policy draws it: the allowed host reachable, another one not.
fn assert_boundary_holds(w: &World, after: &str) {
    let _api = w.listen_tcp(HOST_V4, 443);
    let _other = w.listen_tcp(OTHER_V4, 443);
    assert!(w.tcp_connects(HOST_V4, 443), "the allowed host {after}");
    assert!(
        !w.tcp_connects(OTHER_V4, 443),
        "a host outside the policy {after}"
    );
}

#[test]
fn stateful_objects_in_the_table_are_drift_and_apply_removes_them() {
    // Named counters, quotas and limits do nothing until a rule of the table uses them (and
    // such a rule is drift), but they are in the table: status sees them, apply removes them.
    let (w, policy) = world();
    for (kind, name, body) in [
        ("counter", "XXcounter", ""),
        ("quota", "XXquota", "{ over 1 mbytes }"),
        ("limit", "XXlimit", "{ rate 1/second }"),
    ] {
        nft_script(&w, &format!("add {kind} {TABLE} {name} {body}\n"))
            .unwrap_or_else(|e| panic!("{e}"));
        let shown = format!("{kind} {name}: not egress-fence's");
        assert_drift_then_repaired(&w, &policy, &format!("{kind} {name}"), &shown, name);
    }
    assert_boundary_holds(&w, "after the objects were removed");
}

#[test]
fn a_flowtable_in_the_table_is_drift_and_apply_removes_it() {
    let (w, policy) = world();
    let script = format!(
        "add flowtable {TABLE} XXflows {{ hook ingress priority 0; devices = {{ lo }}; }}\n"
    );
    if let Err(e) = nft_script(&w, &script) {
        eprintln!("SKIP: this kernel has no flowtables (nf_flow_table_inet): {e}");
        return;
    }
    assert_drift_then_repaired(
        &w,
        &policy,
        "a flowtable",
        "flowtable XXflows: not egress-fence's",
        "XXflows",
    );
}

#[test]
fn a_sets_parameters_are_drift() {
    // What a set declares besides its type and flags: a default timeout and garbage
    // collection, a size, a backend policy, expressions its new elements are given.
    let (w, policy) = world();
    let edits: [(&str, &str, &str, &str); 5] = [
        (
            "set resolved4 {\n",
            "\t\ttimeout 1h\n",
            "timeout 3600000ms",
            "timeout 1h",
        ),
        (
            "set resolved6 {\n",
            "\t\tgc-interval 1s\n",
            "gc-interval 1000ms",
            "gc-interval",
        ),
        ("set dns4 {\n", "\t\tsize 2\n", "size 2", "size 2"),
        (
            "set allow6 {\n",
            "\t\tpolicy memory\n",
            "policy memory",
            "policy memory",
        ),
        // An empty set: no element shows the expressions yet.
        (
            "set allow6 {\n",
            "\t\tcounter\n",
            "expressions given to every new element",
            "\t\tcounter\n",
        ),
    ];
    for (set, param, shown, gone) in edits {
        let script = reloaded(&w, |l| l.replacen(set, &format!("{set}{param}"), 1));
        nft_script(&w, &script).unwrap_or_else(|e| panic!("{e}"));
        assert_drift_then_repaired(&w, &policy, param.trim(), shown, gone);
    }
    assert_boundary_holds(&w, "after the sets were sent again");
}
