//! airlock's HTTP server: two doors (the native `/v1` API and the E2B door) over one core.
//! ARCHITECTURE.md at the repository root shows the layers and where new code goes.
//!
//! - `native`, `e2b`: the doors (routes, wire formats, one error mapping each)
//! - `ingress`: host routing and port forwarding into sandboxes
//! - `core`: principal, sandbox/session/file/template services, `CoreError`
//! - `engine`: operations (create, delete, pause, resume), recovery, the reaper
//! - `store`: the control-plane database (SQLite; versioned migrations)
//! - `nodes`: the seam to the hosts that run VMs (`LocalNode` wraps the runtime)

pub mod console;
pub mod core;
pub mod e2b;
pub mod engine;
pub mod error;
pub mod ingress;
pub mod listen;
pub mod model;
pub mod native;
pub mod node_daemon;
pub mod nodes;
pub mod records;
pub mod signals;
pub mod store;
pub mod telemetry;

use axum::routing::{get, post};
use axum::Router;

/// Everything the server's routes share: the core, and the E2B door's domain.
#[derive(Clone)]
pub struct AppState {
    pub core: core::Core,
    /// The E2B domain (`api.<domain>`, `<port>-<id>.<domain>`) returned to SDKs, if configured.
    pub e2b_domain: Option<Arc<str>>,
    /// The web console's sign-in lifetimes.
    pub console: console::ConsoleSettings,
}
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(title = "airlock", description = "Self-hosted microVM sandboxes for AI agents: native API (milestone 1)"),
    paths(
        native::create_sandbox, native::list_sandboxes, native::get_sandbox, native::get_egress, native::get_tenant, native::delete_sandbox, native::pause_sandbox, native::suspend_sandbox, native::resume_sandbox, native::fork_sandbox,
        native::create_snapshot, native::list_snapshots, native::get_snapshot, native::delete_snapshot, native::get_operation,
        native::create_session, native::list_sessions, native::get_session, native::stream_session, native::session_stdin,
        native::session_signal, native::session_resize, native::read_file, native::write_file, native::delete_file, native::list_files,
        native::list_templates, native::get_template, native::build_template, native::delete_template,
        native::upload_context, native::list_builds, native::get_build, native::cancel_build, native::build_logs, native::system,
        native::admin::login, native::admin::create_tenant, native::admin::list_tenants, native::admin::get_tenant,
        native::admin::delete_tenant, native::admin::get_quota, native::admin::put_quota, native::admin::get_policy,
        native::admin::put_policy, native::admin::create_key, native::admin::list_keys, native::admin::revoke_key,
        native::admin::audit, native::admin::put_pool, native::admin::list_pools, native::admin::system,
        native::admin::list_nodes, native::admin::create_scrape_token, native::admin::list_scrape_tokens,
        native::admin::revoke_scrape_token,
        native::create_volume, native::list_volumes, native::get_volume, native::resize_volume, native::delete_volume,
        native::read_volume_file, native::write_volume_file, native::delete_volume_file, native::list_volume_files,
        native::stat_volume_file, native::mkdir_volume,
        native::list_events, native::sandbox_events, native::stream_events, native::create_webhook,
        native::list_webhooks, native::get_webhook, native::update_webhook, native::delete_webhook,
        native::webhook_deliveries,
    ),
    components(schemas(model::OutputEvent, model::ExitedEvent, model::TruncatedEvent)),
    modifiers(&BearerAuth),
)]
pub struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

pub fn openapi_json() -> String {
    ApiDoc::openapi().to_pretty_json().expect("OpenAPI document serializes")
}

/// The largest body a JSON or Connect route reads (native JSON bodies, the E2B control plane,
/// envd's RPCs): they are buffered whole, so a caller cannot make the server hold more.
pub const MAX_JSON_BODY: usize = 1 << 20;
/// The largest upload (`PUT /v1/sandboxes/{id}/files`, envd `POST /files`): uploads stream to
/// the guest; the cap bounds one request.
pub const MAX_UPLOAD_BODY: usize = 1 << 30;

/// What an upload route adds: its larger cap, for buffering extractors (multipart) and for the
/// streamed body itself (a declared length past it is a 413 before anything is read).
fn upload_limits<S: Clone + Send + Sync + 'static>(
    r: axum::routing::MethodRouter<S>,
) -> axum::routing::MethodRouter<S> {
    r.layer::<_, std::convert::Infallible>(axum::extract::DefaultBodyLimit::max(MAX_UPLOAD_BODY))
        .layer::<_, std::convert::Infallible>(tower_http::limit::RequestBodyLimitLayer::new(MAX_UPLOAD_BODY))
}

