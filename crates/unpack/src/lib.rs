//! An image's layers applied to a [`Tree`], and the files airlock adds to it, with nothing
//! followed (its own crate: small enough to fuzz, `fuzz/`, and to read whole): every entry, whiteout and added file goes through the tree's symlink-free
//! resolution (see `tree.rs`), so a layer can shape the image's own tree and nothing else.
//!
//! - whiteouts first (they hide what the layers below hold): `.wh.<name>` removes `<name>`,
//!   `.wh..wh..opq` empties its directory; one whose path runs through a symlink or a file
//!   removes nothing (no lower entry lives at such a path: the tree holds only real paths);
//! - then every other entry: directories, files, symlinks (kept as data, whatever their target),
//!   hard links (to a path of the tree, never out of it), named pipes; device nodes are skipped;
//!   an entry whose parent is a symlink, or that names `..`, refuses the layer;
//! - within [`Budget`]: bytes and entries over all layers.

mod tree;

use std::io::Read;
use std::path::{Component, Path, PathBuf};
pub use tree::{stamp_file, Meta, Tree, TreeError};

/// What the unpacking may still use, over all of an image's layers.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub bytes: u64,
    pub entries: u64,
}

/// Why a layer was refused.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("{0}")]
    Tree(#[from] TreeError),
    #[error("not a tar archive: {0}")]
    Tar(std::io::Error),
    #[error("{0}: a path with `..`")]
    DotDot(PathBuf),
    #[error("its files over the limit of {0} bytes")]
    TooManyBytes(u64),
    #[error("more than {0} entries")]
    TooManyEntries(u64),
    #[error("{path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A layer's path without `./` or a leading `/`; one with `..` is refused.
pub fn clean_path(p: &Path) -> Result<PathBuf, UnpackError> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir | Component::RootDir => {}
            _ => return Err(UnpackError::DotDot(p.to_path_buf())),
        }
    }
    Ok(out)
}

const OPAQUE: &str = ".wh..wh..opq";
const WHITEOUT: &str = ".wh.";

