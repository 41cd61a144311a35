//! The command line without root: policy checking, exit codes and help.

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
}
