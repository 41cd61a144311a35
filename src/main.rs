//! The command line: parse arguments, call the library, print, exit with a documented code.

#![forbid(unsafe_code)]

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};

use clap::builder::TypedValueParser;
use clap::{Args, Parser, Subcommand};
use egress_fence::change::{
    self, ApplyOutcome, ConfirmOutcome, ConfirmRequest, Drift, Planned, RevertOutcome, TimerWake,
    Writer,
};
use egress_fence::core::diff::{CompareOptions, TableDiff, compare};
use egress_fence::core::plan::{denied_answers, plan};
use egress_fence::core::policy::{Interval, Policy, PolicyError, Preset};
use egress_fence::core::resolution::Resolution;
use egress_fence::core::ruleset::TABLE;
use egress_fence::daemon;
use egress_fence::dns::resolve::resolve_policy;
use egress_fence::netns::Netns;
use egress_fence::nft::Nft;
use egress_fence::nft::live::Destinations;
use egress_fence::probe::{self, ProbeOptions};
use egress_fence::state::{
    self, CRASH_BEFORE_RENAME_ENV, DEFAULT_KEEP, DEFAULT_STATE_DIR, PendingConfirm, StateDir,
    WriterLock,
};
use egress_fence::watch::Watcher;
use tracing::{error, info, warn};

const EXIT_CODES: &str = "\
Exit codes:
  0  success; diff: nothing would change
  1  failure: the kernel refused the change, netlink or the namespace failed, no resolver,
     another writer kept the lock, a generation is corrupt;
     diff: something would change; confirm: too late, the change was already reverted
  2  invalid policy or command line (the message names file:line:column);
     run: also when the kernel refused the policy's table (the namespace keeps the table
     in place, else gets a fail-closed one)
  3  done, but some allowed names did not resolve: their entries are missing
  4  status: the table is not installed
  5  probe: at least one check failed (the boundary does not hold as the policy says)
  6  diff: the comparison itself failed (netlink, namespace, resolver)";

const SCHEMA: &str = "\
Policy schema (YAML):
  version: 1                      # required
  action: reject                  # unmatched traffic: reject (fails fast) or drop
  allow:                          # destinations that may be reached
    - domain: api.example.com     # resolved to A and AAAA; or `cidr: 203.0.113.0/28`
      ports: [443, \"8000-8080\"]   # required for a domain; a cidr without it: every port
      protocol: tcp               # tcp (default), udp or any (both)
      comment: model API          # free text
  deny:                           # checked before allow: deny wins
    - preset: cloud-metadata      # or private-networks, dns-over-https; or `cidr: 10.0.0.0/8`
  dns:
    resolvers: [192.0.2.53]       # default: the nameservers of resolv.conf
    # mode: guard                 # be the host's resolver (`upstream:`): see `run --help`
  log:
    prefix: \"EGRESS-DROP: \"       # default as shown
    group: 100                    # NFLOG group for refused packets (default: kernel log)
    rate: 10/second               # log rate limit, with `burst: 20`
  essentials: [loopback, established, icmpv6-nd, dhcpv4, dhcpv6]   # default: all";

/// A default-deny egress boundary for AI agent hosts, built on nftables.
///
/// egress-fence reads a YAML policy of allowed domains and networks, resolves the domains, and
/// installs one nftables table (inet egress_fence) that refuses every other outgoing packet,
/// logs refusals, and leaves every other table alone. Changes are atomic: the kernel applies
/// the whole table or nothing.
#[derive(Parser)]
#[command(version, after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct Target {
    /// Work inside this network namespace: a name from `ip netns list` or a path such as
    /// /proc/PID/ns/net. Resolution and netlink both happen there; a named namespace's
    /// /etc/netns/NAME/resolv.conf is honoured as `ip netns exec` does.
    #[arg(long, value_name = "NS")]
    netns: Option<String>,
}

#[derive(Args)]
struct StateArgs {
    /// Where generations, the writers' lock and pending confirmations are kept, in one
    /// subdirectory per network namespace.
    #[arg(
        long,
        value_name = "DIR",
        env = "EGRESS_FENCE_STATE_DIR",
        default_value = DEFAULT_STATE_DIR
    )]
    state_dir: PathBuf,
}

#[derive(Args)]
struct LockArgs {
    /// How long to wait while another egress-fence writer (apply, rollback, confirm, the
    /// service) holds this namespace's lock, e.g. 30s or 2m.
    #[arg(long, value_name = "DURATION", default_value = "30s")]
    lock_timeout: Interval,
}

#[derive(Args)]
struct WriterArgs {
    #[command(flatten)]
    state: StateArgs,
    #[command(flatten)]
    lock: LockArgs,
    /// How many generations to keep (the newest ones).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_KEEP,
          value_parser = clap::value_parser!(u16).range(1..).map(usize::from))]
    keep: usize,
}

