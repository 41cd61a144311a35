//! `scope:`: who the policy fences when it is not the whole network namespace. Users and
//! groups (their names resolved when the policy is read), cgroup v2 subtrees, and interfaces
//! whose traffic is forwarded (containers on a bridge).
//!
//! Each value checks itself here; which users and groups exist is asked of the host's account
//! database when the policy is validated (like the file itself, read once, at load).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

/// The longest interface name the kernel takes (IFNAMSIZ less the NUL).
pub const MAX_IFACE_NAME: usize = 15;

/// Who the policy fences. Without a `scope:` the whole namespace is fenced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Scope {
    pub users: Vec<ScopeUser>,
    pub groups: Vec<ScopeGroup>,
    pub cgroups: Vec<CgroupPath>,
    pub forward: Vec<IfacePattern>,
}

impl Scope {
    /// Every uid whose sockets are fenced: the listed users and the members of the listed
    /// groups (a member can make any group of theirs the one its new sockets carry, with
    /// `sg`), sorted, once each.
    pub fn uids(&self) -> Vec<u32> {
        let mut uids: Vec<u32> = self
            .users
            .iter()
            .map(|u| u.uid)
            .chain(self.groups.iter().flat_map(|g| g.members.iter().copied()))
            .collect();
        uids.sort_unstable();
        uids.dedup();
        uids
    }

    /// The listed groups' gids, sorted, once each.
    pub fn gids(&self) -> Vec<u32> {
        let mut gids: Vec<u32> = self.groups.iter().map(|g| g.gid).collect();
        gids.sort_unstable();
        gids.dedup();
        gids
    }

    /// Whether anything local (not forwarded) is fenced.
    pub fn fences_local(&self) -> bool {
        !self.users.is_empty() || !self.groups.is_empty() || !self.cgroups.is_empty()
    }
}

/// A user of `scope.users`: as written (a name, or a uid), and its uid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScopeUser {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub uid: u32,
}

impl fmt::Display for ScopeUser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(name) => write!(f, "{name} (uid {})", self.uid),
            None => write!(f, "uid {}", self.uid),
        }
    }
}

/// A group of `scope.groups`: its gid and the uids of its members when the policy was read
/// (the supplementary members the group lists, and the users whose primary group it is).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScopeGroup {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub gid: u32,
    pub members: Vec<u32>,
}

impl fmt::Display for ScopeGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(name) => write!(f, "{name} (gid {})", self.gid),
            None => write!(f, "gid {}", self.gid),
        }
    }
}

/// A user or group as written: a name, or a number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccountRef {
    Name(String),
    Id(u32),
}

impl<'de> Deserialize<'de> for AccountRef {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Id(u32),
            Name(String),
        }
        let bad = |s: &str| {
            serde::de::Error::custom(format!(
                "`{s}` is not a user or group: write a name (agent) or a number (1001)"
            ))
        };
        match Written::deserialize(d).map_err(|_| bad("this value"))? {
            Written::Id(id) if id == u32::MAX => Err(bad(&id.to_string())),
            Written::Id(id) => Ok(AccountRef::Id(id)),
            Written::Name(s) => {
                let t = s.trim();
                if let Ok(id) = t.parse::<u32>() {
                    return Ok(AccountRef::Id(id));
                }
                // POSIX portable names, and the `$` of machine accounts.
                let fine = |c: char| c.is_ascii_alphanumeric() || "._-$".contains(c);
                if t.is_empty() || t.len() > 256 || !t.chars().all(fine) || t.starts_with('-') {
                    return Err(bad(t));
                }
                Ok(AccountRef::Name(t.to_string()))
            }
        }
    }
}

impl fmt::Display for AccountRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AccountRef::Name(n) => f.write_str(n),
            AccountRef::Id(id) => write!(f, "{id}"),
        }
    }
}

/// The longest cgroup path a rule's comment carries (libnftnl's 128-byte comment buffer,
/// less the TLV's type, length and NUL).
pub const MAX_CGROUP_PATH: usize = 125;

