//! A scope holds (issue 11): in one namespace world, the listed users, groups and cgroups and
//! what a listed bridge forwards are fenced, and everyone else passes untouched. Tables are put
//! up by [`put_up`] the way [`SCOPE_LOAD`] says (the plan text through `nft -f`, or `apply`).

mod common;

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;

/// The allowed port on [`HOST_V4`]; [`OTHER_V4`] listens on it too but is not allowed.
const PORT: u16 = 443;

/// A scoped user (1001) and group (2000); only HOST_V4:443 is allowed to them.
const USERS_POLICY: &str = r#"
version: 1
action: reject
scope:
  users: [1001]
  groups: [2000]
allow:
  - cidr: 192.0.2.10/32          # HOST_V4; OTHER_V4 is not allowed
    ports: [443]
  - cidr: 2001:db8:1::10/128     # HOST_V6; OTHER_V6 is not allowed
    ports: [443]
deny:
  - preset: cloud-metadata
dns:
  resolvers: [192.0.2.53]
"#;

const SCOPED_UID: u32 = 1001;
const OTHER_UID: u32 = 1002;
const UNLISTED_UID: u32 = 1003;
const SCOPED_GID: u32 = 2000;
const OTHER_GID: u32 = 3000;

/// Listeners on the allowed and the refused host.
fn listeners(w: &World) -> (Listener, Listener) {
    (w.listen_tcp(HOST_V4, PORT), w.listen_tcp(OTHER_V4, PORT))
}

/// A connection that got through.
fn assert_passes(out: &CmdOutput, what: &str) {
    assert!(out.success(), "{what} should pass: {out}");
}

/// A connection refused by the fence: it failed at once (REJECT, not a timeout).
fn assert_refused(out: &CmdOutput, took: Duration, what: &str) {
    assert!(!out.success(), "{what} should be refused: {out}");
    assert!(
        took < Duration::from_millis(1900),
        "{what} was refused by a timeout ({took:?}), not at once: {out}"
    );
}

/// Runs `f`, with how long it took.
fn timed(f: impl FnOnce() -> CmdOutput) -> (CmdOutput, Duration) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed())
}

