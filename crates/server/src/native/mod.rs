//! The native `/v1` door: HTTP + SSE handlers that translate onto the core's services. No rule
//! lives here: only wire formats (JSON bodies, query strings, SSE events, base64).

pub mod admin;
pub mod error;

use crate::core::egress::EgressRequest;
use crate::core::sandboxes::{Change, CreateSandbox, ListSandboxes};
use crate::core::sessions::{parse_signal, signal_name, SessionEvent, SessionEvents, StartSession};
use crate::core::{Core, CoreError, Credentials, Kind};
use crate::model::*;
use crate::records::{rfc3339, SandboxRecord, SessionRecord, Tenant};
use airlock_proto::frame::EventKind;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine as _;
use error::{ApiError, ApiResult};
use futures_util::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::time::Duration;

/// JSON body whose rejections use the API's error format (400 malformed, 422 wrong shape).
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(JsonRejection::JsonDataError(e)) => Err(CoreError::invalid("body", e.body_text()).into()),
            Err(JsonRejection::JsonSyntaxError(e)) => {
                Err(ApiError::Malformed(format!("malformed JSON: {}", e.body_text())))
            }
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError::Malformed(
                "send the body as JSON with `Content-Type: application/json`".into(),
            )),
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError::TooLarge(format!(
                "the body is larger than {} bytes",
                crate::MAX_JSON_BODY
            ))),
            Err(e) => Err(ApiError::Malformed(e.body_text())),
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
            Err(QueryRejection::FailedToDeserializeQueryString(e)) => {
                Err(CoreError::invalid("query", e.body_text()).into())
            }
            Err(e) => Err(ApiError::Malformed(e.body_text())),
        }
    }
}

/// Every `/v1` route accepts a tenant API key, and only that; checked before a body is read.
pub async fn require_tenant(State(core): State<Core>, mut req: Request, next: axum::middleware::Next) -> Response {
    let creds = Credentials::from_headers(req.headers());
    match core.bearer_principal(creds.bearer.as_deref()).await {
        Ok(principal) => {
            let tenant = principal.tenant().cloned().expect("a bearer names a tenant");
            req.extensions_mut().insert(tenant);
            req.extensions_mut().insert(principal);
            next.run(req).await
        }
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// The error responses every route may give, each with an `ErrorBody`.
pub struct ApiErrors;

impl utoipa::IntoResponses for ApiErrors {
    fn responses() -> std::collections::BTreeMap<String, utoipa::openapi::RefOr<utoipa::openapi::response::Response>> {
        use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
        [
            (
                "400",
                "malformed request, a path the guest rejects, or a refused egress entry",
            ),
            ("401", "missing or wrong API key"),
            ("403", "the guest refused (permissions)"),
            ("404", "no such sandbox, session, operation, template or file"),
            ("409", "the sandbox is not running"),
            ("413", "the body is larger than the route reads"),
            ("422", "a field has an invalid value"),
            ("429", "quota exceeded, rate limited, or too many failed sign-ins"),
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

/// `"30s"`, `"10m"`, `"2h"` as a duration.
fn parse_duration(field: &str, v: &str) -> ApiResult<Duration> {
    humantime::parse_duration(v.trim()).map_err(|_| {
        CoreError::invalid(
            field,
            format!("{v:?} is not a duration; use forms like \"30s\", \"10m\", \"2h\""),
        )
        .into()
    })
}

fn accepted(operation: Operation) -> (StatusCode, Json<OperationAccepted>) {
    let sandbox_id = operation.sandbox_id.clone();
    (StatusCode::ACCEPTED, Json(OperationAccepted { operation, sandbox_id }))
}

#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", request_body = CreateSandboxRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "retries with the same key return the same operation"),
        ("X-Airlock-Egress-Profiles" = Option<String>, Header, description = "egress profiles (`a,b`) instead of the server's defaults; honoured only for a signed-in caller (ignored for API keys)")),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn create_sandbox(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Extension(principal): Extension<crate::core::Principal>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CreateSandboxRequest>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    let timeout = req
        .timeout
        .as_deref()
        .map(|t| parse_duration("timeout", t))
        .transpose()?;
    let idempotency_key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| CoreError::invalid("Idempotency-Key", "must be visible ASCII"))?
                .to_string(),
        ),
    };
    let profiles = match headers.get(crate::core::egress::PROFILES_HEADER) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| CoreError::invalid("X-Airlock-Egress-Profiles", "must be visible ASCII"))?
                .to_string(),
        ),
    };
    let resources = req.resources.unwrap_or(ResourcesSpec {
        vcpu: None,
        memory_mib: None,
        disk_mib: None,
    });
    let created = core
        .create_sandbox(
            &principal,
            CreateSandbox {
                template: req.template,
                runtime: req.runtime,
                vcpu: resources.vcpu,
                memory_mib: resources.memory_mib,
                disk_mib: resources.disk_mib,
                timeout,
                env: req.env.unwrap_or_default(),
                metadata: req.metadata.unwrap_or_default(),
                idempotency_key,
                egress: EgressRequest {
                    profiles,
                    ..Default::default()
                },
                lifecycle: Lifecycle {
                    on_timeout: req.on_timeout.unwrap_or_default(),
                    auto_resume: req.auto_resume.unwrap_or(false),
                },
                inherit_egress: None,
            },
        )
        .await?;
    // The record as it is now: a replayed create may have finished long ago.
    let operation = core
        .store
        .get_operation(&tenant.id, &created.operation.id)
        .await
        .map_err(CoreError::from)?
        .unwrap_or(created.operation);
    Ok(accepted(operation))
}

