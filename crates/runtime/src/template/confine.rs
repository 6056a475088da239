//! An image's layers unpacked, and its ext4 image written, by a process that cannot reach the
//! host: depth under crates/unpack's tree, so that a slip in the unpacking (ours, tar's, mke2fs's) lands in
//! the staging dir and nowhere else.
//!
//! The server runs itself again (`/proc/self/exe` [`UNPACK_ARG`], as runc runs `runc init`);
//! that process, still single-threaded:
//! - enters new user, mount, pid, network, IPC and UTS namespaces; the server maps its uids and
//!   gids 0..65536 to an unused host range ([`UNPACK_UID_BASE`]), so the image's root is a host
//!   uid owning nothing but the staging dir (chowned to it first); no host file's owner is mapped,
//!   so no capability it holds applies to one;
//! - forks the pid namespace's init (which ends every process left in the namespace when it
//!   exits), and that one builds a root of its own: a tmpfs with the host's `/usr` read-only (for
//!   mke2fs and du), `/etc/mke2fs.conf` and `/etc/ld.so.cache`, `/dev/null`, `zero`, `random` and
//!   `urandom`, and the staging dir at `/stage`, all nosuid (and but for those four, nodev);
//!   pivots into it and detaches the host's;
//! - sets `no_new_privs`, drops every capability but the file-owner ones (chown, fowner, fsetid,
//!   DAC override) from its bounding set, is not dumpable;
//! - applies the layers (`unpack.rs`), adds airlock's files, runs `mkfs.ext4 -d` (inside the
//!   namespace it sees the image's own uids) and answers one line of JSON.
//!
//! The server bounds what it reads of the answer and the time the whole takes, then takes the
//! image back: one regular file, opened with `O_NOFOLLOW`, owned by root again.

use super::command::{dir_bytes, run as run_command};
use airlock_unpack::{apply_layer, prepare_root, Budget, Meta, Tree, TreeError, UnpackError};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The first argument that makes `airlock` the confined unpacker (see [`child_main`]).
pub const UNPACK_ARG: &str = "__airlock-unpack-image";
/// The host uid (and gid) the image's uid 0 is; its uids 0..[`UNPACK_UIDS`] follow. A range no
/// account uses, above the VMMs' (`jail.rs`, 2,000,000 + 65,536); `AIRLOCK_UNPACK_UID_BASE`
/// moves it.
pub const UNPACK_UID_BASE: u32 = 3_000_000;
/// How many uids an image may use (0..65535, as a container runtime's default map).
pub const UNPACK_UIDS: u32 = 65_536;
/// The whole of an unpacking, 24 GiB at worst, ends by then.
const DEADLINE: Duration = Duration::from_secs(3600);
/// The most of the child's answer and of its stderr the server reads.
const MAX_ANSWER: u64 = 64 << 10;

/// What the child is asked: in the staging dir, `layers/<file>` each, the agent at `agent`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Job {
    pub layers: Vec<JobLayer>,
    pub budget_bytes: u64,
    pub budget_entries: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct JobLayer {
    pub file: String,
    pub gzip: bool,
    pub digest: String,
}

/// The child's answer.
#[derive(Debug, Serialize, Deserialize)]
pub enum Answer {
    /// `rootfs/` filled, `out/rootfs.ext4` written.
    Done,
    /// Layer `layer` (a digest, or airlock's own files) refused.
    Refused { layer: String, reason: String },
    /// Over the unpacked byte limit.
    TooLarge { limit: u64 },
    /// mke2fs or du failed: their message.
    Failed { what: String, reason: String },
}

/// Why the confined unpacking gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("the confined unpacker: {0}")]
    Io(#[from] std::io::Error),
    #[error("the confined unpacker gave no answer ({status}): {stderr}")]
    NoAnswer { status: String, stderr: String },
    #[error("the confined unpacker took longer than {} s", DEADLINE.as_secs())]
    Timeout,
    #[error("the confined unpacker left {0} as something other than a regular file")]
    BadOutput(PathBuf),
}

fn uid_base() -> u32 {
    std::env::var("AIRLOCK_UNPACK_UID_BASE")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|b: &u32| *b > 0 && b.checked_add(UNPACK_UIDS).is_some())
        .unwrap_or(UNPACK_UID_BASE)
}

/// Whether this process can confine an unpacking: root (it maps the uids and chowns the
/// staging dir) and running the `airlock` binary (the re-exec).
pub fn available() -> bool {
    let root = unsafe { libc::geteuid() } == 0;
    root && std::env::current_exe()
        .ok()
        .and_then(|p| p.file_name().map(|f| f.to_string_lossy().starts_with("airlock")))
        .unwrap_or(false)
}

