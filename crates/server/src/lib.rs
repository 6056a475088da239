//! airlock's HTTP server: the native `/v1` API over one runtime, one store, one operation engine.

pub mod api;
pub mod e2b;
pub mod error;
pub mod forward;
pub mod model;
pub mod ops;
pub mod store;

use api::AppState;
use axum::routing::{get, post};
use axum::Router;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(title = "airlock", description = "Self-hosted microVM sandboxes for AI agents: native API (milestone 1)"),
    paths(
        api::create_sandbox, api::list_sandboxes, api::get_sandbox, api::delete_sandbox, api::pause_sandbox, api::resume_sandbox, api::get_operation,
        api::create_session, api::list_sessions, api::get_session, api::stream_session, api::session_stdin,
        api::session_signal, api::session_resize, api::read_file, api::write_file, api::delete_file, api::list_files,
        api::list_templates, api::get_template, api::system,
    ),
    components(schemas(model::OutputEvent, model::ExitedEvent)),
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

pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/sandboxes", post(api::create_sandbox).get(api::list_sandboxes))
        .route("/sandboxes/{id}", get(api::get_sandbox).delete(api::delete_sandbox))
        .route("/sandboxes/{id}/pause", post(api::pause_sandbox))
        .route("/sandboxes/{id}/resume", post(api::resume_sandbox))
        .route("/operations/{id}", get(api::get_operation))
        .route(
            "/sandboxes/{id}/sessions",
            post(api::create_session).get(api::list_sessions),
        )
        .route("/sandboxes/{id}/sessions/{sid}", get(api::get_session))
        .route("/sandboxes/{id}/sessions/{sid}/stream", get(api::stream_session))
        .route("/sandboxes/{id}/sessions/{sid}/stdin", post(api::session_stdin))
        .route("/sandboxes/{id}/sessions/{sid}/signal", post(api::session_signal))
        .route("/sandboxes/{id}/sessions/{sid}/resize", post(api::session_resize))
        .route(
            "/sandboxes/{id}/files",
            get(api::read_file).put(api::write_file).delete(api::delete_file),
        )
        .route("/sandboxes/{id}/files/list", get(api::list_files))
        .route("/templates", get(api::list_templates))
        .route("/templates/{name}", get(api::get_template))
        .route("/system", get(api::system))
        .fallback(api::not_found)
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), api::auth));
    // The E2B door on the same listener: its control plane (X-API-KEY) and envd (per-sandbox
    // access token); paths do not collide with /v1 or with each other.
    let e2b_api = Router::new()
        .route("/sandboxes", post(e2b::control::create))
        .route("/sandboxes/{id}", get(e2b::control::get).delete(e2b::control::kill))
        .route("/sandboxes/{id}/timeout", post(e2b::control::set_timeout))
        .route("/sandboxes/{id}/connect", post(e2b::control::connect))
        .route("/sandboxes/{id}/metrics", get(e2b::control::metrics))
        .route("/sandboxes/{id}/pause", post(e2b::control::pause))
        .route("/sandboxes/{id}/snapshots", post(e2b::control::create_snapshot))
        .route("/snapshots", get(e2b::control::list_snapshots))
        // Newer SDKs (e.g. 2.63) create and connect through the v2 paths; same semantics.
        .route("/v2/sandboxes", get(e2b::control::list_v2).post(e2b::control::create))
        .route("/v2/sandboxes/{id}/connect", post(e2b::control::connect))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), e2b::control::auth));
    let envd = Router::new()
        .route("/process.Process/{method}", post(e2b::envd::process_rpc))
        .route("/filesystem.Filesystem/{method}", post(e2b::envd::filesystem_rpc))
        .route(
            "/files",
            get(e2b::envd::files_get)
                .post(e2b::envd::files_post)
                // `files.write(..., gzip=True)`: decoded while streaming; other codings reach the
                // handler still encoded and get its 400.
                .layer(tower_http::decompression::RequestDecompressionLayer::new().pass_through_unaccepted(true)),
        )
        .route("/health", get(e2b::envd::health));
    let doc = openapi_json();
    Router::new()
        .nest("/v1", v1)
        .merge(e2b_api)
        .merge(envd)
        .route(
            "/openapi-m1.json",
            get(move || async move { ([("content-type", "application/json")], doc.clone()) }),
        )
        .fallback(api::not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            forward::host_routing,
        ))
        // Uploads stream to the guest; the cap only bounds a single request.
        .layer(axum::extract::DefaultBodyLimit::max(1 << 30))
        .with_state(state)
}

