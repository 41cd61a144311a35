//! The operator's tools as the fenced process plays them: what `watch` prints and the service
//! logs must not be less than what the fence refused without saying so.

use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::common::*;

/// Refused decoys the sandbox sends to spend the log rate (10/second, burst 20).
const DECOYS: usize = 200;
/// Where the attempt it wants hidden goes.
const HIDDEN_PORT: u16 = 4444;
/// The decoys and the one that matters.
pub(crate) const SENT: u64 = DECOYS as u64 + 1;

/// A policy that logs refusals to NFLOG group 100 at the default rate.
pub(crate) fn logging_policy(w: &World) -> std::path::PathBuf {
    w.write_file(
        "policy.yaml",
        "version: 1\ndns:\n  resolvers: [192.0.2.53]\nlog:\n  group: 100\n",
    )
}

/// As nobody: [`DECOYS`] refused datagrams at once, then the one to [`HIDDEN_PORT`].
pub(crate) fn flood_then_hide(w: &World) {
    let flood = format!(
        "import socket\n\
     s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
     refused = 0\n\
     for i in range({DECOYS}):\n\
     \x20   try:\n\
     \x20       s.sendto(b'decoy', ('{OTHER_V4}', 9))\n\
     \x20   except OSError:\n\
     \x20       refused += 1\n\
     try:\n\
     \x20   s.sendto(b'the one that matters', ('{OTHER2_V4}', {HIDDEN_PORT}))\n\
     except OSError:\n\
     \x20   refused += 1\n\
     print(refused)\n"
    );
    let out = w.adversary_cmd(Adversary::Nobody, &[PYTHON, "-c", &flood]);
    assert!(out.success(), "{out}");
    assert_eq!(
        out.stdout.trim(),
        (DECOYS + 1).to_string(),
        "every send refused: {out}"
    );
}

/// The table logs refusals at the policy's `log.rate` (here the default, 10/second burst 20),
/// one limit for every process. The sandbox sends a burst of refused decoys, then the attempt
/// it wants hidden: the limit is spent, the kernel logs nothing of it, and `watch` (which
/// says it prints every refused packet) showed the decoys and nothing else: not the attempt,
/// nor that anything went unshown. The table's counters count every refusal; `watch` now
/// says how many refused packets it could not show.
#[test]
fn a_burst_of_refusals_hides_no_later_one_from_watch() {
    let w = World::new();
    let policy = logging_policy(&w);
    let applied = w.egress_fence(&["apply", path_arg(&policy)]);
    assert!(applied.success(), "{applied}");
    let mut watch = w.spawn_egress_fence(&["watch", "--json"]);
    assert!(watch.wait_for_output("watching NFLOG group 100", Duration::from_secs(5)));

    flood_then_hide(&w);

    // Whatever `watch` says of what it could not show, it says within a few seconds.
    let shown = |w: &Background| {
        let events = events(&w.stdout());
        let logged = events.iter().filter(|e| e["verdict"] == "refused").count();
        let unshown: u64 = events
            .iter()
            .filter(|e| e["verdict"] == "unlogged")
            .filter_map(|e| e["packets"].as_u64())
            .sum();
        let hidden = events.iter().any(|e| e["dport"] == HIDDEN_PORT);
        (logged, unshown, hidden)
    };
    let accounted = within(Duration::from_secs(15), || {
        let (logged, unshown, _) = shown(&watch);
        logged as u64 + unshown >= SENT
    });
    let (logged, unshown, hidden) = shown(&watch);
    watch.signal(Signal::SIGTERM);
    let _ = watch.wait_timeout(Duration::from_secs(5));
    assert!(
        accounted,
        "the fence refused {SENT} packets; watch showed {logged}, said {unshown} went unshown, \
         and the hidden one was {}:\n{}\n{}",
        if hidden { "shown" } else { "not shown" },
        watch.stdout(),
        watch.stderr()
    );
    assert!(
        hidden || unshown > 0,
        "the hidden attempt is neither shown nor counted"
    );
    // Nor does it say more went unshown than did: nothing else is refused in the sandbox.
    assert_eq!(logged as u64 + unshown, SENT, "{}", watch.stdout());
}

