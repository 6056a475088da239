//! The jail every VMM process runs in.
//!
//! A guest that breaks out into its VMM should find as little as possible there. The VMM's
//! child process, between fork and exec (async-signal-safe steps only, all prepared by the
//! parent):
//! - joins the VM's own cgroups: memory = the VM's memory + [`VMM_OVERHEAD_MIB`], a pids
//!   limit, a CPU weight by vcpu (cgroup v2, or the v1 `memory`, `pids` and `cpu` hierarchies);
//! - writes its pid to the sandbox dir ([`PID_FILE`]), so a crash of the server between spawn
//!   and the VM record still leaves the VM findable, and stopped, at the next start;
//! - keeps only the fds it was handed, renumbered from 3; every other fd is closed;
//! - as root: enters a private mount namespace in which every mount is read-only (the VMM
//!   writes only through the fds it was handed: its disk overlay and console log), and drops to
//!   a uid and gid of its own, one per VM, from a range no account uses
//!   ([`JailConfig::uid_base`]), with no supplementary group but the accelerator device's;
//! - as root, in the same `unshare`: a network namespace of its own, empty but for a loopback
//!   that stays down, so a guest that breaks out into its VMM reaches no address at all (not the
//!   host's loopback services, the metadata address or the LAN; nor does it skip the sandbox's
//!   egress rules). The VMM needs no network of its own: its NIC's tap was opened in the
//!   sandbox's namespace and is handed over as an fd, the agent's channel and QMP are unix
//!   sockets bound by path (path sockets are not per namespace; abstract ones are, and QEMU uses
//!   none), and everything else (snapshot state, port tunnels) goes through fds or the agent's
//!   channel. Also IPC (SysV IPC, POSIX queues), UTS (host name) and cgroup (its cgroup is the
//!   root it sees) namespaces of its own: they cost well under a millisecond a spawn.
//!   Not a PID namespace: `unshare(CLONE_NEWPID)` moves only the caller's later children (QEMU
//!   may not fork under its seccomp filter, so that would change nothing), and a real one takes
//!   a second fork: QEMU would be a grandchild the server cannot reap and whose pid `spawn` does
//!   not return, and PID 1 of its namespace, which drops signals it has no handler for. What it
//!   would add is hiding other processes' `/proc` entries; its uid already keeps them out of
//!   reach (no signal, no ptrace);
//! - sets `no_new_privs` and leans toward the OOM killer (a host out of memory loses a VM, not
//!   the server).
//!
//! QEMU then adds its own seccomp filter (`-sandbox`, see `qemu.rs`).
//!
//! What still runs as root: the server (it creates cgroups, opens the files a VMM is handed,
//! and makes the sandboxes' network namespaces), and `qemu-img` creating an overlay (it runs on
//! files the server made, never on guest data).

use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use thiserror::Error;

/// Memory a VMM needs beyond its guest's RAM: its own heap, device state, and under TCG the
/// translated-code cache (bounded to [`TCG_TB_MIB`] so this stays true).
pub const VMM_OVERHEAD_MIB: u64 = 320;
/// TCG's translation cache, in MiB (QEMU's default is up to 1 GiB, more than the overhead the
/// VM's cgroup allows for).
pub const TCG_TB_MIB: u64 = 128;
/// Threads a VMM may have beyond one per vcpu (QEMU: main loop, RCU, I/O worker pool of up to 64).
pub const VMM_EXTRA_PIDS: u32 = 128;
/// The file in the sandbox dir where the VMM's child writes its own pid before exec.
pub const PID_FILE: &str = "vmm.pid";
/// Most fds a VMM may be handed.
const MAX_PASSED_FDS: usize = 16;

