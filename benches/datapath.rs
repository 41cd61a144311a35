//! Benchmark: what the table costs the data path. The time of a TCP connect and close (socket,
//! connect, close: the three-way handshake and the FIN) from a client namespace to a listener
//! in a server namespace, per table loaded into the client's namespace:
//!
//! 1. **no table**: nothing loaded (no conntrack either: the namespace has no `ct` rule);
//! 2. **ct only**: a base chain on the output hook with `ct state established,related accept`
//!    and one set lookup (the server's address . tcp . port), policy accept: the least a
//!    stateful fence costs;
//! 3. **fence**: today's fence, the plan of a policy without `scope:` (guard mode, the server's
//!    name on tcp/443), its `resolved4`/`resolved6` sets filled with 10,000 elements (9,000
//!    IPv4, 1,000 IPv6, the server's among them) as the daemon holds them at issue 16's scale;
//! 4. **scoped, client not in scope**: the plan of the same policy with a `scope:` (users 1001
//!    and 1002, gid 2000, a cgroup the bench creates, `forward: [br-*]`), same 10,000
//!    elements; the client runs as uid 1003, in no listed cgroup;
//! 5. **scoped, client in scope by uid**: the same table, the client as uid 1001;
//! 6. **scoped, client in scope by cgroup**: the same table, the client as uid 1003 in the
//!    listed cgroup (the cgroup rule is the scope chain's last, so this pays the most).
//!
//! The issue's aims: (4) costs at most 1.05x (1), and (5) no more than (3); and (issue 16,
//! aim 2) the fence's allowed connection at most 1.05x (2), conntrack alone ("fence / ct
//! only", printed after the table).
//!
//! Then (issue 16, aim 4) the refusals: how long a refused attempt takes to fail, per family,
//! under the fence of (3) and under the same table with the refused chain as it was before
//! issue 16 (`reject with icmpx admin-prohibited` for everything, in a namespace of its own:
//! this build's plan without the lines issue 16 added). TCP: connect to the server's port
//! 444 (the policy allows only 443) until it fails; UDP: socket, connect and send until the
//! send fails. The two tables take turns, `--refused-rounds` rounds of `--refused-batch`
//! attempts per kind, except the old table's IPv6 TCP, which waits for the first SYN
//! retransmission (about a second) and so makes one attempt per round. The errno of every
//! attempt is checked: ECONNREFUSED (the reset) for TCP under the fence, EHOSTUNREACH and
//! EACCES under the old table, EPERM for UDP under both.
//!
//! Every table is loaded as `nft -f FILE` inside the namespace, FILE being the printed plan
//! (`egress-fence plan POLICY`, run inside the namespace; the plan text is exact nft) and then a
//! file adding the elements (`ip netns exec` is not used: it hides the cgroup hierarchy). The
//! tables of (1)-(3) each have a namespace of their own, (4)-(6) share one; each client
//! namespace has a veth to the one server namespace (client 198.18.I.2 and 2001:db8:I::2,
//! server .1 and ::1; `nodad`), its ephemeral port range widened and `tcp_tw_reuse` on so that
//! the client's TIME_WAITs never run it out of ports. The server
//! (this binary, `--child-server`) accepts on [::]:443 (dual stack), reads each connection to
//! its end and closes it, so that the client closes first. Namespaces are `efp-<pid>-<n>`.
//!
//! Each configuration's client is this binary (`--child-client`), started in its client
//! namespace by `setns` in the forked child; it joins the cgroup if asked, drops to its uid and
//! gid (setgroups, setgid, setuid), makes `--warmup` connections per address unmeasured, then
//! waits for batches: `run N` times connect+close per address, alternating IPv4 and IPv6. The
//! configurations are interleaved finely: the clients all live for the whole run and take
//! turns, one batch of `--batch` each (in an order rotated every round), so that drift and the
//! load of other work on the machine hit all alike. Before measuring, every configuration is
//! checked: a connection to a closed port (444) is answered by the server's RST when the table
//! leaves the client alone, and refused by the fence (ICMP admin-prohibited: the check's socket
//! has the priority the fence answers with ICMP instead of a reset, as the probe's) when it
//! fences the client.
//!
//! Figures per configuration and family: p50, p90, p99, max and mean of every sample, and the
//! ratios of p50 and mean to no table and to the fence. With `--baseline PATH` another egress-fence
//! binary (a build of another commit) plans the fence of (3) and the scoped table of (4)-(5)
//! too, each in a namespace of its own, measured in the same rounds, and the scoped rows are
//! also compared with them (before and after a change of the table's layout, in one run).
//!
//! No figure is asserted: this is a benchmark. Nothing is loaded into the root network
//! namespace; every process the bench starts is ended and every namespace and the cgroup
//! (`<cgroup2 root>/egress-fence-bench-<pid>`, empty: its clients have exited) removed, also
//! on panic or SIGINT/SIGTERM/SIGHUP.
//!
//! Run as root (needs `ip`, `nft`, `sysctl`): `cargo bench --bench datapath` (about a minute
//! with the defaults on 2 vCPUs). Options after `--`: `--conns N` per configuration and family
//! (default 20,000), `--batch B` (default 100), `--warmup W` (default 200), `--family 4|6|both`
//! (default both), `--baseline PATH`, `--refused-rounds R` (default 10), `--refused-batch B`
//! (default 20).

#![deny(unsafe_code)]

