//! Forwarding an allowed query: the query rebuilt from the checked question
//! ([`upstream_query`]), asked of each upstream in turn from a fresh marked socket (over UDP
//! one opened ahead, see [`super::pool`]), and the answer held until the daemon has its
//! addresses in the table.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, Query, ResponseCode};
use tokio::net::{TcpSocket, UdpSocket};
use tokio::sync::oneshot;
use tokio::time::timeout;
use tracing::{debug, warn};

use crate::core::installable::MAX_ADDRS_PER_FAMILY;
use crate::core::policy::DomainName;
use crate::core::resolution::ResolvedAddr;
use crate::core::trace::Record;
use crate::dns::exchange;
use crate::dns::message::{self, EdnsOffer, MAX_MESSAGE};

use super::addresses::answer_addresses;
use super::clients::Asker;
use super::counters::may_log;
use super::mark_socket;
use super::pool::{UpstreamSockets, random_id};
use super::rules::Rules;
use super::serve::Context;
use crate::core::policy::L4Proto;

/// How long one upstream resolver has to answer before the next is asked.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);

/// An answer for an allowed name, waiting for its addresses to be in the table. `done`
/// carries whether the kernel took them.
#[derive(Debug)]
pub struct Answered {
    pub name: DomainName,
    pub addrs: Vec<ResolvedAddr>,
    pub done: oneshot::Sender<bool>,
}

/// The socket of a UDP exchange, kept open until the answer is out, so that closing it is no
/// part of the answer's latency (it is never used again).
pub(super) type Spent = Option<UdpSocket>;

/// Asks upstream, has the answer's addresses installed, and returns the answer with the
/// client's id, and the exchange's socket to close once it is sent.
pub(super) async fn forward(
    context: &Context,
    rules: &Rules,
    query: &Message,
    name: DomainName,
    transport: L4Proto,
    asker: Asker,
) -> Result<(Vec<u8>, Spent), String> {
    let asked = ask_upstream(
        &context.upstream_sockets,
        &rules.upstream,
        rules.mark,
        query,
        transport,
    );
    // Polled in this order: the query goes upstream first, then who asked is looked up (if
    // the trace needs it) while the upstream answers.
    let (answer, uid) = tokio::join!(biased; asked, async { asker.uid() });
    let (mut reply, parsed, spent) = answer?;
    let arrived = Instant::now();
    let (addrs, left_out) = answer_addresses(query, &parsed);
    if left_out > 0
        && let Some(held_back) = may_log(context, rules)
    {
        warn!(name = %name, installed = addrs.len(), left_out, not_logged_before = held_back,
              "an answer brought more than {MAX_ADDRS_PER_FAMILY} addresses of a family; \
               only the first ones are allowed");
    }
    let count = addrs.len();
    if let Some(trace) = &context.trace {
        trace.record(Record::Name {
            time: crate::trace_file::now(),
            name: name.to_string(),
            qtype: query
                .queries
                .first()
                .map(|q| q.query_type().to_string())
                .unwrap_or_default(),
            answer: rcode_name(parsed.metadata.response_code),
            addrs: addrs.iter().map(|a| a.addr).collect(),
            ttl: addrs.iter().map(|a| a.ttl).min(),
            uid,
        });
    }
    // A name only an audit forwards has nothing installed: the audit window lets its
    // traffic through, and logs it.
    if !addrs.is_empty() && rules.allows(&name) {
        let (done, installed) = oneshot::channel();
        let request = Answered {
            name: name.clone(),
            addrs,
            done,
        };
        if context.answered.send(request).await.is_err() {
            return Err("the daemon is stopping".into());
        }
        match installed.await {
            Ok(true) => {}
            Ok(false) => {
                return Err(format!(
                    "the addresses of {name} were not installed (the kernel refused them, or \
                     too many names hold live addresses); the client would be refused"
                ));
            }
            Err(_) => return Err("the daemon dropped the request".into()),
        }
    }
    reply[..2].copy_from_slice(&query.metadata.id.to_be_bytes());
    // What the guard adds to an answer's latency (benches/guard.rs reads it).
    debug!(name = %name, addresses = count, held_us = arrived.elapsed().as_micros() as u64,
           "answer released");
    Ok((reply, spent))
}

/// A response code as DNS people write it ("NOERROR", "NXDOMAIN"), for the trace.
fn rcode_name(code: ResponseCode) -> String {
    match code {
        ResponseCode::NoError => "NOERROR".into(),
        ResponseCode::FormErr => "FORMERR".into(),
        ResponseCode::ServFail => "SERVFAIL".into(),
        ResponseCode::NXDomain => "NXDOMAIN".into(),
        ResponseCode::NotImp => "NOTIMP".into(),
        ResponseCode::Refused => "REFUSED".into(),
        other => format!("RCODE{}", u16::from(other)),
    }
}

/// The first upstream answer that matches the question, raw and parsed, with the socket of
/// its exchange over UDP.
async fn ask_upstream(
    sockets: &std::sync::Arc<UpstreamSockets>,
    upstream: &[SocketAddr],
    mark: u32,
    query: &Message,
    transport: L4Proto,
) -> Result<(Vec<u8>, Message, Spent), String> {
    let mut errors = Vec::new();
    for &server in upstream {
        // Over UDP the socket comes with its random id.
        let udp = match transport {
            L4Proto::Udp => match sockets.take(server, mark) {
                Ok(fresh) => Some(fresh),
                Err(e) => {
                    errors.push(format!("{server}: {e}"));
                    continue;
                }
            },
            L4Proto::Tcp => None,
        };
        let id = udp.as_ref().map_or_else(random_id, |fresh| fresh.id);
        let ours = upstream_query(query, id)
            .to_vec()
            .map_err(|e| format!("encoding the upstream query: {e}"))?;
        let exchange = async {
            match &udp {
                Some(fresh) => exchange::udp(&fresh.socket, &ours, id).await,
                None => ask_tcp(server, mark, &ours).await,
            }
        };
        let reply = match timeout(UPSTREAM_TIMEOUT, exchange).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(e)) => {
                errors.push(format!("{server}: {e}"));
                continue;
            }
            Err(_) => {
                errors.push(format!("{server}: no answer in {UPSTREAM_TIMEOUT:?}"));
                continue;
            }
        };
        match message::parse_reply(&reply, MAX_MESSAGE, id, &query.queries) {
            Ok(parsed) => return Ok((reply, parsed, udp.map(|fresh| fresh.socket))),
            Err(e) => errors.push(format!("{server}: {e}")),
        }
    }
    Err(format!("no upstream answered: {}", errors.join("; ")))
}

