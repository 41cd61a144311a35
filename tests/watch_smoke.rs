//! End to end for `watch`: real packets refused by a real nftables rule with `log group N` in a
//! throwaway network namespace, read back through [`Watcher`].
//!
//! Each test makes its own namespace `eftw-<pid>-<tag>` (lo up, a veth pair, documentation
//! addresses and routes, a tiny ruleset) and deletes it on drop, even when the test panics.
//! Nothing is configured in the root network namespace. Needs root, `ip`, `nft`, `nc`
//! (netcat-openbsd) and `setpriv` (util-linux); without root the tests fail, never skip.

use std::fs::File;
use std::net::IpAddr;
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use egress_fence::watch::{DropEvent, WatchError, Watcher};
use nix::sched::{CloneFlags, setns};

const GROUP: u16 = 7;
const TARGET_V4: &str = "203.0.113.9";
const TARGET_V6: &str = "2001:db8::9";
const SANDBOX_V4: &str = "198.51.100.2";
const SANDBOX_V6: &str = "2001:db8::2";

/// The rules under test: the same shape as the policy's refused chain (log to a group, then
/// refuse), for one IPv4 and one IPv6 destination, and one input rule whose packets carry a
/// kernel timestamp.
const RULESET: &str = r#"
table inet eftw {
    chain output {
        type filter hook output priority 0; policy accept;
        ip daddr 203.0.113.9 log prefix "T4: " group 7 drop
        ip6 daddr 2001:db8::9 log prefix "T6: " group 7 drop
    }
    chain input {
        type filter hook input priority 0; policy accept;
        udp dport 9 log prefix "IN: " group 7 drop
    }
}
"#;

/// Set by the parent of [`permission_child`] to the namespace it should try in.
const CHILD_ENV: &str = "EFTW_PERMISSION_CHILD_NETNS";

/// Concurrent first-time `ip netns add` calls race on /run/netns; serialise ours.
static NETNS_LOCK: Mutex<()> = Mutex::new(());

fn require_root() {
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "the watch smoke tests need root (they create network namespaces and nftables rules \
         inside them); they are never skipped"
    );
}

fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn run_ok(cmd: &mut Command) {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A network namespace that exists from `new` to drop.
struct Netns {
    name: String,
}

impl Netns {
    fn new(tag: &str) -> Netns {
        require_root();
        let name = format!("eftw-{}-{tag}", std::process::id());
        let _lock = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // The guard exists before the namespace does, so a half-made one is removed too.
        let ns = Netns { name };
        run_ok(Command::new("ip").args(["netns", "add", &ns.name]));
        ns
    }

    /// A namespace with lo up, a veth pair with the sandbox addresses, on-link routes to the
    /// targets (so packets to them reach the output hook) and [`RULESET`].
    fn sandbox(tag: &str) -> Netns {
        let ns = Netns::new(tag);
        for args in [
            "link set lo up",
            "link add v0 type veth peer name v1",
            "link set v0 up",
            "link set v1 up",
            &format!("addr add {SANDBOX_V4}/24 dev v0"),
            &format!("addr add {SANDBOX_V6}/64 dev v0 nodad"),
            &format!("route add {TARGET_V4}/32 dev v0"),
        ] {
            run_ok(
                Command::new("ip")
                    .args(["-n", &ns.name])
                    .args(args.split(' ')),
            );
        }
        let mut nft = Command::new("ip")
            .args(["netns", "exec", &ns.name, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot run nft");
        {
            use std::io::Write;
            let mut stdin = nft.stdin.take().expect("piped stdin");
            stdin.write_all(RULESET.as_bytes()).expect("write to nft");
        }
        let out = nft.wait_with_output().expect("nft");
        assert!(
            out.status.success(),
            "nft -f failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        ns
    }

    /// Runs `args` inside the namespace (with `ip netns exec`) and returns its output; failure
    /// is the expected outcome for traffic that is refused.
    fn exec(&self, args: &[&str]) -> Output {
        run(Command::new("timeout")
            .args(["10", "ip", "netns", "exec", &self.name])
            .args(args))
    }

    /// Runs `f` on a thread that has entered the namespace (setns is per thread).
    fn within<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
                setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
                f()
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _lock = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let out = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output();
        if let Ok(out) = out
            && !out.status.success()
        {
            eprintln!(
                "cannot delete netns {}: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("an IP address literal")
}

/// Reads events until every one of `wanted` (protocol, dport) was seen or `limit` passes.
fn collect(w: &mut Watcher, wanted: &[(&str, u16)], limit: Duration) -> Vec<DropEvent> {
    let deadline = Instant::now() + limit;
    let mut events = Vec::new();
    let seen_all = |events: &[DropEvent]| {
        wanted.iter().all(|(proto, port)| {
            events
                .iter()
                .any(|e| e.protocol == *proto && e.dport == Some(*port))
        })
    };
    while !seen_all(&events) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match w.next_event_timeout(left) {
            Ok(Some(e)) => {
                eprintln!("{e}\n{}", serde_json::to_string(&e).expect("json"));
                events.push(e);
            }
            Ok(None) => {}
            Err(e) => panic!("watch failed: {e}"),
        }
    }
    events
}

fn find<'a>(events: &'a [DropEvent], protocol: &str, dport: u16) -> &'a DropEvent {
    events
        .iter()
        .find(|e| e.protocol == protocol && e.dport == Some(dport))
        .unwrap_or_else(|| panic!("no {protocol} event to port {dport} in {events:#?}"))
}

#[test]
fn refused_packets_become_events() {
    let ns = Netns::sandbox("events");
    let events = ns.within(|| {
        let mut w = Watcher::subscribe(GROUP).expect("subscribe");
        assert_eq!(w.group(), GROUP);
        // TCP as root, UDP as nobody (65534), each from a fixed source port.
        ns.exec(&["nc", "-z", "-w1", "-p", "40001", TARGET_V4, "443"]);
        ns.exec(&[
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            &format!("echo x | nc -u -w1 -p 40002 {TARGET_V4} 53"),
        ]);
        ns.exec(&["nc", "-6", "-z", "-w1", "-p", "40003", TARGET_V6, "8443"]);
        ns.exec(&[
            "sh",
            "-c",
            &format!("echo x | nc -6 -u -w1 -p 40004 {TARGET_V6} 5353"),
        ]);
        collect(
            &mut w,
            &[("tcp", 443), ("udp", 53), ("tcp", 8443), ("udp", 5353)],
            Duration::from_secs(10),
        )
    });

    let tcp4 = find(&events, "tcp", 443);
    assert_eq!(tcp4.family, "ipv4");
    assert_eq!(tcp4.prefix, "T4: ");
    assert_eq!((tcp4.src, tcp4.dst), (ip(SANDBOX_V4), ip(TARGET_V4)));
    assert_eq!(tcp4.sport, Some(40001));
    assert_eq!((tcp4.uid, tcp4.gid), (Some(0), Some(0)));
    assert_eq!(tcp4.verdict, "refused");

    let udp4 = find(&events, "udp", 53);
    assert_eq!((udp4.family, udp4.prefix.as_str()), ("ipv4", "T4: "));
    assert_eq!((udp4.src, udp4.dst), (ip(SANDBOX_V4), ip(TARGET_V4)));
    assert_eq!(udp4.sport, Some(40002));
    assert_eq!((udp4.uid, udp4.gid), (Some(65534), Some(65534)));

    let tcp6 = find(&events, "tcp", 8443);
    assert_eq!((tcp6.family, tcp6.prefix.as_str()), ("ipv6", "T6: "));
    assert_eq!((tcp6.src, tcp6.dst), (ip(SANDBOX_V6), ip(TARGET_V6)));
    assert_eq!(tcp6.sport, Some(40003));
    assert_eq!(tcp6.uid, Some(0));
    assert!(
        tcp6.to_string()
            .contains("tcp [2001:db8::2]:40003 -> [2001:db8::9]:8443 uid=0 gid=0 T6:"),
        "{tcp6}"
    );

    let udp6 = find(&events, "udp", 5353);
    assert_eq!((udp6.src, udp6.dst), (ip(SANDBOX_V6), ip(TARGET_V6)));
    assert_eq!(udp6.sport, Some(40004));

    // Nothing but what the rules refused was reported.
    for e in &events {
        assert!(e.dst == ip(TARGET_V4) || e.dst == ip(TARGET_V6), "{e:?}");
        assert!(e.time.ends_with('Z') && e.time.len() == 24, "{}", e.time);
    }
}

#[test]
fn a_group_has_one_listener_and_is_released_on_drop() {
    let ns = Netns::sandbox("busy");
    ns.within(|| {
        let mut first = Watcher::subscribe(GROUP).expect("subscribe");
        match Watcher::subscribe(GROUP) {
            Err(e @ WatchError::GroupBusy { group: GROUP }) => {
                assert!(e.to_string().contains("already bound"), "{e}");
                assert!(!e.is_transient());
            }
            other => panic!("second listener on group {GROUP}: {other:?}"),
        }
        // Other groups are independent.
        Watcher::subscribe(GROUP + 1).expect("another group");

        // Nothing logged: the timeout is honoured.
        let start = Instant::now();
        let none = first
            .next_event_timeout(Duration::from_millis(200))
            .expect("wait");
        assert_eq!(none, None);
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_secs(2),
            "{waited:?}"
        );

        // Closing the socket frees the group: no explicit unbind needed.
        drop(first);
        let mut again = Watcher::subscribe(GROUP).expect("resubscribe after drop");
        ns.exec(&["nc", "-z", "-w1", "-p", "40005", TARGET_V4, "22"]);
        let events = collect(&mut again, &[("tcp", 22)], Duration::from_secs(10));
        assert_eq!(find(&events, "tcp", 22).sport, Some(40005));
    });
}

#[test]
fn without_cap_net_admin_the_bind_is_refused_clearly() {
    let ns = Netns::new("perm");
    // Re-run this test binary as root without CAP_NET_ADMIN (gone from the bounding set, so
    // exec does not grant it back); the child enters the namespace and tries to subscribe.
    let exe = std::env::current_exe().expect("current exe");
    let out = run(Command::new("setpriv")
        .args(["--inh-caps=-net_admin", "--bounding-set=-net_admin"])
        .arg(exe)
        .args([
            "--exact",
            "permission_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &ns.name));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child failed:\n{stdout}\n{stderr}"
    );
}

/// The child of [`without_cap_net_admin_the_bind_is_refused_clearly`]; does nothing when run
/// directly.
#[test]
fn permission_child() {
    let Ok(name) = std::env::var(CHILD_ENV) else {
        return;
    };
    let file = File::open(format!("/run/netns/{name}")).expect("open netns");
    setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
    match Watcher::subscribe(GROUP) {
        Err(e @ WatchError::Permission { group: GROUP }) => {
            let msg = e.to_string();
            assert!(msg.contains("CAP_NET_ADMIN"), "{msg}");
            eprintln!("as expected: {msg}");
        }
        other => panic!("subscribe without CAP_NET_ADMIN: {other:?}"),
    }
}

/// Milliseconds of the day of an RFC 3339 `...THH:MM:SS.mmmZ` time.
fn ms_of_day(time: &str) -> i64 {
    let t = &time[time.len() - 13..time.len() - 1];
    let n = |r: std::ops::Range<usize>| t[r].parse::<i64>().expect("a number");
    ((n(0..2) * 60 + n(3..5)) * 60 + n(6..8)) * 1000 + n(9..12)
}

#[test]
fn kernel_timestamps_are_used_when_present() {
    let ns = Netns::sandbox("stamp");
    let (input, output) = ns.within(|| {
        let mut w = Watcher::subscribe(GROUP).expect("subscribe");
        // To our own address: logged on input, where the kernel stamps the packet.
        ns.exec(&[
            "sh",
            "-c",
            &format!("echo x | nc -u -w1 -p 40006 {SANDBOX_V4} 9"),
        ]);
        std::thread::sleep(Duration::from_millis(700));
        // Logged on output, where it does not: the time is when it is read.
        ns.exec(&[
            "sh",
            "-c",
            &format!("echo x | nc -u -w1 -p 40007 {TARGET_V4} 53"),
        ]);
        let events = collect(&mut w, &[("udp", 9), ("udp", 53)], Duration::from_secs(10));
        (
            find(&events, "udp", 9).clone(),
            find(&events, "udp", 53).clone(),
        )
    });
    assert_eq!(input.prefix, "IN: ");
    assert_eq!(input.uid, None, "no socket on the input side");
    let gap = (ms_of_day(&output.time) - ms_of_day(&input.time)).rem_euclid(86_400_000);
    assert!(
        gap >= 600,
        "the input event's kernel time {} should precede the output event's {} by the sleep",
        input.time,
        output.time
    );
}

#[test]
fn a_listener_that_falls_behind_is_told_and_keeps_going() {
    let ns = Netns::sandbox("overrun");
    // Enough refused datagrams to fill the socket's receive buffer many times over (each log
    // message takes far more than 100 bytes of it).
    let rmem: usize = std::fs::read_to_string("/proc/sys/net/core/rmem_default")
        .expect("rmem_default")
        .trim()
        .parse()
        .expect("a number");
    let flood = (rmem / 100).clamp(5_000, 200_000);
    ns.within(|| {
        let mut w = Watcher::subscribe(GROUP).expect("subscribe");
        let socket = std::net::UdpSocket::bind("0.0.0.0:0").expect("udp socket");
        for _ in 0..flood {
            // Refused: every send fails with EPERM, and is logged.
            let _ = socket.send_to(b"x", (TARGET_V4, 53));
        }
        let (mut events, mut overruns) = (0, 0);
        loop {
            match w.next_event_timeout(Duration::from_millis(300)) {
                Ok(Some(_)) => events += 1,
                Ok(None) => break,
                Err(e @ WatchError::Overrun) => {
                    assert!(e.is_transient());
                    overruns += 1;
                }
                Err(e) => panic!("unexpected error: {e}"),
            }
        }
        assert!(
            events > 0 && overruns > 0,
            "{events} events, {overruns} overruns"
        );
        // The listener still works afterwards.
        let _ = socket.send_to(b"x", (TARGET_V4, 54));
        let events = collect(&mut w, &[("udp", 54)], Duration::from_secs(10));
        assert_eq!(find(&events, "udp", 54).uid, Some(0));
    });
}
