//! The file as written: what serde reads, before the checks that relate two of its parts.

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use schemars::JsonSchema;
use serde::{Deserialize, Deserializer};

use crate::core::ruleset::MAX_COMMENTED_NAME;

use super::includes::AllowPreset;
use super::names::{DomainName, Wildcard};
use super::presets::Preset;
use super::schema::*;
use super::scope::RawScope;
use super::values::{
    HumanDuration, MAX_DOMAIN_PORT_RANGE, PortRange, ProbeTarget, Rate, parse_network,
};

/// How names become addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub(super) enum DnsMode {
    /// Names are re-resolved on a timer (the default).
    Resolve,
    /// egress-fence is the host's resolver (`run`): allowed names are forwarded to
    /// `upstream`, their answers added to the table before they are released.
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
        // The table keeps, as each address's comment, the name it was allowed for: status,
        // probe and a restart explain the address by it.
        let shortest = |target: &Target| match target {
            Target::Domain(name) => name.as_str().len(),
            // One more label of one character.
            Target::Wildcard(w) => w.suffix.as_str().len() + 2,
            Target::Cidr(_) => 0,
        };
        let target = target.and_then(|target| match shortest(&target) {
            len if len > MAX_COMMENTED_NAME => Err(format!(
                "`{t}` allows no name of at most {MAX_COMMENTED_NAME} characters: the table \
                 keeps the name each address was allowed for (as the element's comment, at \
                 most {MAX_COMMENTED_NAME} characters), and could not name a longer one"
            )),
            _ => Ok(target),
        });
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

/// An egress-fence policy: what a host behind the fence may reach.
///
/// Only `version` is required. Generated from the parser's types (`egress-fence check
/// --schema`); `egress-fence check` also runs the checks a schema cannot express.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "egress-fence policy", transform = super::json_schema::policy_rules)]
pub(super) struct RawPolicy {
    /// The policy schema's version: 1.
    #[schemars(extend("enum" = [1]))]
    pub(super) version: u32,
    /// What unmatched traffic gets.
    #[serde(default = "default_action")]
    pub(super) action: Action,
    /// Destinations that may be reached.
    #[serde(default)]
    pub(super) allow: Vec<RawAllow>,
    /// Curated allow lists appended after `allow` (`egress-fence check` lists what each
    /// holds).
    #[serde(default)]
    pub(super) include: Vec<AllowPreset>,
    /// Networks refused before anything is allowed: deny wins.
    #[serde(default)]
    pub(super) deny: Vec<RawDeny>,
    /// How names become addresses: re-resolved on a timer (`mode: resolve`), or the DNS
    /// guard (`mode: guard`).
    #[serde(default)]
    pub(super) dns: RawDns,
    /// How refused packets are logged.
    #[serde(default)]
    pub(super) log: RawLog,
    /// The host essentials that stay allowed (default: all of them).
    #[schemars(extend("default" = ["loopback", "established", "icmpv6-nd", "dhcpv4", "dhcpv6"]))]
    pub(super) essentials: Option<Vec<Essential>>,
    /// What `egress-fence probe` checks besides the policy's own entries.
    #[serde(default)]
    pub(super) probe: RawProbe,
    /// Who is fenced (either DNS mode); left out: the whole network namespace.
    pub(super) scope: Option<RawScope>,
}

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Probe")]
pub(super) struct RawProbe {
    /// Destinations (HOST:PORT) that must be refused.
    #[serde(default)]
    pub(super) blocked: Vec<ProbeTarget>,
    /// Resolvers that must be unreachable (default: well-known public ones).
    #[schemars(extend("default" = ["1.1.1.1", "8.8.8.8", "9.9.9.9", "2606:4700:4700::1111", "2001:4860:4860::8888", "2620:fe::fe"]))]
    pub(super) rogue_resolvers: Option<Vec<Resolver>>,
    /// Random names under this domain must not resolve (DNS exfiltration).
    pub(super) exfil_domain: Option<DomainName>,
}

