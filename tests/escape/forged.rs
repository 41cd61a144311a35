//! Issue 17 item 6: a generation is trusted only if its policy text, planned again with its
//! recorded resolution, gives its ruleset. A forged one (the tight policy's text over an open
//! ruleset, its nft text and number made to match, so that it parses) is listed as CORRUPT,
//! refused by `rollback` and never reported "in sync"; the generations `apply` and `run`
//! record (timed and carried elements included) still load and roll back.

use std::fs;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::common::*;

const TIGHT: &str = "version: 1\nallow:\n  - domain: a.example.com\n    ports: [443]\n\
                     dns:\n  resolvers: [192.0.2.53]\n";
const OPEN: &str = "version: 1\nallow:\n  - cidr: 0.0.0.0/0\n    protocol: any\n\
                    dns:\n  resolvers: [192.0.2.53]\n";

fn read_generation(w: &World, n: u64) -> Value {
    let path = w.sandbox_state_dir().join(format!("gen-{n:06}.json"));
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path:?}: {e}"));
    serde_json::from_str(&text).expect("a generation is JSON")
}

fn write_generation(w: &World, n: u64, generation: &Value) {
    let path = w.sandbox_state_dir().join(format!("gen-{n:06}.json"));
    let text = serde_json::to_string_pretty(generation).expect("encode");
    fs::write(&path, text).unwrap_or_else(|e| panic!("write {path:?}: {e}"));
}

/// Generation `open` with the policy text, path and resolution of generation `tight`, under
/// number `n`: everything a reader checks agrees, but the ruleset opens every host.
fn forge(w: &World, open: u64, tight: u64, n: u64) -> Value {
    let tight = read_generation(w, tight);
    let mut forged = read_generation(w, open);
    for field in ["policy_text", "policy_path", "resolution"] {
        forged[field] = tight[field].clone();
    }
    forged["generation"] = n.into();
    write_generation(w, n, &forged);
    forged
}

/// The (number, corrupt reason) of every generation `history --json` lists.
fn history(w: &World) -> Vec<(u64, Option<String>)> {
    let out = egress_fence_ok(w, &["history", "--json"]);
    let v: Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out}"));
    v["generations"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|g| {
            (
                g["generation"].as_u64().expect("a number"),
                g["corrupt"].as_str().map(str::to_owned),
            )
        })
        .collect()
}

/// Whether a process in the sandbox reaches a host the tight policy does not allow.
fn open_to_other_hosts(w: &World) -> bool {
    let _other = w.listen_tcp(OTHER_V4, 8443);
    w.tcp_connects(OTHER_V4, 8443)
}

