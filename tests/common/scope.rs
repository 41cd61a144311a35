//! Scoped policies (issue 11) in a world: the table put up by the plan text or by `apply`,
//! clients in test cgroups and as other users, real test accounts, and a "container" namespace
//! on a bridge inside the sandbox, which then plays the container host.
//!
//! ```text
//!   container netns (<sandbox>-ct)        sandbox netns (the container host)      net netns
//!   eth0 198.18.0.2/24  <veth ct0>  efbr0 198.18.0.1/24 (bridge)                  (as before)
//!   default via 198.18.0.1                eth0 198.51.100.2 (uplink) --masquerade-->
//! ```
//!
//! Forwarding and NAT are switched on inside the sandbox only (its own sysctls and its own
//! `ip eft_test_nat` table); the container namespace and the bridge go when the
//! [`BridgedContainer`] drops, the cgroups when the [`TestCgroups`] drops, the accounts when the
//! [`TestAccount`] drops, also when a test panics.

use std::fs;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::egress_fence::{STATE_DIR_ENV, path_arg};
use super::process::{Background, CmdOutput, clean_env, run, with_timeout, within};
use super::world::World;

/// How [`put_up`] loads a scoped policy's table into the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopeLoad {
    /// `egress-fence plan POLICY` piped to `nft -f -` inside the sandbox: the plan text loads
    /// with nft, and nft encodes it (independent of egress-fence's netlink encoder).
    NftText,
    /// `egress-fence apply POLICY`, as the other tests run it (egress-fence's own encoding).
    Apply,
}

/// How the scope tests load their tables: through egress-fence's own encoder. That nft
/// loads the plan text to the same table is `tests/fence.rs`'s to show; switching this to
/// [`ScopeLoad::NftText`] runs every scope test against nft's encoding instead.
pub const SCOPE_LOAD: ScopeLoad = ScopeLoad::Apply;

/// Puts the table of `policy` up in the world's sandbox, `how` says by which path; panics with
/// the output when that fails.
pub fn put_up(w: &World, policy: &Path, how: ScopeLoad) {
    match how {
        ScopeLoad::NftText => {
            let plan = w.egress_fence(&["plan", path_arg(policy)]);
            assert!(plan.success(), "egress-fence plan: {plan}");
            let text = plan.stdout.clone();
            let out = w.nft_text_in(w.sandbox_name(), &text);
            assert!(out.success(), "nft -f of the plan text: {out}\n{text}");
        }
        ScopeLoad::Apply => {
            let out = w.egress_fence(&["apply", path_arg(policy)]);
            assert!(out.success(), "egress-fence apply: {out}");
        }
    }
}

impl World {
    /// `nft -f -` with `text`, inside namespace `ns` of this world. Entered with `nsenter
    /// --net` (the network namespace only): `ip netns exec` mounts a fresh /sys, where
    /// /sys/fs/cgroup is empty and nft could not resolve a cgroup path.
    pub fn nft_text_in(&self, ns: &str, text: &str) -> CmdOutput {
        let netns = format!("--net=/run/netns/{ns}");
        let mut cmd = Command::new("nsenter");
        cmd.args([netns.as_str(), "nft", "-f", "-"]);
        run(clean_env(&mut cmd), Some(text.as_bytes()))
    }

    /// Runs `args` in the sandbox from inside cgroup `cgroup` (a directory of
    /// [`TestCgroups`]): the shell moves itself there before it execs the client, so the
    /// client's first socket is the cgroup's. Killed after 60 s.
    pub fn sandbox_cmd_in_cgroup(&self, cgroup: &Path, args: &[&str]) -> CmdOutput {
        let procs = cgroup.join("cgroup.procs");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", r#"echo $$ > "$0" && exec "$@""#])
            .arg(&procs)
            .args(["ip", "netns", "exec", self.sandbox_name()])
            .args(with_timeout(args));
        clean_env(&mut cmd).env(STATE_DIR_ENV, self.state_dir());
        run(&mut cmd, None)
    }

