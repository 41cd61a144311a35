//! What the guard's unit tests share: a policy, queries, records and fake upstreams.

use std::net::SocketAddr;
use std::path::Path;
use std::str::FromStr;

use hickory_proto::op::{Message, MessageType, Query};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use tokio::net::UdpSocket;

use crate::core::guard_identity::GuardIdentity;
use crate::core::policy::Policy;

use super::rules::Rules;

pub(super) fn rules() -> Rules {
    let policy = Policy::parse(
        "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [443]\n  - domain: api.example\n    ports: [443]\n  - cidr: 192.0.2.0/24\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n",
        Path::new("p.yaml"),
    )
    .expect("valid");
    let identity = GuardIdentity::of_policy(&policy, 993).expect("guard mode");
    Rules::of(&policy, &identity).expect("guard mode")
}

pub(super) fn query(name: &str, rtype: RecordType) -> Message {
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_str(name).unwrap(), rtype));
    m
}

pub(super) fn record(name: &str, ttl: u32, data: RData) -> Record {
    Record::from_rdata(Name::from_str(name).unwrap(), ttl, data)
}

/// An upstream on loopback that answers every A question with 192.0.2.7, TTL 60.
pub(super) async fn fake_upstream() -> SocketAddr {
    fake_upstream_with(|a| a).await
}

/// Like [`fake_upstream`], with `tamper` applied to each answer before it is sent.
pub(super) async fn fake_upstream_with(tamper: fn(Message) -> Message) -> SocketAddr {
    let socket = UdpSocket::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = socket.local_addr().expect("local address");
    tokio::spawn(async move {
        let mut buf = vec![0u8; 512];
        while let Ok((n, from)) = socket.recv_from(&mut buf).await {
            let Ok(q) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            let mut a = q.clone();
            a.metadata.message_type = MessageType::Response;
            let name = q.queries[0].name().clone();
            a.add_answer(Record::from_rdata(name, 60, RData::A(A::new(192, 0, 2, 7))));
            let _ = socket.send_to(&tamper(a).to_vec().unwrap(), from).await;
        }
    });
    addr
}
