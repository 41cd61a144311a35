//! What a valid policy allows but probably does not mean: printed, never fatal; and what this
//! host's configuration opens past a scope's fence, which `apply` and `run` refuse.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use ipnet::IpNet;

use crate::core::installable::HostAddrs;

use super::errors::{PolicyError, locate_value, location};
use super::names::Wildcard;
use super::schema::*;
use super::scope::{CgroupPath, IfacePattern};
use super::values::parse_network;

impl Policy {
    /// Things that are allowed but probably not meant; printed, never fatal.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.action == Action::Audit {
            out.push(super::audit::AUDIT_WARNING.to_string());
        }
        for allow in &self.allow {
            if let Target::Cidr(net) = allow.target {
                let shadowing = self
                    .deny
                    .iter()
                    .find(|d| d.networks.iter().any(|dn| dn.contains(&net)));
                if let Some(d) = shadowing {
                    out.push(format!(
                        "allowed network {net} lies inside the denied {}: deny wins, so this \
                         entry allows nothing",
                        d.describe()
                    ));
                }
            }
        }
        // The guard's upstreams are refused to every socket but the guard's, on every port: an
        // allowed network that holds one does not reach it; an entry of its address alone
        // does, on that entry's ports, unless another entry could open it too (see
        // `plan::upstream_denied`).
        for allow in &self.allow {
            if let Target::Cidr(net) = allow.target {
                for r in self.dns.guard.iter().flat_map(|g| &g.upstream) {
                    if net == IpNet::from(*r)
                        && crate::core::plan::upstream_opened_otherwise(self, *r)
                    {
                        out.push(format!(
                            "allowed address {r} is the guard's upstream, which other entries \
                             would open too (a wildcard, whose zone may answer {r}, or a \
                             network that holds it): it stays refused to every socket but the \
                             guard's, this entry's ports too"
                        ));
                    } else if net == IpNet::from(*r) {
                        out.push(format!(
                            "allowed address {r} is the guard's upstream: every process reaches \
                             it on this entry's ports, around the guard if it serves DNS there \
                             (DNS over HTTPS on 443)"
                        ));
                    } else if net.contains(r) {
                        out.push(format!(
                            "allowed network {net} holds the guard's upstream {r}, which only \
                             the guard reaches, on any port: nothing else to {r} is allowed \
                             (an entry of {r} alone would allow its ports, were there no \
                             other to open it)"
                        ));
                    }
                }
            }
        }
        for allow in &self.allow {
            if let Target::Wildcard(w) = &allow.target {
                out.extend(wildcard_risk(w));
            }
        }
        let refresh_set = (self.dns.refresh_min, self.dns.refresh_max)
            != (DEFAULT_REFRESH_MIN, DEFAULT_REFRESH_MAX);
        if self.dns.guard.is_some() && refresh_set {
            out.push(
                "`dns.refresh` has no effect in guard mode: the guard looks nothing up on a \
                 timer; `floor` and `grace` set how long answered addresses live"
                    .into(),
            );
        }
        for r in self.dns.guard.iter().flat_map(|g| &g.upstream) {
            if r.is_loopback() {
                out.push(format!(
                    "upstream {r} is on loopback, which every local process may reach: a \
                     resolver there lets them around the guard"
                ));
            }
        }
        for r in self.dns.resolvers.iter().flatten() {
            if let Some(d) = self.denied_by(*r) {
                out.push(format!(
                    "resolver {r} lies in the denied {}: DNS to it (port 53) stays allowed, \
                     everything else to it is refused",
                    d.describe()
                ));
            }
        }
        if !self.essentials.contains(&Essential::Established) {
            out.push(
                "`essentials` leaves out `established`: replies of inbound connections (SSH \
                 included) will be refused"
                    .into(),
            );
            if self.dns.guard.is_some() {
                out.push(
                    "without `established`, a connection to an answered address is cut when \
                     the address expires (the guard renews only addresses whose connections \
                     conntrack still sees)"
                        .into(),
                );
            }
        }
        out.extend(
            self.dns
                .resolvers
                .as_deref()
                .and_then(|r| self.squattable_resolvers(r, |_| false)),
        );
        if let Some(resolvers) = &self.dns.resolvers
            && resolvers.iter().all(|r| r.is_loopback())
        {
            out.push(
                "every resolver is on loopback: a local stub (systemd-resolved, dnsmasq) needs \
                 its own upstream servers allowed, or names stop resolving; list the upstream \
                 resolvers instead"
                    .into(),
            );
        }
        out
    }
}

impl Policy {
    /// Guard mode: each upstream that is an address of this host (`host`) other than
    /// loopback (which [`Policy::warnings`] names). What goes to an address of this host
    /// leaves by loopback, which the table accepts before its deny sets: every local process
    /// reaches the resolver there on every port but DNS's (the guard's protections cover
    /// 53 and 853), a resolver that may answer DNS over HTTPS among them.
    pub fn upstreams_on_this_host(&self, host: &HostAddrs) -> Vec<String> {
        self.dns
            .guard
            .iter()
            .flat_map(|g| &g.upstream)
            .filter(|r| !r.is_loopback() && host.is_own(**r))
            .map(|r| {
                format!(
                    "upstream {r} is an address of this host: every local process reaches it \
                     over loopback on every port but 53 and 853, which the deny sets do not \
                     cover (a resolver serving DNS over HTTPS would answer any name around the \
                     guard); run the upstream resolver on another host"
                )
            })
            .collect()
    }

    /// Without a scope, asking a resolver on loopback or on an address of this host
    /// (`is_host`; `resolvers`: the policy's, or those resolv.conf named; in guard mode the
    /// guard's upstreams): the warning that a local process may answer in its place. UDP lets
    /// a second socket share the address of a resolver bound with SO_REUSEADDR
    /// (systemd-resolved's and dnsmasq's are), and the later one gets the questions; a fenced
    /// process that may bind port 53 (root in a container on the host's network) then chooses
    /// the addresses of the policy's names. The table cannot tell the resolver's answers from
    /// the squatter's when both are fenced; with a scope the fenced sockets may not answer
    /// from a resolver's address. The guard asks its upstreams as the service asks resolve
    /// mode's: one of the host's is squatted the same way.
    pub fn squattable_resolvers(
        &self,
        resolvers: &[IpAddr],
        is_host: impl Fn(IpAddr) -> bool,
    ) -> Option<String> {
        if self.scope.is_some() {
            return None;
        }
        let (asked, what, answers) = match &self.dns.guard {
            Some(g) => (&g.upstream[..], "upstream", "the guard's questions"),
            None => (resolvers, "resolver", "the service's lookups"),
        };
        let local: Vec<IpAddr> = asked
            .iter()
            .copied()
            .filter(|&r| r.is_loopback() || is_host(r))
            .collect();
        if local.is_empty() {
            return None;
        }
        let where_ = match local.iter().all(IpAddr::is_loopback) {
            true => "on loopback",
            false => "on loopback or an address of this host",
        };
        let list: Vec<String> = local.iter().map(ToString::to_string).collect();
        Some(format!(
            "{what} {} is {where_}: a local process that may bind port 53 there (root in \
             a container on the host's network, or any user where \
             net.ipv4.ip_unprivileged_port_start allows it) can share the stub's address and \
             answer {answers}, pointing allowed names at addresses of its choosing; \
             use `dns.mode: guard` with upstream resolvers elsewhere, name the upstream \
             resolvers in `dns.resolvers`, or scope the fence to the agent (its sockets may \
             then not answer from a resolver's address)",
            list.join(", ")
        ))
    }
}

