//! `egress-fence replay TRACE POLICY`: a handwritten trace judged against policies, its output
//! and exit codes. No network, no kernel, no root.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn egress_fence(args: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_egress-fence"))
        .arg("replay")
        .args(args)
        .output()
        .expect("run egress-fence")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A name the policy allows and connects to; one it does not, with an escape sequence in
/// its answer's record; a flow to the metadata service explained by the allowed name.
const TRACE: &str = r#"{"kind":"start","time":"2026-12-01T10:00:00.000Z","version":1,"mode":"guard","policy":"p.yaml","audit":true}
{"kind":"name","time":"2026-12-01T10:00:01.000Z","name":"api.example","qtype":"A","answer":"NOERROR","addrs":["192.0.2.7","169.254.169.254"],"ttl":60,"uid":1001}
{"kind":"flow","time":"2026-12-01T10:00:02.000Z","family":"ipv4","protocol":"tcp","dst":"192.0.2.7","dport":443,"uid":1001}
{"kind":"name","time":"2026-12-01T10:00:03.000Z","name":"evil\u001b[2J.example","qtype":"TXT","answer":"NOERROR","uid":1001}
{"kind":"flow","time":"2026-12-01T10:00:04.000Z","family":"ipv4","protocol":"tcp","dst":"169.254.169.254","dport":80,"uid":1001}
{"kind":"end","time":"2026-12-01T10:00:05.000Z"}
"#;

/// `trace` without the lines `drop` picks.
fn without_lines(trace: &str, drop: impl Fn(&str) -> bool) -> String {
    trace
        .lines()
        .filter(|l| !drop(l))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// [`TRACE`] without what a policy allowing `api.example` refuses.
fn allowed_only(trace: &str) -> String {
    without_lines(trace, |l| {
        l.contains("evil") || l.contains("\"dst\":\"169.254")
    })
}

const GUARD: &str = "dns:\n  mode: guard\n  upstream: [192.0.2.53]\n";

struct Files {
    _dir: tempfile::TempDir,
    trace: PathBuf,
    dir: PathBuf,
}

impl Files {
    fn new(trace: &str) -> Files {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("trace.jsonl");
        std::fs::write(&path, trace).expect("write trace");
        Files {
            trace: path,
            dir: dir.path().to_owned(),
            _dir: dir,
        }
    }

    fn policy(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, text).expect("write policy");
        path
    }
}

#[test]
fn refusals_exit_1_with_what_and_why() {
    let f = Files::new(TRACE);
    let policy = f.policy(
        "p.yaml",
        &format!(
            "version: 1\nallow:\n  - domain: api.example\n    ports: [443]\n  - domain: \
             \"*.pool.example\"\n    ports: [443]\ndeny:\n  - preset: cloud-metadata\n{GUARD}"
        ),
    );
    let out = egress_fence(&[&f.trace, &policy]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("(guard mode): 2 names asked, 2 flows: 1 allowed, 0 essential"),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "  evil\\u{1b}[2J.example (TXT): not a name a policy can allow; once, at \
             2026-12-01T10:00:03.000Z; uid 1001\n"
        ),
        "{stdout}"
    );
    assert!(!stdout.contains('\u{1b}'), "{stdout}");
    assert!(
        stdout.contains(
            "  tcp 169.254.169.254:80: denied: preset cloud-metadata; once, at \
             2026-12-01T10:00:04.000Z; names api.example; uid 1001\n"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("allow entries nothing in the trace used:\n  *.pool.example tcp 443\n"),
        "{stdout}"
    );

    let out = egress_fence(&[&f.trace, &policy, Path::new("--json")]);
    assert_eq!(out.status.code(), Some(1));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["refused_flows"][0]["why"]["reason"], "denied");
    assert_eq!(json["refused_flows"][0]["names"][0], "api.example");
    assert_eq!(json["unused"][0]["entry"], "*.pool.example tcp 443");
}

#[test]
fn nothing_refused_exits_0() {
    let trace = allowed_only(TRACE);
    let f = Files::new(&trace);
    let policy = f.policy(
        "p.yaml",
        &format!(
            "version: 1\ninclude: [npm]\nallow:\n  - domain: api.example\n    ports: [443]\n{GUARD}"
        ),
    );
    let out = egress_fence(&[&f.trace, &policy]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("nothing would have been refused"),
        "{stdout}"
    );
    assert!(
        stdout.contains("  registry.npmjs.org tcp 443 (include npm)\n"),
        "{stdout}"
    );
}