pub fn router(state: AppState) -> Router {
    let core = state.core.clone();
    let e2b_state = e2b::E2bState {
        core: state.core.clone(),
        domain: state.e2b_domain.clone(),
    };
    let v1 = Router::new()
        .route("/sandboxes", post(native::create_sandbox).get(native::list_sandboxes))
        .route(
            "/sandboxes/{id}",
            get(native::get_sandbox).delete(native::delete_sandbox),
        )
        .route("/sandboxes/{id}/egress", get(native::get_egress))
        .route("/tenant", get(native::get_tenant))
        .route("/sandboxes/{id}/pause", post(native::pause_sandbox))
        .route("/sandboxes/{id}/suspend", post(native::suspend_sandbox))
        .route("/sandboxes/{id}/resume", post(native::resume_sandbox))
        .route("/sandboxes/{id}/fork", post(native::fork_sandbox))
        .route("/sandboxes/{id}/snapshots", post(native::create_snapshot))
        .route("/snapshots", get(native::list_snapshots))
        .route(
            "/snapshots/{id}",
            get(native::get_snapshot).delete(native::delete_snapshot),
        )
        .route("/operations/{id}", get(native::get_operation))
        .route(
            "/sandboxes/{id}/sessions",
            post(native::create_session).get(native::list_sessions),
        )
        .route("/sandboxes/{id}/sessions/{sid}", get(native::get_session))
        .route("/sandboxes/{id}/sessions/{sid}/stream", get(native::stream_session))
        .route("/sandboxes/{id}/sessions/{sid}/stdin", post(native::session_stdin))
        .route("/sandboxes/{id}/sessions/{sid}/signal", post(native::session_signal))
        .route("/sandboxes/{id}/sessions/{sid}/resize", post(native::session_resize))
        .route(
            "/sandboxes/{id}/files",
            upload_limits(
                get(native::read_file)
                    .put(native::write_file)
                    .delete(native::delete_file),
            ),
        )
        .route("/sandboxes/{id}/files/list", get(native::list_files))
        .route("/templates", get(native::list_templates).post(native::build_template))
        .route(
            "/templates/contexts",
            post(native::upload_context).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route(
            "/templates/{name}",
            get(native::get_template).delete(native::delete_template),
        )
        .route("/volumes", post(native::create_volume).get(native::list_volumes))
        .route(
            "/volumes/{id}",
            get(native::get_volume)
                .patch(native::resize_volume)
                .delete(native::delete_volume),
        )
        .route(
            "/volumes/{id}/files",
            upload_limits(
                get(native::read_volume_file)
                    .put(native::write_volume_file)
                    .delete(native::delete_volume_file),
            ),
        )
        .route("/volumes/{id}/files/list", get(native::list_volume_files))
        .route("/volumes/{id}/files/stat", get(native::stat_volume_file))
        .route("/volumes/{id}/files/mkdir", post(native::mkdir_volume))
        .route("/events", get(native::list_events))
        .route("/events/stream", get(native::stream_events))
        .route("/sandboxes/{id}/events", get(native::sandbox_events))
        .route("/webhooks", post(native::create_webhook).get(native::list_webhooks))
        .route(
            "/webhooks/{id}",
            get(native::get_webhook)
                .patch(native::update_webhook)
                .delete(native::delete_webhook),
        )
        .route("/webhooks/{id}/deliveries", get(native::webhook_deliveries))
        .route("/builds", get(native::list_builds))
        .route("/builds/{id}", get(native::get_build).delete(native::cancel_build))
        .route("/builds/{id}/logs", get(native::build_logs))
        .route("/system", get(native::system))
        .fallback(native::not_found)
        .route_layer(axum::middleware::from_fn_with_state(
            core.clone(),
            native::require_tenant,
        ))
        .with_state(core.clone());
    // The platform account's routes: sign in, then an admin token on every other.
    let admin = Router::new()
        .route(
            "/tenants",
            post(native::admin::create_tenant).get(native::admin::list_tenants),
        )
        .route("/pools", get(native::admin::list_pools).put(native::admin::put_pool))
        .route("/system", get(native::admin::system))
        .route("/nodes", get(native::admin::list_nodes))
        .route(
            "/tenants/{name}",
            get(native::admin::get_tenant).delete(native::admin::delete_tenant),
        )
        .route(
            "/tenants/{name}/quota",
            get(native::admin::get_quota).put(native::admin::put_quota),
        )
        .route(
            "/tenants/{name}/egress",
            get(native::admin::get_policy).put(native::admin::put_policy),
        )
        .route(
            "/tenants/{name}/keys",
            post(native::admin::create_key).get(native::admin::list_keys),
        )
        .route(
            "/tenants/{name}/keys/{key_id}",
            axum::routing::delete(native::admin::revoke_key),
        )
        .route("/audit", get(native::admin::audit))
        .route(
            "/scrape-tokens",
            post(native::admin::create_scrape_token).get(native::admin::list_scrape_tokens),
        )
        .route(
            "/scrape-tokens/{id}",
            axum::routing::delete(native::admin::revoke_scrape_token),
        )
        .fallback(native::not_found)
        .route_layer(axum::middleware::from_fn_with_state(
            core.clone(),
            native::admin::require_admin,
        ))
        .route("/login", post(native::admin::login))
        .with_state(core.clone());
    // The E2B door on the same listener: its control plane (X-API-KEY) and envd (per-sandbox
    // access token); paths do not collide with /v1 or with each other.
    let e2b_api = Router::new()
        .route("/sandboxes", post(e2b::control::create).get(e2b::control::list_v1))
        .route("/sandboxes/{id}", get(e2b::control::get).delete(e2b::control::kill))
        .route("/sandboxes/{id}/timeout", post(e2b::control::set_timeout))
        .route("/sandboxes/{id}/connect", post(e2b::control::connect))
        .route("/sandboxes/{id}/metrics", get(e2b::control::metrics))
        .route("/sandboxes/{id}/pause", post(e2b::control::pause))
        .route("/sandboxes/{id}/snapshots", post(e2b::control::create_snapshot))
        .route("/sandboxes/{id}/fork", post(e2b::control::fork))
        .route("/snapshots", get(e2b::control::list_snapshots))
        // Lifecycle events in E2B's shape (kept 7 days).
        .route("/events/sandboxes", get(e2b::control::team_events))
        .route("/events/sandboxes/{id}", get(e2b::control::sandbox_events))
        .route("/templates/{id}", axum::routing::delete(e2b::control::delete_template))
        .route("/templates/aliases/{alias}", get(e2b::control::template_alias))
        // E2B's template builder (the SDK's `Template.build`).
        .route("/v3/templates", post(e2b::control::create_template))
        .route("/templates/{id}/files/{hash}", get(e2b::control::file_link))
        .route("/v2/templates/{id}/builds/{build}", post(e2b::control::start_build))
        .route("/templates/{id}/builds/{build}/status", get(e2b::control::build_status))
        .route(
            "/templates/tags",
            post(e2b::control::assign_tags).delete(e2b::control::remove_tags),
        )
        .route("/templates/{id}/tags", get(e2b::control::get_tags))
        .route(
            "/volumes",
            post(e2b::control::create_volume).get(e2b::control::list_volumes),
        )
        .route(
            "/volumes/{id}",
            get(e2b::control::get_volume).delete(e2b::control::delete_volume),
        )
        // Newer SDKs (e.g. 2.63) create and connect through the v2 paths; same semantics.
        .route("/v2/sandboxes", get(e2b::control::list_v2).post(e2b::control::create))
        .route("/v2/sandboxes/{id}/connect", post(e2b::control::connect))
        .route_layer(axum::middleware::from_fn_with_state(
            e2b_state.clone(),
            e2b::control::require_tenant,
        ))
        .with_state(e2b_state.clone());
    // A volume's content API carries the volume's own token, not an API key.
    let e2b_volumes = Router::new()
        .route(
            "/volumecontent/{id}/file",
            upload_limits(get(e2b::control::read_file).put(e2b::control::write_file)),
        )
        .route(
            "/volumecontent/{id}/dir",
            get(e2b::control::list_dir).post(e2b::control::make_dir),
        )
        .route(
            "/volumecontent/{id}/path",
            get(e2b::control::stat_path)
                .patch(e2b::control::update_path)
                .delete(e2b::control::remove_path),
        )
        .with_state(e2b_state.clone());
    // An upload link carries its own authority (signed), not an API key: E2B's presigned URLs.
    let e2b_uploads = Router::new()
        .route(
            "/templates/{id}/files/{hash}",
            axum::routing::put(e2b::control::upload).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .with_state(e2b_state.clone());
    let envd = Router::new()
        .route("/process.Process/{method}", post(e2b::envd::process_rpc))
        .route("/filesystem.Filesystem/{method}", post(e2b::envd::filesystem_rpc))
        .route(
            "/files",
            upload_limits(
                get(e2b::envd::files_get)
                    .post(e2b::envd::files_post)
                    // `files.write(..., gzip=True)`: decoded while streaming; other codings reach
                    // the handler still encoded and get its 400.
                    .layer(tower_http::decompression::RequestDecompressionLayer::new().pass_through_unaccepted(true)),
            ),
        )
        .route("/health", get(e2b::envd::health))
        // The sandbox (and the caller's right to it) is settled before any body is read.
        .route_layer(axum::middleware::from_fn_with_state(
            e2b_state.clone(),
            e2b::envd::require_sandbox,
        ))
        .with_state(e2b_state);
    let doc = openapi_json();
    let console = console::router(core.clone(), state.console);
    Router::new()
        .nest("/v1/admin", admin)
        .nest("/v1", v1)
        .merge(e2b_api)
        .merge(e2b_uploads)
        .merge(e2b_volumes)
        .merge(envd)
        .merge(console)
        .route("/readyz", get(native::readyz).with_state(core.clone()))
        .route("/metrics", get(native::admin::metrics).with_state(core.clone()))
        .route(
            "/openapi-m1.json",
            get(move || async move { ([("content-type", "application/json")], doc.clone()) }),
        )
        .route_layer(axum::middleware::from_fn(telemetry::mark_route))
        .fallback(native::not_found)
        .layer(axum::middleware::from_fn_with_state(
            core.clone(),
            ingress::host_routing,
        ))
        // Bodies that are read whole stay small; the upload routes raise their own cap.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_JSON_BODY))
        // Every request counted, by the route its router matched (`telemetry::mark_route`).
        .layer(axum::middleware::from_fn_with_state(
            core.telemetry().clone(),
            telemetry::track_http,
        ))
}

/// Serve `app` on `addr` beside the main listener.
async fn spawn_listener(
    addr: SocketAddr,
    app: Router,
    what: &'static str,
    limits: listen::Limits,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("listen on {addr}: {e}"))?;
    tracing::info!("serving {what} on http://{addr}");
    tokio::spawn(async move {
        if let Err(e) = listen::serve(listener, app, None, limits).await {
            tracing::error!("{what} listener: {e}");
        }
    });
    Ok(())
}

pub struct ServeOptions {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// The store: a Postgres URL (`postgres://...`), or `None` for SQLite in the data dir.
    pub store: Option<String>,
    pub max_sandboxes_per_tenant: u32,
    /// A tenant's default vCPU, memory and disk quotas (`None`: `tenant_share` of the node's
    /// budget) and creates per minute (see `core::Config`).
    pub max_vcpu_per_tenant: Option<u64>,
    pub max_memory_mib_per_tenant: Option<u64>,
    pub max_disk_mib_per_tenant: Option<u64>,
    pub tenant_share: f64,
    pub max_creates_per_minute: u32,
    /// Sessions one sandbox may run at once (see `core::Config`).
    pub max_sessions_per_sandbox: u32,
    /// Node budgets (see `core::Config`).
    pub vcpu_overcommit: f64,
    pub memory_reserve_mib: u64,
    pub disk_reserve_mib: u64,
    /// Second listener for E2B's code-interpreter port (`E2B_DEBUG=true` clients).
    pub e2b_debug_listen: Option<SocketAddr>,
    /// A listener serving `GET /metrics` without a credential (keep it private).
    pub metrics_listen: Option<SocketAddr>,
    /// Webhooks may point at the addresses they never reach otherwise (loopback, private,
    /// link-local, documentation, this host's own).
    pub webhook_allow_private: bool,
    /// The web console's sign-in lifetimes.
    pub console: console::ConsoleSettings,
    /// E2B domain for `E2B_DOMAIN` setups: returned to SDKs as the sandbox domain.
    pub e2b_domain: Option<String>,
    /// An HTTPS listener serving the same routes (for `E2B_DOMAIN` behind wildcard DNS).
    pub tls: Option<TlsOptions>,
    /// Timeouts and the connection cap of every listener.
    pub limits: listen::Limits,
    /// Egress profiles and the always-denied ranges ([`egress_config_from_env`]).
    pub egress: airlock_egress::EgressConfig,
    /// Where sandboxes' lookups and connections leave from.
    pub egress_uplink: EgressUplink,
    /// Issuers whose JWTs sign callers in ([`core::federation`]); none: API keys only.
    pub jwt_issuers: Option<PathBuf>,
    /// Where image builds pull from (`--registry-mirror`, `--registry-allow`).
    pub registries: airlock_runtime::template::Registries,
    /// Warm pools to keep from the start: (template, VMs) at the default resources.
    pub warm_pools: Vec<(String, usize)>,
    /// Nodes on other hosts (their faces' addresses), instead of this host's runtime in this
    /// process; a cluster when there are several.
    pub remote_nodes: Vec<SocketAddr>,
    /// A DNS name (`host:port`) whose addresses are the cluster's nodes, asked again every few
    /// seconds (a Kubernetes headless Service), besides or instead of `remote_nodes`.
    pub nodes_dns: Option<String>,
    /// Or the Kubernetes API's pods of this namespace that match a label selector, their nodes
    /// at a port (`serve --nodes-kube`).
    pub nodes_kube: Option<(String, u16)>,
    /// The cluster secret calls to the remote nodes are signed with.
    pub node_secret: Vec<u8>,
    /// Mutual TLS to the nodes (`serve --node-tls-*`); None: plain HTTP, warned about.
    pub node_tls: Option<nodes::tls::TlsFiles>,
    /// How long every replica must have had no answer from a node before its running
    /// sandboxes are lost.
    pub node_grace: std::time::Duration,
}

pub use airlock_egress::EgressConfig;
pub use node_daemon::EgressUplink;

/// The nodes at `addrs` as one cluster, each named by its address. One that does not answer
/// now is kept (placement skips it until it does); none answering is an error naming each,
/// unless discovery will find more (`more_later`).
async fn connect_nodes(
    addrs: &[SocketAddr],
    link: &nodes::NodeLink,
    more_later: bool,
) -> anyhow::Result<nodes::Cluster> {
    use nodes::Nodes as _;
    let mut members: Vec<(String, Arc<dyn nodes::Nodes>)> = Vec::new();
    let mut down = Vec::new();
    for addr in addrs {
        let node = nodes::RemoteNode::open(*addr, link).await;
        match node.members().into_iter().next().and_then(|m| m.refuses) {
            Some(why) => {
                tracing::warn!("--node {addr}: {why}");
                down.push(format!("--node {addr}: {why}"));
            }
            None => tracing::info!("node {addr}: {} with accel {}", node.runtime_name(), node.accel().await),
        }
        members.push((addr.to_string(), Arc::new(node)));
    }
    if !addrs.is_empty() && down.len() == addrs.len() && !more_later {
        anyhow::bail!("no node answers: {}", down.join("; "));
    }
    Ok(nodes::Cluster::new(members))
}

/// The store `serve` uses: Postgres at `url`, else SQLite in `<data-dir>/airlock.db`.
pub async fn open_store(url: Option<&str>, data_dir: &std::path::Path) -> anyhow::Result<Arc<dyn store::Store>> {
    Ok(match url {
        None => Arc::new(store::SqliteStore::open(&data_dir.join("airlock.db")).await?),
        Some(url) => {
            let store = store::PgStore::connect(url)
                .await
                .map_err(|e| anyhow::anyhow!("--store: {e}"))?;
            tracing::info!("store: Postgres at {}", store::redact_url(url));
            Arc::new(store)
        }
    })
}

/// The egress configuration: profiles from `AIRLOCK_EGRESS_PROFILES` (a wildcard or malformed
/// entry is an error naming the entry, which stops the server before anything starts).
pub fn egress_config_from_env() -> anyhow::Result<airlock_egress::EgressConfig> {
    let profiles =
        airlock_egress::Profiles::from_env().map_err(|e| anyhow::anyhow!("{}: {e}", airlock_egress::PROFILES_ENV))?;
    // The host's own addresses join the platform's denies in `serve` (which knows the uplink);
    // the digest leaves them out.
    Ok(airlock_egress::EgressConfig::new(
        airlock_egress::PlatformDenies::new(Vec::new()),
        profiles,
    ))
}

pub struct TlsOptions {
    pub listen: SocketAddr,
    /// PEM certificate chain, leaf first (a wildcard `*.<domain>` plus `<domain>` covers E2B).
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// Read and check the certificate and key before anything else starts, so a bad file is a clear
/// startup error naming the file rather than a failed handshake later.
async fn load_tls(tls: &TlsOptions) -> anyhow::Result<axum_server::tls_rustls::RustlsConfig> {
    // One process-wide provider; `ring` builds with the C compiler the agent build already needs.
    let _ = rustls::crypto::ring::default_provider().install_default();
    axum_server::tls_rustls::RustlsConfig::from_pem_file(&tls.cert, &tls.key)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "TLS: cannot use --tls-cert {} with --tls-key {}: {e}",
                tls.cert.display(),
                tls.key.display()
            )
        })
}