/// Why a VMM's jail could not be set up (its configuration, uid, cgroups, fds or the spawn).
#[derive(Debug, Error)]
pub enum JailError {
    /// An `AIRLOCK_VMM_UID_*` / `AIRLOCK_CGROUP_ROOT` setting that cannot be used.
    #[error("{0}")]
    Config(String),
    #[error("every uid of {base}+{count} runs a VMM; raise AIRLOCK_VMM_UID_COUNT")]
    NoFreeUid { base: u32, count: u32 },
    #[error("cgroup {what} {}: {source}; run airlock as root, or delegate {} to its user", path.display(), delegate.display())]
    Cgroup {
        what: &'static str,
        path: PathBuf,
        delegate: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a VMM is handed at most {MAX_PASSED_FDS} fds")]
    TooManyFds,
    #[error("the VMM driver has no jailer; open it through Runtime")]
    NoJailer,
    #[error("starting {} in its jail: {source}", binary.display())]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

type Result<T, E = JailError> = std::result::Result<T, E>;

#[derive(Debug, Clone)]
pub struct JailConfig {
    /// First uid (and gid) of the range VMMs run as: one per running VM.
    pub uid_base: u32,
    pub uid_count: u32,
    /// Name of airlock's cgroup under the hierarchy's root (per data dir below it).
    pub cgroup_root: String,
}

impl Default for JailConfig {
    fn default() -> Self {
        Self {
            // Above the usual subordinate-id ranges (100000..165535) and systemd's dynamic users.
            uid_base: 2_000_000,
            uid_count: 1 << 16,
            cgroup_root: "airlock".into(),
        }
    }
}

impl JailConfig {
    /// The defaults, with `AIRLOCK_VMM_UID_BASE` / `AIRLOCK_VMM_UID_COUNT` /
    /// `AIRLOCK_CGROUP_ROOT` applied.
    pub fn from_env() -> Result<Self> {
        let mut c = Self::default();
        let num = |name: &str| -> Result<Option<u32>> {
            match std::env::var(name) {
                Ok(v) => v
                    .parse()
                    .map(Some)
                    .map_err(|_| JailError::Config(format!("{name}={v:?} is not a number; unset it or give a uid"))),
                Err(_) => Ok(None),
            }
        };
        if let Some(b) = num("AIRLOCK_VMM_UID_BASE")? {
            c.uid_base = b;
        }
        if let Some(n) = num("AIRLOCK_VMM_UID_COUNT")? {
            c.uid_count = n;
        }
        if c.uid_base == 0 || c.uid_count == 0 || c.uid_base.checked_add(c.uid_count).is_none() {
            return Err(JailError::Config(format!(
                "the VMM uid range {}+{} is empty, includes root or overflows",
                c.uid_base, c.uid_count
            )));
        }
        if let Ok(r) = std::env::var("AIRLOCK_CGROUP_ROOT") {
            if r.is_empty() || r.contains('/') || r.starts_with('.') {
                return Err(JailError::Config(format!(
                    "AIRLOCK_CGROUP_ROOT={r:?} must be one directory name"
                )));
            }
            c.cgroup_root = r;
        }
        Ok(c)
    }
}

/// Which cgroup interface the host has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

impl std::fmt::Display for CgroupVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        })
    }
}

const CGROUP_FS: &str = "/sys/fs/cgroup";
const V1_CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];

/// What a VM may use, enforced by its cgroup.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub memory_mib: u64,
    pub vcpu: u32,
}

impl Limits {
    pub fn memory_bytes(&self) -> u64 {
        (self.memory_mib + VMM_OVERHEAD_MIB) << 20
    }
    pub fn pids(&self) -> u32 {
        self.vcpu + VMM_EXTRA_PIDS
    }
}

/// The isolation VMs get on this host, as `airlock doctor` shows it.
#[derive(Debug, Clone)]
pub struct Isolation {
    /// The uid range VMMs run as, or why they run as the server's user.
    pub user: String,
    pub filesystem: String,
    pub cgroups: String,
    /// The namespaces a VMM gets of its own.
    pub namespaces: String,
}

/// Makes jails for one data dir's VMs.
#[derive(Debug)]
pub struct Jailer {
    config: JailConfig,
    /// Per data dir below the cgroup root, so two servers on one host never sweep each other's.
    tag: String,
    cgroups: Option<CgroupVersion>,
    privileged: bool,
    read_only_mounts: bool,
    /// `CLONE_NEW*` flags of the namespaces a VMM enters (with the mount namespace), those of
    /// [`NAMESPACES`] the kernel has.
    namespaces: libc::c_int,
}

/// The namespaces a VMM gets beyond its mount namespace: flag and name in `/proc/<pid>/ns`.
const NAMESPACES: [(libc::c_int, &str); 4] = [
    (libc::CLONE_NEWNET, "net"),
    (libc::CLONE_NEWIPC, "ipc"),
    (libc::CLONE_NEWUTS, "uts"),
    (libc::CLONE_NEWCGROUP, "cgroup"),
];

