//! File service: read, write (creating parents), stat, list with depth, mkdir, remove, rename,
//! and directory watches (inotify through `notify`).

use crate::error::AgentError;
use crate::users;
use airlock_proto::{FileKind, FileStat, LinkTarget, WatchEvent, WatchEventKind};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::UNIX_EPOCH;

/// Paths must be absolute and free of `..`, so a path always names what it looks like.
pub fn clean_path(path: &str) -> Result<PathBuf, AgentError> {
    if path.is_empty() {
        return Err(AgentError::invalid("path is empty"));
    }
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(AgentError::invalid(format!("path {path:?} must be absolute")));
    }
    if p.components().any(|c| c == Component::ParentDir) {
        return Err(AgentError::invalid(format!("path {path:?} must not contain '..'")));
    }
    if path.contains('\0') {
        return Err(AgentError::invalid("path contains a NUL byte"));
    }
    Ok(p.components().collect())
}

pub fn stat(path: &Path) -> Result<FileStat, AgentError> {
    let shown = path.to_string_lossy().to_string();
    let meta = std::fs::symlink_metadata(path).map_err(|e| AgentError::io(&shown, e))?;
    let ft = meta.file_type();
    let kind = kind_of(ft);
    let modified_ms = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    Ok(FileStat {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "/".into()),
        path: shown,
        kind,
        size: meta.len(),
        mode: meta.permissions().mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        owner: users::name_of_uid(meta.uid()).unwrap_or_else(|| meta.uid().to_string()),
        group: users::name_of_gid(meta.gid()).unwrap_or_else(|| meta.gid().to_string()),
        modified_ms,
        symlink_target: ft
            .is_symlink()
            .then(|| std::fs::read_link(path).ok().map(|t| t.to_string_lossy().to_string()))
            .flatten(),
        symlink_resolved: ft
            .is_symlink()
            .then(|| {
                std::fs::canonicalize(path)
                    .ok()
                    .map(|t| t.to_string_lossy().to_string())
            })
            .flatten(),
        link_target: ft
            .is_symlink()
            .then(|| std::fs::metadata(path).ok())
            .flatten()
            .map(|m| LinkTarget {
                kind: kind_of(m.file_type()),
                mode: m.permissions().mode() & 0o7777,
            }),
        metadata: read_metadata(path),
    })
}

fn kind_of(ft: std::fs::FileType) -> FileKind {
    if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    }
}

/// Most user metadata read back from one file, names and values together: more than uploads
/// write ([`airlock_proto::METADATA_TOTAL_MAX`]), so only xattrs set out of band (`setfattr`)
/// can reach it, and what does not fit is left out rather than bloating every listing.
const METADATA_READ_MAX: usize = 16 << 10;

