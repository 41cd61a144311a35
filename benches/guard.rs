//! Benchmark: the latency the DNS guard (`dns.mode: guard`) adds to each answer, against a
//! plain forwarder and against dnsmasq `--nftset` (the peer: a forwarder that adds each
//! answer's addresses to a set before answering) in the same run.
//!
//! Everything runs in one throwaway network namespace (`efg-<pid>-<n>`), whose `lo` is up and
//! also holds 192.0.2.53/32 and 192.0.2.54/32:
//!
//! * **upstream**: one dnsmasq on 192.0.2.53:53 and 192.0.2.54:53 (`--no-resolv --no-hosts`,
//!   answering only from a hosts file of the bench's names, TTL 300, anything else NXDOMAIN).
//!   The guard asks it at .53, which its table lets only the guard's marked sockets reach;
//!   the others ask it at .54, which the table's loopback accept lets anyone reach;
//! * **guard**: the real binary, `egress-fence run POLICY --log-format json` (the
//!   `CARGO_BIN_EXE_egress-fence` Cargo builds for the bench, in the bench's profile, or
//!   `--bin`'s), with `dns.mode: guard`, listening on 127.0.0.53:53, upstream 192.0.2.53,
//!   allowing `*.bench.example` on tcp/443; `RUST_LOG=info` (the service's default level;
//!   with `--held` also `egress_fence::guard=debug`, the guard's line per released answer),
//!   its log in a file, its state directory (`EGRESS_FENCE_STATE_DIR`) a temporary one;
//! * **plain forwarder**: dnsmasq on 127.0.0.54:53, `--cache-size=0 --no-resolv
//!   --server=192.0.2.54`: the same hop to the same upstream, without a table;
//! * **peer**: dnsmasq on 127.0.0.55:53, as the plain forwarder plus
//!   `--nftset=/bench.example/4#inet#efbench#peer4`, a set (`type ipv4_addr`) in a table of
//!   its own that nothing else writes.
//!
//! The client is this binary re-executed as `--child NETNS LOG N CONCURRENCY GAP_US HELD
//! PIDS`: it enters the namespace and sends A queries over UDP, each for a name nobody asked
//! before (so no cache anywhere answers it), and times each from `send` to the answer's
//! arrival:
//!
//! * **sequential**: N iterations, each one query to the guard (`gI.bench.example`), one to
//!   the plain forwarder (`pI.bench.example`), one to the peer (`nI.bench.example`) and one
//!   straight to the upstream (`dI.bench.example`), the order rotating, so all see the same
//!   moments of the machine; every fourth iteration also one query to the guard for a
//!   `kI.bench.example` name. 100 iterations of warm-up go first and are not counted.
//! * **concurrent** (`--concurrency C`, default 8, 0 skips it): N queries per side (guard,
//!   plain forwarder, peer), by C threads at once, each asking its next name as soon as its
//!   last is answered, in 4 rounds of one block per side (the order rotating). The answers
//!   per second of a side are its answers over the wall time of its blocks; its CPU time per
//!   answer is what its server process used (`/proc/PID/task/*/schedstat`, all threads)
//!   while its blocks ran, over its answers.
//!
//! Every `gI`, `pI`, `nI` and `dI` name answers with an address of its own from
//! 198.18.0.0/15 (RFC 2544's benchmarking range, which the other benches use for set elements
//! too; nothing is ever sent to these addresses: they are answer data and set elements
//! only), so each guard and peer answer carries an address its set does not hold yet: the
//! worst case. Every `kI` name answers 192.0.2.1, which the first one installs: those answers
//! need no batch, and show what the guard costs without the kernel round trip.
//!
//! Figures:
//!
//! * **held** (with `--held`): the guard's own `held_us`, logged per released answer
//!   (`egress_fence::guard`, debug): from the upstream answer arriving to the answer being
//!   released to the client, after the kernel acknowledged the batch with its addresses. The
//!   child reads the log at the end and takes the line of each name it asked. Also for the
//!   first and the last tenth of the sequential run apart: every answered name is one more
//!   name the daemon remembers, so they show whether an answer costs more once the guard has
//!   learned many. The line is a log write per answer that the service does not make: the
//!   round trips of a `--held` run are not comparable with the others.
//! * **client RTT** via the guard, the plain forwarder, the peer and straight to the
//!   upstream; the differences of the guard's p50/p99 and the others' and their ratios; for
//!   the sequential run also the paired differences (guard − other of the same iteration).
//! * **answers per second** and **CPU time per answer** of each side in the concurrent run.
//! * **GETGEN**: the round trip of one NFT_MSG_GETGEN on a netlink socket of the bench's own in
//!   the namespace (read-only): the cost of a netlink round trip that changes nothing (the
//!   daemon sent one after every batch it committed before 5e0cd2b).
//! * the machine (CPUs, their model), kernel, dnsmasq's and nft's versions, and the load
//!   average before and after.
//!
//! Correctness, checked before anything is reported (a failure panics): every answer carried
//! the name's address; with `--held` every guard answer has its `held_us` line; and after the
//! run `nft -j list set inet egress_fence resolved4` holds an element (address, tcp, 443) for
//! every distinct address the guard answered, and `peer4` every address the peer answered.
//!
//! There are no timing asserts: this is a benchmark. Nothing is loaded into the root network
//! namespace and no packet leaves the bench's namespace. The namespace is removed by a drop
//! guard, and every process the bench starts (the dnsmasqs, egress-fence, the child) is
//! ended by one, also on panic or SIGINT/SIGTERM/SIGHUP.
//!
//! Run as root (needs `ip`, `nft`, `dnsmasq` from dnsmasq-base, built with nftset, as
//! Debian's is): `cargo bench --bench guard`. Options after `--`: `--queries N` (per side and
//! mode, default 2000), `--concurrency C` (default 8; 0 = sequential only), `--gap-us G`
//! (pause between sequential iterations, default 0), `--keep-log FILE` (a copy of
//! egress-fence's log), `--held` (see above), `--bin EGRESS-FENCE` (another build to
//! measure, for a before/after on the same machine: run it and this build in turn).
//! `--queries 20000 --held` shows how the cost grows with the names learned.

