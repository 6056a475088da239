//! `/v1/templates` and `/v1/builds`: the platform's templates and a tenant's own, their builds
//! and build logs (JSON pages, or SSE resuming with `Last-Event-ID`), onto the core's builds.

use super::*;
use crate::core::builds::{parse_dockerfile, BuildRequest, Definition};
use crate::core::Principal;

/// The platform's templates, then the tenant's own (`name` with its `tag`).
#[utoipa::path(get, path = "/v1/templates", tag = "templates",
    responses((status = 200, body = TemplateList), ApiErrors), security(("bearer" = [])))]
pub async fn list_templates(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
) -> ApiResult<Json<TemplateList>> {
    let mut templates = core.templates();
    templates.extend(
        core.tenant_templates(&principal)
            .await?
            .into_iter()
            .map(tenant_template),
    );
    Ok(Json(TemplateList { templates }))
}

/// A platform template, or the tenant's own (`name[:tag]`).
#[utoipa::path(get, path = "/v1/templates/{name}", tag = "templates", params(("name" = String, Path)),
    responses((status = 200, body = Template), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_template(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(name): Path<String>,
) -> ApiResult<Json<Template>> {
    if let Ok(t) = core.template(&name) {
        return Ok(Json(t));
    }
    let (base, tag) = crate::core::builds::split_name(&name)?;
    let found = core
        .tenant_templates(&principal)
        .await?
        .into_iter()
        .find(|b| b.name == base && b.tag == tag);
    match found {
        Some(b) => Ok(Json(tenant_template(b))),
        None => Err(CoreError::not_found(Kind::Template, &name).into()),
    }
}

fn tenant_template(b: crate::records::BuildRecord) -> Template {
    let manifest: Option<airlock_runtime::template::TemplateManifest> =
        b.manifest.as_deref().and_then(|m| serde_json::from_str(m).ok());
    Template {
        name: b.name,
        digest: b.digest.unwrap_or_default(),
        kernel_version: manifest.as_ref().map(|m| m.kernel_version.clone()).unwrap_or_default(),
        size_bytes: manifest.as_ref().map(|m| m.size_bytes).unwrap_or(0),
        built_at: b.finished_at_ms.map(rfc3339).unwrap_or_default(),
        tag: Some(b.tag),
        build_id: Some(b.id),
    }
}

/// Build a template of the tenant's in a microVM: its steps run there as the tenant's code,
/// under its egress policy; the build is admitted like a sandbox. Follow it at
/// `/v1/builds/{id}` and its log at `/v1/builds/{id}/logs`.
#[utoipa::path(post, path = "/v1/templates", tag = "templates",
    request_body = BuildTemplateRequest,
    responses((status = 202, body = TemplateBuild), ApiErrors),
    security(("bearer" = [])))]
pub async fn build_template(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    ApiJson(req): ApiJson<BuildTemplateRequest>,
) -> ApiResult<(StatusCode, Json<TemplateBuild>)> {
    let mut definition = match &req.dockerfile {
        Some(text) => {
            if !req.steps.is_empty() || req.from.is_some() {
                return Err(CoreError::invalid("dockerfile", "give a Dockerfile or from and steps, not both").into());
            }
            parse_dockerfile(text, req.context.as_deref())?
        }
        None => Definition {
            from: req
                .from
                .clone()
                .ok_or_else(|| CoreError::invalid("from", "name the parent template (or send a dockerfile)"))?,
            steps: req.steps.clone(),
            ..Default::default()
        },
    };
    if req.start_cmd.is_some() {
        definition.start_cmd = req.start_cmd.clone();
    }
    definition.ready_cmd = req.ready_cmd.clone();
    definition.force = req.force;
    definition.vcpu = req.vcpu;
    definition.memory_mib = req.memory_mib;
    definition.disk_mib = req.disk_mib;
    definition.registry_auth = req.registry_auth;
    let build = core
        .build_template(
            &principal,
            BuildRequest {
                name: req.name,
                definition,
            },
        )
        .await?;
    Ok((StatusCode::ACCEPTED, Json(build.into())))
}

/// Delete the tenant's template (every tag and build). Sandboxes made from it run on.
#[utoipa::path(delete, path = "/v1/templates/{name}", tag = "templates", params(("name" = String, Path)),
    responses((status = 204), ApiErrors),
    security(("bearer" = [])))]
pub async fn delete_template(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    core.delete_tenant_template(&principal, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Upload a build context: a tar archive (gzip-compressed or not) COPY steps copy from.
#[utoipa::path(post, path = "/v1/templates/contexts", tag = "templates",
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 201, body = ContextUploaded), ApiErrors),
    security(("bearer" = [])))]
