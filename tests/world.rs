//! Self-tests of the test world in `tests/common` (no egress-fence binary involved).
//! Need root; see `tests/common/mod.rs`.

mod common;

use std::net::{IpAddr, UdpSocket};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const WAIT: Duration = Duration::from_secs(3);

fn ip(s: &str) -> IpAddr {
    s.parse().expect("an IP address literal")
}

#[test]
fn setup_is_quick_and_drop_removes_everything() {
    let start = Instant::now();
    let world = World::new();
    let setup = start.elapsed();
    eprintln!("world setup took {setup:?}");
    assert!(setup < Duration::from_secs(3), "world setup took {setup:?}");

    let (sandbox, net) = (
        world.sandbox_name().to_string(),
        world.net_name().to_string(),
    );
    let etc = Path::new("/etc/netns").join(&sandbox);
    let dir = world.dir().to_path_buf();
    assert!(world.sandbox_path().exists() && world.net_path().exists());
    assert!(sandbox.len() <= 20 && net.len() <= 20, "{sandbox} {net}");
    let resolv = world.sandbox_cmd(&["cat", "/etc/resolv.conf"]);
    assert!(resolv.stdout.contains("nameserver 192.0.2.53"), "{resolv}");

    // What must be gone afterwards: the resolvers, a background process, a process leaked by
    // a test (spawned and never waited for), a listener still held by the test.
    let in_net = world.net_cmd(&["true"]);
    assert!(in_net.success(), "{in_net}");
    let pids = Command::new("ip")
        .args(["netns", "pids", &net])
        .output()
        .expect("ip netns pids");
    let pids: Vec<String> = String::from_utf8_lossy(&pids.stdout)
        .split_whitespace()
        .map(String::from)
        .collect();
    assert_eq!(pids.len(), 2, "two dnsmasq processes in {net}: {pids:?}");
    let mut background = world.spawn_in_sandbox(&["sh", "-c", "echo started; exec sleep 300"]);
    assert!(
        background.wait_for_output("started", WAIT),
        "{}",
        background.stderr()
    );
    let mut leaked = world
        .sandbox_command(&["sleep", "300"])
        .spawn()
        .expect("spawn sleep in the sandbox");
    let listener = world.listen_tcp(HOST_V4, 7000);

    drop(background);
    let start = Instant::now();
    drop(world);
    eprintln!("world teardown took {:?}", start.elapsed());

    assert!(
        !Path::new("/run/netns").join(&sandbox).exists(),
        "{sandbox} left"
    );
    assert!(!Path::new("/run/netns").join(&net).exists(), "{net} left");
    assert!(!etc.exists(), "{} left", etc.display());
    assert!(!dir.exists(), "{} left", dir.display());
    let list = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    let list = String::from_utf8_lossy(&list.stdout);
    assert!(!list.contains(&sandbox) && !list.contains(&net), "{list}");
    for pid in &pids {
        assert!(
            !Path::new("/proc").join(pid).exists(),
            "dnsmasq {pid} still runs"
        );
    }
    let status = leaked.wait().expect("reap the leaked process");
    assert!(!status.success(), "the leaked process was killed: {status}");
    let start = Instant::now();
    drop(listener);
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "listener stopped with the world"
    );
}

#[test]
fn tcp_from_sandbox_reaches_listener_with_sandbox_source() {
    let world = World::new();
    let listener = world.listen_tcp(HOST_V4, 8080);

    assert!(world.tcp_connects(HOST_V4, 8080));
    assert!(listener.wait_for(1, WAIT));
    assert_eq!(listener.peers(), vec![SANDBOX_V4]);
    assert_eq!(listener.hits()[0].local, listener.local_addr());

    let refused = world.tcp_connect(HOST_V4, 8081, 2);
    assert!(!refused.success(), "{refused}");
    assert!(refused.stderr.contains("refused"), "{refused}");
    assert!(
        !world.tcp_connects(OTHER_V4, 8080),
        "no listener on that host"
    );
    assert!(!listener.wait_for(2, Duration::from_millis(200)));
    assert_eq!(listener.count(), 1);
}

