//! Benchmark: how long `egress-fence exec` takes from being started to CMD running, beside the
//! bare cost of a network namespace.
//!
//! The world is throwaway: a namespace `efx-<pid>-0` plays the host (`lo` up, a veth to a
//! second namespace `efx-<pid>-1` that plays its network: 10.77.0.2/24 here, 10.77.0.1 there,
//! a default route through it, which pasta copies into exec's namespace). Every measured
//! command is started in the host namespace by `setns` in the forked child
//! ([`TempNetns::command`]), so exec never runs in the machine's own namespace.
//!
//! CMD is this bench's own binary with `--stamp`: it prints CLOCK_MONOTONIC (nanoseconds) as
//! the first thing it does and exits. The bench reads CLOCK_MONOTONIC just before it spawns
//! the command; the difference is "started to CMD running" (CMD's own start, a static-ish
//! Rust binary, is in every variant alike). Pid and time namespaces are not involved in
//! CLOCK_MONOTONIC (exec makes no time namespace), so both clocks are one.
//!
//! Variants, one sample of each per round, interleaved (`--runs` rounds, default 50, after 3
//! unmeasured ones):
//!
//! * **plain**: CMD alone (fork+exec, the floor).
//! * **unshare --net**: CMD in a fresh, empty network namespace (util-linux).
//! * **ip netns exec**: CMD in the existing host namespace through iproute2 (its own mount
//!   namespace, /etc/netns bind mounts, as exec does for resolv.conf).
//! * **exec**: `egress-fence exec --policy P -- CMD`, P being guard mode with `log.group`
//!   (so exec follows the refusals too), one CIDR on tcp/443, the upstream resolver 10.77.0.1.
//! * **exec --canary**: the same with `--canary` (pasta also captures the tap to a file).
//!
//! For the exec variants the time also splits into exec's steps: exec logs each at debug
//! level with a wall-clock timestamp (`RUST_LOG=egress_fence::exec=debug`), which is set
//! against the wall clock read beside the monotonic one at spawn.
//!
//! Figures: p50 and p90 (nearest rank) of "started to CMD running" and of the whole run
//! (until the command was reaped: exec's teardown included), and p50 of each exec step.
//! Run as root: `cargo bench --bench exec [-- --runs N]`.
#![deny(unsafe_code)]

#[allow(unsafe_code)] // its blocks, each with its SAFETY comment, are the benches' only ones
mod common;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{TempNetns, kernel_release, percentile, require_root, run, run_parent};
use nix::time::{ClockId, clock_gettime};

const NS_PREFIX: &str = "efx-";
/// Rounds measured unless `--runs` says otherwise.
const DEFAULT_RUNS: usize = 50;
/// Rounds run first and not counted (caches, page cache of the binaries).
const WARMUP: usize = 3;
/// The steps exec logs, in order: each row of the breakdown is the time from the previous
/// one (from the spawn, for the first) to this one.
const STEPS: [(&str, &str); 7] = [
    ("exec: started", "process start (exec, clap, logging)"),
    (
        "exec: namespace made, starting the fence",
        "policy load, namespace, resolution and plan",
    ),
    (
        "exec: the table is the planned one",
        "table applied by the daemon thread, read back",
    ),
    (
        "exec: the guard's refusals are followed",
        "refusal log (NFLOG) and guard events followed",
    ),
    (
        "exec: the inside started, starting pasta",
        "pid namespace, inside started",
    ),
    (
        "exec: pasta connected the namespace",
        "pasta started, namespace connected",
    ),
    (
        "exec: fence proved, CMD starts",
        "table proved again, go to the inside",
    ),
];

fn monotonic_ns() -> u64 {
    let t = clock_gettime(ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC");
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

/// The wall clock as nanoseconds since midnight UTC (what the log's timestamps give).
fn wall_ns_of_day() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970");
    (since.as_nanos() % (86_400 * 1_000_000_000)) as u64
}

/// CMD: the monotonic clock, first thing.
fn stamp() {
    println!("{}", monotonic_ns());
}

struct Options {
    runs: usize,
}

fn options(args: &[String]) -> Options {
    let mut o = Options { runs: DEFAULT_RUNS };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--runs" => {
                o.runs = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--runs N (a number)")
            }
            // cargo bench passes --bench.
            "--bench" => {}
            other => panic!("unknown argument {other}; usage: exec [--runs N]"),
        }
    }
    o
}

/// The world: the host namespace (with its veth to the network namespace) and that one.
struct World {
    host: TempNetns,
    _network: TempNetns,
}

