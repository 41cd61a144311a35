//! The checks of guard mode: resolv.conf names the guard, the guard answers, only the guard
//! reaches its upstream resolvers ([`UpstreamAccess`]), and names outside the policy are
//! refused without being forwarded.

use std::net::{IpAddr, SocketAddr};

use crate::core::plan::{DNS_PORT, DOT_PORT};
use crate::core::policy::{DomainName, GuardSettings, L4Proto};
use crate::core::ruleset::TABLE;

use super::options::TableView;
use super::plan::{Attempt, DEFAULT_EXFIL_ZONE, Expect, Kind, Plan, join, join_sockets};
use super::report::{Check, Outcome};

/// Who the installed table lets reach the upstream resolvers.
#[derive(Debug, Clone, PartialEq, Eq)]
enum UpstreamAccess {
    /// Only sockets of these uids (`meta skuid`) that carry one of these marks (`meta
    /// mark`; none: the uid alone); `source` says where that was learned.
    Uids {
        uids: Vec<u32>,
        marks: Vec<u32>,
        source: String,
    },
    /// Every uid: the table is a resolve-mode one.
    Everyone,
    /// No table: nothing is refused.
    NoTable,
    /// Not known, and why.
    Unknown(String),
}

impl UpstreamAccess {
    /// Said when an attempt of `uid` got through.
    fn why_through(&self, uid: u32) -> String {
        match self {
            UpstreamAccess::Uids { uids, source, .. } if uids.is_empty() => {
                format!("no uid may reach it (learned from {source}), yet uid {uid} did")
            }
            UpstreamAccess::Uids {
                uids,
                marks,
                source,
            } => format!(
                "only sockets of uid {}{} may reach it (learned from {source}), yet this probe \
                 (uid {uid}, its sockets unmarked) got through: another rule lets it",
                uids.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                if marks.is_empty() {
                    String::new()
                } else {
                    format!(
                        " marked {}",
                        marks
                            .iter()
                            .map(|m| format!("{m:#x}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
            ),
            UpstreamAccess::Everyone => "the installed table lets every uid reach the \
                 resolvers: it is not the guard's table (applied in resolve mode?); \
                 `egress-fence run` in guard mode installs it"
                .into(),
            UpstreamAccess::NoTable => format!("table inet {TABLE} is not installed"),
            UpstreamAccess::Unknown(why) => format!(
                "this probe's uid {uid} could not be compared with the guard's: the table {why}"
            ),
        }
    }
}

impl<'a> Plan<'a> {
    /// Guard mode: resolv.conf should name the guard, or programs here resolve nothing.
    pub(super) fn system_resolver(&mut self, guard: &GuardSettings) {
        let Some(system) = &self.options.system else {
            return;
        };
        let label = "system resolver";
        let guard_ips: Vec<IpAddr> = guard
            .listen
            .iter()
            .filter(|l| l.port() == DNS_PORT)
            .map(SocketAddr::ip)
            .collect();
        let serves = |ns: &IpAddr| {
            guard_ips
                .iter()
                .any(|g| g == ns || (g.is_unspecified() && g.is_ipv4() == ns.is_ipv4()))
        };
        let check = match &system.nameservers {
            Err(e) => Check::new(
                Outcome::Warn,
                label,
                format!("cannot tell whether programs here ask the guard: {e}"),
            ),
            Ok(ns) => {
                let others: Vec<IpAddr> = ns.iter().filter(|n| !serves(n)).copied().collect();
                if others.is_empty() {
                    Check::new(
                        Outcome::Pass,
                        label,
                        format!("{} names only the guard ({})", system.path, join(ns)),
                    )
                } else {
                    let fix = if guard_ips.is_empty() {
                        format!(
                            "the guard listens on {} only, and resolv.conf can name port 53 \
                             only",
                            join_sockets(&guard.listen)
                        )
                    } else {
                        format!("list only {} there", join(&guard_ips))
                    };
                    Check::new(
                        Outcome::Warn,
                        label,
                        format!(
                            "{} names {}, which is not the guard: programs here that ask it get \
                             no answer (only the guard may reach resolvers); {fix}",
                            system.path,
                            join(&others)
                        ),
                    )
                }
            }
        };
        self.done(check);
    }

    /// Guard mode: the guard answers on each listen address, over UDP and TCP. It is asked an
    /// allowed name when the policy has one (else [`DNS_TEST_NAME`], which it refuses: any
    /// answer shows that it serves).
    pub(super) fn guard_servers(&mut self, guard: &GuardSettings) {
        let name = self
            .policy
            .domains()
            .into_iter()
            .next()
            .map(|n| n.to_string());
        for &target in &guard.listen {
            for proto in [L4Proto::Udp, L4Proto::Tcp] {
                self.attempt(Attempt {
                    check: format!("guard {} {target}", proto.name()),
                    kind: Kind::Dns(proto),
                    target,
                    expect: Expect::Answer,
                    note: None,
                    on_fail: Some(
                        "the guard does not serve there: is `egress-fence run` running with \
                         this policy?"
                            .into(),
                    ),
                    dns_name: name.clone(),
                });
            }
        }
    }

    /// Who the table lets reach the upstream resolvers.
    fn upstream_access(&self) -> UpstreamAccess {
        // A guard of this version marks its sockets with the policy's mark, and its table
        // asks for it.
        let policy_mark = self.policy.dns.guard.as_ref().map(|g| g.mark);
        let from_socket = |why: String| match self.options.guard_socket {
            Some((uid, addr)) => UpstreamAccess::Uids {
                uids: vec![uid],
                marks: policy_mark.into_iter().collect(),
                source: format!(
                    "the owner of the guard's socket on {addr} and the policy, since the table \
                     {why}"
                ),
            },
            None => UpstreamAccess::Unknown(why),
        };
        match &self.options.table {
            TableView::Read(facts) if facts.dns_for_everyone => UpstreamAccess::Everyone,
            TableView::Read(facts) => UpstreamAccess::Uids {
                uids: facts.dns_uids.clone(),
                marks: facts.dns_marks.clone(),
                source: "the installed table's `meta mark`/`meta skuid` rule".into(),
            },
            TableView::NotInstalled => UpstreamAccess::NoTable,
            TableView::Unreadable(e) => from_socket(format!("cannot be read here: {e}")),
            TableView::NotRead => from_socket("was not read".into()),
        }
    }

    /// Guard mode: DNS (UDP and TCP 53), DNS over TLS (TCP 853) and over QUIC (UDP 853)
    /// straight to each upstream resolver are refused for this probe's unmarked sockets,
    /// whatever its uid (unless an older table knows the guard by this uid alone).
    pub(super) fn upstream(&mut self) {
        let access = self.upstream_access();
        let uid = self.options.uid;
        let servers = self.options.resolvers.clone();
        for server in servers {
            for (kind, proto, port) in [
                (Kind::Dns(L4Proto::Udp), L4Proto::Udp, DNS_PORT),
                (Kind::Dns(L4Proto::Tcp), L4Proto::Tcp, DNS_PORT),
                (Kind::Tcp, L4Proto::Tcp, DOT_PORT),
                // DNS over QUIC (and over DTLS) use UDP 853.
                (Kind::Udp, L4Proto::Udp, DOT_PORT),
            ] {
                let target = SocketAddr::new(server, port);
                let check = format!("upstream {} {target}", proto.name());
                if let UpstreamAccess::Uids {
                    uids,
                    marks,
                    source,
                } = &access
                    && marks.is_empty()
                    && uids.contains(&uid)
                {
                    self.done(Check::new(
                        Outcome::Warn,
                        check,
                        format!(
                            "not probed: this probe runs as uid {uid}, the guard's uid, which \
                             alone may reach the upstream resolvers (learned from {source}: a \
                             table of an older version, without the guard's socket mark; any \
                             process of that uid, root in a container included, gets through \
                             until `egress-fence run` installs its table), so it cannot tell \
                             whether anyone else is refused; run the probe as the agent's user \
                             (e.g. `setpriv --reuid=USER --regid=GROUP --clear-groups \
                             egress-fence probe ...`)"
                        ),
                    ));
                    continue;
                }
                self.attempt(Attempt {
                    check,
                    kind,
                    target,
                    expect: Expect::Refuse,
                    note: None,
                    on_fail: Some(access.why_through(uid)),
                    dns_name: None,
                });
            }
        }
    }

    /// Guard mode: a random name outside the policy must be refused by the guard itself,
    /// never forwarded. An answer with addresses, or an allow entry covering the name (the
    /// guard forwards what the policy allows, so the zone's servers hear every question under
    /// it), is an open channel.
    pub(super) fn guarded_exfiltration(&mut self, name: Option<Result<DomainName, String>>) {
        let check = match name {
            None => return,
            Some(Err(e)) => Check::new(Outcome::Warn, "dns exfiltration", e),
            Some(Ok(name)) => {
                let label = format!("dns exfiltration {name}");
                let via = self.resolver_list();
                let covered = self.covering_entry(&name);
                let default_zone = match &self.policy.probe.exfil_domain {
                    Some(_) => String::new(),
                    None => format!(
                        " (no probe.exfil_domain: a name under the reserved {DEFAULT_EXFIL_ZONE})"
                    ),
                };
                match (self.lookup(&name), self.host(&name)) {
                    (Some(_), Some(host)) if !host.addrs.is_empty() => {
                        let addrs: Vec<IpAddr> = host.addrs.iter().map(|a| a.addr).collect();
                        let why = match &covered {
                            Some(entry) => format!("the allow entry {entry} covers it"),
                            None => "no allow entry covers it".into(),
                        };
                        Check::new(
                            Outcome::Fail,
                            label,
                            format!(
                                "a random name resolved to {} through {via} ({why}): the guard \
                                 forwarded it, so DNS queries can carry data out",
                                join(&addrs)
                            ),
                        )
                    }
                    (Some(lookup), _) if covered.is_some() => Check::new(
                        Outcome::Fail,
                        label,
                        format!(
                            "the allow entry {} covers it, so {via} forwards it upstream ({}): \
                             every question under it carries data to that zone's name servers",
                            covered.unwrap_or_default(),
                            lookup.outcome()
                        ),
                    ),
                    (Some(lookup), _) => match lookup.refusal() {
                        Some(rcode) => Check::new(
                            Outcome::Pass,
                            label,
                            format!(
                                "DNS exfiltration closed: the guard refused {name} without \
                                 forwarding it ({rcode}){default_zone}"
                            ),
                        ),
                        None => Check::new(
                            Outcome::Warn,
                            label,
                            format!("inconclusive: {}", lookup.outcome()),
                        ),
                    },
                    (None, _) => Check::new(Outcome::Warn, label, "the name was not looked up"),
                }
            }
        };
        self.done(check);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::guard_lookup::Asked;
    use crate::probe::options::{ProbeOptions, SystemResolvers, TableFacts};
    use crate::probe::testing::*;

    #[test]
    fn guard_mode_checks_the_guard_its_upstream_and_the_exfiltration_channel() {
        let p = policy(GUARD_POLICY);
        let exfil = "ef-probe-1.egress-fence-probe.invalid";
        let lookups = [
            lookup(
                "api.example.com",
                answered("NOERROR", &["192.0.2.10"]),
                answered("NOERROR", &[]),
            ),
            lookup(
                "paste.example.com",
                answered("REFUSED", &[]),
                answered("REFUSED", &[]),
            ),
            lookup(exfil, answered("REFUSED", &[]), answered("REFUSED", &[])),
        ];
        let checks = guard_plan(&p, &guard_options(table_with_uid(0)), &lookups, exfil);
        let names: Vec<&str> = checks.iter().map(|c| c.1.as_str()).collect();
        assert_eq!(
            names,
            [
                "system resolver",
                "guard udp 127.0.0.53:53",
                "guard tcp 127.0.0.53:53",
                "upstream udp 192.0.2.53:53",
                "upstream tcp 192.0.2.53:53",
                "upstream tcp 192.0.2.53:853",
                "upstream udp 192.0.2.53:853",
                "allowed name api.example.com",
                "allowed tcp api.example.com 192.0.2.10:443",
                "allowed names *.cdn.example.com",
                "denied preset dns-over-https",
                "blocked name paste.example.com",
                "rogue resolver udp 192.0.2.54:53",
                "rogue resolver tcp 192.0.2.54:53",
                "dns exfiltration ef-probe-1.egress-fence-probe.invalid",
            ]
        );
        assert_eq!(find(&checks, "system resolver").0, "PASS");
        let allowed = find(&checks, "allowed name api.example.com");
        assert_eq!(allowed.0, "PASS");
        assert!(
            allowed.2.contains("through the guard 127.0.0.53:53"),
            "{allowed:?}"
        );
        // Another uid than the guard's: the upstream is tried, and must be refused.
        assert_eq!(find(&checks, "upstream tcp 192.0.2.53:853").0, "attempt");
        assert_eq!(find(&checks, "upstream udp 192.0.2.53:853").0, "attempt");
        let blocked = find(&checks, "blocked name paste.example.com");
        assert_eq!(blocked.0, "PASS", "{blocked:?}");
        let doh = find(&checks, "denied preset dns-over-https");
        assert_eq!(doh.0, "PASS", "{doh:?}");
        let exfil_check = checks.last().expect("checks");
        assert_eq!(exfil_check.0, "PASS", "{exfil_check:?}");
        assert!(
            exfil_check.2.starts_with(
                "DNS exfiltration closed: the guard refused \
                 ef-probe-1.egress-fence-probe.invalid without forwarding it (REFUSED)"
            ),
            "{exfil_check:?}"
        );
    }

    #[test]
    fn the_guards_own_uid_is_probed_unless_the_table_knows_the_guard_by_uid_alone() {
        let p = policy(GUARD_POLICY);
        let exfil = "ef-probe-1.egress-fence-probe.invalid";
        let refused = || lookup(exfil, answered("NXDOMAIN", &[]), answered("NXDOMAIN", &[]));
        // The table asks for the guard's mark too: the probe's unmarked sockets must be
        // refused, the guard's uid included.
        let same_uid = ProbeOptions {
            uid: 0,
            ..guard_options(table_with_uid(0))
        };
        let checks = guard_plan(&p, &same_uid, &[refused()], exfil);
        let up = find(&checks, "upstream udp 192.0.2.53:53");
        assert_eq!(up.0, "attempt", "{up:?}");
        assert!(up.2.contains("marked 0x65000000"), "{up:?}");
        // A table of an older version: the uid alone lets the probe through unchecked.
        let uid_only = TableView::Read(TableFacts {
            dns_uids: vec![0],
            ..TableFacts::default()
        });
        let same_uid = ProbeOptions {
            uid: 0,
            ..guard_options(uid_only)
        };
        let checks = guard_plan(&p, &same_uid, &[refused()], exfil);
        let up = find(&checks, "upstream udp 192.0.2.53:53");
        assert_eq!(up.0, "WARN", "{up:?}");
        assert!(up.2.contains("runs as uid 0, the guard's uid"), "{up:?}");
        assert!(up.2.contains("without the guard's socket mark"), "{up:?}");

        // A resolve-mode table lets everyone through: said when the attempt fails.
        let everyone = TableView::Read(TableFacts {
            dns_for_everyone: true,
            ..TableFacts::default()
        });
        let checks = guard_plan(&p, &guard_options(everyone), &[refused()], exfil);
        let up = find(&checks, "upstream tcp 192.0.2.53:53");
        assert_eq!(up.0, "attempt");
        assert!(up.2.contains("resolve mode"), "{up:?}");
        let doh = find(&checks, "denied preset dns-over-https");
        assert_eq!(doh.0, "FAIL", "{doh:?}");
        assert!(doh.2.contains("1.1.1.1/32"), "{doh:?}");

        // An unprivileged probe: the guard's socket owner stands in for the table.
        let unreadable = ProbeOptions {
            uid: 1000,
            guard_socket: Some((1000, "127.0.0.53:53".parse().unwrap())),
            ..guard_options(TableView::Unreadable("EPERM".into()))
        };
        let checks = guard_plan(&p, &unreadable, &[refused()], exfil);
        let up = find(&checks, "upstream tcp 192.0.2.53:853");
        assert_eq!(up.0, "attempt", "{up:?}");
        assert!(up.2.contains("guard's socket on 127.0.0.53:53"), "{up:?}");
        assert_eq!(find(&checks, "denied preset dns-over-https").0, "SKIP");
        let unknown = ProbeOptions {
            guard_socket: None,
            ..unreadable
        };
        let checks = guard_plan(&p, &unknown, &[refused()], exfil);
        let up = find(&checks, "upstream udp 192.0.2.53:53");
        assert_eq!(up.0, "attempt");
        assert!(up.2.contains("could not be compared"), "{up:?}");
    }

    #[test]
    fn a_forwarded_exfiltration_name_fails() {
        let exfil = "ef-probe-2.exfil.example.com";
        let covering = policy(&GUARD_POLICY.replace(
            "  - domain: api.example.com\n",
            "  - domain: \"**.exfil.example.com\"\n    ports: [443]\n  - domain: api.example.com\n",
        ));
        let opts = guard_options(table_with_uid(0));
        // Resolved: the name went out and came back with an address.
        let resolved = lookup(
            exfil,
            answered("NOERROR", &["203.0.113.10"]),
            answered("NOERROR", &[]),
        );
        let checks = guard_plan(&covering, &opts, &[resolved], exfil);
        let c = checks.last().expect("checks");
        assert_eq!(c.0, "FAIL", "{c:?}");
        assert!(c.2.contains("203.0.113.10"), "{c:?}");
        assert!(
            c.2.contains("domain **.exfil.example.com covers it"),
            "{c:?}"
        );
        // Covered but NXDOMAIN upstream: it was still forwarded.
        let nx = lookup(exfil, answered("NXDOMAIN", &[]), answered("NXDOMAIN", &[]));
        let checks = guard_plan(&covering, &opts, &[nx], exfil);
        let c = checks.last().expect("checks");
        assert_eq!(c.0, "FAIL", "{c:?}");
        assert!(c.2.contains("forwards it upstream"), "{c:?}");
        // Not covered, yet answered with an address: something else answers arbitrary names.
        let p = policy(GUARD_POLICY);
        let rogue = lookup(
            exfil,
            answered("NOERROR", &["203.0.113.10"]),
            answered("NOERROR", &[]),
        );
        let checks = guard_plan(&p, &opts, &[rogue], exfil);
        assert_eq!(checks.last().expect("checks").0, "FAIL");
        // No answer at all: inconclusive.
        let silent = lookup(
            exfil,
            Asked::Failed("no answer within 1s".into()),
            Asked::Failed("no answer within 1s".into()),
        );
        let checks = guard_plan(&p, &opts, &[silent], exfil);
        let c = checks.last().expect("checks");
        assert_eq!(c.0, "WARN", "{c:?}");
        assert!(c.2.contains("inconclusive"), "{c:?}");
    }

    #[test]
    fn resolv_conf_must_name_the_guard() {
        let p = policy(GUARD_POLICY);
        let exfil = "ef-probe-1.egress-fence-probe.invalid";
        let elsewhere = ProbeOptions {
            system: Some(SystemResolvers {
                path: "/etc/resolv.conf".into(),
                nameservers: Ok(vec!["192.0.2.53".parse().unwrap()]),
            }),
            ..guard_options(table_with_uid(0))
        };
        let checks = guard_plan(&p, &elsewhere, &[], exfil);
        let c = find(&checks, "system resolver");
        assert_eq!(c.0, "WARN", "{c:?}");
        assert!(
            c.2.contains("names 192.0.2.53") && c.2.contains("127.0.0.53"),
            "{c:?}"
        );
    }
}
