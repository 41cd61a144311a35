//! Hostile input that is not packets: a policy too large for the file-descriptor limit, a
//! state directory someone else prepared (a symlinked lock, a FIFO named like a generation,
//! the last generation number, a directory anyone may write to), and policy values that
//! parse but allow everything or nothing (`check` warns about them, with the line).

use std::fs;
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::process::Command;

use crate::common::*;

/// A policy that needs no DNS answer: one network on TCP 443.
fn cidr_policy(w: &World, file: &str, host: IpAddr) -> std::path::PathBuf {
    w.write_file(
        file,
        &format!(
            "version: 1\nallow:\n  - cidr: {host}\n    ports: [443]\n\
             dns:\n  resolvers: [{DNS_V4}]\n"
        ),
    )
}

/// The sandbox's state directory, made as egress-fence makes it (0700, root's), so that a
/// test can plant something in it before egress-fence ever ran.
fn prepared_state_dir(w: &World) -> std::path::PathBuf {
    let dir = w.sandbox_state_dir();
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .expect("create the state directory");
    dir
}

fn output(mut cmd: Command) -> CmdOutput {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    CmdOutput {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

// ---- item 11: resolution is bounded ----------------------------------------------------------

/// The `i`th name of the big policy and its one address (198.18.0.0/15: never a host).
fn bulk_name(i: usize) -> (String, IpAddr) {
    let addr = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + i as u32);
    (format!("n{i}.bulk.example"), IpAddr::V4(addr))
}

/// 2,000 names under `ulimit -n 1024` (systemd's default): every one resolves and lands in
/// the table. Asking all of them at once took one socket per query and left about half
/// unresolved ("Too many open files").
#[test]
fn apply_resolves_2000_names_under_ulimit_1024() {
    const NAMES: usize = 2_000;
    let w = World::new();
    let records: Vec<(String, Vec<IpAddr>)> = (0..NAMES)
        .map(|i| {
            let (name, addr) = bulk_name(i);
            (name, vec![addr])
        })
        .collect();
    w.dns_set_many(&records, DEFAULT_DNS_TTL);
    let mut policy = format!("version: 1\ndns:\n  resolvers: [{DNS_V4}]\nallow:\n");
    for (name, _) in &records {
        policy.push_str(&format!("  - domain: {name}\n    ports: [443]\n"));
    }
    let policy = w.write_file("many.yaml", &policy);

    let mut cmd = Command::new("prlimit");
    cmd.args(["--nofile=1024:1024", "--", "timeout", "-k", "5", "120"])
        .arg(EGRESS_FENCE_BIN)
        .args(["apply", path_arg(&policy), "--netns", w.sandbox_name()])
        .env(STATE_DIR_ENV, w.state_dir());
    let out = output(cmd);
    assert!(out.success(), "apply under ulimit -n 1024: {out}");
    assert!(
        !out.stderr.contains("NOT RESOLVED") && !out.stderr.contains("partly"),
        "{}",
        out.stderr
    );

    // The kernel's view, read by nft: one element per name.
    let mut in_table: Vec<IpAddr> = w
        .set_elements("resolved4")
        .into_iter()
        .filter(|e| e.port == 443)
        .map(|e| e.addr)
        .collect();
    in_table.sort();
    let mut wanted: Vec<IpAddr> = records.iter().map(|(_, a)| a[0]).collect();
    wanted.sort();
    assert_eq!(in_table.len(), NAMES);
    assert_eq!(in_table, wanted);
}

// ---- item 13: the state directory trusts nothing it finds -----------------------------------

/// A `lock` planted as a symbolic link: `apply` used to open it for writing and truncate
/// whatever it pointed to. Now it refuses, names the file, and the target is untouched.
#[test]
fn a_symlinked_lock_is_refused_and_its_target_kept() {
    let w = World::new();
    let victim = w.write_file("victim", "root:precious:0:0\n");
    let dir = prepared_state_dir(&w);
    std::os::unix::fs::symlink(&victim, dir.join("lock")).expect("plant the link");
    let policy = cidr_policy(&w, "p.yaml", HOST_V4);

    let out = w.egress_fence(&["apply", path_arg(&policy)]);
    assert!(!out.success(), "apply followed the link: {out}");
    assert!(
        out.stderr.contains(&format!("{}/lock", dir.display()))
            && out.stderr.contains("symbolic link"),
        "{out}"
    );
    assert_eq!(
        fs::read_to_string(&victim).expect("the victim"),
        "root:precious:0:0\n"
    );
    assert!(w.table_handle().is_none(), "nothing was applied");
}

/// A FIFO named like a generation: `history`, `status` and `apply` used to block on it
/// forever. They now report it as unusable and go on.
#[test]
fn a_fifo_named_like_a_generation_hangs_nothing() {
    let w = World::new();
    let first = cidr_policy(&w, "a.yaml", HOST_V4);
    let out = w.egress_fence(&["apply", path_arg(&first)]);
    assert!(out.success(), "{out}");
    let fifo = w.sandbox_state_dir().join("gen-000002.json");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");

    let history = w.egress_fence(&["history"]);
    assert_ne!(history.code(), 124, "history hung on the FIFO");
    assert!(
        format!("{}{}", history.stdout, history.stderr).contains("a FIFO"),
        "{history}"
    );
    let status = w.egress_fence(&["status"]);
    assert_ne!(status.code(), 124, "status hung on the FIFO");
    let second = cidr_policy(&w, "b.yaml", HOST2_V4);
    let apply = w.egress_fence(&["apply", path_arg(&second)]);
    assert_ne!(apply.code(), 124, "apply hung on the FIFO");
    assert!(apply.success(), "{apply}");
}

/// A generation numbered u64::MAX: the next one used to wrap to 0 and overwrite. Now
/// `apply` refuses before it changes anything.
#[test]
fn the_last_generation_number_does_not_wrap() {
    let w = World::new();
    let first = cidr_policy(&w, "a.yaml", HOST_V4);
    let out = w.egress_fence(&["apply", path_arg(&first)]);
    assert!(out.success(), "{out}");
    let dir = w.sandbox_state_dir();
    fs::copy(
        dir.join("gen-000001.json"),
        dir.join(format!("gen-{}.json", u64::MAX)),
    )
    .expect("plant the last number");
    let before = w.nft_json();

    let second = cidr_policy(&w, "b.yaml", HOST2_V4);
    let out = w.egress_fence(&["apply", path_arg(&second)]);
    assert!(!out.success(), "{out}");
    assert!(out.stderr.contains("used up"), "{out}");
    assert!(!dir.join("gen-000000.json").exists(), "wrapped to 0");
    assert!(dir.join("gen-000001.json").exists());
    assert_eq!(
        normalized_ruleset(w.nft_json()),
        normalized_ruleset(before),
        "the table changed although no generation could be recorded"
    );
}

/// A state directory that group or others may write to (where anyone could plant a
/// generation that `rollback` would install) is refused, with the path and the fix.
#[test]
fn a_state_directory_others_may_write_is_refused() {
    let w = World::new();
    let dir = prepared_state_dir(&w);
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).expect("chmod");
    let policy = cidr_policy(&w, "p.yaml", HOST_V4);
    for args in [vec!["history"], vec!["apply", path_arg(&policy)]] {
        let out = w.egress_fence(&args);
        assert!(!out.success(), "{args:?}: {out}");
        assert!(
            out.stderr.contains(&dir.display().to_string()) && out.stderr.contains("chmod go-w"),
            "{args:?}: {out}"
        );
    }
    assert!(w.table_handle().is_none(), "nothing was applied");
}

