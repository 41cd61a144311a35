//! `learn` audits, and an audit lets everything out: it must never outlive its run. A
//! `learn` killed with SIGKILL (no chance to close anything) leaves an audit window that
//! nobody renews, and the table refuses again once its timeout runs out.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::common::*;

const PORT: u16 = 9090;

#[test]
fn a_killed_learn_stops_auditing_within_the_windows_timeout() {
    let w = World::new();
    let _listener = w.listen_tcp(OTHER_V4, PORT);
    let policy = w.write_file(
        "start.yaml",
        &format!(
            "version: 1\ndns:\n  mode: guard\n  listen: [\"{GUARD_ADDR}\"]\n  upstream: [{DNS_V4}]\n\
             log:\n  group: 100\n"
        ),
    );
    w.use_guard_resolver();
    let trace = w.dir().join("trace.jsonl");
    let mut learn = w.spawn_egress_fence(&[
        "learn",
        path_arg(&policy),
        "--duration",
        "1h",
        "--trace",
        path_arg(&trace),
    ]);
    assert!(
        learn.wait_for_output("the DNS guard is serving", Duration::from_secs(15)),
        "{}",
        learn.stderr()
    );
    assert!(w.tcp_connects(OTHER_V4, PORT), "audited while learn runs");

    learn.signal(Signal::SIGKILL);
    let killed = Instant::now();
    assert!(learn.wait_timeout(Duration::from_secs(5)).is_some());
    // Nothing closed it: the window is still open for a while (what the bound is for).
    assert!(
        w.tcp_connects(OTHER_V4, PORT),
        "the window closes by its timeout, not at once"
    );

    // The 30 s timeout (from the last renewal, at most 10 s before the kill) closes it.
    let refused = within(Duration::from_secs(45), || {
        !w.tcp_connect(OTHER_V4, PORT, 1).success()
    });
    assert!(refused, "the audit window outlived its learn");
    assert!(
        killed.elapsed() <= Duration::from_secs(33),
        "closed {:?} after the kill",
        killed.elapsed()
    );
    // And it stays refused: the set is empty, the rule matches nothing.
    std::thread::sleep(Duration::from_secs(2));
    assert!(!w.tcp_connects(OTHER_V4, PORT));
    let table = w.sandbox_cmd(&["nft", "list", "set", "inet", "egress_fence", "audit_window"]);
    assert!(table.success(), "{table}");
    assert!(!table.stdout.contains("elements"), "{table}");

    // The window left behind opens again only for a holder of CAP_NET_ADMIN: an unprivileged
    // user and root without it are refused by the kernel...
    let reopen = [
        "nft",
        "add",
        "element",
        "inet",
        "egress_fence",
        "audit_window",
        "{ ipv4 timeout 1h }",
    ];
    for who in [Adversary::Nobody, Adversary::RootWithoutNetAdmin] {
        let out = w.adversary_cmd(who, &reopen);
        assert!(!out.success(), "{who:?} reopened the audit window: {out}");
        assert!(
            !w.tcp_connects(OTHER_V4, PORT),
            "{who:?} reopened the audit"
        );
    }
    // ...while the same command as root opens it (the attack is the real one).
    let root = w.sandbox_cmd(&reopen);
    assert!(root.success(), "{root}");
    assert!(w.tcp_connects(OTHER_V4, PORT), "root reopened the window");
}
