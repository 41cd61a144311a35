//! The boundary end to end: a policy applied in a throwaway sandbox namespace, proved with
//! real connections from inside it, read back by `nft` (an independent reader), torn down.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::*;
use egress_fence::core::plan::plan;
use egress_fence::core::policy::Policy;
use egress_fence::core::policy::{L4Proto, PortRange};
use egress_fence::core::resolution::Resolution;
use egress_fence::core::ruleset::{Elements, Family, SetId, SetRole, Timed, Tuple};
use egress_fence::nft::encode::{self, Encoded};
use egress_fence::nft::sys::{Elem, ElemOp, KeySpec, NlSet};
use egress_fence::nft::{Nft, NftError};
use nix::errno::Errno;
use serde_json::Value;
use std::ffi::CStr;

const POLICY: &str = r#"
version: 1
action: reject
allow:
  - domain: api.example.com        # HOST_V4 and HOST_V6
    ports: [443]
  - domain: rebind.example.com     # resolves onto the metadata service
    ports: [80]
  - domain: missing.example.com    # NXDOMAIN
    ports: [443]
  - cidr: 203.0.113.10/32          # OTHER_V4; its neighbour OTHER2_V4 is not allowed
    ports: [22]
deny:
  - preset: cloud-metadata
dns:
  resolvers: [192.0.2.53, "2001:db8:1::53"]
log:
  group: 100
"#;

/// A world whose DNS answers the policy's names, and the policy file.
fn world() -> (World, PathBuf) {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4, HOST_V6], DEFAULT_DNS_TTL);
    w.dns_set(
        "rebind.example.com",
        &[METADATA_V4, METADATA_V6],
        DEFAULT_DNS_TTL,
    );
    let policy = w.write_file("policy.yaml", POLICY);
    (w, policy)
}

fn path(p: &std::path::Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Applies the policy; exit code 3 because missing.example.com does not resolve.
fn apply(w: &World, policy: &std::path::Path) -> CmdOutput {
    let out = w.egress_fence(&["apply", path(policy)]);
    assert_eq!(out.code(), 3, "apply: {out}");
    assert!(out.stderr.contains("missing.example.com"), "{out}");
    out
}

/// The objects of the ruleset that belong to table `name`.
fn objects_of_table(ruleset: &Value, name: &str) -> Vec<Value> {
    ruleset["nftables"]
        .as_array()
        .expect("nftables array")
        .iter()
        .filter(|o| {
            o.as_object()
                .and_then(|m| m.values().next())
                .is_some_and(|body| body["table"] == name || body["name"] == name)
        })
        .cloned()
        .collect()
}

#[test]
fn the_policy_allows_exactly_what_it_lists() {
    let (w, policy) = world();
    let api4 = w.listen_tcp(HOST_V4, 443);
    let api6 = w.listen_tcp(HOST_V6, 443);
    let api_other_port = w.listen_tcp(HOST_V4, 8443);
    let api_udp = w.listen_udp(HOST_V4, 443);
    let cidr = w.listen_tcp(OTHER_V4, 22);
    let neighbour = w.listen_tcp(OTHER2_V4, 22);
    let unlisted4 = w.listen_tcp(HOST3_V4, 443);
    let unlisted6 = w.listen_tcp(HOST3_V6, 443);
    let metadata4 = w.listen_tcp(METADATA_V4, 80);
    let metadata6 = w.listen_tcp(METADATA_V6, 80);

    // Without the fence every target answers, so a refusal below is the fence's doing.
    for (host, port) in [
        (HOST_V4, 8443),
        (OTHER2_V4, 22),
        (HOST3_V4, 443),
        (HOST3_V6, 443),
        (METADATA_V4, 80),
        (METADATA_V6, 80),
    ] {
        assert!(w.tcp_connects(host, port), "{host}:{port} before the fence");
    }
    assert!(
        w.dig(Some(ROGUE_DNS_V4), "api.example.com", "A", false)
            .answered()
    );

    let out = apply(&w, &policy);
    assert!(
        out.stderr
            .contains("rebind.example.com resolved to 169.254.169.254"),
        "{out}"
    );
    let refused_targets = [
        &api_other_port,
        &neighbour,
        &unlisted4,
        &unlisted6,
        &metadata4,
        &metadata6,
    ];
    let hits = || refused_targets.map(|l| l.count());
    let before = hits();

    // The allowed name and port, by name, over IPv4 and IPv6.
    for (flag, want) in [("-4", "192.0.2.10:443"), ("-6", "[2001:db8:1::10]:443")] {
        let url = "http://api.example.com:443/";
        let out = w.sandbox_cmd(&["curl", flag, "-sS", "--max-time", "5", url]);
        assert!(out.success(), "allowed name, curl {flag}: {out}");
        assert!(out.stdout.contains(&format!("hello from {want}")), "{out}");
    }
    assert!(api4.peers().contains(&SANDBOX_V4));
    assert!(api6.peers().contains(&SANDBOX_V6));

    // The same host on another port, or over UDP: refused.
    assert!(!w.tcp_connects(HOST_V4, 8443));
    let udp = w.udp_send(HOST_V4, 443, b"exfil");
    assert!(
        !udp.success(),
        "UDP to an allowed TCP port left the host: {udp}"
    );
    assert!(!api_udp.wait_for(1, Duration::from_millis(300)));

    // Unlisted hosts, both families.
    assert!(!w.tcp_connects(HOST3_V4, 443));
    assert!(!w.tcp_connects(HOST3_V6, 443));

    // The allowed CIDR, and its neighbour.
    assert!(w.tcp_connects(OTHER_V4, 22));
    assert!(cidr.peers().contains(&SANDBOX_V4));
    assert!(!w.tcp_connects(OTHER2_V4, 22));

    // The metadata service: directly, and through an allowed name that resolves onto it.
    assert!(!w.tcp_connects(METADATA_V4, 80));
    assert!(!w.tcp_connects(METADATA_V6, 80));
    assert!(w.curl("http://rebind.example.com:80/").is_err());

    // None of the refused attempts reached a listener.
    assert_eq!(hits(), before, "a refused connection got through");

    // DNS: the allowed resolver over UDP and TCP, both families; no other resolver.
    for tcp in [false, true] {
        assert!(
            w.dig(Some(DNS_V4), "api.example.com", "A", tcp).answered(),
            "allowed resolver, tcp={tcp}"
        );
        assert!(
            w.dig(Some(DNS_V6), "api.example.com", "AAAA", tcp)
                .answered(),
            "allowed resolver over IPv6, tcp={tcp}"
        );
        assert!(
            !w.dig(Some(ROGUE_DNS_V4), "api.example.com", "A", tcp)
                .answered(),
            "rogue resolver, tcp={tcp}"
        );
        assert!(
            !w.dig(Some(ROGUE_DNS_V6), "api.example.com", "A", tcp)
                .answered(),
            "rogue resolver over IPv6, tcp={tcp}"
        );
    }
}

#[test]
fn nft_reads_back_exactly_the_table_that_plan_renders() {
    let (w, policy) = world();
    apply(&w, &policy);
    let applied = normalized_ruleset(w.nft_json());

    // Only our table, with the expected shape.
    let tables: Vec<&Value> = applied["nftables"]
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|o| o.get("table"))
        .collect();
    assert_eq!(tables.len(), 1, "{applied}");
    assert_eq!(tables[0]["family"], "inet");
    assert_eq!(tables[0]["name"], "egress_fence");
    let output = applied["nftables"]
        .as_array()
        .expect("array")
        .iter()
        .find_map(|o| o.get("chain").filter(|c| c["name"] == "output"))
        .expect("output chain");
    assert_eq!(output["hook"], "output");
    assert_eq!(output["policy"], "drop");
    let sets = applied["nftables"]
        .as_array()
        .expect("array")
        .iter()
        .filter(|o| o.get("set").is_some())
        .count();
    assert_eq!(sets, 8);

    // The same text, loaded by nft itself, reads back identically.
    let plan = w.egress_fence(&["plan", path(&policy)]);
    assert_eq!(plan.code(), 3, "{plan}");
    let check = w.sandbox_cmd_with_input(&["nft", "-c", "-f", "-"], plan.stdout.as_bytes());
    assert!(check.success(), "nft -c -f rejects the plan: {check}");
    assert!(w.egress_fence(&["teardown"]).success());
    let load = w.sandbox_cmd_with_input(&["nft", "-f", "-"], plan.stdout.as_bytes());
    assert!(load.success(), "nft -f: {load}");
    assert_eq!(normalized_ruleset(w.nft_json()), applied);
}

