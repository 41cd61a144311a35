//! Asking the guard: each name's A and AAAA questions, over UDP and again over TCP when the
//! answer is truncated, with REFUSED and NXDOMAIN kept apart.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::thread;
use std::time::Duration;

use hickory_proto::rr::{Name, Record, RecordType};

use crate::core::policy::DomainName;
use crate::core::resolution::{ResolvedAddr, ResolvedHost};
use crate::dns::exchange;
use crate::dns::message::{self, MAX_MESSAGE};

use super::attempt::{
    Ctx, MAX_WORKERS, QTYPE_A, QTYPE_AAAA, Seen, describe, dns_query, dns_rcode, fmt_duration,
    tcp_connect,
};
use super::plan::random_u64;
use super::report::ProbeError;

/// How one question to the guard ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Asked {
    /// A response: its code ("NOERROR", "REFUSED", ...) and the A/AAAA addresses it carries.
    Answered {
        rcode: &'static str,
        addrs: Vec<ResolvedAddr>,
    },
    /// No response from any listen address, and why.
    Failed(String),
}

/// A name asked of the guard, A and AAAA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct GuardLookup {
    pub(super) name: DomainName,
    pub(super) a: Asked,
    pub(super) aaaa: Asked,
}

impl GuardLookup {
    fn asked(&self) -> [(&'static str, &Asked); 2] {
        [("A", &self.a), ("AAAA", &self.aaaa)]
    }

    /// The lookup as the rest of the probe reads names: addresses, NXDOMAIN, and as errors
    /// every question that got no response or another refusal.
    pub(super) fn host(&self) -> ResolvedHost {
        let mut host = ResolvedHost {
            name: self.name.clone(),
            addrs: Vec::new(),
            nxdomain: false,
            dropped: Vec::new(),
            errors: Vec::new(),
        };
        for (qtype, asked) in self.asked() {
            match asked {
                Asked::Answered { rcode, addrs } => {
                    host.addrs.extend(addrs);
                    match *rcode {
                        "NOERROR" => {}
                        "NXDOMAIN" => host.nxdomain = true,
                        other => host.errors.push(format!("{qtype}: answered {other}")),
                    }
                }
                Asked::Failed(e) => host.errors.push(format!("{qtype}: {e}")),
            }
        }
        host.addrs.sort();
        host.addrs.dedup_by_key(|a| a.addr);
        host
    }

    /// The guard's refusal: both questions answered REFUSED or NXDOMAIN, without addresses.
    pub(super) fn refusal(&self) -> Option<&'static str> {
        let mut code = None;
        for (_, asked) in self.asked() {
            match asked {
                Asked::Answered { rcode, addrs }
                    if addrs.is_empty() && matches!(*rcode, "REFUSED" | "NXDOMAIN") =>
                {
                    code = Some(*rcode);
                }
                _ => return None,
            }
        }
        code
    }

