//! The command line's arguments (clap): the commands, and the options several share.

use std::path::PathBuf;

use clap::builder::TypedValueParser;
use clap::{Args, Parser, Subcommand};
use egress_fence::core::policy::HumanDuration;
use egress_fence::state::{DEFAULT_KEEP, DEFAULT_STATE_DIR};

use super::schema::SCHEMA_HELP;

pub const EXIT_CODES: &str = "\
Exit codes:
  0  success; diff: nothing would change; replay: nothing would have been refused
  1  failure: the kernel refused the change, netlink or the namespace failed, no resolver,
     another writer kept the lock, a generation is corrupt;
     diff: something would change; confirm: too late, the change was already reverted;
     replay: the policy would have refused something of the trace
  2  invalid policy, trace or command line (the message names file:line:column);
     run: also when the kernel refused the policy's table (the namespace keeps the table
     in place, else gets a fail-closed one), or a user other than root could change the
     policy file or a directory above it; apply, run: also `action: audit` (learn's);
     learn: also a policy not in guard mode, no --duration/--until-stopped, or --out
     naming the start policy
  3  done, but some allowed names did not resolve: their entries are missing
  4  status: the table is not installed
  5  probe: at least one check failed (the boundary does not hold as the policy says)
  6  diff: the comparison itself failed (netlink, namespace, resolver)
  7  replay: nothing would have been refused of what the trace holds, but it is incomplete
     (its run lost records, or it has no end line), or a user other than root could have
     changed it";

/// A default-deny egress boundary for AI agent hosts, built on nftables.
///
/// egress-fence reads a YAML policy of allowed domains and networks, resolves the domains, and
/// installs one nftables table (inet egress_fence) that refuses every other outgoing packet,
/// logs refusals, and leaves every other table alone. Changes are atomic: the kernel applies
/// the whole table or nothing.
#[derive(Parser)]
#[command(version, after_help = EXIT_CODES)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Args)]
pub struct NamespaceArg {
    /// Work inside this network namespace: a name from `ip netns list` or a path such as
    /// /proc/PID/ns/net. Resolution and netlink both happen there; a named namespace's
    /// /etc/netns/NAME/resolv.conf is honoured as `ip netns exec` does.
    #[arg(long, value_name = "NS")]
    pub netns: Option<String>,
}

#[derive(Args)]
pub struct StateArgs {
    /// Where generations, the writers' lock and pending confirmations are kept, in one
    /// subdirectory per network namespace.
    #[arg(
        long,
        value_name = "DIR",
        env = "EGRESS_FENCE_STATE_DIR",
        default_value = DEFAULT_STATE_DIR
    )]
    pub state_dir: PathBuf,
}

#[derive(Args)]
pub struct LockArgs {
    /// How long to wait while another egress-fence writer (apply, rollback, confirm, the
    /// service) holds this namespace's lock, e.g. 30s or 2m.
    #[arg(long, value_name = "DURATION", default_value = "30s")]
    pub lock_timeout: HumanDuration,
}

#[derive(Args)]
pub struct WriterArgs {
    #[command(flatten)]
    pub state: StateArgs,
    #[command(flatten)]
    pub lock: LockArgs,
    /// How many generations to keep (the newest ones).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_KEEP,
          value_parser = clap::value_parser!(u16).range(1..).map(usize::from))]
    pub keep: usize,
}

#[derive(Args)]
pub struct Resolving {
    /// Where the resolvers come from when the policy names none (default: the named
    /// namespace's /etc/netns/NS/resolv.conf if it exists, else /etc/resolv.conf).
    #[arg(long, value_name = "FILE")]
    pub resolv_conf: Option<PathBuf>,
}

