//! The integration-test "world": a throwaway pair of network namespaces that plays a sandbox host
//! and the internet it talks to.
//!
//! ```text
//!   sandbox netns (policies are applied here)          net netns ("the internet")
//!   eth0 198.51.100.2/24, 2001:db8:ffff::2/64  <veth>  veth0 198.51.100.1/24, 2001:db8:ffff::1/64
//!   default routes via the net side                    lo: test hosts (192.0.2.x, 203.0.113.x,
//!   /etc/netns/<sandbox>/resolv.conf -> 192.0.2.53         2001:db8:1::x, 2001:db8:2::x,
//!                                                          169.254.169.254, fd00:ec2::254)
//!                                                      dnsmasq on 192.0.2.53 + 2001:db8:1::53
//!                                                      rogue dnsmasq on 192.0.2.54 + 2001:db8:1::54
//!                                                      TCP/UDP listeners (threads of the test)
//! ```
//!
//! Everything is created inside namespaces this module makes and is removed by [`World`]'s
//! `Drop`, even when the test panics. Nothing is ever configured in the root network namespace.
//! The host addresses live on `lo` of the net namespace (this kernel has no `dummy` driver).
//!
//! Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and the tools `ip` (iproute2), `dnsmasq`
//! (dnsmasq-base), `dig` (dnsutils), `nc` (netcat-openbsd), `curl`, `nft` (nftables), `bash`,
//! `timeout` and `stdbuf` (coreutils) and `setpriv` (util-linux). Worlds are independent, so
//! tests using them may run in parallel.
//!
//! For the DNS guard (its tests are in tests/guard.rs) a world also has: a rotating pool of
//! test addresses served as many names at once ([`World::rotating_pool`]), a listener on every
//! address ([`World::listen_tcp_any`]), CNAMEs ([`World::dns_cname`]), the sandbox's
//! resolv.conf pointed at the guard ([`World::use_guard_resolver`]), clients as another uid
//! ([`World::sandbox_cmd_as`], [`World::dig_as`]), the resolved sets' elements with their
//! timeouts ([`World::set_elements`]) and a DNS client for the sandbox ([`dns_ask`]).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once, Weak, mpsc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use egress_fence::dns::{exchange, message};
use nix::sched::CloneFlags;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

// ---------------------------------------------------------------------------------------------
// Addresses
// ---------------------------------------------------------------------------------------------

/// The sandbox's IPv4 address (source of everything the sandbox sends over IPv4).
pub const SANDBOX_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 2));
/// The sandbox's IPv6 address.
pub const SANDBOX_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 2));
/// The net side of the veth pair: the sandbox's IPv4 default gateway.
pub const GATEWAY_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1));
/// The net side of the veth pair: the sandbox's IPv6 default gateway.
pub const GATEWAY_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 1));

/// The "allowed" resolver (in the sandbox's resolv.conf), IPv4.
pub const DNS_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 53));
/// The "allowed" resolver, IPv6.
pub const DNS_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x53));
/// A second resolver with the same records that a policy should not allow, IPv4.
pub const ROGUE_DNS_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 54));
/// The rogue resolver, IPv6.
pub const ROGUE_DNS_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x54));

/// The cloud metadata service address (IPv4), a host of every world.
pub const METADATA_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254));
/// The AWS IPv6 metadata address, a host of every world.
pub const METADATA_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254));

/// Test hosts in 192.0.2.0/24.
pub const HOST_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 10));
pub const HOST2_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 11));
pub const HOST3_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 12));
/// Test hosts in 203.0.113.0/24 (a second, separate range, e.g. for deny lists).
pub const OTHER_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 10));
pub const OTHER2_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 11));
/// Test hosts in 2001:db8:1::/64.
pub const HOST_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10));
pub const HOST2_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x11));
pub const HOST3_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x12));
/// A test host in 2001:db8:2::/64 (the IPv6 counterpart of [`OTHER_V4`]).
pub const OTHER_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x10));

/// Every address the net namespace answers on when a world is created (more: [`World::add_host`]).
pub const DEFAULT_HOSTS: [IpAddr; 15] = [
    HOST_V4,
    HOST2_V4,
    HOST3_V4,
    OTHER_V4,
    OTHER2_V4,
    HOST_V6,
    HOST2_V6,
    HOST3_V6,
    OTHER_V6,
    METADATA_V4,
    METADATA_V6,
    DNS_V4,
    DNS_V6,
    ROGUE_DNS_V4,
    ROGUE_DNS_V6,
];

/// Source addresses of the harness's own health probes (never used by tests).
const PROBE_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 252));
const PROBE_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x252));
/// The name the harness asks to see whether a resolver answers; left out of query logs.
const PROBE_NAME: &str = "eft-harness-probe.invalid";

/// TTL of the DNS records until a test sets another one.
pub const DEFAULT_DNS_TTL: u32 = 60;

/// The egress-fence binary built by cargo for these tests.
pub const EGRESS_FENCE_BIN: &str = env!("CARGO_BIN_EXE_egress-fence");

/// The variable egress-fence takes its state directory from when `--state-dir` is not given.
/// The harness sets it for every process it starts, to [`World::state_dir`], so no test ever
/// writes generations or locks to the machine's /var/lib.
pub const STATE_DIR_ENV: &str = "EGRESS_FENCE_STATE_DIR";

/// Upper bound for any command the helpers run, so a hung client fails the test instead of
/// hanging it.
const COMMAND_TIMEOUT_SECS: &str = "60";

/// Serialises `ip netns add/del` and the creation/removal of `/etc/netns` between the worlds
/// of one test process (concurrent first-time `ip netns add` calls race on /run/netns).
static NETNS_LOCK: Mutex<()> = Mutex::new(());
static WORLD_COUNTER: AtomicU32 = AtomicU32::new(0);
static SWEEP: Once = Once::new();

// ---------------------------------------------------------------------------------------------
// World
// ---------------------------------------------------------------------------------------------

/// A sandbox namespace and an "internet" namespace with DNS, hosts and listeners.
///
/// Create one per test with [`World::new`]; dropping it kills its processes, stops its
/// listeners, deletes both namespaces, `/etc/netns/<sandbox>` and its temporary files.
/// All methods take `&self`, so a world can be shared with scoped threads.
pub struct World {
    sandbox: String,
    net: String,
    /// Open handles on the namespaces, for `setns` in threads. `None` until created.
    sandbox_fd: Option<File>,
    net_fd: Option<File>,
    dir: tempfile::TempDir,
    etc_dir: PathBuf,
    dns: Mutex<Dns>,
    listeners: Mutex<Vec<Weak<ListenerShared>>>,
    file_counter: AtomicU32,
}

