//! What the `apply` and `refresh` benchmarks share: the synthetic workload (policy, addresses,
//! resolutions), throwaway network namespaces, signal handling, spawning and reaping children
//! and reading their `key=value` reports, and the statistics of samples.
//!
//! Both benches include it with `mod common;` (Cargo makes bench targets only of `benches/*.rs`
//! and `benches/*/main.rs`, so this file is none). Every `unsafe` block of the benchmarks is
//! here, each with the reason it holds: the benches deny `unsafe_code` everywhere else, so a
//! new one has to come here and be justified.
//!
//! Rules are never loaded into the root network namespace, only into the bench's own
//! [`TempNetns`]es: by a child of the bench after [`enter`], which accepts only the names of the
//! bench's namespaces and checks that the switch took, or by a tool spawned with
//! [`TempNetns::command`], which does not run at all if it cannot switch. A [`TempNetns`] is
//! removed on drop, also when a panic unwinds, and SIGINT/SIGTERM/SIGHUP become such a panic
//! (see [`install_signal_handlers`]).
// Each bench compiles its own copy of this module and uses only part of it.
#![allow(dead_code)]
#![warn(clippy::undocumented_unsafe_blocks)]

use std::fs::File;
use std::io::{ErrorKind, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::panic::UnwindSafe;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use egress_fence::core::policy::{DomainName, Policy};
use egress_fence::core::resolution::{Resolution, ResolvedAddr, ResolvedHost};
use egress_fence::netns::Netns;
use nix::sched::{CloneFlags, setns};

// ---- the workload --------------------------------------------------------------------------

/// Allowed names the addresses are spread over.
pub const NAMES: usize = 100;
/// Of every 10 initial addresses (by block of [`NAMES`]), this many are IPv6.
pub const V6_PER_10: usize = 1;
/// The one port every name allows, over TCP.
pub const PORT: u16 = 443;
/// The resolver the synthetic resolutions name (TEST-NET-1: nothing is ever sent to it).
const RESOLVER: &str = "192.0.2.53";
/// The TTL of every synthetic answer.
const TTL: u32 = 300;
/// The N measured unless `--sizes` says otherwise.
pub const DEFAULT_SIZES: [usize; 3] = [1_000, 10_000, 100_000];
/// Addresses in 198.18.0.0/15, the pool every IPv4 address is taken from.
pub const V4_POOL: usize = 1 << 17;

/// The `i`th allowed name, `hI.bench.example`.
pub fn name(i: usize) -> DomainName {
    format!("h{i}.bench.example").parse().expect("a valid name")
}

/// The bench policy: [`NAMES`] names, each allowing tcp/[`PORT`], and [`RESOLVER`].
pub fn policy() -> Policy {
    let mut text = format!("version: 1\ndns:\n  resolvers: [{RESOLVER}]\nallow:\n");
    for i in 0..NAMES {
        text.push_str(&format!("  - domain: {}\n    ports: [{PORT}]\n", name(i)));
    }
    Policy::parse(&text, Path::new("bench-policy.yaml"))
        .unwrap_or_else(|e| panic!("the bench policy is invalid: {e}"))
}

/// The `i`th address of 198.18.0.0/15.
pub fn v4(i: usize) -> IpAddr {
    assert!(i < V4_POOL, "198.18.0.0/15 holds {V4_POOL} addresses");
    IpAddr::V4(Ipv4Addr::from(
        u32::from(Ipv4Addr::new(198, 18, 0, 0)) + i as u32,
    ))
}

/// The `j`th initial address: blocks of [`NAMES`] consecutive indices share a family, so that
/// every name gets the same mix of IPv4 and IPv6.
pub fn initial_address(j: usize) -> IpAddr {
    if (j / NAMES) % 10 < V6_PER_10 {
        IpAddr::V6(Ipv6Addr::from((0x2001_0db8_u128 << 96) | j as u128))
    } else {
        v4(j)
    }
}

/// The answer of every name when `n` addresses are resolved: address `j` is name `j % NAMES`'s.
pub fn initial_answers(n: usize) -> Vec<Vec<IpAddr>> {
    let mut answers = vec![Vec::new(); NAMES];
    for j in 0..n {
        answers[j % NAMES].push(initial_address(j));
    }
    answers
}

/// `answers[i]` as name `i`'s answer, in the order a real resolution lists hosts and addresses.
pub fn resolution(answers: &[Vec<IpAddr>]) -> Resolution {
    let mut hosts: Vec<ResolvedHost> = answers
        .iter()
        .enumerate()
        .map(|(i, addrs)| {
            let mut addrs: Vec<ResolvedAddr> = addrs
                .iter()
                .map(|&addr| ResolvedAddr { addr, ttl: TTL })
                .collect();
            addrs.sort();
            ResolvedHost {
                name: name(i),
                addrs,
                nxdomain: false,
                dropped: Vec::new(),
                errors: Vec::new(),
            }
        })
        .collect();
    hosts.sort_by(|a, b| a.name.cmp(&b.name));
    Resolution {
        resolvers: vec![RESOLVER.parse().expect("an address")],
        hosts,
        guard_uid: None,
        scope: Default::default(),
    }
}

// ---- namespaces --------------------------------------------------------------------------------

static NS_COUNTER: AtomicU32 = AtomicU32::new(0);

/// The names of this process's namespaces start with this: the bench's `prefix` (`efb-`,
/// `efr-`) and our pid, so that concurrent runs never collide and a leftover tells whose it is.
fn ns_prefix(prefix: &str) -> String {
    format!("{prefix}{}-", std::process::id())
}

/// A fresh network namespace, deleted on drop.
pub struct TempNetns {
    pub name: String,
    /// Held open for [`TempNetns::command`]; closed before the namespace is deleted.
    file: Option<File>,
}

impl TempNetns {
    /// `ip netns add <prefix><pid>-<n>`, `prefix` being the bench's own.
    pub fn new(prefix: &str) -> TempNetns {
        let name = format!(
            "{}{}",
            ns_prefix(prefix),
            NS_COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        run(Command::new("ip").args(["netns", "add", &name]));
        // Built before opening it, so that the guard removes the namespace if that fails.
        let mut ns = TempNetns { name, file: None };
        let path = Path::new("/run/netns").join(&ns.name);
        ns.file = Some(File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
        ns
    }

    /// `program` set up to run inside this namespace: `setns` in the forked child before exec
    /// (no `ip netns exec`/`nsenter` process in between, which would distort its figures). If
    /// `setns` fails, the spawn fails: `program` never runs in the namespace we are in.
    pub fn command(&self, program: &str) -> Command {
        // A descriptor of the closure's own (close-on-exec, so `program` does not inherit it):
        // it stays valid for as long as the command exists, whatever happens to `self.file`.
        let ns = self
            .file
            .as_ref()
            .expect("the namespace is open")
            .try_clone()
            .unwrap_or_else(|e| panic!("netns {}: {e}", self.name));
        let mut cmd = Command::new(program);
        // SAFETY: between fork and exec the hook only calls setns(2), which is
        // async-signal-safe, and builds an io::Error from its errno, which allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                setns(&ns, CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)
            });
        }
        cmd
    }
}