// ---- item 14: check warns about values that allow everything or nothing -----------------

#[test]
fn check_warns_about_values_that_allow_everything_or_nothing_with_the_line() {
    let w = World::new();
    let policy = w.write_file(
        "warn.yaml",
        "version: 1\n\
         allow:\n  \
           - cidr: 0.0.0.0/0\n    ports: [443]\n  \
           - cidr: \"::/0\"\n    ports: [443]\n  \
           - cidr: \"::ffff:192.0.2.0/120\"\n    ports: [443]\n\
         dns:\n  \
           mode: guard\n  \
           upstream: [0.0.0.0, 255.255.255.255, \"ff02::1\"]\n  \
           listen: [\"127.0.0.53:0\"]\n",
    );
    let mut cmd = Command::new(EGRESS_FENCE_BIN);
    cmd.args(["check", path_arg(&policy)]);
    let out = output(cmd);
    assert!(out.success(), "warnings are not errors: {out}");
    let path = policy.display();
    for expected in [
        format!("warning: {path}:3:11: `0.0.0.0/0` allows every IPv4 address"),
        format!("warning: {path}:5:12: `::/0` allows every IPv6 address"),
        format!("warning: {path}:7:12: `::ffff:192.0.2.0/120` is an IPv4-mapped"),
        format!("warning: {path}:11:14: upstream 0.0.0.0 is the unspecified address"),
        format!("warning: {path}:11:23: upstream 255.255.255.255 is the broadcast address"),
        format!("warning: {path}:11:41: upstream ff02::1 is a multicast address"),
        format!("warning: {path}:12:13: the guard's listen address 127.0.0.53:0 has port 0"),
    ] {
        assert!(
            out.stderr.contains(&expected),
            "missing {expected:?}:\n{out}"
        );
    }
}