impl World {
    fn new() -> World {
        let host = TempNetns::new(NS_PREFIX);
        let network = TempNetns::new(NS_PREFIX);
        let ip = |ns: &TempNetns, args: &[&str]| run(ns.command("ip").args(args));
        ip(&host, &["link", "set", "lo", "up"]);
        ip(&network, &["link", "set", "lo", "up"]);
        ip(
            &host,
            &[
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                "up0",
                "netns",
                &network.name,
            ],
        );
        ip(&host, &["addr", "add", "10.77.0.2/24", "dev", "eth0"]);
        ip(&host, &["link", "set", "eth0", "up"]);
        ip(&network, &["addr", "add", "10.77.0.1/24", "dev", "up0"]);
        ip(&network, &["link", "set", "up0", "up"]);
        ip(&host, &["route", "add", "default", "via", "10.77.0.1"]);
        World {
            host,
            _network: network,
        }
    }
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const POLICY: &str = "version: 1\nallow:\n  - cidr: 10.77.0.1/32\n    ports: [443]\n\
dns:\n  mode: guard\n  listen: [\"127.0.0.53:53\"]\n  upstream: [10.77.0.1]\n\
log:\n  group: 100\n";

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Plain,
    Unshare,
    IpNetnsExec,
    Exec,
    ExecCanary,
}

const VARIANTS: [Variant; 5] = [
    Variant::Plain,
    Variant::Unshare,
    Variant::IpNetnsExec,
    Variant::Exec,
    Variant::ExecCanary,
];

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Plain => "plain (CMD alone)",
            Variant::Unshare => "unshare --net CMD",
            Variant::IpNetnsExec => "ip netns exec HOST CMD",
            Variant::Exec => "egress-fence exec --policy P -- CMD",
            Variant::ExecCanary => "egress-fence exec --canary --policy P -- CMD",
        }
    }

    fn is_exec(self) -> bool {
        matches!(self, Variant::Exec | Variant::ExecCanary)
    }
}

struct Setup {
    stamp: PathBuf,
    egress_fence: PathBuf,
    policy: PathBuf,
    state: PathBuf,
}

/// One sample: started to CMD running, the whole run, and exec's steps (offsets from the
/// spawn, in [`STEPS`] order) when it is exec.
struct Sample {
    to_cmd_ns: u64,
    whole_ns: u64,
    steps_ns: Vec<u64>,
}

fn command(world: &World, setup: &Setup, variant: Variant) -> Command {
    let stamp = setup.stamp.to_str().expect("utf-8 path");
    let mut cmd = match variant {
        Variant::Plain => world.host.command(stamp),
        Variant::Unshare => {
            let mut c = world.host.command("unshare");
            c.arg("--net");
            c
        }
        Variant::IpNetnsExec => {
            let mut c = world.host.command("ip");
            c.args(["netns", "exec", &world.host.name]);
            c
        }
        Variant::Exec | Variant::ExecCanary => {
            let mut c = world
                .host
                .command(setup.egress_fence.to_str().expect("utf-8 path"));
            c.arg("exec");
            if variant == Variant::ExecCanary {
                c.arg("--canary");
            }
            c.arg("--policy")
                .arg(&setup.policy)
                .args(["--user", "root", "--"])
                .env("EGRESS_FENCE_STATE_DIR", &setup.state)
                .env("RUST_LOG", "egress_fence::exec=debug")
                .env("NO_COLOR", "1");
            c
        }
    };
    if variant != Variant::Plain {
        cmd.arg(stamp);
    }
    cmd.arg("--stamp");
    cmd
}

fn one(world: &World, setup: &Setup, variant: Variant) -> Sample {
    let mut cmd = command(world, setup, variant);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let wall_at_spawn = wall_ns_of_day();
    let started = monotonic_ns();
    let began = Instant::now();
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let mut stderr_pipe = child.stderr.take().expect("piped");
    let stderr_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr_pipe.read_to_string(&mut text);
        text
    });
    let mut stdout = String::new();
    let _ = child
        .stdout
        .take()
        .expect("piped")
        .read_to_string(&mut stdout);
    let status = child.wait().expect("wait");
    let whole = began.elapsed();
    let stderr = stderr_reader.join().unwrap_or_default();
    common::check_interrupted();
    let cmd_at: u64 = stdout
        .lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "{}: CMD printed no stamp ({status})\n{stdout}\n{stderr}",
                variant.label()
            )
        });
    assert!(
        status.success(),
        "{} failed ({status}): {stderr}",
        variant.label()
    );
    let steps_ns = if variant.is_exec() {
        STEPS
            .iter()
            .map(|(line, _)| step_offset(&stderr, line, wall_at_spawn))
            .collect()
    } else {
        Vec::new()
    };
    Sample {
        to_cmd_ns: cmd_at.saturating_sub(started),
        whole_ns: whole.as_nanos() as u64,
        steps_ns,
    }
}