/// Why a wildcard over `w`'s suffix lets strangers in, if it does: the suffix is a top-level
/// domain, one of the shared hosting suffixes where anyone can own a name, or any other
/// public suffix (the Public Suffix List: `co.uk`, `blogspot.com`,
/// `s3.eu-west-1.amazonaws.com`), where each name below is someone else's registration.
/// `learn` asks this before it folds names into a wildcard: a trace's names are chosen by
/// whoever runs in the fence, so the list a fold is checked against must be the whole one.
pub fn wildcard_risk(w: &Wildcard) -> Option<String> {
    let suffix = w.suffix.as_str();
    if !suffix.contains('.') {
        return Some(format!(
            "`{w}` allows every name under the top-level domain `{suffix}`: anyone can \
             register one; list the domains you use"
        ));
    }
    let shared = |shared: &str| {
        format!(
            "`{w}` lies under `{shared}`, where anyone can own a name (shared hosting): \
             it lets strangers' servers in; list the exact names you use"
        )
    };
    // `**.googleapis.com` reaches storage.googleapis.com's tenants too; a name below a
    // tenant (`*.mine.herokuapp.com`) is that tenant's own.
    if let Some(s) = SHARED_SUFFIXES
        .iter()
        .find(|s| suffix == **s || (w.any_depth && s.ends_with(&format!(".{suffix}"))))
    {
        return Some(shared(s));
    }
    let public = psl::suffix(suffix.as_bytes())
        .filter(|s| s.is_known() && s.as_bytes() == suffix.as_bytes())?;
    Some(match public.typ() {
        Some(psl::Type::Private) => shared(suffix),
        _ => format!(
            "`{w}` allows every name under `{suffix}`, a public suffix where anyone can \
             register a domain: list the domains you use"
        ),
    })
}

/// Shared hosting suffixes where anyone can own a name: a wildcard over one of them lets
/// anybody's server in.
const SHARED_SUFFIXES: [&str; 30] = [
    "amazonaws.com",
    "s3.amazonaws.com",
    "cloudfront.net",
    "elasticbeanstalk.com",
    "azurewebsites.net",
    "blob.core.windows.net",
    "cloudapp.net",
    "azureedge.net",
    "appspot.com",
    "googleusercontent.com",
    "storage.googleapis.com",
    "web.app",
    "firebaseapp.com",
    "run.app",
    "herokuapp.com",
    "github.io",
    "githubusercontent.com",
    "gitlab.io",
    "vercel.app",
    "netlify.app",
    "pages.dev",
    "workers.dev",
    "r2.dev",
    "fly.dev",
    "onrender.com",
    "railway.app",
    "ngrok.io",
    "ngrok-free.app",
    "trycloudflare.com",
    "glitch.me",
];

impl Policy {
    /// Every warning: [`Policy::warnings`], then those about single values that parse but
    /// cannot do what they seem to, each located in `source` like an error
    /// (`path:line:column: ...`).
    pub fn warnings_in(&self, source: &str, path: &Path) -> Vec<String> {
        let mut out = self.warnings();
        for ((line, column), message) in self.suspicious_values(source) {
            out.push(format!("{}: {message}", location(path, line, column)));
        }
        out
    }

    /// Values that allow far more than anyone means, or nothing at all, with where each is
    /// written in `source`.
    fn suspicious_values(&self, source: &str) -> Vec<((usize, usize), String)> {
        let mut out = Vec::new();
        let at_network = |key: &str, net: &IpNet| {
            locate_value(source, key, |t| parse_network(t).is_ok_and(|n| n == *net))
        };
        for allow in &self.allow {
            let Target::Cidr(net) = &allow.target else {
                continue;
            };
            if net.prefix_len() == 0 {
                let family = if net.addr().is_ipv4() { "IPv4" } else { "IPv6" };
                out.push((
                    at_network("allow", net),
                    format!(
                        "`{net}` allows every {family} address: only the deny list still \
                         fences those ports; list the networks you need"
                    ),
                ));
            }
            if let Some(v4) = ipv4_mapped(net) {
                out.push((at_network("allow", net), mapped_message(net, &v4)));
            }
        }
        for deny in self.deny.iter().filter(|d| d.origin == DenyOrigin::Cidr) {
            for net in &deny.networks {
                if let Some(v4) = ipv4_mapped(net) {
                    out.push((at_network("deny", net), mapped_message(net, &v4)));
                }
            }
        }
        let servers = [
            (
                "resolvers",
                "resolver",
                self.dns.resolvers.clone().unwrap_or_default(),
            ),
            (
                "upstream",
                "upstream",
                self.dns
                    .guard
                    .iter()
                    .flat_map(|g| g.upstream.clone())
                    .collect(),
            ),
        ];
        for (key, what, addrs) in servers {
            for addr in addrs {
                let Some(kind) = not_a_server(addr) else {
                    continue;
                };
                out.push((
                    locate_value(source, key, |t| {
                        t.parse::<IpAddr>().is_ok_and(|a| a == addr)
                    }),
                    format!(
                        "{what} {addr} is {kind}: no resolver answers from there, so DNS \
                         through it fails; list the resolver's own unicast address"
                    ),
                ));
            }
        }
        for listen in self.dns.guard.iter().flat_map(|g| &g.listen) {
            if listen.port() == 0 {
                out.push((
                    locate_value(source, "listen", |t| {
                        t.parse::<SocketAddr>().is_ok_and(|a| a == *listen)
                    }),
                    format!(
                        "the guard's listen address {listen} has port 0: the kernel picks a \
                         random port that no client asks; write port 53"
                    ),
                ));
            }
        }
        out
    }
}

/// What `check`, `apply` and `run` ask of this host about a scope (answered by the edge,
/// `crate::host`).
pub trait ScopeHost {
    /// Why the listed cgroup `path` is not there to match (`None`: it is).
    fn cgroup_missing(&self, path: &CgroupPath) -> Option<String>;
    /// Whether some interface of this host matches `pattern` now.
    fn interface_present(&self, pattern: &IfacePattern) -> bool;
    /// Whether the account database knows `uid`.
    fn uid_has_account(&self, uid: u32) -> bool;
    /// Who besides root may move processes into or out of the listed cgroup `path`: the
    /// owners and writers of its directory, its `cgroup.procs` and `cgroup.threads` and
    /// those of each of its ancestors that exists, up to the hierarchy's root.
    fn cgroup_delegations(&self, path: &CgroupPath) -> Vec<CgroupDelegation>;
    /// The ports of every bridge whose name matches `pattern`, and the devices stacked on
    /// it (`Err`: why they cannot be read).
    fn bridge_ports(&self, pattern: &IfacePattern) -> Result<Vec<BridgePort>, String>;
    /// The resolvers of this host that answer any local user over a Unix socket (and so
    /// past the network fence), with the servers each asks.
    fn local_resolvers(&self) -> Vec<LocalResolver>;
}

/// A resolver of this host that any local user may ask over a Unix socket, which no network
/// rule sees: it asks `upstream` as itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResolver {
    pub kind: LocalResolverKind,
    /// Its socket, as found.
    pub socket: PathBuf,
    /// The servers it asks (empty: they could not be read, or it asks none).
    pub upstream: Vec<IpAddr>,
    /// It also asks the local links by multicast (LLMNR, mDNS): a single-label or `.local`
    /// name goes, as its question, to every host on them, whatever servers it has.
    pub multicast: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalResolverKind {
    /// systemd-resolved: varlink `io.systemd.Resolve` and D-Bus `org.freedesktop.resolve1`;
    /// its servers are those of `/run/systemd/resolve/resolv.conf`.
    SystemdResolved,
    /// nscd's hosts cache: it resolves a client's lookup itself, with `/etc/resolv.conf`.
    Nscd,
    /// avahi-daemon (nss-mdns asks it): `.local` names, asked by multicast on every link.
    Avahi,
}

