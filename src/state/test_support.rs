//! Helpers of the state's unit tests: a ruleset, a generation to record, a state directory
//! in a temporary directory and its lock.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;
use crate::core::plan::plan;
use crate::core::policy::Policy;
use crate::core::resolution::Resolution;
use crate::core::ruleset::Ruleset;

/// The policy of the generations the tests record.
pub(super) const POLICY: &str =
    "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\n  - cidr: 203.0.113.0/28\n";

pub(super) fn policy() -> Policy {
    Policy::parse(POLICY, Path::new("/etc/egress-fence/policy.yaml")).expect("valid")
}

/// a.example at 192.0.2.10.
pub(super) fn resolution() -> Resolution {
    crate::core::plan::tests::resolution(&[("a.example", &["192.0.2.10"])])
}

/// What [`POLICY`] plans with [`resolution`].
pub(super) fn ruleset() -> Ruleset {
    plan(&policy(), &resolution())
}

/// A generation as `apply` records it: the policy text, its resolution and their plan.
pub(super) fn new_generation(command: Recorder) -> NewGeneration {
    NewGeneration {
        command,
        source_generation: None,
        policy_path: PathBuf::from("/etc/egress-fence/policy.yaml"),
        policy_text: POLICY.into(),
        resolution: resolution(),
        ruleset: ruleset(),
    }
}

pub(super) fn temp_state() -> (tempfile::TempDir, StateDir) {
    let root = tempfile::tempdir().expect("tempdir");
    let state = StateDir::new(root.path(), "host");
    (root, state)
}

pub(super) fn lock(state: &StateDir) -> WriterLock {
    state
        .lock("test", Duration::from_secs(1), |_| {})
        .expect("lock")
}