/// When exec logged `line`, as nanoseconds after the spawn (the log's timestamp is
/// `YYYY-MM-DDTHH:MM:SS.ffffffZ`, UTC).
fn step_offset(log: &str, line: &str, wall_at_spawn: u64) -> u64 {
    let logged = log
        .lines()
        .find(|l| l.contains(line))
        .unwrap_or_else(|| panic!("exec did not log {line:?}:\n{log}"));
    let time = logged
        .split_whitespace()
        .next()
        .and_then(|t| t.split_once('T'))
        .map(|(_, t)| t.trim_end_matches('Z'))
        .unwrap_or_else(|| panic!("no timestamp in {logged:?}"));
    let mut parts = time.split(':');
    let mut field = || -> f64 {
        parts
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("bad timestamp in {logged:?}"))
    };
    let (h, m, s) = (field(), field(), field());
    let at = ((h * 3600.0 + m * 60.0 + s) * 1e9) as u64;
    const DAY: u64 = 86_400 * 1_000_000_000;
    (at + DAY - wall_at_spawn) % DAY
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn version(program: &str, arg: &str) -> String {
    Command::new(program)
        .arg(arg)
        .output()
        .map(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned()
                + &String::from_utf8_lossy(&o.stderr);
            text.lines().next().unwrap_or("").trim().to_string()
        })
        .unwrap_or_else(|_| format!("{program}: not found"))
}

fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, m)| m.trim())
        })
        .unwrap_or("unknown CPU")
        .to_string();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpus} x {model}")
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn pasta_version() -> String {
    // pasta prints no version of its own on Debian; the package says it.
    let out = Command::new("dpkg-query")
        .args(["-W", "-f", "${Version}", "passt"])
        .output();
    match out {
        Ok(o) if o.status.success() => format!("passt {}", String::from_utf8_lossy(&o.stdout)),
        _ => version("pasta", "--version"),
    }
}

fn bench(args: &[String]) {
    require_root();
    let o = options(args);
    let dir = TempDir(std::env::temp_dir().join(format!("efx-bench-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).expect("a temporary directory");
    let policy = dir.0.join("policy.yaml");
    std::fs::write(&policy, POLICY).expect("write the policy");
    let setup = Setup {
        stamp: std::env::current_exe().expect("current_exe"),
        egress_fence: PathBuf::from(env!("CARGO_BIN_EXE_egress-fence")),
        policy,
        state: dir.0.join("state"),
    };
    let world = World::new();

    println!(
        "exec: started to CMD running, {} rounds (+{WARMUP} unmeasured), variants interleaved",
        o.runs
    );
    println!(
        "machine: {}; kernel {}; load {}",
        machine(),
        kernel_release(),
        loadavg()
    );
    println!(
        "{}; {}; {}; egress-fence {}",
        version("ip", "-V"),
        version("unshare", "--version"),
        pasta_version(),
        version(setup.egress_fence.to_str().expect("utf-8"), "--version"),
    );
    let mut samples: Vec<Vec<Sample>> = VARIANTS.iter().map(|_| Vec::new()).collect();
    for round in 0..WARMUP + o.runs {
        for (i, &variant) in VARIANTS.iter().enumerate() {
            let sample = one(&world, &setup, variant);
            if round >= WARMUP {
                samples[i].push(sample);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    println!();
    println!("| variant | to CMD p50 | p90 | whole run p50 | p90 |");
    println!("|---|---|---|---|---|");
    for (variant, s) in VARIANTS.iter().zip(&samples) {
        let to_cmd: Vec<u64> = s.iter().map(|x| x.to_cmd_ns).collect();
        let whole: Vec<u64> = s.iter().map(|x| x.whole_ns).collect();
        println!(
            "| {} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
            variant.label(),
            ms(percentile(&to_cmd, 50.0)),
            ms(percentile(&to_cmd, 90.0)),
            ms(percentile(&whole, 50.0)),
            ms(percentile(&whole, 90.0)),
        );
    }
    for (variant, s) in VARIANTS.iter().zip(&samples) {
        if !variant.is_exec() {
            continue;
        }
        println!();
        println!(
            "{}: where the time goes (p50 of each step)",
            variant.label()
        );
        println!("| step | p50 | p90 |");
        println!("|---|---|---|");
        for (k, (_, what)) in STEPS.iter().enumerate() {
            let spans: Vec<u64> = s
                .iter()
                .map(|x| {
                    let before = if k == 0 { 0 } else { x.steps_ns[k - 1] };
                    x.steps_ns[k].saturating_sub(before)
                })
                .collect();
            println!(
                "| {what} | {:.1} ms | {:.1} ms |",
                ms(percentile(&spans, 50.0)),
                ms(percentile(&spans, 90.0))
            );
        }
        let last: Vec<u64> = s
            .iter()
            .map(|x| {
                x.to_cmd_ns
                    .saturating_sub(*x.steps_ns.last().expect("steps"))
            })
            .collect();
        println!(
            "| the inside execs CMD, CMD starts | {:.1} ms | {:.1} ms |",
            ms(percentile(&last, 50.0)),
            ms(percentile(&last, 90.0))
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--stamp") => stamp(),
        _ => run_parent(NS_PREFIX, || bench(&args)),
    }
}
