//! The policy's JSON Schema, generated from the parser's own types (`raw`, and the values
//! they are written with) so that it cannot fall behind them: editors check a policy as it is
//! typed (the YAML language server), and `egress-fence check --schema` prints it.
//!
//! The structs and enums derive their schema; the values that have a `Deserialize` impl of
//! their own (names, networks, ports, durations, rates, ...) describe here what that impl
//! takes, as patterns. The schema says what a single value and the keys around it may be; the
//! checks that need more (a port range's width, a name's length, a user that must exist, a
//! duration's upper bound) stay the parser's, and `check` runs them. The tests hold the two
//! to the same verdict on a list of invalid policies, and list where the schema is laxer.

use std::borrow::Cow;

use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde_json::{Value, json};

use super::names::DomainName;
use super::raw::{DomainTarget, ListenAddr, Network, RawPolicy, Resolver};
use super::scope::{AccountRef, CgroupPath, IfacePattern, MAX_IFACE_NAME};
use super::values::{HumanDuration, PortRange, ProbeTarget, Rate};

/// The policy's JSON Schema (draft 7, which the YAML language server reads), as the pretty
/// JSON text that policies/policy.schema.json holds.
pub fn policy_schema() -> String {
    let schema = SchemaSettings::draft07()
        .into_generator()
        .into_root_schema_for::<RawPolicy>();
    let mut schema = schema.to_value();
    unwrap_descriptions(&mut schema);
    let mut text = serde_json::to_string_pretty(&schema).expect("a JSON value always serializes");
    text.push('\n');
    text
}

/// Joins the lines of each description's paragraphs: doc comments are wrapped at 100
/// columns, editors wrap to their own width.
fn unwrap_descriptions(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                match v {
                    Value::String(text) if key == "description" => {
                        *text = text
                            .split("\n\n")
                            .map(|paragraph| paragraph.replace('\n', " "))
                            .collect::<Vec<_>>()
                            .join("\n\n");
                    }
                    _ => unwrap_descriptions(v),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(unwrap_descriptions),
        _ => {}
    }
}

// The patterns, as the ECMA-262 regular expressions JSON Schema takes. The parser trims
// white space around most values; so do they.
const OCTET: &str = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])";
/// Port 1 to 65535, without leading zeros.
const PORT: &str =
    "([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])";
const LABEL: &str = "[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?";

fn ipv4() -> String {
    format!("{OCTET}(\\.{OCTET}){{3}}")
}

/// The shape of an IPv6 address (hex groups and colons, an IPv4 tail); the parser checks the
/// rest.
fn ipv6() -> String {
    format!(
        "[0-9A-Fa-f]{{0,4}}(:[0-9A-Fa-f]{{0,4}}){{1,7}}(:{})?",
        ipv4()
    )
}

fn name() -> String {
    format!("{LABEL}(\\.{LABEL})*\\.?")
}

/// `^\s*(ALTERNATIVES)\s*$`.
fn trimmed(alternatives: &str) -> String {
    format!("^\\s*({alternatives})\\s*$")
}

fn string_schema(description: &str, pattern: String) -> Schema {
    json_schema!({
        "type": "string",
        "description": description,
        "pattern": pattern,
    })
}

/// A JsonSchema impl that describes a value by a schema built at generation time.
macro_rules! described {
    ($type:ty, $name:literal, $schema:expr) => {
        impl JsonSchema for $type {
            fn schema_name() -> Cow<'static, str> {
                $name.into()
            }

            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                $schema
            }
        }
    };
}

described!(DomainName, "DomainName", {
    let mut schema = string_schema(
        "A domain name: labels of letters, digits, '-' and '_' (punycode for international \
         names), at most 253 characters.",
        trimmed(&name()),
    );
    schema.insert("maxLength".into(), json!(260));
    schema
});

described!(DomainTarget, "DomainTarget", {
    string_schema(
        "A domain name, resolved to A and AAAA. With `dns.mode: guard` also a wildcard: \
         `*.example.com` covers one more label, `**.example.com` any depth; neither covers \
         example.com itself. The table keeps the name each address is allowed for as the \
         element's comment, at most 251 characters: a longer name, or a wildcard no name of \
         251 characters fits, is refused.",
        trimmed(&format!("(\\*\\*?\\.)?{}", name())),
    )
});

