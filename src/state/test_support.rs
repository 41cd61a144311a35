//! Helpers of the state's unit tests: a ruleset, a generation to record, a state directory
//! in a temporary directory and its lock.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;
use crate::core::plan::plan;
use crate::core::policy::Policy;
use crate::core::resolution::Resolution;
use crate::core::ruleset::Ruleset;

pub(super) fn ruleset() -> Ruleset {
    let policy = Policy::parse(
        "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\n  - cidr: 203.0.113.0/28\n",
        Path::new("p.yaml"),
    )
    .expect("valid");
    let resolution = crate::core::plan::tests::resolution(&[("a.example", &["192.0.2.10"])]);
    plan(&policy, &resolution)
}

pub(super) fn new_generation(command: Recorder) -> NewGeneration {
    NewGeneration {
        command,
        source_generation: None,
        policy_path: PathBuf::from("/etc/egress-fence/policy.yaml"),
        policy_text: "version: 1\n".into(),
        resolution: Resolution {
            resolvers: vec![],
            hosts: vec![],
            guard_uid: None,
        },
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
