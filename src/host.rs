//! This host and process as the current network namespace shows them: the addresses of its
//! interfaces, which no DNS answer may make an element of (see [`crate::core::installable`]),
//! and the uid the guard runs as.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::core::guard_identity::GuardIdentity;
use crate::core::installable::HostAddrs;
use crate::core::policy::{
    BridgePort, CgroupDelegation, CgroupPath, Delegate, IfacePattern, LocalResolver,
    LocalResolverKind, Policy, ScopeHost,
};
use crate::core::resolution::HostScope;
use crate::core::ruleset::CgroupMatch;

/// The guard of `policy` as this process runs it: `None` unless the policy is in guard mode.
///
/// The one place that reads the guard's uid: this process's effective uid, the uid `run`
/// keeps (the systemd unit's `DynamicUser=` gives it one of its own). `plan` and `apply` name
/// the uid of whoever runs them, which is the service's only when that is the same user.
/// With `scope.forward` the guard also listens on the listed interfaces' addresses (see
/// [`host_scope`]).
pub fn guard_identity(policy: &Policy) -> Option<GuardIdentity> {
    GuardIdentity::of_policy(policy, nix::unistd::geteuid().as_raw())
        .map(|g| g.listening_also_on(&bridge_listen(policy)))
}

/// What of this host a scoped policy's table depends on: the ids of its listed cgroups that
/// exist, and (in guard mode) where the guard listens on its listed interfaces. Empty without
/// a `scope:`.
pub fn host_scope(policy: &Policy) -> HostScope {
    if policy.scope.is_none() {
        return HostScope::default();
    }
    HostScope {
        cgroups: listed_cgroups(policy),
        bridge_listen: bridge_listen(policy),
    }
}

/// The cgroups `policy`'s scope lists that exist now, with their ids, in the policy's order.
pub fn listed_cgroups(policy: &Policy) -> Vec<CgroupMatch> {
    let Some(scope) = &policy.scope else {
        return Vec::new();
    };
    scope
        .cgroups
        .iter()
        .filter_map(|path| cgroup_match(path).ok())
        .collect()
}

/// The directories whose entries come and go when a listed cgroup appears or is removed:
/// the hierarchy's root, each listed cgroup's parent and the listed cgroup itself (for its
/// own removal). Those that do not exist yet are left to the caller's polling.
pub fn cgroup_watch_dirs(policy: &Policy) -> Vec<PathBuf> {
    let (Some(scope), Some(root)) = (&policy.scope, cgroup2_root()) else {
        return Vec::new();
    };
    if scope.cgroups.is_empty() {
        return Vec::new();
    }
    let mut dirs = vec![root.clone()];
    for path in &scope.cgroups {
        let dir = root.join(path.as_str());
        if let Some(parent) = dir.parent() {
            dirs.push(parent.to_path_buf());
        }
        dirs.push(dir);
    }
    dirs.sort();
    dirs.dedup();
    dirs
}

/// Why the listed cgroup `path` has no rule now, in a few words (`None`: it has one).
/// The directory of a cgroup a table names (as nft finds it below /sys/fs/cgroup; a table
/// planned where the hierarchy is mounted elsewhere names it below that), if it is one now.
pub fn cgroup_dir(in_table: &CgroupPath) -> Option<PathBuf> {
    let below_nft = PathBuf::from(NFT_CGROUP_DIR).join(in_table.as_str());
    let below_root = cgroup2_root().map(|root| root.join(in_table.as_str()));
    [Some(below_nft), below_root]
        .into_iter()
        .flatten()
        .find(|dir| dir.join("cgroup.procs").exists())
}

/// The id a cgroup a table names has now (see [`cgroup_dir`]).
pub fn cgroup_id_now(in_table: &CgroupPath) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(cgroup_dir(in_table)?)
        .ok()
        .map(|m| m.ino())
}

