//! The `watch` side: listen on the policy's NFLOG group and turn every logged (refused) packet
//! into a [`DropEvent`]; beside them, the queries the DNS guard refused ([`QueryEvent`]).
//!
//! Why NFLOG and not the kernel log: the plain `log` statement writes to the kernel log only from
//! the initial network namespace (unless `net.netfilter.nf_log_all_netns=1`), and scraping
//! dmesg/journald text is fragile. `log ... group N` hands the packet to the nfnetlink_log
//! subsystem of the packet's own namespace instead, which delivers it over a netlink socket
//! (NETLINK_NETFILTER, subsystem NFNL_SUBSYS_ULOG) to the one listener bound to group N.
//!
//! The socket belongs to the network namespace the calling thread is in when
//! [`Watcher::subscribe`] runs: enter the target namespace first (see [`crate::netns`]).
//!
//! By concern: `nflog` binds the group and reads its messages (the [`Watcher`]), `packet`
//! decodes the copied IP and transport headers, `event` holds the events and how they print,
//! `hear` merges the packets with the guard's query log for `watch`, `scope` says which part
//! of a scoped table's scope a refused packet was refused in, `unlogged` how many refused
//! packets the table counted and never logged (over its log rate). Timestamps are written by
//! [`crate::core::time`].

mod event;
mod hear;
mod nflog;
mod packet;
mod scope;
mod unlogged;

use nix::errno::Errno;

pub use event::{AUDITED, DropEvent, QueryEvent};
pub use hear::{Heard, hear};
use nflog::ACK_TIMEOUT;
pub use nflog::{COPY_RANGE, Watcher};
pub use scope::{FencedScope, Host, HostLookup, ScopeMatched};
pub use unlogged::{Counted, Unlogged, UnloggedEvent};

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("cannot open a netlink socket to netfilter: {0}")]
    Socket(#[source] Errno),
    #[error(
        "NFLOG group {group} is already bound by another listener in this network namespace \
         (another `egress-fence watch`, ulogd, ...): stop it, or log to another group"
    )]
    GroupBusy { group: u16 },
    #[error(
        "binding NFLOG group {group} needs CAP_NET_ADMIN in the network namespace: \
         run egress-fence as root"
    )]
    Permission { group: u16 },
    #[error("the kernel refused to bind NFLOG group {group}: {errno}{}", bind_hint(*errno))]
    Refused { group: u16, errno: Errno },
    #[error("no answer from the kernel to the NFLOG bind of group {group} within {ACK_TIMEOUT:?}")]
    Timeout { group: u16 },
    #[error("netlink {doing} failed: {source}")]
    Io {
        doing: &'static str,
        #[source]
        source: Errno,
    },
    #[error(
        "some refused packets were not reported: the listener fell behind and the kernel \
         dropped log messages (ENOBUFS)"
    )]
    Overrun,
    #[error("the kernel sent an NFLOG message egress-fence cannot read: {0}")]
    Malformed(String),
}

fn bind_hint(errno: Errno) -> &'static str {
    match errno {
        Errno::EINVAL | Errno::EOPNOTSUPP | Errno::ENOENT => {
            "; the kernel may lack nfnetlink_log (CONFIG_NETFILTER_NETLINK_LOG)"
        }
        _ => "",
    }
}

impl WatchError {
    /// Whether the [`Watcher`] is still usable after this error: one unreadable message or a
    /// lost burst is worth a warning, not the end of the listener.
    pub fn is_transient(&self) -> bool {
        matches!(self, WatchError::Overrun | WatchError::Malformed(_))
    }
}

fn malformed(what: impl Into<String>) -> WatchError {
    WatchError::Malformed(what.into())
}
