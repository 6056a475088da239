//! The fake guest's state: its users, in-memory file system, processes and power.

use super::reply::ApiErr;
use super::*;
use crate::datadir::random_hex;
use crate::error::Result;
use crate::vmm::VmSpec;
use airlock_proto::frame::{Event, EventKind, MAX_PAYLOAD};
use airlock_proto::{ExitStatus, ProcessInfo, ProcessState};
use bytes::Bytes;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, watch};

pub(super) struct Guest {
    pub(super) pid: u32,
    pub(super) boot_id: String,
    pub(super) started: Instant,
    pub(super) vcpu: u32,
    pub(super) memory_mib: u32,
    pub(super) disk_mib: u32,
    pub(super) paused: watch::Sender<bool>,
    /// Write end of the VM process's stdin; dropping it powers the VM off.
    pub(super) power: Mutex<Option<std::io::PipeWriter>>,
    pub(super) procs: Mutex<Procs>,
    pub(super) fs: Mutex<BTreeMap<PathBuf, Node>>,
    pub(super) hostile: Mutex<Option<Hostile>>,
    /// File bytes received by uploads so far, finished or not (see [`uploaded_bytes`]).
    pub(super) uploaded: AtomicU64,
}

#[derive(Default)]
pub(super) struct Procs {
    pub(super) next_id: u64,
    pub(super) table: BTreeMap<u64, Arc<FakeProc>>,
}

#[derive(Clone)]
pub(super) struct Node {
    pub(super) dir: bool,
    pub(super) data: Bytes,
    pub(super) mode: u32,
    pub(super) owner: String,
    pub(super) modified_ms: u64,
    /// User metadata (the real agent's `user.e2b.*` xattrs).
    pub(super) metadata: BTreeMap<String, String>,
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Node {
    pub(super) fn dir(owner: &str) -> Self {
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
pub(super) const USERS: &[(&str, u32, &str)] = &[("root", 0, "/root"), ("user", 1000, "/home/user")];

pub(super) fn user(name: &str) -> Result<(&'static str, u32, &'static str), ApiErr> {
    USERS
        .iter()
        .find(|(n, _, _)| *n == name)
        .copied()
        .ok_or_else(|| ApiErr::invalid(format!("no user named {name:?} in the sandbox")))
}

impl Guest {
    pub(super) fn new(spec: &VmSpec, pid: u32, power: std::io::PipeWriter) -> Self {
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

    pub(super) fn hostile(&self) -> Option<Hostile> {
        *self.hostile.lock().unwrap()
    }

    pub(super) fn power_off(&self) {
        if let Some(mut w) = self.power.lock().unwrap().take() {
            let _ = w.write_all(b"poweroff\n");
        }
    }

    pub(super) async fn wait_running(&self) {
        let mut rx = self.paused.subscribe();
        while *rx.borrow_and_update() {
            if rx.changed().await.is_err() {
                return;
            }
        }
    }
}

pub(super) enum Ctl {
    Stdin(Bytes),
    CloseStdin,
    Signal(i32),
}

pub(super) struct FakeProc {
    pub(super) info: Mutex<ProcessInfo>,
    /// The event log and whether it is finished.
    pub(super) log: Mutex<(Vec<Event>, bool)>,
    pub(super) seq: watch::Sender<u64>,
    pub(super) ctl: mpsc::UnboundedSender<Ctl>,
    pub(super) merge_stderr: bool,
}

impl FakeProc {
    pub(super) fn info(&self) -> ProcessInfo {
        self.info.lock().unwrap().clone()
    }

    pub(super) fn stdin(&self, ctl: Ctl) -> Result<(), ApiErr> {
        let info = self.info();
        if !(info.stdin || info.pty) || info.state == ProcessState::Exited {
            return Err(ApiErr::invalid("stdin of this process is closed or was not requested"));
        }
        self.ctl
            .send(ctl)
            .map_err(|_| ApiErr::invalid("stdin of this process is closed or was not requested"))
    }

    pub(super) fn push(&self, kind: EventKind) {
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

    pub(super) fn output(&self, stderr: bool, data: &[u8]) {
        for chunk in data.chunks(MAX_PAYLOAD) {
            let b = Bytes::copy_from_slice(chunk);
            self.push(if stderr && !self.merge_stderr {
                EventKind::Stderr(b)
            } else {
                EventKind::Stdout(b)
            });
        }
    }

    pub(super) fn finish(&self, exit: ExitStatus) {
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
    pub(super) async fn next_events(&self, seq: u64) -> Option<Vec<Event>> {
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
