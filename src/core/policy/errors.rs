//! A policy that cannot be used: where (file:line:column) and why; and how later checks find
//! what they point at in the source text.

use std::path::{Path, PathBuf};

/// Where a problem is written in the source (line and column; 0 and 0 for the whole text)
/// and what it is.
pub(super) type Located = ((usize, usize), String);

/// A policy that cannot be used, with where and why.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("{path}: cannot read the policy: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    /// `run` reads the file again on every reload: a user who may change it (or a directory
    /// or link on the way to it) would widen the fence.
    #[error(
        "{path}: {found}, so a user other than root could change the policy the service \
         reloads; make the file and every directory above it belong to root and not writable \
         by group or others (`chown root`, `chmod go-w`), or keep the policy elsewhere"
    )]
    OpenToOthers { path: PathBuf, found: String },
    #[error("{}: {message}", location(path, *line, *column))]
    Invalid {
        path: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
}

pub(super) fn location(path: &Path, line: usize, column: usize) -> String {
    if line == 0 {
        path.display().to_string()
    } else {
        format!("{}:{line}:{column}", path.display())
    }
}

/// Where in the source text a later check should point.
pub(super) fn locate(source: &str, needle: &str) -> (usize, usize) {
    source
        .lines()
        .enumerate()
        .find_map(|(i, line)| {
            let code = line.split('#').next().unwrap_or("");
            code.find(needle).map(|col| (i + 1, col + 1))
        })
        .unwrap_or((0, 0))
}

/// Where a value is written: the first token at or after the line that holds `key:` for
/// which `is_it` holds (a token is text between blanks, commas, quotes and braces, with
/// list brackets around it taken off), else where `key` is.
pub(super) fn locate_value(
    source: &str,
    key: &str,
    is_it: impl Fn(&str) -> bool,
) -> (usize, usize) {
    let key_colon = format!("{key}:");
    let start = source
        .lines()
        .position(|line| line.split('#').next().unwrap_or("").contains(&key_colon));
    let Some(start) = start else {
        return locate(source, key);
    };
    for (i, line) in source.lines().enumerate().skip(start) {
        let code = line.split('#').next().unwrap_or("");
        let mut from = 0;
        for token in code.split(|c: char| c.is_whitespace() || ",\"'{}".contains(c)) {
            let column = from;
            from += token.len() + 1;
            let candidates = [
                token,
                token.trim_start_matches('['),
                token.trim_end_matches(']'),
                token.trim_start_matches('[').trim_end_matches(']'),
            ];
            if !token.is_empty() && candidates.iter().any(|c| is_it(c)) {
                let lead = token.len() - token.trim_start_matches('[').len();
                let column = if is_it(token) { column } else { column + lead };
                return (i + 1, column + 1);
            }
        }
    }
    locate(source, key)
}

#[cfg(test)]
mod tests {
    use crate::core::policy::test_support::*;

    #[test]
    fn error_display_starts_with_file_line_column() {
        let e = parse("version: 1\nbogus: 1\n").unwrap_err();
        assert!(e.to_string().starts_with("p.yaml:2:1: "), "{e}");
    }
}