pub(crate) fn events(out: &str) -> Vec<Value> {
    out.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The same burst against `run --log-drops`: the journal logged the decoys and never said that
/// later refusals went unlogged (only the metrics' exact totals could tell). The service now
/// logs how many refused packets the table counted and did not log.
#[test]
fn a_burst_of_refusals_hides_no_later_one_from_the_services_log() {
    let w = World::new();
    let policy = logging_policy(&w);
    let mut daemon = w.spawn_egress_fence(&[
        "run",
        path_arg(&policy),
        "--log-drops",
        "--log-format",
        "json",
    ]);
    assert!(
        daemon.wait_for_output("\"running\"", Duration::from_secs(10)),
        "{}",
        daemon.stderr()
    );
    flood_then_hide(&w);

    let told = |daemon: &Background| {
        let lines = events(&daemon.stderr());
        let message = |l: &Value| l["fields"]["message"].as_str().unwrap_or("").to_string();
        let logged = lines
            .iter()
            .filter(|l| message(l) == "refused packet")
            .count() as u64;
        let unlogged: u64 = lines
            .iter()
            .filter(|l| message(l).starts_with("refused packets not logged"))
            .filter_map(|l| l["fields"]["packets"].as_u64())
            .sum();
        (logged, unlogged)
    };
    let accounted = within(Duration::from_secs(15), || {
        let (logged, unlogged) = told(&daemon);
        logged + unlogged >= SENT
    });
    let (logged, unlogged) = told(&daemon);
    daemon.signal(Signal::SIGTERM);
    let _ = daemon.wait_timeout(Duration::from_secs(10));
    assert!(
        accounted,
        "the fence refused {SENT} packets; the service logged {logged} and said {unlogged} \
         were not logged:\n{}",
        daemon.stderr()
    );
    assert_eq!(logged + unlogged, SENT, "{}", daemon.stderr());
}

/// `exec --report FILE` where CMD's user may write FILE's directory (the agent's workspace, as
/// a CI job has it): exec opened the file before CMD started (a symlink there is refused) and
/// wrote the report into it at the end, but CMD removed it meanwhile and left its own at the
/// path. The canary tripped (exit 99), and the report a gate then reads said it had not. At
/// its end exec now puts its report back at the path, whatever CMD left there.
#[test]
fn the_report_at_the_path_is_execs_not_cmds() {
    use crate::common::exec::*;

    let w = World::new();
    let policy = setup(&w);
    let work = w.dir().join("work");
    cmds_workspace(&work);
    let report = work.join("report.json");
    let forge = "host=${CANARY_WEBHOOK_URL#https://}; host=${host%%/*}; \
                 dig +time=1 +tries=1 \"$host\" >/dev/null; \
                 rm -f report.json && \
                 printf '{\"exit_code\": 0, \"exec_exit_code\": 0, \"canary_tripped\": false, \
                 \"refused\": {\"connections\": 0, \"queries\": 0}}\\n' > report.json && \
                 echo forged";
    let out = exec_in(
        &w,
        &work,
        &policy,
        &[
            "--user",
            "nobody",
            "--canary",
            "--report",
            path_arg(&report),
        ],
        forge,
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("forged"),
        "{}",
        show(&out)
    );
    assert_eq!(
        out.status.code(),
        Some(99),
        "the canary trips: {}",
        show(&out)
    );
    let text = std::fs::read_to_string(&report).expect("the report");
    let json: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(
        json["canary_tripped"], true,
        "the report at the path is CMD's forgery: {json}"
    );
    assert_eq!(json["exec_exit_code"], 99, "{json}");
}

/// The same with the report's directory: CMD moves its workspace away and leaves a fresh one
/// of the same name holding its forgery. exec cannot write there without following CMD's
/// moves, so it fails (125) and says the report at the path is not its own.
#[test]
fn a_report_whose_directory_cmd_moved_is_said_not_to_be_there() {
    use crate::common::exec::*;

    let w = World::new();
    let policy = setup(&w);
    let top = w.dir().join("workspace");
    let work = top.join("work");
    for dir in [&top, &work] {
        cmds_workspace(dir);
    }
    let report = work.join("report.json");
    let forge = "cd .. && mv work work.old && mkdir work && \
                 printf '{\"exit_code\": 0, \"exec_exit_code\": 0, \"canary_tripped\": false}\\n' \
                 > work/report.json && echo forged";
    let out = exec_in(
        &w,
        &work,
        &policy,
        &["--user", "nobody", "--report", path_arg(&report)],
        forge,
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("forged"),
        "{}",
        show(&out)
    );
    assert_eq!(out.status.code(), Some(125), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the report is not at"),
        "{}",
        show(&out)
    );
}

/// A DNS server for every name: answers each A question with ADDR (and nothing else), on UDP
/// ADDRESS:53 bound with SO_REUSEADDR (as dnsmasq and systemd-resolved bind theirs). Prints
/// `bound` once it listens. Arguments: ADDRESS ADDR.
pub(crate) const SQUAT_DNS_PY: &str = r#"
import socket, struct, sys
listen, addr = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((listen, 53))
print('bound', flush=True)
while True:
    q, peer = s.recvfrom(4096)
    if len(q) < 12:
        continue
    end = 12
    while q[end] != 0:
        end += q[end] + 1
    question = q[12:end + 5]
    qtype = struct.unpack('!H', q[end + 1:end + 3])[0]
    answers = b''
    if qtype == 1:
        answers = b'\xc0\x0c' + struct.pack('!HHIH', 1, 1, 3600, 4) + socket.inet_aton(addr)
    head = struct.pack('!HHHHHH', struct.unpack('!H', q[:2])[0], 0x8180, 1,
                       1 if answers else 0, 0, 0)
    s.sendto(head + question + answers, peer)
"#;

/// The fenced agent of the squatter tests: a uid of its own, which may bind port 53 once
/// [`squat_target_with_low_ports_open`] has run.
pub(crate) const AGENT: u32 = 1001;

/// What every squatter test sets up first: a listener at OTHER_V4:443, where the squatter's
/// answers point, and the sandbox's low ports open to every user (as in a container by
/// Docker's default), so the agent may bind port 53. Keep the listener for the test.
pub(crate) fn squat_target_with_low_ports_open(w: &World) -> Listener {
    let listener = w.listen_tcp(OTHER_V4, 443);
    let low_ports = w.sandbox_cmd(&["sysctl", "-w", "net.ipv4.ip_unprivileged_port_start=0"]);
    assert!(low_ports.success(), "{low_ports}");
    listener
}

/// The host's resolver on ADDRESS:53, unfenced, answering HOST_V4, and then the agent's
/// squatter sharing that address and port (SO_REUSEADDR) and answering OTHER_V4; both bound.
/// Keep both for the test.
pub(crate) fn host_resolver_and_agents_squatter(w: &World, address: &str) -> [Background; 2] {
    let mut resolver =
        w.spawn_in_sandbox(&[PYTHON, "-c", SQUAT_DNS_PY, address, &HOST_V4.to_string()]);
    assert!(
        resolver.wait_for_output("bound", Duration::from_secs(10)),
        "{}",
        resolver.stderr()
    );
    let mut squatter = w.spawn_adversary(
        Adversary::User(AGENT),
        &[PYTHON, "-c", SQUAT_DNS_PY, address, &OTHER_V4.to_string()],
    );
    assert!(
        squatter.wait_for_output("bound", Duration::from_secs(10)),
        "{}",
        squatter.stderr()
    );
    [resolver, squatter]
}

/// `egress-fence run POLICY`, once it says it is running.
pub(crate) fn running_fence(w: &World, policy: &std::path::Path) -> Background {
    let mut daemon = w.spawn_egress_fence(&["run", path_arg(policy)]);
    assert!(
        daemon.wait_for_output("running", Duration::from_secs(15)),
        "{}",
        daemon.stderr()
    );
    daemon
}

/// Stops `run` as the operator does (SIGTERM), giving it 10 s to take its table down.
pub(crate) fn stop_fence(daemon: &mut Background) {
    daemon.signal(Signal::SIGTERM);
    let _ = daemon.wait_timeout(Duration::from_secs(10));
}

/// Resolve mode's squatter tests: once the service has had time to ask, the agent tries
/// OTHER_V4:443, where the squatter's answer points.
pub(crate) fn agent_tries_the_squatted_address(w: &World) -> CmdOutput {
    std::thread::sleep(Duration::from_secs(3));
    w.adversary_cmd(
        Adversary::User(AGENT),
        &["bash", "-c", &format!("exec 3<>/dev/tcp/{OTHER_V4}/443")],
    )
}

/// Guard mode's squatter tests: the agent asks the guard for api.example.test and then tries
/// OTHER_V4:443, where the squatter's answer points; says `connected` if it got there.
pub(crate) fn agent_asks_the_guard_and_tries_the_squatted_address(w: &World) -> CmdOutput {
    w.adversary_cmd(
        Adversary::User(AGENT),
        &[
            "bash",
            "-c",
            &format!(
                "dig +short +time=2 +tries=1 @127.0.0.53 api.example.test; \
                 exec 3<>/dev/tcp/{OTHER_V4}/443 && echo connected"
            ),
        ],
    )
}

/// Resolve mode with the resolver resolv.conf names (no `dns.resolvers`), here a local stub
/// on 127.0.0.53 as systemd-resolved is on many hosts, bound with SO_REUSEADDR as resolved
/// binds its stub (`set_dns_stub_common_socket_options`). Root in a container that shares the
/// host's network (no CAP_NET_ADMIN, but it may bind port 53; or any user where
/// `ip_unprivileged_port_start` allows it) binds the same address and port with SO_REUSEADDR
/// too, which UDP grants whatever the owner, and as the later socket it gets the unicast
/// questions sent there (also when the stub is down: at boot, in a restart). The service asks
/// it for the policy's names and installs what it answers: the allowed name points at an
/// address of the fenced process's choosing, on the allowed port, and the fenced process
/// connects there.
///
/// Not fixed without a scope: the table cannot tell the stub's answers from the squatter's
/// (resolve mode has no mark of its own on the resolver's sockets, unlike the guard), and the
/// stub is fenced like the squatter. With a scope it is fixed (see the next test). Without
/// one, `apply` and the service say so whenever a resolver (the policy's or resolv.conf's) is
/// on loopback, with the ways out of it: guard mode, the upstream resolvers in
/// `dns.resolvers`, or a scope. Open: a policy setting naming the stub's uid, whose sockets
/// alone may answer from its address (the guard's `RefuseOtherUidsFromGuardPort` with that
/// uid), would close it where the stub runs under a uid of its own.
#[test]
fn a_loopback_resolver_a_fenced_process_could_squat_is_said_in_resolve_mode() {
    let w = World::new();
    let stub: std::net::IpAddr = "127.0.0.53".parse().expect("an address");
    w.set_sandbox_nameserver(stub);
    w.dns_set("api.example.test", &[HOST_V4], 60);
    let policy = w.write_file(
        "resolve.yaml",
        "version: 1\nallow:\n  - domain: api.example.test\n    ports: [443]\nlog:\n  group: 100\n",
    );
    // The host's stub, answering as the real resolver would.
    let mut resolved = w.spawn_in_sandbox(&[
        PYTHON,
        "-c",
        SQUAT_DNS_PY,
        "127.0.0.53",
        &HOST_V4.to_string(),
    ]);
    assert!(
        resolved.wait_for_output("bound", Duration::from_secs(10)),
        "{}",
        resolved.stderr()
    );
    let said = "resolver 127.0.0.53 is on loopback: a local process that may bind port 53";
    let apply = w.egress_fence(&["apply", path_arg(&policy)]);
    assert!(apply.success(), "{apply}");
    assert!(apply.stderr.contains(said), "{apply}");
    let mut daemon = w.spawn_egress_fence(&["run", path_arg(&policy)]);
    assert!(
        daemon.wait_for_output(said, Duration::from_secs(15)),
        "{}",
        daemon.stderr()
    );
    daemon.signal(Signal::SIGTERM);
    let _ = daemon.wait_timeout(Duration::from_secs(10));
}

/// What CMD of an earlier run left at the `--report` path in its workspace: a FIFO made exec
/// (root) wait in the open for a reader before CMD ever started (killed by the harness's
/// timeout); a hard link (where `fs.protected_hardlinks` is off) would have had exec write its
/// report over the linked file. Both are refused at once, before CMD starts, as for the
/// canary's file.
#[test]
fn a_fifo_at_the_report_path_is_refused_not_waited_on() {
    use crate::common::exec::*;

    let w = World::new();
    let policy = setup(&w);
    let work = w.dir().join("work");
    cmds_workspace(&work);
    let report = work.join("report.json");
    nix::unistd::mkfifo(&report, nix::sys::stat::Mode::from_bits_truncate(0o666)).expect("mkfifo");
    std::os::unix::fs::chown(&report, Some(NOBODY), Some(NOBODY)).expect("chown the FIFO");
    let started = std::time::Instant::now();
    let out = exec_in(
        &w,
        &work,
        &policy,
        &["--user", "nobody", "--report", path_arg(&report)],
        "echo ran",
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "exec waited on the FIFO: {}",
        show(&out)
    );
    assert_eq!(out.status.code(), Some(125), "{}", show(&out));
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("ran"),
        "CMD ran: {}",
        show(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the report"),
        "{}",
        show(&out)
    );
}

/// The same burst inside `exec`: its summary and `--report` counted the refused packets the
/// table logged, so CMD's decoys spent the log rate and its next refusals were neither listed
/// nor counted ("a burst may be counted short"). exec now reads the table's counters at the
/// end and says how many refused packets went unlogged.
#[test]
fn a_burst_of_refusals_inside_exec_is_counted_whole() {
    use crate::common::exec::*;

    let w = World::new();
    setup(&w);
    let policy = w.write_file(
        "exec-rate.yaml",
        &policy_text().replace("  rate: 1000/second\n  burst: 1000\n", ""),
    );
    let report = w.dir().join("report.json");
    let flood = format!(
        "python3 -c \"\nimport socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         for i in range({DECOYS}):\n    try: s.sendto(b'decoy', ('{OTHER_V4}', 9))\n    \
         except OSError: pass\ntry: s.sendto(b'x', ('{OTHER2_V4}', {HIDDEN_PORT}))\n\
         except OSError: pass\n\""
    );
    let out = exec(
        &w,
        path_arg(&policy),
        &["--user", "nobody", "--report", path_arg(&report)],
        &flood,
    );
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("the report")).expect("JSON");
    let logged = json["refused"]["connections"].as_u64().expect("a count");
    let unlogged = json["refused"]["unlogged_connections"].as_u64();
    assert_eq!(
        logged + unlogged.unwrap_or(0),
        SENT,
        "the report accounts for {logged} logged and {unlogged:?} unlogged refusals of \
         {SENT}: {json}\n{}",
        show(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("refused {SENT} packet(s)")),
        "{}",
        show(&out)
    );
}