fn default_action() -> Action {
    Action::Reject
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, try_from = "RawAllowFields")]
#[schemars(with = "RawAllowFields")]
pub(super) struct RawAllow(pub(super) Allow);

/// One allowed destination: `domain` or `cidr`, with its ports and protocol.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "AllowEntry", transform = super::json_schema::allow_rules)]
pub(super) struct RawAllowFields {
    /// A name, resolved to A and AAAA; in guard mode also a wildcard.
    pub(super) domain: Option<DomainTarget>,
    /// An IPv4 or IPv6 network, or one address.
    pub(super) cidr: Option<Network>,
    /// Ports and ranges: required for a domain (ranges of at most 256 ports); for a cidr
    /// left out means every port.
    pub(super) ports: Option<Vec<PortRange>>,
    #[serde(default = "default_protocol")]
    pub(super) protocol: Protocol,
    /// Free text.
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

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, try_from = "RawDenyFields")]
#[schemars(with = "RawDenyFields")]
pub(super) struct RawDeny(pub(super) Deny);

/// One denied list of networks: `preset` or `cidr`.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "DenyEntry", transform = super::json_schema::deny_rules)]
pub(super) struct RawDenyFields {
    pub(super) preset: Option<Preset>,
    /// An IPv4 or IPv6 network, or one address.
    pub(super) cidr: Option<Network>,
    /// Free text.
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

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Dns", transform = super::json_schema::dns_rules)]
pub(super) struct RawDns {
    #[schemars(extend("default" = "resolve"))]
    pub(super) mode: Option<DnsMode>,
    /// Resolve mode: the resolvers asked, and the only ones allowed (default: those of
    /// resolv.conf).
    pub(super) resolvers: Option<Vec<Resolver>>,
    /// Resolve mode: a name is re-resolved after its answer's TTL, clamped to these bounds.
    #[serde(default)]
    pub(super) refresh: RawRefresh,
    /// How long an address outlives its last answer.
    #[schemars(extend("default" = "10m"))]
    pub(super) grace: Option<HumanDuration>,
    /// Guard mode: where the guard listens (UDP and TCP); point resolv.conf here.
    #[schemars(extend("default" = ["127.0.0.53:53"]))]
    pub(super) listen: Option<Vec<ListenAddr>>,
    /// Guard mode, required: where allowed names are forwarded; only the guard may ask them.
    pub(super) upstream: Option<Vec<Resolver>>,
    /// Guard mode: the answer to names outside the policy.
    #[schemars(extend("default" = "refused"))]
    pub(super) refuse_with: Option<RefuseWith>,
    /// Guard mode: an answered address lives max(TTL, floor) + grace.
    #[schemars(extend("default" = "30s"))]
    pub(super) floor: Option<HumanDuration>,
    /// Guard mode: the SO_MARK of the guard's upstream sockets (not 0).
    #[schemars(extend("default" = 1694498816u32, "minimum" = 1))]
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

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Refresh")]
pub(super) struct RawRefresh {
    #[schemars(extend("default" = "30s"))]
    pub(super) min: Option<HumanDuration>,
    #[schemars(extend("default" = "1h"))]
    pub(super) max: Option<HumanDuration>,
}

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Log")]
pub(super) struct RawLog {
    /// The kernel log's prefix (at most 127 bytes, no quotes or line breaks).
    #[schemars(extend("default" = "EGRESS-DROP: ", "maxLength" = 127, "pattern" = "^[^\"\\n\\u0000]*$"))]
    pub(super) prefix: Option<String>,
    /// The NFLOG group of refused packets (`watch`, `run --log-drops`); left out: the kernel
    /// log.
    pub(super) group: Option<u16>,
    #[schemars(extend("default" = "10/second"))]
    pub(super) rate: Option<Rate>,
    #[schemars(extend("default" = 20, "minimum" = 1))]
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
