//! Who a client is ([`client_key`]) and how much of the guard each one holds
//! ([`ClientLimits`]), so that one client cannot starve the others.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tracing::warn;

use crate::core::installable::HostAddrs;
use crate::core::policy::L4Proto;
use crate::netlink::sockdiag::SockDiag;

/// Who a client is, for its share of the guard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientKey {
    /// A local client by the uid owning its socket, whatever address it sends from (any
    /// loopback address, or one of the host's own): a local process may choose its source
    /// address, but not its uid.
    LocalUser(u32),
    /// A client from a local address whose socket was gone before the guard asked (a sender
    /// that does not wait for its answer, or a raw socket's forged datagram): all of them
    /// share one share.
    LocalUnknown,
    /// Any other client by its address; an IPv4-mapped one as IPv4, an IPv6 one by its /64,
    /// which one host usually holds whole. A source address is easy to forge (root in a
    /// container keeps CAP_NET_RAW), so all of these together also have one share of their
    /// own (see [`ClientLimits`]): forged sources cannot starve local clients.
    Address(IpAddr),
}

impl ClientKey {
    /// The uid of a local client whose socket's owner is known.
    pub fn uid(self) -> Option<u32> {
        match self {
            ClientKey::LocalUser(uid) => Some(uid),
            _ => None,
        }
    }
}

impl ClientKey {
    /// Whether the key is one of the [`ClientKey::Address`] keys, which share a group cap.
    fn by_address(self) -> bool {
        matches!(self, ClientKey::Address(_))
    }
}

/// Whether `peer` reached us on a local path (a loopback address, or one of `host`'s own,
/// which the kernel never takes from outside): its socket's owner can be asked for.
pub fn is_local(host: &HostAddrs, peer: SocketAddr) -> bool {
    let ip = match peer.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    ip.is_loopback() || host.is_own(ip)
}

/// The key of the client at `peer` that reached our socket at `local`. A peer on a local
/// path (a loopback address, or one of `host`'s own addresses, which the kernel never takes
/// from outside) is a local client: `diag` (when it could be opened) tells the uid of its
/// socket. Any other peer is its address, whatever socket shares its port: a forged
/// datagram from elsewhere cannot be charged to a local user's share.
pub fn client_key(
    diag: Option<&mut SockDiag>,
    host: &HostAddrs,
    protocol: L4Proto,
    local: SocketAddr,
    peer: SocketAddr,
) -> ClientKey {
    let unmapped = |a: SocketAddr| match a.ip() {
        IpAddr::V6(v6) => SocketAddr::new(
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            a.port(),
        ),
        IpAddr::V4(_) => a,
    };
    let (peer, local) = (unmapped(peer), unmapped(local));
    let ip = peer.ip();
    if is_local(host, peer) {
        return match diag.and_then(|d| d.owner(protocol, local, peer)) {
            Some(uid) => ClientKey::LocalUser(uid),
            None => ClientKey::LocalUnknown,
        };
    }
    ClientKey::Address(match ip {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::from([s[0], s[1], s[2], s[3], 0, 0, 0, 0])
        }
        v4 => v4,
    })
}

/// How many of something (queries in flight, connections) each client holds, against a cap;
/// and all [`ClientKey::Address`] clients together, against twice that: forged source
/// addresses are free, so however many there are they hold no more than two clients would.
///
/// Telling a local client apart costs a sock_diag round trip (two system calls, some 5 µs
/// per query), so a few slots may go to local clients not told apart
/// ([`ClientLimits::try_take_unidentified`]), as long as no local client could be over its
/// cap whichever of them holds those: every local client is charged with all of them.
#[derive(Debug)]
pub struct ClientLimits {
    cap: usize,
    held: std::sync::Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    by_client: std::collections::HashMap<ClientKey, usize>,
    /// The sum over the [`ClientKey::Address`] keys.
    by_address: usize,
    /// The sum over the local keys ([`ClientKey::LocalUser`], [`ClientKey::LocalUnknown`]).
    by_local: usize,
    /// Held by local clients not told apart.
    unidentified: usize,
}

/// One unit a client holds; given back when dropped.
#[derive(Debug)]
pub struct ClientSlot {
    limits: Arc<ClientLimits>,
    /// `None`: a local client not told apart.
    key: Option<ClientKey>,
}

