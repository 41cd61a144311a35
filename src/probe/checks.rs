//! The checks of both DNS modes: resolvers, allowed entries, denied presets and networks,
//! blocked targets, rogue resolvers, DNS exfiltration, the installed resolved elements and
//! link-layer frames, tun and tap devices.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::IpNet;

use crate::core::guard_identity::GuardIdentity;
use crate::core::plan::DNS_PORT;
use crate::core::policy::{Allow, DenyOrigin, DomainName, L4Proto, Preset, ProbeHost, Target};
use crate::core::ruleset::{Elements, Family, SetId, SetRole, TABLE, Tuple, fmt_tuple};

use super::guard_lookup::GuardLookup;
use super::kernel_sockets::{kernel_sockets_check, try_families};
use super::link_layer::{CAP_NET_ADMIN, capability_effective, link_layer_access, link_layer_check};
use super::options::TableView;
use super::other_protocols::OtherProto;
use super::plan::{Attempt, Expect, Kind, Plan, join, ports_to_probe};
use super::report::{Check, Outcome};
use super::tun::{tun_access, tun_check};

/// The well-known metadata endpoints probed for the `cloud-metadata` preset: AWS/GCP/Azure's
/// link-local address and the IPv6 ones of AWS, GCP and Scaleway, on the HTTP port they serve.
/// Where one does not exist the attempt cannot leave the host, which passes too.
const METADATA_TARGETS: [SocketAddr; 4] = [
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)), 80),
    SocketAddr::new(
        IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
        80,
    ),
    SocketAddr::new(
        IpAddr::V6(Ipv6Addr::new(0xfd20, 0xce, 0, 0, 0, 0, 0, 0x254)),
        80,
    ),
    SocketAddr::new(
        IpAddr::V6(Ipv6Addr::new(0xfd00, 0x42, 0, 0, 0, 0, 0, 0x42)),
        80,
    ),
];

impl<'a> Plan<'a> {
    /// DNS to each allowed resolver works over UDP and TCP (TCP carries large answers).
    pub(super) fn resolvers(&mut self) {
        for &server in &self.options.resolvers {
            for proto in [L4Proto::Udp, L4Proto::Tcp] {
                let target = SocketAddr::new(server, DNS_PORT);
                self.attempt(Attempt {
                    check: format!("resolver {} {target}", proto.name()),
                    kind: Kind::Dns(proto),
                    target,
                    expect: Expect::Answer,
                    note: None,
                    on_fail: None,
                    dns_name: None,
                });
            }
        }
    }

    pub(super) fn allowed(&mut self) {
        let policy = self.policy;
        for allow in &policy.allow {
            match &allow.target {
                Target::Domain(name) => {
                    let Some(host) = self.host(name) else {
                        continue; // every allowed name was resolved
                    };
                    let label = format!("allowed name {name}");
                    if host.addrs.is_empty() {
                        let reason = format!(
                            "did not resolve through {}: {}",
                            self.resolver_list(),
                            host.why_unresolved()
                        );
                        self.done(Check::new(Outcome::Fail, label, reason));
                        continue;
                    }
                    let addrs: Vec<IpAddr> = host.addrs.iter().map(|a| a.addr).collect();
                    let mut reason = format!(
                        "resolved to {} through {}",
                        join(&addrs),
                        self.resolver_list()
                    );
                    let outcome = if host.errors.is_empty() {
                        Outcome::Pass
                    } else {
                        reason.push_str(&format!(", only partly: {}", host.errors.join("; ")));
                        Outcome::Warn
                    };
                    self.done(Check::new(outcome, label, reason));
                    for addr in addrs {
                        self.allowed_addr(allow, &format!("{name} "), addr);
                    }
                }
                Target::Cidr(net) if net.prefix_len() == net.max_prefix_len() => {
                    self.allowed_addr(allow, "", net.addr());
                }
                Target::Cidr(net) => self.done(Check::new(
                    Outcome::Skip,
                    format!("allowed network {net}"),
                    "not probed: the probe tries names and single addresses, not networks",
                )),
                Target::Wildcard(w) => self.done(Check::new(
                    Outcome::Skip,
                    format!("allowed names {w}"),
                    "not probed: a wildcard names no single host",
                )),
            }
        }
    }

