//! A directory tree the host fills with content it does not trust (an image's layers), touched
//! only through a directory fd of its root: every path is resolved by the kernel with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)`, so
//! no component may be a symlink, `..` cannot climb out, and no mount is crossed; the last
//! component is acted on with the `*at` calls that never follow it (`O_NOFOLLOW`, `O_EXCL`,
//! `AT_SYMLINK_NOFOLLOW`, `unlinkat`). A symlink in the tree is only ever data: created,
//! removed, owned, never followed. Whatever the layers did before, a write lands inside.

use rustix::fs::{AtFlags, Dir, FileType, Gid, Mode, OFlags, ResolveFlags, Timespec, Timestamps, Uid};
use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

/// Why a path of the tree could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("{0}: a path through a symlink")]
    Symlink(PathBuf),
    #[error("{0}: a path through something that is not a directory")]
    NotDir(PathBuf),
    #[error("{0}: not a path inside the tree (empty, `..` or absolute)")]
    Outside(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

type Result<T> = std::result::Result<T, TreeError>;

fn io_err(path: &Path, e: rustix::io::Errno) -> TreeError {
    match e {
        rustix::io::Errno::LOOP => TreeError::Symlink(path.to_path_buf()),
        rustix::io::Errno::NOTDIR => TreeError::NotDir(path.to_path_buf()),
        // RESOLVE_BENEATH's and RESOLVE_NO_XDEV's refusal.
        rustix::io::Errno::XDEV => TreeError::Outside(path.to_path_buf()),
        e => TreeError::Io {
            path: path.to_path_buf(),
            source: e.into(),
        },
    }
}

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS)
    .union(ResolveFlags::NO_XDEV);
