//! `learn` as the fenced process plays it: it chooses the names it asks, their answers (under
//! a zone it runs) and its flows during a learning run. What it makes `learn` write must not
//! be more than what it used, nor put its names on other users' flows, and nothing of its
//! names may write policy text.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::common::*;

const PORT: u16 = 9090;
/// The honest user, whose flows the learned policy is for.
const HONEST: u32 = 1000;

/// A `learn` from a guard-mode policy that allows nothing, until stopped.
fn start_learn(w: &World) -> (Background, PathBuf) {
    let out = w.dir().join("learned.yaml");
    (start_learn_to(w, &out), out)
}

/// Like [`start_learn`], writing the learned policy to `out`.
fn start_learn_to(w: &World, out: &Path) -> Background {
    let policy = w.write_file(
        "start.yaml",
        &format!(
            "version: 1\ndns:\n  mode: guard\n  listen: [\"{GUARD_ADDR}\"]\n  \
             upstream: [{DNS_V4}]\nlog:\n  group: 100\n"
        ),
    );
    w.use_guard_resolver();
    let trace = w.dir().join("trace.jsonl");
    let mut learn = w.spawn_egress_fence(&[
        "learn",
        path_arg(&policy),
        "--until-stopped",
        "--trace",
        path_arg(&trace),
        "--out",
        path_arg(out),
    ]);
    assert!(
        learn.wait_for_output("the DNS guard is serving", Duration::from_secs(15)),
        "{}",
        learn.stderr()
    );
    learn
}

/// Stops `learn` and returns the policy it wrote.
fn learned(mut learn: Background, out: &PathBuf) -> String {
    learn.signal(Signal::SIGTERM);
    assert!(learn.wait_timeout(Duration::from_secs(20)).is_some());
    std::fs::read_to_string(out).unwrap_or_else(|e| panic!("{e}:\n{}", learn.stderr()))
}

fn connect_as(w: &World, who: Adversary, host: std::net::IpAddr) {
    let out = w.adversary_cmd(
        who,
        &["bash", "-c", &format!("exec 3<>/dev/tcp/{host}/{PORT}")],
    );
    assert!(out.success(), "audited, so let through: {out}");
}

/// The sandbox asks a name of its own zone, answered with the address an honest user's name
/// just gave, before the honest user connects: learn credited the user's flow to the last
/// name that answered the address, whoever asked it, so the learned policy allowed the
/// sandbox's name (which it can point anywhere once the policy is applied) and called the
/// user's name "asked but never connected to". A flow is now learned for the last name its
/// own uid asked for the address.
#[test]
fn a_users_flow_is_learned_for_the_name_that_user_asked() {
    let w = World::new();
    let _listener = w.listen_tcp(HOST_V4, PORT);
    w.dns_set("good.example", &[HOST_V4], DEFAULT_DNS_TTL);
    w.dns_set("hijack.evil.example", &[HOST_V4], DEFAULT_DNS_TTL);
    let (learn, out) = start_learn(&w);

    let good = w.dig_as(Some(HONEST), None, "good.example", "A", &[]);
    assert_eq!(good.addrs(), vec![HOST_V4], "{}", good.output);
    let evil = w.dig_as(Some(NOBODY), None, "hijack.evil.example", "A", &[]);
    assert_eq!(evil.addrs(), vec![HOST_V4], "{}", evil.output);
    connect_as(&w, Adversary::User(HONEST), HOST_V4);

    let yaml = learned(learn, &out);
    assert!(
        yaml.contains("- domain: \"good.example\""),
        "the user's flow is not learned for the name the user asked:\n{yaml}"
    );
    assert!(
        !yaml.contains("- domain: \"hijack.evil.example\""),
        "the sandbox's name took the user's flow:\n{yaml}"
    );
}