pub async fn upload_context(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    body: axum::body::Body,
) -> ApiResult<(StatusCode, Json<ContextUploaded>)> {
    let hash = core
        .put_build_context(&principal, None, body.into_data_stream())
        .await?;
    Ok((StatusCode::CREATED, Json(ContextUploaded { hash })))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct BuildsQuery {
    /// Only the builds of this template.
    pub name: Option<String>,
}

/// The tenant's builds, newest first.
#[utoipa::path(get, path = "/v1/builds", tag = "templates", params(BuildsQuery),
    responses((status = 200, body = BuildList), ApiErrors),
    security(("bearer" = [])))]
pub async fn list_builds(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    ApiQuery(q): ApiQuery<BuildsQuery>,
) -> ApiResult<Json<BuildList>> {
    let builds = core.template_builds(&principal, q.name.as_deref()).await?;
    Ok(Json(BuildList {
        builds: builds.into_iter().map(Into::into).collect(),
    }))
}

#[utoipa::path(get, path = "/v1/builds/{id}", tag = "templates", params(("id" = String, Path)),
    responses((status = 200, body = TemplateBuild), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_build(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<TemplateBuild>> {
    Ok(Json(core.template_build(&principal, &id).await?.into()))
}

/// Cancel a build: unless it ended, it ends `error` (`cancelled by ...`) and leaves nothing
/// running or saved; an ended build is answered as it is.
#[utoipa::path(delete, path = "/v1/builds/{id}", tag = "templates", params(("id" = String, Path)),
    responses((status = 200, body = TemplateBuild), ApiErrors),
    security(("bearer" = [])))]
pub async fn cancel_build(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<TemplateBuild>> {
    Ok(Json(core.cancel_build(&principal, &id).await?.into()))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LogsQuery {
    /// The first entry to return (its `seq`).
    pub offset: Option<i64>,
    /// At most this many (100 at most).
    pub limit: Option<i64>,
}

/// A build's log from `offset`: a JSON page, or with `Accept: text/event-stream` an SSE stream
/// (`log` events, their id the entry's `seq`; then `end` with the build) that follows the build
/// until it ends and resumes after `Last-Event-ID`.
#[utoipa::path(get, path = "/v1/builds/{id}/logs", tag = "templates", params(("id" = String, Path), LogsQuery,
           ("Last-Event-ID" = Option<String>, Header, description = "resume after this entry")),
    responses((status = 200, body = BuildLogs), ApiErrors),
    security(("bearer" = [])))]
pub async fn build_logs(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<LogsQuery>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let wants_sse = headers
        .get("accept")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    if !wants_sse {
        let (build, entries) = core
            .template_build_logs(&principal, &id, q.offset.unwrap_or(0), q.limit)
            .await?;
        return Ok(Json(BuildLogs {
            build: build.into(),
            entries: entries.into_iter().map(Into::into).collect(),
        })
        .into_response());
    }
    let offset = match headers.get("last-event-id").and_then(|v| v.to_str().ok()) {
        Some(v) => {
            v.trim()
                .parse::<i64>()
                .map_err(|_| ApiError::Malformed(format!("Last-Event-ID {v:?} is not an entry's seq")))?
                + 1
        }
        None => q.offset.unwrap_or(0),
    };
    // Found now: a build that is not the caller's answers 404 rather than an empty stream.
    core.template_build(&principal, &id).await?;
    // Each turn: the next page (its entries as events), or the build's end once read through.
    let state = (core, principal, id, offset, false);
    let stream = futures_util::stream::unfold(state, |(core, principal, id, mut offset, done)| async move {
        if done {
            return None;
        }
        loop {
            let Ok((build, entries)) = core.template_build_logs(&principal, &id, offset, None).await else {
                return None;
            };
            let ended = build.status.ended();
            let full = entries.len() as i64 == crate::core::builds::MAX_LOG_PAGE;
            if !entries.is_empty() {
                let events: Vec<Result<Event, Infallible>> = entries
                    .into_iter()
                    .map(|e| {
                        offset = e.seq + 1;
                        let line = BuildLogLine::from(e);
                        let data = serde_json::to_string(&line).expect("serializable");
                        Ok(Event::default().event("log").id(line.seq.to_string()).data(data))
                    })
                    .collect();
                return Some((futures_util::stream::iter(events), (core, principal, id, offset, false)));
            }
            if ended && !full {
                let data = serde_json::to_string(&TemplateBuild::from(build)).expect("serializable");
                let end = vec![Ok(Event::default().event("end").data(data))];
                return Some((futures_util::stream::iter(end), (core, principal, id, offset, true)));
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    })
    .flatten();
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}
