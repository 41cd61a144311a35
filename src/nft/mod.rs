//! The kernel side: encode a ruleset into one batch, send it over one netlink socket, map
//! every acknowledgement back to what it carried, and read the table back.

pub mod encode;
pub mod live;
pub mod monitor;
#[allow(unsafe_code)] // the one FFI module: each block has a SAFETY note
pub mod sys;
pub mod table;

use std::collections::BTreeSet;
use std::io::{self, IoSlice};
use std::os::fd::AsRawFd;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::socket::{self, MsgFlags, NetlinkAddr, sockopt};

use crate::core::ruleset::{Ruleset, TABLE, Timed};
use crate::netlink::message::{NFNL_SUBSYS_NFTABLES, NLM_F_REQUEST, nfnl_type};
use crate::netlink::{
    self, DumpError, DumpProgress, Malformed, Message, Request, messages, read_dump,
};
use encode::Encoded;
pub use live::LiveTable;
use sys::Dump;
pub use table::Table;

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("cannot open a netlink socket to nf_tables: {0}")]
    Socket(#[source] io::Error),
    #[error("the kernel refused {what}: {errno}{}", hint(*errno))]
    Refused { what: String, errno: Errno },
    #[error("netlink {doing} failed: {source}")]
    Io {
        doing: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("no answer from the kernel to {0} within {RECV_TIMEOUT:?}")]
    Timeout(&'static str),
    #[error("the kernel sent a netlink message egress-fence cannot read ({0})")]
    Malformed(String),
    #[error("cannot build the batch: {0}")]
    Build(#[from] crate::netlink::message::Oversize),
    #[error(
        "the ruleset changed while the table was read, {0} times in a row; something is \
         rewriting it constantly (another firewall manager?)"
    )]
    Unsettled(usize),
}

fn hint(errno: Errno) -> &'static str {
    match errno {
        Errno::EPERM => {
            "; nftables needs CAP_NET_ADMIN (run as root, or grant it as the systemd unit \
             does; capabilities inside a private user namespace, such as PrivateUsers=yes \
             gives, do not count), and a table another process owns (`flags owner`, held \
             by a running `nft -i` or firewall daemon) refuses everyone else until that \
             process ends"
        }
        Errno::EOPNOTSUPP | Errno::ENOENT => {
            "; the kernel may lack an nftables feature egress-fence needs \
             (nf_tables with inet, set, log, limit, reject)"
        }
        _ => "",
    }
}

impl NftError {
    /// Whether this is the kernel saying "not permitted".
    pub fn is_permission(&self) -> bool {
        matches!(
            self,
            NftError::Refused {
                errno: Errno::EPERM,
                ..
            }
        )
    }

    /// Whether the kernel refused what the batch holds (a value, a feature it lacks), as
    /// opposed to lacking memory, permission or time: sending it again will not help.
    pub fn is_refusal_of_content(&self) -> bool {
        match self {
            NftError::Refused { errno, .. } => !matches!(
                errno,
                Errno::EPERM
                    | Errno::ENOMEM
                    | Errno::ENOBUFS
                    | Errno::EBUSY
                    | Errno::EAGAIN
                    | Errno::EINTR
            ),
            _ => false,
        }
    }
}

/// No single answer to a request of ours should take this long; a bound keeps a wedged
/// kernel from hanging provisioning scripts.
const RECV_TIMEOUT: Duration = Duration::from_secs(30);

/// One netlink socket to nf_tables, in the network namespace the process was in when it was
/// opened.
pub struct Nft {
    socket: mnl::Socket,
    recv_buf: Vec<u8>,
    /// The socket's send buffer as last read or set: only this process changes it, and
    /// reading it for every batch was a system call per guard answer.
    send_buffer: Option<usize>,
    /// A request failed before all of its answer was read (a timeout, a full receive buffer,
    /// a malformed reply): what is left is discarded before the next request, since every
    /// batch is numbered alike and a leftover acknowledgement would pass for the next's.
    unread: bool,
}

