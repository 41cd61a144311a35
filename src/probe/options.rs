//! What the probe takes besides the policy ([`ProbeOptions`]): the resolvers, the timeout, its
//! uid, and what the installed table ([`TableFacts`]) and /proc say about the guard.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use ipnet::IpNet;

use crate::core::policy::Policy;
use crate::core::ruleset::{Elements, Family, SetId, SetRole, Timed, Tuple};
use crate::dns::resolve::system_resolvers;
use crate::nft::{LiveTable, Nft};

use super::report::ProbeError;
use super::scope::Prober;

/// What [`run`](super::run) needs besides the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeOptions {
    /// Resolve mode: the allowed resolvers; names are resolved through them, and DNS to them
    /// must work. Guard mode: the guard's upstream resolvers, which only the guard may reach.
    pub resolvers: Vec<IpAddr>,
    /// How long one connection attempt may take. A UDP attempt waits for a reply at most
    /// this long, and never more than [`MAX_UDP_WAIT`](super::MAX_UDP_WAIT): silence is an answer for UDP.
    pub timeout: Duration,
    /// The effective uid of this probe, which its sockets carry (what `meta skuid` matches).
    pub uid: u32,
    /// What the installed table says, for the checks no traffic may settle (guard mode, the
    /// `dns-over-https` preset).
    pub table: TableView,
    /// Guard mode: the nameservers of resolv.conf, which should be the guard.
    pub system: Option<SystemResolvers>,
    /// Guard mode: the uid owning the guard's listening socket and its address, read from
    /// /proc: the guard's uid when the table cannot be read.
    pub guard_socket: Option<(u32, SocketAddr)>,
    /// The installed table is the service's (`run` recorded the newest generation): its
    /// resolved elements all expire, so one without a timeout is unexplained even when no
    /// other element shows a timeout. Set by the caller that reads the state directory.
    pub service_table: bool,
    /// Set when the policy's `scope:` leaves this probe's sender out: the report's opening
    /// line ("nobody (uid 65534) is not in the scope: expect everything to pass"), and the
    /// fence's refusals are then expected not to happen. See [`Prober`](super::Prober).
    pub outside_scope: Option<String>,
    /// `probe --from`: the addresses of the router whose fence the attempts cross (the
    /// bridge's host). Its `reject` answers from one of them, so an ICMP error from one is the
    /// fence's refusal, as one from this host is. Empty otherwise.
    pub fence_router: Vec<IpAddr>,
}

impl ProbeOptions {
    /// Per connection attempt: long enough for a distant service, short enough that a probe
    /// of a typical policy (whose refused TCP attempts under `action: drop` all wait this
    /// long, concurrently) takes a few seconds.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

    /// The policy's `dns.resolvers`, else the nameservers of `resolv_conf` (the resolvers
    /// `apply` allows), with the default timeout. In guard mode: the upstream resolvers, what
    /// resolv.conf names, the installed table (read from the current network namespace) and
    /// the owner of the guard's socket.
    pub fn for_policy(policy: &Policy, resolv_conf: &Path) -> Result<ProbeOptions, ProbeError> {
        // Always read: every policy's resolved elements are checked against it, and guard
        // mode and the `dns-over-https` preset need its rules and deny sets.
        let table = TableView::read();
        let uid = nix::unistd::geteuid().as_raw();
        if let Some(guard) = &policy.dns.guard {
            return Ok(ProbeOptions {
                resolvers: guard.upstream.clone(),
                timeout: Self::DEFAULT_TIMEOUT,
                uid,
                table,
                system: Some(SystemResolvers {
                    path: resolv_conf.display().to_string(),
                    nameservers: system_resolvers(resolv_conf).map_err(|e| e.to_string()),
                }),
                guard_socket: guard
                    .listen
                    .iter()
                    .find_map(|&l| socket_owner(l).map(|uid| (uid, l))),
                service_table: false,
                outside_scope: Prober::current().outside_scope(policy),
                fence_router: Vec::new(),
            });
        }
        let resolvers = match &policy.dns.resolvers {
            Some(r) => r.clone(),
            None => system_resolvers(resolv_conf)?,
        };
        Ok(ProbeOptions {
            resolvers,
            timeout: Self::DEFAULT_TIMEOUT,
            uid,
            table,
            system: None,
            guard_socket: None,
            service_table: false,
            outside_scope: Prober::current().outside_scope(policy),
            fence_router: Vec::new(),
        })
    }
}

/// resolv.conf as the probe found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemResolvers {
    pub path: String,
    /// Its nameservers, or why they could not be read.
    pub nameservers: Result<Vec<IpAddr>, String>,
}

/// The installed table, as far as the probe needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableView {
    /// Not read: nothing in the policy needs it.
    NotRead,
    /// Table inet egress_fence is not installed.
    NotInstalled,
    /// Reading it failed, e.g. without CAP_NET_ADMIN (a probe run as an unprivileged user).
    Unreadable(String),
    Read(TableFacts),
}

/// What the installed table says about DNS and denied networks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableFacts {
    /// The uids of the rules `meta mark M meta skuid U ... @dns4/@dns6 accept`: in guard mode
    /// only their sockets may reach the resolvers.
    pub dns_uids: Vec<u32>,
    /// The marks of those rules; none in a table that knows the guard by its uid alone.
    pub dns_marks: Vec<u32>,
    /// A rule accepts DNS to the resolvers from every uid (a resolve-mode table).
    pub dns_for_everyone: bool,
    /// The networks of the deny sets.
    pub denied: Vec<IpNet>,
    /// The elements of the resolved sets, which the policy must explain.
    pub resolved: Vec<Timed>,
    /// The elements of the allow sets, which the policy's `cidr:` entries must explain.
    pub allowed: Vec<Tuple>,
    /// The elements of the DNS sets, which the resolvers must explain.
    pub dns: Vec<Tuple>,
    /// Elements of any of the table's sets that egress-fence never writes (another
    /// protocol such as UDP-Lite, a catch-all, a range of protocols): (set, element).
    pub undecodable: Vec<(String, String)>,
}

