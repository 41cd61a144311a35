//! The events `watch` reports, as they print and as they serialise: a refused packet and a
//! query the DNS guard refused.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::scope::ScopeMatched;
use crate::core::time::rfc3339_millis_at;

/// One refused packet, as read from NFLOG. Serialises (serde_json) to one JSON object per event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DropEvent {
    /// RFC 3339, UTC, milliseconds. The kernel's packet timestamp when it sends one (it does
    /// only on the input side: prerouting, input, forward), else the time the message was read:
    /// the kernel sends each message at once, so for outgoing packets this is the time of the
    /// refusal as long as the listener keeps up.
    pub time: String,
    /// The rule's log prefix exactly as configured (e.g. "EGRESS-DROP: " with its trailing
    /// space), without the kernel's NUL terminator, so it can be matched against the policy.
    /// Empty when the rule has none.
    pub prefix: String,
    /// "ipv4" or "ipv6".
    pub family: &'static str,
    /// "tcp", "udp", "icmp", "icmpv6", "sctp", "udplite", else the protocol / next-header
    /// number. For IPv6 the common extension headers are skipped first.
    pub protocol: String,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// Ports, for tcp, udp, sctp and udplite when the header was captured (not in later
    /// fragments).
    pub sport: Option<u16>,
    pub dport: Option<u16>,
    /// Owner of the sending socket, as seen from the listener's user namespace; absent for
    /// packets without a full socket (forwarded packets, TCP resets, time-wait).
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// "refused", or [`AUDITED`]: let through by `learn`'s audit window, and would be
    /// refused without it.
    pub verdict: &'static str,
    /// What egress-fence knows about the destination ("the cloud metadata service", "was
    /// api.example.com until 4 minutes ago"), filled in by the caller.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The interface a forwarded (or bridge-to-host) packet came in on, as the kernel's
    /// index; absent for packets this host sent. Named in [`DropEvent::scope`].
    #[serde(skip)]
    pub in_ifindex: Option<u32>,
    /// With a scoped table: the part of the scope the packet was refused in, filled in by
    /// the caller ([`FencedScope::matched`](super::FencedScope::matched)). Boxed: events
    /// travel in enums beside small variants.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<Box<ScopeMatched>>,
}

/// The verdict of a packet `learn`'s audit window let through (it would be refused).
pub const AUDITED: &str = "audited";

#[cfg(test)]
impl DropEvent {
    /// A refused IPv4 TCP packet from 10.0.0.2 to `dst`:`dport`, for tests.
    pub fn refused_to(dst: &str, dport: u16) -> DropEvent {
        DropEvent {
            time: "2026-12-01T19:00:00.000Z".into(),
            prefix: "EGRESS-DROP: ".into(),
            family: "ipv4",
            protocol: "tcp".into(),
            src: "10.0.0.2".parse().expect("an address"),
            dst: dst.parse().expect("an address"),
            sport: Some(40000),
            dport: Some(dport),
            uid: None,
            gid: None,
            verdict: "refused",
            note: None,
            in_ifindex: None,
            scope: None,
        }
    }
}

impl fmt::Display for DropEvent {
    /// `TIME REFUSED PROTO SRC[:PORT] -> DST[:PORT] [uid=U] [gid=G] [PREFIX] [scope: S]
    /// [NOTE]`, with IPv6 addresses bracketed when a port follows.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = match self.verdict {
            AUDITED => "AUDITED (would be refused)".to_string(),
            other => other.to_uppercase(),
        };
        write!(
            f,
            "{} {} {} {} -> {}",
            self.time,
            verdict,
            self.protocol,
            Endpoint(self.src, self.sport),
            Endpoint(self.dst, self.dport),
        )?;
        if let Some(uid) = self.uid {
            write!(f, " uid={uid}")?;
        }
        if let Some(gid) = self.gid {
            write!(f, " gid={gid}")?;
        }
        let prefix = self.prefix.trim();
        if !prefix.is_empty() {
            write!(f, " {prefix}")?;
        }
        if let Some(scope) = &self.scope {
            write!(f, " [scope: {scope}]")?;
        }
        if let Some(note) = &self.note {
            write!(f, " [{note}]")?;
        }
        Ok(())
    }
}

