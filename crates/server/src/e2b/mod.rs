//! The E2B door: the E2B control-plane API and envd (Connect RPC, `/files`, `/health`) on the
//! same listener as `/v1`, translated onto the core's services (the wire as E2B's Python SDK and
//! e2b-dev/infra's `spec/openapi.yml` and `packages/envd/spec/` have it). Errors: `E2bError`
//! (control plane and `/files`: `{"code": <int>, "message"}`) and `connect::RpcError` (Connect),
//! each made from a `CoreError` in one place. It may use the core only: no store, engine, node or
//! runtime handle.

pub mod connect;
pub mod control;
pub mod envd;
mod error;

pub use error::E2bError;

use crate::core::Core;
use connect::RpcError;
use envd::messages::FilesystemEvent;
use futures_util::{Stream, StreamExt};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// envd version we report; the SDK gates features on it (octet-stream uploads need >= 0.5.7).
pub const ENVD_VERSION: &str = "0.6.13";

/// What the E2B door's handlers share.
#[derive(Clone)]
pub struct E2bState {
    pub core: Core,
    /// The polling file watchers of envd's `CreateWatcher`.
    pub watchers: Arc<Watchers>,
    /// The E2B domain (`api.<domain>`, `<port>-<id>.<domain>`) returned to SDKs, if configured.
    pub domain: Option<Arc<str>>,
}

/// The events one watcher keeps until `GetWatcherEvents` takes them.
pub const MAX_WATCH_EVENTS: usize = 10_000;
/// The bytes (as JSON) one watcher keeps: a guest's events are up to 64 KiB each, so the count
/// alone would let one unpolled watcher hold 640 MiB.
pub const MAX_WATCH_BYTES: usize = 8 << 20;
/// Watchers one sandbox may hold at once; the next `CreateWatcher` is `resource_exhausted`.
pub const MAX_WATCHERS_PER_SANDBOX: usize = 64;
/// How often watchers are checked against the store besides the engine's end-of-sandbox news.
const WATCHER_SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Polling watchers (`CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher`). Each buffers at
/// most [`MAX_WATCH_EVENTS`] and [`MAX_WATCH_BYTES`] (the oldest go first), a sandbox holds at most
/// [`MAX_WATCHERS_PER_SANDBOX`], and a sandbox's watchers go when it ends (the engine's
/// [`Core::follow_ended`], and a periodic sweep).
#[derive(Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, Watcher>>,
    /// Whether the task that removes the watchers of ended sandboxes runs.
    listening: AtomicBool,
}

struct Watcher {
    sandbox_id: String,
    queue: Arc<Mutex<WatchQueue>>,
    task: tokio::task::JoinHandle<()>,
}

/// A watcher's events, bounded in count and bytes: on overflow the oldest go, and are counted.
/// envd's polling API has no way to say events were lost, so the count is only logged.
#[derive(Default)]
struct WatchQueue {
    /// Each event with its size as JSON.
    events: VecDeque<(FilesystemEvent, usize)>,
    bytes: usize,
    lost: u64,
}

impl WatchQueue {
    fn push(&mut self, ev: FilesystemEvent, watcher: &str) {
        let size = serde_json::to_vec(&ev).map_or(0, |v| v.len());
        while !self.events.is_empty() && (self.events.len() >= MAX_WATCH_EVENTS || self.bytes + size > MAX_WATCH_BYTES)
        {
            if let Some((_, gone)) = self.events.pop_front() {
                self.bytes -= gone;
            }
            if self.lost == 0 {
                tracing::warn!(watcher, "watcher not polled; dropping its oldest events");
            }
            self.lost += 1;
        }
        self.bytes += size;
        self.events.push_back((ev, size));
    }

    /// Every event kept, oldest first; the queue is empty after.
    fn take(&mut self) -> Vec<FilesystemEvent> {
        self.bytes = 0;
        std::mem::take(&mut self.events).into_iter().map(|(ev, _)| ev).collect()
    }
}