#[utoipa::path(get, path = "/v1/operations/{id}", tag = "operations",
    params(("id" = String, Path)),
    responses((status = 200, body = Operation), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_operation(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<Operation>> {
    Ok(Json(core.operation(&tenant, &id).await?))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only sandboxes in this state (default: creating, running, paused and deleting).
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
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<Json<SandboxList>> {
    let states = match q.state.as_deref() {
        None => vec![],
        Some(s) => vec![SandboxState::parse(s).ok_or_else(|| {
            CoreError::invalid(
                "state",
                format!("unknown state {s:?}; one of creating, running, paused, suspended, resuming, deleting, deleted, failed"),
            )
        })?],
    };
    let mut metadata = BTreeMap::new();
    for (k, v) in &q.rest {
        match k.strip_prefix("metadata.") {
            Some(key) if !key.is_empty() => {
                metadata.insert(key.to_string(), v.clone());
            }
            _ => return Err(CoreError::invalid("query", format!("unknown query parameter {k:?}")).into()),
        }
    }
    let page = core
        .list_sandboxes(
            &tenant,
            ListSandboxes {
                states,
                metadata,
                page_token: q.page_token,
                limit: q.limit.unwrap_or(50),
                newest_first: false,
                created_from_ms: None,
                created_before_ms: None,
                template: None,
            },
        )
        .await?;
    Ok(Json(SandboxList {
        sandboxes: page.sandboxes.iter().map(SandboxRecord::view).collect(),
        next_page_token: page.next_page_token,
    }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_sandbox(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(core.sandbox(&tenant, &id).await?.view()))
}

/// What the sandbox may reach and why: the platform's denies, its tenant's denies and allows, its
/// profiles; and the decisions counted so far with the most recent denials.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/egress", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = EgressReport), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_egress(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<EgressReport>> {
    Ok(Json(core.egress_report(&tenant, &id).await?))
}

/// The caller's tenant: its limits in force and what it uses of them.
#[utoipa::path(get, path = "/v1/tenant", tag = "tenant",
    responses((status = 200, body = TenantInfo), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_tenant(State(core): State<Core>, Extension(tenant): Extension<Tenant>) -> ApiResult<Json<TenantInfo>> {
    Ok(Json(core.tenant_info(&tenant).await?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn delete_sandbox(
    State(core): State<Core>,
    Extension(principal): Extension<crate::core::Principal>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    Ok(accepted(core.delete_sandbox(&principal, &id).await?))
}

/// Freeze the sandbox in memory (processes, files and memory kept). Its timeout stops running
/// until resume, which restores the time that was left; a pause lasts at most 24 h.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn pause_sandbox(
    State(core): State<Core>,
    Extension(principal): Extension<crate::core::Principal>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    Ok(accepted(core.change_sandbox(&principal, &id, Change::Pause).await?))
}

/// Save the sandbox to disk (memory, running processes, files) and end its VM: it then holds
/// only disk space, not CPU or memory, and survives a server restart. Its timeout stops running
/// until resume, which starts it again as it was; a suspend lasts at most 30 days.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/suspend", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn suspend_sandbox(
    State(core): State<Core>,
    Extension(principal): Extension<crate::core::Principal>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    Ok(accepted(core.change_sandbox(&principal, &id, Change::Suspend).await?))
}

/// Run a paused sandbox again, or start a suspended one from its saved state (it must fit the
/// tenant's quota and the node again, like a create).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn resume_sandbox(
    State(core): State<Core>,
    Extension(principal): Extension<crate::core::Principal>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    Ok(accepted(core.change_sandbox(&principal, &id, Change::Resume).await?))
}

fn session_view(s: &SessionRecord) -> Session {
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
        tag: s.tag.clone(),
        exit_code: s.exit_code,
        signal: s.signal.map(signal_name),
        timed_out: s.timed_out,
        started_at: rfc3339(s.started_at_ms),
        ended_at: s.ended_at_ms.map(rfc3339),
    }
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/sessions", tag = "sessions", params(("id" = String, Path)),
    request_body = CreateSessionRequest,
    responses((status = 201, description = "The session. With `Accept: text/event-stream` (a command and its output in one call): an event stream whose first event is `session` (the Session), then the session's events as `.../stream` sends them", content(
        (Session = "application/json"),
        (String = "text/event-stream"),
    )), ApiErrors),
    security(("bearer" = [])))]
pub async fn create_session(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CreateSessionRequest>,
) -> ApiResult<Response> {
    let sandbox = core.sandbox(&tenant, &id).await?;
    let timeout = req
        .timeout
        .as_deref()
        .map(|t| parse_duration("timeout", t))
        .transpose()?;
    let streamed = headers
        .get_all(axum::http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("text/event-stream"));
    let start = StartSession {
        argv: req.argv,
        cwd: req.cwd,
        env: req.env.unwrap_or_default(),
        user: req.user,
        timeout,
        stdin: req.stdin.unwrap_or(false),
        pty: req.pty.map(|p| airlock_proto::PtySize {
            cols: p.cols,
            rows: p.rows,
        }),
        tag: None,
    };
    if !streamed {
        let row = core.start_session(&sandbox, start).await?.session;
        return Ok((StatusCode::CREATED, Json(session_view(&row))).into_response());
    }
    // One call for a command and its output: no second request (its auth and lookups) before
    // the first byte, and nothing of the output can be missed in between.
    let (row, events) = core.start_session_events(&sandbox, start).await?;
    let first = Event::default()
        .event("session")
        .json_data(session_view(&row))
        .expect("serializable");
    let first = futures_util::stream::once(async move { Ok(first) }).boxed();
    Ok((StatusCode::CREATED, event_stream(first, events)).into_response())
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/sessions", tag = "sessions", params(("id" = String, Path)),
    responses((status = 200, body = Vec<Session>), ApiErrors),
    security(("bearer" = [])))]
pub async fn list_sessions(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<Vec<Session>>> {
    let sandbox = core.sandbox(&tenant, &id).await?;
    Ok(Json(core.sessions(&sandbox).await?.iter().map(session_view).collect()))
}

/// A tenant's sandbox and one of its sessions as recorded (see `Core::session_record`).
async fn session_of(core: &Core, tenant: &Tenant, id: &str, sid: &str) -> ApiResult<(SandboxRecord, SessionRecord)> {
    let sandbox = core.sandbox(tenant, id).await?;
    let session = core.session_record(&sandbox, sid).await?;
    Ok((sandbox, session))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/sessions/{sid}", tag = "sessions",
    params(("id" = String, Path), ("sid" = String, Path)),
    responses((status = 200, body = Session), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_session(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path((id, sid)): Path<(String, String)>,
) -> ApiResult<Json<Session>> {
    let sandbox = core.sandbox(&tenant, &id).await?;
    Ok(Json(session_view(&core.session(&sandbox, &sid).await?)))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StreamQuery {
    /// Resume after this event id (same as the `Last-Event-ID` header).
    pub last_event_id: Option<u64>,
}

fn error_event(e: ApiError) -> Event {
    Event::default()
        .event("error")
        .json_data(e.status_and_body().1)
        .expect("serializable")
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/sessions/{sid}/stream", tag = "sessions",
    params(("id" = String, Path), ("sid" = String, Path), StreamQuery,
           ("Last-Event-ID" = Option<String>, Header, description = "resume after this event id")),
    responses((status = 200, description = "text/event-stream: events `stdout`, `stderr` (OutputEvent), `process_exited` (ExitedEvent), `error` (ErrorBody); each with an `id`", content_type = "text/event-stream", body = String), ApiErrors),
    security(("bearer" = [])))]
pub async fn stream_session(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path((id, sid)): Path<(String, String)>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<StreamQuery>,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    let (sandbox, row) = session_of(&core, &tenant, &id, &sid).await?;
    let after = match headers.get("last-event-id").and_then(|v| v.to_str().ok()) {
        Some(v) => v
            .trim()
            .parse::<u64>()
            .map_err(|_| ApiError::Malformed(format!("Last-Event-ID {v:?} is not an event id")))?,
        None => q.last_event_id.unwrap_or(0),
    };
    let events = core.session_events(&sandbox, row, after).await;
    Ok(event_stream(futures_util::stream::empty().boxed(), events))
}

/// A session's events as SSE (`stdout`, `stderr`, `output_truncated`, `process_exited`,
/// `error`, each with its id), after `first` (the one-call exec's `session` event). A failure to
/// reach the events is reported in-band: the headers already promise an event stream.
fn event_stream(
    first: futures_util::stream::BoxStream<'static, Result<Event, Infallible>>,
    events: Result<SessionEvents, CoreError>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let stream = match events {
        Ok(events) => events
                .map(|ev| {
                    let ev = match ev {
                        Ok(SessionEvent::Event(ev)) => ev,
                        // Its id is the last missing event's: a reconnect resumes after it.
                        Ok(SessionEvent::Truncated { first, last }) => {
                            let body = TruncatedEvent {
                                first_seq: first,
                                last_seq: last,
                                message: format!(
                                    "output events {first} to {last} are no longer kept (the sandbox keeps the last 32 MiB of a process's output)"
                                ),
                            };
                            return Ok(Event::default()
                                .id(last.to_string())
                                .event("output_truncated")
                                .json_data(body)
                                .expect("serializable"));
                        }
                        Err(e) => return Ok(error_event(e.into())),
                    };
                    let b64 = |d: &[u8]| OutputEvent {
                        data: base64::engine::general_purpose::STANDARD.encode(d),
                    };
                    let event = Event::default().id(ev.seq.to_string());
                    Ok(match ev.kind {
                        EventKind::Stdout(d) => event.event("stdout").json_data(b64(&d)),
                        EventKind::Stderr(d) => event.event("stderr").json_data(b64(&d)),
                        EventKind::Exit(exit) => event.event("process_exited").json_data(ExitedEvent {
                            exit_code: exit.exit_code,
                            signal: exit.signal.map(signal_name),
                            timed_out: exit.timed_out,
                        }),
                    }
                    .expect("serializable"))
                })
            .boxed(),
        Err(e) => futures_util::stream::once(async move { Ok(error_event(e.into())) }).boxed(),
    };
    Sse::new(first.chain(stream).boxed()).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/sessions/{sid}/stdin", tag = "sessions",
    params(("id" = String, Path), ("sid" = String, Path)), request_body = StdinRequest,
    responses((status = 204), ApiErrors),
    security(("bearer" = [])))]
pub async fn session_stdin(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path((id, sid)): Path<(String, String)>,
    ApiJson(req): ApiJson<StdinRequest>,
) -> ApiResult<StatusCode> {
    let (sandbox, row) = session_of(&core, &tenant, &id, &sid).await?;
    let data = match &req.data {
        Some(d) => base64::engine::general_purpose::STANDARD
            .decode(d)
            .map_err(|e| CoreError::invalid("data", format!("not base64: {e}")))?,
        None => Vec::new(),
    };
    core.session_stdin(&sandbox, &row, data, req.eof.unwrap_or(false))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/sessions/{sid}/signal", tag = "sessions",
    params(("id" = String, Path), ("sid" = String, Path)), request_body = SignalRequest,
    responses((status = 204), ApiErrors),
    security(("bearer" = [])))]
pub async fn session_signal(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path((id, sid)): Path<(String, String)>,
    ApiJson(req): ApiJson<SignalRequest>,
) -> ApiResult<StatusCode> {
    let (sandbox, row) = session_of(&core, &tenant, &id, &sid).await?;
    let signal = parse_signal(&req.signal)?;
    core.session_signal(&sandbox, &row, signal).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/sessions/{sid}/resize", tag = "sessions",
    params(("id" = String, Path), ("sid" = String, Path)), request_body = PtySpec,
    responses((status = 204), ApiErrors),
    security(("bearer" = [])))]
pub async fn session_resize(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path((id, sid)): Path<(String, String)>,
    ApiJson(req): ApiJson<PtySpec>,
) -> ApiResult<StatusCode> {
    let (sandbox, row) = session_of(&core, &tenant, &id, &sid).await?;
    let size = airlock_proto::PtySize {
        cols: req.cols,
        rows: req.rows,
    };
    core.session_resize(&sandbox, &row, size).await?;
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

async fn files_of(core: &Core, tenant: &Tenant, id: &str) -> ApiResult<crate::core::files::Files> {
    let sandbox = core.sandbox(tenant, id).await?;
    Ok(core.files(&sandbox).await?)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path), PathQuery),
    responses((status = 200, description = "file content", content_type = "application/octet-stream", body = Vec<u8>), ApiErrors),
    security(("bearer" = [])))]
