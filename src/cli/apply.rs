//! `apply`: resolve the policy's names and install the ruleset in one transaction, recorded
//! as a generation, optionally guarded by a revert timer.

use std::path::Path;

use egress_fence::change::{self, ApplyOutcome, ConfirmRequest, Planned, Writer};
use egress_fence::core::policy::HumanDuration;
use egress_fence::core::ruleset::TABLE;
use egress_fence::nft::Nft;
use egress_fence::state::Now;

use super::args::{NamespaceArg, Resolving, WriterArgs};
use super::common::{enter, lock, state_dir};
use super::exit::{Failure, resolution_code};
use super::load::{refuse_scope_holes, resolve_and_plan_quietly};
use super::output::{confirm_command, print_summary, report_pending_notes, report_resolution};
use super::revert_timer;

pub fn run(
    path: &Path,
    target: &NamespaceArg,
    resolving: &Resolving,
    writer: &WriterArgs,
    confirm_within: Option<HumanDuration>,
    json: bool,
) -> Result<u8, Failure> {
    let state = state_dir(target, &writer.state)?;
    let resolv_conf = enter(target, Some(resolving))?;
    let lock = lock(&state, "apply", &writer.lock)?;
    let timer = |token: &str, log: &Path| revert_timer::launch(token, log, target, writer);
    let confirm = || {
        confirm_within.map(|within| ConfirmRequest {
            within: within.0,
            timer: &timer,
        })
    };
    let writer_ctx = Writer {
        state: &state,
        lock: &lock,
        keep: writer.keep,
    };
    let mut nft = Nft::open()?;
    let (mut policy, mut planned) = resolve_and_plan_quietly(path, &resolv_conf)?;
    refuse_scope_holes(&policy, &planned)?;
    // A damaged table of ours (flushed, edited) may have refused our own questions to
    // the resolvers: install what the policy allows with the names that did resolve
    // (never more than the policy allows), then ask again.
    let repaired = change::may_have_blocked_resolution(&planned, &mut nft)?;
    if repaired {
        eprintln!(
            "table inet {TABLE} differs from the policy's and may have refused this \
             process's DNS questions ({} names did not resolve): installing the policy's \
             table first, then resolving again",
            planned.resolution.unresolved().count()
        );
        let first = change::apply(&mut nft, &writer_ctx, planned, confirm())?;
        // What it found of an earlier confirmation (a revert it carried out, say) is said
        // now: the second apply finds nothing of it.
        if first.pending.awaiting().is_none() {
            report_pending_notes(
                &first.pending,
                &state,
                &confirm_command(target, &writer.state),
            );
        }
        (policy, planned) = resolve_and_plan_quietly(path, &resolv_conf)?;
        refuse_scope_holes(&policy, &planned)?;
    }
    report_resolution(&policy, &planned.resolution);
    let code = resolution_code(&planned.resolution);
    let installed = Installed::of(&planned);
    let outcome = change::apply(&mut nft, &writer_ctx, planned, confirm())?;
    drop(lock);
    let confirm_hint = confirm_command(target, &writer.state);
    report_pending_notes(&outcome.pending, &state, &confirm_hint);
    if json {
        let out = serde_json::json!({
            "applied": true,
            "changed": repaired || outcome.changed(),
            "repaired": repaired,
            "generation": outcome.current,
            "recorded": outcome.recorded.as_ref().map(|g| g.generation),
            "table": format!("inet {TABLE}"),
            "elements": installed.elements,
            "rules": installed.rules,
            "unresolved": installed.unresolved,
            "differences": outcome.diff,
            "confirm": outcome.armed,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_apply(&outcome, path, &confirm_hint);
        if confirm_within.is_some() && !outcome.changed() {
            println!("nothing changed, so nothing awaits confirmation");
        }
        installed.print();
    }
    Ok(code)
}

/// What the applied plan holds, for the report (`change::apply` takes the plan).
struct Installed {
    rules: usize,
    elements: usize,
    names: usize,
    unresolved: Vec<String>,
    guard_uid: Option<u32>,
}

impl Installed {
    fn of(planned: &Planned) -> Installed {
        Installed {
            rules: planned.ruleset.rule_count(),
            elements: planned.ruleset.element_count(),
            names: planned.resolution.hosts.len(),
            unresolved: planned
                .resolution
                .unresolved()
                .map(|h| h.name.to_string())
                .collect(),
            guard_uid: planned.resolution.guard_uid,
        }
    }

    fn print(&self) {
        let Installed {
            rules,
            elements,
            names,
            ..
        } = self;
        if let Some(uid) = self.guard_uid {
            println!(
                "table inet {TABLE}: {rules} rules, {elements} set elements; DNS guard \
                 mode: names are allowed only as `egress-fence run` answers them, and \
                 only the guard's marked sockets of uid {uid} may ask the upstream \
                 resolvers"
            );
        } else {
            println!(
                "table inet {TABLE}: {rules} rules, {elements} set elements, {} of {names} names resolved",
                names - self.unresolved.len(),
            );
        }
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
        let left = p.seconds_left(&Now::read());
        let when = format!(
            "at {} (in {left} s)",
            egress_fence::core::time::clock_utc(p.deadline())
        );
        match (p.revert_to, &p.revert_table) {
            (Some(n), _) => println!(
                "generation {} reverts to generation {n} {when} unless `{confirm_hint}` runs before",
                p.generation
            ),
            (None, Some(_)) => println!(
                "generation {} reverts to the table inet {TABLE} that was live before it (no \
                 generation here describes it; recorded with the confirmation) {when} unless \
                 `{confirm_hint}` runs before",
                p.generation
            ),
            (None, None) => println!(
                "generation {} replaced no table, so there is nothing to revert to: unless `{confirm_hint}` \
                 runs before, table inet {TABLE} is DELETED {when} and the host is left unfenced",
                p.generation
            ),
        }
        if let Some(unit) = &p.timer_unit {
            println!("its revert timer runs as systemd unit {unit}");
        }
    }
}
