//! What resolving the policy's names produced: addresses with the TTL that carried them, and
//! why a name has none. Plain values, shared by the planner, the resolver and the daemon.

use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

use crate::core::installable::Dropped;
use crate::core::policy::DomainName;
use crate::core::ruleset::CgroupMatch;

/// What resolving the policy's names produced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resolution {
    /// The resolvers that were asked (and that the ruleset allows for DNS).
    pub resolvers: Vec<IpAddr>,
    /// One entry per distinct name, sorted by name.
    pub hosts: Vec<ResolvedHost>,
    /// In guard mode, the uid whose sockets alone may reach the resolvers: the guard's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guard_uid: Option<u32>,
    /// With a `scope:`, what of the host the table was planned with.
    #[serde(default, skip_serializing_if = "HostScope::is_empty")]
    pub scope: HostScope,
}

/// What of the host a scoped table depends on, read by the edge (`crate::host::host_scope`)
/// when the table is planned: cgroups are matched by id, and the guard listens on the listed
/// bridges' addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostScope {
    /// The listed cgroups that exist, in the policy's order. One that does not exist holds
    /// no process, and has no rule until it does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cgroups: Vec<CgroupMatch>,
    /// In guard mode, where the guard also listens: port 53 of each address of each listed
    /// interface, where containers on it ask.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bridge_listen: Vec<SocketAddr>,
}

impl HostScope {
    pub fn is_empty(&self) -> bool {
        self.cgroups.is_empty() && self.bridge_listen.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedHost {
    pub name: DomainName,
    /// Distinct addresses, sorted, each with the TTL of the record that carried it.
    pub addrs: Vec<ResolvedAddr>,
    /// The server says the name does not exist.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nxdomain: bool,
    /// Answered addresses that were not taken, with why (broadcast, loopback, this host's
    /// own...: see [`crate::core::installable`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<Dropped>,
    /// Failures of the A or AAAA query ("AAAA: timed out"): no answer came for it. A name
    /// with addresses and an error resolved only partly.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

impl ResolvedHost {
    /// "255.255.255.255 (the limited broadcast address), ::1 (loopback address)".
    pub fn describe_dropped(&self) -> String {
        self.dropped
            .iter()
            .map(|d| format!("{} ({})", d.addr, d.why))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Why the name has no address, for messages.
    pub fn why_unresolved(&self) -> String {
        if !self.errors.is_empty() {
            self.errors.join("; ")
        } else if !self.dropped.is_empty() {
            format!(
                "every address it answered was dropped: {}",
                self.describe_dropped()
            )
        } else if self.nxdomain {
            "the name does not exist (NXDOMAIN)".into()
        } else {
            "no A or AAAA records".into()
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ResolvedAddr {
    pub addr: IpAddr,
    pub ttl: u32,
}

impl Resolution {
    /// Names that produced no address at all: their allow entries are left out.
    pub fn unresolved(&self) -> impl Iterator<Item = &ResolvedHost> {
        self.hosts.iter().filter(|h| h.addrs.is_empty())
    }

    pub fn host(&self, name: &DomainName) -> Option<&ResolvedHost> {
        self.hosts.iter().find(|h| &h.name == name)
    }
}
