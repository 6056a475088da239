//! `/v1/sandboxes/{id}/sessions`: start (answering as an SSE stream on request), list, get,
//! stream, stdin, signal, resize; the session's SSE events.

use super::*;

pub(super) fn session_view(s: &SessionRecord) -> Session {
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
pub(super) async fn session_of(
    core: &Core,
    tenant: &Tenant,
    id: &str,
    sid: &str,
) -> ApiResult<(SandboxRecord, SessionRecord)> {
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

pub(super) fn error_event(e: ApiError) -> Event {
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
pub(super) fn event_stream(
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