/// Uids chosen but whose VMM may not show in /proc under them yet (between fork and setuid).
static RESERVED_UIDS: Mutex<Option<HashSet<u32>>> = Mutex::new(None);

impl Jailer {
    pub fn new(config: JailConfig, data_dir: &Path) -> Self {
        let tag = hex::encode(&Sha256::digest(data_dir.as_os_str().as_bytes())[..6]);
        let privileged = unsafe { libc::geteuid() } == 0;
        let cgroups = if Path::new(CGROUP_FS).join("cgroup.controllers").exists() {
            Some(CgroupVersion::V2)
        } else if Path::new(CGROUP_FS).join("memory").is_dir() {
            Some(CgroupVersion::V1)
        } else {
            None
        };
        // A kernel lists in /proc/self/ns exactly the namespace types it was built with.
        let namespaces = NAMESPACES
            .iter()
            .filter(|(_, name)| Path::new("/proc/self/ns").join(name).exists())
            .fold(0, |flags, (flag, _)| flags | flag);
        Self {
            config,
            tag,
            cgroups,
            privileged,
            read_only_mounts: privileged && mount_setattr_available(),
            namespaces: if privileged { namespaces } else { 0 },
        }
    }

    pub fn isolation(&self) -> Isolation {
        let user = if self.privileged {
            format!(
                "one uid per VM from {}..{} (no account, no groups)",
                self.config.uid_base,
                self.config.uid_base as u64 + self.config.uid_count as u64
            )
        } else {
            format!("the server's own uid {} (not root: no uid switch)", unsafe {
                libc::geteuid()
            })
        };
        let filesystem = match (self.privileged, self.read_only_mounts) {
            (true, true) => "private mount namespace, every mount read-only; writes only through the handed fds".into(),
            (true, false) => "no read-only mounts (the kernel lacks mount_setattr, Linux < 5.12)".into(),
            (false, _) => "the server's view (not root: no mount namespace)".into(),
        };
        let cgroups = match self.cgroups {
            Some(v) => format!(
                "{v}, one per VM under {}: memory = VM memory + {VMM_OVERHEAD_MIB} MiB, pids = vcpu + {VMM_EXTRA_PIDS}, CPU weight by vcpu",
                self.cgroup_parent(v, V1_CONTROLLERS[0]).display()
            ),
            None => "none found under /sys/fs/cgroup: VMs run without per-VM limits".into(),
        };
        let namespaces = if self.privileged {
            let named = |has: bool| {
                NAMESPACES
                    .iter()
                    .filter(|(flag, _)| (self.namespaces & flag != 0) == has)
                    .map(|(_, name)| *name)
                    .collect::<Vec<_>>()
            };
            let mut s = format!("mnt, {} of its own", named(true).join(", "));
            if self.namespaces & libc::CLONE_NEWNET != 0 {
                s.push_str(" (net: only a loopback, down; the NIC's tap is handed as an fd)");
            }
            let missing = named(false);
            if !missing.is_empty() {
                s.push_str(&format!("; the kernel lacks {}", missing.join(", ")));
            }
            s.push_str("; the host's pid namespace (its uid reaches no other process)");
            s
        } else {
            "the server's (not root: no namespaces)".into()
        };
        Isolation {
            user,
            filesystem,
            cgroups,
            namespaces,
        }
    }

    /// Where this data dir's VM cgroups live (for v1: in `controller`'s hierarchy).
    fn cgroup_parent(&self, version: CgroupVersion, controller: &str) -> PathBuf {
        let base = Path::new(CGROUP_FS);
        let base = match version {
            CgroupVersion::V2 => base.to_path_buf(),
            CgroupVersion::V1 => base.join(controller),
        };
        base.join(&self.config.cgroup_root).join(&self.tag)
    }

    fn cgroup_dirs(&self, id: &str) -> Vec<PathBuf> {
        match self.cgroups {
            Some(CgroupVersion::V2) => vec![self.cgroup_parent(CgroupVersion::V2, "").join(id)],
            Some(CgroupVersion::V1) => V1_CONTROLLERS
                .iter()
                .map(|c| self.cgroup_parent(CgroupVersion::V1, c).join(id))
                .collect(),
            None => vec![],
        }
    }

