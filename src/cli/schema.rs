//! `check --schema`: the policy's JSON Schema, generated from the parser's types (see
//! `egress_fence::core::policy::policy_schema`), and what `check --help` says of it.

use egress_fence::core::policy::policy_schema;

/// After `check --help`: where the schema is, and a minimal policy.
pub const SCHEMA_HELP: &str = "\
Policy schema: `egress-fence check --schema` prints it as JSON Schema (draft 7), generated from
the parser's own types: every key, its default and what each value may be. Editors with the
YAML language server check a policy against it as it is typed: start the file with
  # yaml-language-server: $schema=/usr/share/egress-fence/policy.schema.json
(the Debian package installs it there; in the source tree: policies/policy.schema.json).
README.md, \"The policy\", explains every key. A minimal policy:
  version: 1                      # required
  allow:
    - domain: api.example.com
      ports: [443]";

/// Prints the schema.
pub fn print() -> u8 {
    print!("{}", policy_schema());
    0
}