/// The acknowledgement an NLMSG_ERROR message carries: `None` for another message,
/// `Some(None)` for success, `Some(Some(errno))` for a refusal.
fn ack(msg: &Message<'_>) -> Result<Option<Option<Errno>>, NftError> {
    msg.error().transpose().map_err(malformed_netlink)
}

fn malformed_netlink(e: Malformed) -> NftError {
    NftError::Malformed(e.to_string())
}

impl Nft {
    pub fn open() -> Result<Nft, NftError> {
        let socket = mnl::Socket::new(mnl::Bus::Netfilter).map_err(NftError::Socket)?;
        // libmnl opens it without SOCK_CLOEXEC: no program this process starts (pasta, the
        // inside of `exec`) may read its acknowledgements and dumps.
        nix::fcntl::fcntl(
            sys::socket_fd(&socket),
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )
        .map_err(|e| NftError::Socket(e.into()))?;
        netlink::socket::set_recv_timeout(sys::socket_fd(&socket), Some(RECV_TIMEOUT))
            .map_err(|e| NftError::Socket(e.into()))?;
        sys::cap_acks(&socket).map_err(NftError::Socket)?;
        // Room for the acknowledgements of a large batch (best effort).
        let _ = socket::setsockopt(&sys::socket_fd(&socket), sockopt::RcvBufForce, &(1 << 20));
        Ok(Nft {
            socket,
            recv_buf: vec![0; 2 * nftnl::nft_nlmsg_maxsize() as usize],
            send_buffer: None,
            unread: false,
        })
    }

    /// The netlink port of this socket: change notifications name it as their origin.
    pub fn portid(&self) -> u32 {
        self.socket.portid()
    }

    /// Adds or renews resolved elements (a refresh) in one transaction.
    pub fn upsert_resolved(&mut self, elements: &[Timed]) -> Result<(), NftError> {
        if elements.is_empty() {
            return Ok(());
        }
        self.send(&encode::upsert_resolved(elements)?)
    }

    /// Replaces the table with `ruleset` in one transaction.
    pub fn apply(&mut self, ruleset: &Ruleset) -> Result<(), NftError> {
        self.send(&encode::replace_table(ruleset))
    }

    /// Deletes the table; `false` if there was none. Nothing else is touched.
    pub fn teardown(&mut self) -> Result<bool, NftError> {
        let existed = self.table_exists()?;
        self.send(&encode::delete_table())?;
        Ok(existed)
    }

    /// Sends a finalized batch as one datagram (the kernel runs a batch only if it arrives
    /// whole) and waits for every acknowledgement.
    pub fn send(&mut self, encoded: &Encoded) -> Result<(), NftError> {
        self.request(|nft| nft.send_and_read(encoded))
    }

    /// Runs one request and its answer on the socket: first drops whatever a failed request
    /// left queued, and notes whether this one leaves some. A refusal is read to its end; any
    /// other failure may leave answers behind.
    fn request<T>(
        &mut self,
        exchange: impl FnOnce(&mut Nft) -> Result<T, NftError>,
    ) -> Result<T, NftError> {
        if std::mem::take(&mut self.unread) {
            let fd = sys::socket_fd(&self.socket);
            while netlink::socket::recv(fd, &mut self.recv_buf, MsgFlags::MSG_DONTWAIT).is_ok() {}
        }
        let result = exchange(self);
        self.unread = matches!(&result, Err(e) if !matches!(e, NftError::Refused { .. }));
        result
    }

