//! `RemoteNode`: `Nodes` over another host's node face (`serve.rs`, routes in `wire.rs`).
//!
//! Lifecycle calls are calls to the node. `Nodes`' synchronous questions (its templates, pools,
//! VMs' states, capacity) are answered from the node's last report, fetched every
//! [`REPORT_EVERY`] and after every change this side asks for: a caller's view of a node is
//! always a little stale, and the node admits on its own. Exits arrive on a long-lived stream.
//! Agent calls go to the node's agent route over one HTTP/2 connection, which the node passes on.
//!
//! Every call is signed for the node's name (`wire::sign_request`) and every reply must verify
//! (`wire::verify_reply`): the first call is a report for any node, and until a report's reply
//! has proven the cluster secret and named the node, nothing else is sent to it.

use super::wire::{
    self, ClaimRequest, Claimed, Digest, ErrorReply, NodeReport, PoolSize, RemoteFailure, Saved, Took, PREFIX,
};
use super::{Booted, Capacity, NodeError, Nodes, PoolInfo, VmRequest, VmState};
use airlock_agent_client::AgentClient;
use airlock_runtime::template::TemplateManifest;
use airlock_runtime::Resources;
use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::broadcast;

/// How often the node's report is fetched besides after each change.
pub const REPORT_EVERY: Duration = Duration::from_secs(1);
/// The longest a lifecycle call may take (a create restores or boots a VM; a suspend writes its
/// memory to disk), and a report.
/// An image import: a pull and an unpack of up to `MAX_IMAGE_BYTES`.
const IMPORT_LIMIT: Duration = Duration::from_secs(1800);
const CALL_LIMIT: Duration = Duration::from_secs(600);
/// A report is read from memory on the node: one that takes longer is from a node cut off
/// (its packets dropped, no reset), which placement must skip within seconds.
const REPORT_LIMIT: Duration = Duration::from_secs(5);
/// A watch's start (the guest's agent arms it).
const WATCH_LIMIT: Duration = Duration::from_secs(30);
/// HTTP/2 pings on an idle connection, and how long one may go unanswered before the
/// connection (and every stream on it: a session's output, an exit stream) is given up.
const PING_EVERY: Duration = Duration::from_secs(10);
const PING_LIMIT: Duration = Duration::from_secs(10);
/// Largest reply read from a node (a report lists every VM and template it has).
const REPLY_MAX: usize = 16 << 20;

pub struct RemoteNode {
    inner: Arc<Inner>,
    /// The report refresher and the exits reader, ended with this value.
    tasks: Vec<tokio::task::AbortHandle>,
}

struct Inner {
    addr: SocketAddr,
    secret: Arc<[u8]>,
    /// The replica's TLS to the node (None: plain HTTP).
    tls: Option<Arc<rustls::ClientConfig>>,
    http: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    report: Mutex<NodeReport>,
    /// The name the node signed its first verified report with: every call is signed for it.
    /// None until then, and nothing but reports is sent.
    name: Mutex<Option<String>>,
    /// Why the last report failed, until one succeeds again (placement skips the node then).
    down: Mutex<Option<String>>,
    exits: broadcast::Sender<String>,
    /// The HTTP/2 connection agent calls share; made again once it closes.
    agent: tokio::sync::Mutex<Option<AgentClient>>,
}