impl World {
    /// Creates the namespaces, the veth link, the hosts, both resolvers and the sandbox's
    /// resolv.conf, and waits until the sandbox reaches the resolver over IPv4 and IPv6.
    ///
    /// Panics with an explanation when not running as root or when namespaces cannot be made.
    pub fn new() -> World {
        require_root();
        SWEEP.call_once(sweep_stale_worlds);

        let id = format!(
            "eft-{}-{}",
            std::process::id(),
            WORLD_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let dir = tempfile::Builder::new()
            .prefix(&format!("{id}-"))
            .tempdir()
            .expect("create the world's temporary directory");
        // The guard exists before anything is created: a panic below still cleans up.
        let mut world = World {
            etc_dir: PathBuf::from(format!("/etc/netns/{id}-sb")),
            sandbox: format!("{id}-sb"),
            net: format!("{id}-net"),
            sandbox_fd: None,
            net_fd: None,
            dir,
            dns: Mutex::new(Dns {
                records: BTreeMap::new(),
                cnames: BTreeMap::new(),
                ttl: DEFAULT_DNS_TTL,
                main: None,
                rogue: None,
            }),
            listeners: Mutex::new(Vec::new()),
            file_counter: AtomicU32::new(0),
        };
        world.create_namespaces();
        world.configure_links();
        world.write_sandbox_etc();

        {
            let mut dns = world.dns_state();
            world.write_hosts_file(&dns);
            let main = world.spawn_dnsmasq(Role::Main, dns.ttl, &[]);
            let rogue = world.spawn_dnsmasq(Role::Rogue, dns.ttl, &[]);
            dns.main = Some(world.wait_dnsmasq_ready(main));
            dns.rogue = Some(world.wait_dnsmasq_ready(rogue));
        }
        // End to end: from the sandbox, through the veth, to the resolver, on both families.
        for server in [DNS_V4, DNS_V6] {
            let unspecified = match server {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            };
            let ok = wait_until(Duration::from_secs(10), || {
                world.in_sandbox_ns(|| dns_probe(server, unspecified, Duration::from_millis(100)))
            });
            assert!(
                ok,
                "the sandbox cannot reach the world's resolver at {server}"
            );
        }
        world
    }

    /// Name of the sandbox network namespace (as in `ip netns list`).
    pub fn sandbox_name(&self) -> &str {
        &self.sandbox
    }

    /// Name of the "internet" network namespace.
    pub fn net_name(&self) -> &str {
        &self.net
    }

    /// `/run/netns/<sandbox>`: the bind mount that `setns` can open.
    pub fn sandbox_path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.sandbox)
    }

    /// `/run/netns/<net>`.
    pub fn net_path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.net)
    }

    /// The world's temporary directory (removed on drop), e.g. for policy files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The state directory every egress-fence started by this world uses (inside
    /// [`World::dir`]; created by egress-fence on first write).
    pub fn state_dir(&self) -> PathBuf {
        self.dir().join("state")
    }

    /// Where egress-fence keeps the sandbox's generations, lock and pending confirmation
    /// (its named-namespace directory below [`World::state_dir`]).
    pub fn sandbox_state_dir(&self) -> PathBuf {
        self.state_dir().join(format!("netns-{}", self.sandbox))
    }

    /// Writes `contents` to `name` inside [`World::dir`] and returns the full path.
    pub fn write_file(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.dir().join(name);
        fs::write(&path, contents).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    }

    /// Makes `ip` one more host of the internet (an address on `lo` in the net namespace).
    /// Adding an address that is already there is fine.
    pub fn add_host(&self, ip: IpAddr) {
        let out = run(
            Command::new("ip")
                .args(["-n", &self.net, "addr", "add"])
                .arg(host_cidr(ip))
                .args(["dev", "lo"])
                .args(nodad(ip)),
            None,
        );
        assert!(
            out.success()
                || out.stderr.contains("File exists")
                || out.stderr.contains("already assigned"),
            "add host {ip} to {}: {out}",
            self.net
        );
    }

    /// Runs `f` on a fresh thread that has entered the sandbox namespace; sockets it opens
    /// belong to the sandbox (and its nftables output hook applies to what they send).
    pub fn in_sandbox_ns<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        in_netns(
            self.sandbox_fd.as_ref().expect("sandbox namespace exists"),
            f,
        )
    }

    /// Runs `f` on a fresh thread that has entered the net namespace ("the internet").
    pub fn in_net_ns<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        in_netns(self.net_fd.as_ref().expect("net namespace exists"), f)
    }

    // --- DNS ------------------------------------------------------------------------------

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

    // --- listeners ------------------------------------------------------------------------

    /// Listens on `ip:port` in the net namespace (port 0: any free port, see
    /// [`Listener::local_addr`]). Every accepted connection is recorded; the listener reads
    /// the request (up to an empty line, EOF or 1 s) and answers
    /// `HTTP/1.0 200 OK\r\n\r\nhello from ADDR:PORT\n` (ADDR:PORT as `SocketAddr` prints it,
    /// so IPv6 is bracketed). `ip` must be a host of the world.
    pub fn listen_tcp(&self, ip: IpAddr, port: u16) -> Listener {
        self.listen(ip, port, Proto::Tcp)
    }

    /// Listens for UDP datagrams on `ip:port` in the net namespace; records each one and
    /// echoes its payload back to the sender.
    pub fn listen_udp(&self, ip: IpAddr, port: u16) -> Listener {
        self.listen(ip, port, Proto::Udp)
    }

    // --- clients in the sandbox -----------------------------------------------------------

    /// A `Command` that runs `args` inside the sandbox (`ip netns exec`, so it sees the
    /// world's resolv.conf), with proxy variables removed. Not started; no timeout.
    pub fn sandbox_command(&self, args: &[&str]) -> Command {
        self.ns_command(&self.sandbox, args)
    }

    /// Runs `args` inside the sandbox and waits for it (killed after 60 s).
    pub fn sandbox_cmd(&self, args: &[&str]) -> CmdOutput {
        run(
            &mut self.ns_command(&self.sandbox, &with_timeout(args)),
            None,
        )
    }

    /// Like [`World::sandbox_cmd`], feeding `input` to its standard input.
    pub fn sandbox_cmd_with_input(&self, args: &[&str], input: &[u8]) -> CmdOutput {
        run(
            &mut self.ns_command(&self.sandbox, &with_timeout(args)),
            Some(input),
        )
    }

    /// Runs `args` inside the net namespace and waits for it (killed after 60 s).
    pub fn net_cmd(&self, args: &[&str]) -> CmdOutput {
        run(&mut self.ns_command(&self.net, &with_timeout(args)), None)
    }

    /// Starts `args` inside the sandbox in the background; killed when the handle drops.
    pub fn spawn_in_sandbox(&self, args: &[&str]) -> Background {
        self.spawn_background(self.ns_command(&self.sandbox, args), args.join(" "))
    }

    /// `nc -z -v -w <timeout_secs>` from the sandbox: the full output, e.g. to tell
    /// "Connection refused" from "Operation not permitted" or a timeout.
    /// `host` may be an IP address (IPv6 with or without brackets) or a name.
    pub fn tcp_connect(&self, host: impl fmt::Display, port: u16, timeout_secs: u32) -> CmdOutput {
        let host = unbracket(&host.to_string());
        let (port, timeout) = (port.to_string(), timeout_secs.to_string());
        self.sandbox_cmd(&["nc", "-z", "-v", "-w", &timeout, &host, &port])
    }

    /// Whether a TCP connection from the sandbox to `host:port` succeeds within 2 s.
    pub fn tcp_connects(&self, host: impl fmt::Display, port: u16) -> bool {
        self.tcp_connect(host, port, 2).success()
    }

    /// Sends `payload` as one UDP datagram (up to 4 KiB) from the sandbox, by `cat` writing
    /// to bash's `/dev/udp/HOST/PORT`. Success means the datagram left the socket, not that it
    /// arrived (check with a [`Listener`]); a datagram the sandbox's output hook drops fails
    /// at once with "Operation not permitted". (`nc -u` waits out its `-w` timeout then and
    /// still exits 0; with `-w0` it may quit before reading its input.)
    pub fn udp_send(&self, host: impl fmt::Display, port: u16, payload: &[u8]) -> CmdOutput {
        let host = unbracket(&host.to_string());
        let port = port.to_string();
        let script = r#"exec cat > "/dev/udp/$0/$1""#;
        self.sandbox_cmd_with_input(&["bash", "-c", script, &host, &port], payload)
    }

    /// `dig +tries=1 +time=2` from the sandbox. `server: None` uses the sandbox's resolv.conf
    /// (the allowed resolver). `rtype` is e.g. "A", "AAAA", "TXT".
    pub fn dig(&self, server: Option<IpAddr>, name: &str, rtype: &str, tcp: bool) -> DigResult {
        let extra: &[&str] = if tcp { &["+tcp"] } else { &[] };
        self.dig_as(None, server, name, rtype, extra)
    }

    /// Like [`World::dig`], as user `uid` (`None`: root, as the test runs; see
    /// [`World::sandbox_cmd_as`]) and with extra dig options after the name and type, e.g.
    /// `+tcp`, `+noedns`, `+ignore` (keep a truncated answer), `-p 853`.
    pub fn dig_as(
        &self,
        uid: Option<u32>,
        server: Option<IpAddr>,
        name: &str,
        rtype: &str,
        extra: &[&str],
    ) -> DigResult {
        let mut args = vec![
            "dig".to_string(),
            "+tries=1".into(),
            "+time=2".into(),
            "+noall".into(),
            "+comments".into(),
            "+answer".into(),
        ];
        if let Some(server) = server {
            args.push(format!("@{server}"));
        }
        args.extend([name.to_string(), rtype.to_string()]);
        args.extend(extra.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        DigResult::parse(match uid {
            Some(uid) => self.sandbox_cmd_as(uid, &args),
            None => self.sandbox_cmd(&args),
        })
    }

    /// `curl` from the sandbox (no proxy, connect timeout 2 s, total 5 s, IPv6 literals in
    /// brackets work). Ok(body) on success, else the whole output (exit code, stderr).
    pub fn curl(&self, url: &str) -> Result<String, CmdOutput> {
        let out = self.sandbox_cmd(&[
            "curl",
            "-sS",
            "--globoff",
            "--noproxy",
            "*",
            "--connect-timeout",
            "2",
            "--max-time",
            "5",
            url,
        ]);
        if out.success() {
            Ok(out.stdout)
        } else {
            Err(out)
        }
    }

    /// The kernel handle of table inet egress_fence in the sandbox (`None`: not installed).
    /// A full apply replaces the table, and the new one gets a new handle.
    pub fn table_handle(&self) -> Option<u64> {
        self.nft_json()["nftables"].as_array().and_then(|a| {
            a.iter()
                .find(|o| o["table"]["family"] == "inet" && o["table"]["name"] == "egress_fence")
                .and_then(|o| o["table"]["handle"].as_u64())
        })
    }

    /// `nft -j list ruleset` inside the sandbox, parsed.
    pub fn nft_json(&self) -> serde_json::Value {
        let out = self.sandbox_cmd(&["nft", "-j", "list", "ruleset"]);
        assert!(out.success(), "nft -j list ruleset in the sandbox: {out}");
        serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("nft -j output is not JSON ({e}): {}", out.stdout))
    }

    /// Runs the egress-fence binary (from the root namespace) with `args` followed by
    /// `--netns <sandbox>`, and waits for it (killed after 60 s).
    pub fn egress_fence(&self, args: &[&str]) -> CmdOutput {
        self.egress_fence_with_env(args, &[])
    }

    /// Like [`World::egress_fence`], with extra environment variables (fault injection).
    pub fn egress_fence_with_env(&self, args: &[&str], env: &[(&str, &str)]) -> CmdOutput {
        let mut cmd = Command::new("timeout");
        cmd.args(["-k", "5", COMMAND_TIMEOUT_SECS, EGRESS_FENCE_BIN])
            .args(args)
            .args(["--netns", &self.sandbox]);
        clean_env(&mut cmd)
            .env(STATE_DIR_ENV, self.state_dir())
            .envs(env.iter().copied());
        run(&mut cmd, None)
    }

    /// Starts the egress-fence binary with `args` + `--netns <sandbox>` in the background
    /// (daemon, watch); it is killed when the handle drops.
    pub fn spawn_egress_fence(&self, args: &[&str]) -> Background {
        self.spawn_egress_fence_with_env(args, &[])
    }

    /// `egress-fence run POLICY` in the sandbox, once its DNS guard serves (the policy must be
    /// in guard mode). Runs as root, so the table lets uid 0 reach the upstream resolvers.
    pub fn spawn_guard(&self, policy_path: &str) -> Background {
        let mut daemon = self.spawn_egress_fence(&["run", policy_path]);
        if !daemon.wait_for_output("the DNS guard is serving", Duration::from_secs(10)) {
            let _ = daemon.terminate();
            panic!("the guard did not start:\n{}", daemon.stderr());
        }
        daemon
    }

    /// Like [`World::spawn_egress_fence`], with extra environment variables (NOTIFY_SOCKET).
    pub fn spawn_egress_fence_with_env(&self, args: &[&str], env: &[(&str, &str)]) -> Background {
        let mut cmd = Command::new(EGRESS_FENCE_BIN);
        cmd.args(args).args(["--netns", &self.sandbox]);
        clean_env(&mut cmd)
            .env(STATE_DIR_ENV, self.state_dir())
            .envs(env.iter().copied());
        self.spawn_background(cmd, format!("egress-fence {}", args.join(" ")))
    }

    // --- internals ------------------------------------------------------------------------

    /// `ip netns exec NS ARGS`, with the world's egress-fence state directory in the
    /// environment.
    fn ns_command(&self, ns: &str, args: &[&str]) -> Command {
        let mut cmd = ns_command(ns, args);
        cmd.env(STATE_DIR_ENV, self.state_dir());
        cmd
    }

    fn dns_state(&self) -> MutexGuard<'_, Dns> {
        self.dns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn create_namespaces(&mut self) {
        {
            let _lock = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            let script = format!("netns add {}\nnetns add {}\n", self.sandbox, self.net);
            let out = run(
                Command::new("ip").args(["-batch", "-"]),
                Some(script.as_bytes()),
            );
            assert!(
                out.success(),
                "`ip netns add` failed: these tests need root in a VM or container that \
                 allows network namespaces (CAP_SYS_ADMIN + CAP_NET_ADMIN, iproute2 \
                 installed).\n{out}"
            );
        }
        let open =
            |p: PathBuf| File::open(&p).unwrap_or_else(|e| panic!("open {}: {e}", p.display()));
        self.sandbox_fd = Some(open(self.sandbox_path()));
        self.net_fd = Some(open(self.net_path()));
    }

    fn configure_links(&self) {
        // The veth pair is created inside the sandbox with its peer moved straight into the
        // net namespace: no interface ever exists in the root namespace.
        ip_batch(
            &self.sandbox,
            &[
                "link set lo up".into(),
                format!("link add eth0 type veth peer name veth0 netns {}", self.net),
            ],
        );
        let mut net = vec![
            "link set lo up".to_string(),
            format!("addr add {GATEWAY_V4}/24 dev veth0"),
            format!("addr add {GATEWAY_V6}/64 dev veth0 nodad"),
            "link set veth0 up".into(),
        ];
        for ip in DEFAULT_HOSTS.iter().chain(&[PROBE_V4, PROBE_V6]) {
            net.push(format!(
                "addr add {} dev lo {}",
                host_cidr(*ip),
                nodad(*ip).join(" ")
            ));
        }
        ip_batch(&self.net, &net);
        ip_batch(
            &self.sandbox,
            &[
                format!("addr add {SANDBOX_V4}/24 dev eth0"),
                format!("addr add {SANDBOX_V6}/64 dev eth0 nodad"),
                "link set eth0 up".into(),
                format!("route add default via {GATEWAY_V4}"),
                format!("route add default via {GATEWAY_V6}"),
            ],
        );
    }

    /// `ip netns exec` bind-mounts these over /etc/resolv.conf and /etc/hosts.
    fn write_sandbox_etc(&self) {
        {
            let _lock = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            fs::create_dir_all(&self.etc_dir)
                .unwrap_or_else(|e| panic!("create {}: {e}", self.etc_dir.display()));
        }
        let write = |name: &str, text: String| {
            let path = self.etc_dir.join(name);
            fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        };
        write(
            "resolv.conf",
            format!("nameserver {DNS_V4}\noptions timeout:2 attempts:1\n"),
        );
        write(
            "hosts",
            "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n".into(),
        );
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

    fn listen(&self, ip: IpAddr, port: u16, proto: Proto) -> Listener {
        let fd = self
            .net_fd
            .as_ref()
            .expect("net namespace exists")
            .try_clone()
            .expect("dup the net namespace fd");
        let (tx, rx) = mpsc::channel::<Result<Arc<ListenerShared>, String>>();
        let thread = thread::Builder::new()
            .name(format!("eft-{proto:?}-{port}"))
            .spawn(move || {
                let bound = (|| -> std::io::Result<Arc<ListenerShared>> {
                    // setns affects only this thread, ours, which ends with the listener.
                    nix::sched::setns(&fd, CloneFlags::CLONE_NEWNET)?;
                    let (socket, local) = match proto {
                        Proto::Tcp | Proto::TcpAny => {
                            let l = TcpListener::bind((ip, port))?;
                            l.set_nonblocking(true)?;
                            let local = l.local_addr()?;
                            (Socket::Tcp(l), local)
                        }
                        Proto::Udp => {
                            let u = UdpSocket::bind((ip, port))?;
                            u.set_nonblocking(true)?;
                            let local = u.local_addr()?;
                            (Socket::Udp(u), local)
                        }
                    };
                    Ok(Arc::new(ListenerShared {
                        socket,
                        local,
                        stop: AtomicBool::new(false),
                        hits: Mutex::new(Vec::new()),
                        arrived: Condvar::new(),
                        threaded: matches!(proto, Proto::TcpAny),
                    }))
                })();
                drop(fd);
                match bound {
                    Ok(shared) => {
                        let _ = tx.send(Ok(shared.clone()));
                        serve(&shared);
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                    }
                }
            })
            .expect("spawn a listener thread");
        let shared = match rx.recv() {
            Ok(Ok(shared)) => shared,
            Ok(Err(e)) => {
                let _ = thread.join();
                panic!(
                    "cannot listen on {proto:?} {ip}:{port} in {}: {e} \
                     (is {ip} a host of this world? see add_host)",
                    self.net
                )
            }
            Err(_) => panic!("the listener thread for {ip}:{port} died"),
        };
        self.listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::downgrade(&shared));
        Listener {
            shared,
            thread: Some(thread),
        }
    }

    fn spawn_background(&self, mut cmd: Command, what: String) -> Background {
        let n = self.file_counter.fetch_add(1, Ordering::Relaxed);
        let stdout_path = self.dir().join(format!("bg-{n}.stdout"));
        let stderr_path = self.dir().join(format!("bg-{n}.stderr"));
        let stdout = File::create(&stdout_path).expect("create background stdout file");
        let stderr = File::create(&stderr_path).expect("create background stderr file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        Background {
            child,
            what,
            stdout_path,
            stderr_path,
        }
    }
}

