//! The DNS guard (`dns.mode: guard`): the sandbox's resolver, and the only way out for DNS.
//!
//! A query for a name the policy allows is forwarded to an upstream resolver as a query the
//! guard rebuilds from the checked question alone (see [`upstream_query`]). The addresses of
//! the answer (A, AAAA and the hints of HTTPS/SVCB records, along the CNAME chain from the
//! asked name; at most 32 of each family, and only those [`crate::core::installable`] accepts) go
//! to the daemon, which adds them to the table in one batch; the answer is released only once
//! the kernel has acknowledged that batch, so a client connecting right after its answer is
//! never refused. If the kernel refuses, the client gets SERVFAIL: never an answer it cannot
//! use.
//!
//! A query for any other name is answered REFUSED (or NXDOMAIN) here and never leaves the
//! host: `<secret>.attacker.example` is a question nobody else hears. Each one is streamed to
//! `watch` as a [`QueryEvent`](crate::watch::QueryEvent) and logged (at the policy's log rate).
//!
//! One client cannot starve the others: what can never be answered (oversize datagrams,
//! responses) is dropped at once and refusals are answered at once, without a slot; a
//! forwarded query takes one of 1,024 slots, at most 128 per client (a local one by the uid
//! of its socket, another by its address: see [`client_key`]); TCP connections are capped per
//! client too, and must bring their first query within 2 s.
//!
//! The table lets only this process's upstream sockets reach the upstream resolvers (see
//! `plan`): they carry the policy's `dns.mark` (`SO_MARK`, which takes CAP_NET_ADMIN, or
//! CAP_NET_RAW since Linux 5.17, to set; set on UDP sockets before sending and on TCP sockets
//! before connecting) and this process's uid. So the guard is the one path for names, even for
//! root without CAP_NET_ADMIN, as long as it runs under a uid of its own. Its listening
//! sockets carry the mark too, and the table refuses what leaves a listen address without it
//! or from another uid: only the guard answers there. Each upstream exchange uses a fresh
//! socket (a random source port; over UDP one opened ahead of need and untouched since, see
//! [`pool`]) and a random query id, and an answer is taken only if it carries that id and the
//! question that was asked.

mod addresses;
mod clients;
mod counters;
mod events;
mod limits;
mod pool;
mod rules;
mod serve;
#[cfg(test)]
mod testing;
mod upstream;

pub use addresses::{answer_addresses, record_addresses};
pub use clients::{ClientKey, ClientLimits, ClientSlot, client_key};
pub use counters::{Counters, LATENCY_BOUNDS, LatencySnapshot, LogBudget};
pub use events::serve_events;
pub use limits::Limits;
#[cfg(test)]
pub use limits::in_flight_limit;
pub use pool::UpstreamSockets;
pub use rules::{Refusal, Rules, Verdict, domain_name_of, judge};
pub use serve::Context;
pub use upstream::{Answered, upstream_query};

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;

use nix::sys::socket::{setsockopt, sockopt};
use tokio::net::{TcpListener, TcpSocket, UdpSocket};
use tokio::sync::Semaphore;
use tracing::warn;

use crate::core::guard_identity::GuardIdentity;
use crate::core::policy::L4Proto;
use crate::netlink::sockdiag::SockDiag;

use limits::raise_nofile;
use serve::{serve_tcp, serve_udp};

#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error(
        "the DNS guard cannot listen on {addr} ({transport}): {source}{}{}",
        holder.map(|uid| format!(" (held by a socket of uid {uid})")).unwrap_or_default(),
        bind_hint(source)
    )]
    Bind {
        addr: SocketAddr,
        transport: &'static str,
        source: io::Error,
        /// The uid owning the UDP socket bound there, when the address is in use.
        holder: Option<u32>,
    },
    #[error("the DNS guard cannot serve its events on {}: {source}", path.display())]
    Events { path: PathBuf, source: io::Error },
    #[error(
        "the DNS guard needs at least {need} open files, and this process may open only \
         {nofile} (RLIMIT_NOFILE, hard limit {hard}): raise LimitNOFILE= in the service, or \
         `ulimit -n` for a shell"
    )]
    TooFewFiles { nofile: u64, hard: u64, need: u64 },
    #[error("the DNS guard cannot mark its socket on {addr} ({transport}): {source}")]
    Mark {
        addr: SocketAddr,
        transport: &'static str,
        source: io::Error,
    },
}

fn bind_hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::AddrInUse => {
            "; another process holds it (systemd-resolved's stub, dnsmasq, or one that took it \
             while the daemon was down: the table still refuses every answer it sends without \
             the guard's mark, so it answers nobody): find it with `ss -lunp` and `ss -ltnp`, \
             stop it, or choose another `dns.listen`"
        }
        io::ErrorKind::PermissionDenied => {
            "; ports below 1024 need CAP_NET_BIND_SERVICE (the drop-in systemd/guard.conf grants \
             it to the service)"
        }
        io::ErrorKind::AddrNotAvailable => "; no interface of this host has that address",
        _ => "",
    }
}

/// The uid owning the UDP socket that a datagram to `addr` would reach: who holds the
/// guard's address (a process that took it while the daemon was down, say).
fn udp_holder(addr: SocketAddr) -> Option<u32> {
    if addr.ip().is_unspecified() {
        return None;
    }
    // The lookup takes a sender; any will do for an unconnected socket.
    let sender = SocketAddr::new(addr.ip(), 1);
    SockDiag::open().ok()?.owner(L4Proto::Udp, sender, addr)
}

