//! Exit codes (documented in `--help`), and a failure on its way to one.

use egress_fence::core::policy::PolicyError;
use egress_fence::core::resolution::Resolution;

pub const EXIT_FAILURE: u8 = 1;
pub const EXIT_BAD_POLICY: u8 = 2;
pub const EXIT_UNRESOLVED: u8 = 3;
pub const EXIT_NOT_INSTALLED: u8 = 4;
pub const EXIT_PROBE_FAILED: u8 = 5;
pub const EXIT_DIFF_FAILED: u8 = 6;
/// `diff`: something would change.
pub const EXIT_CHANGES: u8 = 1;

/// A failure and the exit code it maps to.
pub struct Failure {
    pub code: u8,
    pub error: anyhow::Error,
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Failure {
        let error = e.into();
        let code = if error.is::<PolicyError>() {
            EXIT_BAD_POLICY
        } else {
            EXIT_FAILURE
        };
        Failure { code, error }
    }
}

/// 0, or [`EXIT_UNRESOLVED`] when some allowed name did not resolve.
pub fn resolution_code(resolution: &Resolution) -> u8 {
    if resolution.unresolved().next().is_some() {
        EXIT_UNRESOLVED
    } else {
        0
    }
}
