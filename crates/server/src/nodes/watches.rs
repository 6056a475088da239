//! Polling watches a node keeps for its VMs (what E2B's `CreateWatcher`, `GetWatcherEvents` and
//! `RemoveWatcher` need): a watch's events wait on the VM's node until a caller takes them, so
//! a poll through any replica finds them (envd keeps them in the sandbox; one replica's memory
//! would split them between replicas and lose them with it). A watch keeps at most
//! [`MAX_WATCH_EVENTS`] and [`MAX_WATCH_BYTES`] (the oldest go first), a VM holds at most
//! [`MAX_WATCHES_PER_VM`], and a VM's watches go with it.

use super::NodeError;
use airlock_agent_client::{AgentClient, AgentError};
use airlock_proto::{ErrorCode, WatchEvent};
use futures_util::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// The events one watch keeps until they are taken.
pub const MAX_WATCH_EVENTS: usize = 10_000;
/// The bytes (as JSON) one watch keeps: a guest's events are up to 64 KiB each, so the count
/// alone would let one unpolled watch hold 640 MiB.
pub const MAX_WATCH_BYTES: usize = 8 << 20;
/// Watches one VM may hold at once.
pub const MAX_WATCHES_PER_VM: usize = 64;

/// What to watch: a directory in the guest (absolute), its subdirectories too with
/// `recursive`, each create, write and chmod with the entry's stat with `entries`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WatchSpec {
    pub path: String,
    pub recursive: bool,
    pub entries: bool,
}

/// What a take of a watch's events answers: the directory it watches (the events' paths are
/// absolute) and its events since the last take, oldest first.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Taken {
    pub path: String,
    pub events: Vec<WatchEvent>,
}

/// How a watch's start went, short of the node failing.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum WatchStart {
    Started {
        watch: String,
    },
    /// The VM holds [`MAX_WATCHES_PER_VM`] watches already: stop one first.
    Full {
        limit: usize,
    },
    /// The guest's agent refused the path (missing, not a directory): its answer.
    Refused {
        status: u16,
        code: ErrorCode,
        message: String,
    },
}

/// The watches of a node's VMs.
#[derive(Default)]
pub struct Watches {
    map: Mutex<HashMap<String, Watch>>,
}

struct Watch {
    vm: String,
    path: String,
    queue: Arc<Mutex<WatchQueue>>,
    task: tokio::task::JoinHandle<()>,
}

/// A watch's events, bounded in count and bytes: on overflow the oldest go, and are counted
/// (the polling API has no way to say events were lost, so the count is only logged).
#[derive(Default)]
struct WatchQueue {
    /// Each event with its size as JSON.
    events: VecDeque<(WatchEvent, usize)>,
    bytes: usize,
    lost: u64,
}

impl WatchQueue {
    fn push(&mut self, ev: WatchEvent, watch: &str) {
        let size = serde_json::to_vec(&ev).map_or(0, |v| v.len());
        while !self.events.is_empty() && (self.events.len() >= MAX_WATCH_EVENTS || self.bytes + size > MAX_WATCH_BYTES)
        {
            if let Some((_, gone)) = self.events.pop_front() {
                self.bytes -= gone;
            }
            if self.lost == 0 {
                tracing::warn!(watch, "watch not polled; dropping its oldest events");
            }
            self.lost += 1;
        }
        self.bytes += size;
        self.events.push_back((ev, size));
    }

    /// Every event kept, oldest first; the queue is empty after.
    fn take(&mut self) -> Vec<WatchEvent> {
        self.bytes = 0;
        std::mem::take(&mut self.events).into_iter().map(|(ev, _)| ev).collect()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Watches {
    /// Watch `spec` in VM `vm` through its `agent`.
    pub async fn start(&self, vm: &str, agent: &AgentClient, spec: &WatchSpec) -> Result<WatchStart, NodeError> {
        if self.count(vm) >= MAX_WATCHES_PER_VM {
            return Ok(WatchStart::Full {
                limit: MAX_WATCHES_PER_VM,
            });
        }
        let events = match agent.watch_with_entries(&spec.path, spec.recursive, spec.entries).await {
            Ok(events) => events,
            Err(AgentError::Api { status, code, message }) => return Ok(WatchStart::Refused { status, code, message }),
            Err(e) => return Err(NodeError::Failed(Box::new(e))),
        };
        // The stream ends at the agent's first error (the VM went, or was paused).
        let events = events
            .take_while(|ev| std::future::ready(ev.is_ok()))
            .filter_map(|ev| std::future::ready(ev.ok()));
        Ok(self.insert(vm, &spec.path, events))
    }

    fn insert<S>(&self, vm: &str, path: &str, events: S) -> WatchStart
    where
        S: Stream<Item = WatchEvent> + Send + 'static,
    {
        let mut map = lock(&self.map);
        if map.values().filter(|w| w.vm == vm).count() >= MAX_WATCHES_PER_VM {
            return WatchStart::Full {
                limit: MAX_WATCHES_PER_VM,
            };
        }
        let id = crate::core::random_id("w", 8);
        let queue = Arc::new(Mutex::new(WatchQueue::default()));
        let (sink, name) = (queue.clone(), id.clone());
        let task = tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(ev) = events.next().await {
                lock(&sink).push(ev, &name);
            }
        });
        map.insert(
            id.clone(),
            Watch {
                vm: vm.to_string(),
                path: path.to_string(),
                queue,
                task,
            },
        );
        WatchStart::Started { watch: id }
    }

