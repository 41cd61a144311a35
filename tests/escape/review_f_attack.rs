//! The hostile review of red team F's merge and the session's last commits: `exec --report`
//! written where CMD's user may write, and the scope's refusal of a squatter on the host's
//! resolver.

use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::common::*;
use crate::operator_attack::{
    AGENT, agent_asks_the_guard_and_tries_the_squatted_address, agent_tries_the_squatted_address,
    host_resolver_and_agents_squatter, running_fence, squat_target_with_low_ports_open, stop_fence,
};

/// `exec --report FILE` with FILE relative (`--report report.json` in the CI job's
/// workspace, exec started there). exec holds the report's directory and at the end checks
/// that FILE still leads to it; but a relative FILE is walked again from exec's working
/// directory, which is the directory itself wherever it went. CMD moves the workspace away
/// and leaves a fresh one of the same name with its forgery: exec wrote its report into the
/// moved directory, exited as if all was well, and the report at FILE (as the caller named
/// it) said the tripped canary had not tripped.
#[test]
fn a_relative_report_path_follows_no_move_of_the_working_directory() {
    use crate::common::exec::*;

    let w = World::new();
    let policy = setup(&w);
    let top = w.dir().join("workspace");
    let work = top.join("work");
    for dir in [&top, &work] {
        cmds_workspace(dir);
    }
    let forge = "host=${CANARY_WEBHOOK_URL#https://}; host=${host%%/*}; \
                 dig +time=1 +tries=1 \"$host\" >/dev/null; \
                 cd .. && mv work work.old && mkdir work && \
                 printf '{\"exit_code\": 0, \"exec_exit_code\": 0, \"canary_tripped\": false, \
                 \"refused\": {\"connections\": 0, \"queries\": 0}}\\n' > work/report.json && \
                 echo forged";
    let out = exec_in(
        &w,
        &work,
        &policy,
        &["--user", "nobody", "--canary", "--report", "report.json"],
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
    let said_not_there = String::from_utf8_lossy(&out.stderr).contains("the report is not at");
    let text = std::fs::read_to_string(work.join("report.json")).expect("a report at the path");
    let json: Value = serde_json::from_str(&text).expect("JSON");
    assert!(
        said_not_there || json["canary_tripped"] == true,
        "the report at the path the caller named is CMD's forgery, and exec did not say so: \
         {json}\n{}",
        show(&out)
    );
}

/// F's squat with the host's resolver on an address of the host that is not loopback (a
/// dnsmasq, unbound or BIND listening on the host's LAN address, which resolv.conf names):
/// the service's lookups go there over loopback all the same, and the agent (uid 1001, which
/// may bind port 53) binds that address and port with SO_REUSEADDR and answers them. The
/// scope's refusal of answers from a resolver's address covered loopback resolvers alone: the
/// squatter's answer was a reply of the service's own flow and was accepted, and the allowed
/// name pointed where the agent chose.
#[test]
fn a_fenced_squatter_on_a_resolver_at_a_host_address_answers_nobody() {
    let w = World::new();
    w.set_sandbox_nameserver(SANDBOX_V4);
    let _listener = squat_target_with_low_ports_open(&w);
    let policy = w.write_file(
        "scoped-resolve.yaml",
        &format!(
            "version: 1\nscope:\n  users: [{AGENT}]\nallow:\n  - domain: api.example.test\n    \
             ports: [443]\nlog:\n  group: 100\n"
        ),
    );
    let _resolvers = host_resolver_and_agents_squatter(&w, &SANDBOX_V4.to_string());
    let mut daemon = running_fence(&w, &policy);
    let out = agent_tries_the_squatted_address(&w);
    stop_fence(&mut daemon);
    assert!(
        !out.success() && !daemon.stderr().contains(&format!("added={OTHER_V4}")),
        "the fenced squatter's answer for api.example.test opened {OTHER_V4}:443:\n{}",
        daemon.stderr()
    );
}

/// `watch` reads the table's refused counters only once its packet reader has found the socket
/// empty since the last reading, and the reader noted "empty" only when a wait of 50 ms timed
/// out. Where the operator raised `log.rate` past 20/second, a sandbox that keeps one logged
/// refusal within every 50 ms (a steady trickle of decoys, well within the rate) never lets a
/// wait time out: `watch` took no reading after the first, and the burst it sent meanwhile
/// (the one that matters among it) went unlogged and was never said, for as long as the
/// trickle ran.
#[test]
fn a_steady_trickle_of_logged_decoys_does_not_silence_the_unlogged_count() {
    let w = World::new();
    let policy = w.write_file(
        "policy.yaml",
        "version: 1\ndns:\n  resolvers: [192.0.2.53]\nlog:\n  group: 100\n  rate: 100/second\n  \
         burst: 5\n",
    );
    let applied = w.egress_fence(&["apply", path_arg(&policy)]);
    assert!(applied.success(), "{applied}");
    let mut watch = w.spawn_egress_fence(&["watch", "--json"]);
    assert!(watch.wait_for_output("watching NFLOG group 100", Duration::from_secs(5)));
    // Let the first reading be taken before the sandbox starts.
    std::thread::sleep(Duration::from_millis(1500));
    // A decoy every 20 ms (50/second, all within the rate) for 30 s; after 1 s, a burst of
    // 500 and the one that matters, most of them over the rate.
    let trickle = format!(
        "import socket, time\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         def send(addr):\n\
         \x20   try:\n\
         \x20       s.sendto(b'x', addr)\n\
         \x20   except OSError:\n\
         \x20       pass\n\
         start = time.monotonic()\n\
         burst = False\n\
         print('trickling', flush=True)\n\
         while time.monotonic() - start < 30:\n\
         \x20   send(('{OTHER_V4}', 9))\n\
         \x20   if not burst and time.monotonic() - start > 1:\n\
         \x20       burst = True\n\
         \x20       for i in range(500):\n\
         \x20           send(('{OTHER_V4}', 9))\n\
         \x20       send(('{OTHER2_V4}', 4444))\n\
         \x20       print('burst', flush=True)\n\
         \x20   time.sleep(0.02)\n"
    );
    let mut sandbox = w.spawn_adversary(Adversary::Nobody, &[PYTHON, "-c", &trickle]);
    assert!(
        sandbox.wait_for_output("burst", Duration::from_secs(10)),
        "{}",
        sandbox.stderr()
    );
    let unshown = |w: &Background| -> u64 {
        w.stdout()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["verdict"] == "unlogged")
            .filter_map(|e| e["packets"].as_u64())
            .sum()
    };
    // The burst is said within a few readings, while the trickle goes on.
    let said = within(Duration::from_secs(10), || unshown(&watch) >= 400);
    let total = unshown(&watch);
    drop(sandbox);
    watch.signal(Signal::SIGTERM);
    let _ = watch.wait_timeout(Duration::from_secs(5));
    assert!(
        said,
        "a burst of 501 refusals over the rate went unsaid while the trickle ran: watch said \
         {total} went unshown\n{}",
        watch.stderr()
    );
}

