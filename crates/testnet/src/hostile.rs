//! Hostile image layers: each aims at a host directory (`outside`) through a symlink, a hard
//! link or `..`, the ways the second audit found (and their neighbours). The unpacker's unit
//! tests apply them to a tree beside `outside`; the api test pushes them to the test registry and
//! builds `FROM` each. Either way `outside` must be as [`Outside::make`] left it.

use super::registry::tar_layer;
use std::path::{Path, PathBuf};

/// A host directory with two files the layers go after.
pub struct Outside {
    pub dir: PathBuf,
}

impl Outside {
    /// `dir` made, holding `victim` and `sub/deep`.
    pub fn make(dir: &Path) -> std::io::Result<Outside> {
        std::fs::create_dir_all(dir.join("sub"))?;
        std::fs::write(dir.join("victim"), b"v")?;
        std::fs::write(dir.join("sub/deep"), b"d")?;
        Ok(Outside { dir: dir.to_path_buf() })
    }

    /// What changed in it, if anything: `None` when untouched.
    pub fn changed(&self) -> Option<String> {
        let names: Vec<String> = std::fs::read_dir(&self.dir)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        let mut sorted = names.clone();
        sorted.sort();
        let victim = std::fs::read(self.dir.join("victim")).ok();
        let deep = std::fs::read(self.dir.join("sub/deep")).ok();
        let deep_dir: Vec<String> = std::fs::read_dir(self.dir.join("sub"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        if sorted == ["sub", "victim"]
            && victim.as_deref() == Some(b"v")
            && deep.as_deref() == Some(b"d")
            && deep_dir == ["deep"]
        {
            None
        } else {
            Some(format!(
                "{}: {sorted:?}, sub: {deep_dir:?}, victim {victim:?}",
                self.dir.display()
            ))
        }
    }
}

/// One hostile image: its layers (over nothing, or over a base the caller puts first).
pub struct Hostile {
    pub what: &'static str,
    pub layers: Vec<Vec<u8>>,
    /// Refused by the unpacker (else unpacked, harmlessly).
    pub refused: bool,
    /// Its harm is in the files airlock adds (`usr/sbin`, `etc`): the unpacking itself passes.
    pub via_added_files: bool,
}

/// The set, aimed at `outside` (an absolute path).
pub fn hostile_images(outside: &Path) -> Vec<Hostile> {
    let out = outside.to_str().expect("a UTF-8 path");
    let victim = format!("{out}/victim");
    let new = format!("{out}/new");
    let file = |entries: &[(&str, Option<&[u8]>)]| tar_layer(entries, &[], &[]);
    let h = |what, layers, refused| Hostile {
        what,
        layers,
        refused,
        via_added_files: false,
    };
    let added = |what, layers| Hostile {
        what,
        layers,
        refused: false,
        via_added_files: true,
    };
    vec![
        h(
            "a symlink, then an opaque whiteout through it",
            vec![
                tar_layer(&[], &[("x", out)], &[]),
                file(&[("x/.wh..wh..opq", Some(b""))]),
            ],
            false,
        ),
        h(
            "a symlink at depth, then opaque whiteouts through it",
            vec![
                tar_layer(&[("a/", None), ("a/b/", None)], &[("a/b/c", out)], &[]),
                file(&[("a/b/c/.wh..wh..opq", Some(b"")), ("a/b/c/sub/.wh..wh..opq", Some(b""))]),
            ],
            false,
        ),
        h(
            "a plain whiteout through a symlinked parent",
            vec![tar_layer(&[], &[("p", out)], &[]), file(&[("p/.wh.victim", Some(b""))])],
            false,
        ),
        h(
            "a relative symlink climbing out, then a whiteout through it",
            vec![
                tar_layer(&[("d/", None)], &[("d/up", "../../../../../../../../../../..")], &[]),
                file(&[(&format!("d/up{out}/.wh.victim")[..], Some(b""))]),
            ],
            false,
        ),
        h("a hard link to a host path", vec![hard_link("stolen", &victim)], true),
        h(
            "a hard link with ..",
            vec![raw("stolen", tar::EntryType::Link, Some("../../victim"), b"")],
            true,
        ),
        h(
            "a directory replaced by a symlink, then written under",
            vec![
                file(&[("d/", None), ("d/f", Some(b"1"))]),
                tar_layer(&[], &[("d", out)], &[]),
                file(&[("d/planted", Some(b"x"))]),
            ],
            true,
        ),
        h(
            "a symlink and a file under it in one layer",
            vec![link_then_file("l", out, "l/sub/planted")],
            true,
        ),
        h(
            "a file named with ..",
            vec![raw(
                "../../../../../../../../../tmp/planted-by-layer",
                tar::EntryType::Regular,
                None,
                b"x",
            )],
            true,
        ),
        added(
            "a symlinked usr/sbin and etc/passwd, etc/hosts",
            vec![tar_layer(
                &[("usr/", None), ("etc/", None)],
                &[("usr/sbin", out), ("etc/passwd", &victim), ("etc/hosts", &new)],
                &[],
            )],
        ),
        added(
            "a symlinked usr and etc",
            vec![tar_layer(&[], &[("usr", out), ("etc", out)], &[])],
        ),
    ]
}

/// A tar of symlink `link` -> `target`, then a file at `file` (under the link).
fn link_then_file(link: &str, target: &str, file: &str) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_size(0);
    h.set_mode(0o777);
    b.append_link(&mut h, link, target).expect("tar");
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_size(1);
    h.set_mode(0o644);
    b.append_data(&mut h, file, &b"x"[..]).expect("tar");
    b.into_inner().expect("tar")
}

/// A tar of one hard link `path` -> `target`.
pub fn hard_link(path: &str, target: &str) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Link);
    h.set_size(0);
    h.set_mode(0o644);
    b.append_link(&mut h, path, target).expect("tar");
    b.into_inner().expect("tar")
}

/// A tar of one entry named as written (tar's builder refuses `..`; a hostile one need not).
fn raw(path: &str, kind: tar::EntryType, link: Option<&str>, data: &[u8]) -> Vec<u8> {
    let mut h = tar::Header::new_old();
    h.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
    if let Some(l) = link {
        h.as_old_mut().linkname[..l.len()].copy_from_slice(l.as_bytes());
    }
    h.set_entry_type(kind);
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    let mut out = h.as_bytes().to_vec();
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512 + 1024, 0);
    out
}
