//! Benchmark: `egress-fence apply` end to end with real DNS, against `nft -f` of its plan.
//!
//! The workload is the daemon bench's: dnsmasq on 127.0.0.1 answers `n0.bench.example` ..
//! `n1249.bench.example` (`--names`) from a generated hosts file, 8 addresses each
//! (`--per-name`: all IPv4 from 198.18.0.0/15 but the last, which is IPv6 from 2001:db8::/32),
//! nothing forwarded; the policy allows every name on tcp/443 and names 127.0.0.1 as its
//! resolver: 10,000 addresses.
//!
//! Each measured command runs in a fresh throwaway network namespace of its own (`efa-<pid>-<n>`,
//! `lo` up, dnsmasq already answering), spawned by `setns` in the forked child (no `ip netns
//! exec` process in between) with the limit of open files set to `--nofile` (default 1,024),
//! and is reaped with `wait4` for its CPU time and peak RSS:
//!
//! * **apply**: the real `egress-fence apply POLICY` (this build; with `--baseline PATH` also
//!   another build), with a fresh state directory (`EGRESS_FENCE_STATE_DIR`): it resolves every
//!   name (A and AAAA), plans, reads what is live (nothing), installs the table in one
//!   transaction and records generation 1 (its JSON, fsynced).
//! * **apply again**: the same command once more in the same namespace and state directory:
//!   it resolves again, reads the table back (10,000 elements), compares it and the newest
//!   generation with the plan and, as nothing changed, sends nothing.
//! * **nft -f**: `nft -f plan.nft`, the text `egress-fence plan` prints for the same policy
//!   against the same dnsmasq (taken once, before the runs); it creates the table with the same
//!   10,000 elements. **nft -f again** loads it once more into the same namespace (the plan's
//!   `delete table` replaces the table).
//!
//! The contenders run interleaved, in a rotating order, once per round; each ratio (apply/nft)
//! is taken within a round and the median of the rounds' ratios reported (with their range), so
//! drift of a shared machine hits both sides alike. After every load the bench checks that `resolved4` and
//! `resolved6` hold exactly the 10,000 addresses (`nft -j list set`), and after every apply that
//! generation 1 was recorded. No figure is asserted.
//!
//! Run as root (needs `ip`, `nft`, `dnsmasq`, `dig`): `cargo build --release && cargo bench
//! --bench apply_dns`. Options after `--`: `--rounds R` (default 7), `--names N`,
//! `--per-name A`, `--nofile N`, `--baseline PATH`.

#![deny(unsafe_code)]

#[allow(unsafe_code)] // its blocks, each with its SAFETY comment, are the benches' only ones
mod common;

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{
    Dnsmasq, Measured, TempNetns, first_line_of, forked, kernel_release, limit_open_files, measure,
    measure_any, median, nft_set_len, real_name, require_root, run, run_parent, start_dnsmasq, v4,
};

/// This bench's namespaces are `efa-<pid>-<n>`.
const NS_PREFIX: &str = "efa-";

struct Options {
    rounds: usize,
    names: usize,
    per_name: usize,
    nofile: u64,
    baseline: Option<PathBuf>,
}

fn usage() -> ! {
    eprintln!(
        "usage: apply_dns [--rounds R] [--names N] [--per-name A] [--nofile N] \
         [--baseline PATH]  (run with cargo bench)"
    );
    std::process::exit(2)
}

fn options(args: &[String]) -> Options {
    let mut o = Options {
        rounds: 7,
        names: 1_250,
        per_name: 8,
        nofile: 1024,
        baseline: None,
    };
    let mut it = args.iter().filter(|a| *a != "--bench");
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--rounds" => o.rounds = value().parse().unwrap_or_else(|_| usage()),
            "--names" => o.names = value().parse().unwrap_or_else(|_| usage()),
            "--per-name" => o.per_name = value().parse().unwrap_or_else(|_| usage()),
            "--nofile" => o.nofile = value().parse().unwrap_or_else(|_| usage()),
            "--baseline" => o.baseline = Some(PathBuf::from(value())),
            _ => usage(),
        }
    }
    if o.rounds == 0 || o.names == 0 || o.per_name < 2 {
        usage();
    }
    o
}

