//! `replay`: what a candidate policy would have done with a recorded trace. Reads two files,
//! touches neither the network nor the kernel.

use std::io::Write;
use std::path::Path;

use anyhow::anyhow;
use egress_fence::core::replay::{ReplayReport, describe_flow, replay};
use egress_fence::core::trace::{Trace, TraceError};
use egress_fence::path_trust;
use egress_fence::trace_file::MAX_TRACE_BYTES;

use super::exit::{EXIT_BAD_POLICY, EXIT_FAILURE, EXIT_INCOMPLETE_TRACE, Failure};
use super::load::load;

pub fn run(trace_path: &Path, policy_path: &Path, json: bool) -> Result<u8, Failure> {
    let bad_input = |error| Failure {
        code: EXIT_BAD_POLICY,
        error,
    };
    let (text, read) = read_trace(trace_path).map_err(|e| {
        bad_input(anyhow!(
            "cannot read the trace {}: {e}; give a file `run --record` or `learn` wrote",
            trace_path.display()
        ))
    })?;
    let trace = Trace::parse(&text).map_err(|e| {
        let at = match &e {
            TraceError::Line {
                line,
                column,
                message,
            } => format!("{line}:{column}: {message}"),
            other => format!(" {other}"),
        };
        bad_input(anyhow!(
            "{}:{at}; a trace is JSON lines as `run --record` and `learn` write them (see \
             README, `replay`)",
            trace_path.display()
        ))
    })?;
    let policy = load(policy_path).map_err(|f| bad_input(f.error))?;
    let report = replay(&policy, &trace);
    // Written as it is made: a report can be as long as its trace.
    let mut stdout = std::io::BufWriter::new(std::io::stdout().lock());
    if json {
        serde_json::to_writer_pretty(&mut stdout, &report)?;
        writeln!(stdout)?;
    } else {
        describe(&report, trace_path, policy_path, &mut stdout)?;
    }
    stdout.flush()?;
    // What the trace holds may not be what its run wrote: whoever could change the file
    // could have swapped in a clean one, so it passes no gate (a refusal in it still counts).
    // Judged after it was read, so the walk must end at the file read: another (a magic
    // link of /proc, or one put there since) is no sign of anything.
    let euid = nix::unistd::geteuid().as_raw();
    let open_to_others = match path_trust::walk(trace_path, euid) {
        path_trust::Walk::Trusted(dev, ino) if (dev, ino) == read => None,
        path_trust::Walk::Open(found) => Some(found),
        path_trust::Walk::Trusted(..) | path_trust::Walk::Unfinished => {
            Some(path_trust::OpenToOthers {
                at: trace_path.to_owned(),
                why: path_trust::Why::NotTheFileJudged,
            })
        }
    };
    if let (Some(found), false) = (&open_to_others, report.refuses_anything()) {
        eprintln!(
            "replay: {found}: a user other than root could have changed the trace since its \
             run wrote it, so nothing refused of what it holds passes no gate (exit 7); keep \
             traces where only root writes"
        );
    }
    Ok(if report.refuses_anything() {
        EXIT_FAILURE
    } else if !report.complete() || open_to_others.is_some() {
        EXIT_INCOMPLETE_TRACE
    } else {
        0
    })
}

/// The largest trace replay reads: eight runs' worth of what `run --record` and `learn`
/// write at most ([`MAX_TRACE_BYTES`] each, appended to the same file).
const MAX_REPLAY_BYTES: u64 = 8 * MAX_TRACE_BYTES;

/// Reads a trace that must be a regular file, opened without blocking, of at most
/// [`MAX_REPLAY_BYTES`]: a gate may replay a trace in a directory the fenced process can
/// write, where a FIFO put at the path would hold the gate forever, and a sparse file of any
/// size (which takes no disk) would have it read gigabytes of zeros into memory.
/// The trace's text, and the file it was read from as (`st_dev`, `st_ino`).
fn read_trace(path: &Path) -> std::io::Result<(String, (u64, u64))> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let too_large = || {
        std::io::Error::other(format!(
            "larger than {} MiB, more than runs write: start a new trace file",
            MAX_REPLAY_BYTES >> 20
        ))
    };
    if meta.len() > MAX_REPLAY_BYTES {
        return Err(too_large());
    }
    let mut text = String::new();
    file.take(MAX_REPLAY_BYTES + 1).read_to_string(&mut text)?;
    if text.len() as u64 > MAX_REPLAY_BYTES {
        return Err(too_large());
    }
    Ok((text, (meta.dev(), meta.ino())))
}