impl Drop for RemoteNode {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The node did not answer.
fn unreachable(addr: SocketAddr, what: &str, e: impl std::fmt::Display) -> NodeError {
    NodeError::Unreachable(Box::new(RemoteFailure(format!(
        "node {addr} did not answer {what}: {e}"
    ))))
}

/// The node answered, but not in its protocol.
fn garbled(addr: SocketAddr, what: &str, e: impl std::fmt::Display) -> NodeError {
    NodeError::Failed(Box::new(RemoteFailure(format!(
        "node {addr}: bad answer to {what}: {e}"
    ))))
}

impl Inner {
    fn url(&self, path: &str) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}{PREFIX}{path}", self.addr)
    }

    /// The name calls are signed for; an error until the node proved the secret.
    fn target(&self, what: &str) -> Result<String, NodeError> {
        self.name.lock().unwrap().clone().ok_or_else(|| {
            unreachable(
                self.addr,
                what,
                "it has not yet proven the cluster secret (no report of it verified)",
            )
        })
    }

    /// One call; its JSON answer, or the node's error as the variant it sent.
    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
        limit: Duration,
    ) -> Result<T, NodeError> {
        let what = format!("{method} {path}");
        let body = body.map_or_else(Bytes::new, |b| {
            Bytes::from(serde_json::to_vec(b).expect("serializable"))
        });
        let target = match self.target(&what) {
            Ok(name) => name,
            Err(_) if method == Method::GET && path == "/report" => wire::ANY_NODE.to_string(),
            Err(e) => return Err(e),
        };
        let signed = wire::sign_request(
            &self.secret,
            method.as_str(),
            &format!("{PREFIX}{path}"),
            &wire::body_digest(&body),
            &target,
        );
        let mut req = Request::builder()
            .method(method)
            .uri(self.url(path))
            .header(hyper::header::CONTENT_TYPE, "application/json");
        for (name, value) in &signed.headers {
            req = req.header(*name, value);
        }
        if let Some(op) = wire::current_operation() {
            req = req
                .header(wire::OPERATION_HEADER, op.id)
                .header(wire::EPOCH_HEADER, op.epoch.to_string());
        }
        let req = req.body(Full::new(body)).expect("valid request");
        let exchange = async {
            let resp = self
                .http
                .request(req)
                .await
                .map_err(|e| unreachable(self.addr, &what, airlock_agent_client::error_chain(&e)))?;
            let status = resp.status();
            let headers = resp.headers().clone();
            let bytes = http_body_util::Limited::new(resp.into_body(), REPLY_MAX)
                .collect()
                .await
                .map_err(|e| unreachable(self.addr, &what, e))?
                .to_bytes();
            self.proven(&signed.nonce, status.as_u16(), &wire::body_digest(&bytes), &headers)
                .map_err(|e| match serde_json::from_slice::<ErrorReply>(&bytes) {
                    // The node's refusal of our signature (unsigned: it has no nonce to sign for).
                    Ok(reply) if reply.code == "unauthorized" => NodeError::Failed(Box::new(RemoteFailure(format!(
                        "node {} refused {what}: {}",
                        self.addr, reply.message
                    )))),
                    _ => garbled(self.addr, &what, e),
                })?;
            if status.is_success() {
                serde_json::from_slice(&bytes).map_err(|e| garbled(self.addr, &what, e))
            } else {
                Err(match serde_json::from_slice::<ErrorReply>(&bytes) {
                    Ok(reply) => reply.into_error(),
                    Err(_) => garbled(self.addr, &what, status),
                })
            }
        };
        tokio::time::timeout(limit, exchange)
            .await
            .map_err(|_| unreachable(self.addr, &what, format!("no answer within {limit:?}")))?
    }

    /// Whether a reply to the request of `nonce` is the node's (of the cluster secret, from the
    /// node the calls are for); the first one names it.
    fn proven(&self, nonce: &str, status: u16, digest: &str, headers: &hyper::HeaderMap) -> Result<(), String> {
        let Some(name) = wire::verify_reply(&self.secret, nonce, status, digest, headers) else {
            return Err("its reply is not signed with the cluster secret".into());
        };
        let mut known = self.name.lock().unwrap();
        match known.as_deref() {
            Some(k) if k != name => Err(format!("its reply is signed by node {name:?}, not {k:?}")),
            Some(_) => Ok(()),
            None => {
                *known = Some(name);
                Ok(())
            }
        }
    }

    async fn refresh(&self) -> Result<(), NodeError> {
        match self
            .call::<NodeReport>(Method::GET, "/report", None::<&()>, REPORT_LIMIT)
            .await
        {
            Ok(report) => {
                *self.report.lock().unwrap() = report;
                *self.down.lock().unwrap() = None;
                Ok(())
            }
            Err(e) => {
                *self.down.lock().unwrap() = Some(e.to_string());
                Err(e)
            }
        }
    }

    /// A change went through: learn its effect now, not at the next periodic report.
    async fn changed(&self) {
        if let Err(e) = self.refresh().await {
            tracing::warn!("node {}: report after a change: {e}", self.addr);
        }
    }

    /// A change this side asks for (a lifecycle call, bounded by `limit`), then the node's
    /// report learnt at once, whether or not the change went through.
    async fn change<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
        limit: Duration,
    ) -> Result<T, NodeError> {
        let result = self.call(method, path, body, limit).await;
        self.changed().await;
        result
    }

    /// Read the node's exit stream, again after it ends, for as long as this node is held.
    async fn follow_exits(self: Arc<Self>) {
        loop {
            if let Err(e) = self.read_exits().await {
                tracing::debug!("node {}: exit stream: {e}", self.addr);
            }
            tokio::time::sleep(REPORT_EVERY).await;
        }
    }

    async fn read_exits(&self) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let path = format!("{PREFIX}/exits");
        let signed = wire::sign_request(&self.secret, "GET", &path, wire::UNSIGNED, &self.target("exits")?);
        let mut req = Request::builder().uri(self.url("/exits"));
        for (name, value) in &signed.headers {
            req = req.header(*name, value);
        }
        let resp = self.http.request(req.body(Full::new(Bytes::new()))?).await?;
        self.proven(&signed.nonce, resp.status().as_u16(), wire::UNSIGNED, resp.headers())?;
        let mut body = resp.into_body();
        let mut line = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                for &b in data.iter() {
                    if b == b'\n' {
                        let _ = self.exits.send(String::from_utf8_lossy(&line).into_owned());
                        line.clear();
                    } else if line.len() < 256 {
                        line.push(b);
                    }
                }
            }
        }
        Ok(())
    }
}

