//! Why a packet was refused, in one vocabulary: the daemon's log (which knows names and
//! expiries), `watch` (which knows only what the table holds) and their tests say it the same
//! way. Pure: the callers gather what they know into a [`WhyRefused`] and print it.

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use super::installable::HostAddrs;

/// Why the boundary refused a packet to a destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WhyRefused {
    /// A process of this host sent it from `src`, an address that is not the host's: refused
    /// whatever its destination, since an answer to it would carry the process's bytes to
    /// wherever `src` is ([`Rule::RefuseForeignSource`](super::ruleset::Rule)).
    ForeignSource {
        src: IpAddr,
    },
    /// Guard mode: anything to the guard's upstream resolver from a socket that is not the
    /// guard's (DNS, and DNS over HTTPS or on any other port it serves).
    GuardUpstream {
        guard_uid: u32,
    },
    /// Guard mode: DNS (53, 853) to a resolver other than the guard.
    OtherResolver {
        port: u16,
    },
    /// A deny entry covers it: the entry as the policy says it (`preset cloud-metadata`) or,
    /// read from the table, the network it holds (`169.254.0.0/16`).
    Denied(String),
    /// It is allowed, but not to this port or protocol. `names` are the allowed names that
    /// answered it (empty when only the table was read).
    OtherPortsOnly {
        names: Vec<String>,
    },
    /// It was an address of `name`, whose lifetime ended `ago`: what drifting CDNs look like.
    LifetimeEnded {
        name: String,
        ago: Duration,
    },
    NotInPolicy,
}

impl WhyRefused {
    /// The reason as a fixed word (a metric's label): one per variant, never a name or an
    /// address, so the set of values is bounded whatever was refused.
    pub fn reason(&self) -> &'static str {
        match self {
            WhyRefused::ForeignSource { .. } => "foreign_source",
            WhyRefused::GuardUpstream { .. } => "guard_upstream",
            WhyRefused::OtherResolver { .. } => "other_resolver",
            WhyRefused::Denied(_) => "deny",
            WhyRefused::OtherPortsOnly { .. } => "other_port",
            WhyRefused::LifetimeEnded { .. } => "lifetime_ended",
            WhyRefused::NotInPolicy => "not_in_policy",
        }
    }

    /// Every value [`WhyRefused::reason`] gives.
    pub const REASONS: [&'static str; 7] = [
        "foreign_source",
        "guard_upstream",
        "other_resolver",
        "deny",
        "other_port",
        "lifetime_ended",
        "not_in_policy",
    ];
}

impl fmt::Display for WhyRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WhyRefused::ForeignSource { src } => write!(
                f,
                "sent from {src}, which is not this host's address: a source a process chose, \
                 refused whatever the destination"
            ),
            WhyRefused::GuardUpstream { guard_uid } => write!(
                f,
                "to the guard's upstream resolver: only the guard (uid {guard_uid}, its \
                 sockets marked) may reach it, on any port"
            ),
            WhyRefused::OtherResolver { port } => write!(
                f,
                "DNS (port {port}) to a resolver other than the guard: refused in guard mode"
            ),
            WhyRefused::Denied(what) => write!(f, "denied: {what}"),
            WhyRefused::OtherPortsOnly { names } if names.is_empty() => {
                f.write_str("allowed on other ports or protocols only")
            }
            WhyRefused::OtherPortsOnly { names } => write!(
                f,
                "an address of {}, allowed on other ports or protocols only",
                names.join(", ")
            ),
            WhyRefused::LifetimeEnded { name, ago } => write!(
                f,
                "was an address of {name} until {} ago (its grace ended)",
                super::time::minutes_seconds(*ago)
            ),
            WhyRefused::NotInPolicy => f.write_str("not in the policy"),
        }
    }
}

/// In guard mode, why a packet to one of the guard's upstream resolvers (`to_upstream`, any
/// port) or to a DNS port (53, 853) elsewhere was refused: `None` for other packets.
pub fn guard_dns(guard_uid: u32, dport: Option<u16>, to_upstream: bool) -> Option<WhyRefused> {
    // The guard's upstream is refused to every other socket on every port (see
    // `plan::plan_elements`); DNS elsewhere only on the DNS ports.
    if to_upstream {
        return Some(WhyRefused::GuardUpstream { guard_uid });
    }
    let port = dport.filter(|p| super::plan::GUARDED_DNS_PORTS.contains(p))?;
    Some(WhyRefused::OtherResolver { port })
}

