//! The E2B door: the E2B control-plane API and envd (Connect RPC, `/files`, `/health`) on the
//! same listener as `/v1`, translated onto the same store, engine, runtime and guest agent.
//! Wire details: shared/reference/e2b-wire.md.

pub mod connect;
pub mod control;
pub mod envd;

use crate::error::ApiError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// envd version we report; the SDK gates features on it (octet-stream uploads need >= 0.5.7).
pub const ENVD_VERSION: &str = "0.6.13";
/// Template names the SDK uses by default, mapped onto airlock templates.
pub fn template_alias(name: &str) -> &str {
    match name {
        "base" => "seed",
        other => other,
    }
}

/// Control-plane error as the SDK parses it: `{"code": <int>, "message": <str>}`.
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
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, m)
    }
}

impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> Self {
        let (status, _) = e.status_and_code();
        // The SDK only knows standard codes; 422 is reported as the 400 it expects.
        let status = if status == StatusCode::UNPROCESSABLE_ENTITY {
            StatusCode::BAD_REQUEST
        } else {
            status
        };
        Self::new(status, e.to_string())
    }
}

impl From<crate::store::StoreError> for E2bError {
    fn from(e: crate::store::StoreError) -> Self {
        ApiError::from(e).into()
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "code": self.status.as_u16(), "message": self.message });
        (self.status, axum::Json(body)).into_response()
    }
}
