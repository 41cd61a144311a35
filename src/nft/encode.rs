//! Ruleset -> one netlink batch. Mirrors, expression for expression, what `nft -f` sends for
//! the rendered plan, so `nft list` reads our table back exactly as it reads its own.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ffi::{CString, c_int};
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;

use ipnet::IpNet;
use nftnl::expr::{
    Bitwise, Conntrack, Counter, Expression, IcmpCode, Meta, RejectionType, States, Verdict,
};
use nftnl::{Batch, Chain, ChainType, FinalizedBatch, MsgType, NlMsg, ProtoFamily, Table};

use super::sys::{
    self, DumpedRule, Elem, ElemOp, Expr, KeySpec, LiveExpr, NFT_SET_CONCAT,
    NFT_SET_ELEM_INTERVAL_END, NFT_SET_INTERVAL, NFT_SET_TIMEOUT, NlSet, PayloadBase,
};
use crate::core::policy::{Action, CgroupPath, IfacePattern, L4Proto, Rate, RateUnit};
use crate::core::ruleset::{AUDIT_COMMENT, AUDIT_PREFIX, AUDIT_WINDOW_SET, FLOW_PREFIX};
use crate::core::ruleset::{
    Arrival, BRIDGE_GROUP_PREFIX, BaseChain, CgroupMatch, ChainPolicy, DHCP_CLIENT_LIMIT,
    DHCP_MAX_LENGTH, Elements, FROM_BRIDGE_CHAIN, Family, GUARD_CHAIN, Hook, ICMP_ANSWER_PRIORITY,
    Icmpv6Type, KeyShape, Limit, LimitKind, LogSpec, MLD_REPORT_LIMIT, OUTPUT_CHAIN, REFUSED_CHAIN,
    Rule, Ruleset, ScopeMatch, SetId, SetRole, SourceRoute, TABLE, Timed, Tuple, dhcp_ports,
    dhcp_servers,
};
use crate::netlink::attr::NLA_HDRLEN;
use crate::netlink::bytes::align4;
use crate::netlink::message::{
    NFNL_SUBSYS_NFTABLES, NLM_F_ACK, NLM_F_REQUEST, Oversize, Request, nfnl_type,
};

/// A finalized batch and, for each message in it, what it carries (for error messages).
pub struct Encoded {
    body: Body,
    pub labels: Vec<String>,
}

/// How a batch was built.
enum Body {
    /// By libnftnl, page by page.
    Pages(FinalizedBatch),
    /// Here, with the netlink codec: BEGIN, the changes and END, numbered `seqs`, none of
    /// BEGIN and END asking for an acknowledgement (see [`upsert_resolved`]).
    Written { bytes: Vec<u8>, seqs: Range<u32> },
}

impl Encoded {
    /// A batch libnftnl built, and what each of its changes carries.
    pub fn of_pages(batch: FinalizedBatch, labels: Vec<String>) -> Encoded {
        Encoded {
            body: Body::Pages(batch),
            labels,
        }
    }

    /// The sequence numbers of the batch's messages: the changes', and BEGIN's and END's
    /// when they are numbered among them.
    pub fn sequence_numbers(&self) -> Range<u32> {
        match &self.body {
            Body::Pages(batch) => batch.sequence_numbers(),
            Body::Written { seqs, .. } => seqs.clone(),
        }
    }

    /// The batch's bytes as built (for a libnftnl batch, with BEGIN and END as it wrote them).
    pub fn built(&self) -> Vec<&[u8]> {
        match &self.body {
            Body::Pages(batch) => batch.iter().collect(),
            Body::Written { bytes, .. } => vec![bytes],
        }
    }

    /// What the message with sequence number `seq` carried.
    pub fn label(&self, seq: u32) -> String {
        seq.checked_sub(self.change_seqs().start)
            .and_then(|i| self.labels.get(i as usize))
            .cloned()
            .unwrap_or_else(|| "the transaction".to_string())
    }

    /// The sequence numbers of the messages that carry changes, each of which asks for an
    /// acknowledgement: the kernel sends them once the batch is committed, or an error.
    pub fn change_seqs(&self) -> Range<u32> {
        let seqs = self.sequence_numbers();
        // nftnl numbers the batch's BEGIN and END too when the kernel (6.10 and later) can
        // acknowledge them; then our messages start one after the range's start. Derive that
        // from the batch, never from the kernel version.
        let offset = match seqs.len().checked_sub(self.labels.len()) {
            Some(2) => 1,
            _ => 0,
        };
        let start = seqs.start + offset;
        start..start + self.labels.len() as u32
    }

    /// The batch as it is sent, page by page, with BEGIN and END asking for no
    /// acknowledgement (nftnl asks for both where the kernel gives them): each would be one
    /// more datagram to read per transaction, and they tell nothing the changes' own
    /// acknowledgements do not. A refused batch is still reported, whatever its flags: an
    /// error is always sent, and a failed commit is reported against the first change.
    pub fn pages(&self) -> Vec<Cow<'_, [u8]>> {
        let batch = match &self.body {
            Body::Pages(batch) => batch,
            Body::Written { bytes, .. } => return vec![Cow::Borrowed(bytes)],
        };
        let mut pages: Vec<Cow<'_, [u8]>> = batch.iter().map(Cow::Borrowed).collect();
        let last = pages.len().saturating_sub(1);
        for (index, batch_type) in [(0, NFNL_MSG_BATCH_BEGIN), (last, NFNL_MSG_BATCH_END)] {
            if let Some(page) = pages.get_mut(index) {
                without_ack(page, batch_type);
            }
        }
        pages
    }
}

const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;

/// Clears NLM_F_ACK on the message of `batch_type` (BEGIN first on its page, END last on
/// its), if it is there; the page is copied only then.
fn without_ack(page: &mut Cow<'_, [u8]>, batch_type: u16) {
    let u16_at = |bytes: &[u8], at: usize| {
        bytes
            .get(at..at + 2)
            .map(|b| u16::from_ne_bytes([b[0], b[1]]))
    };
    let u32_at = |bytes: &[u8], at: usize| {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    };
    // The offset of the page's last message: each length rounded up to four bytes.
    let mut at = 0usize;
    let mut offset = 0usize;
    if batch_type == NFNL_MSG_BATCH_END {
        while let Some(len) = u32_at(page, offset).filter(|&l| l >= 16) {
            at = offset;
            offset += (len as usize).div_ceil(4) * 4;
        }
    }
    let flags_at = at + 6;
    let (Some(kind), Some(flags)) = (u16_at(page, at + 4), u16_at(page, flags_at)) else {
        return;
    };
    if kind == batch_type && flags & NLM_F_ACK != 0 {
        let cleared = (flags & !NLM_F_ACK).to_ne_bytes();
        page.to_mut()[flags_at..flags_at + 2].copy_from_slice(&cleared);
    }
}

struct Builder {
    batch: Batch,
    labels: Vec<String>,
}

impl Builder {
    fn new() -> Builder {
        Builder {
            batch: Batch::new(),
            labels: Vec::new(),
        }
    }

    fn add(&mut self, msg: &impl NlMsg, kind: MsgType, label: impl Into<String>) {
        self.batch.add(msg, kind);
        self.labels.push(label.into());
    }

    fn finish(self) -> Encoded {
        Encoded::of_pages(self.batch.finalize(), self.labels)
    }
}

fn table() -> Table {
    Table::new(table_name(), ProtoFamily::Inet)
}

pub fn table_name() -> CString {
    CString::new(TABLE).expect("the table name has no NUL")
}

fn cstring(s: &str) -> CString {
    CString::new(s).expect("set and chain names have no NUL")
}

/// The transaction that replaces the table with `ruleset`: add-if-missing, delete, recreate,
/// fill. The kernel applies all of it or none of it.
pub fn replace_table(ruleset: &Ruleset) -> Encoded {
    let table = table();
    let mut b = Builder::new();
    let label = format!("table inet {TABLE}");
    b.add(&table, MsgType::Add, label.clone());
    b.add(&table, MsgType::Del, label.clone());
    b.add(&table, MsgType::Add, label);

    let mut set_ids = BTreeMap::new();
    for (i, set) in ruleset.sets.iter().enumerate() {
        let id = i as u32 + 1;
        set_ids.insert(set.id, id);
        b.add(
            &nl_set(set.id, id),
            MsgType::Add,
            format!("set {}", set.id.name()),
        );
        add_elements(
            &mut b,
            set.id,
            id,
            set_elements(set.id, &set.elements),
            ElemOp::Create,
        );
    }

    if let Some(window) = &ruleset.audit {
        b.add(
            &audit_window_set(AUDIT_WINDOW_BATCH_ID),
            MsgType::Add,
            format!("set {AUDIT_WINDOW_SET}"),
        );
        if let Some(ms) = window.open_for_ms {
            add_audit_elements(&mut b, AUDIT_WINDOW_BATCH_ID, ms, ElemOp::Create);
        }
    }

    let specs = ruleset.chains();
    let names: Vec<CString> = specs.iter().map(|c| cstring(c.name)).collect();
    let chains: Vec<Chain> = specs
        .iter()
        .zip(&names)
        .map(|(spec, name)| nl_chain(name, &table, spec.base))
        .collect();
    // Every chain exists before any rule goes to one, in the order nft creates them.
    for (spec, chain) in specs.iter().zip(&chains) {
        b.add(chain, MsgType::Add, format!("chain {}", spec.name));
    }
    for (spec, chain) in specs.iter().zip(&chains) {
        for (i, rule) in spec.rules.iter().enumerate() {
            let nl = nl_rule(chain, rule, &set_ids);
            b.add(
                &nl,
                MsgType::Add,
                format!("rule {} of chain {} ({rule:?})", i + 1, spec.name),
            );
        }
    }
    b.finish()
}

/// A chain of the table: on its hook at the hook's priority (see [`Hook::priority`]) with its
/// policy when it is a base chain, else a regular chain.
fn nl_chain<'a>(name: &'a CString, table: &'a Table, base: Option<BaseChain>) -> Chain<'a> {
    let mut chain = Chain::new(name, table);
    if let Some(base) = base {
        chain.set_hook(
            match base.hook {
                Hook::Output => nftnl::Hook::Out,
                Hook::Forward => nftnl::Hook::Forward,
                Hook::Input => nftnl::Hook::In,
                Hook::Prerouting => nftnl::Hook::PreRouting,
            },
            base.hook.priority(),
        );
        chain.set_type(ChainType::Filter);
        chain.set_policy(match base.policy {
            ChainPolicy::Accept => nftnl::Policy::Accept,
            ChainPolicy::Drop => nftnl::Policy::Drop,
        });
    }
    chain
}

/// The transaction that adds resolved elements or renews their timeouts, leaving everything
/// else as it is: what the guard sends for its answers, and a refresh instead of reloading
/// the table.
///
/// It is written with the netlink codec ([`Request`]) rather than by libnftnl, as the bytes
/// libnftnl writes for the same elements (a unit test holds them to those): it is the one
/// batch on the path of a guard answer, and there libnftnl's objects (a batch of 196 KiB, a
/// set, an element each, all allocated and freed again) took 8 to 13 µs to build, their code
/// and data cold after every wait, against 4 to 5 µs for this (BENCHMARKS.md, "Issue 16,
/// third pass").
pub fn upsert_resolved(elements: &[Timed]) -> Result<Encoded, Oversize> {
    let mut bytes = Vec::new();
    let mut labels = Vec::new();
    // Every batch is numbered alike, as libnftnl numbers its own: BEGIN 1, then the changes,
    // then END.
    let first = 1;
    let mut seq = first;
    bytes.extend(batch_marker(NFNL_MSG_BATCH_BEGIN, seq)?);
    for family in Family::BOTH {
        let id = SetId::new(SetRole::Resolved, family);
        let of_family: Vec<Elem> = elements
            .iter()
            .filter(|t| Family::of_net(&t.tuple.net) == family)
            .map(|t| timed_elem(id, t))
            .collect();
        for (message, chunk) in within_one_message(&of_family).enumerate() {
            seq += 1;
            bytes.extend(upsert_message(id, chunk, seq)?);
            labels.push(format!(
                "elements of set {} (message {})",
                id.name(),
                message + 1
            ));
        }
    }
    seq += 1;
    bytes.extend(batch_marker(NFNL_MSG_BATCH_END, seq)?);
    Ok(Encoded {
        body: Body::Written {
            bytes,
            seqs: first..seq + 1,
        },
        labels,
    })
}

// From linux/netfilter/nf_tables.h.
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
const NFTA_SET_ELEM_EXPIRATION: u16 = 5;
const NFTA_SET_ELEM_USERDATA: u16 = 6;
const NFTA_DATA_VALUE: u16 = 1;

/// BEGIN or END of an nf_tables batch, asking for no acknowledgement.
fn batch_marker(kind: u16, seq: u32) -> Result<Vec<u8>, Oversize> {
    Request::new(kind, NLM_F_REQUEST, seq)
        .nfgenmsg(libc::AF_UNSPEC as u8, u16::from(NFNL_SUBSYS_NFTABLES))
        .finish()
}

/// The bytes of one element of a resolved set inside its message: the list entry's header,
/// the timeout and expiration, the key and the comment.
fn resolved_elem_len(e: &Elem) -> usize {
    let attr = |len: usize| NLA_HDRLEN + align4(len);
    let timeouts = if e.timeout_ms.is_some() {
        2 * attr(8)
    } else {
        0
    };
    NLA_HDRLEN
        + timeouts
        + attr(attr(e.key.len()))
        + e.userdata.as_ref().map_or(0, |u| attr(u.len()))
}

/// `elems` in runs whose list attribute fits its 16-bit length, in order.
fn within_one_message(elems: &[Elem]) -> impl Iterator<Item = &[Elem]> {
    let mut rest = elems;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut len = NLA_HDRLEN;
        let fit = rest
            .iter()
            .take_while(|e| {
                len += resolved_elem_len(e);
                len <= usize::from(u16::MAX)
            })
            .count()
            .max(1);
        let (run, after) = rest.split_at(fit);
        rest = after;
        Some(run)
    })
}

/// One NEWSETELEM message (create, or renew what exists) for resolved set `id`. Resolved sets
/// are no interval sets: their elements have no end key and no flags.
fn upsert_message(id: SetId, elems: &[Elem], seq: u32) -> Result<Vec<u8>, Oversize> {
    let mut set = id.name().as_bytes().to_vec();
    set.push(0);
    let mut table = TABLE.as_bytes().to_vec();
    table.push(0);
    let flags = NLM_F_REQUEST | libc::NLM_F_CREATE as u16 | NLM_F_ACK;
    Request::new(
        nfnl_type(NFNL_SUBSYS_NFTABLES, libc::NFT_MSG_NEWSETELEM as u8),
        flags,
        seq,
    )
    .nfgenmsg(libc::NFPROTO_INET as u8, 0)
    .attr(NFTA_SET_ELEM_LIST_SET, &set)
    .attr(NFTA_SET_ELEM_LIST_TABLE, &table)
    .nested(NFTA_SET_ELEM_LIST_ELEMENTS, |list| {
        // libnftnl numbers a message's entries from 1; the kernel reads them in order.
        elems.iter().zip(1u16..).fold(list, |list, (e, n)| {
            debug_assert!(e.key_end.is_none() && e.flags == 0, "an interval element");
            list.nested(n, |mut entry| {
                if let Some(ms) = e.timeout_ms {
                    // The kernel restarts an existing element's expiry only when given one.
                    entry = entry
                        .attr(NFTA_SET_ELEM_TIMEOUT, &ms.to_be_bytes())
                        .attr(NFTA_SET_ELEM_EXPIRATION, &ms.to_be_bytes());
                }
                entry = entry.nested(NFTA_SET_ELEM_KEY, |key| key.attr(NFTA_DATA_VALUE, &e.key));
                match &e.userdata {
                    Some(udata) => entry.attr(NFTA_SET_ELEM_USERDATA, udata),
                    None => entry,
                }
            })
        })
    })
    .finish()
}

/// The audit window's id within a batch (the eight sets take 1 to 8; the kernel never
/// reports it back).
const AUDIT_WINDOW_BATCH_ID: u32 = 0x100;

/// nft's datatype id of `nf_proto` (one byte: `NFPROTO_IPV4`, `NFPROTO_IPV6`).
const NF_PROTO_DATATYPE: u32 = 2;

/// The key and flags of [`AUDIT_WINDOW_SET`]: `type nf_proto; flags timeout`.
pub fn audit_window_key() -> (KeySpec, u32) {
    let key = KeySpec {
        datatype: NF_PROTO_DATATYPE,
        len: 1,
        concat_fields: vec![],
    };
    (key, NFT_SET_TIMEOUT)
}

fn audit_window_set(batch_id: u32) -> NlSet {
    let (key, flags) = audit_window_key();
    NlSet::new(
        &table_name(),
        &cstring(AUDIT_WINDOW_SET),
        batch_id,
        &key,
        flags,
    )
}

/// Both families into the audit window, each open for `open_for_ms` from now.
fn add_audit_elements(b: &mut Builder, batch_id: u32, open_for_ms: u64, op: ElemOp) {
    let mut set = audit_window_set(batch_id);
    for family in Family::BOTH {
        set.push(&Elem {
            key: vec![nfproto(family)],
            timeout_ms: Some(open_for_ms),
            ..Elem::default()
        });
    }
    for _ in 0..set.add_elements_to(&mut b.batch, op) {
        b.labels.push(format!("elements of set {AUDIT_WINDOW_SET}"));
    }
}