impl TableView {
    /// Reads table inet egress_fence of the current network namespace.
    pub fn read() -> TableView {
        match Nft::open().and_then(|mut nft| nft.read_table()) {
            Ok(None) => TableView::NotInstalled,
            Ok(Some(table)) => TableView::Read(TableFacts::of(&table)),
            Err(e) if e.is_permission() => TableView::Unreadable(
                "reading nftables needs CAP_NET_ADMIN, which this user lacks".into(),
            ),
            Err(e) => TableView::Unreadable(e.to_string()),
        }
    }
}

impl TableFacts {
    pub fn of(table: &LiveTable) -> TableFacts {
        let access = table.dns_access();
        let mut facts = TableFacts {
            dns_uids: access.uids,
            dns_marks: access.marks,
            dns_for_everyone: access.everyone,
            denied: Vec::new(),
            resolved: Vec::new(),
            allowed: Vec::new(),
            dns: Vec::new(),
            undecodable: Vec::new(),
        };
        for id in SetId::ALL {
            if let Some(contents) = table.read_set(id) {
                let set = id.name();
                facts
                    .undecodable
                    .extend(contents.undecodable.into_iter().map(|e| (set.clone(), e)));
            }
        }
        for family in Family::BOTH {
            if let Some(Elements::Tuples(tuples)) =
                table.contents(SetId::new(SetRole::Allow, family))
            {
                facts.allowed.extend(tuples);
            }
            if let Some(Elements::Tuples(tuples)) = table.contents(SetId::new(SetRole::Dns, family))
            {
                facts.dns.extend(tuples);
            }
            if let Some(Elements::Networks(nets)) =
                table.contents(SetId::new(SetRole::Deny, family))
            {
                facts.denied.extend(nets);
            }
            if let Some(Elements::Timed(elements)) =
                table.contents(SetId::new(SetRole::Resolved, family))
            {
                facts.resolved.extend(elements);
            }
        }
        facts
    }
}

/// The uid owning a socket bound to `addr` (or to the unspecified address on its port) in
/// the calling thread's network namespace, from /proc/thread-self/net (readable by anyone).
fn socket_owner(addr: SocketAddr) -> Option<u32> {
    let files: &[&str] = match addr {
        SocketAddr::V4(_) => &["udp", "tcp"],
        SocketAddr::V6(_) => &["udp6", "tcp6"],
    };
    files.iter().find_map(|f| {
        let text = std::fs::read_to_string(format!("/proc/thread-self/net/{f}")).ok()?;
        text.lines().skip(1).find_map(|line| {
            let (local, uid) = proc_net_socket(line)?;
            let matches = local.port() == addr.port()
                && (local.ip() == addr.ip() || local.ip().is_unspecified());
            matches.then_some(uid)
        })
    })
}

/// The local address and owner uid of one line of /proc/net/{udp,tcp}{,6}: `sl local_address
/// rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...`, addresses as hex words in
/// host byte order.
fn proc_net_socket(line: &str) -> Option<(SocketAddr, u32)> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let (addr, port) = fields.get(1)?.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let uid = fields.get(7)?.parse().ok()?;
    let mut bytes = Vec::with_capacity(16);
    for i in (0..addr.len()).step_by(8) {
        let word = u32::from_str_radix(addr.get(i..i + 8)?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    let ip = match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    Some((SocketAddr::new(ip, port), uid))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv6Addr;

    use super::*;
    use crate::probe::testing::*;

    #[test]
    fn options_take_the_policy_resolvers_else_resolv_conf() {
        let dir = tempfile::tempdir().expect("tempdir");
        let conf = dir.path().join("resolv.conf");
        std::fs::write(&conf, "nameserver 192.0.2.53\n").expect("write");
        let own = policy("version: 1\ndns:\n  resolvers: [198.51.100.53]\n");
        let o = ProbeOptions::for_policy(&own, &conf).expect("options");
        assert_eq!(
            o.resolvers,
            vec!["198.51.100.53".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(o.timeout, ProbeOptions::DEFAULT_TIMEOUT);
        let system = ProbeOptions::for_policy(&policy("version: 1\n"), &conf).expect("options");
        assert_eq!(
            system.resolvers,
            vec!["192.0.2.53".parse::<IpAddr>().unwrap()]
        );
    }

    #[test]
    fn proc_net_lines_give_the_socket_owner() {
        let v4 = format!(
            "   0: {:08X}:0035 00000000:0000 07 00000000:00000000 00:00000000 00000000   993        0 4242 2 0000000000000000 0",
            u32::from_ne_bytes([127, 0, 0, 53])
        );
        assert_eq!(
            proc_net_socket(&v4),
            Some(("127.0.0.53:53".parse().unwrap(), 993))
        );
        let loopback6: String = Ipv6Addr::LOCALHOST
            .octets()
            .chunks(4)
            .map(|w| format!("{:08X}", u32::from_ne_bytes(w.try_into().unwrap())))
            .collect();
        let v6 = format!(
            "   1: {loopback6}:14E9 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4243 1 0000000000000000 100 0 0 10 0"
        );
        assert_eq!(
            proc_net_socket(&v6),
            Some(("[::1]:5353".parse().unwrap(), 0))
        );
        assert_eq!(
            proc_net_socket("  sl  local_address rem_address   st"),
            None
        );
    }
}
