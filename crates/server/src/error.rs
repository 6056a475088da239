//! API errors: one enum, mapped to HTTP status and `{"code","message"}` in one place.

use airlock_runtime::agent::AgentError;
use airlock_runtime::RuntimeError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Error body of every non-2xx response.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct ErrorBody {
    /// snake_case error code, stable across versions.
    pub code: String,
    /// Human-readable explanation, naming the field or the fix.
    pub message: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Validation(String),
    #[error("missing or invalid API key; send `Authorization: Bearer <key>` (see <data-dir>/credentials)")]
    Unauthorized,
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    QuotaExceeded(String),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error("guest agent: {0}")]
    Agent(#[from] AgentError),
    #[error("{0}")]
    Store(crate::store::StoreError),
    #[error("{0}")]
    Internal(String),
}

impl From<crate::store::StoreError> for ApiError {
    fn from(e: crate::store::StoreError) -> Self {
        match e {
            crate::store::StoreError::QuotaExceeded { .. } => {
                ApiError::QuotaExceeded(format!("{e} (--max-sandboxes); delete one first"))
            }
            e => ApiError::Store(e),
        }
    }
}

impl ApiError {
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            ApiError::Validation(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_argument"),
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            ApiError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ApiError::QuotaExceeded(_) => (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded"),
            ApiError::Runtime(e) => match e {
                RuntimeError::UnknownTemplate(_) => (StatusCode::NOT_FOUND, "template_not_found"),
                RuntimeError::UnknownSandbox(_) => (StatusCode::NOT_FOUND, "sandbox_not_found"),
                RuntimeError::InvalidResources(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_resources"),
                RuntimeError::NotRunning(_) => (StatusCode::CONFLICT, "sandbox_not_running"),
                RuntimeError::BootFailed { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "boot_failed"),
                RuntimeError::Agent(a) => agent_status(a),
                _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            },
            ApiError::Agent(a) => agent_status(a),
            ApiError::Store(_) | ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            code: self.status_and_code().1.into(),
            message: self.to_string(),
        }
    }
}

fn agent_status(a: &AgentError) -> (StatusCode, &'static str) {
    use airlock_proto::ErrorCode as C;
    match a.code() {
        Some(C::NotFound) => (StatusCode::NOT_FOUND, "not_found"),
        Some(C::AlreadyExists) => (StatusCode::CONFLICT, "already_exists"),
        Some(C::InvalidArgument) => (StatusCode::BAD_REQUEST, "invalid_argument"),
        Some(C::NotADirectory) => (StatusCode::BAD_REQUEST, "not_a_directory"),
        Some(C::IsADirectory) => (StatusCode::BAD_REQUEST, "is_a_directory"),
        Some(C::PermissionDenied) => (StatusCode::FORBIDDEN, "permission_denied"),
        Some(C::Internal) => (StatusCode::INTERNAL_SERVER_ERROR, "guest_error"),
        None => (StatusCode::BAD_GATEWAY, "sandbox_unreachable"),
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, _) = self.status_and_code();
        if status.is_server_error() {
            tracing::error!("{self}");
        }
        (status, axum::Json(self.body())).into_response()
    }
}

pub type ApiResult<T> = Result<T, ApiError>;
