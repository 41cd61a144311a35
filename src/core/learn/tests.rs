//! `learn` writes a policy that loads, keeps the start text, and that `replay` finds refuses
//! nothing of the trace it came from.

use super::*;
use crate::core::replay::tests::{GUARD, RESOLVE, T, policy};
use crate::core::replay::{FlowRefusal, replay};

fn learned(start: &str, trace: &Trace) -> (Learned, Policy) {
    let out = learn(start, &policy(start), trace, &LearnOptions::default());
    let p = Policy::parse(&out.yaml, Path::new("learned.yaml"))
        .unwrap_or_else(|e| panic!("the learned policy does not load: {e}\n{}", out.yaml));
    (out, p)
}

/// Whether an allow entry would let the refused flows `f` through and learn would write one
/// for them (not for DNS around the resolvers, nor an address the table never takes).
fn helps(f: &crate::core::replay::RefusedFlow, guard: bool) -> bool {
    f.why.allow_entry_helps()
        && f.dport
            .is_none_or(|port| not_learned(f.dst, port, false, guard).is_none())
}

/// Every line of `start` is in `yaml`, in order.
fn keeps(start: &str, yaml: &str) -> bool {
    let mut rest = yaml.lines();
    start.lines().all(|l| rest.any(|y| y == l))
}

fn busy_trace() -> Trace {
    T::start()
        .name("api.example", &["192.0.2.7"])
        .tcp("192.0.2.7", 443)
        .name("New.Example.", &["192.0.2.8"])
        .tcp("192.0.2.8", 443)
        .udp("192.0.2.8", 443)
        .tcp("192.0.2.8", 443)
        .name("git.example", &["192.0.2.9"])
        .tcp("192.0.2.9", 22)
        .tcp("192.0.2.9", 9418)
        .tcp("203.0.113.5", 8080)
        .tcp("2001:db8::5", 443)
        .name("asked.example", &["192.0.2.10"])
        .name("api.example", &["169.254.169.254"])
        .tcp("169.254.169.254", 80)
        .udp("198.51.100.53", 53)
        // api.example is allowed on 443 only: 8443 is what it needed more.
        .tcp("192.0.2.7", 8443)
        .trace()
}

#[test]
fn the_learned_policy_loads_keeps_the_start_and_refuses_no_flow_of_its_trace() {
    let t = busy_trace();
    let (out, p) = learned(GUARD, &t);
    assert!(keeps(GUARD, &out.yaml), "{}", out.yaml);
    let r = replay(&p, &t);
    let left: Vec<&FlowRefusal> = r.refused_flows.iter().map(|f| &f.why).collect();
    // What no allow entry lets through stays refused, and says so.
    assert!(
        left.iter().all(|w| !w.allow_entry_helps()),
        "{left:?}\n{}",
        out.yaml
    );
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(out.yaml.contains("refused whatever the policy allows"));
    assert!(
        out.yaml
            .contains("tcp 169.254.169.254:80: denied: preset cloud-metadata (1 flow)")
    );
    // The name asked and never connected to is a comment, and still refused.
    assert!(
        out.yaml.contains("  asked.example (asked once"),
        "{}",
        out.yaml
    );
    let names: Vec<&str> = r.refused_names.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["asked.example"]);
    assert_eq!(
        out.added,
        [
            "api.example tcp 8443 (api.example: first seen 2026-12-01T10:00:16.000Z, last seen \
             2026-12-01T10:00:16.000Z, 1 flow)",
            "git.example tcp 22, 9418 (git.example: first seen 2026-12-01T10:00:08.000Z, last \
             seen 2026-12-01T10:00:09.000Z, 2 flows)",
            "new.example tcp+udp 443 (new.example: first seen 2026-12-01T10:00:04.000Z, last \
             seen 2026-12-01T10:00:06.000Z, 3 flows)",
            "203.0.113.5/32 tcp 8080 (no name seen for 203.0.113.5: first seen \
             2026-12-01T10:00:10.000Z, last seen 2026-12-01T10:00:10.000Z, 1 flow)",
            "2001:db8::5/128 tcp 443 (no name seen for 2001:db8::5: first seen \
             2026-12-01T10:00:11.000Z, last seen 2026-12-01T10:00:11.000Z, 1 flow)",
        ]
    );
    // Appended to the start's own list, before `deny:`, at its indentation.
    let at = |s: &str| {
        out.yaml
            .find(s)
            .unwrap_or_else(|| panic!("{s}\n{}", out.yaml))
    };
    assert!(at("  - domain: \"git.example\"") < at("deny:"));
    assert_eq!(p.allow.len(), policy(GUARD).allow.len() + 5);
}

