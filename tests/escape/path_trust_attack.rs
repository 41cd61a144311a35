//! Attacks on `path_trust`, the judgement of who else could change a file that `run` reloads
//! (its policy) or that `replay` gates on (a trace): the fenced user makes the walk find
//! nothing to judge, which it took for "nobody else can change this".

use std::os::unix::fs::{PermissionsExt, chown};
use std::process::Command;
use std::time::Duration;

use crate::common::*;

/// Waits (inotify) for ARGV[1] to be closed after a read, then unlinks it; prints `ready`
/// once watching and `unlinked` after.
const UNLINK_AFTER_READ: &str = r#"
import ctypes, os, sys
path = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init()
if fd < 0 or libc.inotify_add_watch(fd, path.encode(), 0x10) < 0:  # IN_CLOSE_NOWRITE
    print('no inotify', flush=True)
    sys.exit(1)
print('ready', flush=True)
os.read(fd, 4096)
os.unlink(path)
print('unlinked', flush=True)
"#;

/// A trace the fenced user wrote, in a directory where anyone may add files (as /tmp): replay
/// exits 7 for it while it is there, but the walk took a missing entry for a trusted one, so
/// the user who removes its trace once replay has read it (and before replay judges its
/// path) makes the gate pass on a trace only it wrote.
#[test]
fn a_trace_its_writer_removes_after_replay_read_it_still_passes_no_gate() {
    let w = World::new();
    let shared = roots_dir_nobody_may_reach(&w, "shared", 0o1777);
    let policy = w.write_file(
        "policy.yaml",
        "version: 1\nallow:\n  - domain: api.example\n    ports: [443]\ndns:\n  mode: guard\n  \
         upstream: [192.0.2.53]\n",
    );
    // Long enough that parsing and judging it outlast the unlink by far.
    let mut trace = String::from(
        r#"{"kind":"start","time":"2026-12-01T10:00:00.000Z","version":1,"mode":"guard","policy":"p.yaml","audit":false}
{"kind":"name","time":"2026-12-01T10:00:01.000Z","name":"api.example","qtype":"A","answer":"NOERROR","addrs":["192.0.2.7"],"ttl":60,"uid":65534}
"#,
    );
    for _ in 0..20_000 {
        trace.push_str(
            r#"{"kind":"flow","time":"2026-12-01T10:00:02.000Z","family":"ipv4","protocol":"tcp","dst":"192.0.2.7","dport":443,"uid":65534}"#,
        );
        trace.push('\n');
    }
    trace.push_str("{\"kind\":\"end\",\"time\":\"2026-12-01T10:00:05.000Z\"}\n");
    let path = shared.join("trace.jsonl");
    std::fs::write(&path, &trace).expect("write the trace");
    chown(&path, Some(NOBODY), Some(NOBODY)).expect("chown the trace");
    let replay = || replay(path_arg(&path), &policy);
    let out = replay();
    assert_eq!(
        out.status.code(),
        Some(7),
        "nobody's trace passed while it was there: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut watcher = w.spawn_adversary(
        Adversary::Nobody,
        &[PYTHON, "-c", UNLINK_AFTER_READ, path_arg(&path)],
    );
    assert!(
        watcher.wait_for_output("ready", Duration::from_secs(10)),
        "{}",
        watcher.stdout()
    );
    let out = replay();
    assert!(
        watcher.wait_for_output("unlinked", Duration::from_secs(10)),
        "{}",
        watcher.stdout()
    );
    assert_eq!(
        out.status.code(),
        Some(7),
        "a gate passed on a trace nobody wrote, removed once read: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Puts ARGV[2] (a policy) at ARGV[1] and takes it away again, as fast as it can, until
/// killed: prints `ready` once running.
const FLICKER: &str = r#"
import os, sys
path, text = sys.argv[1], sys.argv[2]
tmp = path + '.nobody'
print('ready', flush=True)
while True:
    with open(tmp, 'w') as f:
        f.write(text)
    os.rename(tmp, path)
    os.unlink(path)
"#;

/// Whether the sandbox connects to ADDR:443 within 200 ms.
fn connects(w: &World, addr: std::net::IpAddr) -> bool {
    w.in_sandbox_ns(|| {
        std::net::TcpStream::connect_timeout(
            &std::net::SocketAddr::new(addr, 443),
            Duration::from_millis(200),
        )
        .is_ok()
    })
}

/// `replay TRACE POLICY`.
fn replay(trace: &str, policy: &std::path::Path) -> std::process::Output {
    Command::new(EGRESS_FENCE_BIN)
        .args(["replay", trace, path_arg(policy)])
        .output()
        .expect("run replay")
}

/// A container (`ip netns exec` gives it a mount namespace of its own) where DIR is a tmpfs
/// holding NAME with TEXT, which anyone there may write; running once it is ready.
fn container_with_a_writable_file_over(
    w: &World,
    dir: &std::path::Path,
    name: &str,
    text: &str,
) -> Background {
    let script = format!(
        "mount -t tmpfs none {dir} && printf '%s' '{text}' > {dir}/{name} && chmod 666 \
         {dir}/{name} && echo ready && exec sleep 600",
        dir = path_arg(dir),
    );
    let mut container = w.spawn_in_sandbox(&["sh", "-c", &script]);
    assert!(
        container.wait_for_output("ready", Duration::from_secs(10)),
        "{}",
        container.stderr()
    );
    container
}

/// `run`'s policy in a directory where anyone may add files (as /tmp), root's, which the walk
/// passes. While the operator replaces it (removed, not yet written again), every reload
/// walked to a missing name, took that for "nobody else can change this" and then opened
/// the path again: the fenced user who puts its own file there in between is adopted.
#[test]
fn a_policy_missing_at_the_walk_and_put_there_by_nobody_before_the_read_is_not_adopted() {
    let w = World::new();
    let _listeners = old_and_new_names_listened_on(&w);
    let shared = roots_dir_nobody_may_reach(&w, "shared", 0o1777);
    let path = shared.join("policy.yaml");
    std::fs::write(&path, policy_allowing("old.example.com")).expect("write the policy");
    let mut daemon = run_started(&w, &path);
    assert!(within(Duration::from_secs(5), || connects(&w, HOST_V4)));

    // The operator's rewrite has removed the file and not yet written the new one.
    std::fs::remove_file(&path).expect("remove the policy");
    let mut flicker = w.spawn_adversary(
        Adversary::Nobody,
        &[
            PYTHON,
            "-c",
            FLICKER,
            path_arg(&path),
            &policy_allowing("new.example.com"),
        ],
    );
    assert!(
        flicker.wait_for_output("ready", Duration::from_secs(10)),
        "{}",
        flicker.stderr()
    );
    let mut adopted = false;
    for _ in 0..120 {
        daemon.signal(nix::sys::signal::Signal::SIGHUP);
        if within(Duration::from_millis(300), || connects(&w, HOST2_V4)) {
            adopted = true;
            break;
        }
    }
    let _ = flicker.terminate();
    let log = daemon.stderr();
    let _ = daemon.terminate();
    assert!(!adopted, "nobody's policy was adopted on a reload:\n{log}");
}

/// `check` run by the user who owns the policy (an operator trying it before installing it)
/// said nothing, since that user counted as the one egress-fence runs as; `run`, as root,
/// refuses that file. `check` must warn of what `run` will refuse.
#[test]
fn check_warns_of_a_file_run_refuses_whoever_runs_check() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mine = dir.path().join("mine");
    std::fs::create_dir(&mine).expect("mkdir");
    chown(&mine, Some(NOBODY), Some(NOBODY)).expect("chown");
    let path = mine.join("policy.yaml");
    std::fs::write(&path, policy_allowing("old.example.com")).expect("write");
    chown(&path, Some(NOBODY), Some(NOBODY)).expect("chown");
    let nobody = NOBODY.to_string();
    let out = Command::new("setpriv")
        .args([
            &format!("--reuid={nobody}"),
            &format!("--regid={nobody}"),
            "--clear-groups",
            EGRESS_FENCE_BIN,
            "check",
            path_arg(&path),
        ])
        .output()
        .expect("run check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("`run` refuses a policy file"), "{stderr}");
}

/// Root in a container (uid 0 without CAP_NET_ADMIN, no user namespace) is an adversary of
/// the threat model, but the files it writes are uid 0's, which `path_trust` trusts: a policy
/// kept in a directory such a container also mounts (the agent's project, say) passes the
/// check, and the container's rewrite is adopted at the next reload. Nothing in a file's
/// owner or mode tells host root from container root; the README now says to keep the
/// policy out of every container's mounts (or give containers a user namespace).
#[test]
#[ignore = "finding: uid 0 in a container is trusted as root; documented, not detectable by owner or mode"]
fn a_policy_root_in_a_container_rewrites_is_not_adopted() {
    let w = World::new();
    let _listeners = old_and_new_names_listened_on(&w);
    let project = roots_dir_nobody_may_reach(&w, "project", 0o755);
    let path = project.join("policy.yaml");
    std::fs::write(&path, policy_allowing("old.example.com")).expect("write the policy");
    let mut daemon = run_started(&w, &path);
    let script = format!(
        "printf '%s' '{}' > {}",
        policy_allowing("new.example.com"),
        path_arg(&path)
    );
    let out = w.adversary_cmd(Adversary::RootWithoutNetAdmin, &["sh", "-c", &script]);
    assert!(out.success(), "{out}");
    daemon.signal(nix::sys::signal::Signal::SIGHUP);
    let adopted = within(Duration::from_secs(5), || connects(&w, HOST2_V4));
    let log = daemon.stderr();
    let _ = daemon.terminate();
    assert!(!adopted, "root in a container widened the fence:\n{log}");
}

/// A path through a magic link of /proc (`/proc/PID/root`, as an operator may name a file of
/// a container's): the walk followed the link's text ("/") and judged the host's file of that
/// name, root's; the kernel follows the link to the container's root and `run` read the
/// container's file, which anyone there may write. What is read must be the file judged.
#[test]
fn a_policy_read_through_proc_pid_root_is_the_file_judged() {
    let w = World::new();
    let _listeners = old_and_new_names_listened_on(&w);
    let conf = roots_dir_nobody_may_reach(&w, "conf", 0o755);
    let host_file = conf.join("policy.yaml");
    std::fs::write(&host_file, policy_allowing("old.example.com")).expect("write");
    // The container: its own mounts, where `conf` is a tmpfs holding a policy anyone may
    // write.
    let mut container = container_with_a_writable_file_over(
        &w,
        &conf,
        "policy.yaml",
        &policy_allowing("old.example.com"),
    );
    let pid = container.pid().as_raw();
    let path = format!("/proc/{pid}/root{}", path_arg(&host_file));
    let mut daemon = w.spawn_egress_fence(&["run", &path]);
    let started = daemon.wait_for_output("new addresses allowed", Duration::from_secs(15));
    if started {
        // Nobody, in the container, rewrites the file `run` reads.
        let rewrite = format!(
            "printf '%s' '{}' > {}",
            policy_allowing("new.example.com"),
            path_arg(&host_file)
        );
        let pid = pid.to_string();
        let out = w.sandbox_cmd(&[
            "nsenter",
            "-t",
            &pid,
            "-m",
            "--",
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            &rewrite,
        ]);
        assert!(out.success(), "{out}");
        daemon.signal(nix::sys::signal::Signal::SIGHUP);
    }
    let adopted = started && within(Duration::from_secs(5), || connects(&w, HOST2_V4));
    let log = daemon.stderr();
    let _ = daemon.terminate();
    let _ = container.terminate();
    assert!(
        started || log.contains("opens another file than the one its path leads to"),
        "{log}"
    );
    assert!(
        !adopted,
        "nobody's policy, read through /proc/{pid}/root, was adopted:\n{log}"
    );
}

/// `replay` of a trace named through `/proc/PID/root` (a container's file): the walk judged
/// the host's file of that name, root's, while the trace read was the container's, which
/// anyone there may write; a gate passed on it.
#[test]
fn a_trace_read_through_proc_pid_root_passes_no_gate() {
    let w = World::new();
    let conf = roots_dir_nobody_may_reach(&w, "conf", 0o755);
    let trace = "{\"kind\":\"start\",\"time\":\"2026-12-01T10:00:00.000Z\",\"version\":1,\"mode\":\"guard\",\"policy\":\"p.yaml\",\"audit\":false}\n{\"kind\":\"end\",\"time\":\"2026-12-01T10:00:05.000Z\"}\n";
    let host_file = conf.join("trace.jsonl");
    std::fs::write(&host_file, trace).expect("write");
    let policy = w.write_file(
        "policy.yaml",
        "version: 1\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n",
    );
    let mut container = container_with_a_writable_file_over(&w, &conf, "trace.jsonl", trace);
    let path = format!(
        "/proc/{}/root{}",
        container.pid().as_raw(),
        path_arg(&host_file)
    );
    let out = replay(&path, &policy);
    let _ = container.terminate();
    assert_eq!(
        out.status.code(),
        Some(7),
        "a gate passed on a container's trace: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Holds ARGV[1] open for writing; on SIGUSR1 writes ARGV[2] through that descriptor.
const WRITE_LATER: &str = r#"
import os, signal, sys
f = open(sys.argv[1], 'r+')
def write(*_):
    f.seek(0)
    f.truncate()
    f.write(sys.argv[2])
    f.flush()
    print('written', flush=True)
signal.signal(signal.SIGUSR1, write)
print('ready', flush=True)
while True:
    signal.pause()
"#;

/// The agent proposes a policy in its own directory; the operator takes the directory and
/// file over (`chown root`, `chmod go-w`) and starts `run` on it, which judges every owner
/// and mode fine. But the agent opened the file for writing before, and a descriptor keeps
/// the access it was opened with: it rewrote the policy, adopted at the next reload. The
/// kernel tells whether anyone holds a file open for writing: it grants a read lease
/// (`F_SETLEASE`, `F_RDLCK`) only when no one does. `run` now refuses the file while the
/// agent holds it so (at start here: exit 2, the namespace closed), and takes it once the
/// descriptor is gone.
#[test]
fn a_policy_written_through_a_descriptor_opened_before_the_takeover_is_not_adopted() {
    let w = World::new();
    let _listeners = old_and_new_names_listened_on(&w);
    std::fs::set_permissions(w.dir(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let dir = w.dir().join("proposal");
    std::fs::create_dir(&dir).expect("mkdir");
    let path = dir.join("policy.yaml");
    std::fs::write(&path, policy_allowing("old.example.com")).expect("write");
    for p in [&dir, &path] {
        chown(p, Some(NOBODY), Some(NOBODY)).expect("chown");
    }
    let mut agent = w.spawn_adversary(
        Adversary::Nobody,
        &[
            PYTHON,
            "-c",
            WRITE_LATER,
            path_arg(&path),
            &policy_allowing("new.example.com"),
        ],
    );
    assert!(
        agent.wait_for_output("ready", Duration::from_secs(10)),
        "{}",
        agent.stderr()
    );
    // The operator takes the proposal over.
    for p in [&dir, &path] {
        chown(p, Some(0), Some(0)).expect("chown");
    }
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let mut daemon = w.spawn_egress_fence(&["run", path_arg(&path)]);
    let status = daemon.wait_timeout(Duration::from_secs(15));
    let log = daemon.stderr();
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(2),
        "run took a policy the agent holds open for writing:\n{log}"
    );
    assert!(log.contains("is held open for writing"), "{log}");
    // The agent writes through its descriptor now: nothing took it.
    agent.signal(nix::sys::signal::Signal::SIGUSR1);
    assert!(
        agent.wait_for_output("written", Duration::from_secs(10)),
        "{}",
        agent.stderr()
    );
    assert!(!connects(&w, HOST2_V4), "the agent's policy is up:\n{log}");
    // Once the descriptor is gone, the file is root's alone: taken.
    let _ = agent.terminate();
    std::fs::write(&path, policy_allowing("old.example.com")).expect("rewrite");
    let mut daemon = w.spawn_egress_fence(&["run", path_arg(&path)]);
    assert!(
        daemon.wait_for_output("new addresses allowed", Duration::from_secs(15)),
        "the daemon did not start once the writer was gone:\n{}",
        daemon.stderr()
    );
    assert!(within(Duration::from_secs(5), || connects(&w, HOST_V4)));
    assert!(!connects(&w, HOST2_V4));
    let _ = daemon.terminate();
}
