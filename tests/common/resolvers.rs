//! The world's two resolvers (dnsmasq in the net namespace): their records, CNAMEs,
//! wildcards and TTL, their query logs, and the harness's health probe.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::MutexGuard;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use egress_fence::dns::exchange;

use super::addrs::*;
use super::dns_client::{RTYPE_A, dns_query};
use super::process::{ns_command, read_lossy, stop_child, wait_until};
use super::world::World;

/// The name the harness asks to see whether a resolver answers; left out of query logs.
const PROBE_NAME: &str = "eft-harness-probe.invalid";

/// TTL of the DNS records until a test sets another one.
pub const DEFAULT_DNS_TTL: u32 = 60;

pub(super) struct Dns {
    /// name -> (addresses, ttl); every ttl equals `ttl` except transiently.
    records: BTreeMap<String, (Vec<IpAddr>, u32)>,
    /// alias -> target: CNAME records (dnsmasq's `--cname`), served by both resolvers.
    cnames: BTreeMap<String, String>,
    ttl: u32,
    main: Option<Dnsmasq>,
    rogue: Option<Dnsmasq>,
}

impl Dns {
    /// No records yet, no resolver running.
    pub(super) fn new(ttl: u32) -> Dns {
        Dns {
            records: BTreeMap::new(),
            cnames: BTreeMap::new(),
            ttl,
            main: None,
            rogue: None,
        }
    }

    /// Stops both resolvers (for the world's drop: never panics).
    pub(super) fn stop(&mut self) {
        for d in [self.main.take(), self.rogue.take()].into_iter().flatten() {
            stop_child(d.child, "dnsmasq");
        }
    }

    /// dnsmasq's flags for the CNAME records.
    fn cname_args(&self) -> Vec<String> {
        self.cnames
            .iter()
            .map(|(alias, target)| format!("--cname={alias},{target}"))
            .collect()
    }
}

struct Dnsmasq {
    child: Child,
    role: Role,
    stderr_path: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Main,
    Rogue,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Main => "main",
            Role::Rogue => "rogue",
        }
    }

    /// Listen addresses; the first one (IPv4) is used for health probes.
    fn addrs(self) -> [IpAddr; 2] {
        match self {
            Role::Main => [DNS_V4, DNS_V6],
            Role::Rogue => [ROGUE_DNS_V4, ROGUE_DNS_V6],
        }
    }
}

/// One query a resolver logged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsQuery {
    /// "A", "AAAA", ...
    pub rtype: String,
    pub name: String,
    pub from: Option<IpAddr>,
}

fn parse_query_log(path: &Path) -> Vec<DnsQuery> {
    // Lines look like: "Nov 29 15:50:19 dnsmasq[5388]: query[A] a.test from 198.51.100.2"
    read_lossy(path)
        .lines()
        .filter_map(|line| {
            let rest = &line[line.find("]: query[")? + "]: query[".len()..];
            let (rtype, rest) = rest.split_once("] ")?;
            let (name, from) = rest.rsplit_once(" from ")?;
            Some(DnsQuery {
                rtype: rtype.to_string(),
                name: name.to_string(),
                from: from.trim().parse().ok(),
            })
        })
        .filter(|q| q.name != PROBE_NAME)
        .collect()
}

/// Sends one DNS query for [`PROBE_NAME`] from `bind` to `server:53`; true if any answer
/// with the query's id comes back within `timeout`.
pub(super) fn dns_probe(server: IpAddr, bind: IpAddr, timeout: Duration) -> bool {
    static NEXT_ID: AtomicU32 = AtomicU32::new(1);
    let Ok(sock) = UdpSocket::bind(SocketAddr::new(bind, 0)) else {
        return false;
    };
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed) as u16;
    let Ok(query) = dns_query(id, PROBE_NAME, RTYPE_A) else {
        return false;
    };
    // Connected, so a closed port fails at once (ICMP port unreachable) instead of timing out.
    sock.connect((server, 53)).is_ok() && exchange::udp_blocking(&sock, &query, id, timeout).is_ok()
}