pub fn why_cgroup_missing(path: &CgroupPath) -> Option<String> {
    match cgroup_match(path) {
        Ok(_) => None,
        Err(CgroupError::Missing { path, .. }) => {
            Some(format!("{} does not exist", path.display()))
        }
        Err(e) => Some(e.to_string()),
    }
}

/// This host, as `check`, `apply` and `run` ask about a scope: its cgroup v2 hierarchy (who
/// may write it), the interfaces of the current network namespace (none read: none match;
/// a bridge's ports) and its account database.
pub struct ThisHost;

impl ScopeHost for ThisHost {
    fn cgroup_missing(&self, path: &CgroupPath) -> Option<String> {
        why_cgroup_missing(path)
    }

    fn interface_present(&self, pattern: &IfacePattern) -> bool {
        nix::net::if_::if_nameindex().is_ok_and(|names| {
            names
                .iter()
                .any(|i| i.name().to_str().is_ok_and(|n| pattern.matches(n)))
        })
    }

    fn uid_has_account(&self, uid: u32) -> bool {
        nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)).is_ok_and(|u| u.is_some())
    }

    fn cgroup_delegations(&self, path: &CgroupPath) -> Vec<CgroupDelegation> {
        cgroup_delegations(path)
    }

    fn bridge_ports(&self, pattern: &IfacePattern) -> Result<Vec<BridgePort>, String> {
        bridge_ports(pattern).map_err(|e| e.to_string())
    }

    fn local_resolvers(&self) -> Vec<LocalResolver> {
        local_resolvers_at(
            &LocalResolverKind::ALL.map(|(kind, socket, servers)| {
                (kind, PathBuf::from(socket), PathBuf::from(servers))
            }),
            &resolved_config_files(Path::new("/")),
        )
    }
}

/// The resolvers of `known` (kind, socket, file naming its servers: none when empty) whose
/// socket is there; systemd-resolved's multicast as `resolved_conf` sets it.
fn local_resolvers_at(
    known: &[(LocalResolverKind, PathBuf, PathBuf)],
    resolved_conf: &[PathBuf],
) -> Vec<LocalResolver> {
    use std::os::unix::fs::FileTypeExt;
    known
        .iter()
        .filter(|(_, socket, _)| std::fs::metadata(socket).is_ok_and(|m| m.file_type().is_socket()))
        .map(|(kind, socket, servers)| LocalResolver {
            kind: *kind,
            socket: socket.clone(),
            upstream: match servers.as_os_str().is_empty() {
                true => Vec::new(),
                false => crate::dns::resolve::system_resolvers(servers).unwrap_or_default(),
            },
            multicast: match kind {
                LocalResolverKind::SystemdResolved => resolved_multicast(resolved_conf),
                LocalResolverKind::Nscd => false,
                LocalResolverKind::Avahi => true,
            },
        })
        .collect()
}

/// resolved.conf and its drop-ins under `root`, in the order systemd-resolved reads them: the
/// first main file found, then every `*.conf` of the `resolved.conf.d` directories by file
/// name (a name in an earlier directory hides the same name in a later one).
fn resolved_config_files(root: &Path) -> Vec<PathBuf> {
    let dirs = [
        "etc/systemd",
        "run/systemd",
        "usr/local/lib/systemd",
        "usr/lib/systemd",
    ];
    let mut files: Vec<PathBuf> = dirs
        .iter()
        .map(|d| root.join(d).join("resolved.conf"))
        .find(|p| p.is_file())
        .into_iter()
        .collect();
    let mut dropins = std::collections::BTreeMap::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join("resolved.conf.d")) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().ends_with(".conf") {
                dropins.entry(entry.file_name()).or_insert(entry.path());
            }
        }
    }
    files.extend(dropins.into_values());
    files
}

