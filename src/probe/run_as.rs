//! `probe --as USER`: the user the attempts are made as ([`RunAs`]), and the one-way change of
//! this process into it ([`RunAs::become_user`]), made in a child after the privileged reads.

use std::fmt;

use nix::unistd::{Gid, Group, Uid, User};

/// Why the probe cannot run as the user asked for.
#[derive(Debug, thiserror::Error)]
pub enum RunAsError {
    #[error("--as {0}: no such user")]
    NoSuchUser(String),
    #[error("--as {0}: that is root; run the probe without --as")]
    Root(String),
    #[error("--as {user}: cannot read the user database: {error}")]
    Lookup { user: String, error: nix::Error },
    #[error("cannot become {user}: {doing} failed: {error}")]
    Drop {
        user: String,
        doing: &'static str,
        error: nix::Error,
    },
    #[error("became {user} but still holds capabilities ({which}): refusing to probe")]
    KeptCapabilities { user: String, which: String },
}

/// A user to probe as: its uid, primary gid and supplementary groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunAs {
    /// The name it has in the user database, if any.
    pub name: Option<String>,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

impl RunAs {
    /// `given` as `--as` takes it: a user name, or a uid. A uid the user database does not
    /// know is taken as it is, with the same number as its gid and no other groups (a
    /// container's user is often only a number).
    pub fn lookup(given: &str) -> Result<RunAs, RunAsError> {
        let lookup_error = |error| RunAsError::Lookup {
            user: given.to_string(),
            error,
        };
        let user = match given.parse::<u32>() {
            Ok(uid) => match User::from_uid(Uid::from_raw(uid)).map_err(lookup_error)? {
                Some(u) => u,
                None => {
                    return Self::checked(
                        given,
                        RunAs {
                            name: None,
                            uid,
                            gid: uid,
                            groups: Vec::new(),
                        },
                    );
                }
            },
            Err(_) => User::from_name(given)
                .map_err(lookup_error)?
                .ok_or_else(|| RunAsError::NoSuchUser(given.to_string()))?,
        };
        let groups = match std::ffi::CString::new(user.name.as_str()) {
            Ok(cname) => nix::unistd::getgrouplist(&cname, user.gid)
                .map_err(lookup_error)?
                .into_iter()
                .map(Gid::as_raw)
                .collect(),
            Err(_) => vec![user.gid.as_raw()],
        };
        Self::checked(
            given,
            RunAs {
                name: Some(user.name),
                uid: user.uid.as_raw(),
                gid: user.gid.as_raw(),
                groups,
            },
        )
    }

    fn checked(given: &str, run_as: RunAs) -> Result<RunAs, RunAsError> {
        if run_as.uid == 0 {
            return Err(RunAsError::Root(given.to_string()));
        }
        Ok(run_as)
    }

    /// Turns this process into the user, for good: supplementary groups, gid, then uid (a
    /// uid change from root to another clears every capability), and no new privileges
    /// through exec. Checked after: a capability left over is an error, never a probe that
    /// looks like the user's but is not. Call it with one thread only: the change applies to
    /// the calling thread's credentials, which threads started later inherit.
    pub fn become_user(&self) -> Result<(), RunAsError> {
        let failed = |doing: &'static str| {
            let user = self.to_string();
            move |error| RunAsError::Drop { user, doing, error }
        };
        let groups: Vec<Gid> = self.groups.iter().map(|&g| Gid::from_raw(g)).collect();
        nix::unistd::setgroups(&groups).map_err(failed("setgroups"))?;
        nix::unistd::setgid(Gid::from_raw(self.gid)).map_err(failed("setgid"))?;
        nix::unistd::setuid(Uid::from_raw(self.uid)).map_err(failed("setuid"))?;
        nix::sys::prctl::set_no_new_privs().map_err(failed("prctl(PR_SET_NO_NEW_PRIVS)"))?;
        let status = std::fs::read_to_string("/proc/thread-self/status").unwrap_or_default();
        let kept = held_capabilities(&status);
        if !kept.is_empty() {
            return Err(RunAsError::KeptCapabilities {
                user: self.to_string(),
                which: kept.join(", "),
            });
        }
        if nix::unistd::setuid(Uid::from_raw(0)).is_ok() {
            return Err(RunAsError::KeptCapabilities {
                user: self.to_string(),
                which: "it could become root again".into(),
            });
        }
        Ok(())
    }

    /// The name of `gid` in the group database, if it has one.
    pub fn group_name(gid: u32) -> Option<String> {
        Group::from_gid(Gid::from_raw(gid))
            .ok()
            .flatten()
            .map(|g| g.name)
    }
}

impl fmt::Display for RunAs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(name) => write!(f, "{name} (uid {})", self.uid),
            None => write!(f, "uid {}", self.uid),
        }
    }
}

/// The capability sets of a /proc status text that are not empty: "CapEff 0000000000000400".
fn held_capabilities(status: &str) -> Vec<String> {
    status
        .lines()
        .filter_map(|line| {
            let (key, value) = line.split_once(':')?;
            let value = value.trim();
            let held = ["CapInh", "CapPrm", "CapEff", "CapAmb"].contains(&key)
                && value.chars().any(|c| c != '0');
            held.then(|| format!("{key} {value}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_found_by_name_or_uid_and_root_is_refused() {
        let nobody = RunAs::lookup("nobody").expect("nobody exists");
        assert_eq!(nobody.uid, 65534);
        assert!(nobody.groups.contains(&nobody.gid), "{nobody:?}");
        assert_eq!(nobody.to_string(), "nobody (uid 65534)");
        let by_uid = RunAs::lookup("65534").expect("by uid");
        assert_eq!(by_uid.name.as_deref(), Some("nobody"));
        let unknown = RunAs::lookup("4000000").expect("a bare uid");
        assert_eq!((unknown.uid, unknown.gid), (4_000_000, 4_000_000));
        assert!(unknown.groups.is_empty());
        assert!(matches!(RunAs::lookup("root"), Err(RunAsError::Root(_))));
        assert!(matches!(RunAs::lookup("0"), Err(RunAsError::Root(_))));
        assert!(matches!(
            RunAs::lookup("egress-fence-no-such-user"),
            Err(RunAsError::NoSuchUser(_))
        ));
    }

    #[test]
    fn capabilities_left_over_are_named() {
        let dropped = "Name:\tprobe\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapBnd:\t000001ffffffffff\nCapAmb:\t0000000000000000\n";
        assert!(
            held_capabilities(dropped).is_empty(),
            "the bounding set is no privilege"
        );
        let kept = dropped.replace("CapEff:\t0000000000000000", "CapEff:\t0000000000001000");
        assert_eq!(held_capabilities(&kept), vec!["CapEff 0000000000001000"]);
    }
}