/// A trace that does not hold all its run did (records lost past its bounds, or no `end`
/// line: the run was killed) cannot pass a gate: nothing refused of what it holds exits 7,
/// and says what is missing; a refusal in what it holds still exits 1.
#[test]
fn an_incomplete_trace_exits_7_unless_it_shows_a_refusal() {
    let allowed = allowed_only(TRACE);
    let lost = allowed.replace(
        r#"{"kind":"end","time":"2026-12-01T10:00:05.000Z"}"#,
        r#"{"kind":"end","time":"2026-12-01T10:00:05.000Z","lost":3}"#,
    );
    assert_ne!(lost, allowed);
    let unended = without_lines(&allowed, |l| l.contains("\"kind\":\"end\""));
    let refused = without_lines(TRACE, |l| l.contains("\"kind\":\"end\""));
    let policy_text =
        format!("version: 1\nallow:\n  - domain: api.example\n    ports: [443]\n{GUARD}");
    for (trace, code, says) in [
        (&lost, 7, "but it lost 3 records"),
        (&unended, 7, "but it has no end line"),
        (&refused, 1, "no end line"),
    ] {
        let f = Files::new(trace);
        let policy = f.policy("p.yaml", &policy_text);
        let out = egress_fence(&[&f.trace, &policy]);
        let stdout = text(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{stdout}{}",
            text(&out.stderr)
        );
        assert!(stdout.contains(says), "{stdout}");
        let json = Command::new(env!("CARGO_BIN_EXE_egress-fence"))
            .arg("replay")
            .args([&f.trace, &policy])
            .arg("--json")
            .output()
            .expect("run egress-fence");
        assert_eq!(json.status.code(), Some(code));
        let report: serde_json::Value = serde_json::from_slice(&json.stdout).expect("JSON");
        assert_eq!(
            (report["lost"].as_u64(), report["ended"].as_bool()),
            (
                Some(if trace == &lost { 3 } else { 0 }),
                Some(trace == &lost)
            ),
            "{report}"
        );
    }
}

#[test]
fn a_bad_trace_or_policy_exits_2_with_where() {
    let f = Files::new(&TRACE.replace("\"dport\":443", "\"dport\":\"https\""));
    let policy = f.policy("p.yaml", "version: 1\n");
    let out = egress_fence(&[&f.trace, &policy]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    let at = format!("{}:3:", f.trace.display());
    assert!(stderr.contains(&at), "{stderr}");
    assert!(stderr.contains("record"), "{stderr}");
    assert!(out.stdout.is_empty());

    let missing = f.dir.join("missing.jsonl");
    let out = egress_fence(&[&missing, &policy]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("cannot read the trace"));

    // A FIFO at the trace's path (a gate replaying in a directory the sandbox can write) is
    // refused at once, not waited on.
    let fifo = f.dir.join("fifo.jsonl");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
    let mut replay = Command::new(env!("CARGO_BIN_EXE_egress-fence"))
        .arg("replay")
        .args([&fifo, &policy])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run egress-fence");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while replay.try_wait().expect("wait").is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let finished = replay.try_wait().expect("wait").is_some();
    if !finished {
        let _ = replay.kill();
    }
    let out = replay.wait_with_output().expect("output");
    assert!(finished, "replay waited on a FIFO");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("not a regular file"),
        "{}",
        text(&out.stderr)
    );

    let help = Command::new(env!("CARGO_BIN_EXE_egress-fence"))
        .args(["replay", "--help"])
        .output()
        .expect("run egress-fence");
    let help = text(&help.stdout);
    assert!(
        help.contains("Exit codes") && help.contains("replay: the policy would have refused"),
        "{help}"
    );

    let f = Files::new(TRACE);
    let bad = f.policy("bad.yaml", "version: 1\nallow:\n  - cidr: 10.0.0.0/33\n");
    let out = egress_fence(&[&f.trace, &bad]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("bad.yaml:3:11"), "{stderr}");
}