impl Default for World {
    fn default() -> Self {
        World::new()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Never panic here: this also runs while a failed test unwinds.
        for l in self
            .listeners
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            if let Some(l) = l.upgrade() {
                l.request_stop();
            }
        }
        let dns = self.dns.get_mut().unwrap_or_else(|e| e.into_inner());
        for d in [dns.main.take(), dns.rogue.take()].into_iter().flatten() {
            stop_child(d.child, "dnsmasq");
        }
        self.sandbox_fd = None;
        self.net_fd = None;
        let _lock = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        for ns in [&self.sandbox, &self.net] {
            remove_netns(ns);
        }
        remove_etc_dir(&self.etc_dir);
        // The temporary directory removes itself after this.
    }
}

struct Dns {
    /// name -> (addresses, ttl); every ttl equals `ttl` except transiently.
    records: BTreeMap<String, (Vec<IpAddr>, u32)>,
    /// alias -> target: CNAME records (dnsmasq's `--cname`), served by both resolvers.
    cnames: BTreeMap<String, String>,
    ttl: u32,
    main: Option<Dnsmasq>,
    rogue: Option<Dnsmasq>,
}

impl Dns {
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

// ---------------------------------------------------------------------------------------------
// Listener
// ---------------------------------------------------------------------------------------------

/// A TCP or UDP listener in the net namespace, served by a thread of the test process.
/// It stops when dropped (or when its world drops); what it recorded stays readable.
pub struct Listener {
    shared: Arc<ListenerShared>,
    thread: Option<JoinHandle<()>>,
}

/// One TCP connection or UDP datagram a [`Listener`] received.
#[derive(Clone, Debug)]
pub struct Hit {
    /// The client's address: the sandbox's address for traffic from the sandbox.
    pub peer: SocketAddr,
    /// The listener's own address.
    pub local: SocketAddr,
    /// When the connection was accepted or the datagram received.
    pub at: Instant,
    /// UDP: the payload. TCP: the request read (filled in once read, before the answer).
    pub data: Vec<u8>,
}

impl Listener {
    /// The address it listens on (with the real port when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.shared.local.port()
    }

