//! The table as read back from the kernel, decoded into the ruleset's own terms.

use std::fmt;
use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Subnets, Ipv6Subnets};
use serde::Serialize;

use super::encode::{comment_of, decode_rule};
use super::sys::{DumpedRule, LiveChain, LiveElem, LiveExpr, LiveSet, NFT_SET_ELEM_INTERVAL_END};
use crate::core::policy::{L4Proto, PortRange};
use crate::core::ruleset::{
    Elements, Family, KeyShape, OUTPUT_CHAIN, REFUSED_CHAIN, Rule, SetId, SetRole, TABLE, Timed,
    Tuple,
};

/// Everything in the tool's table, as the kernel reports it.
#[derive(Debug, Clone)]
pub struct LiveTable {
    /// The table's flags (`NFT_TABLE_F_*`); ours has none.
    pub flags: u32,
    pub chains: Vec<LiveChain>,
    pub rules: Vec<LiveRule>,
    pub sets: Vec<(LiveSet, Vec<LiveElem>)>,
}

/// One rule of the live table: its chain, and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveRule {
    pub chain: String,
    pub handle: u64,
    pub rule: ReadRule,
    /// What the rule's counter counted, if it has one.
    pub counter: Option<Counter>,
}

/// A rule as read back from the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadRule {
    /// Exactly a rule egress-fence writes.
    Known(Rule),
    /// Anything else, as libnftnl prints its expressions: equal to no rule egress-fence
    /// wants, so it is always drift.
    Unknown(Vec<String>),
}

impl LiveRule {
    /// Decodes a dumped rule (see [`decode_rule`]).
    pub fn decode(dumped: DumpedRule) -> LiveRule {
        let counter = dumped.exprs.iter().find_map(|e| match e {
            LiveExpr::Counter { packets, bytes } => Some(Counter {
                packets: *packets,
                bytes: *bytes,
            }),
            _ => None,
        });
        let rule = match decode_rule(&dumped.exprs) {
            Some(rule) => ReadRule::Known(rule),
            None => ReadRule::Unknown(dumped.text),
        };
        LiveRule {
            chain: dumped.chain,
            handle: dumped.handle,
            rule,
            counter,
        }
    }
}

/// A known rule as nft writes it; any other as libnftnl's expressions, `[a; b; c]`.
impl fmt::Display for ReadRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadRule::Known(rule) => write!(f, "{rule}"),
            ReadRule::Unknown(text) => write!(f, "[{}]", text.join("; ")),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub table: String,
    /// The table is switched off (`flags dormant`): it refuses nothing.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub dormant: bool,
    pub chains: Vec<ChainStatus>,
    /// Packets and bytes refused since the table was installed, per family.
    pub refused: Refused,
    pub sets: Vec<SetStatus>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChainStatus {
    pub name: String,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hook: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    pub rules: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Refused {
    pub ipv4: Counter,
    pub ipv6: Counter,
}

#[derive(Debug, Clone, Serialize)]
pub struct SetStatus {
    pub name: String,
    /// Kernel elements (an interval counts its start and end where the set stores both).
    pub kernel_elements: usize,
    /// The decoded contents, for the sets egress-fence knows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contents: Option<Elements>,
}

impl LiveTable {
    pub fn status(&self) -> Status {
        let chains = self
            .chains
            .iter()
            .map(|c| ChainStatus {
                name: c.name.clone(),
                kind: c.kind.clone(),
                hook: c.hook.map(|(hook, _, _)| hook_name(hook).to_string()),
                priority: c.hook.map(|(_, prio, _)| prio),
                policy: c.hook.map(|(_, _, policy)| policy_name(policy).to_string()),
                rules: self.rules.iter().filter(|r| r.chain == c.name).count(),
            })
            .collect();
        let counter = |family: Family| {
            self.rules
                .iter()
                .filter(|r| {
                    r.chain == REFUSED_CHAIN && r.rule == ReadRule::Known(Rule::CountFamily(family))
                })
                .find_map(|r| r.counter)
                .unwrap_or_default()
        };
        let refused = Refused {
            ipv4: counter(Family::V4),
            ipv6: counter(Family::V6),
        };
        let sets = self
            .sets
            .iter()
            .map(|(set, elems)| SetStatus {
                name: set.name.clone(),
                kernel_elements: elems.len(),
                contents: SetId::from_name(&set.name).map(|id| decode(id, elems)),
            })
            .collect();
        Status {
            table: format!("inet {TABLE}"),
            dormant: self.flags & TABLE_F_DORMANT != 0,
            chains,
            refused,
            sets,
        }
    }

    /// The decoded contents of one of our sets.
    pub fn contents(&self, id: SetId) -> Option<Elements> {
        let name = id.name();
        self.sets
            .iter()
            .find(|(s, _)| s.name == name)
            .map(|(_, elems)| decode(id, elems))
    }
}

/// The NFLOG group refused packets are logged to, if the table's rules log to one.
pub fn log_group(rules: &[LiveRule]) -> Option<u16> {
    rules
        .iter()
        .filter(|r| r.chain == REFUSED_CHAIN)
        .find_map(|r| match &r.rule {
            ReadRule::Known(Rule::Log(log)) => log.group,
            _ => None,
        })
}

/// Who the table lets ask the resolvers of its DNS sets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DnsAccess {
    /// The uids of the rules `meta mark M meta skuid U ... @dns4/@dns6 accept`: in guard mode
    /// only their sockets may reach the resolvers.
    pub uids: Vec<u32>,
    /// The marks those rules also ask for (the guard's `SO_MARK`). A rule with a uid and no
    /// mark (a table of an older version) lets every socket of that uid through.
    pub marks: Vec<u32>,
    /// A rule accepts DNS to the resolvers from every uid (a resolve-mode table).
    pub everyone: bool,
}