#[test]
fn a_forged_generation_is_corrupt_and_never_rolled_back_to() {
    let w = World::new();
    w.dns_set("a.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    let tight = w.write_file("tight.yaml", TIGHT);
    let open = w.write_file("open.yaml", OPEN);
    for policy in [&tight, &open, &tight] {
        egress_fence_ok(&w, &["apply", path_arg(policy)]);
    }
    assert!(
        !open_to_other_hosts(&w),
        "the tight policy is installed (premise)"
    );

    // Generation 2 rewritten as if it had been the tight policy.
    forge(&w, 2, 1, 2);
    let listed = history(&w);
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert_eq!(
        (listed[0].0, listed[0].1.is_none()),
        (1, true),
        "{listed:?}"
    );
    assert_eq!(
        (listed[2].0, listed[2].1.is_none()),
        (3, true),
        "{listed:?}"
    );
    let why = listed[1].1.as_deref().expect("generation 2 is corrupt");
    assert!(
        why.contains("not what its policy text plans with its recorded resolution")
            && why.contains("allow4"),
        "{why}"
    );
    let text = egress_fence_ok(&w, &["history"]).stdout;
    let line = format!(
        "     2  CORRUPT: {}:",
        w.sandbox_state_dir().join("gen-000002.json").display()
    );
    assert!(text.contains(&line), "{text}");

    let out = w.egress_fence(&["rollback", "--to", "2"]);
    assert_eq!(out.code(), 1, "{out}");
    assert!(
        out.stderr.contains("generation 2")
            && out.stderr.contains("gen-000002.json")
            && out.stderr.contains("corrupt")
            && out.stderr.contains("not what its policy text plans"),
        "{out}"
    );
    assert!(
        !open_to_other_hosts(&w),
        "a refused rollback opened the fence"
    );

    // As the newest generation, over the open table: `status` trusts nothing, and a plain
    // `rollback` goes past it only to an honest generation.
    egress_fence_ok(&w, &["apply", path_arg(&open)]);
    assert!(open_to_other_hosts(&w), "the open policy is installed");
    let forged = forge(&w, 4, 1, 4);
    assert_eq!(forged["policy_text"], TIGHT);
    let out = egress_fence_ok(&w, &["status"]);
    assert!(
        !out.stdout.contains("in sync") && out.stdout.contains("cannot check for drift"),
        "{out}"
    );
    let out = egress_fence_ok(&w, &["rollback"]);
    assert!(out.stdout.contains("generation 3"), "{out}");
    assert!(
        !open_to_other_hosts(&w),
        "the rollback reinstated the tight policy"
    );
    let out = egress_fence_ok(&w, &["status"]);
    assert!(out.stdout.contains("in sync with generation 5"), "{out}");
}

#[test]
fn generations_run_records_load_and_roll_back() {
    let w = World::new();
    w.dns_set("a.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    let tight = w.write_file("tight.yaml", TIGHT);
    let open = w.write_file("open.yaml", OPEN);

    let mut daemon = w.spawn_egress_fence(&["run", path_arg(&tight)]);
    for line in ["recorded generation 1", "new addresses allowed"] {
        assert!(
            daemon.wait_for_output(line, Duration::from_secs(10)),
            "{}",
            daemon.stderr()
        );
    }
    // A reload with the names' addresses known: a generation with timed elements.
    daemon.signal(Signal::SIGHUP);
    assert!(
        daemon.wait_for_output("recorded generation 2", Duration::from_secs(10)),
        "{}",
        daemon.stderr()
    );
    // A restart carries the running table's elements over: they are in its first generation
    // without being in its resolution.
    daemon.signal(Signal::SIGKILL);
    assert!(daemon.wait_timeout(Duration::from_secs(5)).is_some());
    let mut daemon = w.spawn_egress_fence(&["run", path_arg(&tight)]);
    assert!(
        daemon.wait_for_output("recorded generation 3", Duration::from_secs(10)),
        "{}",
        daemon.stderr()
    );
    daemon.terminate();

    let timed = |n: u64| {
        read_generation(&w, n)["ruleset"]["sets"]
            .as_array()
            .expect("sets")
            .iter()
            .filter(|s| s["id"]["role"] == "resolved")
            .flat_map(|s| {
                s["elements"]["timed"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .filter(|e| e["timeout_ms"].is_u64())
            .count()
    };
    assert!(timed(2) > 0, "generation 2 has timed elements");
    assert!(timed(3) > 0, "generation 3 carries elements over");
    assert!(
        history(&w).iter().all(|(_, corrupt)| corrupt.is_none()),
        "{:?}",
        history(&w)
    );

    egress_fence_ok(&w, &["apply", path_arg(&open)]);
    for n in [2, 3] {
        let out = egress_fence_ok(&w, &["rollback", "--to", &n.to_string()]);
        assert!(out.stdout.contains(&format!("generation {n}")), "{out}");
        assert!(!open_to_other_hosts(&w), "rollback to {n}");
        assert!(
            w.resolved_element(HOST_V4, 443)
                .is_some_and(|e| e.timeout.is_some()),
            "rollback to {n} has a.example.com's element, with its timeout"
        );
        egress_fence_ok(&w, &["apply", path_arg(&open)]);
    }
    assert!(
        history(&w).iter().all(|(_, corrupt)| corrupt.is_none()),
        "{:?}",
        history(&w)
    );
}

/// Guard mode: the names the guard learned (for a wildcard), on the guard's uid, are in the
/// generation a reload records; it loads and rolls back like any other.
#[test]
fn generations_the_guard_records_load_and_roll_back() {
    let w = World::new();
    w.dns_set("x.pool.example", &[HOST_V4], DEFAULT_DNS_TTL);
    let guarded = w.write_file(
        "guard.yaml",
        &format!(
            "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [443]\n\
             dns:\n  mode: guard\n  listen: [\"{GUARD_ADDR}\"]\n  upstream: [{DNS_V4}]\n"
        ),
    );
    let open = w.write_file("open.yaml", OPEN);
    w.use_guard_resolver();
    let mut daemon = w.spawn_guard(path_arg(&guarded));
    let dig = w.dig(Some(GUARD_V4), "x.pool.example", "A", false);
    assert_eq!(dig.status.as_deref(), Some("NOERROR"), "{}", dig.output);
    assert!(
        w.resolved_element(HOST_V4, 443).is_some(),
        "the guard allowed what it answered"
    );
    daemon.signal(Signal::SIGHUP);
    assert!(
        daemon.wait_for_output("recorded generation 2", Duration::from_secs(10)),
        "{}",
        daemon.stderr()
    );
    daemon.terminate();
    let recorded = read_generation(&w, 2);
    assert!(recorded["resolution"]["guard_uid"].is_u64(), "{recorded}");
    assert!(
        recorded["nft"]
            .as_str()
            .is_some_and(|nft| nft.contains("comment \"x.pool.example\"")),
        "{recorded}"
    );
    assert!(
        history(&w).iter().all(|(_, corrupt)| corrupt.is_none()),
        "{:?}",
        history(&w)
    );

    egress_fence_ok(&w, &["apply", path_arg(&open)]);
    let out = egress_fence_ok(&w, &["rollback", "--to", "2"]);
    assert!(out.stdout.contains("generation 2"), "{out}");
    assert!(!open_to_other_hosts(&w), "the guard's table is back");
    assert!(w.resolved_element(HOST_V4, 443).is_some());
}

/// The resolution forged along with the ruleset: a generation of the tight policy's text
/// whose recorded resolution asked one more resolver, so that its planned DNS sets let every
/// process out to that address on port 53. It re-planned to itself, so it was listed under
/// the tight policy, rolled back to and reported in sync; a resolver the policy text does not
/// name makes it CORRUPT.
#[test]
fn a_generation_with_a_resolver_its_policy_does_not_name_is_corrupt() {
    let w = World::new();
    let allow = "version: 1\nallow:\n  - cidr: 192.0.2.10/32\n    ports: [443]\n";
    let tight = w.write_file(
        "tight.yaml",
        &format!("{allow}dns:\n  resolvers: [192.0.2.53]\n"),
    );
    let wider = w.write_file(
        "wider.yaml",
        &format!("{allow}dns:\n  resolvers: [192.0.2.53, {OTHER_V4}]\n"),
    );
    egress_fence_ok(&w, &["apply", path_arg(&tight)]);
    egress_fence_ok(&w, &["apply", path_arg(&wider)]);
    egress_fence_ok(&w, &["apply", path_arg(&tight)]);
    let _dns = w.listen_tcp(OTHER_V4, 53);
    assert!(!w.tcp_connects(OTHER_V4, 53), "premise: the tight policy");

    // Generation 2's ruleset and resolution under generation 1's policy text.
    let mut forged = read_generation(&w, 2);
    let text = read_generation(&w, 1);
    for field in ["policy_text", "policy_path"] {
        forged[field] = text[field].clone();
    }
    forged["generation"] = 4.into();
    write_generation(&w, 4, &forged);

    let listed = history(&w);
    let why = listed[3]
        .1
        .as_deref()
        .unwrap_or_else(|| panic!("generation 4 is listed under the tight policy: {listed:?}"));
    assert!(
        why.contains(&format!(
            "its resolution asked {OTHER_V4}, which is not one of the resolvers its policy names"
        )),
        "{why}"
    );
    let out = w.egress_fence(&["rollback", "--to", "4"]);
    assert_eq!(out.code(), 1, "{out}");
    assert!(
        !w.tcp_connects(OTHER_V4, 53),
        "the rollback let DNS out to a resolver the policy does not name"
    );
    // Generation 2 itself names that resolver in its text: honest, and it loads.
    assert!(listed[1].1.is_none(), "{listed:?}");
}