/// This host's own addresses, which no webhook may reach: its interfaces' and those its
/// `listens` bind (an unspecified one is every interface's, listed already).
fn own_addresses(listens: &[SocketAddr]) -> anyhow::Result<Vec<std::net::IpAddr>> {
    let mut addrs = airlock_egress::local_addresses()
        .map_err(|e| anyhow::anyhow!("this host's addresses (webhooks must never reach them): {e}"))?;
    addrs.extend(listens.iter().map(SocketAddr::ip).filter(|ip| !ip.is_unspecified()));
    addrs.sort();
    addrs.dedup();
    Ok(addrs)
}

/// Open everything, recover from the last run, and serve until the process is stopped.
pub async fn serve(opts: ServeOptions) -> anyhow::Result<()> {
    let listens: Vec<SocketAddr> = [Some(opts.listen), opts.tls.as_ref().map(|t| t.listen)]
        .into_iter()
        .chain([opts.e2b_debug_listen, opts.metrics_listen])
        .flatten()
        .collect();
    let webhook_host_addrs = own_addresses(&listens)?;
    let tls = match &opts.tls {
        Some(t) => Some((t.listen, load_tls(t).await?)),
        None => None,
    };
    // The VMs of the last run are re-attached in the background (`recover` below waits for
    // each before settling its sandbox), so the listener binds at once however many there are.
    // A bad issuers file stops the server before anything starts, naming the entry.
    let federation = match &opts.jwt_issuers {
        Some(path) => {
            let path = path.clone();
            tokio::task::spawn_blocking(move || core::federation::Federation::from_file(&path))
                .await?
                .map_err(|e| anyhow::anyhow!("--jwt-issuers: {e}"))?
        }
        None => Default::default(),
    };
    // The node: this host's (the VMs of the last run re-attached in the background, so the
    // listener binds at once however many there are), or one on another host.
    let single_host = opts.remote_nodes.is_empty() && opts.nodes_dns.is_none() && opts.nodes_kube.is_none();
    let (nodes, egress): (Arc<dyn nodes::Nodes>, _) = match single_host {
        true => {
            let (node, egress) = node_daemon::open_local_node(node_daemon::NodeOptions {
                data_dir: opts.data_dir.clone(),
                egress: opts.egress,
                egress_uplink: opts.egress_uplink,
                warm_pools: opts.warm_pools,
                objects: None,
            })
            .await?;
            node_daemon::exit_on_stop(node.clone(), || async {});
            (node, egress)
        }
        false => {
            use nodes::discovery::{Discovery, Source, ROUND};
            let source = match (opts.nodes_dns.clone(), &opts.nodes_kube) {
                (Some(target), _) => Some(Source::Dns(target)),
                (None, Some((selector, port))) => Some(Source::Kube(Box::new(
                    nodes::kube::KubeNodes::from_environment(selector, *port)
                        .await
                        .map_err(|e| anyhow::anyhow!("--nodes-kube: the Kubernetes API: {e}"))?,
                ))),
                (None, None) => None,
            };
            let tls = match &opts.node_tls {
                Some(files) => Some(nodes::tls::client_config(files)?),
                None => {
                    tracing::warn!(
                        "calls to nodes are plain HTTP (signed, but env and registry credentials cross in clear): \
                         give --node-tls-cert, --node-tls-key and --node-tls-ca"
                    );
                    None
                }
            };
            let link = nodes::NodeLink::new(&opts.node_secret, tls);
            let cluster = Arc::new(connect_nodes(&opts.remote_nodes, &link, source.is_some()).await?);
            if let Some(source) = source {
                let mut discovery = Discovery::default();
                match source.list().await {
                    Ok(found) => discovery.round(&cluster, found, &link).await,
                    Err(e) => tracing::warn!("discovery: {e}; asked again every {ROUND:?}"),
                }
                let weak = Arc::downgrade(&cluster);
                tokio::spawn(discovery.follow(weak, link, move || {
                    let source = source.clone();
                    async move { source.list().await }
                }));
            }
            node_daemon::set_pools(&*cluster, &opts.warm_pools).await?;
            (cluster as Arc<dyn nodes::Nodes>, opts.egress)
        }
    };
    let root = opts.data_dir.clone();
    std::fs::create_dir_all(&root).map_err(|e| anyhow::anyhow!("{}: {e}", root.display()))?;
    let store = open_store(opts.store.as_deref(), &root).await?;
    if bootstrap_admin_key(&*store, &root, &opts.listen).await?.is_some() {
        tracing::info!(
            "created tenant `default` and its admin key in {}",
            root.join("credentials").display()
        );
    }
    let secret = core::load_or_create_secret(&root)
        .map_err(|e| anyhow::anyhow!("{}: {e}", root.join("server.secret").display()))?;
    let config = core::Config {
        max_sandboxes_per_tenant: opts.max_sandboxes_per_tenant,
        max_vcpu_per_tenant: opts.max_vcpu_per_tenant,
        max_memory_mib_per_tenant: opts.max_memory_mib_per_tenant,
        max_disk_mib_per_tenant: opts.max_disk_mib_per_tenant,
        tenant_share: opts.tenant_share,
        max_creates_per_minute: opts.max_creates_per_minute,
        vcpu_overcommit: opts.vcpu_overcommit,
        memory_reserve_mib: opts.memory_reserve_mib,
        disk_reserve_mib: opts.disk_reserve_mib,
        max_sessions_per_sandbox: opts.max_sessions_per_sandbox,
        node_grace: opts.node_grace,
        egress,
        federation: federation.clone(),
        build_contexts: Some(root.join("build-contexts")),
        registries: opts.registries.clone(),
        webhook_allow_private: opts.webhook_allow_private,
        webhook_host_addrs,
        ..core::Config::default()
    };
    let capacity = nodes.capacity();
    let budget = config.budget(&capacity);
    tracing::info!(
        "node budget: {} vCPUs ({} CPUs x {}), {} MiB memory, {} MiB disk ({} MiB free)",
        budget.vcpu,
        capacity.cpus,
        config.vcpu_overcommit,
        budget.memory_mib,
        budget.disk_mib,
        capacity.disk_free_mib
    );
    let q = config.default_quota(&budget);
    tracing::info!(
        "a tenant's default quota: {} sandboxes, {} vCPUs, {} MiB memory, {} MiB disk, {} creates a minute",
        q.sandboxes.unwrap_or(0),
        q.vcpu.unwrap_or(0),
        q.memory_mib.unwrap_or(0),
        q.disk_mib.unwrap_or(0),
        q.creates_per_minute.unwrap_or(0)
    );
    tracing::info!(
        "egress: digest {}, profiles [{}], defaults [{}]",
        config.egress.digest(),
        config.egress.profiles.names().collect::<Vec<_>>().join(", "),
        config.egress.profiles.defaults().join(", ")
    );
    let core = core::Core::new(store, nodes, config, secret);
    telemetry::observe_agent_calls(core.telemetry());
    {
        use core::accounts::PASSWORD_ENV;
        let chosen = std::env::var(PASSWORD_ENV).ok();
        if let Some(generated) = core
            .ensure_console_account(chosen.as_deref())
            .await
            .map_err(|e| anyhow::anyhow!("the console account: {e}"))?
        {
            hand_over_console_password(&root, &generated)?;
        } else if chosen.as_deref().is_some_and(|p| !p.is_empty()) {
            remove_console_password_file(&root);
        }
        if !federation.is_empty() {
            tracing::info!("signed-in requests: {federation:?}");
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(core::federation::RELOAD_EVERY).await;
                    let federation = federation.clone();
                    let _ = tokio::task::spawn_blocking(move || federation.reload()).await;
                }
            });
        }
        let pruner = core.clone();
        tokio::spawn(async move {
            loop {
                match pruner.prune_audit().await {
                    Ok(n) if n > 0 => tracing::info!("audit: pruned {n} rows past their retention"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!("audit: pruning failed: {e}"),
                }
                match pruner.prune_events().await {
                    Ok(n) if n > 0 => tracing::info!("events: pruned {n} past their retention"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!("events: pruning failed: {e}"),
                }
                tokio::time::sleep(std::time::Duration::from_secs(6 * 3600)).await;
            }
        });
    }
    // Requests about a sandbox the recovery has yet to settle wait for it (`Core::current`).
    core.engine().start_recovery().await?;
    core.engine().spawn_reaper();
    core.engine().spawn_news();
    core.spawn_metrics_sampler();
    core.spawn_rehoming();
    core.spawn_build_sweeper();
    core.spawn_webhooks();
    let state = AppState {
        core,
        e2b_domain: opts.e2b_domain.map(Into::into),
        console: opts.console,
    };
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| anyhow::anyhow!("listen on {}: {e}", opts.listen))?;
    tracing::info!("serving on http://{}", opts.listen);
    if let Some(addr) = opts.e2b_debug_listen {
        let app = Router::new()
            .fallback(ingress::code_interpreter_by_token)
            .with_state(state.core.clone());
        spawn_listener(addr, app, "the code-interpreter port", opts.limits).await?;
    }
    if let Some(addr) = opts.metrics_listen {
        let app = Router::new()
            .route("/metrics", get(native::admin::open_metrics))
            .with_state(state.core.clone());
        spawn_listener(addr, app, "metrics (no credential asked)", opts.limits).await?;
    }
    let app = router(state);
    if let Some((addr, config)) = tls {
        let tls_listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("listen on {addr}: {e}"))?;
        let app = app.clone();
        let limits = opts.limits;
        tracing::info!("serving on https://{addr}");
        tokio::spawn(async move {
            if let Err(e) = listen::serve(tls_listener, app, Some(config.get_inner()), limits).await {
                tracing::error!("TLS listener: {e}");
            }
        });
    }
    Ok(listen::serve(listener, app, None, opts.limits).await?)
}