impl LiveTable {
    pub fn dns_access(&self) -> DnsAccess {
        let mut access = DnsAccess::default();
        let rules = self.rules.iter().filter(|r| r.chain == OUTPUT_CHAIN);
        // The refusals before the replies look up the same sets (`meta skuid != U ...
        // goto refused`): only accepts say who may ask.
        for rule in rules {
            match &rule.rule {
                ReadRule::Known(Rule::AcceptTupleFromGuard { set, mark, uid })
                    if set.role == SetRole::Dns =>
                {
                    if !access.uids.contains(uid) {
                        access.uids.push(*uid);
                    }
                    if let Some(mark) = mark
                        && !access.marks.contains(mark)
                    {
                        access.marks.push(*mark);
                    }
                }
                ReadRule::Known(Rule::AcceptTupleIn(set)) if set.role == SetRole::Dns => {
                    access.everyone = true;
                }
                _ => {}
            }
        }
        access
    }
}

/// In guard mode, the note for a refused packet to a DNS port (53, 853): `None` for any other.
pub fn guard_dns_note(uid: u32, dport: Option<u16>, to_upstream: bool) -> Option<String> {
    let port = dport.filter(|p| crate::core::plan::GUARDED_DNS_PORTS.contains(p))?;
    Some(if to_upstream {
        format!(
            "DNS to the guard's upstream resolver: only the guard (uid {uid}, its sockets \
             marked) may ask it"
        )
    } else {
        format!("DNS (port {port}) to a resolver other than the guard: refused in guard mode")
    })
}

/// What the installed table says about destinations, for notes on refused packets.
#[derive(Debug, Clone, Default)]
pub struct Destinations {
    denied: Vec<IpNet>,
    allowed: Vec<IpNet>,
    /// The resolvers of the DNS sets, and in guard mode the uid that alone may ask them.
    resolvers: Vec<IpNet>,
    guard_uid: Option<u32>,
}

impl Destinations {
    pub fn of(table: &LiveTable) -> Destinations {
        let mut d = Destinations::default();
        for id in SetId::ALL {
            let Some(contents) = table.contents(id) else {
                continue;
            };
            let nets: Vec<IpNet> = match contents {
                Elements::Networks(n) => n,
                Elements::Tuples(t) => t.into_iter().map(|t| t.net).collect(),
                Elements::Timed(t) => t.into_iter().map(|t| t.tuple.net).collect(),
            };
            match id.role {
                SetRole::Deny => d.denied.extend(nets),
                SetRole::Dns => d.resolvers.extend(nets),
                _ => d.allowed.extend(nets),
            }
        }
        d.guard_uid = table.dns_access().uids.first().copied();
        d
    }

