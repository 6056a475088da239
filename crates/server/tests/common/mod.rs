//! The whole server in-process over the fake VMM, for the fast tests (`core.rs`, `limits.rs`).
//!
//! Each server "life" runs on its own tokio runtime and serves on 127.0.0.1:0; the test talks
//! HTTP to it from the test's runtime. A restart drops the app, the core and the runtime (every
//! task of that life goes with its tokio runtime) and builds a new server on the same data dir,
//! with the fake VMs still running, as a real server restart would.

// Each test crate uses part of it.
#![allow(dead_code)]

use airlock_runtime::{fake, Runtime, RuntimeError};
use airlock_server::core::{Config, Core};
use airlock_server::listen::Limits;
use airlock_server::nodes::{Booted, Capacity, LocalNode, NodeEgress, Nodes, VmState};
use airlock_server::store::SqliteStore;
use airlock_server::AppState;
use axum::body::{Body, Bytes};
use axum::http::{Method, Request};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The same secret every life: access tokens issued before a restart stay valid.
pub const SECRET: [u8; 32] = [7; 32];
/// The cluster secret a test node face and its `RemoteNode` share.
pub const NODE_SECRET: &[u8] = b"test cluster secret";

// ---------------------------------------------------------------------------------------------
// An in-process server

pub mod cluster;
mod node;
pub use node::*;