impl Drop for TempNetns {
    fn drop(&mut self) {
        self.file = None;
        // In its own process group, so a Ctrl-C on the terminal cannot kill the cleanup.
        let status = Command::new("ip")
            .args(["netns", "del", &self.name])
            .process_group(0)
            .status();
        if !matches!(status, Ok(s) if s.success()) {
            eprintln!("warning: could not delete netns {}", self.name);
        }
    }
}

/// Enters the namespace `ns` (a name under /run/netns) and makes sure we really are there and
/// not in the one we came from. A child gets `ns` on its command line, so anything but a
/// namespace of the bench (named with its `prefix`) is refused: rules are loaded nowhere else.
pub fn enter(prefix: &str, ns: &str) {
    assert!(
        ns.starts_with(prefix) && !ns.contains('/'),
        "refusing to enter {ns:?}: not a namespace of this benchmark"
    );
    let before = ns_inode(Path::new("/proc/thread-self/ns/net"));
    Netns::parse(ns).enter().unwrap_or_else(|e| panic!("{e}"));
    let now = ns_inode(Path::new("/proc/thread-self/ns/net"));
    let wanted = ns_inode(&Path::new("/run/netns").join(ns));
    assert!(
        now == wanted && now != before,
        "not inside netns {ns} after setns; refusing to touch nftables"
    );
}

