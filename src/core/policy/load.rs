//! Reading a policy: the file (bounded), the text's shape before the YAML parser sees it, and
//! the parser's errors placed at file:line:column.

use std::io::Read;
use std::path::Path;

use super::errors::{Located, PolicyError, locate};
use super::raw::RawPolicy;
use super::schema::{Policy, SCHEMA_VERSION};

/// The largest policy file read. Real policies are a few KiB; the YAML parser's cost grows
/// faster than the text, and the daemon must never spend long on a file someone else wrote.
pub const MAX_POLICY_BYTES: u64 = 1024 * 1024;

/// The deepest nesting of `[` and `{` a policy may have. The schema needs three levels; the
/// YAML parser's time grows with the square of the depth (240 KB of `[` took 12 s).
pub const MAX_POLICY_NESTING: usize = 32;

impl Policy {
    /// Reads and validates a policy file.
    pub fn load(path: &Path) -> Result<Policy, PolicyError> {
        Policy::load_with_text(path).map(|(policy, _)| policy)
    }

    /// Reads and validates a policy file; also returns the text that was validated (what a
    /// generation records: the file may change right after).
    pub fn load_with_text(path: &Path) -> Result<(Policy, String), PolicyError> {
        let file = std::fs::File::open(path).map_err(|error| PolicyError::Read {
            path: path.to_owned(),
            error,
        })?;
        Policy::read_with_text(file, path)
    }

    /// Like [`Policy::load_with_text`], from a file already open (`run` opens it before it
    /// judges who could change it, so that what it reads is what it judged); `path` labels
    /// the errors.
    pub fn read_with_text(file: impl Read, path: &Path) -> Result<(Policy, String), PolicyError> {
        // At most one byte past the limit is read: a huge file (or /dev/zero) costs nothing.
        let mut source = String::new();
        file.take(MAX_POLICY_BYTES + 1)
            .read_to_string(&mut source)
            .map_err(|error| PolicyError::Read {
                path: path.to_owned(),
                error,
            })?;
        let policy = Policy::parse(&source, path)?;
        Ok((policy, source))
    }

    /// Validates policy text; `path` only labels the errors.
    pub fn parse(source: &str, path: &Path) -> Result<Policy, PolicyError> {
        let invalid = |(line, column): (usize, usize), message: String| PolicyError::Invalid {
            path: path.to_owned(),
            line,
            column,
            message,
        };
        if let Some((at, message)) = refuse_shape(source) {
            return Err(invalid(at, message));
        }
        let raw: RawPolicy = serde_yaml::from_str(source).map_err(|e| {
            let message = yaml_message(&e);
            let at = e.location().map_or((0, 0), |l| {
                refine_location(source, (l.line(), l.column()), &message)
            });
            invalid(at, message)
        })?;
        if raw.version != SCHEMA_VERSION {
            return Err(invalid(
                locate(source, "version"),
                format!(
                    "policy schema version {} is not known to this egress-fence, which reads \
                     version {SCHEMA_VERSION}; write `version: {SCHEMA_VERSION}`",
                    raw.version
                ),
            ));
        }
        Policy::from_raw(raw, source).map_err(|(at, message)| invalid(at, message))
    }
}

/// Refuses, before the YAML parser sees it, text that would cost it too much or that it
/// would misreport: more than [`MAX_POLICY_BYTES`], `[`/`{` nested deeper than
/// [`MAX_POLICY_NESTING`], or several YAML documents. Returns where and why.
fn refuse_shape(source: &str) -> Option<Located> {
    if source.len() as u64 > MAX_POLICY_BYTES {
        return Some((
            (0, 0),
            format!(
                "the policy is larger than {} KiB, the most egress-fence reads; a policy that \
                 large is not one anyone reviews",
                MAX_POLICY_BYTES / 1024
            ),
        ));
    }
    if let Some(at) = too_deep(source, MAX_POLICY_NESTING) {
        return Some((
            at,
            format!(
                "brackets are nested more than {MAX_POLICY_NESTING} deep here; a policy needs \
                 three levels at most"
            ),
        ));
    }
    second_document(source).map(|line| {
        (
            (line, 1),
            "this line starts a second YAML document; a policy is one document: remove the \
             `---` (or `...`) line, or merge what follows it into the first document"
                .to_string(),
        )
    })
}

/// Where `[` and `{` first nest deeper than `max`, counted everywhere but in comments. It
/// over-counts brackets in quoted and block scalars, which only a strange policy has; it
/// never under-counts: text after ` #` is a comment or part of a scalar, never a flow
/// indicator. (Following quotes instead would let a lone `'` in a block scalar hide what
/// comes after it.)
fn too_deep(source: &str, max: usize) -> Option<(usize, usize)> {
    let mut depth = 0usize;
    for (line_no, line) in source.split('\n').enumerate() {
        // A `#` starts a comment at the start of a line or after white space.
        let mut previous = ' ';
        for (column, c) in line.chars().enumerate() {
            match c {
                '#' if previous.is_whitespace() => break,
                '[' | '{' => {
                    depth += 1;
                    if depth > max {
                        return Some((line_no + 1, column + 1));
                    }
                }
                ']' | '}' => depth = depth.saturating_sub(1),
                _ => {}
            }
            previous = c;
        }
    }
    None
}

