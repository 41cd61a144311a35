//! What the probe's unit tests share: policies, options, table views, guard answers and the
//! guard-mode plan.

use std::path::Path;
use std::time::Duration;

use crate::core::policy::{Policy, Preset};
use crate::core::resolution::{ResolvedAddr, ResolvedHost};

use super::attempt::Ctx;
use super::guard_lookup::{Asked, GuardLookup};
use super::options::{ProbeOptions, SystemResolvers, TableFacts, TableView};
use super::plan::{Plan, Step};

pub(super) fn ctx() -> Ctx {
    Ctx {
        timeout: Duration::from_secs(2),
        udp_wait: Duration::from_secs(1),
        fence_router: Vec::new(),
    }
}

pub(super) fn policy(text: &str) -> Policy {
    Policy::parse(text, Path::new("p.yaml")).expect("valid")
}

pub(super) fn options(resolvers: &[&str], table: TableView) -> ProbeOptions {
    ProbeOptions {
        resolvers: resolvers.iter().map(|r| r.parse().unwrap()).collect(),
        timeout: Duration::from_secs(1),
        uid: 65534,
        table,
        system: None,
        guard_socket: None,
        service_table: false,
        outside_scope: None,
        fence_router: Vec::new(),
    }
}

pub(super) const GUARD_POLICY: &str = "version: 1\nallow:\n  - domain: api.example.com\n    ports: [443]\n  - domain: \"*.cdn.example.com\"\n    ports: [443]\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\nprobe:\n  rogue_resolvers: [192.0.2.54]\n  blocked: [\"paste.example.com:443\"]\n";

pub(super) fn guard_options(table: TableView) -> ProbeOptions {
    ProbeOptions {
        system: Some(SystemResolvers {
            path: "/etc/resolv.conf".into(),
            nameservers: Ok(vec!["127.0.0.53".parse().unwrap()]),
        }),
        ..options(&["192.0.2.53"], table)
    }
}

pub(super) fn table_with_uid(uid: u32) -> TableView {
    TableView::Read(TableFacts {
        dns_uids: vec![uid],
        dns_marks: vec![crate::core::policy::DEFAULT_GUARD_MARK],
        dns_for_everyone: false,
        denied: Preset::DnsOverHttps.networks(),
        resolved: Vec::new(),
        allowed: Vec::new(),
        dns: Vec::new(),
        undecodable: Vec::new(),
    })
}

pub(super) fn answered(rcode: &'static str, addrs: &[&str]) -> Asked {
    Asked::Answered {
        rcode,
        addrs: addrs
            .iter()
            .map(|a| ResolvedAddr {
                addr: a.parse().unwrap(),
                ttl: 60,
            })
            .collect(),
    }
}

pub(super) fn lookup(name: &str, a: Asked, aaaa: Asked) -> GuardLookup {
    GuardLookup {
        name: name.parse().unwrap(),
        a,
        aaaa,
    }
}

/// The guard-mode plan's checks: (outcome or "attempt", check, reason or on_fail note).
pub(super) fn guard_plan(
    p: &Policy,
    options: &ProbeOptions,
    lookups: &[GuardLookup],
    exfil: &str,
) -> Vec<(String, String, String)> {
    let hosts: Vec<ResolvedHost> = lookups.iter().map(GuardLookup::host).collect();
    let mut plan = Plan::new(p, options, &hosts, lookups);
    let guard = p.dns.guard.as_ref().expect("guard mode");
    plan.system_resolver(guard);
    plan.guard_servers(guard);
    plan.upstream();
    plan.allowed();
    plan.denied();
    plan.blocked();
    plan.rogue_resolvers();
    plan.guarded_exfiltration(Some(Ok(exfil.parse().unwrap())));
    plan.steps
        .into_iter()
        .map(|s| match s {
            Step::Done(c) => (c.outcome.to_string(), c.check, c.reason),
            Step::Attempt(a) => ("attempt".into(), a.check, a.on_fail.unwrap_or_default()),
        })
        .collect()
}

pub(super) fn find<'a>(
    checks: &'a [(String, String, String)],
    name: &str,
) -> &'a (String, String, String) {
    checks
        .iter()
        .find(|c| c.1 == name)
        .unwrap_or_else(|| panic!("no check {name} in {checks:#?}"))
}