const DIR_FLAGS: OFlags = OFlags::DIRECTORY
    .union(OFlags::RDONLY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// What a tree entry is owned as and stamped with.
#[derive(Debug, Clone, Copy)]
pub struct Meta {
    pub uid: u32,
    pub gid: u32,
    /// Permission bits, setuid/setgid/sticky included.
    pub mode: u32,
    pub mtime: i64,
}

/// The root of a tree; see the module doc.
pub struct Tree {
    root: OwnedFd,
}

/// `rel` as normal components only: no `..`, no root, no `.`, not empty.
fn checked(rel: &Path) -> Result<()> {
    let mut any = false;
    for c in rel.components() {
        match c {
            Component::Normal(_) => any = true,
            _ => return Err(TreeError::Outside(rel.to_path_buf())),
        }
    }
    if any {
        Ok(())
    } else {
        Err(TreeError::Outside(rel.to_path_buf()))
    }
}

/// `rel`'s parent and last component (`rel` already checked).
fn split(rel: &Path) -> (&Path, &OsStr) {
    (
        rel.parent().unwrap_or(Path::new("")),
        rel.file_name().expect("a checked path has a last component"),
    )
}

impl Tree {
    /// The tree rooted at `path`, which must be a real directory (no symlink as its last
    /// component; its parents are the host's own, chosen by the caller).
    pub fn open(path: &Path) -> Result<Tree> {
        let root = rustix::fs::open(path, DIR_FLAGS, Mode::empty()).map_err(|e| io_err(path, e))?;
        Ok(Tree { root })
    }

    /// The tree whose root is `fd` (a directory).
    pub fn from_fd(root: OwnedFd) -> Tree {
        Tree { root }
    }

    /// The directory at `rel` (`""`: the root), reached with no symlink on the way.
    pub fn dir(&self, rel: &Path) -> Result<OwnedFd> {
        if rel.as_os_str().is_empty() {
            return rustix::io::fcntl_dupfd_cloexec(&self.root, 0).map_err(|e| io_err(rel, e));
        }
        checked(rel)?;
        rustix::fs::openat2(&self.root, rel, DIR_FLAGS, Mode::empty(), RESOLVE).map_err(|e| match e {
            // O_NOFOLLOW | O_DIRECTORY on a last component that is a symlink.
            rustix::io::Errno::NOTDIR if self.kind(rel) == Some(FileType::Symlink) => {
                TreeError::Symlink(rel.to_path_buf())
            }
            e => io_err(rel, e),
        })
    }

    /// The directory at `rel`, made (mode 0755, owned by the caller) where a component is
    /// missing; a component that exists must be a real directory.
    pub fn make_dirs(&self, rel: &Path) -> Result<OwnedFd> {
        self.walk_dirs(rel, false)
    }

    /// The directory at `rel` as [`Tree::make_dirs`] makes it, except that a symlink (or any
    /// other non-directory) in the way is removed and replaced by a real directory: for the
    /// places the host itself writes into (`etc`, `usr/sbin`).
    pub fn real_dirs(&self, rel: &Path) -> Result<OwnedFd> {
        self.walk_dirs(rel, true)
    }

    /// `rel` component by component from the root, each made where missing (and, with
    /// `replace`, where it is not a directory).
    fn walk_dirs(&self, rel: &Path, replace: bool) -> Result<OwnedFd> {
        let mut at = self.dir(Path::new(""))?;
        let mut walked = PathBuf::new();
        for c in rel.components() {
            let Component::Normal(name) = c else {
                return Err(TreeError::Outside(rel.to_path_buf()));
            };
            walked.push(name);
            if replace && kind_at(at.as_fd(), name).is_some_and(|k| k != FileType::Directory) {
                remove_at(at.as_fd(), name, &walked)?;
            }
            match rustix::fs::mkdirat(&at, name, Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(io_err(&walked, e)),
            }
            at = open_dir(at.as_fd(), name, &walked)?;
        }
        Ok(at)
    }

    /// What `rel` is (its last component not followed), if it exists and its parents are real
    /// directories.
    pub fn kind(&self, rel: &Path) -> Option<FileType> {
        checked(rel).ok()?;
        let (parent, name) = split(rel);
        let dir = self.dir(parent).ok()?;
        kind_at(dir.as_fd(), name)
    }

    /// `rel` removed, a directory with everything in it; nothing there is no error. Its parents
    /// must be real directories.
    pub fn remove(&self, rel: &Path) -> Result<()> {
        checked(rel)?;
        let (parent, name) = split(rel);
        let dir = self.dir(parent)?;
        remove_at(dir.as_fd(), name, rel)
    }

    /// Everything in the directory `rel` removed, the directory kept.
    pub fn empty(&self, rel: &Path) -> Result<()> {
        let dir = self.dir(rel)?;
        empty_at(dir.as_fd(), rel)
    }

    /// A new regular file at `rel` (what was there removed first, so no write goes through a
    /// hard link either), the parent made if missing; open for writing, mode 0600 until
    /// [`Tree::stamp_file`].
    pub fn create_file(&self, rel: &Path) -> Result<std::fs::File> {
        let (dir, name) = self.fresh(rel)?;
        let fd = rustix::fs::openat(
            &dir,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| io_err(rel, e))?;
        Ok(std::fs::File::from(fd))
    }

    /// A new regular file at `rel` holding `bytes`, only if nothing is there (an entry of any
    /// kind, a symlink too, is left as it is). Whether it was written.
    pub fn create_if_absent(&self, rel: &Path, bytes: &[u8], mode: u32) -> Result<bool> {
        use std::io::Write;
        checked(rel)?;
        let (parent, name) = split(rel);
        let dir = self.dir(parent)?;
        let fd = match rustix::fs::openat(
            &dir,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::EXIST) => return Ok(false),
            Err(e) => return Err(io_err(rel, e)),
        };
        let mut f = std::fs::File::from(fd);
        f.write_all(bytes).map_err(|source| TreeError::Io {
            path: rel.to_path_buf(),
            source,
        })?;
        rustix::fs::fchmod(&f, Mode::from_raw_mode(mode)).map_err(|e| io_err(rel, e))?;
        Ok(true)
    }

    /// The names in the directory `rel` (`""`: the root).
    pub fn names(&self, rel: &Path) -> Result<Vec<std::ffi::OsString>> {
        let dir = self.dir(rel)?;
        let mut names = Vec::new();
        let mut entries = Dir::read_from(&dir).map_err(|e| io_err(rel, e))?;
        while let Some(entry) = entries.read() {
            let entry = entry.map_err(|e| io_err(rel, e))?;
            let name = entry.file_name().to_bytes();
            if name != b"." && name != b".." {
                names.push(<OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(name).to_os_string());
            }
        }
        Ok(names)
    }

    /// The regular file at `rel`, open for reading (a symlink there is refused, not followed).
    pub fn open_file(&self, rel: &Path) -> Result<std::fs::File> {
        checked(rel)?;
        let fd = rustix::fs::openat2(
            &self.root,
            rel,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
            RESOLVE,
        )
        .map_err(|e| io_err(rel, e))?;
        Ok(std::fs::File::from(fd))
    }

    /// The root directory's own owner, mode and mtime.
    pub fn stamp_root(&self, meta: Meta) -> Result<()> {
        stamp_fd(self.root.as_fd(), meta, Path::new(""))
    }

    /// A directory at `rel`: one already there is kept (a later layer restamps it), anything
    /// else there is replaced.
    pub fn make_dir(&self, rel: &Path, meta: Meta) -> Result<()> {
        checked(rel)?;
        let (parent, name) = split(rel);
        let dir = self.make_dirs(parent)?;
        match kind_at(dir.as_fd(), name) {
            Some(FileType::Directory) => {}
            Some(_) => {
                remove_at(dir.as_fd(), name, rel)?;
                rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o700)).map_err(|e| io_err(rel, e))?;
            }
            None => rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o700)).map_err(|e| io_err(rel, e))?,
        }
        let fd = rustix::fs::openat(&dir, name, DIR_FLAGS, Mode::empty()).map_err(|e| io_err(rel, e))?;
        stamp_fd(fd.as_fd(), meta, rel)
    }

    /// A symlink at `rel` to `target` (kept as it is: it is never followed here).
    pub fn symlink(&self, rel: &Path, target: &Path, meta: Meta) -> Result<()> {
        let (dir, name) = self.fresh(rel)?;
        rustix::fs::symlinkat(target, &dir, name).map_err(|e| io_err(rel, e))?;
        let flags = AtFlags::SYMLINK_NOFOLLOW;
        rustix::fs::chownat(&dir, name, Some(uid(meta.uid)), Some(gid(meta.gid)), flags).map_err(|e| io_err(rel, e))?;
        let _ = rustix::fs::utimensat(&dir, name, &times(meta.mtime), flags);
        Ok(())
    }

    /// A hard link at `rel` to the tree's `source` (itself, not what it may point to).
    pub fn hard_link(&self, rel: &Path, source: &Path) -> Result<()> {
        checked(source)?;
        let (from_parent, from_name) = split(source);
        let from = self.dir(from_parent)?;
        if kind_at(from.as_fd(), from_name).is_none() {
            return Err(TreeError::Io {
                path: source.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "a hard link to nothing in the tree"),
            });
        }
        let (dir, name) = self.fresh(rel)?;
        rustix::fs::linkat(&from, from_name, &dir, name, AtFlags::empty()).map_err(|e| io_err(rel, e))
    }

    /// A named pipe at `rel`.
    pub fn fifo(&self, rel: &Path, meta: Meta) -> Result<()> {
        let (dir, name) = self.fresh(rel)?;
        rustix::fs::mknodat(&dir, name, FileType::Fifo, Mode::from_raw_mode(0o600), 0).map_err(|e| io_err(rel, e))?;
        rustix::fs::chownat(
            &dir,
            name,
            Some(uid(meta.uid)),
            Some(gid(meta.gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| io_err(rel, e))?;
        // Only this process writes the tree: the name is still the pipe just made.
        rustix::fs::chmodat(&dir, name, Mode::from_raw_mode(meta.mode & 0o7777), AtFlags::empty())
            .map_err(|e| io_err(rel, e))
    }

    /// `rel`'s parent, made if missing, with nothing left at `rel` but a directory (which a
    /// non-directory then replaces).
    fn fresh<'a>(&self, rel: &'a Path) -> Result<(OwnedFd, &'a OsStr)> {
        checked(rel)?;
        let (parent, name) = split(rel);
        let dir = self.make_dirs(parent)?;
        remove_at(dir.as_fd(), name, rel)?;
        Ok((dir, name))
    }
}

