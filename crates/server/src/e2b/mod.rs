//! The E2B door: the E2B control-plane API and envd (Connect RPC, `/files`, `/health`) on the
//! same listener as `/v1`, translated onto the core's services. Wire details:
//! shared/reference/e2b-wire.md. Errors: `E2bError` (control plane and `/files`: `{"code": <int>,
//! "message"}`) and `connect::RpcError` (Connect), each made from a `CoreError` in one place.

pub mod connect;
pub mod control;
pub mod envd;

use crate::core::CoreError;
use airlock_proto::ErrorCode;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// envd version we report; the SDK gates features on it (octet-stream uploads need >= 0.5.7).
pub const ENVD_VERSION: &str = "0.6.13";

/// An error as the SDK parses control-plane and `/files` answers: `{"code": <int>, "message"}`.
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
    pub fn bad_request(m: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, m)
    }
}

/// The one mapping of core errors onto the E2B statuses its SDKs know. A refused option or value
/// is the 400 they expect (never 422); envd's `/files` answers permission errors with 401.
impl From<CoreError> for E2bError {
    fn from(e: CoreError) -> Self {
        let status = match &e {
            CoreError::Guest { source, .. } if source.code() == Some(ErrorCode::PermissionDenied) => 401,
            _ => match e.code().status {
                422 => 400,
                s => s,
            },
        };
        Self::new(
            StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            e.to_string(),
        )
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!("{}", self.message);
        }
        let body = serde_json::json!({ "code": self.status.as_u16(), "message": self.message });
        (self.status, axum::Json(body)).into_response()
    }
}