/// Who `probe` sends its attempts as, or from.
#[derive(Args)]
pub struct ProbeSender {
    /// Make the attempts as USER (a name, or a uid; not root): the table and the state are
    /// read with this command's privileges first, then a child process drops to USER's uid,
    /// gid and groups (keeping no capability) and makes every attempt. A uid without an
    /// account runs with the same number as its gid and no other groups.
    #[arg(long = "as", value_name = "USER")]
    pub run_as: Option<String>,
    /// Make the attempts from a throwaway container on bridge IFACE, as the forward path
    /// sees them: a network namespace with a veth attached to IFACE, ADDRESS (with its
    /// prefix, e.g. `efbr0=198.18.0.250/24`) on it and a default route via IFACE's address
    /// of the same family. Removed afterwards, also on failure or Ctrl-C. In guard mode the
    /// names are asked of the guard on IFACE's addresses. The fence is then the bridge host's
    /// forward hook: its `reject` answers from IFACE's addresses, and a refused datagram
    /// that meets silence is a WARN (its drop and a rate-limited ICMP error look alike).
    /// With `--as` too, the attempts are made as USER in the container.
    #[arg(long, value_name = "IFACE=ADDRESS")]
    pub from: Option<String>,
    /// Set on the child process that makes the attempts (`--as`, `--from`).
    #[arg(long, hide = true)]
    pub probe_child: bool,
    /// The child makes its attempts from this network namespace (`--from`).
    #[arg(long, hide = true, value_name = "PATH")]
    pub attempts_netns: Option<PathBuf>,
}