#[test]
fn a_second_apply_changes_nothing() {
    let (w, policy) = world();
    apply(&w, &policy);
    let first = normalized_ruleset(w.nft_json());
    apply(&w, &policy);
    assert_eq!(normalized_ruleset(w.nft_json()), first);
}

#[test]
fn other_tables_survive_apply_and_teardown_unchanged() {
    let (w, policy) = world();
    let foreign = "table ip keepme {
        set s { type ipv4_addr; elements = { 192.0.2.99 }; }
        chain c {
            type filter hook output priority 10; policy accept;
            ip daddr @s counter
        }
    }
    table inet other {
        chain c { type filter hook input priority 0; policy accept; }
    }";
    let load = w.sandbox_cmd_with_input(&["nft", "-f", "-"], foreign.as_bytes());
    assert!(load.success(), "{load}");
    let snapshot = |w: &World| {
        let v = normalized_ruleset(w.nft_json());
        [
            objects_of_table(&v, "keepme"),
            objects_of_table(&v, "other"),
        ]
    };
    let before = snapshot(&w);
    assert!(!before[0].is_empty() && !before[1].is_empty());

    apply(&w, &policy);
    assert_eq!(snapshot(&w), before);
    let down = w.egress_fence(&["teardown"]);
    assert!(down.success() && down.stdout.contains("deleted"), "{down}");
    assert_eq!(snapshot(&w), before);

    // Nothing of ours is left, and a second teardown is a no-op.
    let rest = normalized_ruleset(w.nft_json());
    assert!(objects_of_table(&rest, "egress_fence").is_empty(), "{rest}");
    let again = w.egress_fence(&["teardown"]);
    assert!(
        again.success() && again.stdout.contains("nothing to do"),
        "{again}"
    );
}