pub async fn read_file(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<Response> {
    let stream = files_of(&core, &tenant, &id).await?.read(&q.path).await?;
    let body = axum::body::Body::from_stream(stream);
    Ok(([("content-type", "application/octet-stream")], body).into_response())
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path), PathQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = FileInfo), ApiErrors),
    security(("bearer" = [])))]
pub async fn write_file(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
    body: axum::body::Body,
) -> ApiResult<Json<FileInfo>> {
    let files = files_of(&core, &tenant, &id).await?;
    let data = body.into_data_stream().map(|r| r.map_err(std::io::Error::other));
    Ok(Json(file_info(files.write(&q.path, "user", data).await?)))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path), PathQuery),
    responses((status = 204), ApiErrors),
    security(("bearer" = [])))]
pub async fn delete_file(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<StatusCode> {
    files_of(&core, &tenant, &id).await?.remove(&q.path).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", tag = "files", params(("id" = String, Path), ListFilesQuery),
    responses((status = 200, body = FileList), ApiErrors),
    security(("bearer" = [])))]
pub async fn list_files(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<ListFilesQuery>,
) -> ApiResult<Json<FileList>> {
    let files = files_of(&core, &tenant, &id).await?;
    let entries = files.list(&q.path, q.depth.unwrap_or(1)).await?;
    Ok(Json(FileList {
        entries: entries.into_iter().map(file_info).collect(),
    }))
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
pub async fn list_templates(State(core): State<Core>) -> Json<TemplateList> {
    Json(TemplateList {
        templates: core.templates().into_iter().map(template_view).collect(),
    })
}

#[utoipa::path(get, path = "/v1/templates/{name}", tag = "templates", params(("name" = String, Path)),
    responses((status = 200, body = Template), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_template(State(core): State<Core>, Path(name): Path<String>) -> ApiResult<Json<Template>> {
    Ok(Json(template_view(core.resolve_template(&name)?.manifest)))
}

/// What a tenant may know of the server: version, accelerator, runtimes, egress configuration.
/// The node's counts and warm pools are every tenant's business together, so the platform
/// account's `GET /v1/admin/system` alone shows them.
#[utoipa::path(get, path = "/v1/system", tag = "system",
    responses((status = 200, body = SystemInfo), ApiErrors), security(("bearer" = [])))]
