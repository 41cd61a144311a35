//! A minimal DNS client (UDP or TCP, no EDNS) for asking from inside a namespace.

use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use egress_fence::dns::{exchange, message};

/// Record types for [`dns_ask`].
pub const RTYPE_A: u16 = 1;
pub const RTYPE_CNAME: u16 = 5;
pub const RTYPE_MX: u16 = 15;
pub const RTYPE_TXT: u16 = 16;
pub const RTYPE_AAAA: u16 = 28;

/// Response codes of [`DnsReply::rcode`].
pub const RCODE_NOERROR: u8 = 0;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_REFUSED: u8 = 5;

/// How [`dns_ask`] sends its query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// One datagram (no EDNS, so at most 512 bytes come back: more is truncated).
    Udp,
    /// A TCP connection with the two-byte length prefix.
    Tcp,
}

/// The data of an answer record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RData {
    /// A or AAAA.
    Addr(IpAddr),
    /// CNAME (lower case, without the trailing dot).
    Name(String),
    Other(Vec<u8>),
}

/// One record of the answer section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsAnswer {
    /// Lower case, without the trailing dot.
    pub name: String,
    pub rtype: u16,
    pub ttl: u32,
    pub data: RData,
}

/// A response [`dns_ask`] received.
#[derive(Clone, Debug)]
pub struct DnsReply {
    pub rcode: u8,
    /// The TC bit: the answer did not fit (ask again over TCP).
    pub truncated: bool,
    pub answers: Vec<DnsAnswer>,
}

impl DnsReply {
    /// The A and AAAA addresses of the answer section, in order.
    pub fn addrs(&self) -> Vec<IpAddr> {
        self.answers
            .iter()
            .filter_map(|a| match a.data {
                RData::Addr(ip) => Some(ip),
                _ => None,
            })
            .collect()
    }

    /// "NOERROR", "SERVFAIL", "NXDOMAIN", "REFUSED" or "RCODE<n>".
    pub fn rcode_name(&self) -> String {
        match self.rcode {
            RCODE_NOERROR => "NOERROR".into(),
            RCODE_SERVFAIL => "SERVFAIL".into(),
            RCODE_NXDOMAIN => "NXDOMAIN".into(),
            RCODE_REFUSED => "REFUSED".into(),
            n => format!("RCODE{n}"),
        }
    }
}

/// Asks `server` for `name`/`rtype` (class IN, recursion desired, no EDNS) over `transport`
/// and waits up to `timeout` for the response with the query's id. Sockets are opened in the
/// calling thread's network namespace: call it inside [`World::in_sandbox_ns`] to ask as a
/// sandbox process (as root, the test's user). Err: nothing usable came back (timeout, ICMP
/// error, reset, malformed response), with what happened.
pub fn dns_ask(
    server: SocketAddr,
    name: &str,
    rtype: u16,
    transport: Transport,
    timeout: Duration,
) -> Result<DnsReply, String> {
    static NEXT_ID: AtomicU32 = AtomicU32::new(0);
    let seed = std::process::id().wrapping_mul(2_654_435_761);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed).wrapping_add(seed) as u16;
    let query = dns_query(id, name, rtype).unwrap_or_else(|e| panic!("bad DNS name {name:?}: {e}"));
    let what = |e: std::io::Error| format!("{transport:?} {name} {rtype} to {server}: {e}");
    let deadline = Instant::now() + timeout;
    let left = || {
        let l = deadline.saturating_duration_since(Instant::now());
        if l.is_zero() {
            Err(std::io::Error::new(ErrorKind::TimedOut, "timed out"))
        } else {
            Ok(l)
        }
    };
    match transport {
        Transport::Udp => {
            let any: IpAddr = match server {
                SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
                SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
            };
            let sock = UdpSocket::bind((any, 0)).map_err(what)?;
            sock.connect(server).map_err(what)?;
            let reply =
                exchange::udp_blocking(&sock, &query, id, left().map_err(what)?).map_err(what)?;
            parse_dns_reply(&reply).map_err(|e| format!("{name}: {e}"))
        }
        Transport::Tcp => {
            let mut stream = std::net::TcpStream::connect_timeout(&server, left().map_err(what)?)
                .map_err(what)?;
            let reply =
                exchange::tcp_blocking(&mut stream, &query, left().map_err(what)?).map_err(what)?;
            if message::peek_id(&reply) != Some(id) {
                return Err(format!("{name}: a TCP response with another id"));
            }
            parse_dns_reply(&reply).map_err(|e| format!("{name}: {e}"))
        }
    }
}

/// A query for `name`/`rtype`, class IN, recursion desired, no EDNS (the library's codec).
pub(super) fn dns_query(id: u16, name: &str, rtype: u16) -> Result<Vec<u8>, String> {
    let name = hickory_proto::rr::Name::from_ascii(name).map_err(|e| e.to_string())?;
    let question = hickory_proto::op::Query::query(name, rtype.into());
    message::query(id, [question], true, None)
        .to_vec()
        .map_err(|e| e.to_string())
}

fn parse_dns_reply(msg: &[u8]) -> Result<DnsReply, String> {
    use hickory_proto::rr::RData as Data;
    use hickory_proto::serialize::binary::BinEncodable;
    let reply = message::parse(msg, message::MAX_MESSAGE).map_err(|e| e.to_string())?;
    if reply.metadata.message_type != hickory_proto::op::MessageType::Response {
        return Err("not a response (QR clear)".into());
    }
    // Lower case, without the trailing dot.
    let text =
        |n: &hickory_proto::rr::Name| n.to_ascii().trim_end_matches('.').to_ascii_lowercase();
    let answers = reply
        .answers
        .iter()
        .map(|r| DnsAnswer {
            name: text(&r.name),
            rtype: r.record_type().into(),
            ttl: r.ttl,
            data: match &r.data {
                Data::A(a) => RData::Addr(IpAddr::V4(a.0)),
                Data::AAAA(a) => RData::Addr(IpAddr::V6(a.0)),
                Data::CNAME(c) => RData::Name(text(&c.0)),
                other => RData::Other(other.to_bytes().unwrap_or_default()),
            },
        })
        .collect();
    Ok(DnsReply {
        rcode: reply.metadata.response_code.low(),
        truncated: reply.metadata.truncation,
        answers,
    })
}

/// A valid name of exactly `len` characters: `first`, then labels of `a` (at most 63 each),
/// then `zone` (`len` at least two more than `first` and `zone` with their dot). For the
/// longest names a client may ask (up to 253).
pub fn name_of_length(first: &str, zone: &str, len: usize) -> String {
    let mut name = first.to_string();
    while name.len() + 1 + zone.len() < len {
        let room = len - zone.len() - name.len() - 1;
        // A dot and a label; never leave room for a dot alone.
        let label = match room {
            left if left > 65 => 63,
            65 => 62,
            left => left - 1,
        };
        name.push('.');
        name.push_str(&"a".repeat(label));
    }
    let name = format!("{name}.{zone}");
    assert_eq!(name.len(), len, "{name}");
    assert!(
        name.split('.').all(|l| !l.is_empty() && l.len() <= 63),
        "{name}"
    );
    name
}