#[test]
fn udp_datagram_arrives_with_payload_and_source() {
    let world = World::new();
    let listener = world.listen_udp(OTHER_V4, 5353);

    let out = world.udp_send(OTHER_V4, 5353, b"ping 42");
    assert!(out.success(), "{out}");
    assert!(listener.wait_for(1, WAIT));
    let hit = &listener.hits()[0];
    assert_eq!(hit.data, b"ping 42");
    assert_eq!(hit.peer.ip(), SANDBOX_V4);
    assert_eq!(hit.local.port(), 5353);

    world.udp_send(OTHER_V4, 5354, b"elsewhere");
    assert!(!listener.wait_for(2, Duration::from_millis(300)));

    // The listener echoes, so a client in the sandbox gets its datagram back.
    let echo = world.in_sandbox_ns(|| {
        let socket = UdpSocket::bind("0.0.0.0:0").expect("bind a UDP socket in the sandbox");
        socket
            .set_read_timeout(Some(WAIT))
            .expect("set a read timeout");
        socket
            .send_to(b"echo", (OTHER_V4, 5353))
            .expect("send from the sandbox");
        let mut buf = [0u8; 16];
        let (n, from) = socket.recv_from(&mut buf).expect("the echo comes back");
        (buf[..n].to_vec(), from)
    });
    assert_eq!(echo, (b"echo".to_vec(), listener.local_addr()));
    assert_eq!(listener.count(), 2);
}

#[test]
fn ipv6_tcp_udp_and_dns_work() {
    let world = World::new();
    let tcp = world.listen_tcp(HOST_V6, 443);
    let udp = world.listen_udp(HOST2_V6, 9999);

    assert!(world.tcp_connects(HOST_V6, 443));
    assert!(
        world.tcp_connects("[2001:db8:1::10]", 443),
        "bracketed literal"
    );
    assert!(tcp.wait_for(2, WAIT));
    assert_eq!(tcp.peers(), vec![SANDBOX_V6, SANDBOX_V6]);

    let sent = world.udp_send(HOST2_V6, 9999, b"six");
    assert!(sent.success(), "{sent}");
    assert!(udp.wait_for(1, WAIT));
    assert_eq!(udp.hits()[0].peer.ip(), SANDBOX_V6);

    world.dns_set("six.example.test", &[HOST_V6], 60);
    let r = world.dig(Some(DNS_V6), "six.example.test", "AAAA", false);
    assert_eq!(r.status.as_deref(), Some("NOERROR"), "{}", r.output);
    assert_eq!(r.addrs(), vec![HOST_V6]);

    let http = world.listen_tcp(HOST_V6, 80);
    let body = world
        .curl("http://[2001:db8:1::10]/")
        .expect("curl over IPv6");
    assert_eq!(body, "hello from [2001:db8:1::10]:80\n");
    assert_eq!(http.peers(), vec![SANDBOX_V6]);
}