    /// Like [`World::sandbox_cmd_in_cgroup`], but enters the sandbox with `nsenter --net` (the
    /// network namespace only), so that the client still sees the host's /sys/fs/cgroup (to
    /// move itself to another cgroup, as an attacker would). Killed after 60 s.
    pub fn sandbox_net_only_cmd_in_cgroup(&self, cgroup: &Path, args: &[&str]) -> CmdOutput {
        let procs = cgroup.join("cgroup.procs");
        let netns = format!("--net=/run/netns/{}", self.sandbox_name());
        let mut cmd = Command::new("sh");
        cmd.args(["-c", r#"echo $$ > "$0" && exec "$@""#])
            .arg(&procs)
            .args(["nsenter", netns.as_str()])
            .args(with_timeout(args));
        clean_env(&mut cmd).env(STATE_DIR_ENV, self.state_dir());
        run(&mut cmd, None)
    }

    /// Starts `args` in the background in the sandbox (`nsenter --net`) from inside cgroup
    /// `cgroup`; killed when the handle drops.
    pub fn spawn_net_only_in_cgroup(&self, cgroup: &Path, args: &[&str]) -> Background {
        let procs = cgroup.join("cgroup.procs");
        let netns = format!("--net=/run/netns/{}", self.sandbox_name());
        let mut cmd = Command::new("sh");
        cmd.args(["-c", r#"echo $$ > "$0" && exec "$@""#])
            .arg(&procs)
            .args(["nsenter", netns.as_str()])
            .args(args);
        clean_env(&mut cmd);
        self.spawn_background(cmd, args.join(" "))
    }

    /// `nc -z -v -w 2 HOST PORT` from the sandbox with `prefix` (e.g. a `setpriv`) in front.
    pub fn tcp_connect_with(&self, prefix: &[&str], host: IpAddr, port: u16) -> CmdOutput {
        let (host, port) = (host.to_string(), port.to_string());
        let mut args = prefix.to_vec();
        args.extend(["nc", "-z", "-v", "-w", "2", &host, &port]);
        self.sandbox_cmd(&args)
    }
}

/// `setpriv` arguments that run a client as `uid` with primary group `gid` and exactly the
/// supplementary `groups` (none: cleared).
pub fn as_ids(uid: u32, gid: u32, groups: &[u32]) -> Vec<String> {
    let mut v = vec![
        "setpriv".to_string(),
        format!("--reuid={uid}"),
        format!("--regid={gid}"),
    ];
    if groups.is_empty() {
        v.push("--clear-groups".into());
    } else {
        let list: Vec<String> = groups.iter().map(u32::to_string).collect();
        v.push(format!("--groups={}", list.join(",")));
    }
    v.push("--".into());
    v
}

static UNIQUE: AtomicU32 = AtomicU32::new(0);

/// A name unique to this test process and call: `<prefix>-<pid>-<n>`.
fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        UNIQUE.fetch_add(1, Ordering::Relaxed)
    )
}

/// The cgroup v2 hierarchy of this host (`/sys/fs/cgroup/unified` on a hybrid host).
pub fn cgroup2_mount() -> PathBuf {
    egress_fence::host::cgroup2_root().expect("a cgroup v2 hierarchy is mounted")
}

/// `egress-fence-test-<pid>-<n>` below the cgroup v2 root, with cgroups made below it; all of
/// them are removed on drop (what still runs in them is killed first).
pub struct TestCgroups {
    /// Relative to the cgroup v2 root, as a policy's `scope.cgroups` writes it.
    name: String,
    /// Every directory made, parents before children.
    made: Vec<PathBuf>,
}

impl TestCgroups {
    pub fn new() -> TestCgroups {
        let name = unique("egress-fence-test");
        let mut cgroups = TestCgroups {
            name,
            made: Vec::new(),
        };
        cgroups.make("");
        cgroups
    }

    /// Makes the cgroup `rel` ("fenced", "fenced/late") below the test's own; returns its
    /// directory.
    pub fn make(&mut self, rel: &str) -> PathBuf {
        let dir = self.dir(rel);
        fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        self.made.push(dir.clone());
        dir
    }

    /// The directory of cgroup `rel`.
    pub fn dir(&self, rel: &str) -> PathBuf {
        let top = cgroup2_mount().join(&self.name);
        if rel.is_empty() { top } else { top.join(rel) }
    }

    /// `rel` as the policy lists it (relative to the cgroup v2 root).
    pub fn policy_path(&self, rel: &str) -> String {
        format!("{}/{rel}", self.name)
    }
}

impl Default for TestCgroups {
    fn default() -> Self {
        TestCgroups::new()
    }
}

impl Drop for TestCgroups {
    fn drop(&mut self) {
        // Never panic: this also runs while a failed test unwinds.
        for dir in self.made.iter().rev() {
            let gone = within(Duration::from_secs(5), || {
                if let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) {
                    for pid in procs.lines().filter_map(|p| p.parse::<i32>().ok()) {
                        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                    }
                }
                fs::remove_dir(dir).is_ok() || !dir.exists()
            });
            if !gone {
                eprintln!(
                    "warning: could not remove the test cgroup {}",
                    dir.display()
                );
            }
        }
    }
}

/// A real user and group `egress-fence-t-<pid>-<n>` (useradd/groupadd, for members of a listed
/// group: egress-fence reads them from /etc/group), deleted on drop.
pub struct TestAccount {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

impl TestAccount {
    /// A group and a user who is a member (supplementary) of it; the user's primary group is
    /// another one that exists everywhere ("users" where there is one, else root's: tests set
    /// the groups of its processes with `setpriv` anyway).
    pub fn member_of_new_group() -> TestAccount {
        let primary_gid = getent_gid("users").unwrap_or(0);
        let name = unique("egress-fence-t");
        let out = run(Command::new("groupadd").args(["--system", &name]), None);
        assert!(out.success(), "groupadd {name}: {out}");
        // The guard owns the removal from here on.
        let mut account = TestAccount {
            name: name.clone(),
            uid: u32::MAX,
            gid: u32::MAX,
        };
        let out = run(
            Command::new("useradd").args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "--gid",
                &primary_gid.to_string(),
                "--groups",
                &name,
                &name,
            ]),
            None,
        );
        assert!(out.success(), "useradd {name}: {out}");
        account.uid = id_of(&["-u", &name]);
        account.gid = getent_gid(&name).unwrap_or_else(|| panic!("no gid for group {name}"));
        account
    }
}

