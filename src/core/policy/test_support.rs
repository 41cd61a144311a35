//! Helpers of the policy's unit tests: parse a text, take its error apart, sample policies.

use std::path::Path;

use super::{Policy, PolicyError};

pub(super) fn parse(src: &str) -> Result<Policy, PolicyError> {
    Policy::parse(src, Path::new("p.yaml"))
}

pub(super) fn err(src: &str) -> (usize, usize, String) {
    match parse(src) {
        Err(PolicyError::Invalid {
            line,
            column,
            message,
            ..
        }) => (line, column, message),
        other => panic!("expected an invalid policy, got {other:?}"),
    }
}

pub(super) const FULL: &str = r#"
version: 1
action: drop
allow:
  - domain: API.Example.com.
    ports: [443, "8000-8080"]
    protocol: any
    comment: model API
  - cidr: 203.0.113.0/28
    ports: [22]
deny:
  - preset: cloud-metadata
  - cidr: 10.0.0.0/8
dns:
  resolvers: [192.0.2.53, "2001:db8::53"]
log:
  prefix: "EF: "
  group: 100
  rate: 5/minute
essentials: [loopback, established]
"#;

pub(super) fn located_warnings(src: &str) -> Vec<String> {
    parse(src)
        .expect("valid: these are warnings, not errors")
        .warnings_in(src, Path::new("p.yaml"))
}

pub(super) const GUARD: &str = "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [443]\n  - domain: \"**.cdn.example\"\n    ports: [80, 443]\n  - domain: api.example\n    ports: [443]\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n";

/// A policy with a log section of `log`, e.g. "rate: 1/day\n  burst: 9".
pub(super) fn with_log(log: &str) -> String {
    format!("version: 1\nallow:\n  - cidr: 192.0.2.0/24\nlog:\n  {log}\n")
}