#[test]
fn dns_serves_records_with_ttl_on_both_resolvers_and_logs_queries() {
    let world = World::new();
    let name = "api.example.test";
    world.dns_set(name, &[HOST_V4, HOST2_V4, HOST_V6], 123);

    let a = world.dig(Some(DNS_V4), name, "A", false);
    assert_eq!(a.status.as_deref(), Some("NOERROR"), "{}", a.output);
    assert_eq!(a.sorted_addrs(), vec![HOST_V4, HOST2_V4]);
    assert!(a.answers.iter().all(|r| r.ttl == 123), "{:?}", a.answers);

    let aaaa = world.dig(Some(DNS_V6), name, "AAAA", true);
    assert_eq!(aaaa.addrs(), vec![HOST_V6], "{}", aaaa.output);
    assert_eq!(aaaa.answers[0].ttl, 123);

    let via_resolv_conf = world.dig(None, name, "A", false);
    assert_eq!(via_resolv_conf.sorted_addrs(), vec![HOST_V4, HOST2_V4]);

    let rogue = world.dig(Some(ROGUE_DNS_V4), name, "A", false);
    assert_eq!(
        rogue.sorted_addrs(),
        vec![HOST_V4, HOST2_V4],
        "{}",
        rogue.output
    );
    let rogue6 = world.dig(Some(ROGUE_DNS_V6), name, "AAAA", true);
    assert_eq!(rogue6.addrs(), vec![HOST_V6], "{}", rogue6.output);

    for unknown in ["nothere.example.test", "example.com", "localhost"] {
        let r = world.dig(Some(DNS_V4), unknown, "A", false);
        assert_eq!(
            r.status.as_deref(),
            Some("NXDOMAIN"),
            "{unknown}: {}",
            r.output
        );
    }
    let nodata = world.dig(Some(DNS_V4), name, "TXT", false);
    assert_eq!(
        nodata.status.as_deref(),
        Some("NOERROR"),
        "{}",
        nodata.output
    );
    assert!(nodata.answers.is_empty());

    let asked = world.dns_queries();
    assert_eq!(asked.iter().filter(|q| *q == name).count(), 4, "{asked:?}");
    assert!(asked.contains(&"example.com".to_string()), "{asked:?}");
    let log = world.dns_query_log();
    assert!(
        log.iter()
            .any(|q| q.rtype == "AAAA" && q.from == Some(SANDBOX_V6)),
        "{log:?}"
    );
    assert!(
        log.iter()
            .filter(|q| q.rtype == "A")
            .all(|q| q.from == Some(SANDBOX_V4))
    );
    let rogue_log = world.rogue_dns_query_log();
    assert_eq!(rogue_log.len(), 2, "{rogue_log:?}");
}

#[test]
fn dns_changes_are_served_at_once() {
    let world = World::new();
    let name = "svc.example.test";
    let addrs = |rtype: &str| world.dig(Some(DNS_V4), name, rtype, false);

    world.dns_set(name, &[HOST_V4], 30); // new TTL: restarts the resolvers
    let r = addrs("A");
    assert_eq!(
        (r.addrs(), r.answers[0].ttl),
        (vec![HOST_V4], 30),
        "{}",
        r.output
    );

    let start = Instant::now();
    world.dns_set(name, &[HOST3_V4, HOST3_V6], 30); // same TTL: reload by SIGHUP
    eprintln!("dns_set by reload took {:?}", start.elapsed());
    assert_eq!(addrs("A").addrs(), vec![HOST3_V4]);
    assert_eq!(addrs("AAAA").addrs(), vec![HOST3_V6]);
    let rogue = world.dig(Some(ROGUE_DNS_V4), name, "A", false);
    assert_eq!(
        rogue.addrs(),
        vec![HOST3_V4],
        "the rogue resolver reloads too"
    );

    let start = Instant::now();
    world.dns_set(name, &[HOST2_V4], 5);
    eprintln!("dns_set with a new TTL took {:?}", start.elapsed());
    let r = addrs("A");
    assert_eq!(
        (r.addrs(), r.answers[0].ttl),
        (vec![HOST2_V4], 5),
        "{}",
        r.output
    );

    world.dns_set("other.example.test", &[OTHER_V4], 5);
    world.dns_remove(name);
    assert_eq!(addrs("A").status.as_deref(), Some("NXDOMAIN"));
    let other = world.dig(None, "other.example.test", "A", false);
    assert_eq!(other.addrs(), vec![OTHER_V4]);

    let mixed = catch_unwind(AssertUnwindSafe(|| {
        world.dns_set("third.example.test", &[HOST_V4], 7)
    }));
    assert!(
        mixed.is_err(),
        "a second TTL is refused, not silently applied"
    );
    world.dns_set_ttl(7);
    assert_eq!(world.dns_ttl(), 7);
    let other = world.dig(None, "other.example.test", "A", false);
    assert_eq!(other.answers[0].ttl, 7, "{}", other.output);
}

