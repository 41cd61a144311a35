//! Which scope a refused packet matched: who a scoped table fences ([`FencedScope`], from its
//! scope chains' rules), and the part of it a refused packet belongs to ([`ScopeMatched`]):
//! its socket's uid or gid (NFLOG carries both), its socket's cgroup (NFLOG does not: the
//! socket is looked up by its addresses and ports with sock_diag), or, for a forwarded packet,
//! the interface it came in on and its source address.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use serde::Serialize;

use super::DropEvent;
use crate::core::policy::{CgroupPath, IfacePattern, L4Proto};
use crate::core::ruleset::{CgroupMatch, Rule, Ruleset, SCOPE_CHAINS, ScopeMatch};
use crate::netlink::sockdiag::SockDiag;
use crate::nft::LiveTable;
use crate::nft::live::ReadRule;

/// How many cgroups below a listed one are looked through for a socket's cgroup.
const MAX_CGROUPS_WALKED: usize = 4096;

/// Who a scoped table fences, as its rules say.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FencedScope {
    /// `meta skuid U goto output`.
    pub uids: Vec<u32>,
    /// `meta skgid G goto output`.
    pub gids: Vec<u32>,
    /// `socket cgroupv2 level L "PATH" goto output`, with the id it was planned with.
    pub cgroups: Vec<CgroupMatch>,
    /// `iifname "IFACE" goto output` (the forward hook).
    pub forwarded: Vec<IfacePattern>,
    /// `iifname "IFACE" goto from_bridge` (the input hook: the path to the host).
    pub bridges: Vec<IfacePattern>,
    /// `ip daddr A udp dport 53 accept` in `from_bridge`: where the guard answers the
    /// containers, once per address and port.
    pub guard_on_bridges: Vec<SocketAddr>,
}

impl FencedScope {
    /// The scope of a planned or recorded ruleset; `None` when it is not scoped.
    pub fn of_ruleset(ruleset: &Ruleset) -> Option<FencedScope> {
        let chains = ruleset.scope.as_ref()?;
        Some(FencedScope::of_rules(
            chains
                .output
                .iter()
                .chain(&chains.forward)
                .chain(&chains.input)
                .chain(&chains.from_bridge),
        ))
    }

    /// The scope of the live table, from its scope chains' rules as read back; `None` when
    /// it has no scope chain (an unscoped table).
    pub fn of_live(table: &LiveTable) -> Option<FencedScope> {
        if !table
            .chains
            .iter()
            .any(|c| SCOPE_CHAINS.contains(&c.name.as_str()))
        {
            return None;
        }
        Some(FencedScope::of_rules(table.rules.iter().filter_map(
            |r| match (&r.rule, SCOPE_CHAINS.contains(&r.chain.as_str())) {
                (ReadRule::Known(rule), true) => Some(rule),
                _ => None,
            },
        )))
    }

