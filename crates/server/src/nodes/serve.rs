//! A node's HTTP face (the routes in `wire.rs`) over the node's own `Nodes`: what `RemoteNode`
//! calls from another host. Every call must be signed with the cluster secret for this node,
//! fresh and not seen before, and every answer is signed back ([`signed`]; the rules in
//! `wire.rs`); the agent route passes only calls of the agent's protocol (parsed as an
//! `airlock_proto::routes::Route`) on to the VM's agent.

use super::wire::{ClaimRequest, Claimed, Digest, ErrorReply, NodeReport, PoolSize, Saved, Took, VmRequest, PREFIX};
use super::{Admission, Expiry, NodeError, NodeRules, Nodes};
use airlock_runtime::template::TemplateManifest;
use axum::body::Body;
use axum::extract::{OriginalUri, Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post, put};
use axum::{Json, Router};
use http_body_util::BodyExt;
use std::sync::Arc;

#[derive(Clone)]
struct Face {
    nodes: Arc<dyn Nodes>,
    secret: Arc<[u8]>,
    name: Arc<str>,
    /// The node's own admission of creates (None: the caller's is exact, as in tests of it).
    admission: Option<Arc<Admission>>,
    /// The node's own enforcement of timeouts (with `admission`).
    expiry: Option<Arc<Expiry>>,
    /// Set once the node stops ([`NodeFace::drain`]): every start is refused from then on.
    draining: Arc<std::sync::atomic::AtomicBool>,
    /// Changes under way ([`to_completion`]): a stopping node answers them before it exits.
    changing: Arc<std::sync::atomic::AtomicUsize>,
    /// The highest lease epoch each operation's calls carried ([`fence`]), and when.
    epochs: Arc<std::sync::Mutex<std::collections::HashMap<String, (i64, std::time::Instant)>>>,
    /// The nonces of the requests accepted in the last window: a replay is refused.
    nonces: Arc<super::wire::Nonces>,
}

impl Face {
    fn draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// A VM may start here (a create, a resume): refused only while the node drains.
    fn admit_start(&self) -> Result<(), NodeError> {
        match self.draining() {
            true => Err(NodeError::Refused(
                super::Refusal::Draining,
                "this node is draining: it starts no VM; place the sandbox elsewhere".into(),
            )),
            false => Ok(()),
        }
    }
}

/// A `NodeError` as the wire carries it.
struct Failure(NodeError);

impl From<NodeError> for Failure {
    fn from(e: NodeError) -> Self {
        Failure(e)
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(ErrorReply::status(&self.0)).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(ErrorReply::of(&self.0))).into_response()
    }
}

type Reply<T> = Result<Json<T>, Failure>;

fn refused(status: StatusCode, code: &str, message: &str) -> Response {
    let body = ErrorReply {
        code: code.into(),
        message: message.into(),
        reason: None,
    };
    (status, Json(body)).into_response()
}

/// The face of node `name` over `nodes`, every route needing a token of `secret`; with
/// `rules`, it admits each create by them first and ends VMs whose timeout passed itself (an
/// error: the dir it keeps their deadlines in cannot be made).
pub fn router(nodes: Arc<dyn Nodes>, secret: &[u8], name: &str, rules: Option<NodeRules>) -> std::io::Result<Router> {
    Ok(NodeFace::new(nodes, secret, name, rules)?.router())
}

/// A node's face, kept by the daemon that serves it to drain it when it stops.
#[derive(Clone)]
pub struct NodeFace(Face);

impl NodeFace {
    /// See [`router`].
    pub fn new(nodes: Arc<dyn Nodes>, secret: &[u8], name: &str, rules: Option<NodeRules>) -> std::io::Result<Self> {
        let expiry = match &rules {
            Some(r) => Some(Expiry::start(nodes.clone(), r.expiry_grace, r.deadlines.clone())?),
            None => None,
        };
        Ok(NodeFace(Face {
            expiry,
            nodes,
            secret: Arc::from(secret),
            name: Arc::from(name),
            admission: rules.map(|r| Arc::new(Admission::new(r))),
            draining: Default::default(),
            changing: Default::default(),
            epochs: Default::default(),
            nonces: Default::default(),
        }))
    }

