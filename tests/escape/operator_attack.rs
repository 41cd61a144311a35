//! The operator's tools as the fenced process plays them: what `watch` prints and the service
//! logs must not be less than what the fence refused without saying so.

use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::common::*;

/// Refused decoys the sandbox sends to spend the log rate (10/second, burst 20).
const DECOYS: usize = 200;
/// Where the attempt it wants hidden goes.
const HIDDEN_PORT: u16 = 4444;
/// The decoys and the one that matters.
const SENT: u64 = DECOYS as u64 + 1;

/// A policy that logs refusals to NFLOG group 100 at the default rate.
fn logging_policy(w: &World) -> std::path::PathBuf {
    w.write_file(
        "policy.yaml",
        "version: 1\ndns:\n  resolvers: [192.0.2.53]\nlog:\n  group: 100\n",
    )
}

/// As nobody: [`DECOYS`] refused datagrams at once, then the one to [`HIDDEN_PORT`].
fn flood_then_hide(w: &World) {
    let flood = format!(
        "import socket\n\
     s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
     refused = 0\n\
     for i in range({DECOYS}):\n\
     \x20   try:\n\
     \x20       s.sendto(b'decoy', ('{OTHER_V4}', 9))\n\
     \x20   except OSError:\n\
     \x20       refused += 1\n\
     try:\n\
     \x20   s.sendto(b'the one that matters', ('{OTHER2_V4}', {HIDDEN_PORT}))\n\
     except OSError:\n\
     \x20   refused += 1\n\
     print(refused)\n"
    );
    let out = w.adversary_cmd(Adversary::Nobody, &[PYTHON, "-c", &flood]);
    assert!(out.success(), "{out}");
    assert_eq!(
        out.stdout.trim(),
        (DECOYS + 1).to_string(),
        "every send refused: {out}"
    );
}

/// The table logs refusals at the policy's `log.rate` (here the default, 10/second burst 20),
/// one limit for every process. The sandbox sends a burst of refused decoys, then the attempt
/// it wants hidden: the limit is spent, the kernel logs nothing of it, and `watch` (which
/// says it prints every refused packet) showed the decoys and nothing else: not the attempt,
/// nor that anything went unshown. The table's counters count every refusal; `watch` now
/// says how many refused packets it could not show.
#[test]
fn a_burst_of_refusals_hides_no_later_one_from_watch() {
    let w = World::new();
    let policy = logging_policy(&w);
    let applied = w.egress_fence(&["apply", path_arg(&policy)]);
    assert!(applied.success(), "{applied}");
    let mut watch = w.spawn_egress_fence(&["watch", "--json"]);
    assert!(watch.wait_for_output("watching NFLOG group 100", Duration::from_secs(5)));

    flood_then_hide(&w);

    // Whatever `watch` says of what it could not show, it says within a few seconds.
    let shown = |w: &Background| {
        let events = events(&w.stdout());
        let logged = events.iter().filter(|e| e["verdict"] == "refused").count();
        let unshown: u64 = events
            .iter()
            .filter(|e| e["verdict"] == "unlogged")
            .filter_map(|e| e["packets"].as_u64())
            .sum();
        let hidden = events.iter().any(|e| e["dport"] == HIDDEN_PORT);
        (logged, unshown, hidden)
    };
    let accounted = within(Duration::from_secs(15), || {
        let (logged, unshown, _) = shown(&watch);
        logged as u64 + unshown >= SENT
    });
    let (logged, unshown, hidden) = shown(&watch);
    watch.signal(Signal::SIGTERM);
    let _ = watch.wait_timeout(Duration::from_secs(5));
    assert!(
        accounted,
        "the fence refused {SENT} packets; watch showed {logged}, said {unshown} went unshown, \
         and the hidden one was {}:\n{}\n{}",
        if hidden { "shown" } else { "not shown" },
        watch.stdout(),
        watch.stderr()
    );
    assert!(
        hidden || unshown > 0,
        "the hidden attempt is neither shown nor counted"
    );
    // Nor does it say more went unshown than did: nothing else is refused in the sandbox.
    assert_eq!(logged as u64 + unshown, SENT, "{}", watch.stdout());
}

