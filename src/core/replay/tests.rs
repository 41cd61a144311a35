//! The judging rules of `replay`, one test each, with the inputs an attacker would write.

use std::path::Path;

use super::*;
use crate::core::trace::VERSION;

pub(crate) fn policy(text: &str) -> Policy {
    Policy::parse(text, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

pub(crate) const GUARD: &str = "version: 1\nallow:\n  - domain: api.example\n    ports: [443]\n  \
     - domain: \"*.pool.example\"\n    ports: [443]\n  - cidr: 198.51.100.0/24\n    ports: [22]\n\
     deny:\n  - preset: cloud-metadata\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n";

pub(crate) const RESOLVE: &str = "version: 1\nallow:\n  - domain: api.example\n    ports: [443]\n\
     dns:\n  resolvers: [192.0.2.53]\n";

/// A trace builder: each record gets the next second as its time.
#[derive(Default)]
pub(crate) struct T {
    pub(crate) records: Vec<Record>,
}

impl T {
    fn time(&self) -> String {
        format!(
            "2026-12-01T10:{:02}:{:02}.000Z",
            self.records.len() / 60 % 60,
            self.records.len() % 60
        )
    }

    pub(crate) fn start() -> T {
        let mut t = T::default();
        t.records.push(Record::Start {
            time: t.time(),
            version: VERSION,
            mode: "guard".into(),
            policy: "p.yaml".into(),
            audit: true,
        });
        t
    }

    pub(crate) fn name(mut self, name: &str, addrs: &[&str]) -> T {
        self.records.push(Record::Name {
            time: self.time(),
            name: name.into(),
            qtype: "A".into(),
            answer: "NOERROR".into(),
            addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
            ttl: Some(60),
            uid: Some(1001),
        });
        self
    }

    pub(crate) fn typed(mut self, name: &str, qtype: &str) -> T {
        self.records.push(Record::Name {
            time: self.time(),
            name: name.into(),
            qtype: qtype.into(),
            answer: "NOERROR".into(),
            addrs: vec!["192.0.2.99".parse().unwrap()],
            ttl: Some(60),
            uid: Some(1001),
        });
        self
    }

    pub(crate) fn flow_as(
        mut self,
        protocol: &str,
        dst: &str,
        dport: Option<u16>,
        uid: Option<u32>,
        iif: Option<&str>,
    ) -> T {
        let dst: IpAddr = dst.parse().unwrap();
        self.records.push(Record::Flow {
            time: self.time(),
            family: if dst.is_ipv4() { "ipv4" } else { "ipv6" }.into(),
            protocol: protocol.into(),
            dst,
            dport,
            uid,
            iif: iif.map(str::to_string),
        });
        self
    }

    pub(crate) fn tcp(self, dst: &str, port: u16) -> T {
        self.flow_as("tcp", dst, Some(port), Some(1001), None)
    }

    pub(crate) fn udp(self, dst: &str, port: u16) -> T {
        self.flow_as("udp", dst, Some(port), Some(1001), None)
    }

    /// The trace of a run that stopped cleanly: it ends with an `end` line.
    pub(crate) fn trace(mut self) -> Trace {
        if !matches!(self.records.last(), Some(Record::End { .. })) {
            self.records.push(Record::End {
                time: "2026-12-01T12:00:00.000Z".into(),
                lost: 0,
            });
        }
        Trace {
            records: self.records,
        }
    }
}

fn verdicts(policy: &Policy, trace: &Trace) -> Vec<FlowVerdict> {
    judge(policy, trace)
        .flows
        .into_iter()
        .map(|f| f.verdict)
        .collect()
}

fn refused(why: FlowRefusal) -> FlowVerdict {
    FlowVerdict::Refused(why)
}

#[test]
fn guard_mode_refuses_names_outside_the_policy_whatever_their_spelling() {
    let p = policy(GUARD);
    let t = T::start()
        .name("API.Example.", &["192.0.2.7"])
        .name("x.pool.example", &[])
        .name("a.b.pool.example", &[])
        .name("pool.example", &[])
        .name("c2VjcmV0.attacker.example.", &[])
        .name("a\\.b.api.example", &[])
        .typed("api.example", "any")
        .trace();
    let j = judge(&p, &t);
    let got: Vec<String> = j
        .names
        .iter()
        .map(|n| match &n.verdict {
            NameVerdict::Allowed(_) => "allowed".to_string(),
            NameVerdict::Refused(why) => why.to_string(),
            NameVerdict::NotJudged(_) => "not judged".to_string(),
        })
        .collect();
    assert_eq!(
        got,
        [
            "allowed",
            "allowed",
            "not in the policy",
            "not in the policy",
            "not in the policy",
            "not a name a policy can allow",
            "type ANY: the guard never forwards it",
        ]
    );
    let r = replay(&p, &t);
    let shown: Vec<&str> = r.refused_names.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(
        shown,
        [
            "a.b.pool.example",
            "a\\.b.api.example",
            "api.example",
            "c2vjcmv0.attacker.example",
            "pool.example"
        ]
    );
    assert!(r.refuses_anything());
}

#[test]
fn a_flow_is_allowed_by_a_name_that_explains_it_on_the_entrys_ports() {
    let p = policy(GUARD);
    let t = T::start()
        .name("api.example", &["192.0.2.7"])
        .tcp("192.0.2.7", 443)
        .tcp("192.0.2.7", 8443)
        .udp("192.0.2.7", 443)
        .tcp("192.0.2.8", 443)
        .tcp("198.51.100.4", 22)
        .tcp("198.51.100.4", 23)
        .trace();
    assert_eq!(
        verdicts(&p, &t),
        [
            FlowVerdict::Allowed(vec![0]),
            refused(FlowRefusal::OtherPortsOnly),
            refused(FlowRefusal::OtherPortsOnly),
            refused(FlowRefusal::NotInPolicy),
            FlowVerdict::Allowed(vec![2]),
            refused(FlowRefusal::OtherPortsOnly),
        ]
    );
}

#[test]
fn a_flow_before_the_answer_or_after_a_refused_name_is_not_explained() {
    let p = policy(GUARD);
    let t = T::start()
        .tcp("192.0.2.7", 443)
        .name("evil.example", &["192.0.2.7"])
        .tcp("192.0.2.7", 443)
        // An allowed wildcard's owner answers with any address it likes: that address is
        // then allowed, on the wildcard's ports only.
        .name("x.pool.example", &["192.0.2.7"])
        .tcp("192.0.2.7", 443)
        .trace();
    assert_eq!(
        verdicts(&p, &t),
        [
            refused(FlowRefusal::NotInPolicy),
            refused(FlowRefusal::NotInPolicy),
            FlowVerdict::Allowed(vec![1]),
        ]
    );
}

#[test]
fn deny_wins_over_an_allowed_name_that_answers_a_denied_address() {
    let p = policy(GUARD);
    let t = T::start()
        .name("api.example", &["169.254.169.254", "64:ff9b::a9fe:a9fe"])
        .tcp("169.254.169.254", 443)
        .tcp("64:ff9b::a9fe:a9fe", 443)
        .trace();
    let denied = refused(FlowRefusal::Denied {
        by: "preset cloud-metadata".into(),
    });
    assert_eq!(verdicts(&p, &t), [denied.clone(), denied]);
    let r = replay(&p, &t);
    assert_eq!(r.refused_flows[0].names, [Arc::from("api.example")]);
    assert!(!FlowRefusal::Denied { by: String::new() }.allow_entry_helps());
}

#[test]
fn answers_the_table_never_takes_explain_nothing() {
    let p = policy(&GUARD.replace("198.51.100.0/24", "224.0.0.0/4"));
    let t = T::start()
        .name("x.pool.example", &["255.255.255.255", "239.1.2.3"])
        .tcp("255.255.255.255", 443)
        .trace();
    assert_eq!(verdicts(&p, &t), [refused(FlowRefusal::NotInPolicy)]);
    let j = judge(&p, &t);
    assert_eq!(j.flows[0].latest_name, None);
}

#[test]
fn an_answer_explains_only_the_addresses_the_table_takes_of_it() {
    let p = policy(GUARD);
    let many: Vec<String> = (0..40).map(|i| format!("198.18.0.{i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let t = T::start()
        .name("x.pool.example", &many)
        .tcp("198.18.0.31", 443)
        .tcp("198.18.0.32", 443)
        .trace();
    assert_eq!(
        verdicts(&p, &t),
        [
            FlowVerdict::Allowed(vec![1]),
            refused(FlowRefusal::NotInPolicy)
        ]
    );
}

#[test]
fn the_essentials_are_not_refusals() {
    let p = policy(GUARD);
    let t = T::start()
        .tcp("127.0.0.1", 8080)
        .udp("127.0.0.53", 53)
        .udp("255.255.255.255", 67)
        .udp("ff02::1:2", 547)
        .flow_as("icmpv6", "ff02::2", None, None, None)
        .flow_as("icmp", "192.0.2.7", None, Some(1001), None)
        .udp("192.0.2.53", 53)
        .udp("198.51.100.53", 53)
        .tcp("198.51.100.53", 853)
        .flow_as("sctp", "192.0.2.7", Some(9), Some(1001), None)
        .trace();
    assert_eq!(
        verdicts(&p, &t),
        [
            FlowVerdict::Essential("loopback"),
            FlowVerdict::Essential("loopback"),
            FlowVerdict::Essential("a DHCP client's request"),
            FlowVerdict::Essential("a DHCP client's request"),
            FlowVerdict::Essential("the kernel's own ICMP (neighbour discovery, errors)"),
            refused(FlowRefusal::IcmpFromProcess),
            refused(FlowRefusal::GuardUpstream),
            // In guard mode DNS elsewhere is refused even where a cidr entry's ports would
            // cover it.
            refused(FlowRefusal::OtherResolver { port: 53 }),
            refused(FlowRefusal::OtherResolver { port: 853 }),
            refused(FlowRefusal::Protocol),
        ]
    );
    // Without the essential, loopback and DHCP are judged like anything else.
    let narrow = policy(&format!("{GUARD}essentials: [established]\n"));
    let v = verdicts(&narrow, &t);
    assert_eq!(v[0], refused(FlowRefusal::NotInPolicy));
    assert_eq!(v[2], refused(FlowRefusal::NotInPolicy));
}

/// The guard's upstream is refused to every socket but the guard's on every port, also
/// where an allow entry covers it (a resolver serves DNS over HTTPS on 443), and as its NAT64
/// image; the rest of the allowed network is not.
#[test]
fn the_guards_upstream_is_refused_on_every_port() {
    let p = policy(&GUARD.replace("198.51.100.0/24", "192.0.2.0/24"));
    let t = T::start()
        .tcp("192.0.2.53", 22)
        .udp("192.0.2.53", 22)
        .tcp("64:ff9b::c000:235", 22)
        .flow_as("sctp", "192.0.2.53", Some(22), Some(1001), None)
        .tcp("192.0.2.54", 22)
        .trace();
    assert_eq!(
        verdicts(&p, &t),
        [
            refused(FlowRefusal::GuardUpstream),
            refused(FlowRefusal::GuardUpstream),
            refused(FlowRefusal::GuardUpstream),
            refused(FlowRefusal::GuardUpstream),
            FlowVerdict::Allowed(vec![2]),
        ]
    );
    // Beside a wildcard (whose zone may answer the upstream's address) an entry of the
    // upstream's address alone opens nothing: the table keeps it in the deny set.
    let beside_wildcard = policy(&GUARD.replace("198.51.100.0/24", "192.0.2.53/32"));
    let t = T::start()
        .tcp("192.0.2.53", 22)
        .tcp("192.0.2.53", 443)
        .trace();
    assert_eq!(
        verdicts(&beside_wildcard, &t),
        [
            refused(FlowRefusal::GuardUpstream),
            refused(FlowRefusal::GuardUpstream)
        ]
    );
    // Alone, it opens its ports (the table leaves it out of the deny set).
    let alone = policy(
        &GUARD
            .replace("198.51.100.0/24", "192.0.2.53/32")
            .replace("  - domain: \"*.pool.example\"\n    ports: [443]\n", ""),
    );
    let t = T::start()
        .tcp("192.0.2.53", 22)
        .tcp("192.0.2.53", 443)
        .trace();
    assert_eq!(
        verdicts(&alone, &t),
        [
            FlowVerdict::Allowed(vec![1]),
            refused(FlowRefusal::OtherPortsOnly)
        ]
    );
}

#[test]
fn resolve_mode_judges_no_names_and_takes_only_the_policys_own() {
    let p = policy(RESOLVE);
    let t = T::start()
        .name("api.example", &["192.0.2.7"])
        .name("other.example", &["192.0.2.8"])
        .tcp("192.0.2.7", 443)
        .tcp("192.0.2.8", 443)
        .udp("192.0.2.53", 53)
        .udp("198.51.100.53", 53)
        .tcp("198.51.100.53", 853)
        .trace();
    assert_eq!(
        verdicts(&p, &t),
        [
            FlowVerdict::Allowed(vec![0]),
            refused(FlowRefusal::NotInPolicy),
            FlowVerdict::Essential("DNS to a resolver"),
            refused(FlowRefusal::NotInPolicy),
            refused(FlowRefusal::NotInPolicy),
        ]
    );
    let r = replay(&p, &t);
    assert!(r.refused_names.is_empty());
    // Without `dns.resolvers`, DNS goes to resolv.conf's, which the trace does not name.
    let p = policy("version: 1\nallow:\n  - domain: api.example\n    ports: [443]\n");
    let r = replay(&p, &t);
    assert_eq!(r.unjudged.len(), 1);
    assert_eq!(r.unjudged[0].why, CannotJudge::ResolvConf);
    assert_eq!(r.unjudged[0].example, "udp 192.0.2.53:53");
}

#[test]
fn a_scope_leaves_others_alone_and_says_what_it_cannot_judge() {
    let p = policy(&format!(
        "{GUARD}scope:\n  users: [1001]\n  forward: [docker0]\n"
    ));
    let t = T::start()
        .flow_as("tcp", "192.0.2.9", Some(443), Some(1001), None)
        .flow_as("tcp", "192.0.2.9", Some(443), Some(1002), None)
        .flow_as("tcp", "192.0.2.9", Some(443), None, None)
        .flow_as("tcp", "192.0.2.9", Some(443), None, Some("docker0"))
        .flow_as("tcp", "192.0.2.9", Some(443), None, Some("eth0"))
        .trace();
    assert_eq!(
        verdicts(&p, &t),
        [
            refused(FlowRefusal::NotInPolicy),
            FlowVerdict::Untouched,
            FlowVerdict::CannotJudge(CannotJudge::NoOwner),
            refused(FlowRefusal::NotInPolicy),
            FlowVerdict::Untouched,
        ]
    );
    let r = replay(&p, &t);
    assert_eq!(r.refused_flows.len(), 1);
    assert_eq!(r.refused_flows[0].count, 2);
    assert_eq!(r.refused_flows[0].interfaces, ["docker0"]);
    assert_eq!(r.untouched_flows, 2);
    assert!(r.notes.is_empty());

    let cg = policy(&format!(
        "{GUARD}scope:\n  users: [1001]\n  cgroups: [agent.slice]\n"
    ));
    let v = verdicts(&cg, &t);
    assert_eq!(v[1], FlowVerdict::CannotJudge(CannotJudge::MaybeInCgroup));
    assert!(replay(&cg, &t).notes[0].contains("cgroups"));
    // A scope of bridges only leaves every local flow alone.
    let bridges = policy(&format!("{GUARD}scope:\n  forward: [\"br-*\"]\n"));
    let v = verdicts(&bridges, &t);
    assert_eq!(
        v[..3],
        [
            FlowVerdict::Untouched,
            FlowVerdict::Untouched,
            FlowVerdict::Untouched
        ]
    );
}

#[test]
fn refusals_are_grouped_with_their_names_uids_and_times() {
    let p = policy(GUARD);
    let t = T::start()
        .name("evil.example", &["192.0.2.9"])
        .name("EVIL.example.", &["192.0.2.9"])
        .tcp("192.0.2.9", 443)
        .name("later.example", &["192.0.2.9"])
        .flow_as("tcp", "192.0.2.9", Some(443), Some(1002), None)
        .tcp("192.0.2.9", 80)
        .trace();
    let r = replay(&p, &t);
    assert_eq!(r.refused_names.len(), 2);
    let evil = &r.refused_names[0];
    assert_eq!(
        (
            evil.name.as_str(),
            evil.count,
            evil.first.as_str(),
            evil.last.as_str()
        ),
        (
            "evil.example",
            2,
            "2026-12-01T10:00:01.000Z",
            "2026-12-01T10:00:02.000Z"
        )
    );
    type Shown = (Option<u16>, usize, Vec<String>, Vec<u32>);
    let flows: Vec<Shown> = r
        .refused_flows
        .iter()
        .map(|f| {
            let names = f.names.iter().map(|n| n.to_string()).collect();
            (f.dport, f.count, names, f.uids.clone())
        })
        .collect();
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        flows,
        [
            (
                Some(80),
                1,
                names(&["EVIL.example.", "evil.example", "later.example"]),
                vec![1001]
            ),
            (
                Some(443),
                2,
                names(&["EVIL.example.", "evil.example", "later.example"]),
                vec![1001, 1002]
            ),
        ]
    );
}

#[test]
fn entries_nothing_used_are_listed_with_their_preset_and_lone_wildcards_named() {
    let p = policy(&GUARD.replace("deny:", "include: [npm]\ndeny:"));
    let t = T::start()
        .name("a.pool.example", &["192.0.2.7"])
        .name("A.pool.example.", &["192.0.2.7"])
        .tcp("192.0.2.7", 443)
        .trace();
    let r = replay(&p, &t);
    let unused: Vec<(String, Option<String>)> = r
        .unused
        .iter()
        .map(|u| (u.entry.clone(), u.preset.clone()))
        .collect();
    assert_eq!(
        unused,
        [
            ("api.example tcp 443".to_string(), None),
            ("198.51.100.0/24 tcp 22".to_string(), None),
            (
                "registry.npmjs.org tcp 443".to_string(),
                Some("npm".to_string())
            ),
        ]
    );
    assert_eq!(
        r.narrowable,
        [NarrowableWildcard {
            wildcard: "*.pool.example".into(),
            name: "a.pool.example".into()
        }]
    );
    let t = T::start()
        .name("a.pool.example", &[])
        .name("b.pool.example", &[])
        .trace();
    assert!(replay(&p, &t).narrowable.is_empty());
}

/// Every name answers the same address and a flow follows each: judging a flow must not
/// walk the names before it (this would take hours if it did).
#[test]
fn a_huge_trace_of_one_shared_address_is_judged_in_one_pass() {
    let p = policy(GUARD);
    let mut records = Vec::with_capacity(400_001);
    records.extend(T::start().records);
    let base = T::start()
        .name("x", &["192.0.2.7"])
        .tcp("192.0.2.7", 443)
        .records;
    for i in 0..50_000 {
        let mut name = base[1].clone();
        if let Record::Name { name: n, .. } = &mut name {
            *n = format!("n{i}.evil.example");
        }
        records.push(name);
        records.push(base[2].clone());
    }
    let t = Trace { records };
    let r = replay(&p, &t);
    assert_eq!(r.refused_names.len(), 50_000);
    assert_eq!(r.refused_flows.len(), 1);
    assert_eq!(r.refused_flows[0].count, 50_000);
    assert_eq!(r.refused_flows[0].names.len(), MAX_NAMES_SHOWN);
    assert_eq!(r.refused_flows[0].more_names, 50_000 - MAX_NAMES_SHOWN);
}

/// The same, each flow on a port of its own: every refused flow is a group of its own, and
/// each group's names are a longer prefix of the address's names. Listing them must not copy
/// that prefix once per group (50,000 groups of up to 50,000 names each).
#[test]
fn a_huge_trace_of_one_shared_address_on_many_ports_lists_names_in_one_pass() {
    let p = policy(GUARD);
    let n: u16 = 50_000;
    let mut records = Vec::with_capacity(2 * usize::from(n) + 1);
    records.extend(T::start().records);
    let base = T::start()
        .name("x", &["192.0.2.7"])
        .tcp("192.0.2.7", 443)
        .records;
    for i in 0..n {
        let mut name = base[1].clone();
        if let Record::Name { name: na, .. } = &mut name {
            // Later names sort first: the shown ones change with every group.
            *na = format!("n{:05}.evil.example", n - i);
        }
        let mut flow = base[2].clone();
        if let Record::Flow { dport, .. } = &mut flow {
            *dport = Some(i + 1);
        }
        records.push(name);
        records.push(flow);
    }
    let r = replay(&p, &Trace { records });
    assert_eq!(r.refused_flows.len(), usize::from(n));
    for (i, f) in r.refused_flows.iter().enumerate() {
        // The flow on port i + 1 followed i + 1 names: the last of them sort first.
        let before = i + 1;
        let shown = before.min(MAX_NAMES_SHOWN);
        assert_eq!(f.dport, Some(before as u16));
        assert_eq!(f.names.len(), shown, "{f:?}");
        assert_eq!(f.more_names, before - shown);
        let first = usize::from(n) - i;
        assert_eq!(&*f.names[0], format!("n{first:05}.evil.example"));
        assert!(f.names.windows(2).all(|w| w[0] < w[1]));
    }
}

#[test]
fn a_trace_that_lost_records_says_so_in_the_report() {
    let mut t = T::start().tcp("192.0.2.7", 443);
    t.records.push(Record::End {
        time: "2026-12-01T11:00:00.000Z".into(),
        lost: 3,
    });
    let report = replay(&policy(GUARD), &t.trace());
    assert!(
        report.notes.iter().any(|n| n.contains("lost 3 records")),
        "{:?}",
        report.notes
    );
    assert!(!report.complete());
    let whole = replay(&policy(GUARD), &T::start().tcp("192.0.2.7", 443).trace());
    assert!(!whole.notes.iter().any(|n| n.contains("lost")));
    assert!(whole.complete());
    // A run that did not stop cleanly left no end line: said, and not complete.
    let mut cut = T::start().tcp("192.0.2.7", 443).trace();
    cut.records.pop();
    let cut = replay(&policy(GUARD), &cut);
    assert!(!cut.ended && !cut.complete());
    assert!(
        cut.notes.iter().any(|n| n.contains("no end line")),
        "{:?}",
        cut.notes
    );
}