    /// Everything received so far.
    pub fn hits(&self) -> Vec<Hit> {
        self.shared.lock_hits().clone()
    }

    /// Number of connections/datagrams so far.
    pub fn count(&self) -> usize {
        self.shared.lock_hits().len()
    }

    /// The client addresses so far.
    pub fn peers(&self) -> Vec<IpAddr> {
        self.shared
            .lock_hits()
            .iter()
            .map(|h| h.peer.ip())
            .collect()
    }

    /// Waits until at least `n` hits arrived; false after `timeout`. For non-arrival, check
    /// `!wait_for(1, short)` after the client gave up.
    pub fn wait_for(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut hits = self.shared.lock_hits();
        while hits.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            hits = self
                .shared
                .arrived
                .wait_timeout(hits, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Stops listening now (new connections are refused); hits stay readable.
    pub fn stop(&mut self) {
        self.shared.request_stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Clone, Copy, Debug)]
enum Proto {
    Tcp,
    Udp,
    /// TCP, one thread per connection, echo or HTTP ([`World::listen_tcp_any`]).
    TcpAny,
}

enum Socket {
    Tcp(TcpListener),
    Udp(UdpSocket),
}

struct ListenerShared {
    /// Owned here (not by the thread) so `request_stop` can never touch a reused fd.
    socket: Socket,
    local: SocketAddr,
    stop: AtomicBool,
    hits: Mutex<Vec<Hit>>,
    arrived: Condvar,
    /// Each connection is served by a thread of its own ([`handle_tcp_threaded`]).
    threaded: bool,
}

impl ListenerShared {
    fn fd(&self) -> RawFd {
        match &self.socket {
            Socket::Tcp(l) => l.as_raw_fd(),
            Socket::Udp(u) => u.as_raw_fd(),
        }
    }

    fn lock_hits(&self) -> MutexGuard<'_, Vec<Hit>> {
        self.hits.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, hit: Hit) -> usize {
        let mut hits = self.lock_hits();
        hits.push(hit);
        self.arrived.notify_all();
        hits.len() - 1
    }

    fn request_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes a thread blocked in poll at once (for UDP too, although it returns ENOTCONN);
        // the poll timeout in `serve` is the fallback.
        // SAFETY: shutdown on a socket fd that `self` owns and keeps open.
        unsafe { libc::shutdown(self.fd(), libc::SHUT_RDWR) };
    }
}

fn serve(shared: &Arc<ListenerShared>) {
    let fd = shared.fd();
    let mut buf = vec![0u8; 65536];
    while !shared.stop.load(Ordering::SeqCst) {
        if !poll_readable(fd, 100) || shared.stop.load(Ordering::SeqCst) {
            continue;
        }
        match &shared.socket {
            Socket::Tcp(l) => match l.accept() {
                Ok((stream, peer)) if shared.threaded => {
                    let shared = shared.clone();
                    // The thread inherits this thread's network namespace (it opens nothing).
                    let spawned = thread::Builder::new()
                        .name("eft-tcp-conn".into())
                        .spawn(move || handle_tcp_threaded(&shared, stream, peer));
                    if spawned.is_err() {
                        thread::sleep(Duration::from_millis(10));
                    }
                }
                Ok((stream, peer)) => handle_tcp(shared, stream, peer),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(_) => thread::sleep(Duration::from_millis(10)),
            },
            Socket::Udp(u) => match u.recv_from(&mut buf) {
                Ok((n, peer)) => {
                    shared.record(Hit {
                        peer,
                        local: shared.local,
                        at: Instant::now(),
                        data: buf[..n].to_vec(),
                    });
                    let _ = u.send_to(&buf[..n], peer);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(_) => thread::sleep(Duration::from_millis(10)),
            },
        }
    }
}

fn handle_tcp(shared: &ListenerShared, mut stream: std::net::TcpStream, peer: SocketAddr) {
    let index = shared.record(Hit {
        peer,
        local: shared.local,
        at: Instant::now(),
        data: Vec::new(),
    });
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    while !data.windows(4).any(|w| w == b"\r\n\r\n") && data.len() < 65536 {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => data.extend_from_slice(&buf[..n]),
        }
    }
    shared.lock_hits()[index].data = data;
    let body = format!("HTTP/1.0 200 OK\r\n\r\nhello from {}\n", shared.local);
    if stream.write_all(body.as_bytes()).is_ok() {
        let _ = stream.shutdown(Shutdown::Write);
        // Let the client close first so it never sees a reset.
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// A connection of a [`World::listen_tcp_any`] listener: records it (with the address the
/// client actually connected to), then answers an HTTP request (first bytes `GET `, `HEAD`,
/// `POST`) like [`handle_tcp`] does, or echoes everything else back until the client closes
/// it or the listener stops.
fn handle_tcp_threaded(shared: &ListenerShared, mut stream: std::net::TcpStream, peer: SocketAddr) {
    let canonical = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let local = stream.local_addr().map_or(shared.local, canonical);
    let index = shared.record(Hit {
        peer: canonical(peer),
        local,
        at: Instant::now(),
        data: Vec::new(),
    });
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    let mut http = None;
    // Bytes received before the kind of client was known: echoed once it is.
    let mut undecided = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        let n = match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => break,
        };
        let fresh = &buf[..n];
        if data.len() < 65536 {
            data.extend_from_slice(fresh);
        }
        if http.is_none() {
            undecided.extend_from_slice(fresh);
            if undecided.len() >= 4 || fresh.contains(&b'\n') {
                let methods = [&b"GET "[..], b"HEAD", b"POST"];
                http = Some(methods.iter().any(|m| undecided.starts_with(m)));
            }
        }
        match http {
            Some(true) if data.windows(4).any(|w| w == b"\r\n\r\n") => {
                let body = format!("HTTP/1.0 200 OK\r\n\r\nhello from {local}\n");
                if stream.write_all(body.as_bytes()).is_ok() {
                    let _ = stream.shutdown(Shutdown::Write);
                    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
                    while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
                }
                break;
            }
            Some(false) => {
                let echo = if undecided.is_empty() {
                    fresh
                } else {
                    &undecided[..]
                };
                if stream.write_all(echo).is_err() {
                    break;
                }
                undecided.clear();
            }
            _ => {}
        }
    }
    shared.lock_hits()[index].data = data;
}

fn poll_readable(fd: RawFd, timeout_ms: i32) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    n > 0
}

// ---------------------------------------------------------------------------------------------
// Command results
// ---------------------------------------------------------------------------------------------

