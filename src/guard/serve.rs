//! Serving the listening sockets: UDP datagrams and TCP connections, each query decided at
//! once ([`prepare`]: dropped, answered, or left to forward) and only forwarded ones holding
//! a slot.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hickory_proto::op::{Message, OpCode, ResponseCode};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{Semaphore, broadcast, mpsc, watch};
use tokio::time::timeout;
use tracing::{debug, info, warn};

use crate::core::policy::{DomainName, L4Proto};
use crate::core::trace::Record;
use crate::dns::frame;
use crate::dns::message;
use crate::host::HostAddrsCache;
use crate::trace_file::TraceSink;
use crate::watch::QueryEvent;

use super::clients::{
    Asker, ClientKey, ClientLimits, LookUp, is_local, open_sock_diag, shared_client_key,
};
use super::counters::{Counters, LogBudget, may_log};
use super::pool::UpstreamSockets;
use super::rules::{Rules, Verdict, judge};
use super::upstream::{Answered, Spent, forward};

/// How long a TCP client may stay idle between queries.
const TCP_IDLE: Duration = Duration::from_secs(10);

/// How long a new TCP client has to send its first whole query: a connection that sends
/// nothing (or one byte) must not hold a slot for long.
const TCP_FIRST_QUERY: Duration = Duration::from_secs(2);

/// The largest query taken: a question (a name of at most 255 bytes) with an OPT record,
/// cookies and padding stays far below this, the payload size that avoids fragmentation.
/// Anything longer is no query and is dropped unread, without a reply or a slot.
const MAX_QUERY: usize = 1232;

/// What the serving tasks share.
pub struct Context {
    pub in_flight: Arc<Semaphore>,
    pub log_budget: std::sync::Mutex<LogBudget>,
    pub rules: watch::Receiver<Arc<Rules>>,
    pub answered: mpsc::Sender<Answered>,
    pub events: broadcast::Sender<QueryEvent>,
    pub counters: Arc<Counters>,
    /// `run --record` and `learn`: every name asked, answered or refused, goes here.
    pub trace: Option<TraceSink>,
    /// Upstream UDP sockets opened ahead of need.
    pub upstream_sockets: Arc<UpstreamSockets>,
}

/// What the receiving loop does with one UDP datagram or TCP message, decided at once: only
/// a query that must be forwarded takes a slot and a task.
enum Prepared {
    Drop,
    Reply(Vec<u8>),
    Forward(Forward),
}

/// A checked query for an allowed name, waiting to be forwarded.
pub(super) struct Forward {
    query: Message,
    name: DomainName,
    rules: Arc<Rules>,
    /// Who asked, for the trace.
    asker: Asker,
}

pub(super) async fn serve_udp(
    socket: Arc<UdpSocket>,
    context: Arc<Context>,
    forwarding: Arc<ClientLimits>,
) {
    // One byte more than a query may be: a datagram that fills it is oversize.
    let mut buf = vec![0u8; MAX_QUERY + 1];
    let diag = open_sock_diag();
    let mut host = HostAddrsCache::new();
    let Ok(local) = socket.local_addr() else {
        return;
    };
    loop {
        let (len, client) = match socket.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                // ICMP errors of earlier replies surface here; the socket itself is fine.
                debug!(error = %e, "receiving a DNS query");
                continue;
            }
        };
        if len > MAX_QUERY {
            debug!(client = %client, "dropping a datagram too long to be a query");
            continue;
        }
        let forward = match prepare(&context, &buf[..len], client, L4Proto::Udp) {
            Prepared::Drop => continue,
            Prepared::Reply(reply) => {
                if let Err(e) = socket.send_to(&reply, client).await {
                    debug!(error = %e, client = %client, "sending a DNS answer");
                }
                continue;
            }
            Prepared::Forward(forward) => forward,
        };
        // Never wait here: the loop serves every client, and a client over its share (or a
        // guard out of slots) loses this query, which it asks again. A local client is told
        // apart here only when its slot depends on it; the trace's uid is looked up while the
        // upstream answers.
        let untold = is_local(host.current(), client)
            .then(|| forwarding.try_take_unidentified())
            .flatten();
        let (slot, asker) = match untold {
            Some(slot) => {
                let asker = match context.trace {
                    Some(_) => Asker::LookUp(Box::new(LookUp {
                        diag: diag.clone(),
                        local,
                        client,
                    })),
                    None => Asker::Known(None),
                };
                (Some(slot), asker)
            }
            None => {
                let key = shared_client_key(&diag, host.current(), L4Proto::Udp, local, client);
                (forwarding.try_take(key), Asker::Known(key.uid()))
            }
        };
        let forward = Forward { asker, ..forward };
        let Some(slot) = slot else {
            debug!(client = %client, "this client has too many queries in flight; dropping one");
            continue;
        };
        let Ok(permit) = context.in_flight.clone().try_acquire_owned() else {
            debug!(client = %client, "too many queries in flight; dropping one");
            continue;
        };
        let (socket, context) = (socket.clone(), context.clone());
        tokio::spawn(async move {
            let _held = (permit, slot);
            if let Some((reply, spent)) =
                forward_reply(&context, forward, client, L4Proto::Udp).await
            {
                if let Err(e) = socket.send_to(&reply, client).await {
                    debug!(error = %e, client = %client, "sending a DNS answer");
                }
                drop(spent);
            }
        });
    }
}

