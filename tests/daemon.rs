//! `egress-fence run`: the service follows answers as they change, without gaps, keeps the
//! last good addresses through resolver failures for their grace only, reloads on SIGHUP,
//! heals a table someone else changed, and speaks systemd's notify protocol.

mod common;

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;
use serde_json::Value;

/// Short TTLs, refresh and grace so that a test sees several refreshes in seconds.
fn policy(names: &[&str]) -> String {
    let mut p = String::from("version: 1\nallow:\n");
    for n in names {
        p.push_str(&format!("  - domain: {n}\n    ports: [443]\n"));
    }
    p.push_str(
        "dns:\n  resolvers: [192.0.2.53]\n  refresh: { min: 1s, max: 2s }\n  grace: 3s\nlog:\n  group: 100\n",
    );
    p
}

/// Starts the daemon on `policy_path` and waits for READY.
fn start(w: &World, notify: &NotifySocket, policy_path: &Path, extra: &[&str]) -> Background {
    let mut args = vec!["run", policy_path.to_str().expect("utf-8 path")];
    args.extend_from_slice(extra);
    let mut daemon = w.spawn_egress_fence_with_env(&args, &[("NOTIFY_SOCKET", notify.path())]);
    if notify
        .wait_for("READY=1", Duration::from_secs(10))
        .is_none()
    {
        let _ = daemon.terminate();
        panic!("no READY=1 from the daemon:\n{}", daemon.stderr());
    }
    // On a fresh namespace READY comes with the deny-by-default skeleton; the names follow.
    assert!(
        daemon.wait_for_output("new addresses allowed", Duration::from_secs(10)),
        "the names never resolved:\n{}",
        daemon.stderr()
    );
    daemon
}

/// Whether table inet egress_fence is there. `nft list tables` reads the tables only: `nft -j
/// list ruleset` of the large-table test's 200,000 elements, while the daemon put its table
/// back (twice, 65,538 elements each), once ran past its 60 s in CI.
fn has_table(w: &World) -> bool {
    let out = w.sandbox_cmd(&["nft", "list", "tables"]);
    assert!(out.success(), "nft list tables: {out}");
    out.stdout
        .lines()
        .any(|l| l.trim() == "table inet egress_fence")
}

/// A plain TCP connect from the sandbox, with a short timeout.
fn connects(w: &World, addr: IpAddr, port: u16) -> bool {
    w.in_sandbox_ns(|| {
        TcpStream::connect_timeout(&SocketAddr::new(addr, port), Duration::from_millis(500)).is_ok()
    })
}

/// Polls until `f` holds, for at most `timeout`; returns how long it took.
fn within(timeout: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return Some(start.elapsed());
        }
        thread::sleep(Duration::from_millis(50));
    }
    None
}

#[test]
fn ready_comes_once_the_table_is_live_and_sigterm_leaves_it() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    let _api = w.listen_tcp(HOST_V4, 443);
    let path = w.write_file("policy.yaml", &policy(&["api.example.com"]));
    let notify = NotifySocket::new(&w, "notify.sock");
    assert!(!has_table(&w));

    let mut daemon = w.spawn_egress_fence_with_env(
        &["run", path.to_str().expect("utf-8")],
        &[("NOTIFY_SOCKET", notify.path())],
    );
    let ready = notify.wait_for("READY=1", Duration::from_secs(10));
    // Checked at once: READY may only come after the boundary is in place.
    let live = has_table(&w);
    assert!(ready.is_some(), "no READY=1: {}", daemon.stderr());
    assert!(live, "READY=1 arrived before the table was live");
    // A fresh boundary starts as the deny-by-default skeleton; the name follows at once.
    assert!(within(Duration::from_secs(5), || connects(&w, HOST_V4, 443)).is_some());
    let status = notify
        .wait_for("STATUS=1 names, 1 addresses", Duration::from_secs(5))
        .expect("a STATUS= line with the resolved name");
    assert!(status.contains("0 failing"), "{status}");

    let status = daemon.terminate();
    assert!(status.success(), "{status:?}: {}", daemon.stderr());
    assert!(has_table(&w), "SIGTERM must leave the boundary in place");
    assert!(
        daemon.stderr().contains("stays in place"),
        "{}",
        daemon.stderr()
    );

    let mut daemon = start(&w, &notify, &path, &["--teardown-on-exit"]);
    assert!(daemon.terminate().success());
    assert!(
        !has_table(&w),
        "--teardown-on-exit leaves the table: {}",
        daemon.stderr()
    );
}