/// Run `job` in `stage` (which holds `layers/`, `agent`; gets `rootfs/`, `out/rootfs.ext4`) in
/// the confined child; afterwards `out` and its image are root's again.
pub fn run(stage: &Path, job: &Job) -> Result<Answer, ConfineError> {
    let base = uid_base();
    std::fs::create_dir_all(stage.join(".root"))?;
    chown_tree(stage, base)?;
    let mut child = std::process::Command::new("/proc/self/exe")
        .arg(UNPACK_ARG)
        .arg(stage)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin")
        .current_dir("/")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let mut stdout = child.stdout.take().expect("piped");
    let stderr = child.stderr.take().expect("piped");
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.take(MAX_ANSWER).read_to_string(&mut s);
        s
    });
    let answer = (|| -> Result<Vec<u8>, ConfineError> {
        // It has unshared: its uids are mapped, then it is told the job (which lets it go on).
        let mut ready = [0u8; 1];
        stdout.read_exact(&mut ready)?;
        let map = format!("0 {base} {UNPACK_UIDS}\n");
        std::fs::write(format!("/proc/{pid}/uid_map"), &map)?;
        std::fs::write(format!("/proc/{pid}/gid_map"), &map)?;
        let mut stdin = child.stdin.take().expect("piped");
        stdin.write_all(&serde_json::to_vec(job).expect("serializable"))?;
        drop(stdin);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let r = stdout.take(MAX_ANSWER).read_to_end(&mut buf).map(|_| buf);
            let _ = tx.send(r);
        });
        match rx.recv_timeout(DEADLINE) {
            Ok(r) => Ok(r?),
            Err(_) => Err(ConfineError::Timeout),
        }
    })();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        match child.try_wait()? {
            Some(s) => break s,
            None if answer.is_err() || Instant::now() > deadline => {
                // Our own child, by its pid; its namespace's processes end with its init.
                let _ = child.kill();
                break child.wait()?;
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let stderr = err_reader.join().unwrap_or_default();
    let answer = answer?;
    let answer: Answer = serde_json::from_slice(&answer).map_err(|_| ConfineError::NoAnswer {
        status: status.to_string(),
        stderr: stderr.trim().chars().take(2000).collect(),
    })?;
    if matches!(answer, Answer::Done) {
        take_back(stage, super::store::ROOTFS_FILE)?;
    }
    Ok(answer)
}

/// The staging dir and what the server put in it, the image's root's (`base`).
fn chown_tree(stage: &Path, base: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::os::unix::fs::lchown(stage, Some(base), Some(base))?;
    std::fs::set_permissions(stage, std::fs::Permissions::from_mode(0o700))?;
    for entry in std::fs::read_dir(stage)? {
        let p = entry?.path();
        std::os::unix::fs::lchown(&p, Some(base), Some(base))?;
        if std::fs::symlink_metadata(&p)?.is_dir() {
            for inner in std::fs::read_dir(&p)? {
                std::os::unix::fs::lchown(inner?.path(), Some(base), Some(base))?;
            }
        }
    }
    Ok(())
}

/// `stage/out/name` made the server's again, by fd with nothing followed (the child owned the
/// staging dir and may have left links anywhere in it; it and its namespace have ended): `out`
/// a real directory holding only that regular file, with one link, both root's again.
fn take_back(stage: &Path, name: &str) -> Result<(), ConfineError> {
    use std::os::unix::fs::PermissionsExt;
    let bad = || ConfineError::BadOutput(stage.join("out").join(name));
    let tree = |e: TreeError| ConfineError::Io(std::io::Error::other(e.to_string()));
    let out = Tree::from_fd(
        Tree::open(stage)
            .map_err(tree)?
            .dir(Path::new("out"))
            .map_err(|_| bad())?,
    );
    if out.names(Path::new("")).map_err(tree)? != [std::ffi::OsString::from(name)] {
        return Err(bad());
    }
    let f = out.open_file(Path::new(name)).map_err(|_| bad())?;
    let meta = f.metadata()?;
    if !meta.is_file() || meta.nlink() != 1 {
        return Err(bad());
    }
    std::os::unix::fs::fchown(&f, Some(0), Some(0))?;
    f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
    out.stamp_root(Meta {
        uid: 0,
        gid: 0,
        mode: 0o755,
        mtime: 0,
    })
    .map_err(tree)?;
    Ok(())
}

/// `airlock __airlock-unpack-image <stage>`: the child's side (see the module doc). Called by
/// the binary's `main` before anything else runs (no thread may exist yet: `unshare` of a user
/// namespace needs a single-threaded process).
pub fn child_main(stage: &Path) -> i32 {
    match child(stage) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("unpack: {e}");
            2
        }
    }
}