fn ids(uid: u32, gid: u32, groups: &[u32]) -> Vec<String> {
    as_ids(uid, gid, groups)
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn a_scoped_user_is_fenced_and_another_user_and_root_pass() {
    let w = World::new();
    let (allowed, refused) = listeners(&w);
    let policy = w.write_file("scope.yaml", USERS_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);

    let scoped = ids(SCOPED_UID, SCOPED_UID, &[]);
    assert_passes(
        &w.tcp_connect_with(&strs(&scoped), HOST_V4, PORT),
        "uid 1001 to the allowed host",
    );
    let (out, took) = timed(|| w.tcp_connect_with(&strs(&scoped), OTHER_V4, PORT));
    assert_refused(&out, took, "uid 1001 to a host the policy does not allow");
    assert_eq!(refused.count(), 0, "uid 1001 reached the refused host");

    let other = ids(OTHER_UID, OTHER_UID, &[]);
    for (prefix, who) in [(strs(&other), "uid 1002"), (Vec::new(), "root")] {
        assert_passes(
            &w.tcp_connect_with(&prefix, HOST_V4, PORT),
            &format!("{who} to the allowed host"),
        );
        assert_passes(
            &w.tcp_connect_with(&prefix, OTHER_V4, PORT),
            &format!("{who} (not in the scope) to the other host"),
        );
    }
    // The listener records a connection on its own thread, a moment after the client saw it.
    refused.wait_for(2, Duration::from_secs(5));
    assert_eq!(
        refused.count(),
        2,
        "uid 1002 and root reached the other host"
    );
    assert!(
        allowed.wait_for(3, Duration::from_secs(2)),
        "allowed: {} connections, 3 expected",
        allowed.count()
    );
    assert_eq!(allowed.count(), 3);

    let (_allowed6, refused6) = (w.listen_tcp(HOST_V6, PORT), w.listen_tcp(OTHER_V6, PORT));
    assert_passes(
        &w.tcp_connect_with(&strs(&scoped), HOST_V6, PORT),
        "uid 1001 to the allowed host over IPv6",
    );
    let (out, took) = timed(|| w.tcp_connect_with(&strs(&scoped), OTHER_V6, PORT));
    assert_refused(&out, took, "uid 1001 to a host not allowed, over IPv6");
    assert_passes(
        &w.tcp_connect_with(&strs(&other), OTHER_V6, PORT),
        "uid 1002 to the other host over IPv6",
    );
    assert!(
        refused6.wait_for(1, Duration::from_secs(2)),
        "refused6: {} connections, 1 expected",
        refused6.count()
    );
    assert_eq!(refused6.count(), 1);
}

#[test]
fn a_process_of_a_listed_primary_group_is_fenced() {
    let w = World::new();
    let (_allowed, refused) = listeners(&w);
    let policy = w.write_file("scope.yaml", USERS_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);

    let in_group = ids(UNLISTED_UID, SCOPED_GID, &[]);
    assert_passes(
        &w.tcp_connect_with(&strs(&in_group), HOST_V4, PORT),
        "gid 2000 to the allowed host",
    );
    let (out, took) = timed(|| w.tcp_connect_with(&strs(&in_group), OTHER_V4, PORT));
    assert_refused(&out, took, "gid 2000 (primary) to a host not allowed");

    let elsewhere = ids(UNLISTED_UID, OTHER_GID, &[]);
    assert_passes(
        &w.tcp_connect_with(&strs(&elsewhere), OTHER_V4, PORT),
        "uid 1003 in group 3000 (neither listed)",
    );
    assert!(
        refused.wait_for(1, Duration::from_secs(2)),
        "refused: {} connections, 1 expected",
        refused.count()
    );
    assert_eq!(refused.count(), 1);
}

#[test]
fn a_member_of_a_listed_group_stays_fenced_after_switching_its_primary_group() {
    let account = TestAccount::member_of_new_group();
    let w = World::new();
    let (_allowed, refused) = listeners(&w);
    let policy = w.write_file(
        "scope.yaml",
        &format!(
            r#"
version: 1
action: reject
scope:
  groups: [{group}]
allow:
  - cidr: 192.0.2.10/32
    ports: [443]
dns:
  resolvers: [192.0.2.53]
"#,
            group = account.name
        ),
    );
    put_up(&w, &policy, SCOPE_LOAD);

    // The member's uid is fenced, whatever its process's groups are now.
    for (gid, groups) in [
        (OTHER_GID, vec![account.gid]),
        (OTHER_GID, Vec::new()),
        (account.gid, Vec::new()),
    ] {
        let who = ids(account.uid, gid, &groups);
        let what = format!("member uid {} as gid {gid} groups {groups:?}", account.uid);
        assert_passes(&w.tcp_connect_with(&strs(&who), HOST_V4, PORT), &what);
        let (out, took) = timed(|| w.tcp_connect_with(&strs(&who), OTHER_V4, PORT));
        assert_refused(&out, took, &what);
    }
    assert_eq!(refused.count(), 0);
    // Not the whole namespace: root and a user outside the group still pass.
    let outsider = ids(UNLISTED_UID, OTHER_GID, &[account.gid + 1]);
    for prefix in [Vec::new(), strs(&outsider)] {
        assert_passes(
            &w.tcp_connect_with(&prefix, OTHER_V4, PORT),
            "a process outside the scope",
        );
    }
    assert!(
        refused.wait_for(2, Duration::from_secs(2)),
        "refused: {} connections, 2 expected",
        refused.count()
    );
    assert_eq!(refused.count(), 2);
}

fn cgroup_policy(w: &World, cgroups: &TestCgroups) -> PathBuf {
    w.write_file(
        "scope.yaml",
        &format!(
            r#"
version: 1
action: reject
scope:
  cgroups: ["{fenced}"]
allow:
  - cidr: 192.0.2.10/32
    ports: [443]
dns:
  resolvers: [192.0.2.53]
"#,
            fenced = cgroups.policy_path("fenced")
        ),
    )
}

fn nc(host: IpAddr) -> Vec<String> {
    [
        "nc",
        "-z",
        "-v",
        "-w",
        "2",
        &host.to_string(),
        &PORT.to_string(),
    ]
    .map(String::from)
    .to_vec()
}

#[test]
fn a_scoped_cgroup_is_fenced_its_sibling_passes_and_a_later_child_is_fenced_at_once() {
    let mut cgroups = TestCgroups::new();
    let fenced = cgroups.make("fenced");
    let sibling = cgroups.make("sibling");
    let w = World::new();
    let (_allowed, refused) = listeners(&w);
    let policy = cgroup_policy(&w, &cgroups);
    put_up(&w, &policy, SCOPE_LOAD);

    assert_passes(
        &w.sandbox_cmd_in_cgroup(&fenced, &strs(&nc(HOST_V4))),
        "the fenced cgroup to the allowed host",
    );
    let (out, took) = timed(|| w.sandbox_cmd_in_cgroup(&fenced, &strs(&nc(OTHER_V4))));
    assert_refused(&out, took, "the fenced cgroup to a host not allowed");
    assert_passes(
        &w.sandbox_cmd_in_cgroup(&sibling, &strs(&nc(OTHER_V4))),
        "the sibling cgroup to the other host",
    );
    assert_eq!(
        refused.count(),
        1,
        "only the sibling reached the other host"
    );

    // Made after the table went up: fenced from its first packet (the kernel matches the
    // ancestor at the listed level, not a list of cgroups known at apply).
    let late = cgroups.make("fenced/late");
    let (out, took) = timed(|| w.sandbox_cmd_in_cgroup(&late, &strs(&nc(OTHER_V4))));
    assert_refused(
        &out,
        took,
        "a cgroup made below the fenced one after the apply",
    );
    assert!(
        refused.wait_for(1, Duration::from_secs(2)),
        "refused: {} connections, 1 expected",
        refused.count()
    );
    assert_eq!(refused.count(), 1);
}

/// The container may reach api.example.com (HOST_V4) on 443 only.
const BRIDGE_POLICY: &str = r#"
version: 1
action: reject
scope:
  forward: [efbr0]
allow:
  - domain: api.example.com
    ports: [443]
deny:
  - preset: cloud-metadata
dns:
  resolvers: [192.0.2.53]
"#;

/// A TCP listener on `addr` in the sandbox (the container host's own service); the kernel
/// completes handshakes without an accept.
fn host_service(w: &World, addr: SocketAddr) -> TcpListener {
    w.in_sandbox_ns(|| TcpListener::bind(addr))
        .unwrap_or_else(|e| panic!("listen on {addr} in the sandbox: {e}"))
}

#[test]
fn a_bridged_container_is_fenced_and_the_host_is_not() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    let container = BridgedContainer::new(&w);
    let (allowed, refused) = listeners(&w);
    let http = w.listen_tcp(HOST_V4, 80);
    let metadata = w.listen_tcp(METADATA_V4, 80);
    let _on_bridge = host_service(&w, SocketAddr::new(BRIDGE_V4, 22));
    let _on_uplink = host_service(&w, SocketAddr::new(SANDBOX_V4, 22));
    // Before the table: the container reaches all of it (the test's network works).
    assert_passes(
        &container.tcp_connect(OTHER_V4, PORT),
        "container, no table",
    );
    assert_passes(&container.tcp_connect(BRIDGE_V4, 22), "container, no table");
    assert!(refused.wait_for(1, Duration::from_secs(5)));
    let policy = w.write_file("scope.yaml", BRIDGE_POLICY);
    put_up(&w, &policy, SCOPE_LOAD);

    assert_passes(
        &container.tcp_connect(HOST_V4, PORT),
        "the container to api.example.com:443",
    );
    assert!(allowed.wait_for(1, Duration::from_secs(2)));
    assert_eq!(
        allowed.peers(),
        vec![SANDBOX_V4],
        "masqueraded by the container host"
    );
    let before = refused.count();
    for (host, port, what) in [
        (OTHER_V4, PORT, "a host the policy does not name"),
        (HOST_V4, 80, "the allowed host on another port"),
        (METADATA_V4, 80, "the metadata service"),
        (BRIDGE_V4, 22, "the host's bridge address on another port"),
        (SANDBOX_V4, 22, "the host's uplink address"),
    ] {
        let (out, took) = timed(|| container.tcp_connect(host, port));
        assert_refused(&out, took, &format!("the container to {what}"));
    }
    assert_eq!(refused.count(), before, "the container reached OTHER_V4");
    assert_eq!(http.count(), 0);
    assert_eq!(metadata.count(), 0);

    // The container host itself is not in the scope.
    for (host, port) in [
        (OTHER_V4, PORT),
        (HOST_V4, 80),
        (METADATA_V4, 80),
        (BRIDGE_V4, 22),
    ] {
        assert_passes(
            &w.tcp_connect_with(&[], host, port),
            &format!("the host itself to {host}:{port}"),
        );
    }
}

