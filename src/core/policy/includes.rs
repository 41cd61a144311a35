//! The curated allow lists a policy pulls in with `include: [NAME, ...]`, shipped inside the
//! binary (policies/presets/NAME.yaml) so that an installed binary needs no other file.
//!
//! The presets hold exact names only: a wildcard needs `dns.mode: guard`, and a preset that
//! only worked in one mode would make `include:` fail on the policies that need it most
//! (the default, resolve mode).

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

use super::raw::RawAllow;
use super::schema::Allow;

/// A named list of allow entries (`include: [github]`); not the deny presets of `deny:`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum AllowPreset {
    Github,
    Npm,
    Pypi,
    Crates,
    Go,
    DockerHub,
    Debian,
    Ubuntu,
    AnthropicApi,
    OpenaiApi,
}

/// A preset file: its entries, written as a policy's `allow:` is.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PresetFile {
    allow: Vec<RawAllow>,
}

impl AllowPreset {
    pub const ALL: [AllowPreset; 10] = [
        AllowPreset::Github,
        AllowPreset::Npm,
        AllowPreset::Pypi,
        AllowPreset::Crates,
        AllowPreset::Go,
        AllowPreset::DockerHub,
        AllowPreset::Debian,
        AllowPreset::Ubuntu,
        AllowPreset::AnthropicApi,
        AllowPreset::OpenaiApi,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AllowPreset::Github => "github",
            AllowPreset::Npm => "npm",
            AllowPreset::Pypi => "pypi",
            AllowPreset::Crates => "crates",
            AllowPreset::Go => "go",
            AllowPreset::DockerHub => "docker-hub",
            AllowPreset::Debian => "debian",
            AllowPreset::Ubuntu => "ubuntu",
            AllowPreset::AnthropicApi => "anthropic-api",
            AllowPreset::OpenaiApi => "openai-api",
        }
    }

    /// The preset's file as shipped.
    fn source(self) -> &'static str {
        match self {
            AllowPreset::Github => include_str!("../../../policies/presets/github.yaml"),
            AllowPreset::Npm => include_str!("../../../policies/presets/npm.yaml"),
            AllowPreset::Pypi => include_str!("../../../policies/presets/pypi.yaml"),
            AllowPreset::Crates => include_str!("../../../policies/presets/crates.yaml"),
            AllowPreset::Go => include_str!("../../../policies/presets/go.yaml"),
            AllowPreset::DockerHub => include_str!("../../../policies/presets/docker-hub.yaml"),
            AllowPreset::Debian => include_str!("../../../policies/presets/debian.yaml"),
            AllowPreset::Ubuntu => include_str!("../../../policies/presets/ubuntu.yaml"),
            AllowPreset::AnthropicApi => {
                include_str!("../../../policies/presets/anthropic-api.yaml")
            }
            AllowPreset::OpenaiApi => include_str!("../../../policies/presets/openai-api.yaml"),
        }
    }

    /// The preset's entries. The files are part of the build and a unit test parses every
    /// one, so a file that does not parse is a bug of this build, not of the policy.
    pub fn entries(self) -> Vec<Allow> {
        let file: PresetFile = serde_yaml::from_str(self.source())
            .unwrap_or_else(|e| panic!("the shipped preset `{}` does not parse: {e}", self.name()));
        file.allow.into_iter().map(|a| a.0).collect()
    }

    /// The names a policy may include, for messages.
    pub fn known() -> String {
        AllowPreset::ALL.map(AllowPreset::name).join(", ")
    }
}

impl<'de> Deserialize<'de> for AllowPreset {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        AllowPreset::ALL
            .into_iter()
            .find(|p| p.name() == s.trim())
            .ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "`{s}` is not a preset egress-fence ships; the presets are: {}",
                    AllowPreset::known()
                ))
            })
    }
}