/// Where the generated console password is left when no terminal sees it.
pub const CONSOLE_PASSWORD_FILE: &str = "console-password";

/// Hand the console account's generated password to whoever started the server, once (only its
/// hash is kept). Printed on stdout when that is a terminal (a person reads it there); otherwise
/// (a service manager, a pipe: stdout and stderr are the log's streams) written to
/// `<data-dir>/console-password`, 0600, and only its path logged.
pub fn hand_over_console_password(data_dir: &std::path::Path, password: &str) -> anyhow::Result<()> {
    use core::accounts::{PASSWORD_ENV, ROOT};
    use std::io::{IsTerminal, Write};
    let mut stdout = std::io::stdout().lock();
    if stdout.is_terminal() {
        writeln!(
            stdout,
            "airlock: the console account is {ROOT}; its generated password, shown only now: {password}\n\
             airlock: sign in with `airlock login`; set {PASSWORD_ENV} to choose the password instead"
        )?;
        return Ok(());
    }
    let path = data_dir.join(CONSOLE_PASSWORD_FILE);
    airlock_runtime::datadir::write_atomic_mode(&path, format!("{password}\n").as_bytes(), 0o600)
        .map_err(|(p, e)| anyhow::anyhow!("writing the console password: {}: {e}", p.display()))?;
    tracing::info!(
        "the console account {ROOT} has a generated password, in {path} (0600; shown nowhere else): \
         sign in with `airlock login < {path}`; set {PASSWORD_ENV} to choose one instead",
        path = path.display()
    );
    Ok(())
}