const BRIDGE_GUARD_POLICY: &str = r#"
version: 1
action: reject
scope:
  forward: [efbr0]
allow:
  - domain: api.example.com
    ports: [443]
dns:
  mode: guard
  upstream: [192.0.2.53]
"#;

#[test]
fn the_guard_answers_a_bridged_container_on_the_bridge_address() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    w.dns_set("elsewhere.example.com", &[OTHER_V4], DEFAULT_DNS_TTL);
    let container = BridgedContainer::new(&w);
    let (allowed, refused) = listeners(&w);
    let policy = w.write_file("scope.yaml", BRIDGE_GUARD_POLICY);
    let _guard = w.spawn_guard(path_arg(&policy));

    let answer = container.dig(BRIDGE_V4, "api.example.com");
    assert!(
        answer.success() && answer.stdout.contains(&HOST_V4.to_string()),
        "the guard on the bridge address answers an allowed name: {answer}"
    );
    assert_passes(
        &container.tcp_connect(HOST_V4, PORT),
        "the container to the name the guard answered",
    );
    assert!(
        allowed.wait_for(1, Duration::from_secs(2)),
        "allowed: {} connections, 1 expected",
        allowed.count()
    );
    assert_eq!(allowed.count(), 1);

    let outside = container.dig(BRIDGE_V4, "elsewhere.example.com");
    assert!(
        !outside.stdout.contains(&OTHER_V4.to_string()),
        "the guard answered a name outside the policy: {outside}"
    );
    let direct = container.dig(DNS_V4, "api.example.com");
    assert!(
        !direct.stdout.contains("status: NOERROR"),
        "the container asked the upstream resolver past the guard: {direct}"
    );
    let (out, took) = timed(|| container.tcp_connect(OTHER_V4, PORT));
    assert_refused(
        &out,
        took,
        "the container to a name the guard did not answer",
    );
    assert_eq!(refused.count(), 0);
}

