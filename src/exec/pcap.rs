//! The DNS questions that left the run's namespace, and the addresses their answers brought
//! back, read from pasta's capture (`--pcap`) of its tap device: what the guard sent upstream
//! for the names the policy allows. Only Ethernet frames carrying IPv4 or IPv6 (without
//! extension headers) to or from port 53 over UDP, or over TCP when one segment holds the
//! length-prefixed message, are read.

use std::io::{Read, Seek, SeekFrom};
use std::net::IpAddr;
use std::path::Path;

use hickory_proto::op::Message;
use hickory_proto::rr::RData;

/// pcap's magic numbers (microsecond and nanosecond timestamps), as written on this host.
const MAGIC_US: u32 = 0xa1b2_c3d4;
const MAGIC_NS: u32 = 0xa1b2_3c4d;
const GLOBAL_HEADER: usize = 24;
const RECORD_HEADER: usize = 16;
const ETHERNET_HEADER: usize = 14;

/// What the capture holds of DNS.
#[derive(Debug, Default, PartialEq)]
pub struct Captured {
    /// The names asked in the queries that left, in order.
    pub questions: Vec<String>,
    /// Each answer's question and an address (A or AAAA, CNAMEs followed) it brought back.
    pub answers: Vec<(String, IpAddr)>,
}

/// The longest frame read: a DNS message (at most 64 KiB) with its Ethernet, IP and
/// transport headers. A longer one carries none this reads, and is skipped unread.
const MAX_FRAME: u32 = 70_000;

/// Reads the DNS messages of pasta's capture, a frame at a time: the capture holds all of
/// the run's traffic, which CMD chooses (read whole, it would grow this process by as much,
/// and where memory is bounded end it before it says what the fence saw).
pub fn read(path: &Path) -> std::io::Result<Captured> {
    let file = std::fs::File::open(path)?;
    dns_from(std::io::BufReader::new(file))
}

#[cfg(test)]
fn dns_in(bytes: &[u8]) -> Captured {
    dns_from(std::io::Cursor::new(bytes)).unwrap_or_default()
}

