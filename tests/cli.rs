//! The command line: policy checks, exit codes, help, and the README's demo (which, like the
//! namespace tests, needs root).

use std::path::Path;
use std::process::{Command, Output};

fn egress_fence(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_egress-fence"))
        .args(args)
        .output()
        .expect("run egress-fence")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn every_shipped_policy_passes_check() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("policies/ exists") {
        let path = entry.expect("dir entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        seen += 1;
        let out = egress_fence(&["check", path.to_str().expect("utf-8 path")]);
        assert!(
            out.status.success(),
            "{} fails check: {}",
            path.display(),
            text(&out.stderr)
        );
        assert!(
            text(&out.stdout).contains(": valid ("),
            "{}",
            text(&out.stdout)
        );
    }
    assert!(seen >= 1, "no policy found in {}", dir.display());
}

#[test]
fn check_lists_what_an_include_expands_to() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("include.yaml");
    std::fs::write(
        &path,
        "version: 1\nallow:\n  - cidr: 192.0.2.1\ninclude: [npm, debian]\n",
    )
    .expect("write policy");
    let out = egress_fence(&["check", path.to_str().expect("utf-8 path")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(": valid (4 allow entries, 3 names"),
        "{stdout}"
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let npm = lines
        .iter()
        .position(|l| *l == "include npm:")
        .unwrap_or_else(|| panic!("no `include npm:` line in {stdout}"));
    assert!(
        lines[npm + 1].starts_with("  registry.npmjs.org tcp 443  # "),
        "{stdout}"
    );
    assert!(
        stdout.contains("\ninclude debian:\n  deb.debian.org tcp 80, 443  # "),
        "{stdout}"
    );

    std::fs::write(&path, "version: 1\ninclude: [npm, leftpad]\n").expect("write policy");
    let out = egress_fence(&["check", path.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains(&format!("{}:2:16: ", path.display())), "{err}");
    assert!(
        err.contains("github, npm, pypi, crates, go, docker-hub"),
        "{err}"
    );
}

#[test]
fn a_bad_policy_exits_2_naming_file_line_and_column() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.yaml");
    std::fs::write(
        &path,
        "version: 1\nallow:\n  - domain: api.example.com\n    ports: [443, 99999]\n",
    )
    .expect("write policy");
    let out = egress_fence(&["check", path.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    let want = format!("{}:4:18: ", path.display());
    assert!(err.contains(&want), "wanted {want:?} in {err}");
    assert!(err.contains("out of range"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn a_missing_policy_file_exits_2() {
    let out = egress_fence(&["check", "/nonexistent/policy.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("cannot read the policy"));
}

/// A failure whose error has a chain of causes (the library's error wraps the system's)
/// says each cause once, on one line, and exits 1.
#[test]
fn a_failure_says_each_cause_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let in_the_way = dir.path().join("state");
    std::fs::write(&in_the_way, "").expect("write a file where the state directory goes");
    let state_dir = in_the_way.to_str().expect("utf-8 path");
    let out = egress_fence(&["confirm", "--state-dir", state_dir]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    let cause = std::io::Error::from_raw_os_error(libc::ENOTDIR).to_string();
    assert_eq!(
        err,
        format!("egress-fence: cannot create the state directory {state_dir}/host: {cause}\n")
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn usage_errors_exit_2_and_help_documents_exit_codes() {
    assert_eq!(egress_fence(&["apply"]).status.code(), Some(2));
    assert_eq!(egress_fence(&["no-such-command"]).status.code(), Some(2));
    let help = egress_fence(&["--help"]);
    assert!(help.status.success());
    let help = text(&help.stdout);
    for needle in [
        "Exit codes",
        "invalid policy",
        "did not resolve",
        "not installed",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
    let check_help = text(&egress_fence(&["check", "--help"]).stdout);
    assert!(check_help.contains("version: 1"), "{check_help}");
    assert!(check_help.contains("check --schema"), "{check_help}");
}

/// `check --schema` prints the schema the repository ships; `check` takes a policy or
/// --schema, not both and not neither.
#[test]
fn check_schema_prints_the_shipped_schema() {
    let out = egress_fence(&["check", "--schema"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shipped = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/policy.schema.json"),
    )
    .expect("read the shipped schema");
    assert_eq!(text(&out.stdout), shipped);
    assert_eq!(egress_fence(&["check"]).status.code(), Some(2));
    let both = egress_fence(&["check", "--schema", "policies/default.yaml"]);
    assert_eq!(both.status.code(), Some(2));
}

/// The README's first command, on the binary under test (so it needs root, like the
/// namespace tests): the demo must keep showing what it says it shows, and leave nothing.
#[test]
fn the_demo_shows_an_allowed_and_a_refused_connection_and_cleans_up() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(root.join("scripts/demo.sh"))
        .env("EGRESS_FENCE_BIN", env!("CARGO_BIN_EXE_egress-fence"))
        .output()
        .expect("run scripts/demo.sh");
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let allowed = stdout
        .split("-- allowed: the model API")
        .nth(1)
        .expect("allowed step");
    assert!(
        allowed
            .trim_start()
            .lines()
            .nth(1)
            .is_some_and(|l| l.contains("OK: hello")),
        "{stdout}"
    );
    let refused = stdout
        .split("-- refused: the paste site")
        .nth(1)
        .expect("refused step");
    assert!(
        refused
            .trim_start()
            .lines()
            .nth(1)
            .is_some_and(|l| l.contains("REFUSED")),
        "{stdout}"
    );
    assert!(
        stdout.contains("REFUSED tcp 198.51.100.2:"),
        "no watch line: {stdout}"
    );
    assert!(stdout.contains("-> 203.0.113.66:443"), "{stdout}");
    // The guard step: the allowed name connects through the guard's answer, the secret asked
    // as a name is refused, never reaches the upstream resolver, and watch shows it.
    let step = |marker: &str| {
        stdout
            .split(marker)
            .nth(1)
            .and_then(|rest| rest.trim_start().lines().nth(1))
            .unwrap_or_else(|| panic!("no {marker:?} step: {stdout}"))
            .to_string()
    };
    assert!(
        step("learned from the guard's answer").contains("OK: hello"),
        "{stdout}"
    );
    assert!(
        step("a secret asked as a DNS name").contains("status: REFUSED"),
        "{stdout}"
    );
    assert!(!step("as the agent's user").contains("status:"), "{stdout}");
    assert!(stdout.contains("for the secret name 0 times"), "{stdout}");
    assert!(
        stdout.contains("REFUSED dns query c2VjcmV0.paste.example.net"),
        "{stdout}"
    );
    assert!(
        stdout.contains("table inet egress_fence is not installed"),
        "{stdout}"
    );
    let netns = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    assert!(
        !text(&netns.stdout).contains("efdemo-"),
        "the demo left namespaces behind"
    );
    // A process left running would keep its namespace alive, unnamed.
    let left = Command::new("pgrep")
        .args(["-f", "paste.example.net/203.0.113.66|http.server"])
        .output()
        .expect("pgrep");
    assert!(
        left.stdout.is_empty(),
        "the demo left processes: {}",
        text(&left.stdout)
    );
}
