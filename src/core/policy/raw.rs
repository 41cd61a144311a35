//! The file as written: what serde reads, before the checks that relate two of its parts.

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use serde::{Deserialize, Deserializer};

use super::includes::AllowPreset;
use super::names::{DomainName, Wildcard};
use super::presets::Preset;
use super::schema::*;
use super::scope::RawScope;
use super::values::{
    HumanDuration, MAX_DOMAIN_PORT_RANGE, PortRange, ProbeTarget, Rate, parse_network,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum DnsMode {
    Resolve,
    Guard,
}

/// What `domain:` holds: a name, or in guard mode a wildcard.
pub(super) struct DomainTarget(pub(super) Target);

impl<'de> Deserialize<'de> for DomainTarget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let t = s.trim();
        let wildcard = |rest: &str, any_depth| -> Result<Target, String> {
            Ok(Target::Wildcard(Wildcard {
                suffix: rest.parse()?,
                any_depth,
            }))
        };
        let target = if let Some(rest) = t.strip_prefix("**.") {
            wildcard(rest, true)
        } else if let Some(rest) = t.strip_prefix("*.") {
            wildcard(rest, false)
        } else {
            t.parse().map(Target::Domain)
        };
        target.map(DomainTarget).map_err(serde::de::Error::custom)
    }
}

pub(super) struct Network(pub(super) IpNet);

impl<'de> Deserialize<'de> for Network {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_network(&s)
            .map(Network)
            .map_err(serde::de::Error::custom)
    }
}

pub(super) struct Resolver(pub(super) IpAddr);