/// Guard mode with a scope (the README's way), the guard's upstream a resolver on an address
/// of the host (a dnsmasq or BIND on its LAN address, unfenced since the scope leaves the host
/// alone): the guard's questions reach it over loopback, and the agent (uid 1001, which may
/// bind port 53) shares its address and port with SO_REUSEADDR and gets them. The guard's
/// protections refuse the agent's packets to the upstream, not its answers from the
/// upstream's address (a reply of the guard's own flow, accepted as established), and the
/// scope's refusal of answers from a resolver's address was resolve mode's alone: the guard
/// installed the agent's address for the allowed name.
#[test]
fn a_fenced_squatter_on_the_guards_upstream_at_a_host_address_answers_nobody() {
    let w = World::new();
    let _listener = squat_target_with_low_ports_open(&w);
    let upstream = SANDBOX_V4.to_string();
    let policy = w.write_file(
        "scoped-guard.yaml",
        &format!(
            "version: 1\nscope:\n  users: [{AGENT}]\nallow:\n  - domain: api.example.test\n    \
             ports: [443]\ndns:\n  mode: guard\n  upstream: [{upstream}]\nlog:\n  group: 100\n"
        ),
    );
    let _resolvers = host_resolver_and_agents_squatter(&w, &upstream);
    let mut daemon = running_fence(&w, &policy);
    let out = agent_asks_the_guard_and_tries_the_squatted_address(&w);
    stop_fence(&mut daemon);
    assert!(
        !out.stdout.contains("connected"),
        "the fenced squatter's answer for api.example.test opened {OTHER_V4}:443:\n{out}\n{}",
        daemon.stderr()
    );
}