#[test]
fn a_flow_counts_for_the_last_name_that_answered_its_address() {
    let t = T::start()
        .name("a.example", &["192.0.2.7"])
        .name("b.example", &["192.0.2.7"])
        .tcp("192.0.2.7", 443)
        .trace();
    let (out, _) = learned(GUARD, &t);
    assert_eq!(out.added.len(), 1);
    assert!(
        out.added[0].starts_with("b.example tcp 443"),
        "{:?}",
        out.added
    );
}

#[test]
fn resolve_mode_learns_names_and_addresses_too() {
    let t = busy_trace();
    let (out, p) = learned(RESOLVE, &t);
    assert!(keeps(RESOLVE, &out.yaml));
    let r = replay(&p, &t);
    assert!(
        r.refused_flows.iter().all(|f| !helps(f, false)),
        "{:?}",
        r.refused_flows
    );
    // What is left is DNS to another server, said in a comment.
    assert!(
        out.yaml
            .contains("udp 198.51.100.53:53: DNS to a server that is not one of `dns.resolvers`"),
        "{}",
        out.yaml
    );
    assert!(r.refused_names.is_empty());
}

fn siblings(parent: &str, n: usize) -> T {
    let mut t = T::start();
    for i in 0..n {
        let addr = format!("192.0.2.{}", i + 1);
        t = t.name(&format!("n{i}.{parent}"), &[&addr]).tcp(&addr, 443);
    }
    t
}

#[test]
fn siblings_fold_into_a_wildcard_unless_it_would_be_one_check_warns_about() {
    let (out, p) = learned(GUARD, &siblings("cdn.example", 12).trace());
    assert_eq!(out.added.len(), 1, "{:?}", out.added);
    assert!(
        out.yaml.contains("# folds 12 names seen under cdn.example"),
        "{}",
        out.yaml
    );
    assert!(out.yaml.contains("- domain: \"*.cdn.example\""));
    assert!(p.warnings().is_empty(), "{:?}", p.warnings());
    // Fewer than fold_at: one entry each.
    let (out, _) = learned(GUARD, &siblings("cdn.example", 9).trace());
    assert_eq!(out.added.len(), 9);
    // Shared hosting and top-level domains never fold.
    for parent in ["github.io", "example"] {
        let t = siblings(parent, 12).trace();
        let (out, p) = learned(GUARD, &t);
        assert_eq!(out.added.len(), 12, "{parent}: {:?}", out.added);
        assert!(p.warnings().is_empty(), "{:?}", p.warnings());
        assert!(!replay(&p, &t).refuses_anything());
    }
    // Resolve mode has no wildcards.
    let (out, _) = learned(RESOLVE, &siblings("cdn.example", 12).trace());
    assert_eq!(out.added.len(), 12);
    // A bigger fold_at keeps them apart.
    let t = siblings("cdn.example", 12).trace();
    let out = learn(GUARD, &policy(GUARD), &t, &LearnOptions { fold_at: 13 });
    assert_eq!(out.added.len(), 12);
}