fn normalize_name(name: &str) -> String {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    assert!(
        !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_'),
        "not a DNS name the test resolver can serve: {name:?}"
    );
    name
}

impl World {
    /// Starts both resolvers with the records of the world's DNS state and waits until each
    /// answers (for [`World::new`]).
    pub(super) fn start_resolvers(&self) {
        let mut dns = self.dns_state();
        self.write_hosts_file(&dns);
        let main = self.spawn_dnsmasq(Role::Main, dns.ttl, &[]);
        let rogue = self.spawn_dnsmasq(Role::Rogue, dns.ttl, &[]);
        dns.main = Some(self.wait_dnsmasq_ready(main));
        dns.rogue = Some(self.wait_dnsmasq_ready(rogue));
    }

    /// Sets the A/AAAA records of `name` on both resolvers (replacing earlier ones) and
    /// returns once they serve them. Works before and while clients run: the records file is
    /// rewritten and dnsmasq reloads it on SIGHUP without dropping a query.
    ///
    /// dnsmasq has one TTL (`--local-ttl`) for all its records: a `ttl_secs` different from
    /// the current one restarts both resolvers (~25 ms each without DNS) and panics if another
    /// name still has the old TTL; change every name at once with [`World::dns_set_ttl`].
    pub fn dns_set(&self, name: &str, addrs: &[IpAddr], ttl_secs: u32) {
        assert!(
            !addrs.is_empty(),
            "dns_set({name}) needs at least one address; use dns_remove to delete a name"
        );
        let name = normalize_name(name);
        let mut dns = self.dns_state();
        if let Some((other, (_, ttl))) = dns
            .records
            .iter()
            .find(|(n, (_, ttl))| **n != name && *ttl != ttl_secs)
        {
            panic!(
                "dns_set({name}, ttl {ttl_secs}): dnsmasq serves one TTL for all names and \
                 {other} has TTL {ttl}; use dns_set_ttl to change it for every name"
            );
        }
        dns.records.insert(name, (addrs.to_vec(), ttl_secs));
        self.apply_dns(&mut dns, ttl_secs);
    }

    /// Removes `name`: both resolvers answer NXDOMAIN for it when this returns.
    pub fn dns_remove(&self, name: &str) {
        let mut dns = self.dns_state();
        dns.records.remove(&normalize_name(name));
        let ttl = dns.ttl;
        self.apply_dns(&mut dns, ttl);
    }

    /// Sets the TTL of every record (restarts the resolvers if it changes).
    pub fn dns_set_ttl(&self, ttl_secs: u32) {
        let mut dns = self.dns_state();
        for (_, ttl) in dns.records.values_mut() {
            *ttl = ttl_secs;
        }
        self.apply_dns(&mut dns, ttl_secs);
    }

    /// The TTL the resolvers currently give their records.
    pub fn dns_ttl(&self) -> u32 {
        self.dns_state().ttl
    }

    /// Stops the allowed resolver (192.0.2.53 / 2001:db8:1::53): queries to it then get ICMP
    /// port unreachable. The rogue resolver keeps running. No-op if already stopped.
    pub fn dns_stop(&self) {
        let mut dns = self.dns_state();
        if let Some(d) = dns.main.take() {
            stop_child(d.child, "dnsmasq");
        }
    }

    /// Starts the allowed resolver again (same records and TTL) and waits until it answers.
    /// No-op if it is running.
    pub fn dns_start(&self) {
        let mut dns = self.dns_state();
        if dns.main.is_none() {
            self.write_hosts_file(&dns);
            let d = self.spawn_dnsmasq(Role::Main, dns.ttl, &dns.cname_args());
            dns.main = Some(self.wait_dnsmasq_ready(d));
        }
    }

    /// Whether the allowed resolver is running.
    pub fn dns_running(&self) -> bool {
        self.dns_state().main.is_some()
    }

    /// Names asked of the allowed resolver, in order, over its whole life in this world
    /// (stops and restarts included), without the harness's own health probes.
    pub fn dns_queries(&self) -> Vec<String> {
        self.dns_query_log().into_iter().map(|q| q.name).collect()
    }

