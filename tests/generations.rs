//! Safe changes in the namespace world: generations and rollback, confirm-or-revert (also
//! when `apply` dies right after applying), `diff` and its exit codes, idempotent `apply`,
//! drift after a hand edit, the writers' lock (serialised writers, the service's lock, a dead
//! holder's lock), a crash between write and rename, and corrupt generation files.
//!
//! Every egress-fence here keeps its state in the world's temporary directory (the harness
//! sets EGRESS_FENCE_STATE_DIR); revert timers run inside the sandbox namespace, so the
//! world kills any that outlive a failed test.

mod common;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::Signal;
use serde_json::Value;

fn policy(name: &str) -> String {
    format!(
        "version: 1\nallow:\n  - domain: {name}\n    ports: [443]\n\
         dns:\n  resolvers: [192.0.2.53]\nlog:\n  group: 100\n"
    )
}

/// A world where a.example.com is HOST_V4 and b.example.com is HOST2_V4, and the policies A
/// and B that allow one of them each (TCP 443).
fn world() -> (World, PathBuf, PathBuf) {
    let w = World::new();
    w.dns_set("a.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    w.dns_set("b.example.com", &[HOST2_V4], DEFAULT_DNS_TTL);
    let a = w.write_file("a.yaml", &policy("a.example.com"));
    let b = w.write_file("b.yaml", &policy("b.example.com"));
    (w, a, b)
}

/// (number, command, source generation) of every generation, from `history --json`; panics
/// on a corrupt one.
fn generations(w: &World) -> Vec<(u64, String, Option<u64>)> {
    let history = stdout_json(&egress_fence_ok(w, &["history", "--json"]));
    history["generations"]
        .as_array()
        .expect("a list of generations")
        .iter()
        .map(|g| {
            assert!(g["corrupt"].is_null(), "corrupt generation: {g}");
            (
                g["generation"].as_u64().expect("a number"),
                g["command"].as_str().expect("a command").to_string(),
                g["source_generation"].as_u64(),
            )
        })
        .collect()
}

fn gen_apply(n: u64) -> (u64, String, Option<u64>) {
    (n, "apply".into(), None)
}

/// Session id and controlling terminal of `pid`, from /proc/PID/stat.
fn session_and_tty(pid: u32) -> (u32, u32) {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).expect("read stat");
    // After the command name in parentheses: state ppid pgrp session tty_nr ...
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .expect("a stat line")
        .1
        .split_whitespace()
        .collect();
    (
        fields[3].parse().expect("session"),
        fields[4].parse().expect("tty"),
    )
}

fn leftovers(w: &World) -> Vec<String> {
    fs::read_dir(w.sandbox_state_dir())
        .expect("the state directory exists")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.') && n.ends_with(".tmp"))
        .collect()
}

