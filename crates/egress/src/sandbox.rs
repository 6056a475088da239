//! One sandbox's egress state: its fixed policy, its counters, its recent denials, its cap of
//! open proxied connections. Every decision goes through [`SandboxEgress::record`], which counts
//! it and logs it (sandbox, destination, verdict, rule: never payload, headers or paths): at INFO
//! within the sandbox's log limit, else at DEBUG with a summary line per window (`log_limit`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::denied::DeniedNames;
use crate::log_limit::{Kind, LogLimit, Suppressed};
use crate::policy::{Decision, Policy};

/// Per-sandbox bounds.
#[derive(Debug, Clone)]
pub struct SandboxLimits {
    /// Open proxied TCP connections at once; past it new ones are closed (and counted).
    pub max_connections: usize,
    /// DNS queries being answered at once; past it queries are dropped.
    pub max_dns_in_flight: usize,
    /// How many recent denials are kept.
    pub recent_denials: usize,
    /// Decisions (and failed dials or lookups) logged at INFO per `log_window`; the rest at DEBUG,
    /// summed up in one INFO line when the window is over.
    pub log_per_window: u32,
    pub log_window: Duration,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits {
            max_connections: 256,
            max_dns_in_flight: 64,
            recent_denials: 64,
            log_per_window: 10,
            log_window: Duration::from_secs(10),
        }
    }
}

/// Which door a decision came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Path {
    Dns,
    Tcp,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Denial {
    pub at_unix_ms: u64,
    pub path: Path,
    /// `name:port`, `ip:port`, or for DNS the name and type (`allowed.test A`).
    pub destination: String,
    pub rule: String,
}

// A sandbox's decisions so far; also the /v1 API's `EgressCounters` (feature `openapi`; a doc
// comment here would become its schema's description).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EgressCounters {
    pub tcp_allowed: u64,
    pub tcp_denied: u64,
    pub dns_allowed: u64,
    pub dns_denied: u64,
    /// Bytes passed from the sandbox to its destinations, and back (allowed connections'
    /// payload as relayed; DNS not counted).
    #[serde(default)]
    pub bytes_sent: u64,
    #[serde(default)]
    pub bytes_received: u64,
    /// `"allow <rule>"` / `"deny <rule>"` -> decisions.
    pub by_rule: BTreeMap<String, u64>,
}

/// The bytes a sandbox's relayed connections moved, each way (see [`EgressCounters`]).
#[derive(Debug, Default)]
pub struct ByteCounts {
    pub(crate) sent: AtomicU64,
    pub(crate) received: AtomicU64,
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct EgressSnapshot {
    pub sandbox: String,
    pub profiles: Vec<String>,
    pub counters: EgressCounters,
    /// Oldest first.
    pub recent_denials: Vec<Denial>,
}

/// Rule keys are bounded by the configuration, but a cap keeps a bug from growing this forever.
const MAX_RULE_KEYS: usize = 4096;

pub struct SandboxEgress {
    id: String,
    policy: Policy,
    limits: SandboxLimits,
    tcp_allowed: AtomicU64,
    tcp_denied: AtomicU64,
    dns_allowed: AtomicU64,
    dns_denied: AtomicU64,
    bytes: Arc<ByteCounts>,
    by_rule: Mutex<BTreeMap<String, u64>>,
    recent: Mutex<VecDeque<Denial>>,
    connections: Arc<Semaphore>,
    pub(crate) dns_in_flight: Arc<Semaphore>,
    log: LogLimit,
    pub(crate) denied_names: DeniedNames,
}

impl std::fmt::Debug for SandboxEgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxEgress")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl SandboxEgress {
    pub fn new(id: impl Into<String>, policy: Policy, limits: SandboxLimits) -> Arc<Self> {
        Arc::new(SandboxEgress {
            id: id.into(),
            policy,
            connections: Arc::new(Semaphore::new(limits.max_connections)),
            dns_in_flight: Arc::new(Semaphore::new(limits.max_dns_in_flight)),
            log: LogLimit::new(limits.log_per_window, limits.log_window),
            denied_names: DeniedNames::default(),
            limits,
            tcp_allowed: AtomicU64::new(0),
            tcp_denied: AtomicU64::new(0),
            dns_allowed: AtomicU64::new(0),
            dns_denied: AtomicU64::new(0),
            bytes: Arc::default(),
            by_rule: Mutex::new(BTreeMap::new()),
            recent: Mutex::new(VecDeque::new()),
        })
    }