pub async fn system(State(core): State<Core>) -> Json<SystemInfo> {
    Json(system_info(&core, false).await)
}

pub(crate) async fn system_info(core: &Core, node_wide: bool) -> SystemInfo {
    let nodes = &core.nodes;
    let capacity = nodes.capacity();
    SystemInfo {
        version: env!("CARGO_PKG_VERSION").into(),
        accel: nodes.accel().await,
        runtimes: vec![nodes.runtime_name().into()],
        capacity: node_wide.then_some(Capacity {
            cpus: capacity.cpus,
            memory_mib: capacity.memory_mib,
            sandboxes_running: capacity.sandboxes_running,
        }),
        egress: core.egress_info(),
        pools: node_wide.then(|| core.pools()),
    }
}

pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    CoreError::not_found(Kind::Route, uri.path()).into()
}

/// A JSON body that may be left out (`{}` then).
fn optional_body<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, CoreError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| CoreError::invalid("body", e.to_string()))
}

/// Save the sandbox while it runs on (it is stopped only while its memory is written and its
/// disk copied): its memory, running processes and files. New sandboxes start from it by naming
/// it (id or name) as their `template`; they have its resources.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshots", tag = "snapshots", params(("id" = String, Path)),
    request_body(content = CreateSnapshotRequest, description = "optional"),
    responses((status = 201, body = Snapshot), ApiErrors),
    security(("bearer" = [])))]