/// The transaction that keeps the audit window open `open_for_ms` more from now (sent again
/// before that runs out), leaving everything else as it is.
pub fn renew_audit_window(open_for_ms: u64) -> Encoded {
    let mut b = Builder::new();
    add_audit_elements(&mut b, 0, open_for_ms, ElemOp::Upsert);
    b.finish()
}

/// The transaction that closes the audit window at once (its elements deleted): the table
/// refuses again what its policy refuses.
pub fn close_audit_window() -> Encoded {
    let mut b = Builder::new();
    let mut set = audit_window_set(0);
    for family in Family::BOTH {
        set.push(&Elem {
            key: vec![nfproto(family)],
            ..Elem::default()
        });
    }
    for _ in 0..set.add_elements_to(&mut b.batch, ElemOp::Delete) {
        b.labels.push(format!("elements of set {AUDIT_WINDOW_SET}"));
    }
    b.finish()
}

/// The transaction that deletes the table whether or not it exists.
pub fn delete_table() -> Encoded {
    let table = table();
    let mut b = Builder::new();
    let label = format!("table inet {TABLE}");
    b.add(&table, MsgType::Add, label.clone());
    b.add(&table, MsgType::Del, label);
    b.finish()
}

pub fn key_spec(id: SetId) -> KeySpec {
    // nft datatype ids: ipv4_addr 7, ipv6_addr 8, inet_proto 12, inet_service 13.
    let addr = match id.family {
        Family::V4 => (7, 4u8),
        Family::V6 => (8, 16u8),
    };
    match id.shape() {
        KeyShape::Addr => KeySpec {
            datatype: addr.0,
            len: u32::from(addr.1),
            concat_fields: vec![],
        },
        KeyShape::Tuple => KeySpec {
            datatype: (addr.0 << 12) | (12 << 6) | 13,
            len: u32::from(addr.1) + 4 + 4,
            // nft describes the fields of interval concatenations only.
            concat_fields: if id.interval() {
                vec![addr.1, 1, 2]
            } else {
                vec![]
            },
        },
    }
}

pub fn set_flags(id: SetId) -> u32 {
    let mut flags = 0;
    if id.interval() {
        flags |= NFT_SET_INTERVAL;
        if id.shape() == KeyShape::Tuple {
            flags |= NFT_SET_CONCAT;
        }
    }
    if id.timeout() {
        flags |= NFT_SET_TIMEOUT;
    }
    flags
}

/// Set `id` as created in a batch under `batch_id`, without elements.
fn nl_set(id: SetId, batch_id: u32) -> NlSet {
    NlSet::new(
        &table_name(),
        &cstring(&id.name()),
        batch_id,
        &key_spec(id),
        set_flags(id),
    )
}

/// How many elements one short-lived libnftnl set carries into the batch. libnftnl keeps
/// about 270 bytes per element; holding a 100,000-element set at once would triple the peak
/// memory of an apply, while the batch itself needs about 25 bytes per element.
const ELEMS_PER_CHUNK: usize = 2048;

/// Appends the element messages of set `id` (known to the batch as `batch_id`).
fn add_elements(
    b: &mut Builder,
    id: SetId,
    batch_id: u32,
    elems: impl Iterator<Item = Elem>,
    op: ElemOp,
) {
    let name = id.name();
    let mut messages = 0;
    let mut elems = elems.peekable();
    while elems.peek().is_some() {
        let mut chunk = nl_set(id, batch_id);
        for elem in elems.by_ref().take(ELEMS_PER_CHUNK) {
            chunk.push(&elem);
        }
        for _ in 0..chunk.add_elements_to(&mut b.batch, op) {
            messages += 1;
            b.labels
                .push(format!("elements of set {name} (message {messages})"));
        }
    }
}

fn addr_bytes(addr: IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// `addr . proto . port`, each field padded to 4 bytes, the port in network byte order.
pub fn tuple_key(addr: IpAddr, proto: u8, port: u16) -> Vec<u8> {
    let mut key = addr_bytes(addr);
    key.extend_from_slice(&[proto, 0, 0, 0]);
    key.extend_from_slice(&port.to_be_bytes());
    key.extend_from_slice(&[0, 0]);
    key
}

/// The kernel elements for a set's contents, one at a time.
pub fn set_elements(id: SetId, elements: &Elements) -> Box<dyn Iterator<Item = Elem> + '_> {
    match elements {
        // Deny lists are short; their start/end pairs are simplest built whole.
        Elements::Networks(nets) => Box::new(interval_elements(nets).into_iter()),
        Elements::Tuples(tuples) => Box::new(tuples.iter().map(move |t| tuple_elem(id, t))),
        Elements::Timed(timed) => Box::new(timed.iter().map(move |t| timed_elem(id, t))),
    }
}

/// A resolved element: its timeout, and the name it was answered for as its comment.
fn timed_elem(id: SetId, t: &Timed) -> Elem {
    Elem {
        timeout_ms: t.timeout_ms,
        userdata: t.name.as_deref().and_then(comment_userdata),
        ..tuple_elem(id, &t.tuple)
    }
}

/// nft's element comment: the user-data TLV of type 0 (`NFTNL_UDATA_SET_ELEM_COMMENT`), a
/// NUL-terminated string, so that `nft list` shows it as `comment "NAME"`. `None` for a
/// text whose user data an element cannot keep (over [`MAX_ELEM_USERDATA`] bytes: names of
/// 252 and 253 characters, which a client may ask under a `**.` wildcard).
pub fn comment_userdata(text: &str) -> Option<Vec<u8>> {
    if text.len() + 3 > MAX_ELEM_USERDATA || text.contains('\0') {
        return None;
    }
    let len = u8::try_from(text.len() + 1).ok()?;
    let mut out = vec![UDATA_ELEM_COMMENT, len];
    out.extend_from_slice(text.as_bytes());
    out.push(0);
    Some(out)
}

/// The comment in an element's or a rule's user data (see [`comment_userdata`]), if it
/// holds one: libnftnl's `NFTNL_UDATA_RULE_COMMENT` is the same TLV of type 0.
pub fn comment_of(udata: &[u8]) -> Option<String> {
    let mut rest = udata;
    while let [kind, len, tail @ ..] = rest {
        let value = tail.get(..usize::from(*len))?;
        if *kind == UDATA_ELEM_COMMENT {
            let text = value.strip_suffix(&[0])?;
            return String::from_utf8(text.to_vec()).ok();
        }
        rest = &tail[usize::from(*len)..];
    }
    None
}

/// libnftnl's `NFTNL_UDATA_SET_ELEM_COMMENT`.
const UDATA_ELEM_COMMENT: u8 = 0;

/// The most user data a set element keeps, though the attribute may hold 256 bytes: the
/// kernel refuses 255 (EINVAL: `nft_set_ext_check` wants the extension, a length byte and
/// the data, within 255 bytes), which refuses the whole batch, and takes 256 for none (its
/// `u8` length in `nft_add_set_elem` wraps to 0). Measured on 6.18 (tests/upsert_written.rs).
pub const MAX_ELEM_USERDATA: usize = 254;
const _: () = assert!(MAX_ELEM_USERDATA == crate::core::ruleset::MAX_COMMENTED_NAME + 3);

fn tuple_elem(id: SetId, t: &Tuple) -> Elem {
    let proto = t.proto.number();
    let key = tuple_key(t.net.network(), proto, t.ports.first);
    let key_end = id
        .interval()
        .then(|| tuple_key(t.net.broadcast(), proto, t.ports.last));
    Elem {
        key,
        key_end,
        ..Elem::default()
    }
}

/// A plain interval set stores each network as a start element and an end element (the
/// first address after it, flagged INTERVAL_END); like nft, the set opens with an end element
/// at address zero unless a network starts there.
fn interval_elements(nets: &[IpNet]) -> Vec<Elem> {
    let mut out = Vec::new();
    let Some(first) = nets.first() else {
        return out;
    };
    let zero = match first.network() {
        IpAddr::V4(_) => IpAddr::from([0u8; 4]),
        IpAddr::V6(_) => IpAddr::from([0u8; 16]),
    };
    if first.network() != zero {
        out.push(Elem {
            key: addr_bytes(zero),
            flags: NFT_SET_ELEM_INTERVAL_END,
            ..Elem::default()
        });
    }
    for net in nets {
        out.push(Elem {
            key: addr_bytes(net.network()),
            ..Elem::default()
        });
        if let Some(after) = next_addr(net.broadcast()) {
            out.push(Elem {
                key: addr_bytes(after),
                flags: NFT_SET_ELEM_INTERVAL_END,
                ..Elem::default()
            });
        }
    }
    out
}

fn next_addr(addr: IpAddr) -> Option<IpAddr> {
    match addr {
        IpAddr::V4(a) => u32::from(a)
            .checked_add(1)
            .map(|n| IpAddr::from(n.to_be_bytes())),
        IpAddr::V6(a) => u128::from(a)
            .checked_add(1)
            .map(|n| IpAddr::from(n.to_be_bytes())),
    }
}

// ---- rules ----------------------------------------------------------------------------------

const IPPROTO_ICMP: u8 = 1;
const IPPROTO_IGMP: u8 = 2;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_ICMPV6: u8 = 58;
/// `oif "lo"`: the loopback device is interface 1 in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

fn nfproto(family: Family) -> u8 {
    match family {
        Family::V4 => libc::NFPROTO_IPV4 as u8,
        Family::V6 => libc::NFPROTO_IPV6 as u8,
    }
}

/// Offset and length of the destination address in the network header.
fn daddr_field(family: Family) -> (u32, u32) {
    match family {
        Family::V4 => (16, 4),
        Family::V6 => (24, 16),
    }
}

/// Where the source address lies in the network header, and its length.
fn saddr_field(family: Family) -> (u32, u32) {
    match family {
        Family::V4 => (12, 4),
        Family::V6 => (8, 16),
    }
}

/// Registers of the `daddr . l4proto . dport` concatenation, as nft allocates them.
fn tuple_registers(family: Family) -> (u32, u32) {
    match family {
        Family::V4 => (sys::reg32(1), sys::reg32(2)),
        Family::V6 => (sys::REG_2, sys::reg32(5)),
    }
}

/// Our expressions and the crate's, in one list.
struct AnyExpr(Box<dyn Expression>);

impl Expression for AnyExpr {
    fn to_expr(&self, rule: &nftnl::Rule) -> std::ptr::NonNull<nftnl::nftnl_sys::nftnl_expr> {
        self.0.to_expr(rule)
    }
}

fn own(e: Expr) -> AnyExpr {
    AnyExpr(Box::new(e))
}

fn crate_expr(e: impl Expression + 'static) -> AnyExpr {
    AnyExpr(Box::new(e))
}

/// `ct direction reply`'s value (the kernel's `IP_CT_DIR_REPLY`, one byte).
const IP_CT_DIR_REPLY: u8 = 1;

fn eq(data: &[u8]) -> AnyExpr {
    own(Expr::cmp(libc::NFT_CMP_EQ, data))
}

fn is_family(family: Family) -> [AnyExpr; 2] {
    [
        own(Expr::meta(libc::NFT_META_NFPROTO, sys::REG_1)),
        eq(&[nfproto(family)]),
    ]
}

/// `iif 0` (sent by this host), `iif "lo"`.
fn iif_is(arrival: Arrival) -> [AnyExpr; 2] {
    [
        own(Expr::meta(libc::NFT_META_IIF, sys::REG_1)),
        eq(&arrival.iif().to_ne_bytes()),
    ]
}

fn l4proto_is(proto: u8) -> [AnyExpr; 2] {
    [
        own(Expr::meta(libc::NFT_META_L4PROTO, sys::REG_1)),
        eq(&[proto]),
    ]
}

/// Matches packets from the DNS guard's listen address (any, when it listens on the
/// unspecified address) and port over `proto`.
fn from_guard_port(from: SocketAddr, proto: L4Proto) -> Vec<AnyExpr> {
    let mut e = Vec::new();
    if !from.ip().is_unspecified() {
        let family = Family::of(from.ip());
        e.extend(is_family(family));
        let (offset, len) = saddr_field(family);
        e.push(own(Expr::payload(
            PayloadBase::Network,
            offset,
            len,
            sys::REG_1,
        )));
        e.push(eq(&addr_bytes(from.ip())));
    }
    e.extend(l4proto_is(proto.number()));
    e.push(own(Expr::payload(PayloadBase::Transport, 0, 2, sys::REG_1)));
    e.push(eq(&from.port().to_be_bytes()));
    e
}

/// Matches packets to `to` (any address, when it is the unspecified one) over `proto`:
/// `ip daddr 198.18.0.1 udp dport 53`.
fn to_port(to: SocketAddr, proto: L4Proto) -> Vec<AnyExpr> {
    let mut e = Vec::new();
    if !to.ip().is_unspecified() {
        let family = Family::of(to.ip());
        e.extend(is_family(family));
        e.push(daddr_into_reg1(family));
        e.push(eq(&addr_bytes(to.ip())));
    }
    e.extend(l4proto_is(proto.number()));
    e.push(own(Expr::payload(PayloadBase::Transport, 2, 2, sys::REG_1)));
    e.push(eq(&to.port().to_be_bytes()));
    e
}

fn daddr_into_reg1(family: Family) -> AnyExpr {
    let (offset, len) = daddr_field(family);
    own(Expr::payload(PayloadBase::Network, offset, len, sys::REG_1))
}

fn lookup(set: SetId, set_ids: &BTreeMap<SetId, u32>) -> AnyExpr {
    own(Expr::lookup(
        &cstring(&set.name()),
        set_ids.get(&set).copied().unwrap_or_default(),
        sys::REG_1,
    ))
}

fn goto_refused() -> AnyExpr {
    goto(REFUSED_CHAIN)
}

fn goto(chain: &str) -> AnyExpr {
    crate_expr(Verdict::Goto {
        chain: cstring(chain),
    })
}

fn jump(chain: &str) -> AnyExpr {
    crate_expr(Verdict::Jump {
        chain: cstring(chain),
    })
}

/// The kernel's longest interface name, its NUL included (`IFNAMSIZ`).
const IFNAMSIZ: usize = 16;

/// `iifname "docker0"`: the whole name, NUL-padded to [`IFNAMSIZ`] bytes; `iifname "br-*"`:
/// only the prefix's bytes, so that any name starting with them matches (as nft sends them).
fn iifname_is(iface: &IfacePattern) -> [AnyExpr; 2] {
    let data = match iface.prefix() {
        Some(prefix) => prefix.as_bytes().to_vec(),
        None => {
            let mut name = iface.as_str().as_bytes().to_vec();
            name.resize(IFNAMSIZ, 0);
            name
        }
    };
    [
        own(Expr::meta(libc::NFT_META_IIFNAME, sys::REG_1)),
        eq(&data),
    ]
}

/// `socket cgroupv2 level N "path"`: the id of the socket's ancestor at the cgroup's level
/// is the cgroup's (8 bytes, host order, as nft sends it).
fn cgroup_is(cgroup: &CgroupMatch) -> [AnyExpr; 2] {
    [
        own(Expr::socket_cgroupv2(cgroup.level, sys::REG_1)),
        eq(&cgroup.id.to_ne_bytes()),
    ]
}

fn limit(l: Limit) -> AnyExpr {
    let unit = l.per.seconds();
    own(match l.kind {
        LimitKind::Packets => Expr::limit_packets(l.count, unit, l.burst),
        LimitKind::Bytes => Expr::limit_bytes(l.count, unit, l.burst),
    })
}

/// `icmpv6 type T`, with its family and protocol dependencies.
fn icmpv6_type_is(t: Icmpv6Type) -> Vec<AnyExpr> {
    let mut e = Vec::from(is_family(Family::V6));
    e.extend(l4proto_is(IPPROTO_ICMPV6));
    e.push(own(Expr::payload(PayloadBase::Transport, 0, 1, sys::REG_1)));
    e.push(eq(&[t.number()]));
    e
}

/// `ip daddr . meta l4proto . th dport @set`: the family check, the key and its lookup.
fn tuple_in(set: SetId, set_ids: &BTreeMap<SetId, u32>) -> Vec<AnyExpr> {
    let (proto_reg, port_reg) = tuple_registers(set.family);
    let mut e = Vec::from(is_family(set.family));
    e.push(daddr_into_reg1(set.family));
    e.push(own(Expr::meta(libc::NFT_META_L4PROTO, proto_reg)));
    if set.interval() {
        e.push(own(Expr::hton(proto_reg, 2, 1)));
    }
    e.push(own(Expr::payload(PayloadBase::Transport, 2, 2, port_reg)));
    e.push(lookup(set, set_ids));
    e
}

/// The IPv6 routing header's extension header type.
const IPV6_ROUTING_HEADER: u8 = 43;

/// `meta skuid >= 0`: the packet has an owning socket. Breaks (matches nothing) for a
/// socket without a file: the kernel's own packets.
fn has_owner() -> [AnyExpr; 3] {
    [
        own(Expr::meta(libc::NFT_META_SKUID, sys::REG_1)),
        own(Expr::hton(sys::REG_1, 4, 4)),
        own(Expr::cmp(libc::NFT_CMP_GTE, &0u32.to_ne_bytes())),
    ]
}

