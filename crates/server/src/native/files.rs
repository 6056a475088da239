//! `/v1/sandboxes/{id}/files`: read, write (streamed), delete, list, onto the core's files.

use super::*;

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

pub(super) fn file_info(s: airlock_proto::FileStat) -> FileInfo {
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

pub(super) async fn files_of(core: &Core, tenant: &Tenant, id: &str) -> ApiResult<crate::core::files::Files> {
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
) -> Response {
    let files = match files_of(&core, &tenant, &id).await {
        Ok(files) => files,
        Err(e) => return crate::listen::drained(body, e.into_response()).await,
    };
    let data = body.into_data_stream().map(|r| r.map_err(std::io::Error::other));
    match files.write(&q.path, "user", data).await {
        Ok(stat) => Json(file_info(stat)).into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
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