/// The guard's listening sockets, bound before the table goes up so that a port already taken
/// stops the daemon at once.
pub struct Guard {
    udp: Vec<UdpSocket>,
    tcp: Vec<TcpListener>,
    limits: Limits,
}

impl Guard {
    /// Must be called inside the runtime, in the target network namespace. Listens on the
    /// guard's `listen` addresses; every listening socket carries its `mark` (the policy's
    /// `dns.mark`), and so does all it sends: replies, accepted connections (which inherit
    /// it) and their SYN-ACKs. The table refuses what leaves the listen addresses without
    /// it, so a process that takes the address while the daemon is down answers nobody.
    ///
    /// `optional` are addresses of `identity.listen` that are the host's, not the policy's
    /// (the listed bridges', see [`crate::host::bridge_listen`]): one the kernel will not
    /// bind (an IPv6 address still tentative, as on a bridge with no port yet, or one gone
    /// since it was read) is left out with a warning, not a reason to stop. Returns the
    /// guard and who it is: `identity` less what it left out, which is what the table must
    /// name.
    pub async fn bind(
        identity: &GuardIdentity,
        optional: &[SocketAddr],
    ) -> Result<(Guard, GuardIdentity), GuardError> {
        let (listen, mark) = (&identity.listen, identity.mark);
        let (nofile, hard) = raise_nofile();
        let limits = Limits::fit(nofile, listen.len()).ok_or(GuardError::TooFewFiles {
            nofile,
            hard,
            need: Limits::min_nofile(listen.len()),
        })?;
        if limits != Limits::DESIGN {
            warn!(
                nofile,
                in_flight = limits.in_flight,
                tcp_clients = limits.tcp_clients,
                "the limit of open files is low: the DNS guard serves fewer clients at once"
            );
        }
        let mut guard = Guard {
            udp: Vec::new(),
            tcp: Vec::new(),
            limits,
        };
        let mut bound = identity.clone();
        for &addr in listen {
            let bind = |transport| {
                move |source| GuardError::Bind {
                    addr,
                    transport,
                    source,
                    holder: None,
                }
            };
            let marked = |transport| {
                move |source| GuardError::Mark {
                    addr,
                    transport,
                    source,
                }
            };
            let udp = match UdpSocket::bind(addr).await {
                Err(e)
                    if optional.contains(&addr) && e.kind() == io::ErrorKind::AddrNotAvailable =>
                {
                    warn!(address = %addr, error = %e,
                          "the DNS guard cannot listen on {addr}, an address of a listed \
                           interface, now: it is left out (served after a restart once usable)");
                    bound.listen.retain(|a| *a != addr);
                    continue;
                }
                other => other,
            };
            let udp = udp.map_err(|source| {
                let holder = (source.kind() == io::ErrorKind::AddrInUse)
                    .then(|| udp_holder(addr))
                    .flatten();
                GuardError::Bind {
                    addr,
                    transport: "udp",
                    source,
                    holder,
                }
            })?;
            // Nothing was sent from it yet: every reply carries the mark.
            mark_socket(&udp, mark).map_err(marked("udp"))?;
            guard.udp.push(udp);
            // Marked before it listens: no SYN-ACK or accepted connection goes without it.
            let tcp = match addr {
                SocketAddr::V4(_) => TcpSocket::new_v4(),
                SocketAddr::V6(_) => TcpSocket::new_v6(),
            }
            .map_err(bind("tcp"))?;
            tcp.set_reuseaddr(true).map_err(bind("tcp"))?;
            mark_socket(&tcp, mark).map_err(marked("tcp"))?;
            tcp.bind(addr).map_err(bind("tcp"))?;
            guard.tcp.push(tcp.listen(1024).map_err(bind("tcp"))?);
        }
        Ok((guard, bound))
    }

    /// The limit of queries in flight this guard's [`Context`] takes.
    pub fn in_flight_limit(&self) -> Arc<Semaphore> {
        Arc::new(Semaphore::new(self.limits.in_flight))
    }

    /// Serves every socket on tasks of the current runtime.
    pub fn serve(self, context: Context) {
        let context = Arc::new(context);
        let forwarding = ClientLimits::new(self.limits.in_flight_per_client());
        let connected = ClientLimits::new(self.limits.tcp_per_client());
        for socket in self.udp {
            tokio::spawn(serve_udp(
                Arc::new(socket),
                context.clone(),
                forwarding.clone(),
            ));
        }
        for listener in self.tcp {
            tokio::spawn(serve_tcp(
                listener,
                self.limits.tcp_clients,
                context.clone(),
                forwarding.clone(),
                connected.clone(),
            ));
        }
    }
}

/// Sets the socket mark the table knows the guard's sockets by. Fails without
/// CAP_NET_ADMIN: an upstream exchange fails with it, since an unmarked socket would be
/// refused, and so does binding the listeners, whose unmarked replies would be.
fn mark_socket(socket: &impl AsFd, mark: u32) -> io::Result<()> {
    setsockopt(socket, sockopt::Mark, &mark).map_err(|errno| {
        io::Error::new(
            io::Error::from(errno).kind(),
            format!("cannot mark the socket (SO_MARK needs CAP_NET_ADMIN): {errno}"),
        )
    })
}

#[cfg(test)]
mod tests {

    use super::*;

    /// Who holds an address the guard cannot bind: the uid of the socket there.
    #[test]
    fn the_holder_of_a_taken_address_is_named() {
        let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        assert_eq!(udp_holder(addr), Some(nix::unistd::geteuid().as_raw()));
        drop(taken);
        assert_eq!(udp_holder(addr), None);
    }
}
