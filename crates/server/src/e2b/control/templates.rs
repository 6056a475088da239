//! E2B's template builder (`Template.build`, `build_in_background`, tags, `exists`): each call
//! a translation onto the core's builds. A template's `templateID` is its name; its build ids
//! are UUIDs. Uploads go to signed links outside the API-key check, as E2B's presigned URLs.

use super::{parse_body, E2bState, Result};
use super::{
    AssignTags, BuildLogEntry, BuildReason, BuildStatusQuery, BuildStatusReply, FileLink, NewTemplate, RemoveTags,
    TagInfo, TagsAssigned, TemplateBuildStart, TemplateCreated,
};
use crate::core::builds::{Definition, UploadLink, MAX_LOG_PAGE};
use crate::core::{CoreError, Principal};
use crate::e2b::E2bError;
use crate::records::{rfc3339, BuildStatus};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::{Extension, Json};
use serde::Deserialize;

/// `POST /v3/templates`: a build of `name[:tag]` (and `tags`) that waits for its steps.
pub async fn create_template(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<TemplateCreated>)> {
    let req: NewTemplate = parse_body(&body)?;
    let name = req
        .name
        .or(req.alias)
        .filter(|n| !n.trim().is_empty())
        .ok_or_else(|| E2bError::bad_request("Name is required"))?;
    if name.contains('/') {
        return Err(E2bError::bad_request(format!(
            "Invalid name: {name:?}: team-scoped names (`team/name`) are not supported"
        )));
    }
    let definition = Definition {
        vcpu: req.cpu_count,
        memory_mib: req.memory_mb,
        ..Default::default()
    };
    let tags = req.tags.unwrap_or_default();
    let build = state.core.new_build(&principal, &name, &tags, definition).await?;
    let mut all_tags = vec![build.tag.clone()];
    all_tags.extend(
        tags.into_iter()
            .map(|t| t.to_ascii_lowercase())
            .filter(|t| *t != build.tag),
    );
    Ok((
        StatusCode::ACCEPTED,
        Json(TemplateCreated {
            template_id: build.name.clone(),
            build_id: build.id,
            public: false,
            names: vec![build.name.clone()],
            aliases: vec![build.name],
            tags: all_tags,
        }),
    ))
}

