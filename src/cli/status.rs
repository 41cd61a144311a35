//! `status`: the installed table read back from the kernel, and whether it still matches the
//! newest generation.

use egress_fence::change::{self, Drift};
use egress_fence::core::ruleset::TABLE;
use egress_fence::nft::Nft;
use egress_fence::nft::live::Status;
use egress_fence::state::{Now, PendingConfirm, Stage, StateDir, TimerLife};

use super::args::{NamespaceArg, StateArgs};
use super::common::{enter, state_dir};
use super::exit::{EXIT_NOT_INSTALLED, Failure};
use super::output::join_display;

pub fn run(target: &NamespaceArg, state_args: &StateArgs, json: bool) -> Result<u8, Failure> {
    let state = state_dir(target, state_args)?;
    enter(target, None)?;
    // An unreadable record is said, never taken for none: writers refuse until it is removed.
    let (pending, pending_error) = match state.pending() {
        Ok(pending) => (pending, None),
        Err(e) => (
            None,
            Some(format!(
                "cannot read the pending confirmation: {e}; a living revert timer still \
                 reverts at its deadline, and egress-fence apply, rollback and confirm refuse \
                 until the file is removed"
            )),
        ),
    };
    let mut pending_json = pending_json(&state, pending.as_ref());
    if let Some(e) = &pending_error {
        pending_json = serde_json::json!({ "error": e });
    }
    let Some(live) = Nft::open()?.read_table()? else {
        if json {
            println!(
                "{}",
                serde_json::json!({ "installed": false, "pending_confirmation": pending_json })
            );
        } else {
            println!("table inet {TABLE} is not installed");
            if let Some(p) = &pending {
                println!("{}", state.describe_pending(p));
            }
            if let Some(e) = &pending_error {
                println!("{e}");
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
        out["pending_confirmation"] = pending_json;
        if !guard_uids.is_empty() {
            out["dns_guard"] = serde_json::json!({ "uids": guard_uids, "marks": guard_marks,
                                    "serving": guard_serving });
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_status(&status);
        if !guard_uids.is_empty() {
            print_dns_guard(&guard_uids, &guard_marks, guard_serving);
        }
        print_drift(&drift, &state, &unexplained);
        if let Some(p) = &pending {
            println!("{}", state.describe_pending(p));
        }
        if let Some(e) = &pending_error {
            println!("{e}");
        }
    }
    Ok(0)
}

/// The pending confirmation as recorded, with where it stands: whether its revert timer
/// lives, and whether its revert is overdue (the deadline passed and nothing reverted it).
fn pending_json(state: &StateDir, pending: Option<&PendingConfirm>) -> serde_json::Value {
    let Some(p) = pending else {
        return serde_json::Value::Null;
    };
    let mut value = serde_json::to_value(p).unwrap_or_default();
    let timer_alive = state.timer_life(&p.token) == TimerLife::Alive;
    value["revert_timer_alive"] = timer_alive.into();
    value["revert_overdue"] = (p.stage(&Now::read()) == Stage::Due && !timer_alive).into();
    value["state"] = state.describe_pending(p).into();
    value
}

/// Guard mode, as the table's DNS rule shows it, and whether a guard serves.
fn print_dns_guard(guard_uids: &[u32], guard_marks: &[u32], guard_serving: bool) {
    let uids = join_display(guard_uids);
    let marked = match guard_marks {
        [] => " (by uid alone: a table of an older version; `egress-fence \
               run` replaces it)"
            .to_string(),
        marks => {
            let marks: Vec<String> = marks.iter().map(|m| format!("{m:#x}")).collect();
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

fn print_status(status: &Status) {
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