/// The addresses of name `i`: all IPv4 but the last, which is IPv6 (as benches/daemon.rs).
fn addresses(i: usize, per_name: usize) -> Vec<IpAddr> {
    (0..per_name)
        .map(|k| match k + 1 == per_name {
            true => IpAddr::V6(Ipv6Addr::from((0x2001_0db8_u128 << 96) | i as u128)),
            false => v4(i * per_name + k),
        })
        .collect()
}

/// What every run uses.
struct Workload {
    dir: PathBuf,
    hosts: PathBuf,
    policy: PathBuf,
    plan: PathBuf,
    /// Expected elements of resolved4 and resolved6.
    v4: usize,
    v6: usize,
    nofile: u64,
}

/// A fresh namespace with `lo` up and dnsmasq answering (dropped first: dnsmasq, then the
/// namespace).
struct World {
    _dnsmasq: Dnsmasq,
    ns: TempNetns,
}

fn world(w: &Workload) -> World {
    let ns = TempNetns::new(NS_PREFIX);
    run(ns.command("ip").args(["link", "set", "lo", "up"]));
    World {
        _dnsmasq: start_dnsmasq(&ns, &w.hosts, 300),
        ns,
    }
}

/// The elements of resolved4 and resolved6 in `ns`, as `nft -j` lists them.
fn resolved_counts(ns: &TempNetns) -> (usize, usize) {
    let count = |set: &str| nft_set_len(ns.command("nft"), set);
    (count("resolved4"), count("resolved6"))
}

fn check_loaded(ns: &TempNetns, w: &Workload, what: &str) {
    let got = resolved_counts(ns);
    assert_eq!(
        got,
        (w.v4, w.v6),
        "{what}: resolved4/resolved6 hold {got:?} elements"
    );
}

fn apply_command(ns: &TempNetns, bin: &Path, w: &Workload, state: &Path) -> Command {
    let mut cmd = ns.command(bin.to_str().expect("a UTF-8 path"));
    cmd.arg("apply")
        .arg(&w.policy)
        .env("EGRESS_FENCE_STATE_DIR", state);
    limit_open_files(&mut cmd, w.nofile);
    cmd
}

fn nft_command(ns: &TempNetns, w: &Workload) -> Command {
    let mut cmd = ns.command("nft");
    cmd.arg("-f").arg(&w.plan);
    limit_open_files(&mut cmd, w.nofile);
    cmd
}

fn measured(cmd: &mut Command, what: &str) -> Measured {
    let (status, m, stderr) = measure_any(cmd);
    assert!(status.success(), "{what} failed ({status}): {stderr}");
    m
}

/// One apply into a fresh namespace, then one more into the same: (first, again).
fn apply_twice(bin: &Path, w: &Workload, run_no: usize) -> (Measured, Measured) {
    let world = world(w);
    let state = w.dir.join(format!("state-{run_no}"));
    let first = measured(&mut apply_command(&world.ns, bin, w, &state), "apply");
    check_loaded(&world.ns, w, "apply");
    // Without --netns the state of the namespace the command runs in is the "host"'s.
    let recorded = state.join("host").join("gen-000001.json");
    assert!(
        recorded.exists(),
        "apply recorded no generation 1: {} is missing",
        recorded.display()
    );
    let again = measured(&mut apply_command(&world.ns, bin, w, &state), "apply again");
    assert!(
        again.stdout.contains("unchanged"),
        "apply again changed something: {}",
        again.stdout
    );
    check_loaded(&world.ns, w, "apply again");
    (first, again)
}

