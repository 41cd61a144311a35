//! Who else could change what a path reads: the policy file that `run` reads again on every
//! reload must be writable by root (or the user egress-fence runs as) alone, and so must
//! every directory on the way to it and every symbolic link followed, or a fenced user who
//! may write any of them widens the fence at the next reload.
//!
//! The walk resolves the path one component at a time, as the kernel does, and judges each
//! entry by the directory that holds it: a directory that group or others may write lets
//! them rename or replace any entry of it, unless its sticky bit keeps them to their own
//! entries. POSIX ACLs are not read.

use std::ffi::OsString;
use std::fmt;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

/// Links followed at most, as the kernel's own limit.
const MAX_LINKS: usize = 40;

/// A name with nothing behind it is judged as an entry someone else could put there.
const ABSENT: Inode = Inode {
    uid: u32::MAX,
    nlink: 1,
    mode: libc::S_IFREG,
};

/// What of an inode the judgement needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inode {
    pub uid: u32,
    /// Its names: past one, in a directory others may add to, one may be theirs.
    pub nlink: u64,
    /// The whole `st_mode`: type and permission bits.
    pub mode: u32,
}

impl Inode {
    fn of(meta: &std::fs::Metadata) -> Inode {
        Inode {
            uid: meta.uid(),
            nlink: meta.nlink(),
            mode: meta.mode(),
        }
    }

    fn group_or_others_write(self) -> bool {
        self.mode & 0o022 != 0
    }

    fn sticky(self) -> bool {
        self.mode & 0o1000 != 0
    }
}

/// Why a path can be changed by a user other than root and `euid`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenToOthers {
    /// The file, directory or link someone else controls.
    pub at: PathBuf,
    pub why: Why,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Why {
    /// It belongs to this uid, who may change it or, for a directory, its entries.
    Owner(u32),
    /// Its mode lets group or others write it (for a directory: replace its entries).
    Mode(u32),
    /// More links than the kernel follows, or a loop.
    TooManyLinks,
    /// The file opened is not the one the walk judged: reached through a magic link of
    /// /proc, whose text is not where the kernel goes, or put there while it was judged.
    NotTheFileJudged,
    /// A process holds it open for writing (a descriptor opened before the file became
    /// root's keeps the access it was opened with).
    OpenForWriting,
}

impl fmt::Display for OpenToOthers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = self.at.display();
        match self.why {
            Why::Owner(uid) => write!(f, "{at} belongs to uid {uid}, who can change it"),
            Why::Mode(mode) => write!(
                f,
                "{at} has mode {:o}, which lets group or others write it",
                mode & 0o7777
            ),
            Why::TooManyLinks => write!(f, "{at} follows more than {MAX_LINKS} links"),
            Why::NotTheFileJudged => write!(
                f,
                "{at} opens another file than the one its path leads to when each link is read \
                 (a link of /proc such as /proc/PID/root, or a file put there meanwhile)"
            ),
            Why::OpenForWriting => write!(
                f,
                "{at} is held open for writing by a process (a descriptor opened before the \
                 file was root's writes it still)"
            ),
        }
    }
}

/// Which of the two [`judge`] looks at lets others in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Culprit {
    Directory,
    Entry,
}

/// Whether an entry (`entry`, found in the directory `dir`) can be changed or replaced by a
/// user other than root and `euid`: its directory's owner and mode, then its own owner, and
/// for a file (not a directory or link, whose entries and targets are judged on the way on)
/// its mode. Pure: the walk hands it what `lstat` said.
///
/// `hardlinks_protected`: `fs.protected_hardlinks` is 1, so no one links another user's file
/// (unless they may write it, which is judged anyway): a second name is then no sign.
pub fn judge(
    dir: Inode,
    entry: Inode,
    euid: u32,
    hardlinks_protected: bool,
) -> Option<(Culprit, Why)> {
    let trusted = |uid: u32| uid == 0 || uid == euid;
    if !trusted(dir.uid) {
        return Some((Culprit::Directory, Why::Owner(dir.uid)));
    }
    // In a sticky directory others may add entries but rename or remove only their own. A
    // file or link with more than one name may be a hard link one of them made there to
    // root's file (allowed unless `fs.protected_hardlinks=1`): root's, but not put there by
    // root.
    let kind = entry.mode & libc::S_IFMT;
    let own_entry =
        trusted(entry.uid) && (kind == libc::S_IFDIR || entry.nlink <= 1 || hardlinks_protected);
    if dir.group_or_others_write() && !(dir.sticky() && own_entry) {
        return Some((Culprit::Directory, Why::Mode(dir.mode)));
    }
    if !trusted(entry.uid) {
        return Some((Culprit::Entry, Why::Owner(entry.uid)));
    }
    if kind != libc::S_IFDIR && kind != libc::S_IFLNK && entry.group_or_others_write() {
        return Some((Culprit::Entry, Why::Mode(entry.mode)));
    }
    None
}