/// A DNS query the guard refused: its name never left the host. The guard streams these, one
/// JSON object per line, on [`crate::state::StateDir::guard_events`]; `watch` prints them
/// beside refused packets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueryEvent {
    /// RFC 3339, UTC, milliseconds: when the query was answered.
    pub time: String,
    /// Always "refused".
    pub verdict: String,
    /// Always "dns", which tells these lines from refused packets.
    pub protocol: String,
    /// The name asked, as it was asked (case preserved), in RFC 1035 presentation form
    /// without the final dot ([`crate::core::dns_name::presentation`]).
    pub name: String,
    /// "A", "AAAA", "TXT", ... ("TYPE65534" for unknown types).
    pub qtype: String,
    /// Who asked: the address and port the query came from.
    pub client: SocketAddr,
    /// "udp" or "tcp".
    pub transport: String,
    /// The response code the client got: "REFUSED" or "NXDOMAIN".
    pub answer: String,
    /// Why: "not in the policy", or what the question is ("class CH: the guard answers
    /// class IN only", "type ANY: ...").
    pub note: String,
}

impl QueryEvent {
    pub fn refused(
        name: String,
        qtype: String,
        client: SocketAddr,
        transport: &str,
        answer: &str,
        note: String,
    ) -> QueryEvent {
        QueryEvent {
            time: rfc3339_millis_at(SystemTime::now()),
            verdict: "refused".into(),
            protocol: "dns".into(),
            name,
            qtype,
            client,
            transport: transport.into(),
            answer: answer.into(),
            note,
        }
    }
}

impl fmt::Display for QueryEvent {
    /// `TIME REFUSED dns query NAME TYPE from CLIENT (TRANSPORT), answered ANSWER [NOTE]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {} query {} {} from {} ({}), answered {} [{}]",
            self.time,
            self.verdict.to_uppercase(),
            self.protocol,
            self.name,
            self.qtype,
            self.client,
            self.transport,
            self.answer,
            self.note
        )
    }
}

struct Endpoint(IpAddr, Option<u16>);

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.1 {
            Some(port) => SocketAddr::new(self.0, port).fmt(f),
            None => self.0.fmt(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_query_prints_and_round_trips() {
        let mut q = QueryEvent::refused(
            "exfil.example".into(),
            "TXT".into(),
            "127.0.0.1:40000".parse().unwrap(),
            "udp",
            "REFUSED",
            "not in the policy".into(),
        );
        q.time = "2025-11-29T16:01:02.123Z".into();
        assert_eq!(
            q.to_string(),
            "2025-11-29T16:01:02.123Z REFUSED dns query exfil.example TXT from \
             127.0.0.1:40000 (udp), answered REFUSED [not in the policy]"
        );
        let line = serde_json::to_string(&q).unwrap();
        assert_eq!(serde_json::from_str::<QueryEvent>(&line).unwrap(), q);
    }

    #[test]
    fn an_audited_packet_says_it_would_be_refused() {
        let event = DropEvent {
            time: "2025-11-29T16:01:02.123Z".into(),
            prefix: "EGRESS-AUDIT: ".into(),
            family: "ipv4",
            protocol: "tcp".into(),
            src: "198.51.100.2".parse().unwrap(),
            dst: "203.0.113.10".parse().unwrap(),
            sport: Some(40000),
            dport: Some(9090),
            uid: Some(1001),
            gid: None,
            verdict: AUDITED,
            note: None,
            in_ifindex: None,
            scope: None,
        };
        assert_eq!(
            event.to_string(),
            "2025-11-29T16:01:02.123Z AUDITED (would be refused) tcp 198.51.100.2:40000 -> \
             203.0.113.10:9090 uid=1001 EGRESS-AUDIT:"
        );
        let json = serde_json::to_value(&event).unwrap();
        assert_eq!(json["verdict"], "audited");
    }

    #[test]
    fn endpoints_bracket_ipv6_only_before_a_port() {
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(Endpoint(v6, Some(53)).to_string(), "[2001:db8::1]:53");
        assert_eq!(Endpoint(v6, None).to_string(), "2001:db8::1");
        let v4: IpAddr = "192.0.2.1".parse().unwrap();
        assert_eq!(Endpoint(v4, Some(53)).to_string(), "192.0.2.1:53");
    }
}
