//! E2B's volumes: `/volumes` (X-API-KEY) and the content API `/volumecontent/{id}/...` (the
//! volume's own token as `Authorization: Bearer`), onto the core's volume services. E2B's
//! volumes have no size: theirs is `core::volumes::DEFAULT_VOLUME_MIB`.

use super::*;
use crate::core::volumes::{VolumeFiles, DEFAULT_VOLUME_MIB};
use airlock_proto::{FileKind, FileStat};
use futures_util::StreamExt;

/// `POST /volumes`: 201 with the volume's token.
pub async fn create_volume(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<VolumeAndToken>)> {
    let req: NewVolume = parse_body(&body)?;
    let (v, token) = state
        .core
        .create_volume(&principal, &req.name, Some(DEFAULT_VOLUME_MIB))
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(VolumeAndToken {
            volume_id: v.id,
            name: v.name,
            token,
        }),
    ))
}

/// `GET /volumes`: the tenant's volumes.
pub async fn list_volumes(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
) -> Result<Json<Vec<VolumeReply>>> {
    let volumes = state.core.volumes(&principal).await?;
    Ok(Json(
        volumes
            .into_iter()
            .map(|v| VolumeReply {
                volume_id: v.id,
                name: v.name,
            })
            .collect(),
    ))
}

/// `GET /volumes/{id}`: the volume with its token (the SDK's `Volume.connect`).
pub async fn get_volume(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<VolumeAndToken>> {
    let v = state.core.volume(&principal, &id).await?;
    Ok(Json(VolumeAndToken {
        token: state.core.volume_token(&v.id),
        volume_id: v.id,
        name: v.name,
    }))
}

/// `DELETE /volumes/{id}`: 204; 409 while a sandbox mounts it.
pub async fn delete_volume(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode> {
    state.core.delete_volume(&principal, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A create's `volumeMounts` (`[{name, path}]`), as the core's mounts.
pub(super) fn mounts(v: &Option<Value>) -> Result<Vec<crate::core::volumes::MountRequest>> {
    let Some(v) = v.as_ref().filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let wire: Vec<VolumeMountWire> =
        serde_json::from_value(v.clone()).map_err(|e| E2bError::bad_request(format!("volumeMounts: {e}")))?;
    Ok(wire
        .into_iter()
        .map(|m| crate::core::volumes::MountRequest {
            volume: m.name,
            path: m.path,
            read_only: false,
        })
        .collect())
}

/// The volume the path names, if the request's bearer token is its own; a wrong token answers
/// like a missing volume.
async fn volume(state: &E2bState, headers: &HeaderMap, id: &str) -> Result<crate::records::VolumeRecord> {
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| {
            E2bError::new(
                StatusCode::UNAUTHORIZED,
                "the volume's token is required (Authorization: Bearer)",
            )
        })?;
    Ok(state.core.volume_by_token(id, token.trim()).await?)
}

async fn files(state: &E2bState, headers: &HeaderMap, id: &str, write: bool) -> Result<VolumeFiles> {
    let v = volume(state, headers, id).await?;
    Ok(state.core.volume_files(&v, write).await?)
}

fn entry(s: FileStat) -> VolumeEntryStat {
    let t = rfc3339(s.modified_ms as i64);
    VolumeEntryStat {
        name: s.name,
        kind: match s.kind {
            FileKind::File => "file",
            FileKind::Dir => "directory",
            FileKind::Symlink => "symlink",
            FileKind::Other => "unknown",
        },
        path: s.path,
        size: s.size,
        mode: s.mode,
        uid: s.uid,
        gid: s.gid,
        atime: t.clone(),
        mtime: t.clone(),
        ctime: t,
        target: s.symlink_target,
    }
}

/// Who owns what a write or mkdir makes: `uid[:gid]`, else the volume root's owner.
fn owner(q: &VolumePathQuery) -> Result<Option<String>> {
    match (q.uid, q.gid) {
        (None, None) => Ok(None),
        (Some(u), None) => Ok(Some(u.to_string())),
        (Some(u), Some(g)) => Ok(Some(format!("{u}:{g}"))),
        (None, Some(_)) => Err(E2bError::bad_request("gid needs uid")),
    }
}

fn check_mode(mode: Option<u32>) -> Result<Option<u32>> {
    match mode {
        Some(m) if m > 0o7777 => Err(E2bError::bad_request(format!("mode {m:o} is not permission bits"))),
        m => Ok(m),
    }
}

/// `GET /volumecontent/{id}/file?path=`: the file's bytes.
pub async fn read_file(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<VolumePathQuery>,
) -> Result<Response> {
    let data = files(&state, &headers, &id, false).await?.read(&q.path).await?;
    Ok(([("content-type", "application/octet-stream")], data).into_response())
}

/// `PUT /volumecontent/{id}/file?path=[&uid][&gid][&mode]`, the bytes: 201 with its stat.
pub async fn write_file(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<VolumePathQuery>,
    body: axum::body::Body,
) -> Response {
    let made = async {
        let user = owner(&q)?;
        let mode = check_mode(q.mode)?;
        let files = files(&state, &headers, &id, true).await?;
        let data = body.into_data_stream().map(|r| r.map_err(std::io::Error::other));
        let stat = files.write(&q.path, data, user.as_deref(), mode).await?;
        Ok::<_, E2bError>((StatusCode::CREATED, Json(entry(stat))))
    };
    match made.await {
        Ok(r) => r.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /volumecontent/{id}/dir?path=[&depth=]`: its entries.
pub async fn list_dir(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<VolumePathQuery>,
) -> Result<Json<Vec<VolumeEntryStat>>> {
    let files = files(&state, &headers, &id, false).await?;
    let entries = files.list(&q.path, q.depth.unwrap_or(1).clamp(1, 32)).await?;
    Ok(Json(entries.into_iter().map(entry).collect()))
}

/// `POST /volumecontent/{id}/dir?path=[&uid][&gid][&mode][&force]`: 201 with its stat (made
/// with its parents, or there already).
pub async fn make_dir(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<VolumePathQuery>,
) -> Result<(StatusCode, Json<VolumeEntryStat>)> {
    if q.mode.is_some() {
        return Err(E2bError::bad_request(
            "make_dir(mode=...) is not supported by airlock yet; a directory is made 0755",
        ));
    }
    let user = owner(&q)?;
    let files = files(&state, &headers, &id, true).await?;
    let (_, stat) = files.mkdir(&q.path, user.as_deref()).await?;
    Ok((StatusCode::CREATED, Json(entry(stat))))
}

/// `GET /volumecontent/{id}/path?path=`: a file's or directory's stat.
pub async fn stat_path(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<VolumePathQuery>,
) -> Result<Json<VolumeEntryStat>> {
    let stat = files(&state, &headers, &id, false).await?.stat(&q.path).await?;
    Ok(Json(entry(stat)))
}

/// `DELETE /volumecontent/{id}/path?path=`: 204 (a directory with what it holds).
pub async fn remove_path(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<VolumePathQuery>,
) -> Result<StatusCode> {
    files(&state, &headers, &id, true).await?.remove(&q.path).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `PATCH /volumecontent/{id}/path` (`update_metadata`: uid, gid, mode): refused by name until
/// the guest agent can change an existing file's owner and mode.
pub async fn update_path(
    State(state): State<E2bState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(_q): Query<VolumePathQuery>,
) -> Result<Json<VolumeEntryStat>> {
    volume(&state, &headers, &id).await?;
    Err(E2bError::new(
        StatusCode::NOT_IMPLEMENTED,
        "update_metadata (uid, gid, mode of an existing path) is not supported by airlock yet; write the file again with them",
    ))
}