    fn send_and_read(&mut self, encoded: &Encoded) -> Result<(), NftError> {
        let datagram = encoded.pages();
        let pages: Vec<IoSlice<'_>> = datagram.iter().map(|p| IoSlice::new(p)).collect();
        let total: usize = pages.iter().map(|p| p.len()).sum();
        let fd = sys::socket_fd(&self.socket);
        // The datagram must fit the send buffer; as root we may raise it past the sysctl cap.
        let current = match self.send_buffer {
            Some(size) => size,
            None => socket::getsockopt(&fd, sockopt::SndBuf).unwrap_or(0),
        };
        self.send_buffer = Some(current);
        if current < total + 4096 {
            socket::setsockopt(&fd, sockopt::SndBufForce, &(total + 4096))
                .map_err(|e| io_error("send buffer setup", e))?;
            // The kernel doubles what it is given (for its bookkeeping): read back what it set.
            self.send_buffer = socket::getsockopt(&fd, sockopt::SndBuf).ok();
        }
        let kernel = NetlinkAddr::new(0, 0);
        let sent = socket::sendmsg(
            fd.as_raw_fd(),
            &pages,
            &[],
            MsgFlags::empty(),
            Some(&kernel),
        )
        .map_err(|e| io_error("send", e))?;
        if sent != total {
            return Err(NftError::Malformed(format!("sent {sent} of {total} bytes")));
        }

        let mut waiting: BTreeSet<u32> = encoded.change_seqs().collect();
        // BEGIN (numbered 0 when the kernel cannot acknowledge it) and END are answered only
        // with an error: one refuses the whole batch.
        let batch = encoded.sequence_numbers();
        let ours = |seq: u32| seq == 0 || batch.contains(&seq);
        let mut refused: Option<(u32, Errno)> = None;
        // After a refusal everything the kernel sends is read, awaited or not: it answers the
        // batch before sendmsg returns, and a failed commit's error for the first change is
        // followed by that change's acknowledgement. Left queued, it would pass for the next
        // batch's (the sequence numbers of every batch are the same) and make a refused
        // change of that batch read as accepted.
        while !waiting.is_empty() || refused.is_some() {
            // After a refusal the kernel has aborted the batch; take what it still sends
            // without waiting for acknowledgements that may never come.
            let flags = if refused.is_some() {
                MsgFlags::MSG_DONTWAIT
            } else {
                MsgFlags::empty()
            };
            let n = match netlink::socket::recv(fd, &mut self.recv_buf, flags) {
                Ok(n) => n,
                Err(Errno::EAGAIN) if refused.is_some() => break,
                Err(Errno::EAGAIN) => return Err(NftError::Timeout("the batch")),
                Err(e) => return Err(io_error("receive", e)),
            };
            for msg in messages(self.recv_buf.get(..n).unwrap_or_default()) {
                let msg = msg.map_err(malformed_netlink)?;
                let Some(errno) = ack(&msg)? else { continue };
                let awaited = waiting.remove(&msg.seq);
                let refusal_of_ours = errno.is_some() && ours(msg.seq);
                if !(awaited || refusal_of_ours) {
                    continue;
                }
                if let Some(errno) = errno
                    && refused.is_none()
                {
                    refused = Some((msg.seq, errno));
                }
            }
        }
        match refused {
            Some((seq, errno)) => Err(NftError::Refused {
                what: encoded.label(seq),
                errno,
            }),
            None => Ok(()),
        }
    }

    /// Sends a dump request and collects the messages of the answer.
    fn dump(&mut self, request: &[u8], what: &'static str) -> Result<Vec<Vec<u8>>, NftError> {
        self.request(|nft| nft.dump_and_read(request, what))
    }

