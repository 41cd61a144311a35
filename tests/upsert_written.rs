//! The upsert of resolved elements (written with the netlink codec) on the real kernel: the
//! longest names a DNS answer can carry, full messages (the element list at its 16-bit
//! limit), both families, a chunk of the daemon's size; every element read back by `nft`
//! with its timeout and comment; a renewal.

mod common;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use common::*;
use egress_fence::core::plan::plan;
use egress_fence::core::policy::{L4Proto, Policy, PortRange};
use egress_fence::core::resolution::Resolution;
use egress_fence::core::ruleset::{Timed, Tuple};
use egress_fence::nft::Nft;
use egress_fence::nft::encode;
use serde_json::Value;

const POLICY: &str = r#"
version: 1
action: reject
allow:
  - cidr: 203.0.113.10/32
    ports: [22]
"#;

/// The longest name the kernel keeps as an element's comment: its user data (type, length,
/// the name, NUL) must be at most 254 bytes.
const LONGEST_KEPT: usize = 251;

/// A valid name of exactly `len` characters (17 to 253), unique by `i`.
fn name_of_len(i: u32, len: usize) -> String {
    name_of_length(&format!("n{i:06}"), "example", len)
}

fn timed(addr: IpAddr, port: u16, timeout_s: u64, name: Option<String>) -> Timed {
    Timed {
        tuple: Tuple {
            net: addr.into(),
            proto: L4Proto::Tcp,
            ports: PortRange::single(port),
        },
        timeout_ms: Some(timeout_s * 1000),
        expires_ms: None,
        name,
    }
}

/// (addr, port) -> (timeout s, expires s, comment), from `nft -j list set`.
fn read_set(w: &World, set: &str) -> BTreeMap<(IpAddr, u16), (u64, u64, Option<String>)> {
    let out = w.sandbox_cmd(&["nft", "-j", "list", "set", "inet", "egress_fence", set]);
    assert!(out.success(), "{out}");
    let v: Value = serde_json::from_str(&out.stdout).expect("json");
    let mut map = BTreeMap::new();
    for obj in v["nftables"].as_array().expect("array") {
        let Some(elems) = obj["set"]["elem"].as_array() else {
            continue;
        };
        for e in elems {
            let e = &e["elem"];
            let concat = e["val"]["concat"].as_array().expect("concat");
            let addr: IpAddr = concat[0].as_str().expect("addr").parse().expect("ip");
            let port = concat[2].as_u64().expect("port") as u16;
            let prev = map.insert(
                (addr, port),
                (
                    e["timeout"].as_u64().unwrap_or(0),
                    e["expires"].as_u64().unwrap_or(0),
                    e["comment"].as_str().map(String::from),
                ),
            );
            assert!(prev.is_none(), "{addr} {port} twice");
        }
    }
    map
}

/// The message lengths of the ELEMENTS nests in a written batch.
fn nest_lengths(enc: &encode::Encoded) -> Vec<usize> {
    let bytes = enc.pages().concat();
    let mut out = Vec::new();
    let mut at = 0;
    while at + 16 <= bytes.len() {
        let len = u32::from_ne_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        let mut a = at + 20;
        while a + 4 <= at + len {
            let alen = u16::from_ne_bytes([bytes[a], bytes[a + 1]]) as usize;
            let kind = u16::from_ne_bytes([bytes[a + 2], bytes[a + 3]]) & 0x3fff;
            if kind == 3 {
                out.push(alen);
            }
            a += alen.div_ceil(4) * 4;
        }
        at += len.div_ceil(4) * 4;
    }
    out
}

/// The table of `POLICY`, which has the resolved sets.
fn planned() -> egress_fence::core::ruleset::Ruleset {
    let policy = Policy::parse(POLICY, std::path::Path::new("policy.yaml")).expect("valid");
    plan(
        &policy,
        &Resolution {
            resolvers: vec![],
            hosts: vec![],
            guard_uid: None,
            scope: Default::default(),
        },
    )
}