impl LocalResolverKind {
    /// Where it listens, and where its servers are written: what the edge looks at.
    pub const ALL: [(LocalResolverKind, &'static str, &'static str); 3] = [
        (
            LocalResolverKind::SystemdResolved,
            "/run/systemd/resolve/io.systemd.Resolve",
            "/run/systemd/resolve/resolv.conf",
        ),
        (
            LocalResolverKind::Nscd,
            "/run/nscd/socket",
            "/etc/resolv.conf",
        ),
        // No servers: it asks the links.
        (LocalResolverKind::Avahi, "/run/avahi-daemon/socket", ""),
    ];

    fn remedy(self) -> &'static str {
        match self {
            LocalResolverKind::SystemdResolved => {
                "make the guard its only server (`DNS=` the guard's address and `Domains=~.` \
                 in resolved.conf) and turn its multicast off (`LLMNR=no` and \
                 `MulticastDNS=no`), or stop it"
            }
            LocalResolverKind::Nscd => {
                "turn its hosts cache off (`enable-cache hosts no` in nscd.conf), point \
                 /etc/resolv.conf at the guard, or stop it"
            }
            LocalResolverKind::Avahi => {
                "stop it (and take `mdns` off the `hosts:` line of /etc/nsswitch.conf), or keep \
                 its socket from the fenced users"
            }
        }
    }

    fn name(self) -> &'static str {
        match self {
            LocalResolverKind::SystemdResolved => "systemd-resolved",
            LocalResolverKind::Nscd => "nscd",
            LocalResolverKind::Avahi => "avahi-daemon",
        }
    }
}

/// A file or directory of the cgroup hierarchy that someone other than root may write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupDelegation {
    /// What they may write (a directory they own, a `cgroup.procs` they may write).
    pub path: PathBuf,
    pub to: Delegate,
}

/// Who a [`CgroupDelegation`] lets move processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delegate {
    /// This uid owns it (systemd's `Delegate=`, a user's `user@UID.service`, a rootless
    /// container manager's cgroup).
    Uid(u32),
    /// Members of this group may write it.
    Group(u32),
    /// Every user may write it.
    Everyone,
}

/// A port of a listed bridge, or a device stacked on it, as this host has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BridgePort {
    pub bridge: String,
    pub port: String,
    /// Its link type (`veth`, `tun`, `vxlan`...); `None` for a device without one (a NIC).
    pub kind: Option<String>,
    /// Not a port but a device on top of the bridge (a VLAN's or macvlan's lower device is
    /// the bridge): what containers send it arrives with this device as input interface.
    pub stacked: bool,
}

impl BridgePort {
    /// A container's end of a veth pair: what a container runtime puts on its bridge.
    /// Anything else (a NIC, a VM's tap, a VLAN or tunnel device) leads out of the host.
    pub fn is_container_veth(&self) -> bool {
        self.kind.as_deref() == Some("veth")
    }
}

/// What `check` found of a scope on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostFinding {
    /// A way past the fence that this host's configuration opens: `check` fails on it,
    /// `apply` and `run` refuse the policy (see [`Policy::refuse_scope_holes`]).
    Error(String),
    /// Probably not what is meant here.
    Warning(String),
    /// Fine, but worth knowing.
    Note(String),
}

/// The scope entry a [`ScopeHole`] is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScopeEntry {
    Cgroup(CgroupPath),
    Forward(IfacePattern),
}

/// A way past the fence that this host's configuration opens for one entry of a scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeHole {
    pub entry: ScopeEntry,
    pub message: String,
}

impl Policy {
    /// The ways past the fence this host's configuration opens for the scope:
    ///
    /// * a listed cgroup in a subtree delegated to someone other than root: a process in it
    ///   may write its own pid into a sibling's `cgroup.procs` and its next socket is not
    ///   the listed cgroup's. Not a hole when the delegate's uid (or group) is fenced by the
    ///   same scope: its sockets are fenced by uid wherever its processes move.
    /// * a listed bridge with a port that is not a container's veth: the bridge switches the
    ///   containers' frames to that port at layer 2, where no inet hook sees them (and
    ///   bridge netfilter, where on, passes VLAN- and PPPoE-tagged frames by).
    ///
    /// Empty without a `scope:`.
    pub fn scope_holes(&self, host: &dyn ScopeHost) -> Vec<ScopeHole> {
        let Some(scope) = &self.scope else {
            return Vec::new();
        };
        let uids = scope.uids();
        let gids = scope.gids();
        let mut out = Vec::new();
        for cgroup in &scope.cgroups {
            let mut delegations = host.cgroup_delegations(cgroup);
            delegations.retain(|d| match d.to {
                Delegate::Uid(uid) => !uids.contains(&uid),
                Delegate::Group(gid) => !gids.contains(&gid),
                Delegate::Everyone => true,
            });
            let mut seen: Vec<Delegate> = Vec::new();
            for d in delegations {
                if seen.contains(&d.to) {
                    continue;
                }
                seen.push(d.to);
                let path = d.path.display();
                let message = match d.to {
                    Delegate::Uid(uid) => format!(
                        "cgroup `{cgroup}` lies in a subtree delegated to uid {uid} ({path} is \
                         theirs): a process in it can write its pid into another cgroup's \
                         cgroup.procs and leave the fence. Refused unless the same policy also \
                         lists user {uid} in `scope.users` (its sockets are then fenced by uid \
                         wherever its processes move); or list a cgroup only root may move \
                         processes out of"
                    ),
                    Delegate::Group(gid) => format!(
                        "cgroup `{cgroup}` lies in a subtree that group {gid} may write \
                         ({path}): its members' processes in it can move themselves out and \
                         leave the fence. Refused unless the same policy also lists group \
                         {gid} in `scope.groups`, or {path} is made writable by root only"
                    ),
                    Delegate::Everyone => format!(
                        "cgroup `{cgroup}` lies in a subtree every user may write ({path}): \
                         any process in it can move itself out and leave the fence. Refused \
                         until {path} is writable by root only"
                    ),
                };
                out.push(ScopeHole {
                    entry: ScopeEntry::Cgroup(cgroup.clone()),
                    message,
                });
            }
        }
        let read: Vec<_> = scope
            .forward
            .iter()
            .map(|pattern| (pattern, host.bridge_ports(pattern)))
            .collect();
        // A device stacked on a listed bridge and a port of another (a macvlan of one in the
        // other): it leads to the listed bridge, not out of the host.
        let stacked: Vec<&str> = read
            .iter()
            .filter_map(|(_, ports)| ports.as_ref().ok())
            .flatten()
            .filter(|p| p.stacked)
            .map(|p| p.port.as_str())
            .collect();
        for (pattern, ports) in &read {
            let pattern = *pattern;
            let ports = match ports {
                Ok(ports) => ports,
                Err(why) => {
                    out.push(ScopeHole {
                        entry: ScopeEntry::Forward(pattern.clone()),
                        message: format!(
                            "cannot read the ports of the bridges matching `{pattern}` ({why}): \
                             a port that leads out of the host would let containers past the \
                             fence, so the scope is refused"
                        ),
                    });
                    continue;
                }
            };
            for upper in ports
                .iter()
                .filter(|p| p.stacked && !scope.forward.iter().any(|f| f.matches(&p.port)))
            {
                let kind = upper.kind.as_deref().unwrap_or("network");
                out.push(ScopeHole {
                    entry: ScopeEntry::Forward(pattern.clone()),
                    message: format!(
                        "listed bridge {} carries {} (a {kind} device on top of it): what \
                         containers send it arrives with {} as its input interface, past every \
                         rule that names the bridge, and is routed on unfenced. List `{}` in \
                         `scope.forward` too, or remove it",
                        upper.bridge, upper.port, upper.port, upper.port
                    ),
                });
            }
            for port in ports.iter().filter(|p| {
                !p.stacked && !p.is_container_veth() && !stacked.contains(&p.port.as_str())
            }) {
                let kind = match port.kind.as_deref() {
                    Some("tun") => "a tap device (a VM's, say)".to_string(),
                    Some(kind) => format!("a {kind} device"),
                    None => "a network card".to_string(),
                };
                out.push(ScopeHole {
                    entry: ScopeEntry::Forward(pattern.clone()),
                    message: format!(
                        "listed bridge {} has port {} ({kind}), which is not a container's \
                         veth: containers on it reach the LAN at layer 2 past the fence (the \
                         frames the bridge switches between its ports never meet the inet \
                         hooks, and bridge netfilter lets VLAN- and PPPoE-tagged ones by). \
                         Remove the port from the bridge, or fence at the router",
                        port.bridge, port.port
                    ),
                });
            }
        }
        out
    }