#[test]
fn the_start_text_is_edited_where_its_allow_list_is() {
    let t = T::start()
        .name("new.example", &["192.0.2.8"])
        .tcp("192.0.2.8", 443)
        .trace();
    let guard = "dns:\n  mode: guard\n  upstream: [192.0.2.53]\n";
    for start in [
        // No allow: at all.
        format!("version: 1\n# keep me\n{guard}"),
        // An empty one.
        format!("version: 1\nallow: [] # nothing yet\n{guard}"),
        // A list at the key's own indentation, then another key.
        format!(
            "version: 1\nallow:\n- cidr: 192.0.2.1 # mine\n  ports: [22]\n# about dns\n{guard}"
        ),
        // The last key, without a final newline.
        format!("version: 1\n{guard}allow:\n    - cidr: 192.0.2.1\n      comment: \"mine\""),
        // A flow list, kept entry for entry.
        format!(
            "version: 1\nallow: [{{cidr: 192.0.2.1, ports: [22]}},\n  {{domain: a.example, ports: [443], comment: \"x: y\"}}]\n{guard}"
        ),
    ] {
        let (out, p) = learned(&start, &t);
        let r = replay(&p, &t);
        assert!(!r.refuses_anything(), "{start}\n---\n{}", out.yaml);
        assert_eq!(
            p.allow.len(),
            policy(&start).allow.len() + 1,
            "{}",
            out.yaml
        );
        assert_eq!(p.allow[..p.allow.len() - 1], policy(&start).allow[..]);
        assert!(!out.yaml.contains("could not add"), "{}", out.yaml);
        if !start.contains("allow: [") {
            assert!(keeps(&start, &out.yaml), "{start}\n---\n{}", out.yaml);
        }
    }
}

#[test]
fn a_text_it_cannot_edit_is_kept_with_the_entries_commented_below_and_why() {
    let t = T::start()
        .name("new.example", &["192.0.2.8"])
        .tcp("192.0.2.8", 443)
        .trace();
    let start = "{version: 1, allow: [{cidr: 192.0.2.1}]}\n";
    let out = learn(start, &policy(start), &t, &LearnOptions::default());
    assert!(out.yaml.starts_with(start));
    assert!(
        out.yaml.contains("could not add these entries"),
        "{}",
        out.yaml
    );
    assert!(
        out.yaml.contains("#  - domain: \"new.example\""),
        "{}",
        out.yaml
    );
    assert_eq!(policy(&out.yaml), policy(start));
    assert_eq!(out.added.len(), 1);
    assert!(out.added[0].ends_with("[commented out: see the end of the policy]"));
}

#[test]
fn trace_text_cannot_write_policy_lines() {
    let mut t = T::start()
        .name("new.example", &["192.0.2.8"])
        .tcp("192.0.2.8", 443)
        .name("x.example", &[])
        .trace();
    for r in &mut t.records {
        if let crate::core::trace::Record::Flow { time, .. }
        | crate::core::trace::Record::Name { time, .. } = r
        {
            *time = "2026\nallow:\n  - cidr: 0.0.0.0/0".into();
        }
    }
    let (out, p) = learned(GUARD, &t);
    assert!(!out.yaml.contains("\n  - cidr: 0.0.0.0/0"), "{}", out.yaml);
    assert!(!out.yaml.contains("\nallow:\n  - cidr"), "{}", out.yaml);
    assert_eq!(p.allow.len(), policy(GUARD).allow.len() + 1);
    assert!(out.added.iter().all(|a| !a.contains('\n')));
}

#[test]
fn many_ports_make_ranges_a_domain_entry_can_hold() {
    let mut t = T::start().name("scan.example", &["192.0.2.8"]);
    for port in 1000..1600 {
        t = t.tcp("192.0.2.8", port);
    }
    let t = t.trace();
    let (out, p) = learned(GUARD, &t);
    assert!(
        out.yaml
            .contains("ports: [\"1000-1255\", \"1256-1511\", \"1512-1599\"]"),
        "{}",
        out.yaml
    );
    assert!(!replay(&p, &t).refuses_anything());
}