#![deny(unsafe_code)]

#[allow(unsafe_code)] // its blocks, each with its SAFETY comment, are the benches' only ones
mod common;

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    TempNetns, a_query, dnsmasq_on, end_process, enter, field, first_line_of, kernel_release,
    measure, percentile, require_root, run, run_parent, self_command,
};
use egress_fence::nft::Nft;
use hickory_proto::op::{Message, MessageType, ResponseCode};

/// This bench's namespaces are `efg-<pid>-<n>`.
const NS_PREFIX: &str = "efg-";
/// The upstream resolver, on `lo` of the namespace.
const UPSTREAM: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 53);
/// The guard's listening address.
const GUARD: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 53);
/// The same upstream dnsmasq's second address, which the peers and the direct queries ask:
/// the guard's table lets only the guard's marked sockets reach [`UPSTREAM`], and the
/// loopback accept lets anyone reach this one.
const UPSTREAM_PEERS: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 54);
/// The plain forwarder's listening address.
const PLAIN: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 54);
/// The peer's listening address: dnsmasq with `--nftset`, adding each answer's addresses to a
/// set of its own before it answers.
const NFTSET: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 55);
/// The peer's table and set (`inet efbench peer4`, `type ipv4_addr`).
const PEER_TABLE: &str = "efbench";
const PEER_SET: &str = "peer4";
/// What every `kI` name answers (installed by the first of them).
const KNOWN: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// What the readiness probe's name answers.
const READY: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
const READY_NAME: &str = "ready.bench.example";
/// The TTL of every upstream answer.
const TTL: u32 = 300;
/// The policy's port for `*.bench.example`.
const PORT: u16 = 443;
/// Discarded queries per side before anything is measured.
const WARMUP: usize = 100;
/// Rounds of the concurrent run (one block per side each).
const ROUNDS: usize = 4;
/// Every this many sequential iterations also ask a `kI` name.
const KNOWN_EVERY: usize = 4;
/// How long a query may take before the bench gives up on it.
const QUERY_TIMEOUT: Duration = Duration::from_secs(3);
/// GETGEN round trips timed.
const GETGENS: usize = 500;
/// Issue 5's aim for the guard's p99 per answer.
const TARGET_P99_MS: f64 = 5.0;
/// Issue 16's aim: the guard's client round trip at most this many times the plain
/// forwarder's.
const TARGET_RATIO: f64 = 1.3;
/// The log line egress-fence writes once the guard serves (its readiness).
const SERVING: &str = "the DNS guard is serving";

// ---- the workload --------------------------------------------------------------------------

/// A side of the comparison, and the prefix of its names.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// Via the guard, a fresh address per answer.
    Guard,
    /// Via the plain forwarder.
    Plain,
    /// Via dnsmasq `--nftset`, a fresh address per answer.
    Nftset,
    /// Via the guard, an address already installed.
    Known,
    /// Straight to the upstream, no forwarder: what the hop itself costs.
    Direct,
}

impl Kind {
    fn prefix(self) -> char {
        match self {
            Kind::Guard => 'g',
            Kind::Plain => 'p',
            Kind::Nftset => 'n',
            Kind::Known => 'k',
            Kind::Direct => 'd',
        }
    }

    fn server(self) -> SocketAddr {
        match self {
            Kind::Guard | Kind::Known => (GUARD, 53).into(),
            Kind::Plain => (PLAIN, 53).into(),
            Kind::Nftset => (NFTSET, 53).into(),
            Kind::Direct => (UPSTREAM_PEERS, 53).into(),
        }
    }

    fn name(self, i: usize) -> String {
        format!("{}{i}.bench.example", self.prefix())
    }

    /// The one address the `i`th name answers: `gI` 198.18.0.0 + I, `pI`, `nI` and `dI`
    /// 198.19.0.0 + I (they never reach the guard's table; only `nI` reaches the peer's set).
    fn address(self, i: usize) -> Ipv4Addr {
        let base = match self {
            Kind::Guard => Ipv4Addr::new(198, 18, 0, 0),
            Kind::Plain | Kind::Nftset | Kind::Direct => Ipv4Addr::new(198, 19, 0, 0),
            Kind::Known => return KNOWN,
        };
        assert!(i < 1 << 16, "a side has 65,536 addresses");
        Ipv4Addr::from(u32::from(base) + i as u32)
    }
}

/// Names per side for `n` queries per mode: warm-up, sequential, concurrent.
fn names_per_side(n: usize) -> usize {
    WARMUP + 2 * n
}

/// The upstream's records: every name of every side, and the readiness probe's.
fn hosts_file(n: usize) -> String {
    let mut text = format!("{READY} {READY_NAME}\n");
    for kind in [Kind::Guard, Kind::Plain, Kind::Nftset, Kind::Direct] {
        for i in 0..names_per_side(n) {
            text.push_str(&format!("{} {}\n", kind.address(i), kind.name(i)));
        }
    }
    for i in 0..WARMUP + n / KNOWN_EVERY + 1 {
        text.push_str(&format!("{KNOWN} {}\n", Kind::Known.name(i)));
    }
    text
}