    /// `Err` with every [`Policy::scope_holes`] of this host, located in `source` like an
    /// error (`path:line:column: ...`): what `apply` and `run` check before they put up a
    /// table.
    pub fn refuse_scope_holes(
        &self,
        source: &str,
        path: &Path,
        host: &dyn ScopeHost,
    ) -> Result<(), PolicyError> {
        let holes = self.scope_holes(host);
        let Some(first) = holes.first() else {
            return Ok(());
        };
        let (line, column) = locate_entry(source, &first.entry);
        let mut message = first.message.clone();
        for hole in &holes[1..] {
            let (line, column) = locate_entry(source, &hole.entry);
            message.push_str(&format!(
                "\n{}: {}",
                location(path, line, column),
                hole.message
            ));
        }
        Err(PolicyError::Invalid {
            path: path.to_path_buf(),
            line,
            column,
            message,
        })
    }

    /// The scope against this host, each finding located in `source` like an error
    /// (`path:line:column: ...`): its holes ([`Policy::scope_holes`], errors), a listed cgroup
    /// that does not exist (a warning: nobody is in it, and what fences it once it appears), a
    /// listed interface pattern no interface matches (a warning), a user listed by uid without
    /// an account (a note). Empty without a `scope:`.
    pub fn scope_findings(
        &self,
        source: &str,
        path: &Path,
        host: &dyn ScopeHost,
    ) -> Vec<HostFinding> {
        let Some(scope) = &self.scope else {
            return Vec::new();
        };
        let at = |key: &str, is_it: &dyn Fn(&str) -> bool| {
            let (line, column) = locate_value(source, key, is_it);
            location(path, line, column)
        };
        let mut out: Vec<HostFinding> = self
            .scope_holes(host)
            .into_iter()
            .map(|hole| {
                let (line, column) = locate_entry(source, &hole.entry);
                HostFinding::Error(format!(
                    "{}: {}",
                    location(path, line, column),
                    hole.message
                ))
            })
            .collect();
        // The table fences a socket by the cgroup it was made in, so a process in a listed
        // cgroup that takes over a process of its own uid outside it (ptrace and pidfd_getfd
        // need no capability against the same uid) sends through sockets no rule fences; a
        // listed uid or group fences them by their owner wherever they were made.
        if let Some(first) = scope.cgroups.first()
            && scope.users.is_empty()
            && scope.groups.is_empty()
        {
            out.push(HostFinding::Warning(format!(
                "{}: the scope lists cgroups and no user: a process in a listed cgroup can take \
                 over any process of its own uid outside it (ptrace, /proc/PID/mem, \
                 pidfd_getfd: no capability needed against the same uid) and send through \
                 that process's sockets, which no rule fences. List the user the cgroup's \
                 processes run as in `scope.users` too (its sockets are then fenced wherever \
                 they were made), or run them as a user with no process outside the cgroup",
                at("cgroups", &|t| t
                    .parse::<CgroupPath>()
                    .is_ok_and(|c| c == *first))
            )));
        }
        // In guard mode a fenced process's DNS goes to the guard alone, but a local resolver
        // that any user asks over a Unix socket (no packet a rule could see) recurses the
        // question as itself, unfenced, unless the guard is all it asks.
        if let Some(guard) = &self.dns.guard
            && !(scope.users.is_empty() && scope.groups.is_empty() && scope.cgroups.is_empty())
        {
            for resolver in host.local_resolvers() {
                let guarded = !resolver.multicast
                    && !resolver.upstream.is_empty()
                    && resolver
                        .upstream
                        .iter()
                        .all(|u| guard.listen.iter().any(|l| l.ip() == *u));
                if guarded {
                    continue;
                }
                let mut asks = Vec::new();
                match resolver.upstream.as_slice() {
                    [] if resolver.kind == LocalResolverKind::Avahi => {}
                    [] => asks.push("servers that could not be read".to_string()),
                    servers => asks.push(
                        servers
                            .iter()
                            .map(IpAddr::to_string)
                            .collect::<Vec<_>>()
                            .join(", "),
                    ),
                }
                if resolver.multicast {
                    asks.push("the local links by multicast (LLMNR, mDNS)".to_string());
                }
                let asks = asks.join(" and ");
                out.push(HostFinding::Warning(format!(
                    "{}: {} answers every local user on {} and asks {asks} itself, as a \
                     process no scope rule fences: a fenced user's questions there carry data \
                     out in their names, around the guard. {}.",
                    at("mode", &|t| t == "guard"),
                    resolver.kind.name(),
                    resolver.socket.display(),
                    capitalised(resolver.kind.remedy()),
                )));
            }
        }
        for cgroup in &scope.cgroups {
            if let Some(why) = host.cgroup_missing(cgroup) {
                out.push(HostFinding::Warning(format!(
                    "{}: cgroup `{cgroup}` is not on this host ({why}): nobody is in it, and \
                     no rule matches it yet. `egress-fence run` fences it from the moment it \
                     appears (within seconds) and again whenever it is made anew; a table put \
                     up by `apply` fences it only once applied again after it exists",
                    at("cgroups", &|t| t
                        .parse::<CgroupPath>()
                        .is_ok_and(|c| c == *cgroup))
                )));
            }
        }
        for pattern in &scope.forward {
            if !host.interface_present(pattern) {
                let guard = match self.dns.guard {
                    Some(_) => {
                        "; the DNS guard listens on its addresses only once started after they \
                         exist"
                    }
                    None => "",
                };
                out.push(HostFinding::Warning(format!(
                    "{}: no interface of this host matches `{pattern}`: its forwarded traffic \
                     is fenced from the moment one exists (nft matches the name){guard}",
                    at("forward", &|t| t
                        .parse::<IfacePattern>()
                        .is_ok_and(|i| i == *pattern))
                )));
            }
        }
        for user in scope.users.iter().filter(|u| u.name.is_none()) {
            if !host.uid_has_account(user.uid) {
                out.push(HostFinding::Note(format!(
                    "{}: uid {} has no account on this host (a user of a container's user \
                     namespace, say): its sockets are fenced all the same",
                    at("users", &|t| t.parse::<u32>() == Ok(user.uid)),
                    user.uid
                )));
            }
        }
        out
    }
}

