//! Domain names and the wildcard patterns over them.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A name pattern: `*.SUFFIX` stands for exactly one more label, `**.SUFFIX` for one or more.
/// Neither covers SUFFIX itself.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Wildcard {
    pub suffix: DomainName,
    pub any_depth: bool,
}

impl Wildcard {
    pub fn matches(&self, name: &DomainName) -> bool {
        let head = name
            .as_str()
            .strip_suffix(self.suffix.as_str())
            .and_then(|h| h.strip_suffix('.'));
        match head {
            Some(head) if !head.is_empty() => self.any_depth || !head.contains('.'),
            _ => false,
        }
    }
}

impl fmt::Display for Wildcard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stars = if self.any_depth { "**" } else { "*" };
        write!(f, "{stars}.{}", self.suffix)
    }
}

impl Serialize for Wildcard {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A fully qualified domain name, lower case, without the trailing dot.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DomainName(String);

impl DomainName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DomainName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for DomainName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl FromStr for DomainName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let name = s.trim().trim_end_matches('.').to_ascii_lowercase();
        if name.contains('*') {
            return Err(format!(
                "`{s}` is not a name: `*` may stand only as the whole first label, `*.example.com` \
                 (one label) or `**.example.com` (any depth), and needs `dns.mode: guard`"
            ));
        }
        if name.parse::<IpAddr>().is_ok() || name.parse::<IpNet>().is_ok() {
            return Err(format!(
                "`{s}` is an address, not a name; write it as `cidr: {s}`"
            ));
        }
        if name.is_empty() {
            return Err("the domain name is empty; write a name such as api.example.com".into());
        }
        if name.len() > 253 {
            return Err(format!(
                "`{s}` is longer than the 253 characters a DNS name may have"
            ));
        }
        for label in name.split('.') {
            let ok_chars = label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if label.is_empty() || label.len() > 63 || !ok_chars {
                return Err(format!(
                    "`{s}` is not a valid domain name: each dot-separated label must be 1 to 63 \
                     letters, digits, '-' or '_' (use punycode, xn--..., for international names)"
                ));
            }
            if label.starts_with('-') || label.ends_with('-') {
                return Err(format!(
                    "`{s}` is not a valid domain name: the label `{label}` starts or ends with '-'"
                ));
            }
        }
        Ok(DomainName(name))
    }
}

impl<'de> Deserialize<'de> for DomainName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// A valid name of exactly `len` characters under `zone`: labels of `a` (at most 63 each),
/// for the longest names a client may ask.
#[cfg(test)]
pub(crate) fn name_of_length(zone: &str, len: usize) -> String {
    let mut labels: Vec<String> = Vec::new();
    let mut room = len - zone.len() - 1;
    while room > 0 {
        let dot = usize::from(!labels.is_empty());
        // Never leave room for a dot alone.
        let label = match room - dot {
            left if left > 64 => 63,
            64 => 62,
            left => left,
        };
        labels.push("a".repeat(label));
        room -= label + dot;
    }
    let name = format!("{}.{zone}", labels.join("."));
    assert_eq!(name.len(), len, "{name}");
    name
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::test_support::*;

    #[test]
    fn names_of_every_length_are_valid() {
        for len in 9..=253 {
            let name = name_of_length("example", len);
            assert!(name.parse::<DomainName>().is_ok(), "{len}: {name}");
        }
    }

    /// A name, or every name under a wildcard, longer than an element's comment holds is
    /// refused where it is written: the table could not say which name an address is for.
    #[test]
    fn names_longer_than_a_comment_holds_are_refused_where_written() {
        let name = |len: usize| name_of_length("example", len);
        let policy = |domain: &str| {
            format!("version: 1\nallow:\n  - domain: \"{domain}\"\n    ports: [443]\n")
        };
        let guard = |domain: &str| {
            format!(
                "{}dns:\n  mode: guard\n  upstream: [192.0.2.53]\n",
                policy(domain)
            )
        };
        let kept = parse(&policy(&name(251)));
        assert!(kept.is_ok(), "{kept:?}");
        let kept = parse(&guard(&format!("*.{}", name(249))));
        assert!(kept.is_ok(), "{kept:?}");
        for text in [
            policy(&name(252)),
            guard(&format!("*.{}", name(250))),
            guard(&format!("**.{}", name(250))),
        ] {
            let (line, column, msg) = err(&text);
            assert_eq!((line, column), (3, 14), "{msg}");
            assert!(msg.contains("at most 251 characters"), "{msg}");
        }
    }

    #[test]
    fn malformed_domains_are_refused() {
        for bad in ["bad..example", "-a.example", "a_b c.example", "a.example-"] {
            let (line, _, msg) = err(&format!("version: 1\nallow:\n  - domain: \"{bad}\"\n"));
            assert_eq!(line, 3, "{bad}: {msg}");
            assert!(msg.contains("not a valid domain name"), "{bad}: {msg}");
        }
        let long = format!("{}.example", "a".repeat(64));
        let (_, _, msg) = err(&format!("version: 1\nallow:\n  - domain: {long}\n"));
        assert!(msg.contains("not a valid domain name"), "{msg}");
    }

    #[test]
    fn address_as_domain_points_to_cidr() {
        let (_, _, msg) = err("version: 1\nallow:\n  - domain: 192.0.2.1\n");
        assert!(msg.contains("cidr: 192.0.2.1"), "{msg}");
    }

    #[test]
    fn wildcards_need_guard_mode_and_match_by_depth() {
        let (line, col, msg) = err(
            "version: 1\nallow:\n  - domain: api.example\n    ports: [443]\n  - domain: \"*.pool.example\"\n    ports: [443]\n",
        );
        assert_eq!((line, col), (5, 14), "{msg}");
        assert!(msg.contains("dns.mode: guard"), "{msg}");
        let (_, _, msg) = err(&GUARD.replace("*.pool", "a.*.pool"));
        assert!(msg.contains("whole first label"), "{msg}");

        let p = parse(GUARD).expect("valid");
        let allowed = |name: &str| {
            let name: DomainName = name.parse().unwrap();
            p.allow.iter().any(|a| a.target.matches(&name))
        };
        assert!(allowed("a.pool.example"));
        assert!(!allowed("a.b.pool.example"), "`*` is one label");
        assert!(
            !allowed("pool.example"),
            "a wildcard never covers its suffix"
        );
        assert!(!allowed("xpool.example"));
        assert!(allowed("a.cdn.example"));
        assert!(allowed("a.b.c.cdn.example"), "`**` is any depth");
        assert!(!allowed("cdn.example"));
        assert!(allowed("api.example"));
        assert!(
            !allowed("x.api.example"),
            "an exact name covers no subdomain"
        );
        assert!(p.domains().iter().all(|d| d.as_str() == "api.example"));
    }
}
