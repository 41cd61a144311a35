//! Benchmark: resolving a policy of N names (default 10,000) under `ulimit -n 1024`.
//!
//! In a throwaway network namespace, dnsmasq listens on 127.0.0.1 and answers every name
//! `nI.bench.example` (I < N) from a generated hosts file with one A (198.18.0.0/15) and one
//! AAAA (2001:db8::/32) record; nothing is forwarded anywhere. Then, each with the limit of
//! open files set to `--nofile` (default 1,024, systemd's default soft limit) by `setrlimit`
//! in the forked child:
//!
//! 1. **ours**: the real `egress-fence plan POLICY` (release build, found next to this bench's
//!    binary), run in the namespace, resolving all N names (A and AAAA) and printing the plan.
//! 2. **baseline** (optional, `--baseline PATH`): the same command with another egress-fence
//!    binary, e.g. one built from a commit before the lookups were bounded.
//! 3. **dig -f**: the same 2 x N questions, one after the other, from one `dig` process.
//!
//! For each: wall time and peak RSS (`ru_maxrss` from `wait4`), and how many names came back
//! with both their addresses (counted from the plan's `# NAME: ADDR (ttl T), ADDR (ttl T)`
//! lines, or from dig's answer lines). No timing is asserted; the bench prints a table.
//! The namespace (`efs-<pid>-<n>`) and dnsmasq are removed on drop, also on panic or signal.
//!
//! Run as root (needs `ip`, `dnsmasq`, `dig`): `cargo bench --bench resolve`. Options after
//! `--`: `--names 10000`, `--reps 3`, `--nofile 1024`, `--baseline PATH`.

#![deny(unsafe_code)]

#[allow(unsafe_code)] // its blocks, each with its SAFETY comment, are the benches' only ones
mod common;

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{
    TempNetns, kernel_release, limit_open_files, measure, measure_any, median, real_name,
    require_root, run, run_parent, start_dnsmasq, v4,
};

/// This bench's namespaces are `efs-<pid>-<n>`.
const NS_PREFIX: &str = "efs-";
const RESOLVER: &str = "127.0.0.1";

struct Options {
    names: usize,
    reps: usize,
    nofile: u64,
    baseline: Option<PathBuf>,
}

fn usage() -> ! {
    eprintln!(
        "usage: resolve [--names N] [--reps R] [--nofile N] [--baseline PATH]  \
         (run with cargo bench)"
    );
    std::process::exit(2)
}

fn options(args: &[String]) -> Options {
    let mut o = Options {
        names: 10_000,
        reps: 3,
        nofile: 1024,
        baseline: None,
    };
    let mut it = args.iter().filter(|a| *a != "--bench");
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--names" => o.names = value().parse().unwrap_or_else(|_| usage()),
            "--reps" => o.reps = value().parse().unwrap_or_else(|_| usage()),
            "--nofile" => o.nofile = value().parse().unwrap_or_else(|_| usage()),
            "--baseline" => o.baseline = Some(PathBuf::from(value())),
            _ => usage(),
        }
    }
    o
}

fn v6(i: usize) -> IpAddr {
    IpAddr::V6(Ipv6Addr::from((0x2001_0db8_u128 << 96) | i as u128))
}

/// The egress-fence binary built beside this bench (target/release/egress-fence).
fn our_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().and_then(Path::parent).expect("target/release");
    let bin = dir.join("egress-fence");
    assert!(
        bin.exists(),
        "{} is missing: `cargo build --release` first",
        bin.display()
    );
    bin
}

/// Names in a plan's output with both addresses.
fn fully_resolved_in_plan(stdout: &str) -> usize {
    stdout
        .lines()
        .filter(|l| l.starts_with("# n") && l.contains(".bench.example: ") && l.contains(", "))
        .filter(|l| l.matches("(ttl ").count() == 2)
        .count()
}

/// Answer records in dig's output.
fn answers_in_dig(stdout: &str) -> usize {
    stdout
        .lines()
        .filter(|l| {
            let mut words = l.split_whitespace();
            words.next().is_some_and(|w| w.ends_with(".bench.example."))
                && words.any(|w| w == "A" || w == "AAAA")
        })
        .count()
}

struct Sample {
    wall: Duration,
    rss_kib: u64,
    /// Names with both addresses (for dig: answers / 2).
    resolved: usize,
    ok: bool,
}

