//! The native door's errors: `{"code","message"}` with an HTTP status, mapped from `CoreError`
//! in exactly one place (`ApiError::status_and_body`).

use crate::core::CoreError;
use crate::model::ErrorBody;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Core(#[from] CoreError),
    /// The request could not be read at all (malformed JSON, wrong content type, a bad header).
    #[error("{0}")]
    Malformed(String),
    /// The body is larger than the route reads.
    #[error("{0}")]
    TooLarge(String),
}

impl ApiError {
    pub fn status_and_body(&self) -> (StatusCode, ErrorBody) {
        let (status, code) = match self {
            ApiError::Core(e) => {
                let c = e.code();
                (
                    StatusCode::from_u16(c.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                    c.code,
                )
            }
            ApiError::Malformed(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            ApiError::TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
        };
        (
            status,
            ErrorBody {
                code: code.into(),
                message: self.to_string(),
            },
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, body) = self.status_and_body();
        if status.is_server_error() {
            tracing::error!("{}", body.message);
        }
        let mut r = (status, axum::Json(body)).into_response();
        if let ApiError::Core(e) = &self {
            if let Some(s) = e.retry_after() {
                r.headers_mut().insert(axum::http::header::RETRY_AFTER, s.into());
            }
        }
        r
    }
}

pub type ApiResult<T> = Result<T, ApiError>;