    /// The attempts for one allowed address: each protocol, each single port, and both ends
    /// of each range (where an off-by-one in an interval would show).
    fn allowed_addr(&mut self, allow: &Allow, name: &str, addr: IpAddr) {
        let denied = self.policy.denied_by(addr).map(|d| {
            format!(
                "expected: the address lies in the denied {} (deny wins)",
                d.describe()
            )
        });
        for &proto in allow.protocol.l4protos() {
            for range in &allow.ports {
                for (port, strict) in ports_to_probe(*range) {
                    let target = SocketAddr::new(addr, port);
                    let mut check = format!("allowed {} {name}{target}", proto.name());
                    if !range.is_single() {
                        check.push_str(&format!(" (end of {range})"));
                    }
                    self.attempt(Attempt {
                        check,
                        kind: match proto {
                            L4Proto::Tcp => Kind::Tcp,
                            L4Proto::Udp => Kind::Udp,
                        },
                        target,
                        expect: if denied.is_some() {
                            self.fence_refuses()
                        } else {
                            Expect::Reach { strict }
                        },
                        note: denied.clone(),
                        on_fail: None,
                        dns_name: None,
                    });
                }
            }
        }
    }

    /// Attempts that must be refused: TCP and UDP ("denied tcp cloud-metadata
    /// 169.254.169.254:80"), and every other transport an unprivileged process can send
    /// (UDP-Lite, an echo request, SCTP, DCCP): the policy allows none of those anywhere, so
    /// each one that leaves is a hole (a hand-added element, a changed rule).
    fn refused_pair(&mut self, what: &str, name: Option<&str>, target: SocketAddr) {
        let name = name.map(|n| format!("{n} ")).unwrap_or_default();
        for (kind, proto) in [(Kind::Tcp, L4Proto::Tcp), (Kind::Udp, L4Proto::Udp)] {
            self.attempt(Attempt {
                check: format!("{what} {} {name}{target}", proto.name()),
                kind,
                target,
                expect: self.fence_refuses(),
                note: None,
                on_fail: self.allowed_by(target, proto),
                dns_name: None,
            });
        }
        for other in OtherProto::ALL {
            let dest = if other.has_ports() {
                target.to_string()
            } else {
                target.ip().to_string()
            };
            self.attempt(Attempt {
                check: format!("{what} {} {name}{dest}", other.name(target)),
                kind: Kind::Other(other),
                target,
                expect: self.fence_refuses(),
                note: None,
                on_fail: None,
                dns_name: None,
            });
        }
    }

    /// The allow entry that lets `target` through, for a refusal check that fails: a deny
    /// the policy forgot. `None` when the policy denies it or no entry covers it (then the
    /// hole is not the policy's: a changed table, or a bug).
    fn allowed_by(&self, target: SocketAddr, proto: L4Proto) -> Option<String> {
        let addr = target.ip();
        if self.policy.denied_by(addr).is_some() {
            return None;
        }
        self.policy.allow.iter().find_map(|allow| {
            let port_ok = allow.protocol.l4protos().contains(&proto)
                && allow
                    .ports
                    .iter()
                    .any(|r| (r.first..=r.last).contains(&target.port()));
            let entry = match &allow.target {
                Target::Cidr(net) if net.contains(&addr) => format!("cidr {net}"),
                Target::Domain(name)
                    if self
                        .host(name)
                        .is_some_and(|h| h.addrs.iter().any(|a| a.addr == addr)) =>
                {
                    format!("domain {name}")
                }
                // The guard allows the addresses it answers for any name the wildcard covers.
                Target::Wildcard(w)
                    if self
                        .hosts
                        .iter()
                        .any(|h| w.matches(&h.name) && h.addrs.iter().any(|a| a.addr == addr)) =>
                {
                    format!("domain {w}")
                }
                _ => return None,
            };
            port_ok.then(|| format!("the policy allows it: allow entry {entry}"))
        })
    }

