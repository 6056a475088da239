//! Test doubles for the VMM and the guest agent (cargo feature `fake`): a sandbox whose "VM" is a
//! cheap host process and whose agent is a tokio task in this process, so the runtime, the
//! server's engine and their crash recovery can be tested in milliseconds, without KVM or QEMU.
//!
//! - The fake VM is `sh -c 'read line; exit 0' airlock-fake-vm <dir>/fake-vm`, started in its own
//!   session like QEMU. Its pid is real: `kill -9`, pidfd exit watching and the pid-reuse guard
//!   of `is_running` (its command line names the sandbox dir) work as with QEMU. Its stdin is a
//!   pipe whose write end this process keeps: closing it is a clean power-off from inside (the
//!   shell exits 0), and when the test process ends, every fake VM it started ends with it.
//! - Pause is recorded on disk (`<dir>/fake-paused`), so a new `FakeVmm` after a simulated
//!   restart sees it; a paused VM's agent does not answer (no READY, no responses, no events)
//!   until it resumes. The process itself is not SIGSTOPped: a stopped process would not see its
//!   stdin close, and would outlive the test process.
//! - The fake agent serves the real protocol (HELLO/READY, then HTTP/2) on `<dir>/agent.sock`
//!   with a scripted process model and an in-memory file system (an upload to `/dev/null` is
//!   counted and dropped, [`uploaded_bytes`]); it never runs host commands.
//!   Agents live in a process-global registry keyed by socket path and run on their own tokio
//!   runtime (one background thread), so they outlive a dropped `Runtime` and even the tokio
//!   runtime of the test that made them (a restarted runtime re-attaches and finds them
//!   answering); an agent stops when its fake VM process exits.
//!
//! Programs the fake agent knows: `echo ARGS..` (prints them, exit 0), `true`, `false`,
//! `sleep SECS|infinity` (until the time passes or a signal ends it), `cat` (stdin to stdout until
//! stdin closes), `sh -c 'exit N'` (exit N), `poweroff` (exit 0, then the VM powers off); anything
//! else exits 127 with `<name>: command not found` on stderr. `timeout_ms` kills with SIGKILL.
//!
//! A fake agent can be switched to misbehave as a hostile guest's own agent would
//! ([`set_hostile`], [`Hostile`]), to test that the host's client bounds what it reads.

use crate::datadir::{random_hex, write_atomic, DataDir};
use crate::error::{Result, RuntimeError};
use crate::sandbox::RuntimeOptions;
use crate::template::{SeedRecipe, TemplateManifest};
use crate::vmm::{kill_and_wait, pid_alive, reap, wait_exit, Accel, VmHandle, VmSpec, Vmm};
use airlock_proto::frame::{Event, EventKind, MAX_PAYLOAD};
use airlock_proto::{
    ErrorBody, ErrorCode, ExitStatus, FileKind, FileStat, Health, Metrics, MkdirRequest, MkdirResponse, ProcessInfo,
    ProcessSpec, ProcessState, PtySize, RenameRequest, SignalRequest,
};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};

/// `VmHandle::runtime` and `Vmm::name` of fake VMs.
pub const NAME: &str = "fake";
/// Output a fake process keeps for late readers (the real agent keeps 32 MiB); older events are
/// dropped first, and their sequence numbers are skipped, as the real agent does.
pub const RETAINED_OUTPUT: usize = 1 << 20;
/// `argv[0]` of every fake VM process (`pgrep -f airlock-fake-vm` finds them).
pub const PROCESS_MARKER: &str = "airlock-fake-vm";
/// What the fake VM process runs: it ends cleanly once its stdin reaches EOF or a line.
const VM_SCRIPT: &str = "read line; exit 0";

// ---------------------------------------------------------------------------------------------
// Test setup helpers

/// Install template `name` in `data_dir` with tiny dummy kernel/initrd/rootfs blobs, so
/// `TemplateStore::resolve(name)` works and fake sandboxes can be created from it.
pub fn install_template(data_dir: &Path, name: &str) -> Result<TemplateManifest> {
    let (parsed, _) = crate::template::parse_reference(name)?;
    let data = DataDir::open(data_dir)?;
    let hex = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(format!(
        "airlock-fake-template:{parsed}"
    )));
    let dir = data.blobs().join(&hex);
    std::fs::create_dir_all(&dir).map_err(|e| RuntimeError::io(&dir, e))?;
    let rootfs = vec![0u8; 64 << 10];
    let blobs: [(&str, &[u8]); 3] = [
        ("vmlinuz", b"fake kernel\n"),
        ("initrd.img", b"fake initrd\n"),
        ("rootfs.ext4", &rootfs),
    ];
    for (file, content) in blobs {
        std::fs::write(dir.join(file), content).map_err(|e| RuntimeError::io(dir.join(file), e))?;
    }
    let manifest = TemplateManifest {
        name: parsed.clone(),
        digest: format!("sha256:{hex}"),
        kernel_version: "fake".into(),
        built_at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
        size_bytes: blobs.iter().map(|(_, c)| c.len() as u64).sum(),
        rootfs_bytes: rootfs.len() as u64,
        recipe_digest: "fake".into(),
        recipe: SeedRecipe {
            name: parsed.clone(),
            suite: "fake".into(),
            variant: "fake".into(),
            packages: Vec::new(),
            mirror: String::new(),
            kernel_package: "fake".into(),
            modules: Vec::new(),
            agent_sha256: String::new(),
            files_sha256: String::new(),
            wheels: Vec::new(),
            apt: Vec::new(),
            start: None,
            builder_version: 0,
        },
        start: None,
    };
    let path = data.templates().join(format!("{parsed}.json"));
    write_atomic(&path, &serde_json::to_vec_pretty(&manifest).expect("serializable"))?;
    Ok(manifest)
}

/// Runtime options for a fake node on `data_dir`: a new `FakeVmm`, TCG forced (no KVM probe),
/// a short boot timeout.
pub fn options(data_dir: impl Into<PathBuf>) -> RuntimeOptions {
    RuntimeOptions {
        accel: Some(Accel::Tcg),
        boot_timeout: Duration::from_secs(10),
        vmm: Some(Arc::new(FakeVmm::new())),
        // The fake VM has no NIC.
        network: None,
        ..RuntimeOptions::new(data_dir)
    }
}