pub(super) async fn serve_tcp(
    listener: TcpListener,
    max_clients: usize,
    context: Arc<Context>,
    forwarding: Arc<ClientLimits>,
    connected: Arc<ClientLimits>,
) {
    let clients = Arc::new(Semaphore::new(max_clients));
    let diag = open_sock_diag();
    let mut host = HostAddrsCache::new();
    loop {
        match listener.accept().await {
            Ok((stream, client)) => {
                let Ok(local) = stream.local_addr() else {
                    continue;
                };
                // The connection's client, once: its uid stays while it is connected.
                let key = shared_client_key(&diag, host.current(), L4Proto::Tcp, local, client);
                let Some(slot) = connected.try_take(key) else {
                    debug!(client = %client, "this client has too many DNS connections; closing this one");
                    continue;
                };
                let Ok(permit) = clients.clone().try_acquire_owned() else {
                    debug!(client = %client, "too many DNS connections; closing this one");
                    continue;
                };
                let (context, forwarding) = (context.clone(), forwarding.clone());
                tokio::spawn(async move {
                    serve_tcp_client(stream, client, key, context, forwarding).await;
                    drop((permit, slot));
                });
            }
            Err(e) => {
                // Out of descriptors, say: keep serving UDP and try again shortly.
                warn!(error = %e, "accepting a DNS connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Queries on one connection are answered in turn (RFC 7766 allows pipelining; clients that
/// pipeline still get every answer, in order). The first query must arrive whole within
/// [`TCP_FIRST_QUERY`], each later one within [`TCP_IDLE`]; a message longer than a query
/// may be ends the connection.
async fn serve_tcp_client(
    mut stream: TcpStream,
    client: SocketAddr,
    key: ClientKey,
    context: Arc<Context>,
    forwarding: Arc<ClientLimits>,
) {
    let mut wait = TCP_FIRST_QUERY;
    while let Ok(Ok(query)) = timeout(wait, frame::read(&mut stream, MAX_QUERY)).await {
        wait = TCP_IDLE;
        let reply = match prepare(&context, &query, client, L4Proto::Tcp) {
            Prepared::Drop => continue,
            Prepared::Reply(reply) => reply,
            Prepared::Forward(forward) => {
                let Some(_slot) = forwarding.try_take(key) else {
                    debug!(client = %client, "this client has too many queries in flight");
                    match encode(&reply_to(&forward.query, ResponseCode::ServFail)) {
                        Some(reply) if frame::write(&mut stream, &reply).await.is_ok() => {
                            continue;
                        }
                        _ => return,
                    }
                };
                let Ok(_permit) = context.in_flight.acquire().await else {
                    return;
                };
                let forward = Forward {
                    asker: Asker::Known(key.uid()),
                    ..forward
                };
                match forward_reply(&context, forward, client, L4Proto::Tcp).await {
                    Some((reply, _)) => reply,
                    None => return,
                }
            }
        };
        if frame::write(&mut stream, &reply).await.is_err() {
            return;
        }
    }
}

/// The reply to `raw` (`None`: send nothing).
#[cfg(test)]
pub(super) async fn answer(
    context: &Context,
    raw: &[u8],
    client: SocketAddr,
    transport: L4Proto,
) -> Option<Vec<u8>> {
    match prepare(context, raw, client, transport) {
        Prepared::Drop => None,
        Prepared::Reply(reply) => Some(reply),
        Prepared::Forward(forward) => forward_reply(context, forward, client, transport)
            .await
            .map(|(reply, _)| reply),
    }
}

/// What to do with `raw`, decided without waiting for anything: refusals and errors are
/// answered here (and reported), and only an allowed name is left to forward.
fn prepare(context: &Context, raw: &[u8], client: SocketAddr, transport: L4Proto) -> Prepared {
    let reply = |msg: &Message| encode(msg).map_or(Prepared::Drop, Prepared::Reply);
    let Ok(query) = message::parse(raw, MAX_QUERY) else {
        // Answer FORMERR only when there is a header to answer, and never a response: two
        // servers could answer each other's errors forever.
        let Some(id) = message::peek_id(raw) else {
            return Prepared::Drop;
        };
        if message::peek_is_response(raw) {
            return Prepared::Drop;
        }
        return reply(&Message::error_msg(
            id,
            OpCode::Query,
            ResponseCode::FormErr,
        ));
    };
    let rules = context.rules.borrow().clone();
    match judge(&query, &rules) {
        Verdict::Ignore => Prepared::Drop,
        Verdict::Reply(code) => reply(&reply_to(&query, code)),
        Verdict::Refuse { name, qtype, why } => {
            context.counters.refused.fetch_add(1, Ordering::Relaxed);
            let (code, answer) = why.code(rules.refuse_with);
            let note = why.note();
            if let Some(held_back) = may_log(context, &rules) {
                info!(name = %name, qtype = %qtype, client = %client, transport = transport.name(),
                      answer = answer, not_logged_before = held_back,
                      "refused DNS query: {note}");
            }
            if let Some(trace) = &context.trace {
                trace.record(Record::Name {
                    time: crate::trace_file::now(),
                    name: name.to_ascii_lowercase(),
                    qtype: qtype.clone(),
                    answer: answer.to_string(),
                    addrs: Vec::new(),
                    ttl: None,
                    uid: None,
                });
            }
            // Nobody listening is fine.
            let _ = context.events.send(QueryEvent::refused(
                name,
                qtype,
                client,
                transport.name(),
                answer,
                note,
            ));
            reply(&reply_to(&query, code))
        }
        Verdict::Forward(name) => Prepared::Forward(Forward {
            query,
            name,
            rules,
            asker: Asker::Known(None),
        }),
    }
}

/// Forwards a checked query and returns the reply for the client (`None`: send nothing),
/// with the upstream socket to close once it is sent.
async fn forward_reply(
    context: &Context,
    Forward {
        query,
        name,
        rules,
        asker,
    }: Forward,
    client: SocketAddr,
    transport: L4Proto,
) -> Option<(Vec<u8>, Spent)> {
    let asked = std::time::Instant::now();
    match forward(context, &rules, &query, name, transport, asker).await {
        Ok(answered) => {
            context.counters.answered.fetch_add(1, Ordering::Relaxed);
            context.counters.answer_latency.observe(asked.elapsed());
            Some(answered)
        }
        Err(why) => {
            context.counters.failed.fetch_add(1, Ordering::Relaxed);
            if let Some(held_back) = may_log(context, &rules) {
                warn!(client = %client, not_logged_before = held_back,
                      "answering SERVFAIL: {why}");
            }
            encode(&reply_to(&query, ResponseCode::ServFail)).map(|reply| (reply, None))
        }
    }
}

/// A reply to `query` with `code`, the question echoed and no records.
fn reply_to(query: &Message, code: ResponseCode) -> Message {
    let mut reply = Message::error_msg(query.metadata.id, query.metadata.op_code, code);
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    reply.add_queries(query.queries.iter().cloned());
    reply
}

fn encode(msg: &Message) -> Option<Vec<u8>> {
    msg.to_vec()
        .inspect_err(|e| warn!(error = %e, "encoding a DNS reply"))
        .ok()
}

#[cfg(test)]
mod tests {

    use std::net::IpAddr;
    use std::str::FromStr;

    use hickory_proto::op::MessageType;
    use hickory_proto::rr::rdata::A;
    use hickory_proto::rr::{Name, RData, RecordType};

    use super::*;
    use crate::core::resolution::ResolvedAddr;
    use crate::guard::limits::in_flight_limit;
    use crate::guard::testing::*;

    #[test]
    fn refusals_echo_the_question_and_the_flags() {
        let q = query("secret.attacker.example.", RecordType::A);
        let bytes = encode(&reply_to(&q, ResponseCode::Refused)).expect("encodes");
        let back = Message::from_vec(&bytes).expect("parses");
        assert_eq!(back.metadata.id, q.metadata.id);
        assert_eq!(back.metadata.message_type, MessageType::Response);
        assert_eq!(back.metadata.response_code, ResponseCode::Refused);
        assert!(back.metadata.recursion_desired && back.metadata.recursion_available);
        assert_eq!(back.queries, q.queries);
        assert!(back.answers.is_empty());
    }

    #[tokio::test]
    async fn an_answer_waits_for_the_kernel_and_a_refusal_becomes_servfail() {
        let mut rules = rules();
        rules.upstream = vec![fake_upstream().await];
        let (_keep, rules_rx) = watch::channel(Arc::new(rules));
        let (answered, mut daemon) = mpsc::channel(8);
        let context = Arc::new(Context {
            in_flight: in_flight_limit(),
            log_budget: Default::default(),
            rules: rules_rx,
            answered,
            events: broadcast::channel(8).0,
            counters: Arc::new(Counters::default()),
            trace: None,
            upstream_sockets: Default::default(),
        });
        let client: SocketAddr = "127.0.0.1:5353".parse().unwrap();
        let ask = |name: &str| {
            let q = query(name, RecordType::A);
            let raw = q.to_vec().unwrap();
            let context = context.clone();
            (
                q,
                tokio::spawn(async move { answer(&context, &raw, client, L4Proto::Udp).await }),
            )
        };

        let (q, pending) = ask("a.pool.example.");
        let request = daemon.recv().await.expect("the daemon is asked to install");
        assert_eq!(request.name.as_str(), "a.pool.example");
        assert_eq!(
            request.addrs,
            [ResolvedAddr {
                addr: "192.0.2.7".parse().unwrap(),
                ttl: 60
            }]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !pending.is_finished(),
            "released before the kernel acknowledged"
        );
        request.done.send(true).unwrap();
        let reply = Message::from_vec(&pending.await.unwrap().expect("a reply")).unwrap();
        assert_eq!(reply.metadata.id, q.metadata.id, "the client's own id");
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert_eq!(reply.answers.len(), 1);

        let (_, pending) = ask("b.pool.example.");
        let request = daemon.recv().await.expect("the daemon is asked to install");
        request.done.send(false).unwrap();
        let reply = Message::from_vec(&pending.await.unwrap().expect("a reply")).unwrap();
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
        assert!(
            reply.answers.is_empty(),
            "no answer the client could not use"
        );
        assert_eq!(context.counters.failed.load(Ordering::Relaxed), 1);
        assert_eq!(context.counters.answered.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn garbage_gets_formerr_unless_it_is_a_response_or_headless() {
        let (_keep, rules_rx) = watch::channel(Arc::new(rules()));
        let context = Context {
            in_flight: in_flight_limit(),
            log_budget: Default::default(),
            rules: rules_rx,
            answered: mpsc::channel(1).0,
            events: broadcast::channel(1).0,
            counters: Arc::new(Counters::default()),
            trace: None,
            upstream_sockets: Default::default(),
        };
        let client: SocketAddr = "127.0.0.1:5353".parse().unwrap();
        // A header claiming a question the message does not hold.
        let query = [0x12, 0x34, 0x01, 0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0, 0x03];
        let reply = answer(&context, &query, client, L4Proto::Udp)
            .await
            .expect("a reply");
        let reply = Message::from_vec(&reply).expect("parses");
        assert_eq!(reply.metadata.id, 0x1234);
        assert_eq!(reply.metadata.response_code, ResponseCode::FormErr);
        let mut response = query;
        response[2] |= 0x80;
        assert!(
            answer(&context, &response, client, L4Proto::Udp)
                .await
                .is_none()
        );
        assert!(
            answer(&context, &[0x12], client, L4Proto::Udp)
                .await
                .is_none()
        );
    }

    /// An answer with another id or to another question (spoofed, or a confused server) is
    /// never taken: the next upstream is asked, and its addresses are the ones installed.
    #[tokio::test]
    async fn answers_that_do_not_match_the_question_are_not_taken() {
        let other_id: fn(Message) -> Message = |mut a| {
            a.metadata.id = a.metadata.id.wrapping_add(1);
            a
        };
        let other_question: fn(Message) -> Message = |mut a| {
            a.queries[0].set_name(Name::from_str("evil.example.").unwrap());
            a.answers[0].data = RData::A(A::new(203, 0, 113, 66));
            a
        };
        let mut rules = rules();
        rules.upstream = vec![
            fake_upstream_with(other_question).await,
            fake_upstream_with(other_id).await,
            fake_upstream().await,
        ];
        let (_keep, rules_rx) = watch::channel(Arc::new(rules));
        let (answered, mut daemon) = mpsc::channel(8);
        let context = Arc::new(Context {
            in_flight: in_flight_limit(),
            log_budget: Default::default(),
            rules: rules_rx,
            answered,
            events: broadcast::channel(8).0,
            counters: Arc::new(Counters::default()),
            trace: None,
            upstream_sockets: Default::default(),
        });
        let raw = query("a.pool.example.", RecordType::A).to_vec().unwrap();
        let client: SocketAddr = "127.0.0.1:5353".parse().unwrap();
        let asking = context.clone();
        let pending =
            tokio::spawn(async move { answer(&asking, &raw, client, L4Proto::Udp).await });
        // The mismatched id is skipped until the first upstream's time runs out; the wrong
        // question is refused at once. Either way the third upstream answers.
        let request = daemon.recv().await.expect("the daemon is asked to install");
        let addrs: Vec<IpAddr> = request.addrs.iter().map(|a| a.addr).collect();
        assert_eq!(addrs, ["192.0.2.7".parse::<IpAddr>().unwrap()]);
        request.done.send(true).unwrap();
        let reply = Message::from_vec(&pending.await.unwrap().expect("a reply")).unwrap();
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert_eq!(reply.queries[0].name().to_ascii(), "a.pool.example.");
    }
}