/// `GET /templates/{id}/files/{hash}`: whether context `hash` is uploaded, and a link to PUT it
/// (good for 30 minutes, outside the API-key check).
pub async fn file_link(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    Path((template, hash)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<(StatusCode, Json<FileLink>)> {
    if !state.core.has_tenant_template(&principal, &template).await? {
        return Err(CoreError::not_found(crate::core::Kind::Template, &template).into());
    }
    let present = state.core.has_build_context(&principal, &hash)?;
    let link = state.core.upload_link(&principal, &hash)?;
    let url = format!(
        "{}/templates/{template}/files/{hash}?tenant={}&expires={}&signature={}",
        origin(&state, &headers),
        link.tenant_id,
        link.expires,
        link.signature
    );
    Ok((StatusCode::CREATED, Json(FileLink { present, url })))
}

/// Where the caller reached this server: its upload links point there.
fn origin(state: &E2bState, headers: &HeaderMap) -> String {
    let host = headers.get("host").and_then(|h| h.to_str().ok()).unwrap_or("127.0.0.1");
    let forwarded = headers.get("x-forwarded-proto").and_then(|h| h.to_str().ok());
    let tls = match forwarded {
        Some(p) => p == "https",
        None => state
            .domain
            .as_deref()
            .is_some_and(|d| host.split(':').next().is_some_and(|h| h.ends_with(d))),
    };
    format!("{}://{host}", if tls { "https" } else { "http" })
}

#[derive(Debug, Deserialize)]
pub struct UploadQuery {
    tenant: String,
    expires: i64,
    signature: String,
}

/// `PUT <link>`: a context's tar (gzip-compressed or not), on the link's own authority.
pub async fn upload(
    State(state): State<E2bState>,
    Path((_template, hash)): Path<(String, String)>,
    Query(q): Query<UploadQuery>,
    body: axum::body::Body,
) -> Result<StatusCode> {
    let link = UploadLink {
        tenant_id: q.tenant,
        hash,
        expires: q.expires,
        signature: q.signature,
    };
    state.core.upload_through_link(&link, body.into_data_stream()).await?;
    Ok(StatusCode::CREATED)
}

/// `POST /v2/templates/{id}/builds/{buildID}`: the build's steps; it starts.
pub async fn start_build(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    Path((template, build_id)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Result<StatusCode> {
    let req: TemplateBuildStart = parse_body(&body)?;
    let build = state.core.template_build(&principal, &build_id).await?;
    if build.name != template.to_ascii_lowercase() {
        return Err(CoreError::not_found(crate::core::Kind::Template, format!("{template}/{build_id}")).into());
    }
    // A registry account for this pull only: never stored, never logged.
    let registry_auth = match req.from_image_registry.as_ref().filter(|v| !v.is_null()) {
        None => None,
        Some(v) => {
            let field = |k: &str| v.get(k).and_then(serde_json::Value::as_str).map(String::from);
            match (field("type").as_deref(), field("username"), field("password")) {
                (Some("registry"), Some(username), Some(password)) => {
                    Some(airlock_runtime::template::RegistryCredentials { username, password })
                }
                (Some("registry"), ..) => {
                    return Err(E2bError::bad_request(
                        "fromImageRegistry: a registry account needs username and password",
                    ))
                }
                (other, ..) => {
                    return Err(E2bError::bad_request(format!(
                        "fromImageRegistry of type {} is not supported (type registry is)",
                        other.unwrap_or("(none)")
                    )))
                }
            }
        }
    };
    if let Some(k) = req.other.keys().next() {
        return Err(CoreError::unsupported(k, "").into());
    }
    // A template, else an image the core pulls (or stands a template in for).
    let from = match (&req.from_template, &req.from_image) {
        (Some(t), _) => t.clone(),
        (None, image) => image.clone().unwrap_or_else(|| "e2bdev/base".into()),
    };
    let stored: Definition = serde_json::from_str(&build.definition).unwrap_or_default();
    let definition = Definition {
        from,
        steps: req.steps,
        start_cmd: req.start_cmd.filter(|c| !c.trim().is_empty()),
        ready_cmd: req.ready_cmd.filter(|c| !c.trim().is_empty()),
        force: req.force.unwrap_or(false),
        registry_auth,
        ..stored
    };
    state.core.start_build(&principal, &build_id, definition).await?;
    Ok(StatusCode::ACCEPTED)
}

/// `GET /templates/{id}/builds/{buildID}/status`: the build's state and its log from
/// `logsOffset` (100 entries at most).
pub async fn build_status(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    Path((template, build_id)): Path<(String, String)>,
    Query(q): Query<BuildStatusQuery>,
) -> Result<Json<BuildStatusReply>> {
    let limit = q.limit.unwrap_or(MAX_LOG_PAGE);
    let (build, entries) = state
        .core
        .template_build_logs(&principal, &build_id, q.logs_offset.unwrap_or(0), Some(limit))
        .await?;
    let entry = |e: crate::records::BuildLogEntry| BuildLogEntry {
        timestamp: rfc3339(e.at_ms),
        level: e.level,
        message: e.message,
        step: e.step,
    };
    let status = match build.status {
        BuildStatus::Waiting => "waiting",
        BuildStatus::Building => "building",
        BuildStatus::Ready => "ready",
        BuildStatus::Error => "error",
    };
    let reason = build.error.clone().map(|message| BuildReason {
        message,
        step: build.error_step.clone().unwrap_or_else(|| "base".into()),
        log_entries: Vec::new(),
    });
    Ok(Json(BuildStatusReply {
        template_id: template,
        build_id: build.id,
        status: status.into(),
        logs: Vec::new(),
        log_entries: entries.into_iter().map(entry).collect(),
        reason,
    }))
}

/// `POST /templates/tags`: point tags at the build `target` serves.
pub async fn assign_tags(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<TagsAssigned>)> {
    let req: AssignTags = parse_body(&body)?;
    let build = state.core.assign_tags(&principal, &req.target, &req.tags).await?;
    Ok((
        StatusCode::CREATED,
        Json(TagsAssigned {
            build_id: build.id,
            tags: req.tags,
        }),
    ))
}

/// `DELETE /templates/tags`.
pub async fn remove_tags(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    body: axum::body::Bytes,
) -> Result<StatusCode> {
    let req: RemoveTags = parse_body(&body)?;
    state.core.remove_tags(&principal, &req.name, &req.tags).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /templates/{id}/tags`.
pub async fn get_tags(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    Path(template): Path<String>,
) -> Result<Json<Vec<TagInfo>>> {
    let tags = state.core.template_tags(&principal, &template).await?;
    Ok(Json(
        tags.into_iter()
            .map(|(tag, build_id, at)| TagInfo {
                tag,
                build_id,
                created_at: rfc3339(at),
            })
            .collect(),
    ))
}