    pub(super) fn denied(&mut self) {
        let policy = self.policy;
        for deny in &policy.deny {
            match deny.origin {
                DenyOrigin::Preset(Preset::CloudMetadata) => {
                    for target in METADATA_TARGETS {
                        self.refused_pair("denied", Some("cloud-metadata"), target);
                    }
                }
                DenyOrigin::Preset(Preset::DnsOverHttps) => self.doh_preset(),
                DenyOrigin::Preset(preset) => self.done(Check::new(
                    Outcome::Skip,
                    format!("denied preset {}", preset.name()),
                    "not probed: it has no well-known address; list one under probe.blocked \
                     to check it",
                )),
                DenyOrigin::Cidr => self.done(Check::new(
                    Outcome::Skip,
                    format!("denied {}", deny.describe()),
                    "not probed: list an address of it under probe.blocked to check it",
                )),
            }
        }
    }

    /// Every element of the installed table's resolved sets must be one the policy explains:
    /// an allowed name's, on its ports, with a timeout within the policy's cap where the
    /// service keeps the table. Each one that is not fails, named (a PASS would add nothing
    /// a human reads; a table that cannot be read is checked by the other checks).
    pub(super) fn resolved_elements(&mut self) {
        let TableView::Read(facts) = &self.options.table else {
            return;
        };
        // Only the service gives elements timeouts (and in guard mode only it adds any).
        let service_owned = self.policy.dns.guard.is_some()
            || self.options.service_table
            || facts.resolved.iter().any(|t| t.timeout_ms.is_some());
        let failed: Vec<Check> = facts
            .resolved
            .iter()
            .filter_map(|t| {
                let why = crate::core::plan::unexplained_element(self.policy, t, service_owned)?;
                Some(Check::new(
                    Outcome::Fail,
                    format!(
                        "resolved element {}",
                        crate::core::ruleset::fmt_tuple(&t.tuple)
                    ),
                    format!(
                        "the policy does not explain it: {why} ({})",
                        crate::core::ruleset::fmt_timed(t)
                    ),
                ))
            })
            .collect();
        for check in failed {
            self.done(check);
        }
    }

    /// Every element of the installed allow sets must be one a `cidr:` entry of the policy
    /// writes, every element of the DNS sets one of the resolvers on a DNS port, and every
    /// element of every set one egress-fence can read: an element for another protocol
    /// (`0.0.0.0/0 . udplite . 0-65535`), a catch-all or a range of protocols opens what no
    /// traffic check may happen to try. Each one fails, named.
    pub(super) fn table_elements(&mut self) {
        let TableView::Read(facts) = &self.options.table else {
            return;
        };
        // The sets' elements do not depend on the guard's uid, only on its mode and upstream.
        let guard = GuardIdentity::of_policy(self.policy, crate::core::plan::NO_UID);
        let planned = crate::core::plan::plan_elements(
            self.policy,
            &self.options.resolvers,
            guard.as_ref(),
            &[],
            [],
        );
        let planned_tuples = |role: SetRole| -> Vec<Tuple> {
            Family::BOTH
                .into_iter()
                .filter_map(|family| match planned.set(SetId::new(role, family)) {
                    Some(set) => match &set.elements {
                        Elements::Tuples(t) => Some(t.clone()),
                        _ => None,
                    },
                    None => None,
                })
                .flatten()
                .collect()
        };
        let mut checks = Vec::new();
        let sets = [
            (
                SetRole::Allow,
                &facts.allowed,
                "no cidr entry allows that network, protocol and port",
            ),
            (
                SetRole::Dns,
                &facts.dns,
                "it is not DNS to one of the resolvers (the policy's, else resolv.conf's; in \
                 guard mode its upstream)",
            ),
        ];
        for (role, live_tuples, why) in sets {
            let explaining = planned_tuples(role);
            for live in live_tuples {
                // The kernel may store what `apply` wrote merged or split: covered is
                // explained.
                let explained = explaining.iter().any(|p| {
                    p.proto == live.proto
                        && p.net.contains(&live.net)
                        && p.ports.first <= live.ports.first
                        && live.ports.last <= p.ports.last
                });
                if !explained {
                    let set = SetId::new(role, Family::of_net(&live.net)).name();
                    checks.push(Check::new(
                        Outcome::Fail,
                        format!("{set} element {}", fmt_tuple(live)),
                        format!("the policy does not explain it: {why}"),
                    ));
                }
            }
        }
        for (set, element) in &facts.undecodable {
            checks.push(Check::new(
                Outcome::Fail,
                format!("{set} element {element}"),
                "egress-fence never writes such an element (another protocol, a catch-all, a \
                 range of protocols), so the policy does not explain it",
            ));
        }
        for check in checks {
            self.done(check);
        }
    }