/// Whether systemd-resolved asks the local links by multicast, as `files` set it: unless both
/// `LLMNR=` and `MulticastDNS=` are off (`no`) in `[Resolve]`, the last setting winning. Unset,
/// each is what the build made its default (LLMNR on upstream; mDNS on in some
/// distributions): taken as on.
fn resolved_multicast(files: &[PathBuf]) -> bool {
    let (mut llmnr, mut mdns) = (true, true);
    for file in files {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        let mut in_resolve = false;
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                in_resolve = line == "[Resolve]";
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                continue;
            };
            if !in_resolve || line.starts_with('#') || line.starts_with(';') {
                continue;
            }
            let on = !matches!(
                value.trim().to_ascii_lowercase().as_str(),
                "no" | "false" | "0" | "off"
            );
            match key.trim() {
                "LLMNR" => llmnr = on,
                "MulticastDNS" => mdns = on,
                _ => {}
            }
        }
    }
    llmnr || mdns
}

/// The holes this host's configuration opens in `policy`'s scope, each as its message: what
/// the daemon logs as an error whenever its host poll sees one.
pub fn scope_holes(policy: &Policy) -> Vec<String> {
    policy
        .scope_holes(&ThisHost)
        .into_iter()
        .map(|hole| hole.message)
        .collect()
}

/// Who besides root may move processes into or out of the listed cgroup `path` (see
/// [`ScopeHost::cgroup_delegations`]): moving a process takes write access to the
/// destination's `cgroup.procs` and to that of the common ancestor, so a writable file or an
/// owned directory anywhere from the listed cgroup up to the root may be a way out. Parts
/// that do not exist (yet) are skipped: whoever may write the existing ancestor above them
/// makes them.
pub fn cgroup_delegations(path: &CgroupPath) -> Vec<CgroupDelegation> {
    use std::os::unix::fs::MetadataExt;
    let Some(root) = cgroup2_root() else {
        return Vec::new();
    };
    let mut found = Vec::new();
    let mut dir = root.join(path.as_str());
    loop {
        if let Ok(meta) = std::fs::metadata(&dir) {
            if meta.uid() != 0 {
                found.push(CgroupDelegation {
                    path: dir.clone(),
                    to: Delegate::Uid(meta.uid()),
                });
            }
            for file in ["cgroup.procs", "cgroup.threads"] {
                let file = dir.join(file);
                let Ok(meta) = std::fs::metadata(&file) else {
                    continue;
                };
                let mode = meta.mode();
                let mut push = |to| {
                    found.push(CgroupDelegation {
                        path: file.clone(),
                        to,
                    })
                };
                if meta.uid() != 0 && mode & 0o200 != 0 {
                    push(Delegate::Uid(meta.uid()));
                }
                if mode & 0o020 != 0 {
                    push(Delegate::Group(meta.gid()));
                }
                if mode & 0o002 != 0 {
                    push(Delegate::Everyone);
                }
            }
        }
        if dir == root || !dir.pop() || !dir.starts_with(&root) {
            break;
        }
    }
    found
}

/// The ports of every bridge of the current network namespace whose name matches `pattern`,
/// and the devices stacked on it (VLAN, macvlan), with their link types (rtnetlink:
/// /sys/class/net shows the namespace sysfs was mounted in, not the one this thread entered).
pub fn bridge_ports(
    pattern: &IfacePattern,
) -> Result<Vec<BridgePort>, crate::netlink::link::LinkError> {
    Ok(bridge_ports_of(&crate::netlink::link::links()?, pattern))
}