#[derive(Subcommand)]
pub enum Command {
    /// Validate a policy without touching the network or the kernel, and warn about what
    /// parses but is probably not meant (every command that reads a policy warns too).
    #[command(after_help = SCHEMA_HELP)]
    Check {
        #[arg(required_unless_present = "schema")]
        policy: Option<PathBuf>,
        /// Print the policy's JSON Schema instead (for editors; see below).
        #[arg(long, conflicts_with = "policy")]
        schema: bool,
    },
    /// Judge a recorded trace (`run --record FILE`, `learn`) against a candidate policy,
    /// without touching the network or the kernel: the names and flows it would have
    /// refused (by name, and by destination, protocol and port with the names that answered
    /// it and the uids), what a trace cannot tell (cgroups, flows without an owner under a
    /// scope), the allow entries nothing used (an include's named by preset) and wildcards
    /// that allowed a single name. Exits 0 when nothing would have been refused, 1 when
    /// something would, 2 for an unreadable trace or policy, 7 when nothing would of what the
    /// trace holds but it is incomplete (its run lost records, or it has no end line) or a
    /// user other than root could have changed it (keep traces where only root writes).
    #[command(after_help = EXIT_CODES)]
    Replay {
        trace: PathBuf,
        policy: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Resolve the policy's names and print the ruleset as nft text (what `apply` installs;
    /// `nft -c -f` checks it, `nft -f` would load it).
    Plan {
        policy: PathBuf,
        #[command(flatten)]
        target: NamespaceArg,
        #[command(flatten)]
        resolving: Resolving,
        /// Print the resolution and the ruleset as JSON instead.
        #[arg(long)]
        json: bool,
    },
    /// Resolve the policy's names and install the ruleset in one atomic transaction, unless
    /// the live table already matches it (then nothing is sent and it says "unchanged").
    /// Each change is recorded as a generation (see `history`, `rollback`).
    #[command(after_help = EXIT_CODES)]
    Apply {
        policy: PathBuf,
        #[command(flatten)]
        target: NamespaceArg,
        #[command(flatten)]
        resolving: Resolving,
        #[command(flatten)]
        writer: WriterArgs,
        /// Revert to the previous generation by itself unless `egress-fence confirm` runs
        /// within this time (e.g. 60s, 5m): for changes that could cut off the host's own
        /// management access. The revert runs in a process of its own that does not depend
        /// on this terminal.
        #[arg(long, value_name = "DURATION")]
        confirm_within: Option<HumanDuration>,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show what applying the policy would change in the live table (read back from the
    /// kernel): added and removed addresses, ports and rules. Exits 0 when nothing would
    /// change and 1 when something would, so provisioning can report "changed" honestly;
    /// 2 for an invalid policy, 6 when the comparison itself failed.
    #[command(after_help = EXIT_CODES)]
    Diff {
        policy: PathBuf,
        #[command(flatten)]
        target: NamespaceArg,
        #[command(flatten)]
        resolving: Resolving,
        /// Print the differences as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Reinstate the previous generation (or the one given with --to) exactly as it was
    /// applied, in one transaction, and record that as a new generation. A second rollback
    /// undoes the first.
    #[command(after_help = EXIT_CODES)]
    Rollback {
        /// The generation to reinstate (see `history`); default: the one before the newest.
        #[arg(long, value_name = "GEN")]
        to: Option<u64>,
        #[command(flatten)]
        target: NamespaceArg,
        #[command(flatten)]
        writer: WriterArgs,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the recorded generations, oldest first, and any change awaiting confirmation.
    History {
        #[command(flatten)]
        target: NamespaceArg,
        #[command(flatten)]
        state: StateArgs,
        /// Print the generations as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Keep the change applied with `apply --confirm-within`: its revert timer stands down.
    /// Exits 0 also when nothing awaits confirmation, and 1 when it is too late (the change
    /// was already reverted).
    #[command(after_help = EXIT_CODES)]
    Confirm {
        #[command(flatten)]
        target: NamespaceArg,
        #[command(flatten)]
        state: StateArgs,
        #[command(flatten)]
        lock: LockArgs,
    },
    /// Read the installed table back from the kernel, and say whether it still matches the
    /// newest generation (someone may have edited it with nft).
    #[command(after_help = EXIT_CODES)]
    Status {
        #[command(flatten)]
        target: NamespaceArg,
        #[command(flatten)]
        state: StateArgs,
        /// Print the status as JSON (with the fields `generation`, `drift` and `differences`).
        #[arg(long)]
        json: bool,
    },
    /// Apply the policy and keep it current, as a service: names are re-resolved as their
    /// TTLs run out and changed answers are sent as small element batches (the table is never
    /// reloaded for them); if anyone else changes or deletes the table, it is put back.
    /// SIGHUP reloads the policy (one that fails validation, or whose table the kernel
    /// refuses, is not adopted and the running one stays); SIGTERM and SIGINT stop and leave
    /// the boundary in place. Speaks systemd's notify protocol (READY once the table is live,
    /// STATUS, WATCHDOG). The policy file, every directory above it and every link followed
    /// must belong to root (or the user `run` runs as) and not be writable by group or
    /// others: a user who could change it would widen the fence at the next reload.
    ///
    /// A start that cannot put up the policy's table leaves a table already in place as it
    /// is, gives a namespace without one a fail-closed table (loopback and established
    /// connections only), and exits: 2 when only an edit of the policy can fix it (the unit
    /// does not restart then), else 1.
    ///
    /// With `dns.mode: guard` it is the host's resolver instead (point resolv.conf at
    /// `dns.listen`): a query for an allowed name (wildcards too) is forwarded to
    /// `dns.upstream`, and the answer is released only once its addresses are in the table;
    /// any other name is answered REFUSED (or NXDOMAIN) and never leaves the host. Only the
    /// guard's own upstream sockets (its mark `dns.mark` and its uid, both) may reach the
    /// upstream resolvers, so run the guard under a uid of its own and the agent under another.
    /// Changing `dns.mode` or `dns.listen` takes a restart, not a reload.
    Run {
        policy: PathBuf,
        #[command(flatten)]
        target: NamespaceArg,
        #[command(flatten)]
        resolving: Resolving,
        /// Delete the table when stopped (for throwaway hosts); by default it stays.
        #[arg(long)]
        teardown_on_exit: bool,
        /// Log lines as text or as JSON objects.
        #[arg(long, value_enum, default_value_t = LogFormat::Text)]
        log_format: LogFormat,
        /// Also log every refused packet (read from the policy's `log.group`) with what the
        /// daemon knows of its destination.
        #[arg(long)]
        log_drops: bool,
        /// Serve metrics in the Prometheus text format at GET /metrics on ADDR: a loopback
        /// address and port (127.0.0.1:9464, [::1]:9464) or the absolute path of a unix
        /// socket. Any other address is refused (exit 2). Off by default. Refused packets by
        /// the daemon's finer reasons (not in the policy, another port, ...) need --log-drops.
        #[arg(long, value_name = "ADDR")]
        metrics: Option<egress_fence::daemon::MetricsAddr>,
        /// Append a trace to FILE while enforcing (JSON lines: every name the guard is asked
        /// with its answer, every new flow with its uid, port and protocol). Made with mode
        /// 0600, never through a symbolic link. The input of `replay` and `learn`.
        #[arg(long, value_name = "FILE")]
        record: Option<PathBuf>,
        #[command(flatten)]
        writer: WriterArgs,
    },
    /// Learn a policy: run the fence in audit mode for a while, then write a policy that
    /// allows what was used.
    ///
    /// Needs `dns.mode: guard`. While it runs, the guard forwards every name and records it,
    /// and the table lets through what POLICY would refuse, logging it (NFLOG, with its uid:
    /// `watch` shows it as "audited, would be refused") under an audit window that the
    /// process renews every 10 s and that closes by itself 30 s after it stops (SIGKILL
    /// included): the table then refuses again. Everything leaves while it runs: run it
    /// where that is acceptable. The deny list, the guard's protections and DNS to other
    /// resolvers stay refused. At the end (--duration, or SIGTERM/SIGINT) the table enforces
    /// POLICY again, the trace is complete, and the learned policy goes to --out (or
    /// stdout), with what it added on stderr.
    #[command(after_help = EXIT_CODES)]
    #[command(group(clap::ArgGroup::new("how_long").required(true).args(["duration", "until_stopped"])))]
    Learn {
        /// The start policy (`action: audit` or not); it is never overwritten.
        policy: PathBuf,
        /// How long to audit, e.g. 10m. learn refuses to run without it or --until-stopped.
        #[arg(
            long,
            value_name = "DURATION",
            required_unless_present = "until_stopped",
            conflicts_with = "until_stopped"
        )]
        duration: Option<HumanDuration>,
        /// Audit until SIGTERM or SIGINT (Ctrl-C) instead of for a duration.
        #[arg(long)]
        until_stopped: bool,
        /// Write the learned policy to FILE (default: standard output). Never the start
        /// policy's file; an existing FILE is replaced.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
        /// Write the trace to FILE (appended, mode 0600; default: egress-fence-learn.jsonl in
        /// the current directory).
        #[arg(long, value_name = "FILE")]
        trace: Option<PathBuf>,
        /// Fold this many sibling names (or more) under one parent into one wildcard
        /// (default 10; never under a shared-hosting suffix `check` warns about).
        #[arg(long, value_name = "N")]
        fold_at: Option<usize>,
        #[command(flatten)]
        target: NamespaceArg,
        #[command(flatten)]
        resolving: Resolving,
        /// Log lines as text or as JSON objects.
        #[arg(long, value_enum, default_value_t = LogFormat::Text)]
        log_format: LogFormat,
        #[command(flatten)]
        writer: WriterArgs,
    },
    /// Print every refused packet as it happens, read from the table's NFLOG group (works
    /// inside any network namespace; no kernel log needed).
    ///
    /// In `dns.mode: guard` it also prints every DNS query the guard refused (the name, its
    /// type, who asked, the answer given), read from the running service's event socket in
    /// the namespace's state directory (guard-events.sock). When the service is not running
    /// yet, or restarts, watch reconnects by itself about every second.
    Watch {
        #[command(flatten)]
        target: NamespaceArg,
        /// The NFLOG group to read (default: the group of the installed table's log rule).
        #[arg(long)]
        group: Option<u16>,
        /// Exit after this many events (refused packets and refused DNS queries together).
        #[arg(long)]
        count: Option<u64>,
        /// Print JSON lines instead (refused queries have "protocol": "dns" and a "name";
        /// refused packets the table counted but never logged, over its log rate,
        /// "verdict": "unlogged" and "packets").
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        state: StateArgs,
    },
    /// Prove the boundary from inside it: allowed names resolve and their ports connect;
    /// deny presets, `probe.blocked` targets and rogue resolvers are refused (TCP and UDP,
    /// IPv4 and IPv6); a random name under `probe.exfil_domain` does not resolve. One line
    /// per check (PASS, FAIL, WARN, SKIP), then a summary; exits 0 only if nothing failed,
    /// so CI can gate on it: `egress-fence probe policy.yaml --netns sandbox || exit 1`.
    ///
    /// In `dns.mode: guard`: names are asked of the guard, which must refuse a random name
    /// outside the policy without forwarding it, and DNS straight to the upstream resolvers
    /// (UDP/TCP 53 and 853) must be refused. Only sockets with the guard's mark and uid may
    /// reach them and the probe marks none, so that holds for any uid it runs as.
    ///
    /// Every element of the installed resolved sets must be one the policy explains (an
    /// allowed name's, on its ports, within the lifetime cap). Last, the probe must fail to
    /// open a packet socket (AF_PACKET) and an XDP socket (AF_XDP): frames written to them
    /// pass every nftables rule (a process with CAP_NET_ADMIN skips this check), and to attach
    /// any tun or tap device: packets written there arrive as received, and the fence lets out
    /// the answers to a flow forged that way, and a forwarding host what it routes. So run it as
    /// the fenced user: `egress-fence probe policy.yaml --as agent` (or, by hand, `ip netns
    /// exec sandbox setpriv --reuid=agent --regid=agent --clear-groups egress-fence probe
    /// ...`).
    ///
    /// With a `scope:`, the fence applies only to the users, groups, cgroups and forwarded
    /// interfaces it lists. A probe whose traffic the scope leaves out opens its report with
    /// "USER is not in the scope: expect everything to pass", and then every attempt the
    /// fence would refuse must go through untouched (a refusal here FAILs); in guard mode DNS
    /// straight to the upstream resolvers stays refused, for everyone. `--as USER` and
    /// `--from IFACE=ADDRESS` prove the scope from a listed user and from a container.
    #[command(after_help = EXIT_CODES)]
    Probe {
        policy: PathBuf,
        #[command(flatten)]
        target: NamespaceArg,
        #[command(flatten)]
        resolving: Resolving,
        /// Read to learn whether the installed table is the service's (`run`).
        #[command(flatten)]
        state: StateArgs,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        sender: ProbeSender,
    },
    /// Delete the tool's table (and nothing else); a no-op if it is absent. The emergency
    /// exit: it takes no lock and records nothing (a running service puts the table back;
    /// stop it first).
    Teardown {
        #[command(flatten)]
        target: NamespaceArg,
    },
    /// Run one command fenced: in a network namespace of its own, connected to this
    /// namespace's network by pasta (Debian's `passt`), with the policy's table and DNS guard
    /// in front of it.
    ///
    /// The policy must be in `dns.mode: guard` (CMD's resolv.conf names the guard). CMD
    /// starts only once the table is read back and is the planned one; it gets a stripped
    /// environment (PATH, HOME, LANG, TERM, TZ and each --keep-env), no capability and
    /// no_new_privs. Its exit code is exec's (128 + N for a death by signal N); SIGINT and
    /// SIGTERM are passed to it. When it ends, or exec is killed, the namespace, the table,
    /// pasta and every process CMD started are gone. 2: an invalid or resolve-mode policy;
    /// 125: exec itself failed; 126/127: CMD could not be run or was not found; 99: with
    /// --canary, the canary tripped (whatever CMD's own code; stderr and the --report say
    /// which it was, and when CMD's own code is 99 with no trip, stderr says so too).
    Exec {
        /// The policy (`dns.mode: guard`).
        #[arg(long, value_name = "FILE")]
        policy: PathBuf,
        /// Run CMD as this user, with the user's groups. Default: the user who ran `sudo`
        /// ($SUDO_USER); without it exec refuses to run CMD as root unless told `--user root`
        /// (root without capabilities still owns the host's files: a cron job or unit it
        /// writes would later run outside the fence).
        #[arg(long, value_name = "USER")]
        user: Option<String>,
        /// Keep this variable of the caller's environment (repeatable).
        #[arg(long = "keep-env", value_name = "NAME")]
        keep_env: Vec<String>,
        /// Also write what the fence refused during the run (and CMD's exit code) to FILE as
        /// JSON. A summary goes to stderr either way (the policy needs `log.group`).
        #[arg(long, value_name = "FILE")]
        report: Option<PathBuf>,
        /// Put a fresh canary token that looks like a live credential in CMD's environment
        /// (CANARY_API_KEY=ck_live_...), with a URL that carries it
        /// (CANARY_WEBHOOK_URL=https://HOST/hook/TOKEN) and, at exit, say whether the token
        /// (raw, hex, base32 or base64) was asked as a DNS name or HOST was asked at all
        /// (refused or allowed; refused connections to HOST's addresses are listed); exit 99
        /// when either was. Needs `log.group`.
        #[arg(long)]
        canary: bool,
        /// With --canary: also write `CANARY_API_KEY=...` and `CANARY_WEBHOOK_URL=...` to this
        /// file (relative to CMD's working directory, exec's; no symbolic link on the way),
        /// removed when the run ends.
        #[arg(long, value_name = "PATH", requires = "canary")]
        canary_file: Option<PathBuf>,
        /// With --canary: the canary URL's HOST (default: a fresh
        /// `hooks-<random>.canary.invalid`, which nothing answers). Name one the policy
        /// allows to see where its connections would go.
        #[arg(long, value_name = "NAME", requires = "canary")]
        canary_host: Option<egress_fence::core::policy::DomainName>,
        #[command(flatten)]
        target: NamespaceArg,
        #[command(flatten)]
        resolving: Resolving,
        #[command(flatten)]
        state: StateArgs,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true, value_name = "CMD")]
        command: Vec<std::ffi::OsString>,
    },
    /// The inside of `exec` (its pid namespace's first process). Not for direct use.
    #[command(hide = true)]
    ExecChild {
        #[arg(long)]
        resolv_conf: PathBuf,
        #[arg(long)]
        go_fd: i32,
        #[arg(long)]
        parent: u32,
        #[arg(long)]
        user: Option<String>,
        #[arg(last = true, required = true)]
        command: Vec<std::ffi::OsString>,
    },
    /// Writes the man pages and shell completions, generated from these definitions, to DIR
    /// (scripts/package.sh). Not for direct use.
    #[command(hide = true)]
    PackageAssets { dir: PathBuf },
    /// Started by `apply --confirm-within`: waits for the deadline in a session of its own,
    /// then reverts unless the change was confirmed. Not for direct use.
    #[command(hide = true)]
    RevertTimer {
        #[arg(long)]
        token: String,
        /// Already out of the caller's session (a systemd unit, or the timer's second
        /// stage): wait here instead of leaving it first.
        #[arg(long)]
        stay: bool,
        #[command(flatten)]
        target: NamespaceArg,
        #[command(flatten)]
        writer: WriterArgs,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_revert_timer_is_hidden_and_keep_must_be_positive() {
        let help = Cli::command().render_help().to_string();
        assert!(!help.contains("revert-timer"), "{help}");
        assert!(
            help.contains("rollback") && help.contains("confirm"),
            "{help}"
        );
        assert!(Cli::try_parse_from(["egress-fence", "rollback", "--keep", "0"]).is_err());
        assert!(
            Cli::try_parse_from([
                "egress-fence",
                "apply",
                "p.yaml",
                "--confirm-within",
                "soon"
            ])
            .is_err()
        );
    }

    #[test]
    fn run_help_names_the_guards_mark_and_uid() {
        let mut cli = Cli::command();
        let run = cli.find_subcommand_mut("run").expect("the run command");
        let help = run.render_long_help().to_string();
        assert!(help.contains("mark `dns.mark` and its uid"), "{help}");
        assert!(!help.contains("Only this process's uid"), "{help}");
    }
}