/// Owner, mode and mtime of an open file of the tree (owner first: a chown clears setuid).
pub fn stamp_file(f: &std::fs::File, meta: Meta, rel: &Path) -> Result<()> {
    stamp_fd(f.as_fd(), meta, rel)
}

fn stamp_fd(fd: BorrowedFd<'_>, meta: Meta, rel: &Path) -> Result<()> {
    rustix::fs::fchown(fd, Some(uid(meta.uid)), Some(gid(meta.gid))).map_err(|e| io_err(rel, e))?;
    rustix::fs::fchmod(fd, Mode::from_raw_mode(meta.mode & 0o7777)).map_err(|e| io_err(rel, e))?;
    let _ = rustix::fs::futimens(fd, &times(meta.mtime));
    Ok(())
}

fn uid(raw: u32) -> Uid {
    Uid::from_raw_unchecked(raw)
}

fn gid(raw: u32) -> Gid {
    Gid::from_raw_unchecked(raw)
}

fn times(mtime: i64) -> Timestamps {
    let t = Timespec {
        tv_sec: mtime,
        tv_nsec: 0,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}

/// The directory `name` in `at`, not followed: a symlink there is [`TreeError::Symlink`].
fn open_dir(at: BorrowedFd<'_>, name: &OsStr, walked: &Path) -> Result<OwnedFd> {
    rustix::fs::openat(at, name, DIR_FLAGS, Mode::empty()).map_err(|e| match e {
        rustix::io::Errno::NOTDIR | rustix::io::Errno::LOOP if kind_at(at, name) == Some(FileType::Symlink) => {
            TreeError::Symlink(walked.to_path_buf())
        }
        e => io_err(walked, e),
    })
}

fn kind_at(dir: BorrowedFd<'_>, name: &OsStr) -> Option<FileType> {
    rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
        .ok()
        .map(|s| FileType::from_raw_mode(s.st_mode))
}

/// `name` in `dir` removed, a directory with everything in it, nothing followed.
fn remove_at(dir: BorrowedFd<'_>, name: &OsStr, rel: &Path) -> Result<()> {
    match kind_at(dir, name) {
        None => Ok(()),
        Some(FileType::Directory) => {
            let sub = rustix::fs::openat(dir, name, DIR_FLAGS, Mode::empty()).map_err(|e| io_err(rel, e))?;
            empty_at(sub.as_fd(), rel)?;
            rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR).map_err(|e| io_err(rel, e))
        }
        Some(_) => rustix::fs::unlinkat(dir, name, AtFlags::empty()).map_err(|e| io_err(rel, e)),
    }
}