fn child(stage: &Path) -> std::io::Result<i32> {
    use nix::sched::CloneFlags;
    let sys = |e: nix::Error| std::io::Error::from(e);
    // As the host's root still: the data dir is 0700, so the image's root reaches the staging
    // dir only as this working directory (relative paths from here on, until the pivot).
    std::env::set_current_dir(stage)?;
    nix::sched::unshare(
        CloneFlags::CLONE_NEWUSER
            | CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWPID
            | CloneFlags::CLONE_NEWNET
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWUTS,
    )
    .map_err(sys)?;
    let mut out = std::io::stdout().lock();
    out.write_all(b"u")?;
    out.flush()?;
    // The job arrives once the server has mapped our uids.
    let mut job = Vec::new();
    std::io::stdin().take(1 << 20).read_to_end(&mut job)?;
    let job: Job = serde_json::from_slice(&job).map_err(std::io::Error::other)?;
    let zero = nix::unistd::Gid::from_raw(0);
    nix::unistd::setgroups(&[]).map_err(sys)?;
    nix::unistd::setresgid(zero, zero, zero).map_err(sys)?;
    let root = nix::unistd::Uid::from_raw(0);
    nix::unistd::setresuid(root, root, root).map_err(sys)?;
    // SAFETY: single-threaded (nothing has spawned a thread in this process).
    match unsafe { nix::unistd::fork() }.map_err(sys)? {
        nix::unistd::ForkResult::Child => {
            let code = match init(&job) {
                Ok(answer) => {
                    let ok = matches!(answer, Answer::Done);
                    let _ = out.write_all(&serde_json::to_vec(&answer).expect("serializable"));
                    let _ = out.flush();
                    if ok {
                        0
                    } else {
                        1
                    }
                }
                Err(e) => {
                    eprintln!("unpack: {e}");
                    2
                }
            };
            std::process::exit(code);
        }
        nix::unistd::ForkResult::Parent { child } => loop {
            match nix::sys::wait::waitpid(child, None) {
                Ok(nix::sys::wait::WaitStatus::Exited(_, code)) => return Ok(code),
                Ok(nix::sys::wait::WaitStatus::Signaled(..)) => return Ok(3),
                Ok(_) => {}
                Err(nix::Error::EINTR) => {}
                Err(e) => return Err(sys(e)),
            }
        },
    }
}

/// PID 1 of the namespace: its root, its limits, then the work.
fn init(job: &Job) -> std::io::Result<Answer> {
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
    }
    enter_root()?;
    limit_self()?;
    Ok(work(Path::new("/stage"), job))
}

/// A tmpfs root with the host's `/usr` read-only and the staging dir (the working directory)
/// at `/stage`; the host's root detached.
fn enter_root() -> std::io::Result<()> {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    let sys = |e: nix::Error| std::io::Error::from(e);
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none).map_err(sys)?;
    let new = Path::new(".root");
    mount(
        Some("tmpfs"),
        new,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755,size=1m"),
    )
    .map_err(sys)?;
    for d in ["usr", "etc", "stage", "old", "tmp", "dev"] {
        std::fs::create_dir(new.join(d))?;
    }
    // What a spawn and mke2fs open of /dev (a user namespace makes no device node: the host's,
    // bound).
    for n in ["null", "zero", "random", "urandom"] {
        let at = new.join("dev").join(n);
        std::fs::write(&at, b"")?;
        mount(Some(&Path::new("/dev").join(n)), &at, none, MsFlags::MS_BIND, none).map_err(sys)?;
        set_attrs(&at, MOUNT_ATTR_NOSUID, false)?;
    }
    // The loader's paths as the host has them (a merged /usr: links; else read-only binds).
    for d in ["bin", "sbin", "lib", "lib64"] {
        let host = Path::new("/").join(d);
        match std::fs::read_link(&host) {
            Ok(target) => std::os::unix::fs::symlink(target, new.join(d))?,
            Err(_) if host.is_dir() => {
                std::fs::create_dir(new.join(d))?;
                bind(&host, &new.join(d), true)?;
            }
            Err(_) => {}
        }
    }
    bind(Path::new("/usr"), &new.join("usr"), true)?;
    for f in ["mke2fs.conf", "ld.so.cache"] {
        let host = Path::new("/etc").join(f);
        if host.is_file() {
            std::fs::write(new.join("etc").join(f), b"")?;
            bind(&host, &new.join("etc").join(f), true)?;
        }
    }
    // Not recursive: the tmpfs mounted on `.root` inside it stays out.
    mount(Some("."), &new.join("stage"), none, MsFlags::MS_BIND, none).map_err(sys)?;
    set_attrs(&new.join("stage"), MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, false)?;
    std::env::set_current_dir(new)?;
    nix::unistd::pivot_root(".", "old").map_err(sys)?;
    std::env::set_current_dir("/")?;
    umount2("/old", MntFlags::MNT_DETACH).map_err(sys)?;
    std::fs::remove_dir("/old")?;
    Ok(())
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;