    /// What its relayed connections count their bytes into.
    pub(crate) fn bytes(&self) -> Arc<ByteCounts> {
        self.bytes.clone()
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub(crate) fn try_connection(&self) -> Option<OwnedSemaphorePermit> {
        self.connections.clone().try_acquire_owned().ok()
    }

    /// Counts and logs one decision.
    pub fn record(&self, path: Path, destination: &str, decision: &Decision) {
        let counter = match (path, decision.allowed) {
            (Path::Tcp, true) => &self.tcp_allowed,
            (Path::Tcp, false) => &self.tcp_denied,
            (Path::Dns, true) => &self.dns_allowed,
            (Path::Dns, false) => &self.dns_denied,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let verdict = if decision.allowed { "allow" } else { "deny" };
        {
            let mut by_rule = self.by_rule.lock().unwrap();
            let key = format!("{verdict} {}", decision.rule);
            if by_rule.len() < MAX_RULE_KEYS || by_rule.contains_key(&key) {
                *by_rule.entry(key).or_default() += 1;
            } else {
                *by_rule.entry(format!("{verdict} (other)")).or_default() += 1;
            }
        }
        let path_name = match path {
            Path::Dns => "dns",
            Path::Tcp => "tcp",
        };
        let kind = if decision.allowed { Kind::Allowed } else { Kind::Denied };
        if self.admit_log(kind) {
            tracing::info!(
                target: "airlock_egress::decision",
                sandbox = %self.id, path = path_name, destination, verdict, rule = %decision.rule,
                "egress decision"
            );
        } else {
            tracing::debug!(
                target: "airlock_egress::decision",
                sandbox = %self.id, path = path_name, destination, verdict, rule = %decision.rule,
                "egress decision"
            );
        }
        if !decision.allowed && self.limits.recent_denials > 0 {
            let at_unix_ms = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0);
            let mut recent = self.recent.lock().unwrap();
            if recent.len() >= self.limits.recent_denials {
                recent.pop_front();
            }
            recent.push_back(Denial {
                at_unix_ms,
                path,
                destination: destination.to_string(),
                rule: decision.rule.clone(),
            });
        }
    }

    /// Logs a dial or upstream lookup that failed (the guest picks how often), within the same
    /// limit as decisions; `warn`: at WARN rather than INFO when it gets a line.
    pub(crate) fn log_failure(&self, what: &str, destination: &str, error: &dyn std::fmt::Display, warn: bool) {
        if !self.admit_log(Kind::Failed) {
            tracing::debug!(sandbox = %self.id, destination, error = %error, "egress {what} failed");
        } else if warn {
            tracing::warn!(sandbox = %self.id, destination, error = %error, "egress {what} failed");
        } else {
            tracing::info!(sandbox = %self.id, destination, error = %error, "egress {what} failed");
        }
    }

    /// Whether the next line goes to INFO; logs the summary of a window that just ended.
    fn admit_log(&self, kind: Kind) -> bool {
        let admit = self.log.admit(Instant::now(), kind);
        if let Some(held) = admit.summary {
            self.log_summary(held);
        }
        admit.info
    }

    fn log_summary(&self, held: Suppressed) {
        tracing::info!(
            target: "airlock_egress::decision",
            sandbox = %self.id, suppressed = held.total(), allowed = held.allowed, denied = held.denied,
            failed = held.failed,
            "{} egress decisions suppressed (allowed {}, denied {}, failed {})",
            held.total(), held.allowed, held.denied, held.failed
        );
    }

    pub fn snapshot(&self) -> EgressSnapshot {
        EgressSnapshot {
            sandbox: self.id.clone(),
            profiles: self.policy.profile_names().into_iter().map(String::from).collect(),
            counters: EgressCounters {
                tcp_allowed: self.tcp_allowed.load(Ordering::Relaxed),
                tcp_denied: self.tcp_denied.load(Ordering::Relaxed),
                dns_allowed: self.dns_allowed.load(Ordering::Relaxed),
                dns_denied: self.dns_denied.load(Ordering::Relaxed),
                bytes_sent: self.bytes.sent.load(Ordering::Relaxed),
                bytes_received: self.bytes.received.load(Ordering::Relaxed),
                by_rule: self.by_rule.lock().unwrap().clone(),
            },
            recent_denials: self.recent.lock().unwrap().iter().cloned().collect(),
        }
    }
}

impl Drop for SandboxEgress {
    fn drop(&mut self) {
        if let Some(held) = self.log.flush() {
            self.log_summary(held);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{EgressConfig, PlatformDenies, Profiles, TenantPolicy};

    #[test]
    fn ring_is_bounded_and_counts_by_rule() {
        let c = EgressConfig::new(PlatformDenies::new([]), Profiles::default());
        let s = SandboxEgress::new(
            "sb1",
            Policy::new::<&str>(&c, TenantPolicy::sealed(), &[]).unwrap(),
            SandboxLimits {
                recent_denials: 3,
                ..Default::default()
            },
        );
        for i in 0..5 {
            s.record(Path::Tcp, &format!("203.0.113.{i}:80"), &Decision::deny("default deny"));
        }
        s.record(Path::Dns, "a.test A", &Decision::allow("tenant allow domain a.test"));
        let snap = s.snapshot();
        assert_eq!(snap.recent_denials.len(), 3);
        assert_eq!(snap.recent_denials[0].destination, "203.0.113.2:80");
        assert_eq!(snap.counters.tcp_denied, 5);
        assert_eq!(snap.counters.dns_allowed, 1);
        assert_eq!(snap.counters.by_rule["deny default deny"], 5);
    }

    /// Counts INFO events and keeps their messages.
    struct InfoLines(Arc<Mutex<Vec<String>>>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for InfoLines {
        fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            struct Message(String);
            impl tracing::field::Visit for Message {
                fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                    if field.name() == "message" {
                        self.0 = format!("{value:?}");
                    }
                }
            }
            if *event.metadata().level() == tracing::Level::INFO {
                let mut m = Message(String::new());
                event.record(&mut m);
                self.0.lock().unwrap().push(m.0);
            }
        }
    }

    #[test]
    fn ten_thousand_decisions_write_a_bounded_number_of_info_lines() {
        use tracing_subscriber::layer::SubscriberExt;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(InfoLines(lines.clone()));
        let c = EgressConfig::new(PlatformDenies::new([]), Profiles::default());
        tracing::subscriber::with_default(subscriber, || {
            let s = SandboxEgress::new(
                "sb1",
                Policy::new::<&str>(&c, TenantPolicy::sealed(), &[]).unwrap(),
                SandboxLimits::default(),
            );
            for i in 0..10_000 {
                if i % 2 == 0 {
                    s.record(Path::Dns, &format!("n{i}.test A"), &Decision::deny("default deny"));
                } else {
                    s.record(Path::Tcp, "a.test:443", &Decision::allow("tenant allow domain a.test"));
                }
            }
            let snap = s.snapshot();
            assert_eq!(snap.counters.dns_denied + snap.counters.tcp_allowed, 10_000);
            assert_eq!(snap.recent_denials.len(), 64);
        });
        let lines = lines.lock().unwrap();
        // The window's first 10 decisions, then one summary when the sandbox goes.
        assert_eq!(lines.len(), 11, "{lines:?}");
        assert_eq!(
            lines.last().unwrap(),
            "9990 egress decisions suppressed (allowed 4995, denied 4995, failed 0)"
        );
    }
}
