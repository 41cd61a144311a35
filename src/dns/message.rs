//! The DNS message codec every exchange of the tool uses (the guard, the probe, the test
//! harness): building queries, peeking at a header that may not parse, parsing with a size
//! limit, and telling whether a response answers the query that was sent.
//!
//! Every message read is hostile input: nothing here trusts a length, an id or a question
//! that was not checked, and a message longer than its caller takes is refused unread.

use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, Record};
use hickory_proto::serialize::binary::DecodeError;

/// The length of a DNS header: id, flags and the four section counts.
pub const HEADER_LEN: usize = 12;

/// The longest DNS message: what a TCP length prefix can say, and a UDP datagram hold.
pub const MAX_MESSAGE: usize = 65_535;

/// What a query offers in its EDNS record (RFC 6891), when it has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdnsOffer {
    /// The largest UDP response the asker takes.
    pub max_payload: u16,
    /// The DO bit: DNSSEC records wanted.
    pub dnssec_ok: bool,
}

/// A standard query (opcode QUERY) with id `id`, the questions in order, the RD flag and,
/// with `edns`, an OPT record of version 0 carrying only the offer (no options). Nothing else
/// is set: every bit of it is one the caller chose.
pub fn query(
    id: u16,
    questions: impl IntoIterator<Item = Query>,
    recursion_desired: bool,
    edns: Option<EdnsOffer>,
) -> Message {
    let mut message = Message::new(id, MessageType::Query, OpCode::Query);
    message.metadata.recursion_desired = recursion_desired;
    for question in questions {
        message.add_query(question);
    }
    if let Some(offer) = edns {
        let mut record = Edns::new();
        record.set_max_payload(offer.max_payload);
        record.set_dnssec_ok(offer.dnssec_ok);
        message.set_edns(record);
    }
    message
}

/// Why bytes are not a message the caller takes.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("a DNS message of {len} bytes, longer than the {max} taken")]
    TooLong { len: usize, max: usize },
    #[error("{0}")]
    Malformed(DecodeError),
}

/// `bytes` as a message, if it is one of at most `max` bytes (which is checked before
/// anything is decoded). Trailing bytes after the last record are ignored, as hickory does.
pub fn parse(bytes: &[u8], max: usize) -> Result<Message, ParseError> {
    if bytes.len() > max {
        return Err(ParseError::TooLong {
            len: bytes.len(),
            max,
        });
    }
    Message::from_vec(bytes).map_err(ParseError::Malformed)
}

/// The id of whatever `bytes` are, if they are long enough to hold one: what an error reply
/// to a message that does not parse carries.
pub fn peek_id(bytes: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes([*bytes.first()?, *bytes.get(1)?]))
}

/// Whether `bytes` carry the QR bit of a response (false when too short to say).
pub fn peek_is_response(bytes: &[u8]) -> bool {
    bytes.get(2).is_some_and(|flags| flags & 0x80 != 0)
}

/// Whether `bytes` carry the TC bit: the answer did not fit (ask again over TCP).
pub fn peek_is_truncated(bytes: &[u8]) -> bool {
    bytes.get(2).is_some_and(|flags| flags & 0x02 != 0)
}

/// The response code of the header of `bytes` (its four bits, not EDNS's extension), if they
/// hold a whole header of a response with id `id`: the cheap first check of a datagram that
/// arrives for a query, before anything else of it is read.
pub fn response_code(bytes: &[u8], id: u16) -> Option<ResponseCode> {
    let header = bytes.get(..HEADER_LEN)?;
    if header[..2] != id.to_be_bytes() || header[2] & 0x80 == 0 {
        return None;
    }
    Some(ResponseCode::from_low(header[3] & 0x0f))
}

/// A response code as the probe and its readers write it: "NOERROR", "REFUSED", ...; codes
/// past REFUSED are "other response code".
pub fn rcode_name(code: ResponseCode) -> &'static str {
    match code.low() {
        0 => "NOERROR",
        1 => "FORMERR",
        2 => "SERVFAIL",
        3 => "NXDOMAIN",
        4 => "NOTIMP",
        5 => "REFUSED",
        _ => "other response code",
    }
}

