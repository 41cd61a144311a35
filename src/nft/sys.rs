//! What the `nftnl` crate (0.9) lacks, filled in over `nftnl-sys`: expressions with chosen
//! registers (payload, meta, lookup, byteorder), log, limit, `socket cgroupv2 level N`
//! (whose level attribute the bindings lack), `socket mark` and `fib`; sets with flags, concatenated
//! keys and elements that carry key ends, flags and timeouts; element messages with and without
//! NLM_F_EXCL; and parsing of dumped sets, elements, chains and rules (with their user data,
//! where nft keeps a rule's comment).
//!
//! This is the only module with `unsafe`. Every object here owns its libnftnl allocation and
//! frees it on drop; every pointer handed to libnftnl is valid for the duration of the call.

use std::cell::Cell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::ptr::NonNull;

use nftnl::expr::Expression;
use nftnl::nftnl_sys as sys;
use nftnl::{MsgType, NlMsg, Rule};

/// libc's `NFT_SET_CONCAT` (0x80), absent from the libc crate: the key is a concatenation
/// whose field lengths are given in `NFTNL_SET_DESC_CONCAT`.
pub const NFT_SET_CONCAT: u32 = 0x80;
pub const NFT_SET_INTERVAL: u32 = libc::NFT_SET_INTERVAL as u32;
pub const NFT_SET_TIMEOUT: u32 = libc::NFT_SET_TIMEOUT as u32;
pub const NFT_SET_ELEM_INTERVAL_END: u32 = libc::NFT_SET_ELEM_INTERVAL_END as u32;
/// The exthdr expression's flag "only say whether the header is there" (absent from libc).
pub const NFT_EXTHDR_F_PRESENT: u32 = 1;
/// The exthdr expression's operation on IPv6 extension headers (absent from libc).
pub const NFT_EXTHDR_OP_IPV6: u32 = 0;
/// The socket expression's key "the id of the socket's cgroup v2 ancestor at a level"
/// (`NFT_SOCKET_CGROUPV2`, absent from libc).
pub const NFT_SOCKET_CGROUPV2: u32 = 3;
/// The socket expression's key "the socket's mark" (`NFT_SOCKET_MARK`, absent from libc).
pub const NFT_SOCKET_MARK: u32 = 1;
/// The fib expression's result "the output interface" (`NFT_FIB_RESULT_OIF`, absent from
/// libc).
pub const NFT_FIB_RESULT_OIF: u32 = 1;
/// The fib expression's result "the address's type" (`NFT_FIB_RESULT_ADDRTYPE`, absent from
/// libc): an `RTN_*` value.
pub const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
/// `RTN_LOCAL`: an address of this host.
pub const RTN_LOCAL: u32 = 2;
/// `RTN_BROADCAST`: a broadcast address (0.0.0.0 and 255.255.255.255 among them).
pub const RTN_BROADCAST: u32 = 3;
/// The fib expression's flags (`NFTA_FIB_F_*`, absent from libc): look up the source
/// address, restricted to the input interface, and say only whether a route was found.
pub const NFTA_FIB_F_SADDR: u32 = 1 << 0;
pub const NFTA_FIB_F_IIF: u32 = 1 << 3;
pub const NFTA_FIB_F_PRESENT: u32 = 1 << 5;
/// libnftnl's `NFTNL_EXPR_SOCKET_LEVEL` (libnftnl 1.2.4 has it; the bindings of nftnl-sys
/// for it do not).
const NFTNL_EXPR_SOCKET_LEVEL: u32 = sys::NFTNL_EXPR_SOCKET_DREG + 1;