/// A password chosen with `AIRLOCK_CONSOLE_PASSWORD` replaces a generated one: its file goes.
fn remove_console_password_file(data_dir: &std::path::Path) {
    let path = data_dir.join(CONSOLE_PASSWORD_FILE);
    match std::fs::remove_file(&path) {
        Ok(()) => tracing::info!(
            "removed {} ({} replaces the generated password)",
            path.display(),
            core::accounts::PASSWORD_ENV
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("{}: {e}", path.display()),
    }
}

/// Give tenant `default` its admin key, the credentials file first: the key is minted, written
/// whole to `<data-dir>/credentials` (`write_credentials`), and only then its hash is committed,
/// so a crash in between leaves a file whose key the store lacks, never a key nobody has. A start
/// that finds such a file (the store still without a key) commits the file's key. Returns the key
/// it committed, if it committed one.
pub async fn bootstrap_admin_key<S: store::TenantStore + ?Sized>(
    store: &S,
    data_dir: &std::path::Path,
    listen: &SocketAddr,
) -> anyhow::Result<Option<String>> {
    let path = data_dir.join("credentials");
    if let Some(key) = read_credentials_key(data_dir)? {
        if store.bootstrap(&key).await? {
            tracing::info!(
                "committed the admin key in {} (the last start stopped before it)",
                path.display()
            );
            return Ok(Some(key));
        }
        if store.tenant_by_key(&key).await?.is_none() {
            tracing::warn!(
                "{} holds a key the store does not know (tenant `default` has other keys)",
                path.display()
            );
        }
        return Ok(None);
    }
    if !store.needs_bootstrap().await? {
        return Ok(None);
    }
    let key = store::new_key(store::KeyFormat::Airlock);
    write_credentials(data_dir, &key, listen).map_err(|e| anyhow::anyhow!("writing the admin key: {e}"))?;
    if !store.bootstrap(&key).await? {
        // Another process bootstrapped in between; the file now names a key the store lacks.
        anyhow::bail!("tenant `default` got a key while {} was written", path.display());
    }
    Ok(Some(key))
}

/// The `AIRLOCK_API_KEY=` of `<data-dir>/credentials`, if the file exists and has one.
pub fn read_credentials_key(data_dir: &std::path::Path) -> anyhow::Result<Option<String>> {
    let path = data_dir.join("credentials");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => anyhow::bail!("{}: {e}", path.display()),
    };
    Ok(text
        .lines()
        .find_map(|l| l.trim().strip_prefix("AIRLOCK_API_KEY="))
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty()))
}