/// A UDP socket on `addr` in the sandbox, standing in for a service of the container host.
fn host_udp_service(w: &World, addr: SocketAddr) -> std::net::UdpSocket {
    let socket = w
        .in_sandbox_ns(|| std::net::UdpSocket::bind(addr))
        .unwrap_or_else(|e| panic!("bind {addr} in the sandbox: {e}"));
    socket
        .set_read_timeout(Some(Duration::from_millis(500)))
        .expect("a read timeout");
    socket
}

/// Whether a datagram arrived at `socket` within its read timeout.
fn got_datagram(socket: &std::net::UdpSocket) -> bool {
    let mut buf = [0u8; 512];
    socket.recv_from(&mut buf).is_ok()
}

#[test]
fn in_guard_mode_a_container_may_ask_only_the_guards_bridge_address() {
    let w = World::new();
    let container = BridgedContainer::new(&w);
    // Where the guard listens for the container (planned from the sandbox's interfaces);
    // the guard itself needs `run`, so a socket with the guard's mark stands in for it here
    // (the table gives questions to the guard's address to the guard's sockets alone).
    let guard = host_udp_service(&w, SocketAddr::new(BRIDGE_V4, 53));
    nix::sys::socket::setsockopt(
        &guard,
        nix::sys::socket::sockopt::Mark,
        &egress_fence::core::policy::DEFAULT_GUARD_MARK,
    )
    .expect("the guard's mark on the stand-in");
    let other_port = host_udp_service(&w, SocketAddr::new(BRIDGE_V4, 5353));
    let policy = w.write_file("scope.yaml", BRIDGE_GUARD_POLICY);
    let plan = w.egress_fence(&["plan", path_arg(&policy)]);
    assert!(
        plan.stdout
            .contains("ip daddr 198.18.0.1 udp dport 53 accept"),
        "the plan lets the container ask the guard on the bridge address: {plan}"
    );
    put_up(&w, &policy, SCOPE_LOAD);

    let send = |to: IpAddr, port: u16| {
        let script = format!("echo -n question > /dev/udp/{to}/{port}");
        container.cmd(&["bash", "-c", &script])
    };
    let asked = send(BRIDGE_V4, 53);
    assert!(asked.success(), "{asked}");
    assert!(got_datagram(&guard), "the container cannot ask the guard");
    let _ = send(BRIDGE_V4, 5353);
    assert!(
        !got_datagram(&other_port),
        "the container reached 198.18.0.1:5353"
    );

    let upstream = container.dig(DNS_V4, "api.example.com");
    assert!(
        !upstream.stdout.contains("status:"),
        "the container asked the upstream resolver past the guard: {upstream}"
    );
}