#[test]
fn teardown_restores_the_previous_reachability() {
    let (w, policy) = world();
    let _unlisted = w.listen_tcp(HOST3_V4, 443);
    let _metadata = w.listen_tcp(METADATA_V4, 80);
    assert!(w.tcp_connects(HOST3_V4, 443));
    assert!(w.tcp_connects(METADATA_V4, 80));
    assert_eq!(w.egress_fence(&["status"]).code(), 4);

    apply(&w, &policy);
    assert!(!w.tcp_connects(HOST3_V4, 443));
    assert!(!w.tcp_connects(METADATA_V4, 80));

    assert!(w.egress_fence(&["teardown"]).success());
    assert!(w.tcp_connects(HOST3_V4, 443));
    assert!(w.tcp_connects(METADATA_V4, 80));
    let status = w.egress_fence(&["status"]);
    assert_eq!(status.code(), 4, "{status}");
    assert!(status.stdout.contains("not installed"), "{status}");
}

#[test]
fn status_reads_the_live_table_and_counts_refusals() {
    let (w, policy) = world();
    let _unlisted = w.listen_tcp(HOST3_V4, 443);
    let _unlisted6 = w.listen_tcp(HOST3_V6, 443);
    apply(&w, &policy);
    assert!(!w.tcp_connects(HOST3_V4, 443));

    let out = w.egress_fence(&["status", "--json"]);
    assert!(out.success(), "{out}");
    let status: Value = serde_json::from_str(&out.stdout).expect("status --json is JSON");
    assert_eq!(status["installed"], true);
    assert_eq!(status["table"], "inet egress_fence");
    // One refused IPv4 connection (a SYN, and perhaps its retransmission), no IPv6 one.
    let v4 = status["refused"]["ipv4"]["packets"].as_u64().unwrap_or(0);
    assert!((1..=3).contains(&v4), "{status}");
    assert_eq!(status["refused"]["ipv6"]["packets"], 0, "{status}");
    assert!(!w.tcp_connects(HOST3_V6, 443));
    let again: Value = serde_json::from_str(&w.egress_fence(&["status", "--json"]).stdout)
        .expect("status --json is JSON");
    assert!(
        again["refused"]["ipv6"]["packets"].as_u64().unwrap_or(0) >= 1,
        "{again}"
    );
    let set = |name: &str| -> Value {
        status["sets"]
            .as_array()
            .expect("sets")
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("no set {name} in {status}"))["contents"]
            .clone()
    };
    let resolved4 = set("resolved4")["timed"].to_string();
    assert!(
        resolved4.contains("192.0.2.10/32") && resolved4.contains("443"),
        "{resolved4}"
    );
    let allow4 = set("allow4")["tuples"].to_string();
    assert!(allow4.contains("203.0.113.10/32"), "{allow4}");
    let deny4 = set("deny4")["networks"].to_string();
    assert!(deny4.contains("169.254.0.0/16"), "{deny4}");

    let human = w.egress_fence(&["status"]);
    assert!(human.success(), "{human}");
    assert!(
        human.stdout.contains("hook output priority 0 policy drop"),
        "{human}"
    );
    assert!(
        human
            .stdout
            .contains("set resolved6: 2001:db8:1::10 . tcp . 443"),
        "{human}"
    );
}

/// Plans the test policy against the world's resolver from inside the sandbox.
fn planned(w: &World) -> egress_fence::core::ruleset::Ruleset {
    let policy = Policy::parse(POLICY, std::path::Path::new("policy.yaml")).expect("valid");
    let resolution: Resolution = w.in_sandbox_ns(|| {
        let hosts = egress_fence::dns::resolve::resolve_names(policy.domains(), &[DNS_V4])
            .expect("resolver starts");
        Resolution {
            resolvers: vec![DNS_V4],
            hosts,
            guard_uid: None,
            scope: Default::default(),
        }
    });
    plan(&policy, &resolution)
}

#[test]
fn a_refused_transaction_leaves_the_running_table_untouched() {
    let (w, policy) = world();
    apply(&w, &policy);
    let before = normalized_ruleset(w.nft_json());

    // A ruleset the kernel must refuse: two overlapping intervals in the deny set.
    let mut bad = planned(&w);
    let deny4 = bad
        .sets
        .iter_mut()
        .find(|s| s.id == SetId::new(SetRole::Deny, Family::V4))
        .expect("deny4");
    let Elements::Networks(nets) = &mut deny4.elements else {
        panic!("deny4 holds networks")
    };
    nets.push("169.254.169.0/24".parse().expect("network"));
    let err = w
        .in_sandbox_ns(|| Nft::open().and_then(|mut nft| nft.apply(&bad)))
        .expect_err("the kernel refuses overlapping intervals");
    assert!(
        matches!(&err, NftError::Refused { what, .. } if what.contains("set deny4")),
        "{err}"
    );
    assert_eq!(
        normalized_ruleset(w.nft_json()),
        before,
        "a refused batch changed the table"
    );
}

/// A batch of one change: `add` appends it (a set, or the messages of its elements).
fn one_change(add: impl FnOnce(&mut nftnl::Batch), label: &str) -> Encoded {
    let mut batch = nftnl::Batch::new();
    add(&mut batch);
    Encoded::of_pages(batch.finalize(), vec![label.to_string()])
}

const IPV4_ADDR: KeySpec = KeySpec {
    datatype: 7,
    len: 4,
    concat_fields: Vec::new(),
};