/// The line of a document marker (`---`, or `...` followed by more) that starts a second
/// document. serde_yaml reports several documents only as a missing `version` or not at all.
fn second_document(source: &str) -> Option<usize> {
    let is_marker = |line: &str, marker: &str| {
        line.strip_prefix(marker)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r']))
    };
    // Whether a document has begun: a marker or content was seen.
    let mut begun = false;
    let mut ended = false;
    for (i, line) in source.lines().enumerate() {
        let code = line.split('#').next().unwrap_or("").trim();
        if is_marker(line, "---") {
            if begun || ended {
                return Some(i + 1);
            }
            begun = true;
        } else if is_marker(line, "...") {
            ended = true;
        } else if !code.is_empty() && !code.starts_with('%') {
            if ended {
                return Some(i + 1);
            }
            begun = true;
        }
    }
    None
}

/// serde_yaml places errors raised by a value's own `Deserialize` at the start of the
/// enclosing mapping or sequence. Our messages quote the offending text in backticks, so the
/// first occurrence of it from there on is the value itself.
fn refine_location(source: &str, at: (usize, usize), message: &str) -> (usize, usize) {
    let Some(quoted) = message.split('`').nth(1).filter(|q| !q.is_empty()) else {
        return at;
    };
    let (line, column) = at;
    for (i, text) in source.lines().enumerate().skip(line.saturating_sub(1)) {
        let from = if i + 1 == line {
            column.saturating_sub(1)
        } else {
            0
        };
        if let Some(found) = text.get(from..).and_then(|rest| rest.find(quoted)) {
            return (i + 1, from + found + 1);
        }
    }
    at
}