    /// "denied (169.254.0.0/16)", "allowed on other ports or protocols only", "not in the
    /// policy", or in guard mode what it says of DNS.
    pub fn note(&self, dst: IpAddr, dport: Option<u16>) -> String {
        let upstream = self.resolvers.iter().any(|n| n.contains(&dst));
        if let Some(note) = self
            .guard_uid
            .and_then(|uid| guard_dns_note(uid, dport, upstream))
        {
            return note;
        }
        if let Some(net) = self.denied.iter().find(|n| n.contains(&dst)) {
            format!("denied ({})", crate::core::ruleset::fmt_net(net))
        } else if self
            .allowed
            .iter()
            .chain(&self.resolvers)
            .any(|n| n.contains(&dst))
        {
            "allowed on other ports or protocols only".to_string()
        } else {
            "not in the policy".to_string()
        }
    }
}

/// `NFT_TABLE_F_DORMANT`: the table is switched off, and none of its chains sees a packet.
pub const TABLE_F_DORMANT: u32 = 1;
/// `NFT_TABLE_F_OWNER`: the table belongs to the netlink socket that made it.
pub const TABLE_F_OWNER: u32 = 2;

/// A table's flags as nft writes them: "dormant", "owner", "none".
pub fn describe_table_flags(flags: u32) -> String {
    let mut names: Vec<String> = [(TABLE_F_DORMANT, "dormant"), (TABLE_F_OWNER, "owner")]
        .into_iter()
        .filter(|(bit, _)| flags & bit != 0)
        .map(|(_, name)| name.to_string())
        .collect();
    let rest = flags & !(TABLE_F_DORMANT | TABLE_F_OWNER);
    if rest != 0 {
        names.push(format!("{rest:#x}"));
    }
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(",")
    }
}

/// What makes a chain what it is, besides its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainDefinition {
    /// The type of a base chain (`filter`).
    pub kind: Option<String>,
    /// Hook number, priority and policy of a base chain.
    pub hook: Option<(u32, i32, u32)>,
    pub flags: u32,
}

impl ChainDefinition {
    pub fn of(chain: &LiveChain) -> ChainDefinition {
        ChainDefinition {
            kind: chain.kind.clone(),
            hook: chain.hook,
            flags: chain.flags,
        }
    }

    /// "hook output priority 0 policy drop", "no hook"; the type when it is not `filter`
    /// (every chain of ours is one), the flags when there are any.
    pub fn describe(&self) -> String {
        let mut out = match self.kind.as_deref() {
            Some("filter") | None => String::new(),
            Some(kind) => format!("type {kind} "),
        };
        out.push_str(&describe_hook(self.hook));
        if self.flags != 0 {
            out.push_str(&format!(" flags {:#x}", self.flags));
        }
        out
    }
}

/// A chain's hook as nft writes it: "hook output priority 0 policy drop", or "no hook" for a
/// regular chain.
pub fn describe_hook(hook: Option<(u32, i32, u32)>) -> String {
    match hook {
        Some((hook, priority, policy)) => format!(
            "hook {} priority {priority} policy {}",
            hook_name(hook),
            policy_name(policy)
        ),
        None => "no hook".to_string(),
    }
}

fn policy_name(policy: u32) -> &'static str {
    if policy == libc::NF_DROP as u32 {
        "drop"
    } else {
        "accept"
    }
}

fn hook_name(hook: u32) -> &'static str {
    match hook as i32 {
        libc::NF_INET_PRE_ROUTING => "prerouting",
        libc::NF_INET_LOCAL_IN => "input",
        libc::NF_INET_FORWARD => "forward",
        libc::NF_INET_LOCAL_OUT => "output",
        libc::NF_INET_POST_ROUTING => "postrouting",
        _ => "other",
    }
}

fn addr_of(family: Family, bytes: &[u8]) -> Option<IpAddr> {
    match family {
        Family::V4 => <[u8; 4]>::try_from(bytes.get(..4)?).ok().map(IpAddr::from),
        Family::V6 => <[u8; 16]>::try_from(bytes.get(..16)?)
            .ok()
            .map(IpAddr::from),
    }
}

/// The networks exactly covering `first..=last`.
fn cover(first: IpAddr, last: IpAddr) -> Vec<IpNet> {
    match (first, last) {
        (IpAddr::V4(a), IpAddr::V4(b)) => Ipv4Subnets::new(a, b, 0).map(IpNet::V4).collect(),
        (IpAddr::V6(a), IpAddr::V6(b)) => Ipv6Subnets::new(a, b, 0).map(IpNet::V6).collect(),
        _ => Vec::new(),
    }
}

fn prev_addr(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V4(a) => IpAddr::from(u32::from(a).wrapping_sub(1).to_be_bytes()),
        IpAddr::V6(a) => IpAddr::from(u128::from(a).wrapping_sub(1).to_be_bytes()),
    }
}