    pub fn of_rules<'a>(rules: impl IntoIterator<Item = &'a Rule>) -> FencedScope {
        let mut scope = FencedScope::default();
        for rule in rules {
            match rule {
                Rule::Fence(ScopeMatch::Uid(uid)) => scope.uids.push(*uid),
                Rule::Fence(ScopeMatch::Gid(gid)) => scope.gids.push(*gid),
                Rule::Fence(ScopeMatch::Cgroup(c)) => scope.cgroups.push(c.clone()),
                Rule::Fence(ScopeMatch::Interface(i)) => scope.forwarded.push(i.clone()),
                Rule::FromBridge(i) => scope.bridges.push(i.clone()),
                Rule::AcceptGuardQuery { to, .. } if !scope.guard_on_bridges.contains(to) => {
                    scope.guard_on_bridges.push(*to)
                }
                _ => {}
            }
        }
        scope
    }

    /// No rule fences anything (a table whose scope rules were not read back).
    pub fn is_empty(&self) -> bool {
        self.uids.is_empty()
            && self.gids.is_empty()
            && self.cgroups.is_empty()
            && self.forwarded.is_empty()
            && self.bridges.is_empty()
            && self.guard_on_bridges.is_empty()
    }

    /// The part of the scope that `event` was refused in, as the table decides it: a
    /// forwarded (or bridge-to-host) packet by its interface, a local one by its socket's uid,
    /// gid, then cgroup. `None` when the packet is in none of them (the guard's rules refuse
    /// DNS straight to the upstream resolvers for every socket).
    pub fn matched(&self, event: &DropEvent, host: &mut impl HostLookup) -> Option<ScopeMatched> {
        if let Some(ifindex) = event.in_ifindex {
            return Some(ScopeMatched::From {
                iface: host
                    .iface_name(ifindex)
                    .unwrap_or_else(|| format!("#{ifindex}")),
                src: event.src,
            });
        }
        if let Some(uid) = event.uid.filter(|u| self.uids.contains(u)) {
            return Some(ScopeMatched::Uid {
                uid,
                name: host.user_name(uid),
            });
        }
        if let Some(gid) = event.gid.filter(|g| self.gids.contains(g)) {
            return Some(ScopeMatched::Gid {
                gid,
                name: host.group_name(gid),
            });
        }
        if self.cgroups.is_empty() {
            return None;
        }
        let Some(id) = host.socket_cgroup(event) else {
            // The socket is gone (or the kernel does not say): the cgroup cannot be named.
            return Some(ScopeMatched::Cgroup { path: None });
        };
        if let Some(c) = self.cgroups.iter().find(|c| c.id == id) {
            return Some(ScopeMatched::Cgroup {
                path: Some(c.path.clone()),
            });
        }
        self.cgroups
            .iter()
            .find(|c| host.cgroup_holds(&c.path, id))
            .map(|c| ScopeMatched::Cgroup {
                path: Some(c.path.clone()),
            })
    }
}

/// The part of the scope a refused packet matched. Serialises as `{"uid": 1001, "name":
/// "agent"}`, `{"gid": ...}`, `{"cgroup": "agent.slice"}` (null when it cannot be told), or
/// `{"from": "efbr0", "src": "198.18.0.2"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum ScopeMatched {
    Uid {
        uid: u32,
        #[serde(skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    Gid {
        gid: u32,
        #[serde(skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    Cgroup {
        #[serde(rename = "cgroup")]
        path: Option<CgroupPath>,
    },
    From {
        #[serde(rename = "from")]
        iface: String,
        src: IpAddr,
    },
}

impl fmt::Display for ScopeMatched {
    /// `uid 1001 (agent)`, `gid 2000 (agents)`, `cgroup agent.slice`, `cgroup ?`, `from
    /// efbr0 198.18.0.2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScopeMatched::Uid { uid, name } => {
                write!(f, "uid {uid}")?;
                name.as_ref().map_or(Ok(()), |n| write!(f, " ({n})"))
            }
            ScopeMatched::Gid { gid, name } => {
                write!(f, "gid {gid}")?;
                name.as_ref().map_or(Ok(()), |n| write!(f, " ({n})"))
            }
            ScopeMatched::Cgroup { path: Some(p) } => write!(f, "cgroup {p}"),
            ScopeMatched::Cgroup { path: None } => f.write_str("cgroup ?"),
            ScopeMatched::From { iface, src } => write!(f, "from {iface} {src}"),
        }
    }
}

/// What [`FencedScope::matched`] asks of the host.
pub trait HostLookup {
    fn user_name(&mut self, uid: u32) -> Option<String>;
    fn group_name(&mut self, gid: u32) -> Option<String>;
    fn iface_name(&mut self, ifindex: u32) -> Option<String>;
    /// The cgroup id of the socket that sent `event`, if it is still open.
    fn socket_cgroup(&mut self, event: &DropEvent) -> Option<u64>;
    /// Whether cgroup `id` lies below the listed cgroup `path`.
    fn cgroup_holds(&mut self, path: &CgroupPath, id: u64) -> bool;
}

/// The host as the current network namespace and this process's mounts show it.
#[derive(Debug, Default)]
pub struct Host {
    diag: Option<SockDiag>,
}

impl Host {
    /// Opens its sock_diag socket in the current network namespace.
    pub fn open() -> Host {
        Host {
            diag: SockDiag::open().ok(),
        }
    }
}

