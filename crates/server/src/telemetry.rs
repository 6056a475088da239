//! What this process counts for Prometheus (`GET /metrics`, the text exposition format 0.0.4).
//!
//! Two kinds of series, one registry:
//! - **events**, counted where they happen: creates and their start source, operations by kind
//!   and result, HTTP requests by route template and status, agent calls by route and outcome
//!   (histograms in seconds; their `_count` is the number of events);
//! - **state**, read at each scrape ([`crate::core::Core::metrics_text`] fills [`Observed`]):
//!   sandboxes by state, template and tenant, sessions running, warm pools, node budgets, and
//!   the egress counters of live sandboxes summed per tenant (each sandbox's growth since the
//!   last scrape is added, so the per-tenant totals only grow; what a sandbox did after the last
//!   scrape before it ended is not seen).
//!
//! Every series is this replica's: Prometheus sums replicas. Tenants are labelled by name, the
//! first [`MAX_TENANT_LABELS`] this process sees; the rest share the label `_other`, so a
//! platform with many tenants cannot blow up the number of series. No label takes a value a
//! client chose: a request's method is one of [`METHODS`] or `other`, its route the matched
//! template or [`UNMATCHED`], its status the server's; a tenant's own templates share
//! [`BUILT_TEMPLATES`].

use axum::extract::{MatchedPath, Request, State};
use axum::response::Response;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

/// Distinct tenant label values; tenants past it are counted as `_other`.
pub const MAX_TENANT_LABELS: usize = 100;
/// The label of every tenant past [`MAX_TENANT_LABELS`].
pub const OTHER_TENANTS: &str = "_other";
/// The route label of a request no route matched (a sandbox's port by Host, a 404).
pub const UNMATCHED: &str = "unmatched";
/// The template label of every sandbox of a tenant's own template (each build is a template
/// named by its id; an id is never a label).
pub const BUILT_TEMPLATES: &str = "_built";
/// The label of every value outside a label's fixed set (a method no door serves, a start
/// source no node reports today).
pub const OTHER: &str = "other";
/// The `Content-Type` of [`Telemetry::encode`]'s text.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StartLabels {
    /// `boot`, `restore`, `pool`, `snapshot` (else [`OTHER`]).
    pub from: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    pub kind: &'static str,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    /// One of [`METHODS`], else [`OTHER`].
    pub method: &'static str,
    /// The route's template (`/v1/sandboxes/{id}`), or [`UNMATCHED`].
    pub route: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AgentLabels {
    pub route: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SandboxLabels {
    pub state: &'static str,
    pub template: String,
    pub tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    pub tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EgressLabels {
    pub tenant: String,
    /// `allowed` or `denied`.
    pub verdict: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BytesLabels {
    pub tenant: String,
    /// `sent` (from the sandbox) or `received` (to it).
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    pub template: String,
    /// `<vcpu>x<memory MiB>`.
    pub shape: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabels {
    pub node: String,
    /// `vcpu`, `memory_bytes`, `disk_bytes`.
    pub resource: &'static str,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// Durations of lifecycle work: 50 ms to ~7 min.
fn slow_buckets() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.05, 2.0, 14,
    ))
}

/// Durations of requests and agent calls: 1 ms to ~65 s.
fn fast_buckets() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.001, 2.0, 17,
    ))
}

/// The methods counted by name; a client may send any token as a method, and each new label
/// value would be a series kept for the life of the process.
pub const METHODS: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];

/// `method` as its label: one of [`METHODS`], else [`OTHER`].
pub fn method_label(method: &axum::http::Method) -> &'static str {
    METHODS.into_iter().find(|m| *m == method.as_str()).unwrap_or(OTHER)
}

/// How a VM started, as its label: the node reports it as text (a remote node over the wire),
/// so only the known sources are kept.
fn start_label(from: &str) -> &'static str {
    ["boot", "restore", "pool", "snapshot"]
        .into_iter()
        .find(|f| *f == from)
        .unwrap_or(OTHER)
}