#[allow(unsafe_code)] // its blocks, each with its SAFETY comment, are the benches' only ones
mod common;

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use egress_fence::core::ruleset::ICMP_ANSWER_PRIORITY;

use common::{TempNetns, kernel_release, measure, percentile, require_root, run, run_parent};

/// This bench's namespaces are `efp-<pid>-<n>`.
const NS_PREFIX: &str = "efp-";
/// The server's port, the one the policies allow.
const PORT: u16 = 443;
/// Nothing listens here: the check of who the table fences.
const CLOSED_PORT: u16 = 444;
/// Listed in the scope (1002 too).
const SCOPED_UID: u32 = 1001;
const OTHER_SCOPED_UID: u32 = 1002;
const SCOPED_GID: u32 = 2000;
/// Neither listed nor a member of a listed group: the client of every unscoped configuration.
const UNSCOPED_UID: u32 = 1003;
/// Elements in `resolved4` + `resolved6` (issue 16's scale), 1 in 10 IPv6.
const ELEMENTS: usize = 10_000;
const ELEMENTS_V6: usize = ELEMENTS / 10;
/// The server's name in the policies (never resolved: the bench adds the elements).
const SERVER_NAME: &str = "server.bench.example";

struct Options {
    batch: usize,
    conns: usize,
    warmup: usize,
    families: Vec<Family>,
    baseline: Option<PathBuf>,
    refused_rounds: usize,
    refused_batch: usize,
}

#[derive(Clone, Copy, PartialEq)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn label(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: datapath [--conns N] [--batch B] [--warmup W] [--family 4|6|both] \
         [--baseline PATH] [--refused-rounds R] [--refused-batch B]  (run with cargo bench)"
    );
    std::process::exit(2)
}

fn options(args: &[String]) -> Options {
    let mut o = Options {
        batch: 100,
        conns: 20_000,
        warmup: 200,
        families: vec![Family::V4, Family::V6],
        baseline: None,
        refused_rounds: 10,
        refused_batch: 20,
    };
    let mut it = args.iter().filter(|a| *a != "--bench");
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().unwrap_or_else(|| usage());
        let mut number = || value().replace('_', "").parse().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--batch" => o.batch = number(),
            "--conns" => o.conns = number(),
            "--warmup" => o.warmup = number(),
            "--family" => {
                o.families = match value().as_str() {
                    "4" => vec![Family::V4],
                    "6" => vec![Family::V6],
                    "both" => vec![Family::V4, Family::V6],
                    _ => usage(),
                }
            }
            "--baseline" => o.baseline = Some(PathBuf::from(value())),
            "--refused-rounds" => o.refused_rounds = number(),
            "--refused-batch" => o.refused_batch = number(),
            _ => usage(),
        }
    }
    if o.batch == 0 || o.conns == 0 || o.refused_rounds == 0 || o.refused_batch == 0 {
        usage();
    }
    o
}

// ---- the tables --------------------------------------------------------------------------------

/// What a client namespace holds.
#[derive(Clone, Copy, PartialEq)]
enum Table {
    None,
    CtOnly,
    /// The plan of the policy without `scope:`, by this build or (`true`) by `--baseline`.
    Fence {
        baseline: bool,
    },
    /// The plan of the policy with `scope:`, likewise.
    Scoped {
        baseline: bool,
    },
    /// This build's plan of the policy without `scope:`, its refused chain as before issue 16
    /// ([`old_refusal`]).
    FenceOldRefusal,
}

/// A client namespace: its table, its veth to the server, the server's addresses from it.
struct ClientNs {
    ns: TempNetns,
    table: Table,
    server: [IpAddr; 2],
}

impl ClientNs {
    fn server(&self, family: Family) -> IpAddr {
        match family {
            Family::V4 => self.server[0],
            Family::V6 => self.server[1],
        }
    }
}

/// Makes client namespace number `i` (1-based) with a veth into `server_ns`, addressed and up.
fn client_ns(i: u8, table: Table, server_ns: &TempNetns) -> ClientNs {
    let ns = TempNetns::new(NS_PREFIX);
    let server_if = format!("efs{i}");
    let v4 = |host: u8| Ipv4Addr::new(198, 18, i, host);
    let v6 = |host: u16| Ipv6Addr::new(0x2001, 0xdb8, u16::from(i), 0, 0, 0, 0, host);
    let ip = |ns: &TempNetns, args: &[&str]| run(ns.command("ip").args(args));
    ip(&ns, &["link", "set", "lo", "up"]);
    ip(
        &ns,
        &[
            "link",
            "add",
            "efc0",
            "type",
            "veth",
            "peer",
            "name",
            &server_if,
            "netns",
            &server_ns.name,
        ],
    );
    ip(
        &ns,
        &["addr", "add", &format!("{}/24", v4(2)), "dev", "efc0"],
    );
    ip(
        &ns,
        &[
            "addr",
            "add",
            &format!("{}/64", v6(2)),
            "dev",
            "efc0",
            "nodad",
        ],
    );
    ip(&ns, &["link", "set", "efc0", "up"]);
    ip(
        server_ns,
        &["addr", "add", &format!("{}/24", v4(1)), "dev", &server_if],
    );
    ip(
        server_ns,
        &[
            "addr",
            "add",
            &format!("{}/64", v6(1)),
            "dev",
            &server_if,
            "nodad",
        ],
    );
    ip(server_ns, &["link", "set", &server_if, "up"]);
    // Per namespace (the sysctl runs inside it): every round's TIME_WAITs must not exhaust the
    // client's ports.
    run(ns.command("sysctl").args([
        "-q",
        "-w",
        "net.ipv4.ip_local_port_range=1024 65535",
        "net.ipv4.tcp_tw_reuse=1",
    ]));
    ClientNs {
        ns,
        table,
        server: [IpAddr::V4(v4(1)), IpAddr::V6(v6(1))],
    }
}

