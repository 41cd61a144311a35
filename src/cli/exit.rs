//! Exit codes (documented in `--help`), and a failure on its way to one.

use egress_fence::core::policy::PolicyError;
use egress_fence::core::resolution::Resolution;

pub const EXIT_FAILURE: u8 = 1;
pub const EXIT_BAD_POLICY: u8 = 2;
pub const EXIT_UNRESOLVED: u8 = 3;
pub const EXIT_NOT_INSTALLED: u8 = 4;
pub const EXIT_PROBE_FAILED: u8 = 5;
pub const EXIT_DIFF_FAILED: u8 = 6;
/// `replay`: nothing would have been refused of what the trace holds, but it does not hold
/// all its run saw, or a user other than root could have changed it: a gate must not pass on
/// it.
pub const EXIT_INCOMPLETE_TRACE: u8 = 7;
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

impl Failure {
    /// The error and its causes, each said once (see [`describe`]).
    pub fn describe(&self) -> String {
        describe(&self.error)
    }
}

/// An error with its causes, each said once, for a person to read.
///
/// The library's errors carry their causes in their own messages and also return them from
/// `source()` (thiserror's `#[source]`, `#[from]` and `transparent`), so printing the whole
/// chain (`{:#}`) says every cause twice, while a context added on the way (anyhow's
/// `context`) does not repeat its cause, so printing only the outermost message (`{}`) would
/// lose it. A cause is therefore added only when the text so far does not already say it.
pub fn describe(error: &anyhow::Error) -> String {
    let mut text = error.to_string();
    for cause in error.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

/// 0, or [`EXIT_UNRESOLVED`] when some allowed name did not resolve.
pub fn resolution_code(resolution: &Resolution) -> u8 {
    if resolution.unresolved().next().is_some() {
        EXIT_UNRESOLVED
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::path::PathBuf;

    use egress_fence::change::ChangeError;
    use egress_fence::state::StateError;

    use super::*;

    fn times(text: &str, needle: &str) -> usize {
        text.matches(needle).count()
    }

    /// A library error two wrappers deep (a transparent one, and a context) says its root cause
    /// once, and the context too.
    #[test]
    fn each_cause_is_said_once() {
        let denied = io::Error::from_raw_os_error(libc::EACCES).to_string();
        let state = StateError::Io {
            doing: "create",
            path: PathBuf::from("/var/lib/egress-fence/host"),
            source: io::Error::from_raw_os_error(libc::EACCES),
        };
        let error = anyhow::Error::new(ChangeError::State(state)).context("cannot roll back");
        // What printing the chain would say: the reason the edge does not.
        assert_eq!(times(&format!("{error:#}"), &denied), 2, "{error:#}");

        let text = describe(&error);
        assert_eq!(
            text,
            format!("cannot roll back: cannot create /var/lib/egress-fence/host: {denied}")
        );
        assert_eq!(times(&text, &denied), 1, "{text}");
    }

    /// The library's own messages come out as they are: the edge adds nothing to them.
    #[test]
    fn a_library_error_prints_as_its_message() {
        let error = anyhow::Error::new(StateError::Io {
            doing: "read",
            path: PathBuf::from("/x"),
            source: io::Error::from_raw_os_error(libc::ENOTDIR),
        });
        assert_eq!(describe(&error), error.to_string());
        let failure = Failure::from(error);
        assert_eq!(failure.code, EXIT_FAILURE);
        assert_eq!(failure.describe(), failure.error.to_string());
    }
}
