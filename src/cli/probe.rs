//! `probe`: prove the boundary from inside it.
//!
//! With `--as USER` or `--from IFACE=ADDRESS` the command runs in two processes: this one
//! (privileged) makes the throwaway namespace of `--from`, starts itself again with
//! `--probe-child`, passes signals on and removes the namespace when the child is done; the
//! child reads the table and the state with the privileges it starts with, then enters the
//! throwaway namespace and drops to USER, and only then makes its attempts.

use std::path::Path;
use std::process::{Child, Command};

use anyhow::Context;
use nix::sys::signal::{SigSet, Signal};
use nix::unistd::Pid;

use egress_fence::core::policy::Policy;
use egress_fence::netns::Netns;
use egress_fence::probe::{self, ForwardNs, FromBridge, ProbeOptions, Prober, RunAs};
use egress_fence::state::Recorder;

use super::args::{NamespaceArg, ProbeSender, Resolving, StateArgs};
use super::common::{enter, state_dir};
use super::exit::{EXIT_FAILURE, EXIT_PROBE_FAILED, Failure};
use super::load::load;

pub fn run(
    path: &Path,
    target: &NamespaceArg,
    resolving: &Resolving,
    state_args: &StateArgs,
    json: bool,
    sender: &ProbeSender,
) -> Result<u8, Failure> {
    let from: Option<FromBridge> = sender.from.as_deref().map(str::parse).transpose()?;
    let run_as = sender.run_as.as_deref().map(RunAs::lookup).transpose()?;
    if !sender.probe_child && (run_as.is_some() || from.is_some()) {
        enter(target, None)?;
        // Blocked before anything is made, so that a signal cannot end this process
        // between making the namespace and removing it; std's spawn clears the mask in the
        // processes it starts.
        let waited = ending_signals();
        waited.thread_block()?;
        let forward_ns = from
            .as_ref()
            .map(ForwardNs::create)
            .transpose()
            .map_err(Failure::from);
        let code = forward_ns.and_then(|ns| run_child(ns.as_ref(), &waited));
        let _ = waited.thread_unblock();
        return code;
    }

    // Whether the service wrote the table. A state directory this user cannot read leaves
    // the probe to judge by the elements' timeouts alone.
    let service_table = state_dir(target, state_args)
        .ok()
        .and_then(|state| state.newest().ok().flatten())
        .is_some_and(|g| g.command == Recorder::Run);
    let resolv_conf = enter(target, Some(resolving))?;
    let mut policy = load(path)?;
    let mut options = ProbeOptions {
        service_table,
        ..ProbeOptions::for_policy(&policy, &resolv_conf)?
    };
    // What the table says was read above, with this process's privileges; from here on
    // the attempts' sender.
    let mut prober = None;
    if let (Some(from), Some(attempts_ns)) = (&from, &sender.attempts_netns) {
        aim_at_the_bridge(&mut policy, &mut options, from);
        Netns::parse(&attempts_ns.to_string_lossy()).enter()?;
        prober = Some(Prober::Forwarded {
            iface: from.iface.clone(),
            addr: from.addr.addr().to_string(),
        });
    }
    if let Some(user) = &run_as {
        user.become_user()?;
        options.uid = user.uid;
    }
    let prober = prober.unwrap_or_else(Prober::current);
    options.outside_scope = prober.outside_scope(&policy);

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

/// A container asks the guard on its bridge's addresses, and its resolv.conf is its
/// runtime's business, not this host's.
/// And the bridge's host, whose fence the attempts cross, refuses them from the bridge's
/// addresses.
fn aim_at_the_bridge(policy: &mut Policy, options: &mut ProbeOptions, from: &FromBridge) {
    let bridge = probe::interface_addrs(&from.iface).unwrap_or_default();
    options.fence_router = bridge.clone();
    let Some(guard) = policy.dns.guard.as_mut() else {
        return;
    };
    let port = egress_fence::core::plan::DNS_PORT;
    guard.listen = bridge
        .into_iter()
        .map(|ip| std::net::SocketAddr::new(ip, port))
        .collect();
    options.system = None;
}

/// The signals that would end this process, and SIGCHLD: waited for while the child runs.
fn ending_signals() -> SigSet {
    let mut set: SigSet = ENDING.into_iter().collect();
    set.add(Signal::SIGCHLD);
    set
}

const ENDING: [Signal; 3] = [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP];

/// Starts this command again as the child that makes the attempts, passes on the signals
/// that would end this process (so that it outlives the child and cleans up), and returns
/// the child's exit code. `waited` must be blocked.
fn run_child(forward_ns: Option<&ForwardNs>, waited: &SigSet) -> Result<u8, Failure> {
    let exe = std::env::current_exe().context("cannot find this program to start the probe")?;
    let mut command = Command::new(exe);
    command
        .args(std::env::args_os().skip(1))
        .arg("--probe-child");
    if let Some(ns) = forward_ns {
        command.arg("--attempts-netns").arg(ns.path());
    }
    let mut child = command.spawn().context("cannot start the probe's child")?;
    wait_passing_signals(&mut child, waited, &ENDING)
}

fn wait_passing_signals(
    child: &mut Child,
    waited: &SigSet,
    ending: &[Signal],
) -> Result<u8, Failure> {
    let pid = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    loop {
        if let Some(status) = child.try_wait()? {
            use std::os::unix::process::ExitStatusExt;
            return Ok(match (status.code(), status.signal()) {
                (Some(code), _) => u8::try_from(code).unwrap_or(EXIT_FAILURE),
                (None, Some(signal)) => u8::try_from(128 + signal).unwrap_or(EXIT_FAILURE),
                (None, None) => EXIT_FAILURE,
            });
        }
        let signal = waited.wait()?;
        if ending.contains(&signal) {
            let _ = nix::sys::signal::kill(pid, signal);
        }
    }
}