#[test]
fn a_changed_answer_is_followed_without_a_gap_and_the_old_address_fades_after_grace() {
    let w = World::new();
    w.dns_set_ttl(1);
    w.dns_set("api.example.com", &[HOST_V4], 1);
    w.dns_set("steady.example.com", &[HOST2_V4], 1);
    let _old = w.listen_tcp(HOST_V4, 443);
    let _steady = w.listen_tcp(HOST2_V4, 443);
    let _new = w.listen_tcp(HOST3_V4, 443);
    let path = w.write_file(
        "policy.yaml",
        &policy(&["api.example.com", "steady.example.com"]),
    );
    let notify = NotifySocket::new(&w, "notify.sock");
    let daemon = start(&w, &notify, &path, &[]);
    let handle = w.table_handle();
    assert!(connects(&w, HOST_V4, 443));
    assert!(
        !connects(&w, HOST3_V4, 443),
        "not allowed before the answer names it"
    );

    // A client connecting to another name over and over through all the refreshes.
    let stop = AtomicBool::new(false);
    let (attempts, failures) = (AtomicUsize::new(0), AtomicUsize::new(0));
    thread::scope(|s| {
        s.spawn(|| {
            w.in_sandbox_ns(|| {
                while !stop.load(Ordering::Relaxed) {
                    let to = SocketAddr::new(HOST2_V4, 443);
                    if TcpStream::connect_timeout(&to, Duration::from_millis(500)).is_err() {
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                    attempts.fetch_add(1, Ordering::Relaxed);
                    thread::sleep(Duration::from_millis(20));
                }
            })
        });

        w.dns_set("api.example.com", &[HOST3_V4], 1);
        let changed = Instant::now();
        // TTL 1 s + refresh 1 s, with room for a loaded machine.
        let took = within(Duration::from_secs(6), || connects(&w, HOST3_V4, 443));
        assert!(took.is_some(), "the new address never became reachable");
        // The old address was last answered about a second ago: grace (3 s) keeps it.
        assert!(
            connects(&w, HOST_V4, 443),
            "the old address went before its grace"
        );
        // It was last seen at most ~2 s before the change; interval (1 s) + grace (3 s) later
        // it is gone.
        let gone = within(Duration::from_secs(10), || !connects(&w, HOST_V4, 443));
        assert!(gone.is_some(), "the old address stayed after its grace");
        let fade = changed.elapsed();
        assert!(fade >= Duration::from_secs(2), "gone too early: {fade:?}");
        stop.store(true, Ordering::Relaxed);
    });
    let (a, f) = (
        attempts.load(Ordering::Relaxed),
        failures.load(Ordering::Relaxed),
    );
    assert!(a > 50, "the client barely ran ({a} attempts)");
    assert_eq!(
        f, 0,
        "{f} of {a} connects to the steady name failed during refreshes"
    );
    assert_eq!(
        w.table_handle(),
        handle,
        "the table was reloaded instead of updated: {}",
        daemon.stderr()
    );
    assert!(
        daemon.stderr().contains("new addresses allowed"),
        "{}",
        daemon.stderr()
    );
}

#[test]
fn a_failing_resolver_keeps_the_last_good_addresses_for_their_grace_only() {
    let w = World::new();
    w.dns_set_ttl(1);
    w.dns_set("api.example.com", &[HOST_V4], 1);
    let _api = w.listen_tcp(HOST_V4, 443);
    let _unlisted = w.listen_tcp(HOST3_V4, 443);
    let path = w.write_file("policy.yaml", &policy(&["api.example.com"]));
    let notify = NotifySocket::new(&w, "notify.sock");
    let mut daemon = start(&w, &notify, &path, &[]);
    assert!(connects(&w, HOST_V4, 443));

    w.dns_stop();
    let stopped = Instant::now();
    thread::sleep(Duration::from_millis(1500));
    assert!(connects(&w, HOST_V4, 443), "dropped before its grace ended");
    let gone = within(Duration::from_secs(10), || !connects(&w, HOST_V4, 443));
    assert!(
        gone.is_some(),
        "kept past its grace while the resolver was down"
    );
    assert!(stopped.elapsed() >= Duration::from_secs(2));
    assert!(!connects(&w, HOST3_V4, 443), "a failure opened something");
    assert!(
        daemon.wait_for_output("lookup failed", Duration::from_secs(10)),
        "{}",
        daemon.stderr()
    );

    // The resolver returns: retried with backoff, the address comes back.
    w.dns_start();
    let back = within(Duration::from_secs(8), || connects(&w, HOST_V4, 443));
    assert!(back.is_some(), "not restored after the resolver came back");
}

#[test]
fn sighup_refuses_a_broken_policy_and_applies_a_good_one() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    w.dns_set("other.example.com", &[HOST2_V4], DEFAULT_DNS_TTL);
    let _api = w.listen_tcp(HOST_V4, 443);
    let _other = w.listen_tcp(HOST2_V4, 443);
    let path = w.write_file("policy.yaml", &policy(&["api.example.com"]));
    let notify = NotifySocket::new(&w, "notify.sock");
    let mut daemon = start(&w, &notify, &path, &[]);
    let handle = w.table_handle();

    std::fs::write(&path, "version: 1\nallow:\n  - domain: [broken\n").expect("write");
    daemon.signal(Signal::SIGHUP);
    assert!(
        daemon.wait_for_output("the running one stays", Duration::from_secs(5)),
        "{}",
        daemon.stderr()
    );
    assert!(connects(&w, HOST_V4, 443));
    assert!(!connects(&w, HOST2_V4, 443));
    assert_eq!(
        w.table_handle(),
        handle,
        "a refused policy touched the table"
    );

    std::fs::write(&path, policy(&["other.example.com"])).expect("write");
    daemon.signal(Signal::SIGHUP);
    let switched = within(Duration::from_secs(5), || {
        connects(&w, HOST2_V4, 443) && !connects(&w, HOST_V4, 443)
    });
    assert!(
        switched.is_some(),
        "the new policy did not take: {}",
        daemon.stderr()
    );
}

