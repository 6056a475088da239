//! `/v1/volumes`: a tenant's volumes and the files in them, onto the core's volume services.

use super::files::{file_info, ListFilesQuery, PathQuery};
use super::*;
use crate::core::volumes::VolumeInfo;
use crate::core::Principal;

fn volume_view(info: VolumeInfo, token: Option<String>) -> Volume {
    let v = info.record;
    Volume {
        id: v.id,
        name: v.name,
        size_mib: v.size_mib,
        created_at: rfc3339(v.created_at_ms),
        node: v.node,
        mounted_by: info
            .mounted_by
            .into_iter()
            .map(|(sandbox_id, read_only)| VolumeHolder { sandbox_id, read_only })
            .collect(),
        used_bytes: info.used_bytes,
        token,
    }
}

/// A new volume; its `token` (for E2B's volume content API) is in this answer only.
#[utoipa::path(post, path = "/v1/volumes", tag = "volumes", request_body = CreateVolumeRequest,
    responses((status = 201, body = Volume), ApiErrors),
    security(("bearer" = [])))]
pub async fn create_volume(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    ApiJson(req): ApiJson<CreateVolumeRequest>,
) -> ApiResult<(StatusCode, Json<Volume>)> {
    let (v, token) = core.create_volume(&principal, &req.name, req.size_mib).await?;
    let info = core.volume_info(v).await?;
    Ok((StatusCode::CREATED, Json(volume_view(info, Some(token)))))
}

/// The tenant's volumes, oldest first.
#[utoipa::path(get, path = "/v1/volumes", tag = "volumes",
    responses((status = 200, body = VolumeList), ApiErrors),
    security(("bearer" = [])))]
pub async fn list_volumes(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
) -> ApiResult<Json<VolumeList>> {
    let mut volumes = Vec::new();
    for v in core.volumes(&principal).await? {
        volumes.push(volume_view(core.volume_info(v).await?, None));
    }
    Ok(Json(VolumeList { volumes }))
}

#[utoipa::path(get, path = "/v1/volumes/{id}", tag = "volumes", params(("id" = String, Path, description = "id or name")),
    responses((status = 200, body = Volume), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_volume(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<Volume>> {
    let v = core.volume(&principal, &id).await?;
    Ok(Json(volume_view(core.volume_info(v).await?, None)))
}

/// Grow a volume (its filesystem grows when a sandbox next mounts it read-write).
#[utoipa::path(patch, path = "/v1/volumes/{id}", tag = "volumes", params(("id" = String, Path)),
    request_body = ResizeVolumeRequest,
    responses((status = 200, body = Volume), ApiErrors),
    security(("bearer" = [])))]
pub async fn resize_volume(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ResizeVolumeRequest>,
) -> ApiResult<Json<Volume>> {
    let v = core.resize_volume(&principal, &id, req.size_mib).await?;
    Ok(Json(volume_view(core.volume_info(v).await?, None)))
}

/// Delete a volume and its data; 409 naming the sandboxes that mount it.
#[utoipa::path(delete, path = "/v1/volumes/{id}", tag = "volumes", params(("id" = String, Path)),
    responses((status = 204), ApiErrors),
    security(("bearer" = [])))]
pub async fn delete_volume(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    core.delete_volume(&principal, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn files_of(
    core: &Core,
    principal: &Principal,
    id: &str,
    write: bool,
) -> ApiResult<crate::core::volumes::VolumeFiles> {
    let v = core.volume(principal, id).await?;
    Ok(core.volume_files(&v, write).await?)
}

/// A file in the volume (paths are the volume's own: `/a/b`).
#[utoipa::path(get, path = "/v1/volumes/{id}/files", tag = "volumes", params(("id" = String, Path), PathQuery),
    responses((status = 200, description = "file content", content_type = "application/octet-stream", body = Vec<u8>), ApiErrors),
    security(("bearer" = [])))]
pub async fn read_volume_file(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<Response> {
    let data = files_of(&core, &principal, &id, false).await?.read(&q.path).await?;
    Ok(([("content-type", "application/octet-stream")], data).into_response())
}

/// Write a file (parent directories made), owned like the volume's root.
#[utoipa::path(put, path = "/v1/volumes/{id}/files", tag = "volumes", params(("id" = String, Path), PathQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = FileInfo), ApiErrors),
    security(("bearer" = [])))]
pub async fn write_volume_file(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
    body: axum::body::Body,
) -> Response {
    let files = match files_of(&core, &principal, &id, true).await {
        Ok(files) => files,
        Err(e) => return crate::listen::drained(body, e.into_response()).await,
    };
    let data = body.into_data_stream().map(|r| r.map_err(std::io::Error::other));
    match files.write(&q.path, data, None, None).await {
        Ok(stat) => Json(file_info(stat)).into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// Remove a file, or a directory with what it holds.
#[utoipa::path(delete, path = "/v1/volumes/{id}/files", tag = "volumes", params(("id" = String, Path), PathQuery),
    responses((status = 204), ApiErrors),
    security(("bearer" = [])))]
pub async fn delete_volume_file(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<StatusCode> {
    files_of(&core, &principal, &id, true).await?.remove(&q.path).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/volumes/{id}/files/list", tag = "volumes", params(("id" = String, Path), ListFilesQuery),
    responses((status = 200, body = FileList), ApiErrors),
    security(("bearer" = [])))]
pub async fn list_volume_files(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<ListFilesQuery>,
) -> ApiResult<Json<FileList>> {
    let files = files_of(&core, &principal, &id, false).await?;
    let entries = files.list(&q.path, q.depth.unwrap_or(1).min(32)).await?;
    Ok(Json(FileList {
        entries: entries.into_iter().map(file_info).collect(),
    }))
}

#[utoipa::path(get, path = "/v1/volumes/{id}/files/stat", tag = "volumes", params(("id" = String, Path), PathQuery),
    responses((status = 200, body = FileInfo), ApiErrors),
    security(("bearer" = [])))]
pub async fn stat_volume_file(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<Json<FileInfo>> {
    let stat = files_of(&core, &principal, &id, false).await?.stat(&q.path).await?;
    Ok(Json(file_info(stat)))
}

/// Make a directory and its parents; 201 when made, 200 when it was there.
#[utoipa::path(post, path = "/v1/volumes/{id}/files/mkdir", tag = "volumes", params(("id" = String, Path), PathQuery),
    responses((status = 201, body = FileInfo), (status = 200, body = FileInfo), ApiErrors),
    security(("bearer" = [])))]
pub async fn mkdir_volume(
    State(core): State<Core>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<(StatusCode, Json<FileInfo>)> {
    let (made, stat) = files_of(&core, &principal, &id, true)
        .await?
        .mkdir(&q.path, None)
        .await?;
    let status = if made { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(file_info(stat))))
}