/// One element for set `name` of our table: refused (ENOENT) unless that set exists.
fn element_of(name: &CStr) -> Encoded {
    one_change(
        |batch| {
            let mut set = NlSet::new(&encode::table_name(), name, 0, &IPV4_ADDR, 0);
            set.push(&Elem {
                key: vec![192, 0, 2, 1],
                ..Elem::default()
            });
            assert_eq!(set.add_elements_to(batch, ElemOp::Upsert), 1);
        },
        "an element",
    )
}

/// `element_of` a set that does not exist came back refused (ENOENT), not accepted.
fn assert_refused_as_missing(sent: &Result<(), NftError>) {
    assert!(
        matches!(
            sent,
            Err(NftError::Refused {
                errno: Errno::ENOENT,
                ..
            })
        ),
        "a refused element passed for installed: {sent:?}"
    );
}

/// A commit the kernel fails after every change was taken (an anonymous set that no rule
/// binds) is reported against the first change, whose acknowledgement follows the error:
/// `send` must take that too, or the next batch of the same sequence numbers would read it
/// as its own and a refused element would pass for installed.
#[test]
fn a_failed_commit_leaves_nothing_for_the_next_batch_to_read() {
    let (w, policy) = world();
    apply(&w, &policy);
    let (failed, refused, accepted) = w.in_sandbox_ns(|| {
        let mut nft = Nft::open().expect("netlink");
        let unbound = one_change(
            |batch| {
                const ANONYMOUS_CONSTANT: u32 = 0x1 | 0x2;
                let set = NlSet::new(
                    &encode::table_name(),
                    c"__set%d",
                    1,
                    &IPV4_ADDR,
                    ANONYMOUS_CONSTANT,
                );
                batch.add(&set, nftnl::MsgType::Add);
            },
            "an anonymous set no rule binds",
        );
        let failed = nft.send(&unbound);
        let refused = nft.send(&element_of(c"no_such_set"));
        let accepted = nft.upsert_resolved(&[Timed {
            tuple: Tuple {
                net: "198.18.0.7/32".parse().expect("network"),
                proto: L4Proto::Tcp,
                ports: PortRange::single(443),
            },
            timeout_ms: Some(60_000),
            expires_ms: None,
            name: None,
        }]);
        (failed, refused, accepted)
    });
    assert!(
        matches!(&failed, Err(NftError::Refused { errno: Errno::EINVAL, what }) if what.contains("anonymous set")),
        "{failed:?}"
    );
    assert_refused_as_missing(&refused);
    assert!(
        accepted.is_ok(),
        "an accepted element read as refused: {accepted:?}"
    );
    let after = normalized_ruleset(w.nft_json());
    assert!(after.to_string().contains("198.18.0.7"), "{after}");
    assert!(
        !after.to_string().contains("__set"),
        "the failed commit left its set: {after}"
    );
}

/// A read that fails midway (here the receive buffer overflows: a transaction of some 20,000
/// changes is acknowledged 20,000 times) leaves the acknowledgements that fit queued. They
/// are dropped before the next request: every batch is numbered alike, and one left over
/// would make the next batch's refused element pass for installed.
#[test]
fn acknowledgements_a_failed_read_leaves_never_pass_for_the_next_batchs() {
    use egress_fence::core::ruleset::Rule;
    let (w, policy) = world();
    apply(&w, &policy);
    let mut huge = planned(&w);
    huge.output
        .extend(std::iter::repeat_n(Rule::GotoRefused, 20_000));
    let (overflowed, refused, reapplied) = w.in_sandbox_ns(|| {
        let mut nft = Nft::open().expect("netlink");
        let overflowed = nft.apply(&huge);
        let refused = nft.send(&element_of(c"no_such_set"));
        let reapplied = nft.apply(&planned(&w));
        (overflowed, refused, reapplied)
    });
    assert!(
        matches!(
            &overflowed,
            Err(NftError::Io {
                doing: "receive",
                ..
            })
        ),
        "the acknowledgements did not overflow the receive buffer: {overflowed:?}"
    );
    assert_refused_as_missing(&refused);
    assert!(reapplied.is_ok(), "{reapplied:?}");
}

/// A batch the kernel refuses as a whole before its first change (sent by a thread without
/// CAP_NET_ADMIN, as root in a container is: the error names BEGIN, which asks for no
/// acknowledgement) is reported as refused, not waited on, and changes nothing.
#[test]
fn a_batch_refused_before_its_first_change_is_reported_refused() {
    let (w, policy) = world();
    apply(&w, &policy);
    let before = normalized_ruleset(w.nft_json());
    let result = w.in_sandbox_ns(|| {
        // Opened with the capability; the kernel checks the sender's too.
        let mut nft = Nft::open().expect("netlink");
        caps::drop(
            None,
            caps::CapSet::Effective,
            caps::Capability::CAP_NET_ADMIN,
        )
        .expect("drop CAP_NET_ADMIN from this thread");
        let result = nft.send(&element_of(c"resolved4"));
        caps::raise(
            None,
            caps::CapSet::Effective,
            caps::Capability::CAP_NET_ADMIN,
        )
        .expect("raise CAP_NET_ADMIN again");
        // The socket is left clean: the next batch is its own.
        (result, nft.send(&element_of(c"no_such_set")))
    });
    assert!(
        matches!(&result.0, Err(NftError::Refused { errno: Errno::EPERM, what }) if what == "the transaction"),
        "{:?}",
        result.0
    );
    assert!(
        matches!(
            &result.1,
            Err(NftError::Refused {
                errno: Errno::ENOENT,
                ..
            })
        ),
        "{:?}",
        result.1
    );
    assert_eq!(normalized_ruleset(w.nft_json()), before);
}