#[test]
fn the_table_comes_back_within_a_second_after_a_flush_or_a_delete() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    let _api = w.listen_tcp(HOST_V4, 443);
    let _unlisted = w.listen_tcp(HOST3_V4, 443);
    let path = w.write_file("policy.yaml", &policy(&["api.example.com"]));
    let notify = NotifySocket::new(&w, "notify.sock");
    let daemon = start(&w, &notify, &path, &[]);

    for vandalism in [
        vec!["nft", "flush", "ruleset"],
        vec!["nft", "delete", "table", "inet", "egress_fence"],
        vec!["nft", "flush", "chain", "inet", "egress_fence", "output"],
        vec!["nft", "flush", "set", "inet", "egress_fence", "resolved4"],
    ] {
        let out = w.sandbox_cmd(&vandalism);
        assert!(out.success(), "{vandalism:?}: {out}");
        let healed = within(Duration::from_secs(1), || {
            has_table(&w) && !connects(&w, HOST3_V4, 443) && connects(&w, HOST_V4, 443)
        });
        assert!(
            healed.is_some(),
            "not restored within a second after {vandalism:?}: {}",
            daemon.stderr()
        );
    }
    assert!(
        daemon.stderr().contains("changed by someone else"),
        "{}",
        daemon.stderr()
    );
    assert!(
        daemon.stderr().contains("by=nft (netlink port"),
        "the process is named: {}",
        daemon.stderr()
    );
}

#[test]
fn a_killed_daemon_leaves_a_consistent_table_that_the_next_start_takes_over() {
    let w = World::new();
    w.dns_set_ttl(1);
    w.dns_set("api.example.com", &[HOST_V4], 1);
    let _api = w.listen_tcp(HOST_V4, 443);
    let path = w.write_file("policy.yaml", &policy(&["api.example.com"]));
    let notify = NotifySocket::new(&w, "notify.sock");
    let mut daemon = start(&w, &notify, &path, &[]);
    // Let it refresh a few times, then kill it without warning.
    thread::sleep(Duration::from_millis(2500));
    daemon.signal(Signal::SIGKILL);
    let _ = daemon.wait_timeout(Duration::from_secs(5));

    let live = w.egress_fence(&["status", "--json"]);
    assert!(live.success(), "{live}");
    let status: Value = serde_json::from_str(&live.stdout).expect("json");
    assert_eq!(
        status["chains"].as_array().map(Vec::len),
        Some(2),
        "{status}"
    );
    assert_eq!(status["sets"].as_array().map(Vec::len), Some(8), "{status}");
    assert!(connects(&w, HOST_V4, 443));
    // The dead daemon's addresses expire on their own (interval 1 s + grace 3 s).
    let expired = within(Duration::from_secs(8), || !connects(&w, HOST_V4, 443));
    assert!(expired.is_some(), "a dead daemon's addresses never expired");

    let _next = start(&w, &notify, &path, &[]);
    assert!(within(Duration::from_secs(3), || connects(&w, HOST_V4, 443)).is_some());
}