fn no_room() -> RpcError {
    RpcError::new(
        connect::Code::ResourceExhausted,
        format!("a sandbox holds at most {MAX_WATCHERS_PER_SANDBOX} watchers; remove one first"),
    )
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Watchers {
    /// A new watcher of `sandbox_id` fed by `events`; its id. Starts
    /// the cleanup of ended sandboxes' watchers on first use.
    pub fn create<S>(self: &Arc<Self>, core: &Core, sandbox_id: &str, events: S) -> Result<String, RpcError>
    where
        S: Stream<Item = FilesystemEvent> + Send + 'static,
    {
        self.listen(core);
        self.insert(sandbox_id, events)
    }

    /// Whether `sandbox_id` may have another watcher (checked again by `create`).
    pub fn check_room(&self, sandbox_id: &str) -> Result<(), RpcError> {
        if self.count(sandbox_id) >= MAX_WATCHERS_PER_SANDBOX {
            return Err(no_room());
        }
        Ok(())
    }

    fn insert<S>(&self, sandbox_id: &str, events: S) -> Result<String, RpcError>
    where
        S: Stream<Item = FilesystemEvent> + Send + 'static,
    {
        let mut map = lock(&self.map);
        if map.values().filter(|w| w.sandbox_id == sandbox_id).count() >= MAX_WATCHERS_PER_SANDBOX {
            return Err(no_room());
        }
        let id = crate::core::random_id("w", 8);
        let queue = Arc::new(Mutex::new(WatchQueue::default()));
        let sink = queue.clone();
        let name = id.clone();
        let task = tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(ev) = events.next().await {
                lock(&sink).push(ev, &name);
            }
        });
        map.insert(
            id.clone(),
            Watcher {
                sandbox_id: sandbox_id.to_string(),
                queue,
                task,
            },
        );
        Ok(id)
    }

    /// Take the events of `sandbox_id`'s watcher `id`; `None` when it has no such watcher.
    pub fn take_events(&self, sandbox_id: &str, id: &str) -> Option<Vec<FilesystemEvent>> {
        let map = lock(&self.map);
        let w = map.get(id).filter(|w| w.sandbox_id == sandbox_id)?;
        let events = lock(&w.queue).take();
        Some(events)
    }

    /// Stop and forget `sandbox_id`'s watcher `id`; false when it has no such watcher.
    pub fn remove(&self, sandbox_id: &str, id: &str) -> bool {
        let mut map = lock(&self.map);
        if map.get(id).is_none_or(|w| w.sandbox_id != sandbox_id) {
            return false;
        }
        if let Some(w) = map.remove(id) {
            w.task.abort();
        }
        true
    }

    /// Stop and forget every watcher of `sandbox_id`; how many there were.
    pub fn remove_sandbox(&self, sandbox_id: &str) -> usize {
        let mut map = lock(&self.map);
        let before = map.len();
        map.retain(|_, w| {
            let keep = w.sandbox_id != sandbox_id;
            if !keep {
                w.task.abort();
            }
            keep
        });
        before - map.len()
    }

    /// The watchers `sandbox_id` holds.
    pub fn count(&self, sandbox_id: &str) -> usize {
        lock(&self.map).values().filter(|w| w.sandbox_id == sandbox_id).count()
    }

    /// Remove the watchers of every sandbox that is no longer running or paused.
    async fn sweep(&self, core: &Core) {
        let ids: HashSet<String> = lock(&self.map).values().map(|w| w.sandbox_id.clone()).collect();
        for id in ids {
            let live = match core.sandbox_is_live(&id).await {
                Ok(live) => live,
                Err(_) => continue, // the store will answer next time
            };
            if !live {
                self.remove_sandbox(&id);
            }
        }
    }

    /// Once: follow the engine's ended sandboxes (and sweep now and then) for as long as these
    /// watchers exist.
    fn listen(self: &Arc<Self>, core: &Core) {
        if self.listening.swap(true, Ordering::AcqRel) {
            return;
        }
        let sweeper = core.clone();
        core.follow_ended(
            Arc::downgrade(self),
            Duration::ZERO,
            WATCHER_SWEEP_EVERY,
            |watchers, id| {
                watchers.remove_sandbox(id);
            },
            move |watchers: Arc<Self>| {
                let core = sweeper.clone();
                async move { watchers.sweep(&core).await }
            },
        );
    }
}