/// The process's families, registered once.
pub struct Telemetry {
    registry: Registry,
    creates: Family<ResultLabels, Counter>,
    create_seconds: Histograms<StartLabels>,
    operation_seconds: Histograms<OperationLabels>,
    http_seconds: Histograms<HttpLabels>,
    agent_seconds: Histograms<AgentLabels>,
    // Read at each scrape.
    sandboxes: Family<SandboxLabels, Gauge>,
    sessions_running: Family<TenantLabels, Gauge>,
    egress_connections: Family<EgressLabels, Counter>,
    egress_bytes: Family<BytesLabels, Counter>,
    dns_refused: Family<TenantLabels, Counter>,
    dns_answered: Family<TenantLabels, Counter>,
    pool_size: Family<PoolLabels, Gauge>,
    pool_ready: Family<PoolLabels, Gauge>,
    pool_hits: Family<PoolLabels, Counter>,
    pool_misses: Family<PoolLabels, Counter>,
    budget_total: Family<NodeLabels, Gauge>,
    budget_used: Family<NodeLabels, Gauge>,
    nodes_ready: Gauge,
    recovery_seconds: Gauge<f64, AtomicU64>,
    recovered_sandboxes: Gauge,
    /// What each scrape reads is applied under this lock, so two scrapes never interleave.
    scrape: tokio::sync::Mutex<Seen>,
}

/// What earlier scrapes saw: counters read from elsewhere are added as their growth.
#[derive(Default)]
pub(crate) struct Seen {
    /// Tenant id -> its label.
    tenants: HashMap<String, String>,
    /// Sandbox id -> its egress counters at the last scrape.
    egress: HashMap<String, airlock_egress::EgressCounters>,
    /// Pool -> (hits, misses) at the last scrape.
    pools: HashMap<PoolLabels, (u64, u64)>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Self::new()
    }
}