/// [`bridge_ports`] of `links`. Stacked is every device above a matching bridge, however
/// deep: one whose lower device is the bridge, one of its ports or stacked (a VLAN on a
/// macvlan on it; a VLAN on a port; the peer in this namespace of a veth port, which gets
/// what the bridge sends out of the port), and the
/// master of the bridge or of a stacked device (a second bridge a macvlan of it is a port of):
/// what containers send arrives with that device, not the bridge, as input interface.
fn bridge_ports_of(
    links: &[crate::netlink::link::Link],
    pattern: &IfacePattern,
) -> Vec<BridgePort> {
    let mut ports = Vec::new();
    for bridge in links
        .iter()
        .filter(|l| l.kind.as_deref() == Some("bridge") && pattern.matches(&l.name))
    {
        let is_port = |l: &crate::netlink::link::Link| l.master == Some(bridge.index);
        let port = |link: &crate::netlink::link::Link, stacked| BridgePort {
            bridge: bridge.name.clone(),
            port: link.name.clone(),
            kind: link.kind.clone(),
            stacked,
        };
        ports.extend(
            links
                .iter()
                .filter(|l| is_port(l) && l.lower != Some(bridge.index))
                .map(|l| port(l, false)),
        );
        let mut above = vec![bridge.index];
        let mut grew = true;
        while grew {
            grew = false;
            for link in links.iter().filter(|l| !is_port(l)) {
                if above.contains(&link.index) {
                    continue;
                }
                let on_top = link.lower.is_some_and(|i| {
                    above.contains(&i) || links.iter().any(|l| l.index == i && is_port(l))
                }) || links
                    .iter()
                    .any(|l| above.contains(&l.index) && l.master == Some(link.index));
                if on_top {
                    above.push(link.index);
                    ports.push(port(link, true));
                    grew = true;
                }
            }
        }
    }
    ports
}

/// Where the cgroup v2 hierarchy is mounted: /sys/fs/cgroup on a unified host, its
/// `unified` directory on a hybrid one (from /proc/self/mountinfo).
pub fn cgroup2_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mounts.lines().find_map(|line| {
        // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
        let (before, after) = line.split_once(" - ")?;
        let fstype = after.split(' ').next()?;
        let mountpoint = before.split(' ').nth(4)?;
        (fstype == "cgroup2").then(|| PathBuf::from(unescape_mount_path(mountpoint)))
    })
}

