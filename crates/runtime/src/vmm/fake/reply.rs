//! Errors and bodies of the fake agent's answers, and the guest's path rule.

use crate::error::Result;
use airlock_proto::{ErrorBody, ErrorCode};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};
use hyper::body::Incoming;
use std::path::{Component, Path, PathBuf};

pub(super) type Body = UnsyncBoxBody<Bytes, std::io::Error>;

pub(super) struct ApiErr(pub(super) ErrorCode, pub(super) String);

impl ApiErr {
    pub(super) fn invalid(m: impl Into<String>) -> Self {
        Self(ErrorCode::InvalidArgument, m.into())
    }
    pub(super) fn not_found(m: impl Into<String>) -> Self {
        Self(ErrorCode::NotFound, m.into())
    }
    pub(super) fn response(self) -> Response<Body> {
        let status = StatusCode::from_u16(self.0.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        json(
            status,
            &ErrorBody {
                code: self.0,
                message: self.1,
            },
        )
    }
}

pub(super) fn full(status: StatusCode, body: Bytes, content_type: &str) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .body(Full::new(body).map_err(|never| match never {}).boxed_unsync())
        .expect("valid response")
}

pub(super) fn json<T: serde::Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    let body = Bytes::from(serde_json::to_vec(value).expect("serializable"));
    full(status, body, "application/json")
}

pub(super) fn ok_empty() -> Response<Body> {
    json(StatusCode::OK, &serde_json::json!({}))
}

pub(super) async fn body_bytes(req: Request<Incoming>) -> Result<Bytes, ApiErr> {
    Ok(req
        .into_body()
        .collect()
        .await
        .map_err(|e| ApiErr::invalid(format!("body: {e}")))?
        .to_bytes())
}

pub(super) async fn read_json<T: serde::de::DeserializeOwned>(req: Request<Incoming>) -> Result<T, ApiErr> {
    serde_json::from_slice(&body_bytes(req).await?).map_err(|e| ApiErr::invalid(format!("bad JSON body: {e}")))
}

/// The agent's rule: absolute, no `..`, no NUL; normalized (`/a/./b/` is `/a/b`).
pub(super) fn clean_path(path: &str) -> Result<PathBuf, ApiErr> {
    let p = Path::new(path);
    if path.is_empty() {
        return Err(ApiErr::invalid("path is empty"));
    }
    if !p.is_absolute() {
        return Err(ApiErr::invalid(format!("path {path:?} must be absolute")));
    }
    if p.components().any(|c| c == Component::ParentDir) || path.contains('\0') {
        return Err(ApiErr::invalid(format!("path {path:?} must not contain '..' or NUL")));
    }
    Ok(p.components().collect())
}