    /// Everything a VM's jail needs before its VMM is spawned: its cgroups (made, with their
    /// limits), its uid (reserved until [`Prepared::apply`]'s spawn is over).
    pub fn prepare(&self, id: &str, dir: &Path, limits: Limits, device_groups: Vec<u32>) -> Result<Prepared> {
        let cgroup_procs = self.make_cgroups(id, limits)?;
        let uid = if self.privileged {
            Some(self.reserve_uid()?)
        } else {
            None
        };
        let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).expect("no NUL in paths");
        Ok(Prepared {
            uid,
            groups: device_groups,
            cgroup_procs: cgroup_procs.iter().map(|p| c(p)).collect(),
            pid_file: c(&dir.join(PID_FILE)),
            read_only_mounts: self.read_only_mounts,
            namespaces: self.namespaces,
            die_with_parent: false,
            fds: Vec::new(),
        })
    }

    fn make_cgroups(&self, id: &str, limits: Limits) -> Result<Vec<PathBuf>> {
        let Some(version) = self.cgroups else {
            return Ok(vec![]);
        };
        let fail = |what: &'static str, path: &Path, source: std::io::Error| JailError::Cgroup {
            what,
            path: path.to_path_buf(),
            delegate: Path::new(CGROUP_FS).join(&self.config.cgroup_root),
            source,
        };
        let write = |path: PathBuf, value: String| -> Result<()> {
            std::fs::write(&path, value).map_err(|e| fail("write", &path, e))
        };
        let made = |dir: &Path| std::fs::create_dir_all(dir).map_err(|e| fail("mkdir", dir, e));
        let mut procs = Vec::new();
        match version {
            CgroupVersion::V2 => {
                // Controllers must be enabled on every level above the VM's cgroup (the root,
                // airlock's, the data dir's); the levels airlock makes hold no process, so this
                // is allowed.
                let parent = self.cgroup_parent(version, "");
                made(&parent)?;
                let root = Path::new(CGROUP_FS);
                for level in [root, &root.join(&self.config.cgroup_root), &parent] {
                    for ctl in ["+memory", "+pids", "+cpu"] {
                        let _ = std::fs::write(level.join("cgroup.subtree_control"), ctl);
                    }
                }
                let dir = parent.join(id);
                made(&dir)?;
                write(dir.join("memory.max"), limits.memory_bytes().to_string())?;
                // Guest memory never goes to swap behind the limit (absent without swap).
                let _ = std::fs::write(dir.join("memory.swap.max"), "0");
                write(dir.join("pids.max"), limits.pids().to_string())?;
                write(dir.join("cpu.weight"), (100 * limits.vcpu).clamp(1, 10_000).to_string())?;
                procs.push(dir.join("cgroup.procs"));
            }
            CgroupVersion::V1 => {
                for ctl in V1_CONTROLLERS {
                    let dir = self.cgroup_parent(version, ctl).join(id);
                    made(&dir)?;
                    match ctl {
                        "memory" => {
                            write(dir.join("memory.limit_in_bytes"), limits.memory_bytes().to_string())?;
                            // With swap accounting, memory + swap gets the same limit: no swap.
                            let _ = std::fs::write(
                                dir.join("memory.memsw.limit_in_bytes"),
                                limits.memory_bytes().to_string(),
                            );
                        }
                        "pids" => write(dir.join("pids.max"), limits.pids().to_string())?,
                        _ => write(dir.join("cpu.shares"), (1024 * limits.vcpu as u64).to_string())?,
                    }
                    procs.push(dir.join("cgroup.procs"));
                }
            }
        }
        Ok(procs)
    }

    /// A uid of the range that no process runs as and no concurrent start has chosen.
    fn reserve_uid(&self) -> Result<u32> {
        let in_use: HashSet<u32> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().as_bytes().iter().all(u8::is_ascii_digit))
            .filter_map(|e| std::os::unix::fs::MetadataExt::uid(&e.metadata().ok()?).into())
            .collect();
        let mut reserved = RESERVED_UIDS.lock().unwrap();
        let reserved = reserved.get_or_insert_with(HashSet::new);
        // A random start, so two servers on one host rarely race for the same uid.
        let start = u32::from_str_radix(&crate::random::random_hex(4), 16).unwrap_or(0) % self.config.uid_count;
        for i in 0..self.config.uid_count {
            let uid = self.config.uid_base + (start + i) % self.config.uid_count;
            if !in_use.contains(&uid) && reserved.insert(uid) {
                return Ok(uid);
            }
        }
        Err(JailError::NoFreeUid {
            base: self.config.uid_base,
            count: self.config.uid_count,
        })
    }

    /// Remove a VM's cgroups once its VMM is gone (a cgroup with a live process stays).
    pub fn release(&self, id: &str) {
        for dir in self.cgroup_dirs(id) {
            remove_cgroup(&dir);
        }
    }

    /// Remove this data dir's cgroups whose VM is not in `live` (left by a crash).
    pub fn sweep(&self, live: &HashSet<String>) {
        let Some(version) = self.cgroups else { return };
        let parents: Vec<PathBuf> = match version {
            CgroupVersion::V2 => vec![self.cgroup_parent(version, "")],
            CgroupVersion::V1 => V1_CONTROLLERS.iter().map(|c| self.cgroup_parent(version, c)).collect(),
        };
        for parent in parents {
            for entry in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if entry.path().is_dir() && !live.contains(&name) {
                    remove_cgroup(&entry.path());
                }
            }
        }
    }
}

