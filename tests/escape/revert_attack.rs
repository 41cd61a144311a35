//! An outside review of confirm-or-revert (issue 17 items 4, 5 and 7): a revert timer that is
//! stopped rather than killed, and a pending record edited while its timer waits. Each test
//! failed on the main the review attacked.
//!
//! The state directory is root's (0700), but the threat model's root without CAP_NET_ADMIN
//! owns it too: it can stop the timer (same uid) and rewrite the record. What it writes there
//! may delay or cancel a revert (deleting the record is what `confirm` does), but must never
//! make egress-fence install a table wider than both the old and the new policy, and no
//! report may say a stopped timer is reverting.

use std::fs;
use std::net::IpAddr;
use std::thread;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

use crate::common::*;

fn policy(name: &str) -> String {
    format!(
        "version: 1\nallow:\n  - domain: {name}\n    ports: [443]\n\
         dns:\n  resolvers: [192.0.2.53]\n"
    )
}

const OPEN: &str = "version: 1\nallow:\n  - cidr: 0.0.0.0/0\n    protocol: any\n\
                    dns:\n  resolvers: [192.0.2.53]\n";

fn signal(pid: u32, signal: Signal) {
    kill(Pid::from_raw(pid as i32), signal).expect("signal the revert timer");
}

/// The world of tests/generations.rs: a.example.com is HOST_V4, b.example.com HOST2_V4.
fn world() -> (World, std::path::PathBuf, std::path::PathBuf) {
    let w = World::new();
    w.dns_set("a.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    w.dns_set("b.example.com", &[HOST2_V4], DEFAULT_DNS_TTL);
    let a = w.write_file("a.yaml", &policy("a.example.com"));
    let b = w.write_file("b.yaml", &policy("b.example.com"));
    (w, a, b)
}

/// A stopped timer lives (its pid and start time are right) but reverts nothing: `status`
/// said "its revert timer is reverting it now" for as long as it stayed stopped, and
/// `revert_overdue` false. It is reported as stopped and the revert as overdue; the next
/// writer carries it out, and the timer, resumed, stands down.
#[test]
fn a_stopped_revert_timer_is_reported_and_its_revert_carried_out_by_the_next_writer() {
    let (w, a, b) = world();
    egress_fence_ok(&w, &["apply", path_arg(&a)]);
    egress_fence_ok(&w, &["apply", path_arg(&b), "--confirm-within", "2s"]);
    let timer = the_revert_timer(&w);
    signal(timer, Signal::SIGSTOP);
    thread::sleep(Duration::from_millis(2500));
    assert!(live_is(&w, &b), "a stopped timer reverted");

    let out = egress_fence_ok(&w, &["status"]);
    assert!(
        out.stdout.contains("the revert timer is stopped")
            && out.stdout.contains("the revert is overdue"),
        "{out}"
    );
    assert!(!out.stdout.contains("reverting it to"), "{out}");
    let pending =
        stdout_json(&egress_fence_ok(&w, &["status", "--json"]))["pending_confirmation"].clone();
    assert_eq!(pending["revert_timer_alive"], false, "{pending}");
    assert_eq!(pending["revert_overdue"], true, "{pending}");

    let late = w.egress_fence(&["confirm"]);
    assert_eq!(late.code(), 1, "{late}");
    assert!(late.stderr.contains("reverted it now"), "{late}");
    assert!(live_is(&w, &a), "the revert was not carried out");

    signal(timer, Signal::SIGCONT);
    assert!(
        within(Duration::from_secs(5), || revert_timers(&w).is_empty()),
        "the resumed timer did not stand down"
    );
    assert!(live_is(&w, &a));
    let history = stdout_json(&egress_fence_ok(&w, &["history", "--json"]));
    assert_eq!(
        history["generations"].as_array().map(Vec::len),
        Some(3),
        "one revert, not two: {history}"
    );
}

/// The revert target is what `apply` armed, not what the record says at the deadline: the
/// recorded live table (item 7), rewritten while the timer waits into one that lets every
/// host out, was installed by the timer as "the table as it was before the change".
#[test]
fn a_pending_record_rewritten_while_its_timer_waits_does_not_choose_the_revert() {
    let (w, a, b) = world();
    // A table that opens everything, recorded in a state directory of its own: the forger's
    // material (any egress-fence ruleset would do).
    let open_dir = w.dir().join("open-state");
    let open = w.write_file("open.yaml", OPEN);
    egress_fence_ok(
        &w,
        &["apply", path_arg(&open), "--state-dir", path_arg(&open_dir)],
    );
    let open_ruleset: Value = serde_json::from_str(
        &fs::read_to_string(
            open_dir
                .join(format!("netns-{}", w.sandbox_name()))
                .join("gen-000001.json"),
        )
        .expect("the open generation"),
    )
    .expect("JSON");
    // A's table from another state directory: the change reverts to it as recorded.
    let elsewhere = w.dir().join("elsewhere");
    egress_fence_ok(
        &w,
        &["apply", path_arg(&a), "--state-dir", path_arg(&elsewhere)],
    );
    let out = egress_fence_ok(&w, &["apply", path_arg(&b), "--confirm-within", "3s"]);
    assert!(out.stdout.contains("live before it"), "{out}");

    let path = w.sandbox_state_dir().join("pending-confirm.json");
    let mut record: Value =
        serde_json::from_str(&fs::read_to_string(&path).expect("the record")).expect("JSON");
    assert!(record["revert_table"].is_object(), "{record}");
    record["revert_table"] = open_ruleset["ruleset"].clone();
    let forged = w.sandbox_state_dir().join("forged.json");
    fs::write(&forged, record.to_string()).expect("write");
    fs::rename(&forged, &path).expect("rename");

    assert!(
        within(Duration::from_secs(10), || revert_timers(&w).is_empty()),
        "the timer never acted:\n{}",
        revert_timer_log(&w)
    );
    let _other = w.listen_tcp(OTHER_V4, 8443);
    assert!(
        !w.tcp_connects(OTHER_V4, 8443),
        "the revert installed the forged open table:\n{}",
        revert_timer_log(&w)
    );
    assert!(
        live_is(&w, &a),
        "the table that was live was not put back:\n{}",
        revert_timer_log(&w)
    );
    let log = revert_timer_log(&w);
    assert!(log.contains("changed after it was armed"), "{log}");
}

/// Without `--netns` the state directory is "host" whatever namespace the writer is in. A
/// change armed there from one namespace (its timer gone) was dropped by a `confirm` run in
/// another, "applied in network namespace N, which is gone", though that namespace and the
/// unconfirmed change lived on: the revert was lost and the report lied. (Before the
/// deadline that `confirm` confirmed it, and an `apply --confirm-within` replaced it.)
#[test]
fn a_writer_in_another_namespace_neither_drops_nor_settles_a_pending_revert() {
    let w = World::new();
    let allow =
        |addr: IpAddr| format!("version: 1\nallow:\n  - cidr: {addr}/32\n    ports: [443]\n");
    let a = w.write_file("a.yaml", &allow(HOST_V4));
    let b = w.write_file("b.yaml", &allow(HOST2_V4));
    // In the sandbox, without --netns: the state directory "host" of the world's.
    let in_sandbox = |args: &[&str]| w.sandbox_cmd(&[&[EGRESS_FENCE_BIN], args].concat());
    let out = in_sandbox(&["apply", path_arg(&a)]);
    assert!(out.success(), "{out}");
    let out = in_sandbox(&["apply", path_arg(&b), "--confirm-within", "2s"]);
    assert!(out.success(), "{out}");
    let timers = revert_timers_of(&w.state_dir());
    assert_eq!(timers.len(), 1, "{timers:?}");
    signal(timers[0], Signal::SIGKILL);
    thread::sleep(Duration::from_millis(2500));

    let pending = w.state_dir().join("host").join("pending-confirm.json");
    assert!(pending.exists(), "premise: the revert is overdue");
    for args in [
        &["confirm"][..],
        &["apply", path_arg(&b), "--confirm-within", "60s"],
    ] {
        let out = w.net_cmd(&[&[EGRESS_FENCE_BIN], args].concat());
        assert!(!out.success(), "{args:?} from another namespace: {out}");
        assert!(!out.stderr.contains("which is gone"), "{out}");
        assert!(out.stderr.contains("still exists"), "{out}");
        assert!(
            pending.exists(),
            "{args:?} dropped the pending revert: {out}"
        );
    }

    // In its own namespace, the overdue revert is carried out.
    let late = in_sandbox(&["confirm"]);
    assert_eq!(late.code(), 1, "{late}");
    assert!(late.stderr.contains("reverted it now"), "{late}");
    let diff = in_sandbox(&["diff", path_arg(&a)]);
    assert_eq!(diff.code(), 0, "the sandbox is back to A: {diff}");
}

/// A pending record torn or garbled while its timer waits: `status` took the error for "no
/// pending confirmation" and said nothing of it, and the timer, reading it at its deadline,
/// failed and reverted nothing. An unreadable record is no confirmation: it is said, and the
/// timer reverts to what it armed with (and writes the record back whole).
#[test]
fn a_corrupt_pending_record_is_said_and_its_timer_still_reverts() {
    let (w, a, b) = world();
    egress_fence_ok(&w, &["apply", path_arg(&a)]);
    egress_fence_ok(&w, &["apply", path_arg(&b), "--confirm-within", "3s"]);
    the_revert_timer(&w);
    fs::write(w.sandbox_state_dir().join("pending-confirm.json"), "{").expect("garble");

    let out = egress_fence_ok(&w, &["status"]);
    assert!(
        out.stdout.contains("cannot read the pending confirmation")
            && out.stdout.contains("corrupt"),
        "{out}"
    );
    let v = stdout_json(&egress_fence_ok(&w, &["status", "--json"]));
    assert!(v["pending_confirmation"]["error"].is_string(), "{v}");

    assert!(
        within(Duration::from_secs(10), || live_is(&w, &a)),
        "never reverted:\n{}",
        revert_timer_log(&w)
    );
    // The timer says why after it reverted: its line may come a moment after the table.
    assert!(
        within(Duration::from_secs(5), || revert_timer_log(&w)
            .contains("unreadable")),
        "{}",
        revert_timer_log(&w)
    );
    let late = w.egress_fence(&["confirm"]);
    assert_eq!(late.code(), 1, "{late}");
    assert!(late.stderr.contains("too late"), "{late}");
}

/// A confirmation armed before the host restarted is void whatever its deadline: `confirm`
/// said "too late, the deadline passed" of one whose deadline had not come.
#[test]
fn a_confirmation_of_another_boot_is_not_called_too_late() {
    let (w, a, b) = world();
    egress_fence_ok(&w, &["apply", path_arg(&a)]);
    egress_fence_ok(&w, &["apply", path_arg(&b), "--confirm-within", "60s"]);
    signal(the_revert_timer(&w), Signal::SIGKILL);
    let path = w.sandbox_state_dir().join("pending-confirm.json");
    let mut record: Value =
        serde_json::from_str(&fs::read_to_string(&path).expect("the record")).expect("JSON");
    record["boot_id"] = "an earlier boot".into();
    fs::write(&path, record.to_string()).expect("write");

    let out = w.egress_fence(&["confirm"]);
    assert_eq!(out.code(), 1, "{out}");
    assert!(
        out.stderr.contains("nothing to confirm") && out.stderr.contains("restarted"),
        "{out}"
    );
    assert!(!out.stderr.contains("deadline passed"), "{out}");
    assert!(live_is(&w, &b), "nothing is reverted");
}

/// `confirm` and the timer at the deadline take the lock in turn: whatever `confirm` says is
/// what happened, never both (confirmed, then reverted) nor neither.
#[test]
fn a_confirm_racing_the_deadline_is_either_kept_or_reverted() {
    let (w, a, b) = world();
    for offset_ms in [-150i64, -40, 0, 30, 120] {
        egress_fence_ok(&w, &["apply", path_arg(&a)]);
        let armed = std::time::Instant::now();
        egress_fence_ok(&w, &["apply", path_arg(&b), "--confirm-within", "2s"]);
        let at = Duration::from_millis((2000 + offset_ms) as u64);
        if let Some(wait) = at.checked_sub(armed.elapsed()) {
            thread::sleep(wait);
        }
        let out = w.egress_fence(&["confirm"]);
        assert!(
            within(Duration::from_secs(5), || revert_timers(&w).is_empty()),
            "the timer lingers"
        );
        thread::sleep(Duration::from_millis(300));
        match out.code() {
            0 => {
                assert!(out.stdout.contains("confirmed generation"), "{out}");
                assert!(
                    live_is(&w, &b),
                    "confirmed at {offset_ms} ms, then reverted: {out}"
                );
            }
            1 => {
                assert!(out.stderr.contains("too late"), "{out}");
                assert!(
                    live_is(&w, &a),
                    "too late at {offset_ms} ms, not reverted: {out}"
                );
            }
            _ => panic!("{out}"),
        }
        assert!(
            !w.sandbox_state_dir().join("pending-confirm.json").exists(),
            "nothing awaits any more"
        );
    }
}