impl Telemetry {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("airlock");
        let t = Telemetry {
            creates: Family::default(),
            create_seconds: Family::new_with_constructor(slow_buckets as fn() -> Histogram),
            operation_seconds: Family::new_with_constructor(slow_buckets as fn() -> Histogram),
            http_seconds: Family::new_with_constructor(fast_buckets as fn() -> Histogram),
            agent_seconds: Family::new_with_constructor(fast_buckets as fn() -> Histogram),
            sandboxes: Family::default(),
            sessions_running: Family::default(),
            egress_connections: Family::default(),
            egress_bytes: Family::default(),
            dns_refused: Family::default(),
            dns_answered: Family::default(),
            pool_size: Family::default(),
            pool_ready: Family::default(),
            pool_hits: Family::default(),
            pool_misses: Family::default(),
            budget_total: Family::default(),
            budget_used: Family::default(),
            nodes_ready: Gauge::default(),
            recovery_seconds: Gauge::default(),
            recovered_sandboxes: Gauge::default(),
            scrape: Default::default(),
            registry: Registry::default(),
        };
        registry.register(
            "sandbox_creates",
            "Creates that ended, by result (ok, failed)",
            t.creates.clone(),
        );
        registry.register_with_unit(
            "sandbox_create_duration",
            "From a create's submission to its sandbox running, by how its VM started (boot, restore, pool, snapshot)",
            Unit::Seconds,
            t.create_seconds.clone(),
        );
        registry.register_with_unit(
            "operation_duration",
            "Lifecycle operations from submission to their end, by kind and result",
            Unit::Seconds,
            t.operation_seconds.clone(),
        );
        registry.register_with_unit(
            "http_request_duration",
            "HTTP requests to their response's headers, by method, route template and status",
            Unit::Seconds,
            t.http_seconds.clone(),
        );
        registry.register_with_unit(
            "agent_call_duration",
            "Calls to guest agents to their answer's headers, by route and outcome (ok, refused, failed)",
            Unit::Seconds,
            t.agent_seconds.clone(),
        );
        registry.register(
            "sandboxes",
            "Sandboxes that exist, by state, template and tenant",
            t.sandboxes.clone(),
        );
        registry.register(
            "sessions_running",
            "Sessions (processes) running in live sandboxes, by tenant",
            t.sessions_running.clone(),
        );
        registry.register(
            "egress_connections",
            "Sandboxes' outbound connections judged by the egress proxy, by tenant and verdict",
            t.egress_connections.clone(),
        );
        registry.register(
            "egress_bytes",
            "Bytes sandboxes' allowed connections passed through the egress proxy, by tenant and direction",
            t.egress_bytes.clone(),
        );
        registry.register(
            "egress_dns_refused",
            "DNS questions of sandboxes answered with a refusal (a name their policy does not allow), by tenant",
            t.dns_refused.clone(),
        );
        registry.register(
            "egress_dns_answered",
            "DNS questions of sandboxes answered with addresses, by tenant",
            t.dns_answered.clone(),
        );
        registry.register("pool_size", "VMs each warm pool keeps ready", t.pool_size.clone());
        registry.register("pool_ready", "VMs ready in each warm pool", t.pool_ready.clone());
        registry.register(
            "pool_hits",
            "Creates that claimed a warm pool's VM",
            t.pool_hits.clone(),
        );
        registry.register(
            "pool_misses",
            "Creates of a pool's template and shape that found it empty",
            t.pool_misses.clone(),
        );
        registry.register(
            "node_budget",
            "Each node's budget for its sandboxes together (vcpu; memory and disk in bytes)",
            t.budget_total.clone(),
        );
        registry.register(
            "node_budget_used",
            "What live sandboxes hold of each node's budget",
            t.budget_used.clone(),
        );
        registry.register("nodes_ready", "Nodes taking new sandboxes", t.nodes_ready.clone());
        registry.register_with_unit(
            "recovery_duration",
            "How long this process's recovery after its start took (0 until it is done)",
            Unit::Seconds,
            t.recovery_seconds.clone(),
        );
        registry.register(
            "recovered_sandboxes",
            "Sandboxes this process's recovery settled",
            t.recovered_sandboxes.clone(),
        );
        let start = Gauge::<f64, AtomicU64>::default();
        start.set(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0),
        );
        registry.register_with_unit(
            "server_start_time",
            "When this process started, in Unix time (a restart changes it: `changes()` counts restarts)",
            Unit::Seconds,
            start,
        );
        Telemetry { registry, ..t }
    }

    pub fn create_ended(&self, started: Option<(&str, Duration)>) {
        let result = if started.is_some() { "ok" } else { "failed" };
        self.creates.get_or_create(&ResultLabels { result }).inc();
        if let Some((from, took)) = started {
            self.create_seconds
                .get_or_create(&StartLabels {
                    from: start_label(from),
                })
                .observe(took.as_secs_f64());
        }
    }

    pub fn operation_ended(&self, kind: &'static str, ok: bool, took: Duration) {
        let result = if ok { "succeeded" } else { "failed" };
        self.operation_seconds
            .get_or_create(&OperationLabels { kind, result })
            .observe(took.as_secs_f64());
    }

    pub fn agent_call(&self, route: &'static str, took: Duration, outcome: &'static str) {
        self.agent_seconds
            .get_or_create(&AgentLabels { route, outcome })
            .observe(took.as_secs_f64());
    }

    pub fn recovered(&self, took: Duration, sandboxes: usize) {
        self.recovery_seconds.set(took.as_secs_f64().max(f64::MIN_POSITIVE));
        self.recovered_sandboxes.set(sandboxes as i64);
    }

    /// Apply what a scrape read, then the registry as text.
    pub(crate) async fn encode(&self, observed: Observed) -> String {
        let mut seen = self.scrape.lock().await;
        self.apply(&mut seen, observed);
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry);
        text
    }

    fn apply(&self, seen: &mut Seen, o: Observed) {
        for (id, name) in &o.tenants {
            if !seen.tenants.contains_key(id) {
                let label = if seen.tenants.len() < MAX_TENANT_LABELS {
                    name.clone()
                } else {
                    OTHER_TENANTS.to_string()
                };
                seen.tenants.insert(id.clone(), label);
            }
        }
        let tenant = |id: &str| {
            seen.tenants
                .get(id)
                .cloned()
                .unwrap_or_else(|| OTHER_TENANTS.to_string())
        };
        self.sandboxes.clear();
        for ((state, template, tenant_id), n) in &o.sandboxes {
            self.sandboxes
                .get_or_create(&SandboxLabels {
                    state,
                    template: template.clone(),
                    tenant: tenant(tenant_id),
                })
                // Summed: the tenants past the cap share one series.
                .inc_by(*n as i64);
        }
        self.sessions_running.clear();
        for (tenant_id, n) in &o.sessions {
            self.sessions_running
                .get_or_create(&TenantLabels {
                    tenant: tenant(tenant_id),
                })
                .inc_by(*n as i64);
        }
        // Egress: each live sandbox's growth since the last scrape; ended ones are forgotten.
        let mut egress = HashMap::new();
        for (id, tenant_id, now) in o.egress {
            let before = seen.egress.get(&id).cloned().unwrap_or_default();
            let grew = |now: u64, before: u64| now.saturating_sub(before);
            let t = tenant(&tenant_id);
            let add = |family: &Family<EgressLabels, Counter>, verdict, n: u64| {
                if n > 0 {
                    family
                        .get_or_create(&EgressLabels {
                            tenant: t.clone(),
                            verdict,
                        })
                        .inc_by(n);
                }
            };
            add(
                &self.egress_connections,
                "allowed",
                grew(now.tcp_allowed, before.tcp_allowed),
            );
            add(
                &self.egress_connections,
                "denied",
                grew(now.tcp_denied, before.tcp_denied),
            );
            for (direction, now, before) in [
                ("sent", now.bytes_sent, before.bytes_sent),
                ("received", now.bytes_received, before.bytes_received),
            ] {
                self.egress_bytes
                    .get_or_create(&BytesLabels {
                        tenant: t.clone(),
                        direction,
                    })
                    .inc_by(grew(now, before));
            }
            // Touched even at 0, so the series exist from a sandbox's first scrape.
            self.dns_refused
                .get_or_create(&TenantLabels { tenant: t.clone() })
                .inc_by(grew(now.dns_denied, before.dns_denied));
            self.dns_answered
                .get_or_create(&TenantLabels { tenant: t.clone() })
                .inc_by(grew(now.dns_allowed, before.dns_allowed));
            egress.insert(id, now);
        }
        seen.egress = egress;
        self.pool_size.clear();
        self.pool_ready.clear();
        for pool in &o.pools {
            let labels = PoolLabels {
                template: pool.template.clone(),
                shape: format!("{}x{}", pool.resources.vcpu, pool.resources.memory_mib),
            };
            self.pool_size.get_or_create(&labels).set(pool.size as i64);
            self.pool_ready.get_or_create(&labels).set(pool.ready as i64);
            let (hits, misses) = seen.pools.get(&labels).copied().unwrap_or((0, 0));
            self.pool_hits
                .get_or_create(&labels)
                .inc_by(pool.hits.saturating_sub(hits));
            self.pool_misses
                .get_or_create(&labels)
                .inc_by(pool.misses.saturating_sub(misses));
            seen.pools.insert(labels, (pool.hits, pool.misses));
        }
        self.budget_total.clear();
        self.budget_used.clear();
        let mut ready = 0;
        for node in &o.nodes {
            ready += i64::from(node.ready);
            for (resource, total, used) in [
                ("vcpu", node.budget.vcpu, node.used.vcpu),
                ("memory_bytes", node.budget.memory_mib << 20, node.used.memory_mib << 20),
                ("disk_bytes", node.budget.disk_mib << 20, node.used.disk_mib << 20),
            ] {
                let labels = NodeLabels {
                    node: node.name.clone(),
                    resource,
                };
                self.budget_total.get_or_create(&labels).set(total as i64);
                self.budget_used.get_or_create(&labels).set(used as i64);
            }
        }
        self.nodes_ready.set(ready);
    }
}