#[test]
fn refusals_are_logged_with_what_the_daemon_knows_of_their_destination() {
    let w = World::new();
    w.dns_set_ttl(1);
    w.dns_set("api.example.com", &[HOST_V4], 1);
    let _api = w.listen_tcp(HOST_V4, 443);
    let mut text = policy(&["api.example.com"]);
    text.push_str("deny:\n  - preset: cloud-metadata\n");
    let path = w.write_file("policy.yaml", &text);
    let notify = NotifySocket::new(&w, "notify.sock");
    let mut daemon = start(&w, &notify, &path, &["--log-drops"]);

    let expect = |daemon: &mut Background, note: &str| {
        assert!(
            daemon.wait_for_output(note, Duration::from_secs(5)),
            "no refusal logged with {note:?}:\n{}",
            daemon.stderr()
        );
    };
    assert!(!connects(&w, HOST3_V4, 443));
    expect(&mut daemon, "not in the policy");
    assert!(!connects(&w, METADATA_V4, 80));
    expect(&mut daemon, "denied: preset cloud-metadata");
    assert!(!connects(&w, HOST_V4, 8443));
    expect(
        &mut daemon,
        "an address of api.example.com, allowed on other ports",
    );

    // The name moves; once the old address's grace is over, a refusal names its past.
    w.dns_set("api.example.com", &[HOST2_V4], 1);
    let gone = within(Duration::from_secs(10), || !connects(&w, HOST_V4, 443));
    assert!(gone.is_some(), "{}", daemon.stderr());
    // The kernel counts the element's timeout in jiffies and may end it a tick before the
    // daemon's own record does: a refusal in that tick still reads "an address of". One a
    // moment later names the past.
    thread::sleep(Duration::from_millis(100));
    assert!(!connects(&w, HOST_V4, 443));
    expect(&mut daemon, "was an address of api.example.com until");
    assert!(
        daemon.stderr().contains("dst=192.0.2.10"),
        "{}",
        daemon.stderr()
    );
}

/// Our own notifications never reach the daemon's monitor, however large the table: a full
/// apply of 65,536 elements loses none and heals nothing. Someone else's burst that does
/// overflow it (a large table of theirs loaded) puts ours back, since what it changed is
/// unknown; and a plain change to our table is still seen.
#[test]
fn a_large_table_does_not_mistake_its_own_notifications_for_tampering() {
    let w = World::new();
    // 16 addresses x 8 x 256 ports x 2 protocols: 65,536 elements, one notification each on
    // every full apply of ours, far more than the notification socket holds.
    let addrs: Vec<IpAddr> = (20..36u8).map(|i| IpAddr::from([203, 0, 113, i])).collect();
    w.dns_set("big.example.com", &addrs, DEFAULT_DNS_TTL);
    let ranges: Vec<String> = (1..=8).map(|k| format!("\"{k}000-{k}255\"")).collect();
    let text = policy(&["big.example.com"]).replace(
        "ports: [443]",
        &format!("ports: [{}]\n    protocol: any", ranges.join(", ")),
    );
    let path = w.write_file("policy.yaml", &text);
    let notify = NotifySocket::new(&w, "notify.sock");
    let mut daemon = start(&w, &notify, &path, &[]);
    // A reload applies the whole table: our own flood of notifications.
    daemon.signal(Signal::SIGHUP);
    // The first refresh renews the 65,536 elements as well; wait for the reload's apply.
    let deadline = Instant::now() + Duration::from_secs(20);
    while daemon.stderr().matches("applied the table").count() < 2 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    thread::sleep(Duration::from_secs(1));
    let log = daemon.stderr();
    assert!(!log.contains("someone else"), "{log}");
    assert!(!log.contains("notifications were lost"), "{log}");
    assert_eq!(
        log.matches("applied the table").count(),
        2,
        "start and reload only: {log}"
    );

    // Someone else's table of 131,072 elements: a burst the monitor cannot hold.
    let v4: Vec<String> = (0..65_536u32)
        .map(|i| format!("198.18.{}.{}", i >> 8, i & 0xff))
        .collect();
    let v6: Vec<String> = (0..65_536u32)
        .map(|i| format!("2001:db8:{:x}::{:x}", i >> 8, i & 0xff))
        .collect();
    let script = format!(
        "table inet other {{\n set a {{ type ipv4_addr; elements = {{ {} }} }}\n          set b {{ type ipv6_addr; elements = {{ {} }} }}\n}}\n",
        v4.join(", "),
        v6.join(", ")
    );
    let file = w.write_file("other.nft", &script);
    // Stopped while the burst arrives, so that it overflows the monitor for certain: running,
    // the daemon may read someone else's notifications as fast as the kernel makes them (it
    // did on a busy 2-CPU machine), and nothing is lost.
    daemon.signal(Signal::SIGSTOP);
    let out = w.sandbox_cmd(&["nft", "-f", file.to_str().expect("utf-8 path")]);
    daemon.signal(Signal::SIGCONT);
    assert!(out.success(), "{out}");
    assert!(
        daemon.wait_for_output("notifications were lost", Duration::from_secs(10)),
        "the burst did not overflow the monitor: {}",
        daemon.stderr()
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while daemon.stderr().matches("applied the table").count() < 3 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        daemon.stderr().matches("applied the table").count(),
        3,
        "put back after the burst: {}",
        daemon.stderr()
    );

    // A real change is still seen (and this table takes a while to load).
    let out = w.sandbox_cmd(&["nft", "delete", "table", "inet", "egress_fence"]);
    assert!(out.success(), "{out}");
    assert!(
        within(Duration::from_secs(5), || has_table(&w)).is_some(),
        "{}",
        daemon.stderr()
    );
}