#[test]
fn nothing_needed_adds_nothing_and_says_so() {
    let t = T::start()
        .name("api.example", &["192.0.2.7"])
        .tcp("192.0.2.7", 443)
        .trace();
    let (out, p) = learned(GUARD, &t);
    assert!(out.added.is_empty());
    assert!(
        out.yaml
            .contains("the policy refused nothing an allow entry can let through")
    );
    assert_eq!(p, policy(GUARD));
}

/// Traces made up from a small pool of names, addresses and ports, shared and bare, in both
/// modes: whatever the mix, the learned policy loads, keeps the start's entries, and leaves
/// refused only what no allow entry can let through.
#[test]
fn learn_and_replay_agree_on_made_up_traces() {
    let mut seed: u64 = 0x5eed;
    let mut next = |n: u64| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) % n
    };
    let (mut folds, mut bare, mut denied) = (0, 0, 0);
    for round in 0..40 {
        let start = if round % 2 == 0 { GUARD } else { RESOLVE };
        let mut t = T::start();
        for _ in 0..300 {
            let addr = match next(6) {
                0 => "169.254.169.254".to_string(),
                1 => format!("2001:db8::{}", next(4) + 1),
                _ => format!("192.0.2.{}", next(40) + 1),
            };
            match next(4) {
                0 => {
                    let name = match next(3) {
                        0 => format!("n{}.cdn.example", next(14)),
                        1 => format!("Host{}.Example.", next(5)),
                        _ => "api.example".to_string(),
                    };
                    t = t.name(&name, &[&addr]);
                }
                1 => t = t.udp(&addr, [53, 443, 3478][next(3) as usize]),
                _ => t = t.tcp(&addr, [22, 443, 8080, 9418][next(4) as usize]),
            }
        }
        let t = t.trace();
        let (out, p) = learned(start, &t);
        assert_eq!(
            p.allow[..policy(start).allow.len()],
            policy(start).allow[..]
        );
        let r = replay(&p, &t);
        assert!(
            r.refused_flows.iter().all(|f| !helps(f, start == GUARD)),
            "round {round}: {:?}\n{}",
            r.refused_flows,
            out.yaml
        );
        assert!(p.warnings().is_empty(), "{:?}", p.warnings());
        folds += usize::from(out.yaml.contains("# folds "));
        bare += usize::from(out.yaml.contains("# no name seen"));
        denied += usize::from(out.yaml.contains("denied: preset cloud-metadata"));
    }
    // The mix did make each kind of entry and note.
    assert!(
        folds > 0 && bare > 0 && denied > 0,
        "{folds} {bare} {denied}"
    );
}

#[test]
fn what_a_scope_leaves_alone_is_not_learned_and_what_it_cannot_tell_is_said() {
    let start = format!("{GUARD}scope:\n  users: [1001]\n");
    let t = T::start()
        .name("a.example", &["192.0.2.7"])
        .flow_as("tcp", "192.0.2.7", Some(443), Some(1002), None)
        .flow_as("tcp", "192.0.2.7", Some(8443), None, None)
        .trace();
    let (out, _) = learned(&start, &t);
    assert!(out.added.is_empty(), "{:?}", out.added);
    assert!(
        out.yaml
            .contains("#   1 flow such as tcp 192.0.2.7:8443: neither a uid nor an interface"),
        "{}",
        out.yaml
    );
}

#[test]
fn an_include_stays_an_include_and_its_entries_are_not_learned_again() {
    let start = GUARD.replace("deny:", "include: [npm]\ndeny:");
    let t = T::start()
        .name("registry.npmjs.org", &["192.0.2.20"])
        .tcp("192.0.2.20", 443)
        .name("new.example", &["192.0.2.8"])
        .tcp("192.0.2.8", 443)
        .trace();
    let (out, p) = learned(&start, &t);
    assert_eq!(out.added.len(), 1, "{:?}", out.added);
    assert!(out.yaml.contains("include: [npm]"));
    assert_eq!(p.include, policy(&start).include);
    assert!(!replay(&p, &t).refuses_anything());
}