/// The same squat by root without CAP_NET_ADMIN (and without CAP_NET_RAW) in a listed cgroup:
/// a container fenced by its cgroup, whose root may bind port 53 whatever
/// `ip_unprivileged_port_start` says. Its socket is the cgroup's, and what it sends from the
/// stub's address is refused as every scoped socket's is: the service's lookup fails closed.
#[test]
fn a_squatter_in_a_fenced_cgroup_on_the_hosts_stub_answers_nobody() {
    let w = World::new();
    let stub: std::net::IpAddr = "127.0.0.53".parse().expect("an address");
    w.set_sandbox_nameserver(stub);
    let _listener = w.listen_tcp(OTHER_V4, 443);
    let mut cgroups = TestCgroups::new();
    let fenced = cgroups.make("fenced");
    let policy = w.write_file(
        "cgroup-resolve.yaml",
        &format!(
            "version: 1\nscope:\n  cgroups: [{}]\nallow:\n  - domain: api.example.test\n    \
             ports: [443]\nlog:\n  group: 100\n",
            cgroups.policy_path("fenced")
        ),
    );
    let mut resolver = w.spawn_in_sandbox(&[
        PYTHON,
        "-c",
        SQUAT_DNS_PY,
        "127.0.0.53",
        &HOST_V4.to_string(),
    ]);
    assert!(
        resolver.wait_for_output("bound", Duration::from_secs(10)),
        "{}",
        resolver.stderr()
    );
    let root = Adversary::RootWithoutNetAdminOrNetRaw;
    let other = OTHER_V4.to_string();
    let squat = root.command(&[PYTHON, "-c", SQUAT_DNS_PY, "127.0.0.53", &other]);
    let mut squatter = w.spawn_net_only_in_cgroup(
        &fenced,
        &squat.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    assert!(
        squatter.wait_for_output("bound", Duration::from_secs(10)),
        "{}",
        squatter.stderr()
    );
    let mut daemon = running_fence(&w, &policy);
    std::thread::sleep(Duration::from_secs(3));
    let connect = format!("exec 3<>/dev/tcp/{OTHER_V4}/443");
    let attempt = root.command(&["bash", "-c", &connect]);
    let out = w.sandbox_net_only_cmd_in_cgroup(
        &fenced,
        &attempt.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    stop_fence(&mut daemon);
    assert!(
        !out.success() && !daemon.stderr().contains(&format!("added={OTHER_V4}")),
        "the squatter in the fenced cgroup chose api.example.test's address ({OTHER_V4}):\n{}",
        daemon.stderr()
    );
}

/// The same squat with a scope (the README's way: fence the agent, not the host), where the
/// host's stub is not fenced and answers the service: the agent (uid 1001, where
/// `ip_unprivileged_port_start` lets it bind port 53, as in a container by Docker's default)
/// binds the stub's address and port with SO_REUSEADDR and answers the service's questions.
/// What the scope's sockets send from a loopback resolver's address and port 53 is now
/// refused: the squatter's answer never reaches the service, whose lookup fails closed.
#[test]
fn a_fenced_squatter_on_the_hosts_stub_answers_nobody() {
    let w = World::new();
    let stub: std::net::IpAddr = "127.0.0.53".parse().expect("an address");
    w.set_sandbox_nameserver(stub);
    let _listener = squat_target_with_low_ports_open(&w);
    let policy = w.write_file(
        "scoped-resolve.yaml",
        &format!(
            "version: 1\nscope:\n  users: [{AGENT}]\nallow:\n  - domain: api.example.test\n    \
             ports: [443]\nlog:\n  group: 100\n"
        ),
    );
    let _resolvers = host_resolver_and_agents_squatter(&w, "127.0.0.53");
    let mut daemon = running_fence(&w, &policy);
    let out = agent_tries_the_squatted_address(&w);
    stop_fence(&mut daemon);
    assert!(
        !out.success() && !daemon.stderr().contains(&format!("added={OTHER_V4}")),
        "the fenced squatter's answer for api.example.test opened {OTHER_V4}:443:\n{}",
        daemon.stderr()
    );
}