/// A cgroup v2 subtree, relative to the root of the cgroup v2 hierarchy
/// (`agent.slice`, `system.slice/agent.service`): its processes' sockets, and those of every
/// cgroup below it, whenever made.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct CgroupPath(String);

impl CgroupPath {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// How deep it is below the root: the level nft's `socket cgroupv2 level` names.
    pub fn level(&self) -> u32 {
        self.0.split('/').count() as u32
    }
}

impl fmt::Display for CgroupPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for CgroupPath {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let path = s
            .trim()
            .trim_start_matches("/sys/fs/cgroup")
            .trim_matches('/');
        if path.is_empty() {
            return Err(format!(
                "`{s}` is the root cgroup, which holds every process: leave `scope.cgroups` out \
                 to fence the whole namespace"
            ));
        }
        let bad_part = path
            .split('/')
            .find(|p| p.is_empty() || *p == "." || *p == ".." || p.len() > 255);
        // nft writes the path between double quotes, and a rule's comment holds it (at most
        // MAX_CGROUP_PATH bytes: what libnftnl's comment buffer holds, its NUL included).
        let bad_char = path
            .chars()
            .find(|c| c.is_control() || *c == '"' || *c == '\\');
        if bad_part.is_some() || bad_char.is_some() || path.len() > MAX_CGROUP_PATH {
            return Err(format!(
                "`{s}` is not a cgroup path: write it as below /sys/fs/cgroup, such as \
                 agent.slice or system.slice/agent.service (no `..`, quotes or empty parts, at \
                 most {MAX_CGROUP_PATH} bytes)"
            ));
        }
        Ok(CgroupPath(path.to_string()))
    }
}

impl<'de> Deserialize<'de> for CgroupPath {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// An interface name, or a prefix of one ending in `*` (`br-*`), as nft's `iifname` matches
/// them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct IfacePattern(String);

impl IfacePattern {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The prefix of a `br-*` pattern; `None` for a whole name.
    pub fn prefix(&self) -> Option<&str> {
        self.0.strip_suffix('*')
    }

    pub fn matches(&self, name: &str) -> bool {
        match self.prefix() {
            Some(prefix) => name.starts_with(prefix),
            None => name == self.0,
        }
    }
}

impl fmt::Display for IfacePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for IfacePattern {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let name = t.strip_suffix('*').unwrap_or(t);
        // What the kernel takes as a name (dev_valid_name), less what nft's quoting cannot
        // carry; `*` only at the end (nft matches a prefix, not a glob).
        let fine = |c: char| c.is_ascii_graphic() && !"/:\"\\*".contains(c);
        if name.is_empty() || t.len() > MAX_IFACE_NAME || !name.chars().all(fine) {
            return Err(format!(
                "`{s}` is not an interface: write a name such as docker0 (at most \
                 {MAX_IFACE_NAME} characters) or a prefix ending in `*` such as br-*"
            ));
        }
        if name == "lo" {
            return Err("`lo` forwards nothing: list the bridges containers sit on".into());
        }
        Ok(IfacePattern(t.to_string()))
    }
}

impl<'de> Deserialize<'de> for IfacePattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// `scope:` as written.
#[derive(Deserialize, Default, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Scope")]
pub(super) struct RawScope {
    /// Users fenced: names (looked up when the policy is read) or uids; not root.
    #[serde(default)]
    pub(super) users: Vec<AccountRef>,
    /// Groups fenced: names or gids; sockets of the group and of its members.
    #[serde(default)]
    pub(super) groups: Vec<AccountRef>,
    /// cgroup v2 subtrees, below the hierarchy's root (agent.slice).
    #[serde(default)]
    pub(super) cgroups: Vec<CgroupPath>,
    /// What these interfaces forward (containers on a bridge): names or prefixes ending in
    /// `*`.
    #[serde(default)]
    pub(super) forward: Vec<IfacePattern>,
}

/// Where the names of users and groups are looked up.
pub trait Accounts {
    fn uid_of(&self, name: &str) -> Option<u32>;
    /// A group's gid and the uids of its members (listed, and by primary group).
    fn group(&self, name: &str) -> Option<(u32, Vec<u32>)>;
    fn group_by_gid(&self, gid: u32) -> Option<(String, Vec<u32>)>;
}

