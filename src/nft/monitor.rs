//! nf_tables change notifications: who else touched our table.
//!
//! The kernel multicasts every committed change to the NFNLGRP_NFTABLES group, each message
//! carrying the netlink port of the socket that made it. Changes to our table from any port
//! but our own mean someone edited, flushed or deleted it (`nft flush ruleset`, a firewall
//! reset in a provisioning script), and the daemon puts the boundary back.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{MsgFlags, SockProtocol};

use super::NftError;
use crate::core::ruleset::TABLE;
use crate::netlink::message::NFNL_SUBSYS_NFTABLES;
use crate::netlink::{Message, Socket, messages};

/// libc's NFNLGRP_NFTABLES.
const NFNLGRP_NFTABLES: u32 = 7;
const NFT_MSG_NEWGEN: u16 = 15;
/// The first attribute of table, chain, rule, set and element messages names the table.
const ATTR_TABLE: u16 = 1;
const NFTA_GEN_PROC_NAME: u16 = 3;
/// Room for a burst of someone else's notifications (one per element of a table loaded)
/// while the daemon is busy; beyond that they are lost (see [`Drained::overrun`]).
const RECV_BUFFER: usize = 4 << 20;

/// A change to our table made by someone else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// What happened: "table deleted", "rule added", ...
    pub what: &'static str,
    /// The netlink port that made it (usually the process id of its first socket).
    pub portid: u32,
    /// The process name the kernel reported for the transaction, if it did.
    pub process: Option<String>,
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} by netlink port {}", self.what, self.portid)?;
        if let Some(p) = &self.process {
            write!(f, " ({p})")?;
        }
        Ok(())
    }
}

pub struct Monitor {
    socket: Socket,
    buf: Vec<u8>,
}

impl AsRawFd for Monitor {
    fn as_raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}

impl Monitor {
    /// Subscribes to change notifications in the current network namespace.
    pub fn open() -> Result<Monitor, NftError> {
        let socket =
            Socket::open(SockProtocol::NetlinkNetFilter).map_err(|e| NftError::Socket(e.into()))?;
        socket
            .bind(1 << (NFNLGRP_NFTABLES - 1))
            .map_err(|e| match e {
                Errno::EPERM => NftError::Refused {
                    what: "a subscription to nftables change notifications".into(),
                    errno: Errno::EPERM,
                },
                e => NftError::Socket(e.into()),
            })?;
        // Best effort: without it the overrun path still keeps us right.
        let _ = socket.force_recv_buffer(RECV_BUFFER);
        Ok(Monitor {
            socket,
            buf: vec![0; 2 * nftnl::nft_nlmsg_maxsize() as usize],
        })
    }

    /// Has the kernel drop the notifications of the transactions sent from netlink port
    /// `ours` before they are queued: they are the most of what arrives here (every element
    /// a guard answer installs, every element of a full apply), and each would wake the
    /// daemon to be read and skipped. Nor can they fill the buffer any more, so that lost
    /// notifications always mean someone else's burst (see [`Drained::overrun`]).
    pub fn ignore_port(&self, ours: u32) -> Result<(), NftError> {
        self.socket
            .drop_from_port(ours)
            .map_err(|source| NftError::Io {
                doing: "filter our own notifications out",
                source,
            })
    }