pub struct ServeOptions {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub max_sandboxes_per_tenant: u32,
    /// Second listener for E2B's code-interpreter port (`E2B_DEBUG=true` clients).
    pub e2b_debug_listen: Option<SocketAddr>,
    /// E2B domain for `E2B_DOMAIN` setups: returned to SDKs as the sandbox domain.
    pub e2b_domain: Option<String>,
    /// An HTTPS listener serving the same routes (for `E2B_DOMAIN` behind wildcard DNS).
    pub tls: Option<TlsOptions>,
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

/// Open everything, recover from the last run, and serve until the process is stopped.
pub async fn serve(opts: ServeOptions) -> anyhow::Result<()> {
    let tls = match &opts.tls {
        Some(t) => Some((t.listen, load_tls(t).await?)),
        None => None,
    };
    let runtime = airlock_runtime::Runtime::open(airlock_runtime::RuntimeOptions::new(&opts.data_dir)).await?;
    let store: Arc<dyn store::Store> =
        Arc::new(store::SqliteStore::open(&runtime.data_dir().root().join("airlock.db")).await?);
    if let Some(key) = store.bootstrap().await? {
        write_credentials(runtime.data_dir().root(), &key, &opts.listen)?;
        tracing::info!(
            "created tenant `default` and its admin key in {}",
            runtime.data_dir().root().join("credentials").display()
        );
    }
    let accel = runtime.accel().await;
    tracing::info!("runtime {} with accel {accel}", runtime.runtime_name());
    let engine = ops::Engine::new(store.clone(), runtime.clone());
    engine.recover().await?;
    engine.spawn_reaper();
    let state = AppState {
        store,
        runtime,
        engine,
        max_sandboxes_per_tenant: opts.max_sandboxes_per_tenant,
        watchers: Default::default(),
        e2b_domain: opts.e2b_domain.map(Into::into),
    };
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| anyhow::anyhow!("listen on {}: {e}", opts.listen))?;
    tracing::info!("serving on http://{}", opts.listen);
    if let Some(addr) = opts.e2b_debug_listen {
        let jupyter = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("listen on {addr}: {e}"))?;
        let app = Router::new()
            .fallback(forward::code_interpreter_by_token)
            .with_state(state.clone());
        tracing::info!("serving the code-interpreter port on http://{addr}");
        tokio::spawn(async move {
            if let Err(e) = axum::serve(jupyter, app).await {
                tracing::error!("code-interpreter listener: {e}");
            }
        });
    }
    let app = router(state);
    if let Some((addr, config)) = tls {
        let std_listener = std::net::TcpListener::bind(addr).map_err(|e| anyhow::anyhow!("listen on {addr}: {e}"))?;
        std_listener.set_nonblocking(true)?;
        let server = axum_server::from_tcp_rustls(std_listener, config)?;
        let app = app.clone();
        tracing::info!("serving on https://{addr}");
        tokio::spawn(async move {
            if let Err(e) = server.serve(app.into_make_service()).await {
                tracing::error!("TLS listener: {e}");
            }
        });
    }
    Ok(axum::serve(listener, app).await?)
}

/// `<data-dir>/credentials`, mode 0600: the admin key where the CLI and examples find it.
pub fn write_credentials(data_dir: &std::path::Path, key: &str, listen: &SocketAddr) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join("credentials");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&path)?;
    writeln!(
        f,
        "# airlock admin key of tenant `default` (only its hash is stored in airlock.db)"
    )?;
    writeln!(f, "AIRLOCK_URL=http://{listen}")?;
    writeln!(f, "AIRLOCK_API_KEY={key}")?;
    Ok(())
}
