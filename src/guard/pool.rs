//! Upstream UDP sockets opened ahead of need, so that opening one (`socket`, `SO_MARK`,
//! `connect`, registering it with the runtime) is no part of an answer's latency.
//!
//! Each socket serves exactly one exchange and is closed after it, as a socket opened for that
//! exchange would be: the kernel gives it a random source port when it is connected (the
//! guard never binds a port itself), and its query id is random, drawn when it is opened and
//! sent nowhere before its exchange. A socket is taken only if nothing has reached it while
//! it waited: it is connected to its upstream, so only that address can send to it, and
//! anything queued (a datagram forged from the upstream's address ahead of the query, with
//! guessed ids, or an ICMP error) would otherwise be read as a possible answer. Such a socket
//! is closed unused.
//!
//! At most [`PER_SERVER`] sockets wait per upstream (and mark), for at most [`MAX_SERVERS`]
//! upstreams at once: they come out of the descriptors `Limits` reserves for the daemon. A
//! task of the runtime opens them again after each take, which it does between the other
//! tasks' steps (while an exchange waits for its upstream, say); when none waits, the exchange
//! opens its own.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use nix::errno::Errno;
use nix::sys::socket::{MsgFlags, recv};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::UdpSocket;
use tokio::sync::Notify;
use tracing::debug;

use super::mark_socket;

/// Sockets kept open per upstream: enough for the queries that arrive while the refill task
/// waits for its turn.
pub const PER_SERVER: usize = 8;

/// Upstreams (with their mark) sockets are kept for at once; the one asked longest ago gives
/// way to a new one (a reload that changes the upstreams).
pub const MAX_SERVERS: usize = 4;

/// A socket for one exchange with its upstream, and the query id of that exchange.
pub struct Fresh {
    pub socket: UdpSocket,
    pub id: u16,
}

/// Where an upstream's sockets wait.
type Key = (SocketAddr, u32);

#[derive(Default)]
struct State {
    /// Sockets waiting, by upstream and mark, with when each upstream was last asked.
    ready: HashMap<Key, (Vec<Fresh>, Instant)>,
    /// Whether the refill task runs.
    refilling: bool,
}

/// The guard's upstream UDP sockets opened ahead of need.
#[derive(Default)]
pub struct UpstreamSockets {
    state: Mutex<State>,
    wake: Arc<Notify>,
}

