//! The native `/v1` door: thin handlers over the store, the operation engine and the runtime.

use crate::error::{ApiError, ApiResult, ErrorBody};
use crate::model::*;
use crate::ops::{new_operation, Engine};
use crate::store::{now_ms, rfc3339, CreateRecorded, SandboxFilter, SandboxRow, SessionRow, Store, Tenant};
use airlock_proto::frame::EventKind;
use airlock_proto::ProcessSpec;
use airlock_runtime::{Runtime, RuntimeError};
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine as _;
use futures_util::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone)]
pub struct AppState {
    pub store: Arc<dyn Store>,
    pub runtime: Runtime,
    pub engine: Engine,
    /// Live sandboxes (creating, running, deleting) one tenant may have at once.
    pub max_sandboxes_per_tenant: u32,
    /// The E2B door's polling file watchers.
    pub watchers: Arc<crate::e2b::envd::Watchers>,
    /// The E2B domain (`api.<domain>`, `<port>-<id>.<domain>`) returned to SDKs, if configured.
    pub e2b_domain: Option<Arc<str>>,
}

/// JSON body whose rejections use the API's error format (400 malformed, 422 wrong shape).
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(JsonRejection::JsonDataError(e)) => {
                Err(ApiError::Validation(format!("invalid request body: {}", e.body_text())))
            }
            Err(JsonRejection::JsonSyntaxError(e)) => {
                Err(ApiError::BadRequest(format!("malformed JSON: {}", e.body_text())))
            }
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError::BadRequest(
                "send the body as JSON with `Content-Type: application/json`".into(),
            )),
            Err(e) => Err(ApiError::BadRequest(e.body_text())),
        }
    }
}

/// Query string with the API's error format.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(q) => Ok(ApiQuery(q.0)),
            Err(QueryRejection::FailedToDeserializeQueryString(e)) => Err(ApiError::Validation(e.body_text())),
            Err(e) => Err(ApiError::BadRequest(e.body_text())),
        }
    }
}

