//! What a valid policy allows but probably does not mean: printed, never fatal.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use ipnet::IpNet;

use super::errors::{locate_value, location};
use super::schema::*;
use super::scope::{CgroupPath, IfacePattern};
use super::values::parse_network;

impl Policy {
    /// Things that are allowed but probably not meant; printed, never fatal.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
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
        for allow in &self.allow {
            let Target::Wildcard(w) = &allow.target else {
                continue;
            };
            let suffix = w.suffix.as_str();
            if !suffix.contains('.') {
                out.push(format!(
                    "`{w}` allows every name under the top-level domain `{suffix}`: anyone can \
                     register one; list the domains you use"
                ));
            } else if let Some(shared) = SHARED_SUFFIXES.iter().find(|s| {
                // `**.googleapis.com` reaches storage.googleapis.com's tenants too; a name
                // below a tenant (`*.mine.herokuapp.com`) is that tenant's own.
                suffix == **s || (w.any_depth && s.ends_with(&format!(".{suffix}")))
            }) {
                out.push(format!(
                    "`{w}` lies under `{shared}`, where anyone can own a name (shared hosting): \
                     it lets strangers' servers in; list the exact names you use"
                ));
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

/// What `check` asks of this host about a scope (answered by the edge, `crate::host`).
pub trait ScopeHost {
    /// Why the listed cgroup `path` is not there to match (`None`: it is).
    fn cgroup_missing(&self, path: &CgroupPath) -> Option<String>;
    /// Whether some interface of this host matches `pattern` now.
    fn interface_present(&self, pattern: &IfacePattern) -> bool;
    /// Whether the account database knows `uid`.
    fn uid_has_account(&self, uid: u32) -> bool;
}

/// What `check` found of a scope on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostFinding {
    /// Probably not what is meant here.
    Warning(String),
    /// Fine, but worth knowing.
    Note(String),
}

impl Policy {
    /// The scope against this host, each finding located in `source` like an error
    /// (`path:line:column: ...`): a listed cgroup that does not exist (a warning: nobody is
    /// in it, and what fences it once it appears), a listed interface pattern no interface
    /// matches (a warning), a user listed by uid without an account (a note). Empty without a
    /// `scope:`.
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
        let mut out = Vec::new();
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