fn plan_run(ns: &TempNetns, binary: &Path, policy: &Path, nofile: u64) -> Sample {
    let mut cmd = ns.command(binary.to_str().expect("a UTF-8 path"));
    cmd.arg("plan").arg(policy);
    limit_open_files(&mut cmd, nofile);
    let (status, m, _stderr) = measure_any(&mut cmd);
    Sample {
        wall: m.wall,
        rss_kib: m.maxrss_kib,
        resolved: fully_resolved_in_plan(&m.stdout),
        ok: status.success(),
    }
}

fn dig_run(ns: &TempNetns, questions: &Path, nofile: u64) -> Sample {
    let mut cmd = ns.command("dig");
    cmd.args([
        "+tries=1",
        "+time=2",
        "+noall",
        "+answer",
        "@127.0.0.1",
        "-f",
    ])
    .arg(questions);
    limit_open_files(&mut cmd, nofile);
    let m = measure(&mut cmd);
    Sample {
        wall: m.wall,
        rss_kib: m.maxrss_kib,
        resolved: answers_in_dig(&m.stdout) / 2,
        ok: true,
    }
}

fn summary(what: &str, samples: Vec<Sample>, names: usize) -> String {
    let resolved = samples.iter().map(|s| s.resolved).min().unwrap_or(0);
    let failed = samples.iter().filter(|s| !s.ok).count();
    let wall = median(samples.iter().map(|s| s.wall).collect());
    let rss = median(samples.iter().map(|s| s.rss_kib).collect());
    let mut line = format!(
        "| {what} | {:.2} s | {:.1} MiB | {resolved} of {names}",
        wall.as_secs_f64(),
        rss as f64 / 1024.0
    );
    if failed > 0 {
        let _ = write!(line, " ({failed} runs exited non-zero)");
    }
    line.push_str(" |");
    line
}

fn bench(args: &[String]) {
    require_root();
    let o = options(args);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut hosts = String::new();
    let mut questions = String::new();
    let mut policy = format!("version: 1\ndns:\n  resolvers: [{RESOLVER}]\nallow:\n");
    for i in 0..o.names {
        let n = real_name(i);
        let _ = writeln!(hosts, "{} {n}\n{} {n}", v4(i), v6(i));
        let _ = writeln!(questions, "{n} A\n{n} AAAA");
        let _ = writeln!(policy, "  - domain: {n}\n    ports: [443]");
    }
    let write = |file: &str, text: &str| {
        let path = dir.path().join(file);
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        path
    };
    let hosts = write("hosts", &hosts);
    let questions = write("questions", &questions);
    let policy = write("policy.yaml", &policy);
    let ours = our_binary();

    let ns = TempNetns::new(NS_PREFIX);
    run(Command::new("ip").args(["-n", &ns.name, "link", "set", "lo", "up"]));
    let _dnsmasq = start_dnsmasq(&ns, &hosts, 300);

    let mut rows = Vec::new();
    let mut mine = Vec::new();
    let mut baseline = Vec::new();
    let mut dig = Vec::new();
    for _ in 0..o.reps {
        mine.push(plan_run(&ns, &ours, &policy, o.nofile));
        if let Some(b) = &o.baseline {
            baseline.push(plan_run(&ns, b, &policy, o.nofile));
        }
        dig.push(dig_run(&ns, &questions, o.nofile));
    }
    rows.push(summary("`egress-fence plan` (this build)", mine, o.names));
    if let Some(b) = &o.baseline {
        rows.push(summary(
            &format!("`egress-fence plan` ({})", b.display()),
            baseline,
            o.names,
        ));
    }
    rows.push(summary("`dig -f` (2 x N questions in turn)", dig, o.names));

    println!(
        "resolve: {} names (A + AAAA each) from dnsmasq on 127.0.0.1 in a fresh namespace, \
         ulimit -n {}; median of {}; kernel {}",
        o.names,
        o.nofile,
        o.reps,
        kernel_release()
    );
    println!("| what | wall | peak RSS | names with both addresses |");
    println!("|---|---|---|---|");
    for row in rows {
        println!("{row}");
    }
    println!("Aim from the issue: 10,000 names in at most 1.5 s and 48 MiB under ulimit -n 1024.");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    run_parent(NS_PREFIX, || bench(&args));
}