/// The policy of the fence: guard mode, the server's name on tcp/[`PORT`]; with `scope`, the
/// scoped one.
fn policy_text(scope_cgroup: Option<&str>) -> String {
    let mut text = String::from("version: 1\n");
    if let Some(cgroup) = scope_cgroup {
        let _ = write!(
            text,
            "scope:\n  users: [{SCOPED_UID}, {OTHER_SCOPED_UID}]\n  groups: [{SCOPED_GID}]\n  \
             cgroups: [{cgroup}]\n  forward: [\"br-*\"]\n"
        );
    }
    let _ = write!(
        text,
        "dns:\n  mode: guard\n  upstream: [192.0.2.53]\nallow:\n  - domain: {SERVER_NAME}\n    \
         ports: [{PORT}]\n"
    );
    text
}

/// The elements the daemon would hold: [`ELEMENTS`] in all, the server's two among them, the
/// others from 198.19.0.0/16 and 2001:db8:ffff::/48 (no client namespace uses those).
fn elements_text(server: [IpAddr; 2]) -> String {
    let mut text = String::new();
    let mut set = |name: &str, addrs: Vec<IpAddr>| {
        let list: Vec<String> = addrs
            .iter()
            .map(|a| format!("{a} . tcp . {PORT} timeout 1h"))
            .collect();
        let _ = writeln!(
            text,
            "add element inet egress_fence {name} {{ {} }}",
            list.join(", ")
        );
    };
    let v4 = (1..ELEMENTS - ELEMENTS_V6).map(|j| {
        IpAddr::V4(Ipv4Addr::from(
            u32::from(Ipv4Addr::new(198, 19, 0, 0)) + j as u32,
        ))
    });
    set("resolved4", std::iter::once(server[0]).chain(v4).collect());
    let v6 = (1..ELEMENTS_V6)
        .map(|j| IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, j as u16)));
    set("resolved6", std::iter::once(server[1]).chain(v6).collect());
    text
}

/// The ct-only table: the least a stateful fence does.
fn ct_only_text(server: [IpAddr; 2]) -> String {
    format!(
        "table inet egress_fence_bench {{\n\
         \tset allowed4 {{ type ipv4_addr . inet_proto . inet_service; elements = {{ {} . tcp . \
         {PORT} }}; }}\n\
         \tset allowed6 {{ type ipv6_addr . inet_proto . inet_service; elements = {{ {} . tcp . \
         {PORT} }}; }}\n\
         \tchain output {{\n\
         \t\ttype filter hook output priority filter; policy accept;\n\
         \t\tct state established,related accept\n\
         \t\tip daddr . meta l4proto . th dport @allowed4 accept\n\
         \t\tip6 daddr . meta l4proto . th dport @allowed6 accept\n\
         \t}}\n}}\n",
        server[0], server[1]
    )
}

/// The rules issue 16 added to the refused chain: the answers only to this host's sources, and
/// the reset for its TCP connections.
const ISSUE_16_RULES: [&str; 2] = ["fib saddr type != local drop", "reject with tcp reset"];

/// `planned` with the refused chain as it was before issue 16: every refusal answered with
/// `reject with icmpx admin-prohibited`.
fn old_refusal(planned: &str) -> String {
    let old: Vec<&str> = planned
        .lines()
        .filter(|l| !ISSUE_16_RULES.iter().any(|r| l.contains(r)))
        .collect();
    assert_eq!(
        planned.lines().count() - old.len(),
        3,
        "the plan's refused chain is not what issue 16 made it:\n{planned}"
    );
    old.join("\n") + "\n"
}

/// `nft -f FILE` inside `ns`: the only way the bench loads rules. Not `ip netns exec`, which
/// mounts a sysfs of its own over /sys and so hides the cgroup hierarchy nft resolves a
/// `socket cgroupv2` path in; [`TempNetns::command`] switches the network namespace alone, and
/// nft does not run at all if that fails.
fn nft_load(ns: &TempNetns, file: &Path) {
    run(ns.command("nft").arg("-f").arg(file));
}