// What an adversary inside the fence does to a learn run (it chooses the names it asks, the
// flows it opens and, under its own domain, the answers): each test is one attempt to make
// the learned policy wider than the entries a reviewer sees suggest.

#[test]
fn siblings_never_fold_under_a_public_suffix() {
    // `*.co.uk` would let every British company's servers in; `*.blogspot.com` every blog's
    // (the Public Suffix List's private section), `*.s3.amazonaws.com` every bucket.
    for parent in [
        "co.uk",
        "com.au",
        "ac.jp",
        "blogspot.com",
        "s3.amazonaws.com",
        "s3.eu-west-1.amazonaws.com",
        "cloudfunctions.net",
    ] {
        let t = siblings(parent, 12).trace();
        let (out, p) = learned(GUARD, &t);
        assert_eq!(out.added.len(), 12, "{parent}: {}", out.yaml);
        assert!(
            !out.yaml.contains(&format!("*.{parent}")),
            "{parent}: {}",
            out.yaml
        );
        assert!(!replay(&p, &t).refuses_anything());
    }
    // A tenant's own names still fold: they are one owner's.
    let (out, _) = learned(GUARD, &siblings("mine.github.io", 12).trace());
    assert_eq!(out.added.len(), 1, "{}", out.yaml);
}

#[test]
fn a_learned_wildcard_says_what_it_lets_through() {
    // The adversary asks twelve names under a domain whose servers it runs: the fold is a
    // DNS channel to those servers (every question under it is forwarded), and their answers
    // put any address in the table. The reviewer must be told, next to the entry.
    let (out, _) = learned(GUARD, &siblings("attacker.example", 12).trace());
    let at = out
        .yaml
        .find("- domain: \"*.attacker.example\"")
        .unwrap_or_else(|| panic!("{}", out.yaml));
    let above = &out.yaml[..at];
    let comment = above.lines().rev().take(3).collect::<Vec<_>>().join("\n");
    assert!(
        comment.contains("every name under attacker.example")
            && comment.contains("whoever runs attacker.example"),
        "{comment}"
    );
    assert!(out.added[0].contains("wildcard"), "{:?}", out.added);
}

#[test]
fn addresses_the_table_never_takes_are_not_learned() {
    // Without the loopback essential, multicast, broadcast, loopback, link-local, an
    // IPv4-mapped form of the metadata address, NAT64 local use: none is an address a
    // reviewer means to allow by a `cidr:` of one address; each is a note, not an entry.
    let start = "version: 1\nessentials: []\ndeny:\n  - preset: cloud-metadata\n\
                 dns:\n  mode: guard\n  upstream: [192.0.2.53]\n";
    let t = T::start()
        .udp("224.0.0.251", 5353)
        .udp("255.255.255.255", 9)
        .tcp("127.0.0.1", 8080)
        .tcp("0.0.0.0", 80)
        .udp("ff02::fb", 5353)
        .tcp("fe80::1", 80)
        .tcp("::ffff:169.254.169.254", 80)
        .tcp("::ffff:192.0.2.7", 443)
        .tcp("64:ff9b:1::c000:207", 443)
        .tcp("240.0.0.1", 443)
        .tcp("192.0.2.7", 443)
        .trace();
    let (out, p) = learned(start, &t);
    assert_eq!(out.added.len(), 1, "{}", out.yaml);
    assert_eq!(p.allow.len(), 1);
    assert!(
        out.added[0].starts_with("192.0.2.7/32 tcp 443"),
        "{:?}",
        out.added
    );
    assert!(out.yaml.contains("udp 224.0.0.251:5353"), "{}", out.yaml);
    assert!(
        out.yaml.contains("tcp [::ffff:169.254.169.254]:80"),
        "{}",
        out.yaml
    );
}

