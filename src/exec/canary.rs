//! The canary: a per-run token that looks like a live credential, put in CMD's environment
//! (and a file, if asked), and looked for in every DNS question the guard refused, raw or
//! encoded (hex, base32, base64), ignoring case and the dots between labels (DNS is
//! case-insensitive, the guard may vary the case, and a long encoding is split into labels).
//!
//! The canary also has a URL, `https://HOST/hook/TOKEN` (a webhook, where a stolen key is
//! most often sent). Reaching it starts with a DNS question for HOST: every one the guard
//! saw (refused, or sent upstream when the policy allows HOST) trips the canary, and the
//! refused connections to the addresses HOST was answered with are listed. HOST is a fresh
//! name under `canary.invalid` (never answered: a leak shows as its question) unless the
//! caller names one (`--canary-host`).

use super::ExecError;

/// The variable CMD finds the canary in.
pub const VARIABLE: &str = "CANARY_API_KEY";
/// The variable CMD finds the canary's URL in.
pub const URL_VARIABLE: &str = "CANARY_WEBHOOK_URL";
/// Where a run's own canary host is made (RFC 6761: `.invalid` is never answered).
const HOST_PARENT: &str = "canary.invalid";
/// What the token starts with (what a live key of a payment API looks like).
const PREFIX: &str = "ck_live_";

/// A fresh token: `ck_live_` and 32 random hex digits.
pub fn mint() -> Result<String, ExecError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| ExecError::Refused(format!("no randomness: {e}")))?;
    Ok(format!("{PREFIX}{}", hex(&bytes)))
}

/// A fresh host for the canary's URL: `hooks-` and 12 random hex digits under
/// `canary.invalid`.
pub fn mint_host() -> Result<String, ExecError> {
    let mut bytes = [0u8; 6];
    getrandom::fill(&mut bytes).map_err(|e| ExecError::Refused(format!("no randomness: {e}")))?;
    Ok(format!("hooks-{}.{HOST_PARENT}", hex(&bytes)))
}

/// The canary's URL.
pub fn url(host: &str, token: &str) -> String {
    format!("https://{host}/hook/{token}")
}

/// Whether `name` (presentation form, a final dot or not) is `host` or a name under it.
pub fn asks_host(name: &str, host: &str) -> bool {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    name == host || name.ends_with(&format!(".{host}"))
}

/// How many characters of the token's random part a fragment must hold to count: 12 hex
/// digits are 48 random bits, which no innocent name carries by chance.
const FRAGMENT: usize = 12;

/// What a question is searched for, lower case, letters and digits only ([`squash`]): the
/// token and its encodings (hex, base32, base64 and its URL-safe alphabet), each also
/// reversed, and those of the token reversed; the base32 and base64 of the token after 1 to
/// 4 (base32) or 1 to 2 (base64) bytes of anything, which shift its encoding's
/// characters (the ones the other bytes touch left out); and every fragment of the token's
/// random part of [`FRAGMENT`] characters, plain or hex, so a token split across questions
/// or labels is found in each piece. A tripwire, not a proof: an encoding it does not know
/// (encryption, a reordering) goes unseen.
pub fn needles(token: &str) -> Vec<String> {
    let bytes = token.as_bytes();
    let mut out = vec![
        token.to_string(),
        hex(bytes),
        base32(bytes),
        base64(bytes, false),
        base64(bytes, true),
    ];
    // Each leading byte count whose encoding starts at a new offset within the groups.
    for lead in 1..=4usize {
        let mut shifted = vec![0u8; lead];
        shifted.extend_from_slice(bytes);
        let skip = (8 * lead).div_ceil(5);
        let encoded = base32(&shifted);
        out.push(encoded[skip..encoded.len() - 1].to_string());
        if lead <= 2 {
            let skip = (8 * lead).div_ceil(6);
            for url_safe in [false, true] {
                let encoded = base64(&shifted, url_safe);
                out.push(encoded[skip..encoded.len() - 1].to_string());
            }
        }
    }
    out.push(base32hex(bytes));
    // The token reversed, then encoded: in each encoding the forward token has.
    let backwards: Vec<u8> = bytes.iter().rev().copied().collect();
    out.extend([
        hex(&backwards),
        base32(&backwards),
        base32hex(&backwards),
        base64(&backwards, false),
        base64(&backwards, true),
    ]);
    let reversed: Vec<String> = out.iter().map(|n| n.chars().rev().collect()).collect();
    out.extend(reversed);
    let random = token.strip_prefix(PREFIX).unwrap_or(token);
    if random.len() >= FRAGMENT {
        for start in 0..=random.len() - FRAGMENT {
            let piece = &random[start..start + FRAGMENT];
            out.push(piece.to_string());
            out.push(hex(piece.as_bytes()));
        }
    }
    let mut out: Vec<String> = out.iter().map(|n| squash(n)).collect();
    out.retain(|n| !n.is_empty());
    out.sort();
    out.dedup();
    out
}