    /// Take the events of VM `vm`'s watch `id`; `None` when it has no such watch.
    pub fn take(&self, vm: &str, id: &str) -> Option<Taken> {
        let map = lock(&self.map);
        let w = map.get(id).filter(|w| w.vm == vm)?;
        let events = lock(&w.queue).take();
        Some(Taken {
            path: w.path.clone(),
            events,
        })
    }

    /// Stop and forget VM `vm`'s watch `id`; false when it has no such watch.
    pub fn stop(&self, vm: &str, id: &str) -> bool {
        let mut map = lock(&self.map);
        if map.get(id).is_none_or(|w| w.vm != vm) {
            return false;
        }
        if let Some(w) = map.remove(id) {
            w.task.abort();
        }
        true
    }

    /// Stop and forget every watch of VM `vm` (it ended here); how many there were.
    pub fn end_vm(&self, vm: &str) -> usize {
        let mut map = lock(&self.map);
        let before = map.len();
        map.retain(|_, w| {
            let keep = w.vm != vm;
            if !keep {
                w.task.abort();
            }
            keep
        });
        before - map.len()
    }

    fn count(&self, vm: &str) -> usize {
        lock(&self.map).values().filter(|w| w.vm == vm).count()
    }
}

impl Drop for Watches {
    fn drop(&mut self) {
        for w in lock(&self.map).values() {
            w.task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use airlock_proto::WatchEventKind;
    use std::time::Duration;

    fn ev(path: impl Into<String>) -> WatchEvent {
        WatchEvent {
            kind: WatchEventKind::Create,
            path: path.into(),
            entry: None,
        }
    }

    fn paths(events: &[WatchEvent]) -> Vec<&str> {
        events.iter().map(|e| e.path.as_str()).collect()
    }

    #[test]
    fn a_watchs_queue_keeps_the_newest_events() {
        let mut q = WatchQueue::default();
        for i in 0..MAX_WATCH_EVENTS + 5 {
            q.push(ev(i.to_string()), "w1");
        }
        assert_eq!(q.events.len(), MAX_WATCH_EVENTS);
        assert_eq!(q.lost, 5);
        assert_eq!(q.events.front().map(|e| e.0.path.as_str()), Some("5"));
        assert_eq!(
            q.events.back().map(|e| e.0.path.clone()),
            Some((MAX_WATCH_EVENTS + 4).to_string())
        );
    }

    #[test]
    fn a_watchs_queue_is_capped_in_bytes() {
        // Events as large as the agent sends them (a 64 KiB line): far fewer than the count cap
        // fill the byte cap, and the oldest go first as they do past the count.
        let big = |i: usize| ev(format!("/{i}/{}", "x".repeat(64 << 10)));
        let n = 2 * MAX_WATCH_BYTES / (64 << 10);
        let mut q = WatchQueue::default();
        for i in 0..n {
            q.push(big(i), "w1");
        }
        assert!(q.events.len() < MAX_WATCH_EVENTS);
        let held: usize = q.events.iter().map(|e| serde_json::to_vec(&e.0).unwrap().len()).sum();
        assert!(held <= MAX_WATCH_BYTES, "{held} bytes held");
        assert!(
            held > MAX_WATCH_BYTES - (66 << 10),
            "{held} bytes held: the cap is used"
        );
        assert_eq!(q.lost as usize + q.events.len(), n);
        assert_eq!(q.events.back().map(|e| e.0.path.clone()), Some(big(n - 1).path));
        // Taking the events frees their bytes: the queue fills again from empty.
        let taken = q.take();
        assert_eq!(taken.len() as u64 + q.lost, n as u64);
        q.push(big(n), "w1");
        assert_eq!(q.events.len(), 1);
    }

    #[tokio::test]
    async fn watches_are_capped_per_vm_and_go_with_it() {
        let w = Watches::default();
        let started = |s: WatchStart| match s {
            WatchStart::Started { watch } => watch,
            other => panic!("{other:?}"),
        };
        let mut ids = Vec::new();
        for _ in 0..MAX_WATCHES_PER_VM {
            ids.push(started(w.insert("vm1", "/", futures_util::stream::pending())));
        }
        assert_eq!(
            w.insert("vm1", "/", futures_util::stream::pending()),
            WatchStart::Full {
                limit: MAX_WATCHES_PER_VM
            }
        );
        // Another VM has its own room; a watch is only its own VM's.
        let other = started(w.insert("vm2", "/", futures_util::stream::iter([ev("/a")])));
        assert!(w.take("vm1", &other).is_none());
        assert!(!w.stop("vm1", &other));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            w.take("vm2", &other).as_ref().map(|t| paths(&t.events)),
            Some(vec!["/a"])
        );
        assert_eq!(w.take("vm2", &other).map(|t| t.events.len()), Some(0));
        // Stopping one makes room again.
        assert!(w.stop("vm1", &ids[0]));
        started(w.insert("vm1", "/", futures_util::stream::pending()));
        // The VM's end takes all of its watches and stops their tasks.
        let tasks: Vec<_> = lock(&w.map)
            .values()
            .filter(|x| x.vm == "vm1")
            .map(|x| x.task.abort_handle())
            .collect();
        assert_eq!(w.end_vm("vm1"), MAX_WATCHES_PER_VM);
        assert_eq!(w.count("vm1"), 0);
        assert_eq!(w.count("vm2"), 1);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(tasks.iter().all(|t| t.is_finished()));
    }
}