/// Names with line breaks (also U+2028 and NEL, which YAML readers may take for one), quotes
/// and `#` are refused by the guard and reach the learned policy only as escaped comment
/// text; a resolver the sandbox picks is refused while learn audits, and not learned.
#[test]
fn names_the_sandbox_asks_write_no_policy_text() {
    let w = World::new();
    let _listener = w.listen_tcp(OTHER_V4, PORT);
    w.dns_wildcard("evil.example", OTHER_V4);
    let (learn, out) = start_learn(&w);
    let hostile = [
        "a\\010\\032\\032-\\032cidr:\\0320.0.0.0/0\\010#.evil.example",
        "b\\226\\128\\168\\032\\032-\\032cidr:\\0320.0.0.0/0.evil.example",
        "c\\194\\133-\\032cidr:\\0320.0.0.0/0.evil.example",
        "d\\\"\\010allow:\\032[{cidr:\\0320.0.0.0/0}].evil.example",
        "e\\013\\032\\032-\\032cidr:\\0320.0.0.0/0.evil.example",
    ];
    for name in hostile {
        let dig = w.dig_as(Some(NOBODY), None, name, "A", &[]);
        assert_eq!(
            dig.status.as_deref(),
            Some("REFUSED"),
            "{name}: {}",
            dig.output
        );
    }
    for tcp in [&[][..], &["+tcp"][..]] {
        let rogue = w.dig_as(Some(NOBODY), Some(ROGUE_DNS_V4), "x.evil.example", "A", tcp);
        assert!(!rogue.answered(), "{}", rogue.output);
    }
    assert!(w.rogue_dns_query_log().is_empty());
    let dig = w.dig_as(Some(NOBODY), None, "x.evil.example", "A", &[]);
    assert_eq!(dig.addrs(), vec![OTHER_V4], "{}", dig.output);
    connect_as(&w, Adversary::Nobody, OTHER_V4);

    let yaml = learned(learn, &out);
    let entries: Vec<&str> = yaml
        .lines()
        .filter(|l| l.trim_start().starts_with("- "))
        .collect();
    assert_eq!(entries, ["  - domain: \"x.evil.example\""], "{yaml}");
    // The resolver only in a comment, as refused whatever the policy allows.
    let rogue = ROGUE_DNS_V4.to_string();
    assert!(
        yaml.lines()
            .filter(|l| l.contains(&rogue))
            .all(|l| l.trim_start().starts_with('#')),
        "{yaml}"
    );
    for line in yaml.lines() {
        assert!(
            line.is_ascii() && !line.contains('\r'),
            "{line:?} in\n{yaml}"
        );
    }
    let check = std::process::Command::new(EGRESS_FENCE_BIN)
        .args(["check", path_arg(&out)])
        .output()
        .expect("egress-fence check");
    assert!(check.status.success(), "{check:?}");
}

/// `--out` in a directory the sandbox can write (the README advises against it; learn refuses
/// a link or another user's file there, checked before the run and again at the write): a
/// FIFO the sandbox puts at the path during the run made the write's open wait for a reader,
/// so learn never ended (its table was back, but a provisioning script waiting on it hung,
/// and no policy came). It is refused like another user's file, at once.
#[test]
fn a_fifo_put_at_out_during_the_run_is_refused_not_waited_on() {
    let w = World::new();
    let _listener = w.listen_tcp(OTHER_V4, PORT);
    let shared = tempfile::Builder::new()
        .prefix("ef-learn-out-")
        .tempdir()
        .expect("a directory");
    std::fs::set_permissions(shared.path(), std::fs::Permissions::from_mode(0o1777))
        .expect("chmod");
    let out = shared.path().join("learned.yaml");
    let mut learn = start_learn_to(&w, &out);
    let fifo = w.adversary_cmd(Adversary::Nobody, &["mkfifo", path_arg(&out)]);
    assert!(fifo.success(), "{fifo}");

    learn.signal(Signal::SIGTERM);
    let status = learn.wait_timeout(Duration::from_secs(20));
    let Some(status) = status else {
        // Let it go: a reader takes what it writes (nothing: the FIFO is refused after).
        let _ = std::fs::read(&out);
        learn.terminate();
        panic!("learn waits on the FIFO at --out:\n{}", learn.stderr());
    };
    assert!(!status.success(), "{}", learn.stderr());
    assert!(
        learn.stderr().contains(&out.display().to_string()),
        "{}",
        learn.stderr()
    );
    assert!(!w.tcp_connects(OTHER_V4, PORT), "the table enforces again");
}