    /// Whether this process can write link-layer frames (see [`link_layer_check`]).
    pub(super) fn link_layer(&mut self) {
        self.done(link_layer_check(
            &link_layer_access(),
            capability_effective(CAP_NET_ADMIN),
        ));
    }

    /// Whether this process may attach a tun or tap device (see [`tun_check`]).
    pub(super) fn tun_devices(&mut self) {
        let net_admin = capability_effective(CAP_NET_ADMIN);
        self.done(tun_check(&tun_access(net_admin == Some(true)), net_admin));
    }

    /// Whether this process may open a socket whose packets the kernel sends from a socket
    /// of its own (see [`kernel_sockets_check`]).
    pub(super) fn kernel_sockets(&mut self) {
        let fenced_by_socket =
            self.policy.scope.as_ref().is_some_and(|s| {
                !(s.users.is_empty() && s.groups.is_empty() && s.cgroups.is_empty())
            });
        self.done(kernel_sockets_check(&try_families(), fenced_by_socket));
    }

    /// The public DNS-over-HTTPS resolvers are never contacted: the installed table's deny
    /// sets must hold every network of the preset.
    fn doh_preset(&mut self) {
        let preset = Preset::DnsOverHttps;
        let label = format!("denied preset {}", preset.name());
        let not_probed = "not probed: its addresses are public resolvers, which the probe never \
                          contacts";
        let check = match &self.options.table {
            TableView::Read(facts) => {
                let networks = preset.networks();
                let missing: Vec<&IpNet> = networks
                    .iter()
                    .filter(|n| !facts.denied.iter().any(|d| d.contains(*n)))
                    .collect();
                if missing.is_empty() {
                    Check::new(
                        Outcome::Pass,
                        label,
                        format!(
                            "the installed table denies all {} of its networks ({not_probed})",
                            networks.len()
                        ),
                    )
                } else {
                    Check::new(
                        Outcome::Fail,
                        label,
                        format!(
                            "the installed table does not deny {} of its {} networks ({}{}): \
                             DNS over HTTPS to them gets around the guard",
                            missing.len(),
                            networks.len(),
                            missing
                                .iter()
                                .take(4)
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                                .join(", "),
                            if missing.len() > 4 { ", ..." } else { "" }
                        ),
                    )
                }
            }
            TableView::NotInstalled => Check::new(
                Outcome::Fail,
                label,
                format!("table inet {TABLE} is not installed, so nothing denies it"),
            ),
            TableView::Unreadable(e) => Check::new(
                Outcome::Skip,
                label,
                format!(
                    "{not_probed}, and the table that denies them cannot be read here ({e}); run \
                     the probe as root once to check the table"
                ),
            ),
            TableView::NotRead => Check::new(
                Outcome::Skip,
                label,
                format!("{not_probed}; the table was not read"),
            ),
        };
        self.done(check);
    }

