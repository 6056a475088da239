//! Processes started on the host's behalf: spawn, output log with sequence numbers, stdin,
//! signals, PTY resize, timeouts, and reaping (the agent is PID 1, so it reaps orphans too).

use crate::error::AgentError;
use crate::users;
use airlock_proto::frame::{Event, EventKind, MAX_PAYLOAD};
use airlock_proto::{ExitStatus, ProcessInfo, ProcessSpec, ProcessState, PtySize};
use bytes::Bytes;
use nix::sys::signal::{kill, killpg, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{oneshot, watch};

/// Output kept per process for late readers and reconnects; older chunks are dropped first.
const RETAINED_OUTPUT: usize = 32 << 20;
/// Finished processes remembered for reconnects before the oldest are forgotten.
const FINISHED_KEPT: usize = 256;
/// Output all finished processes may keep together: the agent is PID 1 in a small guest, and
/// running out of memory there would take the whole VM down.
const FINISHED_OUTPUT_BUDGET: usize = 48 << 20;
/// After the process exits, how long to wait for its pipes to drain (a background grandchild may
/// hold them open forever).
const DRAIN_GRACE: Duration = Duration::from_millis(300);
const READ_CHUNK: usize = 64 << 10;

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Ordered event log of one process.
#[derive(Default)]
struct Log {
    events: VecDeque<Event>,
    next_seq: u64,
    bytes: usize,
    finished: bool,
}

impl Log {
    fn push(&mut self, kind: EventKind) -> u64 {
        self.next_seq += 1;
        let ev = Event {
            seq: self.next_seq,
            kind,
        };
        self.bytes += ev.wire_len();
        self.events.push_back(ev);
        while self.bytes > RETAINED_OUTPUT && self.events.len() > 1 {
            if let Some(old) = self.events.pop_front() {
                self.bytes -= old.wire_len();
            }
        }
        self.next_seq
    }

    fn after(&self, seq: u64) -> Vec<Event> {
        self.events.iter().filter(|e| e.seq > seq).cloned().collect()
    }
}

enum Stdin {
    Pipe(tokio::net::unix::pipe::Sender),
    Pty(Arc<AsyncFd<OwnedFd>>),
}

pub struct Proc {
    pub id: u64,
    pub pid: u32,
    info: Mutex<ProcessInfo>,
    log: Mutex<Log>,
    /// Latest seq written; readers wait on changes.
    seq_tx: watch::Sender<u64>,
    stdin: tokio::sync::Mutex<Option<Stdin>>,
    pty: Option<Arc<AsyncFd<OwnedFd>>>,
}

impl Proc {
    pub fn info(&self) -> ProcessInfo {
        self.info.lock().unwrap().clone()
    }

    fn append(&self, kind: EventKind) {
        let seq = self.log.lock().unwrap().push(kind);
        self.seq_tx.send_replace(seq);
    }

    /// Events after `seq`, waiting for new ones; `None` once the log is finished and drained.
    pub async fn next_events(&self, seq: u64) -> Option<Vec<Event>> {
        let mut rx = self.seq_tx.subscribe();
        loop {
            {
                let log = self.log.lock().unwrap();
                let evs = log.after(seq);
                if !evs.is_empty() {
                    return Some(evs);
                }
                if log.finished {
                    return None;
                }
            }
            if rx.changed().await.is_err() {
                return None;
            }
        }
    }

    pub async fn write_stdin(&self, data: &[u8]) -> Result<(), AgentError> {
        let mut guard = self.stdin.lock().await;
        match guard.as_mut() {
            None => Err(AgentError::invalid(
                "stdin of this process is closed or was not requested",
            )),
            Some(Stdin::Pipe(tx)) => tx.write_all(data).await.map_err(AgentError::from),
            Some(Stdin::Pty(master)) => write_fd(master, data).await.map_err(AgentError::from),
        }
    }

    pub async fn close_stdin(&self) -> Result<(), AgentError> {
        let mut guard = self.stdin.lock().await;
        match guard.take() {
            // A terminal has no stdin to close: send EOF (^D) the way a user would.
            Some(Stdin::Pty(master)) => write_fd(&master, b"\x04").await.map_err(AgentError::from),
            _ => Ok(()),
        }
    }

    pub fn signal(&self, signal: i32) -> Result<(), AgentError> {
        let sig = Signal::try_from(signal).map_err(|_| AgentError::invalid(format!("unknown signal {signal}")))?;
        if self.info().state == ProcessState::Exited {
            return Err(AgentError::invalid("process has already exited"));
        }
        kill(Pid::from_raw(self.pid as i32), sig).map_err(|e| AgentError::internal(format!("kill: {e}")))
    }

    pub fn resize(&self, size: &PtySize) -> Result<(), AgentError> {
        let master = self
            .pty
            .as_ref()
            .ok_or_else(|| AgentError::invalid("process has no pty"))?;
        set_winsize(master.get_ref().as_raw_fd(), size).map_err(AgentError::from)
    }
}

async fn write_fd(fd: &AsyncFd<OwnedFd>, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        let mut guard = fd.writable().await?;
        match guard.try_io(|inner| {
            let n = unsafe { libc::write(inner.get_ref().as_raw_fd(), data.as_ptr().cast(), data.len()) };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        }) {
            Ok(Ok(n)) => data = &data[n..],
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
    Ok(())
}

fn set_winsize(fd: i32, size: &PtySize) -> std::io::Result<()> {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    if unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[derive(Default)]
struct Table {
    next_id: u64,
    procs: HashMap<u64, Arc<Proc>>,
    waiters: HashMap<u32, oneshot::Sender<WaitStatus>>,
    finished: VecDeque<u64>,
}

/// All processes the agent started. Cloning shares the table.
#[derive(Clone, Default)]
pub struct Processes {
    table: Arc<Mutex<Table>>,
}

impl Processes {
    /// The table, also after a panic elsewhere held it: every update leaves it whole, and one
    /// failed request must not fail every later spawn.
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn get(&self, id: u64) -> Result<Arc<Proc>, AgentError> {
        self.table()
            .procs
            .get(&id)
            .cloned()
            .ok_or_else(|| AgentError::not_found(format!("no process with id {id}")))
    }

    pub fn list(&self) -> Vec<ProcessInfo> {
        let mut v: Vec<_> = self.table().procs.values().map(|p| p.info()).collect();
        v.sort_by_key(|p| p.id);
        v
    }

    /// Reap every exited child; called on SIGCHLD. Orphans re-parented to PID 1 are reaped too.
    ///
    /// It waits under the table lock, which a spawn holds: a child whose exec failed is waited
    /// for by `Command::spawn` itself, which panics if it was reaped here first.
    pub fn reap(&self) {
        let mut table = self.table();
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(status) => {
                    let Some(pid) = status.pid() else { continue };
                    if matches!(status, WaitStatus::Exited(..) | WaitStatus::Signaled(..)) {
                        let waiter = table.waiters.remove(&(pid.as_raw() as u32));
                        if let Some(tx) = waiter {
                            let _ = tx.send(status);
                        }
                    }
                }
            }
        }
    }

    pub fn spawn(&self, spec: ProcessSpec) -> Result<ProcessInfo, AgentError> {
        if spec.argv.is_empty() || spec.argv[0].is_empty() {
            return Err(AgentError::invalid("argv must name a program"));
        }
        if spec.timeout_ms == Some(0) {
            return Err(AgentError::invalid("timeout must be greater than zero"));
        }
        let user_name = spec.user.clone().unwrap_or_else(|| "root".into());
        let user = users::lookup(&user_name)
            .ok_or_else(|| AgentError::invalid(format!("no user named {user_name:?} in the sandbox")))?;
        let cwd = spec.cwd.clone().unwrap_or_else(|| user.home.clone());
        if !std::path::Path::new(&cwd).is_dir() {
            return Err(AgentError::invalid(format!("working directory {cwd:?} does not exist")));
        }

        let mut cmd = Command::new(&spec.argv[0]);
        cmd.args(&spec.argv[1..]).current_dir(&cwd).env_clear();
        let path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
        cmd.env("PATH", path)
            .env("HOME", &user.home)
            .env("USER", &user.name)
            .env("LOGNAME", &user.name)
            .env("SHELL", &user.shell)
            .env("LANG", "C.UTF-8");
        if spec.pty.is_some() {
            cmd.env("TERM", "xterm-256color");
        }
        cmd.envs(&spec.env);

        let (uid, gid, groups): (u32, u32, Vec<libc::gid_t>) = (user.uid, user.gid, user.groups.clone());
        let want_pty = spec.pty.clone();
        let mut pty_master: Option<OwnedFd> = None;
        if let Some(size) = &want_pty {
            let ws = libc::winsize {
                ws_row: size.rows,
                ws_col: size.cols,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            let pty = nix::pty::openpty(Some(&ws), None).map_err(|e| AgentError::internal(format!("openpty: {e}")))?;
            let slave = pty.slave;
            cmd.stdin(Stdio::from(slave.try_clone()?))
                .stdout(Stdio::from(slave.try_clone()?))
                .stderr(Stdio::from(slave));
            pty_master = Some(pty.master);
        } else {
            cmd.stdin(if spec.stdin { Stdio::piped() } else { Stdio::null() })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
        }
        let with_tty = want_pty.is_some();
        unsafe {
            cmd.pre_exec(move || {
                // Own session and process group: a timeout kills the whole tree, and a PTY
                // becomes the controlling terminal.
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if with_tty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // Groups, then gid, then uid: after setuid there is no privilege left to drop.
                if libc::setgroups(groups.len(), groups.as_ptr()) < 0 || libc::setgid(gid) < 0 || libc::setuid(uid) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }

        // Spawn and register under the table lock, so the reaper cannot see the pid first.
        let mut table = self.table();
        let mut child = cmd.spawn().map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => AgentError::invalid(format!("program {:?} not found", spec.argv[0])),
            std::io::ErrorKind::PermissionDenied => {
                AgentError::permission(format!("program {:?} is not executable by {}", spec.argv[0], user.name))
            }
            _ => AgentError::internal(format!("spawn {:?}: {e}", spec.argv[0])),
        })?;
        drop(cmd); // closes our copies of the PTY slave
        let pid = child.id();
        let (exit_tx, exit_rx) = oneshot::channel();
        table.waiters.insert(pid, exit_tx);
        table.next_id += 1;
        let id = table.next_id;

        let pty = match pty_master {
            Some(m) => {
                set_nonblocking(m.as_raw_fd())?;
                // SAFETY: the AsyncFd owns the master fd for its whole life.
                Some(Arc::new(unsafe { AsyncFd::register(m) }.map_err(std::io::Error::from)?))
            }
            None => None,
        };
        let stdin = if let Some(master) = &pty {
            Some(Stdin::Pty(master.clone()))
        } else {
            match child.stdin.take() {
                Some(s) => Some(Stdin::Pipe(tokio::net::unix::pipe::Sender::from_owned_fd(
                    OwnedFd::from(s),
                )?)),
                None => None,
            }
        };
        let info = ProcessInfo {
            id,
            pid,
            tag: spec.tag.clone(),
            argv: spec.argv.clone(),
            cwd,
            user: user.name.clone(),
            pty: pty.is_some(),
            stdin: spec.stdin || pty.is_some(),
            state: ProcessState::Running,
            exit: None,
            started_at_ms: now_ms(),
            ended_at_ms: None,
        };
        let proc = Arc::new(Proc {
            id,
            pid,
            info: Mutex::new(info.clone()),
            log: Mutex::new(Log::default()),
            seq_tx: watch::channel(0).0,
            stdin: tokio::sync::Mutex::new(stdin),
            pty: pty.clone(),
        });
        table.procs.insert(id, proc.clone());
        drop(table);

        let mut pumps = Vec::new();
        if let Some(master) = pty {
            pumps.push(tokio::spawn(pump_pty(proc.clone(), master)));
        } else {
            if let Some(out) = child.stdout.take() {
                let rx = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(out))?;
                pumps.push(tokio::spawn(pump_pipe(proc.clone(), rx, false)));
            }
            if let Some(err) = child.stderr.take() {
                let rx = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(err))?;
                pumps.push(tokio::spawn(pump_pipe(proc.clone(), rx, true)));
            }
        }
        let table = self.clone();
        tokio::spawn(supervise(
            table,
            proc,
            exit_rx,
            spec.timeout_ms.map(Duration::from_millis),
            pumps,
        ));
        Ok(info)
    }

    fn forget_old(&self, id: u64) {
        let mut t = self.table();
        t.finished.push_back(id);
        let retained = |t: &Table| -> usize {
            t.finished
                .iter()
                .filter_map(|id| t.procs.get(id))
                .map(|p| p.log.lock().unwrap().bytes)
                .sum()
        };
        while t.finished.len() > FINISHED_KEPT || (t.finished.len() > 1 && retained(&t) > FINISHED_OUTPUT_BUDGET) {
            if let Some(old) = t.finished.pop_front() {
                t.procs.remove(&old);
            }
        }
    }
}