/// The inode of a namespace file, which identifies the namespace.
fn ns_inode(path: &Path) -> u64 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .ino()
}

/// Namespaces of this run still present (there should be none once the guards dropped).
fn leftover_namespaces(prefix: &str) -> Vec<String> {
    let prefix = ns_prefix(prefix);
    std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

// ---- the parent's run, signals -----------------------------------------------------------------

/// The parent's side of a bench: `bench` runs with the signal handlers installed; afterwards
/// every namespace of this process must be gone. A panic (an interruption too) was reported
/// by the panic hook and the guards have removed the namespaces while unwinding; it ends the
/// process with status 1.
pub fn run_parent(prefix: &str, bench: impl FnOnce() + UnwindSafe) {
    install_signal_handlers();
    let result = std::panic::catch_unwind(bench);
    let left = leftover_namespaces(prefix);
    if !left.is_empty() {
        eprintln!("warning: namespaces left behind: {left:?}");
    }
    if result.is_err() {
        std::process::exit(1);
    }
}

/// Panics unless we are root: creating network namespaces needs it.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "run as root: the benchmark creates network namespaces"
    );
}

/// The running kernel's release, for the report's header.
pub fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT/SIGTERM/SIGHUP only set a flag, without SA_RESTART so that a blocked read or `wait4`
/// on a child returns: [`measure`] then ends the child and panics, and unwinding removes the
/// namespaces (a handler cannot do that itself: it would have to spawn `ip`, and spawning is
/// not async-signal-safe).
fn install_signal_handlers() {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe, and no
        // other code of the process installs or relies on handlers of these signals.
        unsafe { sigaction(signal, &action) }.expect("sigaction");
    }
}

/// Panics if a signal asked us to stop (see [`install_signal_handlers`]).
pub fn check_interrupted() {
    if INTERRUPTED.load(Ordering::SeqCst) {
        panic!("interrupted; removing the benchmark's namespaces");
    }
}

/// Ends `child` if a signal asked us to stop, so that the caller does not wait for it to finish
/// before the namespaces can go.
fn stop_if_interrupted(child: &mut Child) {
    if INTERRUPTED.load(Ordering::SeqCst) {
        // Not reaped yet (only `wait4` below reaps), so its pid is still ours.
        let _ = child.kill();
    }
}

// ---- a real resolver --------------------------------------------------------------------------

/// The `i`th name the benches' real resolver answers, `nI.bench.example`.
pub fn real_name(i: usize) -> String {
    format!("n{i}.bench.example")
}

/// dnsmasq, stopped on drop (before the namespace it runs in goes).
pub struct Dnsmasq(Child);

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// dnsmasq in `ns`, listening on `listen` (an address of `ns`), answering from the hosts file
/// `hosts` only with TTL `ttl` seconds (anything else is NXDOMAIN, never forwarded); the
/// command, to spawn as the bench needs.
pub fn dnsmasq_from_hosts(ns: &TempNetns, listen: &str, hosts: &Path, ttl: u32) -> Command {
    let mut cmd = dnsmasq_on(ns, listen);
    cmd.arg("--local=/#/")
        .arg(format!("--local-ttl={ttl}"))
        .arg(format!("--addn-hosts={}", hosts.display()));
    cmd
}

/// dnsmasq in `ns` in the foreground, listening on `listen` only, reading no configuration,
/// resolv.conf or /etc/hosts: what every bench's dnsmasq starts from.
pub fn dnsmasq_on(ns: &TempNetns, listen: &str) -> Command {
    let mut cmd = ns.command("dnsmasq");
    cmd.args([
        "--keep-in-foreground",
        "--conf-file=/dev/null",
        "--no-resolv",
        "--no-hosts",
        "--bind-interfaces",
        "--user=root",
        "--group=root",
        "--pid-file=",
    ])
    .arg(format!("--listen-address={listen}"));
    cmd
}