impl ClientLimits {
    pub fn new(cap: usize) -> Arc<ClientLimits> {
        Arc::new(ClientLimits {
            cap,
            held: Default::default(),
        })
    }

    /// What all [`ClientKey::Address`] clients together may hold.
    fn address_cap(&self) -> usize {
        self.cap.saturating_mul(2)
    }

    /// What local clients not told apart may hold together: a quarter of a client's cap,
    /// which is all a told-apart local client may lose to them.
    fn unidentified_cap(&self) -> usize {
        self.cap / 4
    }

    /// A slot for the client `key`, unless it already holds its cap (a local client counting
    /// the slots of local clients not told apart as its own), or it is known by its address
    /// only and those clients together hold theirs.
    pub fn try_take(self: &Arc<Self>, key: ClientKey) -> Option<ClientSlot> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if key.by_address() && held.by_address >= self.address_cap() {
            return None;
        }
        let also = if key.by_address() {
            0
        } else {
            held.unidentified
        };
        let count = held.by_client.entry(key).or_default();
        if *count + also >= self.cap {
            if *count == 0 {
                held.by_client.remove(&key);
            }
            return None;
        }
        *count += 1;
        match key.by_address() {
            true => held.by_address += 1,
            false => held.by_local += 1,
        }
        Some(ClientSlot {
            limits: self.clone(),
            key: Some(key),
        })
    }

    /// A slot for a local client that is not told apart, if local clients not told apart hold
    /// fewer than [`ClientLimits::unidentified_cap`] and one more could not put any local
    /// client over its cap (were they all its own); else the client must be told apart and
    /// [`ClientLimits::try_take`] asked.
    pub fn try_take_unidentified(self: &Arc<Self>) -> Option<ClientSlot> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.unidentified >= self.unidentified_cap()
            || held.by_local + held.unidentified >= self.cap
        {
            return None;
        }
        held.unidentified += 1;
        Some(ClientSlot {
            limits: self.clone(),
            key: None,
        })
    }

    /// Slots held by the client `key`.
    pub fn held(&self, key: ClientKey) -> usize {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.by_client.get(&key).copied().unwrap_or(0)
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut held = self.limits.held.lock().unwrap_or_else(|e| e.into_inner());
        let Some(key) = self.key else {
            held.unidentified -= 1;
            return;
        };
        if let Some(count) = held.by_client.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                // Forgotten at once: a flood of spoofed sources leaves no table behind.
                held.by_client.remove(&key);
            }
            match key.by_address() {
                true => held.by_address -= 1,
                false => held.by_local -= 1,
            }
        }
    }
}

/// Opens the lookup of local clients' uids; without it (no netlink, say) every local client
/// shares one share.
pub(super) fn open_sock_diag() -> SharedDiag {
    Arc::new(std::sync::Mutex::new(
        SockDiag::open()
            .inspect_err(|e| warn!(error = %e, "local DNS clients cannot be told apart by uid"))
            .ok(),
    ))
}

/// A listener's lookup of local clients' uids, shared by its receiving loop and the
/// exchanges it starts (one thread: the lock is never contended).
pub(super) type SharedDiag = Arc<std::sync::Mutex<Option<SockDiag>>>;

/// [`client_key`] through a listener's shared lookup.
pub(super) fn shared_client_key(
    diag: &SharedDiag,
    host: &HostAddrs,
    protocol: L4Proto,
    local: SocketAddr,
    peer: SocketAddr,
) -> ClientKey {
    let mut diag = diag.lock().unwrap_or_else(|e| e.into_inner());
    client_key(diag.as_mut(), host, protocol, local, peer)
}

/// Who asked a forwarded query, for the trace (`run --record`, `learn`): known already, or
/// looked up once the query is on its way upstream, off the answer's path (the client waits
/// for its answer, so its socket is still there).
pub(super) enum Asker {
    Known(Option<u32>),
    /// Boxed: every forwarded query carries an `Asker`, and only a traced one this.
    LookUp(Box<LookUp>),
}

/// The lookup of the socket at `client` that asked our listener at `local`.
pub(super) struct LookUp {
    pub diag: SharedDiag,
    pub local: SocketAddr,
    pub client: SocketAddr,
}