/// `fib saddr type != T`, `T` a route type (`RTN_*`).
fn source_type_is_not(route_type: u32) -> [AnyExpr; 2] {
    [
        own(Expr::fib_saddr_type(sys::REG_1)),
        own(Expr::cmp(libc::NFT_CMP_NEQ, &route_type.to_ne_bytes())),
    ]
}

/// The expressions of one rule, in nft's order.
fn rule_exprs(rule: &Rule, set_ids: &BTreeMap<SetId, u32>) -> Vec<AnyExpr> {
    let accept = crate_expr(Verdict::Accept);
    let mut e = Vec::new();
    match rule {
        Rule::Fence(matched) => {
            match matched {
                ScopeMatch::Uid(uid) => {
                    e.push(own(Expr::meta(libc::NFT_META_SKUID, sys::REG_1)));
                    e.push(eq(&uid.to_ne_bytes()));
                }
                ScopeMatch::Gid(gid) => {
                    e.push(own(Expr::meta(libc::NFT_META_SKGID, sys::REG_1)));
                    e.push(eq(&gid.to_ne_bytes()));
                }
                ScopeMatch::Cgroup(cgroup) => e.extend(cgroup_is(cgroup)),
                ScopeMatch::Interface(iface) => e.extend(iifname_is(iface)),
            }
            e.push(goto(OUTPUT_CHAIN));
        }
        Rule::FromBridge(iface) => {
            e.extend(iifname_is(iface));
            e.push(goto(FROM_BRIDGE_CHAIN));
        }
        Rule::JumpGuardFromPort(port) => {
            // `th sport`: no protocol match, as nft sends it.
            e.push(own(Expr::payload(PayloadBase::Transport, 0, 2, sys::REG_1)));
            e.push(eq(&port.to_be_bytes()));
            e.push(jump(GUARD_CHAIN));
        }
        Rule::JumpGuardToUpstream(set) => {
            e.extend(tuple_in(*set, set_ids));
            e.push(jump(GUARD_CHAIN));
        }
        Rule::AcceptGuardQuery { to, proto } => {
            let family = Family::of(to.ip());
            e.extend(is_family(family));
            e.push(daddr_into_reg1(family));
            e.push(eq(&addr_bytes(to.ip())));
            e.extend(l4proto_is(proto.number()));
            e.push(own(Expr::payload(PayloadBase::Transport, 2, 2, sys::REG_1)));
            e.push(eq(&to.port().to_be_bytes()));
            e.push(accept);
        }
        Rule::DropSpoofedFrom(iface) => {
            e.extend(iifname_is(iface));
            // `missing`: the lookup's "present" result compared with 0, as nft sends it.
            e.push(own(Expr::fib_saddr_iif_present(sys::REG_1)));
            e.push(eq(&0u32.to_ne_bytes()));
            e.push(crate_expr(Verdict::Drop));
        }
        Rule::DropBridgeGroupFrames => {
            e.push(own(Expr::payload(
                PayloadBase::LinkLayer,
                0,
                BRIDGE_GROUP_PREFIX.len() as u32,
                sys::REG_1,
            )));
            e.push(eq(&BRIDGE_GROUP_PREFIX));
            e.push(crate_expr(Verdict::Drop));
        }
        Rule::RefuseIcmpv6(t) => {
            e.extend(icmpv6_type_is(*t));
            e.push(goto_refused());
        }
        Rule::FenceIgmp => {
            e.extend(l4proto_is(IPPROTO_IGMP));
            e.push(goto(OUTPUT_CHAIN));
        }
        Rule::FenceIcmpv6(t) => {
            e.extend(icmpv6_type_is(*t));
            e.push(goto(OUTPUT_CHAIN));
        }
        Rule::RefuseGuardQueryToOtherSockets { to, proto, mark } => {
            e.extend(to_port(*to, *proto));
            e.push(own(Expr::socket_mark(sys::REG_1)));
            e.push(own(Expr::cmp(libc::NFT_CMP_NEQ, &mark.to_ne_bytes())));
            e.push(goto_refused());
        }
        Rule::RefuseSourceRoute(route) => {
            e.extend(is_family(route.family()));
            match route {
                SourceRoute::Ipv4Options => {
                    // The header length nibble: 5 words is a header without options.
                    e.push(own(Expr::payload(PayloadBase::Network, 0, 1, sys::REG_1)));
                    e.push(crate_expr(Bitwise::new(0x0fu8, 0u8)));
                    e.push(own(Expr::cmp(libc::NFT_CMP_NEQ, &[5])));
                }
                SourceRoute::Ipv6RoutingHeader => {
                    e.push(own(Expr::exthdr_ipv6_present(
                        IPV6_ROUTING_HEADER,
                        sys::REG_1,
                    )));
                    e.push(eq(&[1]));
                }
            }
            e.push(goto_refused());
        }
        Rule::RefuseUnmarkedFromGuardPort { from, proto, mark } => {
            e.extend(from_guard_port(*from, *proto));
            e.push(own(Expr::meta(libc::NFT_META_MARK, sys::REG_1)));
            e.push(own(Expr::cmp(libc::NFT_CMP_NEQ, &mark.to_ne_bytes())));
            e.push(goto_refused());
        }
        Rule::RefuseIcmpFromProcesses(family) => {
            e.extend(l4proto_is(match family {
                Family::V4 => IPPROTO_ICMP,
                Family::V6 => IPPROTO_ICMPV6,
            }));
            e.extend(has_owner());
            e.push(crate_expr(Meta::Oif));
            e.push(own(Expr::cmp(
                libc::NFT_CMP_NEQ,
                &LOOPBACK_IFINDEX.to_ne_bytes(),
            )));
            e.push(goto_refused());
        }
        Rule::RefuseOtherUidsFromGuardPort { from, proto, uid } => {
            e.extend(from_guard_port(*from, *proto));
            // Breaks (matches nothing) for a packet without an owning socket: the kernel's.
            e.push(own(Expr::meta(libc::NFT_META_SKUID, sys::REG_1)));
            e.push(own(Expr::cmp(libc::NFT_CMP_NEQ, &uid.to_ne_bytes())));
            e.push(goto_refused());
        }
        Rule::RefuseUpstreamFromOtherUids { set, uid } => {
            e.push(own(Expr::meta(libc::NFT_META_SKUID, sys::REG_1)));
            e.push(own(Expr::cmp(libc::NFT_CMP_NEQ, &uid.to_ne_bytes())));
            e.extend(tuple_in(*set, set_ids));
            e.push(goto_refused());
        }
        Rule::RefuseUpstreamUnmarked { set, uid, mark } => {
            e.push(own(Expr::meta(libc::NFT_META_SKUID, sys::REG_1)));
            e.push(eq(&uid.to_ne_bytes()));
            e.push(own(Expr::meta(libc::NFT_META_MARK, sys::REG_1)));
            e.push(own(Expr::cmp(libc::NFT_CMP_NEQ, &mark.to_ne_bytes())));
            e.extend(tuple_in(*set, set_ids));
            e.push(goto_refused());
        }
        Rule::RefuseRepliesOut => {
            e.push(own(Expr::ct(libc::NFT_CT_DIRECTION, sys::REG_1)));
            e.push(eq(&[IP_CT_DIR_REPLY]));
            e.push(crate_expr(Meta::Oif));
            e.push(own(Expr::cmp(
                libc::NFT_CMP_NEQ,
                &LOOPBACK_IFINDEX.to_ne_bytes(),
            )));
            e.push(goto_refused());
        }
        Rule::AcceptEstablished => {
            let wanted = States::ESTABLISHED | States::RELATED;
            e.push(crate_expr(Conntrack::State));
            e.push(crate_expr(Bitwise::new(wanted.bits(), 0u32)));
            e.push(own(Expr::cmp(libc::NFT_CMP_NEQ, &0u32.to_ne_bytes())));
            e.push(accept);
        }
        Rule::AcceptLoopback => {
            e.push(crate_expr(Meta::Oif));
            e.push(eq(&LOOPBACK_IFINDEX.to_ne_bytes()));
            e.push(accept);
        }
        Rule::RefuseForeignSourceToHost => {
            e.push(crate_expr(Meta::Oif));
            e.push(eq(&LOOPBACK_IFINDEX.to_ne_bytes()));
            // The kernel's own packets pass: it sends the fence's reset to this host from
            // the refused destination.
            e.extend(has_owner());
            e.extend(source_type_is_not(sys::RTN_LOCAL));
            e.push(goto_refused());
        }
        Rule::RefuseForeignSource => {
            e.extend(has_owner());
            e.extend(source_type_is_not(sys::RTN_LOCAL));
            // A second lookup, as nft writes the rule, for a source that is not local only.
            e.extend(source_type_is_not(sys::RTN_BROADCAST));
            e.push(goto_refused());
        }
        Rule::AcceptIcmpv6(t) => {
            e.extend(icmpv6_type_is(*t));
            e.push(accept);
        }
        Rule::AcceptMldReport => {
            e.extend(icmpv6_type_is(Icmpv6Type::Mld2ListenerReport));
            e.push(limit(MLD_REPORT_LIMIT));
            e.push(accept);
        }
        Rule::AcceptDhcpClient(family) => {
            let (sport, dport) = dhcp_ports(*family);
            e.extend(is_family(*family));
            e.push(daddr_into_reg1(*family));
            e.push(eq(&addr_bytes(dhcp_servers(*family))));
            e.extend(l4proto_is(IPPROTO_UDP));
            // Source and destination port compared as one 4-byte field, as nft does.
            let mut ports = sport.to_be_bytes().to_vec();
            ports.extend_from_slice(&dport.to_be_bytes());
            e.push(own(Expr::payload(PayloadBase::Transport, 0, 4, sys::REG_1)));
            e.push(eq(&ports));
            // `meta length <= N`: the length in network byte order, compared as nft does.
            e.push(own(Expr::meta(libc::NFT_META_LEN, sys::REG_1)));
            e.push(own(Expr::hton(sys::REG_1, 4, 4)));
            e.push(own(Expr::cmp(
                libc::NFT_CMP_LTE,
                &DHCP_MAX_LENGTH.to_be_bytes(),
            )));
            e.push(limit(DHCP_CLIENT_LIMIT));
            e.push(accept);
        }
        Rule::RefuseDaddrIn(set) => {
            e.extend(is_family(set.family));
            e.push(daddr_into_reg1(set.family));
            e.push(lookup(*set, set_ids));
            e.push(crate_expr(Counter));
            e.push(goto_refused());
        }
        Rule::AcceptTupleIn(set) => {
            e.extend(tuple_in(*set, set_ids));
            e.push(accept);
        }
        Rule::AcceptTupleFromGuard { set, mark, uid } => {
            if let Some(mark) = mark {
                e.push(own(Expr::meta(libc::NFT_META_MARK, sys::REG_1)));
                e.push(eq(&mark.to_ne_bytes()));
            }
            e.push(own(Expr::meta(libc::NFT_META_SKUID, sys::REG_1)));
            e.push(eq(&uid.to_ne_bytes()));
            e.extend(tuple_in(*set, set_ids));
            e.push(accept);
        }
        Rule::RefuseService(proto, port) => {
            e.extend(l4proto_is(proto.number()));
            e.push(own(Expr::payload(PayloadBase::Transport, 2, 2, sys::REG_1)));
            e.push(eq(&port.to_be_bytes()));
            e.push(goto_refused());
        }
        Rule::GotoRefused => e.push(goto_refused()),
        Rule::Log(log) => {
            let prefix = CString::new(log.prefix.as_str()).unwrap_or_default();
            e.push(own(Expr::limit_packets(
                log.rate.count,
                log.rate.unit.seconds(),
                log.burst,
            )));
            e.push(own(Expr::log(&prefix, log.group)));
        }
        Rule::CountFamily(family) => {
            e.extend(is_family(*family));
            e.push(crate_expr(Counter));
        }
        Rule::DropForeignSource(arrival) => {
            e.extend(iif_is(*arrival));
            e.extend(source_type_is_not(sys::RTN_LOCAL));
            e.push(crate_expr(Verdict::Drop));
        }
        Rule::ResetTcp => {
            e.extend(iif_is(Arrival::Sent));
            e.extend(l4proto_is(IPPROTO_TCP));
            e.push(own(Expr::meta(libc::NFT_META_PRIORITY, sys::REG_1)));
            e.push(own(Expr::cmp(
                libc::NFT_CMP_NEQ,
                &ICMP_ANSWER_PRIORITY.to_ne_bytes(),
            )));
            e.push(crate_expr(Verdict::Reject(RejectionType::TcpRst)));
        }
        Rule::Refuse(action) => e.push(crate_expr(match action {
            Action::Reject | Action::Audit => {
                Verdict::Reject(RejectionType::Icmp(IcmpCode::AdminProhibited))
            }
            Action::Drop => Verdict::Drop,
        })),
        Rule::AuditAccept { group } => {
            e.push(own(Expr::meta(libc::NFT_META_NFPROTO, sys::REG_1)));
            e.push(own(Expr::lookup(
                &cstring(AUDIT_WINDOW_SET),
                AUDIT_WINDOW_BATCH_ID,
                sys::REG_1,
            )));
            e.push(own(Expr::log(&cstring(AUDIT_PREFIX), Some(*group))));
            e.push(accept);
        }
        Rule::RecordFlow { group } => {
            e.push(crate_expr(Conntrack::State));
            e.push(crate_expr(Bitwise::new(States::NEW.bits(), 0u32)));
            e.push(own(Expr::cmp(libc::NFT_CMP_NEQ, &0u32.to_ne_bytes())));
            e.push(own(Expr::log(&cstring(FLOW_PREFIX), Some(*group))));
        }
    }
    e
}

/// The expressions of `rule` as the kernel reports them back after an apply: encoded as
/// `apply` sends it, and read by the same parser as a dumped rule. Empty if libnftnl cannot
/// read its own message (then the rule matches nothing read back: drift, never "in sync").
pub fn dumped_rule(rule: &Rule) -> Option<DumpedRule> {
    let table = table();
    // The chain's name is not part of a rule's expressions.
    let name = cstring(OUTPUT_CHAIN);
    let chain = Chain::new(&name, &table);
    // Set ids only matter within one batch; a dump names sets by name.
    let nl = nl_rule(&chain, rule, &BTreeMap::new());
    sys::describe_rule(&nl)
}

/// The expressions of `rule` as libnftnl prints them (`nft --debug=netlink`'s form): what
/// the tests compare with nft's own encoding.
#[cfg(test)]
fn rule_text(rule: &Rule) -> Vec<String> {
    dumped_rule(rule).map_or_else(|| vec![format!("unreadable rule: {rule}")], |r| r.text)
}

// ---- reading rules back ----------------------------------------------------------------------

/// The rule a dumped rule's expressions encode, or `None` if they are not exactly those
/// `rule_exprs` writes for some [`Rule`] (what a counter counted aside). The decoder reads
/// the parameters, then checks its answer by encoding it again: a rule that differs from
/// every rule egress-fence writes in any attribute (another register, an inverted lookup, an
/// extra expression) is never taken for one.
///
/// `userdata` is the rule's user data, where nft keeps its comment: a cgroup's rule names
/// its path there; any other rule has none, and a rule whose user data is not exactly what
/// egress-fence writes is none of its rules either.
pub fn decode_rule(exprs: &[LiveExpr], userdata: Option<&[u8]>) -> Option<Rule> {
    let comment = userdata.and_then(comment_of);
    let rule = decoded_candidate(exprs, comment.as_deref())?;
    let again = dumped_rule(&rule)?;
    let config = |e: &LiveExpr| match e {
        LiveExpr::Counter { .. } => LiveExpr::Counter {
            packets: 0,
            bytes: 0,
        },
        other => other.clone(),
    };
    (again.exprs.len() == exprs.len()
        && again
            .exprs
            .iter()
            .zip(exprs)
            .all(|(a, b)| config(a) == config(b))
        && again.userdata.as_deref() == userdata)
        .then_some(rule)
}

/// `rule` as [`decode_rule`] reads it back: the same rule, except that a listen address
/// given as `[::]` matches what `0.0.0.0` does (any address) and reads back as that.
pub fn as_read_back(rule: &Rule) -> Rule {
    let any = |from: SocketAddr| {
        if from.ip().is_unspecified() {
            SocketAddr::from(([0, 0, 0, 0], from.port()))
        } else {
            from
        }
    };
    match rule.clone() {
        Rule::RefuseUnmarkedFromGuardPort { from, proto, mark } => {
            Rule::RefuseUnmarkedFromGuardPort {
                from: any(from),
                proto,
                mark,
            }
        }
        Rule::RefuseOtherUidsFromGuardPort { from, proto, uid } => {
            Rule::RefuseOtherUidsFromGuardPort {
                from: any(from),
                proto,
                uid,
            }
        }
        Rule::RefuseGuardQueryToOtherSockets { to, proto, mark } => {
            Rule::RefuseGuardQueryToOtherSockets {
                to: any(to),
                proto,
                mark,
            }
        }
        other => other,
    }
}