/// What a walk found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Walk {
    /// Only root and `euid` could change what the path reads: the file it leads to, as
    /// (`st_dev`, `st_ino`).
    Trusted(u64, u64),
    /// Someone else could.
    Open(OpenToOthers),
    /// A component could not be looked up where only root and `euid` add entries, or a
    /// link not read: reading the path fails on its own, with its own error.
    Unfinished,
}

/// Walks `path` (relative to the working directory when not absolute) and returns the first
/// place where a user other than root and `euid` could change what it reads, or `None`.
/// A component that cannot be looked up ends the walk: with the directory that should hold
/// it when others may add entries to that directory, else with `None` (reading the path then
/// fails on its own, with its own error).
pub fn open_to_others(path: &Path, euid: u32) -> Option<OpenToOthers> {
    match walk(path, euid) {
        Walk::Open(found) => Some(found),
        Walk::Trusted(..) | Walk::Unfinished => None,
    }
}

/// Why [`open_trusted`] gave no file.
#[derive(Debug)]
pub enum Refused {
    /// Opening or reading its metadata failed.
    Io(std::io::Error),
    /// Someone else could change what it reads.
    Open(OpenToOthers),
}

/// Opens `path` to read it, if only root and `euid` could change what it reads: opened
/// first, then walked, and the file opened must be the one the walk judged. The kernel
/// follows a magic link of /proc (`/proc/PID/root`, `/proc/PID/fd/N`) to its object, the
/// walk only its text; and a name others may fill could change between the two.
pub fn open_trusted(path: &Path, euid: u32) -> Result<std::fs::File, Refused> {
    use std::os::unix::fs::OpenOptionsExt;
    // Not blocking: a FIFO (which others may put at a name the walk then refuses) would
    // wait for a writer before anything is judged. Blocking again once judged.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(Refused::Io)?;
    let meta = file.metadata().map_err(Refused::Io)?;
    match walk(path, euid) {
        Walk::Trusted(dev, ino) if (dev, ino) == (meta.dev(), meta.ino()) => {
            // Owner and modes say who may open it from now on, not who holds it open: a
            // writer from before it became root's. Where the kernel cannot tell (not this
            // process's file, no CAP_LEASE), owner and modes are all there is.
            if crate::nft::sys::open_for_writing(file.as_fd()) == Some(true) {
                return Err(Refused::Open(OpenToOthers {
                    at: path.to_owned(),
                    why: Why::OpenForWriting,
                }));
            }
            nix::fcntl::fcntl(
                &file,
                nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
            )
            .map_err(|e| Refused::Io(e.into()))?;
            Ok(file)
        }
        Walk::Open(found) => Err(Refused::Open(found)),
        Walk::Trusted(..) | Walk::Unfinished => Err(Refused::Open(OpenToOthers {
            at: path.to_owned(),
            why: Why::NotTheFileJudged,
        })),
    }
}

