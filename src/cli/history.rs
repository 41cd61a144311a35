//! `history`: the recorded generations, and any change awaiting confirmation.

use super::args::{NamespaceArg, StateArgs};
use super::common::state_dir;
use super::exit::Failure;

pub fn run(target: &NamespaceArg, state_args: &StateArgs, json: bool) -> Result<u8, Failure> {
    let state = state_dir(target, state_args)?;
    let entries = state.generations()?;
    let pending = state.pending();
    if json {
        let generations: Vec<serde_json::Value> = entries
            .iter()
            .map(|e| match &e.record {
                Ok(g) => serde_json::to_value(g.summary()).unwrap_or_default(),
                Err(reason) => serde_json::json!({
                    "generation": e.number,
                    "corrupt": reason,
                    "path": e.path,
                }),
            })
            .collect();
        let out = serde_json::json!({
            "state_dir": state.path(),
            "generations": generations,
            "pending_confirmation": pending.as_ref().ok().cloned().flatten(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else if entries.is_empty() {
        println!("no generation is recorded in {}", state.path().display());
    } else {
        for e in &entries {
            match &e.record {
                Ok(g) => println!(
                    "{:>6}  {}  uid {:<5}  {:<14}  {}  ({} rules, {} set elements)",
                    g.generation,
                    g.time,
                    g.uid,
                    g.describe(),
                    g.policy_path.display(),
                    g.rule_count(),
                    g.ruleset.element_count()
                ),
                Err(reason) => println!(
                    "{:>6}  CORRUPT: {}: {reason} (never used)",
                    e.number,
                    e.path.display()
                ),
            }
        }
    }
    if !json {
        match &pending {
            Ok(Some(p)) => println!("{}", state.describe_pending(p)),
            Ok(None) => {}
            Err(e) => println!("{e}"),
        }
    }
    Ok(0)
}
