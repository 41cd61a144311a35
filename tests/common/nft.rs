//! Reading the sandbox's ruleset back with `nft` (an independent reader of the kernel).

use std::net::IpAddr;
use std::time::Duration;

use super::world::World;

/// `nft -j list ruleset` output without what legitimately differs between two loads of the
/// same table: handles, the order in which the kernel lists set elements, and counter values.
pub fn normalized_ruleset(mut v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    fn walk(v: &mut Value) {
        match v {
            Value::Object(map) => {
                map.remove("handle");
                for (key, value) in map.iter_mut() {
                    walk(value);
                    match (key.as_str(), value) {
                        ("elem", Value::Array(items)) => items.sort_by_key(|i| i.to_string()),
                        ("counter", Value::Object(counter)) => {
                            for count in ["packets", "bytes"] {
                                if let Some(n) = counter.get_mut(count) {
                                    *n = 0.into();
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v
}

/// One element of a resolved set (`ADDR . PROTO . PORT`), as `nft list set` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetElement {
    pub addr: IpAddr,
    /// "tcp" or "udp".
    pub proto: String,
    pub port: u16,
    /// The element's lifetime when added (or refreshed).
    pub timeout: Option<Duration>,
    /// What is left of it.
    pub expires: Option<Duration>,
}

/// The elements of a concatenated `ADDR . PROTO . PORT` set in `nft list set` output.
fn parse_set_elements(text: &str) -> Result<Vec<SetElement>, String> {
    let Some(start) = text.find("elements = {") else {
        return Ok(Vec::new()); // an empty set has no elements line
    };
    let body = &text[start + "elements = {".len()..];
    let body = &body[..body.find('}').ok_or("no closing brace")?];
    let mut elements = Vec::new();
    for item in body.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let t: Vec<&str> = item.split_whitespace().collect();
        if t.len() < 5 || t[1] != "." || t[3] != "." {
            return Err(format!("not ADDR . PROTO . PORT: {item:?}"));
        }
        let mut e = SetElement {
            addr: t[0].parse().map_err(|e| format!("{item:?}: {e}"))?,
            proto: match t[2] {
                "6" => "tcp".into(),
                "17" => "udp".into(),
                p => p.to_string(),
            },
            port: t[4].parse().map_err(|e| format!("{item:?}: {e}"))?,
            timeout: None,
            expires: None,
        };
        let mut rest = t[5..].iter();
        while let Some(key) = rest.next() {
            match *key {
                "timeout" => e.timeout = Some(parse_nft_duration(rest.next().unwrap_or(&""))?),
                "expires" => e.expires = Some(parse_nft_duration(rest.next().unwrap_or(&""))?),
                _ => {}
            }
        }
        elements.push(e);
    }
    Ok(elements)
}

/// "3s", "2s592ms", "1h2m", "1d" as nft prints durations.
fn parse_nft_duration(s: &str) -> Result<Duration, String> {
    let mut total = Duration::ZERO;
    let mut rest = s;
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let n: u64 = rest[..digits]
            .parse()
            .map_err(|_| format!("bad duration {s:?}"))?;
        rest = &rest[digits..];
        let unit = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        total += match &rest[..unit] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(60 * n),
            "h" => Duration::from_secs(3600 * n),
            "d" => Duration::from_secs(86400 * n),
            u => return Err(format!("unknown unit {u:?} in {s:?}")),
        };
        rest = &rest[unit..];
    }
    Ok(total)
}

impl World {
    /// The kernel handle of table inet egress_fence in the sandbox (`None`: not installed).
    /// A full apply replaces the table, and the new one gets a new handle.
    pub fn table_handle(&self) -> Option<u64> {
        self.nft_json()["nftables"].as_array().and_then(|a| {
            a.iter()
                .find(|o| o["table"]["family"] == "inet" && o["table"]["name"] == "egress_fence")
                .and_then(|o| o["table"]["handle"].as_u64())
        })
    }

    /// `nft -j list ruleset` inside the sandbox, parsed.
    pub fn nft_json(&self) -> serde_json::Value {
        let out = self.sandbox_cmd(&["nft", "-j", "list", "ruleset"]);
        assert!(out.success(), "nft -j list ruleset in the sandbox: {out}");
        serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("nft -j output is not JSON ({e}): {}", out.stdout))
    }

    /// The elements of the set `set` (e.g. "resolved4") of table inet egress_fence in the
    /// sandbox, with their timeouts (read from `nft list set`, which shows milliseconds where
    /// `nft -j` rounds down to seconds). Panics when the set cannot be listed.
    pub fn set_elements(&self, set: &str) -> Vec<SetElement> {
        let out = self.sandbox_cmd(&["nft", "list", "set", "inet", "egress_fence", set]);
        assert!(out.success(), "nft list set inet egress_fence {set}: {out}");
        parse_set_elements(&out.stdout)
            .unwrap_or_else(|e| panic!("cannot read the elements of {set} ({e}):\n{out}"))
    }

    /// The element of the resolved sets for `addr` on TCP `port`, if there is one.
    pub fn resolved_element(&self, addr: IpAddr, port: u16) -> Option<SetElement> {
        let set = if addr.is_ipv4() {
            "resolved4"
        } else {
            "resolved6"
        };
        self.set_elements(set)
            .into_iter()
            .find(|e| e.addr == addr && e.proto == "tcp" && e.port == port)
    }
}
