//! `run`: the service that keeps the policy's table current (the daemon, and in
//! `dns.mode: guard` the host's resolver).

use std::path::PathBuf;

use egress_fence::daemon;

use super::args::{LogFormat, NamespaceArg, Resolving, WriterArgs};
use super::common::{enter, init_logging, state_dir};
use super::exit::{EXIT_BAD_POLICY, Failure};

/// What `run` says about itself besides its log: refused packets (`--log-drops`) and metrics
/// (`--metrics`).
pub struct Observe {
    pub log_drops: bool,
    pub metrics: Option<daemon::MetricsAddr>,
}

pub fn run(
    policy: PathBuf,
    target: &NamespaceArg,
    resolving: &Resolving,
    teardown_on_exit: bool,
    log_format: LogFormat,
    Observe { log_drops, metrics }: Observe,
    writer: &WriterArgs,
) -> Result<u8, Failure> {
    let state = state_dir(target, &writer.state)?;
    let resolv_conf = enter(target, Some(resolving))?;
    init_logging(log_format);
    let options = daemon::Options {
        policy_path: policy,
        resolv_conf,
        teardown_on_exit,
        log_drops,
        state,
        keep: writer.keep,
        lock_timeout: writer.lock.lock_timeout.0,
        metrics,
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