fn events(out: &str) -> Vec<Value> {
    out.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The same burst against `run --log-drops`: the journal logged the decoys and never said that
/// later refusals went unlogged (only the metrics' exact totals could tell). The service now
/// logs how many refused packets the table counted and did not log.
#[test]
fn a_burst_of_refusals_hides_no_later_one_from_the_services_log() {
    let w = World::new();
    let policy = logging_policy(&w);
    let mut daemon = w.spawn_egress_fence(&[
        "run",
        path_arg(&policy),
        "--log-drops",
        "--log-format",
        "json",
    ]);
    assert!(
        daemon.wait_for_output("\"running\"", Duration::from_secs(10)),
        "{}",
        daemon.stderr()
    );
    flood_then_hide(&w);

    let told = |daemon: &Background| {
        let lines = events(&daemon.stderr());
        let message = |l: &Value| l["fields"]["message"].as_str().unwrap_or("").to_string();
        let logged = lines
            .iter()
            .filter(|l| message(l) == "refused packet")
            .count() as u64;
        let unlogged: u64 = lines
            .iter()
            .filter(|l| message(l).starts_with("refused packets not logged"))
            .filter_map(|l| l["fields"]["packets"].as_u64())
            .sum();
        (logged, unlogged)
    };
    let accounted = within(Duration::from_secs(15), || {
        let (logged, unlogged) = told(&daemon);
        logged + unlogged >= SENT
    });
    let (logged, unlogged) = told(&daemon);
    daemon.signal(Signal::SIGTERM);
    let _ = daemon.wait_timeout(Duration::from_secs(10));
    assert!(
        accounted,
        "the fence refused {SENT} packets; the service logged {logged} and said {unlogged} \
         were not logged:\n{}",
        daemon.stderr()
    );
    assert_eq!(logged + unlogged, SENT, "{}", daemon.stderr());
}

/// `exec --report FILE` where CMD's user may write FILE's directory (the agent's workspace, as
/// a CI job has it): exec opened the file before CMD started (a symlink there is refused) and
/// wrote the report into it at the end, but CMD removed it meanwhile and left its own at the
/// path. The canary tripped (exit 99), and the report a gate then reads said it had not. At
/// its end exec now puts its report back at the path, whatever CMD left there.
#[test]
fn the_report_at_the_path_is_execs_not_cmds() {
    use crate::common::exec::*;
    use std::os::unix::fs::PermissionsExt;

    let w = World::new();
    let policy = setup(&w);
    let work = w.dir().join("work");
    std::fs::create_dir(&work).expect("mkdir work");
    std::os::unix::fs::chown(&work, Some(NOBODY), Some(NOBODY)).expect("chown work");
    std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let report = work.join("report.json");
    let forge = "host=${CANARY_WEBHOOK_URL#https://}; host=${host%%/*}; \
                 dig +time=1 +tries=1 \"$host\" >/dev/null; \
                 rm -f report.json && \
                 printf '{\"exit_code\": 0, \"exec_exit_code\": 0, \"canary_tripped\": false, \
                 \"refused\": {\"connections\": 0, \"queries\": 0}}\\n' > report.json && \
                 echo forged";
    let mut cmd = exec_command(
        &w,
        &policy,
        &[
            "--user",
            "nobody",
            "--canary",
            "--report",
            path_arg(&report),
        ],
        forge,
    );
    cmd.current_dir(&work);
    let out = cmd.output().expect("run egress-fence exec");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("forged"),
        "{}",
        show(&out)
    );
    assert_eq!(
        out.status.code(),
        Some(99),
        "the canary trips: {}",
        show(&out)
    );
    let text = std::fs::read_to_string(&report).expect("the report");
    let json: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(
        json["canary_tripped"], true,
        "the report at the path is CMD's forgery: {json}"
    );
    assert_eq!(json["exec_exit_code"], 99, "{json}");
}

/// The same with the report's directory: CMD moves its workspace away and leaves a fresh one
/// of the same name holding its forgery. exec cannot write there without following CMD's
/// moves, so it fails (125) and says the report at the path is not its own.
#[test]
fn a_report_whose_directory_cmd_moved_is_said_not_to_be_there() {
    use crate::common::exec::*;
    use std::os::unix::fs::PermissionsExt;

    let w = World::new();
    let policy = setup(&w);
    let top = w.dir().join("workspace");
    let work = top.join("work");
    for dir in [&top, &work] {
        std::fs::create_dir(dir).expect("mkdir");
        std::os::unix::fs::chown(dir, Some(NOBODY), Some(NOBODY)).expect("chown");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let report = work.join("report.json");
    let forge = "cd .. && mv work work.old && mkdir work && \
                 printf '{\"exit_code\": 0, \"exec_exit_code\": 0, \"canary_tripped\": false}\\n' \
                 > work/report.json && echo forged";
    let mut cmd = exec_command(
        &w,
        &policy,
        &["--user", "nobody", "--report", path_arg(&report)],
        forge,
    );
    cmd.current_dir(&work);
    let out = cmd.output().expect("run egress-fence exec");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("forged"),
        "{}",
        show(&out)
    );
    assert_eq!(out.status.code(), Some(125), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the report is not at"),
        "{}",
        show(&out)
    );
}