/// What a finished command did.
#[derive(Clone, Debug)]
pub struct CmdOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl CmdOutput {
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// The exit code; 128 + N when killed by signal N. 124 means the 60 s timeout hit.
    pub fn code(&self) -> i32 {
        self.status
            .code()
            .unwrap_or_else(|| 128 + self.status.signal().unwrap_or(0))
    }
}

impl fmt::Display for CmdOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "exit code {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.code(),
            self.stdout.trim_end(),
            self.stderr.trim_end()
        )
    }
}

/// One resource record of a dig answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsRecord {
    /// As dig prints it, with the trailing dot.
    pub name: String,
    pub ttl: u32,
    pub rtype: String,
    pub data: String,
}

/// What `dig` got.
#[derive(Clone, Debug)]
pub struct DigResult {
    /// "NOERROR", "NXDOMAIN", "REFUSED", ...; `None` when no answer came (timeout,
    /// unreachable, connection refused, blocked).
    pub status: Option<String>,
    /// The header's flags as dig prints them ("qr", "aa", "tc", "rd", "ra", ...).
    pub flags: Vec<String>,
    pub answers: Vec<DnsRecord>,
    pub output: CmdOutput,
}

impl DigResult {
    fn parse(output: CmdOutput) -> DigResult {
        let mut status = None;
        let mut flags = Vec::new();
        let mut answers = Vec::new();
        for line in output.stdout.lines() {
            if let Some(rest) = line.strip_prefix(";; flags:") {
                // ";; flags: qr aa tc rd ra; QUERY: 1, ANSWER: 30, ..."
                let list = rest.split(';').next().unwrap_or_default();
                flags = list.split_whitespace().map(String::from).collect();
            } else if line.contains("->>HEADER<<-") {
                status = line
                    .split_once("status: ")
                    .and_then(|(_, s)| s.split(',').next())
                    .map(|s| s.trim().to_string());
            } else if !line.starts_with(';') && !line.trim().is_empty() {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() >= 5
                    && let Ok(ttl) = f[1].parse()
                {
                    answers.push(DnsRecord {
                        name: f[0].to_string(),
                        ttl,
                        rtype: f[3].to_string(),
                        data: f[4..].join(" "),
                    });
                }
            }
        }
        DigResult {
            status,
            flags,
            answers,
            output,
        }
    }

    /// Whether a response came back at all.
    pub fn answered(&self) -> bool {
        self.status.is_some()
    }

    /// The A and AAAA addresses of the answer, in answer order.
    pub fn addrs(&self) -> Vec<IpAddr> {
        self.answers
            .iter()
            .filter(|r| r.rtype == "A" || r.rtype == "AAAA")
            .filter_map(|r| r.data.parse().ok())
            .collect()
    }

    /// The addresses sorted, for comparisons (dnsmasq rotates the order).
    pub fn sorted_addrs(&self) -> Vec<IpAddr> {
        let mut a = self.addrs();
        a.sort();
        a
    }
}

