//! The table as read back from the kernel, decoded into the ruleset's own terms.

use std::fmt;
use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Subnets, Ipv6Subnets};
use serde::Serialize;

use super::encode::{comment_of, decode_rule};
use super::sys::{
    DumpedRule, LiveChain, LiveElem, LiveExpr, LiveObject, LiveSet, NFT_SET_ELEM_INTERVAL_END,
};
use crate::core::explain::{self, WhyRefused};
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
    /// Flowtables and stateful objects: none is egress-fence's.
    pub objects: Vec<LiveObject>,
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
        let rule = match decode_rule(&dumped.exprs, dumped.userdata.as_deref()) {
            Some(rule) => ReadRule::Known(rule),
            None => {
                let mut text = dumped.text;
                // What nft shows as a comment is part of what makes the rule unknown.
                if let Some(udata) = &dumped.userdata {
                    text.push(format!(
                        "userdata {}",
                        String::from_utf8_lossy(udata).escape_debug()
                    ));
                }
                ReadRule::Unknown(text)
            }
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
    /// Elements of it egress-fence never writes (see [`SetContents`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub undecodable: Vec<String>,
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
        let refused = refused_counters(&self.rules).unwrap_or_default();
        let sets = self
            .sets
            .iter()
            .map(|(set, elems)| {
                let read = SetId::from_name(&set.name).map(|id| decode(id, elems));
                let (contents, undecodable) = match read {
                    Some(c) => (Some(c.elements), c.undecodable),
                    None => (None, Vec::new()),
                };
                SetStatus {
                    name: set.name.clone(),
                    kernel_elements: elems.len(),
                    contents,
                    undecodable,
                }
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

    /// Packets and bytes the deny entries refused (their rules' counters), per family.
    pub fn denied(&self) -> Refused {
        let mut denied = Refused::default();
        for r in &self.rules {
            let (ReadRule::Known(Rule::RefuseDaddrIn(set)), Some(c)) = (&r.rule, r.counter) else {
                continue;
            };
            let sum = match set.family {
                Family::V4 => &mut denied.ipv4,
                Family::V6 => &mut denied.ipv6,
            };
            sum.packets += c.packets;
            sum.bytes += c.bytes;
        }
        denied
    }

    /// The decoded contents of one of our sets: the elements egress-fence writes (see
    /// [`LiveTable::read_set`] for the others).
    pub fn contents(&self, id: SetId) -> Option<Elements> {
        self.read_set(id).map(|c| c.elements)
    }

    /// Everything one of our sets holds, every element decoded or listed as undecodable.
    pub fn read_set(&self, id: SetId) -> Option<SetContents> {
        let name = id.name();
        self.sets
            .iter()
            .find(|(s, _)| s.name == name)
            .map(|(_, elems)| decode(id, elems))
    }
}

impl LiveTable {
    /// The table without the flow record and the audit (rule and set) that `run --record`
    /// and `learn` add (see [`crate::core::plan::with_extras`]).
    pub fn has_extras(&self) -> bool {
        self.rules
            .iter()
            .any(|r| matches!(&r.rule, ReadRule::Known(rule) if crate::core::plan::is_extra(rule)))
            || self
                .sets
                .iter()
                .any(|(s, _)| s.name == crate::core::ruleset::AUDIT_WINDOW_SET)
    }

    pub fn without_extras(&self) -> LiveTable {
        let mut table = self.clone();
        table.rules.retain(
            |r| !matches!(&r.rule, ReadRule::Known(rule) if crate::core::plan::is_extra(rule)),
        );
        table
            .sets
            .retain(|(s, _)| s.name != crate::core::ruleset::AUDIT_WINDOW_SET);
        table
    }

    /// How long `learn`'s audit window stays open (the longest its elements have left), if
    /// the table has one and it is open.
    pub fn audit_window_open_ms(&self) -> Option<u64> {
        self.sets
            .iter()
            .find(|(s, _)| s.name == crate::core::ruleset::AUDIT_WINDOW_SET)
            .and_then(|(_, elems)| {
                // An element without a timeout (none of ours) holds the window open for good.
                elems.iter().map(|e| e.expires_ms.unwrap_or(u64::MAX)).max()
            })
    }
}

/// What the refused chain's per-family counters counted; `None` when it has neither (not a
/// table of ours).
pub fn refused_counters(rules: &[LiveRule]) -> Option<Refused> {
    let counter = |family: Family| {
        rules
            .iter()
            .filter(|r| {
                r.chain == REFUSED_CHAIN && r.rule == ReadRule::Known(Rule::CountFamily(family))
            })
            .find_map(|r| r.counter)
    };
    match (counter(Family::V4), counter(Family::V6)) {
        (None, None) => None,
        (ipv4, ipv6) => Some(Refused {
            ipv4: ipv4.unwrap_or_default(),
            ipv6: ipv6.unwrap_or_default(),
        }),
    }
}

impl Refused {
    /// Packets of both families.
    pub fn packets(&self) -> u64 {
        self.ipv4.packets.saturating_add(self.ipv6.packets)
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

    /// Why a packet to `dst`:`dport` was refused, as far as the table tells.
    pub fn why_refused(&self, dst: IpAddr, dport: Option<u16>) -> WhyRefused {
        let upstream = self.resolvers.iter().any(|n| n.contains(&dst));
        if let Some(why) = self
            .guard_uid
            .and_then(|uid| explain::guard_dns(uid, dport, upstream))
        {
            return why;
        }
        if let Some(net) = self.denied.iter().find(|n| n.contains(&dst)) {
            WhyRefused::Denied(crate::core::ruleset::fmt_net(net))
        } else if self
            .allowed
            .iter()
            .chain(&self.resolvers)
            .any(|n| n.contains(&dst))
        {
            WhyRefused::OtherPortsOnly { names: Vec::new() }
        } else {
            WhyRefused::NotInPolicy
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

/// `NFT_CHAIN_BASE`: the kernel's mark of a chain on a hook, reported among its flags.
pub const NFT_CHAIN_BASE: u32 = 1;

/// What makes a chain what it is, besides its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainDefinition {
    /// The type of a base chain (`filter`).
    pub kind: Option<String>,
    /// Hook number, priority and policy of a base chain.
    pub hook: Option<(u32, i32, u32)>,
    /// `NFT_CHAIN_*`: [`NFT_CHAIN_BASE`] for a base chain; hardware offload, binding.
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
        let flags = self.flags & !NFT_CHAIN_BASE;
        if flags != 0 {
            out.push_str(&format!(" flags {flags:#x}"));
        }
        out
    }
}

/// A chain's hook as nft writes it: "hook output priority 0 policy drop", or "no hook" for a
/// regular chain.
fn describe_hook(hook: Option<(u32, i32, u32)>) -> String {
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

/// What one of our sets holds, as far as it is elements egress-fence writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetContents {
    pub elements: Elements,
    /// Elements egress-fence never writes (a catch-all `*`, another protocol, a range of
    /// protocols, data or expressions attached), described as well as they can be: no
    /// ruleset wants them, so they are always drift.
    pub undecodable: Vec<String>,
}

/// `NFT_SET_ELEM_CATCHALL`: the element without a key, which matches every key.
const NFT_SET_ELEM_CATCHALL: u32 = 2;

fn decode(id: SetId, elems: &[LiveElem]) -> SetContents {
    let mut undecodable = Vec::new();
    let elements = match id.shape() {
        KeyShape::Addr => {
            let (ours, theirs): (Vec<&LiveElem>, Vec<&LiveElem>) =
                elems.iter().partition(|e| is_interval_point(id.family, e));
            undecodable.extend(theirs.into_iter().map(|e| describe_elem(id.family, e)));
            Elements::Networks(decode_intervals(id.family, &ours))
        }
        KeyShape::Tuple => {
            let mut decoded = Vec::new();
            for e in elems {
                match decode_tuple(id, e) {
                    Some(tuples) => decoded.extend(tuples.into_iter().map(|t| (t, e))),
                    None => undecodable.push(describe_elem(id.family, e)),
                }
            }
            if id.timeout() {
                let mut timed: Vec<Timed> = decoded
                    .into_iter()
                    .map(|(tuple, e)| Timed {
                        tuple,
                        timeout_ms: e.timeout_ms,
                        expires_ms: e.expires_ms,
                        name: e.userdata.as_deref().and_then(comment_of),
                    })
                    .collect();
                timed.sort();
                Elements::Timed(timed)
            } else {
                let mut tuples: Vec<Tuple> = decoded.into_iter().map(|(t, _)| t).collect();
                tuples.sort();
                Elements::Tuples(tuples)
            }
        }
    };
    SetContents {
        elements,
        undecodable,
    }
}

/// Whether `e` is a start or end point of an interval set of addresses, as ours are made of.
fn is_interval_point(family: Family, e: &LiveElem) -> bool {
    e.flags & !NFT_SET_ELEM_INTERVAL_END == 0
        && e.key.len() == addr_len(family)
        && e.key_end.is_none()
        && e.timeout_ms.is_none()
        && e.unread.is_empty()
}

fn addr_len(family: Family) -> usize {
    match family {
        Family::V4 => 4,
        Family::V6 => 16,
    }
}

/// Start and end elements of a plain interval set back into networks.
fn decode_intervals(family: Family, elems: &[&LiveElem]) -> Vec<IpNet> {
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

/// The fields of a tuple key: `addr . proto . port`, each padded to 4 bytes with zeros.
fn tuple_fields(family: Family, key: &[u8]) -> Option<(IpAddr, u8, u16)> {
    let n = addr_len(family);
    if key.len() != n + 8 || key[n + 1..n + 4] != [0, 0, 0] || key[n + 6..] != [0, 0] {
        return None;
    }
    let addr = addr_of(family, key)?;
    Some((addr, key[n], u16::from_be_bytes([key[n + 4], key[n + 5]])))
}

/// The tuples element `e` of set `id` stands for (the networks covering its address range),
/// or `None` if it is not an element egress-fence writes: every byte of its key and key end
/// is read, and nothing else may be attached.
fn decode_tuple(id: SetId, e: &LiveElem) -> Option<Vec<Tuple>> {
    if e.flags != 0 || !e.unread.is_empty() || (e.timeout_ms.is_some() && !id.timeout()) {
        return None;
    }
    let (first, proto, port_first) = tuple_fields(id.family, &e.key)?;
    let (last, proto_end, port_last) = match &e.key_end {
        Some(end) if id.interval() => tuple_fields(id.family, end)?,
        Some(_) => return None,
        None => (first, proto, port_first),
    };
    if proto_end != proto || first > last || port_first > port_last {
        return None;
    }
    let proto = L4Proto::from_number(proto)?;
    let ports = PortRange {
        first: port_first,
        last: port_last,
    };
    Some(
        cover(first, last)
            .into_iter()
            .map(|net| Tuple { net, proto, ports })
            .collect(),
    )
}

/// An element egress-fence does not write, as nft would about write it: `*` for a
/// catch-all, `0.0.0.0/0 . udplite . 0-65535`, `10.0.0.1 . tcp-udp . 53`; else its bytes.
fn describe_elem(family: Family, e: &LiveElem) -> String {
    let mut out = if e.flags & NFT_SET_ELEM_CATCHALL != 0 {
        "*".to_string()
    } else if let Some((first, proto, port)) = tuple_fields(family, &e.key) {
        let (last, proto_end, port_end) = e
            .key_end
            .as_deref()
            .and_then(|end| tuple_fields(family, end))
            .unwrap_or((first, proto, port));
        let addrs = match cover(first, last).as_slice() {
            [net] => crate::core::ruleset::fmt_net(net),
            _ if first == last => first.to_string(),
            _ => format!("{first}-{last}"),
        };
        let protos = if proto == proto_end {
            proto_name(proto)
        } else {
            format!("{}-{}", proto_name(proto), proto_name(proto_end))
        };
        let ports = if port == port_end {
            port.to_string()
        } else {
            format!("{port}-{port_end}")
        };
        format!("{addrs} . {protos} . {ports}")
    } else if let (Some(addr), true) = (addr_of(family, &e.key), e.key.len() == addr_len(family)) {
        addr.to_string()
    } else {
        format!("key 0x{}", hex(&e.key))
    };
    if let Some(end) = &e.key_end
        && tuple_fields(family, end).is_none()
    {
        out.push_str(&format!(" key end 0x{}", hex(end)));
    }
    let flags = e.flags & !NFT_SET_ELEM_CATCHALL;
    if flags != 0 {
        out.push_str(&format!(" flags {flags:#x}"));
    }
    if !e.unread.is_empty() {
        out.push_str(" with data, a verdict or expressions attached");
    }
    out
}

/// nft's name of an IP protocol (`/etc/protocols`), or its number.
fn proto_name(number: u8) -> String {
    match number {
        1 => "icmp".into(),
        6 => "tcp".into(),
        17 => "udp".into(),
        33 => "dccp".into(),
        58 => "ipv6-icmp".into(),
        132 => "sctp".into(),
        136 => "udplite".into(),
        n => n.to_string(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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
                unread: Vec::new(),
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
            assert_eq!(decoded.elements, Elements::Networks(nets), "{family:?}");
            assert!(decoded.undecodable.is_empty());
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
        assert_eq!(
            decode(id, &live(set_elements(id, &want).collect())).elements,
            want
        );

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
        assert_eq!(decode(id, &elems).elements, want);
    }

    #[test]
    fn elements_egress_fence_never_writes_are_undecodable() {
        let allow4 = SetId::new(SetRole::Allow, Family::V4);
        let tuple = |net: &str, proto: u8, proto_end: u8, ports: (u16, u16)| {
            let net: IpNet = net.parse().unwrap();
            LiveElem {
                key: crate::nft::encode::tuple_key(net.network(), proto, ports.0),
                key_end: Some(crate::nft::encode::tuple_key(
                    net.broadcast(),
                    proto_end,
                    ports.1,
                )),
                flags: 0,
                timeout_ms: None,
                expires_ms: None,
                userdata: None,
                unread: Vec::new(),
            }
        };
        let catch_all = LiveElem {
            key: Vec::new(),
            key_end: None,
            flags: NFT_SET_ELEM_CATCHALL,
            timeout_ms: None,
            expires_ms: None,
            userdata: None,
            unread: Vec::new(),
        };
        let mut padded = tuple("192.0.2.1/32", 6, 6, (22, 22));
        padded.key[5] = 1;
        let mut with_data = tuple("192.0.2.1/32", 6, 6, (22, 22));
        with_data.unread = vec![4];
        let cases = [
            (catch_all.clone(), "*"),
            (
                tuple("0.0.0.0/0", 136, 136, (0, 65535)),
                "0.0.0.0/0 . udplite . 0-65535",
            ),
            (
                tuple("0.0.0.0/0", 6, 17, (0, 65535)),
                "0.0.0.0/0 . tcp-udp . 0-65535",
            ),
            (
                tuple("192.0.2.0/24", 6, 6, (443, 80)),
                "192.0.2.0/24 . tcp . 443-80",
            ),
            (padded, "key 0xc0000201060100000016"),
            (
                with_data,
                "192.0.2.1 . tcp . 22 with data, a verdict or expressions attached",
            ),
        ];
        let good = tuple("192.0.2.1/32", 6, 6, (22, 22));
        for (elem, described) in cases {
            let read = decode(allow4, &[good.clone(), elem]);
            assert_eq!(
                read.elements,
                Elements::Tuples(vec![Tuple {
                    net: "192.0.2.1/32".parse().unwrap(),
                    proto: L4Proto::Tcp,
                    ports: PortRange::single(22),
                }]),
                "{described}"
            );
            assert_eq!(read.undecodable.len(), 1, "{described}");
            assert!(read.undecodable[0].starts_with(described), "{read:?}");
        }
        // A hash set holds single keys: a key end is none of ours, nor a flag.
        let resolved4 = SetId::new(SetRole::Resolved, Family::V4);
        let read = decode(resolved4, &[tuple("192.0.2.1/32", 6, 6, (22, 22))]);
        assert_eq!(read.undecodable.len(), 1);
        // `deny4 { * }` and an address of the wrong length.
        let deny4 = SetId::new(SetRole::Deny, Family::V4);
        let short = LiveElem {
            key: vec![10, 0],
            flags: 0,
            ..catch_all.clone()
        };
        let read = decode(deny4, &[catch_all, short]);
        assert_eq!(read.elements, Elements::Networks(Vec::new()));
        assert_eq!(read.undecodable, ["*", "key 0x0a00"]);
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
        assert!(d.why_refused(upstream, Some(53)) == WhyRefused::GuardUpstream { guard_uid: 993 });
        assert!(d.why_refused(other, Some(853)) == WhyRefused::OtherResolver { port: 853 });
        assert!(d.why_refused(upstream, Some(443)) == WhyRefused::GuardUpstream { guard_uid: 993 });
        d.guard_uid = None;
        assert_eq!(d.why_refused(other, Some(53)), WhyRefused::NotInPolicy);
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
            objects: Vec::new(),
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