// ---------------------------------------------------------------------------------------------
// Test controls

/// SIGKILL a fake VM (what `kill -9 <pid>` does to a QEMU).
pub fn kill_vm(pid: u32) {
    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
}

/// Power the VM off from inside: its process exits cleanly (status 0). False when this process
/// has no fake agent for it. (Spawning `["poweroff"]` through the agent does the same.)
pub fn power_off(vm: &VmHandle) -> bool {
    match guest(&vm.agent_socket) {
        Some(g) => {
            g.power_off();
            true
        }
        None => false,
    }
}

/// Ways a fake agent misbehaves, as an agent replaced by root in a hostile guest could.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hostile {
    /// Every call is answered with `status` and a body that never ends.
    EndlessBody { status: u16 },
    /// Streams send one 100 MiB item: a watch line without a newline, and an event frame whose
    /// length prefix says 100 MiB (followed by that much payload). Other calls behave.
    HugeLine,
    /// Calls are never answered (the connection stays up, the handshake still works).
    Silent,
    /// New sessions get `READY`, then garbage instead of HTTP/2.
    Garbage,
}

/// Switch the VM's agent to misbehave (`None`: behave again), for new calls and sessions.
/// False when this process has no fake agent for it.
pub fn set_hostile(vm: &VmHandle, mode: Option<Hostile>) -> bool {
    match guest(&vm.agent_socket) {
        Some(g) => {
            *g.hostile.lock().unwrap() = mode;
            true
        }
        None => false,
    }
}

/// The file bytes the VM's agent has received in uploads so far, counted as they arrive (before
/// an upload has ended), metadata included. `None` when this process has no fake agent for it.
pub fn uploaded_bytes(vm: &VmHandle) -> Option<u64> {
    guest(&vm.agent_socket).map(|g| g.uploaded.load(Ordering::Relaxed))
}

/// Pids of live fake VM processes whose sandbox dir is under `root` (e.g. a test's data dir).
pub fn live_vms(root: &Path) -> Vec<u32> {
    let needle = root.display().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            cmdline.contains(PROCESS_MARKER) && cmdline.contains(&needle) && pid_alive(*pid)
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The fake VMM

/// A VMM whose VMs are host processes with an in-process fake agent. Stateless: everything it
/// needs is in the sandbox dir, /proc and the process-global agent registry, so a new instance
/// (a restarted runtime) manages the VMs of an earlier one.
#[derive(Debug, Default, Clone)]
pub struct FakeVmm {
    _private: (),
}

impl FakeVmm {
    pub fn new() -> Self {
        Self::default()
    }
}

fn vm_marker(dir: &Path) -> PathBuf {
    dir.join("fake-vm")
}

fn signal(pid: u32, sig: Signal) {
    let _ = kill(Pid::from_raw(pid as i32), sig);
}

fn paused_marker(dir: &Path) -> PathBuf {
    dir.join("fake-paused")
}

#[async_trait]
impl Vmm for FakeVmm {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn start(&self, spec: &VmSpec) -> Result<VmHandle> {
        let dir = &spec.dir;
        let agent_socket = dir.join("agent.sock");
        let console = dir.join("console.log");
        let _ = std::fs::remove_file(&agent_socket);
        // A std listener: the agent runtime adopts it (a tokio one would belong to the caller's).
        let listener =
            std::os::unix::net::UnixListener::bind(&agent_socket).map_err(|e| RuntimeError::io(&agent_socket, e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| RuntimeError::io(&agent_socket, e))?;
        std::fs::write(&console, format!("fake VM {} booting\n", spec.id))
            .map_err(|e| RuntimeError::io(&console, e))?;

        // The VM's stdin: closing our end (or writing a line) powers it off. std's pipe is
        // close-on-exec, so other children do not inherit our end.
        let (power_rx, power_tx) = std::io::pipe().map_err(|e| RuntimeError::io(dir, e))?;
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", VM_SCRIPT, PROCESS_MARKER])
            .arg(vm_marker(dir))
            .stdin(power_rx)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // Own session, like QEMU: the VM outlives the runtime that started it.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|e| RuntimeError::io("sh", e))?;
        drop(cmd); // our copy of the pipe's read end
        let pid = child.id();
        drop(child); // `wait_exit` reaps it

        let handle = VmHandle {
            runtime: NAME.into(),
            pid,
            accel: spec.accel,
            dir: dir.clone(),
            agent_socket: agent_socket.clone(),
            control_socket: vm_marker(dir),
            console_log: console,
        };
        let guest = Arc::new(Guest::new(spec, pid, power_tx));
        register(agent_socket, guest, listener);
        write_atomic(
            &VmHandle::record_path(dir),
            &serde_json::to_vec_pretty(&handle).expect("serializable"),
        )?;
        Ok(handle)
    }

    async fn stop(&self, vm: &VmHandle, grace: Duration) -> Result<()> {
        if !self.is_running(vm) {
            reap(vm.pid);
            return Ok(());
        }
        signal(vm.pid, Signal::SIGTERM);
        if wait_exit(vm.pid, grace).await {
            return Ok(());
        }
        kill_and_wait(vm.pid).await
    }

    fn is_running(&self, vm: &VmHandle) -> bool {
        if !pid_alive(vm.pid) {
            return false;
        }
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", vm.pid)).unwrap_or_default();
        let needle = vm_marker(&vm.dir).display().to_string();
        cmdline.split(|b| *b == 0).any(|arg| arg == needle.as_bytes())
    }

    async fn pause(&self, vm: &VmHandle) -> Result<()> {
        if !self.is_running(vm) {
            return Err(control_failed("pause", vm));
        }
        let marker = paused_marker(&vm.dir);
        std::fs::write(&marker, b"").map_err(|e| RuntimeError::io(&marker, e))?;
        if let Some(g) = guest(&vm.agent_socket) {
            g.paused.send_replace(true);
        }
        Ok(())
    }

    async fn resume(&self, vm: &VmHandle) -> Result<()> {
        if !self.is_running(vm) {
            return Err(control_failed("resume", vm));
        }
        let marker = paused_marker(&vm.dir);
        match std::fs::remove_file(&marker) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(RuntimeError::io(&marker, e)),
            _ => {}
        }
        if let Some(g) = guest(&vm.agent_socket) {
            g.paused.send_replace(false);
        }
        Ok(())
    }

    async fn is_paused(&self, vm: &VmHandle) -> Result<bool> {
        if !self.is_running(vm) {
            return Err(control_failed("query-status", vm));
        }
        Ok(paused_marker(&vm.dir).exists())
    }
}

fn control_failed(command: &str, vm: &VmHandle) -> RuntimeError {
    RuntimeError::ControlCommand {
        command: command.into(),
        reason: format!("fake VM pid {} is not running", vm.pid),
    }
}

// ---------------------------------------------------------------------------------------------
// The agent registry

struct Registered {
    guest: Arc<Guest>,
    server: tokio::task::AbortHandle,
}

static GUESTS: LazyLock<Mutex<HashMap<PathBuf, Registered>>> = LazyLock::new(Default::default);

/// Where the fake agents and their VM watchers run: not on the caller's tokio runtime, which a
/// test may shut down to simulate a restart.
static AGENT_RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("airlock-fake-agent")
        .enable_all()
        .build()
        .expect("the fake agent runtime starts")
});