/// Registers as nft numbers them: the four 128-bit registers and the 32-bit ones from 8.
pub const REG_1: u32 = libc::NFT_REG_1 as u32;
pub const REG_2: u32 = libc::NFT_REG_2 as u32;
pub const fn reg32(n: u32) -> u32 {
    libc::NFT_REG32_00 as u32 + n
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadBase {
    LinkLayer,
    Network,
    Transport,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Attr {
    U8(u8),
    U16(u16),
    U32(u32),
    U64(u64),
    Str(CString),
    Data(Vec<u8>),
}

/// An expression named by its libnftnl type and a list of attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expr {
    name: &'static CStr,
    attrs: Vec<(u32, Attr)>,
}

impl Expr {
    /// Loads `len` bytes at `offset` of a header into register `dreg`.
    pub fn payload(base: PayloadBase, offset: u32, len: u32, dreg: u32) -> Expr {
        let base = match base {
            PayloadBase::LinkLayer => libc::NFT_PAYLOAD_LL_HEADER,
            PayloadBase::Network => libc::NFT_PAYLOAD_NETWORK_HEADER,
            PayloadBase::Transport => libc::NFT_PAYLOAD_TRANSPORT_HEADER,
        } as u32;
        Expr {
            name: c"payload",
            attrs: vec![
                (sys::NFTNL_EXPR_PAYLOAD_DREG, Attr::U32(dreg)),
                (sys::NFTNL_EXPR_PAYLOAD_BASE, Attr::U32(base)),
                (sys::NFTNL_EXPR_PAYLOAD_OFFSET, Attr::U32(offset)),
                (sys::NFTNL_EXPR_PAYLOAD_LEN, Attr::U32(len)),
            ],
        }
    }

    /// Compares register 1 with `data` (`op` is one of `libc::NFT_CMP_*`).
    pub fn cmp(op: c_int, data: &[u8]) -> Expr {
        Expr {
            name: c"cmp",
            attrs: vec![
                (sys::NFTNL_EXPR_CMP_SREG, Attr::U32(REG_1)),
                (sys::NFTNL_EXPR_CMP_OP, Attr::U32(op as u32)),
                (sys::NFTNL_EXPR_CMP_DATA, Attr::Data(data.to_vec())),
            ],
        }
    }

    /// Loads conntrack key `key` (`libc::NFT_CT_*`) of the packet's flow into register `dreg`.
    pub fn ct(key: c_int, dreg: u32) -> Expr {
        Expr {
            name: c"ct",
            attrs: vec![
                (sys::NFTNL_EXPR_CT_KEY, Attr::U32(key as u32)),
                (sys::NFTNL_EXPR_CT_DREG, Attr::U32(dreg)),
            ],
        }
    }

    /// Loads meta key `key` (`libc::NFT_META_*`) into register `dreg`.
    pub fn meta(key: c_int, dreg: u32) -> Expr {
        Expr {
            name: c"meta",
            attrs: vec![
                (sys::NFTNL_EXPR_META_KEY, Attr::U32(key as u32)),
                (sys::NFTNL_EXPR_META_DREG, Attr::U32(dreg)),
            ],
        }
    }

    /// Looks up the key starting at register `sreg` in the named set.
    pub fn lookup(set: &CStr, set_id: u32, sreg: u32) -> Expr {
        Expr {
            name: c"lookup",
            attrs: vec![
                (sys::NFTNL_EXPR_LOOKUP_SREG, Attr::U32(sreg)),
                (sys::NFTNL_EXPR_LOOKUP_SET, Attr::Str(set.to_owned())),
                (sys::NFTNL_EXPR_LOOKUP_SET_ID, Attr::U32(set_id)),
            ],
        }
    }

    /// Converts `len` bytes of register `reg` in `size`-byte units to network byte order.
    /// nft emits this for host-order fields of concatenated interval keys; we mirror it so
    /// that `nft list` reads our rules back exactly as it reads its own.
    pub fn hton(reg: u32, size: u32, len: u32) -> Expr {
        Expr {
            name: c"byteorder",
            attrs: vec![
                (sys::NFTNL_EXPR_BYTEORDER_SREG, Attr::U32(reg)),
                (sys::NFTNL_EXPR_BYTEORDER_DREG, Attr::U32(reg)),
                (
                    sys::NFTNL_EXPR_BYTEORDER_OP,
                    Attr::U32(libc::NFT_BYTEORDER_HTON as u32),
                ),
                (sys::NFTNL_EXPR_BYTEORDER_LEN, Attr::U32(len)),
                (sys::NFTNL_EXPR_BYTEORDER_SIZE, Attr::U32(size)),
            ],
        }
    }

    /// Logs the packet with `prefix`, to NFLOG group `group` or, without one, the kernel log.
    /// The prefix must not contain NUL (the policy validates that).
    pub fn log(prefix: &CStr, group: Option<u16>) -> Expr {
        let mut attrs = vec![(sys::NFTNL_EXPR_LOG_PREFIX, Attr::Str(prefix.to_owned()))];
        if let Some(group) = group {
            attrs.push((sys::NFTNL_EXPR_LOG_GROUP, Attr::U16(group)));
        }
        Expr {
            name: c"log",
            attrs,
        }
    }

    /// Matches while fewer than `rate` packets per `unit_seconds` passed (plus `burst`).
    pub fn limit_packets(rate: u64, unit_seconds: u64, burst: u32) -> Expr {
        Expr::limit(libc::NFT_LIMIT_PKTS, rate, unit_seconds, burst)
    }

    /// Matches while fewer than `rate` bytes per `unit_seconds` passed (plus `burst` bytes):
    /// packets are counted by their length, so the limit bounds what a channel carries.
    pub fn limit_bytes(rate: u64, unit_seconds: u64, burst: u32) -> Expr {
        Expr::limit(libc::NFT_LIMIT_PKT_BYTES, rate, unit_seconds, burst)
    }

    fn limit(kind: c_int, rate: u64, unit_seconds: u64, burst: u32) -> Expr {
        Expr {
            name: c"limit",
            attrs: vec![
                (sys::NFTNL_EXPR_LIMIT_RATE, Attr::U64(rate)),
                (sys::NFTNL_EXPR_LIMIT_UNIT, Attr::U64(unit_seconds)),
                (sys::NFTNL_EXPR_LIMIT_BURST, Attr::U32(burst)),
                (sys::NFTNL_EXPR_LIMIT_TYPE, Attr::U32(kind as u32)),
                (sys::NFTNL_EXPR_LIMIT_FLAGS, Attr::U32(0)),
            ],
        }
    }

    /// Loads the id (inode number) of the socket's cgroup v2 ancestor `level` below the root
    /// into register `dreg` (8 bytes): `socket cgroupv2 level N`. A packet without a socket,
    /// or whose cgroup is less deep, matches nothing.
    pub fn socket_cgroupv2(level: u32, dreg: u32) -> Expr {
        Expr {
            name: c"socket",
            attrs: vec![
                (sys::NFTNL_EXPR_SOCKET_KEY, Attr::U32(NFT_SOCKET_CGROUPV2)),
                (sys::NFTNL_EXPR_SOCKET_DREG, Attr::U32(dreg)),
                (NFTNL_EXPR_SOCKET_LEVEL, Attr::U32(level)),
            ],
        }
    }

    /// Loads the mark of the socket the packet is for (found as the stack would find it)
    /// into register `dreg`: `socket mark`. A packet no full socket gets (none, or a
    /// request or time-wait socket) matches nothing.
    pub fn socket_mark(dreg: u32) -> Expr {
        Expr {
            name: c"socket",
            attrs: vec![
                (sys::NFTNL_EXPR_SOCKET_KEY, Attr::U32(NFT_SOCKET_MARK)),
                (sys::NFTNL_EXPR_SOCKET_DREG, Attr::U32(dreg)),
            ],
        }
    }

    /// Puts into register `dreg` (4 bytes) whether a route back to the packet's source
    /// leaves by the interface it came in on (non-zero) or not (0): `fib saddr . iif oif`
    /// with `present`/`missing`.
    pub fn fib_saddr_iif_present(dreg: u32) -> Expr {
        Expr {
            name: c"fib",
            attrs: vec![
                (sys::NFTNL_EXPR_FIB_DREG, Attr::U32(dreg)),
                (sys::NFTNL_EXPR_FIB_RESULT, Attr::U32(NFT_FIB_RESULT_OIF)),
                (
                    sys::NFTNL_EXPR_FIB_FLAGS,
                    Attr::U32(NFTA_FIB_F_SADDR | NFTA_FIB_F_IIF | NFTA_FIB_F_PRESENT),
                ),
            ],
        }
    }

    /// Puts into register `dreg` (4 bytes) the type of the packet's source address in the
    /// routing tables (`RTN_LOCAL` for an address of this host): `fib saddr type`.
    pub fn fib_saddr_type(dreg: u32) -> Expr {
        Expr {
            name: c"fib",
            attrs: vec![
                (sys::NFTNL_EXPR_FIB_DREG, Attr::U32(dreg)),
                (
                    sys::NFTNL_EXPR_FIB_RESULT,
                    Attr::U32(NFT_FIB_RESULT_ADDRTYPE),
                ),
                (sys::NFTNL_EXPR_FIB_FLAGS, Attr::U32(NFTA_FIB_F_SADDR)),
            ],
        }
    }

    /// Puts 1 into register `dreg` if the packet carries an IPv6 extension header of type
    /// `header` (wherever it sits in the chain of headers), 0 otherwise: `exthdr rt exists`.
    pub fn exthdr_ipv6_present(header: u8, dreg: u32) -> Expr {
        Expr::exthdr_present(NFT_EXTHDR_OP_IPV6, header, dreg)
    }

    fn exthdr_present(op: u32, header: u8, dreg: u32) -> Expr {
        Expr {
            name: c"exthdr",
            attrs: vec![
                (sys::NFTNL_EXPR_EXTHDR_DREG, Attr::U32(dreg)),
                (sys::NFTNL_EXPR_EXTHDR_TYPE, Attr::U8(header)),
                (sys::NFTNL_EXPR_EXTHDR_OFFSET, Attr::U32(0)),
                (sys::NFTNL_EXPR_EXTHDR_LEN, Attr::U32(1)),
                (
                    sys::NFTNL_EXPR_EXTHDR_FLAGS,
                    Attr::U32(NFT_EXTHDR_F_PRESENT),
                ),
                (sys::NFTNL_EXPR_EXTHDR_OP, Attr::U32(op)),
            ],
        }
    }
}

impl Expression for Expr {
    fn to_expr(&self, _rule: &Rule) -> NonNull<sys::nftnl_expr> {
        // SAFETY: `name` is a NUL-terminated static string; a NULL result (allocation failure)
        // is turned into an abort below, as the nftnl crate does for its own expressions.
        let expr = unsafe { sys::nftnl_expr_alloc(self.name.as_ptr()) };
        let Some(expr) = NonNull::new(expr) else {
            std::process::abort();
        };
        for (attr, value) in &self.attrs {
            let attr = *attr as u16;
            // SAFETY: `expr` is a live expression of the type whose attributes we set; string
            // attributes are copied by libnftnl before `value` goes away.
            unsafe {
                match value {
                    Attr::U8(v) => sys::nftnl_expr_set_u8(expr.as_ptr(), attr, *v),
                    Attr::U16(v) => sys::nftnl_expr_set_u16(expr.as_ptr(), attr, *v),
                    Attr::U32(v) => sys::nftnl_expr_set_u32(expr.as_ptr(), attr, *v),
                    Attr::U64(v) => sys::nftnl_expr_set_u64(expr.as_ptr(), attr, *v),
                    Attr::Str(s) => {
                        sys::nftnl_expr_set_str(expr.as_ptr(), attr, s.as_ptr());
                    }
                    Attr::Data(d) => {
                        sys::nftnl_expr_set(
                            expr.as_ptr(),
                            attr,
                            d.as_ptr().cast::<c_void>(),
                            d.len() as u32,
                        );
                    }
                }
            }
        }
        expr
    }
}

/// The key of a set as the kernel sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpec {
    /// nft's datatype id; for concatenations `(t1 << 6 | t2) << 6 | t3`.
    pub datatype: u32,
    /// Total key length in bytes, each field padded to 4.
    pub len: u32,
    /// Field lengths of a concatenation (unpadded); empty for a single field.
    pub concat_fields: Vec<u8>,
}

/// How element messages treat existing elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemOp {
    /// Add; an existing element is an error (EEXIST). Used for a fresh table.
    Create,
    /// Add or refresh: an existing element is kept and its timeout refreshed.
    Upsert,
    Delete,
}

/// One set element: a key, the inclusive end of its interval, flags and a timeout.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Elem {
    pub key: Vec<u8>,
    pub key_end: Option<Vec<u8>>,
    pub flags: u32,
    /// The element expires this long from now; sending it again restarts the count.
    pub timeout_ms: Option<u64>,
    /// The element's user data (nft's comment TLVs), stored with it by the kernel.
    pub userdata: Option<Vec<u8>>,
}

/// A named set of table `table` (family inet) with its elements.
pub struct NlSet {
    set: NonNull<sys::nftnl_set>,
    elements: usize,
}

impl NlSet {
    /// `id` names the set within one batch (so rules can refer to a set created in the same
    /// transaction); 0 for a set that exists already.
    pub fn new(table: &CStr, name: &CStr, id: u32, key: &KeySpec, flags: u32) -> NlSet {
        // SAFETY: allocation failure aborts; all strings are copied by libnftnl.
        let set = unsafe { sys::nftnl_set_alloc() };
        let Some(set) = NonNull::new(set) else {
            std::process::abort();
        };
        let s = set.as_ptr();
        // SAFETY: `s` is a live set; attribute types match libnftnl's (u32 or string, and a
        // u8 array for the concatenation's field lengths, which libnftnl copies).
        unsafe {
            sys::nftnl_set_set_u32(s, sys::NFTNL_SET_FAMILY as u16, libc::NFPROTO_INET as u32);
            sys::nftnl_set_set_str(s, sys::NFTNL_SET_TABLE as u16, table.as_ptr());
            sys::nftnl_set_set_str(s, sys::NFTNL_SET_NAME as u16, name.as_ptr());
            // Id 0: a set that exists already, found by name.
            if id != 0 {
                sys::nftnl_set_set_u32(s, sys::NFTNL_SET_ID as u16, id);
            }
            sys::nftnl_set_set_u32(s, sys::NFTNL_SET_FLAGS as u16, flags);
            sys::nftnl_set_set_u32(s, sys::NFTNL_SET_KEY_TYPE as u16, key.datatype);
            sys::nftnl_set_set_u32(s, sys::NFTNL_SET_KEY_LEN as u16, key.len);
            if !key.concat_fields.is_empty() {
                sys::nftnl_set_set_data(
                    s,
                    sys::NFTNL_SET_DESC_CONCAT as u16,
                    key.concat_fields.as_ptr().cast::<c_void>(),
                    key.concat_fields.len() as u32,
                );
            }
        }
        NlSet { set, elements: 0 }
    }