fn capitalised(s: &str) -> String {
    let mut chars = s.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// Where a scope entry is written in `source`.
fn locate_entry(source: &str, entry: &ScopeEntry) -> (usize, usize) {
    match entry {
        ScopeEntry::Cgroup(cgroup) => locate_value(source, "cgroups", |t| {
            t.parse::<CgroupPath>().is_ok_and(|c| c == *cgroup)
        }),
        ScopeEntry::Forward(pattern) => locate_value(source, "forward", |t| {
            t.parse::<IfacePattern>().is_ok_and(|i| i == *pattern)
        }),
    }
}

/// The IPv4 network an IPv4-mapped IPv6 network (`::ffff:0:0/96` and below) stands for.
fn ipv4_mapped(net: &IpNet) -> Option<ipnet::Ipv4Net> {
    let IpNet::V6(v6) = net else {
        return None;
    };
    let v4 = v6.addr().to_ipv4_mapped()?;
    let prefix = v6.prefix_len().checked_sub(96)?;
    ipnet::Ipv4Net::new(v4, prefix).ok()
}

fn mapped_message(net: &IpNet, v4: &ipnet::Ipv4Net) -> String {
    format!(
        "`{net}` is an IPv4-mapped IPv6 network: no packet on the wire carries such an \
         address (IPv4 goes out as IPv4), so it matches nothing; write `{v4}`"
    )
}

/// What a resolver address is when it cannot be one: unspecified, broadcast or multicast.
fn not_a_server(addr: IpAddr) -> Option<&'static str> {
    if addr.is_unspecified() {
        Some("the unspecified address")
    } else if addr.is_multicast() {
        Some("a multicast address")
    } else if matches!(addr, IpAddr::V4(v4) if v4.is_broadcast()) {
        Some("the broadcast address")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::test_support::*;

    #[test]
    fn an_upstream_at_an_address_of_this_host_is_named() {
        let p = parse(
            "version: 1\ndns:\n  mode: guard\n  upstream: [198.18.0.53, 192.0.2.53, 127.0.0.1]\n",
        )
        .expect("valid");
        let host = HostAddrs::from_interfaces([
            ("198.18.0.53".parse().unwrap(), None, None),
            ("127.0.0.1".parse().unwrap(), None, None),
        ]);
        let w = p.upstreams_on_this_host(&host);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].starts_with("upstream 198.18.0.53 is an address of this host"),
            "{w:?}"
        );
        assert!(p.upstreams_on_this_host(&HostAddrs::none()).is_empty());
    }

    #[test]
    fn a_loopback_resolver_in_resolve_mode_without_a_scope_is_squattable() {
        let stub: Vec<IpAddr> = vec!["127.0.0.53".parse().unwrap(), "192.0.2.53".parse().unwrap()];
        let plain = parse("version: 1\n").expect("valid");
        let w = plain
            .squattable_resolvers(&stub, |_| false)
            .expect("warned");
        assert!(w.starts_with("resolver 127.0.0.53 is on loopback"), "{w}");
        assert_eq!(
            plain.squattable_resolvers(&["192.0.2.53".parse().unwrap()], |_| false),
            None
        );
        // The policy's own resolvers are warned about by `warnings`.
        let given = parse("version: 1\ndns:\n  resolvers: [127.0.0.53]\n").expect("valid");
        assert!(
            given
                .warnings()
                .iter()
                .any(|w| w.contains("can share the stub's address")),
            "{:?}",
            given.warnings()
        );
        // A scope refuses its sockets' answers from the resolver's address; the guard asks
        // its upstreams itself.
        let scoped = parse("version: 1\nscope:\n  users: [1001]\n").expect("valid");
        assert_eq!(scoped.squattable_resolvers(&stub, |_| true), None);
        let guard =
            parse("version: 1\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n").expect("valid");
        assert_eq!(guard.squattable_resolvers(&stub, |_| false), None);
        // A resolver, or the guard's upstream, on an address of this host is squatted the
        // same way.
        let host = |a: IpAddr| a == "192.0.2.53".parse::<IpAddr>().unwrap();
        let w = plain
            .squattable_resolvers(&["192.0.2.53".parse().unwrap()], host)
            .expect("warned");
        assert!(
            w.starts_with("resolver 192.0.2.53 is on loopback or an address of this host"),
            "{w}"
        );
        let w = guard.squattable_resolvers(&[], host).expect("warned");
        assert!(
            w.starts_with("upstream 192.0.2.53 is on loopback or an address"),
            "{w}"
        );
        assert!(w.contains("the guard's questions"), "{w}");
    }

    #[test]
    fn resolver_inside_a_denied_network_is_warned_about() {
        let p = parse(
            "version: 1\ndeny:\n  - preset: cloud-metadata\ndns:\n  resolvers: [169.254.169.253]\n",
        )
        .expect("valid: DNS to a resolver is allowed before the deny list");
        let w = p.warnings();
        assert!(
            w.iter()
                .any(|w| w.contains("169.254.169.253") && w.contains("cloud-metadata")),
            "{w:?}"
        );
    }

    #[test]
    fn allowing_every_address_is_warned_with_its_line() {
        let w = located_warnings(
            "version: 1\nallow:\n  - cidr: 192.0.2.0/24\n  - cidr: 0.0.0.0/0\n    ports: [443]\n  \
             - cidr: \"::/0\"\n",
        );
        assert!(
            w.iter()
                .any(|w| w.starts_with("p.yaml:4:11: `0.0.0.0/0` allows every IPv4 address")),
            "{w:?}"
        );
        assert!(
            w.iter()
                .any(|w| w.starts_with("p.yaml:6:12: `::/0` allows every IPv6 address")),
            "{w:?}"
        );
        assert!(located_warnings(FULL).is_empty());
    }

    #[test]
    fn resolvers_and_upstreams_that_cannot_answer_are_warned() {
        let w = located_warnings(
            "version: 1\ndns:\n  resolvers: [192.0.2.53, 0.0.0.0, 255.255.255.255,\n    \
             \"ff02::fb\", \"::\"]\n",
        );
        let found = |addr: &str, kind: &str, at: &str| {
            w.iter()
                .any(|w| w.starts_with(&format!("p.yaml:{at}: resolver {addr} is {kind}")))
        };
        assert!(found("0.0.0.0", "the unspecified address", "3:27"), "{w:?}");
        assert!(
            found("255.255.255.255", "the broadcast address", "3:36"),
            "{w:?}"
        );
        assert!(found("ff02::fb", "a multicast address", "4:6"), "{w:?}");
        assert!(found("::", "the unspecified address", "4:18"), "{w:?}");
        assert_eq!(w.len(), 4, "192.0.2.53 is fine: {w:?}");

        let w = located_warnings(
            "version: 1\ndns:\n  mode: guard\n  upstream: [224.0.0.251]\n  \
             listen: [\"127.0.0.53:0\", \"[::1]:53\"]\n",
        );
        assert!(
            w.iter()
                .any(|w| w.starts_with("p.yaml:4:14: upstream 224.0.0.251 is a multicast")),
            "{w:?}"
        );
        assert!(
            w.iter().any(|w| w
                .starts_with("p.yaml:5:13: the guard's listen address 127.0.0.53:0 has port 0")),
            "{w:?}"
        );
        assert!(!w.iter().any(|w| w.contains("[::1]:53")), "{w:?}");
    }

    #[test]
    fn ipv4_mapped_networks_are_warned_with_the_ipv4_network() {
        let w = located_warnings(
            "version: 1\ndeny:\n  - cidr: \"::ffff:10.0.0.0/104\"\nallow:\n  - cidr: \
             \"::ffff:192.0.2.7\"\n    ports: [443]\n  - cidr: \"2001:db8::/32\"\n",
        );
        assert!(
            w.iter()
                .any(|w| w.starts_with("p.yaml:3:12: `::ffff:10.0.0.0/104`")
                    && w.ends_with("write `10.0.0.0/8`")),
            "{w:?}"
        );
        assert!(
            w.iter()
                .any(|w| w.starts_with("p.yaml:5:12: `::ffff:192.0.2.7/128`")
                    && w.ends_with("write `192.0.2.7/32`")),
            "{w:?}"
        );
        assert_eq!(w.len(), 2, "{w:?}");
        assert_eq!(
            ipv4_mapped(&"::ffff:0:0/96".parse().unwrap()),
            Some("0.0.0.0/0".parse().unwrap())
        );
        assert_eq!(ipv4_mapped(&"::/0".parse().unwrap()), None);
        assert_eq!(ipv4_mapped(&"::/95".parse().unwrap()), None);
    }

    #[test]
    fn shadowed_allow_and_missing_established_are_warned() {
        let p = parse(
            "version: 1\nallow:\n  - cidr: 10.1.0.0/16\ndeny:\n  - cidr: 10.0.0.0/8\nessentials: [loopback]\n",
        )
        .expect("valid");
        let w = p.warnings();
        assert!(w.iter().any(|w| w.contains("10.1.0.0/16")), "{w:?}");
        assert!(w.iter().any(|w| w.contains("established")), "{w:?}");
        assert!(parse(FULL).unwrap().warnings().is_empty());
    }

    #[test]
    fn an_allowed_network_holding_the_guards_upstream_is_warned() {
        let text = "version: 1\nallow:\n  - cidr: 192.0.2.0/24\n    ports: [443]\ndns:\n  \
                    mode: guard\n  upstream: [192.0.2.53]\n";
        let w = parse(text).expect("valid").warnings();
        assert!(
            w.iter().any(|w| w
                == "allowed network 192.0.2.0/24 holds the guard's upstream 192.0.2.53, which \
                    only the guard reaches, on any port: nothing else to 192.0.2.53 is allowed \
                    (an entry of 192.0.2.53 alone would allow its ports, were there no other \
                    to open it)"),
            "{w:?}"
        );
        let alone = text.replace("192.0.2.0/24", "192.0.2.53/32");
        let w = parse(&alone).expect("valid").warnings();
        assert!(
            w.iter().any(|w| w.starts_with(
                "allowed address 192.0.2.53 is the guard's upstream: every process reaches it"
            )),
            "{w:?}"
        );
        // Beside a wildcard (whose zone may answer the upstream's address) or a network
        // that holds it, the entry alone opens nothing: the upstream stays denied.
        for other in [
            "  - domain: \"*.pool.example\"\n    ports: [443]\n",
            "  - cidr: 192.0.2.0/24\n    ports: [443]\n",
        ] {
            let both = alone.replace("allow:\n", &format!("allow:\n{other}"));
            let w = parse(&both).expect("valid").warnings();
            assert!(
                w.iter().any(|w| w.starts_with(
                    "allowed address 192.0.2.53 is the guard's upstream, which other entries \
                     would open too"
                )),
                "{w:?}"
            );
        }
        let elsewhere = text.replace("192.0.2.0/24", "198.51.100.0/24");
        assert!(parse(&elsewhere).expect("valid").warnings().is_empty());
    }

    #[test]
    fn wildcards_over_shared_suffixes_warn() {
        let with = |pattern: &str| {
            parse(&GUARD.replace("*.pool.example", pattern))
                .expect("valid")
                .warnings()
        };
        let w = with("*.herokuapp.com");
        assert!(
            w.iter().any(|w| w.contains("under `herokuapp.com`")),
            "{w:?}"
        );
        let w = with("**.googleapis.com");
        assert!(
            w.iter().any(|w| w.contains("storage.googleapis.com")),
            "{w:?}"
        );
        let w = with("*.com");
        assert!(
            w.iter().any(|w| w.contains("top-level domain `com`")),
            "{w:?}"
        );
        assert!(with("*.mine.herokuapp.com").is_empty());
        // The rest of the Public Suffix List: a registry's second level, a private section's
        // suffix the short list above does not name.
        let w = with("*.co.uk");
        assert!(w.iter().any(|w| w.contains("a public suffix")), "{w:?}");
        let w = with("*.s3.eu-west-1.amazonaws.com");
        assert!(w.iter().any(|w| w.contains("shared hosting")), "{w:?}");
        assert!(with("*.mine.blogspot.com").is_empty());
        let refresh =
            parse(&GUARD.replace("  mode: guard\n", "  mode: guard\n  refresh: { min: 5s }\n"))
                .expect("valid")
                .warnings();
        assert!(
            refresh
                .iter()
                .any(|w| w.contains("no effect in guard mode")),
            "{refresh:?}"
        );
        assert!(with("*.pool.example").is_empty());
    }

    /// A host with `agent.slice`, interfaces `docker0` and `eth0`, and an account for uid
    /// 1001 only.
    struct Host;

    impl ScopeHost for Host {
        fn cgroup_missing(&self, path: &CgroupPath) -> Option<String> {
            (path.as_str() != "agent.slice").then(|| "it does not exist".to_string())
        }
        fn interface_present(&self, pattern: &IfacePattern) -> bool {
            ["docker0", "eth0"].iter().any(|i| pattern.matches(i))
        }
        fn uid_has_account(&self, uid: u32) -> bool {
            uid == 1001
        }
        fn cgroup_delegations(&self, _: &CgroupPath) -> Vec<CgroupDelegation> {
            Vec::new()
        }
        fn bridge_ports(&self, _: &IfacePattern) -> Result<Vec<BridgePort>, String> {
            Ok(Vec::new())
        }
        fn local_resolvers(&self) -> Vec<LocalResolver> {
            Vec::new()
        }
    }

    /// A host where `user.slice/...` is delegated to uid 1001, `shared.slice` is writable by
    /// everyone, and bridge `docker0` has a container's veth and the host's NIC `eth1`,
    /// `br-lab` a VM's tap.
    struct Delegating;

    impl ScopeHost for Delegating {
        fn cgroup_missing(&self, _: &CgroupPath) -> Option<String> {
            None
        }
        fn interface_present(&self, _: &IfacePattern) -> bool {
            true
        }
        fn uid_has_account(&self, _: u32) -> bool {
            true
        }
        fn cgroup_delegations(&self, path: &CgroupPath) -> Vec<CgroupDelegation> {
            let at = |p: &str, to| CgroupDelegation {
                path: PathBuf::from(p),
                to,
            };
            match path.as_str() {
                "user.slice/user@1001.service/agent.scope" => vec![
                    at(
                        "/cg/user.slice/user@1001.service/agent.scope",
                        Delegate::Uid(1001),
                    ),
                    at("/cg/user.slice/user@1001.service", Delegate::Uid(1001)),
                    at(
                        "/cg/user.slice/user@1001.service/cgroup.procs",
                        Delegate::Uid(1001),
                    ),
                ],
                "shared.slice" => vec![at("/cg/shared.slice/cgroup.procs", Delegate::Everyone)],
                _ => Vec::new(),
            }
        }
        fn bridge_ports(&self, pattern: &IfacePattern) -> Result<Vec<BridgePort>, String> {
            let port = |bridge: &str, port: &str, kind: Option<&str>| BridgePort {
                bridge: bridge.into(),
                port: port.into(),
                kind: kind.map(str::to_string),
                stacked: false,
            };
            let stacked = |bridge: &str, device: &str, kind: &str| BridgePort {
                stacked: true,
                ..port(bridge, device, Some(kind))
            };
            let all = [
                port("docker0", "veth1a2b", Some("veth")),
                port("docker0", "eth1", None),
                port("br-lab", "vnet0", Some("tun")),
                port("br-ok", "veth9", Some("veth")),
                stacked("br-ok", "br-ok.10", "vlan"),
                stacked("br-lab", "br-lab-mv", "macvlan"),
            ];
            Ok(all
                .into_iter()
                .filter(|p| pattern.matches(&p.bridge))
                .collect())
        }
        fn local_resolvers(&self) -> Vec<LocalResolver> {
            Vec::new()
        }
    }

    const DELEGATED: &str = "version: 1\nscope:\n  cgroups: [user.slice/user@1001.service/agent.scope, \
                             shared.slice, system.slice]\n  forward: [docker0, \"br-*\"]\n";

    #[test]
    fn a_delegated_cgroup_and_a_bridge_with_a_lan_port_are_errors() {
        let p = parse(DELEGATED).expect("valid");
        let found = p.scope_findings(DELEGATED, Path::new("p.yaml"), &Delegating);
        let errors: Vec<&String> = found
            .iter()
            .filter_map(|f| match f {
                HostFinding::Error(e) => Some(e),
                _ => None,
            })
            .collect();
        assert_eq!(errors.len(), 4, "{found:?}");
        let [delegated, everyone, nic, tap] = errors.as_slice() else {
            unreachable!()
        };
        assert!(
            delegated.starts_with(
                "p.yaml:3:13: cgroup `user.slice/user@1001.service/agent.scope` lies in a \
                 subtree delegated to uid 1001"
            ),
            "{delegated}"
        );
        assert!(
            delegated.contains("unless the same policy also lists user 1001 in `scope.users`"),
            "{delegated}"
        );
        assert!(
            everyone.starts_with("p.yaml:3:55: cgroup `shared.slice`")
                && everyone.contains("every user may write"),
            "{everyone}"
        );
        assert!(
            nic.starts_with("p.yaml:4:13: listed bridge docker0 has port eth1 (a network card)"),
            "{nic}"
        );
        assert!(
            nic.contains("reach the LAN at layer 2 past the fence")
                && nic.contains("Remove the port from the bridge, or fence at the router"),
            "{nic}"
        );
        assert!(
            tap.starts_with("p.yaml:4:23: listed bridge br-lab has port vnet0 (a tap device"),
            "{tap}"
        );

        let refused = p
            .refuse_scope_holes(DELEGATED, Path::new("p.yaml"), &Delegating)
            .expect_err("refused");
        let text = refused.to_string();
        assert!(text.starts_with("p.yaml:3:13: cgroup"), "{text}");
        assert_eq!(text.lines().count(), 4, "{text}");
    }

    /// A device stacked on a listed bridge (a VLAN, a macvlan) gets what containers send it
    /// as its own input: refused unless listed too (under `br-*`, the DELEGATED policy's, both
    /// are).
    #[test]
    fn a_device_stacked_on_a_listed_bridge_is_an_error_unless_listed_too() {
        let text = "version: 1\nscope:\n  forward: [br-ok]\n";
        let p = parse(text).expect("valid");
        let holes = p.scope_holes(&Delegating);
        let [hole] = holes.as_slice() else {
            panic!("{holes:?}")
        };
        assert!(
            hole.message.starts_with(
                "listed bridge br-ok carries br-ok.10 (a vlan device on top of it): what \
                 containers send it arrives with br-ok.10 as its input interface"
            ),
            "{}",
            hole.message
        );
        assert!(
            hole.message
                .ends_with("List `br-ok.10` in `scope.forward` too, or remove it"),
            "{}",
            hole.message
        );
        let listed = parse("version: 1\nscope:\n  forward: [br-ok, \"br-ok.*\"]\n").unwrap();
        assert_eq!(listed.scope_holes(&Delegating), Vec::new());
    }

    /// A macvlan of listed `br-ok` that is a port of `br-up`: `br-up` is stacked on `br-ok`
    /// (must be listed), and, listed, the macvlan is no LAN port of it (it leads to `br-ok`).
    #[test]
    fn a_device_stacked_on_a_listed_bridge_is_no_lan_port_of_another_listed_one() {
        struct TwoBridges;
        impl ScopeHost for TwoBridges {
            fn cgroup_missing(&self, _: &CgroupPath) -> Option<String> {
                None
            }
            fn interface_present(&self, _: &IfacePattern) -> bool {
                true
            }
            fn uid_has_account(&self, _: u32) -> bool {
                true
            }
            fn cgroup_delegations(&self, _: &CgroupPath) -> Vec<CgroupDelegation> {
                Vec::new()
            }
            fn bridge_ports(&self, pattern: &IfacePattern) -> Result<Vec<BridgePort>, String> {
                let port = |bridge: &str, port: &str, kind: &str, stacked| BridgePort {
                    bridge: bridge.into(),
                    port: port.into(),
                    kind: Some(kind.into()),
                    stacked,
                };
                Ok(match pattern.as_str() {
                    "br-ok" => vec![
                        port("br-ok", "veth9", "veth", false),
                        port("br-ok", "mv0", "macvlan", true),
                        port("br-ok", "br-up", "bridge", true),
                    ],
                    "br-up" => vec![port("br-up", "mv0", "macvlan", false)],
                    _ => Vec::new(),
                })
            }
            fn local_resolvers(&self) -> Vec<LocalResolver> {
                Vec::new()
            }
        }
        let only_mv = parse("version: 1\nscope:\n  forward: [br-ok, mv0]\n").unwrap();
        let holes = only_mv.scope_holes(&TwoBridges);
        let [hole] = holes.as_slice() else {
            panic!("{holes:?}")
        };
        assert!(
            hole.message
                .starts_with("listed bridge br-ok carries br-up (a bridge device on top of it)"),
            "{}",
            hole.message
        );
        let all = parse("version: 1\nscope:\n  forward: [br-ok, mv0, br-up]\n").unwrap();
        assert_eq!(all.scope_holes(&TwoBridges), Vec::new());
    }

    #[test]
    fn a_cgroup_delegated_to_a_listed_user_is_fenced_by_uid() {
        let text = "version: 1\nscope:\n  users: [1001]\n  cgroups: \
                    [user.slice/user@1001.service/agent.scope]\n  forward: [br-ok, br-ok.10]\n";
        let p = parse(text).expect("valid");
        assert_eq!(p.scope_holes(&Delegating), Vec::new());
        assert!(
            p.refuse_scope_holes(text, Path::new("p.yaml"), &Delegating)
                .is_ok()
        );
        let unscoped = parse(FULL).expect("valid");
        assert!(unscoped.scope_holes(&Delegating).is_empty());
    }

    /// A host whose local resolvers are these (and nothing else to say).
    struct Resolving(Vec<LocalResolver>);

    impl Resolving {
        /// systemd-resolved and nscd, each asking the given servers and no link.
        fn asking(resolved: Vec<IpAddr>, nscd: Vec<IpAddr>) -> Resolving {
            Resolving(
                LocalResolverKind::ALL
                    .into_iter()
                    .zip([resolved, nscd])
                    .map(|((kind, socket, _), upstream)| LocalResolver {
                        kind,
                        socket: socket.into(),
                        upstream,
                        multicast: false,
                    })
                    .collect(),
            )
        }
    }

    impl ScopeHost for Resolving {
        fn cgroup_missing(&self, _: &CgroupPath) -> Option<String> {
            None
        }
        fn interface_present(&self, _: &IfacePattern) -> bool {
            true
        }
        fn uid_has_account(&self, _: u32) -> bool {
            true
        }
        fn cgroup_delegations(&self, _: &CgroupPath) -> Vec<CgroupDelegation> {
            Vec::new()
        }
        fn bridge_ports(&self, _: &IfacePattern) -> Result<Vec<BridgePort>, String> {
            Ok(Vec::new())
        }
        fn local_resolvers(&self) -> Vec<LocalResolver> {
            self.0.clone()
        }
    }

    #[test]
    fn a_local_resolver_any_user_asks_over_a_socket_is_warned_about_unless_it_asks_the_guard() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let text = "version: 1\nscope:\n  users: [1001]\ndns:\n  mode: guard\n  listen: \
                    [\"127.0.0.53:53\"]\n  upstream: [192.0.2.53]\n";
        let p = parse(text).expect("valid");
        let host = Resolving::asking(vec![ip("192.0.2.53")], vec![]);
        let found = p.scope_findings(text, Path::new("p.yaml"), &host);
        let [HostFinding::Warning(resolved), HostFinding::Warning(nscd)] = found.as_slice() else {
            panic!("{found:?}")
        };
        assert!(
            resolved.starts_with(
                "p.yaml:5:9: systemd-resolved answers every local user on \
                 /run/systemd/resolve/io.systemd.Resolve and asks 192.0.2.53 itself"
            ),
            "{resolved}"
        );
        assert!(resolved.contains("`Domains=~.`"), "{resolved}");
        assert!(
            nscd.contains(
                "nscd answers every local user on /run/nscd/socket and asks servers \
                           that could not be read"
            ),
            "{nscd}"
        );
        // Both asking the guard alone: nothing to say.
        let guarded = Resolving::asking(vec![ip("127.0.0.53")], vec![ip("127.0.0.53")]);
        assert!(
            p.scope_findings(text, Path::new("p.yaml"), &guarded)
                .is_empty()
        );
        // Resolve mode lets fenced users ask the policy's resolvers anyway; a scope of
        // bridges alone fences no process of the host.
        for text in [
            "version: 1\nscope:\n  users: [1001]\ndns:\n  resolvers: [192.0.2.53]\n",
            "version: 1\nscope:\n  forward: [docker0]\ndns:\n  mode: guard\n  upstream: \
             [192.0.2.53]\n",
        ] {
            let p = parse(text).expect("valid");
            assert!(
                p.scope_findings(text, Path::new("p.yaml"), &host)
                    .is_empty(),
                "{text}"
            );
        }
    }

    /// A resolver that also asks the local links by multicast carries a fenced user's
    /// single-label (LLMNR) or `.local` (mDNS) question to every host on them, even when the
    /// guard is the only server it has: systemd-resolved with LLMNR on (its default), and
    /// avahi-daemon, which asks nothing else.
    #[test]
    fn a_local_resolver_that_asks_the_links_by_multicast_is_warned_about_even_behind_the_guard() {
        let multicast = Resolving(vec![
            LocalResolver {
                kind: LocalResolverKind::SystemdResolved,
                socket: "/run/systemd/resolve/io.systemd.Resolve".into(),
                upstream: vec!["127.0.0.53".parse().unwrap()],
                multicast: true,
            },
            LocalResolver {
                kind: LocalResolverKind::Avahi,
                socket: "/run/avahi-daemon/socket".into(),
                upstream: Vec::new(),
                multicast: true,
            },
        ]);
        let text = "version: 1\nscope:\n  users: [1001]\ndns:\n  mode: guard\n  listen: \
                    [\"127.0.0.53:53\"]\n  upstream: [192.0.2.53]\n";
        let p = parse(text).expect("valid");
        let found = p.scope_findings(text, Path::new("p.yaml"), &multicast);
        let [HostFinding::Warning(resolved), HostFinding::Warning(avahi)] = found.as_slice() else {
            panic!("{found:?}")
        };
        assert!(
            resolved.contains(
                "systemd-resolved answers every local user on \
                 /run/systemd/resolve/io.systemd.Resolve and asks 127.0.0.53 and the local \
                 links by multicast (LLMNR, mDNS) itself"
            ),
            "{resolved}"
        );
        assert!(
            resolved.contains("`LLMNR=no` and `MulticastDNS=no`"),
            "{resolved}"
        );
        assert!(
            avahi.contains(
                "avahi-daemon answers every local user on /run/avahi-daemon/socket and asks \
                 the local links by multicast (LLMNR, mDNS) itself"
            ),
            "{avahi}"
        );
    }

    #[test]
    fn a_cgroup_only_scope_warns_that_its_uid_outside_the_cgroup_is_not_fenced() {
        let text = "version: 1\nscope:\n  cgroups: [agent.slice]\n";
        let p = parse(text).expect("valid");
        let found = p.scope_findings(text, Path::new("p.yaml"), &Host);
        let [HostFinding::Warning(w)] = found.as_slice() else {
            panic!("{found:?}")
        };
        assert!(
            w.starts_with("p.yaml:3:13: the scope lists cgroups and no user"),
            "{w}"
        );
        assert!(
            w.contains("pidfd_getfd") && w.contains("`scope.users`"),
            "{w}"
        );
        for fenced_by_owner in ["users: [1001]", "groups: [1001]"] {
            let text =
                format!("version: 1\nscope:\n  {fenced_by_owner}\n  cgroups: [agent.slice]\n");
            let p = parse(&text).expect("valid");
            let found = p.scope_findings(&text, Path::new("p.yaml"), &Host);
            assert!(
                !found
                    .iter()
                    .any(|f| format!("{f:?}").contains("pidfd_getfd")),
                "{found:?}"
            );
        }
    }

    #[test]
    fn a_scope_is_checked_against_the_host_with_where_each_value_is() {
        let text = "version: 1\nscope:\n  users: [1001, 4242]\n  cgroups: [agent.slice, \
                    /sys/fs/cgroup/gone.slice]\n  forward: [docker0, \"br-*\"]\ndns:\n  mode: \
                    guard\n  upstream: [192.0.2.53]\n";
        let p = parse(text).expect("valid");
        let found = p.scope_findings(text, Path::new("p.yaml"), &Host);
        let [
            HostFinding::Warning(cgroup),
            HostFinding::Warning(iface),
            HostFinding::Note(uid),
        ] = found.as_slice()
        else {
            panic!("{found:?}")
        };
        assert!(
            cgroup.starts_with(
                "p.yaml:4:26: cgroup `gone.slice` is not on this host (it does \
                                not exist): nobody is in it"
            ),
            "{cgroup}"
        );
        assert!(cgroup.contains("from the moment it appears"), "{cgroup}");
        assert!(
            iface.starts_with("p.yaml:5:23: no interface of this host matches `br-*`"),
            "{iface}"
        );
        assert!(iface.contains("DNS guard"), "{iface}");
        assert!(
            uid.starts_with("p.yaml:3:17: uid 4242 has no account on this host"),
            "{uid}"
        );
        assert!(
            parse(FULL)
                .unwrap()
                .scope_findings(FULL, Path::new("p.yaml"), &Host)
                .is_empty()
        );
    }
}
