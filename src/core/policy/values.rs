//! The single values a policy is written with (ports, networks, rates, durations, probe
//! targets), each checked where it is parsed so that errors carry its line and column.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::names::DomainName;

/// `HOST:PORT`: a name, an IPv4 address or a bracketed IPv6 address, and a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTarget {
    pub host: ProbeHost,
    pub port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeHost {
    Name(DomainName),
    Addr(IpAddr),
}

impl fmt::Display for ProbeTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            ProbeHost::Name(n) => write!(f, "{n}:{}", self.port),
            ProbeHost::Addr(IpAddr::V6(a)) => write!(f, "[{a}]:{}", self.port),
            ProbeHost::Addr(a) => write!(f, "{a}:{}", self.port),
        }
    }
}

impl Serialize for ProbeTarget {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl FromStr for ProbeTarget {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let hint = "write HOST:PORT, e.g. \"paste.example:443\", \"203.0.113.9:80\" or \
                    \"[2001:db8::9]:443\"";
        let (host, port) = s
            .trim()
            .rsplit_once(':')
            .ok_or_else(|| format!("`{s}` has no port; {hint}"))?;
        let port = parse_port(port).map_err(|e| format!("{e} (in `{s}`)"))?;
        let host = if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            ProbeHost::Addr(IpAddr::V6(
                v6.parse()
                    .map_err(|_| format!("`{v6}` is not an IPv6 address; {hint}"))?,
            ))
        } else if let Ok(addr) = host.parse::<std::net::Ipv4Addr>() {
            ProbeHost::Addr(IpAddr::V4(addr))
        } else if host.contains(':') {
            return Err(format!("`{s}`: put an IPv6 address in brackets; {hint}"));
        } else {
            ProbeHost::Name(host.parse()?)
        };
        Ok(ProbeTarget { host, port })
    }
}

impl<'de> Deserialize<'de> for ProbeTarget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// An inclusive range of ports; a single port has `first == last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    pub const ALL: PortRange = PortRange {
        first: 0,
        last: u16::MAX,
    };

    pub fn single(port: u16) -> Self {
        PortRange {
            first: port,
            last: port,
        }
    }

    pub fn is_single(self) -> bool {
        self.first == self.last
    }

    /// How many ports the range holds.
    pub fn width(self) -> u32 {
        u32::from(self.last) - u32::from(self.first) + 1
    }

    pub fn ports(self) -> impl Iterator<Item = u16> {
        self.first..=self.last
    }
}

/// Domain entries become one set element per address and port, refreshed as answers change;
/// wider ranges belong in `cidr:` entries.
pub const MAX_DOMAIN_PORT_RANGE: u32 = 256;

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_single() {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

impl Serialize for PortRange {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

const PORT_HINT: &str = "write a port from 1 to 65535, or a range such as \"8000-8080\"";

fn parse_port(s: &str) -> Result<u16, String> {
    let n: u32 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a port number; {PORT_HINT}"))?;
    if !(1..=65535).contains(&n) {
        return Err(format!("port `{n}` is out of range; {PORT_HINT}"));
    }
    Ok(n as u16)
}

impl FromStr for PortRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once('-') {
            None => parse_port(s).map(PortRange::single),
            Some((a, b)) => {
                let (first, last) = (parse_port(a)?, parse_port(b)?);
                if first > last {
                    return Err(format!(
                        "port range `{s}` runs backwards; write it as \"{last}-{first}\""
                    ));
                }
                Ok(PortRange { first, last })
            }
        }
    }
}