/// A container's refusal is logged with its own address (the forward path sees it before the
/// host masquerades it), and `watch` names the bridge it came from.
#[test]
fn a_containers_refusal_is_logged_with_its_address_and_bridge() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    let container = BridgedContainer::new(&w);
    let policy = w.write_file(
        "scope.yaml",
        &format!("{BRIDGE_POLICY}log:\n  group: 100\n"),
    );
    put_up(&w, &policy, SCOPE_LOAD);

    let mut watch = w.spawn_egress_fence(&["watch", "--json", "--count", "1"]);
    assert!(
        watch.wait_for_output("watching NFLOG group 100", Duration::from_secs(5)),
        "{}",
        watch.stderr()
    );
    let (out, took) = timed(|| container.tcp_connect(OTHER_V4, PORT));
    assert_refused(
        &out,
        took,
        "the container to a host the policy does not name",
    );
    assert!(
        watch.wait_timeout(Duration::from_secs(5)).is_some(),
        "watch did not exit after 1 event: {}",
        watch.stderr()
    );
    let events: Vec<serde_json::Value> = watch
        .stdout()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(events.len(), 1, "{}", watch.stdout());
    let event = &events[0];
    assert_eq!(event["src"], CONTAINER_V4.to_string(), "{event}");
    assert_eq!(event["dst"], OTHER_V4.to_string(), "{event}");
    assert_eq!(
        event["scope"],
        serde_json::json!({"from": BRIDGE, "src": CONTAINER_V4.to_string()}),
        "{event}"
    );
}

/// Docker's embedded DNS (127.0.0.11 inside a container on a user-defined network) forwards
/// from the container's own namespace: its questions meet the forward path like the
/// container's, so it reaches the upstream resolver no more than the container does, and
/// pointed at the guard (`--dns <bridge address>`) it answers what the guard answers. A
/// dnsmasq on 127.0.0.11 in the container stands in for it.
#[test]
fn dockers_embedded_dns_is_no_way_around_the_guard() {
    let w = World::new();
    w.dns_set("api.example.com", &[HOST_V4], DEFAULT_DNS_TTL);
    w.dns_set("elsewhere.example.com", &[OTHER_V4], DEFAULT_DNS_TTL);
    let container = BridgedContainer::new(&w);
    let policy = w.write_file("scope.yaml", BRIDGE_GUARD_POLICY);
    let _guard = w.spawn_guard(path_arg(&policy));
    let embedded: IpAddr = "127.0.0.11".parse().expect("an address");
    let lo = container.cmd(&["ip", "addr", "add", "127.0.0.11/32", "dev", "lo"]);
    assert!(lo.success(), "{lo}");
    let forwarder = |upstream: IpAddr| {
        let server = format!("--server={upstream}");
        let mut child = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                container.name(),
                "dnsmasq",
                "-k",
                "--user=root",
            ])
            .args([
                "--no-resolv",
                "--no-hosts",
                "--cache-size=0",
                "--bind-interfaces",
            ])
            .args(["--listen-address=127.0.0.11", "--pid-file=", &server])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("dnsmasq starts");
        let up = within(Duration::from_secs(5), || {
            let listening = container.cmd(&["ss", "-H", "-lun", "src", "127.0.0.11:53"]);
            !listening.stdout.trim().is_empty()
        });
        if !up {
            let _ = child.kill();
            panic!("the stand-in for Docker's embedded DNS does not answer");
        }
        child
    };

    // Forwarding to the upstream resolver, as Docker does with the host's resolvers.
    let mut to_upstream = forwarder(DNS_V4);
    for name in ["api.example.com", "elsewhere.example.com"] {
        let out = container.dig(embedded, name);
        assert!(
            !out.stdout.contains("status: NOERROR"),
            "127.0.0.11 got an answer for {name} from the upstream resolver: {out}"
        );
    }
    let _ = to_upstream.kill();
    let _ = to_upstream.wait();

    // Forwarding to the guard on the bridge address: what the guard answers, and only that.
    let mut to_guard = forwarder(BRIDGE_V4);
    let allowed = container.dig(embedded, "api.example.com");
    assert!(
        allowed.stdout.contains(&HOST_V4.to_string()),
        "127.0.0.11 through the guard: {allowed}"
    );
    let outside = container.dig(embedded, "elsewhere.example.com");
    assert!(
        !outside.stdout.contains(&OTHER_V4.to_string()),
        "127.0.0.11 answered a name outside the policy: {outside}"
    );
    let _ = to_guard.kill();
    let _ = to_guard.wait();
}