/// `<data-dir>/credentials`, mode 0600: the admin key where the CLI and examples find it.
/// Written whole under a temporary name (0600 from its creation, whatever the umask), synced and
/// renamed: a crash leaves the old file or the new one, never half a key.
pub fn write_credentials(data_dir: &std::path::Path, key: &str, listen: &SocketAddr) -> std::io::Result<()> {
    let text = format!(
        "# airlock admin key of tenant `default` (only its hash is stored in airlock.db)\n\
         AIRLOCK_URL=http://{listen}\n\
         AIRLOCK_API_KEY={key}\n"
    );
    airlock_runtime::datadir::write_atomic_mode(&data_dir.join("credentials"), text.as_bytes(), 0o600)
        .map_err(|(path, e)| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_webhook_never_reaches_this_hosts_interfaces_or_listeners() {
        let listens = ["203.0.113.5:8080".parse().unwrap(), "0.0.0.0:80".parse().unwrap()];
        let own = super::own_addresses(&listens).unwrap();
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert!(own.contains(&ip("203.0.113.5")), "a listener's address: {own:?}");
        assert!(own.contains(&ip("127.0.0.1")), "an interface's address: {own:?}");
        assert!(!own.contains(&ip("0.0.0.0")), "{own:?}");
        for a in airlock_egress::local_addresses().unwrap() {
            assert!(own.contains(&a), "{a}: {own:?}");
        }
    }

    /// Set in the child process of `a_generated_password_without_a_terminal_goes_to_a_private_file`.
    const CHILD_DATA_DIR: &str = "AIRLOCK_TEST_CONSOLE_PASSWORD_DIR";
    const GENERATED: &str = "Generated-Password-4242xyz";

    /// The child: logs to stderr as `airlock serve` does, and hands the password over with
    /// stdout and stderr pipes (no terminal).
    #[test]
    fn console_password_child() {
        let Ok(dir) = std::env::var(CHILD_DATA_DIR) else {
            return;
        };
        tracing_subscriber::fmt().with_writer(std::io::stderr).init();
        super::hand_over_console_password(std::path::Path::new(&dir), GENERATED).unwrap();
    }

    /// Started without a terminal, the server leaves the generated password in a 0600 file in
    /// the data dir and says where, never the password, on stdout or stderr (the log).
    #[test]
    fn a_generated_password_without_a_terminal_goes_to_a_private_file() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "tests::console_password_child",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DATA_DIR, d.path())
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{stdout}\n{stderr}");
        for (name, text) in [("stdout", &stdout), ("stderr", &stderr)] {
            assert!(!text.contains(GENERATED), "the password is on {name}: {text}");
        }
        let path = d.path().join(super::CONSOLE_PASSWORD_FILE);
        assert!(
            stderr.contains(&path.display().to_string()),
            "the log names the file: {stderr}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{GENERATED}\n"));
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn credentials_are_private_and_whole() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let listen = "127.0.0.1:7420".parse().unwrap();
        super::write_credentials(d.path(), "ak_one", &listen).unwrap();
        super::write_credentials(d.path(), "ak_two", &listen).unwrap();
        let path = d.path().join("credentials");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("# airlock admin key"), "{text}");
        assert!(
            text.contains("\nAIRLOCK_URL=http://127.0.0.1:7420\nAIRLOCK_API_KEY=ak_two\n"),
            "{text}"
        );
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1, "no temp file is left");
    }
}
