//! The addresses an upstream answer brings for the asked name: what the daemon installs.

use std::net::IpAddr;

use hickory_proto::op::Message;
use hickory_proto::rr::RData;
use hickory_proto::rr::rdata::svcb::SvcParamValue;

use crate::core::installable::answered_addrs;
use crate::core::resolution::ResolvedAddr;
use crate::dns::message::on_chain;

/// The addresses that answer the question: A and AAAA records, and the address hints of
/// HTTPS and SVCB records (clients may connect to those without asking A or AAAA), owned by
/// the asked name or by a name the CNAME chain from it reaches. Records for unrelated names
/// are ignored. At most [`MAX_ADDRS_PER_FAMILY`](crate::core::installable::MAX_ADDRS_PER_FAMILY) addresses of each family are taken, the
/// first ones of the answer; the second value counts those left out.
pub fn answer_addresses(query: &Message, answer: &Message) -> (Vec<ResolvedAddr>, usize) {
    let Some(question) = query.queries.first() else {
        return (Vec::new(), 0);
    };
    let records = on_chain(question.name(), &answer.answers).flat_map(|r| {
        record_addresses(&r.data)
            .into_iter()
            .map(move |a| (a, r.ttl))
    });
    answered_addrs(records)
}

/// The addresses one record brings: an A or AAAA record's, or an HTTPS or SVCB record's
/// hints. The probe takes a name's addresses with this too, as the guard installs them.
pub fn record_addresses(data: &RData) -> Vec<IpAddr> {
    let svcb = match data {
        RData::HTTPS(https) => &https.0,
        RData::SVCB(svcb) => svcb,
        other => return other.ip_addr().into_iter().collect(),
    };
    svcb.svc_params
        .iter()
        .flat_map(|(_, value)| match value {
            SvcParamValue::Ipv4Hint(hint) => hint.0.iter().map(|a| IpAddr::from(a.0)).collect(),
            SvcParamValue::Ipv6Hint(hint) => hint.0.iter().map(|a| IpAddr::from(a.0)).collect(),
            _ => Vec::new(),
        })
        .collect()
}

#[cfg(test)]
mod tests {

    use std::str::FromStr;

    use hickory_proto::op::MessageType;
    use hickory_proto::rr::rdata::{A, AAAA, CNAME};
    use hickory_proto::rr::{Name, RecordType};

    use super::*;
    use crate::core::installable::MAX_ADDRS_PER_FAMILY;
    use crate::guard::testing::*;

    #[test]
    fn addresses_follow_the_cname_chain_and_ignore_strangers() {
        let q = query("www.pool.example.", RecordType::A);
        let mut a = q.clone();
        a.metadata.message_type = MessageType::Response;
        let name = |s: &str| Name::from_str(s).unwrap();
        a.add_answer(record(
            "www.pool.example.",
            300,
            RData::CNAME(CNAME(name("edge.cdn.example."))),
        ));
        a.add_answer(record(
            "edge.cdn.example.",
            60,
            RData::CNAME(CNAME(name("e1.cdn.example."))),
        ));
        a.add_answer(record(
            "e1.cdn.example.",
            20,
            RData::A(A::new(192, 0, 2, 7)),
        ));
        a.add_answer(record(
            "E1.CDN.example.",
            20,
            RData::AAAA(AAAA::from_str("2001:db8::7").unwrap()),
        ));
        // Not on the chain: an injected record for a name the client never asked.
        a.add_answer(record(
            "evil.example.",
            20,
            RData::A(A::new(203, 0, 113, 66)),
        ));
        let (got, _) = answer_addresses(&q, &a);
        let want: Vec<ResolvedAddr> = [("192.0.2.7", 20), ("2001:db8::7", 20)]
            .iter()
            .map(|(ip, ttl)| ResolvedAddr {
                addr: ip.parse().unwrap(),
                ttl: *ttl,
            })
            .collect();
        assert_eq!(got, want);

        // A CNAME loop ends.
        let mut looped = q.clone();
        looped.add_answer(record(
            "www.pool.example.",
            5,
            RData::CNAME(CNAME(name("x.example."))),
        ));
        looped.add_answer(record(
            "x.example.",
            5,
            RData::CNAME(CNAME(name("www.pool.example."))),
        ));
        assert!(answer_addresses(&q, &looped).0.is_empty());
    }

    #[test]
    fn an_answer_installs_at_most_its_first_addresses_of_each_family() {
        let q = query("big.pool.example.", RecordType::A);
        let mut a = q.clone();
        a.metadata.message_type = MessageType::Response;
        for i in 0..3000u32 {
            let addr = std::net::Ipv4Addr::from(0xc612_0000 + i);
            a.add_answer(record("big.pool.example.", 60, RData::A(A(addr))));
        }
        // The same address again counts once, with its lowest TTL.
        a.add_answer(record(
            "big.pool.example.",
            5,
            RData::A(A::new(198, 18, 0, 0)),
        ));
        a.add_answer(record(
            "big.pool.example.",
            60,
            RData::AAAA(AAAA::from_str("2001:db8::1").unwrap()),
        ));
        let (got, left_out) = answer_addresses(&q, &a);
        assert_eq!(left_out, 3000 - MAX_ADDRS_PER_FAMILY);
        assert_eq!(got.len(), MAX_ADDRS_PER_FAMILY + 1);
        let first = got.iter().find(|r| r.addr == IpAddr::from([198, 18, 0, 0]));
        assert_eq!(first.map(|r| r.ttl), Some(5));
        assert!(
            got.iter()
                .filter(|r| r.addr.is_ipv4())
                .all(|r| r.addr < IpAddr::from([198, 18, 0, MAX_ADDRS_PER_FAMILY as u8])),
            "the answer's first addresses are the ones taken: {got:?}"
        );
    }

    #[test]
    fn https_records_bring_their_address_hints() {
        use hickory_proto::rr::rdata::HTTPS;
        use hickory_proto::rr::rdata::svcb::{IpHint, SVCB, SvcParamKey};
        let q = query("a.pool.example.", RecordType::HTTPS);
        let mut a = q.clone();
        a.metadata.message_type = MessageType::Response;
        let svcb = SVCB::new(
            1,
            Name::root(),
            vec![
                (
                    SvcParamKey::Ipv4Hint,
                    SvcParamValue::Ipv4Hint(IpHint(vec![A::new(192, 0, 2, 8)])),
                ),
                (
                    SvcParamKey::Ipv6Hint,
                    SvcParamValue::Ipv6Hint(IpHint(vec![AAAA::from_str("2001:db8::8").unwrap()])),
                ),
            ],
        );
        a.add_answer(record("a.pool.example.", 300, RData::HTTPS(HTTPS(svcb))));
        let got: Vec<IpAddr> = answer_addresses(&q, &a).0.iter().map(|r| r.addr).collect();
        assert_eq!(
            got,
            [
                "192.0.2.8".parse::<IpAddr>().unwrap(),
                "2001:db8::8".parse().unwrap()
            ]
        );
    }
}