    fn dump_and_read(
        &mut self,
        request: &[u8],
        what: &'static str,
    ) -> Result<Vec<Vec<u8>>, NftError> {
        let fd = sys::socket_fd(&self.socket);
        netlink::socket::send(fd, request).map_err(|e| io_error("dump request", e))?;
        let mut out = Vec::new();
        loop {
            let n = match netlink::socket::recv(fd, &mut self.recv_buf, MsgFlags::empty()) {
                Ok(n) => n,
                Err(Errno::EAGAIN) => return Err(NftError::Timeout(what)),
                Err(e) => return Err(io_error("receive", e)),
            };
            let datagram = self.recv_buf.get(..n).unwrap_or_default();
            match read_dump(datagram, |msg| out.push(msg.bytes.to_vec())) {
                Ok(DumpProgress::More) => {}
                Ok(DumpProgress::Done) => return Ok(out),
                Err(DumpError::Refused(errno)) => {
                    return Err(NftError::Refused {
                        what: format!("listing {what}"),
                        errno,
                    });
                }
                Err(DumpError::Malformed(e)) => return Err(malformed_netlink(e)),
            }
        }
    }

    /// Dumps one kind of object of our table; the table filter is applied here too, as not
    /// every kernel honours it in dumps.
    fn dump_own<T>(
        &mut self,
        kind: Dump,
        what: &'static str,
        parse: fn(&[u8]) -> Option<T>,
        table_of: fn(&T) -> &String,
    ) -> Result<Vec<T>, NftError> {
        let request = sys::dump_request(kind, &encode::table_name(), None, 0);
        let mut out = Vec::new();
        for msg in self.dump(&request, what)? {
            let obj = parse(&msg).ok_or_else(|| malformed(what))?;
            if table_of(&obj) == TABLE {
                out.push(obj);
            }
        }
        Ok(out)
    }

    /// The ruleset's generation: the kernel counts every committed transaction, anyone's.
    pub fn generation(&mut self) -> Result<u32, NftError> {
        self.request(Nft::generation_and_read)
    }

    fn generation_and_read(&mut self) -> Result<u32, NftError> {
        let request =
            generation_request().map_err(|_| io_error("generation request", Errno::EMSGSIZE))?;
        let fd = sys::socket_fd(&self.socket);
        netlink::socket::send(fd, &request).map_err(|e| io_error("generation request", e))?;
        loop {
            let n = match netlink::socket::recv(fd, &mut self.recv_buf, MsgFlags::empty()) {
                Ok(n) => n,
                Err(Errno::EAGAIN) => return Err(NftError::Timeout("the generation request")),
                Err(e) => return Err(io_error("receive", e)),
            };
            for msg in messages(self.recv_buf.get(..n).unwrap_or_default()) {
                let msg = msg.map_err(malformed_netlink)?;
                if let Some(Some(errno)) = ack(&msg)? {
                    return Err(NftError::Refused {
                        what: "reading the ruleset generation".into(),
                        errno,
                    });
                }
                if msg.kind == nfnl_type(NFNL_SUBSYS_NFTABLES, NFT_MSG_NEWGEN) {
                    return generation_id(&msg)
                        .ok_or_else(|| NftError::Malformed("a generation message".into()));
                }
            }
        }
    }

    pub fn table_exists(&mut self) -> Result<bool, NftError> {
        Ok(self.table_flags()?.is_some())
    }

    /// The flags of our table (`NFT_TABLE_F_DORMANT`: switched off), if it exists.
    fn table_flags(&mut self) -> Result<Option<u32>, NftError> {
        Ok(self.table_attrs()?.map(|(flags, _)| flags))
    }

    /// Our table's flags and handle, if it exists. The kernel gives each table it makes a
    /// handle of its own, never given again in the namespace: a table applied anew (a
    /// reload, a heal) has another.
    fn table_attrs(&mut self) -> Result<Option<(u32, u64)>, NftError> {
        let request = sys::dump_request(Dump::Tables, &encode::table_name(), None, 0);
        let tables = self.dump(&request, "tables")?;
        Ok(tables
            .iter()
            .filter_map(|m| sys::parse_table(m))
            .find(|(family, name, ..)| *family == libc::NFPROTO_INET as u32 && name == TABLE)
            .map(|(_, _, flags, handle)| (flags, handle)))
    }