/// `BIN plan POLICY`, run inside `ns` (like `nft`, seeing the host's cgroups), as text.
fn plan(ns: &TempNetns, bin: &Path, policy: &Path) -> String {
    let out = ns
        .command(bin.to_str().expect("a UTF-8 path"))
        .arg("plan")
        .arg(policy)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    assert!(
        out.status.success(),
        "{} plan failed: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn write(dir: &Path, file: &str, text: &str) -> PathBuf {
    let path = dir.join(file);
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    path
}

// ---- the cgroup --------------------------------------------------------------------------------

/// The bench's cgroup, `<cgroup2 root>/egress-fence-bench-<pid>`, removed on drop (its clients
/// have exited by then: every client is reaped before the next starts).
struct BenchCgroup {
    dir: PathBuf,
    /// As the policy names it: relative to the hierarchy's root.
    relative: String,
}

impl BenchCgroup {
    fn new() -> BenchCgroup {
        let root = egress_fence::host::cgroup2_root().expect("a cgroup v2 hierarchy is mounted");
        let relative = format!("egress-fence-bench-{}", std::process::id());
        let dir = root.join(&relative);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        BenchCgroup { dir, relative }
    }
}

impl BenchCgroup {
    /// Checks the scoped plan has the bench's cgroup rule (the plan names it as nft finds it
    /// below /sys/fs/cgroup, `unified/` in front on a hybrid host).
    fn check_planned(&self, planned: &str) {
        let below_sys = self
            .dir
            .strip_prefix("/sys/fs/cgroup")
            .expect("the cgroup v2 hierarchy is below /sys/fs/cgroup");
        let rule = format!("level 1 \"{}\" goto", below_sys.display());
        assert!(
            planned.contains(&rule),
            "the scoped plan has no rule for the bench's cgroup:\n{planned}"
        );
    }
}

impl Drop for BenchCgroup {
    fn drop(&mut self) {
        // A client killed by an interruption may take a moment to leave it.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("warning: could not remove cgroup {}", self.dir.display());
    }
}

// ---- the server --------------------------------------------------------------------------------

/// The server process, ended on drop (before its namespace goes).
struct Server(Child);

impl Server {
    fn start(ns: &TempNetns) -> Server {
        let exe = std::env::current_exe().expect("current_exe");
        let mut child = ns
            .command(exe.to_str().expect("a UTF-8 path"))
            .arg("--child-server")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the server");
        let mut line = String::new();
        let _ = BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line);
        let server = Server(child);
        assert_eq!(line.trim(), "listening", "the server did not start");
        server
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `--child-server`: accepts on [::]:[`PORT`] (IPv4 too), reads each connection to its end,
/// closes it. Runs until killed.
fn child_server() {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, SockaddrIn6, bind, listen, socket,
    };
    // Not `TcpListener::bind`: its backlog may be std's 128, and a server descheduled by other
    // work on the machine would then drop SYNs (a 1 s retransmission in the client's figures).
    // -1: the namespace's somaxconn, raised to 65,535 (a whole batch fits many times over).
    let fd = socket(
        AddressFamily::Inet6,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    let addr = SockaddrIn6::from(std::net::SocketAddrV6::new(
        Ipv6Addr::UNSPECIFIED,
        PORT,
        0,
        0,
    ));
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr)
        .unwrap_or_else(|e| panic!("bind [::]:{PORT}: {e}"));
    listen(&fd, Backlog::MAXALLOWABLE).expect("listen");
    let listener = TcpListener::from(fd);
    println!("listening");
    let mut sink = [0u8; 64];
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
        while matches!(stream.read(&mut sink), Ok(k) if k > 0) {}
    }
}

// ---- the client --------------------------------------------------------------------------------

/// `--child-client [--cgroup DIR] --uid U --gid G --conns N --warmup W [--probe] ADDR...`:
/// joins the cgroup, drops to U:G, checks the closed port when asked, then measures. Prints
/// `probe ADDR OUTCOME` per address, and one line of nanoseconds per address.
fn child_client(args: &[String]) {
    let mut cgroup = None;
    let (mut uid, mut gid, mut warmup, mut probe) = (None, None, 0usize, false);
    let mut targets: Vec<IpAddr> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().expect("a value").clone();
        match a.as_str() {
            "--cgroup" => cgroup = Some(PathBuf::from(value())),
            "--uid" => uid = Some(value().parse::<u32>().expect("a uid")),
            "--gid" => gid = Some(value().parse::<u32>().expect("a gid")),
            "--warmup" => warmup = value().parse().expect("a count"),
            "--probe" => probe = true,
            addr => targets.push(addr.parse().expect("an address")),
        }
    }
    // Before the sockets: a socket keeps the cgroup it was made in.
    if let Some(dir) = cgroup {
        std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
            .unwrap_or_else(|e| panic!("joining {}: {e}", dir.display()));
    }
    drop_to(uid.expect("--uid"), gid.expect("--gid"));

    let mut out = String::new();
    if probe {
        for &addr in &targets {
            let outcome = match connect_for_icmp(SocketAddr::new(addr, CLOSED_PORT)) {
                Ok(_) => "connected".to_string(),
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => "rst".to_string(),
                Err(e) => format!("refused (errno {})", e.raw_os_error().unwrap_or(0)),
            };
            let _ = writeln!(out, "probe {addr} {outcome}");
        }
    }
    if probe {
        print!("{out}");
        return;
    }
    let connect_close = |addr: SocketAddr| {
        let start = Instant::now();
        let stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        drop(stream);
        start.elapsed()
    };
    let addrs: Vec<SocketAddr> = targets.iter().map(|&a| SocketAddr::new(a, PORT)).collect();
    for _ in 0..warmup {
        for &addr in &addrs {
            connect_close(addr);
        }
    }
    println!("ready");
    // `run N`: N connect+close per address, alternating the addresses; one line of
    // nanoseconds per address, then `done`.
    for line in std::io::stdin().lines() {
        let line = line.expect("stdin");
        let n: usize = line
            .strip_prefix("run ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("not a command: {line:?}"));
        let mut samples: Vec<Vec<u64>> = vec![Vec::with_capacity(n); addrs.len()];
        for _ in 0..n {
            for (k, &addr) in addrs.iter().enumerate() {
                samples[k].push(connect_close(addr).as_nanos() as u64);
            }
        }
        let mut out = String::new();
        for (addr, s) in addrs.iter().zip(&samples) {
            let list: Vec<String> = s.iter().map(u64::to_string).collect();
            let _ = writeln!(out, "{} {}", addr.ip(), list.join(" "));
        }
        out.push_str("done\n");
        let mut stdout = std::io::stdout().lock();
        stdout.write_all(out.as_bytes()).expect("stdout");
        stdout.flush().expect("stdout");
    }
}

