//! Benchmark: the memory and CPU of the real daemon (`egress-fence run`, resolve mode) that
//! follows 10,000 addresses over 1,250 names and refreshes them every 30 s.
//!
//! Each run gets a throwaway network namespace of its own (`efd-<pid>-<n>`, `lo` up) with:
//!
//! * **resolver**: dnsmasq on 127.0.0.1 (`--no-resolv --no-hosts --local=/#/`: it answers
//!   only from a generated hosts file, anything else is NXDOMAIN, nothing is forwarded), TTL
//!   30 s. Name `nI.bench.example` (I < `--names`, default 1,250) has `--per-name` addresses
//!   (default 8): all IPv4 from 198.18.0.0/15 but the last, which is IPv6 from 2001:db8::/32.
//! * **the daemon**: `egress-fence run POLICY` (the policy allows every name on tcp/443 and
//!   names 127.0.0.1 as its resolver; the default `dns.refresh.min` of 30 s meets the TTL, so
//!   every name is asked again every 30 s), its state directory (`EGRESS_FENCE_STATE_DIR`) a
//!   temporary one, its log in a file, started with the limit of open files at 1,024 (soft
//!   and hard, as systemd's default `LimitNOFILE=` gives a service), by `setns` and
//!   `setrlimit` in the forked child (no `ip netns exec` process in between).
//!
//! Two ways to start, each measured on its own namespace:
//!
//! * **boot**: no table yet. The daemon puts up the table without names, looks every name up
//!   and installs the 10,000 elements as one upsert.
//! * **restart**: a first daemon did the above and was stopped with SIGTERM (the table stays);
//!   the measured daemon resolves every name before it replaces the table with the 10,000
//!   elements (and records a generation holding them).
//!
//! Once the log has a "new addresses allowed" line per name and the table's `resolved4` and
//! `resolved6` sets hold all the addresses (`nft list set` in the namespace), the start is
//! over: the daemon's CPU time so far is read (`/proc/PID/task/*/schedstat`, and user/system
//! from `/proc/PID/stat`), and the bench waits `--cycles` refresh intervals (default 3) and 5
//! seconds more, reading `VmRSS` every second. Then it reads `VmHWM` (the peak resident set
//! since exec, startup included), `VmRSS`, `/proc/PID/smaps_rollup` and `smaps` (the heap
//! mapping, anonymous and file-backed pages, thread stacks) and the CPU time again, checks
//! that the sets still hold every address and that the log has no failed lookup, and stops
//! the daemon with SIGTERM.
//!
//! Figures per binary and start (median over `--reps`, default 1): peak RSS (VmHWM), RSS at
//! the end, its anonymous and file-backed parts, the `[heap]` mapping, threads; CPU of the
//! start, and CPU over the refresh window (per refresh, and as a share of one core). With
//! `--baseline PATH` another egress-fence binary (a build of another commit) runs the same
//! workload, runs alternating with ours, and the table shows ours/baseline.
//!
//! No figure is asserted: this is a benchmark. Nothing is loaded into the root network
//! namespace: the daemon only ever runs inside the bench's namespaces, and `nft` only reads
//! them. Every process the bench starts is ended by a drop guard and every namespace removed,
//! also on panic or SIGINT/SIGTERM/SIGHUP.
//!
//! Run as root (needs `ip`, `nft`, `dnsmasq` from dnsmasq-base): `cargo bench --bench daemon`
//! (about 4 minutes with the defaults, 8 with a baseline). Options after `--`: `--cycles K`,
//! `--reps R`, `--names N`, `--per-name A`, `--start boot|restart|both`, `--baseline PATH`,
//! `--keep DIR` (copies of each run's log, smaps and samples).

#![deny(unsafe_code)]

#[allow(unsafe_code)] // its blocks, each with its SAFETY comment, are the benches' only ones
mod common;

use std::fmt::Write as _;
use std::fs::File;
use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    TempNetns, dnsmasq_from_hosts, end_process, kernel_release, limit_open_files, median,
    require_root, run, run_parent, v4,
};