/// What an agent can make a trace hold (run --record writes what it asks and where it
/// connects): twenty long names answering its own address, then a connection attempt on
/// each of 20,000 ports. Every port is a refused group listing the twenty names: the report
/// must share them, not copy them per group (20,000 x 20 x 500 bytes), and is written as it
/// is made, not held whole. Also a bidi override and a lookalike letter in a name are shown
/// escaped.
#[test]
fn a_trace_shaped_to_amplify_is_reported_in_memory_bounded_by_the_trace() {
    let mut trace = String::from(
        r#"{"kind":"start","time":"2026-12-01T10:00:00.000Z","version":1,"mode":"guard","policy":"p.yaml"}"#,
    );
    trace.push('\n');
    let long = vec!["x".repeat(60); 8].join(".");
    for i in 0..20 {
        trace += &format!(
            r#"{{"kind":"name","time":"2026-12-01T10:00:01.000Z","name":"n{i}.{long}.evil.example","qtype":"A","answer":"NOERROR","addrs":["192.0.2.9"]}}"#
        );
        trace.push('\n');
    }
    trace += r#"{"kind":"name","time":"2026-12-01T10:00:01.000Z","name":"\u202eelpmaxe.\u0430pi","qtype":"TXT","answer":"NOERROR"}"#;
    trace.push('\n');
    for port in 1..=20_000 {
        trace += &format!(
            r#"{{"kind":"flow","time":"2026-12-01T10:00:02.000Z","family":"ipv4","protocol":"tcp","dst":"192.0.2.9","dport":{port}}}"#
        );
        trace.push('\n');
    }
    let f = Files::new(&trace);
    let policy = f.policy("p.yaml", &format!("version: 1\n{GUARD}"));
    for json in [false, true] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_egress-fence"));
        cmd.arg("replay").arg(&f.trace).arg(&policy);
        if json {
            cmd.arg("--json");
        }
        let status = cmd
            .stdout(std::process::Stdio::null())
            .status()
            .expect("run egress-fence");
        assert_eq!(status.code(), Some(1), "json: {json}");
    }
    // The largest child this test process waited for (the other tests' are small).
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
        .expect("getrusage");
    let max_rss_mb = usage.max_rss() / 1024;
    assert!(
        max_rss_mb < 150,
        "replay of a {} MB trace took {max_rss_mb} MB",
        trace.len() >> 20
    );

    let small: String = trace.lines().take(23).map(|l| format!("{l}\n")).collect();
    let f = Files::new(&small);
    let policy = f.policy("p.yaml", &format!("version: 1\n{GUARD}"));
    let out = egress_fence(&[&f.trace, &policy]);
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("  \\u{202e}elpmaxe.\\u{430}pi (TXT): "),
        "{stdout}"
    );
    assert!(stdout.is_ascii(), "{stdout}");
}

/// A sparse file of 2 GiB (8 GiB held one for more than 20 s at 6.6 GB) at the trace's path (which takes no disk, made in a directory the
/// sandbox can write) held a gate for minutes and grew it to gigabytes as replay read it
/// whole: a trace larger than any `run --record` and `learn` write over a few runs is refused
/// at once.
#[test]
fn a_trace_too_large_to_be_one_written_is_refused_at_once() {
    let f = Files::new(TRACE);
    let policy = f.policy("p.yaml", "version: 1\n");
    let huge = f.dir.join("huge.jsonl");
    std::fs::File::create(&huge)
        .and_then(|file| file.set_len(2 << 30))
        .expect("sparse file");
    let started = std::time::Instant::now();
    let mut replay = Command::new(env!("CARGO_BIN_EXE_egress-fence"))
        .arg("replay")
        .args([&huge, &policy])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run egress-fence");
    while replay.try_wait().expect("wait").is_none()
        && started.elapsed() < std::time::Duration::from_secs(10)
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let finished = replay.try_wait().expect("wait").is_some();
    if !finished {
        let _ = replay.kill();
    }
    let out = replay.wait_with_output().expect("output");
    assert!(finished, "replay read a 2 GiB trace");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("larger than"),
        "{}",
        text(&out.stderr)
    );
}

/// A trace that a user other than root (and the one replaying) could have changed since its
/// run wrote it may be a clean one swapped in: nothing refused of it passes no gate (exit 7),
/// whether the file or a directory on its way is open; a refusal in it still exits 1.
#[test]
fn a_trace_others_could_have_changed_passes_no_gate() {
    use std::os::unix::fs::PermissionsExt;
    let policy_text =
        format!("version: 1\nallow:\n  - domain: api.example\n    ports: [443]\n{GUARD}");
    let mode = |path: &Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod")
    };
    for open in ["file", "directory"] {
        for (trace, before, code) in [(allowed_only(TRACE), 0, 7), (TRACE.to_string(), 1, 1)] {
            let f = Files::new(&trace);
            let policy = f.policy("p.yaml", &policy_text);
            let out = egress_fence(&[&f.trace, &policy]);
            assert_eq!(out.status.code(), Some(before), "{}", text(&out.stderr));
            match open {
                "file" => mode(&f.trace, 0o666),
                _ => mode(&f.dir, 0o777),
            }
            let out = egress_fence(&[&f.trace, &policy]);
            let stderr = text(&out.stderr);
            assert_eq!(out.status.code(), Some(code), "{open}: {stderr}");
            assert_eq!(
                stderr.contains("could have changed the trace"),
                code == 7,
                "{open}: {stderr}"
            );
        }
    }
}