impl Drop for TestAccount {
    fn drop(&mut self) {
        for (tool, what) in [("userdel", "user"), ("groupdel", "group")] {
            match Command::new(tool).arg(&self.name).output() {
                Ok(out) if out.status.success() => {}
                Ok(out) => eprintln!(
                    "warning: {tool} {}: {}",
                    self.name,
                    String::from_utf8_lossy(&out.stderr)
                ),
                Err(e) => eprintln!("warning: remove the test {what} {}: {e}", self.name),
            }
        }
    }
}

fn id_of(args: &[&str]) -> u32 {
    let out = run(Command::new("id").args(args), None);
    assert!(out.success(), "id {args:?}: {out}");
    out.stdout.trim().parse().expect("id prints a number")
}

fn getent_gid(group: &str) -> Option<u32> {
    let out = run(Command::new("getent").args(["group", group]), None);
    if !out.success() {
        return None;
    }
    out.stdout
        .split(':')
        .nth(2)
        .and_then(|g| g.trim().parse().ok())
}

/// The bridge's name in the sandbox, as `scope.forward` lists it.
pub const BRIDGE: &str = "efbr0";

/// A scope that forwards [`BRIDGE`]: its containers may reach HOST_V4:443, and ask the
/// policy's resolver (resolve mode, no guard on the bridge); nothing else.
pub const BRIDGE_POLICY: &str = r#"
version: 1
action: reject
scope:
  forward: [efbr0]
allow:
  - cidr: 192.0.2.10/32
    ports: [443]
dns:
  resolvers: [192.0.2.53]
"#;
/// The bridge's address: the container host seen from the container (its gateway).
pub const BRIDGE_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1));
/// The container's address.
pub const CONTAINER_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 18, 0, 2));