pub async fn auth(State(state): State<AppState>, mut req: Request, next: axum::middleware::Next) -> Response {
    let key = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim);
    let Some(key) = key.filter(|k| !k.is_empty()) else {
        return ApiError::Unauthorized.into_response();
    };
    match state.store.tenant_by_key(key).await {
        Ok(Some(tenant)) => {
            req.extensions_mut().insert(tenant);
            next.run(req).await
        }
        Ok(None) => ApiError::Unauthorized.into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// The error responses every route may give, each with an `ErrorBody`.
pub struct ApiErrors;

impl utoipa::IntoResponses for ApiErrors {
    fn responses() -> std::collections::BTreeMap<String, utoipa::openapi::RefOr<utoipa::openapi::response::Response>> {
        use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
        [
            ("400", "malformed request or a path the guest rejects"),
            ("401", "missing or wrong API key"),
            ("403", "the guest refused (permissions)"),
            ("404", "no such sandbox, session, operation, template or file"),
            ("409", "the sandbox is not running"),
            ("422", "a field has an invalid value"),
            ("429", "quota exceeded"),
            ("500", "internal error"),
            ("502", "the sandbox's agent is unreachable"),
            ("503", "temporarily unavailable"),
        ]
        .into_iter()
        .map(|(code, desc)| {
            let content = ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build();
            (
                code.to_string(),
                RefOr::T(
                    ResponseBuilder::new()
                        .description(desc)
                        .content("application/json", content)
                        .build(),
                ),
            )
        })
        .collect()
    }
}

pub const MAX_SANDBOX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
pub const DEFAULT_SANDBOX_TIMEOUT: Duration = Duration::from_secs(300);

pub fn parse_duration(field: &str, v: &str, max: Duration) -> ApiResult<Duration> {
    let d = humantime::parse_duration(v.trim()).map_err(|_| {
        ApiError::Validation(format!(
            "{field} {v:?} is not a duration; use forms like \"30s\", \"10m\", \"2h\""
        ))
    })?;
    if d < Duration::from_secs(1) || d > max {
        return Err(ApiError::Validation(format!(
            "{field} must be between 1s and {}, got {v:?}",
            humantime::format_duration(max)
        )));
    }
    Ok(d)
}

fn check_env(env: &BTreeMap<String, String>) -> ApiResult<()> {
    for k in env.keys() {
        let ok = !k.is_empty()
            && !k.contains('=')
            && !k.contains('\0')
            && !k.chars().next().is_some_and(|c| c.is_ascii_digit());
        if !ok {
            return Err(ApiError::Validation(format!(
                "environment variable name {k:?} is invalid"
            )));
        }
    }
    Ok(())
}

/// Admit a new sandbox for `tenant` (quota) and describe it; both doors create through this.
pub async fn new_sandbox_row(
    state: &AppState,
    tenant: &Tenant,
    template: &airlock_runtime::template::Template,
    resources: airlock_runtime::Resources,
    timeout: Duration,
    env: BTreeMap<String, String>,
    metadata: BTreeMap<String, String>,
) -> ApiResult<SandboxRow> {
    // A fast refusal; insert_create checks the limit again, atomically with the insert.
    let live = state.store.count_live_sandboxes(&tenant.id).await?;
    if live >= state.max_sandboxes_per_tenant {
        return Err(ApiError::QuotaExceeded(format!(
            "tenant {} has {live} live sandboxes, the limit of this server (--max-sandboxes {}); delete one first",
            tenant.name, state.max_sandboxes_per_tenant
        )));
    }
    let now = now_ms();
    Ok(SandboxRow {
        id: airlock_runtime::datadir::random_hex(10),
        tenant_id: tenant.id.clone(),
        state: SandboxState::Creating,
        template: template.manifest.name.clone(),
        template_digest: template.manifest.digest.clone(),
        runtime: state.runtime.runtime_name().into(),
        accel: state.runtime.accel().await.to_string(),
        resources: Resources {
            vcpu: resources.vcpu,
            memory_mib: resources.memory_mib,
            disk_mib: resources.disk_mib,
        },
        env,
        metadata,
        created_at_ms: now,
        expires_at_ms: now + timeout.as_millis() as i64,
    })
}

async fn sandbox_row(state: &AppState, tenant: &Tenant, id: &str) -> ApiResult<SandboxRow> {
    state
        .store
        .get_sandbox(&tenant.id, id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no sandbox with id {id:?}")))
}

async fn running_sandbox(state: &AppState, tenant: &Tenant, id: &str) -> ApiResult<Arc<airlock_runtime::Sandbox>> {
    let row = sandbox_row(state, tenant, id).await?;
    if row.state != SandboxState::Running {
        return Err(ApiError::Conflict(format!(
            "sandbox {id} is {}, not running",
            row.state.as_str()
        )));
    }
    state
        .runtime
        .get(id)
        .map_err(|_| ApiError::Conflict(format!("sandbox {id} is not running")))
}

#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", request_body = CreateSandboxRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "retries with the same key return the same operation")),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn create_sandbox(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CreateSandboxRequest>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    match req.runtime.as_deref() {
        None | Some("qemu") => {}
        Some("fc") => {
            return Err(ApiError::Validation(
                "runtime \"fc\" (Firecracker) is not available on this node".into(),
            ))
        }
        Some(other) => return Err(ApiError::Validation(format!("unknown runtime {other:?}; use \"qemu\""))),
    }
    let template = state.runtime.templates().resolve(&req.template)?;
    let defaults = airlock_runtime::Resources::default();
    let spec = req.resources.unwrap_or(ResourcesSpec {
        vcpu: None,
        memory_mib: None,
        disk_mib: None,
    });
    let resources = airlock_runtime::Resources {
        vcpu: spec.vcpu.unwrap_or(defaults.vcpu),
        memory_mib: spec.memory_mib.unwrap_or(defaults.memory_mib),
        disk_mib: spec.disk_mib.unwrap_or(defaults.disk_mib),
    };
    resources.validate(&template)?;
    let timeout = match &req.timeout {
        Some(t) => parse_duration("timeout", t, MAX_SANDBOX_TIMEOUT)?,
        None => DEFAULT_SANDBOX_TIMEOUT,
    };
    let env = req.env.unwrap_or_default();
    check_env(&env)?;
    let idem = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if idem.as_ref().is_some_and(|k| k.is_empty() || k.len() > 200) {
        return Err(ApiError::BadRequest(
            "Idempotency-Key must be 1 to 200 characters".into(),
        ));
    }
    if let Some(key) = &idem {
        if let Some(prior) = state.store.operation_by_idempotency_key(&tenant.id, key).await? {
            let sandbox_id = prior.sandbox_id.clone();
            return Ok((
                StatusCode::ACCEPTED,
                Json(OperationAccepted {
                    operation: prior,
                    sandbox_id,
                }),
            ));
        }
    }
    let metadata = req.metadata.unwrap_or_default();
    let row = new_sandbox_row(&state, &tenant, &template, resources, timeout, env, metadata).await?;
    let id = row.id.clone();
    let op = new_operation(OperationKind::Create, &id);
    let recorded = match state
        .store
        .insert_create(&row, &op, idem.as_deref(), state.max_sandboxes_per_tenant)
        .await?
    {
        CreateRecorded::New(recorded) => {
            state.engine.start_create(op, row);
            recorded
        }
        CreateRecorded::Existing(prior) => prior,
    };
    let current = state
        .store
        .get_operation(&tenant.id, &recorded.id)
        .await?
        .unwrap_or(recorded);
    let sandbox_id = current.sandbox_id.clone();
    Ok((
        StatusCode::ACCEPTED,
        Json(OperationAccepted {
            operation: current,
            sandbox_id,
        }),
    ))
}

