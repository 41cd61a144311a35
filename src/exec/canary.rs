//! The canary: a per-run token that looks like a live credential, put in CMD's environment
//! (and a file, if asked), and looked for in every DNS question the guard refused, raw or
//! encoded (hex, base32, base64), ignoring case and the dots between labels (DNS is
//! case-insensitive, the guard may vary the case, and a long encoding is split into labels).

use super::ExecError;

/// The variable CMD finds the canary in.
pub const VARIABLE: &str = "CANARY_API_KEY";
/// What the token starts with (what a live key of a payment API looks like).
const PREFIX: &str = "ck_live_";

/// A fresh token: `ck_live_` and 32 random hex digits.
pub fn mint() -> Result<String, ExecError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| ExecError::Refused(format!("no randomness: {e}")))?;
    Ok(format!("{PREFIX}{}", hex(&bytes)))
}

/// What a question is searched for: the token and its encodings, lower case.
pub fn needles(token: &str) -> Vec<String> {
    let bytes = token.as_bytes();
    let mut out = vec![
        token.to_string(),
        hex(bytes),
        base32(bytes),
        base64(bytes, false),
        base64(bytes, true),
    ];
    for n in &mut out {
        *n = n.to_ascii_lowercase();
    }
    out
}

/// Whether the name carries one of `needles` (see the module comment).
pub fn carries(name: &str, needles: &[String]) -> bool {
    let squashed: String = name
        .chars()
        .filter(|c| *c != '.')
        .collect::<String>()
        .to_ascii_lowercase();
    needles.iter().any(|n| squashed.contains(n.as_str()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// RFC 4648 base32, without padding.
fn base32(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::new();
    let (mut buffer, mut bits) = (0u32, 0u32);
    for &b in bytes {
        buffer = (buffer << 8) | u32::from(b);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((buffer >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((buffer << (5 - bits)) & 31) as usize] as char);
    }
    out
}

/// RFC 4648 base64 (or its URL-safe alphabet), without padding.
fn base64(bytes: &[u8], url_safe: bool) -> String {
    let alphabet: &[u8; 64] = if url_safe {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    } else {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    };
    let mut out = String::new();
    let (mut buffer, mut bits) = (0u32, 0u32);
    for &b in bytes {
        buffer = (buffer << 8) | u32::from(b);
        bits += 8;
        while bits >= 6 {
            bits -= 6;
            out.push(alphabet[((buffer >> bits) & 63) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(alphabet[((buffer << (6 - bits)) & 63) as usize] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings_match_rfc_4648() {
        assert_eq!(base32(b"foobar"), "MZXW6YTBOI");
        assert_eq!(base64(b"foobar", false), "Zm9vYmFy");
        assert_eq!(base64(b"fo", false), "Zm8");
        assert_eq!(base64(&[0xfb, 0xff], true), "-_8");
        assert_eq!(hex(b"\x01\xab"), "01ab");
    }

    #[test]
    fn a_token_is_found_raw_or_encoded_across_labels_and_case() {
        let token = mint().expect("a token");
        assert!(token.starts_with("ck_live_") && token.len() == 40);
        let needles = needles(&token);
        let hexed = hex(token.as_bytes());
        let split = format!("{}.{}.evil.test", &hexed[..40], &hexed[40..]);
        assert!(carries(&split, &needles));
        let b32 = base32(token.as_bytes()).to_ascii_uppercase();
        assert!(carries(&format!("{b32}.evil.test"), &needles));
        assert!(carries(
            &format!("x{}.evil.test", token.to_uppercase()),
            &needles
        ));
        assert!(!carries("registry.example.test", &needles));
    }
}