#[derive(Args)]
struct Resolving {
    /// Where the resolvers come from when the policy names none (default: the named
    /// namespace's /etc/netns/NS/resolv.conf if it exists, else /etc/resolv.conf).
    #[arg(long, value_name = "FILE")]
    resolv_conf: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a policy without touching the network or the kernel, and warn about what
    /// parses but is probably not meant (every command that reads a policy warns too).
    #[command(after_help = SCHEMA)]
    Check { policy: PathBuf },
    /// Resolve the policy's names and print the ruleset as nft text (what `apply` installs;
    /// `nft -c -f` checks it, `nft -f` would load it).
    Plan {
        policy: PathBuf,
        #[command(flatten)]
        target: Target,
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
        target: Target,
        #[command(flatten)]
        resolving: Resolving,
        #[command(flatten)]
        writer: WriterArgs,
        /// Revert to the previous generation by itself unless `egress-fence confirm` runs
        /// within this time (e.g. 60s, 5m): for changes that could cut off the host's own
        /// management access. The revert runs in a process of its own that does not depend
        /// on this terminal.
        #[arg(long, value_name = "DURATION")]
        confirm_within: Option<Interval>,
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
        target: Target,
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
        target: Target,
        #[command(flatten)]
        writer: WriterArgs,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the recorded generations, oldest first, and any change awaiting confirmation.
    History {
        #[command(flatten)]
        target: Target,
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
        target: Target,
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
        target: Target,
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
    /// STATUS, WATCHDOG).
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
        target: Target,
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
        target: Target,
        /// The NFLOG group to read (default: the group of the installed table's log rule).
        #[arg(long)]
        group: Option<u16>,
        /// Exit after this many events (refused packets and refused DNS queries together).
        #[arg(long)]
        count: Option<u64>,
        /// Print JSON lines instead (refused queries have "protocol": "dns" and a "name").
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
    /// pass every nftables rule (a process with CAP_NET_ADMIN skips this check). So run it as
    /// the fenced user, e.g. `ip netns exec sandbox setpriv --reuid=agent --regid=agent
    /// --clear-groups egress-fence probe ...`.
    #[command(after_help = EXIT_CODES)]
    Probe {
        policy: PathBuf,
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        resolving: Resolving,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete the tool's table (and nothing else); a no-op if it is absent. The emergency
    /// exit: it takes no lock and records nothing (a running service puts the table back;
    /// stop it first).
    Teardown {
        #[command(flatten)]
        target: Target,
    },
    /// Started by `apply --confirm-within`: waits for the deadline in a session of its own,
    /// then reverts unless the change was confirmed. Not for direct use.
    #[command(hide = true)]
    RevertTimer {
        #[arg(long)]
        token: String,
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        writer: WriterArgs,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Structured logs on stderr (the journal when run by systemd); RUST_LOG overrides the level.
fn init_logging(format: LogFormat) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// How often `watch` reads the table again for its notes.
const WATCH_REREAD: Duration = Duration::from_secs(10);

const EXIT_FAILURE: u8 = 1;
const EXIT_BAD_POLICY: u8 = 2;
const EXIT_UNRESOLVED: u8 = 3;
const EXIT_NOT_INSTALLED: u8 = 4;
const EXIT_PROBE_FAILED: u8 = 5;
const EXIT_DIFF_FAILED: u8 = 6;
/// `diff`: something would change.
const EXIT_CHANGES: u8 = 1;

/// A failure and the exit code it maps to.
struct Failure {
    code: u8,
    error: anyhow::Error,
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Failure {
        let error = e.into();
        let code = if error.is::<PolicyError>() {
            EXIT_BAD_POLICY
        } else {
            EXIT_FAILURE
        };
        Failure { code, error }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            // Our errors carry their causes in their own messages: the outermost one is the
            // whole story (the alternate form would repeat each cause).
            eprintln!("egress-fence: {}", f.error);
            ExitCode::from(f.code)
        }
    }
}

/// Enters the namespace (before any thread exists) and returns the resolv.conf to use.
fn enter(target: &Target, resolving: Option<&Resolving>) -> Result<PathBuf, Failure> {
    let ns = target.netns.as_deref().map(Netns::parse);
    if let Some(ns) = &ns {
        ns.enter()?;
    }
    let given = resolving.and_then(|r| r.resolv_conf.clone());
    Ok(given
        .or_else(|| ns.and_then(|ns| ns.resolv_conf()))
        .unwrap_or_else(|| PathBuf::from("/etc/resolv.conf")))
}

fn load(path: &Path) -> Result<Policy, Failure> {
    load_with_text(path).map(|(policy, _)| policy)
}

fn load_with_text(path: &Path) -> Result<(Policy, String), Failure> {
    let (policy, text) = Policy::load_with_text(path)?;
    for w in policy.warnings_in(&text, path) {
        eprintln!("warning: {w}");
    }
    Ok((policy, text))
}

/// The state directory of the namespace `target` names. Worked out before entering it: a
/// namespace given as a path is named by its file's inode.
fn state_dir(target: &Target, args: &StateArgs) -> Result<StateDir, Failure> {
    let ns = target.netns.as_deref().map(Netns::parse);
    let name = state::namespace_dir_name(ns.as_ref())?;
    Ok(StateDir::new(&args.state_dir, &name))
}

/// Takes the namespace's writers' lock, saying once on stderr whom it waits for.
fn lock(state: &StateDir, command: &str, args: &LockArgs) -> Result<WriterLock, Failure> {
    Ok(state.lock(command, args.lock_timeout.0, |holder| {
        eprintln!("waiting for the lock held by {holder}");
    })?)
}

/// Resolves and plans `path`, warning about names on stderr.
fn resolve_and_plan(path: &Path, resolv_conf: &Path) -> Result<Planned, Failure> {
    let (policy, planned) = resolve_and_plan_quietly(path, resolv_conf)?;
    report_resolution(&policy, &planned.resolution);
    Ok(planned)
}

/// Like [`resolve_and_plan`], leaving the warnings about the resolution to the caller.
fn resolve_and_plan_quietly(path: &Path, resolv_conf: &Path) -> Result<(Policy, Planned), Failure> {
    let (policy, policy_text) = load_with_text(path)?;
    let resolution = resolve_policy(&policy, resolv_conf)?;
    let ruleset = plan(&policy, &resolution);
    let planned = Planned {
        policy_path: std::path::absolute(path).unwrap_or_else(|_| path.to_owned()),
        policy_text,
        resolution,
        ruleset,
    };
    Ok((policy, planned))
}

/// The command that starts a revert timer: this very binary (/proc/self/exe stays the running
/// one even if an upgrade replaced the file), with the namespace and state directory of the
/// change it guards.
fn revert_timer_command(
    token: &str,
    target: &Target,
    writer: &WriterArgs,
) -> std::process::Command {
    let mut cmd = std::process::Command::new("/proc/self/exe");
    cmd.arg0("egress-fence")
        .args(["revert-timer", "--token", token, "--state-dir"])
        .arg(&writer.state.state_dir)
        .args(["--keep", &writer.keep.to_string()])
        .args([
            "--lock-timeout",
            &format!("{}s", writer.lock.lock_timeout.0.as_secs()),
        ]);
    if let Some(ns) = &target.netns {
        cmd.args(["--netns", ns]);
    }
    // The fault injection is for the process a test gives it to, not for its timer.
    cmd.env_remove(CRASH_BEFORE_RENAME_ENV).current_dir("/");
    cmd
}

/// `egress-fence confirm` with the options that find this change's state.
fn confirm_command(target: &Target, state: &StateArgs) -> String {
    let mut cmd = "egress-fence confirm".to_string();
    if let Some(ns) = &target.netns {
        cmd.push_str(&format!(" --netns {ns}"));
    }
    if state.state_dir != Path::new(DEFAULT_STATE_DIR) {
        cmd.push_str(&format!(" --state-dir {}", state.state_dir.display()));
    }
    cmd
}

fn join_display<T: std::fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn run(command: Command) -> Result<u8, Failure> {
    match command {
        Command::Check { policy: path } => {
            let policy = load(&path)?;
            let wildcards = policy
                .allow
                .iter()
                .filter(|a| matches!(a.target, egress_fence::core::policy::Target::Wildcard(_)))
                .count();
            let mode = match &policy.dns.guard {
                Some(g) => format!(
                    "; DNS guard on {} forwarding to {}",
                    join_display(&g.listen),
                    join_display(&g.upstream)
                ),
                None => String::new(),
            };
            println!(
                "{}: valid ({} allow entries, {} names, {wildcards} wildcards, {} deny \
                 entries{mode})",
                path.display(),
                policy.allow.len(),
                policy.domains().len(),
                policy.deny.len()
            );
            Ok(0)
        }
        Command::Plan {
            policy: path,
            target,
            resolving,
            json,
        } => {
            let resolv_conf = enter(&target, Some(&resolving))?;
            let policy = load(&path)?;
            let resolution = resolve_policy(&policy, &resolv_conf)?;
            report_resolution(&policy, &resolution);
            let ruleset = plan(&policy, &resolution);
            if json {
                let out = serde_json::json!({ "resolution": resolution, "ruleset": ruleset });
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                println!("# egress-fence plan for {}", path.display());
                if let (Some(g), Some(uid)) = (&policy.dns.guard, resolution.guard_uid) {
                    println!(
                        "# DNS guard mode: names are allowed as `egress-fence run` answers them \
                         on {}; only sockets of uid {uid} (the uid `run` keeps) marked {:#x} \
                         (the guard's SO_MARK) may ask {}",
                        join_display(&g.listen),
                        g.mark,
                        join_display(&g.upstream)
                    );
                }
                for host in &resolution.hosts {
                    println!("# {}", describe_host(host));
                }
                print!("{}", ruleset.to_nft());
            }
            Ok(resolution_code(&resolution))
        }
        Command::Apply {
            policy: path,
            target,
            resolving,
            writer,
            confirm_within,
            json,
        } => {
            let state = state_dir(&target, &writer.state)?;
            let resolv_conf = enter(&target, Some(&resolving))?;
            let lock = lock(&state, "apply", &writer.lock)?;
            let timer_command = |token: &str| revert_timer_command(token, &target, &writer);
            let confirm = || {
                confirm_within.map(|within| ConfirmRequest {
                    within: within.0,
                    timer_command: &timer_command,
                })
            };
            let writer_ctx = Writer {
                state: &state,
                lock: &lock,
                keep: writer.keep,
            };
            let mut nft = Nft::open()?;
            let (mut policy, mut planned) = resolve_and_plan_quietly(&path, &resolv_conf)?;
            // A damaged table of ours (flushed, edited) may have refused our own questions to
            // the resolvers: install what the policy allows with the names that did resolve
            // (never more than the policy allows), then ask again.
            let repaired =
                change::may_have_blocked_resolution(&planned, nft.read_table()?.as_ref());
            if repaired {
                eprintln!(
                    "table inet {TABLE} differs from the policy's and may have refused this \
                     process's DNS questions ({} names did not resolve): installing the policy's \
                     table first, then resolving again",
                    planned.resolution.unresolved().count()
                );
                change::apply(&mut nft, &writer_ctx, planned, confirm())?;
                (policy, planned) = resolve_and_plan_quietly(&path, &resolv_conf)?;
            }
            report_resolution(&policy, &planned.resolution);
            let code = resolution_code(&planned.resolution);
            let unresolved: Vec<String> = planned
                .resolution
                .unresolved()
                .map(|h| h.name.to_string())
                .collect();
            let names = planned.resolution.hosts.len();
            let guard_uid = planned.resolution.guard_uid;
            let (rules, elements) = (
                planned.ruleset.output.len() + planned.ruleset.refused.len(),
                planned.ruleset.element_count(),
            );
            let outcome = change::apply(&mut nft, &writer_ctx, planned, confirm())?;
            drop(lock);
            let confirm_hint = confirm_command(&target, &writer.state);
            report_pending_notes(&outcome.awaiting, &outcome.noted_revert, &confirm_hint);
            if json {
                let out = serde_json::json!({
                    "applied": true,
                    "changed": repaired || outcome.changed(),
                    "repaired": repaired,
                    "generation": outcome.current,
                    "recorded": outcome.recorded.as_ref().map(|g| g.generation),
                    "table": format!("inet {TABLE}"),
                    "elements": elements,
                    "rules": rules,
                    "unresolved": unresolved,
                    "differences": outcome.diff,
                    "confirm": outcome.armed,
                });
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                print_apply(&outcome, &path, &confirm_hint);
                if confirm_within.is_some() && !outcome.changed() {
                    println!("nothing changed, so nothing awaits confirmation");
                }
                if let Some(uid) = guard_uid {
                    println!(
                        "table inet {TABLE}: {rules} rules, {elements} set elements; DNS guard \
                         mode: names are allowed only as `egress-fence run` answers them, and \
                         only the guard's marked sockets of uid {uid} may ask the upstream \
                         resolvers"
                    );
                } else {
                    println!(
                        "table inet {TABLE}: {rules} rules, {elements} set elements, {} of {names} names resolved",
                        names - unresolved.len(),
                    );
                }
            }
            Ok(code)
        }
        Command::Diff {
            policy: path,
            target,
            resolving,
            json,
        } => diff_command(&path, &target, &resolving, json).map_err(|f| Failure {
            // Exit code 1 means "something would change"; a failed comparison must not look
            // like one.
            code: if f.code == EXIT_FAILURE {
                EXIT_DIFF_FAILED
            } else {
                f.code
            },
            error: f.error,
        }),
        Command::Rollback {
            to,
            target,
            writer,
            json,
        } => {
            let state = state_dir(&target, &writer.state)?;
            enter(&target, None)?;
            let lock = lock(&state, "rollback", &writer.lock)?;
            let writer_ctx = Writer {
                state: &state,
                lock: &lock,
                keep: writer.keep,
            };
            let outcome = change::rollback(&mut Nft::open()?, &writer_ctx, to)?;
            drop(lock);
            report_pending_notes(
                &outcome.awaiting,
                &outcome.noted_revert,
                &confirm_command(&target, &writer.state),
            );
            if json {
                let out = serde_json::json!({
                    "changed": !outcome.diff.is_empty(),
                    "reinstated": outcome.source.generation,
                    "generation": outcome.recorded.generation,
                    "differences": outcome.diff,
                });
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                let (from, recorded) = (outcome.source.generation, outcome.recorded.generation);
                if outcome.diff.is_empty() {
                    println!(
                        "the table already matched generation {from}; recorded the rollback as generation {recorded}"
                    );
                } else {
                    println!("rolled back to generation {from}, recorded as generation {recorded}");
                    print_summary(&outcome.diff);
                }
            }
            Ok(0)
        }
        Command::History {
            target,
            state: state_args,
            json,
        } => {
            let state = state_dir(&target, &state_args)?;
            let entries = state.generations()?;
            let pending = state.pending();
            if json {
                let generations: Vec<serde_json::Value> = entries
                    .iter()
                    .map(|e| match &e.record {
                        Ok(g) => serde_json::to_value(g.summary()).unwrap_or_default(),
                        Err(reason) => serde_json::json!({
                            "generation": e.number,
                            "corrupt": reason,
                            "path": e.path,
                        }),
                    })
                    .collect();
                let out = serde_json::json!({
                    "state_dir": state.path(),
                    "generations": generations,
                    "pending_confirmation": pending.as_ref().ok().cloned().flatten(),
                });
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else if entries.is_empty() {
                println!("no generation is recorded in {}", state.path().display());
            } else {
                for e in &entries {
                    match &e.record {
                        Ok(g) => println!(
                            "{:>6}  {}  uid {:<5}  {:<14}  {}  ({} rules, {} set elements)",
                            g.generation,
                            g.time,
                            g.uid,
                            g.describe(),
                            g.policy_path.display(),
                            g.rule_count(),
                            g.ruleset.element_count()
                        ),
                        Err(reason) => println!(
                            "{:>6}  CORRUPT: {}: {reason} (never used)",
                            e.number,
                            e.path.display()
                        ),
                    }
                }
            }
            if !json {
                match &pending {
                    Ok(Some(p)) => println!("{}", p.describe(SystemTime::now())),
                    Ok(None) => {}
                    Err(e) => println!("{e}"),
                }
            }
            Ok(0)
        }
        Command::Confirm {
            target,
            state: state_args,
            lock: lock_args,
        } => {
            let state = state_dir(&target, &state_args)?;
            let lock = lock(&state, "confirm", &lock_args)?;
            match change::confirm(&state, &lock)? {
                ConfirmOutcome::Confirmed(p) => {
                    println!(
                        "confirmed generation {}: it stays, its revert timer stands down",
                        p.generation
                    );
                    Ok(0)
                }
                ConfirmOutcome::NothingPending => {
                    println!("nothing awaits confirmation");
                    Ok(0)
                }
                ConfirmOutcome::TooLate(p) => {
                    eprintln!(
                        "egress-fence: too late: {}; apply it again to retry",
                        p.describe(SystemTime::now())
                    );
                    Ok(EXIT_FAILURE)
                }
            }
        }
        Command::Status {
            target,
            state: state_args,
            json,
        } => {
            let state = state_dir(&target, &state_args)?;
            enter(&target, None)?;
            let pending = state.pending().ok().flatten();
            let Some(live) = Nft::open()?.read_table()? else {
                if json {
                    println!(
                        "{}",
                        serde_json::json!({ "installed": false, "pending_confirmation": pending })
                    );
                } else {
                    println!("table inet {TABLE} is not installed");
                    if let Some(p) = &pending {
                        println!("{}", p.describe(SystemTime::now()));
                    }
                }
                return Ok(EXIT_NOT_INSTALLED);
            };
            let status = live.status();
            let drift = change::drift(&state, &live);
            let unexplained = match &drift {
                Drift::InSync(g) | Drift::Drifted(g, _) => change::unexplained(g, &live),
                Drift::NoGeneration | Drift::Unreadable(_) => Vec::new(),
            };
            // Guard mode shows in the table's DNS rule; whether a guard serves, in its socket.
            let access = live.dns_access();
            let (guard_uids, guard_marks) = (access.uids, access.marks);
            let guard_serving = !guard_uids.is_empty()
                && std::os::unix::net::UnixStream::connect(state.guard_events()).is_ok();
            if json {
                let mut out = serde_json::to_value(&status)?;
                out["installed"] = true.into();
                let (generation, drifted, differences) = match &drift {
                    Drift::NoGeneration | Drift::Unreadable(_) => (None, None, None),
                    Drift::InSync(g) => (Some(g.summary()), Some(false), None),
                    Drift::Drifted(g, d) => (Some(g.summary()), Some(true), Some(d)),
                };
                out["generation"] = serde_json::to_value(generation)?;
                // Elements the policy does not explain are drift too (someone added them).
                let drifted = drifted.map(|d| d || !unexplained.is_empty());
                out["drift"] = serde_json::to_value(drifted)?;
                out["unexplained_elements"] = serde_json::to_value(&unexplained)?;
                out["differences"] = serde_json::to_value(differences)?;
                if let Drift::Unreadable(e) = &drift {
                    out["generation_error"] = e.to_string().into();
                }
                out["pending_confirmation"] = serde_json::to_value(&pending)?;
                if !guard_uids.is_empty() {
                    out["dns_guard"] = serde_json::json!({ "uids": guard_uids, "marks": guard_marks,
                                            "serving": guard_serving });
                }
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                print_status(&status);
                if !guard_uids.is_empty() {
                    let uids = join_display(&guard_uids);
                    let marked = match guard_marks.as_slice() {
                        [] => " (by uid alone: a table of an older version; `egress-fence \
                               run` replaces it)"
                            .to_string(),
                        marks => {
                            let marks: Vec<String> =
                                marks.iter().map(|m| format!("{m:#x}")).collect();
                            format!(" marked {}", marks.join(", "))
                        }
                    };
                    println!(
                        "  DNS guard mode: only sockets of uid {uids}{marked} may ask the \
                         resolvers; {}",
                        if guard_serving {
                            "a guard is serving (`egress-fence watch` shows what it refuses)"
                        } else {
                            "no guard is serving here, so no name is allowed until \
                             `egress-fence run` answers it"
                        }
                    );
                }
                print_drift(&drift, &state, &unexplained);
                if let Some(p) = &pending {
                    println!("{}", p.describe(SystemTime::now()));
                }
            }
            Ok(0)
        }
        Command::Run {
            policy,
            target,
            resolving,
            teardown_on_exit,
            log_format,
            log_drops,
            writer,
        } => {
            let state = state_dir(&target, &writer.state)?;
            let resolv_conf = enter(&target, Some(&resolving))?;
            init_logging(log_format);
            let options = daemon::Options {
                policy_path: policy,
                resolv_conf,
                teardown_on_exit,
                log_drops,
                state,
                keep: writer.keep,
                lock_timeout: writer.lock.lock_timeout.0,
            };
            match daemon::run(options) {
                Ok(()) => Ok(0),
                Err(daemon::DaemonError::Policy(e)) => Err(e.into()),
                // Like an invalid policy: only an edit fixes it, so systemd does not restart.
                Err(e @ daemon::DaemonError::TableRefused(_)) => Err(Failure {
                    code: EXIT_BAD_POLICY,
                    error: e.into(),
                }),
                Err(e) => Err(e.into()),
            }
        }
        Command::Watch {
            target,
            group,
            count,
            json,
            state,
        } => {
            use egress_fence::watch::Heard;

            let state = state_dir(&target, &state)?;
            enter(&target, None)?;
            let group = match group {
                Some(g) => g,
                None => match Nft::open()?.log_group()? {
                    Some(Some(g)) => g,
                    Some(None) => {
                        return Err(anyhow::anyhow!(
                            "the installed table logs refusals to the kernel log, not to an NFLOG \
                         group: set `log.group` in the policy, or give --group"
                        )
                        .into());
                    }
                    None => return Err(anyhow::anyhow!(
                        "table inet {TABLE} is not installed: apply a policy first, or give --group"
                    )
                    .into()),
                },
            };
            let watcher = Watcher::subscribe(group)?;
            eprintln!("watching NFLOG group {group} for refused packets");

            let rx = egress_fence::watch::hear(watcher, state.guard_events())?;

            // What the table says of destinations, read again now and then: a daemon keeps
            // changing the resolved sets.
            let mut nft = Nft::open()?;
            let mut known: Option<(Instant, Destinations)> = None;
            let mut seen = 0;
            let mut stdout = std::io::stdout().lock();
            while count.is_none_or(|c| seen < c) {
                let Ok(heard) = rx.recv() else {
                    return Err(anyhow::anyhow!("both event readers stopped").into());
                };
                let line = match heard {
                    Heard::Note(note) => {
                        eprintln!("{note}");
                        continue;
                    }
                    Heard::Packet(Err(e)) if e.is_transient() => {
                        eprintln!("warning: {e}");
                        continue;
                    }
                    Heard::Packet(Err(e)) => return Err(e.into()),
                    Heard::Query(query) if json => serde_json::to_string(&query)?,
                    Heard::Query(query) => query.to_string(),
                    Heard::Packet(Ok(mut event)) => {
                        if known
                            .as_ref()
                            .is_none_or(|(at, _)| at.elapsed() > WATCH_REREAD)
                        {
                            let table = nft.read_table()?;
                            known = Some((
                                Instant::now(),
                                table.as_ref().map(Destinations::of).unwrap_or_default(),
                            ));
                        }
                        let table_note =
                            known.as_ref().map(|(_, d)| d.note(event.dst, event.dport));
                        event.note = match Preset::containing(event.dst) {
                            Some(p) => Some(format!("{} (preset {})", p.describe(), p.name())),
                            None => table_note,
                        };
                        if json {
                            serde_json::to_string(&event)?
                        } else {
                            event.to_string()
                        }
                    }
                };
                writeln!(stdout, "{line}")?;
                stdout.flush()?;
                seen += 1;
            }
            Ok(0)
        }
        Command::Probe {
            policy: path,
            target,
            resolving,
            json,
        } => {
            let resolv_conf = enter(&target, Some(&resolving))?;
            let policy = load(&path)?;
            let options = ProbeOptions::for_policy(&policy, &resolv_conf)?;
            let report = probe::run(&policy, &options)?;
            if json {
                let out = serde_json::json!({
                    "passed": report.passed(),
                    "summary": report.summary(),
                    "checks": report.checks,
                });
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                for check in &report.checks {
                    println!("{check}");
                }
                println!("{}", report.summary());
            }
            Ok(if report.passed() {
                0
            } else {
                EXIT_PROBE_FAILED
            })
        }
        Command::Teardown { target } => {
            enter(&target, None)?;
            if Nft::open()?.teardown()? {
                println!("deleted table inet {TABLE}");
            } else {
                println!("table inet {TABLE} was not installed; nothing to do");
            }
            Ok(0)
        }
        Command::RevertTimer {
            token,
            target,
            writer,
        } => {
            // First of all: no signal of the terminal that ran `apply` may reach us.
            change::detach_from_session()?;
            let state = state_dir(&target, &writer.state)?;
            enter(&target, None)?;
            init_logging(LogFormat::Text);
            revert_timer(&state, &token, &writer).inspect_err(|f| {
                error!(error = format!("{:#}", f.error), "the revert timer failed");
            })
        }
    }
}

/// The revert timer's life: armed (said on stdout, which `apply` reads), then asleep until
/// the deadline or a confirmation, then the revert under the lock. Its stderr is the state
/// directory's revert-timer.log.
fn revert_timer(state: &StateDir, token: &str, writer: &WriterArgs) -> Result<u8, Failure> {
    let pending = change::arm_timer(state, token)?;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "{}", change::TIMER_ARMED)
        .and_then(|()| stdout.flush())
        .map_err(|e| anyhow::anyhow!("cannot report to apply: {e}"))?;
    info!(
        pid = std::process::id(),
        "armed: {}",
        pending.describe(SystemTime::now())
    );
    if change::wait_for_deadline(state, &pending) == TimerWake::StandDown {
        info!(
            generation = pending.generation,
            "confirmed or replaced; standing down"
        );
        return Ok(0);
    }
    let lock = state.lock("revert-timer", writer.lock.lock_timeout.0, |holder| {
        warn!(holder = %holder, "the deadline came; waiting for the lock");
    })?;
    let writer_ctx = Writer {
        state,
        lock: &lock,
        keep: writer.keep,
    };
    match change::revert(&mut Nft::open()?, &writer_ctx, token)? {
        RevertOutcome::StoodDown => {
            info!(
                generation = pending.generation,
                "confirmed at the deadline; standing down"
            );
        }
        RevertOutcome::Reinstated {
            source, recorded, ..
        } => info!(
            generation = pending.generation,
            "not confirmed: reverted to generation {source}, recorded as generation {recorded}"
        ),
        RevertOutcome::Deleted => warn!(
            generation = pending.generation,
            "not confirmed and there was no earlier generation: table inet {TABLE} deleted"
        ),
    }
    Ok(0)
}

fn diff_command(
    path: &Path,
    target: &Target,
    resolving: &Resolving,
    json: bool,
) -> Result<u8, Failure> {
    let resolv_conf = enter(target, Some(resolving))?;
    let planned = resolve_and_plan(path, &resolv_conf)?;
    let live = Nft::open()?.read_table()?;
    let diff = compare(&planned.ruleset, live.as_ref(), CompareOptions::default());
    if json {
        let out = serde_json::json!({ "changed": !diff.is_empty(), "differences": diff });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else if diff.is_empty() {
        println!("no changes: table inet {TABLE} matches {}", path.display());
    } else {
        println!(
            "applying {} would change table inet {TABLE} (+ adds, - removes):",
            path.display()
        );
        print!("{diff}");
    }
    Ok(if diff.is_empty() { 0 } else { EXIT_CHANGES })
}

fn print_summary(diff: &TableDiff) {
    for line in diff.summary() {
        println!("  {line}");
    }
}

fn print_apply(outcome: &ApplyOutcome, path: &Path, confirm_hint: &str) {
    let current = outcome
        .current
        .map_or(String::new(), |g| format!(" (generation {g})"));
    if !outcome.changed() {
        match &outcome.recorded {
            Some(g) => println!(
                "unchanged: the live table already matches {}; recorded as generation {}",
                path.display(),
                g.generation
            ),
            None => println!(
                "unchanged: the live table already matches {}{current}",
                path.display()
            ),
        }
        return;
    }
    println!("applied {}{current}; changed:", path.display());
    print_summary(&outcome.diff);
    if let Some(p) = &outcome.armed {
        let left = p.seconds_left(SystemTime::now());
        let when = format!("at {} (in {left} s)", state::clock_utc(p.deadline()));
        match p.revert_to {
            Some(n) => println!(
                "generation {} reverts to generation {n} {when} unless `{confirm_hint}` runs before",
                p.generation
            ),
            None => println!(
                "generation {} has no earlier generation to revert to: unless `{confirm_hint}` \
                 runs before, table inet {TABLE} is DELETED {when} and the host is left unfenced",
                p.generation
            ),
        }
    }
}

/// What a writer learnt about an earlier confirm-or-revert, on stderr.
fn report_pending_notes(
    awaiting: &Option<PendingConfirm>,
    noted_revert: &Option<PendingConfirm>,
    confirm_hint: &str,
) {
    let now = SystemTime::now();
    if let Some(p) = noted_revert {
        eprintln!("note: {}", p.describe(now));
    }
    if let Some(p) = awaiting {
        eprintln!(
            "warning: {}; that revert undoes this change too (`{confirm_hint}` keeps both)",
            p.describe(now)
        );
    }
}

fn print_drift(drift: &Drift, state: &StateDir, unexplained: &[change::UnexplainedElement]) {
    if let (Drift::InSync(g) | Drift::Drifted(g, _), false) = (drift, unexplained.is_empty()) {
        println!(
            "DRIFT: {} resolved element(s) that the policy of generation {} does not explain \
             (added beside egress-fence, or left from an older policy):",
            unexplained.len(),
            g.generation
        );
        for u in unexplained {
            println!("  {}: {}", u.element, u.why);
        }
        if let Drift::InSync(_) = drift {
            return;
        }
    }
    match drift {
        Drift::NoGeneration => println!(
            "no generation is recorded in {} (applied by hand, or by an older egress-fence)",
            state.path().display()
        ),
        Drift::Unreadable(e) => println!("cannot check for drift: {e}"),
        Drift::InSync(g) => println!(
            "in sync with generation {} ({} at {})",
            g.generation,
            g.describe(),
            g.time
        ),
        Drift::Drifted(g, diff) => {
            println!(
                "DRIFT from generation {} ({} at {}): the live table was changed beside \
                 egress-fence; applying the generation again would change (+ adds, - removes):",
                g.generation,
                g.describe(),
                g.time
            );
            for line in diff.to_string().lines() {
                println!("  {line}");
            }
            println!(
                "  `egress-fence apply` of the policy, or `egress-fence rollback --to {}`, puts it back",
                g.generation
            );
        }
    }
}

fn resolution_code(resolution: &Resolution) -> u8 {
    if resolution.unresolved().next().is_some() {
        EXIT_UNRESOLVED
    } else {
        0
    }
}

fn describe_host(host: &egress_fence::core::resolution::ResolvedHost) -> String {
    if host.addrs.is_empty() {
        return format!(
            "{}: NOT RESOLVED ({}): its allow entries are left out",
            host.name,
            host.why_unresolved()
        );
    }
    let addrs: Vec<String> = host
        .addrs
        .iter()
        .map(|a| format!("{} (ttl {})", a.addr, a.ttl))
        .collect();
    format!("{}: {}", host.name, addrs.join(", "))
}

/// Warnings about the resolution, on stderr so that stdout stays machine-readable.
fn report_resolution(policy: &Policy, resolution: &Resolution) {
    for host in &resolution.hosts {
        if !host.dropped.is_empty() && !host.addrs.is_empty() {
            eprintln!(
                "warning: {} answered addresses that are never allowed, left out: {}",
                host.name,
                host.describe_dropped()
            );
        }
        if host.addrs.is_empty() {
            eprintln!("warning: {}", describe_host(host));
        } else if !host.errors.is_empty() {
            eprintln!(
                "warning: {} resolved only partly: {}",
                host.name,
                host.errors.join("; ")
            );
        }
    }
    for w in denied_answers(policy, &resolution.hosts) {
        eprintln!("warning: {w}");
    }
}

fn print_status(status: &egress_fence::nft::live::Status) {
    let dormant = if status.dormant { " (dormant)" } else { "" };
    println!("table {}: installed{dormant}", status.table);
    for c in &status.chains {
        match (&c.hook, c.priority, &c.policy) {
            (Some(hook), Some(prio), Some(policy)) => println!(
                "  chain {}: hook {hook} priority {prio} policy {policy}, {} rules",
                c.name, c.rules
            ),
            _ => println!("  chain {}: {} rules", c.name, c.rules),
        }
    }
    let r = status.refused;
    println!(
        "  refused so far: IPv4 {} packets ({} bytes), IPv6 {} packets ({} bytes)",
        r.ipv4.packets, r.ipv4.bytes, r.ipv6.packets, r.ipv6.bytes
    );
    for s in &status.sets {
        let mut items = match &s.contents {
            Some(elements) => elements.to_nft(),
            None => vec![format!("({} kernel elements)", s.kernel_elements)],
        };
        items.extend(s.undecodable.iter().map(|e| format!("{e} (undecodable)")));
        if items.is_empty() {
            println!("  set {}: empty", s.name);
        } else {
            println!("  set {}: {}", s.name, items.join(", "));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The command line `apply` starts a revert timer with parses back into the same options,
    /// so the two can never drift apart.
    #[test]
    fn the_revert_timer_command_line_parses_back() {
        let target = Target {
            netns: Some("sandbox".into()),
        };
        let writer = WriterArgs {
            state: StateArgs {
                state_dir: PathBuf::from("/tmp/state dir"),
            },
            lock: LockArgs {
                lock_timeout: "2m".parse().expect("a duration"),
            },
            keep: 4,
        };
        let cmd = revert_timer_command("123-456", &target, &writer);
        assert_eq!(cmd.get_program(), "/proc/self/exe");
        assert!(
            cmd.get_envs()
                .any(|(k, v)| k == CRASH_BEFORE_RENAME_ENV && v.is_none()),
            "the fault injection is not passed on"
        );
        let mut argv = vec![std::ffi::OsString::from("egress-fence")];
        argv.extend(cmd.get_args().map(|a| a.to_owned()));
        let Command::RevertTimer {
            token,
            target,
            writer,
        } = Cli::try_parse_from(argv).expect("parses").command
        else {
            panic!("not the revert-timer command");
        };
        assert_eq!(token, "123-456");
        assert_eq!(target.netns.as_deref(), Some("sandbox"));
        assert_eq!(writer.state.state_dir, Path::new("/tmp/state dir"));
        assert_eq!(writer.lock.lock_timeout.0, Duration::from_secs(120));
        assert_eq!(writer.keep, 4);
    }

    #[test]
    fn the_revert_timer_is_hidden_and_keep_must_be_positive() {
        use clap::CommandFactory;
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
        use clap::CommandFactory;
        let mut cli = Cli::command();
        let run = cli.find_subcommand_mut("run").expect("the run command");
        let help = run.render_long_help().to_string();
        assert!(help.contains("mark `dns.mark` and its uid"), "{help}");
        assert!(!help.contains("Only this process's uid"), "{help}");
    }
}