/// Drops to `uid`:`gid`, no supplementary groups, for good.
fn drop_to(uid: u32, gid: u32) {
    nix::unistd::setgroups(&[]).expect("setgroups");
    nix::unistd::setgid(nix::unistd::Gid::from_raw(gid)).expect("setgid");
    nix::unistd::setuid(nix::unistd::Uid::from_raw(uid)).expect("setuid");
    assert!(
        nix::unistd::setuid(nix::unistd::Uid::from_raw(0)).is_err(),
        "still able to become root"
    );
}

/// A TCP connection from a socket of the priority the fence answers with ICMP admin-prohibited
/// instead of a reset: a reset then comes from the server, an ICMP error from the fence.
fn connect_for_icmp(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )?;
    nix::sys::socket::setsockopt(
        &socket,
        nix::sys::socket::sockopt::Priority,
        &(ICMP_ANSWER_PRIORITY as i32),
    )?;
    socket.connect(&addr.into())?;
    Ok(socket.into())
}

/// A kind of refused attempt.
#[derive(Clone, Copy, PartialEq)]
enum Refused {
    /// connect until it fails.
    Tcp,
    /// socket, connect, send until the send fails.
    Udp,
}

impl Refused {
    fn label(self) -> &'static str {
        match self {
            Refused::Tcp => "tcp",
            Refused::Udp => "udp",
        }
    }

    /// One attempt at `addr`, port [`CLOSED_PORT`] (refused by the fence): how long until it
    /// failed, and its errno. Panics if it did not fail within 5 s.
    fn attempt(self, addr: IpAddr) -> (Duration, i32) {
        let to = SocketAddr::new(addr, CLOSED_PORT);
        let start = Instant::now();
        let failed = match self {
            Refused::Tcp => TcpStream::connect_timeout(&to, Duration::from_secs(5)).map(drop),
            Refused::Udp => {
                let any: IpAddr = match addr {
                    IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
                    IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
                };
                UdpSocket::bind(SocketAddr::new(any, 0))
                    .and_then(|s| s.connect(to).and_then(|()| s.send(b"refused?")))
                    .map(drop)
            }
        };
        let took = start.elapsed();
        match failed {
            Err(e) if e.kind() != ErrorKind::TimedOut => (took, e.raw_os_error().unwrap_or(0)),
            other => panic!("{} to {to} was not refused: {other:?}", self.label()),
        }
    }
}

/// `--child-refused --uid U --gid G --count N tcp|udp ADDR`: drops to U:G, makes N refused
/// attempts, prints `NANOSECONDS:ERRNO` per attempt on one line.
fn child_refused(args: &[String]) {
    let (mut uid, mut gid, mut count, mut kind, mut addr) = (None, None, 0usize, None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().expect("a value").clone();
        match a.as_str() {
            "--uid" => uid = Some(value().parse::<u32>().expect("a uid")),
            "--gid" => gid = Some(value().parse::<u32>().expect("a gid")),
            "--count" => count = value().parse().expect("a count"),
            "tcp" => kind = Some(Refused::Tcp),
            "udp" => kind = Some(Refused::Udp),
            other => addr = Some(other.parse::<IpAddr>().expect("an address")),
        }
    }
    drop_to(uid.expect("--uid"), gid.expect("--gid"));
    let (kind, addr) = (kind.expect("tcp or udp"), addr.expect("an address"));
    let line: Vec<String> = (0..count)
        .map(|_| {
            let (took, errno) = kind.attempt(addr);
            format!("{}:{errno}", took.as_nanos())
        })
        .collect();
    println!("{}", line.join(" "));
}

// ---- the configurations ------------------------------------------------------------------------

struct Config {
    label: String,
    /// Index into the client namespaces.
    ns: usize,
    uid: u32,
    in_cgroup: bool,
    /// Whether the table fences this client (checked before measuring).
    fenced: bool,
}

/// The client of `config` as a command: `--child-client`, in its namespace, with its uid and
/// cgroup.
fn client_command(
    clients: &[ClientNs],
    config: &Config,
    cgroup: &BenchCgroup,
    families: &[Family],
) -> Command {
    let client = &clients[config.ns];
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = client.ns.command(exe.to_str().expect("a UTF-8 path"));
    cmd.arg("--child-client");
    if config.in_cgroup {
        cmd.arg("--cgroup").arg(&cgroup.dir);
    }
    let uid = config.uid.to_string();
    cmd.args(["--uid", &uid, "--gid", &uid]);
    for &f in families {
        cmd.arg(client.server(f).to_string());
    }
    cmd
}

