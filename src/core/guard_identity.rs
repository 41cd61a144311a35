//! Who the DNS guard is, in one value: the uid its process runs as, the mark (`SO_MARK`) its
//! sockets carry, where it listens and which resolvers it asks. The table knows the guard by
//! these (only the guard's marked sockets of its uid answer from its listen addresses and
//! reach its upstream resolvers), the guard binds and marks its sockets by them, and
//! explanations of refused DNS name them.
//!
//! Built in one place, [`GuardIdentity::of`]: the policy's [`GuardSettings`] give the mark,
//! the listen addresses and the upstream resolvers; the uid is a fact of the running process,
//! which the edge reads (`crate::host::guard_identity`) and passes in. Pure: no I/O here.

use std::net::{IpAddr, SocketAddr};

use crate::core::explain::{self, WhyRefused};
use crate::core::plan::DNS_PORT;
use crate::core::policy::{GuardSettings, Policy};

/// The DNS guard as the table, its sockets and the explanations know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardIdentity {
    /// The uid of the guard's process: with the mark, what the table recognises its sockets by.
    pub uid: u32,
    /// The socket mark of every socket of the guard, listening and upstream (the policy's
    /// `dns.mark`).
    pub mark: u32,
    /// Where the guard answers (the policy's `dns.listen`).
    pub listen: Vec<SocketAddr>,
    /// The resolvers the guard forwards to, and that only the guard may reach (the policy's
    /// `dns.upstream`).
    pub upstream: Vec<IpAddr>,
}

impl GuardIdentity {
    /// The guard of `settings`, run as `uid`.
    pub fn of(settings: &GuardSettings, uid: u32) -> GuardIdentity {
        GuardIdentity {
            uid,
            mark: settings.mark,
            listen: settings.listen.clone(),
            upstream: settings.upstream.clone(),
        }
    }

    /// The guard of `policy`, run as `uid`: `None` unless the policy is in guard mode.
    pub fn of_policy(policy: &Policy, uid: u32) -> Option<GuardIdentity> {
        policy.dns.guard.as_ref().map(|g| GuardIdentity::of(g, uid))
    }

    /// The same guard, also listening on `more` (the listed bridges' addresses, for the
    /// containers on them), each once.
    pub fn listening_also_on(mut self, more: &[SocketAddr]) -> GuardIdentity {
        for addr in more {
            if !self.listen.contains(addr) {
                self.listen.push(*addr);
            }
        }
        self
    }

    /// The upstream resolvers as the guard asks them: plain DNS, port 53.
    pub fn upstream_servers(&self) -> Vec<SocketAddr> {
        self.upstream
            .iter()
            .map(|&ip| SocketAddr::new(ip, DNS_PORT))
            .collect()
    }

    /// What about the guard a new policy changes that the running guard cannot take without
    /// a restart: its listening sockets are bound once, with the mark they keep (the table
    /// of a new mark would refuse their replies). The uid is the process's and the upstream
    /// resolvers may change on a reload.
    pub fn change_needing_restart(&self, new: &GuardIdentity) -> Option<&'static str> {
        if self.listen != new.listen {
            Some("`dns.listen`")
        } else if self.mark != new.mark {
            Some("`dns.mark`")
        } else {
            None
        }
    }

    /// Why a refused packet to `dst`:`dport` was refused, if it is DNS (53, 853): to an
    /// upstream resolver only the guard may ask; elsewhere nobody may.
    pub fn why_dns_refused(&self, dst: IpAddr, dport: Option<u16>) -> Option<WhyRefused> {
        explain::guard_dns(self.uid, dport, self.upstream.contains(&dst))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::core::policy::DEFAULT_GUARD_MARK;

    const GUARD: &str = "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\ndns:\n  mode: guard\n  upstream: [192.0.2.53, 2001:db8::53]\n";

    fn policy(text: &str) -> Policy {
        Policy::parse(text, Path::new("p.yaml")).expect("valid")
    }

    fn identity(text: &str, uid: u32) -> GuardIdentity {
        GuardIdentity::of_policy(&policy(text), uid).expect("guard mode")
    }

    #[test]
    fn the_policy_gives_mark_listen_and_upstream_and_the_caller_the_uid() {
        assert_eq!(
            identity(GUARD, 993),
            GuardIdentity {
                uid: 993,
                mark: DEFAULT_GUARD_MARK,
                listen: vec!["127.0.0.53:53".parse().unwrap()],
                upstream: vec![
                    "192.0.2.53".parse().unwrap(),
                    "2001:db8::53".parse().unwrap()
                ],
            }
        );
        let set = identity(
            &GUARD.replace(
                "  mode: guard\n",
                "  mode: guard\n  listen: [127.0.0.54:5353]\n  mark: 16\n",
            ),
            0,
        );
        assert_eq!(
            (set.uid, set.mark, set.listen),
            (0, 0x10, vec!["127.0.0.54:5353".parse().unwrap()])
        );
    }

    #[test]
    fn a_resolve_mode_policy_has_no_guard() {
        let resolve = "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\ndns:\n  resolvers: [192.0.2.53]\n";
        assert_eq!(GuardIdentity::of_policy(&policy(resolve), 993), None);
    }

    #[test]
    fn the_guard_asks_its_upstream_on_port_53() {
        assert_eq!(
            identity(GUARD, 993).upstream_servers(),
            [
                "192.0.2.53:53".parse::<SocketAddr>().unwrap(),
                "[2001:db8::53]:53".parse().unwrap()
            ]
        );
    }

    #[test]
    fn only_listen_and_mark_take_a_restart() {
        let running = identity(GUARD, 993);
        let mut new = running.clone();
        new.upstream = vec!["192.0.2.54".parse().unwrap()];
        new.uid = 0;
        assert_eq!(running.change_needing_restart(&new), None);
        new.mark = 0x10;
        assert_eq!(running.change_needing_restart(&new), Some("`dns.mark`"));
        new.listen = vec!["127.0.0.54:53".parse().unwrap()];
        assert_eq!(running.change_needing_restart(&new), Some("`dns.listen`"));
    }

    #[test]
    fn refused_dns_is_explained_by_whom_it_was_sent_to() {
        let guard = identity(GUARD, 993);
        let upstream: IpAddr = "2001:db8::53".parse().unwrap();
        let other: IpAddr = "192.0.2.99".parse().unwrap();
        assert_eq!(
            guard.why_dns_refused(upstream, Some(853)),
            Some(WhyRefused::GuardUpstream { guard_uid: 993 })
        );
        assert_eq!(
            guard.why_dns_refused(other, Some(53)),
            Some(WhyRefused::OtherResolver { port: 53 })
        );
        assert_eq!(
            guard.why_dns_refused(upstream, Some(443)),
            Some(WhyRefused::GuardUpstream { guard_uid: 993 })
        );
        assert_eq!(guard.why_dns_refused(other, Some(443)), None);
        assert_eq!(guard.why_dns_refused(other, None), None);
    }
}