impl Asker {
    /// The uid of the socket that asked, if it is a local one still open.
    pub(super) fn uid(self) -> Option<u32> {
        match self {
            Asker::Known(uid) => uid,
            Asker::LookUp(lookup) => {
                let mut diag = lookup.diag.lock().unwrap_or_else(|e| e.into_inner());
                diag.as_mut()?
                    .owner(L4Proto::Udp, lookup.local, lookup.client)
            }
        }
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    /// One client holds at most its cap; others are not affected; a slot given back can be
    /// taken again, and a client holding nothing leaves nothing behind.
    #[test]
    fn each_client_holds_at_most_its_share() {
        let limits = ClientLimits::new(2);
        let flood = ClientKey::LocalUser(4242);
        let other = ClientKey::LocalUser(65534);
        let a = limits.try_take(flood).expect("first");
        let _b = limits.try_take(flood).expect("second");
        assert!(limits.try_take(flood).is_none(), "over the cap");
        let c = limits
            .try_take(other)
            .expect("another client is not affected");
        drop(a);
        let _again = limits.try_take(flood).expect("a slot given back");
        drop(c);
        assert_eq!(limits.held(other), 0);
        assert!(!limits.held.lock().unwrap().by_client.contains_key(&other));
    }

    /// Clients known by their address only (any of which may be forged) hold at most twice
    /// a client's cap together, however many addresses they use; local clients keep theirs.
    #[test]
    fn clients_known_by_address_share_one_group_cap() {
        let limits = ClientLimits::new(2);
        let forged = |i: u8| ClientKey::Address(IpAddr::from([203, 0, 113, i]));
        let held: Vec<ClientSlot> = (1..=64)
            .filter_map(|i| limits.try_take(forged(i)))
            .collect();
        assert_eq!(held.len(), 4, "two clients' worth, over 64 addresses");
        let _local = limits
            .try_take(ClientKey::LocalUser(65534))
            .expect("a local client is not affected");
        let _unknown = limits
            .try_take(ClientKey::LocalUnknown)
            .expect("nor are local clients whose socket is gone");
        drop(held);
        assert_eq!(limits.held.lock().unwrap().by_address, 0);
        assert!(limits.try_take(forged(9)).is_some(), "slots given back");
    }

    /// The guard's order for a local UDP query (a slot not told apart if one is free, else
    /// one by uid), under random takes and releases by three local users: whichever of them
    /// really holds the slots not told apart, no user ever holds more than its cap, and a
    /// user holding nothing can always take a slot, up to three quarters of its cap.
    #[test]
    fn no_local_user_exceeds_its_cap_or_is_starved_below_three_quarters() {
        for cap in [1, 3, 4, 8, 128] {
            let limits = ClientLimits::new(cap);
            let users = [4242u32, 4243, 0];
            let mut held: Vec<(u32, ClientSlot)> = Vec::new();
            let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ cap as u64;
            for _ in 0..20_000 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let pick = (state >> 32) as usize;
                if pick.is_multiple_of(3) && !held.is_empty() {
                    held.swap_remove(pick % held.len());
                } else {
                    let uid = users[pick % users.len()];
                    let slot = limits
                        .try_take_unidentified()
                        .or_else(|| limits.try_take(ClientKey::LocalUser(uid)));
                    held.extend(slot.map(|s| (uid, s)));
                }
                for uid in users {
                    let really = held.iter().filter(|(u, _)| *u == uid).count();
                    assert!(really <= cap, "uid {uid} holds {really} of cap {cap}");
                }
                let quiet = ClientKey::LocalUser(65534);
                let mut taken = Vec::new();
                while let Some(slot) = limits.try_take(quiet) {
                    taken.push(slot);
                }
                assert!(
                    taken.len() >= cap - cap / 4,
                    "a quiet user got {} of cap {cap}",
                    taken.len()
                );
            }
        }
    }