fn guest(socket: &Path) -> Option<Arc<Guest>> {
    GUESTS.lock().unwrap().get(socket).map(|r| r.guest.clone())
}

/// Serve `guest` on `listener` until its VM process exits.
fn register(socket: PathBuf, guest: Arc<Guest>, listener: std::os::unix::net::UnixListener) {
    let server = AGENT_RUNTIME.spawn(serve(guest.clone(), listener)).abort_handle();
    let pid = guest.pid;
    let old = GUESTS.lock().unwrap().insert(
        socket.clone(),
        Registered {
            guest: guest.clone(),
            server,
        },
    );
    if let Some(old) = old {
        old.server.abort();
    }
    AGENT_RUNTIME.spawn(async move {
        while !wait_exit(pid, Duration::from_secs(3600)).await {}
        let mut guests = GUESTS.lock().unwrap();
        if guests.get(&socket).is_some_and(|r| Arc::ptr_eq(&r.guest, &guest)) {
            if let Some(r) = guests.remove(&socket) {
                r.server.abort();
            }
        }
    });
}

async fn serve(guest: Arc<Guest>, listener: std::os::unix::net::UnixListener) {
    let listener = match UnixListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!("fake agent listener: {e}");
            return;
        }
    };
    // Connections live in the set: aborting this task (the VM died) ends them all.
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    conns.spawn(serve_connection(guest.clone(), stream));
                }
                Err(e) => {
                    tracing::debug!("fake agent accept: {e}");
                    return;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

async fn serve_connection(guest: Arc<Guest>, mut stream: UnixStream) {
    if handshake(&mut stream, guest.paused.subscribe()).await.is_err() {
        return;
    }
    if guest.hostile() == Some(Hostile::Garbage) {
        return garbage(stream).await;
    }
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let guest = guest.clone();
        async move {
            if let Some(mode) = guest.hostile() {
                if let Some(resp) = hostile_reply(mode, req.uri().path()).await {
                    return Ok(resp);
                }
            }
            guest.wait_running().await;
            Ok::<_, std::convert::Infallible>(route(guest, req).await.unwrap_or_else(|e| e.response()))
        }
    });
    let conn = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
    if let Err(e) = conn.await {
        tracing::debug!("fake agent session ended: {e}");
    }
}

/// 64 KiB of what a hostile agent sends: not JSON, no newline.
static JUNK: [u8; 64 << 10] = [b'x'; 64 << 10];

/// Up to 100 MiB of junk where HTTP/2 should be, then read until the host hangs up.
async fn garbage(mut stream: UnixStream) {
    for _ in 0..1600 {
        if stream.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.is_err() || stream.write_all(&JUNK).await.is_err() {
            return;
        }
    }
    let mut sink = [0u8; 4096];
    while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
}

/// A body of `JUNK` chunks: `total` bytes, or without end.
fn junk_body(total: Option<usize>, prefix: Bytes) -> Body {
    use futures_util::StreamExt;
    let chunks = futures_util::stream::repeat_with(|| Ok(Frame::data(Bytes::from_static(&JUNK))))
        .take(total.map_or(usize::MAX, |t| t.div_ceil(JUNK.len())));
    let stream = futures_util::stream::iter([Ok(Frame::data(prefix))]).chain(chunks);
    BodyExt::boxed_unsync(StreamBody::new(stream))
}

/// What a hostile agent answers to `req`; `None`: the call is served as usual.
async fn hostile_reply(mode: Hostile, path: &str) -> Option<Response<Body>> {
    const HUGE: usize = 100 << 20;
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let stream = |body| {
        Response::builder()
            .status(StatusCode::OK)
            .body(body)
            .expect("valid response")
    };
    match mode {
        Hostile::EndlessBody { status } => Some(
            Response::builder()
                .status(StatusCode::from_u16(status).unwrap_or(StatusCode::OK))
                .header("content-type", "application/json")
                .body(junk_body(None, Bytes::from_static(b"[")))
                .expect("valid response"),
        ),
        Hostile::HugeLine => match segs.as_slice() {
            ["files", "watch"] => Some(stream(junk_body(Some(HUGE), Bytes::new()))),
            ["processes", _, "events"] => {
                let mut header = BytesMut::new();
                header.extend_from_slice(&[1u8]); // stdout
                header.extend_from_slice(&1u64.to_be_bytes());
                header.extend_from_slice(&(HUGE as u32).to_be_bytes());
                Some(stream(junk_body(Some(HUGE), header.freeze())))
            }
            _ => None,
        },
        Hostile::Silent => std::future::pending().await,
        Hostile::Garbage => None,
    }
}