impl HostLookup for Host {
    fn user_name(&mut self, uid: u32) -> Option<String> {
        let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid));
        user.ok().flatten().map(|u| u.name)
    }

    fn group_name(&mut self, gid: u32) -> Option<String> {
        let group = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid));
        group.ok().flatten().map(|g| g.name)
    }

    fn iface_name(&mut self, ifindex: u32) -> Option<String> {
        let name = nix::net::if_::if_indextoname(ifindex).ok()?;
        name.into_string().ok()
    }

    fn socket_cgroup(&mut self, event: &DropEvent) -> Option<u64> {
        let protocol = match event.protocol.as_str() {
            "tcp" => L4Proto::Tcp,
            "udp" => L4Proto::Udp,
            _ => return None,
        };
        let ours = SocketAddr::new(event.src, event.sport?);
        let theirs = SocketAddr::new(event.dst, event.dport?);
        // sock_diag finds "the socket at `peer` talking to `local`": ours talks to theirs.
        let info = self.diag.as_mut()?.socket_info(protocol, theirs, ours)?;
        info.cgroup_id
    }

    fn cgroup_holds(&mut self, path: &CgroupPath, id: u64) -> bool {
        let Some(dir) = crate::host::cgroup_dir(path) else {
            return false;
        };
        let mut budget = MAX_CGROUPS_WALKED;
        subtree_holds(&dir, id, &mut budget)
    }
}

