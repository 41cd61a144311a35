//! `learn`: the daemon in audit mode for a while (see [`egress_fence::daemon::AuditFor`]),
//! then the policy the trace asks for, written by [`egress_fence::core::learn::learn`].

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use egress_fence::core::learn::{LearnOptions, learn};
use egress_fence::core::plan::AUDIT_WINDOW;
use egress_fence::core::trace::Trace;
use egress_fence::daemon;
use egress_fence::trace_file::{open_append, refuse_foreign};

use super::args::{LogFormat, NamespaceArg, Resolving, WriterArgs};
use super::common::{enter, init_logging, state_dir};
use super::exit::{EXIT_BAD_POLICY, Failure};
use super::load::load_with_text;
use super::run::{run_daemon, start_trace};

/// Where the trace goes without `--trace`.
pub const DEFAULT_TRACE: &str = "egress-fence-learn.jsonl";

pub struct LearnArgs {
    pub policy: PathBuf,
    /// `None`: until stopped (clap made sure one of the two was given).
    pub duration: Option<Duration>,
    pub out: Option<PathBuf>,
    pub trace: Option<PathBuf>,
    pub fold_at: Option<usize>,
    pub log_format: LogFormat,
}

pub fn run(
    args: LearnArgs,
    target: &NamespaceArg,
    resolving: &Resolving,
    writer: &WriterArgs,
) -> Result<u8, Failure> {
    // Everything a person can fix is refused before anything runs.
    let (start, start_text) = load_with_text(&args.policy)?;
    start.refuse_learn(&start_text, &args.policy)?;
    if let Some(out) = &args.out {
        refuse_start_policy(out, &args.policy)?;
        refuse_out(out)?;
    }
    let trace_path = args
        .trace
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_TRACE));
    let state = state_dir(target, &writer.state)?;
    let resolv_conf = enter(target, Some(resolving))?;
    init_logging(args.log_format);
    // learn reads back only what it wrote (the file may hold earlier runs), through the file
    // it wrote: the path may name another file by then (renamed, made anew).
    let file = open_append(&trace_path)?;
    let mut ours = file.try_clone().context("opening the trace")?;
    let offset = ours.metadata().context("opening the trace")?.len();
    let trace = start_trace(file, &args.policy, true)?;
    let audit = match args.duration {
        Some(d) => daemon::AuditFor::Duration(d),
        None => daemon::AuditFor::UntilStopped,
    };
    eprintln!(
        "learn: AUDIT MODE {}: what {} refuses is let through and logged (watch shows it); \
         the window closes by itself {} s after this process stops",
        match args.duration {
            Some(d) => format!("for {}", egress_fence::core::time::minutes_seconds(d)),
            None => "until stopped (SIGTERM or Ctrl-C)".into(),
        },
        args.policy.display(),
        AUDIT_WINDOW.as_secs()
    );
    let options = daemon::Options {
        policy_path: args.policy.clone(),
        resolv_conf,
        teardown_on_exit: false,
        log_drops: false,
        state,
        keep: writer.keep,
        lock_timeout: writer.lock.lock_timeout.0,
        metrics: None,
        recording: Some(daemon::Recording {
            trace: trace.clone(),
            audit: Some(audit),
        }),
        trusted_policy_file: false,
        refuse_replies: false,
    };
    let result = run_daemon(options);
    trace.finish();
    result?;

    let recorded = read_trace_from(&mut ours, &trace_path, offset)?;
    let options = LearnOptions {
        fold_at: args.fold_at.unwrap_or(LearnOptions::default().fold_at),
    };
    if !recorded.ended() {
        eprintln!(
            "learn: WARNING: the trace has no end line: its writer failed (see the log above), \
             and the learned policy lacks what it did not write"
        );
    }
    if recorded.lost() > 0 {
        eprintln!(
            "learn: WARNING: the run lost {} records (the trace writer's queue was full, or the \
             trace reached its size cap): the learned policy lacks what they held",
            recorded.lost()
        );
    }
    let learned = learn(&start_text, &start, &recorded, &options);
    match &args.out {
        Some(out) => write_policy(out, &learned.yaml)?,
        None => {
            let mut stdout = std::io::stdout().lock();
            stdout
                .write_all(learned.yaml.as_bytes())
                .and_then(|()| stdout.flush())
                .context("writing the learned policy")?;
        }
    }
    eprintln!(
        "learn: the table enforces {} again; trace in {}",
        args.policy.display(),
        trace_path.display()
    );
    match learned.added.len() {
        0 => eprintln!("learn: nothing to add"),
        n => {
            eprintln!("learn: {n} entr{} added:", if n == 1 { "y" } else { "ies" });
            for line in &learned.added {
                eprintln!("  {line}");
            }
        }
    }
    if let Some(out) = &args.out {
        eprintln!(
            "learn: review {} before you apply it (`egress-fence check`, `replay`)",
            out.display()
        );
    }
    Ok(0)
}