    /// Reads every pending notification without blocking: the changes to our table that a
    /// port other than `ours` made, and whether notifications were lost.
    pub fn drain(&mut self, ours: u32) -> Result<Drained, NftError> {
        let mut drained = Drained::default();
        let changes = &mut drained.changes;
        loop {
            let n = match self.socket.recv(&mut self.buf, MsgFlags::MSG_DONTWAIT) {
                Ok(n) => {
                    drained.datagrams += 1;
                    n
                }
                Err(Errno::EAGAIN) => return Ok(drained),
                Err(Errno::ENOBUFS) => {
                    drained.overrun = true;
                    continue;
                }
                Err(e) => {
                    return Err(NftError::Io {
                        doing: "receive notifications",
                        source: io::Error::from(e),
                    });
                }
            };
            for msg in messages(self.buf.get(..n).unwrap_or_default()) {
                let msg = msg.map_err(|e| NftError::Malformed(e.to_string()))?;
                match parse(msg) {
                    Some(Notification::Change(c)) if c.portid != ours => changes.push(c),
                    Some(Notification::Generation { portid, process }) => {
                        for c in changes.iter_mut().filter(|c| c.portid == portid) {
                            c.process.get_or_insert_with(|| process.clone());
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

/// What one drain of the notification socket found.
#[derive(Debug, Default)]
pub struct Drained {
    pub changes: Vec<Change>,
    /// The socket overflowed and notifications were lost. Ours never reach it
    /// ([`Monitor::ignore_port`]): someone else's burst filled it, and what it changed is
    /// unknown.
    pub overrun: bool,
    /// How many datagrams were read (ours the kernel drops before they are queued).
    pub datagrams: usize,
}

enum Notification {
    Change(Change),
    /// The end of a transaction, with the name of the process that committed it.
    Generation {
        portid: u32,
        process: String,
    },
}

fn parse(msg: Message<'_>) -> Option<Notification> {
    let portid = msg.portid;
    if msg.kind >> 8 != u16::from(NFNL_SUBSYS_NFTABLES) {
        return None;
    }
    let (nfgen, attrs) = msg.nfgenmsg().ok()?;
    let family = nfgen.family;
    let msg_type = msg.kind & 0xff;
    if msg_type == NFT_MSG_NEWGEN {
        let process = attrs.find(NFTA_GEN_PROC_NAME)?.string();
        return Some(Notification::Generation { portid, process });
    }
    let what = match i32::from(msg_type) {
        libc::NFT_MSG_NEWTABLE => "table changed",
        libc::NFT_MSG_DELTABLE => "table deleted",
        libc::NFT_MSG_NEWCHAIN => "chain added",
        libc::NFT_MSG_DELCHAIN => "chain deleted",
        libc::NFT_MSG_NEWRULE => "rule added",
        libc::NFT_MSG_DELRULE => "rule deleted",
        libc::NFT_MSG_NEWSET => "set added",
        libc::NFT_MSG_DELSET => "set deleted",
        libc::NFT_MSG_NEWSETELEM => "set elements added",
        libc::NFT_MSG_DELSETELEM => "set elements deleted",
        _ => "object changed",
    };
    let ours = family == libc::NFPROTO_INET as u8
        && attrs.find(ATTR_TABLE).map(|a| a.string()).as_deref() == Some(TABLE);
    ours.then_some(Notification::Change(Change {
        what,
        portid,
        process: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::Request;
    use crate::netlink::message::{NFGENMSG_LEN, NLMSG_HDRLEN, nfnl_type};

    fn message(msg_type: u16, family: u8, portid: u32, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let kind = nfnl_type(NFNL_SUBSYS_NFTABLES, msg_type as u8);
        let mut m = attrs
            .iter()
            .fold(Request::new(kind, 0, 1).nfgenmsg(family, 0), |r, (k, v)| {
                r.attr(*k, v)
            })
            .finish()
            .unwrap();
        m[12..16].copy_from_slice(&portid.to_ne_bytes());
        m
    }

    fn parse_bytes(m: &[u8]) -> Option<Notification> {
        parse(Message::parse(m).ok()?)
    }

    fn change(m: &[u8]) -> Option<Change> {
        match parse_bytes(m) {
            Some(Notification::Change(c)) => Some(c),
            _ => None,
        }
    }

    const OURS: (u16, &[u8]) = (ATTR_TABLE, b"egress_fence\0");

    #[test]
    fn changes_to_our_table_are_recognised() {
        let inet = libc::NFPROTO_INET as u8;
        let del = message(libc::NFT_MSG_DELTABLE as u16, inet, 4242, &[OURS]);
        assert_eq!(
            change(&del),
            Some(Change {
                what: "table deleted",
                portid: 4242,
                process: None
            })
        );
        let rule = message(libc::NFT_MSG_DELRULE as u16, inet, 7, &[OURS]);
        assert_eq!(change(&rule).map(|c| c.what), Some("rule deleted"));
        // The kernel may flag the attribute's byte order; the type is what counts.
        let flagged = message(
            libc::NFT_MSG_NEWSET as u16,
            inet,
            7,
            &[(ATTR_TABLE | 0x4000, b"egress_fence\0")],
        );
        assert_eq!(change(&flagged).map(|c| c.what), Some("set added"));
    }

    #[test]
    fn other_tables_and_families_are_ignored() {
        let other: (u16, &[u8]) = (ATTR_TABLE, b"docker\0");
        let inet = libc::NFPROTO_INET as u8;
        assert_eq!(change(&message(2, inet, 1, &[other])), None);
        assert_eq!(
            change(&message(2, libc::NFPROTO_IPV4 as u8, 1, &[OURS])),
            None
        );
        // Another subsystem's message (conntrack, subsystem 1) with the same layout.
        let mut ct = message(2, inet, 1, &[OURS]);
        ct[4..6].copy_from_slice(&nfnl_type(1, 2).to_ne_bytes());
        assert_eq!(change(&ct), None);
    }

    #[test]
    fn generations_name_the_process_and_garbage_is_ignored() {
        let generation = message(
            NFT_MSG_NEWGEN,
            0,
            99,
            &[(1, &7u32.to_be_bytes()), (NFTA_GEN_PROC_NAME, b"nft\0")],
        );
        match parse_bytes(&generation) {
            Some(Notification::Generation { portid, process }) => {
                assert_eq!((portid, process.as_str()), (99, "nft"));
            }
            _ => panic!("a NEWGEN message"),
        }
        assert!(parse_bytes(&[1, 2, 3]).is_none());
        let mut broken = message(2, 1, 1, &[OURS]);
        broken[NLMSG_HDRLEN + NFGENMSG_LEN] = 200; // attribute length past the end
        assert!(change(&broken).is_none());
        // A message cut inside its nfgenmsg, and every truncation of a good one.
        let del = message(
            libc::NFT_MSG_DELTABLE as u16,
            libc::NFPROTO_INET as u8,
            1,
            &[OURS],
        );
        let mut cut = del[..NLMSG_HDRLEN + 2].to_vec();
        let len = cut.len() as u32;
        cut[..4].copy_from_slice(&len.to_ne_bytes());
        assert!(parse_bytes(&cut).is_none());
        // (the table's name must be whole: cut inside its value at the latest)
        for n in 0..NLMSG_HDRLEN + NFGENMSG_LEN + 4 + 12 {
            let mut m = del[..n].to_vec();
            if m.len() >= 4 {
                m[..4].copy_from_slice(&(n as u32).to_ne_bytes());
            }
            assert!(change(&m).is_none(), "{n}");
        }
    }
}
