//! `learn` and `run --record` (issue 13, the runtime side): the fence in audit mode for a
//! bounded time, the trace it writes, and the table it leaves behind; `action: audit` outside
//! `learn`; the audit window's encoding against `nft` as an independent reader.
//!
//! The escape test (SIGKILL `learn`, the window closes by itself) is in tests/escape/learn.rs.

mod common;

use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use egress_fence::core::trace::{Record, Trace};

/// The port the start policy opens for its one name.
const PORT: u16 = 8080;
/// A port it opens for nothing.
const OTHER_PORT: u16 = 9090;

/// A guard-mode start policy that allows `a.learn.example` on TCP [`PORT`] only; `action`
/// as given.
fn start_policy(action: &str) -> String {
    format!(
        "version: 1\naction: {action}\nallow:\n  - domain: a.learn.example\n    ports: [{PORT}]\n\
         deny:\n  - preset: cloud-metadata\ndns:\n  mode: guard\n  listen: [\"{GUARD_ADDR}\"]\n  \
         upstream: [{DNS_V4}]\nlog:\n  group: 100\n  rate: 1000/second\n  burst: 1000\n"
    )
}

/// The names of the world: three the client uses, a fourth it does not.
fn names(w: &World) {
    w.dns_set("a.learn.example", &[HOST_V4], 60);
    w.dns_set("b.learn.example", &[HOST2_V4], 60);
    w.dns_set("c.learn.example", &[HOST3_V4], 60);
    w.dns_set("d.learn.example", &[OTHER2_V4], 60);
}

/// `learn POLICY ARGS... --trace TRACE`, once its guard serves.
fn spawn_learn(w: &World, policy: &Path, trace: &Path, args: &[&str]) -> Background {
    w.use_guard_resolver();
    let mut all = vec!["learn", path_arg(policy), "--trace", path_arg(trace)];
    all.extend_from_slice(args);
    let mut learn = w.spawn_egress_fence(&all);
    if !learn.wait_for_output("the DNS guard is serving", Duration::from_secs(15)) {
        let _ = learn.terminate();
        panic!("learn did not start:\n{}", learn.stderr());
    }
    learn
}

fn table_text(w: &World) -> String {
    let out = w.sandbox_cmd(&["nft", "list", "table", "inet", "egress_fence"]);
    assert!(out.success(), "{out}");
    out.stdout
}

