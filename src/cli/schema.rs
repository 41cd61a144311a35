//! The policy schema that `check --help` prints (and an invalid policy's message points to).

/// Two example policies: every key the parser takes, in resolve mode (the default) and in
/// guard mode, with its default where it has one. The unit tests below parse both examples
/// and ask the parser which keys it takes, so this text cannot fall behind the schema.
pub const SCHEMA: &str = "\
Policy schema (YAML). Only `version` is required; \"default\" marks what a key left out gives.
  version: 1                      # required
  action: reject                  # unmatched traffic: reject (default; fails fast) or drop
  allow:                          # destinations that may be reached
    - domain: api.example.com     # resolved to A and AAAA
      ports: [443, \"8000-8080\"]   # required for a domain (ranges of at most 256 ports)
      protocol: tcp               # tcp (default), udp or any (both)
      comment: model API          # free text, any entry
    - cidr: 203.0.113.0/28        # an IPv4 or IPv6 network, or one address
      ports: [22]                 # default for a cidr: every port
  include: [github, npm]         # curated allow entries appended after yours: github, npm,
                                  #   pypi, crates, go, docker-hub, debian, ubuntu,
                                  #   anthropic-api, openai-api (`check` lists them)
  deny:                           # checked before allow: deny wins
    - preset: cloud-metadata      # or private-networks, dns-over-https (implied in guard mode)
      comment: instance credentials
    - cidr: 10.0.0.0/8
  dns:                            # mode: resolve (default): names re-resolved on a timer
    resolvers: [192.0.2.53]       # the only resolvers allowed; default: those of resolv.conf
    refresh: {min: 30s, max: 1h}  # re-resolve after the TTL, clamped to these (defaults)
    grace: 10m                    # default; an address outlives its last answer this long
  log:
    prefix: \"EGRESS-DROP: \"       # default as shown
    group: 100                    # NFLOG group for refused packets (default: kernel log)
    rate: 10/second               # default; per second, minute, hour or day
    burst: 20                     # default
  essentials: [loopback, established, icmpv6-nd, dhcpv4, dhcpv6]   # default: all
  probe:                          # what `egress-fence probe` checks besides the policy
    blocked: [\"paste.example:443\", \"[2001:db8::9]:443\"]   # must be refused
    rogue_resolvers: [1.1.1.1]    # must be unreachable; default: well-known public ones
    exfil_domain: exfil.example.com   # random names under it must not resolve

DNS guard (`run` is the host's resolver: see `run --help`); the same keys, with this `dns:`:
  dns:
    mode: guard
    upstream: [192.0.2.53]        # required: where allowed names go; only the guard may ask
    listen: [127.0.0.53:53]       # default; UDP and TCP: point resolv.conf here
    refuse_with: refused          # default; or nxdomain: the answer to other names
    floor: 30s                    # default; an answered address lives max(TTL, floor) + grace
    grace: 10m                    # default
    mark: 0x65000000              # default; the SO_MARK of the guard's upstream sockets
  allow:
    - domain: \"*.example.com\"     # wildcards (guard mode only): `*.` one label, `**.` any
      ports: [443]                #   depth; neither covers example.com itself
  scope:                          # who is fenced (either mode); default: the whole namespace
    users: [1001]                 # names (looked up when the policy is read) or uids; not root
    groups: [2000]                # names or gids: sockets of the group and of its members
    cgroups: [agent.slice]        # cgroup v2 subtrees, below the hierarchy's root
    forward: [docker0, \"br-*\"]    # what these interfaces forward (containers on a bridge)";

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;

    use egress_fence::core::policy::Policy;
    use serde_yaml::Value;

    use super::SCHEMA;

    /// The schema's two examples as policy files: the resolve-mode one, and the guard-mode one
    /// (its lines after the blank one, with `version: 1`).
    fn examples() -> [String; 2] {
        let (resolve, guard) = SCHEMA.split_once("\n\n").expect("two examples");
        let body = |text: &str| -> String {
            text.lines()
                .skip(1)
                .map(|l| l.strip_prefix("  ").expect("indented by two spaces"))
                .map(|l| format!("{l}\n"))
                .collect()
        };
        [body(resolve), format!("version: 1\n{}", body(guard))]
    }

    fn parse(text: &str) -> Policy {
        Policy::parse(text, Path::new("schema.yaml"))
            .unwrap_or_else(|e| panic!("the schema's example does not parse: {e}\n{text}"))
    }

    #[test]
    fn both_examples_are_valid_policies() {
        let [resolve, guard] = examples();
        assert!(parse(&resolve).dns.guard.is_none());
        let guard = parse(&guard);
        let g = guard.dns.guard.expect("guard mode");
        assert_eq!(g.mark, 0x6500_0000);
    }

    /// A line whose note says it shows the default changes nothing when it is left out.
    #[test]
    fn what_the_schema_calls_a_default_is_the_default() {
        let mut checked = 0;
        for example in examples() {
            let full = parse(&example);
            for (i, line) in example.lines().enumerate() {
                let Some((code, note)) = line.split_once("  # ") else {
                    continue;
                };
                if code.trim_end().ends_with(':') {
                    continue; // a section: its note is about what it holds
                }
                let claims_default = note == "default"
                    || note.starts_with("default;")
                    || note.starts_with("default as shown")
                    || ["(default)", "(default;", "(defaults)"]
                        .iter()
                        .any(|d| note.contains(d));
                if !claims_default {
                    continue;
                }
                let without: String = example
                    .lines()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, l)| format!("{l}\n"))
                    .collect();
                let without = Policy::parse(&without, Path::new("schema.yaml"))
                    .unwrap_or_else(|e| panic!("without `{line}`: {e}"));
                assert_eq!(without, full, "`{line}` is not the default");
                checked += 1;
            }
        }
        assert!(checked >= 10, "only {checked} defaults checked");
    }

    /// The keys the parser takes at one place of a policy, as its own error names them:
    /// `section` holds the placeholder `KEY`, which the parser refuses.
    fn accepted_keys(section: &str) -> BTreeSet<String> {
        let text = format!("version: 1\n{}\n", section.replace("KEY", "no_such_key"));
        let error = Policy::parse(&text, Path::new("keys.yaml"))
            .expect_err("an unknown key is refused")
            .to_string();
        let expected = error
            .split_once("expected ")
            .and_then(|(_, keys)| keys.split(" (").next())
            .unwrap_or_else(|| panic!("no list of keys in: {error}"));
        let keys: BTreeSet<String> = expected
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect();
        assert!(!keys.is_empty(), "{error}");
        keys
    }

    /// The keys the examples write at `path` ("[]" steps into every list item).
    fn written_keys(path: &[&str]) -> BTreeSet<String> {
        let mut at: Vec<Value> = examples()
            .iter()
            .map(|e| serde_yaml::from_str(e).expect("YAML"))
            .collect();
        for step in path {
            at = at
                .into_iter()
                .flat_map(|v| match (*step, v) {
                    ("[]", Value::Sequence(items)) => items,
                    (key, Value::Mapping(m)) => m.get(key).cloned().into_iter().collect(),
                    _ => Vec::new(),
                })
                .collect();
        }
        at.iter()
            .filter_map(Value::as_mapping)
            .flat_map(|m| m.keys().filter_map(Value::as_str).map(str::to_owned))
            .collect()
    }

    #[test]
    fn every_key_the_parser_takes_is_in_the_schema() {
        for (section, path) in [
            ("KEY: 1", &[][..]),
            ("allow: [{KEY: 1}]", &["allow", "[]"][..]),
            ("deny: [{KEY: 1}]", &["deny", "[]"][..]),
            ("dns: {KEY: 1}", &["dns"][..]),
            ("dns: {refresh: {KEY: 1}}", &["dns", "refresh"][..]),
            ("log: {KEY: 1}", &["log"][..]),
            ("probe: {KEY: 1}", &["probe"][..]),
            ("scope: {KEY: 1}", &["scope"][..]),
        ] {
            let accepted = accepted_keys(section);
            let written = written_keys(path);
            let missing: Vec<_> = accepted.difference(&written).collect();
            assert!(
                missing.is_empty(),
                "{section}: the schema lacks {missing:?}"
            );
            let unknown: Vec<_> = written.difference(&accepted).collect();
            assert!(
                unknown.is_empty(),
                "{section}: the parser refuses {unknown:?}"
            );
        }
    }
}