impl RemoteNode {
    /// The node at `addr`, whose calls are signed with the cluster `secret`; fails when it does
    /// not answer its first report (or its answer does not prove the secret).
    pub async fn connect(addr: SocketAddr, link: impl Into<super::NodeLink>) -> Result<Self, NodeError> {
        let node = Self::open(addr, link).await;
        let down = node.inner.down.lock().unwrap().clone();
        match down {
            Some(why) => Err(NodeError::Unreachable(Box::new(RemoteFailure(why)))),
            None => Ok(node),
        }
    }

    /// The node at `addr` whether or not it answers now: until it does, it has nothing and
    /// placement skips it ([`Nodes::members`] says why).
    pub async fn open(addr: SocketAddr, link: impl Into<super::NodeLink>) -> Self {
        let link: super::NodeLink = link.into();
        // Without TLS the URLs are http:// and this config is never used.
        let mut tls = link.tls.as_deref().cloned().unwrap_or_else(|| {
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("ring's defaults")
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth()
        });
        // The connector sets ALPN (h2) itself.
        tls.alpn_protocols.clear();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(
                super::tls::node_server_name(),
            ))
            .enable_http2()
            .build();
        let http = Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .timer(hyper_util::rt::TokioTimer::new())
            .http2_keep_alive_interval(PING_EVERY)
            .http2_keep_alive_timeout(PING_LIMIT)
            .http2_keep_alive_while_idle(true)
            .build(connector);
        let inner = Arc::new(Inner {
            addr,
            secret: link.secret,
            tls: link.tls,
            http,
            name: Mutex::new(None),
            report: Mutex::new(NodeReport {
                name: String::new(),
                runtime_name: String::new(),
                accel: String::new(),
                capacity: Capacity::default(),
                templates: Vec::new(),
                pools: Vec::new(),
                vms: Vec::new(),
                images: Vec::new(),
                draining: false,
                fingerprint: String::new(),
                parks: false,
            }),
            down: Mutex::new(None),
            exits: broadcast::channel(1024).0,
            agent: tokio::sync::Mutex::new(None),
        });
        let _ = inner.refresh().await;
        let refresher = {
            let inner = Arc::downgrade(&inner);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(REPORT_EVERY).await;
                    let Some(inner) = inner.upgrade() else { return };
                    if let Err(e) = inner.refresh().await {
                        tracing::debug!("node {}: report: {e}", inner.addr);
                    }
                }
            })
        };
        let exits = tokio::spawn(inner.clone().follow_exits());
        RemoteNode {
            inner,
            tasks: vec![refresher.abort_handle(), exits.abort_handle()],
        }
    }

    /// The name the node reports (empty until it answers).
    pub fn reported_name(&self) -> String {
        self.report(|r| r.name.clone())
    }

    fn report<T>(&self, f: impl FnOnce(&NodeReport) -> T) -> T {
        f(&self.inner.report.lock().unwrap())
    }
}