/// `watch` tells a table applied anew (a reload, a heal, `apply`) by its refused counter going
/// down. A new table whose counter has passed the old one's last reading by the next reading
/// (a burst in its first second, after an old table that had counted little) was taken for
/// the old one: what the old one counted was taken off what the new one did not log, and that
/// many refusals went unsaid.
#[test]
fn a_table_applied_anew_is_not_taken_for_the_old_one() {
    use crate::operator_attack::{SENT, events, flood_then_hide, logging_policy};
    let w = World::new();
    let policy = logging_policy(&w);
    let applied = w.egress_fence(&["apply", path_arg(&policy)]);
    assert!(applied.success(), "{applied}");
    let mut watch = w.spawn_egress_fence(&["watch", "--json"]);
    assert!(watch.wait_for_output("watching NFLOG group 100", Duration::from_secs(5)));
    let shown = |w: &Background| {
        let events = events(&w.stdout());
        let logged = events.iter().filter(|e| e["verdict"] == "refused").count() as u64;
        let unshown: u64 = events
            .iter()
            .filter(|e| e["verdict"] == "unlogged")
            .filter_map(|e| e["packets"].as_u64())
            .sum();
        logged + unshown
    };
    flood_then_hide(&w);
    let first = within(Duration::from_secs(10), || shown(&watch) >= SENT);
    assert!(first, "{}", watch.stdout());
    // Another table, made anew (its counter starts at 0), and a burst at once.
    let other = w.write_file(
        "policy2.yaml",
        "version: 1\ndns:\n  resolvers: [192.0.2.53, 192.0.2.54]\nlog:\n  group: 100\n",
    );
    let applied = w.egress_fence(&["apply", path_arg(&other)]);
    assert!(applied.success(), "{applied}");
    flood_then_hide(&w);
    flood_then_hide(&w);
    let all = within(Duration::from_secs(10), || shown(&watch) >= 3 * SENT);
    let total = shown(&watch);
    watch.signal(Signal::SIGTERM);
    let _ = watch.wait_timeout(Duration::from_secs(5));
    assert!(
        all,
        "the fence refused {} packets; watch accounted for {total}:\n{}",
        3 * SENT,
        watch.stdout()
    );
}

/// The same without a scope: every socket is fenced, the upstream resolver on the host's
/// address too, so the table cannot tell its answers to the guard from the squatter's (both
/// are replies of the guard's flow, from the upstream's address and port), and nothing
/// warned (`check` and `apply` warned about an upstream on loopback only; `apply` and `run`
/// now say so, see the next test). Not fixed: as for resolve mode's loopback stub, the fix is
/// a setting naming the upstream resolver's uid, whose sockets alone may answer from its
/// address.
#[test]
#[ignore = "finding: without a scope a fenced squatter on a guard upstream at a host address answers the guard; now warned; fix: a setting naming the upstream resolver's uid, whose sockets alone may answer from its address"]
fn without_a_scope_a_squatter_on_the_guards_upstream_at_a_host_address_answers_nobody() {
    let w = World::new();
    let _listener = squat_target_with_low_ports_open(&w);
    let upstream = SANDBOX_V4.to_string();
    let policy = w.write_file(
        "guard.yaml",
        &format!(
            "version: 1\nallow:\n  - domain: api.example.test\n    \
             ports: [443]\ndns:\n  mode: guard\n  upstream: [{upstream}]\nlog:\n  group: 100\n"
        ),
    );
    let _resolvers = host_resolver_and_agents_squatter(&w, &upstream);
    let mut daemon = running_fence(&w, &policy);
    let out = agent_asks_the_guard_and_tries_the_squatted_address(&w);
    stop_fence(&mut daemon);
    assert!(
        !out.stdout.contains("connected"),
        "the fenced squatter's answer for api.example.test opened {OTHER_V4}:443:\n{out}\n{}",
        daemon.stderr()
    );
}

/// What can be said of the open way above: `apply` and `run` warn when the guard's upstream
/// (or resolve mode's resolver) is an address of this host and no scope tells the fenced
/// squatter's answers from the resolver's. Before, only loopback ones were warned about.
#[test]
fn a_guard_upstream_at_a_host_address_a_fenced_process_could_squat_is_said() {
    let w = World::new();
    let policy = w.write_file(
        "guard.yaml",
        &format!(
            "version: 1\nallow:\n  - domain: api.example.test\n    ports: [443]\ndns:\n  \
             mode: guard\n  upstream: [{SANDBOX_V4}]\nlog:\n  group: 100\n"
        ),
    );
    let said = format!("upstream {SANDBOX_V4} is on loopback or an address of this host");
    let apply = w.egress_fence(&["apply", path_arg(&policy)]);
    assert!(apply.stderr.contains(&said), "{apply}");
    let mut daemon = w.spawn_egress_fence(&["run", path_arg(&policy)]);
    let warned = daemon.wait_for_output(&said, Duration::from_secs(15));
    daemon.signal(Signal::SIGTERM);
    let _ = daemon.wait_timeout(Duration::from_secs(10));
    assert!(warned, "{}", daemon.stderr());
}