#[utoipa::path(get, path = "/v1/operations/{id}", tag = "operations",
    params(("id" = String, Path)),
    responses((status = 200, body = Operation), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_operation(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<Operation>> {
    state
        .store
        .get_operation(&tenant.id, &id)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no operation with id {id:?}")))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only sandboxes in this state (default: creating, running and deleting).
    pub state: Option<String>,
    /// Page size, 1..=100 (default 50).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    pub page_token: Option<String>,
    /// `metadata.<key>=<value>` filters are also accepted.
    #[serde(flatten)]
    #[param(ignore)]
    pub rest: HashMap<String, String>,
}

#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes", params(ListQuery),
    responses((status = 200, body = SandboxList), ApiErrors),
    security(("bearer" = [])))]
pub async fn list_sandboxes(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<Json<SandboxList>> {
    let wanted = match q.state.as_deref() {
        None => None,
        Some(s) => Some(SandboxState::parse(s).ok_or_else(|| {
            ApiError::Validation(format!(
                "unknown state {s:?}; one of creating, running, paused, deleting, deleted, failed"
            ))
        })?),
    };
    let limit = q.limit.unwrap_or(50);
    if !(1..=100).contains(&limit) {
        return Err(ApiError::Validation(format!(
            "limit must be between 1 and 100, got {limit}"
        )));
    }
    let after = match &q.page_token {
        None => None,
        Some(t) => {
            Some(crate::store::parse_page_token(t).ok_or_else(|| ApiError::Validation("bad page_token".into()))?)
        }
    };
    let mut metadata = BTreeMap::new();
    for (k, v) in &q.rest {
        match k.strip_prefix("metadata.") {
            Some(key) if !key.is_empty() => {
                metadata.insert(key.to_string(), v.clone());
            }
            _ => return Err(ApiError::Validation(format!("unknown query parameter {k:?}"))),
        }
    }
    let filter = SandboxFilter {
        states: wanted.into_iter().collect(),
        metadata,
        after,
        limit,
    };
    let mut rows = state.store.list_sandboxes(&tenant.id, &filter).await?;
    if wanted.is_none() {
        rows.retain(|r| r.state != SandboxState::Failed);
    }
    let next = crate::store::next_page_token(&rows, limit);
    rows.truncate(limit as usize);
    Ok(Json(SandboxList {
        sandboxes: rows.iter().map(SandboxRow::view).collect(),
        next_page_token: next,
    }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_sandbox(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(sandbox_row(&state, &tenant, &id).await?.view()))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn delete_sandbox(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    let row = sandbox_row(&state, &tenant, &id).await?;
    if row.state == SandboxState::Deleted {
        return Err(ApiError::NotFound(format!("sandbox {id} was already deleted")));
    }
    let op = state.engine.request_delete(&row).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(OperationAccepted {
            operation: op,
            sandbox_id: id,
        }),
    ))
}

/// Freeze the sandbox in memory (processes, files and memory kept). Its timeout stops running
/// until resume, which restores the time that was left; a pause lasts at most 24 h.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn pause_sandbox(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    pause_or_resume(state, tenant, id, true).await
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn resume_sandbox(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    pause_or_resume(state, tenant, id, false).await
}

async fn pause_or_resume(
    state: AppState,
    tenant: Tenant,
    id: String,
    pause: bool,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    let row = sandbox_row(&state, &tenant, &id).await?;
    let from = if pause {
        SandboxState::Running
    } else {
        SandboxState::Paused
    };
    if row.state != from {
        return Err(ApiError::Conflict(format!(
            "sandbox {id} is {}; only a {} sandbox can be {}",
            row.state.as_str(),
            from.as_str(),
            if pause { "paused" } else { "resumed" }
        )));
    }
    let op = state.engine.pause_or_resume(&row, pause).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(OperationAccepted {
            operation: op,
            sandbox_id: id,
        }),
    ))
}

