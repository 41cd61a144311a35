//! A minimal DNS client (UDP or TCP, no EDNS) for asking from inside a namespace.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

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
    let id = (NEXT_ID.fetch_add(1, Ordering::Relaxed).wrapping_add(seed) as u16).to_be_bytes();
    let mut query = Vec::with_capacity(64);
    query.extend_from_slice(&id);
    query.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]); // RD, one question
    for label in name.trim_end_matches('.').split('.') {
        assert!(
            !label.is_empty() && label.len() < 64,
            "bad DNS name {name:?}"
        );
        query.push(label.len() as u8);
        query.extend_from_slice(label.as_bytes());
    }
    query.push(0);
    query.extend_from_slice(&rtype.to_be_bytes());
    query.extend_from_slice(&[0, 1]); // IN
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
            sock.send(&query).map_err(what)?;
            let mut buf = vec![0u8; 65536];
            loop {
                sock.set_read_timeout(Some(left().map_err(what)?))
                    .map_err(what)?;
                let n = sock.recv(&mut buf).map_err(what)?;
                if n >= 12 && buf[..2] == id {
                    return parse_dns_reply(&buf[..n]).map_err(|e| format!("{name}: {e}"));
                }
            }
        }
        Transport::Tcp => {
            let mut stream = std::net::TcpStream::connect_timeout(&server, left().map_err(what)?)
                .map_err(what)?;
            let mut msg = (query.len() as u16).to_be_bytes().to_vec();
            msg.extend_from_slice(&query);
            stream
                .set_write_timeout(Some(left().map_err(what)?))
                .map_err(what)?;
            stream.write_all(&msg).map_err(what)?;
            stream
                .set_read_timeout(Some(left().map_err(what)?))
                .map_err(what)?;
            let mut len = [0u8; 2];
            stream.read_exact(&mut len).map_err(what)?;
            let mut buf = vec![0u8; u16::from_be_bytes(len) as usize];
            stream.read_exact(&mut buf).map_err(what)?;
            if buf.len() < 12 || buf[..2] != id {
                return Err(format!("{name}: a TCP response with another id"));
            }
            parse_dns_reply(&buf).map_err(|e| format!("{name}: {e}"))
        }
    }
}

fn parse_dns_reply(msg: &[u8]) -> Result<DnsReply, String> {
    let u16_at = |p: usize| -> Result<u16, String> {
        msg.get(p..p + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or_else(|| "response cut short".to_string())
    };
    let flags = u16_at(2)?;
    if flags & 0x8000 == 0 {
        return Err("not a response (QR clear)".into());
    }
    let (qdcount, ancount) = (u16_at(4)?, u16_at(6)?);
    let mut pos = 12;
    for _ in 0..qdcount {
        pos = read_dns_name(msg, pos)?.1 + 4;
    }
    let mut answers = Vec::new();
    for _ in 0..ancount {
        let (name, next) = read_dns_name(msg, pos)?;
        let rtype = u16_at(next)?;
        let ttl = (u32::from(u16_at(next + 4)?) << 16) | u32::from(u16_at(next + 6)?);
        let rdlen = usize::from(u16_at(next + 8)?);
        let rdata_at = next + 10;
        let rdata = msg
            .get(rdata_at..rdata_at + rdlen)
            .ok_or("record data cut short")?;
        let data = match (rtype, rdlen) {
            (RTYPE_A, 4) => RData::Addr(IpAddr::from(<[u8; 4]>::try_from(rdata).unwrap())),
            (RTYPE_AAAA, 16) => RData::Addr(IpAddr::from(<[u8; 16]>::try_from(rdata).unwrap())),
            (RTYPE_CNAME, _) => RData::Name(read_dns_name(msg, rdata_at)?.0),
            _ => RData::Other(rdata.to_vec()),
        };
        answers.push(DnsAnswer {
            name,
            rtype,
            ttl,
            data,
        });
        pos = rdata_at + rdlen;
    }
    Ok(DnsReply {
        rcode: (flags & 0x000f) as u8,
        truncated: flags & 0x0200 != 0,
        answers,
    })
}

/// Reads a (possibly compressed) name at `pos`: the name in lower case without the trailing
/// dot, and where the record continues.
fn read_dns_name(msg: &[u8], mut pos: usize) -> Result<(String, usize), String> {
    let mut labels: Vec<String> = Vec::new();
    let mut end = None;
    for _ in 0..128 {
        let len = *msg.get(pos).ok_or("name cut short")? as usize;
        match len {
            0 => {
                return Ok((labels.join("."), end.unwrap_or(pos + 1)));
            }
            l if l & 0xc0 == 0xc0 => {
                let low = *msg.get(pos + 1).ok_or("pointer cut short")? as usize;
                end.get_or_insert(pos + 2);
                pos = ((l & 0x3f) << 8) | low;
            }
            l => {
                let label = msg.get(pos + 1..pos + 1 + l).ok_or("label cut short")?;
                labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
                pos += 1 + l;
            }
        }
    }
    Err("name with a pointer loop".into())
}