/// This bench's namespaces are `efd-<pid>-<n>`.
const NS_PREFIX: &str = "efd-";
const RESOLVER: &str = "127.0.0.1";
/// dnsmasq's TTL, which is also the daemon's default `dns.refresh.min`: one refresh per 30 s.
const TTL_S: u64 = 30;
/// The limit of open files of the daemon (systemd's default for a service).
const NOFILE: u64 = 1024;
/// How long the start may take before the bench gives up.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Waited past the last refresh of the window, so that it is over when the window closes,
/// and well before the next one.
const SETTLE: Duration = Duration::from_secs(5);

struct Options {
    cycles: u32,
    reps: usize,
    names: usize,
    per_name: usize,
    starts: Vec<Start>,
    baseline: Option<PathBuf>,
    keep: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq)]
enum Start {
    Boot,
    Restart,
}

impl Start {
    fn label(self) -> &'static str {
        match self {
            Start::Boot => "boot",
            Start::Restart => "restart",
        }
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: daemon [--cycles K] [--reps R] [--names N] [--per-name A] \
         [--start boot|restart|both] [--baseline PATH] [--keep DIR]  (run with cargo bench)"
    );
    std::process::exit(2)
}

fn options(args: &[String]) -> Options {
    let mut o = Options {
        cycles: 3,
        reps: 1,
        names: 1_250,
        per_name: 8,
        starts: vec![Start::Boot, Start::Restart],
        baseline: None,
        keep: None,
    };
    let mut it = args.iter().filter(|a| *a != "--bench");
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().unwrap_or_else(|| usage());
        let mut number = || value().replace('_', "").parse().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--cycles" => o.cycles = number() as u32,
            "--reps" => o.reps = number(),
            "--names" => o.names = number(),
            "--per-name" => o.per_name = number(),
            "--start" => {
                o.starts = match value().as_str() {
                    "boot" => vec![Start::Boot],
                    "restart" => vec![Start::Restart],
                    "both" => vec![Start::Boot, Start::Restart],
                    _ => usage(),
                }
            }
            "--baseline" => o.baseline = Some(PathBuf::from(value())),
            "--keep" => o.keep = Some(PathBuf::from(value())),
            _ => usage(),
        }
    }
    // Every address of every name must fit 198.18.0.0/15; a name answers at most 256 of a
    // family (src/daemon/).
    if o.reps == 0 || o.names == 0 || !(1..=256).contains(&o.per_name) {
        usage();
    }
    if o.names * o.per_name > common::V4_POOL {
        usage();
    }
    o
}

fn name(i: usize) -> String {
    format!("n{i}.bench.example")
}

/// The addresses of name `i`: all IPv4 but the last, which is IPv6.
fn addresses(i: usize, per_name: usize) -> Vec<IpAddr> {
    (0..per_name)
        .map(|k| match k + 1 == per_name && per_name > 1 {
            true => IpAddr::V6(Ipv6Addr::from((0x2001_0db8_u128 << 96) | i as u128)),
            false => v4(i * per_name + k),
        })
        .collect()
}