fn signal_name(n: i32) -> String {
    match n {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        6 => "SIGABRT",
        9 => "SIGKILL",
        10 => "SIGUSR1",
        12 => "SIGUSR2",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        _ => return format!("SIG{n}"),
    }
    .into()
}

pub fn parse_signal(s: &str) -> ApiResult<i32> {
    if let Ok(n) = s.parse::<i32>() {
        return if (1..=64).contains(&n) {
            Ok(n)
        } else {
            Err(ApiError::Validation(format!("signal {n} is out of range")))
        };
    }
    let name = s.trim().to_ascii_uppercase();
    let name = name.strip_prefix("SIG").unwrap_or(&name);
    (1..=31)
        .find(|n| signal_name(*n).trim_start_matches("SIG") == name)
        .or(match name {
            "CONT" => Some(18),
            "STOP" => Some(19),
            "TSTP" => Some(20),
            "WINCH" => Some(28),
            _ => None,
        })
        .ok_or_else(|| ApiError::Validation(format!("unknown signal {s:?}")))
}

fn session_view(s: &SessionRow) -> Session {
    Session {
        id: s.id.clone(),
        sandbox_id: s.sandbox_id.clone(),
        state: if s.exited {
            SessionState::Exited
        } else {
            SessionState::Running
        },
        argv: s.argv.clone(),
        cwd: s.cwd.clone(),
        user: s.user.clone(),
        pty: s.pty,
        exit_code: s.exit_code,
        signal: s.signal.map(signal_name),
        timed_out: s.timed_out,
        started_at: rfc3339(s.started_at_ms),
        ended_at: s.ended_at_ms.map(rfc3339),
    }
}

/// Bring a session row up to date from the agent (exit status, end time).
async fn refresh_session(state: &AppState, mut row: SessionRow) -> ApiResult<SessionRow> {
    if row.exited {
        return Ok(row);
    }
    let Ok(sb) = state.runtime.get(&row.sandbox_id) else {
        return Ok(row);
    };
    let Ok(agent) = sb.agent().await else { return Ok(row) };
    if let Ok(info) = agent.process(row.process_id).await {
        if let Some(exit) = info.exit {
            row.exited = true;
            row.exit_code = exit.exit_code;
            row.signal = exit.signal;
            row.timed_out = exit.timed_out;
            row.ended_at_ms = info.ended_at_ms.map(|v| v as i64);
            state.store.finish_session(&row).await?;
        }
    }
    Ok(row)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/sessions", tag = "sessions", params(("id" = String, Path)),
    request_body = CreateSessionRequest,
    responses((status = 201, body = Session), ApiErrors),
    security(("bearer" = [])))]
pub async fn create_session(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<CreateSessionRequest>,
) -> ApiResult<(StatusCode, Json<Session>)> {
    if req.argv.is_empty() || req.argv[0].is_empty() {
        return Err(ApiError::Validation(
            "argv must name a program, e.g. [\"python3\", \"-c\", \"print(1)\"]".into(),
        ));
    }
    if req.argv.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::Validation("argv must not contain NUL bytes".into()));
    }
    let timeout = match &req.timeout {
        Some(t) => Some(parse_duration("timeout", t, MAX_SANDBOX_TIMEOUT)?),
        None => None,
    };
    if let Some(p) = &req.pty {
        if p.cols == 0 || p.rows == 0 {
            return Err(ApiError::Validation("pty cols and rows must be at least 1".into()));
        }
    }
    let mut env = sandbox_row(&state, &tenant, &id).await?.env;
    let extra = req.env.unwrap_or_default();
    check_env(&extra)?;
    env.extend(extra);
    let sb = running_sandbox(&state, &tenant, &id).await?;
    let session_id = format!("ses_{}", airlock_runtime::datadir::random_hex(8));
    let spec = ProcessSpec {
        argv: req.argv.clone(),
        cwd: req.cwd.clone(),
        env,
        user: Some(req.user.clone().unwrap_or_else(|| "user".into())),
        timeout_ms: timeout.map(|t| t.as_millis() as u64),
        stdin: req.stdin.unwrap_or(false),
        pty: req.pty.as_ref().map(|p| airlock_proto::PtySize {
            cols: p.cols,
            rows: p.rows,
        }),
        tag: Some(session_id.clone()),
    };
    let info = sb.agent().await?.spawn(&spec).await?;
    let row = SessionRow {
        id: session_id,
        sandbox_id: id,
        process_id: info.id,
        argv: info.argv,
        cwd: info.cwd,
        user: info.user,
        pty: info.pty,
        exit_code: None,
        signal: None,
        timed_out: false,
        exited: false,
        started_at_ms: info.started_at_ms as i64,
        ended_at_ms: None,
        tag: None,
    };
    state.store.insert_session(&row).await?;
    Ok((StatusCode::CREATED, Json(session_view(&row))))
}