    /// Like [`World::dns_queries`], with the record type and the client address.
    pub fn dns_query_log(&self) -> Vec<DnsQuery> {
        parse_query_log(&self.log_path(Role::Main))
    }

    /// The queries the rogue resolver received.
    pub fn rogue_dns_query_log(&self) -> Vec<DnsQuery> {
        parse_query_log(&self.log_path(Role::Rogue))
    }

    fn dns_state(&self) -> MutexGuard<'_, Dns> {
        self.dns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn hosts_path(&self) -> PathBuf {
        self.dir().join("dns-hosts")
    }

    fn log_path(&self, role: Role) -> PathBuf {
        self.dir().join(format!("dnsmasq-{}.log", role.name()))
    }

    fn write_hosts_file(&self, dns: &Dns) {
        let mut text = String::new();
        for (name, (addrs, _)) in &dns.records {
            for addr in addrs {
                text.push_str(&format!("{addr} {name}\n"));
            }
        }
        // Atomic replace: dnsmasq never reads half a file.
        let tmp = self.dir().join("dns-hosts.tmp");
        fs::write(&tmp, text).expect("write the DNS records file");
        fs::rename(&tmp, self.hosts_path()).expect("replace the DNS records file");
    }

    /// Serves `dns.records` with `ttl` from every running resolver.
    fn apply_dns(&self, dns: &mut Dns, ttl: u32) {
        self.write_hosts_file(dns);
        if ttl != dns.ttl {
            dns.ttl = ttl;
            self.restart_dns(dns);
            return;
        }
        let hosts = self.hosts_path();
        let marker = format!("read {} - ", hosts.display());
        let mut pending = Vec::new();
        for d in [&dns.main, &dns.rogue].into_iter().flatten() {
            let log = self.log_path(d.role);
            let before = read_lossy(&log).matches(&marker).count();
            kill(Pid::from_raw(d.child.id() as i32), Signal::SIGHUP).expect("SIGHUP dnsmasq");
            pending.push((log, before));
        }
        for (log, before) in pending {
            // dnsmasq logs "read <file> - N names" once the reload is complete.
            let reloaded = wait_until(Duration::from_secs(5), || {
                read_lossy(&log).matches(&marker).count() > before
            });
            assert!(
                reloaded,
                "dnsmasq did not reload {}:\n{}",
                hosts.display(),
                read_lossy(&log)
            );
        }
    }

    /// Restarts every running resolver with the records, CNAMEs and TTL of `dns` (dnsmasq
    /// reads `--cname` and `--local-ttl` only at start) and waits until each answers.
    fn restart_dns(&self, dns: &mut Dns) {
        let extra = dns.cname_args();
        for role in [Role::Main, Role::Rogue] {
            let slot = match role {
                Role::Main => &mut dns.main,
                Role::Rogue => &mut dns.rogue,
            };
            if let Some(d) = slot.take() {
                stop_child(d.child, "dnsmasq");
                let d = self.spawn_dnsmasq(role, dns.ttl, &extra);
                *slot = Some(self.wait_dnsmasq_ready(d));
            }
        }
    }