/// Trace text for a terminal: anything but printable ASCII is shown escaped (`\u{1b}`), not
/// sent: a control character (an escape sequence in a recorded name), and also a bidi
/// override or a lookalike letter, which would show a name other than the one recorded. The
/// guard records names as printable ASCII; anything else was written by another hand.
fn shown(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c == ' ' || c.is_ascii_graphic() {
            true => out.push(c),
            false => out.extend(c.escape_default()),
        }
    }
    out
}

fn list<T: ToString>(items: &[T]) -> String {
    items
        .iter()
        .map(|i| shown(&i.to_string()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn times(count: usize, first: &str, last: &str) -> String {
    match count {
        1 => format!("once, at {}", shown(first)),
        n => format!("{n} times, first {}, last {}", shown(first), shown(last)),
    }
}

/// The report for a person, written to `out`.
fn describe(
    r: &ReplayReport,
    trace: &Path,
    policy: &Path,
    out: &mut impl Write,
) -> std::io::Result<()> {
    writeln!(
        out,
        "replay of {} against {} ({} mode): {} names asked, {} flows: {} allowed, {} essential, \
         {} outside the scope",
        trace.display(),
        policy.display(),
        r.mode,
        r.names,
        r.flows,
        r.allowed_flows,
        r.essential_flows,
        r.untouched_flows
    )?;
    if !r.refused_names.is_empty() {
        writeln!(out, "would refuse these names ({}):", r.refused_names.len())?;
        for n in &r.refused_names {
            write!(
                out,
                "  {} ({}): {}; {}",
                shown(&n.name),
                list(&n.qtypes),
                n.why,
                times(n.count, &n.first, &n.last)
            )?;
            if !n.uids.is_empty() {
                write!(out, "; uid {}", list(&n.uids))?;
            }
            writeln!(out)?;
        }
    }
    if !r.refused_flows.is_empty() {
        writeln!(
            out,
            "would refuse flows to these destinations ({}):",
            r.refused_flows.len()
        )?;
        for f in &r.refused_flows {
            write!(
                out,
                "  {}: {}; {}",
                shown(&describe_flow(&f.protocol, f.dst, f.dport)),
                f.why,
                times(f.count, &f.first, &f.last)
            )?;
            match (f.names.is_empty(), f.more_names) {
                (true, _) => write!(out, "; no name answered it")?,
                (false, 0) => write!(out, "; names {}", list(&f.names))?,
                (false, more) => write!(out, "; names {} and {more} more", list(&f.names))?,
            }
            if !f.uids.is_empty() {
                write!(out, "; uid {}", list(&f.uids))?;
            }
            if !f.interfaces.is_empty() {
                write!(out, "; from {}", list(&f.interfaces))?;
            }
            writeln!(out)?;
        }
    }
    if !r.unjudged.is_empty() {
        writeln!(out, "cannot judge from the trace:")?;
        for u in &r.unjudged {
            writeln!(
                out,
                "  {} flows such as {}: {}",
                u.count,
                shown(&u.example),
                u.why
            )?;
        }
    }
    if !r.unused.is_empty() {
        writeln!(out, "allow entries nothing in the trace used:")?;
        for u in &r.unused {
            match &u.preset {
                Some(p) => writeln!(out, "  {} (include {p})", u.entry)?,
                None => writeln!(out, "  {}", u.entry)?,
            }
        }
    }
    if !r.narrowable.is_empty() {
        writeln!(
            out,
            "wildcards that allowed a single name (it could be that name):"
        )?;
        for w in &r.narrowable {
            writeln!(out, "  {}: {}", w.wildcard, w.name)?;
        }
    }
    for n in &r.notes {
        writeln!(out, "note: {n}")?;
    }
    let missing = match (r.lost, r.ended) {
        (0, true) => None,
        (0, false) => Some("it has no end line".to_string()),
        (lost, true) => Some(format!("it lost {lost} records")),
        (lost, false) => Some(format!("it lost {lost} records and has no end line")),
    };
    match (r.refuses_anything(), missing) {
        (true, _) => {}
        (false, None) => writeln!(out, "nothing would have been refused")?,
        (false, Some(missing)) => writeln!(
            out,
            "nothing would have been refused of what the trace holds, but {missing}: it may \
             not hold all its run did"
        )?,
    }
    Ok(())
}