/// The EDNS payload size the guard offers upstream: the size that avoids IP fragmentation
/// (DNS flag day 2020), at most, and never less than the 512 bytes of plain DNS.
const UPSTREAM_PAYLOAD: u16 = 1232;

/// The query the guard sends upstream for a checked `query`, rebuilt from what the guard
/// checked and nothing else: the question (name, type, class), the RD flag, the fresh `id`,
/// and EDNS only if the client used it, with the guard's own fields (version 0, the DO bit,
/// a payload size the guard bounds, no options). The client's other bits, EDNS options,
/// answer, authority and additional records and any trailing bytes are not forwarded: a
/// client could otherwise carry data to the upstream (and past it) in them.
pub fn upstream_query(query: &Message, id: u16) -> Message {
    let questions = query.queries.iter().map(|q| {
        let mut question = Query::query(q.name().clone(), q.query_type());
        question.set_query_class(q.query_class());
        question
    });
    let edns = query.edns.as_ref().map(|client| EdnsOffer {
        // The client's buffer bounds what it can take over UDP; the guard passes the answer
        // on as it came, so it asks for no more than that.
        max_payload: client.max_payload().clamp(512, UPSTREAM_PAYLOAD),
        dnssec_ok: client.flags().dnssec_ok,
    });
    message::query(id, questions, query.metadata.recursion_desired, edns)
}

async fn ask_tcp(server: SocketAddr, mark: u32, query: &[u8]) -> io::Result<Vec<u8>> {
    let socket = match server {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    // Before connect: the SYN is the packet the table judges.
    mark_socket(&socket, mark)?;
    let mut stream = socket.connect(server).await?;
    exchange::tcp(&mut stream, query).await
}

#[cfg(test)]
mod tests {

    use hickory_proto::op::MessageType;
    use hickory_proto::rr::{RData, RecordType};

    use super::*;
    use crate::guard::rules::{Verdict, judge};
    use crate::guard::testing::*;

    /// A client's query carrying an EDNS option of its own, an answer and an additional
    /// record and trailing bytes: upstream gets the question, RD and the guard's EDNS only.
    #[test]
    fn the_upstream_query_is_rebuilt_from_the_checked_question_alone() {
        use hickory_proto::op::Edns;
        use hickory_proto::rr::rdata::TXT;
        use hickory_proto::rr::rdata::opt::EdnsOption;
        const SECRET: &[u8] = b"SECRET-BYTES-0123456789";
        let secret = String::from_utf8(SECRET.to_vec()).unwrap();
        let mut client = query("API.example.", RecordType::AAAA);
        client.metadata.checking_disabled = true;
        let mut edns = Edns::new();
        edns.set_max_payload(4096);
        edns.set_dnssec_ok(true);
        edns.options_mut()
            .insert(EdnsOption::Unknown(65001, SECRET.to_vec()));
        client.set_edns(edns);
        client.add_answer(record(
            "x.example.",
            60,
            RData::TXT(TXT::new(vec![secret.clone()])),
        ));
        client.add_additional(record("y.example.", 60, RData::TXT(TXT::new(vec![secret]))));
        let mut raw = client.to_vec().unwrap();
        raw.extend_from_slice(SECRET);
        let contains = |hay: &[u8]| hay.windows(SECRET.len()).any(|w| w == SECRET);
        assert!(contains(&raw));
        // The guard parses what it got (trailing bytes and all), checks the question, and
        // sends this:
        let parsed = Message::from_vec(&raw).expect("parses despite the trailing bytes");
        assert!(matches!(judge(&parsed, &rules()), Verdict::Forward(_)));
        let ours = upstream_query(&parsed, 0xbeef);
        let bytes = ours.to_vec().unwrap();
        assert!(!contains(&bytes), "the client's bytes went upstream");
        let back = Message::from_vec(&bytes).unwrap();
        assert_eq!(back.metadata.id, 0xbeef);
        assert_eq!(back.metadata.message_type, MessageType::Query);
        assert!(back.metadata.recursion_desired);
        assert!(!back.metadata.checking_disabled);
        assert_eq!(back.queries, parsed.queries, "the question, case and all");
        assert!(back.answers.is_empty() && back.authorities.is_empty());
        assert!(back.additionals.is_empty());
        let edns = back.edns.expect("EDNS, since the client used it");
        assert_eq!(edns.max_payload(), UPSTREAM_PAYLOAD);
        assert!(edns.flags().dnssec_ok);
        assert_eq!(edns.options().as_ref().len(), 0, "no client options");
        // Without EDNS from the client, none upstream (plain DNS, 512 bytes over UDP).
        let plain = query("api.example.", RecordType::A);
        assert!(upstream_query(&plain, 1).edns.is_none());
        assert_eq!(
            upstream_query(&plain, 1).to_vec().unwrap().len(),
            12 + 13 + 4
        );
    }
}