/// A "container": namespace `<sandbox>-ct` with `eth0` on the sandbox's bridge [`BRIDGE`],
/// routed out through the sandbox (forwarding on, masquerade to its uplink, both in the
/// sandbox only). Removed on drop: declare it after the world.
pub struct BridgedContainer {
    ns: String,
    sandbox: String,
}

impl BridgedContainer {
    pub fn new(w: &World) -> BridgedContainer {
        let ns = format!("{}-ct", w.sandbox_name());
        let out = run(Command::new("ip").args(["netns", "add", &ns]), None);
        assert!(out.success(), "ip netns add {ns}: {out}");
        let container = BridgedContainer {
            ns: ns.clone(),
            sandbox: w.sandbox_name().to_string(),
        };
        ip_batch(
            &container.sandbox,
            &[
                format!("link add {BRIDGE} type bridge"),
                format!("addr add {BRIDGE_V4}/24 dev {BRIDGE}"),
                format!("link set {BRIDGE} up"),
                format!("link add ct0 type veth peer name eth0 netns {ns}"),
                format!("link set ct0 master {BRIDGE}"),
                "link set ct0 up".into(),
            ],
        );
        ip_batch(
            &ns,
            &[
                "link set lo up".into(),
                format!("addr add {CONTAINER_V4}/24 dev eth0"),
                "link set eth0 up".into(),
                format!("route add default via {BRIDGE_V4}"),
            ],
        );
        let forwarding = w.sandbox_cmd(&["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]);
        assert!(forwarding.success(), "{forwarding}");
        let nat = w.nft_text_in(
            w.sandbox_name(),
            "table ip eft_test_nat {\n\tchain postrouting {\n\t\ttype nat hook postrouting \
             priority srcnat; policy accept;\n\t\tip saddr 198.18.0.0/24 oifname \"eth0\" \
             masquerade\n\t}\n}\n",
        );
        assert!(nat.success(), "the sandbox's NAT table: {nat}");
        // Any answer from the bridge address (a RST from a closed port too) is a working link.
        let up = within(Duration::from_secs(5), || {
            let out = container.tcp_connect(BRIDGE_V4, 9);
            out.success() || out.stderr.contains("refused")
        });
        assert!(up, "the container does not reach its bridge");
        container
    }

    pub fn name(&self) -> &str {
        &self.ns
    }

    /// Runs `args` in the container (`ip netns exec`) and waits for it (killed after 60 s).
    pub fn cmd(&self, args: &[&str]) -> CmdOutput {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns])
            .args(with_timeout(args));
        run(clean_env(&mut cmd), None)
    }

    /// `nc -z -v -w 2 HOST PORT` from the container.
    pub fn tcp_connect(&self, host: IpAddr, port: u16) -> CmdOutput {
        let (host, port) = (host.to_string(), port.to_string());
        self.cmd(&["nc", "-z", "-v", "-w", "2", &host, &port])
    }

    /// `dig +tries=1 +time=2 @SERVER NAME A` from the container; the output.
    pub fn dig(&self, server: IpAddr, name: &str) -> CmdOutput {
        let server = format!("@{server}");
        self.cmd(&[
            "dig",
            "+tries=1",
            "+time=2",
            "+noall",
            "+comments",
            "+answer",
            &server,
            name,
            "A",
        ])
    }
}

impl Drop for BridgedContainer {
    fn drop(&mut self) {
        // Never panic. The veth and the bridge go with the namespaces; the bridge is removed
        // here as well, in case the world outlives the container.
        if let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &self.ns])
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
            {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
        let _ = Command::new("ip")
            .args(["-n", &self.sandbox, "link", "del", BRIDGE])
            .output();
        // Give the kernel a moment to tear the veth down before the world deletes its side.
        thread::sleep(Duration::from_millis(10));
    }
}

fn ip_batch(ns: &str, lines: &[String]) {
    let script = lines.join("\n") + "\n";
    let out = run(
        Command::new("ip").args(["-n", ns, "-batch", "-"]),
        Some(script.as_bytes()),
    );
    assert!(out.success(), "ip -n {ns} -batch failed:\n{script}{out}");
}