/// rmdir a cgroup, waiting briefly for an exiting process to leave it.
fn remove_cgroup(dir: &Path) {
    for _ in 0..20 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(50)),
        }
    }
    tracing::warn!("cgroup {} still has processes; left in place", dir.display());
}

/// Whether the kernel has `mount_setattr` (Linux 5.12): probed with flags it must refuse.
fn mount_setattr_available() -> bool {
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            -1,
            c"".as_ptr(),
            u32::MAX,
            std::ptr::null::<u8>(),
            0usize,
        )
    };
    !(r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS))
}

/// One VM's jail, ready to be applied to its VMM's command.
pub struct Prepared {
    uid: Option<u32>,
    groups: Vec<u32>,
    cgroup_procs: Vec<CString>,
    pid_file: CString,
    read_only_mounts: bool,
    namespaces: libc::c_int,
    /// Killed when the thread that spawned it ends (a builder must not outlive its server).
    die_with_parent: bool,
    fds: Vec<OwnedFd>,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("uid", &self.uid)
            .field("fds", &self.fds.len())
            .finish()
    }
}

impl Prepared {
    /// The uid the VMM will run as (None: the server's own).
    pub fn uid(&self) -> Option<u32> {
        self.uid
    }

    /// Leave the mounts writable in this VMM's namespace. Only for a base snapshot's builder:
    /// QEMU maps guest RAM from a file it opens by path (`/proc/self/fd/N`, which reopens), and a
    /// shared, writable mapping needs a writable mount. That VM runs the platform's own template
    /// and is never handed to a tenant; its uid still owns nothing but that file.
    pub fn with_writable_mounts(self) -> Self {
        Self {
            read_only_mounts: false,
            ..self
        }
    }

    /// Have the VMM killed when the server goes (`PR_SET_PDEATHSIG`; spawned from a runtime
    /// worker thread, which lives as long as the server). Only for a base snapshot's builder:
    /// a sandbox's VM outlives the server by design; a build would only be thrown away.
    pub fn dying_with_parent(self) -> Self {
        Self {
            die_with_parent: true,
            ..self
        }
    }

    /// Hand `fd` to the VMM; returns the number it has there.
    pub fn pass(&mut self, fd: OwnedFd) -> Result<RawFd> {
        if self.fds.len() == MAX_PASSED_FDS {
            return Err(JailError::TooManyFds);
        }
        self.fds.push(fd);
        Ok(2 + self.fds.len() as RawFd)
    }

    /// Spawn `cmd` in the jail. Its stdin/stdout/stderr are the command's own.
    pub fn spawn(self, mut cmd: std::process::Command) -> std::io::Result<std::process::Child> {
        let Prepared {
            uid,
            groups,
            cgroup_procs,
            pid_file,
            read_only_mounts,
            namespaces,
            die_with_parent,
            fds,
        } = self;
        let parent = std::process::id() as libc::pid_t;
        let sources: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let groups: Vec<libc::gid_t> = groups;
        // SAFETY: the hook only makes async-signal-safe calls on data prepared above.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                child_setup(
                    &sources,
                    uid,
                    &groups,
                    &cgroup_procs,
                    &pid_file,
                    read_only_mounts,
                    namespaces,
                )?;
                if die_with_parent {
                    // After the uid change, which would clear it; then the parent may already be gone.
                    check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) as libc::c_long)?;
                    if libc::getppid() != parent {
                        libc::_exit(1);
                    }
                }
                Ok(())
            });
        }
        let child = cmd.spawn();
        drop(fds);
        if let Some(uid) = uid {
            if let Some(set) = RESERVED_UIDS.lock().unwrap().as_mut() {
                set.remove(&uid);
            }
        }
        child
    }
}

