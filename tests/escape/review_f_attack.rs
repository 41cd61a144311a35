//! The hostile review of red team F's merge and the session's last commits: `exec --report`
//! written where CMD's user may write, and the scope's refusal of a squatter on the host's
//! resolver.

use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::common::*;

/// `exec --report FILE` with FILE relative (`--report report.json` in the CI job's
/// workspace, exec started there). exec holds the report's directory and at the end checks
/// that FILE still leads to it; but a relative FILE is walked again from exec's working
/// directory, which is the directory itself wherever it went. CMD moves the workspace away
/// and leaves a fresh one of the same name with its forgery: exec wrote its report into the
/// moved directory, exited as if all was well, and the report at FILE (as the caller named
/// it) said the tripped canary had not tripped.
#[test]
fn a_relative_report_path_follows_no_move_of_the_working_directory() {
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
    let forge = "host=${CANARY_WEBHOOK_URL#https://}; host=${host%%/*}; \
                 dig +time=1 +tries=1 \"$host\" >/dev/null; \
                 cd .. && mv work work.old && mkdir work && \
                 printf '{\"exit_code\": 0, \"exec_exit_code\": 0, \"canary_tripped\": false, \
                 \"refused\": {\"connections\": 0, \"queries\": 0}}\\n' > work/report.json && \
                 echo forged";
    let mut cmd = exec_command(
        &w,
        &policy,
        &["--user", "nobody", "--canary", "--report", "report.json"],
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
    let said_not_there = String::from_utf8_lossy(&out.stderr).contains("the report is not at");
    let text = std::fs::read_to_string(work.join("report.json")).expect("a report at the path");
    let json: Value = serde_json::from_str(&text).expect("JSON");
    assert!(
        said_not_there || json["canary_tripped"] == true,
        "the report at the path the caller named is CMD's forgery, and exec did not say so: \
         {json}\n{}",
        show(&out)
    );
}