/// Processes the bench started, ended on drop (before the namespace they run in goes).
#[derive(Default)]
struct Procs(Vec<(&'static str, Child)>);

impl Procs {
    fn spawn(&mut self, what: &'static str, cmd: &mut Command, log: &Path) -> u32 {
        let log = File::create(log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let err = log.try_clone().expect("dup");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let pid = child.id();
        self.0.push((what, child));
        pid
    }

    /// SIGTERM to the process `pid`, then waits for it (3 s, then SIGKILL).
    fn stop(&mut self, pid: u32) {
        if let Some(i) = self.0.iter().position(|(_, c)| c.id() == pid) {
            let (what, child) = self.0.remove(i);
            end_process(what, child);
        }
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        while let Some((what, child)) = self.0.pop() {
            end_process(what, child);
        }
    }
}

fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// A `Key:   123 kB` line of a /proc file, in KiB.
fn kib(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {text}"))
}

/// CPU time of process `pid` so far: (on CPU, from every thread's schedstat; user; system).
fn cpu(pid: u32) -> (Duration, Duration, Duration) {
    let mut on_cpu = 0u64;
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the daemon runs");
    for task in tasks.flatten() {
        let stat = read_lossy(&task.path().join("schedstat"));
        on_cpu += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    let stat = read_lossy(Path::new(&format!("/proc/{pid}/stat")));
    // Fields after the command (which may hold spaces) start at field 3.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<u64> = rest
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    let tick = |f: u64| Duration::from_millis(f * 10); // USER_HZ = 100
    (
        Duration::from_nanos(on_cpu),
        tick(fields.get(11).copied().unwrap_or(0)),
        tick(fields.get(12).copied().unwrap_or(0)),
    )
}

/// Resident KiB per kind of mapping from `/proc/PID/smaps`: `[heap]`, other anonymous
/// mappings (thread stacks, mmapped allocations, glibc arenas), the executable, libraries.
fn smaps_breakdown(smaps: &str, exe: &Path) -> [u64; 4] {
    let exe_name = exe.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let mut out = [0u64; 4];
    let mut kind = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            let path = line.split_whitespace().nth(5).unwrap_or("");
            kind = match path {
                "[heap]" => 0,
                "" | "[stack]" | "[vvar]" | "[vdso]" | "[anon]" => 1,
                p if p.ends_with(exe_name) => 2,
                _ => 3,
            };
        } else if let Some(v) = line.strip_prefix("Rss:") {
            out[kind] += v
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    out
}

/// Elements in the table's resolved sets, read back with `nft` in the namespace.
fn resolved_elements(ns: &TempNetns) -> usize {
    let mut n = 0;
    for set in ["resolved4", "resolved6"] {
        let out = ns
            .command("nft")
            .args(["list", "set", "inet", "egress_fence", set])
            .output()
            .expect("nft");
        n += String::from_utf8_lossy(&out.stdout)
            .matches(" expires ")
            .count();
    }
    n
}

struct Sample {
    hwm_start_kib: u64,
    hwm_kib: u64,
    rss_kib: u64,
    max_rss_kib: u64,
    anon_kib: u64,
    file_kib: u64,
    heap_kib: u64,
    other_anon_kib: u64,
    threads: usize,
    start_cpu: Duration,
    window: Duration,
    window_cpu: Duration,
    window_user: Duration,
    window_sys: Duration,
}

struct Workload {
    dir: PathBuf,
    policy: PathBuf,
    hosts: PathBuf,
    names: usize,
    addrs: usize,
}

fn daemon_command(ns: &TempNetns, bin: &Path, w: &Workload, state: &Path) -> Command {
    let mut cmd = ns.command(bin.to_str().expect("a UTF-8 path"));
    cmd.arg("run")
        .arg(&w.policy)
        .env("EGRESS_FENCE_STATE_DIR", state)
        .env("RUST_LOG", "info");
    limit_open_files(&mut cmd, NOFILE);
    cmd
}

/// Waits until the daemon logging to `log` has taken in every name and the table holds every
/// address.
fn wait_started(ns: &TempNetns, pid: u32, log: &Path, w: &Workload) {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let text = read_lossy(log);
        assert!(
            Path::new(&format!("/proc/{pid}")).exists(),
            "egress-fence exited:\n{text}"
        );
        if text.contains("running")
            && text.matches("new addresses allowed").count() >= w.names
            && resolved_elements(ns) == w.addrs
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "egress-fence did not install every address within {START_TIMEOUT:?}:\n{}",
            text.lines().rev().take(20).collect::<Vec<_>>().join("\n")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn one_run(bin: &Path, start: Start, w: &Workload, o: &Options, run_no: usize) -> Sample {
    let ns = TempNetns::new(NS_PREFIX);
    run(ns.command("ip").args(["link", "set", "lo", "up"]));
    let dir = w.dir.join(format!("run{run_no}"));
    std::fs::create_dir_all(&dir).expect("run dir");
    let path = |f: &str| dir.join(f);
    // Declared after the namespace: dropped (every process ended) before it goes.
    let mut procs = Procs::default();
    procs.spawn(
        "dnsmasq",
        &mut dnsmasq_from_hosts(&ns, RESOLVER, &w.hosts, TTL_S as u32),
        &path("dnsmasq.log"),
    );
    let state = path("state");
    if start == Start::Restart {
        let first = procs.spawn(
            "the first egress-fence",
            &mut daemon_command(&ns, bin, w, &state),
            &path("first.log"),
        );
        wait_started(&ns, first, &path("first.log"), w);
        procs.stop(first);
    }
    let log = path("egress-fence.log");
    let pid = procs.spawn(
        "egress-fence",
        &mut daemon_command(&ns, bin, w, &state),
        &log,
    );
    wait_started(&ns, pid, &log, w);
    let status = |pid: u32| read_lossy(Path::new(&format!("/proc/{pid}/status")));
    let hwm_start_kib = kib(&status(pid), "VmHWM");
    let at_start = Instant::now();
    let (cpu0, user0, sys0) = cpu(pid);

    let window = Duration::from_secs(TTL_S) * o.cycles + SETTLE;
    let mut max_rss_kib = 0;
    let mut samples = String::new();
    while at_start.elapsed() < window {
        std::thread::sleep(Duration::from_secs(1));
        let s = status(pid);
        assert!(!s.is_empty(), "egress-fence exited:\n{}", read_lossy(&log));
        let rss = kib(&s, "VmRSS");
        max_rss_kib = max_rss_kib.max(rss);
        let (c, _, _) = cpu(pid);
        let _ = writeln!(
            samples,
            "{:.1} s: VmRSS {rss} KiB, cpu {:.3} s",
            at_start.elapsed().as_secs_f64(),
            (c - cpu0).as_secs_f64()
        );
    }
    let (cpu1, user1, sys1) = cpu(pid);
    let window = at_start.elapsed();
    let s = status(pid);
    let rollup = read_lossy(Path::new(&format!("/proc/{pid}/smaps_rollup")));
    let smaps = read_lossy(Path::new(&format!("/proc/{pid}/smaps")));
    let [heap_kib, other_anon_kib, _, _] = smaps_breakdown(&smaps, bin);
    let held = resolved_elements(&ns);
    procs.stop(pid);
    let text = read_lossy(&log);
    assert_eq!(
        held, w.addrs,
        "the sets hold {held} elements, not {}",
        w.addrs
    );
    assert!(
        !text.contains("lookup failed") && !text.contains("resolver failure"),
        "lookups failed during the window:\n{text}"
    );
    if let Some(keep) = &o.keep {
        let to = keep.join(format!("run{run_no}-{}", start.label()));
        std::fs::create_dir_all(&to).expect("--keep dir");
        for (f, t) in [
            ("egress-fence.log", text.as_str()),
            ("smaps", smaps.as_str()),
            ("smaps_rollup", rollup.as_str()),
            ("status", s.as_str()),
            ("samples", samples.as_str()),
        ] {
            std::fs::write(to.join(f), t).expect("--keep");
        }
    }
    let rss_kib = kib(&s, "VmRSS");
    let anon_kib = kib(&rollup, "Anonymous");
    Sample {
        hwm_start_kib,
        hwm_kib: kib(&s, "VmHWM"),
        rss_kib,
        max_rss_kib,
        anon_kib,
        file_kib: rss_kib.saturating_sub(anon_kib),
        heap_kib,
        other_anon_kib,
        threads: kib(&s, "Threads") as usize,
        start_cpu: cpu0,
        window,
        window_cpu: cpu1 - cpu0,
        window_user: user1 - user0,
        window_sys: sys1 - sys0,
    }
}

/// The medians of `samples`' figures, as the table's cells.
struct Row {
    hwm: f64,
    hwm_start: f64,
    rss: f64,
    max_rss: f64,
    anon: f64,
    file: f64,
    heap: f64,
    other_anon: f64,
    threads: usize,
    start_cpu: f64,
    per_refresh: f64,
    user_sys: (f64, f64),
    core_pct: f64,
}

fn row(samples: &[Sample], cycles: u32) -> Row {
    let mib = |f: fn(&Sample) -> u64| median(samples.iter().map(f).collect()) as f64 / 1024.0;
    let secs = |f: fn(&Sample) -> Duration| median(samples.iter().map(f).collect()).as_secs_f64();
    Row {
        hwm: mib(|s| s.hwm_kib),
        hwm_start: mib(|s| s.hwm_start_kib),
        rss: mib(|s| s.rss_kib),
        max_rss: mib(|s| s.max_rss_kib),
        anon: mib(|s| s.anon_kib),
        file: mib(|s| s.file_kib),
        heap: mib(|s| s.heap_kib),
        other_anon: mib(|s| s.other_anon_kib),
        threads: median(samples.iter().map(|s| s.threads).collect()),
        start_cpu: secs(|s| s.start_cpu),
        per_refresh: secs(|s| s.window_cpu) / f64::from(cycles),
        user_sys: (
            secs(|s| s.window_user) / f64::from(cycles),
            secs(|s| s.window_sys) / f64::from(cycles),
        ),
        core_pct: median(
            samples
                .iter()
                .map(|s| (s.window_cpu.as_secs_f64() / s.window.as_secs_f64() * 1e6) as u64)
                .collect(),
        ) as f64
            / 1e4,
    }
}

fn bench(args: &[String]) {
    require_root();
    let o = options(args);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut hosts = String::new();
    let mut policy = format!("version: 1\ndns:\n  resolvers: [{RESOLVER}]\nallow:\n");
    for i in 0..o.names {
        let n = name(i);
        for a in addresses(i, o.per_name) {
            let _ = writeln!(hosts, "{a} {n}");
        }
        let _ = writeln!(policy, "  - domain: {n}\n    ports: [443]");
    }
    let write = |file: &str, text: &str| {
        let path = dir.path().join(file);
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        path
    };
    let w = Workload {
        dir: dir.path().to_path_buf(),
        policy: write("policy.yaml", &policy),
        hosts: write("hosts", &hosts),
        names: o.names,
        addrs: o.names * o.per_name,
    };
    let ours = PathBuf::from(env!("CARGO_BIN_EXE_egress-fence"));
    let mut binaries = vec![("this build".to_string(), ours)];
    if let Some(b) = &o.baseline {
        binaries.push((b.display().to_string(), b.clone()));
    }

    println!(
        "daemon: egress-fence run, {} names x {} addresses = {} (tcp/443), dnsmasq on {RESOLVER} \
         with TTL {TTL_S} s (= one refresh per {TTL_S} s), ulimit -n {NOFILE}; {} refreshes \
         measured; median of {}; kernel {}",
        o.names,
        o.per_name,
        w.addrs,
        o.cycles,
        o.reps,
        kernel_release()
    );
    let mut results: Vec<Vec<Vec<Sample>>> = o
        .starts
        .iter()
        .map(|_| binaries.iter().map(|_| Vec::new()).collect())
        .collect();
    let mut run_no = 0;
    for _ in 0..o.reps {
        for (si, &start) in o.starts.iter().enumerate() {
            for (bi, (label, bin)) in binaries.iter().enumerate() {
                eprintln!("{} start, {label}...", start.label());
                run_no += 1;
                results[si][bi].push(one_run(bin, start, &w, &o, run_no));
            }
        }
    }

    println!(
        "| start | binary | peak RSS (VmHWM) | after start | RSS at end (max) | anon / file | \
         [heap] / other anon | threads | CPU of the start | CPU per refresh (user + sys) | \
         share of a core |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (si, start) in o.starts.iter().enumerate() {
        let rows: Vec<Row> = results[si].iter().map(|s| row(s, o.cycles)).collect();
        for ((label, _), r) in binaries.iter().zip(&rows) {
            println!(
                "| {} | {label} | {:.1} MiB | {:.1} MiB | {:.1} ({:.1}) MiB | {:.1} / {:.1} MiB | \
                 {:.1} / {:.1} MiB | {} | {:.3} s | {:.3} s ({:.3} + {:.3}) | {:.2} % |",
                start.label(),
                r.hwm,
                r.hwm_start,
                r.rss,
                r.max_rss,
                r.anon,
                r.file,
                r.heap,
                r.other_anon,
                r.threads,
                r.start_cpu,
                r.per_refresh,
                r.user_sys.0,
                r.user_sys.1,
                r.core_pct
            );
        }
        if let [ours, base] = &rows[..] {
            println!(
                "| {} | ours/baseline | {:.2} | {:.2} | {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | | \
                 {:.2} | {:.2} | {:.2} |",
                start.label(),
                ours.hwm / base.hwm,
                ours.hwm_start / base.hwm_start,
                ours.rss / base.rss,
                ours.anon / base.anon,
                ours.file / base.file,
                ours.heap / base.heap,
                ours.other_anon / base.other_anon.max(f64::MIN_POSITIVE),
                ours.start_cpu / base.start_cpu,
                ours.per_refresh / base.per_refresh,
                ours.core_pct / base.core_pct,
            );
        }
    }
    println!(
        "Checked on every run: the sets held all {} addresses after the start and at the end; \
         no lookup failed.",
        w.addrs
    );
    println!(
        "Aim from issue 14: peak RSS at most 24 MiB; CPU for the refreshes no higher than before."
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    run_parent(NS_PREFIX, || bench(&args));
}