#[test]
fn rollback_reinstates_the_previous_generation_exactly_and_to_picks_an_older_one() {
    let (w, a, b) = world();
    let _a = w.listen_tcp(HOST_V4, 443);
    let _b = w.listen_tcp(HOST2_V4, 443);
    let _c = w.listen_tcp(HOST3_V4, 443);

    let out = egress_fence_ok(&w, &["apply", path_arg(&a)]);
    assert!(out.stdout.contains("(generation 1)"), "{out}");
    let table_a = normalized_ruleset(w.nft_json());
    assert!(w.tcp_connects(HOST_V4, 443) && !w.tcp_connects(HOST2_V4, 443));

    let out = egress_fence_ok(&w, &["apply", path_arg(&b)]);
    assert!(out.stdout.contains("(generation 2)"), "{out}");
    let table_b = normalized_ruleset(w.nft_json());
    assert!(!w.tcp_connects(HOST_V4, 443) && w.tcp_connects(HOST2_V4, 443));

    // A's name moves meanwhile: a rollback reinstates what A's generation installed, not a
    // new resolution of it.
    w.dns_set("a.example.com", &[HOST3_V4], DEFAULT_DNS_TTL);
    let out = egress_fence_ok(&w, &["rollback"]);
    assert!(
        out.stdout
            .contains("rolled back to generation 1, recorded as generation 3"),
        "{out}"
    );
    assert_eq!(
        normalized_ruleset(w.nft_json()),
        table_a,
        "the rollback installs exactly generation 1's table"
    );
    assert!(
        w.tcp_connects(HOST_V4, 443),
        "A's address is reachable again"
    );
    assert!(!w.tcp_connects(HOST2_V4, 443), "B's is not");
    assert!(!w.tcp_connects(HOST3_V4, 443), "nor A's new answer");

    // --to picks an older generation.
    let out = egress_fence_ok(&w, &["rollback", "--to", "2"]);
    assert!(out.stdout.contains("rolled back to generation 2"), "{out}");
    assert_eq!(normalized_ruleset(w.nft_json()), table_b);
    assert!(!w.tcp_connects(HOST_V4, 443) && w.tcp_connects(HOST2_V4, 443));

    // A plain rollback undoes the last change, a rollback included.
    let out = egress_fence_ok(&w, &["rollback", "--json"]);
    let out = stdout_json(&out);
    assert_eq!(out["reinstated"], 3);
    assert_eq!(out["generation"], 5);
    assert_eq!(out["changed"], true);
    assert_eq!(normalized_ruleset(w.nft_json()), table_a);

    assert_eq!(
        generations(&w),
        vec![
            gen_apply(1),
            gen_apply(2),
            (3, "rollback".into(), Some(1)),
            (4, "rollback".into(), Some(2)),
            (5, "rollback".into(), Some(3)),
        ]
    );
    let history = egress_fence_ok(&w, &["history"]).stdout;
    assert!(history.contains("rollback to 1"), "{history}");
    assert!(
        history.contains(path_arg(&a)) && history.contains(path_arg(&b)),
        "{history}"
    );

    // Nothing before the oldest, nothing that was never recorded.
    let out = w.egress_fence(&["rollback", "--to", "9"]);
    assert_eq!(out.code(), 1, "{out}");
    assert!(
        out.stderr.contains("there is no generation 9 in")
            && out.stderr.contains("generations 1 to 5"),
        "{out}"
    );
}