/// The DNS messages of a capture read from `reader`; a cut-off last record ends it (a run
/// killed while pasta wrote).
fn dns_from(mut reader: impl Read + Seek) -> std::io::Result<Captured> {
    let mut captured = Captured::default();
    let mut header = [0u8; GLOBAL_HEADER];
    if reader.read_exact(&mut header).is_err() {
        return Ok(captured);
    }
    let magic = u32_at(&header, 0);
    if magic != Some(MAGIC_US) && magic != Some(MAGIC_NS) {
        return Ok(captured);
    }
    let mut frame = Vec::new();
    loop {
        let mut record = [0u8; RECORD_HEADER];
        if reader.read_exact(&mut record).is_err() {
            break;
        }
        let Some(len) = u32_at(&record, 8) else {
            break;
        };
        if len > MAX_FRAME {
            reader.seek(SeekFrom::Current(i64::from(len)))?;
            continue;
        }
        frame.resize(len as usize, 0);
        if reader.read_exact(&mut frame).is_err() {
            break;
        }
        match dns_payload(&frame).map(|(to_53, p)| (to_53, Message::from_vec(p))) {
            Some((true, Ok(query))) => captured
                .questions
                .extend(query.queries.iter().map(|q| q.name().to_ascii())),
            Some((false, Ok(answer))) => {
                let addresses = answer.answers.iter().filter_map(|r| match &r.data {
                    RData::A(a) => Some(IpAddr::V4(a.0)),
                    RData::AAAA(a) => Some(IpAddr::V6(a.0)),
                    _ => None,
                });
                for address in addresses {
                    for q in &answer.queries {
                        captured.answers.push((q.name().to_ascii(), address));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(captured)
}

/// The DNS message a frame carries to port 53 (true) or from it (false), if it carries one.
fn dns_payload(frame: &[u8]) -> Option<(bool, &[u8])> {
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    let ip = frame.get(ETHERNET_HEADER..)?;
    let (protocol, transport) = match ethertype {
        0x0800 => {
            let header = usize::from(ip.first()? & 0x0f) * 4;
            (*ip.get(9)?, ip.get(header..)?)
        }
        0x86dd => (*ip.get(6)?, ip.get(40..)?),
        _ => return None,
    };
    let sport = u16::from_be_bytes([*transport.first()?, *transport.get(1)?]);
    let dport = u16::from_be_bytes([*transport.get(2)?, *transport.get(3)?]);
    let to_53 = match (sport, dport) {
        (_, 53) => true,
        (53, _) => false,
        _ => return None,
    };
    let payload = match protocol {
        17 => transport.get(8..),
        6 => {
            let offset = usize::from(transport.get(12)? >> 4) * 4;
            // The two-byte length prefix of DNS over TCP.
            transport.get(offset + 2..).filter(|p| !p.is_empty())
        }
        _ => None,
    }?;
    Some((to_53, payload))
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::{Message, Query};
    use hickory_proto::rr::{Name, RecordType};

    fn frame(query: &[u8]) -> Vec<u8> {
        frame_ports(query, [0x30, 0x39, 0, 53])
    }

    fn frame_ports(query: &[u8], ports: [u8; 4]) -> Vec<u8> {
        let mut f = vec![0u8; 12];
        f.extend_from_slice(&[0x08, 0x00]);
        let mut ip = vec![
            0x45, 0, 0, 0, 0, 0, 0, 0, 64, 17, 0, 0, 10, 0, 0, 1, 192, 0, 2, 53,
        ];
        let udp_len = (8 + query.len()) as u16;
        ip.extend_from_slice(&ports);
        ip.extend_from_slice(&udp_len.to_be_bytes());
        ip.extend_from_slice(&[0, 0]);
        ip.extend_from_slice(query);
        f.extend_from_slice(&ip);
        f
    }

    fn pcap_of(frames: &[Vec<u8>]) -> Vec<u8> {
        let mut pcap = Vec::new();
        pcap.extend_from_slice(&MAGIC_US.to_le_bytes());
        pcap.extend_from_slice(&[0u8; 20]);
        for f in frames {
            pcap.extend_from_slice(&[0u8; 8]);
            pcap.extend_from_slice(&(f.len() as u32).to_le_bytes());
            pcap.extend_from_slice(&(f.len() as u32).to_le_bytes());
            pcap.extend_from_slice(f);
        }
        pcap
    }

    #[test]
    fn an_answer_from_port_53_gives_its_addresses() {
        use hickory_proto::rr::rdata::A;
        use hickory_proto::rr::{RData, Record};
        let name = Name::from_ascii("hooks.example.test.").expect("a name");
        let mut m = Message::query();
        m.add_query(Query::query(name.clone(), RecordType::A));
        m.add_answer(Record::from_rdata(
            name,
            60,
            RData::A(A::new(192, 0, 2, 11)),
        ));
        let answer = m.to_vec().expect("encoded");
        let captured = dns_in(&pcap_of(&[frame_ports(&answer, [0, 53, 0x30, 0x39])]));
        assert!(captured.questions.is_empty());
        assert_eq!(
            captured.answers,
            vec![(
                "hooks.example.test.".to_string(),
                "192.0.2.11".parse().expect("an address")
            )]
        );
    }

    /// A frame too long to carry a DNS message is skipped unread, and what follows is read.
    #[test]
    fn a_long_frame_is_skipped_and_the_next_read() {
        let mut m = Message::query();
        m.add_query(Query::query(
            Name::from_ascii("after.exfil.test.").expect("a name"),
            RecordType::A,
        ));
        let query = m.to_vec().expect("encoded");
        let long = vec![0u8; MAX_FRAME as usize + 1];
        let captured = dns_in(&pcap_of(&[long, frame(&query)]));
        assert_eq!(captured.questions, vec!["after.exfil.test.".to_string()]);
    }

    #[test]
    fn a_captured_query_is_read_back() {
        let mut m = Message::query();
        m.add_query(Query::query(
            Name::from_ascii("secret.exfil.test.").expect("a name"),
            RecordType::A,
        ));
        let query = m.to_vec().expect("encoded");
        let f = frame(&query);
        let mut pcap = Vec::new();
        pcap.extend_from_slice(&MAGIC_US.to_le_bytes());
        pcap.extend_from_slice(&[0u8; 20]);
        pcap.extend_from_slice(&[0u8; 8]);
        pcap.extend_from_slice(&(f.len() as u32).to_le_bytes());
        pcap.extend_from_slice(&(f.len() as u32).to_le_bytes());
        pcap.extend_from_slice(&f);
        assert_eq!(
            dns_in(&pcap).questions,
            vec!["secret.exfil.test.".to_string()]
        );
        assert_eq!(dns_in(&pcap[..30]), Captured::default());
    }
}