#[test]
fn dns_stop_and_start() {
    let world = World::new();
    let name = "up.example.test";
    world.dns_set(name, &[HOST_V4], 60);
    assert_eq!(world.dig(None, name, "A", false).addrs(), vec![HOST_V4]);

    world.dns_stop();
    assert!(!world.dns_running());
    let start = Instant::now();
    let down = world.dig(Some(DNS_V4), name, "A", false);
    eprintln!("dig to a stopped resolver took {:?}", start.elapsed());
    assert!(!down.answered(), "{}", down.output);
    assert!(!world.dig(Some(DNS_V6), name, "A", true).answered());
    let rogue = world.dig(Some(ROGUE_DNS_V4), name, "A", false);
    assert_eq!(rogue.addrs(), vec![HOST_V4], "the rogue resolver stays up");

    world.dns_set("later.example.test", &[HOST2_V4], 60); // while stopped
    world.dns_start();
    assert!(world.dns_running());
    assert_eq!(world.dig(None, name, "A", false).addrs(), vec![HOST_V4]);
    assert_eq!(
        world.dig(None, "later.example.test", "A", false).addrs(),
        vec![HOST2_V4]
    );
    let asked = world.dns_queries();
    assert_eq!(asked.iter().filter(|q| *q == name).count(), 2, "{asked:?}");
}

#[test]
fn curl_by_name_through_the_worlds_dns() {
    let world = World::new();
    let listener = world.listen_tcp(HOST_V4, 80);
    world.dns_set("web.example.test", &[HOST_V4], 60);

    let body = world
        .curl("http://web.example.test/path")
        .expect("curl web.example.test");
    assert_eq!(body, "hello from 192.0.2.10:80\n");
    let hits = listener.hits();
    assert_eq!(hits.len(), 1);
    let request = String::from_utf8_lossy(&hits[0].data);
    assert!(request.starts_with("GET /path HTTP/1.1\r\n"), "{request}");
    assert!(request.contains("Host: web.example.test"), "{request}");

    let err = world
        .curl("http://missing.example.test/")
        .expect_err("an unknown name does not resolve");
    assert_eq!(err.code(), 6, "curl: could not resolve host: {err}");
}

#[test]
fn metadata_service_addresses_answer() {
    let world = World::new();
    let v4 = world.listen_tcp(METADATA_V4, 80);
    let v6 = world.listen_tcp(METADATA_V6, 80);
    let body = world
        .curl("http://169.254.169.254/latest/meta-data/")
        .expect("curl metadata v4");
    assert_eq!(body, "hello from 169.254.169.254:80\n");
    let body = world
        .curl("http://[fd00:ec2::254]/latest/meta-data/")
        .expect("curl metadata v6");
    assert_eq!(body, "hello from [fd00:ec2::254]:80\n");
    assert_eq!(
        (v4.peers(), v6.peers()),
        (vec![SANDBOX_V4], vec![SANDBOX_V6])
    );
}

#[test]
fn add_host_extends_the_internet() {
    let world = World::new();
    let extra = ip("203.0.113.77");
    let not_a_host = catch_unwind(AssertUnwindSafe(|| world.listen_tcp(extra, 80)));
    assert!(
        not_a_host.is_err(),
        "listening needs the address to be a host"
    );

    world.add_host(extra);
    world.add_host(extra); // twice is fine
    let listener = world.listen_tcp(extra, 80);
    assert!(world.tcp_connects(extra, 80));
    assert!(listener.wait_for(1, WAIT));

    let extra6 = ip("2001:db8:3::77");
    world.add_host(extra6);
    let listener6 = world.listen_tcp(extra6, 0);
    assert_ne!(listener6.port(), 0);
    assert!(world.tcp_connects(extra6, listener6.port()));
}