pub async fn create_snapshot(
    State(core): State<Core>,
    Extension(principal): Extension<crate::core::Principal>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> ApiResult<(StatusCode, Json<Snapshot>)> {
    let req: CreateSnapshotRequest = optional_body(&body)?;
    Ok((
        StatusCode::CREATED,
        Json(core.create_snapshot(&principal, &id, req.name).await?),
    ))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SnapshotsQuery {
    /// Only the snapshots of this sandbox.
    pub sandbox_id: Option<String>,
}

/// The tenant's snapshots, oldest first.
#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots", params(SnapshotsQuery),
    responses((status = 200, body = SnapshotList), ApiErrors),
    security(("bearer" = [])))]
pub async fn list_snapshots(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    ApiQuery(q): ApiQuery<SnapshotsQuery>,
) -> ApiResult<Json<SnapshotList>> {
    let rows = core.list_snapshots(&tenant, q.sandbox_id.as_deref()).await?;
    Ok(Json(SnapshotList {
        snapshots: rows.iter().map(|s| s.view()).collect(),
    }))
}

#[utoipa::path(get, path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path)),
    responses((status = 200, body = Snapshot), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_snapshot(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<Snapshot>> {
    Ok(Json(core.snapshot(&tenant, &id).await?.view()))
}

/// Delete a snapshot; sandboxes made from it run on.
#[utoipa::path(delete, path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path)),
    responses((status = 204), ApiErrors),
    security(("bearer" = [])))]
