//! The world itself: its two namespaces, the veth link between them, the hosts of the
//! internet, the sandbox's /etc, and the cleanup (on drop and of worlds a dead test left).

use std::fs::{self, File};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, Once, Weak};
use std::thread;
use std::time::Duration;

use nix::sched::CloneFlags;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::addrs::*;
use super::egress_fence::STATE_DIR_ENV;
use super::listener::ListenerShared;
use super::process::{ns_command, run, wait_until};
use super::resolvers::{DEFAULT_DNS_TTL, Dns, dns_probe};

/// Serialises `ip netns add/del` and the creation/removal of `/etc/netns` between the worlds
/// of one test process (concurrent first-time `ip netns add` calls race on /run/netns).
static NETNS_LOCK: Mutex<()> = Mutex::new(());
static WORLD_COUNTER: AtomicU32 = AtomicU32::new(0);
static SWEEP: Once = Once::new();

/// A sandbox namespace and an "internet" namespace with DNS, hosts and listeners.
///
/// Create one per test with [`World::new`]; dropping it kills its processes, stops its
/// listeners, deletes both namespaces, `/etc/netns/<sandbox>` and its temporary files.
/// All methods take `&self`, so a world can be shared with scoped threads.
pub struct World {
    pub(super) sandbox: String,
    pub(super) net: String,
    /// Open handles on the namespaces, for `setns` in threads. `None` until created.
    pub(super) sandbox_fd: Option<File>,
    pub(super) net_fd: Option<File>,
    pub(super) dir: tempfile::TempDir,
    pub(super) etc_dir: PathBuf,
    pub(super) dns: Mutex<Dns>,
    pub(super) listeners: Mutex<Vec<Weak<ListenerShared>>>,
    pub(super) file_counter: AtomicU32,
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
            dns: Mutex::new(Dns::new(DEFAULT_DNS_TTL)),
            listeners: Mutex::new(Vec::new()),
            file_counter: AtomicU32::new(0),
        };
        world.create_namespaces();
        world.configure_links();
        world.write_sandbox_etc();

        world.start_resolvers();
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
        self.dns.get_mut().unwrap_or_else(|e| e.into_inner()).stop();
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

impl World {
    /// `ip netns exec NS ARGS`, with the world's egress-fence state directory in the
    /// environment.
    pub(super) fn ns_command(&self, ns: &str, args: &[&str]) -> Command {
        let mut cmd = ns_command(ns, args);
        cmd.env(STATE_DIR_ENV, self.state_dir());
        cmd
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
}