    /// Starts one resolver; `extra` adds dnsmasq flags (a wildcard record, CNAMEs).
    fn spawn_dnsmasq(&self, role: Role, ttl: u32, extra: &[String]) -> Dnsmasq {
        let mut args: Vec<String> = [
            "dnsmasq",
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--bind-interfaces",
            // Answer only from local data; anything else is NXDOMAIN, never forwarded.
            "--local=/#/",
            "--user=root",
            "--group=root",
            "--pid-file=",
            "--log-queries",
        ]
        .map(String::from)
        .to_vec();
        for addr in role.addrs() {
            args.push(format!("--listen-address={addr}"));
        }
        args.push(format!("--addn-hosts={}", self.hosts_path().display()));
        args.push(format!("--local-ttl={ttl}"));
        args.push(format!("--log-facility={}", self.log_path(role).display()));
        args.extend(extra.iter().cloned());

        let stderr_path = self.dir().join(format!("dnsmasq-{}.stderr", role.name()));
        let stderr = File::create(&stderr_path).expect("create dnsmasq stderr file");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let child = ns_command(&self.net, &args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn `ip netns exec ... dnsmasq`");
        Dnsmasq {
            child,
            role,
            stderr_path,
        }
    }

    fn wait_dnsmasq_ready(&self, mut d: Dnsmasq) -> Dnsmasq {
        let server = d.role.addrs()[0];
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = d.child.try_wait() {
                panic!(
                    "dnsmasq ({}) exited at start with {status} (is dnsmasq-base installed?)\n\
                     stderr: {}\nlog: {}",
                    d.role.name(),
                    read_lossy(&d.stderr_path),
                    read_lossy(&self.log_path(d.role))
                );
            }
            if self.in_net_ns(|| dns_probe(server, PROBE_V4, Duration::from_millis(50))) {
                return d;
            }
            if Instant::now() > deadline {
                let stderr = read_lossy(&d.stderr_path);
                stop_child(d.child, "dnsmasq");
                panic!(
                    "dnsmasq ({}) does not answer on {server}: {stderr}",
                    d.role.name()
                );
            }
            thread::sleep(Duration::from_millis(2));
        }
    }

    /// Makes the allowed resolver answer every name under `domain` (and `domain` itself) with
    /// the A record `addr`, as an attacker's zone with a wildcard would: random subnames
    /// resolve. dnsmasq reads wildcards only from its command line (`--address=/DOMAIN/ADDR`),
    /// so this restarts the allowed resolver with that flag (~25 ms without DNS); the records
    /// of [`World::dns_set`] stay. The rogue resolver is not changed. A later restart by the
    /// other methods (a TTL change, [`World::dns_stop`] then [`World::dns_start`]) drops the
    /// wildcard.
    pub fn dns_wildcard(&self, domain: &str, addr: IpAddr) {
        let domain = normalize_name(domain);
        let mut dns = self.dns_state();
        if let Some(d) = dns.main.take() {
            stop_child(d.child, "dnsmasq");
        }
        self.write_hosts_file(&dns);
        let mut extra = dns.cname_args();
        extra.push(format!("--address=/{domain}/{addr}"));
        let d = self.spawn_dnsmasq(Role::Main, dns.ttl, &extra);
        dns.main = Some(self.wait_dnsmasq_ready(d));
    }

    /// Sets the records of many names with ONE reload of each resolver (like [`World::dns_set`]
    /// for each of them, which would reload once per name).
    pub fn dns_set_many(&self, records: &[(String, Vec<IpAddr>)], ttl_secs: u32) {
        let mut dns = self.dns_state();
        let mut new = BTreeMap::new();
        for (name, addrs) in records {
            assert!(!addrs.is_empty(), "dns_set_many: {name} has no address");
            new.insert(normalize_name(name), (addrs.clone(), ttl_secs));
        }
        if let Some((other, (_, ttl))) = dns
            .records
            .iter()
            .find(|(n, (_, ttl))| !new.contains_key(*n) && *ttl != ttl_secs)
        {
            panic!(
                "dns_set_many(ttl {ttl_secs}): dnsmasq serves one TTL for all names and \
                 {other} has TTL {ttl}; use dns_set_ttl to change it for every name"
            );
        }
        dns.records.extend(new);
        self.apply_dns(&mut dns, ttl_secs);
    }

    /// Adds the CNAME record `alias -> target` to both resolvers (restarting them: dnsmasq
    /// reads CNAMEs only at start; ~25 ms each) and returns once they serve it. dnsmasq
    /// answers a CNAME only while it knows `target` itself: give it records with
    /// [`World::dns_set`] (before or after). The answer carries the CNAME and the target's
    /// records, with the resolvers' one TTL.
    pub fn dns_cname(&self, alias: &str, target: &str) {
        let mut dns = self.dns_state();
        dns.cnames
            .insert(normalize_name(alias), normalize_name(target));
        self.restart_dns(&mut dns);
    }
}