#[test]
fn dns_around_the_resolvers_is_not_learned() {
    // Resolve mode: DNS (53) or DNS over TLS (853) to a server that is not one of
    // `dns.resolvers` is the classic way around a name policy; learn says so and leaves it out.
    let t = T::start()
        .udp("198.51.100.53", 53)
        .tcp("198.51.100.53", 853)
        .name("dns.example", &["198.51.100.54"])
        .tcp("198.51.100.54", 853)
        .tcp("198.51.100.55", 443)
        .trace();
    let (out, p) = learned(RESOLVE, &t);
    assert_eq!(out.added.len(), 1, "{}", out.yaml);
    assert_eq!(p.allow.len(), policy(RESOLVE).allow.len() + 1);
    assert!(out.yaml.contains("udp 198.51.100.53:53"), "{}", out.yaml);
    assert!(out.yaml.contains("tcp 198.51.100.54:853"), "{}", out.yaml);
}

/// Many names asked and never connected to, and many bare addresses connected to: telling
/// whether an asked name is covered by a new entry must not walk every new entry (30,000 names
/// times 30,000 entries).
#[test]
fn many_asked_names_and_many_new_entries_are_written_in_one_pass() {
    let n: u32 = 30_000;
    let mut records = T::start().records;
    let (ask, connect) = {
        let t = T::start()
            .name("x.example", &[])
            .tcp("10.0.0.1", 443)
            .records;
        (t[1].clone(), t[2].clone())
    };
    for i in 0..n {
        let mut name = ask.clone();
        if let crate::core::trace::Record::Name { name: na, .. } = &mut name {
            *na = format!("q{i}.asked.example");
        }
        let mut flow = connect.clone();
        if let crate::core::trace::Record::Flow { dst, .. } = &mut flow {
            *dst = std::net::Ipv4Addr::from(0x0a00_0000 + i).into();
        }
        records.extend([name, flow]);
    }
    let t = Trace { records };
    let out = learn(GUARD, &policy(GUARD), &t, &LearnOptions::default());
    assert_eq!(out.added.len(), n as usize);
    // So many entries make a policy larger than egress-fence reads: the start text is kept,
    // the entries are commented out below it, and why is said.
    assert!(out.yaml.starts_with(GUARD));
    assert!(
        out.yaml.contains(
            "could not add these entries to this policy's `allow:` list (the edited text does \
             not load: learned.yaml: the policy is larger than 1024 KiB"
        ),
        "{}",
        &out.yaml[GUARD.len()..GUARD.len() + 500]
    );
    // The notes stop at MAX_NOTES.
    assert!(
        out.yaml
            .contains(&format!("#  #   ... and {} more", n as usize - MAX_NOTES)),
        "{}",
        &out.yaml[..2000]
    );
}

/// The names, query types, protocols and interfaces of a trace are the agent's to choose (a
/// trace may also be edited by hand): none may write a policy line. The guard writes only
/// the presentation form of a name (printable ASCII), but `learn` does not rely on it.
#[test]
fn trace_names_and_protocols_cannot_write_policy_lines() {
    let inject = "x\n- cidr: 0.0.0.0/0\n  ports: [1-65535]\n#";
    let start = "version: 1\nallow:\n  - domain: api.example\n    ports: [443]\n\
                 dns:\n  mode: guard\n  upstream: [192.0.2.53]\nlog:\n  group: 7\n";
    let t = T::start()
        .typed(inject, "A")
        .typed(inject, "ANY")
        .typed("a.example\r\n- cidr: ::/0\u{2028}\u{85}", "ANY")
        .typed(" padded.example\n", "A")
        .tcp("192.0.2.99", 443)
        .name("new.example", &["192.0.2.8"])
        .tcp("192.0.2.8", 443)
        .flow_as(inject, "192.0.2.8", Some(443), Some(1001), Some(inject))
        .flow_as(inject, "192.0.2.9", None, None, None)
        .trace();
    let (out, p) = learned(start, &t);
    // The two names learned: the one the padding hid is the policy name it reads as.
    assert_eq!(p.allow.len(), 3, "{}", out.yaml);
    assert!(
        out.yaml.contains("- domain: \"padded.example\""),
        "{}",
        out.yaml
    );
    for line in out
        .yaml
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
    {
        assert!(
            !line.contains("0.0.0.0/0") && !line.contains("::/0") && !line.contains("1-65535"),
            "{line}\n{}",
            out.yaml
        );
    }
    assert!(out.yaml.is_ascii());
    assert!(
        out.added
            .iter()
            .all(|a| a.is_ascii() && !a.contains(['\n', '\r']))
    );
}