/// Whether a directory below `dir` (a cgroup) has inode `id`, looking at no more than
/// `budget` directories.
fn subtree_holds(dir: &Path, id: u64, budget: &mut usize) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    for entry in entries.flatten() {
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_dir() {
            continue;
        }
        if *budget == 0 {
            return false;
        }
        *budget -= 1;
        if meta.ino() == id || subtree_holds(&entry.path(), id, budget) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ruleset::CgroupMatch;

    /// A host of fixed answers: names for 1001 and 2000, interface 7 is efbr0, the socket's
    /// cgroup, and which ids lie below which listed cgroup.
    #[derive(Default)]
    struct FakeHost {
        socket_cgroup: Option<u64>,
        below: Vec<(&'static str, u64)>,
    }

    impl HostLookup for FakeHost {
        fn user_name(&mut self, uid: u32) -> Option<String> {
            (uid == 1001).then(|| "agent".into())
        }
        fn group_name(&mut self, gid: u32) -> Option<String> {
            (gid == 2000).then(|| "agents".into())
        }
        fn iface_name(&mut self, ifindex: u32) -> Option<String> {
            (ifindex == 7).then(|| "efbr0".into())
        }
        fn socket_cgroup(&mut self, _: &DropEvent) -> Option<u64> {
            self.socket_cgroup
        }
        fn cgroup_holds(&mut self, path: &CgroupPath, id: u64) -> bool {
            self.below
                .iter()
                .any(|&(p, i)| p == path.as_str() && i == id)
        }
    }

    fn cgroup(path: &str, id: u64) -> CgroupMatch {
        let path: CgroupPath = path.parse().unwrap();
        CgroupMatch {
            level: path.level(),
            path,
            id,
        }
    }

    /// The lead's planner on a scope of every kind: the ruleset `watch` and `status` read.
    fn scope() -> FencedScope {
        let policy = crate::core::policy::Policy::parse(
            "version: 1\nscope:\n  users: [1001]\n  groups: [2000]\n  cgroups: [agent.slice]\n  forward: [efbr0]\n",
            std::path::Path::new("p.yaml"),
        )
        .expect("valid");
        let mut resolution = crate::core::plan::tests::resolution(&[]);
        resolution.scope.cgroups = vec![cgroup("agent.slice", 40)];
        let ruleset = crate::core::plan::plan(&policy, &resolution);
        FencedScope::of_ruleset(&ruleset).expect("scoped")
    }

    fn event(uid: Option<u32>, gid: Option<u32>, in_ifindex: Option<u32>) -> DropEvent {
        DropEvent {
            time: "2026-12-01T19:00:00.000Z".into(),
            prefix: "EGRESS-DROP: ".into(),
            family: "ipv4",
            protocol: "tcp".into(),
            src: "198.18.0.2".parse().unwrap(),
            dst: "203.0.113.9".parse().unwrap(),
            sport: Some(40000),
            dport: Some(443),
            uid,
            gid,
            verdict: "refused",
            note: None,
            in_ifindex,
            scope: None,
        }
    }

    #[test]
    fn the_rules_give_the_scope() {
        let s = scope();
        assert_eq!(
            (s.uids.as_slice(), s.gids.as_slice()),
            (&[1001][..], &[2000][..])
        );
        assert_eq!(s.cgroups, vec![cgroup("agent.slice", 40)]);
        assert_eq!(s.forwarded.len(), 1);
        assert_eq!(s.bridges.len(), 1);
        assert!(!s.is_empty());
        let unscoped = crate::core::policy::Policy::parse("version: 1\n", Path::new("p.yaml"));
        let ruleset = crate::core::plan::plan(
            &unscoped.expect("valid"),
            &crate::core::plan::tests::resolution(&[]),
        );
        assert_eq!(FencedScope::of_ruleset(&ruleset), None);
    }

    #[test]
    fn a_packet_is_matched_by_uid_gid_cgroup_or_interface() {
        let s = scope();
        let mut host = FakeHost::default();
        let said = |m: Option<ScopeMatched>| m.map(|m| m.to_string());
        let by_uid = s.matched(&event(Some(1001), Some(1001), None), &mut host);
        assert_eq!(said(by_uid.clone()).as_deref(), Some("uid 1001 (agent)"));
        let json = serde_json::to_value(&by_uid).unwrap();
        assert_eq!(json, serde_json::json!({"uid": 1001, "name": "agent"}));
        let by_gid = s.matched(&event(Some(1500), Some(2000), None), &mut host);
        assert_eq!(said(by_gid).as_deref(), Some("gid 2000 (agents)"));
        let forwarded = s.matched(&event(None, None, Some(7)), &mut host);
        assert_eq!(
            said(forwarded.clone()).as_deref(),
            Some("from efbr0 198.18.0.2")
        );
        assert_eq!(
            serde_json::to_value(&forwarded).unwrap(),
            serde_json::json!({"from": "efbr0", "src": "198.18.0.2"})
        );
        let unknown_iface = s.matched(&event(None, None, Some(9)), &mut host);
        assert_eq!(said(unknown_iface).as_deref(), Some("from #9 198.18.0.2"));

        // Not by uid or gid: the socket's cgroup, the listed one itself or one below it.
        let other = event(Some(0), Some(0), None);
        assert_eq!(
            said(s.matched(&other, &mut host)).as_deref(),
            Some("cgroup ?")
        );
        let mut host = FakeHost {
            socket_cgroup: Some(40),
            below: vec![("agent.slice", 41)],
        };
        let listed = s.matched(&other, &mut host);
        assert_eq!(said(listed.clone()).as_deref(), Some("cgroup agent.slice"));
        assert_eq!(
            serde_json::to_value(&listed).unwrap(),
            serde_json::json!({"cgroup": "agent.slice"})
        );
        host.socket_cgroup = Some(41);
        assert_eq!(
            said(s.matched(&other, &mut host)).as_deref(),
            Some("cgroup agent.slice")
        );
        // A socket outside every listed cgroup: refused by the rules for everyone.
        host.socket_cgroup = Some(99);
        assert_eq!(s.matched(&other, &mut host), None);
        assert_eq!(
            serde_json::to_value(ScopeMatched::Cgroup { path: None }).unwrap(),
            serde_json::json!({"cgroup": null})
        );
    }

    #[test]
    fn without_cgroups_an_unmatched_socket_is_in_no_scope() {
        let s = FencedScope {
            uids: vec![1001],
            ..FencedScope::default()
        };
        let mut host = FakeHost::default();
        assert_eq!(s.matched(&event(Some(0), Some(0), None), &mut host), None);
    }

    #[test]
    fn a_cgroup_subtree_is_walked_for_the_id() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("a/b/c");
        std::fs::create_dir_all(&deep).unwrap();
        let id = std::fs::metadata(&deep).unwrap().ino();
        let mut budget = MAX_CGROUPS_WALKED;
        assert!(subtree_holds(dir.path(), id, &mut budget));
        let mut none = 2;
        assert!(
            !subtree_holds(dir.path(), id, &mut none),
            "the budget bounds the walk"
        );
    }
}