/// Runs `nft ARGS` in the namespace of the calling thread; panics with nft's message if it
/// fails.
fn nft_here<S: AsRef<std::ffi::OsStr>>(args: &[S]) {
    let out = Command::new("nft").args(args).output().expect("run nft");
    assert!(
        out.status.success(),
        "nft: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The daemon's change monitor is told of every transaction but its own: the kernel drops
/// the notifications of our batches (every element a guard answer installs) before they are
/// queued, and still delivers another process's change to our table, naming it. Without the
/// filter the first read below would see our apply's datagrams (eight of them).
#[test]
fn the_change_monitor_hears_others_transactions_and_never_its_own() {
    use egress_fence::nft::monitor::Monitor;
    let (w, _policy) = world();
    let ruleset = planned(&w);
    let (ours, theirs) = w.in_sandbox_ns(|| {
        let mut monitor = Monitor::open().expect("subscribe to nftables notifications");
        let mut nft = Nft::open().expect("netlink");
        monitor.ignore_port(nft.portid()).expect("filter");
        nft.apply(&ruleset).expect("apply");
        let ours = monitor.drain(nft.portid()).expect("drain");
        nft_here(&["add", "chain", "inet", "egress_fence", "intruder"]);
        let theirs = monitor.drain(nft.portid()).expect("drain");
        (ours, theirs)
    });
    assert_eq!(ours.datagrams, 0, "our own transaction reached the monitor");
    assert!(ours.changes.is_empty() && !ours.overrun);
    assert!(theirs.datagrams >= 1, "{theirs:?}");
    assert!(!theirs.overrun);
    let change = theirs.changes.first().expect("nft's change is reported");
    assert_eq!(change.what, "chain added");
    assert_eq!(change.process.as_deref(), Some("nft"));
}

/// The table is read back in several dumps (table, chains, rules, sets, each set's
/// elements), and a transaction landing between two of them would mix two tables. While
/// another process commits without pause, a chain and an element that come and go together in
/// one transaction are, in every read, both there or both gone; a read that cannot fall
/// within one generation gives up (`Unsettled`) rather than mix.
#[test]
fn reads_while_others_commit_never_mix_two_tables() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (w, policy) = world();
    apply(&w, &policy);
    const MARKER: [u8; 4] = [198, 51, 100, 77];
    let add = w.write_file(
        "add.nft",
        "add chain inet egress_fence hammer\n\
         add element inet egress_fence deny4 { 198.51.100.77 }\n",
    );
    let del = w.write_file(
        "del.nft",
        "delete chain inet egress_fence hammer\n\
         delete element inet egress_fence deny4 { 198.51.100.77 }\n",
    );
    let stop = AtomicBool::new(false);
    let (reads, commits) = w.in_sandbox_ns(|| {
        std::thread::scope(|scope| {
            // Started from this thread, in its namespace, as are the nft processes it runs.
            let hammer = scope.spawn(|| {
                let mut commits = 0;
                for file in [&add, &del].into_iter().cycle() {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    nft_here(&["-f".as_ref(), file.as_os_str()]);
                    commits += 1;
                }
                commits
            });
            let mut nft = Nft::open().expect("netlink");
            let read = |nft: &mut Nft| {
                nft.read_table().map(|table| {
                    let table = table.expect("our table");
                    let chain = table.chains.iter().any(|c| c.name == "hammer");
                    let element = table.sets.iter().any(|(set, elems)| {
                        set.name == "deny4" && elems.iter().any(|e| e.key == MARKER)
                    });
                    (chain, element)
                })
            };
            // 300 reads at least, and on until both states were read (a slow machine).
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            let mut reads: Vec<Result<(bool, bool), NftError>> = Vec::new();
            while reads.len() < 300
                || (!reads.iter().any(|r| matches!(r, Ok((true, true))))
                    && std::time::Instant::now() < deadline)
            {
                reads.push(read(&mut nft));
            }
            stop.store(true, Ordering::Relaxed);
            (reads, hammer.join().expect("the committing thread"))
        })
    });
    // (chain there, element there) -> reads; gave up -> unsettled.
    let mut seen = std::collections::BTreeMap::new();
    let mut unsettled = 0;
    for read in &reads {
        match read {
            Ok(state) => *seen.entry(*state).or_insert(0) += 1,
            Err(NftError::Unsettled(_)) => unsettled += 1,
            Err(e) => panic!("a read failed: {e}"),
        }
    }
    let report = format!("{seen:?}, {unsettled} unsettled, {commits} commits");
    assert!(
        !seen.contains_key(&(true, false)) && !seen.contains_key(&(false, true)),
        "a read mixed two tables: {report}"
    );
    assert!(
        seen.contains_key(&(true, true)) && seen.contains_key(&(false, false)),
        "the reads did not see both states: {report}"
    );
    eprintln!("{report}");
}

#[test]
fn netns_may_be_given_as_a_path() {
    let (w, policy) = world();
    let holder = w.spawn_in_sandbox(&["sleep", "60"]);
    let ns = format!("/proc/{}/ns/net", holder.pid());
    // `ip netns exec` enters the namespace only after it started: until then the holder is
    // still in the machine's own namespace, where nothing may ever be applied. Wait until
    // its namespace is the sandbox's, and refuse to go on otherwise.
    use std::os::unix::fs::MetadataExt;
    let sandbox = std::fs::metadata(w.sandbox_path())
        .expect("stat the sandbox")
        .ino();
    let entered = (0..200).any(|_| {
        let now = std::fs::metadata(&ns).map(|m| m.ino()).ok();
        std::thread::sleep(Duration::from_millis(10));
        now == Some(sandbox)
    });
    assert!(entered, "the holder never entered the sandbox namespace");
    let out = Command::new(EGRESS_FENCE_BIN)
        .args(["apply", path(&policy), "--netns", &ns])
        .env(STATE_DIR_ENV, w.state_dir())
        .output()
        .expect("run egress-fence");
    // The path form has no /etc/netns resolv.conf, but this policy names its resolvers.
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tables = objects_of_table(&w.nft_json(), "egress_fence");
    assert!(!tables.is_empty(), "the table is not in the sandbox");
}

#[test]
fn an_unreachable_resolver_still_installs_the_boundary_and_exits_3() {
    let (w, _) = world();
    let _unlisted = w.listen_tcp(HOST3_V4, 443);
    let _cidr = w.listen_tcp(OTHER_V4, 22);
    // No DNS server answers at 192.0.2.99: every name fails, nothing of them is allowed.
    let text = POLICY.replace("[192.0.2.53, \"2001:db8:1::53\"]", "[192.0.2.99]");
    let policy = w.write_file("dead-dns.yaml", &text);
    let out = w.egress_fence(&["apply", path(&policy)]);
    assert_eq!(out.code(), 3, "{out}");
    assert!(
        out.stderr.contains("api.example.com: NOT RESOLVED"),
        "{out}"
    );
    assert!(!objects_of_table(&w.nft_json(), "egress_fence").is_empty());
    assert!(
        !w.tcp_connects(HOST_V4, 443),
        "a name that never resolved is allowed"
    );
    assert!(!w.tcp_connects(HOST3_V4, 443));
    assert!(w.tcp_connects(OTHER_V4, 22), "the cidr entry needs no DNS");
}

/// A cgroup v2 directory of the test's own, `egress-fence-test-<pid>-<n>` at the root of the
/// hierarchy, with `sub` below it; nothing ever runs in them. Removed on drop, also when the
/// test fails.
struct TestCgroup {
    dir: PathBuf,
    name: String,
}

impl TestCgroup {
    fn new() -> TestCgroup {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let root = egress_fence::host::cgroup2_root().expect("a cgroup v2 hierarchy");
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("egress-fence-test-{}-{n}", std::process::id());
        let dir = root.join(&name);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let cgroup = TestCgroup { dir, name };
        let sub = cgroup.dir.join("sub");
        std::fs::create_dir(&sub).unwrap_or_else(|e| panic!("mkdir {}: {e}", sub.display()));
        cgroup
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        for dir in [self.dir.join("sub"), self.dir.clone()] {
            if let Err(e) = std::fs::remove_dir(&dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                eprintln!("warning: rmdir {}: {e}", dir.display());
            }
        }
    }
}

/// Every kind of scope (CGROUP is replaced by a [`TestCgroup`]'s name), in guard mode.
const SCOPED_POLICY: &str = r#"
version: 1
scope:
  users: [1001]
  groups: [4242]
  cgroups: [CGROUP, CGROUP/sub]
  forward: [docker0, "br-*"]
dns:
  mode: guard
  upstream: [192.0.2.53]
allow:
  - cidr: 203.0.113.10/32
    ports: [22]
"#;

/// The rules of the table as `nft --debug=netlink list` prints what the kernel holds: each
/// with its chain, expressions and user data (where nft keeps a comment), without handles.
fn netlink_rules(w: &World) -> Vec<String> {
    let out = w.sandbox_cmd(&[
        "nft",
        "--debug=netlink",
        "list",
        "table",
        "inet",
        "egress_fence",
    ]);
    assert!(out.success(), "nft --debug=netlink list: {out}");
    let mut rules: Vec<String> = Vec::new();
    for line in out.stdout.lines() {
        if let Some(rest) = line.strip_prefix("inet egress_fence ") {
            let chain = rest.split_whitespace().next().unwrap_or_default();
            if !chain.starts_with('@') {
                rules.push(format!("{chain}:"));
            }
        } else if (line.starts_with("  [") || line.starts_with("  userdata"))
            && let Some(rule) = rules.last_mut()
        {
            rule.push(' ');
            rule.push_str(line.trim());
        }
    }
    rules
}

/// The rules of chain `name` in nft text (its hook line left out).
fn chain_lines<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    let head = format!("chain {name} {{");
    text.lines()
        .skip_while(|l| l.trim() != head)
        .skip(1)
        .take_while(|l| l.trim() != "}")
        .map(str::trim)
        .filter(|l| !l.starts_with("type filter hook"))
        .collect()
}