/// A flow-style `allow:` with an include: the list rewritten in block style holds the
/// policy's own entries only (the preset's stay the include's, not copied in where an edit
/// of the preset would no longer reach them), and a preset's name used on another port is
/// learned as an entry of its own.
#[test]
fn a_rewritten_list_beside_an_include_keeps_the_presets_entries_out() {
    let start = "version: 1\ninclude: [npm]\nallow: [{domain: a.example, ports: [443]}]\n\
                 dns:\n  mode: guard\n  upstream: [192.0.2.53]\n";
    let t = T::start()
        .name("registry.npmjs.org", &["192.0.2.20"])
        .tcp("192.0.2.20", 443)
        .tcp("192.0.2.20", 80)
        .name("new.example", &["192.0.2.8"])
        .tcp("192.0.2.8", 443)
        .trace();
    let (out, p) = learned(start, &t);
    assert!(!out.yaml.contains("could not add"), "{}", out.yaml);
    assert_eq!(p.include, policy(start).include);
    assert_eq!(
        out.yaml.matches("registry.npmjs.org").count(),
        2,
        "the learned entry and its comment only: {}",
        out.yaml
    );
    assert!(
        out.yaml
            .contains("- domain: \"registry.npmjs.org\"\n    ports: [80]")
    );
    let presets = replay::entry_presets(&p);
    assert_eq!(
        presets.iter().filter(|p| p.is_some()).count(),
        policy(start).allow.len() - 1,
        "the include's entries are still the include's"
    );
    assert!(!replay(&p, &t).refuses_anything());
}

/// A name longer than an allowed name may be (251 characters: the table keeps it as each
/// address's comment) is left to a person, not written as an entry the policy would refuse:
/// that made every learned entry a comment, the text left as it was.
#[test]
fn a_name_too_long_to_be_allowed_is_a_note_not_an_entry() {
    let long = crate::core::policy::name_of_length("example", 252);
    let t = T::start()
        .name(&long, &["192.0.2.20"])
        .tcp("192.0.2.20", 443)
        .name("fine.example", &["192.0.2.21"])
        .tcp("192.0.2.21", 443)
        .trace();
    let (out, p) = learned(GUARD, &t);
    assert_eq!(out.added.len(), 1, "{}", out.yaml);
    assert!(
        out.added[0].starts_with("fine.example tcp 443"),
        "{:?}",
        out.added
    );
    assert_eq!(p.allow.len(), policy(GUARD).allow.len() + 1);
    assert!(
        out.yaml
            .contains("tcp 192.0.2.20:443: its name has 252 characters, more than the 251"),
        "{}",
        out.yaml
    );
}

