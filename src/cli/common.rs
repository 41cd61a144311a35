//! What the options several commands share do: enter the namespace `--netns` names, find its
//! state directory, take its writers' lock, start the logs.

use std::path::PathBuf;

use egress_fence::netns::Netns;
use egress_fence::state::{self, StateDir, WriterLock};

use super::args::{LockArgs, LogFormat, NamespaceArg, Resolving, StateArgs};
use super::exit::Failure;

/// Enters the namespace (before any thread exists) and returns the resolv.conf to use.
pub fn enter(target: &NamespaceArg, resolving: Option<&Resolving>) -> Result<PathBuf, Failure> {
    let ns = target.netns.as_deref().map(Netns::parse);
    if let Some(ns) = &ns {
        ns.enter()?;
    }
    let given = resolving.and_then(|r| r.resolv_conf.clone());
    Ok(given
        .or_else(|| ns.and_then(|ns| ns.resolv_conf()))
        .unwrap_or_else(|| PathBuf::from("/etc/resolv.conf")))
}

/// The state directory of the namespace `target` names. Worked out before entering it: a
/// namespace given as a path is named by its file's inode.
pub fn state_dir(target: &NamespaceArg, args: &StateArgs) -> Result<StateDir, Failure> {
    let ns = target.netns.as_deref().map(Netns::parse);
    let name = state::namespace_dir_name(ns.as_ref())?;
    Ok(StateDir::new(&args.state_dir, &name))
}

/// Takes the namespace's writers' lock, saying once on stderr whom it waits for.
pub fn lock(state: &StateDir, command: &str, args: &LockArgs) -> Result<WriterLock, Failure> {
    Ok(state.lock(command, args.lock_timeout.0, |holder| {
        eprintln!("waiting for the lock held by {holder}");
    })?)
}

/// Structured logs on stderr (the journal when run by systemd); RUST_LOG overrides the level.
pub fn init_logging(format: LogFormat) {
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