/// `nft -j list ruleset` output without what legitimately differs between two loads of the
/// same table: handles, the order in which the kernel lists set elements, and counter values.
pub fn normalized_ruleset(mut v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    fn walk(v: &mut Value) {
        match v {
            Value::Object(map) => {
                map.remove("handle");
                for (key, value) in map.iter_mut() {
                    walk(value);
                    match (key.as_str(), value) {
                        ("elem", Value::Array(items)) => items.sort_by_key(|i| i.to_string()),
                        ("counter", Value::Object(counter)) => {
                            for count in ["packets", "bytes"] {
                                if let Some(n) = counter.get_mut(count) {
                                    *n = 0.into();
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v
}

// ---------------------------------------------------------------------------------------------
// Background processes
// ---------------------------------------------------------------------------------------------

/// A process running in the background; killed (SIGKILL) and reaped when dropped. Its output
/// goes to files in the world's directory, so drop it before the world (declare it after).
pub struct Background {
    child: Child,
    what: String,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
}

impl Background {
    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// Sends `sig` (e.g. SIGHUP to reload a daemon).
    pub fn signal(&self, sig: Signal) {
        kill(self.pid(), sig).unwrap_or_else(|e| panic!("send {sig} to {}: {e}", self.what));
    }

    pub fn stdout(&self) -> String {
        read_lossy(&self.stdout_path)
    }

    pub fn stderr(&self) -> String {
        read_lossy(&self.stderr_path)
    }

    /// Waits until stdout or stderr contains `needle`; false after `timeout` or once the
    /// process exited without printing it.
    pub fn wait_for_output(&mut self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let exited = matches!(self.child.try_wait(), Ok(Some(_)));
            if self.stdout().contains(needle) || self.stderr().contains(needle) {
                return true;
            }
            if exited || Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// The exit status if it exits within `timeout`.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(5)),
                _ => return None,
            }
        }
    }

    /// SIGTERM, then waits up to 5 s (SIGKILL after that); returns the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        let _ = kill(self.pid(), Signal::SIGTERM);
        if let Some(status) = self.wait_timeout(Duration::from_secs(5)) {
            return status;
        }
        let _ = self.child.kill();
        self.child
            .wait()
            .unwrap_or_else(|e| panic!("wait for {}: {e}", self.what))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn require_root() {
    if !nix::unistd::Uid::effective().is_root() {
        panic!(
            "these integration tests need root (they create network namespaces, veth pairs and \
             nftables rulesets inside them): run them as root in a VM or container that allows \
             network namespaces. They are never skipped."
        );
    }
}

/// Runs `f` on a scoped thread that first joins the namespace `ns` (setns is per thread, and
/// this thread is ours alone).
fn in_netns<T: Send>(ns: &File, f: impl FnOnce() -> T + Send) -> T {
    thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(ns, CloneFlags::CLONE_NEWNET).expect("setns into a test namespace");
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// Sends one DNS query for [`PROBE_NAME`] from `bind` to `server:53`; true if any answer
/// with the query's id comes back within `timeout`.
fn dns_probe(server: IpAddr, bind: IpAddr, timeout: Duration) -> bool {
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

/// Polls `f` every 100 ms until it holds (true) or `timeout` passes (false): for checks that
/// run commands.
pub fn within(timeout: Duration, f: impl FnMut() -> bool) -> bool {
    poll(timeout, Duration::from_millis(100), f)
}

/// Polls `f` every 2 ms until it is true (true) or `timeout` passes (false).
fn wait_until(timeout: Duration, f: impl FnMut() -> bool) -> bool {
    poll(timeout, Duration::from_millis(2), f)
}

fn poll(timeout: Duration, every: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(every);
    }
}

fn clean_env(cmd: &mut Command) -> &mut Command {
    for var in [
        "http_proxy",
        "https_proxy",
        "ftp_proxy",
        "all_proxy",
        "no_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "FTP_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("LC_ALL", "C")
}

fn ns_command(ns: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns]).args(args);
    clean_env(&mut cmd);
    cmd
}

fn with_timeout<'a>(args: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["timeout", "-k", "5", COMMAND_TIMEOUT_SECS];
    v.extend_from_slice(args);
    v
}

/// Runs `cmd` to completion, with `input` on its stdin (else /dev/null).
fn run(cmd: &mut Command, input: Option<&[u8]>) -> CmdOutput {
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    if let Some(input) = input {
        let mut stdin = child.stdin.take().expect("piped stdin");
        // Inputs are small (well below a pipe buffer), so this cannot deadlock.
        // A command may exit without reading its input: its output tells why.
        if let Err(e) = stdin.write_all(input)
            && e.kind() != ErrorKind::BrokenPipe
        {
            panic!("write stdin of {cmd:?}: {e}");
        }
    }
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("wait for {cmd:?}: {e}"));
    CmdOutput {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `ip -n <ns> -batch -` with `lines`; panics with ip's message on failure.
fn ip_batch(ns: &str, lines: &[String]) {
    let script = lines.join("\n") + "\n";
    let out = run(
        Command::new("ip").args(["-n", ns, "-batch", "-"]),
        Some(script.as_bytes()),
    );
    assert!(out.success(), "ip -n {ns} -batch failed:\n{script}{out}");
}

fn host_cidr(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(_) => format!("{ip}/32"),
        IpAddr::V6(_) => format!("{ip}/128"),
    }
}

/// IPv6 addresses skip duplicate address detection, so they are usable at once.
fn nodad(ip: IpAddr) -> &'static [&'static str] {
    match ip {
        IpAddr::V4(_) => &[],
        IpAddr::V6(_) => &["nodad"],
    }
}

fn unbracket(host: &str) -> String {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_string()
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

fn read_lossy(path: &Path) -> String {
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// SIGTERM, up to 2 s grace, then SIGKILL; always reaps.
fn stop_child(mut child: Child, what: &str) {
    let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return,
            Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(2)),
            _ => break,
        }
    }
    let _ = child.kill();
    if let Err(e) = child.wait() {
        eprintln!("warning: could not reap {what}: {e}");
    }
}

/// Kills whatever still runs in namespace `ns` (all of it was started by a test), then
/// deletes the namespace. Call with NETNS_LOCK held. Never panics.
fn remove_netns(ns: &str) {
    if !Path::new("/run/netns").join(ns).exists() {
        return;
    }
    let own = std::process::id();
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse::<u32>().ok())
            .filter(|p| *p != own)
        {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
        }
    }
    match Command::new("ip").args(["netns", "del", ns]).output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => eprintln!(
            "warning: ip netns del {ns}: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => eprintln!("warning: ip netns del {ns}: {e}"),
    }
}

/// Removes /etc/netns/<sandbox> and /etc/netns itself once empty. Call with NETNS_LOCK held.
fn remove_etc_dir(dir: &Path) {
    if dir.exists()
        && let Err(e) = fs::remove_dir_all(dir)
    {
        eprintln!("warning: remove {}: {e}", dir.display());
    }
    if let Some(parent) = dir.parent() {
        let _ = fs::remove_dir(parent); // fails (fine) while other worlds use it
    }
}

/// Removes what test processes that died without cleaning up (SIGKILL, abort) left behind:
/// namespaces "eft-<pid>-<n>-sb|net" (killing what runs in them), their /etc/netns entries and
/// temporary directories "eft-<pid>-<n>-*". Only names whose pid is dead are touched.
fn sweep_stale_worlds() {
    let stale = |name: &str, netns: bool| -> bool {
        let mut parts = name.splitn(4, '-');
        let (Some("eft"), Some(pid), Some(n), Some(rest)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return false;
        };
        let (Ok(pid), Ok(_)) = (pid.parse::<u32>(), n.parse::<u32>()) else {
            return false;
        };
        (!netns || rest == "sb" || rest == "net")
            && pid != std::process::id()
            && !Path::new(&format!("/proc/{pid}")).exists()
    };
    let _lock = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = std::env::temp_dir();
    for dir in [Path::new("/run/netns"), Path::new("/etc/netns"), &tmp] {
        let Ok(entries) = fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !stale(&name, dir != tmp) {
                continue;
            }
            eprintln!("removing stale test state {}", entry.path().display());
            if dir == Path::new("/run/netns") {
                remove_netns(&name);
            } else if dir == Path::new("/etc/netns") {
                remove_etc_dir(&entry.path());
            } else if let Err(e) = fs::remove_dir_all(entry.path()) {
                eprintln!("warning: remove {}: {e}", entry.path().display());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Wildcard records (appended for the probe tests)
// ---------------------------------------------------------------------------------------------

impl World {
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
}

// ---------------------------------------------------------------------------------------------
// The DNS guard's world (appended for the guard tests)
// ---------------------------------------------------------------------------------------------

/// Where the guard listens by default (`dns.listen: [127.0.0.53:53]`), in the sandbox.
pub const GUARD_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 53));
/// The guard's default listen address and port.
pub const GUARD_ADDR: SocketAddr = SocketAddr::new(GUARD_V4, 53);

/// The uid (and gid) of sandbox clients that must not pass as the guard: the guard runs as
/// root in the tests, and the table lets the guard's uid alone reach the upstream resolvers.
pub const NOBODY: u32 = 65534;

/// The system's python3, for scripts run in the namespaces: a user's shims (e.g. pyenv under
/// /root) are not readable by [`NOBODY`] or another user.
pub const PYTHON: &str = "/usr/bin/python3";

/// The first lines of a `python3 -c` script run as an [`Adversary`]: it exits non-zero when
/// CAP_NET_ADMIN is effective (then it is not the threat model's adversary and the test would
/// prove nothing). Imports `sys` and leaves the effective set in `cap_eff` for further checks
/// (CAP_NET_RAW is bit 13). Prepend it: `format!("{REFUSE_CAP_NET_ADMIN_PY}{SCRIPT}")`.
/// Counts the frames of ETHERTYPE arriving on veth0 (the sandbox's link, seen from the
/// world's network) that carry MARKER, for SECONDS; creates READY_FILE once bound. Prints the
/// count. Arguments: SECONDS READY_FILE MARKER ETHERTYPE.
const COUNT_MARKED_FRAMES: &str = r#"
import socket, sys, time
seconds, ready, marker = float(sys.argv[1]), sys.argv[2], sys.argv[3].encode()
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(int(sys.argv[4], 0)))
s.bind(('veth0', 0))
s.settimeout(0.2)
open(ready, 'w').close()
end, count = time.time() + seconds, 0
while time.time() < end:
    try:
        frame, addr = s.recvfrom(65535)
    except socket.timeout:
        continue
    if addr[2] != socket.PACKET_OUTGOING and marker in frame:
        count += 1
print(count)
"#;

impl World {
    /// Runs `during` while counting, for `seconds`, the frames of `ethertype` (0x0800 for
    /// IPv4, 0x86dd for IPv6) that reach the world's side of the sandbox's link carrying
    /// `marker`; returns the capture's output (the count on stdout) and what `during` gave.
    pub fn count_marked_frames<T: Send>(
        &self,
        ethertype: u16,
        marker: &str,
        seconds: u32,
        during: impl FnOnce() -> T + Send,
    ) -> (CmdOutput, T) {
        let ready = self.dir().join(format!("capture-ready-{marker}"));
        let ready_arg = ready.to_str().expect("utf-8 path").to_string();
        let (seconds, ethertype) = (seconds.to_string(), format!("{ethertype:#x}"));
        std::thread::scope(|scope| {
            let capture = scope.spawn(|| {
                self.net_cmd(&[
                    PYTHON,
                    "-c",
                    COUNT_MARKED_FRAMES,
                    &seconds,
                    &ready_arg,
                    marker,
                    &ethertype,
                ])
            });
            assert!(
                within(Duration::from_secs(5), || ready.exists()),
                "the capture did not start"
            );
            let during = during();
            (capture.join().expect("the capture thread"), during)
        })
    }
}

pub const REFUSE_CAP_NET_ADMIN_PY: &str = r#"
import sys
status = open('/proc/self/status').read().split('\n')
cap_eff = int([l for l in status if l.startswith('CapEff:')][0].split()[1], 16)
if cap_eff & (1 << 12):
    sys.exit('CAP_NET_ADMIN is effective')
"#;

/// A process inside the fence as the threat model has it: it lacks CAP_NET_ADMIN. Tests start
/// it as root in the sandbox and `setpriv` makes it the adversary before it execs
/// ([`World::adversary_cmd`], [`World::spawn_adversary`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adversary {
    /// An unprivileged user: uid and gid [`NOBODY`], no supplementary groups.
    Nobody,
    /// An unprivileged user with uid and gid N, no supplementary groups (another client than
    /// [`Adversary::Nobody`]).
    User(u32),
    /// uid 0 without CAP_NET_ADMIN that keeps CAP_NET_RAW: root in a container by Docker's
    /// default.
    RootWithoutNetAdmin,
    /// uid 0 without CAP_NET_ADMIN and CAP_NET_RAW (either may set a socket mark): root in a
    /// container that drops both, as the README advises.
    RootWithoutNetAdminOrNetRaw,
}

impl Adversary {
    /// `args` prefixed with the `setpriv` command that turns a root process into this
    /// adversary before it execs them.
    pub fn command(self, args: &[&str]) -> Vec<String> {
        let user = |uid: u32| {
            vec![
                format!("--reuid={uid}"),
                format!("--regid={uid}"),
                "--clear-groups".to_string(),
            ]
        };
        let without = |caps: &str| {
            vec![
                format!("--inh-caps={caps}"),
                format!("--bounding-set={caps}"),
            ]
        };
        let mut full = vec!["setpriv".to_string()];
        full.extend(match self {
            Adversary::Nobody => user(NOBODY),
            Adversary::User(uid) => user(uid),
            Adversary::RootWithoutNetAdmin => without("-net_admin"),
            Adversary::RootWithoutNetAdminOrNetRaw => without("-net_admin,-net_raw"),
        });
        full.push("--".into());
        full.extend(args.iter().map(|a| a.to_string()));
        full
    }
}

/// How many distinct IPv4 addresses the rotating pool has ([`pool_v4`]).
pub const POOL_V4_LEN: usize = 2 * 187;

/// The `i`-th address of the rotating IPv4 pool: even `i` in 192.0.2.64-192.0.2.250, odd `i`
/// in 203.0.113.64-203.0.113.250 (clear of the world's fixed hosts), repeating after
/// [`POOL_V4_LEN`]. Not a host until added ([`World::add_hosts`], [`World::rotating_pool`]).
pub fn pool_v4(i: usize) -> IpAddr {
    let k = i % POOL_V4_LEN;
    let host = 64 + (k / 2) as u8;
    if k.is_multiple_of(2) {
        IpAddr::V4(Ipv4Addr::new(192, 0, 2, host))
    } else {
        IpAddr::V4(Ipv4Addr::new(203, 0, 113, host))
    }
}

/// The `i`-th address of the IPv6 pool, 2001:db8:3::/64 (`i + 1` as the interface id): a
/// distinct address for every `i` below 2^32.
pub fn pool_v6(i: usize) -> IpAddr {
    let n = i as u32 + 1;
    IpAddr::V6(Ipv6Addr::new(
        0x2001,
        0xdb8,
        3,
        0,
        0,
        0,
        (n >> 16) as u16,
        n as u16,
    ))
}

/// One name of [`World::rotating_pool`] and the addresses its A and AAAA records hold.
#[derive(Clone, Debug)]
pub struct PoolName {
    pub name: String,
    pub addrs: Vec<IpAddr>,
}

impl PoolName {
    /// The IPv4 addresses (its A records).
    pub fn v4(&self) -> Vec<IpAddr> {
        self.addrs.iter().copied().filter(IpAddr::is_ipv4).collect()
    }

    /// The IPv6 addresses (its AAAA records).
    pub fn v6(&self) -> Vec<IpAddr> {
        self.addrs.iter().copied().filter(IpAddr::is_ipv6).collect()
    }
}

/// One element of a resolved set (`ADDR . PROTO . PORT`), as `nft list set` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetElement {
    pub addr: IpAddr,
    /// "tcp" or "udp".
    pub proto: String,
    pub port: u16,
    /// The element's lifetime when added (or refreshed).
    pub timeout: Option<Duration>,
    /// What is left of it.
    pub expires: Option<Duration>,
}

