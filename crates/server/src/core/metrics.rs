//! Sandboxes' resource metrics over time: the server samples every running sandbox's agent
//! every [`SAMPLE_EVERY`] and keeps a bounded history per sandbox ([`MAX_AGE`],
//! [`MAX_SAMPLES`]), dropped when the sandbox ends, so a caller can ask for a window
//! (E2B's `GET /sandboxes/{id}/metrics?start=&end=`).

use super::Core;
use crate::error::{CoreError, CoreResult, Kind};
use crate::model::SandboxState;
use crate::records::SandboxRecord;
use airlock_proto::Metrics;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// How often each running sandbox is sampled (E2B exports a sandbox's metrics every 5 s).
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// The oldest sample kept.
pub const MAX_AGE: Duration = Duration::from_secs(3600);
/// Most samples kept per sandbox (an hour at [`SAMPLE_EVERY`]).
pub const MAX_SAMPLES: usize = 720;
/// How long one sample may take before that sandbox is skipped for the round.
const SAMPLE_WITHIN: Duration = Duration::from_secs(4);

/// One sample of a sandbox's metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Milliseconds since the Unix epoch.
    pub at_ms: i64,
    pub metrics: Metrics,
}

/// Every sandbox's recent samples.
#[derive(Default)]
pub struct MetricsHistory {
    map: Mutex<HashMap<String, VecDeque<Sample>>>,
    sampling: AtomicBool,
}

impl MetricsHistory {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, VecDeque<Sample>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Record a sample; what is past [`MAX_AGE`] (before `at_ms`) or [`MAX_SAMPLES`] goes.
    pub fn record(&self, id: &str, sample: Sample) {
        let mut map = self.lock();
        let q = map.entry(id.to_string()).or_default();
        // Samples stay in time order (a clock stepping back drops what now looks later).
        while q.back().is_some_and(|s| s.at_ms > sample.at_ms) {
            q.pop_back();
        }
        let oldest = sample.at_ms - MAX_AGE.as_millis() as i64;
        q.push_back(sample);
        while q.len() > MAX_SAMPLES || q.front().is_some_and(|s| s.at_ms < oldest) {
            q.pop_front();
        }
    }

    pub fn newest(&self, id: &str) -> Option<Sample> {
        self.lock().get(id).and_then(|q| q.back().cloned())
    }

    /// The samples from `start_ms` to `end_ms` (both included); with a `step` coarser than
    /// [`SAMPLE_EVERY`], at most one per step (the newest of each step-long bucket from
    /// `start_ms`). At the sampling period itself every sample stays: samples are not aligned
    /// to buckets, and two a period apart must not fall into one.
    pub fn window(&self, id: &str, start_ms: i64, end_ms: i64, step: Duration) -> Vec<Sample> {
        let step = if step <= SAMPLE_EVERY {
            1
        } else {
            step.as_millis() as i64
        };
        let map = self.lock();
        let mut out: Vec<Sample> = Vec::new();
        let mut last_bucket = None;
        for s in map.get(id).into_iter().flatten() {
            if s.at_ms < start_ms || s.at_ms > end_ms {
                continue;
            }
            let bucket = (s.at_ms - start_ms) / step;
            if last_bucket == Some(bucket) {
                out.pop();
            }
            last_bucket = Some(bucket);
            out.push(s.clone());
        }
        out
    }

    pub fn remove(&self, id: &str) {
        self.lock().remove(id);
    }