/// The `user.e2b.*` xattrs of `path` (following a symlink), prefix stripped; empty where the
/// filesystem has none (or no xattrs at all). Entries that are not UTF-8 are skipped.
pub fn read_metadata(path: &Path) -> std::collections::BTreeMap<String, String> {
    use std::os::unix::ffi::OsStrExt;
    let mut out = std::collections::BTreeMap::new();
    let Ok(cpath) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return out;
    };
    // The name list: at most XATTR_LIST_MAX (64 KiB) by the kernel's own limit.
    let mut names = vec![0u8; 64 << 10];
    let n = unsafe { libc::listxattr(cpath.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n <= 0 {
        return out;
    }
    names.truncate(n as usize);
    let prefix = airlock_proto::METADATA_XATTR_PREFIX.as_bytes();
    let mut total = 0;
    let mut value = vec![0u8; 4096];
    for name in names.split(|b| *b == 0).filter(|n| n.starts_with(prefix)) {
        let Ok(key) = std::str::from_utf8(&name[prefix.len()..]) else {
            continue;
        };
        let Ok(cname) = std::ffi::CString::new(name) else {
            continue;
        };
        let len = unsafe { libc::getxattr(cpath.as_ptr(), cname.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
        if len < 0 {
            continue; // removed meanwhile, or longer than any metadata we keep
        }
        let Ok(v) = std::str::from_utf8(&value[..len as usize]) else {
            continue;
        };
        total += name.len() + v.len();
        if total > METADATA_READ_MAX {
            break;
        }
        out.insert(key.to_string(), v.to_string());
    }
    out
}

/// Replace the user metadata of the open file `file` with `metadata` (already checked): every
/// `user.e2b.*` xattr not in it goes. A filesystem without xattrs keeps none, silently (as envd).
pub fn write_metadata(
    file: &std::fs::File,
    shown: &str,
    metadata: &std::collections::BTreeMap<String, String>,
) -> Result<(), AgentError> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let unsupported = |e: &std::io::Error| matches!(e.raw_os_error(), Some(libc::ENOTSUP));
    let mut names = vec![0u8; 64 << 10];
    let n = unsafe { libc::flistxattr(fd, names.as_mut_ptr().cast(), names.len()) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return if unsupported(&e) {
            Ok(())
        } else {
            Err(AgentError::io(shown, e))
        };
    }
    names.truncate(n as usize);
    let prefix = airlock_proto::METADATA_XATTR_PREFIX.as_bytes();
    for name in names.split(|b| *b == 0).filter(|n| n.starts_with(prefix)) {
        let keep = std::str::from_utf8(&name[prefix.len()..]).is_ok_and(|k| metadata.contains_key(k));
        if keep {
            continue;
        }
        let Ok(cname) = std::ffi::CString::new(name) else {
            continue;
        };
        unsafe { libc::fremovexattr(fd, cname.as_ptr()) };
    }
    for (k, v) in metadata {
        let name = std::ffi::CString::new(format!("{}{k}", airlock_proto::METADATA_XATTR_PREFIX))
            .map_err(|_| AgentError::invalid(format!("metadata key {k:?} contains a NUL byte")))?;
        let r = unsafe { libc::fsetxattr(fd, name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if unsupported(&e) {
                return Ok(());
            }
            return Err(AgentError::io(&format!("{shown} (metadata {k:?})"), e));
        }
    }
    Ok(())
}

/// Entries below `dir`, `depth` levels deep (1 = direct children), sorted by path.
pub fn list(dir: &Path, depth: u32) -> Result<Vec<FileStat>, AgentError> {
    if depth == 0 {
        return Err(AgentError::invalid("depth must be at least 1"));
    }
    let shown = dir.to_string_lossy().to_string();
    let meta = std::fs::metadata(dir).map_err(|e| AgentError::io(&shown, e))?;
    if !meta.is_dir() {
        return Err(AgentError::new(
            airlock_proto::ErrorCode::NotADirectory,
            format!("{shown} is not a directory"),
        ));
    }
    let mut out = Vec::new();
    walk(dir, depth, &mut out)?;
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

fn walk(dir: &Path, depth: u32, out: &mut Vec<FileStat>) -> Result<(), AgentError> {
    let shown = dir.to_string_lossy().to_string();
    for entry in std::fs::read_dir(dir).map_err(|e| AgentError::io(&shown, e))? {
        let entry = entry.map_err(|e| AgentError::io(&shown, e))?;
        let Ok(st) = stat(&entry.path()) else { continue }; // raced with a removal
        let is_dir = st.kind == FileKind::Dir;
        out.push(st);
        if is_dir && depth > 1 {
            // Unreadable subdirectories are listed but not entered.
            let _ = walk(&entry.path(), depth - 1, out);
        }
    }
    Ok(())
}

/// Create `path` and missing parents; the ones created are given to `owner` when set.
pub fn mkdir_all(path: &Path, owner: Option<&users::User>) -> Result<bool, AgentError> {
    let shown = path.to_string_lossy().to_string();
    if path.is_dir() {
        return Ok(false);
    }
    if path.exists() {
        return Err(AgentError::new(
            airlock_proto::ErrorCode::AlreadyExists,
            format!("{shown} exists and is not a directory"),
        ));
    }
    let mut missing = Vec::new();
    let mut cur = Some(path);
    while let Some(p) = cur {
        if p.exists() {
            break;
        }
        missing.push(p.to_path_buf());
        cur = p.parent();
    }
    std::fs::create_dir_all(path).map_err(|e| AgentError::io(&shown, e))?;
    if let Some(u) = owner {
        for p in missing {
            let _ = std::os::unix::fs::chown(&p, Some(u.uid), Some(u.gid));
        }
    }
    Ok(true)
}

pub fn remove(path: &Path) -> Result<(), AgentError> {
    let shown = path.to_string_lossy().to_string();
    if path == Path::new("/") {
        return Err(AgentError::invalid("refusing to remove /"));
    }
    let meta = std::fs::symlink_metadata(path).map_err(|e| AgentError::io(&shown, e))?;
    if meta.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
    .map_err(|e| AgentError::io(&shown, e))
}

const STAGING_MARK: &str = ".airlock-upload-";

/// A hidden file beside an upload's target while the upload is in progress: same directory, so
/// the final rename is atomic; unique per upload, so concurrent uploads to one path do not mix.
/// Removed on drop (a failed upload, or one whose request was dropped midway); after a successful
/// rename there is nothing left to remove.
pub struct Staging(PathBuf);

impl Staging {
    pub fn beside(target: &Path) -> Staging {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        Staging(target.with_file_name(format!(".{name}{STAGING_MARK}{n}")))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn is_staging(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.to_string_lossy().contains(STAGING_MARK))
}

/// Targets an upload just renamed into place, and whether each existed before, so watchers report
/// the upload as the create/write a user expects rather than as a rename of a hidden file. Every
/// watcher sees the rename, so entries expire by age instead of being taken by the first.
static LANDED_UPLOADS: std::sync::Mutex<Vec<(PathBuf, Landing, std::time::Instant)>> =
    std::sync::Mutex::new(Vec::new());

/// What an upload landing on its target did there, for the events a watcher is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Landing {
    /// The target was there before (its content replaced) rather than created.
    pub existed: bool,
    /// The new content has bytes (an empty one is never written to).
    pub has_bytes: bool,
}

impl Landing {
    /// The events envd's write makes, which E2B's SDK tests count: it opens the target with
    /// `O_CREAT|O_TRUNC` (a create when new; a truncation, a write, when not), gives it to the
    /// user (a chmod, inotify's IN_ATTRIB), then writes the bytes (a write, when there are any).
    fn events(self) -> Vec<WatchEventKind> {
        let mut kinds = vec![
            if self.existed {
                WatchEventKind::Write
            } else {
                WatchEventKind::Create
            },
            WatchEventKind::Chmod,
        ];
        if self.has_bytes {
            kinds.push(WatchEventKind::Write);
        }
        kinds
    }
}

/// Record an upload about to land on `target` (call right before the rename).
pub fn note_upload_landing(target: &Path, landing: Landing) {
    let mut landed = LANDED_UPLOADS.lock().unwrap_or_else(|e| e.into_inner());
    landed.retain(|(_, _, at)| at.elapsed() < std::time::Duration::from_secs(30));
    landed.push((target.to_path_buf(), landing, std::time::Instant::now()));
}

fn landed_upload(target: &Path) -> Option<Landing> {
    let landed = LANDED_UPLOADS.lock().unwrap_or_else(|e| e.into_inner());
    landed
        .iter()
        .rev()
        .find(|(p, _, _)| p == target)
        .map(|(_, landing, _)| *landing)
}

pub fn rename(from: &Path, to: &Path) -> Result<(), AgentError> {
    let shown = from.to_string_lossy().to_string();
    if !from.exists() && std::fs::symlink_metadata(from).is_err() {
        return Err(AgentError::not_found(format!("{shown}: no such file or directory")));
    }
    if let Some(parent) = to.parent() {
        mkdir_all(parent, None)?;
    }
    std::fs::rename(from, to).map_err(|e| AgentError::io(&shown, e))
}

/// Translate one notify event into the watch events the host sees.
pub fn translate(event: &notify::Event) -> Vec<WatchEvent> {
    use notify::event::{EventKind as K, ModifyKind, RenameMode};
    let event_at = |kind, p: &Path| WatchEvent {
        kind,
        path: p.to_string_lossy().to_string(),
        entry: None,
    };
    // An upload landing (staging file renamed onto its target): the events of envd's write.
    if let K::Modify(ModifyKind::Name(RenameMode::To)) = event.kind {
        if let Some(landing) = event.paths.first().and_then(|p| landed_upload(p)) {
            let p = &event.paths[0];
            return landing.events().into_iter().map(|k| event_at(k, p)).collect();
        }
    }
    let kind = match event.kind {
        // notify pairs a move's two halves into one more report; envd (fsnotify) has none.
        K::Modify(ModifyKind::Name(RenameMode::Both)) => return Vec::new(),
        // As fsnotify: the name moved away is renamed, the name moved to is created.
        K::Create(_) | K::Modify(ModifyKind::Name(RenameMode::To)) => WatchEventKind::Create,
        K::Modify(ModifyKind::Name(_)) => WatchEventKind::Rename,
        K::Modify(ModifyKind::Metadata(_)) => WatchEventKind::Chmod,
        K::Modify(_) => WatchEventKind::Write,
        K::Remove(_) => WatchEventKind::Remove,
        _ => return Vec::new(),
    };
    event
        .paths
        .iter()
        .filter(|p| !is_staging(p)) // uploads in progress are not the user's files
        .map(|p| event_at(kind, p))
        .collect()
}

/// Recursive watches miss what lands in a new directory before its own inotify watch exists
/// (`mkdir -p d/inner && echo x > d/inner/f`): notify arms the watch on `inner` only after it has
/// handed out the batch holding `inner`'s CREATE. So a new directory is scanned twice, right away
/// and again once its watch is armed ([`RESCAN_AFTER`] later), and what the scans find is reported
/// as created. A real event arriving afterwards for a path a scan reported is a duplicate and is
/// dropped; a scan skips what real events already reported.
#[derive(Default)]
pub struct RecursiveCatchUp {
    /// Reported by a scan: the real CREATE, if it comes, is dropped (once).
    synthesized: std::collections::HashMap<PathBuf, std::time::Instant>,
    /// Reported by a real CREATE: later scans skip it.
    real: std::collections::HashMap<PathBuf, std::time::Instant>,
}

/// When the second scan of a new directory runs; notify arms its watch right after the batch.
pub const RESCAN_AFTER: std::time::Duration = std::time::Duration::from_millis(200);

impl RecursiveCatchUp {
    const REMEMBER: std::time::Duration = std::time::Duration::from_secs(10);
    /// Bounds the scan of one new directory (a huge tree copied in at once).
    const MAX_SCAN: usize = 10_000;

    /// Pass one translated event on; returns a new directory to [`Self::scan`] again later.
    #[must_use]
    pub fn process(&mut self, ev: WatchEvent, emit: &mut impl FnMut(WatchEvent)) -> Option<PathBuf> {
        if ev.kind != WatchEventKind::Create {
            emit(ev);
            return None;
        }
        let path = PathBuf::from(&ev.path);
        self.synthesized.retain(|_, at| at.elapsed() < Self::REMEMBER);
        self.real.retain(|_, at| at.elapsed() < Self::REMEMBER);
        if self.synthesized.remove(&path).is_some() {
            return None;
        }
        self.real.insert(path.clone(), std::time::Instant::now());
        emit(ev);
        if !path.is_dir() {
            return None;
        }
        self.scan(&path, emit);
        Some(path)
    }

    /// Report everything under `dir` that no event has reported yet.
    pub fn scan(&mut self, dir: &Path, emit: &mut impl FnMut(WatchEvent)) {
        let mut pending = vec![dir.to_path_buf()];
        let mut scanned = 0;
        while let Some(dir) = pending.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            for entry in entries.flatten() {
                scanned += 1;
                if scanned > Self::MAX_SCAN {
                    return;
                }
                let p = entry.path();
                if is_staging(&p) {
                    continue;
                }
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    pending.push(p.clone());
                }
                if self.real.contains_key(&p) || self.synthesized.contains_key(&p) {
                    continue;
                }
                emit(WatchEvent {
                    kind: WatchEventKind::Create,
                    path: p.to_string_lossy().to_string(),
                    entry: None,
                });
                self.synthesized.insert(p, std::time::Instant::now());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a real inotify watch on `dir` reports, translated, while `act` runs.
    fn watched(dir: &Path, act: impl FnOnce()) -> Vec<(WatchEventKind, String)> {
        use notify::Watcher;
        let (tx, rx) = std::sync::mpsc::channel();
        let mut w = notify::recommended_watcher(move |r: notify::Result<notify::Event>| {
            if let Ok(ev) = r {
                for e in translate(&ev) {
                    let _ = tx.send(e);
                }
            }
        })
        .unwrap();
        w.watch(dir, notify::RecursiveMode::NonRecursive).unwrap();
        act();
        let mut got = Vec::new();
        while let Ok(e) = rx.recv_timeout(std::time::Duration::from_millis(300)) {
            let name = Path::new(&e.path).file_name().unwrap().to_string_lossy().to_string();
            got.push((e.kind, name));
        }
        got
    }

    /// Land `content` on `target` as an upload does: staged beside it, then renamed over it.
    fn land(target: &Path, content: &[u8]) {
        let staging = Staging::beside(target);
        std::fs::write(&staging.0, content).unwrap();
        note_upload_landing(
            target,
            Landing {
                existed: target.exists(),
                has_bytes: !content.is_empty(),
            },
        );
        std::fs::rename(&staging.0, target).unwrap();
    }

    #[test]
    fn watch_events_are_envds_for_writes_renames_and_removes() {
        use WatchEventKind::*;
        let d = tempfile::tempdir().unwrap();
        let dir = std::fs::canonicalize(d.path()).unwrap();
        let f = dir.join("f.txt");
        let s = |k, n: &str| (k, n.to_string());
        // New, then overwritten, then emptied: as envd's open(O_CREAT|O_TRUNC), chown, write.
        assert_eq!(
            watched(&dir, || land(&f, b"one")),
            [s(Create, "f.txt"), s(Chmod, "f.txt"), s(Write, "f.txt")]
        );
        assert_eq!(
            watched(&dir, || land(&f, b"two")),
            [s(Write, "f.txt"), s(Chmod, "f.txt"), s(Write, "f.txt")]
        );
        assert_eq!(watched(&dir, || land(&f, b"")), [s(Write, "f.txt"), s(Chmod, "f.txt")]);
        // A rename: the old name renamed, the new one created (fsnotify's IN_MOVED_FROM/TO).
        let g = dir.join("g.txt");
        assert_eq!(
            watched(&dir, || rename(&f, &g).unwrap()),
            [s(Rename, "f.txt"), s(Create, "g.txt")]
        );
        assert_eq!(
            watched(&dir, || std::fs::remove_file(&g).unwrap()),
            [s(Remove, "g.txt")]
        );
    }

    #[test]
    fn clean_path_rejects_relative_and_parent_components() {
        assert!(clean_path("relative/x").is_err());
        assert!(clean_path("/a/../etc/passwd").is_err());
        assert!(clean_path("").is_err());
        assert_eq!(clean_path("/a//b/./c").unwrap(), PathBuf::from("/a/b/c"));
    }

    #[test]
    fn new_directories_report_what_is_already_inside_once() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("inner/deeper")).unwrap();
        std::fs::write(d.path().join("inner/deeper/f.txt"), b"x").unwrap();
        let create = |p: &Path| WatchEvent {
            kind: WatchEventKind::Create,
            path: p.to_string_lossy().to_string(),
            entry: None,
        };
        let mut seen = Vec::new();
        let mut catch_up = RecursiveCatchUp::default();
        let rescan = catch_up.process(create(&d.path().join("inner")), &mut |e| seen.push(e.path));
        assert_eq!(rescan.as_deref(), Some(d.path().join("inner").as_path()));
        // Landed after the first scan, before the watch: the rescan finds it, and only it.
        std::fs::write(d.path().join("inner/late.txt"), b"y").unwrap();
        catch_up.scan(&d.path().join("inner"), &mut |e| seen.push(e.path));
        // The watch on `inner` was armed late: its own events for the same files are duplicates.
        let _ = catch_up.process(create(&d.path().join("inner/deeper")), &mut |e| seen.push(e.path));
        let _ = catch_up.process(create(&d.path().join("inner/deeper/f.txt")), &mut |e| seen.push(e.path));
        let rel: Vec<_> = seen
            .iter()
            .map(|p| {
                Path::new(p)
                    .strip_prefix(d.path())
                    .unwrap()
                    .to_string_lossy()
                    .to_string()
            })
            .collect();
        assert_eq!(
            rel,
            vec!["inner", "inner/deeper", "inner/deeper/f.txt", "inner/late.txt"]
        );
    }

    #[test]
    fn a_symlink_is_stated_with_its_resolved_target() {
        let d = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(d.path()).unwrap();
        std::fs::create_dir_all(root.join("data/sub")).unwrap();
        std::fs::write(root.join("data/t.txt"), b"hi").unwrap();
        std::fs::set_permissions(root.join("data/t.txt"), std::fs::Permissions::from_mode(0o640)).unwrap();
        std::fs::create_dir(root.join("ln")).unwrap();
        std::os::unix::fs::symlink("../data/t.txt", root.join("ln/rel")).unwrap();
        std::os::unix::fs::symlink("rel", root.join("ln/chain")).unwrap();
        std::os::unix::fs::symlink(root.join("data/sub"), root.join("ln/dir")).unwrap();
        std::os::unix::fs::symlink("nowhere", root.join("ln/dangling")).unwrap();
        let rel = stat(&root.join("ln/rel")).unwrap();
        assert_eq!(rel.kind, FileKind::Symlink);
        assert_eq!(rel.symlink_target.as_deref(), Some("../data/t.txt"));
        let want = root.join("data/t.txt").to_string_lossy().to_string();
        assert_eq!(rel.symlink_resolved.as_deref(), Some(want.as_str()));
        assert_eq!(
            rel.link_target,
            Some(LinkTarget {
                kind: FileKind::File,
                mode: 0o640
            })
        );
        let chain = stat(&root.join("ln/chain")).unwrap();
        assert_eq!(chain.symlink_resolved.as_deref(), Some(want.as_str()));
        let dir = stat(&root.join("ln/dir")).unwrap();
        assert_eq!(dir.link_target.map(|t| t.kind), Some(FileKind::Dir));
        let dangling = stat(&root.join("ln/dangling")).unwrap();
        assert_eq!((dangling.symlink_resolved, dangling.link_target), (None, None));
        let plain = stat(&root.join("data/t.txt")).unwrap();
        assert_eq!(
            (plain.symlink_target, plain.symlink_resolved, plain.link_target),
            (None, None, None)
        );
    }

    #[test]
    fn metadata_is_replaced_and_read_back_from_xattrs() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, b"x").unwrap();
        let f = std::fs::File::open(&p).unwrap();
        let first: std::collections::BTreeMap<String, String> =
            [("a".to_string(), "1".to_string()), ("b".to_string(), "2".to_string())].into();
        write_metadata(&f, "f", &first).unwrap();
        if read_metadata(&p).is_empty() {
            // The test's filesystem keeps no user xattrs (the guest's ext4 does): nothing to see.
            eprintln!("no user xattrs on {}; skipped", d.path().display());
            return;
        }
        assert_eq!(read_metadata(&p), first);
        // Another xattr outside the namespace is neither read nor removed.
        let name = std::ffi::CString::new("user.other").unwrap();
        let cpath = std::ffi::CString::new(p.to_string_lossy().as_bytes()).unwrap();
        assert_eq!(
            unsafe { libc::setxattr(cpath.as_ptr(), name.as_ptr(), b"o".as_ptr().cast(), 1, 0) },
            0
        );
        let second: std::collections::BTreeMap<String, String> = [("b".to_string(), "3".to_string())].into();
        write_metadata(&f, "f", &second).unwrap();
        assert_eq!(read_metadata(&p), second);
        assert_eq!(stat(&p).unwrap().metadata, second);
        assert_eq!(
            unsafe { libc::getxattr(cpath.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) },
            1
        );
    }

    #[test]
    fn list_respects_depth() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("a/b/c")).unwrap();
        std::fs::write(d.path().join("a/f"), b"x").unwrap();
        let one = list(d.path(), 1).unwrap();
        assert_eq!(one.len(), 1);
        let two: Vec<_> = list(d.path(), 2).unwrap().into_iter().map(|s| s.name).collect();
        assert_eq!(two, vec!["a", "b", "f"]);
        assert_eq!(list(d.path(), 9).unwrap().len(), 4);
        assert!(list(d.path(), 0).is_err());
        assert!(list(&d.path().join("a/f"), 1).is_err());
    }

    #[test]
    fn mkdir_reports_whether_it_created() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x/y");
        assert!(mkdir_all(&p, None).unwrap());
        assert!(!mkdir_all(&p, None).unwrap());
        std::fs::write(d.path().join("file"), b"").unwrap();
        assert!(mkdir_all(&d.path().join("file"), None).is_err());
    }
}
