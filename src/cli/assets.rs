//! `package-assets DIR` (hidden): the man pages and shell completions, generated from the
//! clap definitions in args.rs, so that they say what `--help` says. scripts/package.sh
//! writes them at package time; nothing generated is kept in the repository.

use std::path::Path;

use anyhow::Context;
use clap::CommandFactory;
use clap_complete::Shell;

use super::args::Cli;
use super::exit::Failure;

/// The command's name, as installed.
const BIN: &str = "egress-fence";

/// The shells a completion is written for, and where each file goes in the package
/// (Cargo.toml's `[package.metadata.deb]` names the same files).
pub const SHELLS: [Shell; 3] = [Shell::Bash, Shell::Zsh, Shell::Fish];

/// Writes DIR/man/egress-fence.1 and one page per visible command (egress-fence-check.1,
/// ...), and DIR/completions/ for bash, zsh and fish.
pub fn write(dir: &Path) -> Result<u8, Failure> {
    let man = dir.join("man");
    let completions = dir.join("completions");
    for d in [&man, &completions] {
        std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
    }
    let mut cli = Cli::command().disable_help_subcommand(true);
    cli.build();
    for command in cli.get_subcommands().filter(|c| !c.is_hide_set()) {
        man_page(command, &man)?;
    }
    man_page(&cli, &man)?;
    let mut visible = visible(Cli::command());
    for shell in SHELLS {
        clap_complete::generate_to(shell, &mut visible, BIN, &completions).with_context(|| {
            format!("write the {shell} completion to {}", completions.display())
        })?;
    }
    Ok(0)
}

/// One man page: clap_mangen's sections, but the text after the options (the exit codes, the
/// schema note) kept line for line, since it is laid out in columns that roff's filling would
/// scramble.
fn man_page(command: &clap::Command, dir: &Path) -> anyhow::Result<()> {
    let man = clap_mangen::Man::new(command.clone());
    let path = dir.join(man.get_filename());
    let mut page = Vec::new();
    man.render_title(&mut page)?;
    man.render_name_section(&mut page)?;
    man.render_synopsis_section(&mut page)?;
    man.render_description_section(&mut page)?;
    if command.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut page)?;
    }
    if command.get_subcommands().any(|c| !c.is_hide_set()) {
        man.render_subcommands_section(&mut page)?;
    }
    if let Some(after) = command
        .get_after_long_help()
        .or_else(|| command.get_after_help())
    {
        page.extend_from_slice(b".SH NOTES\n.nf\n");
        for line in after.to_string().lines() {
            page.extend_from_slice(roff_line(line).as_bytes());
            page.push(b'\n');
        }
        page.extend_from_slice(b".fi\n");
    }
    if command.get_version().is_some() {
        man.render_version_section(&mut page)?;
    }
    std::fs::write(&path, page).with_context(|| format!("write {}", path.display()))
}

/// A line of text as roff prints it: backslashes and dashes escaped, and no line taken for a
/// request.
fn roff_line(line: &str) -> String {
    let escaped = line.replace('\\', "\\e").replace('-', "\\-");
    if escaped.starts_with(['.', '\'']) {
        format!("\\&{escaped}")
    } else {
        escaped
    }
}

/// `command` without its hidden commands and options, which clap_complete would otherwise
/// offer (the man pages leave them out by themselves).
fn visible(command: clap::Command) -> clap::Command {
    let mut copy = clap::Command::new(command.get_name().to_owned())
        .args(
            command
                .get_arguments()
                .filter(|a| !a.is_hide_set())
                .cloned(),
        )
        .subcommands(
            command
                .get_subcommands()
                .filter(|c| !c.is_hide_set())
                .cloned()
                .map(visible),
        );
    if let Some(about) = command.get_about() {
        copy = copy.about(about.clone());
    }
    if let Some(version) = command.get_version() {
        copy = copy.version(version.to_owned());
    }
    copy
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    /// The pages and completions hold every visible command and option of the definitions,
    /// and nothing hidden.
    #[test]
    fn the_pages_and_completions_follow_the_definitions() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        assert_eq!(write(dir.path()).ok(), Some(0));
        let read = |p: &str| {
            std::fs::read_to_string(dir.path().join(p)).unwrap_or_else(|e| panic!("{p}: {e}"))
        };
        let main = read("man/egress-fence.1");
        // Kept line for line: a column of the exit codes, as --help shows it.
        assert!(
            main.contains(".nf\nExit codes:\n  0  success; diff: nothing would change;"),
            "{main}"
        );
        assert!(read("man/egress-fence-check.1").contains("check \\-\\-schema"));
        let bash = read("completions/egress-fence.bash");
        let zsh = read("completions/_egress-fence");
        let fish = read("completions/egress-fence.fish");
        let cli = Cli::command();
        let mut pages = 0;
        for command in cli.get_subcommands() {
            let name = command.get_name();
            let page = format!("man/egress-fence-{name}.1");
            if command.is_hide_set() {
                assert!(!dir.path().join(&page).exists(), "{page}");
                for completion in [&bash, &zsh, &fish] {
                    assert!(!completion.contains(name), "hidden {name} is completed");
                }
                continue;
            }
            let page = read(&page);
            pages += 1;
            for completion in [&bash, &zsh, &fish] {
                assert!(completion.contains(name), "{name} lacks a completion");
            }
            for arg in command.get_arguments() {
                let Some(long) = arg.get_long() else {
                    continue;
                };
                if arg.is_hide_set() {
                    for completion in [&bash, &zsh, &fish] {
                        assert!(!completion.contains(long), "hidden --{long} is completed");
                    }
                    assert!(
                        !page.contains(&long.replace('-', "\\-")),
                        "{name}: --{long}"
                    );
                } else {
                    // roff escapes the dashes.
                    let option = format!("\\-\\-{}", long.replace('-', "\\-"));
                    assert!(
                        page.contains(&option),
                        "egress-fence-{name}.1 lacks {option}"
                    );
                    assert!(
                        bash.contains(&format!("--{long}")),
                        "bash lacks {name} --{long}"
                    );
                }
            }
        }
        assert!(pages >= 12, "{pages} pages");
    }
}