/// The host's account database (NSS), read when the policy is.
pub struct SystemAccounts;

impl SystemAccounts {
    /// The uids of `members` (names), and of the users whose primary group is `gid`
    /// (/etc/passwd: NSS has no portable way to list the users of a group by their primary
    /// gid; `meta skgid` fences those it misses while they keep that group).
    fn member_uids(gid: u32, members: &[String]) -> Vec<u32> {
        let mut uids: Vec<u32> = members
            .iter()
            .filter_map(|m| SystemAccounts.uid_of(m))
            .collect();
        if let Ok(passwd) = std::fs::read_to_string("/etc/passwd") {
            for line in passwd.lines() {
                let fields: Vec<&str> = line.split(':').collect();
                if let [_, _, uid, primary, ..] = fields[..]
                    && primary.parse() == Ok(gid)
                    && let Ok(uid) = uid.parse()
                {
                    uids.push(uid);
                }
            }
        }
        uids.sort_unstable();
        uids.dedup();
        uids
    }
}

impl Accounts for SystemAccounts {
    fn uid_of(&self, name: &str) -> Option<u32> {
        nix::unistd::User::from_name(name)
            .ok()
            .flatten()
            .map(|u| u.uid.as_raw())
    }

    fn group(&self, name: &str) -> Option<(u32, Vec<u32>)> {
        let g = nix::unistd::Group::from_name(name).ok().flatten()?;
        let gid = g.gid.as_raw();
        Some((gid, Self::member_uids(gid, &g.mem)))
    }

    fn group_by_gid(&self, gid: u32) -> Option<(String, Vec<u32>)> {
        let g = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid))
            .ok()
            .flatten()?;
        let members = Self::member_uids(gid, &g.mem);
        Some((g.name, members))
    }
}

/// Why a scope cannot be: a message, and the text to locate it by.
pub(super) type ScopeError = (String, String);

impl RawScope {
    pub(super) fn resolve(self, accounts: &dyn Accounts) -> Result<Scope, ScopeError> {
        let mut users = Vec::new();
        for u in self.users {
            users.push(match u {
                AccountRef::Id(uid) => ScopeUser { name: None, uid },
                AccountRef::Name(name) => match accounts.uid_of(&name) {
                    Some(uid) => ScopeUser {
                        name: Some(name),
                        uid,
                    },
                    None => {
                        return Err((
                            format!(
                                "there is no user `{name}` on this host: create it first, or \
                                 write its uid (a user of a container's user namespace has \
                                 none here)"
                            ),
                            name,
                        ));
                    }
                },
            });
        }
        let mut groups = Vec::new();
        for g in self.groups {
            groups.push(match g {
                AccountRef::Id(gid) => {
                    let (name, members) = accounts
                        .group_by_gid(gid)
                        .map_or((None, Vec::new()), |(n, m)| (Some(n), m));
                    ScopeGroup { name, gid, members }
                }
                AccountRef::Name(name) => match accounts.group(&name) {
                    Some((gid, members)) => ScopeGroup {
                        name: Some(name),
                        gid,
                        members,
                    },
                    None => {
                        return Err((
                            format!("there is no group `{name}` on this host: create it first"),
                            name,
                        ));
                    }
                },
            });
        }
        if let Some(root) = users.iter().find(|u| u.uid == 0) {
            return Err((
                format!(
                    "`{root}` holds CAP_NET_ADMIN and could take the fence down: fence root \
                     with a cgroup, a container or the whole namespace instead"
                ),
                root.name.clone().unwrap_or_else(|| "0".into()),
            ));
        }
        let scope = Scope {
            users,
            groups,
            cgroups: dedup(self.cgroups),
            forward: dedup(self.forward),
        };
        if !scope.fences_local() && scope.forward.is_empty() {
            return Err((
                "`scope:` lists nobody: list users, groups, cgroups or forward interfaces, or \
                 leave `scope:` out to fence the whole namespace"
                    .into(),
                "scope".into(),
            ));
        }
        Ok(scope)
    }
}