/// What a name or needle is compared as: its letters and digits alone, lower case, a DNS
/// name's escapes (`\DDD`, `\X`) read first. The dots between labels are not all a name
/// may split a token with: a hyphen, an underscore or any other byte between pieces shorter
/// than a fragment would hide it just as well.
fn squash(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        let c = match c {
            '\\' => {
                let digits: String = std::iter::from_fn(|| chars.next_if(char::is_ascii_digit))
                    .take(3)
                    .collect();
                match digits.parse::<u8>() {
                    Ok(byte) if digits.len() == 3 => char::from(byte),
                    _ if digits.is_empty() => chars.next().unwrap_or('\\'),
                    // A short escape: its digits are data.
                    _ => {
                        out.push_str(&digits);
                        continue;
                    }
                }
            }
            c => c,
        };
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

/// Whether the name carries one of `needles` (see the module comment).
pub fn carries(name: &str, needles: &[String]) -> bool {
    let squashed = squash(name);
    needles.iter().any(|n| squashed.contains(n.as_str()))
}

/// The questions of a run joined in the order they came, by their first labels (where a name
/// carries its data), so that a token sent in pieces too short to trip alone (fewer than
/// [`FRAGMENT`] characters a question) is found where the pieces meet. Only the most recent
/// characters are kept: enough to hold any needle whole.
#[derive(Debug, Default)]
pub struct Joined {
    tail: String,
}

/// How much of the joined first labels is kept.
const JOINED_TAIL: usize = 512;

impl Joined {
    /// Adds `name`'s first label; whether the joined labels now carry one of `needles`.
    pub fn push(&mut self, name: &str, needles: &[String]) -> bool {
        let label = squash(name.split('.').next().unwrap_or_default());
        self.tail.push_str(&label);
        if self.tail.len() > JOINED_TAIL {
            let cut = self.tail.len() - JOINED_TAIL;
            let cut = (cut..self.tail.len())
                .find(|&i| self.tail.is_char_boundary(i))
                .unwrap_or(self.tail.len());
            self.tail.drain(..cut);
        }
        needles.iter().any(|n| self.tail.contains(n.as_str()))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// RFC 4648 base32, without padding.
fn base32(bytes: &[u8]) -> String {
    base32_with(bytes, b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567")
}

/// RFC 4648 base32 with the extended hex alphabet ("base32hex", as DNSSEC's NSEC3 writes
/// names), without padding.
fn base32hex(bytes: &[u8]) -> String {
    base32_with(bytes, b"0123456789ABCDEFGHIJKLMNOPQRSTUV")
}

fn base32_with(bytes: &[u8], alphabet: &[u8; 32]) -> String {
    let mut out = String::new();
    let (mut buffer, mut bits) = (0u32, 0u32);
    for &b in bytes {
        buffer = (buffer << 8) | u32::from(b);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(alphabet[((buffer >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(alphabet[((buffer << (5 - bits)) & 31) as usize] as char);
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

    #[test]
    fn a_token_reversed_split_or_shifted_is_found_too() {
        let token = mint().expect("a token");
        let needles = needles(&token);
        let reversed: String = token.chars().rev().collect();
        assert!(carries(&format!("{reversed}.evil.test"), &needles));
        // Split in two questions: each piece alone trips.
        assert!(carries(&format!("{}.evil.test", &token[..20]), &needles));
        assert!(carries(&format!("{}.evil.test", &token[20..]), &needles));
        // Shifted by bytes before it, in each alignment, in either base.
        for lead in 1..=4usize {
            let mut shifted = b"xyzw"[..lead].to_vec();
            shifted.extend_from_slice(token.as_bytes());
            let b32 = base32(&shifted);
            assert!(carries(&format!("{b32}.evil.test"), &needles), "{lead}");
            let b64 = base64(&shifted, true);
            assert!(carries(&format!("{b64}.evil.test"), &needles), "{lead}");
        }
        // Split inside one label by hyphens, or by escaped bytes, into pieces shorter than a
        // fragment.
        let random = &token["ck_live_".len()..];
        let hyphens = format!("{}-{}-{}", &random[..11], &random[11..22], &random[22..]);
        assert!(carries(&format!("{hyphens}.evil.test"), &needles));
        let escaped = format!(
            "{}\\000{}\\.{}",
            &random[..11],
            &random[11..22],
            &random[22..]
        );
        assert!(carries(&format!("{escaped}.evil.test"), &needles));
        assert_eq!(squash("a\\065b\\.c-d_e"), "aabcde");
        // Names that merely look like hex are not the token.
        assert!(!carries("0123456789ab.cdn.example.test", &needles));
    }

    #[test]
    fn the_host_is_matched_with_its_subdomains_in_any_case() {
        let host = mint_host().expect("a host");
        assert!(host.starts_with("hooks-") && host.ends_with(".canary.invalid"));
        assert!(asks_host(&format!("{}.", host.to_uppercase()), &host));
        assert!(asks_host(&format!("www.{host}"), &host));
        assert!(!asks_host(&format!("x{host}"), &host));
        assert!(!asks_host("canary.invalid", &host));
        assert_eq!(url("h.test", "ck_live_1"), "https://h.test/hook/ck_live_1");
    }
}