/// Why a response is not taken for the answer to a query.
#[derive(Debug, thiserror::Error)]
pub enum ReplyError {
    #[error("a malformed answer ({0})")]
    Malformed(ParseError),
    #[error("an answer to another question")]
    Mismatch,
}

/// `bytes` parsed, if they are a response with id `id` to exactly `questions` (name, type and
/// class; names compare as DNS compares them, without regard to case): a spoofed answer or
/// one of a confused server is refused.
pub fn parse_reply(
    bytes: &[u8],
    max: usize,
    id: u16,
    questions: &[Query],
) -> Result<Message, ReplyError> {
    let reply = parse(bytes, max).map_err(ReplyError::Malformed)?;
    if reply.metadata.id == id
        && reply.metadata.message_type == MessageType::Response
        && reply.queries == questions
    {
        Ok(reply)
    } else {
        Err(ReplyError::Mismatch)
    }
}

/// CNAME hops followed from the asked name, as resolvers bound them.
const MAX_CHAIN: usize = 16;

/// The records of `answers` that answer `asked`: those owned by the asked name or by a name
/// the CNAME chain from it reaches (in any order, loops ended, at most [`MAX_CHAIN`] hops;
/// names compare without regard to case). An answer is hostile input: a record of any other
/// name is one nobody asked for, and installing its address under the asked name would
/// allow what no entry names.
pub fn on_chain<'a>(asked: &'a Name, answers: &'a [Record]) -> impl Iterator<Item = &'a Record> {
    let mut chain: Vec<&Name> = vec![asked];
    for _ in 0..MAX_CHAIN {
        let next = answers.iter().find_map(|r| match &r.data {
            RData::CNAME(target) if chain.iter().any(|n| **n == r.name) => {
                (!chain.contains(&&target.0)).then_some(&target.0)
            }
            _ => None,
        });
        match next {
            Some(target) => chain.push(target),
            None => break,
        }
    }
    answers.iter().filter(move |r| chain.contains(&&r.name))
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use hickory_proto::rr::{Name, RecordType};

    use super::*;

    fn question(name: &str) -> Query {
        Query::query(Name::from_str(name).unwrap(), RecordType::A)
    }

    fn answer_to(query: &Message) -> Vec<u8> {
        let mut reply = query.clone();
        reply.metadata.message_type = MessageType::Response;
        reply.to_vec().unwrap()
    }

    /// The bytes a plain query makes: header, one question, nothing else; with an offer, one
    /// OPT record of 11 bytes more.
    #[test]
    fn a_query_holds_only_what_was_asked() {
        let plain = query(0x1234, [question("api.example.")], true, None);
        let bytes = plain.to_vec().unwrap();
        assert_eq!(bytes.len(), HEADER_LEN + 13 + 4);
        assert_eq!(&bytes[..4], &[0x12, 0x34, 0x01, 0x00], "id, RD only");
        assert_eq!(&bytes[4..12], &[0, 1, 0, 0, 0, 0, 0, 0]);
        let offer = EdnsOffer {
            max_payload: 1232,
            dnssec_ok: true,
        };
        let with_edns = query(7, [question("api.example.")], false, Some(offer));
        let bytes = with_edns.to_vec().unwrap();
        assert_eq!(bytes.len(), HEADER_LEN + 13 + 4 + 11);
        let back = parse(&bytes, MAX_MESSAGE).unwrap();
        assert!(!back.metadata.recursion_desired);
        let edns = back.edns.expect("an OPT record");
        assert_eq!(edns.max_payload(), 1232);
        assert!(edns.flags().dnssec_ok);
        assert_eq!(edns.options().as_ref().len(), 0);
    }

    #[test]
    fn oversize_and_truncated_messages_are_refused() {
        let bytes = query(1, [question("api.example.")], true, None)
            .to_vec()
            .unwrap();
        assert!(matches!(
            parse(&bytes, bytes.len() - 1),
            Err(ParseError::TooLong { .. })
        ));
        assert!(parse(&bytes, bytes.len()).is_ok());
        for cut in [0, 1, 11, 12, bytes.len() - 1] {
            assert!(
                matches!(
                    parse(&bytes[..cut], MAX_MESSAGE),
                    Err(ParseError::Malformed(_))
                ),
                "{cut}"
            );
        }
    }

    #[test]
    fn a_header_is_read_only_when_whole_and_a_response_to_the_id() {
        let q = query(0xbeef, [question("api.example.")], true, None);
        let mut reply = answer_to(&q);
        reply[3] = (reply[3] & 0xf0) | 5;
        assert_eq!(response_code(&reply, 0xbeef), Some(ResponseCode::Refused));
        assert_eq!(rcode_name(ResponseCode::Refused), "REFUSED");
        assert_eq!(rcode_name(ResponseCode::BADCOOKIE), "other response code");
        assert_eq!(response_code(&reply, 0xbeee), None, "another id");
        assert_eq!(response_code(&reply[..11], 0xbeef), None, "cut short");
        let asked = q.to_vec().unwrap();
        assert_eq!(
            response_code(&asked, 0xbeef),
            None,
            "a query, not a response"
        );
        assert_eq!(peek_id(&[0xab]), None);
        assert_eq!(peek_id(&[0xab, 0xcd]), Some(0xabcd));
        assert!(!peek_is_response(&[0xab, 0xcd]));
        assert!(peek_is_response(&reply) && !peek_is_response(&asked));
        reply[2] |= 0x02;
        assert!(peek_is_truncated(&reply) && !peek_is_truncated(&asked));
    }

    /// An answer with another id, to another question, or that is a query, is not the
    /// answer.
    #[test]
    fn only_the_answer_to_the_question_asked_is_taken() {
        let questions = [question("API.example.")];
        let q = query(42, questions.clone(), true, None);
        let good = answer_to(&q);
        assert!(parse_reply(&good, MAX_MESSAGE, 42, &questions).is_ok());
        assert!(matches!(
            parse_reply(&good, MAX_MESSAGE, 43, &questions),
            Err(ReplyError::Mismatch)
        ));
        let wrong = answer_to(&query(42, [question("evil.example.")], true, None));
        assert!(matches!(
            parse_reply(&wrong, MAX_MESSAGE, 42, &questions),
            Err(ReplyError::Mismatch)
        ));
        let mut aaaa = question("API.example.");
        aaaa.set_query_type(RecordType::AAAA);
        let wrong = answer_to(&query(42, [aaaa], true, None));
        assert!(matches!(
            parse_reply(&wrong, MAX_MESSAGE, 42, &questions),
            Err(ReplyError::Mismatch)
        ));
        let not_a_response = q.to_vec().unwrap();
        assert!(matches!(
            parse_reply(&not_a_response, MAX_MESSAGE, 42, &questions),
            Err(ReplyError::Mismatch)
        ));
        let err = parse_reply(&good[..good.len() - 2], MAX_MESSAGE, 42, &questions).unwrap_err();
        assert!(err.to_string().starts_with("a malformed answer ("), "{err}");
    }

    /// Records of names off the CNAME chain from the asked name are not the answer.
    #[test]
    fn only_records_on_the_asked_names_chain_answer_it() {
        use hickory_proto::rr::rdata::{A, CNAME};
        let name = |s: &str| Name::from_str(s).unwrap();
        let rec = |owner: &str, data| Record::from_rdata(name(owner), 60, data);
        let answers = vec![
            rec("stranger.example.", RData::A(A::new(203, 0, 113, 66))),
            rec("Good.Example.", RData::A(A::new(192, 0, 2, 1))),
            rec("edge.example.", RData::A(A::new(192, 0, 2, 3))),
            rec("good.example.", RData::CNAME(CNAME(name("EDGE.example.")))),
            rec(
                "other.example.",
                RData::CNAME(CNAME(name("stranger.example."))),
            ),
        ];
        let asked = name("good.example.");
        let taken: Vec<String> = on_chain(&asked, &answers)
            .map(|r| r.data.to_string().to_ascii_lowercase())
            .collect();
        assert_eq!(taken, ["192.0.2.1", "192.0.2.3", "edge.example."]);
        assert_eq!(on_chain(&name("nobody.example."), &answers).count(), 0);
    }
}