    pub(super) fn blocked(&mut self) {
        let policy = self.policy;
        for blocked in &policy.probe.blocked {
            match &blocked.host {
                ProbeHost::Addr(addr) => {
                    self.refused_pair("blocked", None, SocketAddr::new(*addr, blocked.port))
                }
                ProbeHost::Name(name) => {
                    let Some(host) = self.host(name) else {
                        continue;
                    };
                    let refused = self.lookup(name).and_then(GuardLookup::refusal);
                    if let Some(rcode) = refused.filter(|_| self.covering_entry(name).is_none()) {
                        let reason = format!(
                            "{} refused it ({rcode}): nothing here can look it up; list its \
                             addresses as HOST:PORT to check them too",
                            self.resolver_list()
                        );
                        self.done(Check::new(
                            Outcome::Pass,
                            format!("blocked name {name}"),
                            reason,
                        ));
                        continue;
                    }
                    if host.addrs.is_empty() {
                        let reason = format!(
                            "did not resolve through {} ({}): nothing to probe; list its \
                             addresses as HOST:PORT to check them",
                            self.resolver_list(),
                            host.why_unresolved()
                        );
                        self.done(Check::new(
                            Outcome::Warn,
                            format!("blocked name {name}"),
                            reason,
                        ));
                        continue;
                    }
                    for a in &host.addrs {
                        let target = SocketAddr::new(a.addr, blocked.port);
                        self.refused_pair("blocked", Some(name.as_str()), target);
                    }
                }
            }
        }
    }

    pub(super) fn rogue_resolvers(&mut self) {
        let policy = self.policy;
        for &server in &policy.probe.rogue_resolvers {
            if self.options.resolvers.contains(&server) {
                let which = match policy.dns.guard {
                    Some(_) => "the guard's upstream resolvers (checked above)",
                    None => "the allowed resolvers",
                };
                self.done(Check::new(
                    Outcome::Warn,
                    format!("rogue resolver {server}"),
                    format!("not probed: it is one of {which}"),
                ));
                continue;
            }
            for proto in [L4Proto::Udp, L4Proto::Tcp] {
                let target = SocketAddr::new(server, DNS_PORT);
                self.attempt(Attempt {
                    check: format!("rogue resolver {} {target}", proto.name()),
                    kind: Kind::Dns(proto),
                    target,
                    expect: self.fence_refuses(),
                    note: None,
                    on_fail: None,
                    dns_name: None,
                });
            }
        }
    }