impl UpstreamSockets {
    /// A socket connected to `server`, carrying `mark`, never used before and untouched since
    /// it was opened; opened now if none waits. Must be called inside the runtime.
    pub fn take(self: &Arc<Self>, server: SocketAddr, mark: u32) -> io::Result<Fresh> {
        let waiting = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if !state.refilling {
                state.refilling = true;
                tokio::spawn(refill(Arc::downgrade(self), self.wake.clone()));
            }
            let now = Instant::now();
            if !state.ready.contains_key(&(server, mark)) && state.ready.len() >= MAX_SERVERS {
                // The upstream asked longest ago gives way.
                let oldest = state.ready.iter().min_by_key(|(_, (_, at))| *at);
                if let Some(key) = oldest.map(|(k, _)| *k) {
                    state.ready.remove(&key);
                }
            }
            let (sockets, asked) = state
                .ready
                .entry((server, mark))
                .or_insert_with(|| (Vec::new(), now));
            *asked = now;
            let mut found = None;
            while let Some(fresh) = sockets.pop() {
                if untouched(&fresh.socket) {
                    found = Some(fresh);
                    break;
                }
                debug!(upstream = %server, "an upstream socket received something before its \
                       query; closed unused");
            }
            found
        };
        self.wake.notify_one();
        match waiting {
            Some(fresh) => Ok(fresh),
            None => open(server, mark),
        }
    }

    /// The local addresses of the sockets waiting for `server`.
    #[cfg(test)]
    pub fn waiting(&self, server: SocketAddr, mark: u32) -> Vec<SocketAddr> {
        let state = self.state.lock().unwrap();
        state
            .ready
            .get(&(server, mark))
            .map(|(v, _)| {
                v.iter()
                    .filter_map(|f| f.socket.local_addr().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Tops every upstream's sockets up to [`PER_SERVER`].
    fn refill_once(&self) {
        let keys: Vec<(Key, usize)> = {
            let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state
                .ready
                .iter()
                .map(|(k, (v, _))| (*k, PER_SERVER.saturating_sub(v.len())))
                .collect()
        };
        for ((server, mark), missing) in keys {
            for _ in 0..missing {
                let fresh = match open(server, mark) {
                    Ok(f) => f,
                    Err(e) => {
                        // The exchange opens its own and reports what fails.
                        debug!(upstream = %server, error = %e, "opening an upstream socket ahead");
                        break;
                    }
                };
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                match state.ready.get_mut(&(server, mark)) {
                    Some((v, _)) if v.len() < PER_SERVER => v.push(fresh),
                    _ => break,
                }
            }
        }
    }
}

/// Opens the sockets that were taken, whenever one is.
async fn refill(pool: Weak<UpstreamSockets>, wake: Arc<Notify>) {
    loop {
        wake.notified().await;
        let Some(pool) = pool.upgrade() else {
            return;
        };
        pool.refill_once();
    }
}

/// A new UDP socket carrying `mark`, connected to `server` (the kernel binds it to a random
/// port), registered with the runtime, with a random query id.
fn open(server: SocketAddr, mark: u32) -> io::Result<Fresh> {
    let socket = Socket::new(
        Domain::for_address(server),
        Type::DGRAM.nonblocking().cloexec(),
        Some(Protocol::UDP),
    )?;
    // Before anything is sent: the table judges every datagram by it.
    mark_socket(&socket, mark)?;
    socket.connect(&server.into())?;
    let socket = UdpSocket::from_std(std::net::UdpSocket::from(socket))?;
    Ok(Fresh {
        socket,
        id: random_id(),
    })
}

/// Whether nothing (no datagram, no error) has reached `socket`: asked of the kernel, not of
/// the runtime's idea of its readiness, which may be older.
fn untouched(socket: &UdpSocket) -> bool {
    let mut byte = [0u8; 1];
    let fd = socket.as_fd().as_raw_fd();
    matches!(
        recv(fd, &mut byte, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_PEEK),
        Err(Errno::EAGAIN)
    )
}

/// How many query ids are drawn from the kernel's random source at once: a getrandom per id
/// was one more system call per exchange.
const IDS_DRAWN: usize = 128;

/// A random query id. Ids are drawn [`IDS_DRAWN`] at a time and each is handed out once; they
/// wait in this process's memory only, as the sockets opened ahead do.
pub fn random_id() -> u16 {
    thread_local! {
        static DRAWN: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    DRAWN.with_borrow_mut(|ids| {
        if ids.is_empty() {
            let mut bytes = [0u8; 2 * IDS_DRAWN];
            // A failing getrandom (no entropy at early boot) still yields an id; the fresh
            // random source port of each exchange keeps guessing hard.
            if getrandom::fill(&mut bytes).is_err() {
                return 0x5a5a;
            }
            ids.extend(
                bytes
                    .chunks_exact(2)
                    .map(|pair| u16::from_ne_bytes([pair[0], pair[1]])),
            );
        }
        ids.pop().unwrap_or(0x5a5a)
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// Ids drawn ahead are random all the same: 1,000 in a row (several draws) are
    /// hardly ever equal (some 8 collisions are expected among 1,000 random 16-bit values).
    #[test]
    fn query_ids_drawn_ahead_are_all_but_distinct() {
        let ids: Vec<u16> = (0..1000).map(|_| random_id()).collect();
        let distinct: BTreeSet<u16> = ids.iter().copied().collect();
        assert!(distinct.len() >= 970, "{} distinct of 1000", distinct.len());
    }

    const MARK: u32 = 993;

    /// Every take is a socket of its own: a port no other take had while it was open.
    #[tokio::test]
    async fn every_take_is_a_new_socket_on_a_port_of_its_own() {
        let upstream = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let server = upstream.local_addr().unwrap();
        let pool = Arc::new(UpstreamSockets::default());
        let mut taken = Vec::new();
        for _ in 0..3 * PER_SERVER {
            taken.push(pool.take(server, MARK).expect("a socket"));
            // The refill task's turn.
            tokio::task::yield_now().await;
        }
        let ports: BTreeSet<u16> = taken
            .iter()
            .map(|f| f.socket.local_addr().unwrap().port())
            .collect();
        assert_eq!(ports.len(), taken.len(), "a port served twice: {ports:?}");
        assert!(
            taken
                .iter()
                .all(|f| f.socket.peer_addr().unwrap() == server)
        );
        assert_eq!(pool.waiting(server, MARK).len(), PER_SERVER, "refilled");
    }

    /// A datagram that reached a waiting socket before its query (a forged answer with a
    /// guessed id, sent from the upstream's address) makes it unusable: it is closed, and
    /// the exchange gets a socket nothing reached.
    #[tokio::test]
    async fn a_socket_that_received_anything_before_its_query_is_never_used() {
        let upstream = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let server = upstream.local_addr().unwrap();
        let pool = Arc::new(UpstreamSockets::default());
        drop(pool.take(server, MARK).unwrap());
        tokio::task::yield_now().await;
        let waiting = pool.waiting(server, MARK);
        assert_eq!(waiting.len(), PER_SERVER);
        for to in &waiting {
            upstream.send_to(b"\x12\x34\x81\x80forged", to).unwrap();
        }
        // Delivered on loopback before `send_to` returns; the runtime has not seen it yet.
        let fresh = pool.take(server, MARK).unwrap();
        let port = fresh.socket.local_addr().unwrap();
        assert!(
            !waiting.contains(&port),
            "a socket with a queued datagram was used"
        );
        let mut buf = [0u8; 64];
        assert_eq!(
            fresh.socket.try_recv(&mut buf).map_err(|e| e.kind()),
            Err(io::ErrorKind::WouldBlock)
        );
    }
}