impl<'de> Deserialize<'de> for PortRange {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(i64),
            Text(String),
        }
        let raw = Raw::deserialize(d)
            .map_err(|_| serde::de::Error::custom(format!("expected a port; {PORT_HINT}")))?;
        let text = match raw {
            Raw::Number(n) => n.to_string(),
            Raw::Text(t) => t,
        };
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A network written as CIDR or as a single address (a /32 or /128).
pub(super) fn parse_network(s: &str) -> Result<IpNet, String> {
    let s = s.trim();
    let net = if let Ok(addr) = s.parse::<IpAddr>() {
        IpNet::from(addr)
    } else {
        s.parse::<IpNet>().map_err(|_| {
            format!(
                "`{s}` is not an IP network; write an address (203.0.113.7, 2001:db8::7) or a \
                 network in CIDR form (203.0.113.0/24, 2001:db8::/32)"
            )
        })?
    };
    if net.trunc() != net {
        return Err(format!(
            "`{s}` has host bits set below its prefix; did you mean {}?",
            net.trunc()
        ));
    }
    Ok(net)
}

/// A log rate such as `10/second`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub count: u64,
    pub unit: RateUnit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateUnit {
    Second,
    Minute,
    Hour,
    Day,
}

impl RateUnit {
    pub fn seconds(self) -> u64 {
        match self {
            RateUnit::Second => 1,
            RateUnit::Minute => 60,
            RateUnit::Hour => 3600,
            RateUnit::Day => 86400,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RateUnit::Second => "second",
            RateUnit::Minute => "minute",
            RateUnit::Hour => "hour",
            RateUnit::Day => "day",
        }
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, self.unit.name())
    }
}

impl Serialize for Rate {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let hint = "write a rate such as \"10/second\" (units: second, minute, hour, day)";
        let (count, unit) = s
            .split_once('/')
            .ok_or_else(|| format!("`{s}` is not a rate; {hint}"))?;
        let count: u64 = count
            .trim()
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("`{count}` is not a positive count; {hint}"))?;
        let unit = match unit.trim() {
            "second" | "s" => RateUnit::Second,
            "minute" | "m" => RateUnit::Minute,
            "hour" | "h" => RateUnit::Hour,
            "day" | "d" => RateUnit::Day,
            other => return Err(format!("`{other}` is not a time unit; {hint}")),
        };
        Ok(Rate { count, unit })
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// Durations end up as kernel element timeouts in milliseconds and as deadlines: a year is
/// far beyond any sensible setting and far inside what either can hold.
const MAX_DURATION_SECS: u64 = 365 * 86_400;

/// A duration written as `30s`, `10m`, `1h` or `1d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HumanDuration(pub Duration);

impl FromStr for HumanDuration {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let hint = "write a duration such as \"30s\", \"10m\", \"1h\" or \"1d\"";
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (n, unit) = t.split_at(split);
        let n: u64 = n
            .parse()
            .map_err(|_| format!("`{s}` is not a duration; {hint}"))?;
        let secs = match unit {
            "s" => n,
            "m" => n.saturating_mul(60),
            "h" => n.saturating_mul(3600),
            "d" => n.saturating_mul(86400),
            _ => return Err(format!("`{s}` is not a duration; {hint}")),
        };
        if secs == 0 {
            return Err(format!("`{s}` is zero; {hint}"));
        }
        if secs > MAX_DURATION_SECS {
            return Err(format!(
                "`{s}` is longer than a year, the longest a duration here may be"
            ));
        }
        Ok(HumanDuration(Duration::from_secs(secs)))
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::test_support::*;
    use crate::core::policy::*;

    #[test]
    fn bad_cidr_points_at_the_value() {
        let (line, col, msg) = err("version: 1\ndeny:\n  - cidr: 10.0.0.0/33\n");
        assert_eq!((line, col), (3, 11), "{msg}");
        assert!(msg.contains("not an IP network"), "{msg}");
    }

    #[test]
    fn host_bits_are_refused_with_a_suggestion() {
        let (_, _, msg) = err("version: 1\nallow:\n  - cidr: 203.0.113.9/24\n");
        assert!(msg.contains("did you mean 203.0.113.0/24"), "{msg}");
    }