    pub fn push(&mut self, elem: &Elem) {
        // SAFETY: allocation failure aborts; key data is copied into the element; the
        // element's ownership passes to the set with `nftnl_set_elem_add`.
        unsafe {
            let e = sys::nftnl_set_elem_alloc();
            if e.is_null() {
                std::process::abort();
            }
            set_elem_data(e, sys::NFTNL_SET_ELEM_KEY, &elem.key);
            if let Some(end) = &elem.key_end {
                set_elem_data(e, sys::NFTNL_SET_ELEM_KEY_END, end);
            }
            if elem.flags != 0 {
                sys::nftnl_set_elem_set_u32(e, sys::NFTNL_SET_ELEM_FLAGS as u16, elem.flags);
            }
            if let Some(ms) = elem.timeout_ms {
                // The kernel restarts an existing element's expiry only when given one
                // explicitly (re-adding the same timeout alone leaves it running).
                sys::nftnl_set_elem_set_u64(e, sys::NFTNL_SET_ELEM_TIMEOUT as u16, ms);
                sys::nftnl_set_elem_set_u64(e, sys::NFTNL_SET_ELEM_EXPIRATION as u16, ms);
            }
            if let Some(udata) = &elem.userdata {
                set_elem_data(e, sys::NFTNL_SET_ELEM_USERDATA, udata);
            }
            sys::nftnl_set_elem_add(self.set.as_ptr(), e);
        }
        self.elements += 1;
    }

    pub fn len(&self) -> usize {
        self.elements
    }

    pub fn is_empty(&self) -> bool {
        self.elements == 0
    }

    /// Appends the messages carrying the elements to `batch` (as many as the 64 KiB netlink
    /// attribute limit needs) and returns how many messages that took.
    pub fn add_elements_to(&self, batch: &mut nftnl::Batch, op: ElemOp) -> usize {
        if self.is_empty() {
            return 0;
        }
        // SAFETY: the iterator borrows the set, which outlives it (dropped at the end of this
        // function, before `self` can be).
        let iter = unsafe { sys::nftnl_set_elems_iter_create(self.set.as_ptr()) };
        let Some(iter) = NonNull::new(iter) else {
            std::process::abort();
        };
        let mut messages = 0;
        loop {
            let chunk = ElemChunk {
                set: std::marker::PhantomData,
                iter,
                op,
                more: Cell::new(0),
            };
            batch.add(&chunk, MsgType::Add);
            messages += 1;
            if chunk.more.get() <= 0 {
                break;
            }
        }
        // SAFETY: created above and not used after this.
        unsafe { sys::nftnl_set_elems_iter_destroy(iter.as_ptr()) };
        messages
    }

    #[cfg(test)]
    fn get_u32(&self, attr: u32) -> u32 {
        // SAFETY: reading an attribute of a live set.
        unsafe { sys::nftnl_set_get_u32(self.set.as_ptr(), attr as u16) }
    }
}

/// # Safety
/// `e` must be a live set element.
unsafe fn set_elem_data(e: *mut sys::nftnl_set_elem, attr: u32, data: &[u8]) {
    // SAFETY: per the caller; libnftnl copies `data`.
    unsafe {
        sys::nftnl_set_elem_set(
            e,
            attr as u16,
            data.as_ptr().cast::<c_void>(),
            data.len() as u32,
        );
    }
}

impl Drop for NlSet {
    fn drop(&mut self) {
        // SAFETY: we own the set and its elements.
        unsafe { sys::nftnl_set_free(self.set.as_ptr()) };
    }
}

// SAFETY: writes one NEWSET or DELSET message, which libnftnl bounds by the set's attributes,
// far below nft_nlmsg_maxsize.
unsafe impl NlMsg for NlSet {
    unsafe fn write(&self, buf: *mut c_void, seq: u32, msg_type: MsgType) {
        let (kind, flags) = match msg_type {
            MsgType::Add => (libc::NFT_MSG_NEWSET, libc::NLM_F_CREATE | libc::NLM_F_ACK),
            MsgType::Del => (libc::NFT_MSG_DELSET, libc::NLM_F_ACK),
        };
        // SAFETY: the batch hands us a buffer of nft_nlmsg_maxsize bytes.
        unsafe {
            let nlh = inet_header(buf, kind, flags, seq);
            sys::nftnl_set_nlmsg_build_payload(nlh, self.set.as_ptr());
        }
    }
}

/// Writes the header of an nf_tables message for family inet.
///
/// # Safety
/// `buf` must have room for nft_nlmsg_maxsize bytes.
unsafe fn inet_header(
    buf: *mut c_void,
    kind: c_int,
    flags: c_int,
    seq: u32,
) -> *mut libc::nlmsghdr {
    // SAFETY: per the caller.
    unsafe {
        sys::nftnl_nlmsg_build_hdr(
            buf.cast::<c_char>(),
            kind as u16,
            libc::NFPROTO_INET as u16,
            flags as u16,
            seq,
        )
    }
}

struct ElemChunk<'a> {
    /// The iterator walks this set's elements, so the set must outlive the chunk.
    set: std::marker::PhantomData<&'a NlSet>,
    iter: NonNull<sys::nftnl_set_elems_iter>,
    op: ElemOp,
    /// libnftnl's answer: 1 when elements remain for another message.
    more: Cell<c_int>,
}

// SAFETY: libnftnl stops filling the message before its element nest outgrows 64 KiB, inside
// the nft_nlmsg_maxsize buffer the batch provides.
unsafe impl NlMsg for ElemChunk<'_> {
    unsafe fn write(&self, buf: *mut c_void, seq: u32, _: MsgType) {
        let (kind, flags) = match self.op {
            ElemOp::Create => (
                libc::NFT_MSG_NEWSETELEM,
                libc::NLM_F_CREATE | libc::NLM_F_EXCL | libc::NLM_F_ACK,
            ),
            ElemOp::Upsert => (
                libc::NFT_MSG_NEWSETELEM,
                libc::NLM_F_CREATE | libc::NLM_F_ACK,
            ),
            ElemOp::Delete => (libc::NFT_MSG_DELSETELEM, libc::NLM_F_ACK),
        };
        // SAFETY: buffer as above; the iterator is live and belongs to the borrowed set.
        unsafe {
            let nlh = inet_header(buf, kind, flags, seq);
            self.more.set(sys::nftnl_set_elems_nlmsg_build_payload_iter(
                nlh,
                self.iter.as_ptr(),
            ));
        }
    }
}

/// The socket's descriptor, borrowed for nix's safe socket calls.
pub fn socket_fd(socket: &mnl::Socket) -> std::os::fd::BorrowedFd<'_> {
    use std::os::fd::AsRawFd;
    // SAFETY: the mnl socket owns this descriptor and keeps it open for as long as the
    // borrow (tied to `socket`) lasts.
    unsafe { std::os::fd::BorrowedFd::borrow_raw(socket.as_raw_fd()) }
}

/// Makes the kernel's error replies carry only the failing message's header, not the whole
/// message: a refused batch of large element messages would otherwise overflow the socket
/// with copies of them, and the acknowledgements behind them would be lost.
pub fn cap_acks(socket: &mnl::Socket) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    const NETLINK_CAP_ACK: c_int = 10;
    let on: c_int = 1;
    // SAFETY: a plain int option on a live socket descriptor; the pointer and length describe
    // `on`, which outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_NETLINK,
            NETLINK_CAP_ACK,
            (&on as *const c_int).cast::<c_void>(),
            std::mem::size_of::<c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Opens a socket of `family` and `kind` with protocol 0, for families nix does not name