/// Whether a refused packet was refused for its source, which the fence judges before any
/// destination: sent by a socket of this host (`owned`: the rule spares the kernel's own
/// packets; forwarded ones have no owner) from an address the host's routing does not call
/// local or broadcast. `None` when the host's addresses could not be read: every source would
/// look foreign.
pub fn foreign_source(src: IpAddr, owned: bool, host: &HostAddrs) -> Option<WhyRefused> {
    (owned && host.is_known() && !host.is_local_or_broadcast(src))
        .then_some(WhyRefused::ForeignSource { src })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_reason_reads_as_one_sentence() {
        let said = [
            WhyRefused::ForeignSource {
                src: "2001:db8:2::10".parse().unwrap(),
            },
            WhyRefused::GuardUpstream { guard_uid: 993 },
            WhyRefused::OtherResolver { port: 853 },
            WhyRefused::Denied("preset cloud-metadata".into()),
            WhyRefused::OtherPortsOnly { names: vec![] },
            WhyRefused::OtherPortsOnly {
                names: vec!["a.example".into(), "b.example".into()],
            },
            WhyRefused::LifetimeEnded {
                name: "a.example".into(),
                ago: Duration::from_secs(250),
            },
            WhyRefused::NotInPolicy,
        ]
        .map(|r| r.to_string());
        assert_eq!(
            said,
            [
                "sent from 2001:db8:2::10, which is not this host's address: a source a \
                 process chose, refused whatever the destination",
                "to the guard's upstream resolver: only the guard (uid 993, its sockets \
                 marked) may reach it, on any port",
                "DNS (port 853) to a resolver other than the guard: refused in guard mode",
                "denied: preset cloud-metadata",
                "allowed on other ports or protocols only",
                "an address of a.example, b.example, allowed on other ports or protocols only",
                "was an address of a.example until 4m10s ago (its grace ended)",
                "not in the policy",
            ]
        );
    }

    #[test]
    fn only_an_owned_packet_from_an_address_not_the_hosts_is_refused_for_its_source() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let host = HostAddrs::from_interfaces([
            (ip("127.0.0.1"), Some(ip("255.0.0.0")), None),
            (ip("::1"), None, None),
            (
                ip("10.0.0.2"),
                Some(ip("255.255.255.0")),
                Some(ip("10.0.0.255")),
            ),
            (ip("2001:db8::2"), None, None),
        ]);
        let foreign = |src: &str, owned| foreign_source(ip(src), owned, &host);
        assert_eq!(
            foreign("2001:db8:2::10", true),
            Some(WhyRefused::ForeignSource {
                src: ip("2001:db8:2::10")
            })
        );
        assert!(foreign("203.0.113.7", true).is_some());
        assert!(
            foreign("::", true).is_some(),
            "the fib calls :: no local address"
        );
        // The kernel's own packets (a reset from a refused destination) and forwarded ones.
        assert_eq!(foreign("203.0.113.7", false), None);
        // The host's addresses, all of 127/8, and what the fib calls broadcast (DHCPv4's
        // 0.0.0.0 among them).
        for own in [
            "10.0.0.2",
            "2001:db8::2",
            "::1",
            "127.0.0.1",
            "127.0.0.53",
            "0.0.0.0",
            "255.255.255.255",
            "10.0.0.255",
        ] {
            assert_eq!(foreign(own, true), None, "{own}");
        }
        // Unread addresses: no source is called foreign.
        assert_eq!(
            foreign_source(ip("203.0.113.7"), true, &HostAddrs::none()),
            None
        );
    }

    #[test]
    fn the_upstream_on_any_port_and_dns_ports_elsewhere_get_a_guard_reason() {
        assert_eq!(
            guard_dns(993, Some(53), true),
            Some(WhyRefused::GuardUpstream { guard_uid: 993 })
        );
        assert_eq!(
            guard_dns(993, Some(853), false),
            Some(WhyRefused::OtherResolver { port: 853 })
        );
        for port in [Some(443), None] {
            assert_eq!(
                guard_dns(993, port, true),
                Some(WhyRefused::GuardUpstream { guard_uid: 993 })
            );
        }
        assert_eq!(guard_dns(993, Some(443), false), None);
        assert_eq!(guard_dns(993, None, false), None);
    }
}