    pub(super) fn exfiltration(&mut self, name: Option<Result<DomainName, String>>) {
        let check = match name {
            None => Check::new(
                Outcome::Skip,
                "dns exfiltration",
                "no probe.exfil_domain: set it to a domain with a wildcard record to check \
                 whether DNS can carry data out",
            ),
            Some(Err(e)) => Check::new(Outcome::Warn, "dns exfiltration", e),
            Some(Ok(name)) => {
                let label = format!("dns exfiltration {name}");
                match self.host(&name) {
                    None => Check::new(Outcome::Warn, label, "the name was not looked up"),
                    Some(host) if !host.addrs.is_empty() => {
                        let addrs: Vec<IpAddr> = host.addrs.iter().map(|a| a.addr).collect();
                        Check::new(
                            Outcome::Warn,
                            label,
                            format!(
                                "a random name resolved to {} through {}: the allowed \
                                 resolvers answer arbitrary names, so DNS queries can carry \
                                 data out (a warning in resolve mode; `dns.mode: guard` \
                                 closes it)",
                                join(&addrs),
                                self.resolver_list()
                            ),
                        )
                    }
                    Some(host) if !host.errors.is_empty() => Check::new(
                        Outcome::Warn,
                        label,
                        format!("inconclusive: {}", host.errors.join("; ")),
                    ),
                    Some(host) => Check::new(
                        Outcome::Pass,
                        label,
                        format!(
                            "a random name under it did not resolve through {}: {}",
                            self.resolver_list(),
                            host.why_unresolved()
                        ),
                    ),
                }
            }
        };
        self.done(check);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::PortRange;
    use crate::probe::options::TableFacts;
    use crate::probe::plan::Step;
    use crate::probe::testing::*;

    fn steps(plan: Plan<'_>) -> Vec<(String, String)> {
        plan.steps
            .into_iter()
            .map(|s| match s {
                Step::Done(c) => (c.outcome.to_string(), c.check),
                Step::Attempt(a) => ("attempt".into(), a.check),
            })
            .collect()
    }

    #[test]
    fn refused_targets_are_tried_over_every_transport() {
        let p =
            policy("version: 1\nprobe:\n  blocked: [\"203.0.113.11:443\", \"[2001:db8::9]:80\"]\n");
        let options = options(&["192.0.2.53"], TableView::NotRead);
        let mut plan = Plan::new(&p, &options, &[], &[]);
        plan.blocked();
        let names: Vec<String> = steps(plan).into_iter().map(|(_, c)| c).collect();
        assert_eq!(
            names,
            [
                "blocked tcp 203.0.113.11:443",
                "blocked udp 203.0.113.11:443",
                "blocked udplite 203.0.113.11:443",
                "blocked icmp 203.0.113.11",
                "blocked sctp 203.0.113.11:443",
                "blocked dccp 203.0.113.11:443",
                "blocked tcp [2001:db8::9]:80",
                "blocked udp [2001:db8::9]:80",
                "blocked udplite [2001:db8::9]:80",
                "blocked icmpv6 2001:db8::9",
                "blocked sctp [2001:db8::9]:80",
                "blocked dccp [2001:db8::9]:80",
            ]
        );
    }

    #[test]
    fn allow_elements_must_be_the_policys_and_readable() {
        let p = policy(
            "version: 1\nallow:\n  - cidr: 203.0.113.0/24\n    ports: [443]\n    protocol: tcp\n",
        );
        let tuple = |net: &str, first, last| Tuple {
            net: net.parse().unwrap(),
            proto: L4Proto::Tcp,
            ports: PortRange { first, last },
        };
        let facts = TableFacts {
            allowed: vec![
                tuple("203.0.113.0/24", 443, 443),
                // Part of what the entry writes, as a kernel may store it.
                tuple("203.0.113.0/25", 443, 443),
                tuple("203.0.113.0/24", 443, 444),
                tuple("198.18.0.0/15", 1, 65535),
            ],
            dns: vec![
                Tuple {
                    proto: L4Proto::Udp,
                    ..tuple("192.0.2.53/32", 53, 53)
                },
                // DNS to everyone, and a resolver on another port.
                Tuple {
                    proto: L4Proto::Udp,
                    ..tuple("0.0.0.0/0", 53, 53)
                },
                tuple("192.0.2.53/32", 443, 443),
            ],
            undecodable: vec![("allow4".into(), "0.0.0.0/0 . udplite . 0-65535".into())],
            ..TableFacts::default()
        };
        let options = options(&["192.0.2.53"], TableView::Read(facts));
        let mut plan = Plan::new(&p, &options, &[], &[]);
        plan.table_elements();
        assert_eq!(
            steps(plan),
            [
                (
                    "FAIL".into(),
                    "allow4 element 203.0.113.0/24 . tcp . 443-444".into()
                ),
                (
                    "FAIL".into(),
                    "allow4 element 198.18.0.0/15 . tcp . 1-65535".into()
                ),
                ("FAIL".into(), "dns4 element 0.0.0.0/0 . udp . 53".into()),
                ("FAIL".into(), "dns4 element 192.0.2.53 . tcp . 443".into()),
                (
                    "FAIL".into(),
                    "allow4 element 0.0.0.0/0 . udplite . 0-65535".into()
                ),
            ]
        );
        // A table that cannot be read is judged by the other checks.
        let unread = super::super::testing::options(&["192.0.2.53"], TableView::NotRead);
        let mut plan = Plan::new(&p, &unread, &[], &[]);
        plan.table_elements();
        assert!(plan.steps.is_empty());
    }
}
