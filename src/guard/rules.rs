//! What the guard answers: the policy's names ([`Rules`]), and the verdict on one query
//! ([`judge`]), with why a question is refused ([`Refusal`]).

use std::net::SocketAddr;

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{DNSClass, Name, RecordType};

use crate::core::guard_identity::GuardIdentity;
use crate::core::policy::{DomainName, Policy, Rate, RefuseWith, Target};

/// What the guard answers, from the policy; the daemon replaces it on reload.
#[derive(Debug, Clone)]
pub struct Rules {
    pub(super) allow: Vec<Target>,
    pub(super) upstream: Vec<SocketAddr>,
    pub(super) refuse_with: RefuseWith,
    /// The mark of every upstream socket, by which (with the uid) the table knows the guard.
    pub(super) mark: u32,
    /// How many refused queries the log takes: the policy's `log.rate` and `log.burst`, as
    /// for refused packets (`watch` still gets every one).
    pub(super) log_rate: Rate,
    pub(super) log_burst: u32,
    /// `learn`: every name is forwarded (what is not the policy's has no addresses installed:
    /// the audit window lets its traffic through and logs it).
    pub(super) audit: bool,
}

impl Rules {
    /// The rules of `policy`'s guard, which asks its upstream resolvers as `identity` (the
    /// guard of that policy: see [`GuardIdentity::of_policy`]). `None` unless the policy is
    /// in guard mode.
    pub fn of(policy: &Policy, identity: &GuardIdentity) -> Option<Rules> {
        let guard = policy.dns.guard.as_ref()?;
        Some(Rules {
            allow: policy
                .allow
                .iter()
                .filter(|a| !matches!(a.target, Target::Cidr(_)))
                .map(|a| a.target.clone())
                .collect(),
            upstream: identity.upstream_servers(),
            refuse_with: guard.refuse_with,
            mark: identity.mark,
            log_rate: policy.log.rate,
            log_burst: policy.log.burst,
            audit: false,
        })
    }

    /// These rules, forwarding every name while `audit` (`learn`).
    pub fn auditing(mut self, audit: bool) -> Rules {
        self.audit = audit;
        self
    }

    pub fn allows(&self, name: &DomainName) -> bool {
        self.allow.iter().any(|t| t.matches(name))
    }
}

/// The asked name as a policy name: lower case, no trailing dot. `None` for what no policy
/// can name (the root, escaped dots, wildcard labels): such names are refused.
pub fn domain_name_of(name: &Name) -> Option<DomainName> {
    let text = name.to_ascii().to_ascii_lowercase();
    if text.contains('\\') {
        return None;
    }
    text.parse().ok()
}

/// What to do with one query, decided from the message alone.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not a query we answer (a response, or not even a header): no reply.
    Ignore,
    /// Answer at once with this code.
    Reply(ResponseCode),
    /// A name outside the policy, or a question the guard does not forward: refuse, and
    /// report it with why.
    Refuse {
        name: String,
        qtype: String,
        why: Refusal,
    },
    /// An allowed name: forward it.
    Forward(DomainName),
}

pub fn judge(query: &Message, rules: &Rules) -> Verdict {
    if query.metadata.message_type != MessageType::Query {
        return Verdict::Ignore;
    }
    if query.metadata.op_code != OpCode::Query {
        return Verdict::Reply(ResponseCode::NotImp);
    }
    let [question] = query.queries.as_slice() else {
        return Verdict::Reply(ResponseCode::FormErr);
    };
    let refuse = |why| Verdict::Refuse {
        name: crate::core::dns_name::presentation(question.name().iter()),
        qtype: question.query_type().to_string(),
        why,
    };
    // What a question is comes before whether its name is allowed: `version.bind CH TXT` is
    // a server fingerprint, not a name someone forgot in the policy.
    if question.query_class() != DNSClass::IN {
        return refuse(Refusal::Class(question.query_class()));
    }
    if matches!(
        question.query_type(),
        RecordType::ANY | RecordType::AXFR | RecordType::IXFR
    ) {
        return refuse(Refusal::Type(question.query_type()));
    }
    match domain_name_of(question.name()) {
        Some(name) if rules.allows(&name) || rules.audit => Verdict::Forward(name),
        _ => refuse(Refusal::NotInPolicy),
    }
}

/// Why a question was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The name is not one the policy allows.
    NotInPolicy,
    /// A class other than IN (CH: server identity and version; ANY; HS): the policy allows
    /// names of the internet class only.
    Class(DNSClass),
    /// ANY (RFC 8482 lets a server decline it) or a zone transfer (AXFR, IXFR): never
    /// forwarded, whatever the name.
    Type(RecordType),
}

impl Refusal {
    /// What `watch` and the log say.
    pub fn note(self) -> String {
        match self {
            Refusal::NotInPolicy => "not in the policy".into(),
            Refusal::Class(class) => {
                let class = match class {
                    DNSClass::OPT(_) | DNSClass::Unknown(_) => format!("CLASS{}", u16::from(class)),
                    known => known.to_string(),
                };
                format!("class {class}: the guard answers class IN only")
            }
            Refusal::Type(RecordType::ANY) => {
                "type ANY: the guard forwards no ANY queries (RFC 8482)".into()
            }
            Refusal::Type(rtype) => format!("type {rtype}: the guard forwards no zone transfers"),
        }
    }