fn set_nonblocking(fd: i32) -> std::io::Result<()> {
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

async fn pump_pipe(proc: Arc<Proc>, mut rx: tokio::net::unix::pipe::Receiver, is_stderr: bool) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        match rx.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let data = Bytes::copy_from_slice(&buf[..n]);
                proc.append(if is_stderr {
                    EventKind::Stderr(data)
                } else {
                    EventKind::Stdout(data)
                });
            }
        }
    }
}

async fn pump_pty(proc: Arc<Proc>, master: Arc<AsyncFd<OwnedFd>>) {
    let mut buf = vec![0u8; READ_CHUNK.min(MAX_PAYLOAD)];
    loop {
        let Ok(mut guard) = master.readable().await else { return };
        let res = guard.try_io(|inner| {
            let n = unsafe { libc::read(inner.get_ref().as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match res {
            Err(_would_block) => continue,
            // EIO once the last slave fd closes: the terminal is gone.
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Ok(Ok(n)) => proc.append(EventKind::Stdout(Bytes::copy_from_slice(&buf[..n]))),
        }
    }
}

async fn supervise(
    table: Processes,
    proc: Arc<Proc>,
    exit_rx: oneshot::Receiver<WaitStatus>,
    timeout: Option<Duration>,
    pumps: Vec<tokio::task::JoinHandle<()>>,
) {
    let mut timed_out = false;
    let mut exit_rx = exit_rx;
    let status = match timeout {
        None => exit_rx.await.ok(),
        Some(limit) => tokio::select! {
            s = &mut exit_rx => s.ok(),
            _ = tokio::time::sleep(limit) => {
                timed_out = true;
                let _ = killpg(Pid::from_raw(proc.pid as i32), Signal::SIGKILL);
                let _ = kill(Pid::from_raw(proc.pid as i32), Signal::SIGKILL);
                exit_rx.await.ok()
            }
        },
    };
    let drain = futures_util::future::join_all(pumps);
    if tokio::time::timeout(DRAIN_GRACE, drain).await.is_err() {
        // A descendant still holds the output open; what it writes later is not this process's.
    }
    let exit = match status {
        Some(WaitStatus::Exited(_, code)) => ExitStatus {
            exit_code: Some(code),
            signal: None,
            timed_out,
        },
        Some(WaitStatus::Signaled(_, sig, _)) => ExitStatus {
            exit_code: None,
            signal: Some(sig as i32),
            timed_out,
        },
        _ => ExitStatus {
            exit_code: None,
            signal: None,
            timed_out,
        },
    };
    *proc.stdin.lock().await = None;
    {
        let mut info = proc.info.lock().unwrap();
        info.state = ProcessState::Exited;
        info.exit = Some(exit.clone());
        info.ended_at_ms = Some(now_ms());
    }
    {
        let mut log = proc.log.lock().unwrap();
        let seq = log.push(EventKind::Exit(exit));
        log.finished = true;
        drop(log);
        proc.seq_tx.send_replace(seq);
    }
    table.forget_old(proc.id);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn spec(argv: &[&str]) -> ProcessSpec {
        ProcessSpec {
            argv: argv.iter().map(|a| a.to_string()).collect(),
            cwd: Some("/".into()),
            ..Default::default()
        }
    }

    /// A program that does not exist is reported as such every time, while the SIGCHLD reaper
    /// runs: the reaper must not take the failed child `Command::spawn` waits for (std panics
    /// then, under the table lock, and every later spawn failed).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_missing_program_is_an_error_every_time_while_the_reaper_runs() {
        let processes = Processes::default();
        let stop = Arc::new(AtomicBool::new(false));
        let reaper = {
            let (processes, stop) = (processes.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    processes.reap();
                }
            })
        };
        for _ in 0..300 {
            let err = processes.spawn(spec(&["airlock-no-such-program"])).unwrap_err();
            assert_eq!(err.code, airlock_proto::ErrorCode::InvalidArgument, "{}", err.message);
        }
        let started = processes
            .spawn(spec(&["true"]))
            .expect("a program that exists still starts");
        assert!(started.id > 0);
        stop.store(true, Ordering::Relaxed);
        reaper.join().unwrap();
    }
}