#[async_trait]
impl Nodes for RemoteNode {
    fn runtime_name(&self) -> String {
        self.report(|r| r.runtime_name.clone())
    }

    async fn accel(&self) -> String {
        self.report(|r| r.accel.clone())
    }

    fn templates(&self) -> Vec<TemplateManifest> {
        self.report(|r| r.templates.clone())
    }

    fn template(&self, reference: &str) -> Option<TemplateManifest> {
        self.report(|r| airlock_runtime::template::find_manifest(&r.templates, reference))
    }

    async fn create(&self, vm: &VmRequest) -> Result<Booted, NodeError> {
        self.inner.change(Method::POST, "/vms", Some(vm), CALL_LIMIT).await
    }

    async fn delete(&self, id: &str, run: Option<&str>) -> Result<(), NodeError> {
        let path = match run {
            // A run id is hex (`VmRecord::run`): nothing to escape; anything else is refused.
            Some(run) if run.bytes().all(|b| b.is_ascii_hexdigit()) => format!("/vms/{id}?run={run}"),
            Some(_) => return Err(NodeError::StaleRun(id.into())),
            None => format!("/vms/{id}"),
        };
        self.inner.change(Method::DELETE, &path, None::<&()>, CALL_LIMIT).await
    }

    async fn pause(&self, id: &str) -> Result<(), NodeError> {
        let path = format!("/vms/{id}/pause");
        self.inner.change(Method::POST, &path, None::<&()>, CALL_LIMIT).await
    }

    async fn suspend(&self, id: &str) -> Result<u64, NodeError> {
        let path = format!("/vms/{id}/suspend");
        let took: Took = self.inner.change(Method::POST, &path, None::<&()>, CALL_LIMIT).await?;
        Ok(took.ms)
    }

    async fn save_image(&self, id: &str, image_id: &str) -> Result<u64, NodeError> {
        let path = format!("/vms/{id}/images/{image_id}");
        let saved: Saved = self.inner.change(Method::POST, &path, None::<&()>, CALL_LIMIT).await?;
        Ok(saved.bytes)
    }

    async fn capture_template(&self, id: &str, capture: &super::Capture) -> Result<TemplateManifest, NodeError> {
        let path = format!("/vms/{id}/capture");
        self.inner.change(Method::POST, &path, Some(capture), CALL_LIMIT).await
    }

    async fn import_image(&self, import: &super::ImageImport) -> Result<TemplateManifest, NodeError> {
        self.inner
            .change(Method::POST, "/templates/import", Some(import), IMPORT_LIMIT)
            .await
    }

    async fn remove_template(&self, name: &str) -> Result<(), NodeError> {
        let path = format!("/templates/{name}");
        self.inner.change(Method::DELETE, &path, None::<&()>, CALL_LIMIT).await
    }

    async fn park(&self, id: &str, image_id: &str) -> Result<super::Parked, NodeError> {
        let path = format!("/vms/{id}/park/{image_id}");
        self.inner.change(Method::POST, &path, None::<&()>, CALL_LIMIT).await
    }

    async fn share_image(&self, image_id: &str) -> Result<super::Parked, NodeError> {
        let path = format!("/images/{image_id}/share");
        self.inner.change(Method::POST, &path, None::<&()>, CALL_LIMIT).await
    }