async fn session_row(state: &AppState, tenant: &Tenant, id: &str, sid: &str) -> ApiResult<SessionRow> {
    sandbox_row(state, tenant, id).await?;
    state
        .store
        .get_session(id, sid)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no session {sid:?} in sandbox {id}")))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/sessions", tag = "sessions", params(("id" = String, Path)),
    responses((status = 200, body = Vec<Session>), ApiErrors),
    security(("bearer" = [])))]
pub async fn list_sessions(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<Vec<Session>>> {
    sandbox_row(&state, &tenant, &id).await?;
    let mut out = Vec::new();
    for row in state.store.list_sessions(&id).await? {
        out.push(session_view(&refresh_session(&state, row).await?));
    }
    Ok(Json(out))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/sessions/{sid}", tag = "sessions",
    params(("id" = String, Path), ("sid" = String, Path)),
    responses((status = 200, body = Session), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_session(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path((id, sid)): Path<(String, String)>,
) -> ApiResult<Json<Session>> {
    let row = session_row(&state, &tenant, &id, &sid).await?;
    Ok(Json(session_view(&refresh_session(&state, row).await?)))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StreamQuery {
    /// Resume after this event id (same as the `Last-Event-ID` header).
    pub last_event_id: Option<u64>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/sessions/{sid}/stream", tag = "sessions",
    params(("id" = String, Path), ("sid" = String, Path), StreamQuery,
           ("Last-Event-ID" = Option<String>, Header, description = "resume after this event id")),
    responses((status = 200, description = "text/event-stream: events `stdout`, `stderr` (OutputEvent), `process_exited` (ExitedEvent), `error` (ErrorBody); each with an `id`", content_type = "text/event-stream", body = String), ApiErrors),
    security(("bearer" = [])))]
pub async fn stream_session(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path((id, sid)): Path<(String, String)>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<StreamQuery>,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    let row = session_row(&state, &tenant, &id, &sid).await?;
    let after = match headers.get("last-event-id").and_then(|v| v.to_str().ok()) {
        Some(v) => v
            .trim()
            .parse::<u64>()
            .map_err(|_| ApiError::BadRequest(format!("Last-Event-ID {v:?} is not an event id")))?,
        None => q.last_event_id.unwrap_or(0),
    };
    let events = match state.runtime.get(&id) {
        Ok(sb) => match sb.agent().await {
            Ok(agent) => agent
                .events(row.process_id, after)
                .await
                .map(|s| s.boxed())
                .map_err(ApiError::from),
            Err(e) => Err(ApiError::from(e)),
        },
        Err(_) => Err(ApiError::Conflict(format!("sandbox {id} is not running"))),
    };
    let store = state.store.clone();
    let stream: futures_util::stream::BoxStream<'static, Result<Event, Infallible>> = match events {
        Ok(events) => {
            let mut row = row;
            events
                .map(move |ev| {
                    let ev = match ev {
                        Ok(ev) => ev,
                        Err(e) => {
                            let body = ApiError::from(e).body();
                            return (
                                Event::default().event("error").json_data(body).expect("serializable"),
                                None,
                            );
                        }
                    };
                    let id = ev.seq.to_string();
                    let b64 = |d: &[u8]| OutputEvent {
                        data: base64::engine::general_purpose::STANDARD.encode(d),
                    };
                    match ev.kind {
                        EventKind::Stdout(d) => (
                            Event::default()
                                .id(id)
                                .event("stdout")
                                .json_data(b64(&d))
                                .expect("json"),
                            None,
                        ),
                        EventKind::Stderr(d) => (
                            Event::default()
                                .id(id)
                                .event("stderr")
                                .json_data(b64(&d))
                                .expect("json"),
                            None,
                        ),
                        EventKind::Exit(exit) => {
                            row.exited = true;
                            row.exit_code = exit.exit_code;
                            row.signal = exit.signal;
                            row.timed_out = exit.timed_out;
                            row.ended_at_ms = Some(now_ms());
                            let body = ExitedEvent {
                                exit_code: exit.exit_code,
                                signal: exit.signal.map(signal_name),
                                timed_out: exit.timed_out,
                            };
                            (
                                Event::default()
                                    .id(id)
                                    .event("process_exited")
                                    .json_data(body)
                                    .expect("json"),
                                Some(row.clone()),
                            )
                        }
                    }
                })
                .then(move |(event, finished)| {
                    let store = store.clone();
                    async move {
                        if let Some(row) = finished {
                            let _ = store.finish_session(&row).await;
                        }
                        Ok(event)
                    }
                })
                .boxed()
        }
        Err(e) => {
            // Headers are already promised as an event stream: report the failure in-band.
            let body = e.body();
            futures_util::stream::once(
                async move { Ok(Event::default().event("error").json_data(body).expect("json")) },
            )
            .boxed()
        }
    };
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/sessions/{sid}/stdin", tag = "sessions",
    params(("id" = String, Path), ("sid" = String, Path)), request_body = StdinRequest,
    responses((status = 204), ApiErrors),
    security(("bearer" = [])))]
pub async fn session_stdin(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path((id, sid)): Path<(String, String)>,
    ApiJson(req): ApiJson<StdinRequest>,
) -> ApiResult<StatusCode> {
    let row = session_row(&state, &tenant, &id, &sid).await?;
    let data = match &req.data {
        Some(d) => base64::engine::general_purpose::STANDARD
            .decode(d)
            .map_err(|e| ApiError::Validation(format!("data is not base64: {e}")))?,
        None => Vec::new(),
    };
    let agent = running_sandbox(&state, &tenant, &id).await?.agent().await?;
    if !data.is_empty() {
        agent.write_stdin(row.process_id, data).await?;
    }
    if req.eof.unwrap_or(false) {
        agent.close_stdin(row.process_id).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/sessions/{sid}/signal", tag = "sessions",
    params(("id" = String, Path), ("sid" = String, Path)), request_body = SignalRequest,
    responses((status = 204), ApiErrors),
    security(("bearer" = [])))]
pub async fn session_signal(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path((id, sid)): Path<(String, String)>,
    ApiJson(req): ApiJson<SignalRequest>,
) -> ApiResult<StatusCode> {
    let row = session_row(&state, &tenant, &id, &sid).await?;
    let sig = parse_signal(&req.signal)?;
    running_sandbox(&state, &tenant, &id)
        .await?
        .agent()
        .await?
        .signal(row.process_id, sig)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/sessions/{sid}/resize", tag = "sessions",
    params(("id" = String, Path), ("sid" = String, Path)), request_body = PtySpec,
    responses((status = 204), ApiErrors),
    security(("bearer" = [])))]