/// A recursive query for `name`'s A record with id `id`, and its wire form.
pub fn a_query(id: u16, name: &str) -> (hickory_proto::op::Message, Vec<u8>) {
    use hickory_proto::op::{Message, Query};
    use hickory_proto::rr::{Name, RecordType};
    let mut query = Message::query();
    query.metadata.id = id;
    query.metadata.recursion_desired = true;
    query.add_query(Query::query(
        Name::from_str(&format!("{name}.")).expect("a valid name"),
        RecordType::A,
    ));
    let bytes = query.to_vec().expect("encode a query");
    (query, bytes)
}

/// dnsmasq on 127.0.0.1 in `ns` (whose `lo` must be up), answering from the hosts file `hosts`
/// only, with TTL `ttl` seconds; returns once it answers [`real_name`]`(0)` with [`v4`]`(0)`,
/// which `hosts` must list.
pub fn start_dnsmasq(ns: &TempNetns, hosts: &Path, ttl: u32) -> Dnsmasq {
    let child = dnsmasq_from_hosts(ns, "127.0.0.1", hosts, ttl)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("dnsmasq: {e} (apt-get install dnsmasq-base)"));
    let dnsmasq = Dnsmasq(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    let first = v4(0).to_string();
    loop {
        let out = ns
            .command("dig")
            .args([
                "+short",
                "+tries=1",
                "+time=1",
                "@127.0.0.1",
                &real_name(0),
                "A",
            ])
            .output()
            .expect("dig");
        if String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.trim() == first)
        {
            return dnsmasq;
        }
        assert!(Instant::now() < deadline, "dnsmasq does not answer");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How many elements `nft -j list set inet egress_fence SET` shows, `nft` being the command
/// to run it with (in the namespace the caller means).
pub fn nft_set_len(mut nft: Command, set: &str) -> usize {
    let out = nft
        .args(["-j", "list", "set", "inet", "egress_fence", set])
        .output()
        .expect("running nft");
    assert!(out.status.success(), "nft -j list set {set} failed");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("nft's JSON");
    json["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o["set"]["elem"].as_array())
        .map(Vec::len)
        .sum()
}

/// The first line `program args` prints, for a bench's machine line.
pub fn first_line_of(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| format!("{program}: missing"))
}

// ---- children and their reports ----------------------------------------------------------------

/// A command that std spawns with fork+exec, as [`TempNetns::command`] does. Without a
/// `pre_exec` hook std would use posix_spawn (vfork), and the child's `ru_maxrss` would start
/// from the parent's high-water mark instead of the parent's anonymous pages at fork: every
/// measured process must be spawned the same way.
pub fn forked(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    // SAFETY: the hook does nothing, so nothing unsafe can happen between fork and exec.
    unsafe { cmd.pre_exec(|| Ok(())) };
    cmd
}

/// This bench's own binary with `args` (its child modes), spawned like every measured process.
pub fn self_command(args: &[&str]) -> Command {
    let mut cmd = forked(std::env::current_exe().expect("current_exe"));
    cmd.args(args);
    cmd
}

/// Ends a process the bench started: SIGTERM, 3 s to exit, then SIGKILL; reaped either way.
pub fn end_process(what: &str, mut child: Child) {
    // Not reaped yet (only `try_wait`/`wait` below reap), so its pid is still ours.
    if let Ok(None) = child.try_wait() {
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(3);
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    if let Ok(None) = child.try_wait() {
        eprintln!("warning: {what} ignored SIGTERM; killing it");
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Runs `cmd` to its end; panics with its stderr if it fails.
pub fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What `wait4` reports about a finished child.
pub struct Measured {
    pub wall: Duration,
    pub user: Duration,
    pub sys: Duration,
    /// Peak resident set, KiB.
    pub maxrss_kib: u64,
    pub stdout: String,
}

/// Spawns `cmd`, collects its output and reaps it with `wait4` for its resource usage, which
/// std's `wait` does not give. Panics, with the child's stdout and stderr, if it failed; and
/// if a signal asked us to stop, after ending the child (see [`install_signal_handlers`]).
pub fn measure(cmd: &mut Command) -> Measured {
    let (status, measured, stderr) = measure_any(cmd);
    assert!(
        status.success(),
        "{cmd:?} failed ({status}): {}{}",
        measured.stdout,
        stderr
    );
    measured
}

/// Like [`measure`], for a child that may fail: its exit status and stderr come back too.
pub fn measure_any(cmd: &mut Command) -> (ExitStatus, Measured, String) {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    // Standard error is drained on a thread of its own, so that a child with much to say on
    // both (a warning per unresolved name) never blocks on a full pipe while we read the
    // other. The thread's read ends when the child exits or is killed.
    let mut stderr_pipe = child.stderr.take().expect("piped");
    let stderr_reader = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = stderr_pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    });
    let stdout = read_to_end(child.stdout.take().expect("piped"), &mut child);
    let stderr = stderr_reader.join().unwrap_or_default();
    let (status, usage) = wait4(&mut child);
    let wall = start.elapsed();
    // `child` was reaped by wait4; dropping it neither waits nor kills.
    drop(child);
    check_interrupted();
    let measured = Measured {
        wall,
        user: timeval(usage.ru_utime),
        sys: timeval(usage.ru_stime),
        maxrss_kib: usage.ru_maxrss as u64,
        stdout,
    };
    (status, measured, stderr)
}

/// Sets `cmd`'s limit of open files (soft and hard) to `n` before it runs, as
/// `ulimit -n` or systemd's `LimitNOFILE=` would.
pub fn limit_open_files(cmd: &mut Command, n: u64) {
    let limit = libc::rlimit {
        rlim_cur: n,
        rlim_max: n,
    };
    // SAFETY: between fork and exec the hook only calls setrlimit(2), which is
    // async-signal-safe, on a struct it owns, and builds an io::Error from errno, which
    // allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// Reads one of `child`'s pipes to its end. Not `read_to_string`: that retries when a signal
/// interrupts the read, so an interrupted parent would sit here until the child finished.
fn read_to_end(mut pipe: impl Read, child: &mut Child) -> String {
    let mut bytes = Vec::new();
    let mut chunk = [0; 4096];
    loop {
        match pipe.read(&mut chunk) {
            Ok(0) => break,
            Ok(k) => bytes.extend_from_slice(&chunk[..k]),
            Err(e) if e.kind() == ErrorKind::Interrupted => stop_if_interrupted(child),
            // The exit status tells what went wrong.
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Reaps `child` with wait4(2) (nix has no safe wrapper that returns the resource usage).
fn wait4(child: &mut Child) -> (ExitStatus, libc::rusage) {
    let pid = child.id() as libc::pid_t;
    let mut status: libc::c_int = 0;
    // SAFETY: rusage is a C struct of integers only, for which all-zero bytes are a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: both pointers are to live locals of the types wait4 writes. `pid` cannot name
        // another process: it is our child, and not reaped yet (std's `Child` reaps only in
        // its own wait methods, which nothing calls).
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if r == pid {
            return (ExitStatus::from_raw(status), usage);
        }
        let err = std::io::Error::last_os_error();
        assert_eq!(err.kind(), ErrorKind::Interrupted, "wait4: {err}");
        stop_if_interrupted(child);
    }
}

fn timeval(tv: libc::timeval) -> Duration {
    Duration::from_secs(tv.tv_sec as u64) + Duration::from_micros(tv.tv_usec as u64)
}

/// The value of `key` in a child's report of `key=value` pairs.
pub fn field<T: FromStr>(report: &str, key: &str) -> T {
    report
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in child report {report:?}"))
}

// ---- statistics --------------------------------------------------------------------------------

/// The middle sample; of an even count, the upper of the two middle ones.
pub fn median<T: Copy + Ord>(mut v: Vec<T>) -> T {
    v.sort();
    v[v.len() / 2]
}

/// Nearest-rank percentile (`p` from 0 to 100); of an even count, `p = 50` is the lower of the
/// two middle samples. The default value for no samples.
pub fn percentile<T: Copy + Ord + Default>(samples: &[T], p: f64) -> T {
    let mut v = samples.to_vec();
    v.sort();
    let rank = ((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1));
    v.get(rank - 1).copied().unwrap_or_default()
}