/// serde_yaml's message without its own " at line L column C" tail (we print the location
/// first, as compilers do).
fn yaml_message(e: &serde_yaml::Error) -> String {
    let text = e.to_string();
    let mut text = match text.rsplit_once(" at line ") {
        Some((head, _)) if e.location().is_some() => head.to_string(),
        _ => text,
    };
    // serde quotes the offending value whole: a megabyte-long string must not become a
    // megabyte-long log line.
    const MAX_MESSAGE: usize = 500;
    if text.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    if text.contains("unknown field") {
        format!("{text} (check the spelling; `egress-fence check --schema` prints every key)")
    } else if text.contains("missing field `version`") {
        format!("{text}: every policy starts with `version: {SCHEMA_VERSION}`")
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::test_support::*;
    use crate::core::policy::*;

    #[test]
    fn full_policy_parses_with_every_field() {
        let p = parse(FULL).expect("valid");
        assert_eq!(p.action, Action::Drop);
        assert_eq!(
            p.allow[0].target,
            Target::Domain("api.example.com".parse().unwrap())
        );
        assert_eq!(
            p.allow[0].ports,
            vec![
                PortRange::single(443),
                PortRange {
                    first: 8000,
                    last: 8080
                }
            ]
        );
        assert_eq!(p.allow[0].protocol, Protocol::Any);
        assert_eq!(p.allow[0].comment.as_deref(), Some("model API"));
        assert_eq!(p.allow[1].protocol, Protocol::Tcp);
        assert_eq!(p.deny[0].origin, DenyOrigin::Preset(Preset::CloudMetadata));
        assert!(
            p.deny[0]
                .networks
                .contains(&"169.254.0.0/16".parse().unwrap())
        );
        assert_eq!(p.dns.resolvers.as_ref().map(Vec::len), Some(2));
        assert_eq!(p.log.group, Some(100));
        assert_eq!(p.log.rate.to_string(), "5/minute");
        assert_eq!(p.essentials.len(), 2);
    }

    #[test]
    fn defaults_are_applied() {
        let p = parse("version: 1\nallow:\n  - cidr: 192.0.2.1\n").expect("valid");
        assert_eq!(p.action, Action::Reject);
        assert_eq!(p.allow[0].ports, vec![PortRange::ALL]);
        assert_eq!(
            p.allow[0].target,
            Target::Cidr("192.0.2.1/32".parse().unwrap())
        );
        assert_eq!(p.log.prefix, DEFAULT_LOG_PREFIX);
        assert_eq!(p.log.rate, DEFAULT_RATE);
        assert_eq!(p.log.group, None);
        assert_eq!(p.dns.resolvers, None);
        assert_eq!(p.essentials.len(), Essential::ALL.len());
    }

    #[test]
    fn unknown_key_is_refused_with_its_position() {
        let (line, col, msg) = err("version: 1\nallow:\n  - domain: a.example\n    prots: [1]\n");
        assert_eq!((line, col), (4, 5), "{msg}");
        assert!(msg.contains("unknown field `prots`"), "{msg}");
    }

    #[test]
    fn unknown_top_level_key_is_refused() {
        let (line, _, msg) = err("version: 1\nalow: []\n");
        assert_eq!(line, 2);
        assert!(msg.contains("unknown field `alow`"), "{msg}");
    }

    #[test]
    fn yaml_syntax_errors_carry_a_position() {
        let (line, col, msg) = err("version: 1\nallow:\n  - domain: [a\n");
        assert!(line >= 3 && col > 0, "{line}:{col} {msg}");
    }

    #[test]
    fn wrong_version_and_missing_version_are_refused() {
        let (line, _, msg) = err("version: 2\n");
        assert_eq!(line, 1);
        assert!(msg.contains("version 2 is not known"), "{msg}");
        let (_, _, msg) = err("allow: []\n");
        assert!(msg.contains("version: 1"), "{msg}");
    }

    #[test]
    fn oversized_policies_are_refused_before_parsing() {
        let padding = |n: usize| format!("version: 1\n{}", "#\n".repeat(n));
        let limit = MAX_POLICY_BYTES as usize;
        let at_limit = padding((limit - 11) / 2);
        assert!(at_limit.len() <= limit && at_limit.len() > limit - 2);
        assert!(parse(&at_limit).is_ok());
        let over = format!("{at_limit}##");
        let (line, _, message) = err(&over);
        assert_eq!(line, 0);
        assert!(message.contains("1024 KiB"), "{message}");

        // What the file holds past the limit is never read.
        let dir = std::env::temp_dir().join(format!("ef-policy-size-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("big.yaml");
        std::fs::write(&file, padding(limit)).expect("write");
        let e = Policy::load(&file).expect_err("too big");
        std::fs::remove_dir_all(&dir).expect("clean up");
        assert!(e.to_string().contains("larger than"), "{e}");
    }

    #[test]
    fn deep_nesting_is_refused_at_the_bracket_that_goes_too_deep() {
        let nested = |n: usize| {
            format!(
                "version: 1\nallow:\n  - cidr: 192.0.2.0/24\n    ports: {}{}\n",
                "[".repeat(n),
                "]".repeat(n)
            )
        };
        // Within the limit the text reaches serde, which refuses it as the wrong shape.
        let (_, _, message) = err(&nested(MAX_POLICY_NESTING));
        assert!(!message.contains("nested"), "{message}");
        let (line, column, message) = err(&nested(MAX_POLICY_NESTING + 1));
        assert_eq!((line, column), (4, 11 + MAX_POLICY_NESTING + 1));
        assert!(message.contains("nested more than 32"), "{message}");
        // The 240 KB of `[` is refused by the scan, before the YAML parser.
        let (line, column, _) = err(&"[".repeat(240_000));
        assert_eq!((line, column), (1, MAX_POLICY_NESTING + 1));
        // Brackets in comments do not count; in a quoted or block scalar they do, so that no
        // quote can hide the brackets after it.
        let commented = format!(
            "version: 1\n# {}\nlog:  # {}\n",
            "[".repeat(40),
            "{".repeat(40)
        );
        assert!(parse(&commented).is_ok());
        let (line, _, _) = err(&format!(
            "version: 1\nlog:\n  prefix: \"{}\"\n",
            "[".repeat(40)
        ));
        assert_eq!(line, 3);
        let hidden = format!(
            "version: 1\nprobe:\n  exfil_domain: |\n    '\nallow: [x', {}\n",
            "[".repeat(40)
        );
        assert_eq!(err(&hidden).0, 5);
        // The schema's own flow style is far inside the limit.
        assert!(parse(FULL).is_ok());
    }

    #[test]
    fn a_long_value_is_not_quoted_whole() {
        let (_, _, message) = err(&format!("version: 1\nallow: {}\n", "\u{e9}".repeat(5000)));
        assert!(message.len() < 520, "{} bytes", message.len());
        assert!(message.ends_with("..."), "{message}");
    }

    #[test]
    fn several_documents_are_named_as_such() {
        for (src, line) in [
            ("version: 1\n---\nallow: []\n", 2),
            ("---\nversion: 1\n---\nversion: 1\n", 3),
            ("--- {version: 1}\n--- {version: 1}\n", 2),
            ("---\n---\nversion: 1\n", 2),
            ("version: 1\n...\nallow: []\n", 3),
        ] {
            let (l, column, message) = err(src);
            assert_eq!((l, column), (line, 1), "{src:?}");
            assert!(message.contains("second YAML document"), "{message}");
        }
        // One document, with its optional markers, is fine.
        assert!(parse("---\nversion: 1\n...\n").is_ok());
        assert!(parse("# comment\n---\nversion: 1\n").is_ok());
        assert!(parse("--- # policy\nversion: 1\n").is_ok());
    }
}