impl World {
    /// Makes every address of `ips` a host of the internet at once (one `ip -batch`; an
    /// address that is already there is fine).
    pub fn add_hosts(&self, ips: &[IpAddr]) {
        let lines: Vec<String> = ips
            .iter()
            .map(|ip| {
                format!(
                    "addr replace {} dev lo {}",
                    host_cidr(*ip),
                    nodad(*ip).join(" ")
                )
            })
            .collect();
        if !lines.is_empty() {
            ip_batch(&self.net, &lines);
        }
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

    /// A CDN-like zone: `count` names `r0.DOMAIN` .. `r{count-1}.DOMAIN`, name `i` answering
    /// the A records `pool_v4(i * v4_per_name + j)` for `j < v4_per_name` (so consecutive
    /// names rotate through the pool and it wraps after [`POOL_V4_LEN`] addresses) and, with
    /// `v6`, the AAAA record `pool_v6(i)` (distinct for every name). All addresses become
    /// hosts in one `ip -batch` and both resolvers serve the names after one reload, with the
    /// current TTL. Listen with [`World::listen_tcp_any`] to accept on all of them.
    pub fn rotating_pool(
        &self,
        domain: &str,
        count: usize,
        v4_per_name: usize,
        v6: bool,
    ) -> Vec<PoolName> {
        assert!(v4_per_name > 0 || v6, "a pool name needs an address");
        let pool: Vec<PoolName> = (0..count)
            .map(|i| {
                let mut addrs: Vec<IpAddr> = (0..v4_per_name)
                    .map(|j| pool_v4(i * v4_per_name + j))
                    .collect();
                if v6 {
                    addrs.push(pool_v6(i));
                }
                PoolName {
                    name: format!("r{i}.{domain}"),
                    addrs,
                }
            })
            .collect();
        let mut hosts: Vec<IpAddr> = pool.iter().flat_map(|p| p.addrs.clone()).collect();
        hosts.sort();
        hosts.dedup();
        self.add_hosts(&hosts);
        let records: Vec<(String, Vec<IpAddr>)> = pool
            .iter()
            .map(|p| (p.name.clone(), p.addrs.clone()))
            .collect();
        self.dns_set_many(&records, self.dns_ttl());
        pool
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

    /// Rewrites the sandbox's resolv.conf (`/etc/netns/<sandbox>/resolv.conf`) to name
    /// `server` alone, so that curl, getent and dig without `@` inside the sandbox ask it.
    /// Commands started afterwards see it.
    pub fn set_sandbox_nameserver(&self, server: IpAddr) {
        let path = self.etc_dir.join("resolv.conf");
        fs::write(
            &path,
            format!("nameserver {server}\noptions timeout:2 attempts:1\n"),
        )
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }

    /// Points the sandbox's resolv.conf at the DNS guard ([`GUARD_V4`]).
    pub fn use_guard_resolver(&self) {
        self.set_sandbox_nameserver(GUARD_V4);
    }

    /// Runs `args` inside the sandbox as user and group `uid` with no supplementary groups
    /// (`setpriv`), and waits for it (killed after 60 s). Use [`NOBODY`] for a client that
    /// must not pass as the guard.
    pub fn sandbox_cmd_as(&self, uid: u32, args: &[&str]) -> CmdOutput {
        self.adversary_cmd(Adversary::User(uid), args)
    }

    /// Runs `args` inside the sandbox as `who`, and waits for it (killed after 60 s).
    pub fn adversary_cmd(&self, who: Adversary, args: &[&str]) -> CmdOutput {
        let full = who.command(args);
        self.sandbox_cmd(&full.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// Starts `args` inside the sandbox as `who` in the background; killed when the handle
    /// drops.
    pub fn spawn_adversary(&self, who: Adversary, args: &[&str]) -> Background {
        let full = who.command(args);
        self.spawn_in_sandbox(&full.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// A TCP listener on `[::]:port` in the net namespace (dual stack: every IPv4 and IPv6
    /// host of the world, e.g. a whole [`World::rotating_pool`]). Each connection is served
    /// by a thread of its own: it is recorded with the address the client really connected
    /// to ([`Hit::local`], IPv4 without the `::ffff:` mapping, like [`Hit::peer`]), then an
    /// HTTP request (first bytes `GET `, `HEAD` or `POST`) is answered like
    /// [`World::listen_tcp`] does, and anything else is echoed back until the client closes
    /// (a long-lived connection). Do not combine it with another listener on the same port.
    pub fn listen_tcp_any(&self, port: u16) -> Listener {
        self.listen(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port, Proto::TcpAny)
    }

    /// The elements of the set `set` (e.g. "resolved4") of table inet egress_fence in the
    /// sandbox, with their timeouts (read from `nft list set`, which shows milliseconds where
    /// `nft -j` rounds down to seconds). Panics when the set cannot be listed.
    pub fn set_elements(&self, set: &str) -> Vec<SetElement> {
        let out = self.sandbox_cmd(&["nft", "list", "set", "inet", "egress_fence", set]);
        assert!(out.success(), "nft list set inet egress_fence {set}: {out}");
        parse_set_elements(&out.stdout)
            .unwrap_or_else(|e| panic!("cannot read the elements of {set} ({e}):\n{out}"))
    }

    /// The element of the resolved sets for `addr` on TCP `port`, if there is one.
    pub fn resolved_element(&self, addr: IpAddr, port: u16) -> Option<SetElement> {
        let set = if addr.is_ipv4() {
            "resolved4"
        } else {
            "resolved6"
        };
        self.set_elements(set)
            .into_iter()
            .find(|e| e.addr == addr && e.proto == "tcp" && e.port == port)
    }
}

/// The elements of a concatenated `ADDR . PROTO . PORT` set in `nft list set` output.
fn parse_set_elements(text: &str) -> Result<Vec<SetElement>, String> {
    let Some(start) = text.find("elements = {") else {
        return Ok(Vec::new()); // an empty set has no elements line
    };
    let body = &text[start + "elements = {".len()..];
    let body = &body[..body.find('}').ok_or("no closing brace")?];
    let mut elements = Vec::new();
    for item in body.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let t: Vec<&str> = item.split_whitespace().collect();
        if t.len() < 5 || t[1] != "." || t[3] != "." {
            return Err(format!("not ADDR . PROTO . PORT: {item:?}"));
        }
        let mut e = SetElement {
            addr: t[0].parse().map_err(|e| format!("{item:?}: {e}"))?,
            proto: match t[2] {
                "6" => "tcp".into(),
                "17" => "udp".into(),
                p => p.to_string(),
            },
            port: t[4].parse().map_err(|e| format!("{item:?}: {e}"))?,
            timeout: None,
            expires: None,
        };
        let mut rest = t[5..].iter();
        while let Some(key) = rest.next() {
            match *key {
                "timeout" => e.timeout = Some(parse_nft_duration(rest.next().unwrap_or(&""))?),
                "expires" => e.expires = Some(parse_nft_duration(rest.next().unwrap_or(&""))?),
                _ => {}
            }
        }
        elements.push(e);
    }
    Ok(elements)
}

/// "3s", "2s592ms", "1h2m", "1d" as nft prints durations.
fn parse_nft_duration(s: &str) -> Result<Duration, String> {
    let mut total = Duration::ZERO;
    let mut rest = s;
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let n: u64 = rest[..digits]
            .parse()
            .map_err(|_| format!("bad duration {s:?}"))?;
        rest = &rest[digits..];
        let unit = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        total += match &rest[..unit] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(60 * n),
            "h" => Duration::from_secs(3600 * n),
            "d" => Duration::from_secs(86400 * n),
            u => return Err(format!("unknown unit {u:?} in {s:?}")),
        };
        rest = &rest[unit..];
    }
    Ok(total)
}

// ---------------------------------------------------------------------------------------------
// systemd's notify socket
// ---------------------------------------------------------------------------------------------

/// A systemd-style notify socket (`NOTIFY_SOCKET`) in the world's directory, drained
/// continuously by a thread as systemd does, for waiting on `READY=1`.
pub struct NotifySocket {
    path: String,
    received: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
}

impl NotifySocket {
    /// Binds `name` (e.g. "notify.sock") inside [`World::dir`].
    pub fn new(w: &World, name: &str) -> NotifySocket {
        let path = w.dir().join(name);
        let socket = std::os::unix::net::UnixDatagram::bind(&path)
            .unwrap_or_else(|e| panic!("bind the notify socket {}: {e}", path.display()));
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .expect("set a read timeout");
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (sink, done) = (received.clone(), stop.clone());
        thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while !done.load(Ordering::Relaxed) {
                if let Ok(n) = socket.recv(&mut buf) {
                    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                    sink.lock().unwrap_or_else(|e| e.into_inner()).push(msg);
                }
            }
        });
        NotifySocket {
            path: path.to_str().expect("utf-8 path").to_string(),
            received,
            stop,
        }
    }

    /// The value for `NOTIFY_SOCKET`.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Waits for a datagram containing `needle`, taking the datagrams up to it; returns it.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut got = self.received.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(i) = got.iter().position(|m| m.contains(needle)) {
                    return got.drain(..=i).next_back();
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for NotifySocket {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

// ---------------------------------------------------------------------------------------------
// A minimal DNS client
// ---------------------------------------------------------------------------------------------

/// Record types for [`dns_ask`].
pub const RTYPE_A: u16 = 1;
pub const RTYPE_CNAME: u16 = 5;
pub const RTYPE_MX: u16 = 15;
pub const RTYPE_TXT: u16 = 16;
pub const RTYPE_AAAA: u16 = 28;

/// Response codes of [`DnsReply::rcode`].
pub const RCODE_NOERROR: u8 = 0;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_REFUSED: u8 = 5;

/// How [`dns_ask`] sends its query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// One datagram (no EDNS, so at most 512 bytes come back: more is truncated).
    Udp,
    /// A TCP connection with the two-byte length prefix.
    Tcp,
}

/// The data of an answer record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RData {
    /// A or AAAA.
    Addr(IpAddr),
    /// CNAME (lower case, without the trailing dot).
    Name(String),
    Other(Vec<u8>),
}

/// One record of the answer section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsAnswer {
    /// Lower case, without the trailing dot.
    pub name: String,
    pub rtype: u16,
    pub ttl: u32,
    pub data: RData,
}