described!(Network, "Network", {
    string_schema(
        "An IPv4 or IPv6 network in CIDR form (203.0.113.0/24, 2001:db8::/32), or one address; \
         no host bits below the prefix.",
        trimmed(&format!(
            "{}(/(3[0-2]|[12]?[0-9]))?|{}(/(12[0-8]|1[01][0-9]|[1-9]?[0-9]))?",
            ipv4(),
            ipv6()
        )),
    )
});

described!(Resolver, "Resolver", {
    string_schema(
        "A resolver's IP address (DNS always uses port 53).",
        trimmed(&format!("{}|{}", ipv4(), ipv6())),
    )
});

described!(ListenAddr, "ListenAddr", {
    string_schema(
        "An address to listen on: 127.0.0.53:53, [::1]:53, or an address alone for port 53.",
        trimmed(&format!(
            "{v4}(:{PORT})?|\\[{v6}\\]:{PORT}|{v6}",
            v4 = ipv4(),
            v6 = ipv6()
        )),
    )
});

described!(PortRange, "PortRange", {
    json_schema!({
        "description": "A port from 1 to 65535, or a range such as \"8000-8080\".",
        "anyOf": [
            {"type": "integer", "minimum": 1, "maximum": 65535},
            {"type": "string", "pattern": trimmed(&format!("{PORT}\\s*(-\\s*{PORT})?"))},
        ],
    })
});

described!(ProbeTarget, "ProbeTarget", {
    string_schema(
        "HOST:PORT: a name, an IPv4 address or a bracketed IPv6 address, and a port \
         (\"paste.example:443\", \"[2001:db8::9]:443\").",
        trimmed(&format!("({}|{}|\\[{}\\]):{PORT}", name(), ipv4(), ipv6())),
    )
});

described!(Rate, "Rate", {
    string_schema(
        "A rate such as \"10/second\": a positive count per second, minute, hour or day.",
        "^\\s*0*[1-9][0-9]*\\s*/\\s*(second|minute|hour|day|s|m|h|d)\\s*$".into(),
    )
});

described!(HumanDuration, "Duration", {
    string_schema(
        "A duration such as \"30s\", \"10m\", \"1h\" or \"1d\": more than zero, at most a year.",
        "^\\s*0*[1-9][0-9]*[smhd]\\s*$".into(),
    )
});

described!(AccountRef, "Account", {
    json_schema!({
        "description": "A user or group: a name (agent) or a number (1001).",
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 4_294_967_294u32},
            {"type": "string", "pattern": "^\\s*[A-Za-z0-9._$][A-Za-z0-9._$-]{0,255}\\s*$"},
        ],
    })
});

described!(CgroupPath, "CgroupPath", {
    json_schema!({
        "type": "string",
        "description": "A cgroup v2 subtree as below /sys/fs/cgroup, such as agent.slice or \
                        system.slice/agent.service (not the root; no `..`, quotes or empty parts).",
        "pattern": "^[^\"\\\\\\u0000-\\u001f]+$",
        "not": {"anyOf": [{"pattern": "^[\\s/]*$"}, {"pattern": "(^|/)\\.\\.?(/|$)"}]},
    })
});

described!(IfacePattern, "IfacePattern", {
    json_schema!({
        "type": "string",
        "description": "An interface name such as docker0, or a prefix ending in `*` such as br-*.",
        "maxLength": MAX_IFACE_NAME,
        // Printable ASCII but `"`, `*`, `/`, `:` and `\`; `*` only at the end.
        "pattern": "^\\s*[!#-)+-.0-9;-\\[\\]-~]+\\*?\\s*$",
        "not": {"pattern": "^\\s*lo\\s*$"},
    })
});

fn insert_all(schema: &mut Schema, rules: Value) {
    if let Value::Object(rules) = rules {
        schema.ensure_object().extend(rules);
    }
}

/// The whole policy: a wildcard needs `dns.mode: guard`.
pub(super) fn policy_rules(schema: &mut Schema) {
    insert_all(
        schema,
        json!({
            "if": {
                "properties": {"dns": {"properties": {"mode": {"const": "guard"}}, "required": ["mode"]}},
                "required": ["dns"],
            },
            "else": {
                "properties": {"allow": {"items": {"properties": {"domain": {
                    "not": {"pattern": "^\\s*\\*"},
                }}}}},
            },
        }),
    );
}