    async fn fingerprint(&self) -> String {
        self.report(|r| r.fingerprint.clone())
    }

    fn parks(&self) -> bool {
        self.report(|r| r.parks)
    }

    async fn delete_image(&self, image_id: &str) -> Result<(), NodeError> {
        let path = format!("/images/{image_id}");
        self.inner.change(Method::DELETE, &path, None::<&()>, CALL_LIMIT).await
    }

    async fn delete_parked(&self, image_id: &str) -> Result<(), NodeError> {
        let path = format!("/parked/{image_id}");
        self.inner.change(Method::DELETE, &path, None::<&()>, CALL_LIMIT).await
    }

    async fn digest_image(&self, image_id: &str) -> Result<String, NodeError> {
        let d: Digest = self
            .inner
            .call(
                Method::GET,
                &format!("/images/{image_id}/digest"),
                None::<&()>,
                CALL_LIMIT,
            )
            .await?;
        Ok(d.digest)
    }

    fn image_ids(&self) -> Vec<String> {
        self.report(|r| r.images.clone())
    }

    async fn claim(&self, template: &str, resources: &Resources) -> Option<String> {
        let req = ClaimRequest {
            template: template.into(),
            resources: *resources,
        };
        match self
            .inner
            .call::<Claimed>(Method::POST, "/claims", Some(&req), REPORT_LIMIT)
            .await
        {
            Ok(c) => c.id,
            // No pool VM then: the create boots or restores one of its own.
            Err(e) => {
                tracing::warn!("node {}: claim: {e}", self.inner.addr);
                None
            }
        }
    }

    fn unclaim(&self, id: &str) {
        let (inner, path) = (self.inner.clone(), format!("/claims/{id}"));
        tokio::spawn(async move {
            if let Err(e) = inner.call::<()>(Method::DELETE, &path, None::<&()>, REPORT_LIMIT).await {
                tracing::warn!("node {}: unclaim: {e}", inner.addr);
            }
        });
    }

    async fn set_pool(&self, template: &str, resources: &Resources, size: usize) -> Result<(), NodeError> {
        let req = PoolSize {
            template: template.into(),
            resources: *resources,
            size,
        };
        self.inner.change(Method::PUT, "/pools", Some(&req), REPORT_LIMIT).await
    }

    fn pools(&self) -> Vec<PoolInfo> {
        self.report(|r| r.pools.clone())
    }

    async fn resume(&self, id: &str) -> Result<(), NodeError> {
        let path = format!("/vms/{id}/resume");
        self.inner.change(Method::POST, &path, None::<&()>, CALL_LIMIT).await
    }

    fn vm_state(&self, id: &str) -> VmState {
        self.report(|r| r.vms.iter().find(|vm| vm.id == id).map_or(VmState::Gone, |vm| vm.state))
    }

    async fn vm_state_now(&self, id: &str) -> Option<VmState> {
        self.inner.refresh().await.ok().map(|_| self.vm_state(id))
    }

    async fn settled(&self, id: &str) {
        let path = format!("/vms/{id}/settled");
        if let Err(e) = self
            .inner
            .call::<()>(Method::POST, &path, None::<&()>, CALL_LIMIT)
            .await
        {
            tracing::warn!("node {}: settled: {e}", self.inner.addr);
        }
        self.inner.changed().await;
    }

    async fn settled_all(&self) {
        if let Err(e) = self
            .inner
            .call::<()>(Method::POST, "/settled", None::<&()>, CALL_LIMIT)
            .await
        {
            tracing::warn!("node {}: settled: {e}", self.inner.addr);
        }
        self.inner.changed().await;
    }

    fn vm_ids(&self) -> Vec<String> {
        self.report(|r| r.vms.iter().map(|vm| vm.id.clone()).collect())
    }

    fn vm_run(&self, id: &str) -> Option<String> {
        self.report(|r| r.vms.iter().find(|vm| vm.id == id).map(|vm| vm.run.clone()))
    }