/// mountinfo writes a space, tab, newline and backslash as octal escapes (`\040`).
fn unescape_mount_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut rest = path;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let code = rest
            .get(at + 1..at + 4)
            .and_then(|o| u8::from_str_radix(o, 8).ok());
        match code {
            Some(byte) => {
                out.push(byte as char);
                rest = &rest[at + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Why a listed cgroup has no rule.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("this host has no cgroup v2 hierarchy mounted")]
    NoHierarchy,
    #[error("{path} does not exist: nobody is in it yet ({error})")]
    Missing {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{0} is not a directory of the cgroup v2 hierarchy")]
    NotACgroup(PathBuf),
}

/// Where nft looks cgroup v2 paths up (`socket cgroupv2 level 1 "agent.slice"`).
const NFT_CGROUP_DIR: &str = "/sys/fs/cgroup";

/// The listed cgroup `path` as the kernel matches it now: its id (the directory's inode
/// number, what `socket cgroupv2` compares) and its level below the root, named as nft finds
/// it below /sys/fs/cgroup (`unified/agent.slice` on a hybrid host).
pub fn cgroup_match(path: &CgroupPath) -> Result<CgroupMatch, CgroupError> {
    use std::os::unix::fs::MetadataExt;
    let root = cgroup2_root().ok_or(CgroupError::NoHierarchy)?;
    let dir = root.join(path.as_str());
    let nft_path = match root.strip_prefix(NFT_CGROUP_DIR) {
        Ok(below) if below.as_os_str().is_empty() => path.clone(),
        Ok(below) => below
            .join(path.as_str())
            .to_str()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| path.clone()),
        // Mounted elsewhere: nft cannot find it by name, the kernel still matches the id.
        Err(_) => path.clone(),
    };
    let meta = std::fs::metadata(&dir).map_err(|error| CgroupError::Missing {
        path: dir.clone(),
        error,
    })?;
    if !meta.is_dir() || !dir.join("cgroup.procs").exists() {
        return Err(CgroupError::NotACgroup(dir));
    }
    Ok(CgroupMatch {
        path: nft_path,
        level: path.level(),
        id: meta.ino(),
    })
}

/// In guard mode with `scope.forward`: port 53 of every address of every interface the
/// scope lists (link-local IPv6 addresses left out: a socket bound to one needs its
/// interface, and containers are given a global address to ask).
pub fn bridge_listen(policy: &Policy) -> Vec<SocketAddr> {
    let mut found: Vec<SocketAddr> = listed_bridge_addrs(policy)
        .into_iter()
        .map(|(_, addr)| addr)
        .collect();
    found.sort();
    found.dedup();
    found
}

/// [`bridge_listen`] by interface: each listed interface's name with port 53 of each of its
/// addresses (what a warning names when the guard does not listen there).
pub fn listed_bridge_addrs(policy: &Policy) -> Vec<(String, SocketAddr)> {
    let (Some(scope), Some(_)) = (&policy.scope, &policy.dns.guard) else {
        return Vec::new();
    };
    if scope.forward.is_empty() {
        return Vec::new();
    }
    let Ok(interfaces) = nix::ifaddrs::getifaddrs() else {
        tracing::warn!("cannot read this host's interfaces; the guard listens on no bridge");
        return Vec::new();
    };
    let mut found: Vec<(String, SocketAddr)> = Vec::new();
    for i in interfaces {
        if !scope.forward.iter().any(|p| p.matches(&i.interface_name)) {
            continue;
        }
        let Some(addr) = i.address else { continue };
        let ip = if let Some(v4) = addr.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = addr.as_sockaddr_in6() {
            let ip = v6.ip();
            if ip.segments()[0] & 0xffc0 == 0xfe80 {
                continue;
            }
            IpAddr::V6(ip)
        } else {
            continue;
        };
        let listen = (
            i.interface_name,
            SocketAddr::new(ip, crate::core::plan::DNS_PORT),
        );
        if !found.contains(&listen) {
            found.push(listen);
        }
    }
    found.sort();
    found
}

/// An interface address: the address, its netmask and its broadcast address.
pub type InterfaceAddr = (IpAddr, Option<IpAddr>, Option<IpAddr>);

/// This host's addresses in a network namespace other than the one this process reads its
/// interfaces in, taken as its own too (see [`set_addrs_elsewhere`]).
static ELSEWHERE: std::sync::Mutex<Vec<InterfaceAddr>> = std::sync::Mutex::new(Vec::new());

/// Says what the host's addresses are where this process's namespace does not show them:
/// `exec` runs its guard in the run's namespace, which has a copy of one interface's
/// addresses (pasta's), while pasta connects CMD from the host's, where every other address
/// of the host (a second interface's, docker0's, one on its loopback device) reaches the
/// host itself. An answer naming one of them must not be installed, as for a fenced host.
pub fn set_addrs_elsewhere(interfaces: Vec<InterfaceAddr>) {
    match ELSEWHERE.lock() {
        Ok(mut held) => *held = interfaces,
        Err(poisoned) => *poisoned.into_inner() = interfaces,
    }
}

/// The addresses of the interfaces of the calling thread's namespace now (getifaddrs).
pub fn read_interfaces() -> Result<Vec<InterfaceAddr>, nix::Error> {
    let ip = |s: Option<nix::sys::socket::SockaddrStorage>| -> Option<IpAddr> {
        let s = s?;
        if let Some(v4) = s.as_sockaddr_in() {
            return Some(IpAddr::V4(v4.ip()));
        }
        s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
    };
    let interfaces = nix::ifaddrs::getifaddrs()?.filter_map(|i| {
        let addr = ip(i.address)?;
        Some((addr, ip(i.netmask), ip(i.broadcast)))
    });
    Ok(interfaces.collect())
}

/// The interfaces' addresses now (getifaddrs), and those set with [`set_addrs_elsewhere`].
pub fn read_addrs() -> Result<HostAddrs, nix::Error> {
    let mut interfaces = read_interfaces()?;
    match ELSEWHERE.lock() {
        Ok(held) => interfaces.extend(held.iter().copied()),
        Err(poisoned) => interfaces.extend(poisoned.into_inner().iter().copied()),
    }
    Ok(HostAddrs::from_interfaces(interfaces))
}

/// Reads the interfaces, or, when that fails, knows none (the address classes still apply)
/// and says so.
pub fn read_addrs_or_warn() -> HostAddrs {
    read_addrs().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot read this host's addresses; answers are checked \
                        without them");
        HostAddrs::none()
    })
}