    /// The answer: the policy's `refuse_with` for names it does not allow; REFUSED for the
    /// rest, since NXDOMAIN would tell caches that an allowed name does not exist.
    pub(super) fn code(self, refuse_with: RefuseWith) -> (ResponseCode, &'static str) {
        match (self, refuse_with) {
            (Refusal::NotInPolicy, RefuseWith::Nxdomain) => (ResponseCode::NXDomain, "NXDOMAIN"),
            _ => (ResponseCode::Refused, "REFUSED"),
        }
    }
}

#[cfg(test)]
mod tests {

    use std::str::FromStr;

    use hickory_proto::op::Query;

    use hickory_proto::rr::RecordType;

    use super::*;
    use crate::guard::testing::*;

    #[test]
    fn allowed_names_are_forwarded_and_others_refused_with_their_name() {
        let r = rules();
        assert_eq!(
            judge(&query("API.Example.", RecordType::A), &r),
            Verdict::Forward("api.example".parse().unwrap())
        );
        assert_eq!(
            judge(&query("x.pool.example.", RecordType::AAAA), &r),
            Verdict::Forward("x.pool.example".parse().unwrap())
        );
        assert_eq!(
            judge(&query("c2VjcmV0.attacker.example.", RecordType::TXT), &r),
            Verdict::Refuse {
                name: "c2vjcmv0.attacker.example".into(),
                qtype: "TXT".into(),
                why: Refusal::NotInPolicy,
            }
        );
        // Deeper than the one label `*` stands for, and the suffix itself.
        for name in ["a.b.pool.example.", "pool.example."] {
            assert!(matches!(
                judge(&query(name, RecordType::A), &r),
                Verdict::Refuse { .. }
            ));
        }
        // A CIDR entry allows no name, reverse lookups included.
        assert!(matches!(
            judge(&query("1.2.0.192.in-addr.arpa.", RecordType::PTR), &r),
            Verdict::Refuse { .. }
        ));
    }

    #[test]
    fn odd_messages_are_not_forwarded() {
        let r = rules();
        let mut two = query("api.example.", RecordType::A);
        two.add_query(Query::query(
            Name::from_str("api.example.").unwrap(),
            RecordType::AAAA,
        ));
        assert_eq!(judge(&two, &r), Verdict::Reply(ResponseCode::FormErr));
        let mut notify = query("api.example.", RecordType::A);
        notify.metadata.op_code = OpCode::Notify;
        assert_eq!(judge(&notify, &r), Verdict::Reply(ResponseCode::NotImp));
        let mut response = query("api.example.", RecordType::A);
        response.metadata.message_type = MessageType::Response;
        assert_eq!(judge(&response, &r), Verdict::Ignore);
        let mut chaos = query("api.example.", RecordType::TXT);
        chaos.queries[0].set_query_class(DNSClass::CH);
        assert!(matches!(judge(&chaos, &r), Verdict::Refuse { .. }));
        // A label with an escaped dot is no name a policy can hold.
        let escaped = Name::from_labels(vec![&b"a.b"[..], b"pool", b"example"]).unwrap();
        assert_eq!(domain_name_of(&escaped), None);
    }

    /// Class CH or ANY, type ANY and zone transfers are refused as what they are, for
    /// allowed names too, and never answered NXDOMAIN (which would deny an allowed name).
    #[test]
    fn odd_classes_and_types_are_refused_as_what_they_are() {
        let r = rules();
        let why = |name: &str, rtype, class| {
            let mut q = query(name, rtype);
            q.queries[0].set_query_class(class);
            match judge(&q, &r) {
                Verdict::Refuse { why, .. } => why,
                other => panic!("{name} {rtype} {class}: {other:?}"),
            }
        };
        let version = why("version.bind.", RecordType::TXT, DNSClass::CH);
        assert_eq!(version, Refusal::Class(DNSClass::CH));
        assert_eq!(version.note(), "class CH: the guard answers class IN only");
        let any_class = why("api.example.", RecordType::A, DNSClass::ANY);
        assert_eq!(
            any_class.note(),
            "class ANY: the guard answers class IN only"
        );
        let odd = why("api.example.", RecordType::A, DNSClass::Unknown(77));
        assert_eq!(odd.note(), "class CLASS77: the guard answers class IN only");
        let any = why("api.example.", RecordType::ANY, DNSClass::IN);
        assert_eq!(
            any.note(),
            "type ANY: the guard forwards no ANY queries (RFC 8482)"
        );
        let axfr = why("x.pool.example.", RecordType::AXFR, DNSClass::IN);
        assert_eq!(
            axfr.note(),
            "type AXFR: the guard forwards no zone transfers"
        );
        let outside = why("secret.attacker.example.", RecordType::A, DNSClass::IN);
        assert_eq!(outside.note(), "not in the policy");
        assert_eq!(
            outside.code(RefuseWith::Nxdomain),
            (ResponseCode::NXDomain, "NXDOMAIN")
        );
        for refusal in [version, any_class, any, axfr] {
            assert_eq!(
                refusal.code(RefuseWith::Nxdomain),
                (ResponseCode::Refused, "REFUSED")
            );
        }
    }
}