pub async fn session_resize(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path((id, sid)): Path<(String, String)>,
    ApiJson(req): ApiJson<PtySpec>,
) -> ApiResult<StatusCode> {
    let row = session_row(&state, &tenant, &id, &sid).await?;
    if req.cols == 0 || req.rows == 0 {
        return Err(ApiError::Validation("cols and rows must be at least 1".into()));
    }
    let size = airlock_proto::PtySize {
        cols: req.cols,
        rows: req.rows,
    };
    running_sandbox(&state, &tenant, &id)
        .await?
        .agent()
        .await?
        .resize(row.process_id, size)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PathQuery {
    /// Absolute path in the sandbox.
    pub path: String,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListFilesQuery {
    /// Absolute directory path in the sandbox.
    pub path: String,
    /// Levels to descend, 1..=32 (default 1).
    #[param(minimum = 1, maximum = 32)]
    pub depth: Option<u32>,
}

fn file_info(s: airlock_proto::FileStat) -> FileInfo {
    FileInfo {
        path: s.path,
        name: s.name,
        kind: match s.kind {
            airlock_proto::FileKind::File => "file",
            airlock_proto::FileKind::Dir => "dir",
            airlock_proto::FileKind::Symlink => "symlink",
            airlock_proto::FileKind::Other => "other",
        }
        .into(),
        size: s.size,
        mode: format!("{:04o}", s.mode),
        owner: s.owner,
        group: s.group,
        modified_at: rfc3339(s.modified_ms as i64),
        symlink_target: s.symlink_target,
    }
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path), PathQuery),
    responses((status = 200, description = "file content", content_type = "application/octet-stream", body = Vec<u8>), ApiErrors),
    security(("bearer" = [])))]