/// The vCPUs, memory and disk of a budget or of what is used of one.
#[derive(Debug, Clone, Copy, Default)]
pub struct Amounts {
    pub vcpu: u64,
    pub memory_mib: u64,
    pub disk_mib: u64,
}

#[derive(Debug, Clone)]
pub struct NodeObserved {
    pub name: String,
    pub ready: bool,
    pub budget: Amounts,
    pub used: Amounts,
}

/// What one scrape read from the store and the nodes.
#[derive(Debug, Default)]
pub struct Observed {
    /// Tenant id -> name.
    pub tenants: Vec<(String, String)>,
    /// (state, template, tenant id) -> sandboxes.
    pub sandboxes: HashMap<(&'static str, String, String), u64>,
    /// Tenant id -> sessions running.
    pub sessions: HashMap<String, u64>,
    /// (sandbox id, tenant id, its egress counters now).
    pub egress: Vec<(String, String, airlock_egress::EgressCounters)>,
    pub pools: Vec<crate::model::PoolInfo>,
    pub nodes: Vec<NodeObserved>,
}

/// The HTTP layer: each request's duration to its response's headers, labelled with the route
/// template [`mark_route`] found (outermost, so every door's requests and refusals count).
pub async fn track_http(
    State(telemetry): State<Arc<Telemetry>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let method = method_label(req.method());
    let start = std::time::Instant::now();
    let resp = next.run(req).await;
    let route = resp
        .extensions()
        .get::<MatchedPath>()
        .map_or(UNMATCHED.to_string(), |p| p.as_str().to_string());
    telemetry
        .http_seconds
        .get_or_create(&HttpLabels {
            method,
            route,
            status: resp.status().as_u16(),
        })
        .observe(start.elapsed().as_secs_f64());
    resp
}

/// A route layer of every router: hands the matched route's template to [`track_http`] on the
/// response (routing happens inside the outer layer, so the request there has none yet).
pub async fn mark_route(req: Request, next: axum::middleware::Next) -> Response {
    let matched = req.extensions().get::<MatchedPath>().cloned();
    let mut resp = next.run(req).await;
    if let Some(m) = matched {
        resp.extensions_mut().insert(m);
    }
    resp
}

/// Seconds since `rfc3339` (an operation's `created_at`), if it parses.
pub fn since_rfc3339(rfc3339: &str) -> Option<Duration> {
    let at = humantime::parse_rfc3339(rfc3339).ok()?;
    std::time::SystemTime::now().duration_since(at).ok()
}

/// The process's agent calls go to `telemetry` (once per process; the first server wins).
pub fn observe_agent_calls(telemetry: &Arc<Telemetry>) {
    let weak = Arc::downgrade(telemetry);
    airlock_agent_client::observe_calls(Box::new(move |route, took, outcome| {
        if let Some(t) = weak.upgrade() {
            t.agent_call(route, took, outcome.as_str());
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn names_follow_prometheus_conventions_and_tenants_are_capped() {
        let t = Telemetry::new();
        t.create_ended(Some(("restore", Duration::from_millis(300))));
        t.create_ended(None);
        t.operation_ended("create", true, Duration::from_millis(300));
        let mut o = Observed::default();
        for i in 0..MAX_TENANT_LABELS + 5 {
            o.tenants.push((format!("t{i}"), format!("name{i}")));
            o.sandboxes.insert(("running", "seed".into(), format!("t{i}")), 1);
        }
        let text = t.encode(o).await;
        assert!(
            text.contains("airlock_sandbox_creates_total{result=\"ok\"} 1"),
            "{text}"
        );
        assert!(text.contains("airlock_sandbox_creates_total{result=\"failed\"} 1"));
        assert!(text.contains("airlock_sandbox_create_duration_seconds_count{from=\"restore\"} 1"));
        assert!(text.contains("# TYPE airlock_operation_duration_seconds histogram"));
        assert!(text.contains("airlock_server_start_time_seconds "));
        let tenants: std::collections::HashSet<&str> = text
            .lines()
            .filter(|l| l.starts_with("airlock_sandboxes{"))
            .filter_map(|l| l.split("tenant=\"").nth(1)?.split('"').next())
            .collect();
        assert_eq!(tenants.len(), MAX_TENANT_LABELS + 1, "{tenants:?}");
        assert!(tenants.contains(OTHER_TENANTS));
        let other = text
            .lines()
            .find(|l| l.starts_with("airlock_sandboxes{") && l.contains("tenant=\"_other\""))
            .unwrap();
        assert!(other.ends_with(" 5"), "{other}");
    }

    #[test]
    fn labels_come_from_fixed_sets() {
        use axum::http::Method;
        for m in METHODS {
            assert_eq!(method_label(&Method::from_bytes(m.as_bytes()).unwrap()), m);
        }
        for m in ["MADEUP", "get", "PROPFIND", "CONNECT", "TRACE"] {
            assert_eq!(method_label(&Method::from_bytes(m.as_bytes()).unwrap()), OTHER, "{m}");
        }
        assert_eq!(start_label("restore"), "restore");
        assert_eq!(start_label("anything a node says"), OTHER);
    }

    #[tokio::test]
    async fn counters_read_elsewhere_only_grow() {
        let t = Telemetry::new();
        let counters = |tcp_denied, dns_denied| airlock_egress::EgressCounters {
            tcp_denied,
            dns_denied,
            bytes_sent: tcp_denied * 100,
            ..Default::default()
        };
        let scrape = |c| Observed {
            tenants: vec![("t1".into(), "acme".into())],
            egress: vec![("sb1".into(), "t1".into(), c)],
            ..Default::default()
        };
        t.encode(scrape(counters(2, 3))).await;
        let text = t.encode(scrape(counters(5, 3))).await;
        assert!(
            text.contains("airlock_egress_connections_total{tenant=\"acme\",verdict=\"denied\"} 5"),
            "{text}"
        );
        assert!(
            text.contains("airlock_egress_dns_refused_total{tenant=\"acme\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("airlock_egress_bytes_total{tenant=\"acme\",direction=\"sent\"} 500"),
            "{text}"
        );
        // The sandbox ended: its counts stay.
        let text = t
            .encode(Observed {
                tenants: vec![("t1".into(), "acme".into())],
                ..Default::default()
            })
            .await;
        assert!(
            text.contains("airlock_egress_connections_total{tenant=\"acme\",verdict=\"denied\"} 5"),
            "{text}"
        );
    }
}
