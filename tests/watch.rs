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
    let as_nobody = w.sandbox_cmd(&[
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "nc",
        "-z",
        "-w",
        "1",
        "203.0.113.10",
        "9",
    ]);
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