/// Without a scope the fence is on the hook, and in guard mode it enters the guard's
/// protections the way a scoped table does: through the jumps, before the replies' accept (a
/// squatter's answers and a stranger's packets over the guard's old flows are established
/// too), so that an established packet walks three rules, not eight.
#[test]
fn an_unscoped_guard_table_enters_the_guards_chain_and_reads_back_clean() {
    let w = World::new();
    let policy = w.write_file(
        "guarded.yaml",
        "version: 1\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\nallow:\n  \
         - cidr: 203.0.113.10/32\n    ports: [22]\n",
    );
    let plan = w.egress_fence(&["plan", path(&policy)]);
    assert!(plan.success(), "{plan}");
    let output = chain_lines(&plan.stdout, "output");
    let at = |shape: &str| {
        output
            .iter()
            .position(|l| l.contains(shape))
            .unwrap_or_else(|| panic!("output lacks `{shape}`: {output:#?}"))
    };
    let established = at("ct state established,related accept");
    for gate in [
        "th sport 53 jump guard",
        "ip daddr . meta l4proto . th dport @dns4 jump guard",
        "ip6 daddr . meta l4proto . th dport @dns6 jump guard",
    ] {
        assert!(at(gate) < established, "{output:#?}");
    }
    // What an established packet walks first: source routes, ICMP of processes, the jumps,
    // and what a process writes to this host from a source not its own (one interface
    // compare for a packet that does not go to loopback).
    assert_eq!(established, 8, "{output:#?}");
    assert_eq!(
        output[7], "oif \"lo\" meta skuid >= 0 fib saddr type != local goto refused",
        "{output:#?}"
    );
    assert!(
        !output.iter().any(|l| l.contains("meta mark !=")),
        "{output:#?}"
    );
    let guard = chain_lines(&plan.stdout, "guard");
    assert_eq!(guard.len(), 8, "{guard:#?}");
    assert!(
        guard.iter().all(|l| l.ends_with("goto refused")),
        "{guard:#?}"
    );
    assert!(
        guard
            .iter()
            .any(|l| l.starts_with("ip saddr 127.0.0.53 udp sport 53 meta mark != ")),
        "{guard:#?}"
    );

    let apply = w.egress_fence(&["apply", path(&policy)]);
    assert!(apply.success(), "{apply}");
    let diff = w.egress_fence(&["diff", path(&policy)]);
    assert_eq!(diff.code(), 0, "it reads back as applied: {diff}");
    let status = w.egress_fence(&["status"]);
    assert!(
        status.success() && status.stdout.contains("in sync with generation 1"),
        "{status}"
    );
    let ours = (netlink_rules(&w), normalized_ruleset(w.nft_json()));
    assert!(w.egress_fence(&["teardown"]).success());
    let load = w.nft_text_in(w.sandbox_name(), &plan.stdout);
    assert!(load.success(), "nft -f: {load}");
    let theirs = (netlink_rules(&w), normalized_ruleset(w.nft_json()));
    assert_eq!(theirs.0, ours.0, "nft sends the expressions we send");
    assert_eq!(theirs.1, ours.1);
    let diff = w.egress_fence(&["diff", path(&policy)]);
    assert_eq!(
        diff.code(),
        0,
        "nft's own table reads back as the plan: {diff}"
    );
}