/// (`AF_XDP`); the probe opens and closes such sockets only to learn whether it may.
pub fn open_socket(family: c_int, kind: c_int) -> Result<std::os::fd::OwnedFd, nix::errno::Errno> {
    use std::os::fd::FromRawFd;
    // SAFETY: socket(2) takes plain integers and returns a new descriptor or -1.
    let fd = unsafe { libc::socket(family, kind | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(nix::errno::Errno::last());
    }
    // SAFETY: `fd` was just returned by socket(2); nothing else owns it.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Registers the change monitor with the tokio reactor of the current runtime.
pub fn async_monitor(
    monitor: super::monitor::Monitor,
) -> std::io::Result<tokio::io::unix::AsyncFd<super::monitor::Monitor>> {
    // SAFETY: the monitor owns its netlink socket (closed when the monitor drops), and the
    // AsyncFd owns the monitor, so the descriptor stays open and unshared for as long as it
    // is registered.
    unsafe { tokio::io::unix::AsyncFd::register(monitor) }.map_err(std::io::Error::from)
}

// ---- reading back -------------------------------------------------------------------------

/// What a dump request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dump {
    Tables,
    Chains,
    Sets,
    Rules,
    /// The elements of one set (name given to [`dump_request`]).
    Elements,
    /// Stateful objects: named counters, quotas, limits, ct helpers and the like.
    Objects,
    Flowtables,
}

/// `NFT_MSG_GETFLOWTABLE`, absent from the libc crate.
const NFT_MSG_GETFLOWTABLE: c_int = 23;

/// A dump request for the objects of `table` (family inet).
pub fn dump_request(kind: Dump, table: &CStr, set: Option<&CStr>, seq: u32) -> Vec<u8> {
    let mut buf = vec![0u8; nftnl::nft_nlmsg_maxsize() as usize];
    let msg_type = match kind {
        Dump::Tables => libc::NFT_MSG_GETTABLE,
        Dump::Chains => libc::NFT_MSG_GETCHAIN,
        Dump::Sets => libc::NFT_MSG_GETSET,
        Dump::Rules => libc::NFT_MSG_GETRULE,
        Dump::Elements => libc::NFT_MSG_GETSETELEM,
        Dump::Objects => libc::NFT_MSG_GETOBJ,
        Dump::Flowtables => NFT_MSG_GETFLOWTABLE,
    };
    let flags = (libc::NLM_F_DUMP | libc::NLM_F_REQUEST) as u16;
    // SAFETY: `buf` has nft_nlmsg_maxsize bytes; the temporary objects are freed after their
    // payload is written; strings are copied by libnftnl.
    let len = unsafe {
        let nlh = sys::nftnl_nlmsg_build_hdr(
            buf.as_mut_ptr().cast::<c_char>(),
            msg_type as u16,
            libc::NFPROTO_INET as u16,
            flags,
            seq,
        );
        match kind {
            Dump::Tables => {}
            Dump::Chains => {
                let c = sys::nftnl_chain_alloc();
                sys::nftnl_chain_set_str(c, sys::NFTNL_CHAIN_TABLE as u16, table.as_ptr());
                sys::nftnl_chain_nlmsg_build_payload(nlh, c);
                sys::nftnl_chain_free(c);
            }
            Dump::Rules => {
                let r = sys::nftnl_rule_alloc();
                sys::nftnl_rule_set_str(r, sys::NFTNL_RULE_TABLE as u16, table.as_ptr());
                sys::nftnl_rule_nlmsg_build_payload(nlh, r);
                sys::nftnl_rule_free(r);
            }
            Dump::Objects => {
                let o = sys::nftnl_obj_alloc();
                sys::nftnl_obj_set_str(o, sys::NFTNL_OBJ_TABLE as u16, table.as_ptr());
                sys::nftnl_obj_nlmsg_build_payload(nlh, o);
                sys::nftnl_obj_free(o);
            }
            Dump::Flowtables => {
                let f = sys::nftnl_flowtable_alloc();
                sys::nftnl_flowtable_set_str(f, sys::NFTNL_FLOWTABLE_TABLE as u16, table.as_ptr());
                sys::nftnl_flowtable_nlmsg_build_payload(nlh, f);
                sys::nftnl_flowtable_free(f);
            }
            Dump::Sets | Dump::Elements => {
                let s = sys::nftnl_set_alloc();
                sys::nftnl_set_set_str(s, sys::NFTNL_SET_TABLE as u16, table.as_ptr());
                if let Some(name) = set {
                    sys::nftnl_set_set_str(s, sys::NFTNL_SET_NAME as u16, name.as_ptr());
                }
                if kind == Dump::Sets {
                    sys::nftnl_set_nlmsg_build_payload(nlh, s);
                } else {
                    sys::nftnl_set_elems_nlmsg_build_payload(nlh, s);
                }
                sys::nftnl_set_free(s);
            }
        }
        (*nlh).nlmsg_len as usize
    };
    buf.truncate(len);
    buf
}

/// A netlink message copied to 4-byte aligned storage, as libnftnl's parsers require.
struct Aligned(Vec<u32>);

impl Aligned {
    fn new(msg: &[u8]) -> Aligned {
        let mut words = vec![0u32; msg.len().div_ceil(4)];
        for (w, chunk) in words.iter_mut().zip(msg.chunks(4)) {
            let mut b = [0u8; 4];
            b[..chunk.len()].copy_from_slice(chunk);
            *w = u32::from_ne_bytes(b);
        }
        Aligned(words)
    }

    fn header(&self) -> *const libc::nlmsghdr {
        self.0.as_ptr().cast()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveChain {
    pub table: String,
    pub name: String,
    /// The type of a base chain (`filter`, `route`, `nat`).
    pub kind: Option<String>,
    /// `NFT_CHAIN_*` flags: base (on a hook), hardware offload, binding.
    pub flags: u32,
    /// Hook number, priority and policy of a base chain.
    pub hook: Option<(u32, i32, u32)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveSet {
    pub table: String,
    pub name: String,
    pub flags: u32,
    pub key_type: u32,
    pub key_len: u32,
    /// The lengths of a concatenated key's fields (unpadded), as the set describes them: a
    /// set of intervals matches each field as a range of its own.
    pub key_fields: Vec<u8>,
    /// What else the set declares; egress-fence declares none of it.
    pub params: SetParams,
}

/// What a set may declare besides its key and flags (`timeout 1h; gc-interval 1s; size 2;
/// policy memory; counter`): the kernel reports each only when it is not the default, and
/// egress-fence never sets one, so ours read back as [`SetParams::default`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetParams {
    /// The timeout of elements added without one (0: they never expire).
    pub timeout_ms: u64,
    pub gc_interval_ms: u32,
    /// `NFT_SET_POL_*`: 0 performance, 1 memory.
    pub policy: u32,
    /// The most elements the set may hold (0: no bound).
    pub size: u32,
    /// The set gives the elements added to it expressions (a counter, a quota, a limit).
    pub expressions: bool,
    /// The data type and length of a map's values (0 for a set).
    pub data_type: u32,
    pub data_len: u32,
    /// The type of the objects a map of objects refers to (0 for a set).
    pub object_type: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveElem {
    pub key: Vec<u8>,
    pub key_end: Option<Vec<u8>>,
    pub flags: u32,
    pub timeout_ms: Option<u64>,
    pub expires_ms: Option<u64>,
    pub userdata: Option<Vec<u8>>,
    /// The attributes it carries that egress-fence never sets (`NFTNL_SET_ELEM_*`: data, a
    /// verdict, expressions, an object reference): such an element is none of ours.
    pub unread: Vec<u32>,
}

/// Element attributes egress-fence never sets.
const ELEM_ATTRS_NEVER_SET: [u32; 6] = [
    sys::NFTNL_SET_ELEM_VERDICT,
    sys::NFTNL_SET_ELEM_CHAIN,
    sys::NFTNL_SET_ELEM_DATA,
    sys::NFTNL_SET_ELEM_EXPR,
    sys::NFTNL_SET_ELEM_OBJREF,
    sys::NFTNL_SET_ELEM_EXPRESSIONS,
];

/// A flowtable or a stateful object (a named counter, quota, limit, ct helper, ...) of a
/// table: egress-fence makes none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveObject {
    pub table: String,
    pub name: String,
    /// As nft names the kind: "counter", "quota", "ct helper", "flowtable".
    pub kind: String,
}

/// nft's name of an object type (`NFT_OBJECT_*`).
fn object_kind(kind: u32) -> String {
    match kind {
        1 => "counter".into(),
        2 => "quota".into(),
        3 => "ct helper".into(),
        4 => "limit".into(),
        5 => "ct count".into(),
        6 => "tunnel".into(),
        7 => "ct timeout".into(),
        8 => "secmark".into(),
        9 => "ct expectation".into(),
        10 => "synproxy".into(),
        other => format!("object of type {other}"),
    }
}

/// A rule as dumped: where it sits, and its expressions with every attribute read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpedRule {
    pub table: String,
    pub chain: String,
    pub handle: u64,
    pub exprs: Vec<LiveExpr>,
    /// Each expression as libnftnl prints it ("lookup reg 1 set allow4 0x0"): how a rule
    /// egress-fence cannot decode is shown.
    pub text: Vec<String>,
    /// The rule's user data (`NFTA_RULE_USERDATA`): nft keeps a rule's `comment` there.
    pub userdata: Option<Vec<u8>>,
}

/// One expression of a rule, with every attribute libnftnl read from it, for the kinds of
/// expression egress-fence writes. Attributes the kernel fills in with a default when a
/// message leaves them out read as that default, so a rule we sent and the same rule dumped
/// compare equal. An expression of another kind, or with an attribute egress-fence never
/// sets (a `meta set`, a payload write, a map lookup), is [`LiveExpr::Other`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LiveExpr {
    /// `meta load KEY => reg DREG`
    Meta { key: u32, dreg: u32 },
    /// `cmp OP reg SREG DATA`
    Cmp { sreg: u32, op: u32, data: Vec<u8> },
    /// `payload load LEN b @ BASE header + OFFSET => reg DREG`
    Payload {
        base: u32,
        offset: u32,
        len: u32,
        dreg: u32,
    },
    /// `bitwise reg DREG = ( reg SREG & MASK ) ^ XOR` (`op` 0, NFT_BITWISE_BOOL)
    Bitwise {
        sreg: u32,
        dreg: u32,
        len: u32,
        op: u32,
        mask: Vec<u8>,
        xor: Vec<u8>,
    },
    /// `byteorder reg DREG = OP(reg SREG, SIZE, LEN)`
    Byteorder {
        sreg: u32,
        dreg: u32,
        op: u32,
        len: u32,
        size: u32,
    },
    /// `lookup reg SREG set SET FLAGS` (FLAGS 1: the match is inverted)
    Lookup { sreg: u32, set: String, flags: u32 },
    /// `ct load KEY => reg DREG`
    Ct {
        key: u32,
        dreg: u32,
        dir: Option<u8>,
    },
    /// `socket load KEY => reg DREG`, with the cgroup level of `socket cgroupv2 level N`.
    Socket {
        key: u32,
        dreg: u32,
        level: Option<u32>,
    },
    /// `fib FLAGS RESULT => reg DREG`
    Fib { dreg: u32, result: u32, flags: u32 },
    /// `exthdr load ...`: whether (flags 1) or what of an extension header.
    Exthdr {
        dreg: u32,
        kind: u8,
        offset: u32,
        len: u32,
        flags: u32,
        op: u32,
    },
    /// `limit rate RATE/UNIT burst BURST type KIND flags FLAGS`
    Limit {
        rate: u64,
        unit: u64,
        burst: u32,
        kind: u32,
        flags: u32,
    },
    /// `log prefix P [group G]`; `level` is the kernel log's (4 when a message names none),
    /// absent for a log to an NFLOG group.
    Log {
        prefix: String,
        group: Option<u16>,
        snaplen: u32,
        qthreshold: u32,
        level: Option<u32>,
        flags: u32,
    },
    /// `counter`: what it counted is state, not configuration.
    Counter { packets: u64, bytes: u64 },
    /// `immediate reg 0 VERDICT [-> CHAIN]`
    Verdict { code: i32, chain: Option<String> },
    /// `reject type KIND code CODE`
    Reject { kind: u32, code: u8 },
    /// Any other expression, as libnftnl prints it.
    Other(String),
}

/// Reads an optional string attribute that libnftnl returns as a C string.
///
/// # Safety
/// `p` must be NULL or point to a NUL-terminated string valid for this call.
unsafe fn owned_str(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: per the caller.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Fills a fresh libnftnl object from one dumped message and reads it with `read`.
///
/// # Safety
/// `alloc`, `parse` and `free` must be the matching libnftnl functions of one object type,
/// and `read` may only use the object while it is called.
unsafe fn parse_with<T, R>(
    msg: &[u8],
    alloc: unsafe extern "C" fn() -> *mut T,
    parse: unsafe extern "C" fn(*const libc::nlmsghdr, *mut T) -> c_int,
    free: unsafe extern "C" fn(*const T),
    read: impl FnOnce(*mut T) -> R,
) -> Option<R> {
    // libnftnl walks the message as far as its header says: that must be within `msg`, and
    // hold the nfgenmsg it reads first.
    let checked = crate::netlink::Message::parse(msg).ok()?;
    checked.nfgenmsg().ok()?;
    let msg = Aligned::new(checked.bytes);
    // SAFETY: per the caller; the object is freed on every path, after `read` copied out what
    // it needs.
    unsafe {
        let obj = alloc();
        if obj.is_null() {
            std::process::abort();
        }
        let out = (parse(msg.header(), obj) >= 0).then(|| read(obj));
        free(obj);
        out
    }
}

/// Parses one table message of a dump into its family, name and flags (`NFT_TABLE_F_*`:
/// dormant, owner).
pub fn parse_table(msg: &[u8]) -> Option<(u32, String, u32, u64)> {
    // SAFETY: the table functions belong together; attributes are read while `t` lives and
    // strings copied.
    unsafe {
        parse_with(
            msg,
            sys::nftnl_table_alloc,
            sys::nftnl_table_nlmsg_parse,
            sys::nftnl_table_free,
            |t| {
                (
                    sys::nftnl_table_get_u32(t, sys::NFTNL_TABLE_FAMILY as u16),
                    owned_str(sys::nftnl_table_get_str(t, sys::NFTNL_TABLE_NAME as u16)),
                    sys::nftnl_table_get_u32(t, sys::NFTNL_TABLE_FLAGS as u16),
                    sys::nftnl_table_get_u64(t, sys::NFTNL_TABLE_HANDLE as u16),
                )
            },
        )
    }
}

/// Parses one chain message of a dump; `None` if libnftnl cannot read it.
pub fn parse_chain(msg: &[u8]) -> Option<LiveChain> {
    // SAFETY: as in `parse_table`, for chains.
    unsafe {
        parse_with(
            msg,
            sys::nftnl_chain_alloc,
            sys::nftnl_chain_nlmsg_parse,
            sys::nftnl_chain_free,
            |c| LiveChain {
                table: owned_str(sys::nftnl_chain_get_str(c, sys::NFTNL_CHAIN_TABLE as u16)),
                name: owned_str(sys::nftnl_chain_get_str(c, sys::NFTNL_CHAIN_NAME as u16)),
                kind: sys::nftnl_chain_is_set(c, sys::NFTNL_CHAIN_TYPE as u16)
                    .then(|| owned_str(sys::nftnl_chain_get_str(c, sys::NFTNL_CHAIN_TYPE as u16))),
                flags: sys::nftnl_chain_get_u32(c, sys::NFTNL_CHAIN_FLAGS as u16),
                hook: sys::nftnl_chain_is_set(c, sys::NFTNL_CHAIN_HOOKNUM as u16).then(|| {
                    (
                        sys::nftnl_chain_get_u32(c, sys::NFTNL_CHAIN_HOOKNUM as u16),
                        sys::nftnl_chain_get_s32(c, sys::NFTNL_CHAIN_PRIO as u16),
                        sys::nftnl_chain_get_u32(c, sys::NFTNL_CHAIN_POLICY as u16),
                    )
                }),
            },
        )
    }
}

/// Parses one stateful object message of a dump.
pub fn parse_object(msg: &[u8]) -> Option<LiveObject> {
    // SAFETY: as in `parse_table`, for objects.
    unsafe {
        parse_with(
            msg,
            sys::nftnl_obj_alloc,
            sys::nftnl_obj_nlmsg_parse,
            sys::nftnl_obj_free,
            |o| LiveObject {
                table: owned_str(sys::nftnl_obj_get_str(o, sys::NFTNL_OBJ_TABLE as u16)),
                name: owned_str(sys::nftnl_obj_get_str(o, sys::NFTNL_OBJ_NAME as u16)),
                kind: object_kind(sys::nftnl_obj_get_u32(o, sys::NFTNL_OBJ_TYPE as u16)),
            },
        )
    }
}

/// Parses one flowtable message of a dump.
pub fn parse_flowtable(msg: &[u8]) -> Option<LiveObject> {
    // SAFETY: as in `parse_table`, for flowtables.
    unsafe {
        parse_with(
            msg,
            sys::nftnl_flowtable_alloc,
            sys::nftnl_flowtable_nlmsg_parse,
            sys::nftnl_flowtable_free,
            |f| LiveObject {
                table: owned_str(sys::nftnl_flowtable_get_str(
                    f,
                    sys::NFTNL_FLOWTABLE_TABLE as u16,
                )),
                name: owned_str(sys::nftnl_flowtable_get_str(
                    f,
                    sys::NFTNL_FLOWTABLE_NAME as u16,
                )),
                kind: "flowtable".into(),
            },
        )
    }
}

/// Parses one set message of a dump.
pub fn parse_set(msg: &[u8]) -> Option<LiveSet> {
    // SAFETY: as in `parse_table`, for sets.
    unsafe {
        parse_with(
            msg,
            sys::nftnl_set_alloc,
            sys::nftnl_set_nlmsg_parse,
            sys::nftnl_set_free,
            |s| {
                let get = |attr: u32| sys::nftnl_set_get_u32(s, attr as u16);
                LiveSet {
                    table: owned_str(sys::nftnl_set_get_str(s, sys::NFTNL_SET_TABLE as u16)),
                    name: owned_str(sys::nftnl_set_get_str(s, sys::NFTNL_SET_NAME as u16)),
                    flags: get(sys::NFTNL_SET_FLAGS),
                    key_type: get(sys::NFTNL_SET_KEY_TYPE),
                    key_len: get(sys::NFTNL_SET_KEY_LEN),
                    key_fields: if sys::nftnl_set_is_set(s, sys::NFTNL_SET_DESC_CONCAT as u16) {
                        // libnftnl gives the field lengths, one byte each, and their count.
                        let mut count = 0u32;
                        let p = sys::nftnl_set_get_data(
                            s,
                            sys::NFTNL_SET_DESC_CONCAT as u16,
                            &mut count,
                        );
                        if p.is_null() {
                            Vec::new()
                        } else {
                            std::slice::from_raw_parts(p.cast::<u8>(), count as usize).to_vec()
                        }
                    } else {
                        Vec::new()
                    },
                    params: SetParams {
                        timeout_ms: sys::nftnl_set_get_u64(s, sys::NFTNL_SET_TIMEOUT as u16),
                        gc_interval_ms: get(sys::NFTNL_SET_GC_INTERVAL),
                        policy: get(sys::NFTNL_SET_POLICY),
                        size: get(sys::NFTNL_SET_DESC_SIZE),
                        expressions: sys::nftnl_set_is_set(s, sys::NFTNL_SET_EXPR as u16)
                            || sys::nftnl_set_is_set(s, sys::NFTNL_SET_EXPRESSIONS as u16),
                        data_type: get(sys::NFTNL_SET_DATA_TYPE),
                        data_len: get(sys::NFTNL_SET_DATA_LEN),
                        object_type: get(sys::NFTNL_SET_OBJ_TYPE),
                    },
                }
            },
        )
    }
}

/// Parses one element message of a dump into its elements.
pub fn parse_elems(msg: &[u8]) -> Option<Vec<LiveElem>> {
    // SAFETY: as in `parse_table`, for a set holding the dumped elements; the iterator is
    // destroyed before the set is freed, and element data is copied out with the length
    // libnftnl reports.
    unsafe {
        parse_with(
            msg,
            sys::nftnl_set_alloc,
            sys::nftnl_set_elems_nlmsg_parse,
            sys::nftnl_set_free,
            |s| {
                let mut out = Vec::new();
                let iter = sys::nftnl_set_elems_iter_create(s);
                if iter.is_null() {
                    return out;
                }
                let mut e = sys::nftnl_set_elems_iter_next(iter);
                while !e.is_null() {
                    let is_set = |attr: u32| sys::nftnl_set_elem_is_set(e, attr as u16);
                    let data = |attr: u32| {
                        let mut len = 0u32;
                        let p = sys::nftnl_set_elem_get(e, attr as u16, &mut len);
                        (is_set(attr) && !p.is_null()).then(|| {
                            std::slice::from_raw_parts(p.cast::<u8>(), len as usize).to_vec()
                        })
                    };
                    let u64_attr = |attr: u32| {
                        is_set(attr).then(|| sys::nftnl_set_elem_get_u64(e, attr as u16))
                    };
                    out.push(LiveElem {
                        key: data(sys::NFTNL_SET_ELEM_KEY).unwrap_or_default(),
                        key_end: data(sys::NFTNL_SET_ELEM_KEY_END),
                        flags: if is_set(sys::NFTNL_SET_ELEM_FLAGS) {
                            sys::nftnl_set_elem_get_u32(e, sys::NFTNL_SET_ELEM_FLAGS as u16)
                        } else {
                            0
                        },
                        timeout_ms: u64_attr(sys::NFTNL_SET_ELEM_TIMEOUT),
                        expires_ms: u64_attr(sys::NFTNL_SET_ELEM_EXPIRATION),
                        userdata: data(sys::NFTNL_SET_ELEM_USERDATA),
                        unread: ELEM_ATTRS_NEVER_SET
                            .into_iter()
                            .filter(|&attr| is_set(attr))
                            .collect(),
                    });
                    e = sys::nftnl_set_elems_iter_next(iter);
                }
                sys::nftnl_set_elems_iter_destroy(iter);
                out
            },
        )
    }
}

/// Parses one rule message of a dump. A rule libnftnl cannot read (an expression newer
/// than it, which the kernel accepted from another tool) is still placed, by the table,
/// chain and handle its message names, and reads as one [`LiveExpr::Other`]: drift that
/// `apply` replaces, instead of a table nobody can check or repair.
pub fn parse_rule(msg: &[u8]) -> Option<DumpedRule> {
    parse_rule_with_libnftnl(msg).or_else(|| unreadable_rule(msg))
}

/// `NFTA_RULE_*`: the attributes that say where a rule sits.
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_HANDLE: u16 = 3;

/// A rule message libnftnl refused, read as far as where it sits; `None` if not even that.
fn unreadable_rule(msg: &[u8]) -> Option<DumpedRule> {
    let message = crate::netlink::Message::parse(msg).ok()?;
    let (_, attrs) = message.nfgenmsg().ok()?;
    let name = |kind: u16| {
        let value = attrs.clone().value(kind)?;
        let value = value.split(|&b| b == 0).next().unwrap_or_default();
        Some(String::from_utf8_lossy(value).into_owned())
    };
    let handle = attrs
        .clone()
        .value(NFTA_RULE_HANDLE)
        .and_then(|v| <[u8; 8]>::try_from(v).ok())
        .map_or(0, u64::from_be_bytes);
    let what = "an expression libnftnl cannot read".to_string();
    Some(DumpedRule {
        table: name(NFTA_RULE_TABLE)?,
        chain: name(NFTA_RULE_CHAIN)?,
        handle,
        exprs: vec![LiveExpr::Other(what.clone())],
        text: vec![what],
        userdata: None,
    })
}

fn parse_rule_with_libnftnl(msg: &[u8]) -> Option<DumpedRule> {
    // SAFETY: as in `parse_table`, for rules; expressions belong to the rule and are only
    // read while it lives.
    unsafe {
        parse_with(
            msg,
            sys::nftnl_rule_alloc,
            sys::nftnl_rule_nlmsg_parse,
            sys::nftnl_rule_free,
            |r| {
                let (exprs, text) = rule_exprs(r);
                DumpedRule {
                    table: owned_str(sys::nftnl_rule_get_str(r, sys::NFTNL_RULE_TABLE as u16)),
                    chain: owned_str(sys::nftnl_rule_get_str(r, sys::NFTNL_RULE_CHAIN as u16)),
                    handle: sys::nftnl_rule_get_u64(r, sys::NFTNL_RULE_HANDLE as u16),
                    exprs,
                    text,
                    userdata: rule_userdata(r),
                }
            },
        )
    }
}

/// A rule's user data, copied out, if it has any.
///
/// # Safety
/// `r` must be a live rule.
unsafe fn rule_userdata(r: *const sys::nftnl_rule) -> Option<Vec<u8>> {
    let attr = sys::NFTNL_RULE_USERDATA as u16;
    // SAFETY: per the caller; the data belongs to the rule and is copied at once, with the
    // length libnftnl reports.
    unsafe {
        if !sys::nftnl_rule_is_set(r, attr) {
            return None;
        }
        let mut len = 0u32;
        let p = sys::nftnl_rule_get_data(r, attr, &mut len);
        (!p.is_null()).then(|| std::slice::from_raw_parts(p.cast::<u8>(), len as usize).to_vec())
    }
}

/// The expressions of a rule, read, and as libnftnl prints them.
///
/// # Safety
/// `r` must be a live rule.
unsafe fn rule_exprs(r: *const sys::nftnl_rule) -> (Vec<LiveExpr>, Vec<String>) {
    let (mut exprs, mut text) = (Vec::new(), Vec::new());
    // SAFETY: per the caller; the iterator is destroyed before returning, and every
    // expression is read while the rule lives.
    unsafe {
        let iter = sys::nftnl_expr_iter_create(r);
        if iter.is_null() {
            return (exprs, text);
        }
        let mut e = sys::nftnl_expr_iter_next(iter);
        while !e.is_null() {
            let name = owned_str(sys::nftnl_expr_get_str(e, sys::NFTNL_EXPR_NAME as u16));
            let mut buf = [0u8; 512];
            let n = sys::nftnl_expr_snprintf(
                buf.as_mut_ptr().cast::<c_char>(),
                buf.len(),
                e,
                sys::NFTNL_OUTPUT_DEFAULT,
                0,
            );
            let printed = String::from_utf8_lossy(&buf[..(n.max(0) as usize).min(buf.len() - 1)]);
            let printed = format!("{name} {}", printed.trim());
            exprs.push(read_expr(e, &name).unwrap_or_else(|| LiveExpr::Other(printed.clone())));
            text.push(printed);
            e = sys::nftnl_expr_iter_next(iter);
        }
        sys::nftnl_expr_iter_destroy(iter);
    }
    (exprs, text)
}

/// The highest attribute number of any expression type libnftnl knows (all are below 16).
const EXPR_ATTR_MAX: u32 = 15;

/// Reads expression `e` of type `name`; `None` for a kind egress-fence does not write, or
/// one that carries an attribute it never sets or lacks one it always does.
///
/// # Safety
/// `e` must be a live expression.
unsafe fn read_expr(e: *const sys::nftnl_expr, name: &str) -> Option<LiveExpr> {
    // SAFETY (all closures): per the caller; data pointers are copied out at once, with the
    // length libnftnl reports.
    let is_set = |attr: u32| unsafe { sys::nftnl_expr_is_set(e, attr as u16) };
    let u8_attr = |attr: u32| unsafe { sys::nftnl_expr_get_u8(e, attr as u16) };
    let u16_attr = |attr: u32| unsafe { sys::nftnl_expr_get_u16(e, attr as u16) };
    let u32_attr = |attr: u32| unsafe { sys::nftnl_expr_get_u32(e, attr as u16) };
    let u64_attr = |attr: u32| unsafe { sys::nftnl_expr_get_u64(e, attr as u16) };
    let str_attr = |attr: u32| unsafe { owned_str(sys::nftnl_expr_get_str(e, attr as u16)) };
    let data_attr = |attr: u32| unsafe {
        let mut len = 0u32;
        let p = sys::nftnl_expr_get(e, attr as u16, &mut len);
        if p.is_null() {
            Vec::new()
        } else {
            std::slice::from_raw_parts(p.cast::<u8>(), len as usize).to_vec()
        }
    };
    // Every attribute that is set is one of `allowed`, and every one of `required` is set.
    let attrs_are = |allowed: &[u32], required: &[u32]| {
        (1..=EXPR_ATTR_MAX).all(|a| !is_set(a) || allowed.contains(&a))
            && required.iter().all(|&a| is_set(a))
    };
    match name {
        "meta" => {
            use sys::{NFTNL_EXPR_META_DREG as DREG, NFTNL_EXPR_META_KEY as KEY};
            attrs_are(&[KEY, DREG], &[KEY, DREG]).then(|| LiveExpr::Meta {
                key: u32_attr(KEY),
                dreg: u32_attr(DREG),
            })
        }
        "cmp" => {
            use sys::{
                NFTNL_EXPR_CMP_DATA as DATA, NFTNL_EXPR_CMP_OP as OP, NFTNL_EXPR_CMP_SREG as SREG,
            };
            attrs_are(&[SREG, OP, DATA], &[SREG, OP, DATA]).then(|| LiveExpr::Cmp {
                sreg: u32_attr(SREG),
                op: u32_attr(OP),
                data: data_attr(DATA),
            })
        }
        "payload" => {
            use sys::{
                NFTNL_EXPR_PAYLOAD_BASE as BASE, NFTNL_EXPR_PAYLOAD_DREG as DREG,
                NFTNL_EXPR_PAYLOAD_LEN as LEN, NFTNL_EXPR_PAYLOAD_OFFSET as OFFSET,
            };
            let all = [DREG, BASE, OFFSET, LEN];
            attrs_are(&all, &all).then(|| LiveExpr::Payload {
                base: u32_attr(BASE),
                offset: u32_attr(OFFSET),
                len: u32_attr(LEN),
                dreg: u32_attr(DREG),
            })
        }
        "bitwise" => {
            use sys::{
                NFTNL_EXPR_BITWISE_DREG as DREG, NFTNL_EXPR_BITWISE_LEN as LEN,
                NFTNL_EXPR_BITWISE_MASK as MASK, NFTNL_EXPR_BITWISE_OP as OP,
                NFTNL_EXPR_BITWISE_SREG as SREG, NFTNL_EXPR_BITWISE_XOR as XOR,
            };
            // Kernels from 5.6 report the operation; 0 (a mask and xor) when they do not.
            let required = [SREG, DREG, LEN, MASK, XOR];
            attrs_are(&[SREG, DREG, LEN, MASK, XOR, OP], &required).then(|| LiveExpr::Bitwise {
                sreg: u32_attr(SREG),
                dreg: u32_attr(DREG),
                len: u32_attr(LEN),
                op: u32_attr(OP),
                mask: data_attr(MASK),
                xor: data_attr(XOR),
            })
        }
        "byteorder" => {
            use sys::{
                NFTNL_EXPR_BYTEORDER_DREG as DREG, NFTNL_EXPR_BYTEORDER_LEN as LEN,
                NFTNL_EXPR_BYTEORDER_OP as OP, NFTNL_EXPR_BYTEORDER_SIZE as SIZE,
                NFTNL_EXPR_BYTEORDER_SREG as SREG,
            };
            let all = [SREG, DREG, OP, LEN, SIZE];
            attrs_are(&all, &all).then(|| LiveExpr::Byteorder {
                sreg: u32_attr(SREG),
                dreg: u32_attr(DREG),
                op: u32_attr(OP),
                len: u32_attr(LEN),
                size: u32_attr(SIZE),
            })
        }
        "lookup" => {
            use sys::{
                NFTNL_EXPR_LOOKUP_FLAGS as FLAGS, NFTNL_EXPR_LOOKUP_SET as SET,
                NFTNL_EXPR_LOOKUP_SET_ID as SET_ID, NFTNL_EXPR_LOOKUP_SREG as SREG,
            };
            // The set id names a set within one batch only (the kernel never reports it);
            // the flags are 0 unless the match is inverted.
            attrs_are(&[SREG, SET, SET_ID, FLAGS], &[SREG, SET]).then(|| LiveExpr::Lookup {
                sreg: u32_attr(SREG),
                set: str_attr(SET),
                flags: u32_attr(FLAGS),
            })
        }
        "ct" => {
            use sys::{
                NFTNL_EXPR_CT_DIR as DIR, NFTNL_EXPR_CT_DREG as DREG, NFTNL_EXPR_CT_KEY as KEY,
            };
            attrs_are(&[DREG, KEY, DIR], &[DREG, KEY]).then(|| LiveExpr::Ct {
                key: u32_attr(KEY),
                dreg: u32_attr(DREG),
                dir: is_set(DIR).then(|| u8_attr(DIR)),
            })
        }
        "socket" => {
            use sys::{NFTNL_EXPR_SOCKET_DREG as DREG, NFTNL_EXPR_SOCKET_KEY as KEY};
            const LEVEL: u32 = NFTNL_EXPR_SOCKET_LEVEL;
            attrs_are(&[KEY, DREG, LEVEL], &[KEY, DREG]).then(|| LiveExpr::Socket {
                key: u32_attr(KEY),
                dreg: u32_attr(DREG),
                level: is_set(LEVEL).then(|| u32_attr(LEVEL)),
            })
        }
        "fib" => {
            use sys::{
                NFTNL_EXPR_FIB_DREG as DREG, NFTNL_EXPR_FIB_FLAGS as FLAGS,
                NFTNL_EXPR_FIB_RESULT as RESULT,
            };
            let all = [DREG, RESULT, FLAGS];
            attrs_are(&all, &all).then(|| LiveExpr::Fib {
                dreg: u32_attr(DREG),
                result: u32_attr(RESULT),
                flags: u32_attr(FLAGS),
            })
        }
        "exthdr" => {
            use sys::{
                NFTNL_EXPR_EXTHDR_DREG as DREG, NFTNL_EXPR_EXTHDR_FLAGS as FLAGS,
                NFTNL_EXPR_EXTHDR_LEN as LEN, NFTNL_EXPR_EXTHDR_OFFSET as OFFSET,
                NFTNL_EXPR_EXTHDR_OP as OP, NFTNL_EXPR_EXTHDR_TYPE as TYPE,
            };
            let allowed = [DREG, TYPE, OFFSET, LEN, FLAGS, OP];
            attrs_are(&allowed, &[DREG, TYPE, LEN]).then(|| LiveExpr::Exthdr {
                dreg: u32_attr(DREG),
                kind: u8_attr(TYPE),
                offset: u32_attr(OFFSET),
                len: u32_attr(LEN),
                flags: u32_attr(FLAGS),
                op: u32_attr(OP),
            })
        }
        "limit" => {
            use sys::{
                NFTNL_EXPR_LIMIT_BURST as BURST, NFTNL_EXPR_LIMIT_FLAGS as FLAGS,
                NFTNL_EXPR_LIMIT_RATE as RATE, NFTNL_EXPR_LIMIT_TYPE as TYPE,
                NFTNL_EXPR_LIMIT_UNIT as UNIT,
            };
            let allowed = [RATE, UNIT, BURST, TYPE, FLAGS];
            attrs_are(&allowed, &[RATE, UNIT]).then(|| LiveExpr::Limit {
                rate: u64_attr(RATE),
                unit: u64_attr(UNIT),
                burst: u32_attr(BURST),
                kind: u32_attr(TYPE),
                flags: u32_attr(FLAGS),
            })
        }
        "log" => {
            use sys::{
                NFTNL_EXPR_LOG_FLAGS as FLAGS, NFTNL_EXPR_LOG_GROUP as GROUP,
                NFTNL_EXPR_LOG_LEVEL as LEVEL, NFTNL_EXPR_LOG_PREFIX as PREFIX,
                NFTNL_EXPR_LOG_QTHRESHOLD as QTHRESHOLD, NFTNL_EXPR_LOG_SNAPLEN as SNAPLEN,
            };
            let allowed = [PREFIX, GROUP, SNAPLEN, QTHRESHOLD, LEVEL, FLAGS];
            let group = is_set(GROUP).then(|| u16_attr(GROUP));
            // Without a group the kernel logs at level 4 (warning) unless told otherwise.
            let level = match (group, is_set(LEVEL)) {
                (_, true) => Some(u32_attr(LEVEL)),
                (None, false) => Some(4),
                (Some(_), false) => None,
            };
            attrs_are(&allowed, &[]).then(|| LiveExpr::Log {
                prefix: str_attr(PREFIX),
                group,
                snaplen: u32_attr(SNAPLEN),
                qthreshold: u32_attr(QTHRESHOLD),
                level,
                flags: u32_attr(FLAGS),
            })
        }
        "counter" => {
            use sys::{NFTNL_EXPR_CTR_BYTES as BYTES, NFTNL_EXPR_CTR_PACKETS as PACKETS};
            attrs_are(&[PACKETS, BYTES], &[]).then(|| LiveExpr::Counter {
                packets: u64_attr(PACKETS),
                bytes: u64_attr(BYTES),
            })
        }
        "immediate" => {
            use sys::{
                NFTNL_EXPR_IMM_CHAIN as CHAIN, NFTNL_EXPR_IMM_DREG as DREG,
                NFTNL_EXPR_IMM_VERDICT as VERDICT,
            };
            // Register 0 is the verdict register: anything else loads data.
            (attrs_are(&[DREG, VERDICT, CHAIN], &[DREG, VERDICT])
                && u32_attr(DREG) == libc::NFT_REG_VERDICT as u32)
                .then(|| LiveExpr::Verdict {
                    code: u32_attr(VERDICT) as i32,
                    chain: is_set(CHAIN).then(|| str_attr(CHAIN)),
                })
        }
        "reject" => {
            use sys::{NFTNL_EXPR_REJECT_CODE as CODE, NFTNL_EXPR_REJECT_TYPE as TYPE};
            attrs_are(&[TYPE, CODE], &[TYPE]).then(|| LiveExpr::Reject {
                kind: u32_attr(TYPE),
                code: u8_attr(CODE),
            })
        }
        _ => None,
    }
}

/// The expressions of a message we built (a rule, say), as [`parse_rule`] reports them for
/// a live one: the form a decoder of dumped rules reads.
pub fn describe_rule(rule: &impl NlMsg) -> Option<DumpedRule> {
    let mut buf = vec![0u32; nftnl::nft_nlmsg_maxsize() as usize / 4];
    // SAFETY: `buf` holds nft_nlmsg_maxsize bytes, the most one message may need; the length
    // read back is the header's own, within the buffer.
    let len = unsafe {
        rule.write(buf.as_mut_ptr().cast::<c_void>(), 0, MsgType::Add);
        (*buf.as_ptr().cast::<libc::nlmsghdr>()).nlmsg_len as usize
    };
    let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).take(len).collect();
    parse_rule(&bytes)
}

/// Hands the allocator's free memory back to the kernel. glibc keeps what is freed inside its
/// heap resident until the top of the heap is free too: after a burst of lookups and one large
/// batch the daemon of a 10,000-address policy kept twice its live heap (benches/daemon.rs).
/// Here with the FFI, though it concerns no netlink, because this is the crate's one module
/// allowed `unsafe`. Costs well under a millisecond for such a heap; call it after bursts,
/// not per packet.
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim(3) takes no pointer and works on the allocator's own free lists
    // under its locks; it may be called at any time, from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `TUNSETIFF` (`_IOW('T', 202, int)`, linux/if_tun.h; absent from libc).
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

/// Whether a process holds `file` open for writing: the kernel grants a read lease
/// (`F_SETLEASE`, `F_RDLCK`) only while no descriptor of it, anywhere, was opened for writing
/// (one in flight over a Unix socket, or a shared writable mapping, included); the lease is let
/// go at once. `None` when the kernel cannot tell this process: the file is not its own and it
/// lacks CAP_LEASE, leases are off (`fs.leases-enable`), or the file system has none.
pub fn open_for_writing(file: std::os::fd::BorrowedFd<'_>) -> Option<bool> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: F_SETLEASE takes an int argument and no pointer; `fd` is a descriptor the
    // caller holds open for the whole call (it is borrowed).
    let r = unsafe { libc::fcntl(fd, libc::F_SETLEASE, libc::F_RDLCK) };
    if r == 0 {
        // SAFETY: as above; F_UNLCK lets go of the lease just taken.
        unsafe { libc::fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK) };
        return Some(false);
    }
    match nix::errno::Errno::last() {
        nix::errno::Errno::EAGAIN => Some(true),
        _ => None,
    }
}