/// What a rule's matches compare with, as [`decoded_candidate`] collects them.
#[derive(Debug, Default)]
struct Matches {
    family: Option<Family>,
    l4proto: Option<u8>,
    saddr: Option<IpAddr>,
    daddr: Option<IpAddr>,
    gid_eq: Option<u32>,
    /// `iifname`: the bytes compared with.
    iifname: Option<Vec<u8>>,
    /// `socket cgroupv2 level N`: the level, and the id compared with.
    cgroup: Option<(u32, u64)>,
    /// The rule's comment.
    comment: Option<String>,
    sport: Option<u16>,
    dport: Option<u16>,
    icmp_type: Option<u8>,
    uid_eq: Option<u32>,
    uid_neq: Option<u32>,
    /// `meta skuid >= 0`: the packet has an owning socket.
    has_owner: bool,
    /// `socket mark != M`.
    socket_mark_neq: Option<u32>,
    /// `fib saddr . iif oif missing`.
    fib_missing: bool,
    /// `@ll,0,40`: the frame's destination's first five bytes, compared (equal) with these.
    ll_daddr_prefix: Option<Vec<u8>>,
    /// `fib saddr type != local`.
    fib_not_local: bool,
    fib_not_broadcast: bool,
    /// `iif N`: the input interface's index.
    iif: Option<u32>,
    /// `meta priority != P`.
    priority_neq: Option<u32>,
    mark_eq: Option<u32>,
    mark_neq: Option<u32>,
    oif_eq: bool,
    ct_state: bool,
    /// `ct direction reply`.
    ct_reply: bool,
    hdrlength: bool,
    routing_header: bool,
    set: Option<SetId>,
    /// `@audit_window`.
    audit_window: bool,
    limit: Option<(u64, u64, u32)>,
    log: Option<(String, Option<u16>)>,
    counter: bool,
    verdict: Option<ReadVerdict>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadVerdict {
    Accept,
    Drop,
    GotoRefused,
    GotoOutput,
    GotoFromBridge,
    JumpGuard,
    Reject,
    ResetTcp,
}

/// What a register was last loaded with, for the comparison that follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loaded {
    Meta(c_int),
    Payload(PayloadBase, u32, u32),
    Ct,
    /// `ct direction`.
    CtDirection,
    Exthdr,
    /// `socket cgroupv2 level N`.
    Cgroup(u32),
    /// `socket mark`.
    SocketMark,
    /// `fib saddr . iif oif present`.
    Fib,
    /// `fib saddr type`.
    FibType,
}

fn u32_of(data: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(data.try_into().ok()?))
}

fn u16_be_of(data: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes(data.try_into().ok()?))
}

/// The rule `exprs` would be if they are one of ours: parameters read, shape chosen, nothing
/// checked yet (see [`decode_rule`]).
fn decoded_candidate(exprs: &[LiveExpr], comment: Option<&str>) -> Option<Rule> {
    let mut m = Matches {
        comment: comment.map(str::to_string),
        ..Matches::default()
    };
    let mut loaded: Option<Loaded> = None;
    for e in exprs {
        match e {
            LiveExpr::Meta { key, dreg } if *dreg == sys::REG_1 => {
                loaded = Some(Loaded::Meta(*key as c_int));
            }
            LiveExpr::Payload {
                base,
                offset,
                len,
                dreg,
            } if *dreg == sys::REG_1 => {
                let base = match *base as c_int {
                    libc::NFT_PAYLOAD_LL_HEADER => PayloadBase::LinkLayer,
                    libc::NFT_PAYLOAD_NETWORK_HEADER => PayloadBase::Network,
                    libc::NFT_PAYLOAD_TRANSPORT_HEADER => PayloadBase::Transport,
                    _ => return None,
                };
                loaded = Some(Loaded::Payload(base, *offset, *len));
            }
            LiveExpr::Ct { key, dir: None, .. } if *key == libc::NFT_CT_DIRECTION as u32 => {
                loaded = Some(Loaded::CtDirection);
            }
            LiveExpr::Ct { .. } => loaded = Some(Loaded::Ct),
            LiveExpr::Socket {
                key: sys::NFT_SOCKET_CGROUPV2,
                dreg,
                level: Some(level),
            } if *dreg == sys::REG_1 => loaded = Some(Loaded::Cgroup(*level)),
            LiveExpr::Socket {
                key: sys::NFT_SOCKET_MARK,
                dreg,
                level: None,
            } if *dreg == sys::REG_1 => loaded = Some(Loaded::SocketMark),
            LiveExpr::Fib { dreg, result, .. } if *dreg == sys::REG_1 => {
                loaded = Some(if *result == sys::NFT_FIB_RESULT_ADDRTYPE {
                    Loaded::FibType
                } else {
                    Loaded::Fib
                });
            }
            LiveExpr::Exthdr { .. } => loaded = Some(Loaded::Exthdr),
            LiveExpr::Cmp { op, data, .. } => {
                let (op, eq) = (*op as c_int, *op as c_int == libc::NFT_CMP_EQ);
                match loaded? {
                    Loaded::Meta(libc::NFT_META_NFPROTO) => {
                        m.family = match data.as_slice() {
                            [p] if *p == nfproto(Family::V4) => Some(Family::V4),
                            [p] if *p == nfproto(Family::V6) => Some(Family::V6),
                            _ => return None,
                        }
                    }
                    Loaded::Meta(libc::NFT_META_L4PROTO) => m.l4proto = data.first().copied(),
                    Loaded::Meta(libc::NFT_META_SKUID) if op == libc::NFT_CMP_GTE => {
                        m.has_owner = true;
                    }
                    Loaded::Meta(libc::NFT_META_SKUID) if eq => m.uid_eq = u32_of(data),
                    Loaded::Meta(libc::NFT_META_SKUID) => m.uid_neq = u32_of(data),
                    Loaded::Meta(libc::NFT_META_MARK) if eq => m.mark_eq = u32_of(data),
                    Loaded::Meta(libc::NFT_META_MARK) => m.mark_neq = u32_of(data),
                    Loaded::Meta(libc::NFT_META_OIF) => m.oif_eq = eq,
                    Loaded::Meta(libc::NFT_META_SKGID) => m.gid_eq = u32_of(data),
                    Loaded::Meta(libc::NFT_META_IIFNAME) => m.iifname = Some(data.clone()),
                    Loaded::SocketMark if !eq => m.socket_mark_neq = u32_of(data),
                    Loaded::Fib => m.fib_missing = eq && data.iter().all(|&b| b == 0),
                    Loaded::FibType if !eq && u32_of(data) == Some(sys::RTN_BROADCAST) => {
                        m.fib_not_broadcast = true;
                    }
                    Loaded::FibType => {
                        m.fib_not_local = !eq && u32_of(data) == Some(sys::RTN_LOCAL);
                    }
                    Loaded::Meta(libc::NFT_META_IIF) if eq => m.iif = u32_of(data),
                    Loaded::Meta(libc::NFT_META_PRIORITY) if !eq => {
                        m.priority_neq = u32_of(data);
                    }
                    Loaded::Cgroup(level) => {
                        let id = u64::from_ne_bytes(data.as_slice().try_into().ok()?);
                        m.cgroup = Some((level, id));
                    }
                    Loaded::Payload(PayloadBase::LinkLayer, 0, 5) if eq => {
                        m.ll_daddr_prefix = Some(data.clone());
                    }
                    Loaded::Payload(PayloadBase::Network, 0, 1) => m.hdrlength = true,
                    Loaded::Payload(PayloadBase::Network, offset, len) => {
                        let family = m.family?;
                        let addr = match family {
                            Family::V4 => {
                                <[u8; 4]>::try_from(data.as_slice()).ok().map(IpAddr::from)
                            }
                            Family::V6 => {
                                <[u8; 16]>::try_from(data.as_slice()).ok().map(IpAddr::from)
                            }
                        };
                        if (offset, len) == saddr_field(family) {
                            m.saddr = addr;
                        } else if (offset, len) == daddr_field(family) {
                            m.daddr = addr;
                        }
                    }
                    Loaded::Payload(PayloadBase::Transport, 0, 1) => {
                        m.icmp_type = data.first().copied();
                    }
                    Loaded::Payload(PayloadBase::Transport, 0, 2) => m.sport = u16_be_of(data),
                    Loaded::Payload(PayloadBase::Transport, 2, 2) => m.dport = u16_be_of(data),
                    Loaded::Exthdr => m.routing_header = true,
                    Loaded::Ct => m.ct_state = true,
                    Loaded::CtDirection => m.ct_reply = eq && data.as_slice() == [IP_CT_DIR_REPLY],
                    _ => {}
                }
            }
            LiveExpr::Lookup { set, .. } if set == AUDIT_WINDOW_SET => m.audit_window = true,
            LiveExpr::Lookup { set, .. } => m.set = Some(SetId::from_name(set)?),
            LiveExpr::Limit {
                rate, unit, burst, ..
            } => m.limit = Some((*rate, *unit, *burst)),
            LiveExpr::Log { prefix, group, .. } => m.log = Some((prefix.clone(), *group)),
            LiveExpr::Counter { .. } => m.counter = true,
            LiveExpr::Verdict { code, chain } => {
                m.verdict = Some(match (*code, chain.as_deref()) {
                    (libc::NF_ACCEPT, None) => ReadVerdict::Accept,
                    (libc::NF_DROP, None) => ReadVerdict::Drop,
                    (libc::NFT_GOTO, Some(REFUSED_CHAIN)) => ReadVerdict::GotoRefused,
                    (libc::NFT_GOTO, Some(OUTPUT_CHAIN)) => ReadVerdict::GotoOutput,
                    (libc::NFT_GOTO, Some(FROM_BRIDGE_CHAIN)) => ReadVerdict::GotoFromBridge,
                    (libc::NFT_JUMP, Some(GUARD_CHAIN)) => ReadVerdict::JumpGuard,
                    _ => return None,
                });
            }
            LiveExpr::Reject { kind, .. } => {
                m.verdict = Some(if *kind == libc::NFT_REJECT_TCP_RST as u32 {
                    ReadVerdict::ResetTcp
                } else {
                    ReadVerdict::Reject
                });
            }
            LiveExpr::Other(_) => return None,
            _ => {}
        }
    }
    rule_of(&m)
}

fn rule_of(m: &Matches) -> Option<Rule> {
    let proto = || m.l4proto.and_then(L4Proto::from_number);
    let Some(verdict) = m.verdict else {
        if let (true, Some((_, Some(group)))) = (m.ct_state, &m.log) {
            return Some(Rule::RecordFlow { group: *group });
        }
        if let Some((prefix, group)) = &m.log {
            let (count, unit, burst) = m.limit?;
            let unit = [
                RateUnit::Second,
                RateUnit::Minute,
                RateUnit::Hour,
                RateUnit::Day,
            ]
            .into_iter()
            .find(|u| u.seconds() == unit)?;
            return Some(Rule::Log(LogSpec {
                prefix: prefix.clone(),
                group: *group,
                rate: Rate { count, unit },
                burst,
            }));
        }
        return m.counter.then_some(Rule::CountFamily(m.family?));
    };
    Some(match verdict {
        ReadVerdict::Reject => Rule::Refuse(Action::Reject),
        // The re-encoding checks the interface, protocol and priority.
        ReadVerdict::ResetTcp => Rule::ResetTcp,
        ReadVerdict::Drop if m.fib_not_local => {
            Rule::DropForeignSource(Arrival::ALL.into_iter().find(|a| Some(a.iif()) == m.iif)?)
        }
        // The re-encoding checks the bytes.
        ReadVerdict::Drop if m.ll_daddr_prefix.is_some() => Rule::DropBridgeGroupFrames,
        ReadVerdict::Drop if m.fib_missing => {
            Rule::DropSpoofedFrom(iface_of(m.iifname.as_deref()?)?)
        }
        ReadVerdict::Drop => Rule::Refuse(Action::Drop),
        ReadVerdict::Accept if m.audit_window => Rule::AuditAccept {
            group: m.log.as_ref()?.1?,
        },
        ReadVerdict::Accept => {
            if m.ct_state {
                Rule::AcceptEstablished
            } else if let Some(set) = m.set {
                match m.uid_eq {
                    Some(uid) => Rule::AcceptTupleFromGuard {
                        set,
                        mark: m.mark_eq,
                        uid,
                    },
                    None => Rule::AcceptTupleIn(set),
                }
            } else if let Some(number) = m.icmp_type {
                let t = icmpv6_type_of(number)?;
                if m.limit.is_some() && t == Icmpv6Type::Mld2ListenerReport {
                    Rule::AcceptMldReport
                } else {
                    Rule::AcceptIcmpv6(t)
                }
            } else if m.oif_eq {
                Rule::AcceptLoopback
            } else if let (Some(ip), Some(port), None) = (m.daddr, m.dport, m.limit) {
                Rule::AcceptGuardQuery {
                    to: SocketAddr::new(ip, port),
                    proto: proto()?,
                }
            } else {
                Rule::AcceptDhcpClient(m.family?)
            }
        }
        ReadVerdict::GotoOutput if m.icmp_type.is_some() => {
            Rule::FenceIcmpv6(icmpv6_type_of(m.icmp_type?)?)
        }
        ReadVerdict::GotoOutput if m.iifname.is_none() && m.l4proto == Some(IPPROTO_IGMP) => {
            Rule::FenceIgmp
        }
        ReadVerdict::GotoOutput => Rule::Fence(if let Some(uid) = m.uid_eq {
            ScopeMatch::Uid(uid)
        } else if let Some(gid) = m.gid_eq {
            ScopeMatch::Gid(gid)
        } else if let Some((level, id)) = m.cgroup {
            // The kernel knows the cgroup by its id alone; the path is the rule's comment,
            // and a rule whose path is not as deep as its level is none of ours (it may be
            // deeper: on a hybrid host nft's path starts with the hierarchy's mount point,
            // `unified/`).
            let path: CgroupPath = m.comment.as_deref()?.parse().ok()?;
            if path.level() < level {
                return None;
            }
            ScopeMatch::Cgroup(CgroupMatch { path, level, id })
        } else {
            ScopeMatch::Interface(iface_of(m.iifname.as_deref()?)?)
        }),
        ReadVerdict::GotoFromBridge => Rule::FromBridge(iface_of(m.iifname.as_deref()?)?),
        // Anything besides the lookup or the port (a uid, a protocol) fails the re-encoding.
        ReadVerdict::JumpGuard => match (m.set, m.sport) {
            (Some(set), None) if set.role == SetRole::Dns => Rule::JumpGuardToUpstream(set),
            (None, Some(port)) => Rule::JumpGuardFromPort(port),
            _ => return None,
        },
        ReadVerdict::GotoRefused => {
            if m.ct_reply {
                Rule::RefuseRepliesOut
            } else if m.fib_not_local && m.oif_eq {
                Rule::RefuseForeignSourceToHost
            } else if m.fib_not_local && m.fib_not_broadcast {
                Rule::RefuseForeignSource
            } else if let Some(mark) = m.socket_mark_neq {
                Rule::RefuseGuardQueryToOtherSockets {
                    to: SocketAddr::new(m.daddr.unwrap_or(IpAddr::from([0u8; 4])), m.dport?),
                    proto: proto()?,
                    mark,
                }
            } else if let Some(number) = m.icmp_type {
                Rule::RefuseIcmpv6(icmpv6_type_of(number)?)
            } else if m.hdrlength {
                Rule::RefuseSourceRoute(SourceRoute::Ipv4Options)
            } else if m.routing_header {
                Rule::RefuseSourceRoute(SourceRoute::Ipv6RoutingHeader)
            } else if let Some(set) = m.set {
                match (m.uid_eq, m.uid_neq, m.mark_neq) {
                    (_, Some(uid), _) => Rule::RefuseUpstreamFromOtherUids { set, uid },
                    (Some(uid), None, Some(mark)) => {
                        Rule::RefuseUpstreamUnmarked { set, uid, mark }
                    }
                    _ => Rule::RefuseDaddrIn(set),
                }
            } else if m.has_owner {
                Rule::RefuseIcmpFromProcesses(match m.l4proto? {
                    IPPROTO_ICMP => Family::V4,
                    _ => Family::V6,
                })
            } else if let Some(port) = m.sport {
                let ip = m.saddr.unwrap_or(IpAddr::from([0u8; 4]));
                let from = SocketAddr::new(ip, port);
                match (m.mark_neq, m.uid_neq) {
                    (Some(mark), _) => Rule::RefuseUnmarkedFromGuardPort {
                        from,
                        proto: proto()?,
                        mark,
                    },
                    (None, Some(uid)) => Rule::RefuseOtherUidsFromGuardPort {
                        from,
                        proto: proto()?,
                        uid,
                    },
                    (None, None) => return None,
                }
            } else if let Some(port) = m.dport {
                Rule::RefuseService(proto()?, port)
            } else {
                Rule::GotoRefused
            }
        }
    })
}

/// The interface pattern `iifname` compares with: a whole name NUL-padded to [`IFNAMSIZ`]
/// bytes, or a prefix's bytes alone (`br-*`).
fn iface_of(data: &[u8]) -> Option<IfacePattern> {
    let text = match data.iter().position(|&b| b == 0) {
        Some(end) if data.len() == IFNAMSIZ => std::str::from_utf8(&data[..end]).ok()?.to_string(),
        Some(_) => return None,
        None => format!("{}*", std::str::from_utf8(data).ok()?),
    };
    text.parse().ok()
}