pub async fn delete_snapshot(
    State(core): State<Core>,
    Extension(principal): Extension<crate::core::Principal>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    core.delete_snapshot(&principal, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `count` new sandboxes, each with the memory, running processes and files this one has now,
/// then independent of it and of each other (it runs on, stopped only while it is saved). Each
/// child is a create of its own, under the tenant's quota, with the parent's egress, env,
/// metadata and lifecycle.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", tag = "sandboxes", params(("id" = String, Path)),
    request_body(content = ForkRequest, description = "optional"),
    responses((status = 202, body = ForkAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn fork_sandbox(
    State(core): State<Core>,
    Extension(principal): Extension<crate::core::Principal>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> ApiResult<(StatusCode, Json<ForkAccepted>)> {
    let req: ForkRequest = optional_body(&body)?;
    let timeout = req
        .timeout
        .as_deref()
        .map(|t| parse_duration("timeout", t))
        .transpose()?;
    let children = core
        .fork_sandbox(&principal, &id, req.count.unwrap_or(1), timeout)
        .await?;
    let mut sandboxes = Vec::new();
    let mut errors = Vec::new();
    for child in children {
        match child {
            Ok(created) => sandboxes.push(accepted(created.operation).1 .0),
            Err(e) => errors.push(ErrorBody::from(&e)),
        }
    }
    Ok((StatusCode::ACCEPTED, Json(ForkAccepted { sandboxes, errors })))
}