fn top(family: Family) -> IpAddr {
    match family {
        Family::V4 => IpAddr::from([0xff; 4]),
        Family::V6 => IpAddr::from([0xff; 16]),
    }
}

fn decode(id: SetId, elems: &[LiveElem]) -> Elements {
    match id.shape() {
        KeyShape::Addr => Elements::Networks(decode_intervals(id.family, elems)),
        KeyShape::Tuple if id.timeout() => {
            let mut timed: Vec<Timed> = elems
                .iter()
                .flat_map(|e| {
                    decode_tuple(id.family, e).into_iter().map(|tuple| Timed {
                        tuple,
                        timeout_ms: e.timeout_ms,
                        expires_ms: e.expires_ms,
                        name: e.userdata.as_deref().and_then(comment_of),
                    })
                })
                .collect();
            timed.sort();
            Elements::Timed(timed)
        }
        KeyShape::Tuple => {
            let mut tuples: Vec<Tuple> = elems
                .iter()
                .flat_map(|e| decode_tuple(id.family, e))
                .collect();
            tuples.sort();
            Elements::Tuples(tuples)
        }
    }
}

/// Start and end elements of a plain interval set back into networks.
fn decode_intervals(family: Family, elems: &[LiveElem]) -> Vec<IpNet> {
    let mut points: Vec<(IpAddr, bool)> = elems
        .iter()
        .filter_map(|e| {
            let is_end = e.flags & NFT_SET_ELEM_INTERVAL_END != 0;
            addr_of(family, &e.key).map(|a| (a, is_end))
        })
        .collect();
    // At an address where one interval ends and the next starts, close before opening.
    points.sort_by_key(|(a, is_end)| (*a, !*is_end));
    let mut nets = Vec::new();
    let mut open: Option<IpAddr> = None;
    for (addr, is_end) in points {
        match (is_end, open) {
            (false, None) => open = Some(addr),
            (true, Some(start)) => {
                nets.extend(cover(start, prev_addr(addr)));
                open = None;
            }
            _ => {}
        }
    }
    if let Some(start) = open {
        nets.extend(cover(start, top(family)));
    }
    nets
}

