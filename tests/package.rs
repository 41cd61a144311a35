//! The Debian package (scripts/package.sh, cargo-deb), built from the binary under test and
//! unpacked into a throwaway root: every file where the unit, the README and the shell look
//! for it, the unit's paths inside the package, the policy a conffile, and the man pages and
//! completions what the packaged binary generates from its clap definitions. Needs cargo-deb
//! (scripts/deps.sh installs it); without it the test fails and says so.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn run(command: &mut Command) -> Output {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("run {command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every file below `dir`, by its path relative to `dir`, with its content (gzip undone).
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let name = path
                .strip_prefix(dir)
                .expect("below dir")
                .to_string_lossy()
                .into_owned();
            let bytes = std::fs::read(&path).expect("read a file");
            match name.strip_suffix(".gz") {
                Some(plain) => {
                    let out_ = run(Command::new("gzip").args(["-dc"]).arg(&path));
                    out.insert(plain.to_string(), out_.stdout);
                }
                None => {
                    out.insert(name, bytes);
                }
            }
        }
    }
    out
}

#[test]
fn the_deb_holds_the_binary_unit_policy_schema_pages_and_completions() {
    let have_cargo_deb = Command::new("cargo-deb")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        have_cargo_deb,
        "cargo-deb is missing: run scripts/deps.sh (cargo install --locked cargo-deb)"
    );
    let work = tempfile::tempdir().expect("a temporary directory");
    let out_dir = work.path().join("out");
    run(Command::new(repo().join("scripts/package.sh"))
        .env("EGRESS_FENCE_BIN", env!("CARGO_BIN_EXE_egress-fence"))
        .args(["--fast", "-o"])
        .arg(&out_dir));
    let debs: Vec<PathBuf> = std::fs::read_dir(&out_dir)
        .expect("the output directory")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "deb"))
        .collect();
    let [deb] = &debs[..] else {
        panic!("expected one .deb, found {debs:?}");
    };
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        deb.file_name().is_some_and(|n| n
            .to_string_lossy()
            .starts_with(&format!("egress-fence_{version}-"))),
        "{}",
        deb.display()
    );

    // The control data: libraries found by dpkg-shlibdeps, the policy a conffile, and
    // maintainer scripts that neither enable nor start the boundary.
    let control = work.path().join("control");
    run(Command::new("dpkg-deb").arg("-e").arg(deb).arg(&control));
    let fields = read(&control.join("control"));
    for needle in [
        "Package: egress-fence",
        "libnftnl",
        "libmnl",
        "Section: net",
    ] {
        assert!(fields.contains(needle), "control lacks {needle}:\n{fields}");
    }
    assert_eq!(
        read(&control.join("conffiles")).trim(),
        "/etc/egress-fence/policy.yaml"
    );
    let postinst = read(&control.join("postinst"));
    assert!(postinst.contains("daemon-reload"), "{postinst}");
    assert!(!postinst.contains("invoke start"), "{postinst}");
    // dh_installsystemd's "enable" snippet enables unconditionally; its "don't enable"
    // one only keeps a unit enabled that the administrator had enabled.
    let lines: Vec<&str> = postinst.lines().map(str::trim).collect();
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with("deb-systemd-helper enable") {
            assert!(
                i > 0 && lines[i - 2..i].iter().any(|l| l.contains("was-enabled")),
                "postinst enables the unit: {postinst}"
            );
        }
    }

    // dpkg unpacks it into an empty root of its own. Nothing is configured: no maintainer
    // script runs (the package has no preinst), so nothing touches this host's systemd.
    let root = work.path().join("root");
    for d in ["var/lib/dpkg/info", "var/lib/dpkg/updates"] {
        std::fs::create_dir_all(root.join(d)).expect("make the dpkg database");
    }
    std::fs::write(root.join("var/lib/dpkg/status"), "").expect("an empty status file");
    run(Command::new("dpkg")
        .arg(format!("--root={}", root.display()))
        .args(["--force-depends", "--unpack"])
        .arg(deb));

    // The binary runs, and checks the policy the package puts in /etc: a conffile, which
    // dpkg unpacks beside its final name until the package is configured.
    let bin = root.join("usr/bin/egress-fence");
    let out = run(Command::new(&bin).arg("--version"));
    assert!(String::from_utf8_lossy(&out.stdout).contains(version));
    let policy = root.join("etc/egress-fence/policy.yaml.dpkg-new");
    run(Command::new(&bin).arg("check").arg(&policy));
    assert_eq!(read(&policy), read(&repo().join("policies/default.yaml")));

    // The unit is systemd/'s with ExecStart= at the packaged binary, and every path it runs
    // is in the package.
    let unit = read(&root.join("usr/lib/systemd/system/egress-fence.service"));
    assert_eq!(
        unit,
        read(&repo().join("systemd/egress-fence.service"))
            .replace("/usr/local/bin/egress-fence", "/usr/bin/egress-fence")
    );
    let exec_start = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("an ExecStart= line");
    assert!(
        exec_start.starts_with("/usr/bin/egress-fence run "),
        "{exec_start}"
    );
    let listed = read(&root.join("var/lib/dpkg/info/egress-fence.list"));
    for path in exec_start.split_whitespace().filter(|w| w.starts_with('/')) {
        assert!(
            listed.lines().any(|l| l == path),
            "ExecStart= names {path}, which the package does not hold:\n{listed}"
        );
    }
    assert_eq!(
        read(&root.join("usr/share/egress-fence/systemd/guard.conf")),
        read(&repo().join("systemd/guard.conf"))
    );

    // The schema is the packaged binary's.
    let schema = run(Command::new(&bin).args(["check", "--schema"])).stdout;
    assert_eq!(
        read(&root.join("usr/share/egress-fence/policy.schema.json")).as_bytes(),
        &schema[..]
    );

    // The man pages and completions are what the packaged binary generates, where man and
    // the shells look for them.
    let generated = work.path().join("generated");
    run(Command::new(&bin).arg("package-assets").arg(&generated));
    let generated = files(&generated);
    let mut packaged = BTreeMap::new();
    for (dir, prefix) in [
        ("usr/share/man/man1", "man/"),
        ("usr/share/bash-completion/completions", "completions/"),
        ("usr/share/zsh/vendor-completions", "completions/"),
        ("usr/share/fish/vendor_completions.d", "completions/"),
    ] {
        for (name, content) in files(&root.join(dir)) {
            let name = match name.as_str() {
                "egress-fence" => "egress-fence.bash".to_string(),
                other => other.to_string(),
            };
            packaged.insert(format!("{prefix}{name}"), content);
        }
    }
    assert_eq!(
        packaged.keys().collect::<Vec<_>>(),
        generated.keys().collect::<Vec<_>>()
    );
    for (name, content) in &generated {
        assert!(
            packaged[name] == *content,
            "{name} differs from the binary's"
        );
    }
    assert!(generated.len() >= 16, "{:?}", generated.keys());

    let mut readme = String::new();
    std::fs::File::open(root.join("usr/share/doc/egress-fence/README.md"))
        .and_then(|mut f| f.read_to_string(&mut readme))
        .expect("the README");
    assert!(readme.starts_with("# egress-fence"));
}