/// How long the host's addresses are taken as read: they come and go, but reading them for
/// every answer or datagram would cost a netlink dump each.
const HOST_ADDRS_FOR: Duration = Duration::from_secs(5);

/// [`HostAddrs`] read again at most every `HOST_ADDRS_FOR`: what the guard's serving tasks
/// and the daemon check answers and clients against.
#[derive(Debug)]
pub struct HostAddrsCache {
    addrs: HostAddrs,
    read: Instant,
}

impl HostAddrsCache {
    pub fn new() -> HostAddrsCache {
        HostAddrsCache {
            addrs: read_addrs_or_warn(),
            read: Instant::now(),
        }
    }

    pub fn current(&mut self) -> &HostAddrs {
        if self.read.elapsed() >= HOST_ADDRS_FOR {
            self.read = Instant::now();
            match read_addrs() {
                Ok(addrs) => self.addrs = addrs,
                // The last ones read are still the best guess.
                Err(e) => tracing::debug!(error = %e, "reading the host's addresses"),
            }
        }
        &self.addrs
    }
}

impl Default for HostAddrsCache {
    fn default() -> Self {
        HostAddrsCache::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Devices above a listed bridge are stacked however deep: a VLAN on a macvlan on it, a
    /// second bridge a macvlan of it is a port of, the peer of a veth port left in this
    /// namespace; the bridge's ports are not.
    #[test]
    fn every_device_above_a_listed_bridge_is_stacked_however_deep() {
        use crate::netlink::link::Link;
        let link = |index, name: &str, master, lower, kind: Option<&str>| Link {
            index,
            name: name.into(),
            master,
            lower,
            kind: kind.map(str::to_string),
            tun: None,
        };
        let links = [
            link(2, "efbr0", None, None, Some("bridge")),
            link(3, "ct0", Some(2), None, Some("veth")),
            link(4, "mv0", None, Some(2), Some("macvlan")),
            link(5, "mv0.10", None, Some(4), Some("vlan")),
            link(6, "br2", None, None, Some("bridge")),
            link(7, "mv1", Some(6), Some(2), Some("macvlan")),
            link(8, "vA", Some(2), Some(9), Some("veth")),
            link(9, "vB", None, Some(8), Some("veth")),
            link(10, "other", None, None, Some("bridge")),
            link(11, "eth0", Some(10), None, None),
        ];
        let found = bridge_ports_of(&links, &"efbr0".parse().unwrap());
        let mut named: Vec<(&str, bool)> =
            found.iter().map(|p| (p.port.as_str(), p.stacked)).collect();
        named.sort();
        assert_eq!(
            named,
            [
                ("br2", true),
                ("ct0", false),
                ("mv0", true),
                ("mv0.10", true),
                ("mv1", true),
                ("vA", false),
                ("vB", true),
            ]
        );
        assert!(found.iter().all(|p| p.bridge == "efbr0"));
    }

    #[test]
    fn mount_paths_are_unescaped() {
        assert_eq!(unescape_mount_path("/a\\040b/c"), "/a b/c");
        assert_eq!(unescape_mount_path("/plain"), "/plain");
        assert_eq!(unescape_mount_path("/odd\\x"), "/odd\\x");
    }

    #[test]
    fn the_cgroup_hierarchy_is_found_and_a_missing_cgroup_named() {
        let Some(root) = cgroup2_root() else { return };
        assert!(root.join("cgroup.procs").exists(), "{root:?}");
        let missing: CgroupPath = "egress-fence-no-such-cgroup".parse().unwrap();
        let e = cgroup_match(&missing).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
    }

    #[test]
    fn reading_the_interfaces_finds_loopback() {
        let host = read_addrs().expect("getifaddrs");
        assert!(host.is_own("127.0.0.1".parse().unwrap()), "{host:?}");
    }

    /// Only a resolver whose socket is there is found, with the servers its file names
    /// (none when the file cannot be read).
    #[test]
    fn local_resolvers_are_those_whose_socket_is_there() {
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str| dir.path().join(name);
        let _resolved = std::os::unix::net::UnixListener::bind(at("resolve.sock")).unwrap();
        std::fs::write(
            at("resolved.conf"),
            "nameserver 192.0.2.53\nnameserver ::1\n",
        )
        .unwrap();
        std::fs::write(at("not-a-socket"), "").unwrap();
        let _nscd = std::os::unix::net::UnixListener::bind(at("nscd.sock")).unwrap();
        let _avahi = std::os::unix::net::UnixListener::bind(at("avahi.sock")).unwrap();
        let found = local_resolvers_at(
            &[
                (
                    LocalResolverKind::SystemdResolved,
                    at("resolve.sock"),
                    at("resolved.conf"),
                ),
                (
                    LocalResolverKind::Nscd,
                    at("not-a-socket"),
                    at("resolved.conf"),
                ),
                (LocalResolverKind::Nscd, at("nscd.sock"), at("missing.conf")),
                (LocalResolverKind::Avahi, at("avahi.sock"), PathBuf::new()),
            ],
            &[],
        );
        let got: Vec<(LocalResolverKind, Vec<IpAddr>, bool)> = found
            .into_iter()
            .map(|r| (r.kind, r.upstream, r.multicast))
            .collect();
        assert_eq!(
            got,
            [
                (
                    LocalResolverKind::SystemdResolved,
                    vec!["192.0.2.53".parse().unwrap(), "::1".parse().unwrap()],
                    true
                ),
                (LocalResolverKind::Nscd, vec![], false),
                (LocalResolverKind::Avahi, vec![], true),
            ]
        );
    }

    /// systemd-resolved's multicast is off only where both LLMNR and MulticastDNS are set
    /// off, by the main file or a drop-in read after it (the last setting wins; outside
    /// `[Resolve]` or commented out, nothing counts).
    #[test]
    fn resolved_multicast_is_off_only_where_both_are_set_off() {
        let root = tempfile::tempdir().unwrap();
        let write = |rel: &str, text: &str| {
            let path = root.path().join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        let multicast = || resolved_multicast(&resolved_config_files(root.path()));
        assert!(multicast(), "unset: the build's defaults");
        write(
            "usr/lib/systemd/resolved.conf",
            "[Resolve]\nLLMNR=no\nMulticastDNS=no\n",
        );
        assert!(!multicast());
        // /etc's main file replaces /usr/lib's: its commented lines set nothing.
        write(
            "etc/systemd/resolved.conf",
            "[Resolve]\n#LLMNR=no\nMulticastDNS=no\n",
        );
        assert!(multicast());
        write(
            "usr/lib/systemd/resolved.conf.d/50-llmnr.conf",
            "[Resolve]\nLLMNR=false\n",
        );
        assert!(!multicast());
        // A later drop-in turns it back on; one of the same name in /etc hides /usr/lib's.
        write(
            "run/systemd/resolved.conf.d/60-on.conf",
            "[Resolve]\nLLMNR=resolve\n",
        );
        assert!(multicast());
        write(
            "etc/systemd/resolved.conf.d/60-on.conf",
            "[Other]\nLLMNR=yes\n",
        );
        assert!(!multicast());
    }
}