fn decode_tuple(family: Family, e: &LiveElem) -> Vec<Tuple> {
    let addr_len = match family {
        Family::V4 => 4,
        Family::V6 => 16,
    };
    let field = |key: &[u8]| -> Option<(IpAddr, u8, u16)> {
        let addr = addr_of(family, key)?;
        let proto = *key.get(addr_len)?;
        let port = u16::from_be_bytes([*key.get(addr_len + 4)?, *key.get(addr_len + 5)?]);
        Some((addr, proto, port))
    };
    let Some((first, proto, port_first)) = field(&e.key) else {
        return Vec::new();
    };
    let (last, port_last) = match e.key_end.as_deref().and_then(field) {
        Some((last, _, port_last)) => (last, port_last),
        None => (first, port_first),
    };
    let Some(proto) = L4Proto::from_number(proto) else {
        return Vec::new();
    };
    cover(first, last)
        .into_iter()
        .map(|net| Tuple {
            net,
            proto,
            ports: PortRange {
                first: port_first,
                last: port_last,
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ruleset::SetRole;
    use crate::nft::encode::set_elements;

    fn live(elems: Vec<super::super::sys::Elem>) -> Vec<LiveElem> {
        elems
            .into_iter()
            .map(|e| LiveElem {
                key: e.key,
                key_end: e.key_end,
                flags: e.flags,
                timeout_ms: e.timeout_ms,
                expires_ms: None,
                userdata: e.userdata,
            })
            .collect()
    }

    #[test]
    fn interval_sets_decode_to_what_was_encoded() {
        for family in Family::BOTH {
            let nets: Vec<IpNet> = match family {
                Family::V4 => vec![
                    "0.0.0.0/8",
                    "10.0.0.0/8",
                    "11.0.0.0/8",
                    "255.255.255.255/32",
                ],
                Family::V6 => vec!["2001:db8::/32", "fd00:ec2::254/128"],
            }
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
            let id = SetId::new(SetRole::Deny, family);
            let mut elems = live(set_elements(id, &Elements::Networks(nets.clone())).collect());
            elems.reverse(); // the kernel lists an rbtree backwards
            let decoded = decode(id, &elems);
            assert_eq!(decoded, Elements::Networks(nets), "{family:?}");
        }
    }

    #[test]
    fn tuple_sets_decode_to_what_was_encoded() {
        let tuples = [
            Tuple {
                net: "192.0.2.10/32".parse().unwrap(),
                proto: L4Proto::Tcp,
                ports: PortRange::single(443),
            },
            Tuple {
                net: "203.0.113.0/28".parse().unwrap(),
                proto: L4Proto::Udp,
                ports: PortRange {
                    first: 8000,
                    last: 8080,
                },
            },
        ];
        let id = SetId::new(SetRole::Allow, Family::V4);
        let want = Elements::Tuples(tuples.to_vec());
        assert_eq!(decode(id, &live(set_elements(id, &want).collect())), want);

        let id = SetId::new(SetRole::Resolved, Family::V4);
        let want = Elements::Timed(vec![Timed {
            tuple: tuples[0],
            timeout_ms: Some(5000),
            expires_ms: None,
            name: Some("api.example.com".into()),
        }]);
        let elems = live(set_elements(id, &want).collect());
        assert_eq!(elems[0].timeout_ms, Some(5000));
        // nft's comment TLV: type 0, length, the text and its NUL.
        assert_eq!(
            elems[0].userdata.as_deref(),
            Some(&b"\x00\x10api.example.com\x00"[..])
        );
        assert_eq!(decode(id, &elems), want);
    }

    #[test]
    fn notes_say_why_dns_was_refused_in_guard_mode() {
        let mut d = Destinations {
            resolvers: vec!["192.0.2.53/32".parse().unwrap()],
            guard_uid: Some(993),
            ..Destinations::default()
        };
        let upstream: IpAddr = "192.0.2.53".parse().unwrap();
        let other: IpAddr = "203.0.113.9".parse().unwrap();
        assert!(
            d.note(upstream, Some(53))
                .contains("only the guard (uid 993, its sockets marked)")
        );
        assert!(
            d.note(other, Some(853))
                .contains("port 853) to a resolver other than the guard")
        );
        assert_eq!(
            d.note(upstream, Some(443)),
            "allowed on other ports or protocols only"
        );
        d.guard_uid = None;
        assert_eq!(d.note(other, Some(53)), "not in the policy");
    }

    #[test]
    fn dns_access_reads_the_guard_uid_from_the_rules() {
        let rule = |r: crate::core::ruleset::Rule| {
            let mut dumped = crate::nft::encode::dumped_rule(&r).unwrap();
            dumped.chain = OUTPUT_CHAIN.into();
            LiveRule::decode(dumped)
        };
        let dns4 = SetId::new(SetRole::Dns, Family::V4);
        let table = |rules| LiveTable {
            flags: 0,
            chains: Vec::new(),
            rules,
            sets: Vec::new(),
        };
        let guard = |mark| crate::core::ruleset::Rule::AcceptTupleFromGuard {
            set: dns4,
            mark,
            uid: 993,
        };
        assert_eq!(
            table(vec![rule(guard(Some(0x6500_0000)))]).dns_access(),
            DnsAccess {
                uids: vec![993],
                marks: vec![0x6500_0000],
                everyone: false
            }
        );
        // A table of an older version: the uid alone.
        assert_eq!(
            table(vec![rule(guard(None))]).dns_access(),
            DnsAccess {
                uids: vec![993],
                marks: vec![],
                everyone: false
            }
        );
        let resolve = crate::core::ruleset::Rule::AcceptTupleIn(dns4);
        assert_eq!(
            table(vec![rule(resolve)]).dns_access(),
            DnsAccess {
                uids: vec![],
                marks: vec![],
                everyone: true
            }
        );
        // The refusals of other uids and unmarked sockets say nothing of who may ask.
        let refusals = vec![
            rule(crate::core::ruleset::Rule::RefuseUpstreamFromOtherUids {
                set: dns4,
                uid: 993,
            }),
            rule(crate::core::ruleset::Rule::RefuseUpstreamUnmarked {
                set: dns4,
                uid: 993,
                mark: 0x6500_0000,
            }),
            rule(guard(Some(0x6500_0000))),
        ];
        assert_eq!(
            table(refusals).dns_access(),
            DnsAccess {
                uids: vec![993],
                marks: vec![0x6500_0000],
                everyone: false
            }
        );
        // A lookup in another set says nothing about DNS.
        let allow =
            crate::core::ruleset::Rule::AcceptTupleIn(SetId::new(SetRole::Allow, Family::V4));
        assert_eq!(table(vec![rule(allow)]).dns_access(), DnsAccess::default());
    }
}
