//! nf_tables change notifications: who else touched our table.
//!
//! The kernel multicasts every committed change to the NFNLGRP_NFTABLES group, each message
//! carrying the netlink port of the socket that made it. Changes to our table from any port
//! but our own mean someone edited, flushed or deleted it (`nft flush ruleset`, a firewall
//! reset in a provisioning script), and the daemon puts the boundary back.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{self, MsgFlags};

use super::{NftError, sys};
use crate::core::ruleset::TABLE;

/// libc's NFNLGRP_NFTABLES.
const NFNLGRP_NFTABLES: u32 = 7;
const NFT_MSG_NEWGEN: u16 = 15;
/// The first attribute of table, chain, rule, set and element messages names the table.
const ATTR_TABLE: u16 = 1;
const NFTA_GEN_PROC_NAME: u16 = 3;
const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;
/// Our own full apply of a large table is one notification per element: room for a few
/// thousand; beyond that an overrun is resolved by the ruleset generation (see `Drained`).
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
    socket: mnl::Socket,
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
        let socket = mnl::Socket::open(mnl::Bus::Netfilter).map_err(NftError::Socket)?;
        socket
            .bind(1 << (NFNLGRP_NFTABLES - 1), 0)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::EPERM) => NftError::Refused {
                    what: "a subscription to nftables change notifications".into(),
                    errno: Errno::EPERM,
                },
                _ => NftError::Socket(e),
            })?;
        // Best effort: without it the overrun path still keeps us right.
        let _ = socket::setsockopt(
            &sys::socket_fd(&socket),
            nix::sys::socket::sockopt::RcvBufForce,
            &RECV_BUFFER,
        );
        Ok(Monitor {
            socket,
            buf: vec![0; 2 * nftnl::nft_nlmsg_maxsize() as usize],
        })
    }

    /// Reads every pending notification without blocking: the changes to our table that a
    /// port other than `ours` made, and whether notifications were lost.
    pub fn drain(&mut self, ours: u32) -> Result<Drained, NftError> {
        let mut drained = Drained::default();
        let changes = &mut drained.changes;
        let fd = sys::socket_fd(&self.socket);
        loop {
            let n = match socket::recv(fd.as_raw_fd(), &mut self.buf, MsgFlags::MSG_DONTWAIT) {
                Ok(n) => n,
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
            for msg in mnl::NlMessages::new(&self.buf[..n]) {
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
    /// The socket overflowed and notifications were lost: whether anyone but us changed
    /// anything is then told by the ruleset generation (`Nft::generation`).
    pub overrun: bool,
}

enum Notification {
    Change(Change),
    /// The end of a transaction, with the name of the process that committed it.
    Generation {
        portid: u32,
        process: String,
    },
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The string attribute `kind` of a message's attributes, if present.
fn string_attr(attrs: &[u8], kind: u16) -> Option<String> {
    let value = super::attr(attrs, kind)?;
    let end = value.iter().position(|&b| b == 0).unwrap_or(value.len());
    Some(String::from_utf8_lossy(&value[..end]).into_owned())
}

fn parse(msg: &[u8]) -> Option<Notification> {
    let kind = u16_at(msg, 4)?;
    let portid = u32_at(msg, 12)?;
    if kind >> 8 != u16::from(super::NFNL_SUBSYS_NFTABLES) {
        return None;
    }
    let family = *msg.get(NLMSG_HDRLEN)?;
    let attrs = msg.get(NLMSG_HDRLEN + NFGENMSG_LEN..)?;
    let msg_type = kind & 0xff;
    if msg_type == NFT_MSG_NEWGEN {
        let process = string_attr(attrs, NFTA_GEN_PROC_NAME)?;
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
        && string_attr(attrs, ATTR_TABLE).as_deref() == Some(TABLE);
    ours.then_some(Notification::Change(Change {
        what,
        portid,
        process: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut a = ((4 + value.len()) as u16).to_ne_bytes().to_vec();
        a.extend_from_slice(&kind.to_ne_bytes());
        a.extend_from_slice(value);
        while !a.len().is_multiple_of(4) {
            a.push(0);
        }
        a
    }

    fn message(msg_type: u16, family: u8, portid: u32, attrs: &[Vec<u8>]) -> Vec<u8> {
        let body: Vec<u8> = attrs.concat();
        let len = (NLMSG_HDRLEN + NFGENMSG_LEN + body.len()) as u32;
        let mut m = len.to_ne_bytes().to_vec();
        m.extend_from_slice(
            &((u16::from(crate::nft::NFNL_SUBSYS_NFTABLES) << 8) | msg_type).to_ne_bytes(),
        );
        m.extend_from_slice(&0u16.to_ne_bytes());
        m.extend_from_slice(&1u32.to_ne_bytes());
        m.extend_from_slice(&portid.to_ne_bytes());
        m.extend_from_slice(&[family, 0, 0, 0]);
        m.extend_from_slice(&body);
        m
    }

    fn change(m: &[u8]) -> Option<Change> {
        match parse(m) {
            Some(Notification::Change(c)) => Some(c),
            _ => None,
        }
    }

    #[test]
    fn changes_to_our_table_are_recognised() {
        let inet = libc::NFPROTO_INET as u8;
        let ours = attr(ATTR_TABLE, b"egress_fence\0");
        let del = message(
            libc::NFT_MSG_DELTABLE as u16,
            inet,
            4242,
            std::slice::from_ref(&ours),
        );
        assert_eq!(
            change(&del),
            Some(Change {
                what: "table deleted",
                portid: 4242,
                process: None
            })
        );
        let rule = message(
            libc::NFT_MSG_DELRULE as u16,
            inet,
            7,
            std::slice::from_ref(&ours),
        );
        assert_eq!(change(&rule).map(|c| c.what), Some("rule deleted"));
    }

    #[test]
    fn other_tables_and_families_are_ignored() {
        let other = attr(ATTR_TABLE, b"docker\0");
        let inet = libc::NFPROTO_INET as u8;
        assert_eq!(change(&message(2, inet, 1, &[other])), None);
        let ours = attr(ATTR_TABLE, b"egress_fence\0");
        assert_eq!(
            change(&message(2, libc::NFPROTO_IPV4 as u8, 1, &[ours])),
            None
        );
    }

    #[test]
    fn generations_name_the_process_and_garbage_is_ignored() {
        let generation = message(
            NFT_MSG_NEWGEN,
            0,
            99,
            &[
                attr(1, &7u32.to_be_bytes()),
                attr(NFTA_GEN_PROC_NAME, b"nft\0"),
            ],
        );
        match parse(&generation) {
            Some(Notification::Generation { portid, process }) => {
                assert_eq!((portid, process.as_str()), (99, "nft"));
            }
            _ => panic!("a NEWGEN message"),
        }
        assert!(parse(&[1, 2, 3]).is_none());
        let mut broken = message(2, 1, 1, &[attr(ATTR_TABLE, b"egress_fence\0")]);
        broken[NLMSG_HDRLEN + NFGENMSG_LEN] = 200; // attribute length past the end
        assert!(change(&broken).is_none());
    }
}