    async fn agent(&self, id: &str) -> Result<AgentClient, NodeError> {
        // Nothing is sent to a node that has not proven the secret.
        let (secret, target) = (self.inner.secret.clone(), self.inner.target("agent calls")?);
        let mut conn = self.inner.agent.lock().await;
        let root = match conn.as_ref().filter(|c| !c.is_closed()) {
            Some(c) => c.clone(),
            None => {
                let addr = self.inner.addr;
                let stream = tokio::net::TcpStream::connect(addr)
                    .await
                    .map_err(|e| unreachable(addr, "agent connection", e))?;
                let _ = stream.set_nodelay(true);
                let c = match &self.inner.tls {
                    None => AgentClient::handshake(stream).await,
                    Some(tls) => {
                        let stream = tokio_rustls::TlsConnector::from(tls.clone())
                            .connect(super::tls::node_server_name(), stream)
                            .await
                            .map_err(|e| unreachable(addr, "agent connection (TLS)", e))?;
                        AgentClient::handshake(stream).await
                    }
                }
                .map_err(|e| unreachable(addr, "agent connection", e))?;
                *conn = Some(c.clone());
                c
            }
        };
        let sign: airlock_agent_client::Sign = Arc::new(move |method, uri| {
            let path = uri.path_and_query().map_or("/", |p| p.as_str());
            wire::sign_request(&secret, method.as_str(), path, wire::UNSIGNED, &target)
                .headers
                .into_iter()
                .filter_map(|(name, value)| Some((hyper::header::HeaderName::from_static(name), value.parse().ok()?)))
                .collect()
        });
        Ok(root
            .at(&self.inner.url(&format!("/vms/{id}/agent")), None)
            .signed_by(sign))
    }

    fn exits(&self) -> broadcast::Receiver<String> {
        self.inner.exits.subscribe()
    }

    async fn set_deadline(&self, id: &str, deadline: Option<super::Deadline>) -> Result<(), NodeError> {
        let path = format!("/vms/{id}/deadline");
        self.inner.call(Method::PUT, &path, Some(&deadline), REPORT_LIMIT).await
    }

    async fn watch_start(&self, id: &str, spec: &super::WatchSpec) -> Result<super::WatchStart, NodeError> {
        let path = format!("/vms/{id}/watches");
        self.inner.call(Method::POST, &path, Some(spec), WATCH_LIMIT).await
    }

    async fn watch_take(&self, id: &str, watch: &str) -> Result<Option<super::watches::Taken>, NodeError> {
        let path = format!("/vms/{id}/watches/{watch}/take");
        self.inner.call(Method::POST, &path, None::<&()>, REPORT_LIMIT).await
    }

    async fn watch_stop(&self, id: &str, watch: &str) -> Result<bool, NodeError> {
        let path = format!("/vms/{id}/watches/{watch}");
        self.inner.call(Method::DELETE, &path, None::<&()>, REPORT_LIMIT).await
    }

    async fn egress(&self, id: &str) -> Option<airlock_egress::EgressSnapshot> {
        let path = format!("/vms/{id}/egress");
        match self.inner.call(Method::GET, &path, None::<&()>, REPORT_LIMIT).await {
            Ok(report) => report,
            Err(e) => {
                tracing::warn!("node {}: egress of {id}: {e}", self.inner.addr);
                None
            }
        }
    }

    fn capacity(&self) -> Capacity {
        self.report(|r| r.capacity)
    }

    fn members(&self) -> Vec<super::Member> {
        // Read once: a guard held to the end of the literal would deadlock a second read.
        let down = self.inner.down.lock().unwrap().clone();
        vec![super::Member {
            name: String::new(),
            capacity: self.capacity(),
            answering: down.is_none(),
            refuses: down.or_else(|| {
                self.report(|r| r.draining)
                    .then(|| "draining: it is stopping and takes no new sandbox".to_string())
            }),
            draining: self.report(|r| r.draining),
            fingerprint: self.report(|r| r.fingerprint.clone()),
            parks: self.report(|r| r.parks),
        }]
    }
}
