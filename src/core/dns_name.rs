//! DNS names as text for people and logs: the presentation form of RFC 1035 (section 5.1),
//! as dig and BIND write it. A name a client asked is hostile input: every byte that is not
//! plain printable ASCII becomes `\DDD` (three decimal digits), so that no control
//! character, escape sequence or invisible byte reaches a terminal or a log line, and the same
//! bytes always read the same way.

/// `labels` (as on the wire, case preserved) in presentation form, without the final dot;
/// the root (no labels) is `.`.
///
/// A label's `.` and `\`, and the characters a zone file gives a meaning (`"`, `(`, `)`,
/// `;`, `@`, `$`), are written with a backslash before them; space, control characters and
/// bytes above 126 as `\DDD` in decimal (hickory writes octal there, which RFC 1035 readers
/// take for decimal: `\200` would read back as byte 200, not 128).
pub fn presentation<L: AsRef<[u8]>>(labels: impl IntoIterator<Item = L>) -> String {
    let mut out = String::new();
    for (i, label) in labels.into_iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        for &byte in label.as_ref() {
            match byte {
                b'.' | b'\\' | b'"' | b'(' | b')' | b';' | b'@' | b'$' => {
                    out.push('\\');
                    out.push(char::from(byte));
                }
                0x21..=0x7e => out.push(char::from(byte)),
                _ => out.push_str(&format!("\\{byte:03}")),
            }
        }
    }
    if out.is_empty() {
        out.push('.');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_are_written_as_they_are_case_preserved() {
        assert_eq!(presentation(["www", "Example", "COM"]), "www.Example.COM");
        assert_eq!(
            presentation(["_dmarc", "a-b", "example"]),
            "_dmarc.a-b.example"
        );
        assert_eq!(presentation(["*", "pool", "example"]), "*.pool.example");
    }

    #[test]
    fn the_root_is_a_dot() {
        assert_eq!(presentation(Vec::<&[u8]>::new()), ".");
    }

    #[test]
    fn other_bytes_are_escaped_in_decimal() {
        assert_eq!(presentation([&[0x80u8][..], b"example"]), "\\128.example");
        assert_eq!(presentation([&b"a\x00b"[..]]), "a\\000b");
        assert_eq!(presentation([&b"tab\there"[..]]), "tab\\009here");
        assert_eq!(presentation([&b"a b"[..]]), "a\\032b");
        assert_eq!(presentation([&b"\x1b[31m"[..]]), "\\027[31m");
        assert_eq!(presentation([&b"\x7f\xff"[..]]), "\\127\\255");
        // UTF-8 is bytes like any other: no lookalike letters reach the reader.
        assert_eq!(presentation(["é"]), "\\195\\169");
    }

    #[test]
    fn dots_backslashes_and_zone_file_specials_are_quoted() {
        // One label holding a dot is not two labels, and no final dot goes missing.
        assert_eq!(presentation(["ben.fry", "example"]), "ben\\.fry.example");
        assert_eq!(presentation(["a."]), "a\\.");
        assert_eq!(presentation(["a\\b"]), "a\\\\b");
        assert_eq!(presentation(["\"();@$"]), "\\\"\\(\\)\\;\\@\\$");
    }
}
