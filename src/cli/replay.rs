//! `replay`: what a candidate policy would have done with a recorded trace. Reads two files,
//! touches neither the network nor the kernel.

use std::path::Path;

use anyhow::anyhow;
use egress_fence::core::replay::{ReplayReport, describe_flow, replay};
use egress_fence::core::trace::{Trace, TraceError};

use super::exit::{EXIT_BAD_POLICY, EXIT_FAILURE, Failure};
use super::load::load;

pub fn run(trace_path: &Path, policy_path: &Path, json: bool) -> Result<u8, Failure> {
    let bad_input = |error| Failure {
        code: EXIT_BAD_POLICY,
        error,
    };
    let text = std::fs::read_to_string(trace_path).map_err(|e| {
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
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", describe(&report, trace_path, policy_path));
    }
    Ok(if report.refuses_anything() {
        EXIT_FAILURE
    } else {
        0
    })
}

/// Trace text for a terminal: a control character (an escape sequence in a recorded name)
/// is shown escaped, not sent.
fn shown(text: &str) -> String {
    text.chars()
        .map(|c| match c.is_control() {
            true => c.escape_default().to_string(),
            false => c.to_string(),
        })
        .collect()
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

/// The report for a person.
fn describe(r: &ReplayReport, trace: &Path, policy: &Path) -> String {
    let mut out = format!(
        "replay of {} against {} ({} mode): {} names asked, {} flows: {} allowed, {} essential, \
         {} outside the scope\n",
        trace.display(),
        policy.display(),
        r.mode,
        r.names,
        r.flows,
        r.allowed_flows,
        r.essential_flows,
        r.untouched_flows
    );
    if !r.refused_names.is_empty() {
        out += &format!("would refuse these names ({}):\n", r.refused_names.len());
        for n in &r.refused_names {
            out += &format!(
                "  {} ({}): {}; {}",
                shown(&n.name),
                list(&n.qtypes),
                n.why,
                times(n.count, &n.first, &n.last)
            );
            if !n.uids.is_empty() {
                out += &format!("; uid {}", list(&n.uids));
            }
            out += "\n";
        }
    }
    if !r.refused_flows.is_empty() {
        out += &format!(
            "would refuse flows to these destinations ({}):\n",
            r.refused_flows.len()
        );
        for f in &r.refused_flows {
            out += &format!(
                "  {}: {}; {}",
                shown(&describe_flow(&f.protocol, f.dst, f.dport)),
                f.why,
                times(f.count, &f.first, &f.last)
            );
            match (f.names.is_empty(), f.more_names) {
                (true, _) => out += "; no name answered it",
                (false, 0) => out += &format!("; names {}", list(&f.names)),
                (false, more) => out += &format!("; names {} and {more} more", list(&f.names)),
            }
            if !f.uids.is_empty() {
                out += &format!("; uid {}", list(&f.uids));
            }
            if !f.interfaces.is_empty() {
                out += &format!("; from {}", list(&f.interfaces));
            }
            out += "\n";
        }
    }
    if !r.unjudged.is_empty() {
        out += "cannot judge from the trace:\n";
        for u in &r.unjudged {
            out += &format!(
                "  {} flows such as {}: {}\n",
                u.count,
                shown(&u.example),
                u.why
            );
        }
    }
    if !r.unused.is_empty() {
        out += "allow entries nothing in the trace used:\n";
        for u in &r.unused {
            match &u.preset {
                Some(p) => out += &format!("  {} (include {p})\n", u.entry),
                None => out += &format!("  {}\n", u.entry),
            }
        }
    }
    if !r.narrowable.is_empty() {
        out += "wildcards that allowed a single name (it could be that name):\n";
        for w in &r.narrowable {
            out += &format!("  {}: {}\n", w.wildcard, w.name);
        }
    }
    for n in &r.notes {
        out += &format!("note: {n}\n");
    }
    if !r.refuses_anything() {
        out += "nothing would have been refused\n";
    }
    out
}