/// The walk of [`open_to_others`], with the file it ends at.
pub fn walk(path: &Path, euid: u32) -> Walk {
    let found = |at, why| Walk::Open(OpenToOthers { at, why });
    let Ok(absolute) = std::path::absolute(path) else {
        return Walk::Unfinished;
    };
    let mut pending: Vec<OsString> = Vec::new();
    push_components(&mut pending, &absolute);
    let mut current = PathBuf::from("/");
    let Ok(root) = std::fs::symlink_metadata(&current) else {
        return Walk::Unfinished;
    };
    let mut dir = Inode::of(&root);
    let protected = hardlinks_protected();
    if let Some((_, why)) = judge(dir, dir, euid, protected) {
        return found(current, why);
    }
    let mut last = (root.dev(), root.ino());
    let mut links = 0;
    while let Some(name) = pending.pop() {
        match name.as_bytes() {
            b"" | b"." => continue,
            b".." => {
                // `current` never holds a link (each is replaced by its target), so its
                // parent is the directory `..` names.
                current.pop();
                match std::fs::symlink_metadata(&current) {
                    Ok(meta) => {
                        dir = Inode::of(&meta);
                        last = (meta.dev(), meta.ino());
                    }
                    Err(_) => return Walk::Unfinished,
                }
                continue;
            }
            _ => {}
        }
        let next = current.join(&name);
        let Ok(meta) = std::fs::symlink_metadata(&next) else {
            // Nothing there: whoever may add an entry to `current` may put one there before
            // the path is read, or have removed theirs since it was read (replay judges
            // after reading). Elsewhere reading fails on its own.
            return match judge(dir, ABSENT, euid, protected) {
                Some((Culprit::Directory, why)) => found(current, why),
                _ => Walk::Unfinished,
            };
        };
        let entry = Inode::of(&meta);
        if let Some((culprit, why)) = judge(dir, entry, euid, protected) {
            let at = match culprit {
                Culprit::Directory => current,
                Culprit::Entry => next,
            };
            return found(at, why);
        }
        if meta.file_type().is_symlink() {
            links += 1;
            if links > MAX_LINKS {
                return found(path.to_owned(), Why::TooManyLinks);
            }
            let Ok(target) = std::fs::read_link(&next) else {
                return Walk::Unfinished;
            };
            if target.is_absolute() {
                current = PathBuf::from("/");
                dir = Inode::of(&root);
                last = (root.dev(), root.ino());
            }
            push_components(&mut pending, &target);
        } else {
            current = next;
            dir = entry;
            last = (meta.dev(), meta.ino());
        }
    }
    Walk::Trusted(last.0, last.1)
}

/// Whether `fs.protected_hardlinks` is 1; unreadable, it is taken as not.
fn hardlinks_protected() -> bool {
    std::fs::read_to_string("/proc/sys/fs/protected_hardlinks").is_ok_and(|v| v.trim() == "1")
}

