//! Entering a network namespace before anything else happens.

use std::fs::File;
use std::path::{Path, PathBuf};

use nix::sched::{CloneFlags, setns};

/// Where `ip netns add NAME` keeps its namespaces.
const NETNS_RUN_DIR: &str = "/run/netns";
/// Where `ip netns exec NAME` finds the namespace's own resolv.conf, if it has one.
const NETNS_ETC_DIR: &str = "/etc/netns";

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error(
        "cannot open network namespace {path}: {error}; give a name from `ip netns list` or a path such as /proc/PID/ns/net"
    )]
    Open {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(
        "cannot enter network namespace {path}: {error} (entering needs CAP_SYS_ADMIN: run as root)"
    )]
    Enter { path: PathBuf, error: nix::Error },
}

/// A network namespace given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Netns {
    /// The file to open: /run/netns/NAME, or the path as given.
    pub path: PathBuf,
    /// The name, when given as one (it selects /etc/netns/NAME/resolv.conf).
    pub name: Option<String>,
}

impl Netns {
    /// A bare name means /run/netns/NAME; anything with a slash is a path.
    pub fn parse(arg: &str) -> Netns {
        if arg.contains('/') {
            Netns {
                path: PathBuf::from(arg),
                name: None,
            }
        } else {
            Netns {
                path: Path::new(NETNS_RUN_DIR).join(arg),
                name: Some(arg.to_string()),
            }
        }
    }

    /// The namespace's name: as given, or the file name of a path in /run/netns (the same
    /// namespace as that name).
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref().or_else(|| {
            (self.path.parent() == Some(Path::new(NETNS_RUN_DIR)))
                .then(|| self.path.file_name()?.to_str())
                .flatten()
        })
    }

    /// Moves the calling thread into the namespace. Call it before any other thread exists:
    /// threads started earlier stay where they were.
    pub fn enter(&self) -> Result<(), NetnsError> {
        let file = File::open(&self.path).map_err(|error| NetnsError::Open {
            path: self.path.clone(),
            error,
        })?;
        setns(&file, CloneFlags::CLONE_NEWNET).map_err(|error| NetnsError::Enter {
            path: self.path.clone(),
            error,
        })
    }

    /// The resolv.conf that processes in this namespace use, as `ip netns exec` arranges it.
    pub fn resolv_conf(&self) -> Option<PathBuf> {
        let name = self.name.as_ref()?;
        let path = Path::new(NETNS_ETC_DIR).join(name).join("resolv.conf");
        path.exists().then_some(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_paths() {
        let n = Netns::parse("sandbox");
        assert_eq!(n.path, Path::new("/run/netns/sandbox"));
        assert_eq!(n.name.as_deref(), Some("sandbox"));
        let p = Netns::parse("/proc/1/ns/net");
        assert_eq!(p.path, Path::new("/proc/1/ns/net"));
        assert_eq!(p.name, None);
    }

    #[test]
    fn a_missing_namespace_is_a_clear_error() {
        let err = Netns::parse("egress-fence-test-no-such-ns")
            .enter()
            .unwrap_err();
        assert!(err.to_string().contains("ip netns list"), "{err}");
    }
}
