//! `run --metrics` on loopback, from inside the fence: loopback is accepted, so the sandbox
//! can connect to the metrics server. It can hold its few connections (the README says a
//! unix socket is for figures that must hold against the sandbox), but churning them must
//! stall neither healing nor the guard, which share the daemon with the server.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::common::*;

const METRICS: &str = "127.0.0.1:9464";

/// Holds six connections that send nothing and reconnects each the moment the server closes
/// it (the two past the server's four at once are closed at once: a connect loop), for
/// argv[1] seconds.
const HOLD: &str = r#"
import socket, time, sys, select
end = time.time() + float(sys.argv[1])
def conn():
    s = socket.socket(); s.connect(("127.0.0.1", 9464)); return s
held = [conn() for _ in range(6)]
n = 0
while time.time() < end:
    r, _, _ = select.select(held, [], [], 0.2)
    for s in r:
        if s.recv(4096) == b"":
            held.remove(s); s.close(); held.append(conn()); n += 1
print("reconnects", n)
"#;

#[test]
fn a_sandbox_churning_the_metrics_server_stalls_neither_healing_nor_the_guard() {
    let w = World::new();
    w.dns_set("allowed.example", &[HOST_V4], DEFAULT_DNS_TTL);
    let policy = w.write_file(
        "p.yaml",
        &format!(
            "version: 1\nallow:\n  - domain: allowed.example\n    ports: [443]\n\
             dns:\n  mode: guard\n  listen: [\"{GUARD_ADDR}\"]\n  upstream: [{DNS_V4}]\n"
        ),
    );
    w.use_guard_resolver();
    let mut daemon = w.spawn_egress_fence(&["run", path_arg(&policy), "--metrics", METRICS]);
    assert!(
        daemon.wait_for_output("the DNS guard is serving", Duration::from_secs(10)),
        "{}",
        daemon.stderr()
    );
    let mut hold = w.spawn_adversary(Adversary::Nobody, &[PYTHON, "-c", HOLD, "8"]);
    std::thread::sleep(Duration::from_secs(1));

    // The guard answers at once.
    let asked = Instant::now();
    let dig = w.dig(Some(GUARD_V4), "allowed.example", "A", false);
    assert_eq!(dig.addrs(), vec![HOST_V4], "{}", dig.output);
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "{:?}",
        asked.elapsed()
    );
    // Healing puts the table back at once.
    let out = w.sandbox_cmd(&["nft", "flush", "ruleset"]);
    assert!(out.success(), "{out}");
    let healed = within(Duration::from_secs(3), || w.table_handle().is_some());
    assert!(
        healed,
        "no heal while the sandbox churns:\n{}",
        daemon.stderr()
    );

    assert!(hold.wait_timeout(Duration::from_secs(20)).is_some());
    assert!(hold.stdout().contains("reconnects"), "{}", hold.stderr());
    // Once it stops, a scrape is served.
    let url = format!("http://{METRICS}/metrics");
    let served = within(Duration::from_secs(12), || {
        w.sandbox_cmd(&["curl", "-sS", "--fail", "--max-time", "2", &url])
            .success()
    });
    assert!(served, "{}", daemon.stderr());
    daemon.signal(Signal::SIGTERM);
    assert!(daemon.wait_timeout(Duration::from_secs(10)).is_some());
}