/// `allow` followed by the entries of `includes` that `allow` does not already hold (the
/// same destination, ports and protocol; a local entry's comment is kept), in order.
pub(super) fn expand(mut allow: Vec<Allow>, includes: &[AllowPreset]) -> Vec<Allow> {
    for preset in includes {
        for entry in preset.entries() {
            let held = allow.iter().any(|a| {
                a.target == entry.target && a.ports == entry.ports && a.protocol == entry.protocol
            });
            if !held {
                allow.push(entry);
            }
        }
    }
    allow
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::test_support::*;
    use crate::core::policy::{PortRange, Protocol, Target};

    #[test]
    fn every_shipped_preset_parses_is_exact_and_says_where_it_comes_from() {
        for preset in AllowPreset::ALL {
            let entries = preset.entries();
            assert!(!entries.is_empty(), "{}", preset.name());
            assert!(
                !entries
                    .iter()
                    .any(|a| matches!(a.target, Target::Wildcard(_))),
                "{}",
                preset.name()
            );
            for e in &entries {
                let comment = e.comment.as_deref().unwrap_or("");
                assert!(
                    comment.contains("source: ") && comment.contains("listed 2026-12-01"),
                    "{}: {comment:?}",
                    preset.name()
                );
                assert!(
                    e.ports
                        .iter()
                        .all(|p| [22, 80, 443].contains(&p.first) && p.first == p.last),
                    "{}: {:?}",
                    preset.name(),
                    e.ports
                );
                assert_eq!(e.protocol, Protocol::Tcp);
            }
            // Included alone, in either DNS mode, every preset makes a valid policy.
            let name = preset.name();
            assert!(parse(&format!("version: 1\ninclude: [{name}]\n")).is_ok());
            let guard = format!(
                "version: 1\ninclude: [{name}]\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n"
            );
            assert!(parse(&guard).is_ok());
        }
    }

    #[test]
    fn the_file_name_is_the_preset_name() {
        for preset in AllowPreset::ALL {
            assert!(
                preset
                    .source()
                    .starts_with(&format!("# Preset `{}`:", preset.name())),
                "{}",
                preset.name()
            );
        }
    }

    #[test]
    fn an_include_appends_its_entries_after_the_local_ones() {
        let p = parse("version: 1\nallow:\n  - cidr: 192.0.2.1\ninclude: [npm, anthropic-api]\n")
            .expect("valid");
        let targets: Vec<String> = p
            .allow
            .iter()
            .map(|a| match &a.target {
                Target::Domain(d) => d.to_string(),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(targets[1..], ["registry.npmjs.org", "api.anthropic.com"]);
        assert!(matches!(p.allow[0].target, Target::Cidr(_)));
        assert_eq!(p.include, [AllowPreset::Npm, AllowPreset::AnthropicApi]);
    }

    #[test]
    fn an_entry_the_policy_already_has_is_not_added_twice() {
        let p = parse(
            "version: 1\nallow:\n  - domain: registry.npmjs.org\n    ports: [443]\n    \
             comment: ours\ninclude: [npm, npm]\n",
        )
        .expect("valid");
        assert_eq!(p.allow.len(), 1);
        assert_eq!(p.allow[0].comment.as_deref(), Some("ours"));
        // Other ports are another entry: the local one stays first.
        let p = parse(
            "version: 1\nallow:\n  - domain: registry.npmjs.org\n    ports: [8443]\n\
             include: [npm]\n",
        )
        .expect("valid");
        assert_eq!(p.allow.len(), 2);
        assert_eq!(p.allow[0].ports, [PortRange::single(8443)]);
        assert_eq!(p.allow[1].ports, [PortRange::single(443)]);
        // Two presets that share nothing keep all their entries.
        let p = parse("version: 1\ninclude: [debian, ubuntu]\n").expect("valid");
        assert_eq!(
            p.allow.len(),
            AllowPreset::Debian.entries().len() + AllowPreset::Ubuntu.entries().len()
        );
    }

    #[test]
    fn an_unknown_preset_is_refused_at_its_place_with_the_known_ones() {
        let (line, column, message) = err("version: 1\ninclude: [npm, left-pad]\n");
        assert_eq!((line, column), (2, 16), "{message}");
        assert!(
            message.contains("`left-pad` is not a preset egress-fence ships"),
            "{message}"
        );
        assert!(message.contains(&AllowPreset::known()), "{message}");
        let (line, column, message) = err("version: 1\ninclude:\n  - github\n  - gitlab\n");
        assert_eq!((line, column), (4, 5), "{message}");
        // A deny preset is not an allow preset.
        let (_, _, message) = err("version: 1\ninclude: [cloud-metadata]\n");
        assert!(message.contains("docker-hub"), "{message}");
    }
}