fn dedup<T: Ord + Clone>(mut v: Vec<T>) -> Vec<T> {
    let mut seen = std::collections::BTreeSet::new();
    v.retain(|x| seen.insert(x.clone()));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed;

    impl Accounts for Fixed {
        fn uid_of(&self, name: &str) -> Option<u32> {
            match name {
                "agent" => Some(1001),
                "root" => Some(0),
                _ => None,
            }
        }
        fn group(&self, name: &str) -> Option<(u32, Vec<u32>)> {
            (name == "agents").then(|| (2000, vec![1001, 1002]))
        }
        fn group_by_gid(&self, gid: u32) -> Option<(String, Vec<u32>)> {
            (gid == 2000).then(|| ("agents".into(), vec![1001, 1002]))
        }
    }

    fn raw(yaml: &str) -> Result<RawScope, serde_yaml::Error> {
        serde_yaml::from_str(yaml)
    }

    #[test]
    fn names_become_ids_and_groups_bring_their_members() {
        let scope = raw("users: [agent, 1003]\ngroups: [agents, 2000]\n")
            .unwrap()
            .resolve(&Fixed)
            .unwrap();
        assert_eq!(scope.uids(), vec![1001, 1002, 1003]);
        assert_eq!(scope.gids(), vec![2000]);
        assert_eq!(scope.users[0].to_string(), "agent (uid 1001)");
        assert_eq!(scope.groups[1].to_string(), "agents (gid 2000)");
    }

    #[test]
    fn unknown_names_root_and_an_empty_scope_are_refused() {
        let (msg, at) = raw("users: [nobody-here]\n")
            .unwrap()
            .resolve(&Fixed)
            .unwrap_err();
        assert!(msg.contains("no user `nobody-here`"), "{msg}");
        assert_eq!(at, "nobody-here");
        let (msg, _) = raw("groups: [wheel]\n")
            .unwrap()
            .resolve(&Fixed)
            .unwrap_err();
        assert!(msg.contains("no group `wheel`"), "{msg}");
        for root in ["users: [root]\n", "users: [0]\n"] {
            let (msg, _) = raw(root).unwrap().resolve(&Fixed).unwrap_err();
            assert!(msg.contains("CAP_NET_ADMIN"), "{msg}");
        }
        let (msg, _) = raw("{}").unwrap().resolve(&Fixed).unwrap_err();
        assert!(msg.contains("lists nobody"), "{msg}");
    }

    #[test]
    fn bad_account_values_are_refused_as_values() {
        for bad in [
            "users: [\"a b\"]\n",
            "users: [\"-x\"]\n",
            "users: [4294967295]\n",
            "users: [[1]]\n",
        ] {
            assert!(raw(bad).is_err(), "{bad}");
        }
        assert_eq!(
            raw("users: [\"1005\"]\n").unwrap().users,
            vec![AccountRef::Id(1005)]
        );
    }

    #[test]
    fn cgroup_paths_are_relative_and_plain() {
        let p: CgroupPath = "/sys/fs/cgroup/agent.slice/".parse().unwrap();
        assert_eq!((p.as_str(), p.level()), ("agent.slice", 1));
        let p: CgroupPath = "system.slice/agent.service".parse().unwrap();
        assert_eq!(p.level(), 2);
        for bad in ["", "/", "a/../b", "a//b", "a\"b", "./a"] {
            assert!(bad.parse::<CgroupPath>().is_err(), "{bad}");
        }
    }

    #[test]
    fn interface_patterns_are_names_or_prefixes() {
        let p: IfacePattern = "br-*".parse().unwrap();
        assert_eq!(p.prefix(), Some("br-"));
        assert!(p.matches("br-0a1b") && !p.matches("docker0"));
        let p: IfacePattern = "docker0".parse().unwrap();
        assert!(p.matches("docker0") && !p.matches("docker01"));
        for bad in [
            "",
            "*",
            "a*b",
            "a/b",
            "sixteen-chars-xx",
            "lo",
            "a b",
            "x\"y",
        ] {
            assert!(bad.parse::<IfacePattern>().is_err(), "{bad}");
        }
    }
}