/// The agent's side of the session start: answer the latest `HELLO <nonce>` with
/// `READY <nonce>`, discarding anything before it; a paused VM answers once it resumes.
async fn handshake(stream: &mut UnixStream, mut paused: watch::Receiver<bool>) -> std::io::Result<()> {
    let mut line = Vec::with_capacity(64);
    let mut nonce: Option<String> = None;
    loop {
        if let Some(n) = &nonce {
            if !*paused.borrow_and_update() {
                let ready = format!("{}{n}\n", airlock_proto::SESSION_READY);
                return stream.write_all(ready.as_bytes()).await;
            }
        }
        let mut b = [0u8; 1];
        tokio::select! {
            n = stream.read(&mut b) => {
                if n? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                if b[0] != b'\n' {
                    line.push(b[0]);
                    if line.len() > airlock_proto::SESSION_LINE_MAX {
                        line.clear();
                    }
                    continue;
                }
                let text = String::from_utf8_lossy(&line).to_string();
                line.clear();
                if let Some(pos) = text.find(airlock_proto::SESSION_HELLO) {
                    let n = &text[pos + airlock_proto::SESSION_HELLO.len()..];
                    if !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric()) {
                        nonce = Some(n.to_string());
                    }
                }
            }
            changed = paused.changed(), if nonce.is_some() => {
                if changed.is_err() {
                    return Err(std::io::ErrorKind::BrokenPipe.into());
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The fake guest

struct Guest {
    pid: u32,
    boot_id: String,
    started: Instant,
    vcpu: u32,
    memory_mib: u32,
    disk_mib: u32,
    paused: watch::Sender<bool>,
    /// Write end of the VM process's stdin; dropping it powers the VM off.
    power: Mutex<Option<std::io::PipeWriter>>,
    procs: Mutex<Procs>,
    fs: Mutex<BTreeMap<PathBuf, Node>>,
    hostile: Mutex<Option<Hostile>>,
    /// File bytes received by uploads so far, finished or not (see [`uploaded_bytes`]).
    uploaded: AtomicU64,
}

#[derive(Default)]
struct Procs {
    next_id: u64,
    table: BTreeMap<u64, Arc<FakeProc>>,
}

#[derive(Clone)]
struct Node {
    dir: bool,
    data: Bytes,
    mode: u32,
    owner: String,
    modified_ms: u64,
    /// User metadata (the real agent's `user.e2b.*` xattrs).
    metadata: BTreeMap<String, String>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Node {
    fn dir(owner: &str) -> Self {
        Self {
            dir: true,
            data: Bytes::new(),
            mode: 0o755,
            owner: owner.into(),
            modified_ms: now_ms(),
            metadata: BTreeMap::new(),
        }
    }
}

/// The fake guest's users: name, uid, home.
const USERS: &[(&str, u32, &str)] = &[("root", 0, "/root"), ("user", 1000, "/home/user")];

fn user(name: &str) -> Result<(&'static str, u32, &'static str), ApiErr> {
    USERS
        .iter()
        .find(|(n, _, _)| *n == name)
        .copied()
        .ok_or_else(|| ApiErr::invalid(format!("no user named {name:?} in the sandbox")))
}

impl Guest {
    fn new(spec: &VmSpec, pid: u32, power: std::io::PipeWriter) -> Self {
        let mut fs = BTreeMap::new();
        for (dir, owner) in [("/", "root"), ("/root", "root"), ("/tmp", "root"), ("/home", "root")] {
            fs.insert(PathBuf::from(dir), Node::dir(owner));
        }
        fs.insert(PathBuf::from("/home/user"), Node::dir("user"));
        Self {
            pid,
            boot_id: random_hex(16),
            started: Instant::now(),
            vcpu: spec.vcpu,
            memory_mib: spec.memory_mib,
            disk_mib: spec.disk_mib,
            paused: watch::channel(false).0,
            power: Mutex::new(Some(power)),
            procs: Mutex::new(Procs::default()),
            fs: Mutex::new(fs),
            hostile: Mutex::new(None),
            uploaded: AtomicU64::new(0),
        }
    }

    fn hostile(&self) -> Option<Hostile> {
        *self.hostile.lock().unwrap()
    }

    fn power_off(&self) {
        if let Some(mut w) = self.power.lock().unwrap().take() {
            let _ = w.write_all(b"poweroff\n");
        }
    }

    async fn wait_running(&self) {
        let mut rx = self.paused.subscribe();
        while *rx.borrow_and_update() {
            if rx.changed().await.is_err() {
                return;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Errors and bodies

type Body = UnsyncBoxBody<Bytes, std::io::Error>;

struct ApiErr(ErrorCode, String);

impl ApiErr {
    fn invalid(m: impl Into<String>) -> Self {
        Self(ErrorCode::InvalidArgument, m.into())
    }
    fn not_found(m: impl Into<String>) -> Self {
        Self(ErrorCode::NotFound, m.into())
    }
    fn response(self) -> Response<Body> {
        let status = StatusCode::from_u16(self.0.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        json(
            status,
            &ErrorBody {
                code: self.0,
                message: self.1,
            },
        )
    }
}

fn full(status: StatusCode, body: Bytes, content_type: &str) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .body(Full::new(body).map_err(|never| match never {}).boxed_unsync())
        .expect("valid response")
}

fn json<T: serde::Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    let body = Bytes::from(serde_json::to_vec(value).expect("serializable"));
    full(status, body, "application/json")
}

fn ok_empty() -> Response<Body> {
    json(StatusCode::OK, &serde_json::json!({}))
}

async fn body_bytes(req: Request<Incoming>) -> Result<Bytes, ApiErr> {
    Ok(req
        .into_body()
        .collect()
        .await
        .map_err(|e| ApiErr::invalid(format!("body: {e}")))?
        .to_bytes())
}

async fn read_json<T: serde::de::DeserializeOwned>(req: Request<Incoming>) -> Result<T, ApiErr> {
    serde_json::from_slice(&body_bytes(req).await?).map_err(|e| ApiErr::invalid(format!("bad JSON body: {e}")))
}

fn query(req: &Request<Incoming>) -> HashMap<String, String> {
    req.uri()
        .query()
        .map(|q| url::form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default()
}

fn query_path(q: &HashMap<String, String>, key: &str) -> Result<PathBuf, ApiErr> {
    clean_path(
        q.get(key)
            .ok_or_else(|| ApiErr::invalid(format!("query parameter {key:?} is required")))?,
    )
}

/// The agent's rule: absolute, no `..`, no NUL; normalized (`/a/./b/` is `/a/b`).
fn clean_path(path: &str) -> Result<PathBuf, ApiErr> {
    let p = Path::new(path);
    if path.is_empty() {
        return Err(ApiErr::invalid("path is empty"));
    }
    if !p.is_absolute() {
        return Err(ApiErr::invalid(format!("path {path:?} must be absolute")));
    }
    if p.components().any(|c| c == Component::ParentDir) || path.contains('\0') {
        return Err(ApiErr::invalid(format!("path {path:?} must not contain '..' or NUL")));
    }
    Ok(p.components().collect())
}

// ---------------------------------------------------------------------------------------------
// Routes

/// What listens on port 8000 of a fake sandbox (nothing listens on the others): an HTTP/1 app that answers each request with
/// the headers it received (as JSON) and, as a hostile guest would, sets a cookie for the parent
/// domain; tests see what the port proxy lets through either way.
fn port_app(req: Request<Incoming>) -> Response<Body> {
    let (app, host_end) = tokio::io::duplex(64 << 10);
    tokio::spawn(async move {
        let svc = hyper::service::service_fn(|r: Request<Incoming>| async move {
            let headers: BTreeMap<String, String> = r
                .headers()
                .iter()
                .map(|(k, v)| (k.to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
                .collect();
            let mut resp = json(StatusCode::OK, &serde_json::json!({ "headers": headers }));
            resp.headers_mut().insert(
                http::header::SET_COOKIE,
                http::HeaderValue::from_static("tossed=1; Domain=localhost; Path=/"),
            );
            Ok::<_, std::convert::Infallible>(resp)
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(hyper_util::rt::TokioIo::new(app), svc)
            .await;
    });
    let (rd, mut wr) = tokio::io::split(host_end);
    tokio::spawn(async move {
        let mut body = req.into_body();
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data() {
                if wr.write_all(&data).await.is_err() {
                    break;
                }
            }
        }
        let _ = wr.shutdown().await;
    });
    use futures_util::TryStreamExt;
    let out = tokio_util::io::ReaderStream::new(rd).map_ok(Frame::data);
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/octet-stream")
        .body(StreamBody::new(out).boxed_unsync())
        .expect("valid response")
}

async fn route(guest: Arc<Guest>, req: Request<Incoming>) -> Result<Response<Body>, ApiErr> {
    let path = req.uri().path().to_string();
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let method = req.method().clone();
    match (&method, segs.as_slice()) {
        (&Method::POST, ["tcp", "8000"]) => Ok(port_app(req)),
        (&Method::GET, ["health"]) => Ok(json(
            StatusCode::OK,
            &Health {
                version: format!("{}-fake", env!("CARGO_PKG_VERSION")),
                protocol: airlock_proto::PROTOCOL_VERSION,
                boot_id: guest.boot_id.clone(),
                uptime_ms: guest.started.elapsed().as_millis() as u64,
            },
        )),
        (&Method::GET, ["metrics"]) => {
            let used: u64 = guest.fs.lock().unwrap().values().map(|n| n.data.len() as u64).sum();
            Ok(json(
                StatusCode::OK,
                &Metrics {
                    cpu_count: guest.vcpu,
                    cpu_used_pct: 1.0,
                    mem_total_bytes: (guest.memory_mib as u64) << 20,
                    mem_used_bytes: 32 << 20,
                    disk_total_bytes: (guest.disk_mib as u64) << 20,
                    disk_used_bytes: used,
                },
            ))
        }
        (&Method::POST, ["identity"]) => {
            // The real agent applies it to the guest; the fake only checks it is well formed.
            let identity: airlock_proto::Identity = read_json(req).await?;
            if identity.hostname.is_empty() || identity.machine_id.len() != 32 {
                return Err(ApiErr::invalid("bad identity".to_string()));
            }
            Ok(ok_empty())
        }
        (&Method::POST, ["system", "sync"]) => Ok(ok_empty()),
        (&Method::POST, ["system", "shutdown"]) => {
            let g = guest.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                g.power_off();
            });
            Ok(json(StatusCode::ACCEPTED, &serde_json::json!({})))
        }
        (&Method::POST, ["processes"]) => {
            let spec: ProcessSpec = read_json(req).await?;
            Ok(json(StatusCode::CREATED, &spawn(&guest, spec)?))
        }
        (&Method::GET, ["processes"]) => {
            let procs = guest.procs.lock().unwrap();
            let list: Vec<ProcessInfo> = procs.table.values().map(|p| p.info()).collect();
            Ok(json(StatusCode::OK, &list))
        }
        (_, ["processes", id, rest @ ..]) => {
            let id: u64 = id
                .parse()
                .map_err(|_| ApiErr::invalid(format!("bad process id {id:?}")))?;
            let proc = guest.procs.lock().unwrap().table.get(&id).cloned();
            let proc = proc.ok_or_else(|| ApiErr::not_found(format!("no process with id {id}")))?;
            match (&method, rest) {
                (&Method::GET, []) => Ok(json(StatusCode::OK, &proc.info())),
                (&Method::GET, ["events"]) => {
                    let after = query(&req).get("after").and_then(|v| v.parse().ok()).unwrap_or(0);
                    Ok(event_stream(guest, proc, after))
                }
                (&Method::POST, ["stdin"]) => {
                    let data = body_bytes(req).await?;
                    proc.stdin(Ctl::Stdin(data))?;
                    Ok(ok_empty())
                }
                (&Method::POST, ["stdin", "close"]) => {
                    if proc.info().stdin || proc.info().pty {
                        let _ = proc.stdin(Ctl::CloseStdin);
                    }
                    Ok(ok_empty())
                }
                (&Method::POST, ["signal"]) => {
                    let r: SignalRequest = read_json(req).await?;
                    Signal::try_from(r.signal).map_err(|_| ApiErr::invalid(format!("unknown signal {}", r.signal)))?;
                    if proc.info().state == ProcessState::Exited {
                        return Err(ApiErr::invalid("process has already exited"));
                    }
                    let _ = proc.ctl.send(Ctl::Signal(r.signal));
                    Ok(ok_empty())
                }
                (&Method::POST, ["resize"]) => {
                    let _size: PtySize = read_json(req).await?;
                    if !proc.info().pty {
                        return Err(ApiErr::invalid("process has no pty"));
                    }
                    Ok(ok_empty())
                }
                _ => Err(ApiErr::not_found(format!("no route {method} {path}"))),
            }
        }
        (&Method::GET, ["files"]) => {
            let p = query_path(&query(&req), "path")?;
            let fs = guest.fs.lock().unwrap();
            let node = fs.get(&p).ok_or_else(|| no_such(&p))?;
            if node.dir {
                return Err(ApiErr(
                    ErrorCode::IsADirectory,
                    format!("{} is a directory", p.display()),
                ));
            }
            Ok(full(StatusCode::OK, node.data.clone(), "application/octet-stream"))
        }
        (&Method::PUT, ["files"]) => {
            let q = query(&req);
            let p = query_path(&q, "path")?;
            let owner = user(q.get("user").map(String::as_str).unwrap_or("root"))?.0;
            let mode = match q.get("mode") {
                Some(m) => {
                    Some(u32::from_str_radix(m, 8).map_err(|_| ApiErr::invalid(format!("bad octal mode {m:?}")))?)
                }
                None => None,
            };
            let metadata_len: usize = match q.get("metadata_len") {
                Some(n) => n
                    .parse()
                    .map_err(|_| ApiErr::invalid(format!("bad metadata_len {n:?}")))?,
                None => 0,
            };
            // Read as it arrives, counted; what goes to `/dev/null` is dropped as the device
            // would (so a test can upload much without this process holding it).
            let sink = p == Path::new("/dev/null");
            let mut body = req.into_body();
            let mut data = BytesMut::new();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| ApiErr::invalid(format!("body: {e}")))?;
                if let Ok(chunk) = frame.into_data() {
                    guest.uploaded.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    if !sink || data.len() < metadata_len {
                        data.extend_from_slice(&chunk);
                    }
                }
            }
            let mut data = data.freeze();
            if sink {
                data.truncate(metadata_len);
            }
            if data.len() < metadata_len {
                return Err(ApiErr::invalid("upload ended within its metadata"));
            }
            let metadata: BTreeMap<String, String> = match metadata_len {
                0 => BTreeMap::new(),
                n => serde_json::from_slice(&data.split_to(n))
                    .map_err(|e| ApiErr::invalid(format!("bad metadata: {e}")))?,
            };
            airlock_proto::check_metadata(&metadata).map_err(ApiErr::invalid)?;
            let mut fs = guest.fs.lock().unwrap();
            if let Some(parent) = p.parent() {
                mkdir_all(&mut fs, parent, owner)?;
            }
            let existing = fs.get(&p).cloned();
            if existing.as_ref().is_some_and(|n| n.dir) {
                return Err(ApiErr(
                    ErrorCode::IsADirectory,
                    format!("{} is a directory", p.display()),
                ));
            }
            let node = Node {
                dir: false,
                data,
                mode: mode.or(existing.map(|n| n.mode)).unwrap_or(0o644),
                owner: owner.into(),
                modified_ms: now_ms(),
                metadata,
            };
            fs.insert(p.clone(), node);
            Ok(json(StatusCode::OK, &stat(&fs, &p)?))
        }
        (&Method::DELETE, ["files"]) => {
            let p = query_path(&query(&req), "path")?;
            if p == Path::new("/") {
                return Err(ApiErr::invalid("refusing to remove /"));
            }
            let mut fs = guest.fs.lock().unwrap();
            if fs.remove(&p).is_none() {
                return Err(no_such(&p));
            }
            fs.retain(|k, _| !k.starts_with(&p));
            Ok(ok_empty())
        }
        (&Method::GET, ["files", "stat"]) => {
            let p = query_path(&query(&req), "path")?;
            Ok(json(StatusCode::OK, &stat(&guest.fs.lock().unwrap(), &p)?))
        }
        (&Method::GET, ["files", "list"]) => {
            let q = query(&req);
            let p = query_path(&q, "path")?;
            let depth: usize = match q.get("depth") {
                None => 1,
                Some(d) => d.parse().map_err(|_| ApiErr::invalid(format!("bad depth {d:?}")))?,
            };
            if depth == 0 {
                return Err(ApiErr::invalid("depth must be at least 1"));
            }
            let fs = guest.fs.lock().unwrap();
            if !fs.get(&p).ok_or_else(|| no_such(&p))?.dir {
                return Err(ApiErr(
                    ErrorCode::NotADirectory,
                    format!("{} is not a directory", p.display()),
                ));
            }
            let base = p.components().count();
            let list = fs
                .keys()
                .filter(|k| k.starts_with(&p) && **k != p && k.components().count() - base <= depth)
                .map(|k| stat(&fs, k))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(json(StatusCode::OK, &list))
        }
        (&Method::POST, ["files", "mkdir"]) => {
            let r: MkdirRequest = read_json(req).await?;
            let p = clean_path(&r.path)?;
            let owner = user(r.user.as_deref().unwrap_or("root"))?.0;
            let mut fs = guest.fs.lock().unwrap();
            let created = mkdir_all(&mut fs, &p, owner)?;
            let stat = stat(&fs, &p)?;
            Ok(json(StatusCode::OK, &MkdirResponse { created, stat }))
        }
        (&Method::POST, ["files", "rename"]) => {
            let r: RenameRequest = read_json(req).await?;
            let (from, to) = (clean_path(&r.from)?, clean_path(&r.to)?);
            let mut fs = guest.fs.lock().unwrap();
            if !fs.contains_key(&from) {
                return Err(no_such(&from));
            }
            if !to.parent().and_then(|d| fs.get(d)).is_some_and(|n| n.dir) || to.starts_with(&from) {
                return Err(ApiErr::invalid(format!(
                    "cannot rename {} to {}",
                    from.display(),
                    to.display()
                )));
            }
            let moved: Vec<PathBuf> = fs.keys().filter(|k| k.starts_with(&from)).cloned().collect();
            fs.retain(|k, _| !k.starts_with(&to));
            for old in moved {
                let node = fs.remove(&old).expect("listed");
                let rel = old.strip_prefix(&from).expect("under from");
                fs.insert(
                    if rel.as_os_str().is_empty() {
                        to.clone()
                    } else {
                        to.join(rel)
                    },
                    node,
                );
            }
            Ok(json(StatusCode::OK, &stat(&fs, &to)?))
        }
        (&Method::POST, ["tcp", port]) => Err(ApiErr::not_found(format!(
            "nothing listens on port {port} in the sandbox (fake agent)"
        ))),
        (&Method::GET, ["files", "watch"]) => Err(ApiErr(
            ErrorCode::Internal,
            "the fake agent does not support watches".into(),
        )),
        _ => Err(ApiErr::not_found(format!("no route {method} {path}"))),
    }
}

fn no_such(p: &Path) -> ApiErr {
    ApiErr::not_found(format!("{}: No such file or directory (os error 2)", p.display()))
}

fn stat(fs: &BTreeMap<PathBuf, Node>, p: &Path) -> Result<FileStat, ApiErr> {
    let node = fs.get(p).ok_or_else(|| no_such(p))?;
    let uid = USERS.iter().find(|u| u.0 == node.owner).map(|u| u.1).unwrap_or(0);
    Ok(FileStat {
        path: p.display().to_string(),
        name: p
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "/".into()),
        kind: if node.dir { FileKind::Dir } else { FileKind::File },
        size: if node.dir { 4096 } else { node.data.len() as u64 },
        mode: node.mode,
        uid,
        gid: uid,
        owner: node.owner.clone(),
        group: node.owner.clone(),
        modified_ms: node.modified_ms,
        symlink_target: None,
        symlink_resolved: None,
        link_target: None,
        metadata: node.metadata.clone(),
    })
}

/// Create `p` and its missing parents; false when it already was a directory.
fn mkdir_all(fs: &mut BTreeMap<PathBuf, Node>, p: &Path, owner: &str) -> Result<bool, ApiErr> {
    if let Some(n) = fs.get(p) {
        return match n.dir {
            true => Ok(false),
            false => Err(ApiErr(
                ErrorCode::AlreadyExists,
                format!("{} exists and is not a directory", p.display()),
            )),
        };
    }
    if let Some(parent) = p.parent() {
        mkdir_all(fs, parent, owner)?;
    }
    fs.insert(p.to_path_buf(), Node::dir(owner));
    Ok(true)
}

// ---------------------------------------------------------------------------------------------
// Processes

enum Ctl {
    Stdin(Bytes),
    CloseStdin,
    Signal(i32),
}

struct FakeProc {
    info: Mutex<ProcessInfo>,
    /// The event log and whether it is finished.
    log: Mutex<(Vec<Event>, bool)>,
    seq: watch::Sender<u64>,
    ctl: mpsc::UnboundedSender<Ctl>,
    merge_stderr: bool,
}

impl FakeProc {
    fn info(&self) -> ProcessInfo {
        self.info.lock().unwrap().clone()
    }

    fn stdin(&self, ctl: Ctl) -> Result<(), ApiErr> {
        let info = self.info();
        if !(info.stdin || info.pty) || info.state == ProcessState::Exited {
            return Err(ApiErr::invalid("stdin of this process is closed or was not requested"));
        }
        self.ctl
            .send(ctl)
            .map_err(|_| ApiErr::invalid("stdin of this process is closed or was not requested"))
    }

    fn push(&self, kind: EventKind) {
        let mut log = self.log.lock().unwrap();
        let seq = log.0.last().map_or(0, |e| e.seq) + 1;
        log.0.push(Event { seq, kind });
        // As the real agent: the oldest events go past the cap (the newest always stays).
        let mut bytes: usize = log.0.iter().map(Event::wire_len).sum();
        while bytes > RETAINED_OUTPUT && log.0.len() > 1 {
            bytes -= log.0.remove(0).wire_len();
        }
        self.seq.send_replace(seq);
    }

    fn output(&self, stderr: bool, data: &[u8]) {
        for chunk in data.chunks(MAX_PAYLOAD) {
            let b = Bytes::copy_from_slice(chunk);
            self.push(if stderr && !self.merge_stderr {
                EventKind::Stderr(b)
            } else {
                EventKind::Stdout(b)
            });
        }
    }

    fn finish(&self, exit: ExitStatus) {
        {
            let mut info = self.info.lock().unwrap();
            info.state = ProcessState::Exited;
            info.exit = Some(exit.clone());
            info.ended_at_ms = Some(now_ms());
        }
        self.push(EventKind::Exit(exit));
        self.log.lock().unwrap().1 = true;
        self.seq.send_modify(|_| {});
    }

    /// Events after `seq`, waiting for new ones; `None` once the log is finished and drained.
    async fn next_events(&self, seq: u64) -> Option<Vec<Event>> {
        let mut rx = self.seq.subscribe();
        loop {
            {
                let log = self.log.lock().unwrap();
                let evs: Vec<Event> = log.0.iter().filter(|e| e.seq > seq).cloned().collect();
                if !evs.is_empty() {
                    return Some(evs);
                }
                if log.1 {
                    return None;
                }
            }
            rx.changed().await.ok()?;
        }
    }
}

/// What a fake process does.
enum Program {
    Done {
        stdout: Vec<u8>,
        stderr: Vec<u8>,
        code: i32,
    },
    Sleep(Option<Duration>),
    Cat,
    PowerOff,
}

fn program(argv: &[String]) -> Program {
    let done = |stdout: String, stderr: String, code| Program::Done {
        stdout: stdout.into_bytes(),
        stderr: stderr.into_bytes(),
        code,
    };
    let name = argv[0].rsplit('/').next().unwrap_or_default();
    match (name, &argv[1..]) {
        ("echo", args) => done(format!("{}\n", args.join(" ")), String::new(), 0),
        ("true", _) => done(String::new(), String::new(), 0),
        ("false", _) => done(String::new(), String::new(), 1),
        ("cat", []) => Program::Cat,
        ("poweroff", _) => Program::PowerOff,
        ("sleep", [secs]) if secs == "infinity" => Program::Sleep(None),
        ("sleep", [secs]) => match secs.parse::<f64>() {
            Ok(s) if s >= 0.0 && s.is_finite() => Program::Sleep(Some(Duration::from_secs_f64(s))),
            _ => done(String::new(), format!("sleep: invalid time interval {secs:?}\n"), 1),
        },
        ("sh" | "bash", [c, script]) if c == "-c" => {
            let code = script.trim().strip_prefix("exit").map(|n| n.trim().parse::<i32>());
            match code {
                Some(Ok(code)) => done(String::new(), String::new(), code & 0xff),
                Some(Err(_)) if script.trim() == "exit" => done(String::new(), String::new(), 0),
                _ => done(
                    String::new(),
                    format!("{name}: the fake agent only runs `exit N` scripts, not {script:?}\n"),
                    127,
                ),
            }
        }
        _ => done(String::new(), format!("{name}: command not found\n"), 127),
    }
}

/// Signals whose default action does not end a process.
fn ignored_by_default(sig: i32) -> bool {
    sig == 0
        || [Signal::SIGCHLD, Signal::SIGCONT, Signal::SIGURG, Signal::SIGWINCH]
            .iter()
            .any(|s| *s as i32 == sig)
}

fn spawn(guest: &Arc<Guest>, spec: ProcessSpec) -> Result<ProcessInfo, ApiErr> {
    if spec.argv.is_empty() || spec.argv[0].is_empty() {
        return Err(ApiErr::invalid("argv must name a program"));
    }
    if spec.timeout_ms == Some(0) {
        return Err(ApiErr::invalid("timeout must be greater than zero"));
    }
    let (user_name, _, home) = user(spec.user.as_deref().unwrap_or("root"))?;
    let cwd = spec.cwd.clone().unwrap_or_else(|| home.to_string());
    if !guest.fs.lock().unwrap().get(Path::new(&cwd)).is_some_and(|n| n.dir) {
        return Err(ApiErr::invalid(format!("working directory {cwd:?} does not exist")));
    }
    let (ctl, rx) = mpsc::unbounded_channel();
    let proc = {
        let mut procs = guest.procs.lock().unwrap();
        procs.next_id += 1;
        let id = procs.next_id;
        let info = ProcessInfo {
            id,
            pid: 100 + id as u32,
            tag: spec.tag.clone(),
            argv: spec.argv.clone(),
            cwd,
            user: user_name.into(),
            pty: spec.pty.is_some(),
            stdin: spec.stdin,
            state: ProcessState::Running,
            exit: None,
            started_at_ms: now_ms(),
            ended_at_ms: None,
        };
        let proc = Arc::new(FakeProc {
            info: Mutex::new(info),
            log: Mutex::new((Vec::new(), false)),
            seq: watch::channel(0).0,
            ctl,
            merge_stderr: spec.pty.is_some(),
        });
        procs.table.insert(id, proc.clone());
        proc
    };
    let info = proc.info();
    tokio::spawn(run(
        guest.clone(),
        proc,
        program(&spec.argv),
        rx,
        spec.timeout_ms.map(Duration::from_millis),
    ));
    Ok(info)
}

async fn run(
    guest: Arc<Guest>,
    proc: Arc<FakeProc>,
    program: Program,
    mut ctl: mpsc::UnboundedReceiver<Ctl>,
    timeout: Option<Duration>,
) {
    let code = |c| ExitStatus {
        exit_code: Some(c),
        signal: None,
        timed_out: false,
    };
    let signaled = |s| ExitStatus {
        exit_code: None,
        signal: Some(s),
        timed_out: false,
    };
    let timed_out = || ExitStatus {
        exit_code: None,
        signal: Some(Signal::SIGKILL as i32),
        timed_out: true,
    };
    let timer = async {
        match timeout {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(timer);
    let exit = match program {
        Program::Done {
            stdout,
            stderr,
            code: c,
        } => {
            proc.output(false, &stdout);
            proc.output(true, &stderr);
            code(c)
        }
        Program::PowerOff => {
            let g = guest.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                g.power_off();
            });
            code(0)
        }
        Program::Sleep(d) => {
            let sleep = async {
                match d {
                    Some(d) => tokio::time::sleep(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    _ = &mut sleep => break code(0),
                    _ = &mut timer => break timed_out(),
                    Some(c) = ctl.recv() => {
                        if let Ctl::Signal(s) = c {
                            if !ignored_by_default(s) {
                                break signaled(s);
                            }
                        }
                    }
                }
            }
        }
        Program::Cat => loop {
            tokio::select! {
                _ = &mut timer => break timed_out(),
                c = ctl.recv() => match c {
                    Some(Ctl::Stdin(b)) => proc.output(false, &b),
                    Some(Ctl::CloseStdin) | None => break code(0),
                    Some(Ctl::Signal(s)) if !ignored_by_default(s) => break signaled(s),
                    Some(Ctl::Signal(_)) => {}
                },
            }
        },
    };
    proc.finish(exit);
}

fn event_stream(guest: Arc<Guest>, proc: Arc<FakeProc>, after: u64) -> Response<Body> {
    let stream = futures_util::stream::unfold((guest, proc, after), |(guest, proc, last)| async move {
        let events = proc.next_events(last).await?;
        guest.wait_running().await; // a frozen guest sends nothing
        let mut buf = BytesMut::new();
        let mut last = last;
        for e in &events {
            e.encode(&mut buf);
            last = e.seq;
        }
        Some((Ok::<_, std::io::Error>(Frame::data(buf.freeze())), (guest, proc, last)))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/x-airlock-events")
        .body(BodyExt::boxed_unsync(StreamBody::new(stream)))
        .expect("valid response")
}