#[test]
fn listener_stops_on_drop() {
    let world = World::new();
    let listener = world.listen_tcp(HOST2_V4, 9000);
    assert!(world.tcp_connects(HOST2_V4, 9000));
    let start = Instant::now();
    drop(listener);
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "{:?}",
        start.elapsed()
    );
    let after = world.tcp_connect(HOST2_V4, 9000, 2);
    assert!(after.stderr.contains("refused"), "{after}");
}

#[test]
fn nft_rulesets_are_per_sandbox() {
    let world = World::new();
    let tables = |v: &serde_json::Value| -> Vec<String> {
        v["nftables"]
            .as_array()
            .expect("nftables array")
            .iter()
            .filter_map(|o| o["table"]["name"].as_str().map(String::from))
            .collect()
    };
    assert!(
        tables(&world.nft_json()).is_empty(),
        "a fresh sandbox has no tables"
    );

    let add = world.sandbox_cmd(&["nft", "add", "table", "inet", "eft_selftest"]);
    assert!(add.success(), "{add}");
    assert_eq!(tables(&world.nft_json()), vec!["eft_selftest"]);

    let root = Command::new("nft")
        .args(["-j", "list", "tables"])
        .output()
        .expect("nft list tables in the root namespace");
    assert!(
        !String::from_utf8_lossy(&root.stdout).contains("eft_selftest"),
        "the sandbox's table is not in the root namespace"
    );
}

#[test]
fn helpers_report_what_a_sandbox_ruleset_blocks() {
    let world = World::new();
    let open = world.listen_tcp(HOST_V4, 80);
    let closed = world.listen_tcp(HOST2_V4, 80);
    let udp = world.listen_udp(HOST_V4, 9999);
    let rules = world.write_file(
        "selftest.nft",
        "table inet eft_selftest {
            chain output {
                type filter hook output priority filter; policy accept;
                ip daddr 192.0.2.11 reject with icmpx admin-prohibited
                ip daddr 192.0.2.54 reject with icmpx admin-prohibited
                udp dport 9999 drop
            }
        }
        ",
    );
    let path = rules.to_str().expect("a UTF-8 path");
    let load = world.sandbox_cmd(&["nft", "-f", path]);
    assert!(load.success(), "{load}");

    let start = Instant::now();
    assert!(world.tcp_connects(HOST_V4, 80));
    assert!(!world.tcp_connects(HOST2_V4, 80));
    let sent = world.udp_send(HOST_V4, 9999, b"blocked");
    assert!(!sent.success(), "{sent}");
    assert!(sent.stderr.contains("Operation not permitted"), "{sent}");
    assert!(world.dig(None, "x.example.test", "A", false).answered());
    let rogue = world.dig(Some(ROGUE_DNS_V4), "x.example.test", "A", false);
    assert!(!rogue.answered(), "{}", rogue.output);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "rejects and local drops fail fast: {:?}",
        start.elapsed()
    );

    assert!(open.wait_for(1, WAIT));
    assert_eq!(closed.count(), 0);
    assert!(!udp.wait_for(1, Duration::from_millis(200)));
    assert!(world.rogue_dns_query_log().is_empty());
}

#[test]
fn worlds_are_isolated_from_each_other() {
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(World::new);
        let b = s.spawn(World::new);
        (
            a.join().expect("create world a"),
            b.join().expect("create world b"),
        )
    });
    assert_ne!(a.sandbox_name(), b.sandbox_name());
    let listener = a.listen_tcp(HOST_V4, 8000);
    assert!(a.tcp_connects(HOST_V4, 8000));
    assert!(!b.tcp_connects(HOST_V4, 8000));
    assert_eq!(listener.count(), 1);

    a.dns_set("only-a.example.test", &[HOST_V4], 60);
    let in_b = b.dig(None, "only-a.example.test", "A", false);
    assert_eq!(in_b.status.as_deref(), Some("NXDOMAIN"), "{}", in_b.output);
    assert!(!b.dns_queries().is_empty());
    assert!(a.dns_queries().is_empty());
}
