//! Netlink, spoken by hand on plain sockets (no libmnl for these families, no `unsafe`): one
//! codec for every family egress-fence uses.
//!
//! * [`message`]: the message header, the walk over a datagram, acknowledgements and errors,
//!   the nfnetlink header, multi-part dumps, and requests built from their parts;
//! * [`attr`]: attributes and nested attributes, bounds-checked;
//! * [`bytes`]: bounds-checked integer reads;
//! * [`socket`]: open, bind, send, receive, timeouts.
//!
//! Its users: NFLOG (`watch`), the nf_tables change monitor and the acknowledgements of
//! nf_tables batches and dumps (`nft`; the nf_tables objects themselves are encoded and
//! decoded by libnftnl in `nft::sys`), and the two families below, [`sockdiag`] (who owns a
//! socket), [`conntrack`] (which flows are alive) and rtnetlink's
//! interface list, [`link`] (which ports a bridge has).
//!
//! Why not the `netlink-packet-*` crates: they cover NFLOG and conntrack, but not sock_diag
//! or nf_tables notifications in the same crate family; they parse every message into owned
//! vectors of attributes, where these readers look up a handful of attributes in borrowed
//! bytes; and the whole codec here is a few hundred lines, fuzzed by its tests.

pub mod attr;
pub mod bytes;
pub mod conntrack;
pub mod link;
pub mod message;
pub mod sockdiag;
pub mod socket;

pub use attr::{Attr, Attrs};
pub use message::{DumpError, DumpProgress, Malformed, Message, Request, messages, read_dump};
pub use socket::Socket;