/// One layer over `tree`; `open` gives its (decompressed) tar from the start, once per pass.
/// `limit` is what the budget started at, for the message.
pub fn apply_layer<R: Read>(
    tree: &Tree,
    mut open: impl FnMut() -> std::io::Result<R>,
    budget: &mut Budget,
    limit: Budget,
) -> Result<(), UnpackError> {
    let tar_err = UnpackError::Tar;
    // Pass 1: whiteouts.
    let mut a = tar::Archive::new(open().map_err(tar_err)?);
    for entry in a.entries().map_err(tar_err)? {
        let entry = entry.map_err(tar_err)?;
        let rel = clean_path(&entry.path().map_err(tar_err)?)?;
        let Some(file) = rel.file_name().and_then(|f| f.to_str()) else {
            continue;
        };
        let parent = rel.parent().unwrap_or(Path::new(""));
        let gone = if file == OPAQUE {
            tree.empty(parent)
        } else if let Some(hidden) = file.strip_prefix(WHITEOUT) {
            if hidden.is_empty() {
                continue;
            }
            tree.remove(&parent.join(hidden))
        } else {
            continue;
        };
        match gone {
            Ok(()) => {}
            // Nothing below lives at a path through a symlink, a file or nothing.
            Err(TreeError::Symlink(_) | TreeError::NotDir(_)) => {}
            Err(TreeError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
    }
    // Pass 2: everything else.
    let mut a = tar::Archive::new(open().map_err(tar_err)?);
    for entry in a.entries().map_err(tar_err)? {
        let mut entry = entry.map_err(tar_err)?;
        let rel = clean_path(&entry.path().map_err(tar_err)?)?;
        let name = rel.file_name().and_then(|f| f.to_str()).unwrap_or("");
        if name.starts_with(WHITEOUT) || rel.as_os_str().is_empty() {
            continue;
        }
        budget.entries = budget
            .entries
            .checked_sub(1)
            .ok_or(UnpackError::TooManyEntries(limit.entries))?;
        let size = entry.size();
        budget.bytes = budget
            .bytes
            .checked_sub(size)
            .ok_or(UnpackError::TooManyBytes(limit.bytes))?;
        let h = entry.header();
        let meta = Meta {
            uid: h.uid().unwrap_or(0).try_into().unwrap_or(u32::MAX),
            gid: h.gid().unwrap_or(0).try_into().unwrap_or(u32::MAX),
            mode: h.mode().unwrap_or(0o644),
            mtime: h.mtime().unwrap_or(0).min(i64::MAX as u64) as i64,
        };
        let kind = h.entry_type();
        if kind.is_dir() {
            tree.make_dir(&rel, meta)?;
        } else if kind.is_file() || kind.is_gnu_sparse() {
            let mut f = tree.create_file(&rel)?;
            std::io::copy(&mut (&mut entry).take(size), &mut f).map_err(|source| UnpackError::Write {
                path: rel.clone(),
                source,
            })?;
            stamp_file(&f, meta, &rel)?;
        } else if kind.is_symlink() {
            let target = entry.link_name().map_err(tar_err)?.unwrap_or_default().into_owned();
            tree.symlink(&rel, &target, meta)?;
        } else if kind.is_hard_link() {
            let target = entry.link_name().map_err(tar_err)?.unwrap_or_default();
            let source = clean_path(&target)?;
            tree.hard_link(&rel, &source)?;
        } else if kind.is_fifo() {
            tree.fifo(&rel, meta)?;
        }
        // Device nodes and the rest (tar's own metadata entries are read by `entries`): skipped.
    }
    Ok(())
}

/// What the agent needs of a root it did not come with: its mount points (an entry the image
/// has there, of any kind, is the image's: the guest resolves it), `/etc`'s account files
/// where missing, and the agent at `/usr/sbin/airlock-agent`. The host writes only into real
/// directories: a symlinked `etc` or `usr/sbin` (or `usr`) is replaced by one.
pub fn prepare_root(tree: &Tree, agent: &Path) -> Result<(), UnpackError> {
    for dir in ["dev", "proc", "sys", "tmp", "run", "root", "home"] {
        if tree.kind(Path::new(dir)).is_none() {
            tree.make_dirs(Path::new(dir))?;
        }
    }
    drop(tree.real_dirs(Path::new("etc"))?);
    let files = [
        ("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
        ("etc/group", "root:x:0:\n"),
        (
            "etc/hosts",
            "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n",
        ),
    ];
    for (rel, text) in files {
        tree.create_if_absent(Path::new(rel), text.as_bytes(), 0o644)?;
    }
    install(tree, agent, Path::new("usr/sbin/airlock-agent"), 0o755)
}

/// The host's file `src` as `rel` in the tree (its directory made real), mode `mode`, root's.
pub fn install(tree: &Tree, src: &Path, rel: &Path, mode: u32) -> Result<(), UnpackError> {
    let write = |source| UnpackError::Write {
        path: rel.to_path_buf(),
        source,
    };
    drop(tree.real_dirs(rel.parent().unwrap_or(Path::new("")))?);
    let mut from = std::fs::File::open(src).map_err(write)?;
    let mut to = tree.create_file(rel)?;
    std::io::copy(&mut from, &mut to).map_err(write)?;
    let meta = Meta {
        uid: 0,
        gid: 0,
        mode,
        mtime: 0,
    };
    stamp_file(&to, meta, rel)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use airlock_testnet::hostile::{hard_link, hostile_images, Outside};
    use airlock_testnet::registry::tar_layer;

    fn budget() -> Budget {
        Budget {
            bytes: 1 << 20,
            entries: 1000,
        }
    }

    fn apply(tree: &Tree, tar: &[u8]) -> Result<(), UnpackError> {
        let mut b = budget();
        apply_layer(tree, || Ok(tar), &mut b, budget())
    }

    fn tar_of(entries: &[(&str, Option<&[u8]>)]) -> Vec<u8> {
        tar_layer(entries, &[], &[])
    }

    #[test]
    fn layers_apply_in_order_with_whiteouts() {
        let dir = tempfile::tempdir().unwrap();
        let t = Tree::open(dir.path()).unwrap();
        apply(
            &t,
            &tar_of(&[
                ("etc/", None),
                ("etc/keep", Some(b"1")),
                ("etc/gone", Some(b"1")),
                ("opt/", None),
                ("opt/old", Some(b"1")),
                ("opt/sub/", None),
                ("opt/sub/x", Some(b"1")),
            ]),
        )
        .unwrap();
        apply(
            &t,
            &tar_of(&[
                ("etc/.wh.gone", Some(b"")),
                ("opt/.wh..wh..opq", Some(b"")),
                ("opt/new", Some(b"2")),
                ("etc/keep", Some(b"2")),
            ]),
        )
        .unwrap();
        let root = dir.path();
        assert_eq!(std::fs::read(root.join("etc/keep")).unwrap(), b"2");
        assert!(!root.join("etc/gone").exists());
        assert!(!root.join("opt/old").exists() && !root.join("opt/sub").exists());
        assert_eq!(std::fs::read(root.join("opt/new")).unwrap(), b"2");
        assert!(!root.join("etc/.wh.gone").exists());
    }

    /// The audit's hostile set (testnet's, which the api test builds from too): none reaches the
    /// directory beside the root; those that must be refused are; airlock's own files land in
    /// real directories of the tree.
    #[test]
    fn hostile_layers_leave_the_host_untouched() {
        for case in hostile_images(&std::env::temp_dir().join("unused")) {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().join("root");
            std::fs::create_dir(&root).unwrap();
            let outside = Outside::make(&dir.path().join("outside")).unwrap();
            // The same set, aimed at this test's own directory.
            let case = hostile_images(&outside.dir)
                .into_iter()
                .find(|c| c.what == case.what)
                .unwrap();
            let t = Tree::open(&root).unwrap();
            let mut refused = false;
            for layer in &case.layers {
                refused |= apply(&t, layer).is_err();
            }
            assert_eq!(refused, case.refused, "{}", case.what);
            let agent = dir.path().join("agent");
            std::fs::write(&agent, b"AGENT").unwrap();
            prepare_root(&t, &agent).unwrap();
            assert_eq!(outside.changed(), None, "{}", case.what);
            assert_eq!(std::fs::read(root.join("usr/sbin/airlock-agent")).unwrap(), b"AGENT");
            assert!(std::fs::symlink_metadata(root.join("usr/sbin")).unwrap().is_dir());
            assert!(std::fs::symlink_metadata(root.join("etc")).unwrap().is_dir());
        }
    }

    #[test]
    fn links_and_budgets() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let t = Tree::open(root).unwrap();
        // An absolute hard link target is the tree's own path.
        apply(&t, &tar_of(&[("etc/", None), ("etc/shadow", Some(b"tree's"))])).unwrap();
        apply(&t, &hard_link("copy", "/etc/shadow")).unwrap();
        assert_eq!(std::fs::read(root.join("copy")).unwrap(), b"tree's");
        // A later layer writing the linked name replaces it, not the file linked to.
        apply(&t, &tar_of(&[("copy", Some(b"new"))])).unwrap();
        assert_eq!(std::fs::read(root.join("etc/shadow")).unwrap(), b"tree's");
        // Too many bytes, too many entries.
        let small = Budget { bytes: 1, entries: 100 };
        let big = tar_of(&[("big", Some(b"12345"))]);
        assert!(matches!(
            apply_layer(&t, || Ok(&big[..]), &mut small.clone(), small),
            Err(UnpackError::TooManyBytes(1))
        ));
        let few = Budget { bytes: 100, entries: 1 };
        let two = tar_of(&[("a", Some(b"1")), ("b", Some(b"1"))]);
        assert!(matches!(
            apply_layer(&t, || Ok(&two[..]), &mut few.clone(), few),
            Err(UnpackError::TooManyEntries(1))
        ));
        assert!(clean_path(Path::new("a/../../etc")).is_err());
    }
}
