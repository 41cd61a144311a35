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
}

fn hint(errno: Errno) -> &'static str {
    match errno {
        Errno::EPERM => {
            "; nftables needs CAP_NET_ADMIN (run as root, or grant it as the systemd unit \
             does; capabilities inside a private user namespace, such as PrivateUsers=yes \
             gives, do not count)"
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
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;

/// One netlink socket to nf_tables, in the network namespace the process was in when it was
/// opened.
pub struct Nft {
    socket: mnl::Socket,
    recv_buf: Vec<u8>,
}

/// The header fields of one netlink message, read from its bytes.
struct Header {
    kind: u16,
    seq: u32,
    /// For NLMSG_ERROR: 0 for an acknowledgement, else the errno the kernel reported.
    error: i32,
}

fn header(msg: &[u8]) -> Result<Header, NftError> {
    let word = |at: usize| -> Option<[u8; 4]> { msg.get(at..at + 4)?.try_into().ok() };
    let malformed = || NftError::Malformed(format!("{} byte message", msg.len()));
    let kind_flags = word(4).ok_or_else(malformed)?;
    let kind = u16::from_ne_bytes([kind_flags[0], kind_flags[1]]);
    let seq = u32::from_ne_bytes(word(8).ok_or_else(malformed)?);
    let error = if kind == NLMSG_ERROR {
        -i32::from_ne_bytes(word(16).ok_or_else(malformed)?)
    } else {
        0
    };
    Ok(Header { kind, seq, error })
}

impl Nft {
    pub fn open() -> Result<Nft, NftError> {
        let socket = mnl::Socket::new(mnl::Bus::Netfilter).map_err(NftError::Socket)?;
        socket::setsockopt(
            &sys::socket_fd(&socket),
            sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(RECV_TIMEOUT.as_secs() as _, 0),
        )
        .map_err(|e| NftError::Socket(e.into()))?;
        sys::cap_acks(&socket).map_err(NftError::Socket)?;
        // Room for the acknowledgements of a large batch (best effort).
        let _ = socket::setsockopt(&sys::socket_fd(&socket), sockopt::RcvBufForce, &(1 << 20));
        Ok(Nft {
            socket,
            recv_buf: vec![0; 2 * nftnl::nft_nlmsg_maxsize() as usize],
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
        self.send(&encode::upsert_resolved(elements))
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
        let pages: Vec<IoSlice<'_>> = encoded.batch.iter().map(IoSlice::new).collect();
        let total: usize = pages.iter().map(|p| p.len()).sum();
        let fd = sys::socket_fd(&self.socket);
        // The datagram must fit the send buffer; as root we may raise it past the sysctl cap.
        let current = socket::getsockopt(&fd, sockopt::SndBuf).unwrap_or(0);
        if current < total + 4096 {
            socket::setsockopt(&fd, sockopt::SndBufForce, &(total + 4096))
                .map_err(|e| io_error("send buffer setup", e))?;
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

        let mut waiting: BTreeSet<u32> = encoded.batch.sequence_numbers().collect();
        let mut refused: Option<(u32, Errno)> = None;
        while !waiting.is_empty() {
            // After a refusal the kernel has aborted the batch; take what it still sends
            // without waiting for acknowledgements that may never come.
            let flags = if refused.is_some() {
                MsgFlags::MSG_DONTWAIT
            } else {
                MsgFlags::empty()
            };
            let n = match socket::recv(fd.as_raw_fd(), &mut self.recv_buf, flags) {
                Ok(n) => n,
                Err(Errno::EAGAIN) if refused.is_some() => break,
                Err(Errno::EAGAIN) => return Err(NftError::Timeout("the batch")),
                Err(e) => return Err(io_error("receive", e)),
            };
            for msg in mnl::NlMessages::new(&self.recv_buf[..n]) {
                let msg = msg.map_err(|e| NftError::Malformed(e.to_string()))?;
                let h = header(msg)?;
                if h.kind != NLMSG_ERROR || !waiting.remove(&h.seq) {
                    continue;
                }
                if h.error != 0 && refused.is_none() {
                    refused = Some((h.seq, Errno::from_raw(h.error)));
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
        let fd = sys::socket_fd(&self.socket);
        let kernel = NetlinkAddr::new(0, 0);
        socket::sendto(fd.as_raw_fd(), request, &kernel, MsgFlags::empty())
            .map_err(|e| io_error("dump request", e))?;
        let mut out = Vec::new();
        loop {
            let n = match socket::recv(fd.as_raw_fd(), &mut self.recv_buf, MsgFlags::empty()) {
                Ok(n) => n,
                Err(Errno::EAGAIN) => return Err(NftError::Timeout(what)),
                Err(e) => return Err(io_error("receive", e)),
            };
            for msg in mnl::NlMessages::new(&self.recv_buf[..n]) {
                let msg = msg.map_err(|e| NftError::Malformed(e.to_string()))?;
                let h = header(msg)?;
                match h.kind {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR if h.error != 0 => {
                        return Err(NftError::Refused {
                            what: format!("listing {what}"),
                            errno: Errno::from_raw(h.error),
                        });
                    }
                    NLMSG_ERROR => {}
                    _ => out.push(msg.to_vec()),
                }
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
        const NFT_MSG_GETGEN: u16 = 16;
        const NFT_MSG_NEWGEN: u16 = 15;
        const NFTA_GEN_ID: u16 = 1;
        let subsys = u16::from(NFNL_SUBSYS_NFTABLES) << 8;
        // nlmsghdr, then nfgenmsg (family unspec, version 0, resource 0).
        let mut request = 20u32.to_ne_bytes().to_vec();
        request.extend_from_slice(&(subsys | NFT_MSG_GETGEN).to_ne_bytes());
        request.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
        request.extend_from_slice(&0u32.to_ne_bytes());
        request.extend_from_slice(&0u32.to_ne_bytes());
        request.extend_from_slice(&[0, 0, 0, 0]);
        let fd = sys::socket_fd(&self.socket);
        socket::sendto(
            fd.as_raw_fd(),
            &request,
            &NetlinkAddr::new(0, 0),
            MsgFlags::empty(),
        )
        .map_err(|e| io_error("generation request", e))?;
        loop {
            let n = match socket::recv(fd.as_raw_fd(), &mut self.recv_buf, MsgFlags::empty()) {
                Ok(n) => n,
                Err(Errno::EAGAIN) => return Err(NftError::Timeout("the generation request")),
                Err(e) => return Err(io_error("receive", e)),
            };
            for msg in mnl::NlMessages::new(&self.recv_buf[..n]) {
                let msg = msg.map_err(|e| NftError::Malformed(e.to_string()))?;
                let h = header(msg)?;
                if h.kind == NLMSG_ERROR && h.error != 0 {
                    return Err(NftError::Refused {
                        what: "reading the ruleset generation".into(),
                        errno: Errno::from_raw(h.error),
                    });
                }
                if h.kind == subsys | NFT_MSG_NEWGEN {
                    let id = msg
                        .get(NFGEN_PAYLOAD..)
                        .and_then(|attrs| attr(attrs, NFTA_GEN_ID))
                        .and_then(|v| v.try_into().ok())
                        .map(u32::from_be_bytes)
                        .ok_or_else(|| NftError::Malformed("a generation message".into()))?;
                    return Ok(id);
                }
            }
        }
    }

    pub fn table_exists(&mut self) -> Result<bool, NftError> {
        let request = sys::dump_request(Dump::Tables, &encode::table_name(), None, 0);
        let tables = self.dump(&request, "tables")?;
        Ok(tables
            .iter()
            .filter_map(|m| sys::parse_table(m))
            .any(|(_, name)| name == TABLE))
    }

    /// The NFLOG group the installed table logs refusals to: `None` when no table is
    /// installed, `Some(None)` when it logs to the kernel log instead.
    pub fn log_group(&mut self) -> Result<Option<Option<u16>>, NftError> {
        if !self.table_exists()? {
            return Ok(None);
        }
        let rules = self.dump_own(Dump::Rules, "rules", sys::parse_rule, |r| &r.table)?;
        Ok(Some(live::log_group(&rules)))
    }

    /// Reads the table back from the kernel; `None` if it is not installed.
    pub fn read_table(&mut self) -> Result<Option<LiveTable>, NftError> {
        if !self.table_exists()? {
            return Ok(None);
        }
        let table = encode::table_name();
        let chains = self.dump_own(Dump::Chains, "chains", sys::parse_chain, |c| &c.table)?;
        let rules = self.dump_own(Dump::Rules, "rules", sys::parse_rule, |r| &r.table)?;
        let sets = self.dump_own(Dump::Sets, "sets", sys::parse_set, |s| &s.table)?;
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
            chains,
            rules,
            sets: with_elements,
        }))
    }
}

/// nf_tables messages carry their attributes after the netlink header and the nfgenmsg.
const NFGEN_PAYLOAD: usize = 16 + 4;
/// libc's NFNL_SUBSYS_NFTABLES.
const NFNL_SUBSYS_NFTABLES: u8 = 10;

/// The value of netlink attribute `kind` among `attrs`, if present.
fn attr(attrs: &[u8], kind: u16) -> Option<&[u8]> {
    let mut at = 0;
    while at + 4 <= attrs.len() {
        let len = usize::from(u16::from_ne_bytes([attrs[at], attrs[at + 1]]));
        if len < 4 || at + len > attrs.len() {
            return None;
        }
        // Without NLA_F_NESTED and NLA_F_NET_BYTEORDER.
        if u16::from_ne_bytes([attrs[at + 2], attrs[at + 3]]) & 0x3fff == kind {
            return Some(&attrs[at + 4..at + len]);
        }
        at += len.div_ceil(4) * 4;
    }
    None
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