    /// The NFLOG group the installed table logs refusals to: `None` when no table is
    /// installed, `Some(None)` when it logs to the kernel log instead.
    pub fn log_group(&mut self) -> Result<Option<Option<u16>>, NftError> {
        if !self.table_exists()? {
            return Ok(None);
        }
        let rules = self.read_rules()?;
        Ok(Some(live::log_group(&rules)))
    }

    /// What the installed table's refused chain counted, per family, read from its rules
    /// alone (no sets), with the table's handle: `None` when no table of ours is installed.
    /// Cheap enough to ask every second. The handle is read first: a table applied anew
    /// between the two reads has its counters read under the old handle, and the next
    /// reading, under the new one, tells it from the old.
    pub fn refused_counters(&mut self) -> Result<Option<(u64, live::Refused)>, NftError> {
        let Some((_, handle)) = self.table_attrs()? else {
            return Ok(None);
        };
        Ok(live::refused_counters(&self.read_rules()?).map(|r| (handle, r)))
    }

    /// The rules of our table, decoded.
    fn read_rules(&mut self) -> Result<Vec<live::LiveRule>, NftError> {
        let dumped = self.dump_own(Dump::Rules, "rules", sys::parse_rule, |r| &r.table)?;
        Ok(dumped.into_iter().map(live::LiveRule::decode).collect())
    }

    /// Reads the table back from the kernel; `None` if it is not installed. The table is read
    /// in several dumps; a transaction between them (the ruleset generation moved) would mix
    /// two tables, so the read is repeated until one falls within a single generation.
    pub fn read_table(&mut self) -> Result<Option<LiveTable>, NftError> {
        for _ in 0..READ_ATTEMPTS {
            let before = self.generation()?;
            let table = self.read_table_once()?;
            if self.generation()? == before {
                return Ok(table);
            }
        }
        Err(NftError::Unsettled(READ_ATTEMPTS))
    }

    fn read_table_once(&mut self) -> Result<Option<LiveTable>, NftError> {
        let Some(flags) = self.table_flags()? else {
            return Ok(None);
        };
        let table = encode::table_name();
        let chains = self.dump_own(Dump::Chains, "chains", sys::parse_chain, |c| &c.table)?;
        let rules = self.read_rules()?;
        let sets = self.dump_own(Dump::Sets, "sets", sys::parse_set, |s| &s.table)?;
        let mut objects =
            self.dump_own(Dump::Objects, "objects", sys::parse_object, |o| &o.table)?;
        objects.extend(self.dump_own(
            Dump::Flowtables,
            "flowtables",
            sys::parse_flowtable,
            |f| &f.table,
        )?);
        let mut with_elements = Vec::new();
        for set in sets {
            let name =
                std::ffi::CString::new(set.name.as_str()).map_err(|_| malformed("a set name"))?;
            let request = sys::dump_request(Dump::Elements, &table, Some(&name), 0);
            let mut elems = Vec::new();
            for m in self.dump(&request, "set elements")? {
                elems.extend(sys::parse_elems(&m).ok_or_else(|| malformed("set elements"))?);
            }
            with_elements.push((set, elems));
        }
        Ok(Some(LiveTable {
            flags,
            chains,
            rules,
            sets: with_elements,
            objects,
        }))
    }
}

/// How many times [`Nft::read_table`] starts again when a transaction lands during a read:
/// the daemon's refreshes land every few seconds at most, so more than a few in a row means
/// something rewrites the ruleset without pause.
const READ_ATTEMPTS: usize = 8;

const NFT_MSG_GETGEN: u8 = 16;
const NFT_MSG_NEWGEN: u8 = 15;
const NFTA_GEN_ID: u16 = 1;

/// NFT_MSG_GETGEN: nfgenmsg with family unspec, resource 0.
fn generation_request() -> Result<Vec<u8>, netlink::message::Oversize> {
    Request::new(
        nfnl_type(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETGEN),
        NLM_F_REQUEST,
        0,
    )
    .nfgenmsg(libc::AF_UNSPEC as u8, 0)
    .finish()
}