    #[test]
    fn port_out_of_range_is_refused() {
        let (line, col, msg) =
            err("version: 1\nallow:\n  - domain: a.example\n    ports: [443, 70000]\n");
        assert_eq!((line, col), (4, 18), "{msg}");
        assert!(msg.contains("port `70000` is out of range"), "{msg}");
        let (_, _, msg) = err("version: 1\nallow:\n  - cidr: 192.0.2.0/24\n    ports: [0]\n");
        assert!(msg.contains("port `0` is out of range"), "{msg}");
    }

    #[test]
    fn backwards_and_malformed_ranges_are_refused() {
        let (_, _, msg) =
            err("version: 1\nallow:\n  - cidr: 192.0.2.0/24\n    ports: [\"90-80\"]\n");
        assert!(msg.contains("runs backwards"), "{msg}");
        let (_, _, msg) =
            err("version: 1\nallow:\n  - cidr: 192.0.2.0/24\n    ports: [\"http\"]\n");
        assert!(msg.contains("not a port number"), "{msg}");
    }

    #[test]
    fn refresh_and_grace_durations() {
        let p = parse("version: 1\ndns:\n  refresh: { min: 5s, max: 2h }\n  grace: 1m\n")
            .expect("valid");
        assert_eq!(p.dns.refresh_min, Duration::from_secs(5));
        assert_eq!(p.dns.refresh_max, Duration::from_secs(7200));
        assert_eq!(p.dns.grace, Duration::from_secs(60));
        let d = parse("version: 1\n").expect("valid");
        assert_eq!(
            (d.dns.refresh_min, d.dns.refresh_max, d.dns.grace),
            (DEFAULT_REFRESH_MIN, DEFAULT_REFRESH_MAX, DEFAULT_GRACE)
        );
        let (line, col, msg) = err("version: 1\ndns:\n  grace: 10 minutes\n");
        assert_eq!((line, col), (3, 10), "{msg}");
        assert!(msg.contains("not a duration"), "{msg}");
        let (_, _, msg) = err("version: 1\ndns:\n  refresh: { min: 2h, max: 1h }\n");
        assert!(msg.contains("swap them"), "{msg}");
        let (_, _, msg) = err("version: 1\ndns:\n  grace: 0s\n");
        assert!(msg.contains("is zero"), "{msg}");
        // Would overflow a deadline (and a kernel timeout in milliseconds).
        let (line, _, msg) = err("version: 1\ndns:\n  grace: 99999999999999999d\n");
        assert_eq!(line, 3);
        assert!(msg.contains("longer than a year"), "{msg}");
        assert!(parse("version: 1\ndns:\n  grace: 365d\n").is_ok());
    }

    #[test]
    fn probe_section_parses_targets_and_defaults() {
        let p = parse(
            "version: 1\nprobe:\n  blocked: [\"paste.example:443\", \"203.0.113.9:80\", \"[2001:db8::9]:443\"]\n  rogue_resolvers: [198.51.100.53]\n  exfil_domain: exfil.example.com\n",
        )
        .expect("valid");
        let shown: Vec<String> = p.probe.blocked.iter().map(|t| t.to_string()).collect();
        assert_eq!(
            shown,
            ["paste.example:443", "203.0.113.9:80", "[2001:db8::9]:443"]
        );
        assert_eq!(
            p.probe.rogue_resolvers,
            vec!["198.51.100.53".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(p.probe.exfil_domain.unwrap().as_str(), "exfil.example.com");
        let d = parse("version: 1\n").expect("valid");
        assert!(d.probe.blocked.is_empty());
        assert_eq!(d.probe.rogue_resolvers.len(), DEFAULT_ROGUE_RESOLVERS.len());
        assert_eq!(d.probe.exfil_domain, None);
        for bad in [
            "\"paste.example\"",
            "\"2001:db8::9:443\"",
            "\"a.example:0\"",
            "\"[zz]:1\"",
        ] {
            let (line, _, msg) = err(&format!("version: 1\nprobe:\n  blocked: [{bad}]\n"));
            assert_eq!(line, 3, "{bad}: {msg}");
        }
    }
}