/// A name a client may ask under an allowed `**.` wildcard runs to 253 characters. The kernel
/// refuses an element whose user data is 255 bytes (a 252-character name: EINVAL from
/// `nft_set_ext_check`, which refused the whole batch, everyone's answers in it with it, and
/// every full apply that carried the name) and silently drops 256 bytes (its `u8` length
/// wraps to 0). Every such element is installed; the comment is there exactly when the
/// kernel can keep it, and never a different one.
#[test]
fn the_longest_names_are_installed_and_never_refuse_their_batch() {
    let w = World::new();
    let rs = planned();
    let lens = 248..=253usize;
    let mut elements = Vec::new();
    for len in lens.clone() {
        let v4 = IpAddr::from([198, 18, 0, len as u8]);
        let v6 = IpAddr::from([0x2001, 0xdb8, 0, 0, 0, 0, 0, len as u16]);
        for addr in [v4, v6] {
            elements.push(timed(addr, 443, 600, Some(name_of_len(len as u32, len))));
        }
    }
    // Another client's answer in the same batch.
    elements.push(timed(
        IpAddr::from([198, 18, 1, 1]),
        443,
        600,
        Some("a.example".into()),
    ));
    let sent = w.in_sandbox_ns(|| {
        let mut nft = Nft::open().expect("netlink");
        nft.apply(&rs).expect("apply");
        let one_by_one: Vec<_> = elements
            .iter()
            .map(|t| {
                nft.upsert_resolved(std::slice::from_ref(t))
                    .map_err(|e| e.to_string())
            })
            .collect();
        let mut with_full_apply = rs.clone();
        for set in &mut with_full_apply.sets {
            if let egress_fence::core::ruleset::Elements::Timed(timed) = &mut set.elements {
                let family = set.id.family;
                timed.extend(
                    elements
                        .iter()
                        .filter(|t| {
                            egress_fence::core::ruleset::Family::of_net(&t.tuple.net) == family
                        })
                        .cloned(),
                );
            }
        }
        (
            one_by_one,
            nft.upsert_resolved(&elements).map_err(|e| e.to_string()),
            nft.apply(&with_full_apply).map_err(|e| e.to_string()),
        )
    });
    for (t, result) in elements.iter().zip(&sent.0) {
        assert!(
            result.is_ok(),
            "{} characters: {result:?}",
            t.name.as_ref().map_or(0, String::len)
        );
    }
    assert!(sent.1.is_ok(), "one batch: {:?}", sent.1);
    assert!(sent.2.is_ok(), "the full table: {:?}", sent.2);
    let v4 = read_set(&w, "resolved4");
    let v6 = read_set(&w, "resolved6");
    for t in &elements {
        let key = (t.tuple.net.addr(), t.tuple.ports.first);
        let (timeout, _, comment) = if key.0.is_ipv4() { &v4 } else { &v6 }
            .get(&key)
            .unwrap_or_else(|| panic!("{key:?} missing"));
        assert_eq!(*timeout, 600, "{key:?}");
        let name = t.name.as_ref().expect("named");
        let want = (name.len() <= LONGEST_KEPT).then(|| name.clone());
        assert_eq!(comment, &want, "{} characters", name.len());
    }
}