    /// Keep only the histories of `live` sandboxes.
    fn retain(&self, live: &std::collections::HashSet<String>) {
        self.lock().retain(|id, _| live.contains(id));
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// E2B's step for a window of this length: 5 s below an hour, then coarser.
pub fn step_for(window: Duration) -> Duration {
    let h = 3600;
    Duration::from_secs(match window.as_secs() {
        s if s < h => 5,
        s if s < 6 * h => 30,
        s if s < 12 * h => 60,
        s if s < 24 * h => 120,
        s if s < 7 * 24 * h => 300,
        _ => 900,
    })
}

impl Core {
    /// Sample every running sandbox every [`SAMPLE_EVERY`] for as long as the core lives, and
    /// drop the history of every sandbox that ends. Once; later calls do nothing.
    pub fn spawn_metrics_sampler(&self) {
        if self.metrics.sampling.swap(true, Ordering::AcqRel) {
            return;
        }
        let core = self.clone();
        // The task holds the core but not the history: it ends once the history is gone.
        self.engine.follow_ended(
            Arc::downgrade(&self.metrics),
            Duration::ZERO,
            SAMPLE_EVERY,
            |history, id| history.remove(id),
            move |history| {
                drop(history);
                let core = core.clone();
                async move { core.sample_all().await }
            },
        );
    }

    /// One round: a sample of each running sandbox (at once, each within [`SAMPLE_WITHIN`]);
    /// histories of sandboxes no longer live go.
    async fn sample_all(&self) {
        let Ok(live) = self.store.live_sandboxes().await else {
            return;
        };
        self.metrics.retain(&live.iter().map(|r| r.id.clone()).collect());
        let running = live.into_iter().filter(|r| r.state == SandboxState::Running);
        futures_util::future::join_all(running.map(|row| async move {
            let _ = tokio::time::timeout(SAMPLE_WITHIN, self.sample(&row.id)).await;
        }))
        .await;
    }

    /// Sample one running sandbox now and record it.
    async fn sample(&self, id: &str) -> CoreResult<Sample> {
        let agent = self.nodes.agent(id).await.map_err(|e| CoreError::node(id, e))?;
        let metrics = agent
            .metrics()
            .await
            .map_err(|e| CoreError::agent(Kind::Sandbox, id, e))?;
        let sample = Sample {
            at_ms: crate::records::now_ms(),
            metrics,
        };
        // A sandbox that ended meanwhile keeps no history.
        if self.engine.recovering(id)
            || self
                .store
                .sandbox_by_id(id)
                .await
                .ok()
                .flatten()
                .is_some_and(|r| r.state.is_held_or_running())
        {
            self.metrics.record(id, sample.clone());
        }
        Ok(sample)
    }

    /// A live sandbox's metrics from `start` to `end` (Unix seconds, both included; by default
    /// from its creation to now), as sampled. A running sandbox whose newest sample is older
    /// than [`SAMPLE_EVERY`] is sampled now, so a fresh one has a sample at once.
    pub async fn sandbox_metrics(
        &self,
        row: &SandboxRecord,
        start: Option<i64>,
        end: Option<i64>,
    ) -> CoreResult<Vec<Sample>> {
        let now = crate::records::now_ms();
        let start_ms = start.map(secs_to_ms).unwrap_or(row.created_at_ms);
        // By default to the end of its life: everything sampled (on demand, below, too).
        let end_ms = end.map(|e| secs_to_ms(e).saturating_add(999)).unwrap_or(i64::MAX);
        if start_ms > end_ms {
            return Err(CoreError::invalid("start", "start time cannot be after end time"));
        }
        if row.state == SandboxState::Running
            && end_ms >= now - SAMPLE_EVERY.as_millis() as i64
            && self
                .metrics
                .newest(&row.id)
                .is_none_or(|s| s.at_ms < now - SAMPLE_EVERY.as_millis() as i64)
        {
            match self.sample(&row.id).await {
                Ok(_) => {}
                // No history yet and the agent does not answer: say why.
                Err(e) if self.metrics.newest(&row.id).is_none() => return Err(e),
                Err(_) => {}
            }
        }
        let step = step_for(Duration::from_millis((end_ms.min(now) - start_ms).max(0) as u64));
        Ok(self.metrics.window(&row.id, start_ms, end_ms, step))
    }
}

/// Unix seconds as milliseconds, saturating (a hostile `start` or `end` never wraps).
fn secs_to_ms(s: i64) -> i64 {
    s.saturating_mul(1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(cpu: f64) -> Metrics {
        Metrics {
            cpu_count: 1,
            cpu_used_pct: cpu,
            mem_total_bytes: 1,
            mem_used_bytes: 1,
            disk_total_bytes: 1,
            disk_used_bytes: 1,
        }
    }

    #[test]
    fn history_is_bounded_in_age_and_count_and_windows_select() {
        let h = MetricsHistory::default();
        let t0 = 1_000_000_000_000;
        for i in 0..(MAX_SAMPLES as i64 + 50) {
            h.record(
                "a",
                Sample {
                    at_ms: t0 + i * 5000,
                    metrics: m(i as f64),
                },
            );
        }
        let all = h.window("a", 0, i64::MAX, Duration::from_secs(5));
        assert_eq!(all.len(), MAX_SAMPLES);
        assert_eq!(all[0].metrics.cpu_used_pct, 50.0);
        // Older than an hour before the newest: gone, however few samples there are.
        h.record(
            "b",
            Sample {
                at_ms: t0,
                metrics: m(1.0),
            },
        );
        h.record(
            "b",
            Sample {
                at_ms: t0 + MAX_AGE.as_millis() as i64 + 1,
                metrics: m(2.0),
            },
        );
        assert_eq!(h.window("b", 0, i64::MAX, Duration::from_secs(5)).len(), 1);
        // A window picks what lies within, both ends included.
        let last = all.last().unwrap().at_ms;
        let w = h.window("a", last - 10_000, last - 5000, Duration::from_secs(5));
        assert_eq!(
            w.iter().map(|s| s.at_ms).collect::<Vec<_>>(),
            vec![last - 10_000, last - 5000]
        );
        // A coarser step keeps the newest sample of each bucket.
        let w = h.window("a", last - 59_999, last, Duration::from_secs(30));
        assert_eq!(w.len(), 2);
        assert_eq!(w[1].at_ms, last);
        h.remove("a");
        assert!(h.window("a", 0, i64::MAX, Duration::from_secs(5)).is_empty());
        assert_eq!(step_for(Duration::from_secs(3599)), Duration::from_secs(5));
        assert_eq!(step_for(Duration::from_secs(3600)), Duration::from_secs(30));
    }
}
