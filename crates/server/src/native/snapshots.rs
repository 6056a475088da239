//! `/v1/snapshots` and a sandbox's `snapshots` and `fork`: tenants' snapshots onto the core's
//! snapshot services.

use super::*;

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