/// A core over `store` and `nodes`, recovered, its reaper and sampler running, its routes served
/// on loopback: (address, core).
pub async fn serve_core(
    store: Arc<dyn airlock_server::store::Store>,
    nodes: Arc<dyn Nodes>,
    config: Config,
    background: bool,
    limits: Limits,
) -> (SocketAddr, Core) {
    let core = Core::new(store, nodes, config, SECRET.to_vec());
    if background {
        core.engine().start_recovery().await.unwrap();
    } else {
        core.engine().recover().await.unwrap();
    }
    core.engine().spawn_reaper();
    core.spawn_metrics_sampler();
    let app = airlock_server::router(AppState {
        core: core.clone(),
        e2b_domain: None,
        console: Default::default(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(airlock_server::listen::serve(listener, app, None, limits));
    (addr, core)
}

pub struct Server {
    pub dir: PathBuf,
    pub max: u32,
    pub addr: SocketAddr,
    /// The admin key of tenant `default`.
    pub key: String,
    pub core: Option<Core>,
    /// The runtime the server's `LocalNode` wraps (a clone: the same VMs).
    pub runtime: Option<Runtime>,
    pub tokio: Option<tokio::runtime::Runtime>,
    /// The data dir, when this server made its own (`start_fresh`).
    pub tmp: Option<tempfile::TempDir>,
    /// The node's HTTP face, when the core reaches its node through it.
    pub node_face: Option<SocketAddr>,
    /// The node's egress side (its specs and counters; the fake VMM has no networks to serve);
    /// none for a replica of a cluster.
    pub node_egress: Option<Arc<NodeEgress>>,
    /// A replica's cluster of nodes.
    pub cluster: Option<Arc<airlock_server::nodes::Cluster>>,
}

/// A fresh data dir with the `seed` template.
pub fn fresh() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    fake::install_template(tmp.path(), "seed").unwrap();
    tmp
}

/// `Runtime::open`, retrying while the previous life's runtime lets go of the data dir.
pub async fn open_runtime(dir: &Path, reconcile_in_background: bool) -> Runtime {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let opts = airlock_runtime::RuntimeOptions {
            reconcile_in_background,
            ..fake::options(dir)
        };
        match Runtime::open(opts).await {
            Ok(rt) => return rt,
            Err(RuntimeError::DataDirInUse(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("open the runtime: {e}"),
        }
    }
}

impl Server {
    /// Open everything on `dir` as `airlock_server::serve` does, recover, and serve.
    pub async fn start(dir: &Path, max: u32, key: Option<&str>) -> Server {
        Self::start_with(dir, max, key, Duration::ZERO).await
    }

    /// `start`, with every VM create held back by `create_delay` before it reaches the node
    /// (to let other operations overtake it).
    pub async fn start_with(dir: &Path, max: u32, key: Option<&str>, create_delay: Duration) -> Server {
        Self::start_full(dir, max, key, create_delay, ROOMY, Config::default()).await
    }

    /// `start` on a node that has `capacity` (budgets derived from it by `config`).
    pub async fn start_sized(dir: &Path, max: u32, capacity: Capacity, config: Config) -> Server {
        Self::start_full(dir, max, None, Duration::ZERO, capacity, config).await
    }

    pub async fn start_full(
        dir: &Path,
        max: u32,
        key: Option<&str>,
        create_delay: Duration,
        capacity: Capacity,
        config: Config,
    ) -> Server {
        Self::start_life(dir, max, key, create_delay, capacity, config, None).await
    }

    /// A server on a data dir of its own, with the tenant quota (8) as its only limit and
    /// `limits` on its listener.
    pub async fn start_fresh(limits: Limits) -> Server {
        let tmp = fresh();
        let config = Config {
            max_sandboxes_per_tenant: 8,
            ..Config::default()
        };
        let mut server =
            Self::start_listening(tmp.path(), 8, None, Duration::ZERO, ROOMY, config, None, limits, false).await;
        server.tmp = Some(tmp);
        server
    }

    /// A life that starts as `airlock_server::serve` does: the runtime re-attaches VMs in the
    /// background, the recovery runs while the listener serves, and the node reports a VM in
    /// `hold` settled only once the test releases it (a slow re-attach).
    pub async fn start_recovering(dir: &Path, key: &str, config: Config, hold: Arc<Hold>) -> Server {
        Self::start_life(dir, 4, Some(key), Duration::ZERO, ROOMY, config, Some(hold)).await
    }

    pub async fn start_life(
        dir: &Path,
        max: u32,
        key: Option<&str>,
        create_delay: Duration,
        capacity: Capacity,
        config: Config,
        hold: Option<Arc<Hold>>,
    ) -> Server {
        Self::start_listening(
            dir,
            max,
            key,
            create_delay,
            capacity,
            config,
            hold,
            Limits::default(),
            false,
        )
        .await
    }

    /// `start`, with the node on the far side of its HTTP face: the core holds a `RemoteNode`
    /// that calls the node's face (`nodes::serve`) over loopback, as an API replica calls a node
    /// on another host.
    pub async fn start_over_node_face(dir: &Path) -> Server {
        Self::start_listening(
            dir,
            4,
            None,
            Duration::ZERO,
            ROOMY,
            Config::default(),
            None,
            Limits::default(),
            true,
        )
        .await
    }

    // The one place every test server's knobs meet; the public constructors name them.
    #[allow(clippy::too_many_arguments)]
    async fn start_listening(
        dir: &Path,
        max: u32,
        key: Option<&str>,
        create_delay: Duration,
        capacity: Capacity,
        config: Config,
        hold: Option<Arc<Hold>>,
        limits: Limits,
        over_node_face: bool,
    ) -> Server {
        let tokio_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("airlock-test-server")
            .enable_all()
            .build()
            .unwrap();
        let d = dir.to_path_buf();
        let known_key = key.map(String::from);
        let (addr, key, core, runtime, node_face, node_egress) = tokio_rt
            .spawn(async move {
                let background = hold.is_some();
                let store = SqliteStore::open(&d.join("airlock.db")).await.unwrap();
                let minted = airlock_server::bootstrap_admin_key(&store, &d, &"127.0.0.1:0".parse().unwrap())
                    .await
                    .unwrap();
                let key = known_key.or(minted).expect("an admin key");
                let (node, runtime, node_egress) = test_node(
                    &d,
                    &config.egress,
                    capacity,
                    create_delay,
                    hold.unwrap_or_default(),
                    background,
                )
                .await;
                let mut nodes = node;
                let mut node_face = None;
                if over_node_face {
                    let face = airlock_server::nodes::serve::router(nodes, NODE_SECRET, "test-node", None).unwrap();
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                    let face_addr = listener.local_addr().unwrap();
                    node_face = Some(face_addr);
                    tokio::spawn(airlock_server::listen::serve(listener, face, None, Limits::default()));
                    nodes = Arc::new(
                        airlock_server::nodes::RemoteNode::connect(face_addr, NODE_SECRET)
                            .await
                            .unwrap(),
                    );
                }
                let config = Config {
                    max_sandboxes_per_tenant: max,
                    ..config
                };
                let (addr, core) = serve_core(Arc::new(store), nodes, config, background, limits).await;
                (addr, key, core, runtime, node_face, node_egress)
            })
            .await
            .unwrap();
        Server {
            dir: dir.to_path_buf(),
            max,
            addr,
            key,
            core: Some(core),
            runtime: Some(runtime),
            tokio: Some(tokio_rt),
            tmp: None,
            node_face,
            node_egress: Some(node_egress),
            cluster: None,
        }
    }

    /// Stop this life: its tasks, app, core and runtime all go; the fake VMs keep running.
    pub async fn stop(mut self) {
        let core = self.core.take();
        let runtime = self.runtime.take();
        let rt = self.tokio.take().unwrap();
        tokio::task::spawn_blocking(move || {
            rt.block_on(async move { drop((core, runtime)) });
            drop(rt); // waits for its workers: every task of this life is dropped
        })
        .await
        .unwrap();
    }

    pub async fn restart(self) -> Server {
        let (dir, max, key) = (self.dir.clone(), self.max, self.key.clone());
        self.stop().await;
        Server::start(&dir, max, Some(&key)).await
    }

    pub fn core(&self) -> &Core {
        self.core.as_ref().unwrap()
    }

    pub fn runtime(&self) -> Runtime {
        self.runtime.clone().unwrap()
    }

    pub fn node_egress(&self) -> &NodeEgress {
        self.node_egress.as_deref().expect("a server with its own node")
    }

    /// Run `f` on this server's tokio runtime (runtime calls spawn tasks that belong to it).
    pub async fn on_server<T: Send + 'static>(&self, f: impl Future<Output = T> + Send + 'static) -> T {
        self.tokio.as_ref().unwrap().spawn(f).await.unwrap()
    }

    pub async fn tenant_id(&self) -> String {
        self.core().store().tenant_by_key(&self.key).await.unwrap().unwrap().id
    }

    pub fn vm_pid(&self, id: &str) -> u32 {
        self.runtime().get(id).expect("the sandbox's VM").handle.pid
    }

    // --- HTTP

    pub async fn send(&self, method: Method, path: &str, headers: &[(&str, &str)], body: Body) -> Resp {
        self.send_to(self.addr, method, path, headers, body).await
    }

    /// A request to `addr` (another listener of this server's core).
    pub async fn send_to(
        &self,
        addr: SocketAddr,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Body,
    ) -> Resp {
        let mut req = Request::builder().method(method).uri(path);
        if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
            req = req.header("host", addr.to_string());
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let res = sender.send_request(req.body(body).unwrap()).await.unwrap();
        let status = res.status().as_u16();
        let headers = res.headers().clone();
        Resp {
            status,
            headers,
            body: Body::new(res.into_body()),
        }
    }

    /// Any request; the answer as JSON (or a JSON string of a body that is not JSON).
    pub async fn json(&self, method: Method, path: &str, headers: &[(&str, &str)], body: Body) -> (u16, Value) {
        self.send(method, path, headers, body).await.json().await
    }

    /// A `/v1` call with the admin key.
    /// root@local's password set to `password`, and an admin token signed in with it.
    pub async fn admin_token(&self, password: &str) -> String {
        self.core().ensure_console_account(Some(password)).await.unwrap();
        let (status, body) = self
            .json(
                Method::POST,
                "/v1/admin/login",
                &[("content-type", "application/json")],
                Body::from(serde_json::json!({"username": "root@local", "password": password}).to_string()),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        body["token"].as_str().unwrap().to_string()
    }

    /// An admin route (`/v1/admin` + `path`) with an admin token.
    pub async fn admin_json(&self, token: &str, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let auth = format!("Bearer {token}");
        let mut headers = vec![("authorization", auth.as_str())];
        let body = match body {
            Some(b) => {
                headers.push(("content-type", "application/json"));
                Body::from(b.to_string())
            }
            None => Body::empty(),
        };
        self.json(method, &format!("/v1/admin{path}"), &headers, body).await
    }

    pub async fn v1(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        self.v1_as(&self.key, method, path, body).await
    }

    pub async fn v1_as(&self, key: &str, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let auth = format!("Bearer {key}");
        let (headers, body) = match body {
            Some(b) => (
                vec![("authorization", auth.as_str()), ("content-type", "application/json")],
                Body::from(b.to_string()),
            ),
            None => (vec![("authorization", auth.as_str())], Body::empty()),
        };
        self.send(method, &format!("/v1{path}"), &headers, body)
            .await
            .json()
            .await
    }

    /// An E2B control-plane call (`X-API-KEY`).
    pub async fn e2b(&self, method: Method, path: &str, body: Value) -> (u16, Value) {
        let headers = [("x-api-key", self.key.as_str()), ("content-type", "application/json")];
        self.send(method, path, &headers, Body::from(body.to_string()))
            .await
            .json()
            .await
    }

    /// A unary envd Connect RPC (`/process.Process/List`, ...).
    pub async fn envd_unary(&self, sb: &E2bSandbox, rpc: &str, req: Value) -> (u16, Value) {
        let headers = [
            ("x-access-token", sb.token.as_str()),
            ("e2b-sandbox-id", sb.id.as_str()),
            ("content-type", "application/json"),
            ("connect-protocol-version", "1"),
        ];
        self.send(Method::POST, rpc, &headers, Body::from(req.to_string()))
            .await
            .json()
            .await
    }

    /// A server-streaming envd Connect RPC (`/process.Process/Start`): the request enveloped.
    pub async fn envd_stream(&self, sb: &E2bSandbox, rpc: &str, req: Value) -> (u16, ConnectStream) {
        let headers = [
            ("x-access-token", sb.token.as_str()),
            ("e2b-sandbox-id", sb.id.as_str()),
            ("content-type", "application/connect+json"),
            ("connect-protocol-version", "1"),
        ];
        let resp = self.send(Method::POST, rpc, &headers, Body::from(envelope(&req))).await;
        (
            resp.status,
            ConnectStream {
                body: resp.body.into_data_stream().boxed(),
                buf: Vec::new(),
            },
        )
    }

    // --- Common steps

    /// `POST /v1/sandboxes`; the operation is not waited for.
    pub async fn create_native(&self) -> (String, String) {
        let (status, body) = self
            .v1(Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
            .await;
        assert_eq!(status, 202, "{body}");
        (
            body["sandbox_id"].as_str().unwrap().to_string(),
            body["operation"]["id"].as_str().unwrap().to_string(),
        )
    }

    /// A running sandbox made through `/v1`.
    pub async fn running_sandbox(&self) -> String {
        let (id, op) = self.create_native().await;
        let op = self.wait_op(&op).await;
        assert_eq!(op["state"], "succeeded", "{op}");
        assert_eq!(self.sandbox_state(&id).await, "running");
        id
    }

    /// A running sandbox made through E2B `POST /sandboxes`, with its envd access token.
    pub async fn e2b_sandbox(&self) -> E2bSandbox {
        let (status, body) = self
            .e2b(Method::POST, "/sandboxes", json!({ "templateID": "base" }))
            .await;
        assert_eq!(status, 201, "{body}");
        E2bSandbox {
            id: body["sandboxID"].as_str().unwrap().to_string(),
            token: body["envdAccessToken"].as_str().unwrap().to_string(),
            traffic: body["trafficAccessToken"].as_str().unwrap().to_string(),
        }
    }

    pub async fn operation(&self, id: &str) -> Value {
        let (status, op) = self.v1(Method::GET, &format!("/operations/{id}"), None).await;
        assert_eq!(status, 200, "{op}");
        op
    }

    /// Poll an operation until it is final.
    pub async fn wait_op(&self, id: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let op = self.operation(id).await;
            if op["state"] == "succeeded" || op["state"] == "failed" {
                return op;
            }
            assert!(Instant::now() < deadline, "operation still open after 10 s: {op}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn sandbox_state(&self, id: &str) -> String {
        let (status, sb) = self.v1(Method::GET, &format!("/sandboxes/{id}"), None).await;
        assert_eq!(status, 200, "{sb}");
        sb["state"].as_str().unwrap().to_string()
    }

    /// Poll until the sandbox is in `state`, for at most `within`.
    pub async fn await_state(&self, id: &str, state: &str, within: Duration) -> Duration {
        let started = Instant::now();
        loop {
            let now = self.sandbox_state(id).await;
            if now == state {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < within,
                "sandbox {id} is still {now} after {within:?}, expected {state}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Start `argv` as a `/v1` session; returns the session.
    pub async fn session(&self, id: &str, argv: &[&str]) -> Value {
        let (status, s) = self
            .v1(
                Method::POST,
                &format!("/sandboxes/{id}/sessions"),
                Some(json!({ "argv": argv })),
            )
            .await;
        assert_eq!(status, 201, "{s}");
        s
    }

    /// The sandbox answers: `echo alive` runs in it and its output streams back.
    pub async fn assert_answers(&self, id: &str) {
        let s = self.session(id, &["echo", "alive"]).await;
        let sid = s["id"].as_str().unwrap();
        let resp = self
            .send(
                Method::GET,
                &format!("/v1/sandboxes/{id}/sessions/{sid}/stream"),
                &[("authorization", &format!("Bearer {}", self.key))],
                Body::empty(),
            )
            .await;
        assert_eq!(resp.status, 200);
        let sse = tokio::time::timeout(Duration::from_secs(5), axum::body::to_bytes(resp.body, 1 << 20))
            .await
            .expect("the session's stream ends within 5 s")
            .unwrap();
        let sse = String::from_utf8_lossy(&sse);
        // base64("alive\n")
        assert!(sse.contains("YWxpdmUK"), "no output in {sse}");
        assert!(
            sse.contains("event: process_exited") && sse.contains("\"exit_code\":0"),
            "no clean exit in {sse}"
        );
    }

    /// Delete through `/v1` and wait for it.
    pub async fn delete(&self, id: &str) {
        let (status, body) = self.v1(Method::DELETE, &format!("/sandboxes/{id}"), None).await;
        assert_eq!(status, 202, "{body}");
        let op = self.wait_op(body["operation"]["id"].as_str().unwrap()).await;
        assert_eq!(op["state"], "succeeded", "{op}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Only on a panic path (`stop` takes the runtime): do not block in async context.
        if let Some(rt) = self.tokio.take() {
            rt.shutdown_background();
        }
    }
}

pub struct E2bSandbox {
    pub id: String,
    /// `envdAccessToken`.
    pub token: String,
    /// `trafficAccessToken`: the sandbox's ports only.
    pub traffic: String,
}

pub struct Resp {
    pub status: u16,
    pub headers: axum::http::HeaderMap,
    pub body: Body,
}

impl Resp {
    pub async fn json(self) -> (u16, Value) {
        let bytes = tokio::time::timeout(Duration::from_secs(10), axum::body::to_bytes(self.body, 16 << 20))
            .await
            .expect("a response body within 10 s")
            .unwrap();
        let v = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        (self.status, v)
    }
}

/// A Connect envelope: flags u8, length u32 BE, JSON.
pub fn envelope(v: &Value) -> Vec<u8> {
    let payload = serde_json::to_vec(v).unwrap();
    let mut b = vec![0u8];
    b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    b.extend_from_slice(&payload);
    b
}

/// The messages of a Connect server stream, as they arrive.
pub struct ConnectStream {
    pub body: futures_util::stream::BoxStream<'static, Result<Bytes, axum::Error>>,
    pub buf: Vec<u8>,
}

impl ConnectStream {
    /// The next envelope (flags, JSON); `None` once the stream ends.
    pub async fn next(&mut self) -> Option<(u8, Value)> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes(self.buf[1..5].try_into().unwrap()) as usize;
                if self.buf.len() >= 5 + len {
                    let flags = self.buf[0];
                    let v = serde_json::from_slice(&self.buf[5..5 + len]).unwrap();
                    self.buf.drain(..5 + len);
                    return Some((flags, v));
                }
            }
            let chunk = tokio::time::timeout(Duration::from_secs(5), self.body.next())
                .await
                .expect("a stream message within 5 s")?;
            self.buf.extend_from_slice(&chunk.unwrap());
        }
    }

    /// The next message that is not a keepalive.
    pub async fn next_event(&mut self) -> Option<(u8, Value)> {
        loop {
            let m = self.next().await?;
            if m.1["event"].get("keepalive").is_none() {
                return Some(m);
            }
        }
    }
}

/// No fake VM of this data dir may outlive the test.
pub fn assert_no_vms(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while !fake::live_vms(dir).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(fake::live_vms(dir), Vec::<u32>::new(), "fake VMs left behind");
}