#[test]
fn a_scoped_table_is_what_nft_loads_from_the_plan_and_reads_back_clean() {
    let w = World::new();
    let cgroup = TestCgroup::new();
    // A "bridge" with an address in the sandbox (veth: this kernel has no bridge or dummy
    // driver to count on): the guard listens there too, and its queries are accepted there.
    let bridge = w.sandbox_cmd(&[
        "sh",
        "-c",
        "ip link add docker0 type veth peer name ef-peer0 && \
         ip addr add 198.18.0.1/24 dev docker0 && ip link set docker0 up",
    ]);
    assert!(bridge.success(), "{bridge}");
    let policy = w.write_file(
        "scoped.yaml",
        &SCOPED_POLICY.replace("CGROUP", &cgroup.name),
    );

    let plan = w.egress_fence(&["plan", path(&policy)]);
    assert!(plan.success(), "{plan}");
    // The plan names a cgroup as nft finds it below /sys/fs/cgroup (`unified/` in front on a
    // hybrid host).
    let root = egress_fence::host::cgroup2_root().expect("a cgroup v2 hierarchy");
    let below = root
        .strip_prefix("/sys/fs/cgroup")
        .expect("mounted below /sys/fs/cgroup")
        .to_string_lossy()
        .into_owned();
    let name = &match below.as_str() {
        "" => cgroup.name.clone(),
        below => format!("{below}/{}", cgroup.name),
    };
    for shape in [
        "meta skuid 1001 goto output".to_string(),
        "meta skgid 4242 goto output".to_string(),
        format!("socket cgroupv2 level 1 \"{name}\" goto output comment \"{name}\""),
        format!("socket cgroupv2 level 2 \"{name}/sub\" goto output comment \"{name}/sub\""),
        "iifname \"docker0\" goto output".to_string(),
        "iifname \"br-*\" goto output".to_string(),
        "iifname \"br-*\" goto from_bridge".to_string(),
        "type filter hook prerouting priority raw; policy accept;".to_string(),
        "iifname \"docker0\" fib saddr . iif oif missing drop".to_string(),
        "iifname \"br-*\" fib saddr . iif oif missing drop".to_string(),
        "icmpv6 type nd-neighbor-solicit goto refused".to_string(),
        "icmpv6 type mld-listener-report goto refused".to_string(),
        "meta l4proto igmp goto output".to_string(),
        "icmpv6 type mld-listener-done goto output".to_string(),
        "ip daddr 127.0.0.53 udp dport 53 socket mark != 0x65000000 goto refused".to_string(),
        "ip daddr 198.18.0.1 tcp dport 53 socket mark != 0x65000000 goto refused".to_string(),
        "ip daddr 198.18.0.1 udp dport 53 accept".to_string(),
        "ip daddr 127.0.0.53 tcp dport 53 accept".to_string(),
        // The guard's protections in a chain of their own, entered only by what they concern.
        "chain guard {".to_string(),
        "ip saddr 198.18.0.1 udp sport 53 meta mark != ".to_string(),
        "th sport 53 jump guard".to_string(),
        "ip daddr . meta l4proto . th dport @dns4 jump guard".to_string(),
        "ip6 daddr . meta l4proto . th dport @dns6 jump guard".to_string(),
    ] {
        assert!(
            plan.stdout.contains(&shape),
            "the plan lacks `{shape}`: {plan}"
        );
    }

    let apply = w.egress_fence(&["apply", path(&policy)]);
    assert!(apply.success(), "{apply}");
    let diff = w.egress_fence(&["diff", path(&policy)]);
    assert_eq!(
        diff.code(),
        0,
        "a scoped table reads back as applied: {diff}"
    );
    // The generation it recorded is what its policy plans, scope chains included.
    let status = w.egress_fence(&["status"]);
    assert!(
        status.success() && status.stdout.contains("in sync with generation 1"),
        "{status}"
    );
    let ours = (netlink_rules(&w), normalized_ruleset(w.nft_json()));
    assert!(
        ours.0.iter().any(|r| r.starts_with("scope_output:")
            && r.contains("socket load cgroupv2")
            && r.contains("userdata = { \\x00")
            && r.ends_with(&format!("{name}/sub\\x00 }}"))),
        "{:#?}",
        ours.0
    );

    // nft loads the plan's text as it is, entered into the network namespace only (`ip netns
    // exec` would give it a fresh /sys, without the cgroup hierarchy).
    assert!(w.egress_fence(&["teardown"]).success());
    let load = w.nft_text_in(w.sandbox_name(), &plan.stdout);
    assert!(load.success(), "nft -f: {load}");
    let theirs = (netlink_rules(&w), normalized_ruleset(w.nft_json()));
    assert_eq!(
        theirs.0, ours.0,
        "nft sends the expressions and comments we send"
    );
    assert_eq!(theirs.1, ours.1);
    let diff = w.egress_fence(&["diff", path(&policy)]);
    assert_eq!(
        diff.code(),
        0,
        "nft's own table reads back as the plan: {diff}"
    );

    // A scope chain that drops what the scope does not name is drift.
    let drop = w.sandbox_cmd(&[
        "nft",
        "add",
        "chain",
        "inet",
        "egress_fence",
        "scope_output",
        "{ type filter hook output priority filter; policy drop; }",
    ]);
    assert!(drop.success(), "{drop}");
    let diff = w.egress_fence(&["diff", path(&policy)]);
    assert_eq!(diff.code(), 1, "{diff}");
    assert!(diff.stdout.contains("chain scope_output"), "{diff}");
}