/// Everything in `dir` removed (depth first, by fd: nothing is followed).
fn empty_at(dir: BorrowedFd<'_>, rel: &Path) -> Result<()> {
    // The names first: removing while reading the same stream may skip entries.
    let mut names = Vec::new();
    let mut entries = Dir::read_from(dir).map_err(|e| io_err(rel, e))?;
    while let Some(entry) = entries.read() {
        let entry = entry.map_err(|e| io_err(rel, e))?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(<OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(name).to_os_string());
        }
    }
    for name in names {
        remove_at(dir, &name, &rel.join(&name))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Meta {
        Meta {
            uid: 0,
            gid: 0,
            mode: 0o755,
            mtime: 1_700_000_000,
        }
    }

    #[test]
    fn nothing_is_followed_out() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("victim"), b"v").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("abs")).unwrap();
        std::os::unix::fs::symlink("../outside", root.join("rel")).unwrap();
        std::fs::create_dir(root.join("d")).unwrap();
        std::os::unix::fs::symlink("../../outside", root.join("d/up")).unwrap();
        let t = Tree::open(&root).unwrap();
        for link in ["abs", "rel", "d/up"] {
            let through = Path::new(link).join("victim");
            let r = t.remove(&through);
            assert!(matches!(r, Err(TreeError::Symlink(_))), "{link}: {r:?}");
            assert!(matches!(t.empty(Path::new(link)), Err(TreeError::Symlink(_))), "{link}");
            assert!(matches!(
                t.create_file(&Path::new(link).join("planted")),
                Err(TreeError::Symlink(_))
            ));
            assert!(t.make_dir(&Path::new(link).join("x"), meta()).is_err());
            assert!(t.create_if_absent(&through, b"x", 0o644).is_err());
            assert!(t.hard_link(Path::new("new"), &through).is_err());
        }
        assert!(matches!(
            t.remove(Path::new("../outside/victim")),
            Err(TreeError::Outside(_))
        ));
        assert!(matches!(t.remove(Path::new("/etc/passwd")), Err(TreeError::Outside(_))));
        assert_eq!(std::fs::read(outside.join("victim")).unwrap(), b"v");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
        // The links themselves are data: removed without touching what they name.
        t.remove(Path::new("abs")).unwrap();
        assert!(outside.join("victim").exists());
        // A symlinked directory the host writes into becomes a real one.
        std::os::unix::fs::symlink(&outside, root.join("etc")).unwrap();
        let etc = t.real_dirs(Path::new("etc")).unwrap();
        drop(etc);
        assert!(std::fs::symlink_metadata(root.join("etc")).unwrap().is_dir());
        assert!(t.create_if_absent(Path::new("etc/passwd"), b"root", 0o644).unwrap());
        assert!(!t.create_if_absent(Path::new("etc/passwd"), b"again", 0o644).unwrap());
        assert_eq!(std::fs::read(root.join("etc/passwd")).unwrap(), b"root");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
    }
}
