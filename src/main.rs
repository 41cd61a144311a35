//! The command line: parse arguments, then hand each command to its file in src/cli/, which
//! calls the library, prints, and returns a documented exit code.

#![forbid(unsafe_code)]

mod cli;

use std::process::ExitCode;

use clap::Parser;

use cli::args::{Cli, Command};
use cli::exit::Failure;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            // Not `eprintln!`, which panics when stderr is gone (exec's CMD shares it and may
            // have shut it): the exit code must still say what happened.
            let _ = std::io::Write::write_fmt(
                &mut std::io::stderr(),
                format_args!("egress-fence: {}\n", f.describe()),
            );
            ExitCode::from(f.code)
        }
    }
}

fn run(command: Command) -> Result<u8, Failure> {
    match command {
        Command::Check {
            policy: Some(policy),
            schema: false,
        } => cli::check::run(&policy),
        // clap requires a policy or --schema, and refuses both.
        Command::Check { .. } => Ok(cli::schema::print()),
        Command::Replay {
            trace,
            policy,
            json,
        } => cli::replay::run(&trace, &policy, json),
        Command::Plan {
            policy,
            target,
            resolving,
            json,
        } => cli::plan::run(&policy, &target, &resolving, json),
        Command::Apply {
            policy,
            target,
            resolving,
            writer,
            confirm_within,
            json,
        } => cli::apply::run(&policy, &target, &resolving, &writer, confirm_within, json),
        Command::Diff {
            policy,
            target,
            resolving,
            json,
        } => cli::diff::run(&policy, &target, &resolving, json),
        Command::Rollback {
            to,
            target,
            writer,
            json,
        } => cli::rollback::run(to, &target, &writer, json),
        Command::History {
            target,
            state,
            json,
        } => cli::history::run(&target, &state, json),
        Command::Confirm {
            target,
            state,
            lock,
        } => cli::confirm::run(&target, &state, &lock),
        Command::Status {
            target,
            state,
            json,
        } => cli::status::run(&target, &state, json),
        Command::Run {
            policy,
            target,
            resolving,
            teardown_on_exit,
            log_format,
            log_drops,
            metrics,
            record,
            writer,
        } => cli::run::run(
            cli::run::RunArgs {
                policy,
                teardown_on_exit,
                log_format,
                log_drops,
                record,
                metrics,
            },
            &target,
            &resolving,
            &writer,
        ),
        Command::Learn {
            policy,
            duration,
            until_stopped: _,
            out,
            trace,
            fold_at,
            target,
            resolving,
            log_format,
            writer,
        } => cli::learn::run(
            cli::learn::LearnArgs {
                policy,
                duration: duration.map(|d| d.0),
                out,
                trace,
                fold_at,
                log_format,
            },
            &target,
            &resolving,
            &writer,
        ),
        Command::Watch {
            target,
            group,
            count,
            json,
            state,
        } => cli::watch::run(&target, group, count, json, &state),
        Command::Probe {
            policy,
            target,
            resolving,
            state,
            json,
            sender,
        } => cli::probe::run(&policy, &target, &resolving, &state, json, &sender),
        Command::Exec {
            policy,
            user,
            keep_env,
            report,
            canary,
            canary_file,
            canary_host,
            target,
            resolving,
            state,
            command,
        } => cli::exec::run(
            cli::exec::ExecArgs {
                policy,
                user,
                keep_env,
                report,
                canary,
                canary_file,
                canary_host,
                command,
            },
            &target,
            &resolving,
            &state,
        ),
        Command::ExecChild {
            resolv_conf,
            go_fd,
            parent,
            user,
            command,
        } => cli::exec::run_child(resolv_conf, go_fd, parent, user, command),
        Command::Teardown { target } => cli::teardown::run(&target),
        Command::RevertTimer {
            token,
            stay,
            target,
            writer,
        } => cli::revert_timer::run(&token, stay, &target, &writer),
        Command::PackageAssets { dir } => cli::assets::write(&dir),
    }
}