#[test]
fn an_included_preset_lets_its_names_through_and_loses_to_a_deny_entry() {
    let w = World::new();
    // registry.npmjs.org (preset `npm`) answers with two hosts; the policy denies one of them.
    w.dns_set("registry.npmjs.org", &[HOST_V4, OTHER_V4], DEFAULT_DNS_TTL);
    let denied = w.listen_tcp(HOST_V4, 443);
    let _allowed = w.listen_tcp(OTHER_V4, 443);
    let _other_port = w.listen_tcp(OTHER_V4, 80);
    assert!(w.tcp_connects(HOST_V4, 443), "before the fence");
    assert!(denied.wait_for(1, Duration::from_secs(5)));
    let policy = w.write_file(
        "include.yaml",
        "version: 1\ninclude: [npm]\ndeny:\n  - cidr: 192.0.2.10/32\ndns:\n  resolvers: [192.0.2.53]\n",
    );
    let out = w.egress_fence(&["apply", path(&policy)]);
    assert!(out.success(), "apply: {out}");

    // The preset's name, on the preset's port: through; its other port: refused.
    assert!(w.tcp_connects(OTHER_V4, 443), "the preset's name on 443");
    assert!(!w.tcp_connects(OTHER_V4, 80), "the preset lists 443 only");
    // The denied address the preset's name resolved to: refused, and nothing reached it.
    let before = denied.count();
    assert!(!w.tcp_connects(HOST_V4, 443), "deny lost to an include");
    assert_eq!(denied.count(), before);
    let table = w.sandbox_cmd(&["nft", "list", "table", "inet", "egress_fence"]);
    assert!(table.stdout.contains("203.0.113.10"), "{table}");
}
