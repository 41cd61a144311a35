//! The commands, one file each: each parses nothing (clap did, in [`args`]), calls the
//! library, prints, and returns its exit code. They live in the binary, not the library:
//! stdout, stderr and exit codes are the command line's business, and the library stays
//! usable without them.
//!
//! Shared by several commands: [`common`] (what `--netns`, `--state-dir` and
//! `--lock-timeout` do), [`load`] (reading, resolving and planning a policy), [`output`]
//! (printing), [`exit`] (codes, and the failure that carries one and prints each cause once),
//! [`schema`] (the policy's JSON Schema that `check --schema` prints), [`assets`] (the man
//! pages and completions the package ships).

pub mod args;
pub mod assets;
pub mod common;
pub mod exit;
pub mod load;
pub mod output;
pub mod schema;

pub mod apply;
pub mod check;
pub mod confirm;
pub mod diff;
pub mod exec;
pub mod history;
pub mod learn;
pub mod plan;
pub mod probe;
pub mod replay;
pub mod revert_timer;
pub mod rollback;
pub mod run;
pub mod status;
pub mod teardown;
pub mod watch;