/// Asks the tun driver behind `fd` (an open `/dev/net/tun`) to attach it to the device `name`
/// with `flags` (`IFF_TUN` or `IFF_TAP`, `IFF_MULTI_QUEUE` as the device has it): `Ok` once
/// attached (closing `fd` detaches it), EPERM when the device is not this process's to
/// attach, EBUSY when it may but another descriptor holds it now. A name that is not a
/// device's makes a new one (only with CAP_NET_ADMIN): callers pass names of devices that
/// exist.
pub fn tun_set_iff(
    fd: std::os::fd::BorrowedFd<'_>,
    name: &str,
    flags: i16,
) -> Result<(), nix::errno::Errno> {
    use std::os::fd::AsRawFd;
    let mut ifreq = [0u8; 40]; // struct ifreq: the name (IFNAMSIZ), then a union of 24 bytes
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(nix::errno::Errno::EINVAL);
    }
    ifreq[..bytes.len()].copy_from_slice(bytes);
    ifreq[libc::IFNAMSIZ..libc::IFNAMSIZ + 2].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: TUNSETIFF reads and writes a struct ifreq, which `ifreq` is in size (40 bytes)
    // and layout (the name, NUL-terminated, then the flags), valid for the whole call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, ifreq.as_mut_ptr()) };
    if r < 0 {
        return Err(nix::errno::Errno::last());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftnl::{Chain, ProtoFamily, Table};

    #[test]
    fn set_attributes_read_back() {
        let key = KeySpec {
            datatype: 29453,
            len: 12,
            concat_fields: vec![4, 1, 2],
        };
        let mut set = NlSet::new(c"t", c"allow4", 3, &key, NFT_SET_INTERVAL | NFT_SET_CONCAT);
        assert_eq!(set.get_u32(sys::NFTNL_SET_KEY_TYPE), 29453);
        assert_eq!(set.get_u32(sys::NFTNL_SET_KEY_LEN), 12);
        assert_eq!(set.get_u32(sys::NFTNL_SET_FLAGS), 0x84);
        assert_eq!(set.get_u32(sys::NFTNL_SET_ID), 3);
        assert!(set.is_empty());
        set.push(&Elem {
            key: vec![0; 12],
            key_end: Some(vec![1; 12]),
            ..Elem::default()
        });
        assert_eq!(set.len(), 1);
    }

    #[test]
    fn a_rule_libnftnl_cannot_read_is_placed_and_reads_as_unknown() {
        let table = Table::new(c"egress_fence", ProtoFamily::Inet);
        let chain = Chain::new(c"output", &table);
        let mut rule = Rule::new(&chain);
        rule.add_expr(&Expr::log(c"x", None));
        let dumped = describe_rule(&rule).expect("libnftnl reads its own rule");
        assert_eq!(dumped.chain, "output");
        assert!(matches!(dumped.exprs[..], [LiveExpr::Log { .. }]));

        // The same message with an expression named as none libnftnl 1.2.4 knows ("inner",
        // from Linux 6.2 and libnftnl 1.2.5, is one): the name is patched in place.
        let mut buf = vec![0u32; nftnl::nft_nlmsg_maxsize() as usize / 4];
        // SAFETY: as in `describe_rule`.
        let len = unsafe {
            rule.write(buf.as_mut_ptr().cast::<c_void>(), 0, MsgType::Add);
            (*buf.as_ptr().cast::<libc::nlmsghdr>()).nlmsg_len as usize
        };
        let mut bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).take(len).collect();
        let at = bytes
            .windows(4)
            .position(|w| w == b"log\0")
            .expect("the expression's name");
        bytes[at..at + 3].copy_from_slice(b"lxg");
        let dumped = parse_rule(&bytes).expect("placed although unreadable");
        assert_eq!(
            (dumped.table.as_str(), dumped.chain.as_str()),
            ("egress_fence", "output")
        );
        assert!(matches!(dumped.exprs[..], [LiveExpr::Other(_)]));
    }

    #[test]
    fn a_message_shorter_than_its_header_says_is_not_parsed() {
        let table = Table::new(c"egress_fence", ProtoFamily::Inet);
        let chain = Chain::new(c"output", &table);
        let mut rule = Rule::new(&chain);
        rule.add_expr(&Expr::log(c"x", None));
        let mut buf = vec![0u32; nftnl::nft_nlmsg_maxsize() as usize / 4];
        // SAFETY: as in `describe_rule`.
        let len = unsafe {
            rule.write(buf.as_mut_ptr().cast::<c_void>(), 0, MsgType::Add);
            (*buf.as_ptr().cast::<libc::nlmsghdr>()).nlmsg_len as usize
        };
        let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).take(len).collect();
        assert!(parse_rule(&bytes).is_some());
        // libnftnl would read on past the end, as far as the header claims.
        assert!(parse_rule(&bytes[..len - 4]).is_none());
        assert!(parse_rule(&bytes[..16]).is_none());
    }

    #[test]
    fn large_element_lists_are_split_across_messages() {
        let key = KeySpec {
            datatype: 7,
            len: 4,
            concat_fields: vec![],
        };
        let mut set = NlSet::new(c"t", c"s", 1, &key, 0);
        for i in 0..20_000u32 {
            set.push(&Elem {
                key: i.to_be_bytes().to_vec(),
                ..Elem::default()
            });
        }
        let table = Table::new(c"t", ProtoFamily::Inet);
        let mut batch = nftnl::Batch::new();
        batch.add(&table, MsgType::Add);
        let messages = set.add_elements_to(&mut batch, ElemOp::Create);
        assert!(
            messages > 1,
            "20,000 elements cannot fit one 64 KiB message"
        );
        let _ = Chain::new(c"c", &table);
    }
}
