//! The policy file `run` reads again on every reload is the fence's own configuration: a
//! fenced user who may change it, or a directory or link on the way to it, would widen the
//! fence at the next reload (a policy kept in the agent's project, or a directory handed to
//! it later). `run` refuses such a file at start (the namespace stays closed) and on reload
//! (the running policy stays).

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::unix::fs::chown;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::common::*;

fn connects(w: &World, addr: IpAddr, port: u16) -> bool {
    w.in_sandbox_ns(|| {
        TcpStream::connect_timeout(&SocketAddr::new(addr, port), Duration::from_millis(500)).is_ok()
    })
}

/// `conf/policy.yaml` under the world's directory (which `nobody` may pass through, not
/// write), allowing `name`; the directory belongs to root.
fn policy_dir(w: &World, name: &str) -> (PathBuf, PathBuf) {
    let dir = roots_dir_nobody_may_reach(w, "conf", 0o755);
    let path = dir.join("policy.yaml");
    std::fs::write(&path, policy_allowing(name)).expect("write the policy");
    (dir, path)
}

/// The fenced user replaces the policy with one allowing `name`, as it may in `dir`.
fn rewritten_by_nobody(w: &World, dir: &Path, name: &str) {
    let script = format!(
        "printf '%s' '{}' > {dir}/new.yaml && mv -f {dir}/new.yaml {dir}/policy.yaml",
        policy_allowing(name),
        dir = dir.display()
    );
    let out = w.adversary_cmd(Adversary::Nobody, &["sh", "-c", &script]);
    assert!(out.success(), "nobody could not rewrite the policy: {out}");
}

#[test]
fn a_policy_in_a_directory_the_fenced_user_owns_is_refused_at_start_and_the_host_stays_closed() {
    let w = World::new();
    w.dns_set("old.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    let _old = w.listen_tcp(HOST_V4, 443);
    let (dir, path) = policy_dir(&w, "old.example.com");
    chown(&dir, Some(NOBODY), Some(NOBODY)).expect("chown conf");

    let mut daemon = w.spawn_egress_fence(&["run", path.to_str().expect("utf-8 path")]);
    let status = daemon.wait_timeout(Duration::from_secs(15));
    let stderr = daemon.stderr();
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(2),
        "run did not refuse a policy in nobody's directory:\n{stderr}"
    );
    assert!(
        stderr.contains(&format!("{} belongs to uid {NOBODY}", dir.display())),
        "{stderr}"
    );
    assert!(w.table_handle().is_some(), "no fail-closed table: {stderr}");
    assert!(!connects(&w, HOST_V4, 443), "the host is open: {stderr}");

    // `check` says so too, and still validates the policy.
    let out = std::process::Command::new(EGRESS_FENCE_BIN)
        .args(["check", path.to_str().expect("utf-8 path")])
        .output()
        .expect("run check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("`run` refuses a policy file"), "{stderr}");
}

#[test]
fn a_policy_the_fenced_user_rewrote_is_not_reloaded() {
    let w = World::new();
    let _listeners = old_and_new_names_listened_on(&w);
    let (dir, path) = policy_dir(&w, "old.example.com");
    let mut daemon = run_started(&w, &path);
    assert!(within(Duration::from_secs(5), || connects(
        &w, HOST_V4, 443
    )));

    // The directory is handed to the agent's user after the service started.
    chown(&dir, Some(NOBODY), Some(NOBODY)).expect("chown conf");
    rewritten_by_nobody(&w, &dir, "new.example.com");
    daemon.signal(Signal::SIGHUP);
    assert!(
        daemon.wait_for_output("the running one stays", Duration::from_secs(10)),
        "the rewritten policy was not refused:\n{}",
        daemon.stderr()
    );
    assert!(
        daemon
            .stderr()
            .contains(&format!("belongs to uid {NOBODY}")),
        "{}",
        daemon.stderr()
    );
    assert!(
        !within(Duration::from_secs(3), || connects(&w, HOST2_V4, 443)),
        "the fenced user's policy was adopted:\n{}",
        daemon.stderr()
    );
    assert!(connects(&w, HOST_V4, 443), "{}", daemon.stderr());
    assert!(daemon.terminate().success(), "{}", daemon.stderr());
}