fn read_trace(path: &Path) -> Trace {
    let text = std::fs::read_to_string(path).expect("the trace exists");
    Trace::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

fn names_in(trace: &Trace) -> Vec<(String, String, Vec<IpAddr>)> {
    trace
        .records
        .iter()
        .filter_map(|r| match r {
            Record::Name {
                name,
                answer,
                addrs,
                ..
            } => Some((name.clone(), answer.clone(), addrs.clone())),
            _ => None,
        })
        .collect()
}

fn flows_in(trace: &Trace) -> Vec<(IpAddr, Option<u16>, String, Option<u32>)> {
    trace
        .records
        .iter()
        .filter_map(|r| match r {
            Record::Flow {
                dst,
                dport,
                protocol,
                uid,
                ..
            } => Some((*dst, *dport, protocol.clone(), *uid)),
            _ => None,
        })
        .collect()
}

#[test]
fn learn_lets_through_and_records_what_the_policy_refuses_then_enforces_it_again() {
    let w = World::new();
    names(&w);
    let _listeners = [
        w.listen_tcp(HOST_V4, PORT),
        w.listen_tcp(HOST2_V4, PORT),
        w.listen_tcp(HOST3_V4, OTHER_PORT),
        w.listen_tcp(OTHER_V4, OTHER_PORT),
        w.listen_tcp(METADATA_V4, 80),
    ];
    let policy = w.write_file("start.yaml", &start_policy("reject"));
    let trace_path = w.dir().join("trace.jsonl");
    let out = w.dir().join("learned.yaml");
    let mut learn = spawn_learn(
        &w,
        &policy,
        &trace_path,
        &["--duration", "10m", "--out", path_arg(&out)],
    );
    assert!(
        learn.stderr().contains("AUDIT MODE for 10m"),
        "learn says it audits: {}",
        learn.stderr()
    );

    // The table says what it does, and the window is open.
    let table = table_text(&w);
    assert!(table.contains("set audit_window"), "{table}");
    assert!(
        table.contains("meta nfproto @audit_window log prefix \"EGRESS-AUDIT: \" group 100 accept comment \"audit:"),
        "{table}"
    );
    assert!(
        table.contains("ct state new log prefix \"EGRESS-FLOW: \""),
        "{table}"
    );

    // A name the policy does not allow is forwarded, and its address let through (audited).
    let b = w.dig(Some(GUARD_V4), "b.learn.example", "A", false);
    assert_eq!(b.addrs(), vec![HOST2_V4], "{b:?}");
    assert!(w.tcp_connects(HOST2_V4, PORT), "an audited name");
    let c = w.dig_as(Some(NOBODY), Some(GUARD_V4), "c.learn.example", "A", &[]);
    assert_eq!(c.addrs(), vec![HOST3_V4], "{c:?}");
    let as_nobody = w.sandbox_cmd_as(
        NOBODY,
        &[
            "nc",
            "-z",
            "-w",
            "2",
            &HOST3_V4.to_string(),
            &OTHER_PORT.to_string(),
        ],
    );
    assert!(
        as_nobody.success(),
        "an audited port, as another uid: {as_nobody}"
    );
    // The allowed name behaves as always.
    let a = w.dig(Some(GUARD_V4), "a.learn.example", "A", false);
    assert_eq!(a.addrs(), vec![HOST_V4], "{a:?}");
    assert!(w.tcp_connects(HOST_V4, PORT));
    // A bare address, audited.
    assert!(
        w.tcp_connects(OTHER_V4, OTHER_PORT),
        "a bare address, audited"
    );
    // Deny wins even while auditing.
    assert!(
        !w.tcp_connects(METADATA_V4, 80),
        "the deny list holds under audit"
    );

    // SIGTERM ends it: the window closes, the table is the policy's, the trace is whole.
    let status = learn.terminate();
    assert_eq!(status.code(), Some(0), "{}", learn.stderr());
    let table = table_text(&w);
    assert!(!table.contains("audit"), "{table}");
    assert!(!table.contains("EGRESS-FLOW"), "{table}");
    assert!(!w.tcp_connects(OTHER_V4, OTHER_PORT), "refused again");
    assert!(!w.tcp_connects(HOST2_V4, PORT), "refused again");
    let status = w.egress_fence(&["status"]);
    assert!(!status.stdout.contains("AUDIT"), "{status}");
    assert!(
        status.stdout.contains("in sync with generation 2"),
        "{status}"
    );
    let history = w.egress_fence(&["history"]);
    assert!(
        history.success(),
        "every generation reads as valid: {history}"
    );
    let diff = w.egress_fence(&["diff", path_arg(&policy)]);
    assert!(
        !diff.stdout.contains("audit") && !diff.stdout.contains("EGRESS-FLOW"),
        "the table is the start policy's: {diff}"
    );
    assert!(
        learn.stderr().contains("the table enforces"),
        "{}",
        learn.stderr()
    );
    assert!(out.exists(), "the learned policy was written");

    let trace = read_trace(&trace_path);
    let mode = std::fs::metadata(&trace_path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the trace names hosts and uids");
    assert!(
        matches!(&trace.records[0], Record::Start { audit: true, mode, .. } if mode == "guard"),
        "{:?}",
        trace.records[0]
    );
    assert!(matches!(trace.records.last(), Some(Record::End { .. })));
    let names = names_in(&trace);
    for (name, addr) in [
        ("a.learn.example", HOST_V4),
        ("b.learn.example", HOST2_V4),
        ("c.learn.example", HOST3_V4),
    ] {
        assert!(
            names
                .iter()
                .any(|(n, answer, addrs)| n == name && answer == "NOERROR" && addrs == &[addr]),
            "{name}: {names:?}"
        );
    }
    let asked_by = |name: &str| {
        trace.records.iter().find_map(|r| match r {
            Record::Name { name: n, uid, .. } if n == name => Some(*uid),
            _ => None,
        })
    };
    assert_eq!(asked_by("c.learn.example"), Some(Some(NOBODY)), "who asked");
    let flows = flows_in(&trace);
    let has = |dst: IpAddr, port: u16, uid: Option<u32>| {
        flows.iter().any(|(d, p, proto, u)| {
            *d == dst && *p == Some(port) && proto == "tcp" && (uid.is_none() || *u == uid)
        })
    };
    assert!(has(HOST2_V4, PORT, Some(0)), "{flows:?}");
    assert!(
        has(HOST3_V4, OTHER_PORT, Some(NOBODY)),
        "with its uid: {flows:?}"
    );
    assert!(has(OTHER_V4, OTHER_PORT, None), "{flows:?}");
    assert!(has(HOST_V4, PORT, None), "allowed flows too: {flows:?}");
    assert!(
        !flows.iter().any(|(d, ..)| *d == DNS_V4),
        "the guard's own upstream queries are not the host's traffic: {flows:?}"
    );
}

#[test]
fn the_duration_ends_learn_by_itself() {
    let w = World::new();
    names(&w);
    let _listener = w.listen_tcp(OTHER_V4, OTHER_PORT);
    let policy = w.write_file("start.yaml", &start_policy("audit"));
    let trace_path = w.dir().join("trace.jsonl");
    let mut learn = spawn_learn(&w, &policy, &trace_path, &["--duration", "4s"]);
    assert!(
        w.tcp_connects(OTHER_V4, OTHER_PORT),
        "audited while it runs"
    );
    let status = learn
        .wait_timeout(Duration::from_secs(20))
        .expect("learn ends after its duration");
    assert_eq!(status.code(), Some(0), "{}", learn.stderr());
    assert!(
        learn.stdout().starts_with("version: 1"),
        "the learned policy goes to stdout without --out: {}",
        learn.stdout()
    );
    assert!(!table_text(&w).contains("audit_window"));
    // `action: audit` is reject once the window is gone.
    let refused = w.tcp_connect(OTHER_V4, OTHER_PORT, 2);
    assert!(!refused.success(), "{refused}");
    assert!(
        matches!(
            read_trace(&trace_path).records.last(),
            Some(Record::End { .. })
        ),
        "a whole trace"
    );
}

/// Whoever can write in the directory of the trace (an agent's project directory, where
/// learn was started) may rename it during the run and put a file of its own in its place:
/// learn reads back what it wrote, through the file it wrote, not what the path names then.
#[test]
fn learn_reads_back_its_own_trace_not_what_its_path_names_at_the_end() {
    let w = World::new();
    names(&w);
    let _listener = w.listen_tcp(OTHER_V4, OTHER_PORT);
    let policy = w.write_file("start.yaml", &start_policy("reject"));
    let trace_path = w.dir().join("trace.jsonl");
    let mut learn = spawn_learn(&w, &policy, &trace_path, &["--duration", "4s"]);
    let moved = w.dir().join("moved.jsonl");
    std::fs::rename(&trace_path, &moved).unwrap();
    std::fs::write(
        &trace_path,
        "{\"kind\":\"start\",\"time\":\"t\",\"version\":1,\"mode\":\"guard\",\"policy\":\"p\"}\n\
         {\"kind\":\"flow\",\"time\":\"t\",\"family\":\"ipv4\",\"protocol\":\"tcp\",\
         \"dst\":\"203.0.113.66\",\"dport\":4444}\n",
    )
    .unwrap();
    assert!(w.tcp_connects(OTHER_V4, OTHER_PORT), "audited");
    let status = learn
        .wait_timeout(Duration::from_secs(20))
        .expect("learn ends after its duration");
    assert_eq!(status.code(), Some(0), "{}", learn.stderr());
    let learned = learn.stdout();
    assert!(
        learned.contains(&format!("- cidr: \"{OTHER_V4}/32\"")),
        "what was used: {learned}"
    );
    assert!(!learned.contains("203.0.113.66"), "{learned}");
    assert!(matches!(
        read_trace(&moved).records.last(),
        Some(Record::End { .. })
    ));
}

#[test]
fn action_audit_is_learns_alone_and_learn_needs_a_duration_and_the_guard() {
    let w = World::new();
    let audit = w.write_file("audit.yaml", &start_policy("audit"));

    let check = std::process::Command::new(EGRESS_FENCE_BIN)
        .args(["check", path_arg(&audit)])
        .output()
        .expect("check runs");
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert_eq!(check.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("`action: audit` lets everything out"),
        "{stderr}"
    );

    for command in ["apply", "run"] {
        let out = w.egress_fence(&[command, path_arg(&audit)]);
        assert_eq!(out.code(), 2, "{command}: {out}");
        assert!(
            out.stderr.contains(":2:9:") && out.stderr.contains("egress-fence learn"),
            "{command} points to learn, at the line: {out}"
        );
    }
    // run left the namespace closed (it could not put up the policy's table).
    let table = table_text(&w);
    assert!(!table.contains("audit"), "{table}");

    let no_duration = w.egress_fence(&["learn", path_arg(&audit)]);
    assert_eq!(no_duration.code(), 2, "{no_duration}");
    assert!(
        no_duration.stderr.contains("--duration") && no_duration.stderr.contains("--until-stopped"),
        "{no_duration}"
    );

    let resolve = w.write_file(
        "resolve.yaml",
        &format!("version: 1\ndns:\n  mode: resolve\n  resolvers: [{DNS_V4}]\n"),
    );
    let out = w.egress_fence(&["learn", path_arg(&resolve), "--duration", "1m"]);
    assert_eq!(out.code(), 2, "{out}");
    assert!(out.stderr.contains("needs `dns.mode: guard`"), "{out}");

    let same = w.egress_fence(&[
        "learn",
        path_arg(&audit),
        "--duration",
        "1m",
        "--out",
        path_arg(&audit),
    ]);
    assert_eq!(same.code(), 2, "{same}");
    assert!(same.stderr.contains("never overwrites"), "{same}");
    assert!(
        std::fs::read_to_string(&audit).unwrap() == start_policy("audit"),
        "the start policy is untouched"
    );

    // A file another user made where learn writes (an agent that can write in that
    // directory, holding it open) is refused before anything runs: its owner could read the
    // trace, write records into it, or edit the learned policy before it is reviewed.
    let theirs = w.dir().join("theirs");
    std::fs::write(&theirs, "").unwrap();
    std::os::unix::fs::chown(&theirs, Some(NOBODY), None).unwrap();
    let link = w.dir().join("link.yaml");
    std::os::unix::fs::symlink(w.dir().join("elsewhere.yaml"), &link).unwrap();
    for (flag, path, code, said) in [
        ("--out", &theirs, 2, format!("belongs to uid {NOBODY}")),
        ("--trace", &theirs, 1, format!("belongs to uid {NOBODY}")),
        ("--out", &link, 2, "symbolic link".to_string()),
    ] {
        let out = w.egress_fence(&[
            "learn",
            path_arg(&audit),
            "--duration",
            "1m",
            flag,
            path_arg(path),
        ]);
        assert_eq!(out.code(), code, "{flag} {}: {out}", path.display());
        assert!(out.stderr.contains(&said), "{out}");
        assert!(!table_text(&w).contains("audit"), "nothing ran");
    }
    assert_eq!(std::fs::read_to_string(&theirs).unwrap(), "", "untouched");
    assert!(!w.dir().join("elsewhere.yaml").exists());
}

#[test]
fn run_record_appends_a_trace_while_enforcing() {
    let w = World::new();
    names(&w);
    let _listeners = [
        w.listen_tcp(HOST_V4, PORT),
        w.listen_tcp(OTHER_V4, OTHER_PORT),
    ];
    let policy = w.write_file("start.yaml", &start_policy("reject"));
    let trace_path = w.dir().join("run.jsonl");
    std::fs::write(&trace_path, "").unwrap();
    std::fs::set_permissions(&trace_path, std::fs::Permissions::from_mode(0o644)).unwrap();
    w.use_guard_resolver();
    let mut run =
        w.spawn_egress_fence(&["run", path_arg(&policy), "--record", path_arg(&trace_path)]);
    assert!(
        run.wait_for_output("the DNS guard is serving", Duration::from_secs(15)),
        "{}",
        run.stderr()
    );
    assert!(!table_text(&w).contains("audit"), "run --record enforces");
    let a = w.dig(Some(GUARD_V4), "a.learn.example", "A", false);
    assert_eq!(a.addrs(), vec![HOST_V4]);
    assert!(w.tcp_connects(HOST_V4, PORT));
    let b = w.dig(Some(GUARD_V4), "b.learn.example", "A", false);
    assert!(b.addrs().is_empty(), "refused: {b:?}");
    assert!(
        !w.tcp_connects(OTHER_V4, OTHER_PORT),
        "refused, and recorded"
    );
    assert_eq!(run.terminate().code(), Some(0), "{}", run.stderr());

    let trace = read_trace(&trace_path);
    let mode = std::fs::metadata(&trace_path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "made private");
    assert!(matches!(
        &trace.records[0],
        Record::Start { audit: false, .. }
    ));
    let names = names_in(&trace);
    assert!(
        names
            .iter()
            .any(|(n, a, _)| n == "a.learn.example" && a == "NOERROR"),
        "{names:?}"
    );
    assert!(
        names
            .iter()
            .any(|(n, a, _)| n == "b.learn.example" && a == "REFUSED"),
        "{names:?}"
    );
    let flows = flows_in(&trace);
    assert!(
        flows
            .iter()
            .any(|(d, p, ..)| *d == HOST_V4 && *p == Some(PORT)),
        "{flows:?}"
    );
    assert!(
        flows
            .iter()
            .any(|(d, p, ..)| *d == OTHER_V4 && *p == Some(OTHER_PORT)),
        "refused flows are recorded too: {flows:?}"
    );
    // A second run appends.
    let before = trace.records.len();
    let mut again =
        w.spawn_egress_fence(&["run", path_arg(&policy), "--record", path_arg(&trace_path)]);
    assert!(again.wait_for_output("the DNS guard is serving", Duration::from_secs(15)));
    assert_eq!(again.terminate().code(), Some(0));
    assert!(read_trace(&trace_path).records.len() >= before + 2);

    // Never through a symbolic link.
    let link = w.dir().join("link.jsonl");
    std::os::unix::fs::symlink(w.dir().join("elsewhere"), &link).unwrap();
    let out = w.egress_fence(&["run", path_arg(&policy), "--record", path_arg(&link)]);
    assert_eq!(out.code(), 1, "{out}");
    assert!(out.stderr.contains("symbolic link"), "{out}");
    assert!(!w.dir().join("elsewhere").exists());
}

/// The learned policy, applied, lets exactly what was used through (three names on two ports
/// and a bare address) and refuses a fourth name; 30 sibling names fold into one wildcard.
#[test]
fn the_learned_policy_allows_exactly_what_was_used() {
    let w = World::new();
    names(&w);
    for i in 0..30 {
        w.dns_set(&format!("n{i}.pool.learn.example"), &[HOST_V4], 60);
    }
    let _listeners = [
        w.listen_tcp(HOST_V4, PORT),
        w.listen_tcp(HOST_V4, OTHER_PORT),
        w.listen_tcp(HOST2_V4, PORT),
        w.listen_tcp(HOST3_V4, OTHER_PORT),
        w.listen_tcp(OTHER_V4, OTHER_PORT),
        w.listen_tcp(OTHER2_V4, PORT),
    ];
    let policy = w.write_file("start.yaml", &start_policy("reject"));
    let trace_path = w.dir().join("trace.jsonl");
    let out: PathBuf = w.dir().join("learned.yaml");
    let mut learn = spawn_learn(
        &w,
        &policy,
        &trace_path,
        &["--until-stopped", "--out", path_arg(&out)],
    );
    for name in ["a.learn.example", "b.learn.example"] {
        w.dig(Some(GUARD_V4), name, "A", false);
    }
    assert!(w.tcp_connects(HOST_V4, PORT) && w.tcp_connects(HOST2_V4, PORT));
    w.dig(Some(GUARD_V4), "c.learn.example", "A", false);
    assert!(w.tcp_connects(HOST3_V4, OTHER_PORT));
    assert!(w.tcp_connects(OTHER_V4, OTHER_PORT));
    // Thirty siblings, each used once (they share an address: each flow is the name that
    // answered it last).
    for i in 0..30 {
        let name = format!("n{i}.pool.learn.example");
        w.dig(Some(GUARD_V4), &name, "A", false);
        assert!(w.tcp_connects(HOST_V4, OTHER_PORT), "{name}");
    }
    assert_eq!(learn.terminate().code(), Some(0), "{}", learn.stderr());
    let learned = std::fs::read_to_string(&out).unwrap();
    assert!(learned.contains("*.pool.learn.example"), "{learned}");
    assert!(
        learn.stderr().contains("30"),
        "the fold says its count: {}",
        learn.stderr()
    );

    let mut run = w.spawn_guard(path_arg(&out));
    let d = w.dig(Some(GUARD_V4), "d.learn.example", "A", false);
    assert!(d.addrs().is_empty(), "a fourth name is refused: {d:?}");
    for (name, addr, port) in [
        ("a.learn.example", HOST_V4, PORT),
        ("b.learn.example", HOST2_V4, PORT),
        ("c.learn.example", HOST3_V4, OTHER_PORT),
    ] {
        assert_eq!(w.dig(Some(GUARD_V4), name, "A", false).addrs(), vec![addr]);
        assert!(w.tcp_connects(addr, port), "{name}");
    }
    assert!(w.tcp_connects(OTHER_V4, OTHER_PORT), "the bare address");
    assert!(!w.tcp_connects(HOST3_V4, PORT), "only the ports used");
    run.terminate();

    // The recorded trace as a review gate: the learned policy would have refused nothing of
    // it; the same policy without b.learn.example would have refused that name (exit 1).
    assert_eq!(replay(&trace_path, &out).status.code(), Some(0));
    let without_b = learned.replace(
        "- domain: \"b.learn.example\"",
        "- domain: \"z.learn.example\"",
    );
    assert_ne!(without_b, learned, "{learned}");
    let candidate = w.write_file("without-b.yaml", &without_b);
    let report = replay(&trace_path, &candidate);
    let stdout = String::from_utf8_lossy(&report.stdout);
    assert_eq!(report.status.code(), Some(1), "{stdout}");
    let refused: Vec<_> = stdout
        .lines()
        .filter(|l| l.contains(".learn.example"))
        .collect();
    assert!(
        refused.iter().any(|l| l.contains("b.learn.example")),
        "{stdout}"
    );
    assert!(
        !refused
            .iter()
            .any(|l| l.contains("a.learn.example") || l.contains("c.learn.example")),
        "only the missing name: {stdout}"
    );
}

/// `egress-fence replay TRACE POLICY` (no namespace: it touches neither network nor kernel).
fn replay(trace: &Path, policy: &Path) -> std::process::Output {
    std::process::Command::new(EGRESS_FENCE_BIN)
        .args(["replay", path_arg(trace), path_arg(policy)])
        .output()
        .expect("replay runs")
}

/// `nft -j` output with the elements' `expires` left out (it counts down between reads).
fn without_expiry(mut v: serde_json::Value) -> serde_json::Value {
    fn walk(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(map) => {
                map.remove("expires");
                map.values_mut().for_each(walk);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    normalized_ruleset(v)
}

#[test]
fn the_audited_table_is_what_nft_loads_from_its_text_and_reads_back_as_planned() {
    use egress_fence::core::diff::{CompareOptions, compare};
    use egress_fence::core::plan::{Extras, plan, with_extras};
    use egress_fence::core::policy::Policy;
    use egress_fence::core::resolution::Resolution;
    use egress_fence::nft::Nft;

    let w = World::new();
    let policy = Policy::parse(&start_policy("audit"), Path::new("p.yaml")).expect("valid");
    let resolution = Resolution {
        resolvers: vec![DNS_V4],
        hosts: Vec::new(),
        guard_uid: Some(0),
        scope: Default::default(),
    };
    let ruleset = with_extras(
        plan(&policy, &resolution),
        &Extras::of_run(&policy, true, true),
    );
    let text = ruleset.to_nft();
    assert!(text.contains("set audit_window {"), "{text}");
    let check = w.sandbox_cmd_with_input(&["nft", "-c", "-f", "-"], text.as_bytes());
    assert!(check.success(), "nft -c -f: {check}\n{text}");

    let read_back = || {
        w.in_sandbox_ns(|| {
            let mut nft = Nft::open().expect("netlink");
            nft.read_table().expect("read back")
        })
    };
    w.in_sandbox_ns(|| Nft::open().expect("netlink").apply(&ruleset))
        .expect("the kernel takes the audited table");
    let ours = without_expiry(w.nft_json());
    let diff = compare(&ruleset, read_back().as_ref(), CompareOptions::default());
    assert!(diff.is_empty(), "our table reads back as planned: {diff}");

    assert!(w.egress_fence(&["teardown"]).success());
    let load = w.sandbox_cmd_with_input(&["nft", "-f", "-"], text.as_bytes());
    assert!(load.success(), "nft -f: {load}");
    assert_eq!(
        without_expiry(w.nft_json()),
        ours,
        "nft loads what we install"
    );
    let diff = compare(&ruleset, read_back().as_ref(), CompareOptions::default());
    assert!(
        diff.is_empty(),
        "nft's table reads back as the plan: {diff}"
    );

    // Without the window's set, or with another rule in its place, it is drift.
    let without = compare(
        &with_extras(plan(&policy, &resolution), &Extras::default()),
        read_back().as_ref(),
        CompareOptions::default(),
    );
    assert!(
        without.to_string().contains("audit_window"),
        "a table that audits is not the policy's: {without}"
    );
}

#[test]
fn a_bridged_containers_flows_are_audited_and_recorded_with_their_bridge() {
    let w = World::new();
    w.dns_set("b.learn.example", &[HOST2_V4], 60);
    let container = BridgedContainer::new(&w);
    let _listeners = [
        w.listen_tcp(HOST2_V4, PORT),
        w.listen_tcp(OTHER_V4, OTHER_PORT),
    ];
    let policy = w.write_file(
        "scoped.yaml",
        &format!(
            "version: 1\nscope:\n  forward: [{BRIDGE}]\nallow:\n  - domain: a.learn.example\n    \
             ports: [{PORT}]\ndns:\n  mode: guard\n  upstream: [{DNS_V4}]\nlog:\n  group: 100\n"
        ),
    );
    let trace_path = w.dir().join("trace.jsonl");
    let mut learn = spawn_learn(&w, &policy, &trace_path, &["--duration", "10m"]);

    let answer = container.dig(BRIDGE_V4, "b.learn.example");
    assert!(answer.stdout.contains(&HOST2_V4.to_string()), "{answer}");
    let out = container.tcp_connect(HOST2_V4, PORT);
    assert!(out.success(), "audited from the container: {out}");
    let out = container.tcp_connect(OTHER_V4, OTHER_PORT);
    assert!(
        out.success(),
        "a bare address, audited from the container: {out}"
    );
    assert_eq!(learn.terminate().code(), Some(0), "{}", learn.stderr());
    let out = container.tcp_connect(OTHER_V4, OTHER_PORT);
    assert!(!out.success(), "refused again: {out}");

    let trace = read_trace(&trace_path);
    let from_bridge: Vec<&Record> = trace
        .records
        .iter()
        .filter(|r| matches!(r, Record::Flow { iif: Some(i), .. } if i == BRIDGE))
        .collect();
    for (dst, port) in [(HOST2_V4, PORT), (OTHER_V4, OTHER_PORT)] {
        assert!(
            from_bridge
                .iter()
                .any(|r| matches!(r, Record::Flow { dst: d, dport: Some(p), .. } if *d == dst && *p == port)),
            "{dst}:{port} from {BRIDGE}: {:?}",
            trace.records
        );
    }
    assert!(
        names_in(&trace)
            .iter()
            .any(|(n, a, _)| n == "b.learn.example" && a == "NOERROR"),
        "the container's question: {:?}",
        trace.records
    );
}
