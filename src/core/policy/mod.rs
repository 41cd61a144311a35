//! The policy file: YAML schema, validation and the deny presets.
//!
//! Every check that concerns a single value lives in that value's `Deserialize` impl, so that
//! serde_yaml attaches the line and column of the offending value to the error. Checks that
//! relate two parts of the policy run afterwards and locate their subject in the source text.
//!
//! `schema` holds the validated policy the rest of the program reads; `names` and `values` the
//! single values a policy is written with; `raw` the file as written; `load` reads it (size,
//! nesting and document checks before the YAML parser, its errors placed at file:line:column);
//! `validate` turns the raw file into a policy; `errors` says where and why; `presets` the
//! named deny lists; `includes` the curated allow lists (`include:`); `limits` what the kernel accepts; `warnings` what is allowed but
//! probably not meant; `json_schema` the JSON Schema generated from `raw`'s types.

mod audit;
mod errors;
mod includes;
mod json_schema;
mod limits;
mod load;
mod names;
mod presets;
mod raw;
mod schema;
mod scope;
mod validate;
mod values;
mod warnings;

pub use audit::AUDIT_WARNING;
pub use errors::PolicyError;
pub use includes::AllowPreset;
pub use json_schema::policy_schema;
pub use limits::{UNCHECKED_KERNEL_LIMITS_ENV, kernel_accepts_limit};
pub use load::{MAX_POLICY_BYTES, MAX_POLICY_NESTING};
#[cfg(test)]
pub(crate) use names::name_of_length;
pub use names::{DomainName, Wildcard};
pub use presets::Preset;
pub use schema::*;
pub use scope::{
    AccountRef, Accounts, CgroupPath, IfacePattern, MAX_IFACE_NAME, Scope, ScopeGroup, ScopeUser,
    SystemAccounts,
};
pub use values::{
    HumanDuration, MAX_DOMAIN_PORT_RANGE, PortRange, ProbeHost, ProbeTarget, Rate, RateUnit,
};
pub use warnings::{
    BridgePort, CgroupDelegation, Delegate, HostFinding, LocalResolver, LocalResolverKind,
    ScopeEntry, ScopeHole, ScopeHost, wildcard_risk,
};

#[cfg(test)]
mod test_support;

#[cfg(test)]
mod tests {
    /// Every file of the policy module, for checks over the text of its messages.
    const SOURCES: [(&str, &str); 12] = [
        ("errors.rs", include_str!("errors.rs")),
        ("includes.rs", include_str!("includes.rs")),
        ("limits.rs", include_str!("limits.rs")),
        ("load.rs", include_str!("load.rs")),
        ("mod.rs", include_str!("mod.rs")),
        ("names.rs", include_str!("names.rs")),
        ("presets.rs", include_str!("presets.rs")),
        ("raw.rs", include_str!("raw.rs")),
        ("schema.rs", include_str!("schema.rs")),
        ("validate.rs", include_str!("validate.rs")),
        ("values.rs", include_str!("values.rs")),
        ("warnings.rs", include_str!("warnings.rs")),
    ];

    /// The text of the ordinary (not raw) string literals in `code`, with `\` line
    /// continuations applied as the compiler applies them; comments and char literals skipped.
    fn string_literals(code: &str) -> Vec<String> {
        let b = code.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'/' if b.get(i + 1) == Some(&b'/') => {
                    while i < b.len() && b[i] != b'\n' {
                        i += 1;
                    }
                }
                b'\'' if b.get(i + 1) == Some(&b'\\') => {
                    i += 3;
                    while i < b.len() && b[i] != b'\'' {
                        i += 1;
                    }
                    i += 1;
                }
                b'\'' if b.get(i + 2) == Some(&b'\'') => i += 3,
                b'r' if b.get(i + 1).is_some_and(|c| *c == b'"' || *c == b'#')
                    && !b[i - 1].is_ascii_alphanumeric()
                    && b[i - 1] != b'_' =>
                {
                    let hashes = b[i + 1..].iter().take_while(|c| **c == b'#').count();
                    let close = format!("\"{}", "#".repeat(hashes));
                    let start = i + 2 + hashes;
                    i = code[start..]
                        .find(&close)
                        .map_or(b.len(), |n| start + n + close.len());
                }
                b'"' => {
                    let mut text = Vec::new();
                    i += 1;
                    while i < b.len() && b[i] != b'"' {
                        if b[i] == b'\\' && b.get(i + 1) == Some(&b'\n') {
                            i += 2;
                            while i < b.len() && b[i].is_ascii_whitespace() {
                                i += 1;
                            }
                        } else if b[i] == b'\\' {
                            text.extend_from_slice(&b[i..i + 2]);
                            i += 2;
                        } else {
                            text.push(b[i]);
                            i += 1;
                        }
                    }
                    out.push(String::from_utf8_lossy(&text).into_owned());
                    i += 1;
                }
                _ => i += 1,
            }
        }
        out
    }

    #[test]
    fn the_literal_scanner_applies_continuations_and_skips_comments() {
        let code =
            "// \"a  b\"\nlet x = b'\"'; let y = '\\''; f(\"one \\\n     two\", r#\"c  d\"#);\n";
        assert_eq!(string_literals(code), vec!["one two".to_string()]);
        assert_eq!(string_literals("\"a\n  b\""), vec!["a\n  b".to_string()]);
    }

    /// A message written across source lines without a `\` keeps the next line's
    /// indentation: no message (nor any other literal outside the tests) has a run of spaces.
    #[test]
    fn no_message_has_a_run_of_spaces() {
        for (file, text) in SOURCES {
            let code = text.split("#[cfg(test)]").next().unwrap_or(text);
            for literal in string_literals(code) {
                assert!(
                    !literal.contains("  ") && !literal.contains('\n'),
                    "{file}: a string literal holds a run of spaces or a line break: {literal:?}"
                );
            }
        }
    }
}