pub async fn read_file(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<Response> {
    let agent = running_sandbox(&state, &tenant, &id).await?.agent().await?;
    let stream = agent.read_file_stream(&q.path).await?;
    let body = axum::body::Body::from_stream(stream.map(|r| r.map_err(std::io::Error::other)));
    Ok(([("content-type", "application/octet-stream")], body).into_response())
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path), PathQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = FileInfo), ApiErrors),
    security(("bearer" = [])))]
pub async fn write_file(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
    body: axum::body::Body,
) -> ApiResult<Json<FileInfo>> {
    let agent = running_sandbox(&state, &tenant, &id).await?.agent().await?;
    let data = body.into_data_stream().map(|r| r.map_err(std::io::Error::other));
    Ok(Json(file_info(
        agent.write_file_stream(&q.path, Some("user"), data).await?,
    )))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path), PathQuery),
    responses((status = 204), ApiErrors),
    security(("bearer" = [])))]
pub async fn delete_file(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<StatusCode> {
    running_sandbox(&state, &tenant, &id)
        .await?
        .agent()
        .await?
        .remove(&q.path)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", tag = "files", params(("id" = String, Path), ListFilesQuery),
    responses((status = 200, body = FileList), ApiErrors),
    security(("bearer" = [])))]
pub async fn list_files(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<ListFilesQuery>,
) -> ApiResult<Json<FileList>> {
    let depth = q.depth.unwrap_or(1);
    if !(1..=32).contains(&depth) {
        return Err(ApiError::Validation(format!(
            "depth must be between 1 and 32, got {depth}"
        )));
    }
    let agent = running_sandbox(&state, &tenant, &id).await?.agent().await?;
    let entries = agent.list(&q.path, depth).await?.into_iter().map(file_info).collect();
    Ok(Json(FileList { entries }))
}

fn template_view(m: airlock_runtime::template::TemplateManifest) -> Template {
    Template {
        name: m.name,
        digest: m.digest,
        kernel_version: m.kernel_version,
        size_bytes: m.size_bytes,
        built_at: m.built_at,
    }
}

#[utoipa::path(get, path = "/v1/templates", tag = "templates",
    responses((status = 200, body = TemplateList), ApiErrors), security(("bearer" = [])))]
pub async fn list_templates(State(state): State<AppState>) -> Json<TemplateList> {
    Json(TemplateList {
        templates: state
            .runtime
            .templates()
            .list()
            .into_iter()
            .map(template_view)
            .collect(),
    })
}

#[utoipa::path(get, path = "/v1/templates/{name}", tag = "templates", params(("name" = String, Path)),
    responses((status = 200, body = Template), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_template(State(state): State<AppState>, Path(name): Path<String>) -> ApiResult<Json<Template>> {
    Ok(Json(template_view(state.runtime.templates().resolve(&name)?.manifest)))
}

#[utoipa::path(get, path = "/v1/system", tag = "system",
    responses((status = 200, body = SystemInfo), ApiErrors), security(("bearer" = [])))]
pub async fn system(State(state): State<AppState>) -> Json<SystemInfo> {
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
        / 1024;
    Json(SystemInfo {
        version: env!("CARGO_PKG_VERSION").into(),
        accel: state.runtime.accel().await.to_string(),
        runtimes: vec![state.runtime.runtime_name().into()],
        capacity: Capacity {
            cpus: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
            memory_mib: mem,
            sandboxes_running: state.runtime.list().len() as u32,
        },
    })
}

pub async fn not_found() -> ApiError {
    ApiError::NotFound("no such route".into())
}

impl From<RuntimeError> for ErrorBody {
    fn from(e: RuntimeError) -> Self {
        ApiError::from(e).body()
    }
}
