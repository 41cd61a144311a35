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
    std::fs::set_permissions(w.dir(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let shared = w.dir().join("shared");
    std::fs::create_dir(&shared).expect("mkdir shared");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
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
    let replay = || {
        Command::new(EGRESS_FENCE_BIN)
            .args(["replay", path_arg(&path), path_arg(&policy)])
            .output()
            .expect("run replay")
    };
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