    /// Changes under way (a replica's park, suspend, delete) whose caller awaits the answer.
    pub fn changes_under_way(&self) -> usize {
        self.0.changing.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// From now on every start (create, resume) is refused `draining`, and the report says so:
    /// replicas place nothing here and move what runs here elsewhere.
    pub fn drain(&self) {
        self.0.draining.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn router(&self) -> Router {
        let face = self.0.clone();
        let routes = Router::new()
            .route("/report", get(report))
            .route("/vms", post(create))
            .route("/vms/{id}", delete(remove))
            .route("/vms/{id}/pause", post(pause))
            .route("/vms/{id}/resume", post(resume))
            .route("/vms/{id}/suspend", post(suspend))
            .route("/vms/{id}/settled", post(settled))
            .route("/settled", post(settled_all))
            .route("/vms/{id}/images/{image}", post(save_image))
            .route("/vms/{id}/park/{image}", post(park))
            .route("/images/{image}", delete(delete_image))
            .route("/vms/{id}/capture", post(capture_template))
            .route("/templates/{name}", delete(remove_template))
            .route("/templates/import", post(import_image))
            .route("/images/{image}/share", post(share_image))
            .route("/images/{image}/digest", get(digest_image))
            .route("/parked/{image}", delete(delete_parked))
            .route("/claims", post(claim))
            .route("/claims/{id}", delete(unclaim))
            .route("/pools", put(set_pool))
            .route("/vms/{id}/egress", get(egress))
            .route("/vms/{id}/watches", post(watch_start))
            .route("/vms/{id}/watches/{watch}/take", post(watch_take))
            .route("/vms/{id}/watches/{watch}", delete(watch_stop))
            .route("/vms/{id}/deadline", put(set_deadline))
            .route("/exits", get(exits))
            .route("/vms/{id}/agent/{*route}", any(agent))
            .layer(axum::middleware::from_fn_with_state(face.clone(), fence))
            .layer(axum::middleware::from_fn(log_change))
            .with_state(face.clone());
        // Outside the nest: the path checked is the one signed, prefix and all.
        Router::new()
            .nest(PREFIX, routes)
            .layer(axum::middleware::from_fn_with_state(face, signed))
    }
}

/// The largest request body a node reads (to check its digest) on a route other than the
/// agent's: axum's bound on a JSON body, which each route's extractor applies anyway.
const REQUEST_MAX: usize = 2 << 20;

/// Where a body streams and is signed [`super::wire::UNSIGNED`]: the agent route (both ways)
/// and the exit stream (its answer).
fn streams(path: &str) -> bool {
    let rest = path.strip_prefix(PREFIX).unwrap_or("");
    let mut parts = rest.split('/').skip(1);
    rest == "/exits" || (parts.next() == Some("vms") && parts.nth(1) == Some("agent"))
}

/// A request whose signature does not pass: 401, or 503 when the nonces have no room.
fn unsigned(method: &axum::http::Method, path: &str, e: super::wire::Unsigned) -> Response {
    tracing::warn!("refused {method} {path}: {e}");
    let status = match e {
        super::wire::Unsigned::Busy => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::UNAUTHORIZED,
    };
    refused(status, "unauthorized", &e.to_string())
}

/// Every request checked against its signature ([`super::wire::verify_request`]), refused
/// otherwise ([`unsigned`]); every answer signed over its request's nonce.
async fn signed(State(face): State<Face>, req: Request, next: axum::middleware::Next) -> Response {
    use super::wire;
    let (parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let streamed = streams(parts.uri.path());
    let is_report = parts.method == axum::http::Method::GET && parts.uri.path() == format!("{PREFIX}/report");
    // Before the body is read: a request that cannot pass costs no buffer.
    if let Err(e) = wire::precheck(&face.name, is_report, &parts.headers) {
        return unsigned(&parts.method, parts.uri.path(), e);
    }
    let (digest, body) = if streamed {
        (wire::UNSIGNED.to_string(), body)
    } else {
        match axum::body::to_bytes(body, REQUEST_MAX).await {
            Ok(bytes) => (wire::body_digest(&bytes), Body::from(bytes)),
            Err(_) => {
                return refused(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "too_large",
                    "the request body is too large",
                )
            }
        }
    };
    let nonce = match wire::verify_request(
        &face.secret,
        &face.name,
        parts.method.as_str(),
        &path,
        &digest,
        is_report,
        &parts.headers,
        &face.nonces,
    ) {
        Ok(nonce) => nonce,
        Err(e) => return unsigned(&parts.method, parts.uri.path(), e),
    };
    let resp = next.run(Request::from_parts(parts, body)).await;
    let (mut parts, body) = resp.into_parts();
    let (digest, body) = if streamed {
        (wire::UNSIGNED.to_string(), body)
    } else {
        match axum::body::to_bytes(body, usize::MAX).await {
            Ok(bytes) => (wire::body_digest(&bytes), Body::from(bytes)),
            Err(e) => return Failure(NodeError::Failed(Box::new(std::io::Error::other(e)))).into_response(),
        }
    };
    let tag = wire::sign_reply(&face.secret, &nonce, &face.name, parts.status.as_u16(), &digest);
    for (name, value) in [
        (wire::NAME_HEADER, face.name.to_string()),
        (wire::BODY_HEADER, digest),
        (wire::SIGNATURE_HEADER, tag),
    ] {
        if let Ok(value) = axum::http::HeaderValue::from_str(&value) {
            parts.headers.insert(name, value);
        }
    }
    Response::from_parts(parts, body)
}

/// A change: not a read, not the agent's traffic, not a poll of a watch (a read too, however
/// often it comes).
fn is_change(req: &Request) -> bool {
    let (method, path) = (req.method(), req.uri().path());
    method != axum::http::Method::GET && !path.contains("/agent/") && !path.ends_with("/take")
}

/// How long a node remembers an operation's epoch: far past any lease ([`crate::store::LEASE_MS`])
/// a stalled caller could still hold a call through.
const EPOCHS_KEPT: std::time::Duration = std::time::Duration::from_secs(3600);

/// Fencing: a change made for an operation whose lease epoch is lower than one this node has
/// seen for it is refused 409 `fenced`; its caller stalled past its lease and another replica
/// drives the operation now. Calls without an operation (a reaper's, a read) pass.
async fn fence(State(face): State<Face>, req: Request, next: axum::middleware::Next) -> Response {
    match face.fenced(&req) {
        Some(op) => Failure(NodeError::Fenced(op)).into_response(),
        None => next.run(req).await,
    }
}

impl Face {
    /// The operation `req` is made for, if its epoch is lower than one seen for it; else
    /// None, its epoch recorded.
    fn fenced(&self, req: &Request) -> Option<String> {
        let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
        let (op, epoch) = match (header(super::wire::OPERATION_HEADER), header(super::wire::EPOCH_HEADER)) {
            (Some(op), Some(epoch)) if op.len() <= 64 && is_change(req) => (op, epoch.parse::<i64>().ok()?),
            _ => return None,
        };
        let mut epochs = self.epochs.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        if epochs.len() > 4096 {
            epochs.retain(|_, (_, at)| now.duration_since(*at) < EPOCHS_KEPT);
        }
        match epochs.get(op) {
            Some((seen, _)) if *seen > epoch => {
                tracing::warn!(%op, epoch, seen, "refused a change of a lease since taken over");
                Some(op.to_string())
            }
            _ => {
                epochs.insert(op.to_string(), (epoch, now));
                None
            }
        }
    }
}

/// One line per change a caller asks for, with the operation it is made for: what this node
/// was asked to do for which operation. Written as the call arrives, as its caller may go
/// before the answer.
async fn log_change(req: Request, next: axum::middleware::Next) -> Response {
    let (method, path) = (req.method(), req.uri().path());
    if is_change(&req) {
        let op = req
            .headers()
            .get(super::wire::OPERATION_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|v| v.len() <= 64)
            .unwrap_or("-");
        tracing::info!(op = %op, "change: {method} {path}");
    }
    next.run(req).await
}

async fn report(State(f): State<Face>) -> Json<NodeReport> {
    let n = &f.nodes;
    Json(NodeReport {
        name: f.name.to_string(),
        runtime_name: n.runtime_name(),
        accel: n.accel().await,
        capacity: n.capacity(),
        templates: n.templates(),
        pools: n.pools(),
        vms: n.vm_reports().into_iter().map(|(_, vm)| vm).collect(),
        images: n.image_ids(),
        draining: f.draining(),
        fingerprint: n.fingerprint().await,
        parks: n.parks(),
    })
}

/// Carry a change out to its end even if its caller goes away (a replica that dies mid-call):
/// the VM is then whole or gone, and the replica that takes the operation over finds which.
/// Counted in `changing` while it runs.
async fn to_completion<T: Send + 'static>(
    changing: Arc<std::sync::atomic::AtomicUsize>,
    change: impl std::future::Future<Output = Result<T, NodeError>> + Send + 'static,
) -> Reply<T> {
    use std::sync::atomic::Ordering;
    changing.fetch_add(1, Ordering::SeqCst);
    let done = tokio::spawn(async move {
        let done = change.await;
        changing.fetch_sub(1, Ordering::SeqCst);
        done
    })
    .await;
    match done {
        Ok(done) => Ok(Json(done?)),
        Err(e) => Err(Failure(NodeError::Failed(Box::new(e)))),
    }
}

async fn create(State(f): State<Face>, Json(vm): Json<VmRequest>) -> Reply<super::Booted> {
    f.admit_start()?;
    if vm.moved_from.is_some() {
        super::admission::machine_fits(&f.nodes.fingerprint().await, &vm)?;
    }
    to_completion(f.changing.clone(), async move {
        // Held until the create returns: by then the VM counts among the node's own, or is gone.
        let _ticket = match &f.admission {
            Some(a) => Some(a.admit(&f.nodes.capacity(), &vm)?),
            None => None,
        };
        f.nodes.create(&vm).await
    })
    .await
}

/// `DELETE /vms/{id}?run=R`: only that run of the VM.
#[derive(serde::Deserialize)]
struct RunQuery {
    run: Option<String>,
}

async fn remove(
    State(f): State<Face>,
    Path(id): Path<String>,
    axum::extract::Query(q): axum::extract::Query<RunQuery>,
) -> Reply<()> {
    to_completion(f.changing.clone(), async move {
        f.nodes.delete(&id, q.run.as_deref()).await?;
        if let Some(expiry) = &f.expiry {
            expiry.set(&id, None);
        }
        Ok(())
    })
    .await
}

async fn set_deadline(
    State(f): State<Face>,
    Path(id): Path<String>,
    Json(deadline): Json<Option<super::Deadline>>,
) -> Reply<()> {
    match &f.expiry {
        Some(expiry) => expiry.set(&id, deadline),
        None => f.nodes.set_deadline(&id, deadline).await?,
    }
    Ok(Json(()))
}

async fn pause(State(f): State<Face>, Path(id): Path<String>) -> Reply<()> {
    to_completion(f.changing.clone(), async move { f.nodes.pause(&id).await }).await
}

async fn resume(State(f): State<Face>, Path(id): Path<String>) -> Reply<()> {
    f.admit_start()?;
    to_completion(f.changing.clone(), async move { f.nodes.resume(&id).await }).await
}

async fn suspend(State(f): State<Face>, Path(id): Path<String>) -> Reply<Took> {
    to_completion(f.changing.clone(), async move {
        Ok(Took {
            ms: f.nodes.suspend(&id).await?,
        })
    })
    .await
}

async fn settled(State(f): State<Face>, Path(id): Path<String>) -> Json<()> {
    f.nodes.settled(&id).await;
    Json(())
}

async fn settled_all(State(f): State<Face>) -> Json<()> {
    f.nodes.settled_all().await;
    Json(())
}

async fn save_image(State(f): State<Face>, Path((id, image)): Path<(String, String)>) -> Reply<Saved> {
    to_completion(f.changing.clone(), async move {
        Ok(Saved {
            bytes: f.nodes.save_image(&id, &image).await?,
        })
    })
    .await
}

async fn park(State(f): State<Face>, Path((id, image)): Path<(String, String)>) -> Reply<super::Parked> {
    to_completion(f.changing.clone(), async move {
        let parked = f.nodes.park(&id, &image).await?;
        if let Some(expiry) = &f.expiry {
            expiry.set(&id, None);
        }
        Ok(parked)
    })
    .await
}

async fn capture_template(
    State(f): State<Face>,
    Path(id): Path<String>,
    Json(capture): Json<super::Capture>,
) -> Reply<TemplateManifest> {
    to_completion(f.changing.clone(), async move {
        let manifest = f.nodes.capture_template(&id, &capture).await?;
        if let Some(expiry) = &f.expiry {
            expiry.set(&id, None);
        }
        Ok(manifest)
    })
    .await
}

async fn import_image(State(f): State<Face>, Json(import): Json<super::ImageImport>) -> Reply<TemplateManifest> {
    to_completion(f.changing.clone(), async move { f.nodes.import_image(&import).await }).await
}

async fn remove_template(State(f): State<Face>, Path(name): Path<String>) -> Reply<()> {
    to_completion(f.changing.clone(), async move { f.nodes.remove_template(&name).await }).await
}

async fn delete_image(State(f): State<Face>, Path(image): Path<String>) -> Reply<()> {
    to_completion(f.changing.clone(), async move { f.nodes.delete_image(&image).await }).await
}

async fn share_image(State(f): State<Face>, Path(image): Path<String>) -> Reply<super::Parked> {
    to_completion(f.changing.clone(), async move { f.nodes.share_image(&image).await }).await
}

async fn delete_parked(State(f): State<Face>, Path(image): Path<String>) -> Reply<()> {
    to_completion(f.changing.clone(), async move { f.nodes.delete_parked(&image).await }).await
}

async fn digest_image(State(f): State<Face>, Path(image): Path<String>) -> Reply<Digest> {
    Ok(Json(Digest {
        digest: f.nodes.digest_image(&image).await?,
    }))
}

async fn claim(State(f): State<Face>, Json(c): Json<ClaimRequest>) -> Json<Claimed> {
    Json(Claimed {
        id: f.nodes.claim(&c.template, &c.resources).await,
    })
}

async fn unclaim(State(f): State<Face>, Path(id): Path<String>) -> Json<()> {
    f.nodes.unclaim(&id);
    Json(())
}

async fn set_pool(State(f): State<Face>, Json(p): Json<PoolSize>) -> Reply<()> {
    Ok(Json(f.nodes.set_pool(&p.template, &p.resources, p.size).await?))
}

async fn egress(State(f): State<Face>, Path(id): Path<String>) -> Json<Option<airlock_egress::EgressSnapshot>> {
    Json(f.nodes.egress(&id).await)
}

/// The ids of VMs that exit from now on, a line each, for as long as the caller reads.
async fn exits(State(f): State<Face>) -> Response {
    let lines = futures_util::stream::unfold(f.nodes.exits(), |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(id) => return Some((Ok::<_, std::io::Error>(format!("{id}\n")), rx)),
                // A caller that fell behind lost some: it learns them from its next report.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    Body::from_stream(lines).into_response()
}

/// One call of the agent's protocol, passed to the VM's agent and its answer passed back.
async fn agent(
    State(f): State<Face>,
    Path((id, _)): Path<(String, String)>,
    OriginalUri(uri): OriginalUri,
    req: Request,
) -> Response {
    // The path as sent (percent-encoded, as the agent parses it), less the node's part.
    let prefix = format!("{PREFIX}/vms/{id}/agent");
    let path = uri.path().strip_prefix(prefix.as_str()).unwrap_or("/");
    let route = match airlock_proto::routes::Route::parse(req.method().as_str(), path, uri.query()) {
        Ok(r) => r,
        Err(e) => return refused(StatusCode::NOT_FOUND, "not_found", &e.to_string()),
    };
    let client = match f.nodes.agent(&id).await {
        Ok(c) => c,
        Err(e) => return Failure(e).into_response(),
    };
    let body = req.into_body().map_err(std::io::Error::other).boxed_unsync();
    match client.forward(&route, body).await {
        Ok(resp) => resp.map(Body::new),
        Err(e) => refused(StatusCode::BAD_GATEWAY, "agent_unreachable", &e.to_string()),
    }
}

async fn watch_start(
    State(f): State<Face>,
    Path(id): Path<String>,
    Json(spec): Json<super::WatchSpec>,
) -> Reply<super::WatchStart> {
    Ok(Json(f.nodes.watch_start(&id, &spec).await?))
}

async fn watch_take(
    State(f): State<Face>,
    Path((id, watch)): Path<(String, String)>,
) -> Reply<Option<super::watches::Taken>> {
    Ok(Json(f.nodes.watch_take(&id, &watch).await?))
}

async fn watch_stop(State(f): State<Face>, Path((id, watch)): Path<(String, String)>) -> Reply<bool> {
    Ok(Json(f.nodes.watch_stop(&id, &watch).await?))
}