#[test]
fn at_boot_without_resolvers_the_skeleton_goes_up_and_names_follow() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    let _api = w.listen_tcp(HOST_V4, 443);
    let _unlisted = w.listen_tcp(HOST3_V4, 443);
    // No dns.resolvers in the policy, and the resolv.conf it falls back to is not written
    // yet, as early in a boot.
    let text = policy(&["api.example.com"]).replace("  resolvers: [192.0.2.53]\n", "");
    let path = w.write_file("policy.yaml", &text);
    let resolv = w.dir().join("resolv.conf");
    let notify = NotifySocket::new(&w, "notify.sock");
    let resolv_arg = resolv.to_str().expect("utf-8 path");
    let mut daemon = w.spawn_egress_fence_with_env(
        &[
            "run",
            path.to_str().expect("utf-8"),
            "--resolv-conf",
            resolv_arg,
        ],
        &[("NOTIFY_SOCKET", notify.path())],
    );
    assert!(
        notify
            .wait_for("READY=1", Duration::from_secs(10))
            .is_some(),
        "no READY without resolvers: {}",
        daemon.stderr()
    );
    assert!(has_table(&w), "READY without a boundary");
    assert!(!connects(&w, HOST3_V4, 443));
    assert!(
        !connects(&w, HOST_V4, 443),
        "a name allowed before it resolved"
    );

    std::fs::write(&resolv, "nameserver 192.0.2.53\n").expect("write resolv.conf");
    let up = within(Duration::from_secs(10), || connects(&w, HOST_V4, 443));
    assert!(up.is_some(), "the name never followed: {}", daemon.stderr());
    assert!(!connects(&w, HOST3_V4, 443));
    assert!(
        daemon.stderr().contains("resolvers found"),
        "{}",
        daemon.stderr()
    );
    assert!(daemon.terminate().success());
}

/// A cgroup made for one test under the cgroup v2 root, removed when dropped (also when the
/// test fails). It holds no process.
struct TestCgroup {
    dir: std::path::PathBuf,
    name: String,
}

impl TestCgroup {
    /// A name of its own, not made yet; `None` on a host without cgroup v2.
    fn named() -> Option<TestCgroup> {
        let root = egress_fence::host::cgroup2_root()?;
        let unique = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!("egress-fence-test-{}-{unique}", std::process::id());
        Some(TestCgroup {
            dir: root.join(&name),
            name,
        })
    }

    fn make(&self) {
        std::fs::create_dir(&self.dir)
            .unwrap_or_else(|e| panic!("mkdir {}: {e}", self.dir.display()));
    }

