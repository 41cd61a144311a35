//! The command line: parse arguments, call the library, print, exit with a documented code.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use egress_fence::daemon;
use egress_fence::netns::Netns;
use egress_fence::nft::Nft;
use egress_fence::nft::live::Destinations;
use egress_fence::plan::{denied_answers, plan};
use egress_fence::policy::{Policy, PolicyError, Preset};
use egress_fence::probe::{self, ProbeOptions};
use egress_fence::resolve::{Resolution, resolve_policy};
use egress_fence::ruleset::TABLE;
use egress_fence::watch::Watcher;

const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  failure: the kernel refused the change, netlink or the namespace failed, no resolver
  2  invalid policy or command line (the message names file:line:column)
  3  done, but some allowed names did not resolve: their entries are missing
  4  status: the table is not installed
  5  probe: at least one check failed (the boundary does not hold as the policy says)";

const SCHEMA: &str = "\
Policy schema (YAML):
  version: 1                      # required
  action: reject                  # unmatched traffic: reject (fails fast) or drop
  allow:                          # destinations that may be reached
    - domain: api.example.com     # resolved to A and AAAA; or `cidr: 203.0.113.0/28`
      ports: [443, \"8000-8080\"]   # default: every port
      protocol: tcp               # tcp (default), udp or any (both)
      comment: model API          # free text
  deny:                           # checked before allow: deny wins
    - preset: cloud-metadata      # or private-networks; or `cidr: 10.0.0.0/8`
  dns:
    resolvers: [192.0.2.53]       # default: the nameservers of resolv.conf
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
struct Resolving {
    /// Where the resolvers come from when the policy names none (default: the named
    /// namespace's /etc/netns/NS/resolv.conf if it exists, else /etc/resolv.conf).
    #[arg(long, value_name = "FILE")]
    resolv_conf: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a policy without touching the network or the kernel.
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
    /// Resolve the policy's names and install the ruleset in one atomic transaction.
    #[command(after_help = EXIT_CODES)]
    Apply {
        policy: PathBuf,
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        resolving: Resolving,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Read the installed table back from the kernel.
    #[command(after_help = EXIT_CODES)]
    Status {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Apply the policy and keep it current, as a service: names are re-resolved as their
    /// TTLs run out and changed answers are sent as small element batches (the table is never
    /// reloaded for them); if anyone else changes or deletes the table, it is put back.
    /// SIGHUP reloads the policy (an invalid one is refused and the running one stays);
    /// SIGTERM and SIGINT stop and leave the boundary in place. Speaks systemd's notify
    /// protocol (READY once the table is live, STATUS, WATCHDOG).
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
    },
    /// Print every refused packet as it happens, read from the table's NFLOG group (works
    /// inside any network namespace; no kernel log needed).
    Watch {
        #[command(flatten)]
        target: Target,
        /// The NFLOG group to read (default: the group of the installed table's log rule).
        #[arg(long)]
        group: Option<u16>,
        /// Exit after this many events.
        #[arg(long)]
        count: Option<u64>,
        /// Print JSON lines instead.
        #[arg(long)]
        json: bool,
    },
    /// Prove the boundary from inside it: allowed names resolve and their ports connect;
    /// deny presets, `probe.blocked` targets and rogue resolvers are refused (TCP and UDP,
    /// IPv4 and IPv6); a random name under `probe.exfil_domain` does not resolve. One line
    /// per check (PASS, FAIL, WARN, SKIP), then a summary; exits 0 only if nothing failed,
    /// so CI can gate on it: `egress-fence probe policy.yaml --netns sandbox || exit 1`.
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
    /// Delete the tool's table (and nothing else); a no-op if it is absent.
    Teardown {
        #[command(flatten)]
        target: Target,
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
            eprintln!("egress-fence: {:#}", f.error);
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
    let policy = Policy::load(path)?;
    for w in policy.warnings() {
        eprintln!("warning: {w}");
    }
    Ok(policy)
}

fn run(command: Command) -> Result<u8, Failure> {
    match command {
        Command::Check { policy: path } => {
            let policy = load(&path)?;
            println!(
                "{}: valid ({} allow entries, {} names, {} deny entries)",
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
            json,
        } => {
            let resolv_conf = enter(&target, Some(&resolving))?;
            let policy = load(&path)?;
            let resolution = resolve_policy(&policy, &resolv_conf)?;
            report_resolution(&policy, &resolution);
            let ruleset = plan(&policy, &resolution);
            Nft::open()?.apply(&ruleset)?;
            let unresolved: Vec<String> = resolution
                .unresolved()
                .map(|h| h.name.to_string())
                .collect();
            if json {
                let out = serde_json::json!({
                    "applied": true,
                    "table": format!("inet {TABLE}"),
                    "elements": ruleset.element_count(),
                    "rules": ruleset.output.len() + ruleset.refused.len(),
                    "unresolved": unresolved,
                });
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                println!(
                    "applied table inet {TABLE}: {} rules, {} set elements, {} of {} names resolved",
                    ruleset.output.len() + ruleset.refused.len(),
                    ruleset.element_count(),
                    resolution.hosts.len() - unresolved.len(),
                    resolution.hosts.len()
                );
            }
            Ok(resolution_code(&resolution))
        }
        Command::Status { target, json } => {
            enter(&target, None)?;
            let Some(live) = Nft::open()?.read_table()? else {
                if json {
                    println!("{}", serde_json::json!({ "installed": false }));
                } else {
                    println!("table inet {TABLE} is not installed");
                }
                return Ok(EXIT_NOT_INSTALLED);
            };
            let status = live.status();
            if json {
                let mut out = serde_json::to_value(&status)?;
                out["installed"] = true.into();
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                print_status(&status);
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
        } => {
            let resolv_conf = enter(&target, Some(&resolving))?;
            init_logging(log_format);
            let options = daemon::Options {
                policy_path: policy,
                resolv_conf,
                teardown_on_exit,
                log_drops,
            };
            match daemon::run(options) {
                Ok(()) => Ok(0),
                Err(daemon::DaemonError::Policy(e)) => Err(e.into()),
                Err(e) => Err(e.into()),
            }
        }
        Command::Watch {
            target,
            group,
            count,
            json,
        } => {
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
            let mut watcher = Watcher::subscribe(group)?;
            eprintln!("watching NFLOG group {group} for refused packets");
            // What the table says of destinations, read again now and then: a daemon keeps
            // changing the resolved sets.
            let mut nft = Nft::open()?;
            let mut known: Option<(Instant, Destinations)> = None;
            let mut seen = 0;
            while count.is_none_or(|c| seen < c) {
                let mut event = match watcher.next_event() {
                    Ok(e) => e,
                    Err(e) if e.is_transient() => {
                        eprintln!("warning: {e}");
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                };
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
                let table_note = known.as_ref().map(|(_, d)| d.note(event.dst));
                event.note = match Preset::containing(event.dst) {
                    Some(p) => Some(format!("{} (preset {})", p.describe(), p.name())),
                    None => table_note,
                };
                if json {
                    println!("{}", serde_json::to_string(&event)?);
                } else {
                    println!("{event}");
                }
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
    }
}

fn resolution_code(resolution: &Resolution) -> u8 {
    if resolution.unresolved().next().is_some() {
        EXIT_UNRESOLVED
    } else {
        0
    }
}

fn describe_host(host: &egress_fence::resolve::ResolvedHost) -> String {
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
    for w in denied_answers(policy, resolution) {
        eprintln!("warning: {w}");
    }
}

fn print_status(status: &egress_fence::nft::live::Status) {
    println!("table {}: installed", status.table);
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
        let items = match &s.contents {
            Some(elements) => elements.to_nft(),
            None => vec![format!("({} kernel elements)", s.kernel_elements)],
        };
        if items.is_empty() {
            println!("  set {}: empty", s.name);
        } else {
            println!("  set {}: {}", s.name, items.join(", "));
        }
    }
}