fn bind(from: &Path, to: &Path, read_only: bool) -> std::io::Result<()> {
    use nix::mount::{mount, MsFlags};
    let none: Option<&str> = None;
    mount(Some(from), to, none, MsFlags::MS_BIND | MsFlags::MS_REC, none).map_err(std::io::Error::from)?;
    let ro = if read_only { MOUNT_ATTR_RDONLY } else { 0 };
    set_attrs(to, ro | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, true)
}

/// `mount_setattr`: sets only the given attributes (a remount would have to restate the
/// locked ones a user namespace may not clear).
fn set_attrs(at: &Path, set: u64, recursive: bool) -> std::io::Result<()> {
    const AT_RECURSIVE: libc::c_uint = 0x8000;
    let path = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(at.as_os_str()))
        .map_err(std::io::Error::other)?;
    let attr: [u64; 4] = [set, 0, 0, 0];
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            if recursive { AT_RECURSIVE } else { 0 },
            attr.as_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// No new privileges, no core dump or ptrace by its uid's other processes, and of the
/// capabilities only those over files.
fn limit_self() -> std::io::Result<()> {
    const KEEP: [u32; 5] = [
        0, // CAP_CHOWN
        1, // CAP_DAC_OVERRIDE
        2, // CAP_DAC_READ_SEARCH
        3, // CAP_FOWNER
        4, // CAP_FSETID
    ];
    let check = |r: libc::c_int| {
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    unsafe {
        // Every capability the kernel knows (no /proc here to ask which: past the last, EINVAL).
        for cap in 0..64u32 {
            if !KEEP.contains(&cap) && libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINVAL) {
                    return Err(e);
                }
            }
        }
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
        check(libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0))?;
        // The effective and permitted sets too (version 3 header, two 32-bit words).
        let keep: u32 = KEEP.iter().map(|c| 1u32 << c).sum();
        let header: [u32; 2] = [0x2008_0522, 0];
        let data: [u32; 6] = [keep, keep, 0, 0, 0, 0];
        check(libc::syscall(libc::SYS_capset, header.as_ptr(), data.as_ptr()) as libc::c_int)?;
    }
    Ok(())
}

/// Inside: the layers, airlock's files, the image (also what a server that cannot confine it
/// runs itself).
pub fn work(stage: &Path, job: &Job) -> Answer {
    let root = stage.join("rootfs");
    for d in [&root, &stage.join("out")] {
        if let Err(e) = std::fs::create_dir_all(d) {
            return Answer::Failed {
                what: "the staging dir".into(),
                reason: e.to_string(),
            };
        }
    }
    let tree = match Tree::open(&root) {
        Ok(t) => t,
        Err(e) => {
            return Answer::Failed {
                what: "the tree".into(),
                reason: e.to_string(),
            }
        }
    };
    let limit = Budget {
        bytes: job.budget_bytes,
        entries: job.budget_entries,
    };
    let mut budget = limit;
    for l in &job.layers {
        let path = stage.join("layers").join(&l.file);
        let gzip = l.gzip;
        let open = || -> std::io::Result<Box<dyn Read>> {
            let f = std::io::BufReader::new(std::fs::File::open(&path)?);
            Ok(if gzip {
                Box::new(flate2::read::GzDecoder::new(f))
            } else {
                Box::new(f)
            })
        };
        match apply_layer(&tree, open, &mut budget, limit) {
            Ok(()) => {}
            Err(UnpackError::TooManyBytes(limit)) => return Answer::TooLarge { limit },
            Err(e) => {
                return Answer::Refused {
                    layer: l.digest.clone(),
                    reason: e.to_string(),
                }
            }
        }
        let _ = std::fs::remove_file(&path);
    }
    if let Err(e) = prepare_root(&tree, &stage.join("agent")) {
        return Answer::Refused {
            layer: "(airlock's files)".into(),
            reason: e.to_string(),
        };
    }
    match make_image(stage) {
        Ok(()) => Answer::Done,
        Err((what, reason)) => Answer::Failed { what, reason },
    }
}

/// `out/rootfs.ext4` of `rootfs/`: its bytes and a margin (as the platform's templates).
fn make_image(stage: &Path) -> Result<(), (String, String)> {
    let root = stage.join("rootfs");
    let used = dir_bytes(&root).map_err(|e| ("du".to_string(), e.to_string()))?;
    let image_mib = ((used * 13 / 10) >> 20) + 64;
    run_command(
        std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L", "airlock-root", "-m", "0", "-b", "4096", "-d"])
            .arg(&root)
            .arg(stage.join("out").join(super::store::ROOTFS_FILE))
            .arg(format!("{image_mib}M")),
        "mkfs.ext4",
    )
    .map_err(|e| ("mkfs.ext4".to_string(), e.to_string()))?;
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