fn policy_text() -> String {
    format!(
        "version: 1\nallow:\n  - domain: \"*.bench.example\"\n    ports: [{PORT}]\ndns:\n  \
         mode: guard\n  listen: [{GUARD}:53]\n  upstream: [{UPSTREAM}]\n"
    )
}

// ---- the client ------------------------------------------------------------------------------

/// A UDP client of one server.
struct Client {
    socket: UdpSocket,
    next_id: u16,
}

/// One answered query.
struct Sample {
    kind: Kind,
    name: String,
    rtt: Duration,
}

impl Client {
    fn new(server: SocketAddr) -> Client {
        let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a client socket");
        socket.connect(server).expect("connect the client socket");
        socket
            .set_read_timeout(Some(QUERY_TIMEOUT))
            .expect("set a read timeout");
        Client {
            socket,
            next_id: first_id(),
        }
    }

    /// Asks `name`'s A record; the round trip and the answer's addresses, or why not.
    fn ask(&mut self, name: &str) -> Result<(Duration, Vec<IpAddr>), String> {
        self.next_id = self.next_id.wrapping_add(1);
        let id = self.next_id;
        let (query, bytes) = a_query(id, name);
        let mut buf = [0u8; 4096];
        let start = Instant::now();
        self.socket.send(&bytes).map_err(|e| format!("send: {e}"))?;
        let (rtt, parsed) = loop {
            let len = self
                .socket
                .recv(&mut buf)
                .map_err(|e| format!("no answer ({e})"))?;
            let rtt = start.elapsed();
            // A late answer to an earlier query of this socket (none expected) is skipped.
            if len >= 2 && buf[..2] == id.to_be_bytes() {
                break (rtt, Message::from_vec(&buf[..len]));
            }
        };
        let parsed = parsed.map_err(|e| format!("malformed answer: {e}"))?;
        if parsed.metadata.message_type != MessageType::Response || parsed.queries != query.queries
        {
            return Err("an answer to another question".into());
        }
        if parsed.metadata.response_code != ResponseCode::NoError {
            return Err(format!("answer {}", parsed.metadata.response_code));
        }
        Ok((
            rtt,
            parsed
                .answers
                .iter()
                .filter_map(|r| r.data.ip_addr())
                .collect(),
        ))
    }

    /// Asks the `i`th name of `kind`; panics unless the answer is exactly its address.
    fn sample(&mut self, kind: Kind, i: usize) -> Sample {
        let name = kind.name(i);
        let (rtt, addrs) = self
            .ask(&name)
            .unwrap_or_else(|e| panic!("{name} via {}: {e}", kind.server()));
        let want = IpAddr::V4(kind.address(i));
        assert!(
            addrs == [want],
            "{name} via {}: answered {addrs:?}, expected [{want}]",
            kind.server()
        );
        Sample { kind, name, rtt }
    }
}

/// Where a client's query ids start (they only have to differ between its queries).
fn first_id() -> u16 {
    (std::process::id() as u16).wrapping_mul(2_654)
}