    fn remove(&self) {
        std::fs::remove_dir(&self.dir)
            .unwrap_or_else(|e| panic!("rmdir {}: {e}", self.dir.display()));
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

impl TestCgroup {
    /// Whether a TCP connection to `addr`:`port` from a process of the sandbox in this cgroup
    /// succeeds (`nc -z`, 2 s). The process waits for a flag file until the test has moved it
    /// in, so that its socket is made inside the cgroup.
    fn connects(&self, w: &World, addr: IpAddr, port: u16) -> bool {
        let flag = w.dir().join(format!("moved-{}", self.name));
        let script = format!(
            "while [ ! -e {flag} ]; do sleep 0.02; done; exec nc -z -w 2 {addr} {port}",
            flag = flag.display()
        );
        let mut nc = w.spawn_in_sandbox(&["sh", "-c", &script]);
        let procs = self.dir.join("cgroup.procs");
        std::fs::write(&procs, nc.pid().to_string())
            .unwrap_or_else(|e| panic!("move {} into {}: {e}", nc.pid(), procs.display()));
        std::fs::write(&flag, b"").expect("write the flag file");
        let status = nc.wait_timeout(Duration::from_secs(10)).expect("nc exits");
        let _ = std::fs::remove_file(&flag);
        status.success()
    }
}

/// How many rules chain `chain` of table inet egress_fence holds in the sandbox.
fn rules_in_chain(w: &World, chain: &str) -> usize {
    let out = w.sandbox_cmd(&["nft", "-j", "list", "chain", "inet", "egress_fence", chain]);
    assert!(out.success(), "nft list chain {chain}: {out}");
    let v: Value = serde_json::from_str(&out.stdout).expect("nft -j output is JSON");
    v["nftables"]
        .as_array()
        .map_or(0, |a| a.iter().filter(|o| o.get("rule").is_some()).count())
}

#[test]
fn a_listed_cgroup_made_after_start_is_fenced_and_followed_when_made_again() {
    let Some(cgroup) = TestCgroup::named() else {
        eprintln!("skipped: no cgroup v2 hierarchy on this host");
        return;
    };
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    // A uid besides the cgroup, so that the scope's output chain exists before the cgroup does.
    let text = policy(&["api.example.com"]).replace(
        "version: 1\n",
        &format!(
            "version: 1\nscope:\n  users: [4001]\n  cgroups: [{}]\n",
            cgroup.name
        ),
    );
    let path = w.write_file("policy.yaml", &text);
    let notify = NotifySocket::new(&w, "notify.sock");
    let mut daemon = start(&w, &notify, &path, &[]);
    let name = &cgroup.name;
    assert!(
        daemon
            .stderr()
            .contains(&format!("listed cgroup {name} is not fenced yet")),
        "a missing cgroup is named at start:\n{}",
        daemon.stderr()
    );
    let before = rules_in_chain(&w, "scope_output");

    let count = |d: &Background, needle: &str| d.stderr().matches(needle).count();
    let appeared = format!("cgroup {name} appeared: fenced from now on");
    cgroup.make();
    assert!(
        daemon.wait_for_output(&appeared, Duration::from_secs(5)),
        "{}",
        daemon.stderr()
    );
    assert!(
        within(Duration::from_secs(2), || rules_in_chain(
            &w,
            "scope_output"
        ) == before + 1)
        .is_some(),
        "the cgroup's rule is not in the table: {} rules, {before} before",
        rules_in_chain(&w, "scope_output")
    );
    let listed = w.sandbox_cmd(&[
        "nft",
        "list",
        "chain",
        "inet",
        "egress_fence",
        "scope_output",
    ]);
    assert!(
        listed
            .stdout
            .lines()
            .any(|l| l.contains("socket cgroupv2") && l.contains(name.as_str())),
        "{listed}"
    );

    // Removed: its rule goes; made again (a new id): a rule for the new one.
    cgroup.remove();
    let gone = format!("cgroup {name} is gone");
    assert!(
        daemon.wait_for_output(&gone, Duration::from_secs(5)),
        "{}",
        daemon.stderr()
    );
    assert!(
        within(Duration::from_secs(2), || rules_in_chain(
            &w,
            "scope_output"
        ) == before)
        .is_some()
    );
    cgroup.make();
    assert!(
        within(Duration::from_secs(5), || count(&daemon, &appeared) == 2).is_some(),
        "{}",
        daemon.stderr()
    );
    assert!(
        within(Duration::from_secs(2), || rules_in_chain(
            &w,
            "scope_output"
        ) == before + 1)
        .is_some()
    );
    // A process in the cgroup made again is fenced; root outside it is not.
    let _other = w.listen_tcp(HOST2_V4, 443);
    assert!(w.tcp_connects(HOST2_V4, 443), "outside the scope");
    assert!(
        !cgroup.connects(&w, HOST2_V4, 443),
        "a process of the cgroup made again reached a host the policy does not allow"
    );
    assert!(daemon.terminate().success(), "{}", daemon.stderr());
    // Why it is followed: with nobody following, the rule of the old id matches nothing
    // once the cgroup is made again (this also shows the check above can fail).
    cgroup.remove();
    cgroup.make();
    assert!(cgroup.connects(&w, HOST2_V4, 443));
}

/// Adds an interface `name` with `addr` (a /24) to the sandbox, up: one end of a veth pair
/// (this kernel has no dummy interfaces), its peer `<name>p` up too.
fn add_bridge(w: &World, name: &str, addr: &str) {
    let peer = format!("{name}p");
    for args in [
        vec![
            "ip", "link", "add", name, "type", "veth", "peer", "name", &peer,
        ],
        vec!["ip", "addr", "add", addr, "dev", name],
        vec!["ip", "link", "set", &peer, "up"],
        vec!["ip", "link", "set", name, "up"],
    ] {
        let out = w.sandbox_cmd(&args);
        assert!(out.success(), "{args:?}: {out}");
    }
}

#[test]
fn a_scoped_guard_answers_on_the_listed_bridges_it_found_and_names_those_it_does_not() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    add_bridge(&w, "efbr0", "198.18.0.1/24");
    // An IPv6 address on an interface without carrier stays tentative: it cannot be bound.
    let tentative = [
        vec![
            "ip", "link", "add", "efbr9", "type", "veth", "peer", "name", "efbr9p",
        ],
        vec!["ip", "link", "set", "efbr9", "up"],
        vec!["ip", "-6", "addr", "add", "fd00:18::1/64", "dev", "efbr9"],
    ];
    for args in tentative {
        let out = w.sandbox_cmd(&args);
        assert!(out.success(), "{args:?}: {out}");
    }
    let text = format!(
        "version: 1\nscope:\n  users: [4001]\n  forward: [\"efbr*\"]\nallow:\n  - domain: \
         api.example.com\n    ports: [443]\ndns:\n  mode: guard\n  upstream: [{DNS_V4}]\n"
    );
    let path = w.write_file("policy.yaml", &text);
    let mut daemon = w.spawn_guard(path_arg(&path));
    assert!(
        daemon.stderr().contains("198.18.0.1:53"),
        "the guard says it listens on the bridge:\n{}",
        daemon.stderr()
    );
    assert!(
        daemon
            .stderr()
            .contains("the DNS guard cannot listen on [fd00:18::1]:53"),
        "a bridge address it cannot bind is left out, named:\n{}",
        daemon.stderr()
    );
    let bridge: IpAddr = "198.18.0.1".parse().expect("an address");
    // Asked on the bridge's address, by root (not fenced) and by a fenced user.
    for uid in [None, Some(4001)] {
        let answer = w.dig_as(uid, Some(bridge), "api.example.com", "A", &[]);
        assert_eq!(answer.addrs(), vec![HOST_V4], "{uid:?}: {answer:?}");
    }

    // A bridge that comes after start is named, and is no reason to refuse a reload.
    add_bridge(&w, "efbr1", "198.18.1.1/24");
    assert!(
        daemon.wait_for_output(
            "listed interface efbr1 has 198.18.1.1:53, where the DNS guard does not listen",
            Duration::from_secs(5)
        ),
        "{}",
        daemon.stderr()
    );
    let applied = |d: &Background| d.stderr().matches("applied the table").count();
    let before = applied(&daemon);
    daemon.signal(Signal::SIGHUP);
    assert!(
        within(Duration::from_secs(5), || applied(&daemon) > before).is_some(),
        "the reload was not applied:\n{}",
        daemon.stderr()
    );
    assert!(
        !daemon.stderr().contains("takes a restart"),
        "{}",
        daemon.stderr()
    );
    let answer = w.dig(Some(bridge), "api.example.com", "A", false);
    assert_eq!(answer.addrs(), vec![HOST_V4], "{answer:?}");
    assert!(daemon.terminate().success(), "{}", daemon.stderr());
}