/// `nft -f` of the plan into a fresh namespace, then once more into the same.
fn nft_twice(w: &Workload) -> (Measured, Measured) {
    let world = world(w);
    let first = measured(&mut nft_command(&world.ns, w), "nft -f");
    check_loaded(&world.ns, w, "nft -f");
    let again = measured(&mut nft_command(&world.ns, w), "nft -f again");
    check_loaded(&world.ns, w, "nft -f again");
    (first, again)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// One line of the machine's description.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name")?.split(':').nth(1))
        .map_or("unknown CPU".to_string(), |m| m.trim().to_string());
    let cpus = cpuinfo
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count();
    format!(
        "{cpus} x {model}, kernel {}, {}, {}; egress-fence {}",
        kernel_release(),
        first_line_of("nft", &["--version"]),
        first_line_of("dnsmasq", &["--version"]),
        // The build measured: the commit the bench was built from (`-dirty` with local edits).
        option_env!("CARGO_MANIFEST_DIR")
            .and_then(|dir| {
                let out = Command::new("git")
                    .args(["-C", dir, "describe", "--always", "--dirty"])
                    .output()
                    .ok()?;
                let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
                (out.status.success() && !text.is_empty()).then_some(text)
            })
            .unwrap_or_else(|| "at an unknown commit".to_string())
    )
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
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

/// The samples of one contender.
#[derive(Default)]
struct Samples {
    first: Vec<Measured>,
    again: Vec<Measured>,
}

fn row(label: &str, s: &[Measured], nft: &[Measured]) -> String {
    let med = |f: &dyn Fn(&Measured) -> Duration| median(s.iter().map(f).collect());
    let rss = median(s.iter().map(|m| m.maxrss_kib).collect());
    // Ratios within each round, then their median.
    let ratio = |a: f64, b: f64| (a / b * 1000.0).round() as u64;
    let wall_ratios: Vec<u64> = s
        .iter()
        .zip(nft)
        .map(|(m, n)| ratio(ms(m.wall), ms(n.wall)))
        .collect();
    let wall_ratio = median(wall_ratios.clone());
    // The spread says how far one round's figure may stray from the median on this machine.
    let (lo, hi) = (
        wall_ratios.iter().min().copied().unwrap_or_default(),
        wall_ratios.iter().max().copied().unwrap_or_default(),
    );
    let rss_ratio = median(
        s.iter()
            .zip(nft)
            .map(|(m, n)| ratio(m.maxrss_kib as f64, n.maxrss_kib as f64))
            .collect(),
    );
    let walls: Vec<String> = s.iter().map(|m| format!("{:.0}", ms(m.wall))).collect();
    format!(
        "| {label} | {:.1} ms | {:.1} / {:.1} ms | {:.1} MiB | {:.2} ({:.2}-{:.2}) | {:.2} | {} |",
        ms(med(&|m| m.wall)),
        ms(med(&|m| m.user)),
        ms(med(&|m| m.sys)),
        mib(rss),
        wall_ratio as f64 / 1000.0,
        lo as f64 / 1000.0,
        hi as f64 / 1000.0,
        rss_ratio as f64 / 1000.0,
        walls.join(", ")
    )
}

fn bench(args: &[String]) {
    require_root();
    let o = options(args);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut hosts = String::new();
    let mut policy = "version: 1\ndns:\n  resolvers: [127.0.0.1]\nallow:\n".to_string();
    let (mut n4, mut n6) = (0, 0);
    for i in 0..o.names {
        let n = real_name(i);
        for a in addresses(i, o.per_name) {
            let _ = writeln!(hosts, "{a} {n}");
            match a {
                IpAddr::V4(_) => n4 += 1,
                IpAddr::V6(_) => n6 += 1,
            }
        }
        let _ = writeln!(policy, "  - domain: {n}\n    ports: [443]");
    }
    let write = |file: &str, text: &str| {
        let path = dir.path().join(file);
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        path
    };
    let mut w = Workload {
        dir: dir.path().to_path_buf(),
        hosts: write("hosts", &hosts),
        policy: write("policy.yaml", &policy),
        plan: dir.path().join("plan.nft"),
        v4: n4,
        v6: n6,
        nofile: o.nofile,
    };
    let ours = our_binary();
    let mut binaries = vec![("apply (this build)".to_string(), ours.clone())];
    if let Some(b) = &o.baseline {
        binaries.push((format!("apply ({})", b.display()), b.clone()));
    }

    // The plan nft loads: what this build plans against the same resolver.
    {
        let world = world(&w);
        let mut cmd = world.ns.command(ours.to_str().expect("UTF-8"));
        let plan = measure(cmd.arg("plan").arg(&w.policy)).stdout;
        std::fs::write(&w.plan, plan).expect("plan.nft");
    }
    w.plan = w.plan.canonicalize().expect("plan.nft");
    let floor = measure(&mut forked("true")).maxrss_kib;
    println!(
        "apply_dns: {} names x {} addresses = {} ({n4} IPv4, {n6} IPv6) on tcp/443 from dnsmasq \
         on 127.0.0.1, ulimit -n {}; {} rounds; plan text {} KiB",
        o.names,
        o.per_name,
        n4 + n6,
        o.nofile,
        o.rounds,
        std::fs::metadata(&w.plan).map_or(0, |m| m.len() / 1024)
    );
    println!("machine: {}", machine());
    println!("load average at the start: {}", load_average());

    // Warm-up (modules, page cache), discarded.
    eprintln!("warming up...");
    apply_twice(&ours, &w, 0);
    nft_twice(&w);

    let mut nft = Samples::default();
    let mut applied: Vec<Samples> = binaries.iter().map(|_| Samples::default()).collect();
    let contenders = binaries.len() + 1;
    let mut run_no = 0;
    for round in 0..o.rounds {
        for k in 0..contenders {
            let which = (round + k) % contenders;
            run_no += 1;
            let (first, again) = match binaries.get(which) {
                Some((_, bin)) => {
                    let s = apply_twice(bin, &w, run_no);
                    applied[which].first.push(s.0);
                    applied[which].again.push(s.1);
                    continue;
                }
                None => nft_twice(&w),
            };
            nft.first.push(first);
            nft.again.push(again);
        }
        eprintln!(
            "round {}: {}; nft -f {:.0} ms",
            round + 1,
            binaries
                .iter()
                .zip(&applied)
                .map(|((label, _), s)| format!(
                    "{label} {:.0} ms",
                    ms(s.first.last().expect("measured").wall)
                ))
                .collect::<Vec<_>>()
                .join(", "),
            ms(nft.first.last().expect("measured").wall)
        );
    }

    println!("load average at the end: {}", load_average());
    println!(
        "spawn floor (ru_maxrss of `true` forked from the bench): {:.1} MiB",
        mib(floor)
    );
    /// Which of a side's samples a table shows.
    type Pick = fn(&Samples) -> &[Measured];
    let cases: [(&str, &str, Pick); 2] = [
        ("into a fresh namespace", "nft -f", |s| &s.first),
        ("again, nothing changed", "nft -f again", |s| &s.again),
    ];
    for (case, baseline, samples) in cases {
        println!();
        println!(
            "| {case} | wall (median) | user / sys | peak RSS | wall / {baseline} (rounds' range) \
             | peak / {baseline} | every round's wall (ms) |"
        );
        println!("|---|---|---|---|---|---|---|");
        for ((label, _), s) in binaries.iter().zip(&applied) {
            println!("{}", row(label, samples(s), samples(&nft)));
        }
        println!(
            "{}",
            row("`nft -f` of the plan", samples(&nft), samples(&nft))
        );
    }
    println!();
    println!(
        "Aim from issue 16: apply at most 1.5x the wall time and 1.5x the peak RSS of nft -f of \
         its plan. Every load was checked to hold all {} addresses.",
        n4 + n6
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    run_parent(NS_PREFIX, || bench(&args));
}
