//! `run`: the service that keeps the policy's table current (the daemon, and in
//! `dns.mode: guard` the host's resolver); with `--record FILE`, it also writes a trace.

use std::path::PathBuf;

use egress_fence::daemon;
use egress_fence::trace_file::{TraceSink, open_append};

use super::args::{LogFormat, NamespaceArg, Resolving, WriterArgs};
use super::common::{enter, init_logging, state_dir};
use super::exit::{EXIT_BAD_POLICY, Failure};

pub struct RunArgs {
    pub policy: PathBuf,
    pub teardown_on_exit: bool,
    pub log_format: LogFormat,
    pub log_drops: bool,
    pub record: Option<PathBuf>,
    pub metrics: Option<daemon::MetricsAddr>,
}

pub fn run(
    args: RunArgs,
    target: &NamespaceArg,
    resolving: &Resolving,
    writer: &WriterArgs,
) -> Result<u8, Failure> {
    let state = state_dir(target, &writer.state)?;
    let resolv_conf = enter(target, Some(resolving))?;
    init_logging(args.log_format);
    let recording = match &args.record {
        Some(path) => Some(daemon::Recording {
            trace: start_trace(open_append(path)?, &args.policy, false)?,
            audit: None,
        }),
        None => None,
    };
    let trace = recording.as_ref().map(|r| r.trace.clone());
    let options = daemon::Options {
        policy_path: args.policy,
        resolv_conf,
        teardown_on_exit: args.teardown_on_exit,
        log_drops: args.log_drops,
        state,
        keep: writer.keep,
        lock_timeout: writer.lock.lock_timeout.0,
        metrics: args.metrics,
        recording,
        trusted_policy_file: true,
        refuse_replies: false,
    };
    let result = run_daemon(options);
    if let Some(trace) = trace {
        trace.finish();
    }
    result.map(|()| 0)
}

/// Starts the trace in `file` (from [`open_append`]) with its start line.
pub fn start_trace(
    file: std::fs::File,
    policy: &std::path::Path,
    audit: bool,
) -> Result<TraceSink, Failure> {
    // The daemon reads the policy again (and says what is wrong with it).
    let mode = match egress_fence::core::policy::Policy::load(policy) {
        Ok(p) if p.dns.guard.is_none() => "resolve",
        _ => "guard",
    };
    let policy = std::path::absolute(policy).unwrap_or_else(|_| policy.to_owned());
    Ok(TraceSink::start(file, mode, &policy, audit)?)
}

/// Runs the daemon; a table the kernel refused is the policy's fault (exit 2).
pub fn run_daemon(options: daemon::Options) -> Result<(), Failure> {
    match daemon::run(options) {
        Ok(()) => Ok(()),
        Err(daemon::DaemonError::Policy(e)) => Err(e.into()),
        // Like an invalid policy: only an edit fixes it, so systemd does not restart.
        Err(e @ daemon::DaemonError::TableRefused(_)) => Err(Failure {
            code: EXIT_BAD_POLICY,
            error: e.into(),
        }),
        Err(e) => Err(e.into()),
    }
}