/// The ICMPv6 type a rule names by its number.
fn icmpv6_type_of(number: u8) -> Option<Icmpv6Type> {
    Icmpv6Type::ALL.into_iter().find(|t| t.number() == number)
}

fn nl_rule<'a>(
    chain: &'a Chain<'a>,
    rule: &Rule,
    set_ids: &BTreeMap<SetId, u32>,
) -> nftnl::Rule<'a> {
    let mut nl = nftnl::Rule::new(chain);
    for e in rule_exprs(rule, set_ids) {
        nl.add_expr(&e);
    }
    if let Some(comment) = rule_comment(rule) {
        // A comment libnftnl's buffer cannot hold (a path longer than 125 bytes) is left
        // out: the rule then reads back as none of ours, drift, never as another cgroup.
        let _ = nl.set_comment(comment);
    }
    nl
}

/// The comment a rule carries (nft's `comment "..."`, kept in the rule's user data): a
/// cgroup's path, which the kernel knows only by its id.
fn rule_comment(rule: &Rule) -> Option<CString> {
    match rule {
        Rule::Fence(ScopeMatch::Cgroup(c)) => CString::new(c.path.as_str()).ok(),
        Rule::AuditAccept { .. } => CString::new(AUDIT_COMMENT).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::{L4Proto, PortRange};
    use crate::core::ruleset::{Icmpv6Type, LogSpec, SetRole};
    use crate::nft::sys::DumpedRule;

    fn exprs(rule: &Rule) -> Vec<String> {
        rule_text(rule)
    }

    // Expected texts are those `nft --debug=netlink` prints for the same rule written as
    // nft text (libnftnl's format), recorded from nft 1.0.6.

    #[test]
    fn tuple_lookup_in_an_interval_set_matches_nft() {
        let got = exprs(&Rule::AcceptTupleIn(SetId::new(SetRole::Allow, Family::V4)));
        assert_eq!(
            got,
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x00000002",
                "payload load 4b @ network header + 16 => reg 1",
                "meta load l4proto => reg 9",
                "byteorder reg 9 = hton(reg 9, 2, 1)",
                "payload load 2b @ transport header + 2 => reg 10",
                "lookup reg 1 set allow4",
                "immediate reg 0 accept",
            ]
        );
    }

    #[test]
    fn ipv6_tuple_lookup_in_a_hash_set_uses_nfts_registers() {
        let got = exprs(&Rule::AcceptTupleIn(SetId::new(
            SetRole::Resolved,
            Family::V6,
        )));
        assert_eq!(
            got,
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "payload load 16b @ network header + 24 => reg 1",
                "meta load l4proto => reg 2",
                "payload load 2b @ transport header + 2 => reg 13",
                "lookup reg 1 set resolved6",
                "immediate reg 0 accept",
            ]
        );
    }

    #[test]
    fn guard_rules_match_nft() {
        let from_guard = Rule::AcceptTupleFromGuard {
            set: SetId::new(SetRole::Dns, Family::V4),
            mark: Some(0x6500_0000),
            uid: 993,
        };
        assert_eq!(
            exprs(&from_guard),
            [
                "meta load mark => reg 1",
                "cmp eq reg 1 0x65000000",
                "meta load skuid => reg 1",
                "cmp eq reg 1 0x000003e1",
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x00000002",
                "payload load 4b @ network header + 16 => reg 1",
                "meta load l4proto => reg 9",
                "payload load 2b @ transport header + 2 => reg 10",
                "lookup reg 1 set dns4",
                "immediate reg 0 accept",
            ]
        );
        assert_eq!(
            exprs(&Rule::RefuseService(L4Proto::Udp, 853)),
            [
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000011",
                "payload load 2b @ transport header + 2 => reg 1",
                "cmp eq reg 1 0x00005503",
                "immediate reg 0 goto -> refused",
            ]
        );
    }

    #[test]
    fn unmarked_replies_from_the_guards_port_match_nft() {
        let rule = |from: &str, proto, mark| Rule::RefuseUnmarkedFromGuardPort {
            from: from.parse().unwrap(),
            proto,
            mark,
        };
        assert_eq!(
            exprs(&rule("127.0.0.53:53", L4Proto::Udp, 0x6500_0000)),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x00000002",
                "payload load 4b @ network header + 12 => reg 1",
                "cmp eq reg 1 0x3500007f",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000011",
                "payload load 2b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x00003500",
                "meta load mark => reg 1",
                "cmp neq reg 1 0x65000000",
                "immediate reg 0 goto -> refused",
            ]
        );
        assert_eq!(
            exprs(&rule("[::1]:5353", L4Proto::Tcp, 0x1e00)),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "payload load 16b @ network header + 8 => reg 1",
                "cmp eq reg 1 0x00000000 0x00000000 0x00000000 0x01000000",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000006",
                "payload load 2b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x0000e914",
                "meta load mark => reg 1",
                "cmp neq reg 1 0x00001e00",
                "immediate reg 0 goto -> refused",
            ]
        );
        assert_eq!(
            exprs(&rule("0.0.0.0:53", L4Proto::Udp, 0x1e00)),
            [
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000011",
                "payload load 2b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x00003500",
                "meta load mark => reg 1",
                "cmp neq reg 1 0x00001e00",
                "immediate reg 0 goto -> refused",
            ]
        );
    }

    #[test]
    fn icmp_from_processes_off_loopback_matches_nft() {
        for (family, proto) in [(Family::V4, "0x00000001"), (Family::V6, "0x0000003a")] {
            assert_eq!(
                exprs(&Rule::RefuseIcmpFromProcesses(family)),
                [
                    "meta load l4proto => reg 1".to_string(),
                    format!("cmp eq reg 1 {proto}"),
                    "meta load skuid => reg 1".to_string(),
                    "byteorder reg 1 = hton(reg 1, 4, 4)".to_string(),
                    "cmp gte reg 1 0x00000000".to_string(),
                    "meta load oif => reg 1".to_string(),
                    "cmp neq reg 1 0x00000001".to_string(),
                    "immediate reg 0 goto -> refused".to_string(),
                ]
            );
        }
    }

    #[test]
    fn refusals_of_other_uids_and_unmarked_sockets_match_nft() {
        assert_eq!(
            exprs(&Rule::RefuseUpstreamFromOtherUids {
                set: SetId::new(SetRole::Dns, Family::V4),
                uid: 993,
            }),
            [
                "meta load skuid => reg 1",
                "cmp neq reg 1 0x000003e1",
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x00000002",
                "payload load 4b @ network header + 16 => reg 1",
                "meta load l4proto => reg 9",
                "payload load 2b @ transport header + 2 => reg 10",
                "lookup reg 1 set dns4",
                "immediate reg 0 goto -> refused",
            ]
        );
        assert_eq!(
            exprs(&Rule::RefuseUpstreamUnmarked {
                set: SetId::new(SetRole::Dns, Family::V6),
                uid: 993,
                mark: 0x6500_0000,
            }),
            [
                "meta load skuid => reg 1",
                "cmp eq reg 1 0x000003e1",
                "meta load mark => reg 1",
                "cmp neq reg 1 0x65000000",
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "payload load 16b @ network header + 24 => reg 1",
                "meta load l4proto => reg 2",
                "payload load 2b @ transport header + 2 => reg 13",
                "lookup reg 1 set dns6",
                "immediate reg 0 goto -> refused",
            ]
        );
        let from_port = |from: &str| Rule::RefuseOtherUidsFromGuardPort {
            from: from.parse().unwrap(),
            proto: L4Proto::Udp,
            uid: 993,
        };
        assert_eq!(
            exprs(&from_port("127.0.0.53:53")),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x00000002",
                "payload load 4b @ network header + 12 => reg 1",
                "cmp eq reg 1 0x3500007f",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000011",
                "payload load 2b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x00003500",
                "meta load skuid => reg 1",
                "cmp neq reg 1 0x000003e1",
                "immediate reg 0 goto -> refused",
            ]
        );
        assert_eq!(
            exprs(&from_port("0.0.0.0:53")),
            [
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000011",
                "payload load 2b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x00003500",
                "meta load skuid => reg 1",
                "cmp neq reg 1 0x000003e1",
                "immediate reg 0 goto -> refused",
            ]
        );
    }

    #[test]
    fn essentials_match_nft() {
        assert_eq!(
            exprs(&Rule::AcceptEstablished),
            [
                "ct load state => reg 1",
                "bitwise reg 1 = ( reg 1 & 0x00000006 ) ^ 0x00000000",
                "cmp neq reg 1 0x00000000",
                "immediate reg 0 accept",
            ]
        );
        assert_eq!(
            exprs(&Rule::AcceptLoopback),
            [
                "meta load oif => reg 1",
                "cmp eq reg 1 0x00000001",
                "immediate reg 0 accept"
            ]
        );
        assert_eq!(
            exprs(&Rule::AcceptDhcpClient(Family::V4)),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x00000002",
                "payload load 4b @ network header + 16 => reg 1",
                "cmp eq reg 1 0xffffffff",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000011",
                "payload load 4b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x43004400",
                "meta load len => reg 1",
                "byteorder reg 1 = hton(reg 1, 4, 4)",
                "cmp lte reg 1 0xdc050000",
                "limit rate 2048/minute burst 1500 type bytes flags 0x0",
                "immediate reg 0 accept",
            ]
        );
        assert_eq!(
            exprs(&Rule::AcceptDhcpClient(Family::V6)),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "payload load 16b @ network header + 24 => reg 1",
                "cmp eq reg 1 0x000002ff 0x00000000 0x00000000 0x02000100",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000011",
                "payload load 4b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x23022202",
                "meta load len => reg 1",
                "byteorder reg 1 = hton(reg 1, 4, 4)",
                "cmp lte reg 1 0xdc050000",
                "limit rate 2048/minute burst 1500 type bytes flags 0x0",
                "immediate reg 0 accept",
            ]
        );
        assert_eq!(
            exprs(&Rule::AcceptMldReport),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x0000003a",
                "payload load 1b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x0000008f",
                "limit rate 1024/minute burst 1500 type bytes flags 0x0",
                "immediate reg 0 accept",
            ]
        );
        assert_eq!(
            exprs(&Rule::RefuseSourceRoute(SourceRoute::Ipv4Options)),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x00000002",
                "payload load 1b @ network header + 0 => reg 1",
                "bitwise reg 1 = ( reg 1 & 0x0000000f ) ^ 0x00000000",
                "cmp neq reg 1 0x00000005",
                "immediate reg 0 goto -> refused",
            ]
        );
        assert_eq!(
            exprs(&Rule::RefuseSourceRoute(SourceRoute::Ipv6RoutingHeader)),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "exthdr load ipv6 1b @ 43 + 0 present => reg 1",
                "cmp eq reg 1 0x00000001",
                "immediate reg 0 goto -> refused",
            ]
        );
        assert_eq!(
            exprs(&Rule::AcceptIcmpv6(Icmpv6Type::Mld2ListenerReport)),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x0000003a",
                "payload load 1b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x0000008f",
                "immediate reg 0 accept",
            ]
        );
    }

    #[test]
    fn deny_log_and_final_verdicts_match_nft() {
        assert_eq!(
            exprs(&Rule::RefuseDaddrIn(SetId::new(SetRole::Deny, Family::V4))),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x00000002",
                "payload load 4b @ network header + 16 => reg 1",
                "lookup reg 1 set deny4",
                "counter pkts 0 bytes 0",
                "immediate reg 0 goto -> refused",
            ]
        );
        assert_eq!(
            exprs(&Rule::Log(LogSpec {
                prefix: "EGRESS-DROP: ".into(),
                group: Some(100),
                rate: "10/second".parse().unwrap(),
                burst: 20,
            })),
            [
                "limit rate 10/second burst 20 type packets flags 0x0",
                "log prefix EGRESS-DROP:  group 100 snaplen 0 qthreshold 0",
            ]
        );
        assert_eq!(
            exprs(&Rule::CountFamily(Family::V4)),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x00000002",
                "counter pkts 0 bytes 0"
            ]
        );
        assert_eq!(
            exprs(&Rule::Refuse(Action::Reject)),
            ["reject type 2 code 3"]
        );
        assert_eq!(exprs(&Rule::Refuse(Action::Drop)), ["immediate reg 0 drop"]);
        // nft --debug=netlink: `iif 0 meta l4proto tcp meta priority != 0:5 reject with tcp
        // reset`, `iif "lo" fib saddr type != local drop`.
        assert_eq!(
            exprs(&Rule::ResetTcp),
            [
                "meta load iif => reg 1",
                "cmp eq reg 1 0x00000000",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000006",
                "meta load priority => reg 1",
                "cmp neq reg 1 0x00000005",
                "reject type 1 code 0"
            ]
        );
        // `oif "lo" meta skuid >= 0 fib saddr type != local goto refused`.
        assert_eq!(
            exprs(&Rule::RefuseForeignSourceToHost),
            [
                "meta load oif => reg 1",
                "cmp eq reg 1 0x00000001",
                "meta load skuid => reg 1",
                "byteorder reg 1 = hton(reg 1, 4, 4)",
                "cmp gte reg 1 0x00000000",
                "fib saddr type => reg 1",
                "cmp neq reg 1 0x00000002",
                "immediate reg 0 goto -> refused"
            ]
        );
        // `meta skuid >= 0 fib saddr type != local fib saddr type != broadcast goto refused`.
        assert_eq!(
            exprs(&Rule::RefuseForeignSource),
            [
                "meta load skuid => reg 1",
                "byteorder reg 1 = hton(reg 1, 4, 4)",
                "cmp gte reg 1 0x00000000",
                "fib saddr type => reg 1",
                "cmp neq reg 1 0x00000002",
                "fib saddr type => reg 1",
                "cmp neq reg 1 0x00000003",
                "immediate reg 0 goto -> refused"
            ]
        );
        assert_eq!(
            exprs(&Rule::DropForeignSource(Arrival::Loopback)),
            [
                "meta load iif => reg 1",
                "cmp eq reg 1 0x00000001",
                "fib saddr type => reg 1",
                "cmp neq reg 1 0x00000002",
                "immediate reg 0 drop"
            ]
        );
    }

    #[test]
    fn audit_and_flow_records_match_nft() {
        // nft --debug=netlink of `meta nfproto @audit_window log prefix "EGRESS-AUDIT: "
        // group 7 accept comment "..."` and `ct state new log prefix "EGRESS-FLOW: " group 8`.
        assert_eq!(
            exprs(&Rule::AuditAccept { group: 7 }),
            [
                "meta load nfproto => reg 1",
                "lookup reg 1 set audit_window",
                "log prefix EGRESS-AUDIT:  group 7 snaplen 0 qthreshold 0",
                "immediate reg 0 accept",
            ]
        );
        assert_eq!(
            exprs(&Rule::RecordFlow { group: 8 }),
            [
                "ct load state => reg 1",
                "bitwise reg 1 = ( reg 1 & 0x00000008 ) ^ 0x00000000",
                "cmp neq reg 1 0x00000000",
                "log prefix EGRESS-FLOW:  group 8 snaplen 0 qthreshold 0",
            ]
        );
        let audit = dumped_rule(&Rule::AuditAccept { group: 7 }).unwrap();
        assert_eq!(
            audit.userdata.as_deref().and_then(comment_of).as_deref(),
            Some(AUDIT_COMMENT),
            "nft list says what the rule is for"
        );
        // Without its comment, or looking up another set, it is none of ours.
        assert_eq!(decode_rule(&audit.exprs, None), None);
        let mut other_set = audit.exprs.clone();
        for e in &mut other_set {
            if let LiveExpr::Lookup { set, .. } = e {
                *set = "audit_windows".into();
            }
        }
        assert_eq!(decode_rule(&other_set, audit.userdata.as_deref()), None);
    }

    #[test]
    fn a_table_without_extras_is_the_plans_byte_for_byte() {
        use crate::core::plan::{Audit, Extras, with_extras};
        let rs = crate::core::plan::fail_closed();
        let bytes = |rs: &Ruleset| without_padding(replace_table(rs).built().concat());
        assert_eq!(
            bytes(&with_extras(rs.clone(), &Extras::default())),
            bytes(&rs)
        );
        let recording = Extras {
            flow_group: Some(8),
            audit: Some(Audit {
                group: 7,
                open_for_ms: Some(30_000),
            }),
            refuse_replies: true,
        };
        let extra = with_extras(rs.clone(), &recording);
        assert_ne!(bytes(&extra), bytes(&rs));
        let enc = replace_table(&extra);
        assert!(
            enc.labels.iter().any(|l| l == "set audit_window")
                && enc
                    .labels
                    .iter()
                    .any(|l| l == "elements of set audit_window"),
            "{:?}",
            enc.labels
        );
    }

    #[test]
    fn set_keys_match_nfts_layout() {
        // nft's element dump for `203.0.113.0/28 . tcp . 22`: 007100cb 00000006 00001600
        // up to 0f7100cb 00000006 00001600 (32-bit words in host order).
        let id = SetId::new(SetRole::Allow, Family::V4);
        let e = tuple_elem(
            id,
            &Tuple {
                net: "203.0.113.0/28".parse().unwrap(),
                proto: L4Proto::Tcp,
                ports: PortRange::single(22),
            },
        );
        assert_eq!(e.key, [203, 0, 113, 0, 6, 0, 0, 0, 0, 22, 0, 0]);
        assert_eq!(
            e.key_end.unwrap(),
            [203, 0, 113, 15, 6, 0, 0, 0, 0, 22, 0, 0]
        );
        assert_eq!(key_spec(id).datatype, 0x730d);
        assert_eq!(set_flags(id), 0x84);
        assert_eq!(set_flags(SetId::new(SetRole::Resolved, Family::V4)), 0x10);
        assert_eq!(key_spec(SetId::new(SetRole::Resolved, Family::V6)).len, 24);
        assert!(
            key_spec(SetId::new(SetRole::Resolved, Family::V6))
                .concat_fields
                .is_empty()
        );
    }

    #[test]
    fn interval_elements_match_nfts_layout() {
        let nets: Vec<IpNet> = ["10.0.0.0/8", "169.254.0.0/16", "255.255.255.0/24"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let got: Vec<(Vec<u8>, u32)> = interval_elements(&nets)
            .into_iter()
            .map(|e| (e.key, e.flags))
            .collect();
        assert_eq!(
            got,
            vec![
                (vec![0, 0, 0, 0], 1),
                (vec![10, 0, 0, 0], 0),
                (vec![11, 0, 0, 0], 1),
                (vec![169, 254, 0, 0], 0),
                (vec![169, 255, 0, 0], 1),
                // The last network reaches the top of the space: no end element.
                (vec![255, 255, 255, 0], 0),
            ]
        );
    }

    /// Every shape of rule, with the parameters the planner gives them (and a few it could).
    fn every_rule() -> Vec<Rule> {
        let mut rules = vec![
            Rule::AuditAccept { group: 7 },
            Rule::RecordFlow { group: 8 },
            Rule::RefuseRepliesOut,
            Rule::AcceptEstablished,
            Rule::AcceptLoopback,
            Rule::RefuseForeignSourceToHost,
            Rule::RefuseForeignSource,
            Rule::AcceptMldReport,
            Rule::GotoRefused,
            Rule::Refuse(Action::Reject),
            Rule::Refuse(Action::Drop),
            Rule::ResetTcp,
        ];
        rules.extend(Arrival::ALL.map(Rule::DropForeignSource));
        rules.extend(Icmpv6Type::ALL.map(Rule::AcceptIcmpv6));
        rules.extend(SourceRoute::ALL.map(Rule::RefuseSourceRoute));
        for family in Family::BOTH {
            rules.push(Rule::AcceptDhcpClient(family));
            rules.push(Rule::CountFamily(family));
            rules.push(Rule::RefuseIcmpFromProcesses(family));
        }
        for id in SetId::ALL {
            rules.push(Rule::RefuseDaddrIn(id));
            rules.push(Rule::AcceptTupleIn(id));
        }
        for family in Family::BOTH {
            let set = SetId::new(SetRole::Dns, family);
            rules.push(Rule::RefuseUpstreamFromOtherUids { set, uid: 993 });
            rules.push(Rule::RefuseUpstreamUnmarked {
                set,
                uid: 0,
                mark: 0x6500_0000,
            });
            for mark in [Some(0x6500_0000), None] {
                rules.push(Rule::AcceptTupleFromGuard {
                    set,
                    mark,
                    uid: 993,
                });
            }
        }
        for proto in [L4Proto::Tcp, L4Proto::Udp] {
            rules.push(Rule::RefuseService(proto, 53));
            rules.push(Rule::RefuseService(proto, 853));
            for from in ["127.0.0.53:53", "[::1]:5353", "0.0.0.0:53"] {
                let from = from.parse().unwrap();
                rules.push(Rule::RefuseUnmarkedFromGuardPort {
                    from,
                    proto,
                    mark: 0x1e00,
                });
                rules.push(Rule::RefuseOtherUidsFromGuardPort {
                    from,
                    proto,
                    uid: 993,
                });
            }
        }
        rules.extend(scope_rules());
        for (prefix, group, rate) in [
            ("EGRESS-DROP: ", Some(100), "10/second"),
            ("EGRESS-DROP: ", None, "10/second"),
            ("x", Some(0), "3/day"),
        ] {
            rules.push(Rule::Log(LogSpec {
                prefix: prefix.into(),
                group,
                rate: rate.parse().unwrap(),
                burst: 20,
            }));
        }
        rules
    }

    fn iface(name: &str) -> IfacePattern {
        name.parse().unwrap()
    }

    fn cgroup(path: &str, id: u64) -> CgroupMatch {
        let path: CgroupPath = path.parse().unwrap();
        CgroupMatch {
            level: path.level(),
            path,
            id,
        }
    }

    /// Every shape of rule a scope adds.
    fn scope_rules() -> Vec<Rule> {
        let mut rules = vec![
            Rule::Fence(ScopeMatch::Uid(1001)),
            Rule::Fence(ScopeMatch::Uid(0)),
            Rule::Fence(ScopeMatch::Gid(2000)),
            Rule::Fence(ScopeMatch::Cgroup(cgroup("agent.slice", 0x3f))),
            Rule::Fence(ScopeMatch::Cgroup(cgroup(
                "system.slice/agent.service",
                u64::MAX - 7,
            ))),
        ];
        for name in ["docker0", "br-*", "efbr0", "abcdefghijklmno", "x*"] {
            rules.push(Rule::Fence(ScopeMatch::Interface(iface(name))));
            rules.push(Rule::FromBridge(iface(name)));
        }
        for to in ["198.18.0.1:53", "[fd00::1]:53", "172.17.0.1:5353"] {
            for proto in [L4Proto::Udp, L4Proto::Tcp] {
                rules.push(Rule::AcceptGuardQuery {
                    to: to.parse().unwrap(),
                    proto,
                });
            }
        }
        for name in ["docker0", "br-*"] {
            rules.push(Rule::DropSpoofedFrom(iface(name)));
        }
        rules.push(Rule::DropBridgeGroupFrames);
        rules.extend(Icmpv6Type::ALL.map(Rule::RefuseIcmpv6));
        rules.extend(Icmpv6Type::ALL.map(Rule::FenceIcmpv6));
        rules.push(Rule::FenceIgmp);
        for to in [
            "127.0.0.53:53",
            "[fd00::1]:53",
            "198.18.0.1:5353",
            "0.0.0.0:53",
        ] {
            for proto in [L4Proto::Udp, L4Proto::Tcp] {
                rules.push(Rule::RefuseGuardQueryToOtherSockets {
                    to: to.parse().unwrap(),
                    proto,
                    mark: 0x6500_0000,
                });
            }
        }
        rules.extend([53, 5353, 0].map(Rule::JumpGuardFromPort));
        rules.extend(Family::BOTH.map(|f| Rule::JumpGuardToUpstream(SetId::new(SetRole::Dns, f))));
        rules
    }

    #[test]
    fn jumps_to_the_guards_protections_match_nft() {
        // Recorded from `nft --debug=netlink -f` (nft 1.0.6): `th` adds no protocol match.
        assert_eq!(
            exprs(&Rule::JumpGuardFromPort(53)),
            [
                "payload load 2b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x00003500",
                "immediate reg 0 jump -> guard",
            ]
        );
        assert_eq!(
            exprs(&Rule::JumpGuardToUpstream(SetId::new(
                SetRole::Dns,
                Family::V4
            ))),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x00000002",
                "payload load 4b @ network header + 16 => reg 1",
                "meta load l4proto => reg 9",
                "payload load 2b @ transport header + 2 => reg 10",
                "lookup reg 1 set dns4",
                "immediate reg 0 jump -> guard",
            ]
        );
        assert_eq!(
            exprs(&Rule::JumpGuardToUpstream(SetId::new(
                SetRole::Dns,
                Family::V6
            ))),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "payload load 16b @ network header + 24 => reg 1",
                "meta load l4proto => reg 2",
                "payload load 2b @ transport header + 2 => reg 13",
                "lookup reg 1 set dns6",
                "immediate reg 0 jump -> guard",
            ]
        );
    }

    #[test]
    fn altered_jumps_to_the_guard_read_as_no_rule() {
        let read = |d: &DumpedRule| decode_rule(&d.exprs, d.userdata.as_deref());
        let port = Rule::JumpGuardFromPort(53);
        let upstream = Rule::JumpGuardToUpstream(SetId::new(SetRole::Dns, Family::V4));
        type DumpEdit = dyn Fn(&mut DumpedRule);
        let cases: Vec<(&str, &Rule, Box<DumpEdit>)> = vec![
            (
                "a goto instead of a jump",
                &port,
                Box::new(|d| {
                    if let Some(LiveExpr::Verdict { code, .. }) = d.exprs.last_mut() {
                        *code = libc::NFT_GOTO;
                    }
                }),
            ),
            (
                "a jump to another chain",
                &upstream,
                Box::new(|d| {
                    if let Some(LiveExpr::Verdict { chain, .. }) = d.exprs.last_mut() {
                        *chain = Some("output".into());
                    }
                }),
            ),
            (
                "the destination port instead of the source",
                &port,
                Box::new(|d| {
                    if let LiveExpr::Payload { offset, .. } = &mut d.exprs[0] {
                        *offset = 2;
                    }
                }),
            ),
            (
                "the port compared with !=",
                &port,
                Box::new(|d| {
                    if let LiveExpr::Cmp { op, .. } = &mut d.exprs[1] {
                        *op = libc::NFT_CMP_NEQ as u32;
                    }
                }),
            ),
            (
                "a lookup in another set",
                &upstream,
                Box::new(|d| {
                    if let LiveExpr::Lookup { set, .. } = &mut d.exprs[5] {
                        *set = "allow4".into();
                    }
                }),
            ),
            (
                "a comment",
                &port,
                Box::new(|d| d.userdata = comment_userdata("x")),
            ),
        ];
        for (what, rule, edit) in cases {
            let mut d = dumped_rule(rule).unwrap();
            assert_eq!(read(&d), Some(rule.clone()), "{what}: unedited");
            edit(&mut d);
            assert_ne!(
                &d,
                &dumped_rule(rule).unwrap(),
                "{what}: the edit changed nothing"
            );
            assert_eq!(read(&d), None, "{what}");
        }
    }

    #[test]
    fn scope_rules_match_nft() {
        // Recorded from `nft --debug=netlink -f` (nft 1.0.6) for the same rules as nft text.
        assert_eq!(
            exprs(&Rule::Fence(ScopeMatch::Uid(1001))),
            [
                "meta load skuid => reg 1",
                "cmp eq reg 1 0x000003e9",
                "immediate reg 0 goto -> output"
            ]
        );
        assert_eq!(
            exprs(&Rule::Fence(ScopeMatch::Gid(2000))),
            [
                "meta load skgid => reg 1",
                "cmp eq reg 1 0x000007d0",
                "immediate reg 0 goto -> output"
            ]
        );
        assert_eq!(
            exprs(&Rule::Fence(ScopeMatch::Interface(iface("docker0")))),
            [
                "meta load iifname => reg 1",
                "cmp eq reg 1 0x6b636f64 0x00307265 0x00000000 0x00000000",
                "immediate reg 0 goto -> output"
            ]
        );
        assert_eq!(
            exprs(&Rule::Fence(ScopeMatch::Interface(iface("br-*")))),
            [
                "meta load iifname => reg 1",
                "cmp eq reg 1 0x002d7262",
                "immediate reg 0 goto -> output"
            ]
        );
        // Only the prefix's three bytes, no NUL: any name that starts with them matches.
        let prefix = dumped_rule(&Rule::FromBridge(iface("br-*"))).unwrap();
        assert!(matches!(&prefix.exprs[1], LiveExpr::Cmp { data, .. } if data == b"br-"));
        assert_eq!(
            exprs(&Rule::FromBridge(iface("docker0"))),
            [
                "meta load iifname => reg 1",
                "cmp eq reg 1 0x6b636f64 0x00307265 0x00000000 0x00000000",
                "immediate reg 0 goto -> from_bridge"
            ]
        );
        assert_eq!(
            exprs(&Rule::AcceptGuardQuery {
                to: "198.18.0.1:53".parse().unwrap(),
                proto: L4Proto::Udp
            }),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x00000002",
                "payload load 4b @ network header + 16 => reg 1",
                "cmp eq reg 1 0x010012c6",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000011",
                "payload load 2b @ transport header + 2 => reg 1",
                "cmp eq reg 1 0x00003500",
                "immediate reg 0 accept",
            ]
        );
        assert_eq!(
            exprs(&Rule::AcceptGuardQuery {
                to: "[fd00::1]:53".parse().unwrap(),
                proto: L4Proto::Tcp
            }),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "payload load 16b @ network header + 24 => reg 1",
                "cmp eq reg 1 0x000000fd 0x00000000 0x00000000 0x01000000",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000006",
                "payload load 2b @ transport header + 2 => reg 1",
                "cmp eq reg 1 0x00003500",
                "immediate reg 0 accept",
            ]
        );
        // `socket cgroupv2 level 1 "egress-fence-test-enc16970" ... comment "..."` for a
        // cgroup of inode 0x3f: nft sends key 3 (cgroupv2), register 1, level 1, the id in
        // 8 bytes of host order, and the comment as user data TLV 0 with its NUL.
        let path = "egress-fence-test-enc16970";
        let rule = Rule::Fence(ScopeMatch::Cgroup(cgroup(path, 0x3f)));
        assert_eq!(
            exprs(&rule),
            [
                "socket load cgroupv2 => reg 1",
                "cmp eq reg 1 0x0000003f 0x00000000",
                "immediate reg 0 goto -> output"
            ]
        );
        let dumped = dumped_rule(&rule).unwrap();
        assert_eq!(
            dumped.exprs[0],
            LiveExpr::Socket {
                key: 3,
                dreg: sys::REG_1,
                level: Some(1)
            }
        );
        let mut udata = vec![0u8, 0x1b];
        udata.extend_from_slice(path.as_bytes());
        udata.push(0);
        assert_eq!(dumped.userdata, Some(udata));
        let deeper = dumped_rule(&Rule::Fence(ScopeMatch::Cgroup(cgroup("a/b/c", 1)))).unwrap();
        assert!(matches!(
            deeper.exprs[0],
            LiveExpr::Socket { level: Some(3), .. }
        ));
        // Rules without a cgroup (or the audit's) carry no user data, as nft's without a
        // comment.
        for rule in every_rule() {
            if !matches!(
                rule,
                Rule::Fence(ScopeMatch::Cgroup(_)) | Rule::AuditAccept { .. }
            ) {
                assert_eq!(dumped_rule(&rule).unwrap().userdata, None, "{rule}");
            }
        }
    }

    #[test]
    fn scope_guards_match_nft() {
        // Recorded from `nft --debug=netlink -f` (nft 1.0.6) for the same rules as nft text.
        assert_eq!(
            exprs(&Rule::DropBridgeGroupFrames),
            [
                "payload load 5b @ link header + 0 => reg 1",
                "cmp eq reg 1 0x00c28001 0x00000000",
                "immediate reg 0 drop",
            ]
        );
        assert_eq!(
            exprs(&Rule::DropSpoofedFrom(iface("docker0"))),
            [
                "meta load iifname => reg 1",
                "cmp eq reg 1 0x6b636f64 0x00307265 0x00000000 0x00000000",
                "fib saddr . iif oif present => reg 1",
                "cmp eq reg 1 0x00000000",
                "immediate reg 0 drop",
            ]
        );
        assert_eq!(
            exprs(&Rule::DropSpoofedFrom(iface("br-*"))),
            [
                "meta load iifname => reg 1",
                "cmp eq reg 1 0x002d7262",
                "fib saddr . iif oif present => reg 1",
                "cmp eq reg 1 0x00000000",
                "immediate reg 0 drop",
            ]
        );
        assert_eq!(
            exprs(&Rule::RefuseIcmpv6(Icmpv6Type::NdRouterSolicit)),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x0000003a",
                "payload load 1b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x00000085",
                "immediate reg 0 goto -> refused",
            ]
        );
        assert_eq!(
            exprs(&Rule::RefuseIcmpv6(Icmpv6Type::MldListenerReport)),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x0000003a",
                "payload load 1b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x00000083",
                "immediate reg 0 goto -> refused",
            ]
        );
        assert_eq!(
            exprs(&Rule::FenceIgmp),
            [
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000002",
                "immediate reg 0 goto -> output",
            ]
        );
        assert_eq!(
            exprs(&Rule::FenceIcmpv6(Icmpv6Type::Mld2ListenerReport)),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x0000003a",
                "payload load 1b @ transport header + 0 => reg 1",
                "cmp eq reg 1 0x0000008f",
                "immediate reg 0 goto -> output",
            ]
        );
        assert_eq!(
            exprs(&Rule::RefuseGuardQueryToOtherSockets {
                to: "127.0.0.53:53".parse().unwrap(),
                proto: L4Proto::Udp,
                mark: 0x6500_0000,
            }),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x00000002",
                "payload load 4b @ network header + 16 => reg 1",
                "cmp eq reg 1 0x3500007f",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000011",
                "payload load 2b @ transport header + 2 => reg 1",
                "cmp eq reg 1 0x00003500",
                "socket load mark => reg 1",
                "cmp neq reg 1 0x65000000",
                "immediate reg 0 goto -> refused",
            ]
        );
        assert_eq!(
            exprs(&Rule::RefuseGuardQueryToOtherSockets {
                to: "[fd00::1]:53".parse().unwrap(),
                proto: L4Proto::Tcp,
                mark: 0x6500_0000,
            }),
            [
                "meta load nfproto => reg 1",
                "cmp eq reg 1 0x0000000a",
                "payload load 16b @ network header + 24 => reg 1",
                "cmp eq reg 1 0x000000fd 0x00000000 0x00000000 0x01000000",
                "meta load l4proto => reg 1",
                "cmp eq reg 1 0x00000006",
                "payload load 2b @ transport header + 2 => reg 1",
                "cmp eq reg 1 0x00003500",
                "socket load mark => reg 1",
                "cmp neq reg 1 0x65000000",
                "immediate reg 0 goto -> refused",
            ]
        );
    }

    #[test]
    fn altered_refusal_answers_read_as_no_rule() {
        let reset = Rule::ResetTcp;
        let foreign = Rule::DropForeignSource(Arrival::Sent);
        type DumpEdit = dyn Fn(&mut DumpedRule);
        let cmp_at = |at: usize, edit: fn(&mut u32, &mut Vec<u8>)| -> Box<DumpEdit> {
            Box::new(move |d| {
                if let LiveExpr::Cmp { op, data, .. } = &mut d.exprs[at] {
                    edit(op, data);
                }
            })
        };
        let cases: Vec<(&str, &Rule, Box<DumpEdit>)> = vec![
            (
                "a reset for another priority",
                &reset,
                cmp_at(5, |_, data| *data = 6u32.to_ne_bytes().to_vec()),
            ),
            (
                "a reset for the probe's priority only",
                &reset,
                cmp_at(5, |op, _| *op = libc::NFT_CMP_EQ as u32),
            ),
            (
                "a reset of what is forwarded too",
                &reset,
                Box::new(|d| drop(d.exprs.drain(0..2))),
            ),
            (
                "a reset of UDP",
                &reset,
                cmp_at(3, |_, data| *data = vec![17]),
            ),
            (
                "ICMP behind the reset's matches",
                &reset,
                Box::new(|d| {
                    if let Some(LiveExpr::Reject { kind, code }) = d.exprs.last_mut() {
                        (*kind, *code) = (2, 3);
                    }
                }),
            ),
            (
                "a drop of this host's own sources",
                &foreign,
                cmp_at(3, |op, _| *op = libc::NFT_CMP_EQ as u32),
            ),
            (
                "a drop of another interface's foreign sources",
                &foreign,
                cmp_at(1, |_, data| *data = 2u32.to_ne_bytes().to_vec()),
            ),
            (
                "a drop by the destination's type",
                &foreign,
                Box::new(|d| {
                    if let LiveExpr::Fib { flags, .. } = &mut d.exprs[2] {
                        *flags = 2;
                    }
                }),
            ),
            (
                "foreign sources accepted",
                &foreign,
                Box::new(|d| {
                    if let Some(LiveExpr::Verdict { code, .. }) = d.exprs.last_mut() {
                        *code = libc::NF_ACCEPT;
                    }
                }),
            ),
        ];
        for (what, rule, edit) in cases {
            let mut d = dumped_rule(rule).expect("libnftnl reads its own message");
            let before = d.exprs.clone();
            edit(&mut d);
            assert_ne!(d.exprs, before, "{what}: the edit changed nothing");
            assert_eq!(decode_rule(&d.exprs, None), None, "{what}");
        }
    }

    #[test]
    fn altered_scope_guards_read_as_no_rule() {
        let read = |d: &DumpedRule| decode_rule(&d.exprs, d.userdata.as_deref());
        let spoof = Rule::DropSpoofedFrom(iface("docker0"));
        let nd = Rule::RefuseIcmpv6(Icmpv6Type::NdNeighborSolicit);
        let igmp = Rule::FenceIgmp;
        let query = Rule::RefuseGuardQueryToOtherSockets {
            to: "198.18.0.1:53".parse().unwrap(),
            proto: L4Proto::Udp,
            mark: 0x6500_0000,
        };
        const FIB_AT: usize = 2;
        const MARK_AT: usize = 8;
        type DumpEdit = dyn Fn(&mut DumpedRule);
        let cases: Vec<(&str, &Rule, Box<DumpEdit>)> = vec![
            (
                "fib present instead of missing",
                &spoof,
                Box::new(|d| {
                    if let LiveExpr::Cmp { op, .. } = &mut d.exprs[FIB_AT + 1] {
                        *op = libc::NFT_CMP_NEQ as u32;
                    }
                }),
            ),
            (
                "fib of the destination",
                &spoof,
                Box::new(|d| {
                    if let LiveExpr::Fib { flags, .. } = &mut d.exprs[FIB_AT] {
                        *flags = sys::NFTA_FIB_F_IIF | sys::NFTA_FIB_F_PRESENT | 2;
                    }
                }),
            ),
            (
                "fib without the input interface",
                &spoof,
                Box::new(|d| {
                    if let LiveExpr::Fib { flags, .. } = &mut d.exprs[FIB_AT] {
                        *flags = sys::NFTA_FIB_F_SADDR | sys::NFTA_FIB_F_PRESENT;
                    }
                }),
            ),
            (
                "fib's output interface itself, not whether there is one",
                &spoof,
                Box::new(|d| {
                    if let LiveExpr::Fib { flags, .. } = &mut d.exprs[FIB_AT] {
                        *flags = sys::NFTA_FIB_F_SADDR | sys::NFTA_FIB_F_IIF;
                    }
                }),
            ),
            (
                "fib's address type",
                &spoof,
                Box::new(|d| {
                    if let LiveExpr::Fib { result, .. } = &mut d.exprs[FIB_AT] {
                        *result = 3;
                    }
                }),
            ),
            (
                "a spoof check accepting",
                &spoof,
                Box::new(|d| {
                    if let Some(LiveExpr::Verdict { code, .. }) = d.exprs.last_mut() {
                        *code = libc::NF_ACCEPT;
                    }
                }),
            ),
            (
                "a spoof check without its interface",
                &spoof,
                Box::new(|d| drop(d.exprs.drain(0..2))),
            ),
            (
                "another ICMPv6 type",
                &nd,
                Box::new(|d| {
                    if let LiveExpr::Cmp { data, .. } = &mut d.exprs[5] {
                        *data = vec![128];
                    }
                }),
            ),
            (
                "ND refused without the family",
                &nd,
                Box::new(|d| drop(d.exprs.drain(0..2))),
            ),
            (
                "IGMP from an interface",
                &igmp,
                Box::new(|d| {
                    d.exprs.insert(
                        0,
                        LiveExpr::Meta {
                            key: libc::NFT_META_IIFNAME as u32,
                            dreg: sys::REG_1,
                        },
                    );
                    d.exprs.insert(
                        1,
                        LiveExpr::Cmp {
                            sreg: sys::REG_1,
                            op: libc::NFT_CMP_EQ as u32,
                            data: b"docker0\0\0\0\0\0\0\0\0\0".to_vec(),
                        },
                    );
                }),
            ),
            (
                "socket mark compared with ==",
                &query,
                Box::new(|d| {
                    if let LiveExpr::Cmp { op, .. } = &mut d.exprs[MARK_AT + 1] {
                        *op = libc::NFT_CMP_EQ as u32;
                    }
                }),
            ),
            (
                "socket transparent instead of mark",
                &query,
                Box::new(|d| {
                    if let LiveExpr::Socket { key, .. } = &mut d.exprs[MARK_AT] {
                        *key = 0;
                    }
                }),
            ),
            (
                "socket mark with a level",
                &query,
                Box::new(|d| {
                    if let LiveExpr::Socket { level, .. } = &mut d.exprs[MARK_AT] {
                        *level = Some(1);
                    }
                }),
            ),
            (
                "a guard query refusal without its port",
                &query,
                Box::new(|d| drop(d.exprs.drain(6..8))),
            ),
            (
                "a guard query refusal accepting",
                &query,
                Box::new(|d| {
                    if let Some(LiveExpr::Verdict { code, chain }) = d.exprs.last_mut() {
                        (*code, *chain) = (libc::NF_ACCEPT, None);
                    }
                }),
            ),
        ];
        for (what, rule, edit) in cases {
            let mut d = dumped_rule(rule).unwrap();
            assert_eq!(read(&d), Some(rule.clone()), "{what}: unedited");
            edit(&mut d);
            assert_ne!(
                &d,
                &dumped_rule(rule).unwrap(),
                "{what}: the edit changed nothing"
            );
            assert_eq!(read(&d), None, "{what}");
        }
    }

    #[test]
    fn the_longest_cgroup_path_a_policy_takes_reads_back() {
        let longest = format!("{}/{}", "a".repeat(62), "b".repeat(62));
        assert_eq!(longest.len(), 125);
        let rule = Rule::Fence(ScopeMatch::Cgroup(cgroup(&longest, 7)));
        let d = dumped_rule(&rule).unwrap();
        assert_eq!(decode_rule(&d.exprs, d.userdata.as_deref()), Some(rule));
        // One byte more is refused where the policy is read: its comment would not fit.
        assert!(format!("{longest}c").parse::<CgroupPath>().is_err());
    }

    #[test]
    fn altered_scope_rules_read_as_no_rule() {
        let read = |d: &DumpedRule| decode_rule(&d.exprs, d.userdata.as_deref());
        let agent = Rule::Fence(ScopeMatch::Cgroup(cgroup("agent.slice", 0x3f)));
        let nested = Rule::Fence(ScopeMatch::Cgroup(cgroup("a.slice/b.service", 0x52)));
        let docker0 = Rule::Fence(ScopeMatch::Interface(iface("docker0")));
        let uid = Rule::Fence(ScopeMatch::Uid(1001));
        let query = Rule::AcceptGuardQuery {
            to: "198.18.0.1:53".parse().unwrap(),
            proto: L4Proto::Udp,
        };
        type DumpEdit = dyn Fn(&mut DumpedRule);
        let cases: Vec<(&str, &Rule, Box<DumpEdit>)> = vec![
            (
                "cgroup without its comment",
                &agent,
                Box::new(|d| d.userdata = None),
            ),
            (
                "cgroup with a truncated comment",
                &agent,
                Box::new(|d| {
                    if let Some(u) = &mut d.userdata {
                        u.truncate(5);
                    }
                }),
            ),
            (
                "cgroup whose comment is not as deep as its level",
                &nested,
                Box::new(|d| d.userdata = comment_userdata("b.service")),
            ),
            (
                "cgroup deeper than its path",
                &nested,
                Box::new(|d| {
                    if let LiveExpr::Socket { level, .. } = &mut d.exprs[0] {
                        *level = Some(3);
                    }
                }),
            ),
            (
                "cgroup without a level",
                &agent,
                Box::new(|d| {
                    if let LiveExpr::Socket { level, .. } = &mut d.exprs[0] {
                        *level = None;
                    }
                }),
            ),
            (
                "socket mark instead of cgroup",
                &agent,
                Box::new(|d| {
                    if let LiveExpr::Socket { key, .. } = &mut d.exprs[0] {
                        *key = 2;
                    }
                }),
            ),
            (
                "cgroup id truncated",
                &agent,
                Box::new(|d| {
                    if let LiveExpr::Cmp { data, .. } = &mut d.exprs[1] {
                        data.truncate(4);
                    }
                }),
            ),
            (
                "cgroup id compared with !=",
                &agent,
                Box::new(|d| {
                    if let LiveExpr::Cmp { op, .. } = &mut d.exprs[1] {
                        *op = libc::NFT_CMP_NEQ as u32;
                    }
                }),
            ),
            (
                "interface name cut inside its padding",
                &docker0,
                Box::new(|d| {
                    if let LiveExpr::Cmp { data, .. } = &mut d.exprs[1] {
                        data.truncate(10);
                    }
                }),
            ),
            (
                "interface name without padding beyond 15 bytes",
                &docker0,
                Box::new(|d| {
                    if let LiveExpr::Cmp { data, .. } = &mut d.exprs[1] {
                        *data = b"abcdefghijklmnop".to_vec();
                    }
                }),
            ),
            (
                "oifname instead of iifname",
                &docker0,
                Box::new(|d| {
                    if let LiveExpr::Meta { key, .. } = &mut d.exprs[0] {
                        *key = libc::NFT_META_OIFNAME as u32;
                    }
                }),
            ),
            (
                "a goto to another chain",
                &uid,
                Box::new(|d| {
                    if let Some(LiveExpr::Verdict { chain, .. }) = d.exprs.last_mut() {
                        *chain = Some("elsewhere".into());
                    }
                }),
            ),
            (
                "a jump instead of a goto",
                &uid,
                Box::new(|d| {
                    if let Some(LiveExpr::Verdict { code, .. }) = d.exprs.last_mut() {
                        *code = libc::NFT_JUMP;
                    }
                }),
            ),
            (
                "a comment on a rule that has none",
                &uid,
                Box::new(|d| d.userdata = comment_userdata("x")),
            ),
            (
                "a uid compared in 2 bytes",
                &uid,
                Box::new(|d| {
                    if let LiveExpr::Cmp { data, .. } = &mut d.exprs[1] {
                        data.truncate(2);
                    }
                }),
            ),
            (
                "a guard query without its port",
                &query,
                Box::new(|d| drop(d.exprs.drain(6..8))),
            ),
            (
                "a guard query from the address instead of to it",
                &query,
                Box::new(|d| {
                    if let LiveExpr::Payload { offset, .. } = &mut d.exprs[2] {
                        *offset = 12;
                    }
                }),
            ),
            (
                "a guard query with a limit",
                &query,
                Box::new(|d| {
                    let at = d.exprs.len() - 1;
                    d.exprs.insert(
                        at,
                        LiveExpr::Limit {
                            rate: 1,
                            unit: 1,
                            burst: 0,
                            kind: 0,
                            flags: 0,
                        },
                    );
                }),
            ),
        ];
        for (what, rule, edit) in cases {
            let mut d = dumped_rule(rule).unwrap();
            assert_eq!(read(&d), Some(rule.clone()), "{what}: unedited");
            edit(&mut d);
            assert_ne!(
                &d,
                &dumped_rule(rule).unwrap(),
                "{what}: the edit changed nothing"
            );
            assert_eq!(read(&d), None, "{what}");
        }
        // Another path in the comment is another rule (which no plan with this cgroup's id
        // wants: drift all the same).
        let mut d = dumped_rule(&agent).unwrap();
        d.userdata = comment_userdata("other.slice");
        assert_eq!(
            read(&d),
            Some(Rule::Fence(ScopeMatch::Cgroup(cgroup("other.slice", 0x3f))))
        );
        // A comment that is no cgroup path is unknown to the live reader too, and the
        // reader says what it holds.
        let mut d = dumped_rule(&agent).unwrap();
        d.userdata = comment_userdata("other\"slice");
        let live = crate::nft::live::LiveRule::decode(d);
        assert!(
            matches!(&live.rule, crate::nft::live::ReadRule::Unknown(t) if t.last().is_some_and(|l| l.contains("other"))),
            "{:?}",
            live.rule
        );
    }

    #[test]
    fn every_rule_reads_back_as_itself() {
        for rule in every_rule() {
            let dumped = dumped_rule(&rule).expect("libnftnl reads its own message");
            assert_eq!(
                decode_rule(&dumped.exprs, dumped.userdata.as_deref()),
                Some(rule.clone()),
                "{rule}"
            );
        }
        // The unspecified address of either family matches any source: it reads back as
        // 0.0.0.0, and so does the wanted rule compared with it.
        let any6 = Rule::RefuseOtherUidsFromGuardPort {
            from: "[::]:53".parse().unwrap(),
            proto: L4Proto::Udp,
            uid: 993,
        };
        let read = decode_rule(&dumped_rule(&any6).unwrap().exprs, None);
        assert_eq!(read, Some(as_read_back(&any6)));
        assert_ne!(as_read_back(&any6), any6);
        for rule in every_rule() {
            if !matches!(
                rule,
                Rule::RefuseOtherUidsFromGuardPort { .. }
                    | Rule::RefuseUnmarkedFromGuardPort { .. }
                    | Rule::RefuseGuardQueryToOtherSockets { .. }
            ) {
                assert_eq!(as_read_back(&rule), rule);
            }
        }
    }

    #[test]
    fn counters_count_without_changing_the_rule() {
        for rule in [
            Rule::CountFamily(Family::V6),
            Rule::RefuseDaddrIn(SetId::new(SetRole::Deny, Family::V4)),
        ] {
            let mut exprs = dumped_rule(&rule).unwrap().exprs;
            for e in &mut exprs {
                if let LiveExpr::Counter { packets, bytes } = e {
                    (*packets, *bytes) = (7, 560);
                }
            }
            let read = crate::nft::live::LiveRule::decode(DumpedRule {
                exprs: exprs.clone(),
                ..dumped_rule(&rule).unwrap()
            });
            assert_eq!(read.counter.map(|c| (c.packets, c.bytes)), Some((7, 560)));
            assert_eq!(decode_rule(&exprs, None), Some(rule));
        }
    }

    /// A hand edit of a dumped rule's expressions.
    type Edit = dyn Fn(&mut Vec<LiveExpr>);

    #[test]
    fn altered_or_unknown_expressions_read_as_no_rule() {
        let exprs = |rule: &Rule| dumped_rule(rule).unwrap().exprs;
        let deny4 = Rule::RefuseDaddrIn(SetId::new(SetRole::Deny, Family::V4));
        let edits: Vec<(&str, Box<Edit>)> = vec![
            // `ip daddr != @deny4 goto refused`
            (
                "inverted lookup",
                Box::new(|e| {
                    if let LiveExpr::Lookup { flags, .. } = &mut e[3] {
                        *flags = 1;
                    }
                }),
            ),
            (
                "another set",
                Box::new(|e| {
                    if let LiveExpr::Lookup { set, .. } = &mut e[3] {
                        *set = "theirs".into();
                    }
                }),
            ),
            ("a match fewer", Box::new(|e| drop(e.drain(0..2)))),
            (
                "an extra expression",
                Box::new(|e| {
                    e.insert(0, LiveExpr::Other("queue num 0".into()));
                }),
            ),
            (
                "another register",
                Box::new(|e| {
                    if let LiveExpr::Payload { dreg, .. } = &mut e[2] {
                        *dreg = sys::REG_2;
                    }
                }),
            ),
            (
                "another verdict",
                Box::new(|e| {
                    if let Some(LiveExpr::Verdict { code, chain }) = e.last_mut() {
                        (*code, *chain) = (libc::NF_ACCEPT, None);
                    }
                }),
            ),
            (
                "another chain",
                Box::new(|e| {
                    if let Some(LiveExpr::Verdict { chain, .. }) = e.last_mut() {
                        *chain = Some("elsewhere".into());
                    }
                }),
            ),
        ];
        for (what, edit) in edits {
            let mut e = exprs(&deny4);
            edit(&mut e);
            assert_ne!(e, exprs(&deny4), "{what}: the edit changed nothing");
            assert_eq!(decode_rule(&e, None), None, "{what}");
        }
        // A guard's rule whose mark compare became `!=`, or whose uid is another.
        let guard = Rule::AcceptTupleFromGuard {
            set: SetId::new(SetRole::Dns, Family::V4),
            mark: Some(0x6500_0000),
            uid: 993,
        };
        let mut e = exprs(&guard);
        if let LiveExpr::Cmp { op, .. } = &mut e[1] {
            *op = libc::NFT_CMP_NEQ as u32;
        }
        assert_eq!(decode_rule(&e, None), None);
        let mut e = exprs(&guard);
        if let LiveExpr::Cmp { data, .. } = &mut e[3] {
            *data = 0u32.to_ne_bytes().to_vec();
        }
        assert_eq!(
            decode_rule(&e, None),
            Some(Rule::AcceptTupleFromGuard {
                set: SetId::new(SetRole::Dns, Family::V4),
                mark: Some(0x6500_0000),
                uid: 0,
            })
        );
        // A log to the kernel log at another level than nft's default.
        let log = Rule::Log(LogSpec {
            prefix: "X: ".into(),
            group: None,
            rate: "3/minute".parse().unwrap(),
            burst: 5,
        });
        let mut e = exprs(&log);
        if let LiveExpr::Log { level, .. } = &mut e[1] {
            *level = Some(7);
        }
        assert_eq!(decode_rule(&e, None), None);
        assert_eq!(decode_rule(&[], None), None);
        assert_eq!(
            decode_rule(&[LiveExpr::Other("counter".into())], None),
            None
        );
    }

    /// A batch's messages with the padding after each attribute zeroed: libnftnl leaves
    /// whatever the buffer held there, and the kernel reads none of it.
    fn without_padding(mut batch: Vec<u8>) -> Vec<u8> {
        fn attrs(b: &mut [u8]) {
            let mut at = 0;
            while at + 4 <= b.len() {
                let len = usize::from(u16::from_ne_bytes([b[at], b[at + 1]]));
                let kind = u16::from_ne_bytes([b[at + 2], b[at + 3]]);
                let padded = len.next_multiple_of(4).min(b.len() - at);
                if len < 4 || at + len > b.len() {
                    return;
                }
                if kind & 0x8000 != 0 {
                    attrs(&mut b[at + 4..at + len]);
                }
                b[at + len..at + padded].fill(0);
                at += padded;
            }
        }
        let mut at = 0;
        while at + 20 <= batch.len() {
            let len = u32::from_ne_bytes(batch[at..at + 4].try_into().unwrap()) as usize;
            attrs(&mut batch[at + 20..at + len]);
            at += len.next_multiple_of(4);
        }
        batch
    }

    #[test]
    fn an_unscoped_tables_batch_is_the_one_before_scopes() {
        // The transaction as replace_table built it with its two fixed chains.
        let before = |rs: &Ruleset| {
            let table = table();
            let mut batch = Batch::new();
            batch.add(&table, MsgType::Add);
            batch.add(&table, MsgType::Del);
            batch.add(&table, MsgType::Add);
            let (output_name, refused_name) = (cstring(OUTPUT_CHAIN), cstring(REFUSED_CHAIN));
            let mut output = Chain::new(&output_name, &table);
            output.set_hook(nftnl::Hook::Out, 0);
            output.set_type(ChainType::Filter);
            output.set_policy(nftnl::Policy::Drop);
            let refused = Chain::new(&refused_name, &table);
            batch.add(&output, MsgType::Add);
            batch.add(&refused, MsgType::Add);
            for (chain, rules) in [(&output, &rs.output), (&refused, &rs.refused)] {
                for rule in rules {
                    batch.add(&nl_rule(chain, rule, &BTreeMap::new()), MsgType::Add);
                }
            }
            let batch = batch.finalize();
            without_padding(batch.iter().flatten().copied().collect())
        };
        let rs = Ruleset {
            sets: vec![],
            output: vec![Rule::AcceptEstablished, Rule::GotoRefused],
            refused: vec![Rule::CountFamily(Family::V4), Rule::Refuse(Action::Drop)],
            guard: vec![],
            scope: None,
            audit: None,
        };
        let now = replace_table(&rs);
        let now_bytes = without_padding(now.built().concat());
        assert_eq!(now_bytes, before(&rs));
        let mut other = rs.clone();
        other.refused[1] = Rule::Refuse(Action::Reject);
        assert_ne!(
            now_bytes,
            before(&other),
            "the comparison sees a rule's attributes"
        );
        assert_eq!(
            now.labels[3..5],
            ["chain output".to_string(), "chain refused".to_string()]
        );
    }

    #[test]
    fn a_scoped_table_makes_every_chain_before_any_rule() {
        let rules = |r: Rule| vec![r];
        let rs = Ruleset {
            sets: vec![],
            output: rules(Rule::GotoRefused),
            refused: rules(Rule::Refuse(Action::Drop)),
            guard: rules(Rule::GotoRefused),
            scope: Some(crate::core::ruleset::ScopeChains {
                output: rules(Rule::Fence(ScopeMatch::Uid(1001))),
                forward: rules(Rule::Fence(ScopeMatch::Interface(iface("br-*")))),
                input: rules(Rule::FromBridge(iface("br-*"))),
                from_bridge: rules(Rule::GotoRefused),
                prerouting: vec![],
            }),
            audit: None,
        };
        let enc = replace_table(&rs);
        let labels: Vec<&str> = enc.labels[3..].iter().map(String::as_str).collect();
        assert_eq!(
            labels[..7],
            [
                "chain output",
                "chain refused",
                "chain guard",
                "chain from_bridge",
                "chain scope_output",
                "chain scope_forward",
                "chain scope_input"
            ]
        );
        assert!(labels[7..].iter().all(|l| l.starts_with("rule 1 of chain")));
        assert_eq!(labels.len(), 14);
    }

    #[test]
    fn labels_follow_the_messages() {
        let rs = Ruleset {
            sets: vec![],
            output: vec![Rule::GotoRefused],
            refused: vec![],
            guard: vec![],
            scope: None,
            audit: None,
        };
        let enc = replace_table(&rs);
        let seqs = enc.sequence_numbers();
        // The last message is our rule, whether or not BEGIN/END are acknowledged.
        let last_ours = if seqs.len() == enc.labels.len() + 2 {
            seqs.end - 2
        } else {
            seqs.end - 1
        };
        assert!(enc.label(last_ours).starts_with("rule 1 of chain output"));
    }

    /// A comment is written only when the kernel keeps it: up to 251 characters (254 bytes of
    /// user data); a longer name gets none rather than one the kernel refuses or drops.
    #[test]
    fn element_comments_stop_where_the_kernel_keeps_them() {
        let name = |len: usize| "a".repeat(len);
        let kept = comment_userdata(&name(251)).expect("kept");
        assert_eq!(kept.len(), MAX_ELEM_USERDATA);
        assert_eq!(comment_of(&kept), Some(name(251)));
        for len in [252, 253, 254, 300] {
            assert_eq!(comment_userdata(&name(len)), None, "{len}");
        }
    }

    /// `count` resolved IPv4 elements on tcp/443, from 198.18.0.0, each with a timeout and, if
    /// `named`, its name as its comment.
    fn resolved(count: u32, named: bool) -> Vec<Timed> {
        (0..count)
            .map(|i| Timed {
                tuple: Tuple {
                    net: IpNet::from(IpAddr::from((0xc612_0000u32 + i).to_be_bytes())),
                    proto: L4Proto::Tcp,
                    ports: crate::core::policy::PortRange::single(443),
                },
                timeout_ms: Some(60_000),
                expires_ms: None,
                name: named.then(|| format!("n{i}.example")),
            })
            .collect()
    }

    /// The upsert as libnftnl builds it (what `upsert_resolved` built before it was written
    /// with the netlink codec).
    fn libnftnl_upsert(elements: &[Timed]) -> Encoded {
        let mut b = Builder::new();
        for family in Family::BOTH {
            let id = SetId::new(SetRole::Resolved, family);
            let of_family = elements
                .iter()
                .filter(|t| Family::of_net(&t.tuple.net) == family)
                .map(|t| timed_elem(id, t));
            add_elements(&mut b, id, 0, of_family, ElemOp::Upsert);
        }
        b.finish()
    }

    /// Each message of a batch as sent: (type, asks for an acknowledgement, sequence number).
    fn sent_messages(enc: &Encoded) -> Vec<(u16, bool, u32)> {
        let mut out = Vec::new();
        for page in &enc.pages() {
            let mut at = 0;
            while at + 16 <= page.len() {
                let field =
                    |o: usize| u32::from_ne_bytes(page[at + o..at + o + 4].try_into().unwrap());
                let kind = u16::from_ne_bytes([page[at + 4], page[at + 5]]);
                let flag = u16::from_ne_bytes([page[at + 6], page[at + 7]]);
                out.push((kind, flag & NLM_F_ACK != 0, field(8)));
                at += (field(0) as usize).div_ceil(4) * 4;
            }
        }
        out
    }

    /// BEGIN and END go out asking for no acknowledgement, every change asks for one, and the
    /// sequence numbers awaited are exactly the changes': for the upserts written here, and
    /// for libnftnl's batches (a large one spans pages).
    #[test]
    fn only_the_changes_ask_for_acknowledgements() {
        let elements = resolved(20_000, false);
        let large_by_libnftnl = libnftnl_upsert(&elements);
        assert!(large_by_libnftnl.pages().len() > 1, "one page only");
        for enc in [
            upsert_resolved(&elements[..1]).unwrap(),
            upsert_resolved(&elements).unwrap(),
            libnftnl_upsert(&elements[..1]),
            large_by_libnftnl,
        ] {
            let sent = sent_messages(&enc);
            let (first, rest) = sent.split_first().expect("messages");
            let (last, changes) = rest.split_last().expect("messages");
            assert_eq!((first.0, first.1), (NFNL_MSG_BATCH_BEGIN, false));
            assert_eq!((last.0, last.1), (NFNL_MSG_BATCH_END, false));
            assert_eq!(changes.len(), enc.labels.len());
            assert!(changes.iter().all(|(_, ack, _)| *ack), "{changes:?}");
            let seqs: Vec<u32> = changes.iter().map(|(_, _, seq)| *seq).collect();
            assert_eq!(seqs, enc.change_seqs().collect::<Vec<_>>());
            assert!(enc.sequence_numbers().contains(&first.2) || first.2 == 0);
            // What was built is left as it was; only the copies sent differ.
            assert_eq!(
                enc.pages().iter().map(|p| p.len()).sum::<usize>(),
                enc.built().iter().map(|p| p.len()).sum::<usize>()
            );
        }
    }

    /// The upsert written with the netlink codec is the one libnftnl writes, byte for byte but
    /// the sequence numbers (libnftnl's depend on the running kernel) and the padding (ours is
    /// zeros, libnftnl's what its buffer held): one element, both
    /// families with and without comments, no timeout, and a batch of several messages.
    #[test]
    fn the_written_upsert_is_libnftnls_byte_for_byte() {
        let zero_seqs = |mut bytes: Vec<u8>| {
            let mut at = 0;
            while at + 16 <= bytes.len() {
                let len = u32::from_ne_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
                bytes[at + 8..at + 12].fill(0);
                at += len.div_ceil(4) * 4;
            }
            bytes
        };
        let v6 = |i: u16, named: bool| Timed {
            tuple: Tuple {
                net: IpNet::from(IpAddr::from([0x2001, 0xdb8, 0, 0, 0, 0, 0, i])),
                proto: L4Proto::Udp,
                ports: crate::core::policy::PortRange::single(8443),
            },
            timeout_ms: Some(3_600_000),
            expires_ms: None,
            name: named.then(|| "v6.example".to_string()),
        };
        let mut mixed = resolved(3, true);
        mixed.extend([v6(1, true), v6(2, false)]);
        mixed.extend(resolved(2, false));
        let mut untimed = resolved(2, true);
        for t in &mut untimed {
            t.timeout_ms = None;
        }
        // As many as one message holds (some 900): libnftnl's is split where our own
        // chunks of `ELEMS_PER_CHUNK` end, ours only where the 16-bit length needs it.
        let full = resolved(900, true);
        for elements in [&resolved(1, true)[..], &mixed, &untimed, &full] {
            let ours = upsert_resolved(elements).unwrap();
            let theirs = libnftnl_upsert(elements);
            // libnftnl leaves whatever its buffer held in the padding.
            assert_eq!(
                zero_seqs(ours.pages().concat()),
                zero_seqs(without_padding(theirs.pages().concat())),
                "{} elements",
                elements.len()
            );
            assert_eq!(ours.labels, theirs.labels);
        }
    }

    /// An element message as the kernel dumps it, for libnftnl's parser: each entry of the
    /// list typed NFTA_LIST_ELEM. libnftnl (and so the upsert) numbers them instead, which the
    /// kernel does not read.
    fn as_dumped(message: &[u8]) -> Vec<u8> {
        let mut out = message.to_vec();
        let field = |b: &[u8], at: usize| u16::from_ne_bytes([b[at], b[at + 1]]);
        let mut at = 20;
        while at + 4 <= out.len() {
            let len = usize::from(field(&out, at));
            if field(&out, at + 2) & !crate::netlink::attr::NLA_F_NESTED
                == NFTA_SET_ELEM_LIST_ELEMENTS
            {
                let mut entry = at + 4;
                while entry + 4 <= at + len {
                    let kind = 1 | crate::netlink::attr::NLA_F_NESTED;
                    out[entry + 2..entry + 4].copy_from_slice(&kind.to_ne_bytes());
                    entry += usize::from(field(&out, entry)).div_ceil(4) * 4;
                }
            }
            at += len.div_ceil(4) * 4;
        }
        out
    }

    /// A batch too large for one message is split where the list of elements would outgrow
    /// its 16-bit length, and libnftnl's parser reads every element back, in order.
    #[test]
    fn a_large_upsert_is_split_into_messages_libnftnl_reads_back() {
        let elements = resolved(20_000, true);
        let enc = upsert_resolved(&elements).unwrap();
        let bytes = enc.pages().concat();
        let mut messages = Vec::new();
        let mut at = 0;
        while at + 16 <= bytes.len() {
            let len = u32::from_ne_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
            messages.push(&bytes[at..at + len]);
            at += len.div_ceil(4) * 4;
        }
        assert_eq!(at, bytes.len());
        let changes = &messages[1..messages.len() - 1];
        assert_eq!(changes.len(), enc.labels.len());
        assert!(changes.len() >= 20, "{} messages", changes.len());
        let mut read = Vec::new();
        for (n, message) in changes.iter().enumerate() {
            // Full but for the last: another element would not have fitted.
            if n + 1 < changes.len() {
                assert!(
                    message.len() > 65_535 - 100,
                    "message {n}: {}",
                    message.len()
                );
            }
            read.extend(sys::parse_elems(&as_dumped(message)).expect("libnftnl parses it"));
        }
        assert_eq!(read.len(), elements.len());
        for (live, sent) in read.iter().zip(&elements) {
            let want = timed_elem(SetId::new(SetRole::Resolved, Family::V4), sent);
            assert_eq!(live.key, want.key);
            assert_eq!(live.timeout_ms, Some(60_000));
            assert_eq!(live.userdata, want.userdata);
            assert!(live.key_end.is_none() && live.flags == 0 && live.unread.is_empty());
        }
    }
}