/// A response [`dns_ask`] received.
#[derive(Clone, Debug)]
pub struct DnsReply {
    pub rcode: u8,
    /// The TC bit: the answer did not fit (ask again over TCP).
    pub truncated: bool,
    pub answers: Vec<DnsAnswer>,
}

impl DnsReply {
    /// The A and AAAA addresses of the answer section, in order.
    pub fn addrs(&self) -> Vec<IpAddr> {
        self.answers
            .iter()
            .filter_map(|a| match a.data {
                RData::Addr(ip) => Some(ip),
                _ => None,
            })
            .collect()
    }

    /// "NOERROR", "SERVFAIL", "NXDOMAIN", "REFUSED" or "RCODE<n>".
    pub fn rcode_name(&self) -> String {
        match self.rcode {
            RCODE_NOERROR => "NOERROR".into(),
            RCODE_SERVFAIL => "SERVFAIL".into(),
            RCODE_NXDOMAIN => "NXDOMAIN".into(),
            RCODE_REFUSED => "REFUSED".into(),
            n => format!("RCODE{n}"),
        }
    }
}

/// Asks `server` for `name`/`rtype` (class IN, recursion desired, no EDNS) over `transport`
/// and waits up to `timeout` for the response with the query's id. Sockets are opened in the
/// calling thread's network namespace: call it inside [`World::in_sandbox_ns`] to ask as a
/// sandbox process (as root, the test's user). Err: nothing usable came back (timeout, ICMP
/// error, reset, malformed response), with what happened.
pub fn dns_ask(
    server: SocketAddr,
    name: &str,
    rtype: u16,
    transport: Transport,
    timeout: Duration,
) -> Result<DnsReply, String> {
    static NEXT_ID: AtomicU32 = AtomicU32::new(0);
    let seed = std::process::id().wrapping_mul(2_654_435_761);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed).wrapping_add(seed) as u16;
    let query = dns_query(id, name, rtype).unwrap_or_else(|e| panic!("bad DNS name {name:?}: {e}"));
    let what = |e: std::io::Error| format!("{transport:?} {name} {rtype} to {server}: {e}");
    let deadline = Instant::now() + timeout;
    let left = || {
        let l = deadline.saturating_duration_since(Instant::now());
        if l.is_zero() {
            Err(std::io::Error::new(ErrorKind::TimedOut, "timed out"))
        } else {
            Ok(l)
        }
    };
    match transport {
        Transport::Udp => {
            let any: IpAddr = match server {
                SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
                SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
            };
            let sock = UdpSocket::bind((any, 0)).map_err(what)?;
            sock.connect(server).map_err(what)?;
            let reply =
                exchange::udp_blocking(&sock, &query, id, left().map_err(what)?).map_err(what)?;
            parse_dns_reply(&reply).map_err(|e| format!("{name}: {e}"))
        }
        Transport::Tcp => {
            let mut stream = std::net::TcpStream::connect_timeout(&server, left().map_err(what)?)
                .map_err(what)?;
            let reply =
                exchange::tcp_blocking(&mut stream, &query, left().map_err(what)?).map_err(what)?;
            if message::peek_id(&reply) != Some(id) {
                return Err(format!("{name}: a TCP response with another id"));
            }
            parse_dns_reply(&reply).map_err(|e| format!("{name}: {e}"))
        }
    }
}

/// A query for `name`/`rtype`, class IN, recursion desired, no EDNS (the library's codec).
fn dns_query(id: u16, name: &str, rtype: u16) -> Result<Vec<u8>, String> {
    let name = hickory_proto::rr::Name::from_ascii(name).map_err(|e| e.to_string())?;
    let question = hickory_proto::op::Query::query(name, rtype.into());
    message::query(id, [question], true, None)
        .to_vec()
        .map_err(|e| e.to_string())
}

fn parse_dns_reply(msg: &[u8]) -> Result<DnsReply, String> {
    use hickory_proto::rr::RData as Data;
    use hickory_proto::serialize::binary::BinEncodable;
    let reply = message::parse(msg, message::MAX_MESSAGE).map_err(|e| e.to_string())?;
    if reply.metadata.message_type != hickory_proto::op::MessageType::Response {
        return Err("not a response (QR clear)".into());
    }
    // Lower case, without the trailing dot.
    let text =
        |n: &hickory_proto::rr::Name| n.to_ascii().trim_end_matches('.').to_ascii_lowercase();
    let answers = reply
        .answers
        .iter()
        .map(|r| DnsAnswer {
            name: text(&r.name),
            rtype: r.record_type().into(),
            ttl: r.ttl,
            data: match &r.data {
                Data::A(a) => RData::Addr(IpAddr::V4(a.0)),
                Data::AAAA(a) => RData::Addr(IpAddr::V6(a.0)),
                Data::CNAME(c) => RData::Name(text(&c.0)),
                other => RData::Other(other.to_bytes().unwrap_or_default()),
            },
        })
        .collect();
    Ok(DnsReply {
        rcode: reply.metadata.response_code.low(),
        truncated: reply.metadata.truncation,
        answers,
    })
}
