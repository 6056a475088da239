//! envd's plain HTTP `/files`: downloads and uploads (multipart or a raw body, gzip decoded by
//! the route's layer), signed URLs in place of the access token, `X-Metadata-*` headers. A
//! translation onto the core's `Files`; uses the gate in `mod.rs` and the core, nothing else.

use super::{abs_path, header, sandbox_gone, EnvdSandbox};
use crate::core::files::Files;
use crate::core::principal::SignedUrl;
use crate::core::{CoreError, Kind};
use crate::e2b::{E2bError, E2bState};
use crate::listen::drained;
use crate::records::SandboxRecord;
use airlock_proto::FileStat;
use axum::body::Body;
use axum::extract::{FromRequest as _, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Whether a `/files` request proves itself by a signed URL instead of a token.
pub(super) fn signed_url(h: &HeaderMap, q: &FilesQuery) -> bool {
    q.signature.is_some() && header(h, "x-access-token").is_none()
}

/// One written file as the upload answers it: exactly `name`, `type` and `path` (older SDKs take
/// no other key), and `metadata` when the file has some, as envd answers: only an upload that
/// set metadata leaves any.
#[derive(Debug, Serialize)]
struct WriteInfo {
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    path: String,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    metadata: BTreeMap<String, String>,
}

impl WriteInfo {
    fn of(path: &str, stat: &FileStat) -> Self {
        Self {
            name: path.rsplit('/').next().unwrap_or(path).to_string(),
            kind: "file",
            path: path.to_string(),
            metadata: stat.metadata.clone(),
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct FilesQuery {
    pub path: Option<String>,
    pub username: Option<String>,
    pub signature: Option<String>,
    pub signature_expiration: Option<i64>,
}

/// Upload headers that carry the written files' metadata (`X-Metadata-<key>`), lowercase as
/// header names arrive.
const METADATA_HEADER: &str = "x-metadata-";

impl FilesQuery {
    pub(super) fn signed(&self) -> SignedUrl<'_> {
        SignedUrl {
            path: self.path.as_deref().unwrap_or(""),
            user: self.username.as_deref().unwrap_or(""),
            signature: self.signature.as_deref().unwrap_or(""),
            expiration: self.signature_expiration,
        }
    }
}

fn files_error(e: impl Into<E2bError>) -> Response {
    e.into().into_response()
}

/// `/files` accepts the access token, or a valid signed-URL signature instead.
async fn files_target(
    state: &E2bState,
    sandbox: SandboxRecord,
    h: &HeaderMap,
    q: &FilesQuery,
    op: &str,
) -> Result<Files, Response> {
    if signed_url(h, q) {
        let url = q.signed();
        // A signature that does not match proves nothing: the answer for a missing sandbox.
        state.core.check_signed_url(&sandbox, &url, op).map_err(|e| match e {
            CoreError::NotFound {
                kind: Kind::Sandbox, ..
            } => sandbox_gone(&sandbox.id),
            e => files_error(e),
        })?;
    }
    let id = sandbox.id.clone();
    let sandbox = match state.core.current(sandbox).await {
        Ok(row) if row.answers_requests() => row,
        Ok(_) | Err(CoreError::NotFound { .. }) => return Err(sandbox_gone(&id)),
        Err(e) => return Err(files_error(e)),
    };
    state.core.files(&sandbox).await.map_err(|_| sandbox_gone(&sandbox.id))
}

/// `GET /files?path=`: the file's bytes as they stream from the agent.
pub async fn files_get(
    State(state): State<E2bState>,
    axum::Extension(EnvdSandbox(sandbox)): axum::Extension<EnvdSandbox>,
    headers: HeaderMap,
    Query(q): Query<FilesQuery>,
) -> Response {
    let files = match files_target(&state, sandbox, &headers, &q, "read").await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let user = q.username.clone().unwrap_or_else(|| "user".into());
    let Some(path) = q.path.as_deref().map(|p| abs_path(p, &user)) else {
        return files_error(E2bError::bad_request("query parameter `path` is required"));
    };
    match files.read(&path).await {
        Ok(s) => Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/octet-stream")
            .body(Body::from_stream(s))
            .expect("valid response"),
        Err(e) => files_error(e),
    }
}

/// What an upload checks before it reads the body: the target's `Files` and the
/// `X-Metadata-<key>: <value>` headers (newer SDKs' `metadata=`) as the written files' metadata.
async fn upload_target(
    state: &E2bState,
    sandbox: SandboxRecord,
    headers: &HeaderMap,
    q: &FilesQuery,
) -> Result<(Files, BTreeMap<String, String>), Response> {
    let files = files_target(state, sandbox, headers, q, "write").await?;
    // gzip was decoded by the route's layer; anything still encoded is a coding we lack.
    if let Some(coding) = header(headers, "content-encoding").filter(|c| !c.eq_ignore_ascii_case("identity")) {
        return Err(files_error(E2bError::bad_request(format!(
            "Content-Encoding {coding:?} is not supported; send the bytes as they are or gzip them"
        ))));
    }
    let metadata = crate::core::files::check_metadata(headers.iter().filter_map(|(name, value)| {
        let key = name.as_str().strip_prefix(METADATA_HEADER).filter(|k| !k.is_empty())?;
        Some((key.to_string(), String::from_utf8_lossy(value.as_bytes()).into_owned()))
    }))
    .map_err(|e| files_error(E2bError::bad_request(format!("invalid {e}"))))?;
    Ok((files, metadata))
}

/// `POST /files`: each file streams to the agent as it arrives; the written files' `WriteInfo`s.
pub async fn files_post(
    State(state): State<E2bState>,
    axum::Extension(EnvdSandbox(sandbox)): axum::Extension<EnvdSandbox>,
    headers: HeaderMap,
    Query(q): Query<FilesQuery>,
    req: axum::extract::Request,
) -> Response {
    let (files, metadata) = match upload_target(&state, sandbox, &headers, &q).await {
        Ok(x) => x,
        Err(refusal) => return drained(req.into_body(), refusal).await,
    };
    let signed = signed_url(&headers, &q);
    let user = q.username.clone().unwrap_or_else(|| "user".into());
    let content_type = header(&headers, "content-type").unwrap_or("").to_ascii_lowercase();
    let mut written = Vec::new();
    if content_type.starts_with("multipart/form-data") {
        let mut mp = match axum::extract::Multipart::from_request(req, &()).await {
            Ok(m) => m,
            Err(e) => return files_error(E2bError::bad_request(format!("bad multipart body: {e}"))),
        };
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return files_error(E2bError::bad_request(format!("bad multipart body: {e}"))),
            };
            // A signed URL covers one path: one part, written there.
            if signed && !written.is_empty() {
                return files_error(E2bError::bad_request(
                    "a signed upload URL writes one file; send one part",
                ));
            }
            // One file: `?path=`; several: each part's filename is its destination.
            let dest = if signed {
                q.path.clone()
            } else {
                q.path
                    .clone()
                    .filter(|_| written.is_empty())
                    .or_else(|| field.file_name().map(String::from))
            };
            let Some(dest) = dest.map(|d| abs_path(&d, &user)) else {
                return files_error(E2bError::bad_request(
                    "each file part needs a filename or the query needs `path`",
                ));
            };
            // The part streams to the agent as it arrives. It borrows the request, and the write
            // takes a stream of its own: a small channel carries its chunks, read while it runs.
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let data = tokio_stream::wrappers::ReceiverStream::new(rx);
            let (read, wrote) = tokio::join!(
                read_part(field, tx),
                files.write_with_metadata(&dest, &user, &metadata, data)
            );
            match (read, wrote) {
                // The agent saw the stream break and kept the old file.
                (Err((status, why)), _) => {
                    return files_error(E2bError::new(status, format!("upload interrupted: {why}")))
                }
                (Ok(()), Ok(stat)) => written.push(WriteInfo::of(&dest, &stat)),
                (Ok(()), Err(e)) => return files_error(e),
            }
        }
    } else {
        let Some(dest) = q.path.as_deref().map(|p| abs_path(p, &user)) else {
            return drained(
                req.into_body(),
                files_error(E2bError::bad_request("query parameter `path` is required")),
            )
            .await;
        };
        // A body that breaks off (a corrupt gzip stream, a dropped client, past the cap) is the
        // upload's fault: remember why, so the reply is a 400 (413) naming it rather than a 502
        // about the agent. The agent keeps the old file in that case. The cap counts the bytes
        // as written (a gzip body decoded), as for multipart.
        let body_error = Arc::new(std::sync::Mutex::new(None::<(StatusCode, String)>));
        let seen = body_error.clone();
        let body = axum::RequestExt::with_limited_body(req).into_body();
        let data = body.into_data_stream().map(move |r| {
            r.map_err(|e| {
                *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some((body_error_status(&e), e.to_string()));
                std::io::Error::other(e)
            })
        });
        match files.write_with_metadata(&dest, &user, &metadata, data).await {
            Ok(stat) => written.push(WriteInfo::of(&dest, &stat)),
            Err(e) => {
                if let Some((status, why)) = body_error.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    return files_error(E2bError::new(status, format!("could not read the upload body: {why}")));
                }
                return files_error(e);
            }
        }
    }
    if written.is_empty() {
        return files_error(E2bError::bad_request("no file in the upload"));
    }
    (StatusCode::OK, axum::Json(written)).into_response()
}

/// A request body that could not be read is the upload's fault (400), or past the upload cap
/// (413: the limit's error lies deep in the chain of body layers, where axum's own check does
/// not look).
fn body_error_status(e: &(dyn std::error::Error + 'static)) -> StatusCode {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if e.is::<http_body_util::LengthLimitError>() {
            return StatusCode::PAYLOAD_TOO_LARGE;
        }
        cause = e.source();
    }
    StatusCode::BAD_REQUEST
}

/// Send a multipart part's chunks to `tx` until it ends; a broken body (or one past the upload
/// cap: 413) is sent on as an error (so the write fails and the agent keeps the old file) and
/// returned. A write that ended early (refused) stops the reading; its own error says why.
async fn read_part(
    mut part: axum::extract::multipart::Field<'_>,
    tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
) -> Result<(), (StatusCode, String)> {
    loop {
        match part.chunk().await {
            Ok(Some(chunk)) => {
                if tx.send(Ok(chunk)).await.is_err() {
                    return Ok(());
                }
            }
            Ok(None) => return Ok(()),
            Err(e) => {
                let why = e.body_text();
                let _ = tx.send(Err(std::io::Error::other(why.clone()))).await;
                return Err((body_error_status(&e), why));
            }
        }
    }
}
