//! `/v1/events`, `/v1/sandboxes/{id}/events` and `/v1/webhooks`: a tenant's lifecycle events
//! (pages newest first, or SSE resuming after `Last-Event-ID`) and its webhooks, onto the core's
//! events and webhooks.

use super::*;
use crate::core::events::event_view;
use crate::core::Principal;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// Only this sandbox's events.
    pub sandbox_id: Option<String>,
    /// Events older than this `seq` (the next page: the previous page's `next_before`).
    pub before: Option<i64>,
    /// At most this many (default 100, at most 1000).
    pub limit: Option<u32>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct EventStreamQuery {
    /// Only this sandbox's events.
    pub sandbox_id: Option<String>,
    /// Events after this `seq` (as `Last-Event-ID`); none: only events from now on.
    pub after: Option<i64>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct SandboxEventsQuery {
    pub before: Option<i64>,
    pub limit: Option<u32>,
}

async fn page(
    core: &Core,
    principal: &Principal,
    sandbox: Option<&str>,
    before: Option<i64>,
    limit: Option<u32>,
) -> ApiResult<Json<EventList>> {
    let (events, next_before) = core.events(principal, sandbox, before, limit).await?;
    Ok(Json(EventList {
        events: events.into_iter().map(event_view).collect(),
        next_before,
    }))
}

/// The tenant's lifecycle events, newest first (kept 7 days).
#[utoipa::path(get, path = "/v1/events", tag = "events", params(EventsQuery),
    responses((status = 200, body = EventList), ApiErrors), security(("bearer" = [])))]
pub async fn list_events(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> ApiResult<Json<EventList>> {
    page(&core, &principal, q.sandbox_id.as_deref(), q.before, q.limit).await
}

/// One sandbox's lifecycle events, newest first (also after it ended, while they are kept).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/events", tag = "events", params(("id" = String, Path), SandboxEventsQuery),
    responses((status = 200, body = EventList), ApiErrors), security(("bearer" = [])))]
pub async fn sandbox_events(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<SandboxEventsQuery>,
) -> ApiResult<Json<EventList>> {
    page(&core, &principal, Some(&id), q.before, q.limit).await
}

/// The tenant's events as they happen, oldest first: SSE events named by their type
/// (`sandbox.created`, ...), each with its `seq` as id; a reconnect with `Last-Event-ID` (or
/// `?after=`) resumes after it, without loss or repeats while the events are kept.
#[utoipa::path(get, path = "/v1/events/stream", tag = "events",
    params(EventStreamQuery, ("Last-Event-ID" = Option<String>, Header, description = "resume after this event's seq")),
    responses((status = 200, description = "text/event-stream of Event", content_type = "text/event-stream", body = String), ApiErrors),
    security(("bearer" = [])))]
pub async fn stream_events(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<EventStreamQuery>,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    let after = match headers.get("last-event-id").and_then(|v| v.to_str().ok()) {
        Some(v) => Some(
            v.trim()
                .parse::<i64>()
                .map_err(|_| ApiError::Malformed(format!("Last-Event-ID {v:?} is not an event's seq")))?,
        ),
        None => q.after,
    };
    let after = match after {
        Some(a) => a,
        // From now on: after the newest event there is.
        None => core
            .events(&principal, q.sandbox_id.as_deref(), None, Some(1))
            .await?
            .0
            .first()
            .map_or(0, |e| e.seq),
    };
    let events = core.event_stream(&principal, q.sandbox_id.as_deref(), after).await?;
    let stream = events.map(|e| {
        Ok(match e {
            Ok(e) => {
                let view = event_view(e);
                Event::default()
                    .id(view.seq.to_string())
                    .event(view.kind.clone())
                    .json_data(view)
                    .expect("serializable")
            }
            Err(e) => error_event(e.into()),
        })
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

/// Register a webhook: the tenant's events (all, or the types in `events`) are POSTed to `url`,
/// signed with the `secret` returned here once.
#[utoipa::path(post, path = "/v1/webhooks", tag = "events", request_body = CreateWebhookRequest,
    responses((status = 201, body = NewWebhook), ApiErrors), security(("bearer" = [])))]
pub async fn create_webhook(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    ApiJson(req): ApiJson<CreateWebhookRequest>,
) -> ApiResult<(StatusCode, Json<NewWebhook>)> {
    Ok((StatusCode::CREATED, Json(core.create_webhook(&principal, req).await?)))
}

#[utoipa::path(get, path = "/v1/webhooks", tag = "events",
    responses((status = 200, body = WebhookList), ApiErrors), security(("bearer" = [])))]
pub async fn list_webhooks(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
) -> ApiResult<Json<WebhookList>> {
    Ok(Json(WebhookList {
        webhooks: core.webhooks(&principal).await?,
    }))
}

/// A webhook and how its deliveries go (the last attempt's status and error).
#[utoipa::path(get, path = "/v1/webhooks/{id}", tag = "events", params(("id" = String, Path)),
    responses((status = 200, body = WebhookView), ApiErrors), security(("bearer" = [])))]
pub async fn get_webhook(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<WebhookView>> {
    Ok(Json(core.webhook(&principal, &id).await?))
}

#[utoipa::path(patch, path = "/v1/webhooks/{id}", tag = "events", params(("id" = String, Path)),
    request_body = UpdateWebhookRequest, responses((status = 200, body = WebhookView), ApiErrors),
    security(("bearer" = [])))]
pub async fn update_webhook(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<UpdateWebhookRequest>,
) -> ApiResult<Json<WebhookView>> {
    Ok(Json(core.update_webhook(&principal, &id, req).await?))
}

#[utoipa::path(delete, path = "/v1/webhooks/{id}", tag = "events", params(("id" = String, Path)),
    responses((status = 204), ApiErrors), security(("bearer" = [])))]
pub async fn delete_webhook(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    core.delete_webhook(&principal, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A webhook's delivery attempts, newest first (the last 100, kept 7 days).
#[utoipa::path(get, path = "/v1/webhooks/{id}/deliveries", tag = "events", params(("id" = String, Path)),
    responses((status = 200, body = DeliveryList), ApiErrors), security(("bearer" = [])))]
pub async fn webhook_deliveries(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<DeliveryList>> {
    Ok(Json(DeliveryList {
        deliveries: core.webhook_deliveries(&principal, &id).await?,
    }))
}