impl<'de> Deserialize<'de> for Resolver {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.trim().parse().map(Resolver).map_err(|_| {
            serde::de::Error::custom(format!(
                "`{s}` is not an IP address; resolvers are addresses such as 192.0.2.53 \
                 (DNS always uses port 53)"
            ))
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    pub(super) version: u32,
    #[serde(default = "default_action")]
    pub(super) action: Action,
    #[serde(default)]
    pub(super) allow: Vec<RawAllow>,
    #[serde(default)]
    pub(super) include: Vec<AllowPreset>,
    #[serde(default)]
    pub(super) deny: Vec<RawDeny>,
    #[serde(default)]
    pub(super) dns: RawDns,
    #[serde(default)]
    pub(super) log: RawLog,
    pub(super) essentials: Option<Vec<Essential>>,
    #[serde(default)]
    pub(super) probe: RawProbe,
    pub(super) scope: Option<RawScope>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProbe {
    #[serde(default)]
    pub(super) blocked: Vec<ProbeTarget>,
    pub(super) rogue_resolvers: Option<Vec<Resolver>>,
    pub(super) exfil_domain: Option<DomainName>,
}

fn default_action() -> Action {
    Action::Reject
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, try_from = "RawAllowFields")]
pub(super) struct RawAllow(pub(super) Allow);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAllowFields {
    pub(super) domain: Option<DomainTarget>,
    pub(super) cidr: Option<Network>,
    pub(super) ports: Option<Vec<PortRange>>,
    #[serde(default = "default_protocol")]
    pub(super) protocol: Protocol,
    pub(super) comment: Option<String>,
}

fn default_protocol() -> Protocol {
    Protocol::Tcp
}

impl TryFrom<RawAllowFields> for RawAllow {
    type Error = String;

    fn try_from(raw: RawAllowFields) -> Result<Self, String> {
        let target = match (raw.domain, raw.cidr) {
            (Some(DomainTarget(d)), None) => d,
            (None, Some(Network(n))) => Target::Cidr(n),
            (Some(_), Some(_)) => {
                return Err("an allow entry has either `domain:` or `cidr:`, not both; \
                            split it into two entries"
                    .into());
            }
            (None, None) => {
                return Err("an allow entry needs `domain: NAME` or `cidr: NETWORK`".into());
            }
        };
        let name = match &target {
            Target::Domain(d) => d.to_string(),
            Target::Wildcard(w) => w.to_string(),
            Target::Cidr(_) => String::new(),
        };
        let ports = match (raw.ports, &target) {
            (None, Target::Cidr(_)) => vec![PortRange::ALL],
            (None, _) => {
                return Err(format!(
                    "the entry for `{name}` needs `ports:`: a name's addresses are often shared \
                     (CDNs), so allow only the ports you use, e.g. `ports: [443]`"
                ));
            }
            (Some(p), Target::Domain(_) | Target::Wildcard(_)) => {
                if let Some(wide) = p.iter().find(|r| r.width() > MAX_DOMAIN_PORT_RANGE) {
                    return Err(format!(
                        "the port range `{wide}` of `{name}` spans more than \
                         {MAX_DOMAIN_PORT_RANGE} ports: a name's addresses are refreshed port \
                         by port, so split it, or allow the addresses with a `cidr:` entry"
                    ));
                }
                p
            }
            (Some(p), _) if p.is_empty() => {
                return Err(
                    "`ports: []` allows nothing; list ports, or leave `ports` out to \
                            allow every port"
                        .into(),
                );
            }
            (Some(p), _) => p,
        };
        Ok(RawAllow(Allow {
            target,
            ports,
            protocol: raw.protocol,
            comment: raw.comment,
        }))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, try_from = "RawDenyFields")]
pub(super) struct RawDeny(pub(super) Deny);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDenyFields {
    pub(super) preset: Option<Preset>,
    pub(super) cidr: Option<Network>,
    pub(super) comment: Option<String>,
}

impl TryFrom<RawDenyFields> for RawDeny {
    type Error = String;

    fn try_from(raw: RawDenyFields) -> Result<Self, String> {
        let (networks, origin) = match (raw.preset, raw.cidr) {
            (Some(p), None) => (p.networks(), DenyOrigin::Preset(p)),
            (None, Some(Network(n))) => (vec![n], DenyOrigin::Cidr),
            (Some(_), Some(_)) => {
                return Err(
                    "a deny entry has either `preset:` or `cidr:`, not both; split it \
                            into two entries"
                        .into(),
                );
            }
            (None, None) => {
                return Err(
                    "a deny entry needs `preset: cloud-metadata` (or private-networks) or \
                     `cidr: NETWORK`"
                        .into(),
                );
            }
        };
        Ok(RawDeny(Deny {
            networks,
            origin,
            comment: raw.comment,
        }))
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDns {
    pub(super) mode: Option<DnsMode>,
    pub(super) resolvers: Option<Vec<Resolver>>,
    #[serde(default)]
    pub(super) refresh: RawRefresh,
    pub(super) grace: Option<HumanDuration>,
    pub(super) listen: Option<Vec<ListenAddr>>,
    pub(super) upstream: Option<Vec<Resolver>>,
    pub(super) refuse_with: Option<RefuseWith>,
    pub(super) floor: Option<HumanDuration>,
    pub(super) mark: Option<u32>,
}

/// `127.0.0.53:53`, `[::1]:53`, or an address alone (port 53).
pub(super) struct ListenAddr(pub(super) SocketAddr);

impl<'de> Deserialize<'de> for ListenAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let t = s.trim();
        t.parse::<SocketAddr>()
            .or_else(|_| t.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 53)))
            .map(ListenAddr)
            .map_err(|_| {
                serde::de::Error::custom(format!(
                    "`{s}` is not an address to listen on; write 127.0.0.53:53, [::1]:53 or an \
                     address alone for port 53"
                ))
            })
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRefresh {
    pub(super) min: Option<HumanDuration>,
    pub(super) max: Option<HumanDuration>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLog {
    pub(super) prefix: Option<String>,
    pub(super) group: Option<u16>,
    pub(super) rate: Option<Rate>,
    pub(super) burst: Option<u32>,
}

#[cfg(test)]
mod tests {
    use crate::core::policy::test_support::*;

    #[test]
    fn entry_needs_exactly_one_target() {
        let (line, _, msg) =
            err("version: 1\nallow:\n  - domain: a.example\n    cidr: 192.0.2.0/24\n");
        assert!(line >= 3, "{msg}");
        assert!(msg.contains("not both"), "{msg}");
        let (_, _, msg) = err("version: 1\nallow:\n  - ports: [1]\n");
        assert!(msg.contains("needs `domain: NAME`"), "{msg}");
    }

    #[test]
    fn unknown_preset_protocol_action_and_essential_are_refused() {
        for src in [
            "version: 1\ndeny:\n  - preset: cloud\n",
            "version: 1\nallow:\n  - cidr: 192.0.2.1\n    protocol: icmp\n",
            "version: 1\naction: allow\n",
            "version: 1\nessentials: [ssh]\n",
            "version: 1\nlog:\n  rate: 10/fortnight\n",
            "version: 1\ndns:\n  resolvers: [dns.example]\n",
        ] {
            let (line, col, msg) = err(src);
            assert!(line >= 2 && col > 0, "{src}: {line}:{col} {msg}");
        }
    }

    #[test]
    fn domain_entries_need_ports_and_narrow_ranges() {
        let (line, col, msg) = err("version: 1\nallow:\n  - domain: api.example.com\n");
        assert_eq!((line, col), (3, 13), "{msg}");
        assert!(msg.contains("needs `ports:`"), "{msg}");
        let (line, col, msg) =
            err("version: 1\nallow:\n  - domain: api.example.com\n    ports: [\"1000-2000\"]\n");
        assert_eq!((line, col), (4, 14), "{msg}");
        assert!(msg.contains("spans more than 256 ports"), "{msg}");
        let p = parse("version: 1\nallow:\n  - domain: a.example\n    ports: [\"8000-8255\"]\n");
        assert!(p.is_ok(), "{p:?}");
    }

    #[test]
    fn a_bad_listen_address_is_refused_in_one_sentence() {
        let (_, _, msg) = err(
            "version: 1\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  listen: [localhost]\n",
        );
        assert!(
            msg.ends_with(
                "`localhost` is not an address to listen on; write 127.0.0.53:53, [::1]:53 or \
                 an address alone for port 53"
            ),
            "{msg}"
        );
    }
}