/// The sandbox's own zone answers a user's address last, before the user's flow: the flow is
/// learned for the name its own uid asked, not for the sandbox's name (which it could point
/// anywhere once the policy is applied). A flow whose uid asked no name for the address,
/// which two uids asked names for, is learned as the address alone.
#[test]
fn a_flow_is_learned_for_the_name_its_own_uid_asked() {
    let mut t = T::start().name("good.example", &["192.0.2.7"]);
    t.records.push(crate::core::trace::Record::Name {
        time: "2026-12-01T10:00:02.500Z".into(),
        name: "hijack.evil.example".into(),
        qtype: "A".into(),
        answer: "NOERROR".into(),
        addrs: vec!["192.0.2.7".parse().unwrap()],
        ttl: Some(60),
        uid: Some(65534),
    });
    let t = t
        .tcp("192.0.2.7", 443)
        .flow_as("tcp", "192.0.2.7", Some(8443), Some(1002), None)
        .trace();
    let (out, _) = learned(GUARD, &t);
    assert_eq!(out.added.len(), 2, "{:?}", out.added);
    assert!(
        out.yaml
            .contains("- domain: \"good.example\"\n    ports: [443]\n"),
        "{}",
        out.yaml
    );
    assert!(
        out.yaml
            .contains("- cidr: \"192.0.2.7/32\"\n    ports: [8443]\n"),
        "{}",
        out.yaml
    );
}

/// A container's flow has no uid, nor has the name the container asked (both cross the
/// bridge): the host's fenced process asking its own name for the same address afterwards
/// does not take the flow, which goes to the last name asked with no uid.
#[test]
fn a_flow_with_no_uid_is_learned_for_the_name_asked_with_no_uid() {
    let name = |name: &str, uid| crate::core::trace::Record::Name {
        time: "2026-12-01T10:00:02.500Z".into(),
        name: name.into(),
        qtype: "A".into(),
        answer: "NOERROR".into(),
        addrs: vec!["192.0.2.7".parse().unwrap()],
        ttl: Some(60),
        uid,
    };
    let mut t = T::start();
    t.records.push(name("good.example", None));
    t.records.push(name("hijack.evil.example", Some(65534)));
    let t = t
        .flow_as("tcp", "192.0.2.7", Some(443), None, Some("efbr0"))
        .trace();
    let (out, _) = learned(GUARD, &t);
    assert_eq!(out.added.len(), 1, "{:?}", out.added);
    assert!(
        out.yaml
            .contains("- domain: \"good.example\"\n    ports: [443]\n"),
        "{}",
        out.yaml
    );
    assert!(!out.yaml.contains("- domain: \"hijack"), "{}", out.yaml);
}

/// The user's name was asked through a caching stub (its uid, not the user's), then the
/// sandbox asked its own name for the same address directly: the user's flow, whose uid asked
/// nothing, is no longer the last asker's; two askers answered the address, so it is learned
/// as the address alone, which the sandbox cannot point anywhere.
#[test]
fn a_flow_whose_uid_asked_nothing_is_no_names_when_several_uids_asked() {
    let name = |name: &str, uid| crate::core::trace::Record::Name {
        time: "2026-12-01T10:00:02.500Z".into(),
        name: name.into(),
        qtype: "A".into(),
        answer: "NOERROR".into(),
        addrs: vec!["192.0.2.7".parse().unwrap()],
        ttl: Some(60),
        uid,
    };
    let stub = Some(193);
    let mut t = T::start();
    t.records.push(name("good.example", stub));
    t.records.push(name("hijack.evil.example", Some(65534)));
    let t = t.tcp("192.0.2.7", 443).trace();
    let (out, _) = learned(GUARD, &t);
    assert!(!out.yaml.contains("- domain: \"hijack"), "{}", out.yaml);
    assert!(
        out.yaml.contains("- cidr: \"192.0.2.7/32\""),
        "{}",
        out.yaml
    );
    // One asker (the stub alone): its name, as before.
    let mut t = T::start();
    t.records.push(name("good.example", stub));
    let t = t.tcp("192.0.2.7", 443).trace();
    let (out, _) = learned(GUARD, &t);
    assert!(
        out.yaml
            .contains("- domain: \"good.example\"\n    ports: [443]\n"),
        "{}",
        out.yaml
    );
}