fn check(r: libc::c_long) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Write `n` and a newline to the file at `path` (no allocation: this runs after fork).
fn write_number(path: &std::ffi::CStr, n: u32, flags: libc::c_int) -> std::io::Result<()> {
    let mut buf = [0u8; 12];
    let mut i = buf.len() - 1;
    buf[i] = b'\n';
    let mut v = n;
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    unsafe {
        let fd = libc::open(path.as_ptr(), flags | libc::O_WRONLY | libc::O_CLOEXEC, 0o600);
        check(fd as libc::c_long)?;
        let w = libc::write(fd, buf[i..].as_ptr().cast(), buf.len() - i);
        libc::close(fd);
        check(w as libc::c_long)
    }
}

/// Between fork and exec, in the child. See the module doc for the order and why.
fn child_setup(
    sources: &[RawFd],
    uid: Option<u32>,
    groups: &[libc::gid_t],
    cgroup_procs: &[CString],
    pid_file: &CString,
    read_only_mounts: bool,
    namespaces: libc::c_int,
) -> std::io::Result<()> {
    unsafe {
        // Own session: the VM outlives the server (a restarted one re-attaches to it).
        check(libc::setsid() as libc::c_long)?;
        let pid = libc::getpid() as u32;
        for procs in cgroup_procs {
            write_number(procs, pid, 0)?;
        }
        write_number(pid_file, pid, libc::O_CREAT | libc::O_TRUNC)?;
        let _ = write_number(c"/proc/self/oom_score_adj", 500, 0);

        // The handed fds become 3, 4, ...: first copied above every number involved, then
        // into place (dup2 clears close-on-exec), then everything above them is closed.
        let n = sources.len();
        let high = sources.iter().copied().max().unwrap_or(0).max(2 + n as RawFd) + 1;
        let mut copies = [0 as RawFd; MAX_PASSED_FDS];
        for (i, &fd) in sources.iter().enumerate() {
            copies[i] = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, high);
            check(copies[i] as libc::c_long)?;
        }
        for (i, &copy) in copies[..n].iter().enumerate() {
            check(libc::dup2(copy, 3 + i as RawFd) as libc::c_long)?;
        }
        let first_closed = 3 + n as libc::c_uint;
        if libc::syscall(libc::SYS_close_range, first_closed, libc::c_uint::MAX, 0) < 0 {
            let max = libc::sysconf(libc::_SC_OPEN_MAX).clamp(1024, 1 << 20) as libc::c_int;
            for fd in first_closed as libc::c_int..max {
                libc::close(fd);
            }
        }

        if let Some(uid) = uid {
            // After joining its cgroups: the cgroup namespace's root is the VM's own cgroup.
            check(libc::unshare(libc::CLONE_NEWNS | namespaces) as libc::c_long)?;
            check(libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) as libc::c_long)?;
            if read_only_mounts {
                // struct mount_attr { attr_set, attr_clr, propagation, userns_fd }
                const MOUNT_ATTR_RDONLY: u64 = 0x1;
                const MOUNT_ATTR_NOSUID: u64 = 0x2;
                const AT_RECURSIVE: libc::c_uint = 0x8000;
                let attr: [u64; 4] = [MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0];
                check(libc::syscall(
                    libc::SYS_mount_setattr,
                    libc::AT_FDCWD,
                    c"/".as_ptr(),
                    AT_RECURSIVE,
                    attr.as_ptr(),
                    std::mem::size_of_val(&attr),
                ))?;
            }
            check(libc::setgroups(groups.len(), groups.as_ptr()) as libc::c_long)?;
            check(libc::setgid(uid) as libc::c_long)?;
            check(libc::setuid(uid) as libc::c_long)?;
        }
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) as libc::c_long)?;
    }
    Ok(())
}