/// An allow entry: `domain` or `cidr`; a domain needs `ports`, a cidr's may not be empty.
pub(super) fn allow_rules(schema: &mut Schema) {
    insert_all(
        schema,
        json!({
            "oneOf": [{"required": ["domain"]}, {"required": ["cidr"]}],
            "if": {"required": ["domain"]},
            "then": {"required": ["ports"]},
            "else": {"properties": {"ports": {"minItems": 1}}},
        }),
    );
}

/// A deny entry: `preset` or `cidr`.
pub(super) fn deny_rules(schema: &mut Schema) {
    insert_all(
        schema,
        json!({"oneOf": [{"required": ["preset"]}, {"required": ["cidr"]}]}),
    );
}

/// Keys of the DNS guard, which `mode: resolve` refuses.
const GUARD_ONLY: [&str; 5] = ["listen", "upstream", "refuse_with", "floor", "mark"];

/// `dns`: guard mode needs `upstream` and takes no `resolvers`; resolve mode takes none of
/// the guard's keys.
pub(super) fn dns_rules(schema: &mut Schema) {
    let refused: serde_json::Map<String, Value> = GUARD_ONLY
        .iter()
        .map(|k| ((*k).to_string(), Value::Bool(false)))
        .collect();
    insert_all(
        schema,
        json!({
            "if": {"properties": {"mode": {"const": "guard"}}, "required": ["mode"]},
            "then": {
                "required": ["upstream"],
                "properties": {
                    "resolvers": false,
                    "upstream": {"minItems": 1},
                    "listen": {"minItems": 1},
                },
            },
            "else": {"properties": refused},
        }),
    );
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::{Path, PathBuf};

    use jsonschema::Validator;
    use serde_json::{Value, json};

    use super::policy_schema;
    use crate::core::policy::Policy;
    use crate::core::policy::test_support::{FULL, GUARD, parse};

    /// Every key, in resolve mode, with the values the README's reference shows.
    const EVERY_KEY_RESOLVE: &str = r#"
version: 1
action: reject
allow:
  - domain: api.example.com
    ports: [443, "8000-8080"]
    protocol: tcp
    comment: model API
  - cidr: 203.0.113.0/28
    ports: [22]
include: [github, npm]
deny:
  - preset: cloud-metadata
    comment: instance credentials
  - cidr: 10.0.0.0/8
dns:
  resolvers: [192.0.2.53]
  refresh: {min: 30s, max: 1h}
  grace: 10m
log:
  prefix: "EGRESS-DROP: "
  group: 100
  rate: 10/second
  burst: 20
essentials: [loopback, established, icmpv6-nd, dhcpv4, dhcpv6]
probe:
  blocked: ["paste.example:443", "[2001:db8::9]:443"]
  rogue_resolvers: [1.1.1.1]
  exfil_domain: exfil.example.com
"#;

    /// The DNS guard's keys, wildcards and a scope.
    const EVERY_KEY_GUARD: &str = r#"
version: 1
dns:
  mode: guard
  upstream: [192.0.2.53]
  listen: [127.0.0.53:53, "[::1]:53", 127.0.0.54]
  refuse_with: nxdomain
  floor: 30s
  grace: 10m
  mark: 0x65000000
allow:
  - domain: "*.example.com"
    ports: [443]
  - domain: "**.cdn.example"
    ports: [443]
scope:
  users: [1001]
  groups: [2000]
  cgroups: [agent.slice]
  forward: [docker0, "br-*"]
"#;

    fn validator() -> Validator {
        let schema: Value = serde_json::from_str(&policy_schema()).expect("the schema is JSON");
        jsonschema::meta::validate(&schema).expect("the schema is a valid draft-7 schema");
        jsonschema::validator_for(&schema).expect("the schema compiles")
    }

    fn as_json(yaml: &str) -> Value {
        serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("not YAML: {e}\n{yaml}"))
    }

    /// The schema's complaints about `yaml`; empty when it validates.
    fn schema_errors(validator: &Validator, yaml: &str) -> Vec<String> {
        validator
            .iter_errors(&as_json(yaml))
            .map(|e| format!("{}: {e}", e.instance_path()))
            .collect()
    }

    fn repo() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    fn yaml_files(dir: &Path) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.expect("a directory entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .collect();
        files.sort();
        files
    }

    #[test]
    fn the_shipped_schema_is_the_generated_one() {
        let path = repo().join("policies/policy.schema.json");
        let shipped = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            shipped == policy_schema(),
            "{} is not the schema the types generate; regenerate it:\n  cargo run -- check \
             --schema > policies/policy.schema.json",
            path.display()
        );
    }

    #[test]
    fn every_shipped_policy_and_preset_validates_against_the_schema() {
        let validator = validator();
        let policies = yaml_files(&repo().join("policies"));
        assert!(policies.len() >= 2, "{policies:?}");
        for path in &policies {
            let text = std::fs::read_to_string(path).expect("read the policy");
            let errors = schema_errors(&validator, &text);
            assert!(errors.is_empty(), "{}: {errors:?}", path.display());
            Policy::parse(&text, path).unwrap_or_else(|e| panic!("{e}"));
        }
        // A preset is a fragment: the `allow:` of a policy, which it is checked as.
        let presets = yaml_files(&repo().join("policies/presets"));
        assert!(presets.len() >= 10, "{presets:?}");
        for path in &presets {
            let mut fragment = as_json(&std::fs::read_to_string(path).expect("read the preset"));
            fragment["version"] = json!(1);
            let text = serde_yaml::to_string(&fragment).expect("YAML");
            let errors = schema_errors(&validator, &text);
            assert!(errors.is_empty(), "{}: {errors:?}", path.display());
            Policy::parse(&text, path).unwrap_or_else(|e| panic!("{e}"));
        }
    }

    #[test]
    fn valid_policies_pass_both() {
        let validator = validator();
        for text in [
            EVERY_KEY_RESOLVE,
            EVERY_KEY_GUARD,
            FULL,
            GUARD,
            "version: 1\n",
        ] {
            let errors = schema_errors(&validator, text);
            assert!(errors.is_empty(), "{errors:?}\n{text}");
            parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        }
    }

    /// Policies with one mistake each, after `version: 1` unless they start with `version`.
    const INVALID: &[&str] = &[
        "version: 2",
        "# no version\nallow: []",
        "versoin: 1",
        "action: allow",
        "allow:\n  - domain: a.example\n    cidr: 192.0.2.0/24\n    ports: [443]",
        "allow:\n  - ports: [443]",
        "allow:\n  - domain: a.example",
        "allow:\n  - cidr: 192.0.2.0/24\n    ports: []",
        "allow:\n  - cidr: 192.0.2.0/24\n    ports: [70000]",
        "allow:\n  - cidr: 192.0.2.0/24\n    ports: [0]",
        "allow:\n  - cidr: 192.0.2.0/24\n    ports: [\"http\"]",
        "allow:\n  - cidr: 192.0.2.0/24\n    protocol: icmp",
        "allow:\n  - cidr: 10.0.0.0/33",
        "allow:\n  - cidr: 2001:db8::/129",
        "allow:\n  - cidr: 192.0.2.256",
        "allow:\n  - domain: bad..example\n    ports: [443]",
        "allow:\n  - domain: -a.example\n    ports: [443]",
        "allow:\n  - domain: \"a.*.example\"\n    ports: [443]",
        "allow:\n  - domain: \"*.example.com\"\n    ports: [443]",
        "allow:\n  - cidr: 192.0.2.0/24\n    colour: red",
        "include: [leftpad]",
        "deny:\n  - preset: cloud",
        "deny:\n  - preset: cloud-metadata\n    cidr: 10.0.0.0/8",
        "deny:\n  - comment: nothing",
        "dns:\n  resolvers: [dns.example]",
        "dns:\n  refersh: {min: 30s}",
        "dns:\n  grace: 10 minutes",
        "dns:\n  grace: 0s",
        "dns:\n  refresh: {min: 5x}",
        "dns:\n  mode: cache",
        "dns:\n  mode: guard",
        "dns:\n  mode: guard\n  upstream: []",
        "dns:\n  mode: guard\n  upstream: [192.0.2.53]\n  resolvers: [192.0.2.53]",
        "dns:\n  mode: guard\n  upstream: [192.0.2.53]\n  listen: [localhost]",
        "dns:\n  mode: guard\n  upstream: [192.0.2.53]\n  listen: []",
        "dns:\n  mode: guard\n  upstream: [192.0.2.53]\n  mark: 0",
        "dns:\n  mode: guard\n  upstream: [192.0.2.53]\n  refuse_with: servfail",
        "dns:\n  listen: [127.0.0.53:53]",
        "dns:\n  upstream: [192.0.2.53]",
        "dns:\n  mark: 7",
        "dns:\n  floor: 30s",
        "dns:\n  mode: resolve\n  refuse_with: refused",
        "log:\n  rate: 10/fortnight",
        "log:\n  rate: 0/second",
        "log:\n  burst: 0",
        "log:\n  group: 70000",
        "log:\n  prefix: \"a\\\"b\"",
        "essentials: [ssh]",
        "probe:\n  blocked: [paste.example]",
        "probe:\n  blocked: [\"2001:db8::9:443\"]",
        "probe:\n  rogue_resolvers: [one.one.one.one]",
        "probe:\n  exfil_domain: \"exfil example\"",
        "scope:\n  forward: [lo]",
        "scope:\n  forward: [averyveryverylongname]",
        "scope:\n  cgroups: [\"/\"]",
        "scope:\n  cgroups: [\"a/../b\"]",
        "scope:\n  users: [\"-bad\"]",
        "scope:\n  owners: [1001]",
    ];

    fn policy_text(mistake: &str) -> String {
        if ["version", "versoin", "#"]
            .iter()
            .any(|p| mistake.starts_with(p))
        {
            format!("{mistake}\n")
        } else {
            format!("version: 1\n{mistake}\n")
        }
    }

    #[test]
    fn the_schema_and_the_parser_refuse_the_same_mistakes() {
        let validator = validator();
        for mistake in INVALID {
            let text = policy_text(mistake);
            assert!(parse(&text).is_err(), "the parser takes:\n{text}");
            assert!(
                !schema_errors(&validator, &text).is_empty(),
                "the schema takes:\n{text}"
            );
        }
    }

    /// What only the parser refuses: checks a pattern cannot make (widths, order, sizes,
    /// accounts), or that would make the schema's patterns unreadable. README.md lists these.
    /// When the schema learns one, move it to INVALID.
    const ONLY_THE_PARSER_REFUSES: &[&str] = &[
        "allow:\n  - domain: a.example\n    ports: [\"1000-2000\"]",
        "allow:\n  - cidr: 192.0.2.0/24\n    ports: [\"90-80\"]",
        "allow:\n  - cidr: 203.0.113.9/24",
        "allow:\n  - domain: 192.0.2.1\n    ports: [443]",
        "dns:\n  grace: 400d",
        "dns:\n  refresh: {min: 2h, max: 1h}",
        "scope:\n  users: [0]",
        "scope:\n  users: [no-such-user-egress-fence]",
        "log:\n  rate: 1/day\n  burst: 213504",
    ];

    #[test]
    fn what_only_the_parser_refuses_is_known() {
        let validator = validator();
        for mistake in ONLY_THE_PARSER_REFUSES {
            let text = policy_text(mistake);
            assert!(parse(&text).is_err(), "the parser takes:\n{text}");
            let errors = schema_errors(&validator, &text);
            assert!(
                errors.is_empty(),
                "the schema now refuses this too: move it to INVALID:\n{text}{errors:?}"
            );
        }
    }

    /// The object definitions of the schema, by where they are in a policy: (path, schema).
    fn objects(schema: &Value) -> Vec<(Vec<Value>, Value)> {
        fn target<'a>(schema: &'a Value, root: &'a Value) -> &'a Value {
            let reference = schema["$ref"]
                .as_str()
                .or_else(|| schema["allOf"][0]["$ref"].as_str())
                .or_else(|| schema["anyOf"][0]["$ref"].as_str());
            match reference.and_then(|r| r.strip_prefix("#/definitions/")) {
                Some(name) => &root["definitions"][name],
                None => schema,
            }
        }
        let mut out = vec![(Vec::new(), schema.clone())];
        let mut i = 0;
        while i < out.len() {
            let (path, object) = out[i].clone();
            for (key, property) in object["properties"].as_object().into_iter().flatten() {
                let mut at = path.clone();
                at.push(json!(key));
                let mut found = target(property, schema);
                if found["type"] == "array" || found["items"].is_object() {
                    at.push(json!(0));
                    found = target(&found["items"], schema);
                }
                if found["properties"].is_object() {
                    out.push((at, found.clone()));
                }
            }
            i += 1;
        }
        out
    }

    /// The keys the parser takes in an object at `path`, as its error for an unknown key lists
    /// them.
    fn accepted_keys(path: &[Value]) -> BTreeSet<String> {
        let mut policy = json!({"version": 1});
        set(&mut policy, path, "no_such_key", json!(1));
        let text = serde_yaml::to_string(&policy).expect("YAML");
        let error = parse(&text).expect_err("an unknown key").to_string();
        let expected = error
            .split_once("expected ")
            .and_then(|(_, keys)| keys.split(" (").next())
            .unwrap_or_else(|| panic!("no list of keys in: {error}"));
        expected
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    }

    /// Sets `key` of the object at `path` in `policy`, making the objects and the first list
    /// item on the way.
    fn set(policy: &mut Value, path: &[Value], key: &str, value: Value) {
        let mut at = policy;
        for step in path {
            at = match step {
                Value::Number(_) => {
                    if !at.is_array() {
                        *at = json!([{}]);
                    }
                    &mut at[0]
                }
                Value::String(k) => {
                    if at.get(k).is_none() {
                        at[k] = json!({});
                    }
                    &mut at[k]
                }
                _ => unreachable!("a path holds keys and indices"),
            };
        }
        at[key] = value;
    }

    #[test]
    fn the_schema_has_exactly_the_keys_the_parser_takes() {
        let schema: Value = serde_json::from_str(&policy_schema()).expect("JSON");
        let objects = objects(&schema);
        assert!(
            objects.len() >= 8,
            "{:?}",
            objects.iter().map(|o| &o.0).collect::<Vec<_>>()
        );
        for (path, object) in objects {
            let written: BTreeSet<String> = object["properties"]
                .as_object()
                .expect("properties")
                .keys()
                .cloned()
                .collect();
            assert_eq!(object["additionalProperties"], json!(false), "{path:?}");
            assert_eq!(accepted_keys(&path), written, "at {path:?}");
        }
    }

    fn remove_nulls(value: &mut Value) {
        match value {
            Value::Object(map) => {
                map.retain(|_, v| !v.is_null());
                map.values_mut().for_each(remove_nulls);
            }
            Value::Array(items) => items.iter_mut().for_each(remove_nulls),
            _ => {}
        }
    }

    /// Writing down what the schema calls a key's default changes nothing.
    #[test]
    fn what_the_schema_calls_a_default_is_the_default() {
        let schema: Value = serde_json::from_str(&policy_schema()).expect("JSON");
        let entry = json!([{"domain": "a.example", "ports": [443]}]);
        let bases = [
            json!({"version": 1, "allow": entry}),
            json!({"version": 1, "allow": entry,
                   "dns": {"mode": "guard", "upstream": ["192.0.2.53"]},
                   "scope": {"users": [1001], "cgroups": ["agent.slice"]}}),
        ];
        let yaml = |v: &Value| serde_yaml::to_string(v).expect("YAML");
        let mut checked = Vec::new();
        for (path, object) in objects(&schema) {
            for (key, property) in object["properties"].as_object().expect("properties") {
                let Some(default) = property.get("default") else {
                    continue;
                };
                let mut parsed_somewhere = false;
                for base in &bases {
                    let mut without = base.clone();
                    set(&mut without, &path, key, Value::Null);
                    remove_nulls(&mut without);
                    let mut with = without.clone();
                    set(&mut with, &path, key, default.clone());
                    let (Ok(with), Ok(without)) = (parse(&yaml(&with)), parse(&yaml(&without)))
                    else {
                        continue;
                    };
                    parsed_somewhere = true;
                    assert_eq!(
                        with, without,
                        "{path:?} {key}: {default} is not the default"
                    );
                }
                assert!(parsed_somewhere, "{path:?} {key}: {default} is refused");
                checked.push(key.clone());
            }
        }
        assert!(checked.len() >= 15, "only {checked:?}");
    }
}