/// One chunk of the daemon's size, full messages and the longest comments kept: every element
/// is installed with its own timeout and comment, and an upsert restarts an element's expiry.
#[test]
fn full_messages_of_the_longest_comments_are_installed_element_by_element() {
    let w = World::new();
    let rs = planned();

    // One chunk of the daemon's size (1,024), both families, the longest comments.
    let mut chunk = Vec::new();
    for i in 0..600u32 {
        let addr = IpAddr::from((0xc612_0000u32 + i).to_be_bytes());
        chunk.push(timed(
            addr,
            443,
            60 + u64::from(i),
            Some(name_of_len(i, LONGEST_KEPT)),
        ));
    }
    for i in 0..424u32 {
        let addr = IpAddr::from([0x2001, 0xdb8, 0, 0, 0, 0, 1, i as u16]);
        chunk.push(timed(
            addr,
            443,
            60 + u64::from(i),
            Some(name_of_len(10_000 + i, LONGEST_KEPT)),
        ));
    }
    // A v4 list at exactly 65,532 bytes (the largest a 16-bit, 4-aligned length holds):
    // 212 entries of 308 bytes and one of 232, then one element more.
    let mut exact = Vec::new();
    for i in 0..212u32 {
        let addr = IpAddr::from((0xc613_0000u32 + i).to_be_bytes());
        exact.push(timed(
            addr,
            8443,
            3600,
            Some(name_of_len(20_000 + i, LONGEST_KEPT)),
        ));
    }
    exact.push(timed(
        IpAddr::from([198, 19, 1, 0]),
        8443,
        3600,
        Some(name_of_len(30_000, 177)),
    ));
    exact.push(timed(
        IpAddr::from([198, 19, 1, 1]),
        8443,
        3600,
        Some(name_of_len(30_001, LONGEST_KEPT)),
    ));
    let exact_enc = encode::upsert_resolved(&exact).expect("fits");
    assert_eq!(nest_lengths(&exact_enc), vec![65_532, 4 + 308]);
    let chunk_nests = nest_lengths(&encode::upsert_resolved(&chunk).expect("fits"));
    assert!(chunk_nests.len() > 2, "{chunk_nests:?}");

    let (a, b) = w.in_sandbox_ns(|| {
        let mut nft = Nft::open().expect("netlink");
        nft.apply(&rs).expect("apply");
        (nft.upsert_resolved(&chunk), nft.send(&exact_enc))
    });
    a.expect("chunk accepted");
    b.expect("exact accepted");

    let v4 = read_set(&w, "resolved4");
    let v6 = read_set(&w, "resolved6");
    assert_eq!(v4.len(), 600 + exact.len());
    assert_eq!(v6.len(), 424);
    for t in chunk.iter().chain(&exact) {
        let key = (t.tuple.net.addr(), t.tuple.ports.first);
        let got = if key.0.is_ipv4() { &v4 } else { &v6 }
            .get(&key)
            .unwrap_or_else(|| panic!("{key:?} missing"));
        assert_eq!(got.0 * 1000, t.timeout_ms.unwrap(), "{key:?}");
        // Its expiry started when it was installed (a slow machine may take some seconds).
        assert!(got.1 <= got.0 && got.1 + 30 >= got.0, "{key:?}: {got:?}");
        assert_eq!(got.2, t.name, "{key:?}");
    }

    // Renewal: the same element with a longer, then a shorter timeout: each restarts the
    // expiry with the new timeout.
    let one = |timeout_s| {
        vec![timed(
            IpAddr::from([198, 18, 0, 0]),
            443,
            timeout_s,
            Some(name_of_len(0, LONGEST_KEPT)),
        )]
    };
    std::thread::sleep(Duration::from_millis(2_100));
    let key = (IpAddr::from([198, 18, 0, 0]), 443);
    let before = read_set(&w, "resolved4")[&key].clone();
    assert!(before.1 <= 58, "{before:?}");
    w.in_sandbox_ns(|| Nft::open().and_then(|mut nft| nft.upsert_resolved(&one(7200))))
        .expect("renewal");
    let longer = read_set(&w, "resolved4")[&key].clone();
    assert_eq!(longer.0, 7200, "{longer:?}");
    assert!(longer.1 >= 7000, "{longer:?}");
    w.in_sandbox_ns(|| Nft::open().and_then(|mut nft| nft.upsert_resolved(&one(30))))
        .expect("renewal");
    let shorter = read_set(&w, "resolved4")[&key].clone();
    assert_eq!(shorter.0, 30, "{shorter:?}");
    assert!(shorter.1 <= 30, "{shorter:?}");
    assert_eq!(
        shorter.2.as_deref(),
        Some(name_of_len(0, LONGEST_KEPT).as_str())
    );
}