/// `--out` naming the start policy (the same file by any path) is refused: learn never
/// overwrites what it started from.
fn refuse_start_policy(out: &Path, policy: &Path) -> Result<(), Failure> {
    let same = match (std::fs::metadata(out), std::fs::metadata(policy)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    };
    if same {
        return Err(Failure {
            code: EXIT_BAD_POLICY,
            error: anyhow::anyhow!(
                "--out {} is the start policy: learn never overwrites it; write the learned \
                 policy to another file and compare them",
                out.display()
            ),
        });
    }
    Ok(())
}

/// `--out` that is a symbolic link or another user's file is refused before the run (the
/// write would refuse it after the run: see [`write_policy`]).
fn refuse_out(out: &Path) -> Result<(), Failure> {
    let refused = |error| Failure {
        code: EXIT_BAD_POLICY,
        error,
    };
    match std::fs::symlink_metadata(out) {
        Ok(m) if m.file_type().is_symlink() => Err(refused(anyhow::anyhow!(
            "--out {} is a symbolic link: the learned policy is never written through one",
            out.display()
        ))),
        Ok(m) if m.is_file() && m.nlink() != 1 => Err(refused(anyhow::anyhow!(
            "--out {} has {} names (hard links): writing it would change another file too",
            out.display(),
            m.nlink()
        ))),
        Ok(m) => refuse_foreign(&m, out).map_err(|e| refused(e.into())),
        Err(_) => Ok(()),
    }
}

/// The trace as this run wrote it into `file` (at `path` when it was opened): from `offset`
/// on.
fn read_trace_from(file: &mut std::fs::File, path: &Path, offset: u64) -> Result<Trace, Failure> {
    let mut bytes = Vec::new();
    file.seek(SeekFrom::Start(offset))
        .and_then(|_| file.read_to_end(&mut bytes))
        .with_context(|| format!("reading the trace {}", path.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    Trace::parse(&text)
        .with_context(|| format!("reading the trace {}", path.display()))
        .map_err(Failure::from)
}

/// Writes the learned policy to `out` (replaced whole), never through a symbolic link, nor
/// into a file another user made (it could edit the policy between review and apply), nor
/// into anything but a regular file: the open does not block, so a FIFO put at the path
/// during the run is refused at once instead of holding learn until someone reads it.
fn write_policy(out: &Path, yaml: &str) -> Result<(), Failure> {
    let context = || format!("writing the learned policy to {}", out.display());
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(out)
        .with_context(context)?;
    // Checked before anything is cut: a file made during the run is refused untouched.
    let meta = file.metadata().with_context(context)?;
    if !meta.is_file() {
        return Err(anyhow::anyhow!(
            "writing the learned policy to {}: it is not a regular file (a FIFO, socket or \
             device): give the path of a file, or remove what is there",
            out.display()
        )
        .into());
    }
    refuse_foreign(&meta, out)?;
    // A second name for the file (a hard link someone made at the path during the run, where
    // the kernel lets them link files they do not own: `fs.protected_hardlinks=0`) would
    // have the policy written into whatever file that is, this host's policy for one.
    if meta.nlink() != 1 {
        return Err(anyhow::anyhow!(
            "writing the learned policy to {}: the file has {} names (hard links), so \
             writing it would change another file too: give a path of your own (or remove the \
             file)",
            out.display(),
            meta.nlink()
        )
        .into());
    }
    file.set_len(0).with_context(context)?;
    file.write_all(yaml.as_bytes()).with_context(context)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_learned_policy_goes_into_a_regular_file_of_one_name_only() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("learned.yaml");
        let ok = |path: &Path, text: &str| {
            if let Err(e) = write_policy(path, text) {
                panic!("{}", e.describe());
            }
        };
        ok(&out, "version: 1\n");
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "version: 1\n");
        // Replaced whole.
        ok(&out, "v\n");
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "v\n");

        // A hard link to another file at the path: refused, and that file is untouched.
        let other = dir.path().join("policy.yaml");
        std::fs::write(&other, "the host's policy\n").unwrap();
        let linked = dir.path().join("linked.yaml");
        std::fs::hard_link(&other, &linked).unwrap();
        let Err(e) = write_policy(&linked, "allow: everything\n") else {
            panic!("written through a hard link");
        };
        assert!(e.describe().contains("hard links"), "{}", e.describe());
        assert_eq!(
            std::fs::read_to_string(&other).unwrap(),
            "the host's policy\n"
        );

        // A FIFO: refused at once, not waited on (no reader ever comes here).
        let fifo = dir.path().join("fifo.yaml");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(write_policy(&fifo, "version: 1\n").is_err());
    }
}