/// The generation an NFT_MSG_NEWGEN message carries (NFTA_GEN_ID, big-endian).
fn generation_id(msg: &Message<'_>) -> Option<u32> {
    let (_, attrs) = msg.nfgenmsg().ok()?;
    let id: [u8; 4] = attrs.value(NFTA_GEN_ID)?.try_into().ok()?;
    Some(u32::from_be_bytes(id))
}

fn malformed(what: &str) -> NftError {
    NftError::Malformed(format!("a message listing {what}"))
}

fn io_error(doing: &'static str, e: Errno) -> NftError {
    NftError::Io {
        doing,
        source: e.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No program this process starts (`exec`'s pasta and inside) inherits the netfilter
    /// socket: libmnl opens it without SOCK_CLOEXEC. Opening one needs no privilege.
    #[test]
    fn the_netfilter_socket_is_close_on_exec() {
        let nft = Nft::open().expect("a netfilter socket");
        let flags = nix::fcntl::fcntl(sys::socket_fd(&nft.socket), nix::fcntl::FcntlArg::F_GETFD)
            .expect("its descriptor flags");
        assert!(
            nix::fcntl::FdFlag::from_bits_truncate(flags).contains(nix::fcntl::FdFlag::FD_CLOEXEC)
        );
    }

    #[test]
    fn the_generation_request_and_answer() {
        let r = generation_request().unwrap();
        assert_eq!(r.len(), 20);
        assert_eq!(&r[4..6], &0x0a10u16.to_ne_bytes());
        assert_eq!(&r[6..8], &1u16.to_ne_bytes());
        assert_eq!(&r[16..20], &[0, 0, 0, 0]);

        let answer = |attrs: &[(u16, &[u8])]| {
            let kind = nfnl_type(NFNL_SUBSYS_NFTABLES, NFT_MSG_NEWGEN);
            attrs
                .iter()
                .fold(Request::new(kind, 0, 0).nfgenmsg(0, 0), |r, (k, v)| {
                    r.attr(*k, v)
                })
                .finish()
                .unwrap()
        };
        let good = answer(&[(NFTA_GEN_ID, &42u32.to_be_bytes()), (3, b"nft\0")]);
        let msg = Message::parse(&good).unwrap();
        assert_eq!(generation_id(&msg), Some(42));
        // A short id, a missing one, an id whose length runs past the message.
        let short = answer(&[(NFTA_GEN_ID, &[0, 42])]);
        assert_eq!(generation_id(&Message::parse(&short).unwrap()), None);
        let none = answer(&[(3, b"nft\0")]);
        assert_eq!(generation_id(&Message::parse(&none).unwrap()), None);
        let mut past = good.clone();
        past[20] = 0xf0;
        assert_eq!(generation_id(&Message::parse(&past).unwrap()), None);
    }

    #[test]
    fn acknowledgements_are_read_and_short_ones_are_malformed() {
        let error = |code: i32| {
            Request::new(libc::NLMSG_ERROR as u16, 0, 3)
                .raw(&code.to_ne_bytes())
                .raw(&[0; 16])
                .finish()
                .unwrap()
        };
        let ok = error(0);
        assert_eq!(ack(&Message::parse(&ok).unwrap()).unwrap(), Some(None));
        let refused = error(-libc::EEXIST);
        assert_eq!(
            ack(&Message::parse(&refused).unwrap()).unwrap(),
            Some(Some(Errno::EEXIST))
        );
        let mut short = ok[..18].to_vec();
        short[..4].copy_from_slice(&18u32.to_ne_bytes());
        assert!(matches!(
            ack(&Message::parse(&short).unwrap()),
            Err(NftError::Malformed(_))
        ));
        let other = generation_request().unwrap();
        assert_eq!(ack(&Message::parse(&other).unwrap()).unwrap(), None);
    }
}