/// Puts the components of `path` on `pending` so that the first is popped first.
fn push_components(pending: &mut Vec<OsString>, path: &Path) {
    let names: Vec<OsString> = path
        .components()
        .filter_map(|c| match c {
            Component::Normal(name) => Some(name.to_owned()),
            Component::ParentDir => Some(OsString::from("..")),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect();
    pending.extend(names.into_iter().rev());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};

    const DIR: u32 = libc::S_IFDIR;
    const FILE: u32 = libc::S_IFREG;
    const LINK: u32 = libc::S_IFLNK;

    fn inode(uid: u32, mode: u32) -> Inode {
        Inode {
            uid,
            mode,
            nlink: 1,
        }
    }

    /// A second name of root's file, which where hard links are not protected
    /// (`fs.protected_hardlinks=0`, the kernel's default) anyone may make in /tmp.
    fn linked(uid: u32, mode: u32) -> Inode {
        Inode {
            uid,
            mode,
            nlink: 2,
        }
    }

    /// Each case: the directory, the entry found in it, the uid egress-fence runs as, and
    /// who may change the entry besides root and that uid.
    #[test]
    fn an_entry_is_judged_by_its_directory_then_by_itself() {
        use Culprit::{Directory, Entry};
        let cases = [
            // Root's file in root's directory; the uid egress-fence runs as counts as root.
            (inode(0, DIR | 0o755), inode(0, FILE | 0o644), 0, None),
            (
                inode(0, DIR | 0o755),
                inode(61234, FILE | 0o600),
                61234,
                None,
            ),
            // A directory another user owns, or group or others may write.
            (
                inode(1000, DIR | 0o755),
                inode(0, FILE | 0o644),
                0,
                Some((Directory, Why::Owner(1000))),
            ),
            (
                inode(0, DIR | 0o775),
                inode(0, FILE | 0o644),
                0,
                Some((Directory, Why::Mode(DIR | 0o775))),
            ),
            (
                inode(0, DIR | 0o777),
                inode(0, DIR | 0o755),
                0,
                Some((Directory, Why::Mode(DIR | 0o777))),
            ),
            // /tmp: root's entries stay root's; a link another user planted there is theirs.
            (inode(0, DIR | 0o1777), inode(0, FILE | 0o644), 0, None),
            (
                inode(0, DIR | 0o1777),
                inode(65534, LINK | 0o777),
                0,
                Some((Directory, Why::Mode(DIR | 0o1777))),
            ),
            (
                inode(0, DIR | 0o1777),
                linked(0, FILE | 0o644),
                0,
                Some((Directory, Why::Mode(DIR | 0o1777))),
            ),
            (inode(0, DIR | 0o755), linked(0, FILE | 0o644), 0, None),
            // A file others own or may write; a link's own mode means nothing.
            (
                inode(0, DIR | 0o755),
                inode(65534, FILE | 0o644),
                0,
                Some((Entry, Why::Owner(65534))),
            ),
            (
                inode(0, DIR | 0o755),
                inode(0, FILE | 0o666),
                0,
                Some((Entry, Why::Mode(FILE | 0o666))),
            ),
            (inode(0, DIR | 0o755), inode(0, LINK | 0o777), 0, None),
        ];
        // Where hard links are protected, no one else made that second name (the Nix store,
        // optimised, is full of them).
        assert_eq!(
            judge(inode(0, DIR | 0o1775), linked(0, FILE | 0o444), 0, true),
            None
        );
        for (dir, entry, euid, expected) in cases {
            assert_eq!(
                judge(dir, entry, euid, false),
                expected,
                "{dir:?} {entry:?} {euid}"
            );
        }
    }

    /// A FIFO at the path (which others may put at a missing name of /tmp) is not waited
    /// on: opening it for the judgement must not hang a reload for good.
    #[test]
    fn opening_a_fifo_to_judge_it_does_not_wait_for_a_writer() {
        let euid = nix::unistd::geteuid().as_raw();
        let dir = tempfile::tempdir().expect("tempdir");
        let fifo = dir.path().join("policy.yaml");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o644))
            .expect("mkfifo");
        let (done, opened) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(open_trusted(&fifo, euid).is_ok());
        });
        assert!(
            opened
                .recv_timeout(std::time::Duration::from_secs(5))
                .is_ok(),
            "open_trusted waited for a writer"
        );
    }

    /// The walk on real files: this test runs as whoever runs `cargo test`, which is
    /// `euid` here, in a private directory under the temporary one.
    #[test]
    fn the_walk_follows_links_and_names_where_others_could_write() {
        let euid = nix::unistd::geteuid().as_raw();
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path();
        std::fs::set_permissions(base, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let file = base.join("policy.yaml");
        std::fs::write(&file, "version: 1\n").expect("write");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        if open_to_others(base, euid).is_some() {
            // The temporary directory itself is shared (a group-writable TMPDIR): nothing
            // under it can be judged trusted.
            return;
        }
        assert_eq!(open_to_others(&file, euid), None);

        // A link through a directory others may write: the directory is named.
        let shared = base.join("shared");
        std::fs::create_dir(&shared).expect("mkdir");
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let link = base.join("link.yaml");
        symlink(shared.join("policy.yaml"), &link).expect("symlink");
        std::fs::write(shared.join("policy.yaml"), "version: 1\n").expect("write");
        let found = open_to_others(&link, euid).expect("the shared directory is named");
        assert_eq!(found.at, shared);
        assert!(matches!(found.why, Why::Mode(_)), "{found}");

        // A relative link with `..` resolves like the kernel's.
        let sub = base.join("sub");
        std::fs::create_dir(&sub).expect("mkdir");
        symlink("../policy.yaml", sub.join("up.yaml")).expect("symlink");
        assert_eq!(open_to_others(&sub.join("up.yaml"), euid), None);

        // A file others may write.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).expect("chmod");
        let found = open_to_others(&sub.join("up.yaml"), euid).expect("the file is named");
        assert_eq!(found.at, file);
        assert!(found.to_string().contains("666"), "{found}");

        // Nothing (yet, or any more) at a name in a directory others may add to: they may
        // put their own entry there before the path is read, or have removed theirs since.
        let found = open_to_others(&shared.join("absent.yaml"), euid).expect("named");
        assert_eq!(found.at, shared);
        let sticky = base.join("sticky");
        std::fs::create_dir(&sticky).expect("mkdir");
        std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        let found = open_to_others(&sticky.join("absent.yaml"), euid).expect("named");
        assert_eq!(found.at, sticky);
        // Where only root and `euid` may add entries, reading fails on its own.
        assert_eq!(open_to_others(&base.join("absent.yaml"), euid), None);

        // A loop.
        symlink("loop-b", base.join("loop-a")).expect("symlink");
        symlink("loop-a", base.join("loop-b")).expect("symlink");
        assert_eq!(
            open_to_others(&base.join("loop-a"), euid).map(|f| f.why),
            Some(Why::TooManyLinks)
        );
    }
}