    /// "A: REFUSED, AAAA: no answer within 2s", for reasons.
    pub(super) fn outcome(&self) -> String {
        self.asked()
            .iter()
            .map(|(qtype, asked)| match asked {
                Asked::Answered { rcode, .. } => format!("{qtype}: answered {rcode}"),
                Asked::Failed(e) => format!("{qtype}: {e}"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Asks the guard for the A and AAAA records of every name, a few names at a time.
pub(super) fn guard_lookups(
    names: &[&DomainName],
    listen: &[SocketAddr],
    ctx: &Ctx,
) -> Result<Vec<GuardLookup>, ProbeError> {
    let mut lookups = Vec::with_capacity(names.len());
    for chunk in names.chunks(MAX_WORKERS) {
        let done: Vec<GuardLookup> = thread::scope(|s| {
            let mut handles = Vec::with_capacity(chunk.len());
            for &name in chunk {
                let handle = thread::Builder::new()
                    .name("probe-dns".into())
                    .spawn_scoped(s, move || guard_lookup(name, listen, ctx))
                    .map_err(ProbeError::Thread)?;
                handles.push(handle);
            }
            Ok::<_, ProbeError>(
                handles
                    .into_iter()
                    .zip(chunk)
                    .map(|(h, &name)| {
                        h.join().unwrap_or_else(|_| GuardLookup {
                            name: name.clone(),
                            a: Asked::Failed("the lookup thread panicked".into()),
                            aaaa: Asked::Failed("the lookup thread panicked".into()),
                        })
                    })
                    .collect(),
            )
        })?;
        lookups.extend(done);
    }
    Ok(lookups)
}

pub(super) fn guard_lookup(name: &DomainName, listen: &[SocketAddr], ctx: &Ctx) -> GuardLookup {
    let (server, a) = ask_guard(listen, name.as_str(), QTYPE_A, ctx);
    // The AAAA question goes first to the address that answered the A question.
    let order: Vec<SocketAddr> = server
        .into_iter()
        .chain(listen.iter().copied().filter(|l| Some(*l) != server))
        .collect();
    let (_, aaaa) = ask_guard(&order, name.as_str(), QTYPE_AAAA, ctx);
    GuardLookup {
        name: name.clone(),
        a,
        aaaa,
    }
}

/// One question to the first listen address that responds.
fn ask_guard(
    listen: &[SocketAddr],
    name: &str,
    qtype: RecordType,
    ctx: &Ctx,
) -> (Option<SocketAddr>, Asked) {
    let mut failures = Vec::new();
    for &server in listen {
        match dns_exchange(server, name, qtype, ctx) {
            Ok(asked) => return (Some(server), asked),
            Err(e) => failures.push(format!("{server}: {e}")),
        }
    }
    (None, Asked::Failed(failures.join("; ")))
}

/// Asks `server` over UDP, and again over TCP when the response is truncated.
fn dns_exchange(
    server: SocketAddr,
    name: &str,
    qtype: RecordType,
    ctx: &Ctx,
) -> Result<Asked, String> {
    let id = random_u64() as u16;
    let query = dns_query(id, name, qtype);
    let mut reply = udp_exchange(server, &query, id, ctx.timeout)?;
    if message::peek_is_truncated(&reply) {
        reply = tcp_exchange(server, &query, id, ctx)?;
    }
    let rcode = dns_rcode(id, &reply).ok_or("the response does not match the query")?;
    let response =
        message::parse(&reply, MAX_MESSAGE).map_err(|e| format!("an unreadable response ({e})"))?;
    Ok(Asked::Answered {
        rcode,
        addrs: answered_addrs(name, &response.answers),
    })
}

/// The addresses an answer gives `name`: those of its records and of the CNAME chain from it,
/// A and AAAA records and HTTPS and SVCB hints whatever was asked, as the guard takes them
/// ([`message::on_chain`], [`crate::guard::record_addresses`]). A record of another name in the answer
/// (which a zone's owner may add under an allowed wildcard) is no address of `name`, and the
/// probe must not judge its targets by it.
fn answered_addrs(name: &str, answers: &[Record]) -> Vec<ResolvedAddr> {
    let Ok(mut asked) = Name::from_ascii(name) else {
        return Vec::new();
    };
    asked.set_fqdn(true);
    message::on_chain(&asked, answers)
        .flat_map(|r| {
            crate::guard::record_addresses(&r.data)
                .into_iter()
                .map(|addr| ResolvedAddr { addr, ttl: r.ttl })
        })
        .collect()
}

fn udp_exchange(
    server: SocketAddr,
    query: &[u8],
    id: u16,
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    let bind = match server {
        SocketAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        SocketAddr::V6(_) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
    };
    let socket = UdpSocket::bind(bind)
        .and_then(|s| s.connect(server).map(|()| s))
        .map_err(|e| describe(&e))?;
    exchange::udp_blocking(&socket, query, id, timeout).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            format!("no answer within {}", fmt_duration(timeout))
        }
        _ if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
            "nothing answers there (port unreachable)".into()
        }
        _ => describe(&e),
    })
}

fn tcp_exchange(server: SocketAddr, query: &[u8], id: u16, ctx: &Ctx) -> Result<Vec<u8>, String> {
    let mut stream = tcp_connect(server, ctx).map_err(|seen| match seen {
        Seen::RefusedRemotely(d) | Seen::RefusedHere(d) | Seen::NotSent(d) => d,
        _ => format!("no TCP connection within {}", fmt_duration(ctx.timeout)),
    })?;
    let reply = exchange::tcp_blocking(&mut stream, query, ctx.timeout)
        .map_err(|e| format!("over TCP: {}", describe(&e)))?;
    match dns_rcode(id, &reply) {
        Some(_) => Ok(reply),
        None => Err("the TCP response does not match the query".into()),
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use hickory_proto::rr::RData;
    use hickory_proto::rr::rdata::{A, AAAA, CNAME};

    use super::*;

    fn record(name: &str, data: RData) -> Record {
        Record::from_rdata(Name::from_str(name).expect("name"), 300, data)
    }

    #[test]
    fn only_the_asked_names_chain_gives_it_addresses() {
        let answers = [
            record(
                "WWW.Example.com.",
                RData::CNAME(CNAME(Name::from_str("edge.cdn.test.").expect("name"))),
            ),
            record("edge.cdn.test.", RData::A(A::new(192, 0, 2, 10))),
            // Records of names not asked, as a zone's owner may add them.
            record("blocked.test.", RData::A(A::new(203, 0, 113, 10))),
            record(
                "www.example.com.evil.",
                RData::AAAA(AAAA::from_str("2001:db8::10").expect("addr")),
            ),
        ];
        let addrs: Vec<IpAddr> = answered_addrs("www.example.com", &answers)
            .into_iter()
            .map(|a| a.addr)
            .collect();
        assert_eq!(addrs, [IpAddr::from([192, 0, 2, 10])]);
        assert!(answered_addrs("not a name\u{0}", &answers).is_empty());
    }

    /// The guard installs the address hints of an HTTPS or SVCB record on the chain whatever
    /// was asked (`guard::answer_addresses`), so a zone's owner under an allowed wildcard can
    /// put a blocked target in a hint of its answer to an A question: the probe must count
    /// it among the name's addresses, as the guard allows it.
    #[test]
    fn an_address_hint_in_an_answer_to_a_is_the_names_as_the_guard_installs_it() {
        use hickory_proto::rr::rdata::HTTPS;
        use hickory_proto::rr::rdata::svcb::{IpHint, SVCB, SvcParamKey, SvcParamValue};
        let hint = SVCB::new(
            1,
            Name::root(),
            vec![(
                SvcParamKey::Ipv4Hint,
                SvcParamValue::Ipv4Hint(IpHint(vec![A::new(203, 0, 113, 10)])),
            )],
        );
        let answers = [
            record("www.example.com.", RData::A(A::new(192, 0, 2, 10))),
            record("www.example.com.", RData::HTTPS(HTTPS(hint))),
        ];
        let addrs: Vec<IpAddr> = answered_addrs("www.example.com", &answers)
            .into_iter()
            .map(|a| a.addr)
            .collect();
        assert_eq!(
            addrs,
            [
                IpAddr::from([192, 0, 2, 10]),
                IpAddr::from([203, 0, 113, 10])
            ]
        );
    }
}