#[test]
fn diff_shows_the_change_with_honest_exit_codes_and_apply_is_idempotent() {
    let (w, a, b) = world();

    let out = w.egress_fence(&["diff", path_arg(&a)]);
    assert_eq!(
        out.code(),
        1,
        "nothing installed: everything would change: {out}"
    );
    assert!(
        out.stdout
            .contains("table inet egress_fence: not installed"),
        "{out}"
    );

    egress_fence_ok(&w, &["apply", path_arg(&a)]);
    let handle = w.table_handle();
    let out = w.egress_fence(&["diff", path_arg(&a)]);
    assert_eq!(out.code(), 0, "{out}");
    assert!(out.stdout.contains("no changes"), "{out}");

    let out = w.egress_fence(&["diff", path_arg(&b)]);
    assert_eq!(out.code(), 1, "{out}");
    assert!(
        out.stdout.contains(
            "set resolved4: +1 -1 elements\n  + 192.0.2.11 . tcp . 443\n  - 192.0.2.10 . tcp . 443\n"
        ),
        "{out}"
    );
    let out = w.egress_fence(&["diff", path_arg(&b), "--json"]);
    assert_eq!(out.code(), 1, "{out}");
    let v = stdout_json(&out);
    assert_eq!(v["changed"], true);
    assert_eq!(v["differences"]["sets"][0]["name"], "resolved4");
    assert_eq!(
        v["differences"]["sets"][0]["added"][0],
        "192.0.2.11 . tcp . 443"
    );
    assert_eq!(v["differences"]["chains"], Value::Array(vec![]));
    assert_eq!(w.table_handle(), handle, "diff changes nothing");

    // Applying what is already live sends nothing and records nothing.
    let out = egress_fence_ok(&w, &["apply", path_arg(&a)]);
    assert!(out.stdout.contains("unchanged"), "{out}");
    let v = stdout_json(&egress_fence_ok(&w, &["apply", path_arg(&a), "--json"]));
    assert_eq!(v["changed"], false);
    assert_eq!(v["generation"], 1);
    assert_eq!(v["recorded"], Value::Null);
    assert_eq!(
        w.table_handle(),
        handle,
        "an unchanged apply must not reload the table"
    );
    assert_eq!(generations(&w), vec![gen_apply(1)]);

    let v = stdout_json(&egress_fence_ok(&w, &["apply", path_arg(&b), "--json"]));
    assert_eq!(v["changed"], true);
    assert_eq!(v["generation"], 2);
    assert_eq!(
        v["differences"]["sets"][0]["removed"][0],
        "192.0.2.10 . tcp . 443"
    );

    // An invalid policy is 2, as everywhere; a comparison that could not run is 6, never
    // "changed".
    let bad = w.write_file("bad.yaml", "version: 1\nallow: [\n");
    assert_eq!(w.egress_fence(&["diff", path_arg(&bad)]).code(), 2);
    let missing_ns = format!("{}-no-such-namespace", w.sandbox_name());
    let out = Command::new(EGRESS_FENCE_BIN)
        .args(["diff", path_arg(&a), "--netns", &missing_ns])
        .env(STATE_DIR_ENV, w.state_dir())
        .output()
        .expect("run egress-fence");
    assert_eq!(
        out.status.code(),
        Some(6),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_hand_edit_is_reported_by_status_and_undone_by_apply() {
    let (w, a, _) = world();
    let _ssh = w.listen_tcp(OTHER_V4, 22);
    egress_fence_ok(&w, &["apply", path_arg(&a)]);
    let out = egress_fence_ok(&w, &["status"]);
    assert!(
        out.stdout.contains("in sync with generation 1 (apply at "),
        "{out}"
    );

    // Someone opens a hole by hand.
    let edit = w.sandbox_cmd(&[
        "nft",
        "add",
        "element",
        "inet",
        "egress_fence",
        "allow4",
        "{ 203.0.113.10 . tcp . 22 }",
    ]);
    assert!(edit.success(), "{edit}");
    assert!(w.tcp_connects(OTHER_V4, 22), "the hand edit opened a hole");

    let out = egress_fence_ok(&w, &["status"]);
    assert!(out.stdout.contains("DRIFT from generation 1"), "{out}");
    assert!(
        out.stdout
            .contains("set allow4: +0 -1 elements\n    - 203.0.113.10 . tcp . 22"),
        "{out}"
    );
    let v = stdout_json(&egress_fence_ok(&w, &["status", "--json"]));
    assert_eq!(v["drift"], true);
    assert_eq!(v["generation"]["generation"], 1);
    assert_eq!(
        v["differences"]["sets"][0]["removed"][0],
        "203.0.113.10 . tcp . 22"
    );

    let out = egress_fence_ok(&w, &["apply", path_arg(&a)]);
    assert!(out.stdout.contains("set allow4: +0 -1 elements"), "{out}");
    assert!(!w.tcp_connects(OTHER_V4, 22), "apply closed the hole");
    let out = egress_fence_ok(&w, &["status"]);
    assert!(out.stdout.contains("in sync with generation 2"), "{out}");
    assert_eq!(
        stdout_json(&egress_fence_ok(&w, &["status", "--json"]))["drift"],
        false
    );
}

#[test]
fn an_unconfirmed_change_reverts_by_itself_and_a_confirmed_one_stays() {
    let (w, a, b) = world();
    let _a = w.listen_tcp(HOST_V4, 443);
    let _b = w.listen_tcp(HOST2_V4, 443);
    egress_fence_ok(&w, &["apply", path_arg(&a)]);

    let out = egress_fence_ok(&w, &["apply", path_arg(&b), "--confirm-within", "2s"]);
    assert!(
        out.stdout
            .contains("generation 2 reverts to generation 1 at "),
        "{out}"
    );
    let confirm_hint = format!("egress-fence confirm --netns {}", w.sandbox_name());
    assert!(out.stdout.contains(&confirm_hint), "{out}");
    assert!(
        w.tcp_connects(HOST2_V4, 443),
        "B is live until the deadline"
    );

    // The timer depends on no terminal: a session of its own, none controlling it, and
    // (its first stage having left) it leads none, so it can never gain one.
    let timers = revert_timers(&w);
    assert_eq!(timers.len(), 1, "one revert timer: {timers:?}");
    let (session, tty) = session_and_tty(timers[0]);
    let (test_session, _) = session_and_tty(std::process::id());
    assert_ne!(session, test_session, "the timer left the caller's session");
    assert_ne!(session, timers[0], "the timer leads no session");
    assert_eq!(tty, 0, "and has no controlling terminal");
    let stdin = fs::read_link(format!("/proc/{}/fd/0", timers[0])).expect("its stdin");
    assert_eq!(stdin, Path::new("/dev/null"));

    assert!(
        within(Duration::from_secs(8), || live_is(&w, &a)),
        "generation 2 was never reverted:\n{}",
        revert_timer_log(&w)
    );
    assert!(w.tcp_connects(HOST_V4, 443) && !w.tcp_connects(HOST2_V4, 443));
    assert_eq!(
        generations(&w),
        vec![gen_apply(1), gen_apply(2), (3, "revert".into(), Some(1))]
    );
    assert!(
        revert_timer_log(&w).contains("not confirmed: reverted to generation 1"),
        "{}",
        revert_timer_log(&w)
    );
    let late = w.egress_fence(&["confirm"]);
    assert_eq!(late.code(), 1, "{late}");
    assert!(late.stderr.contains("too late"), "{late}");

    // Nothing to change, nothing to confirm.
    let out = egress_fence_ok(&w, &["apply", path_arg(&a), "--confirm-within", "2s"]);
    assert!(
        out.stdout.contains("unchanged") && out.stdout.contains("nothing awaits confirmation"),
        "{out}"
    );
    assert!(revert_timers(&w).is_empty());

    // Confirmed in time: it stays.
    let out = egress_fence_ok(&w, &["apply", path_arg(&b), "--confirm-within", "2s"]);
    assert!(
        out.stdout.contains("generation 4 reverts to generation 3"),
        "{out}"
    );
    let out = egress_fence_ok(&w, &["confirm"]);
    assert!(out.stdout.contains("confirmed generation 4"), "{out}");
    assert!(
        within(Duration::from_secs(3), || revert_timers(&w).is_empty()),
        "the timer did not stand down"
    );
    thread::sleep(Duration::from_millis(2500));
    assert!(live_is(&w, &b), "a confirmed change must stay");
    assert_eq!(generations(&w).len(), 4, "no revert after the confirmation");
    let out = egress_fence_ok(&w, &["confirm"]);
    assert!(out.stdout.contains("nothing awaits confirmation"), "{out}");
}

#[test]
fn pending_changes_revert_to_the_last_confirmed_generation() {
    let (w, a, b) = world();
    w.dns_set("c.example.com", &[HOST3_V4], DEFAULT_DNS_TTL);
    let c = w.write_file("c.yaml", &policy("c.example.com"));
    egress_fence_ok(&w, &["apply", path_arg(&a)]);
    let out = egress_fence_ok(&w, &["apply", path_arg(&b), "--confirm-within", "30s"]);
    assert!(
        out.stdout.contains("generation 2 reverts to generation 1"),
        "{out}"
    );
    // Generation 2 was never confirmed: a second change reverts to 1, not to 2, and the
    // first timer stands down.
    let out = egress_fence_ok(&w, &["apply", path_arg(&c), "--confirm-within", "2s"]);
    assert!(
        out.stdout.contains("generation 3 reverts to generation 1"),
        "{out}"
    );
    assert!(
        within(Duration::from_secs(3), || revert_timers(&w).len() == 1),
        "{:?}",
        revert_timers(&w)
    );
    // A plain apply meanwhile is told that the pending revert undoes it too.
    let out = egress_fence_ok(&w, &["apply", path_arg(&b)]);
    assert!(
        out.stderr
            .contains("warning: generation 3 awaits confirmation: it reverts to generation 1"),
        "{out}"
    );
    assert!(
        within(Duration::from_secs(8), || live_is(&w, &a)),
        "never reverted:\n{}",
        revert_timer_log(&w)
    );
    let last = generations(&w).pop();
    assert_eq!(last, Some((5, "revert".into(), Some(1))));
}

#[test]
fn an_unconfirmed_change_reverts_even_when_apply_is_killed_right_after_applying() {
    let (w, a, b) = world();
    egress_fence_ok(&w, &["apply", path_arg(&a)]);
    // The fault injection kills `apply` (SIGKILL) once the kernel has B and while it writes
    // generation 2: after the timer is armed and the table applied, before anything else.
    let out = w.egress_fence_with_env(
        &["apply", path_arg(&b), "--confirm-within", "2s"],
        &[("EGRESS_FENCE_TEST_CRASH_BEFORE_RENAME", "1")],
    );
    assert_eq!(out.code(), 128 + 9, "apply should have been killed: {out}");
    assert!(live_is(&w, &b), "the kernel had B when apply died");
    assert!(
        within(Duration::from_secs(8), || live_is(&w, &a)),
        "the change was never reverted:\n{}",
        revert_timer_log(&w)
    );
    // Generation 2 was never recorded, and its number is not reused by the revert.
    assert_eq!(
        generations(&w),
        vec![gen_apply(1), (3, "revert".into(), Some(1))]
    );
    assert!(leftovers(&w).is_empty(), "{:?}", leftovers(&w));
}

#[test]
fn without_an_earlier_generation_the_revert_deletes_the_table() {
    let (w, a, _) = world();
    let out = egress_fence_ok(&w, &["apply", path_arg(&a), "--confirm-within", "2s"]);
    assert!(
        out.stdout.contains("replaced no table") && out.stdout.contains("DELETED"),
        "{out}"
    );
    assert!(
        within(Duration::from_secs(8), || w
            .egress_fence(&["status"])
            .code()
            == 4),
        "the table was not deleted:\n{}",
        revert_timer_log(&w)
    );
    let out = egress_fence_ok(&w, &["history"]);
    assert!(
        out.stdout.contains("generation 1 was not confirmed by")
            && out.stdout.contains("the table was deleted"),
        "{out}"
    );
    let late = w.egress_fence(&["confirm"]);
    assert_eq!(late.code(), 1, "{late}");
    assert!(late.stderr.contains("the table was deleted"), "{late}");
}

fn kill_revert_timer(w: &World) {
    let timer = the_revert_timer(w);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(timer as i32), Signal::SIGKILL)
        .expect("kill the revert timer");
    assert!(
        within(Duration::from_secs(3), || revert_timers(w).is_empty()),
        "the timer did not die"
    );
}

#[test]
fn a_killed_revert_timer_is_reported_and_the_next_command_carries_out_its_revert() {
    let (w, a, b) = world();
    egress_fence_ok(&w, &["apply", path_arg(&a)]);
    egress_fence_ok(&w, &["apply", path_arg(&b), "--confirm-within", "3s"]);
    kill_revert_timer(&w);

    // Before the deadline: said, and when the revert will happen after all.
    let out = egress_fence_ok(&w, &["status"]);
    assert!(
        out.stdout
            .contains("generation 2 awaits confirmation until")
            && out.stdout.contains("the revert timer is gone"),
        "{out}"
    );
    thread::sleep(Duration::from_millis(3500));
    let out = egress_fence_ok(&w, &["status"]);
    assert!(
        out.stdout
            .contains("the revert timer is gone; the revert is overdue"),
        "{out}"
    );
    assert!(!out.stdout.contains("in 0 s"), "{out}");
    let status = stdout_json(&egress_fence_ok(&w, &["status", "--json"]));
    let pending = &status["pending_confirmation"];
    assert_eq!(pending["revert_timer_alive"], false, "{status}");
    assert_eq!(pending["revert_overdue"], true, "{status}");
    assert!(live_is(&w, &b), "status changes nothing");

    // A late confirm: too late, and the revert it finds due is carried out now.
    let late = w.egress_fence(&["confirm"]);
    assert_eq!(late.code(), 1, "{late}");
    assert!(
        late.stderr.contains("too late") && late.stderr.contains("reverted it now"),
        "{late}"
    );
    assert!(!late.stdout.contains("stands down"), "{late}");
    assert!(live_is(&w, &a), "the revert was not carried out");
    assert_eq!(
        generations(&w),
        vec![gen_apply(1), gen_apply(2), (3, "revert".into(), Some(1))]
    );
    let out = egress_fence_ok(&w, &["confirm"]);
    assert!(out.stdout.contains("nothing awaits confirmation"), "{out}");

    // The next apply carries it out just the same, says so, then applies.
    egress_fence_ok(&w, &["apply", path_arg(&b), "--confirm-within", "2s"]);
    kill_revert_timer(&w);
    thread::sleep(Duration::from_millis(2500));
    let out = egress_fence_ok(&w, &["apply", path_arg(&b)]);
    assert!(
        out.stderr
            .contains("warning: generation 4 was not confirmed by")
            && out
                .stderr
                .contains("reverted it now: reinstated generation 3, recorded as generation 5"),
        "{out}"
    );
    assert!(live_is(&w, &b));
    let history = generations(&w);
    assert_eq!(
        history[4..],
        [(5, "revert".into(), Some(3)), gen_apply(6)],
        "{history:?}"
    );
}

/// A step of the wall clock cannot be made in a test (it is the host's), so the record is
/// stepped instead: its wall-clock deadline set an hour back is what a wall clock that jumped
/// an hour ahead would see. Before, a plain `apply` then took the confirmation for abandoned
/// and dropped it silently; the boot-clock deadline that decides now has not moved.
#[test]
fn a_wall_clock_step_does_not_drop_a_pending_revert() {
    let (w, a, b) = world();
    egress_fence_ok(&w, &["apply", path_arg(&a)]);
    egress_fence_ok(&w, &["apply", path_arg(&b), "--confirm-within", "60s"]);
    let path = w.sandbox_state_dir().join("pending-confirm.json");
    let mut record: Value =
        serde_json::from_str(&fs::read_to_string(&path).expect("the record")).expect("JSON");
    let wall = record["deadline_unix_ms"]
        .as_u64()
        .expect("a wall deadline");
    record["deadline_unix_ms"] = (wall - 3_600_000).into();
    let stepped = w.sandbox_state_dir().join("stepped.json");
    fs::write(&stepped, record.to_string()).expect("write");
    fs::rename(&stepped, &path).expect("rename");

    let out = egress_fence_ok(&w, &["apply", path_arg(&a)]);
    assert!(
        out.stderr
            .contains("warning: generation 2 awaits confirmation: it reverts to generation 1"),
        "{out}"
    );
    let out = egress_fence_ok(&w, &["status"]);
    assert!(
        out.stdout.contains("generation 2 awaits confirmation"),
        "{out}"
    );
    assert!(path.exists(), "the pending revert was dropped");
    let out = egress_fence_ok(&w, &["confirm"]);
    assert!(out.stdout.contains("confirmed generation 2"), "{out}");
    assert!(
        within(Duration::from_secs(3), || revert_timers(&w).is_empty()),
        "the timer did not stand down"
    );
}

/// A table installed from another state directory (so no generation here describes it) is
/// what a revert puts back, never nothing.
#[test]
fn a_revert_puts_back_a_table_it_did_not_make() {
    let (w, a, b) = world();
    let elsewhere = w.dir().join("elsewhere");
    egress_fence_ok(
        &w,
        &["apply", path_arg(&a), "--state-dir", path_arg(&elsewhere)],
    );
    let out = egress_fence_ok(&w, &["apply", path_arg(&b), "--confirm-within", "2s"]);
    assert!(
        out.stdout.contains(
            "generation 1 reverts to the table inet egress_fence that was live before it"
        ),
        "{out}"
    );
    assert!(!out.stdout.contains("DELETED"), "{out}");
    assert!(
        within(Duration::from_secs(8), || live_is(&w, &a)),
        "the table that was there was not put back:\n{}",
        revert_timer_log(&w)
    );
    let _a = w.listen_tcp(HOST_V4, 443);
    let _b = w.listen_tcp(HOST2_V4, 443);
    assert!(w.tcp_connects(HOST_V4, 443) && !w.tcp_connects(HOST2_V4, 443));
    assert_eq!(
        generations(&w),
        vec![gen_apply(1)],
        "the revert is no generation"
    );
    let late = w.egress_fence(&["confirm"]);
    assert_eq!(late.code(), 1, "{late}");
    assert!(late.stderr.contains("live before it"), "{late}");
}

#[test]
fn concurrent_writers_are_serialised_by_the_lock() {
    let (w, a, b) = world();
    // Hold the sandbox's lock as another writer would, so both applies start while it is
    // busy and must queue behind it and then behind each other.
    fs::create_dir_all(w.sandbox_state_dir()).expect("create the state directory");
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(w.sandbox_state_dir().join("lock"))
        .expect("open the lock");
    let mut held = Flock::lock(file, FlockArg::LockExclusive).expect("take the lock");
    write!(held, "{} test", std::process::id()).expect("name the holder");

    let mut first = w.spawn_egress_fence(&["apply", path_arg(&a)]);
    let mut second = w.spawn_egress_fence(&["apply", path_arg(&b)]);
    let waiting = format!(
        "waiting for the lock held by pid {} (test)",
        std::process::id()
    );
    for writer in [&mut first, &mut second] {
        assert!(
            writer.wait_for_output(&waiting, Duration::from_secs(20)),
            "{}",
            writer.stderr()
        );
    }
    assert!(first.wait_timeout(Duration::from_millis(300)).is_none());
    assert!(second.wait_timeout(Duration::from_millis(10)).is_none());
    drop(held);

    let mut numbers = Vec::new();
    for (writer, policy) in [(&mut first, &a), (&mut second, &b)] {
        let status = writer.wait_timeout(Duration::from_secs(30));
        assert!(
            status.is_some_and(|s| s.success()),
            "{status:?}: {}",
            writer.stderr()
        );
        let out = writer.stdout();
        let number: u64 = out
            .split("(generation ")
            .nth(1)
            .and_then(|rest| rest.split(')').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no generation in {out}"));
        numbers.push((number, policy.clone()));
    }
    numbers.sort();
    let got: Vec<u64> = numbers.iter().map(|(n, _)| *n).collect();
    assert_eq!(got, vec![1, 2], "one generation each, no number twice");
    assert_eq!(generations(&w), vec![gen_apply(1), gen_apply(2)]);
    assert!(
        live_is(&w, &numbers[1].1),
        "the writer that went second has the last word"
    );
}

#[test]
fn the_service_holds_the_lock_and_a_dead_holders_lock_is_taken_over() {
    let (w, a, b) = world();
    let service = w.write_file("service.yaml", &policy("a.example.com"));
    let mut daemon = w.spawn_egress_fence(&["run", path_arg(&service)]);
    assert!(
        daemon.wait_for_output("recorded generation 1", Duration::from_secs(10)),
        "{}",
        daemon.stderr()
    );
    assert!(
        daemon.wait_for_output("new addresses allowed", Duration::from_secs(10)),
        "{}",
        daemon.stderr()
    );
    // The daemon's resolved sets are its business: its refreshes are no drift.
    let out = egress_fence_ok(&w, &["status"]);
    assert!(
        out.stdout.contains("in sync with generation 1 (run at "),
        "{out}"
    );

    // A reload that applies is a generation.
    fs::write(&service, policy("b.example.com")).expect("rewrite the policy");
    daemon.signal(Signal::SIGHUP);
    assert!(
        daemon.wait_for_output("recorded generation 2", Duration::from_secs(10)),
        "{}",
        daemon.stderr()
    );

    let started = Instant::now();
    let out = w.egress_fence(&["apply", path_arg(&a), "--lock-timeout", "1s"]);
    assert_eq!(out.code(), 1, "{out}");
    let holder = format!("waiting for the lock held by pid {} (run)", daemon.pid());
    assert!(out.stderr.contains(&holder), "{out}");
    assert!(
        out.stderr.contains("systemctl reload egress-fence"),
        "{out}"
    );
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert!(live_is(&w, &b), "the service's table is untouched");

    // A holder killed outright leaves its lock to the kernel, which releases it.
    daemon.signal(Signal::SIGKILL);
    assert!(daemon.wait_timeout(Duration::from_secs(5)).is_some());
    let started = Instant::now();
    let out = egress_fence_ok(&w, &["apply", path_arg(&a)]);
    assert!(!out.stderr.contains("waiting"), "{out}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        generations(&w),
        vec![
            (1, "run".into(), None),
            (2, "run".into(), None),
            gen_apply(3)
        ]
    );
}

#[test]
fn the_state_directory_survives_a_crash_between_write_and_rename() {
    let (w, a, b) = world();
    egress_fence_ok(&w, &["apply", path_arg(&a)]);
    let out = w.egress_fence_with_env(
        &["apply", path_arg(&b)],
        &[("EGRESS_FENCE_TEST_CRASH_BEFORE_RENAME", "1")],
    );
    assert_eq!(out.code(), 128 + 9, "apply should have been killed: {out}");
    let left = leftovers(&w);
    assert!(
        left.len() == 1 && left[0].starts_with(".gen-000002.json."),
        "{left:?}"
    );

    // The record is whole: generation 1, and no trace of a torn generation 2.
    assert_eq!(generations(&w), vec![gen_apply(1)]);
    let history = egress_fence_ok(&w, &["history"]).stdout;
    assert!(!history.contains("CORRUPT"), "{history}");
    // The kernel got B before the crash: status says so instead of trusting the record.
    let out = egress_fence_ok(&w, &["status"]);
    assert!(out.stdout.contains("DRIFT from generation 1"), "{out}");

    let out = egress_fence_ok(&w, &["apply", path_arg(&b)]);
    assert!(
        out.stdout.contains("unchanged") && out.stdout.contains("recorded as generation 2"),
        "{out}"
    );
    assert!(leftovers(&w).is_empty(), "{:?}", leftovers(&w));
    assert_eq!(generations(&w), vec![gen_apply(1), gen_apply(2)]);
    assert!(
        egress_fence_ok(&w, &["status"])
            .stdout
            .contains("in sync with generation 2")
    );
}

#[test]
fn a_corrupt_generation_is_reported_and_never_used() {
    let (w, a, b) = world();
    for policy in [&a, &b, &a] {
        egress_fence_ok(&w, &["apply", path_arg(policy)]);
    }
    let second = w.sandbox_state_dir().join("gen-000002.json");
    let text = fs::read_to_string(&second).expect("read generation 2");
    fs::write(&second, &text[..text.len() / 2]).expect("tear generation 2");

    let history = egress_fence_ok(&w, &["history"]).stdout;
    let listed = format!("     2  CORRUPT: {}:", second.display());
    assert!(history.contains(&listed), "{history}");
    let v = stdout_json(&egress_fence_ok(&w, &["history", "--json"]));
    assert!(v["generations"][1]["corrupt"].is_string(), "{v}");
    assert_eq!(v["generations"][2]["generation"], 3);

    // Neither named nor as "the previous one" is it used, or skipped in silence.
    for args in [vec!["rollback", "--to", "2"], vec!["rollback"]] {
        let out = w.egress_fence(&args);
        assert_eq!(out.code(), 1, "{args:?}: {out}");
        assert!(
            out.stderr.contains("generation 2")
                && out.stderr.contains("gen-000002.json")
                && out.stderr.contains("corrupt"),
            "{args:?}: {out}"
        );
        assert!(live_is(&w, &a), "a refused rollback changed the table");
    }
    let out = egress_fence_ok(&w, &["rollback", "--to", "1"]);
    assert!(
        out.stdout.contains(
            "the table already matched generation 1; recorded the rollback as generation 4"
        ),
        "{out}"
    );

    // A corrupt newest generation: status says it cannot tell drift.
    fs::write(w.sandbox_state_dir().join("gen-000004.json"), "{}").expect("corrupt 4");
    let out = egress_fence_ok(&w, &["status"]);
    assert!(
        out.stdout.contains("cannot check for drift: generation 4"),
        "{out}"
    );
}