/// Waits until `server` answers the readiness name with its address.
fn wait_ready(server: SocketAddr, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut client = Client::new(server);
    client
        .socket
        .set_read_timeout(Some(Duration::from_millis(100)))
        .expect("set a read timeout");
    loop {
        match client.ask(READY_NAME) {
            Ok((_, addrs)) if addrs == [IpAddr::V4(READY)] => return,
            Ok((_, addrs)) => panic!("{what} answered {READY_NAME} with {addrs:?}"),
            Err(e) if Instant::now() > deadline => panic!("{what} ({server}) is not ready: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// The sequential run: `n` iterations from name index `from` on; see the module docs.
fn sequential(from: usize, n: usize, gap: Duration, known_from: usize) -> Vec<Sample> {
    let mut guard = Client::new(Kind::Guard.server());
    let mut plain = Client::new(Kind::Plain.server());
    let mut nftset = Client::new(Kind::Nftset.server());
    let mut direct = Client::new(Kind::Direct.server());
    let mut samples = Vec::with_capacity(4 * n + n / KNOWN_EVERY);
    let mut known = known_from;
    for k in 0..n {
        if !gap.is_zero() {
            std::thread::sleep(gap);
        }
        let i = from + k;
        // Each side goes first, second, third and fourth equally often.
        for turn in 0..4 {
            match (k + turn) % 4 {
                0 => samples.push(guard.sample(Kind::Guard, i)),
                1 => samples.push(plain.sample(Kind::Plain, i)),
                2 => samples.push(nftset.sample(Kind::Nftset, i)),
                _ => samples.push(direct.sample(Kind::Direct, i)),
            }
        }
        if k % KNOWN_EVERY == KNOWN_EVERY - 1 {
            samples.push(guard.sample(Kind::Known, known));
            known += 1;
        }
    }
    samples
}

/// `count` queries of `kind` from name index `from` on, by `threads` threads at once, each
/// asking its next name as soon as the last one is answered; with the block's wall time.
fn block(kind: Kind, from: usize, count: usize, threads: usize) -> (Vec<Sample>, Duration) {
    let start = Instant::now();
    let samples = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut client = Client::new(kind.server());
                    (from + t..from + count)
                        .step_by(threads)
                        .map(|i| client.sample(kind, i))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a client thread panicked"))
            .collect()
    });
    (samples, start.elapsed())
}

/// The sides of the concurrent run.
const CONCURRENT: [Kind; 3] = [Kind::Guard, Kind::Plain, Kind::Nftset];

/// What a side of the concurrent run took: wall time, and the CPU time of its server process.
#[derive(Default, Clone, Copy)]
struct Spent {
    wall: Duration,
    cpu_ns: u64,
}

/// The concurrent run: `n` queries per side from name index `from` on; with what each side
/// took (`pids`: each side's server process, by prefix).
fn concurrent(
    from: usize,
    n: usize,
    threads: usize,
    pids: &HashMap<char, u32>,
) -> (Vec<Sample>, HashMap<char, Spent>) {
    let mut samples = Vec::with_capacity(CONCURRENT.len() * n);
    let mut spent: HashMap<char, Spent> = HashMap::new();
    for round in 0..ROUNDS {
        let start = from + n * round / ROUNDS;
        let count = n * (round + 1) / ROUNDS - n * round / ROUNDS;
        // Each side goes first, second and third in turn.
        for k in 0..CONCURRENT.len() {
            let kind = CONCURRENT[(round + k) % CONCURRENT.len()];
            let pid = pids.get(&kind.prefix()).copied().unwrap_or(0);
            let cpu_before = cpu_ns(pid);
            let (answered, wall) = block(kind, start, count, threads);
            let cpu = cpu_ns(pid).saturating_sub(cpu_before);
            samples.extend(answered);
            let side = spent.entry(kind.prefix()).or_default();
            side.wall += wall;
            side.cpu_ns += cpu;
        }
    }
    (samples, spent)
}

// ---- what the guard logged, what the table holds ---------------------------------------------

/// `held_us` of every answer the guard released, by name, from its JSON log.
fn held_by_name(log: &Path) -> HashMap<String, Vec<u64>> {
    let text = std::fs::read_to_string(log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    let mut held: HashMap<String, Vec<u64>> = HashMap::new();
    for line in text.lines() {
        let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let fields = &event["fields"];
        if let (Some(name), Some(us)) = (fields["name"].as_str(), fields["held_us"].as_u64()) {
            held.entry(name.to_owned()).or_default().push(us);
        }
    }
    held
}

/// The IPv4 addresses with an element (address, tcp, [`PORT`]) in the live `resolved4`.
fn resolved4() -> BTreeSet<Ipv4Addr> {
    let json = nft_json(&["-j", "list", "set", "inet", "egress_fence", "resolved4"]);
    let mut addrs = BTreeSet::new();
    for item in json["nftables"].as_array().expect("an nftables array") {
        let Some(elems) = item["set"]["elem"].as_array() else {
            continue;
        };
        for e in elems {
            let concat = &e["elem"]["val"]["concat"];
            if concat[1] == "tcp" && concat[2] == PORT {
                let addr = concat[0].as_str().and_then(|a| a.parse().ok());
                addrs.insert(addr.unwrap_or_else(|| panic!("an element of resolved4: {e}")));
            }
        }
    }
    addrs
}

/// The addresses in the peer's set (`inet efbench peer4`).
fn peer_set() -> BTreeSet<Ipv4Addr> {
    let json = nft_json(&["-j", "list", "set", "inet", PEER_TABLE, PEER_SET]);
    let mut addrs = BTreeSet::new();
    for item in json["nftables"].as_array().expect("an nftables array") {
        let Some(elems) = item["set"]["elem"].as_array() else {
            continue;
        };
        for e in elems {
            // Plain addresses, or objects when an element has a timeout or counter.
            let addr = e.as_str().or_else(|| e["elem"]["val"].as_str());
            let addr = addr.and_then(|a| a.parse().ok());
            addrs.insert(addr.unwrap_or_else(|| panic!("an element of {PEER_SET}: {e}")));
        }
    }
    addrs
}

/// `nft ARGS`' JSON output.
fn nft_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new("nft").args(args).output().expect("run nft");
    assert!(
        out.status.success(),
        "nft {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("nft's JSON")
}

/// The round trip of `GETGENS` GETGEN requests on a socket of our own, in µs.
fn getgen_us() -> Vec<u64> {
    let mut nft = Nft::open().unwrap_or_else(|e| panic!("{e}"));
    (0..GETGENS)
        .map(|_| {
            let start = Instant::now();
            nft.generation().unwrap_or_else(|e| panic!("GETGEN: {e}"));
            start.elapsed().as_micros() as u64
        })
        .collect()
}

// ---- the child's report ----------------------------------------------------------------------

/// `key_n`, `key_p50`, `key_p99`, `key_max` of samples in µs.
fn stats(key: &str, us: &[u64]) -> String {
    format!(
        "{key}_n={} {key}_p50={} {key}_p99={} {key}_max={}",
        us.len(),
        percentile(us, 50.0),
        percentile(us, 99.0),
        us.iter().max().copied().unwrap_or(0)
    )
}

/// The same for signed samples.
fn stats_signed(key: &str, us: &[i64]) -> String {
    format!(
        "{key}_p50={} {key}_p99={}",
        percentile(us, 50.0),
        percentile(us, 99.0)
    )
}

fn rtt_us(samples: &[Sample], kind: Kind) -> Vec<u64> {
    samples
        .iter()
        .filter(|s| s.kind == kind)
        .map(|s| s.rtt.as_micros() as u64)
        .collect()
}

/// The `held_us` of every guard answer among `samples` of `kind`; panics if one is missing.
fn held_us(samples: &[Sample], kind: Kind, held: &HashMap<String, Vec<u64>>) -> Vec<u64> {
    samples
        .iter()
        .filter(|s| s.kind == kind)
        .map(|s| match held.get(&s.name).map(Vec::as_slice) {
            Some(&[us]) => us,
            other => panic!("the guard logged {other:?} as held_us of {}", s.name),
        })
        .collect()
}

/// `--child NETNS LOG N CONCURRENCY GAP_US HELD PIDS`: the client; prints its figures as
/// `key=value`. `HELD` is 1 when the guard logs `held_us` per answer; `PIDS` are the guard's,
/// the plain forwarder's and the peer's process ids, comma-separated.
fn child(
    ns: &str,
    log: &Path,
    n: usize,
    threads: usize,
    gap: Duration,
    with_held: bool,
    pids: &HashMap<char, u32>,
) {
    enter(NS_PREFIX, ns);
    wait_ready((UPSTREAM_PEERS, 53).into(), "the upstream dnsmasq");
    wait_ready(Kind::Plain.server(), "the plain forwarder");
    wait_ready(Kind::Nftset.server(), "dnsmasq --nftset");
    wait_ready(Kind::Guard.server(), "the guard");

    // Warm-up (every server's code paths, the table's set, the sockets): discarded, but the
    // answers' addresses are checked in the sets like the others.
    let warm = sequential(0, WARMUP, Duration::ZERO, 0);
    let seq = sequential(WARMUP, n, gap, WARMUP / KNOWN_EVERY);
    let (conc, spent) = match threads {
        0 => Default::default(),
        t => concurrent(WARMUP + n, n, t, pids),
    };
    let getgen = getgen_us();

    let mut report = vec![
        stats("rtt_direct_seq", &rtt_us(&seq, Kind::Direct)),
        stats("rtt_guard_seq", &rtt_us(&seq, Kind::Guard)),
        stats("rtt_plain_seq", &rtt_us(&seq, Kind::Plain)),
        stats("rtt_nftset_seq", &rtt_us(&seq, Kind::Nftset)),
        stats("rtt_known_seq", &rtt_us(&seq, Kind::Known)),
        stats("rtt_guard_conc", &rtt_us(&conc, Kind::Guard)),
        stats("rtt_plain_conc", &rtt_us(&conc, Kind::Plain)),
        stats("rtt_nftset_conc", &rtt_us(&conc, Kind::Nftset)),
        stats("getgen", &getgen),
    ];
    for kind in CONCURRENT {
        let side = spent.get(&kind.prefix()).copied().unwrap_or_default();
        let answered = conc.iter().filter(|s| s.kind == kind).count().max(1);
        report.push(format!(
            "qps_{k}={:.0} cpu_{k}={:.1}",
            answered as f64 / side.wall.as_secs_f64().max(1e-9),
            side.cpu_ns as f64 / 1e3 / answered as f64,
            k = kind.prefix(),
        ));
    }
    if with_held {
        // Every guard answer was logged once.
        let held = held_by_name(log);
        let held_seq = held_us(&seq, Kind::Guard, &held);
        let held_known = held_us(&seq, Kind::Known, &held);
        // The first and the last tenth of the sequential run: does an answer cost more when
        // the guard has learned more names?
        let tenth = |v: &[u64], last: bool| -> Vec<u64> {
            let k = (v.len() / 10).max(1);
            match last {
                false => v[..k].to_vec(),
                true => v[v.len() - k..].to_vec(),
            }
        };
        report.extend([
            stats("held_seq", &held_seq),
            stats("held_seq_first", &tenth(&held_seq, false)),
            stats("held_seq_last", &tenth(&held_seq, true)),
            stats("held_known", &held_known),
            stats("held_known_first", &tenth(&held_known, false)),
            stats("held_known_last", &tenth(&held_known, true)),
            stats("held_conc", &held_us(&conc, Kind::Guard, &held)),
        ]);
        held_us(&warm, Kind::Guard, &held);
        held_us(&warm, Kind::Known, &held);
    }
    let paired = |other: Kind| -> Vec<i64> {
        rtt_us(&seq, Kind::Guard)
            .iter()
            .zip(rtt_us(&seq, other))
            .map(|(&g, p)| g as i64 - p as i64)
            .collect()
    };
    report.push(stats_signed("paired_seq", &paired(Kind::Plain)));
    report.push(stats_signed("paired_nftset_seq", &paired(Kind::Nftset)));

    // Every address the guard answered is in its table, and every one the peer answered in
    // the peer's set.
    let answered = |kinds: &[Kind]| -> BTreeSet<Ipv4Addr> {
        [&warm, &seq, &conc]
            .into_iter()
            .flatten()
            .filter(|s| kinds.contains(&s.kind))
            .map(|s| {
                let i: usize = s.name[1..s.name.find('.').expect("a dot")]
                    .parse()
                    .expect("an index");
                s.kind.address(i)
            })
            .collect()
    };
    let guard_answered: BTreeSet<Ipv4Addr> = answered(&[Kind::Guard, Kind::Known])
        .into_iter()
        .chain([READY])
        .collect();
    let live = resolved4();
    assert_holds("resolved4", "the guard", &guard_answered, &live);
    let peer_answered = answered(&[Kind::Nftset]);
    let peer_live = peer_set();
    assert_holds(PEER_SET, "dnsmasq --nftset", &peer_answered, &peer_live);
    report.push(format!(
        "answered_addrs={} set_elements={} peer_answered={} peer_elements={}",
        guard_answered.len(),
        live.len(),
        peer_answered.len(),
        peer_live.len()
    ));
    println!("{}", report.join(" "));
}

/// Panics unless `live` (the set `set`) holds every address of `answered`.
fn assert_holds(set: &str, who: &str, answered: &BTreeSet<Ipv4Addr>, live: &BTreeSet<Ipv4Addr>) {
    let missing: Vec<&Ipv4Addr> = answered.difference(live).collect();
    assert!(
        missing.is_empty(),
        "{set} lacks {} of the {} addresses {who} answered, e.g. {:?}",
        missing.len(),
        answered.len(),
        &missing[..missing.len().min(5)]
    );
}

// ---- the parent --------------------------------------------------------------------------------

/// The processes the bench started in its namespace; each is ended (SIGTERM, then SIGKILL)
/// and reaped on drop, in reverse order of start, also when a panic unwinds.
#[derive(Default)]
struct Procs(Vec<(&'static str, Child)>);

impl Procs {
    fn spawn(&mut self, what: &'static str, cmd: &mut Command, stderr: &Path) -> &mut Child {
        let stderr = File::create(stderr).unwrap_or_else(|e| panic!("{}: {e}", stderr.display()));
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        self.0.push((what, child));
        &mut self.0.last_mut().expect("just pushed").1
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

struct Options {
    queries: usize,
    concurrency: usize,
    gap: Duration,
    /// Where to copy egress-fence's log before the temporary directory goes.
    keep_log: Option<PathBuf>,
    /// Whether the guard logs `held_us` per answer (a debug line each, which the service
    /// does not write by default).
    held: bool,
    /// Another egress-fence binary to measure (an older build, for a before/after).
    bin: Option<PathBuf>,
}

fn usage() -> ! {
    eprintln!(
        "usage: guard [--queries N] [--concurrency C] [--gap-us G] [--keep-log FILE] [--held] \
         [--bin EGRESS-FENCE]  \
         (run with cargo bench)"
    );
    std::process::exit(2)
}

fn options(args: &[String]) -> Options {
    let mut o = Options {
        queries: 2_000,
        concurrency: 8,
        gap: Duration::ZERO,
        keep_log: None,
        held: false,
        bin: None,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        if arg == "--held" {
            o.held = true;
            continue;
        }
        if arg == "--bin" {
            o.bin = Some(args.next().unwrap_or_else(|| usage()).into());
            continue;
        }
        if arg == "--keep-log" {
            o.keep_log = Some(args.next().unwrap_or_else(|| usage()).into());
            continue;
        }
        let mut value = || {
            let v = args.next().unwrap_or_else(|| usage());
            v.trim()
                .replace('_', "")
                .parse::<usize>()
                .unwrap_or_else(|_| usage())
        };
        match arg.as_str() {
            "--bench" => {} // passed by `cargo bench`
            "--queries" => o.queries = value(),
            "--concurrency" => o.concurrency = value(),
            "--gap-us" => o.gap = Duration::from_micros(value() as u64),
            _ => usage(),
        }
    }
    if o.queries < ROUNDS || names_per_side(o.queries) > 1 << 16 {
        eprintln!(
            "--queries goes from {ROUNDS} to {}",
            ((1 << 16) - WARMUP) / 2
        );
        usage();
    }
    o
}

/// A child's figure in ms (it reports µs).
fn ms(report: &str, key: &str) -> f64 {
    field::<f64>(report, key) / 1e3
}

fn bench(args: &[String]) {
    let o = options(args);
    require_root();
    let bin = o
        .bin
        .clone()
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_egress-fence").into());
    let dir = tempfile::Builder::new()
        .prefix("efg-")
        .tempdir()
        .expect("a temporary directory");
    let path = |file: &str| -> PathBuf { dir.path().join(file) };
    std::fs::write(path("hosts"), hosts_file(o.queries)).expect("write the hosts file");
    std::fs::write(path("policy.yaml"), policy_text()).expect("write the policy");
    std::fs::create_dir(path("state")).expect("create the state directory");

    // Dropped in reverse: the processes end before the namespace goes, and both before the
    // directory.
    let ns = TempNetns::new(NS_PREFIX);
    run(ns.command("ip").args(["link", "set", "lo", "up"]));
    run(ns
        .command("ip")
        .args(["addr", "add", &format!("{UPSTREAM}/32"), "dev", "lo"]));
    let mut procs = Procs::default();
    run(ns
        .command("ip")
        .args(["addr", "add", &format!("{UPSTREAM_PEERS}/32"), "dev", "lo"]));
    // The peer's own table, which nothing but dnsmasq --nftset writes.
    run(ns
        .command("nft")
        .args(["add table inet efbench; add set inet efbench peer4 { type ipv4_addr; }"]));
    procs.spawn(
        "the upstream dnsmasq",
        dnsmasq_on(&ns, &UPSTREAM.to_string())
            .arg(format!("--listen-address={UPSTREAM_PEERS}"))
            .arg(format!("--addn-hosts={}", path("hosts").display()))
            .arg(format!("--local-ttl={TTL}"))
            // Answer only from the hosts file; anything else is NXDOMAIN, never forwarded.
            .arg("--local=/#/"),
        &path("upstream.stderr"),
    );
    procs.spawn(
        "the plain forwarder",
        dnsmasq_on(&ns, &PLAIN.to_string())
            .arg("--cache-size=0")
            .arg(format!("--server={UPSTREAM_PEERS}")),
        &path("plain.stderr"),
    );
    procs.spawn(
        "dnsmasq --nftset",
        dnsmasq_on(&ns, &NFTSET.to_string())
            .arg("--cache-size=0")
            .arg(format!("--server={UPSTREAM_PEERS}"))
            .arg(format!(
                "--nftset=/bench.example/4#inet#{PEER_TABLE}#{PEER_SET}"
            )),
        &path("nftset.stderr"),
    );
    let log = path("egress-fence.log");
    let fence = procs.spawn(
        "egress-fence",
        ns.command(bin.to_str().expect("a UTF-8 path"))
            .arg("run")
            .arg(path("policy.yaml"))
            .args(["--log-format", "json"])
            .env(
                "RUST_LOG",
                match o.held {
                    // The service's default level, and the guard's line per answer.
                    true => "info,egress_fence::guard=debug",
                    false => "info",
                },
            )
            .env("EGRESS_FENCE_STATE_DIR", path("state")),
        &log,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !read_lossy(&log).contains(SERVING) {
        if let Ok(Some(status)) = fence.try_wait() {
            panic!("egress-fence exited ({status}):\n{}", read_lossy(&log));
        }
        assert!(
            Instant::now() < deadline,
            "egress-fence does not serve after 10 s:\n{}",
            read_lossy(&log)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for (what, child) in &mut procs.0 {
        if let Ok(Some(status)) = child.try_wait() {
            let file = if what.contains("upstream") {
                "upstream"
            } else if what.contains("nftset") {
                "nftset"
            } else {
                "plain"
            };
            panic!(
                "{what} exited ({status}): {}",
                read_lossy(&path(&format!("{file}.stderr")))
            );
        }
    }

    let kernel = kernel_release();
    println!(
        "egress-fence guard benchmark: {}; kernel {kernel}; {}; {}; {} queries per side and \
         mode, concurrency {}; every name asked once; load average before: {}",
        machine(),
        first_line_of("dnsmasq", &["--version"]),
        first_line_of("nft", &["--version"]),
        o.queries,
        o.concurrency,
        load_average(),
    );
    println!("guard: {}", bin.display());
    println!(
        "one netns: upstream dnsmasq {UPSTREAM} and {UPSTREAM_PEERS} (hosts file), guard \
         {GUARD} (egress-fence run, dns.mode guard, log level {}) to {UPSTREAM}; plain forwarder \
         {PLAIN} (dnsmasq --cache-size=0) and peer {NFTSET} (dnsmasq --cache-size=0 --nftset) \
         to {UPSTREAM_PEERS}",
        match o.held {
            true => "info, guard debug",
            false => "info",
        }
    );
    eprintln!("measuring...");
    let pid = |what: &str| -> u32 {
        procs
            .0
            .iter()
            .find(|(w, _)| *w == what)
            .map(|(_, c)| c.id())
            .expect("started")
    };
    let pids = format!(
        "{},{},{}",
        pid("egress-fence"),
        pid("the plain forwarder"),
        pid("dnsmasq --nftset")
    );
    let r = measure(&mut self_command(&[
        "--child",
        &ns.name,
        &log.to_string_lossy(),
        &o.queries.to_string(),
        &o.concurrency.to_string(),
        &o.gap.as_micros().to_string(),
        if o.held { "1" } else { "0" },
        &pids,
    ]))
    .stdout;
    let load_after = load_average();
    drop(procs);
    let log_text = read_lossy(&log);
    if let Some(keep) = &o.keep_log {
        std::fs::write(keep, &log_text).unwrap_or_else(|e| panic!("{}: {e}", keep.display()));
    }

    // Names the guard had learned when the first and last tenth of the sequential run were
    // asked (each answered name is one, the warm-up's and the probe's included).
    let learned = |k: usize| 1 + WARMUP + WARMUP / KNOWN_EVERY + k + k / KNOWN_EVERY;
    let tenth = o.queries / 10;
    let row = |label: &str, key: &str| {
        println!(
            "{label:<58} {:>7} {:>8.3} {:>8.3} {:>8.3}",
            field::<u64>(&r, &format!("{key}_n")),
            ms(&r, &format!("{key}_p50")),
            ms(&r, &format!("{key}_p99")),
            ms(&r, &format!("{key}_max")),
        );
    };
    println!();
    println!(
        "{:<58} {:>7} {:>8} {:>8} {:>8}",
        "ms", "answers", "p50", "p99", "max"
    );
    if o.held {
        println!("guard held_us (upstream answer in -> answer out, incl. the netlink batch):");
        row("  sequential, new address", "held_seq");
        row(
            &format!("    first tenth (~{} names learned)", learned(0)),
            "held_seq_first",
        );
        row(
            &format!(
                "    last tenth (~{} names learned)",
                learned(o.queries - tenth)
            ),
            "held_seq_last",
        );
        row("  sequential, known address (no batch)", "held_known");
        row("    first tenth", "held_known_first");
        row("    last tenth", "held_known_last");
        if o.concurrency > 0 {
            row(
                &format!("  concurrency {}, new address", o.concurrency),
                "held_conc",
            );
        }
    }
    println!("client RTT:");
    row("  via guard, sequential, new address", "rtt_guard_seq");
    row("  via guard, sequential, known address", "rtt_known_seq");
    row("  via plain forwarder, sequential", "rtt_plain_seq");
    row(
        "  via dnsmasq --nftset, sequential, new address",
        "rtt_nftset_seq",
    );
    row("  straight to the upstream, sequential", "rtt_direct_seq");
    if o.concurrency > 0 {
        for (label, key) in [
            ("via guard", "rtt_guard_conc"),
            ("via plain forwarder", "rtt_plain_conc"),
            ("via dnsmasq --nftset", "rtt_nftset_conc"),
        ] {
            row(&format!("  {label}, concurrency {}", o.concurrency), key);
        }
    }
    row("GETGEN round trip (a socket of the bench's own)", "getgen");

    println!();
    let modes: &[(&str, &str)] = match o.concurrency {
        0 => &[("sequential", "seq")],
        _ => &[("sequential", "seq"), ("concurrent", "conc")],
    };
    for (mode, key) in modes {
        let g = |q: &str| ms(&r, &format!("rtt_guard_{key}_{q}"));
        for (peer, side) in [("plain", "plain"), ("nftset", "nftset")] {
            let p = |q: &str| ms(&r, &format!("rtt_{side}_{key}_{q}"));
            println!(
                "{mode}: guard - {peer}: p50 {:+.3} ms, p99 {:+.3} ms; ratio guard/{peer}: p50 \
                 {:.2}, p99 {:.2}",
                g("p50") - p("p50"),
                g("p99") - p("p99"),
                g("p50") / p("p50"),
                g("p99") / p("p99"),
            );
        }
    }
    println!(
        "sequential, paired (guard - other of the same iteration): plain p50 {:+.3} ms, p99 \
         {:+.3} ms; nftset p50 {:+.3} ms, p99 {:+.3} ms",
        ms(&r, "paired_seq_p50"),
        ms(&r, "paired_seq_p99"),
        ms(&r, "paired_nftset_seq_p50"),
        ms(&r, "paired_nftset_seq_p99"),
    );
    if o.concurrency > 0 {
        let cpu = |k: char| field::<f64>(&r, &format!("cpu_{k}"));
        println!(
            "CPU time per answer, {} clients, new names (the server's own, while its blocks \
             ran): guard {:.1} µs, plain {:.1} µs, nftset {:.1} µs; guard/plain {:.2}",
            o.concurrency,
            cpu('g'),
            cpu('p'),
            cpu('n'),
            cpu('g') / cpu('p'),
        );
        let qps = |k: char| field::<f64>(&r, &format!("qps_{k}"));
        println!(
            "answers per second, {} clients, new names: guard {:.0}, plain {:.0}, nftset {:.0}; \
             guard/plain {:.2}, guard/nftset {:.2}",
            o.concurrency,
            qps('g'),
            qps('p'),
            qps('n'),
            qps('g') / qps('p'),
            qps('g') / qps('n'),
        );
    }
    println!(
        "correctness: every answer carried its name's address{}; resolved4 holds all {} \
         addresses the guard answered ({} elements); {PEER_SET} all {} dnsmasq --nftset \
         answered ({} elements)",
        if o.held {
            "; every guard answer logged its held_us"
        } else {
            ""
        },
        field::<u64>(&r, "answered_addrs"),
        field::<u64>(&r, "set_elements"),
        field::<u64>(&r, "peer_answered"),
        field::<u64>(&r, "peer_elements"),
    );
    println!("load average after: {load_after}");
    let complaints: Vec<&str> = log_text
        .lines()
        .filter(|l| l.contains(r#""level":"WARN""#) || l.contains(r#""level":"ERROR""#))
        .collect();
    println!(
        "egress-fence logged {} warnings or errors{}",
        complaints.len(),
        if complaints.is_empty() { "" } else { ", e.g.:" }
    );
    for line in complaints.iter().take(5) {
        println!("  {line}");
    }
    // After an overrun of its notification socket the daemon's loop pauses 50 ms (answers
    // wait), then compares the ruleset generation with its own.
    let overruns = log_text.matches("notifications overran").count();
    if overruns > 0 {
        println!("egress-fence's nftables notifications overran {overruns} times");
    }
    if o.held {
        let p99 = ms(&r, "held_seq_p99");
        println!(
            "Aim of issue 5: guard held p99 under {TARGET_P99_MS} ms per answer; sequential \
             p99 here {p99:.3} ms ({}).",
            if p99 < TARGET_P99_MS { "met" } else { "MISSED" }
        );
    }
    let ratio = |key: &str, q: &str| {
        ms(&r, &format!("rtt_guard_{key}_{q}")) / ms(&r, &format!("rtt_plain_{key}_{q}"))
    };
    let mut worst = ratio("seq", "p50").max(ratio("seq", "p99"));
    if o.concurrency > 0 {
        worst = worst.max(ratio("conc", "p50")).max(ratio("conc", "p99"));
    }
    println!(
        "Aim of issue 16: guard round trip at most {TARGET_RATIO}x the plain forwarder's (p50, \
         p99, sequential and concurrent): worst here {worst:.2} ({}).",
        if worst <= TARGET_RATIO {
            "met"
        } else {
            "MISSED"
        }
    );
    if o.concurrency > 0 {
        let share = field::<f64>(&r, "qps_g") / field::<f64>(&r, "qps_p");
        println!(
            "Aim of issue 16: guard answers per second ({} clients, new names) at least the \
             plain forwarder's: guard/plain here {share:.2} ({}).",
            o.concurrency,
            if share >= 1.0 { "met" } else { "MISSED" }
        );
    }
}

/// The CPU model and how many CPUs this process may use.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown CPU", |(_, m)| m.trim());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpus} CPUs ({model})")
}

/// The CPU time of every thread of `pid` so far, in ns.
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// The 1-, 5- and 15-minute load averages.
fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or_else(|| usage());
        let num = |i: usize| arg(i).parse::<usize>().unwrap_or_else(|_| usage());
        let gap = Duration::from_micros(num(5) as u64);
        let pids: Vec<u32> = arg(7)
            .split(',')
            .map(|p| p.parse().unwrap_or_else(|_| usage()))
            .collect();
        let pids: HashMap<char, u32> = CONCURRENT.iter().map(|k| k.prefix()).zip(pids).collect();
        child(
            arg(1),
            Path::new(arg(2)),
            num(3),
            num(4),
            gap,
            num(6) == 1,
            &pids,
        );
        return;
    }
    run_parent(NS_PREFIX, || bench(&args));
}