impl Drop for Watchers {
    fn drop(&mut self) {
        for w in lock(&self.map).values() {
            w.task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envd::messages::EventType;

    fn ev(name: impl Into<String>) -> FilesystemEvent {
        FilesystemEvent {
            name: name.into(),
            event_type: EventType::Create,
            entry: None,
        }
    }

    fn names<'a>(events: impl IntoIterator<Item = &'a FilesystemEvent>) -> Vec<&'a str> {
        events.into_iter().map(|e| e.name.as_str()).collect()
    }

    #[test]
    fn a_watchers_queue_keeps_the_newest_events() {
        let mut q = WatchQueue::default();
        for i in 0..MAX_WATCH_EVENTS + 5 {
            q.push(ev(i.to_string()), "w1");
        }
        assert_eq!(q.events.len(), MAX_WATCH_EVENTS);
        assert_eq!(q.lost, 5);
        assert_eq!(q.events.front().map(|e| e.0.name.as_str()), Some("5"));
        assert_eq!(
            q.events.back().map(|e| e.0.name.clone()),
            Some((MAX_WATCH_EVENTS + 4).to_string())
        );
    }

    #[test]
    fn a_watchers_queue_is_capped_in_bytes() {
        // Events as large as the agent sends them (a 64 KiB line): far fewer than the count cap
        // fill the byte cap, and the oldest go first as they do past the count.
        let big = |i: usize| ev(format!("{i}/{}", "x".repeat(64 << 10)));
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
        assert_eq!(q.events.back().map(|e| e.0.name.clone()), Some(big(n - 1).name));
        // Taking the events frees their bytes: the queue fills again from empty.
        let taken = q.take();
        assert_eq!(taken.len() as u64 + q.lost, n as u64);
        q.push(big(n), "w1");
        assert_eq!(q.events.len(), 1);
    }

    #[tokio::test]
    async fn watchers_are_capped_per_sandbox_and_go_with_it() {
        let w = Watchers::default();
        let mut ids = Vec::new();
        for _ in 0..MAX_WATCHERS_PER_SANDBOX {
            ids.push(w.insert("sb1", futures_util::stream::pending()).unwrap());
        }
        let err = w.insert("sb1", futures_util::stream::pending()).unwrap_err();
        assert_eq!(err.code, connect::Code::ResourceExhausted);
        assert_eq!(w.check_room("sb1").unwrap_err().code, connect::Code::ResourceExhausted);
        // Another sandbox has its own room.
        let other = w.insert("sb2", futures_util::stream::iter([ev("a")])).unwrap();
        // A watcher is only its own sandbox's.
        assert!(w.take_events("sb1", &other).is_none());
        assert!(!w.remove("sb1", &other));
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(w.take_events("sb2", &other).as_ref().map(names), Some(vec!["a"]));
        assert_eq!(w.take_events("sb2", &other).map(|e| e.len()), Some(0));
        // Removing one makes room again.
        assert!(w.remove("sb1", &ids[0]));
        w.insert("sb1", futures_util::stream::pending()).unwrap();
        // The sandbox's end takes all of its watchers and stops their tasks.
        let tasks: Vec<_> = {
            let map = lock(&w.map);
            map.values()
                .filter(|x| x.sandbox_id == "sb1")
                .map(|x| x.task.abort_handle())
                .collect()
        };
        assert_eq!(w.remove_sandbox("sb1"), MAX_WATCHERS_PER_SANDBOX);
        assert_eq!(w.count("sb1"), 0);
        assert_eq!(w.count("sb2"), 1);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(tasks.iter().all(|t| t.is_finished()));
    }
}