/// A client that waits for `run N` on its stdin; ended on drop (before its namespace goes).
struct ClientProc {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl ClientProc {
    fn start(mut cmd: Command, warmup: usize) -> ClientProc {
        cmd.args(["--warmup", &warmup.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        let stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut client = ClientProc {
            child,
            stdin,
            stdout,
        };
        assert_eq!(client.line(), "ready", "the client did not start");
        client
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        let _ = self.stdout.read_line(&mut line);
        assert!(!line.is_empty(), "a client exited");
        line.trim_end().to_string()
    }

    /// `n` connect+close per address: a line of nanoseconds per address.
    fn run(&mut self, n: usize) -> Vec<String> {
        writeln!(self.stdin, "run {n}").expect("a client exited");
        self.stdin.flush().expect("a client exited");
        let mut lines = Vec::new();
        loop {
            let line = self.line();
            if line == "done" {
                return lines;
            }
            lines.push(line);
        }
    }
}

impl Drop for ClientProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Stats {
    p50: f64,
    p90: f64,
    p99: f64,
    mean: f64,
    max: f64,
    n: usize,
}

fn stats(samples: &[u64]) -> Stats {
    let us = |ns: u64| ns as f64 / 1000.0;
    Stats {
        p50: us(percentile(samples, 50.0)),
        p90: us(percentile(samples, 90.0)),
        p99: us(percentile(samples, 99.0)),
        max: us(samples.iter().copied().max().unwrap_or(0)),
        mean: samples.iter().sum::<u64>() as f64 / samples.len().max(1) as f64 / 1000.0,
        n: samples.len(),
    }
}

/// The machine, for the header: CPU model and count.
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

fn tool_version(program: &str, arg: &str) -> String {
    Command::new(program)
        .arg(arg)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|_| format!("{program}: not found"))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn bench(args: &[String]) {
    require_root();
    let o = options(args);
    let ours = PathBuf::from(env!("CARGO_BIN_EXE_egress-fence"));
    let dir = tempfile::tempdir().expect("tempdir");
    let cgroup = BenchCgroup::new();
    let plain_policy = write(dir.path(), "fence.yaml", &policy_text(None));
    let scoped_policy = write(
        dir.path(),
        "scoped.yaml",
        &policy_text(Some(&cgroup.relative)),
    );

    // Declared in this order so that they drop in reverse: clients, then the server process,
    // then the server's namespace.
    let server_ns = TempNetns::new(NS_PREFIX);
    run(server_ns.command("ip").args(["link", "set", "lo", "up"]));
    run(server_ns
        .command("sysctl")
        .args(["-q", "-w", "net.core.somaxconn=65535"]));
    let mut tables = vec![Table::None, Table::CtOnly, Table::Fence { baseline: false }];
    if o.baseline.is_some() {
        tables.push(Table::Fence { baseline: true });
    }
    tables.push(Table::Scoped { baseline: false });
    if o.baseline.is_some() {
        tables.push(Table::Scoped { baseline: true });
    }
    tables.push(Table::FenceOldRefusal);
    let clients: Vec<ClientNs> = tables
        .iter()
        .enumerate()
        .map(|(i, &t)| client_ns(i as u8 + 1, t, &server_ns))
        .collect();
    let _server = Server::start(&server_ns);

    for (i, c) in clients.iter().enumerate() {
        let file = |f: &str, text: &str| write(dir.path(), &format!("ns{i}-{f}"), text);
        match c.table {
            Table::None => {}
            Table::CtOnly => nft_load(&c.ns, &file("ct.nft", &ct_only_text(c.server))),
            Table::FenceOldRefusal => {
                let planned = old_refusal(&plan(&c.ns, &ours, &plain_policy));
                nft_load(&c.ns, &file("plan.nft", &planned));
                nft_load(&c.ns, &file("elements.nft", &elements_text(c.server)));
            }
            Table::Fence { baseline } | Table::Scoped { baseline } => {
                let bin = match baseline {
                    true => o.baseline.clone().expect("--baseline"),
                    false => ours.clone(),
                };
                let scoped = matches!(c.table, Table::Scoped { .. });
                let policy = if scoped {
                    &scoped_policy
                } else {
                    &plain_policy
                };
                let planned = plan(&c.ns, &bin, policy);
                if scoped {
                    cgroup.check_planned(&planned);
                }
                nft_load(&c.ns, &file("plan.nft", &planned));
                nft_load(&c.ns, &file("elements.nft", &elements_text(c.server)));
            }
        }
    }

    let ns_of = |t: Table| {
        tables
            .iter()
            .position(|&x| x == t)
            .expect("a namespace per table")
    };
    let config = |label: &str, t: Table, uid: u32, in_cgroup: bool, fenced: bool| Config {
        label: label.to_string(),
        ns: ns_of(t),
        uid,
        in_cgroup,
        fenced,
    };
    let mut configs = vec![
        config("no table", Table::None, UNSCOPED_UID, false, false),
        config("ct only", Table::CtOnly, UNSCOPED_UID, false, false),
        config(
            "fence (no scope)",
            Table::Fence { baseline: false },
            UNSCOPED_UID,
            false,
            true,
        ),
    ];
    if o.baseline.is_some() {
        configs.push(config(
            "fence (no scope), baseline",
            Table::Fence { baseline: true },
            UNSCOPED_UID,
            false,
            true,
        ));
    }
    configs.extend([
        config(
            "scoped, client not in scope",
            Table::Scoped { baseline: false },
            UNSCOPED_UID,
            false,
            false,
        ),
        config(
            "scoped, client in scope (uid)",
            Table::Scoped { baseline: false },
            SCOPED_UID,
            false,
            true,
        ),
        config(
            "scoped, client in scope (cgroup)",
            Table::Scoped { baseline: false },
            UNSCOPED_UID,
            true,
            true,
        ),
    ]);
    if o.baseline.is_some() {
        configs.extend([
            config(
                "scoped, client not in scope, baseline",
                Table::Scoped { baseline: true },
                UNSCOPED_UID,
                false,
                false,
            ),
            config(
                "scoped, client in scope (uid), baseline",
                Table::Scoped { baseline: true },
                SCOPED_UID,
                false,
                true,
            ),
        ]);
    }

    // Who is fenced, checked before anything is measured.
    for c in &configs {
        let mut cmd = client_command(&clients, c, &cgroup, &o.families);
        let out = measure(cmd.arg("--probe")).stdout;
        for &f in &o.families {
            let addr = clients[c.ns].server(f).to_string();
            let outcome = out
                .lines()
                .find_map(|l| l.strip_prefix(&format!("probe {addr} ")))
                .unwrap_or_else(|| panic!("no probe of {addr} in {out:?}"));
            let refused = outcome.starts_with("refused");
            assert!(
                refused == c.fenced && (refused || outcome == "rst"),
                "{}: a connection to {addr} port {CLOSED_PORT} (closed) gave {outcome} \
                 (expected {})",
                c.label,
                if c.fenced {
                    "a refusal by the fence"
                } else {
                    "the server's RST"
                }
            );
        }
    }

    println!(
        "datapath: connect+close per connection, client namespace -> veth -> server namespace \
         (tcp/{PORT}); {} connections per configuration and family, in batches of {} \
         interleaved round-robin, after {} warm-up connections per client; fence tables hold \
         {ELEMENTS} resolved elements",
        o.conns, o.batch, o.warmup
    );
    println!(
        "machine: {}; kernel {}; {}; egress-fence {}; load average before: {}",
        machine(),
        kernel_release(),
        tool_version("nft", "--version"),
        env!("CARGO_PKG_VERSION"),
        loadavg()
    );
    let mut samples: Vec<Vec<Vec<u64>>> = configs
        .iter()
        .map(|_| o.families.iter().map(|_| Vec::new()).collect())
        .collect();
    let mut procs: Vec<ClientProc> = configs
        .iter()
        .map(|c| ClientProc::start(client_command(&clients, c, &cgroup, &o.families), o.warmup))
        .collect();
    let started = Instant::now();
    let rounds = o.conns.div_ceil(o.batch);
    for round in 0..rounds {
        if round % 10 == 0 {
            eprint!("\rround {}/{rounds}", round + 1);
        }
        let n = o.batch.min(o.conns - round * o.batch);
        for k in 0..configs.len() {
            let ci = (k + round) % configs.len();
            let lines = procs[ci].run(n);
            for (fi, &f) in o.families.iter().enumerate() {
                let addr = clients[configs[ci].ns].server(f).to_string();
                let line = lines
                    .iter()
                    .find(|l| l.split_whitespace().next() == Some(addr.as_str()))
                    .unwrap_or_else(|| panic!("no samples for {addr} in the client's output"));
                samples[ci][fi].extend(
                    line.split_whitespace()
                        .skip(1)
                        .map(|v| v.parse::<u64>().expect("nanoseconds")),
                );
            }
        }
        common::check_interrupted();
    }
    drop(procs);
    eprintln!();
    println!(
        "measured in {:.0} s; load average after: {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    );

    let base_of = |label: &str| configs.iter().position(|c| c.label == label);
    let none = base_of("no table").expect("no table");
    let fence = base_of("fence (no scope)").expect("fence");
    let ct_only = base_of("ct only").expect("ct only");
    let baseline = base_of("fence (no scope), baseline");
    println!(
        "| configuration | family | client | p50 | p90 | p99 | max | mean | p50 / no table | mean / \
         no table | p50 / fence | mean / fence |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let all: Vec<Vec<Stats>> = samples
        .iter()
        .map(|per_family| per_family.iter().map(|s| stats(s)).collect())
        .collect();
    for (fi, &f) in o.families.iter().enumerate() {
        for (ci, c) in configs.iter().enumerate() {
            let s = &all[ci][fi];
            let (n, fe) = (&all[none][fi], &all[fence][fi]);
            let client = match (c.uid, c.in_cgroup) {
                (_, true) => format!("uid {} in the cgroup", c.uid),
                (uid, false) => format!("uid {uid}"),
            };
            println!(
                "| {} | {} | {client} | {:.1} µs | {:.1} µs | {:.1} µs | {:.0} µs | {:.1} µs | {:.3} | \
                 {:.3} | {:.3} | {:.3} |",
                c.label,
                f.label(),
                s.p50,
                s.p90,
                s.p99,
                s.max,
                s.mean,
                s.p50 / n.p50,
                s.mean / n.mean,
                s.p50 / fe.p50,
                s.mean / fe.mean,
            );
            assert_eq!(s.n, o.conns, "every sample was collected");
        }
    }
    let ratio = |a: &str, b: usize, fi: usize| {
        let a = &all[base_of(a).expect("a configuration")][fi];
        let b = &all[b][fi];
        format!("p50 {:.3}, mean {:.3}", a.p50 / b.p50, a.mean / b.mean)
    };
    for (fi, &f) in o.families.iter().enumerate() {
        println!(
            "{}: fence / ct only: {} (aim: at most 1.05)",
            f.label(),
            ratio("fence (no scope)", ct_only, fi)
        );
        println!(
            "{}: scoped table, client not in scope / no table: {} (aim: at most 1.05)",
            f.label(),
            ratio("scoped, client not in scope", none, fi)
        );
        println!(
            "{}: scoped table, client not in scope / ct only: {}",
            f.label(),
            ratio("scoped, client not in scope", ct_only, fi)
        );
        println!(
            "{}: scoped table, client in scope (uid) / fence: {} (aim: at most 1.0)",
            f.label(),
            ratio("scoped, client in scope (uid)", fence, fi)
        );
        println!(
            "{}: scoped table, client in scope (cgroup) / fence: {}",
            f.label(),
            ratio("scoped, client in scope (cgroup)", fence, fi)
        );
        if let Some(b) = baseline {
            println!(
                "{}: fence / baseline's fence: {}; scoped (uid) / baseline's fence: {}",
                f.label(),
                ratio("fence (no scope)", b, fi),
                ratio("scoped, client in scope (uid)", b, fi)
            );
            println!(
                "{}: scoped, not in scope / baseline's: {}; in scope (uid) / baseline's: {}",
                f.label(),
                ratio(
                    "scoped, client not in scope",
                    base_of("scoped, client not in scope, baseline").expect("baseline scoped"),
                    fi
                ),
                ratio(
                    "scoped, client in scope (uid)",
                    base_of("scoped, client in scope (uid), baseline").expect("baseline scoped"),
                    fi
                )
            );
        }
    }
    println!(
        "Checked before measuring: a connection to the closed port {CLOSED_PORT} was refused by \
         the fence for every fenced client and answered by the server's RST for every other."
    );

    let new = &clients[ns_of(Table::Fence { baseline: false })];
    let old = &clients[ns_of(Table::FenceOldRefusal)];
    refusals(&o, new, old);
}

/// The refusals' latency, the fence against the old refused chain, taking turns.
fn refusals(o: &Options, new: &ClientNs, old: &ClientNs) {
    let tables = [("fence", new), ("old refusal (icmpx for all)", old)];
    let kinds: Vec<(Refused, Family)> = [Refused::Tcp, Refused::Udp]
        .into_iter()
        .flat_map(|k| o.families.iter().map(move |&f| (k, f)))
        .collect();
    // samples[table][kind]: (nanoseconds, errno).
    let mut samples: Vec<Vec<Vec<(u64, i32)>>> = vec![vec![Vec::new(); kinds.len()]; 2];
    println!(
        "\nrefused attempts: {} rounds, the two tables taking turns; load average before: {}",
        o.refused_rounds,
        loadavg()
    );
    for round in 0..o.refused_rounds {
        for k in 0..tables.len() {
            let ti = (k + round) % tables.len();
            let (_, client) = tables[ti];
            for (ki, &(kind, family)) in kinds.iter().enumerate() {
                // The old IPv6 TCP waits out a SYN retransmission per attempt.
                let slow = ti == 1 && kind == Refused::Tcp && family == Family::V6;
                let count = if slow { 1 } else { o.refused_batch };
                let exe = std::env::current_exe().expect("current_exe");
                let uid = UNSCOPED_UID.to_string();
                let out = measure(
                    client
                        .ns
                        .command(exe.to_str().expect("a UTF-8 path"))
                        .args(["--child-refused", "--uid", &uid, "--gid", &uid])
                        .args(["--count", &count.to_string(), kind.label()])
                        .arg(client.server(family).to_string()),
                )
                .stdout;
                samples[ti][ki].extend(out.split_whitespace().map(|v| {
                    let (ns, errno) = v.split_once(':').expect("NS:ERRNO");
                    (
                        ns.parse::<u64>().expect("nanoseconds"),
                        errno.parse::<i32>().expect("an errno"),
                    )
                }));
            }
        }
        common::check_interrupted();
    }
    println!("load average after: {}", loadavg());
    let name = |errno: i32| match errno {
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::EHOSTUNREACH => "EHOSTUNREACH",
        libc::EACCES => "EACCES",
        libc::EPERM => "EPERM",
        _ => "another errno",
    };
    println!("| table | attempt | family | errno | p50 | p90 | max | mean | n |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut p50 = vec![vec![0.0; kinds.len()]; 2];
    for (ki, &(kind, family)) in kinds.iter().enumerate() {
        for (ti, (label, _)) in tables.iter().enumerate() {
            let s = &samples[ti][ki];
            let mut errnos: Vec<&str> = s.iter().map(|&(_, e)| name(e)).collect();
            errnos.dedup();
            let want = match (kind, ti, family) {
                (Refused::Udp, _, _) => "EPERM",
                (Refused::Tcp, 0, _) => "ECONNREFUSED",
                (Refused::Tcp, _, Family::V4) => "EHOSTUNREACH",
                (Refused::Tcp, _, Family::V6) => "EACCES",
            };
            assert_eq!(
                errnos,
                [want],
                "{label}: refused {} over {}",
                kind.label(),
                family.label()
            );
            let ns: Vec<u64> = s.iter().map(|&(ns, _)| ns).collect();
            let st = stats(&ns);
            p50[ti][ki] = st.p50;
            println!(
                "| {label} | {} | {} | {want} | {:.1} µs | {:.1} µs | {:.0} µs | {:.1} µs | {} |",
                kind.label(),
                family.label(),
                st.p50,
                st.p90,
                st.max,
                st.mean,
                st.n
            );
        }
    }
    for (ki, &(kind, family)) in kinds.iter().enumerate() {
        println!(
            "refused {} over {}: p50 fence {:.1} µs, old refusal {:.1} µs: fence / old = {:.6}",
            kind.label(),
            family.label(),
            p50[0][ki],
            p50[1][ki],
            p50[0][ki] / p50[1][ki]
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--child-server") => child_server(),
        Some("--child-client") => child_client(&args[1..]),
        Some("--child-refused") => child_refused(&args[1..]),
        _ => run_parent(NS_PREFIX, || bench(&args)),
    }
}