    /// Local clients not told apart hold at most a quarter of a client's cap together, and
    /// only while that could put no local client over its cap: each local client counts them
    /// as its own, so none holds more than its cap whoever they are. Clients known by their
    /// address are not charged with them.
    #[test]
    fn local_clients_not_told_apart_count_against_every_local_client() {
        let limits = ClientLimits::new(8);
        let flood = ClientKey::LocalUser(4242);
        let quiet = ClientKey::LocalUser(65534);
        let unknown: Vec<ClientSlot> = (0..8)
            .map_while(|_| limits.try_take_unidentified())
            .collect();
        assert_eq!(unknown.len(), 2, "a quarter of the cap");
        let mut flooded: Vec<ClientSlot> = (0..8).map_while(|_| limits.try_take(flood)).collect();
        assert_eq!(
            flooded.len(),
            6,
            "the cap, counting the two not told apart as its own"
        );
        let quiet_slot = limits
            .try_take(quiet)
            .expect("another local client is served");
        drop(unknown);
        // Seven told apart: one more not told apart could be anyone's eighth, not a ninth.
        let one = limits
            .try_take_unidentified()
            .expect("no local client over its cap");
        assert!(
            limits.try_take_unidentified().is_none(),
            "a second could make one local client's ninth"
        );
        flooded.extend(limits.try_take(flood));
        assert_eq!(
            flooded.len(),
            7,
            "the eighth, counting the one not told apart"
        );
        assert!(limits.try_take(flood).is_none());
        let away = ClientKey::Address(IpAddr::from([192, 0, 2, 9]));
        let remote: Vec<ClientSlot> = (0..9).map_while(|_| limits.try_take(away)).collect();
        assert_eq!(remote.len(), 8, "not charged with local clients' slots");
        drop((one, flooded, quiet_slot, remote));
        let held = limits.held.lock().unwrap();
        assert_eq!(
            (held.unidentified, held.by_address, held.by_local),
            (0, 0, 0)
        );
        assert!(held.by_client.is_empty());
        drop(held);
        assert!(
            ClientLimits::new(3).try_take_unidentified().is_none(),
            "a cap too small"
        );
    }

    /// A local client is its socket's uid, whatever loopback or own address it sends from;
    /// any other one its address (even when a local socket has its port), an IPv6 one by
    /// its /64.
    #[test]
    fn clients_are_told_apart_by_uid_when_local_and_by_address_otherwise() {
        let me = nix::unistd::geteuid().as_raw();
        let mut diag = SockDiag::open().expect("sock_diag");
        let server = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let local = server.local_addr().unwrap();
        let udp = L4Proto::Udp;
        let none = HostAddrs::none();
        for from in ["127.0.0.1:0", "127.0.0.2:0", "127.9.8.7:0"] {
            let client = std::net::UdpSocket::bind(from).unwrap();
            client.send_to(b"q", local).unwrap();
            let peer = client.local_addr().unwrap();
            assert_eq!(
                client_key(Some(&mut diag), &none, udp, local, peer),
                ClientKey::LocalUser(me),
                "{from}"
            );
        }
        // Gone before the guard asked: the local clients' shared key.
        let gone: SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert_eq!(
            client_key(Some(&mut diag), &none, udp, local, gone),
            ClientKey::LocalUnknown
        );
        // A socket on every address (an unconnected client's usual one) takes datagrams to
        // its port from any source: from the host's own address it is its uid, from an
        // address that is not the host's (a forged one, say) the address, not that uid.
        let wildcard = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        wildcard.send_to(b"q", local).unwrap();
        let port = wildcard.local_addr().unwrap().port();
        let own = HostAddrs::from_interfaces([("203.0.113.7".parse().unwrap(), None, None)]);
        let from_own = SocketAddr::new("203.0.113.7".parse().unwrap(), port);
        assert_eq!(
            client_key(Some(&mut diag), &own, udp, local, from_own),
            ClientKey::LocalUser(me)
        );
        assert_eq!(
            client_key(Some(&mut diag), &none, udp, local, from_own),
            ClientKey::Address("203.0.113.7".parse().unwrap())
        );
        let gone_own: SocketAddr = "203.0.113.7:9".parse().unwrap();
        assert_eq!(
            client_key(Some(&mut diag), &own, udp, local, gone_own),
            ClientKey::LocalUnknown
        );
        let key = |peer: &str| client_key(None, &none, udp, local, peer.parse().unwrap());
        assert_eq!(key("127.0.0.1:5353"), ClientKey::LocalUnknown);
        assert_eq!(
            key("[::ffff:192.0.2.7]:5353"),
            ClientKey::Address("192.0.2.7".parse().unwrap())
        );
        assert_eq!(
            key("[2001:db8:1:2::1]:53"),
            key("[2001:db8:1:2:ffff::9]:53")
        );
        assert_ne!(key("[2001:db8:1:2::1]:53"), key("[2001:db8:1:3::1]:53"));
    }
}
