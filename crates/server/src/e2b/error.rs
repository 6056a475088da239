//! `E2bError`: an error as E2B's SDKs parse control-plane and `/files` answers,
//! `{"code": <int>, "message"}` with that status, made from a `CoreError` in one place.

use crate::core::{CoreError, NodeError};
use airlock_proto::ErrorCode;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
    /// `Retry-After`, in seconds, for a rate-limited request.
    pub retry_after: Option<u64>,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after: None,
        }
    }
    pub fn bad_request(m: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, m)
    }
}

/// The one mapping of core errors onto the statuses E2B's SDKs know. Every variant is named: a
/// new one does not compile until it is placed here. A refused option or value is the 400 they
/// expect (never 422); envd's `/files` answers a permission error with 401.
impl From<CoreError> for E2bError {
    fn from(e: CoreError) -> Self {
        use StatusCode as S;
        let status = match &e {
            CoreError::NotFound { .. } => S::NOT_FOUND,
            CoreError::InvalidField { .. }
            | CoreError::InvalidResources(..)
            | CoreError::Unsupported { .. }
            | CoreError::Egress(..)
            | CoreError::EgressNotAllowed { .. } => S::BAD_REQUEST,
            CoreError::InvalidState { .. } | CoreError::Conflict(..) => S::CONFLICT,
            CoreError::QuotaExceeded { .. }
            | CoreError::RateLimited { .. }
            | CoreError::SignInThrottled { .. }
            | CoreError::SessionLimit { .. }
            | CoreError::WatcherLimit { .. }
            | CoreError::TooManyUploads { .. } => S::TOO_MANY_REQUESTS,
            // The node is full for everyone: retry later or elsewhere.
            CoreError::NodeBudgetExceeded { .. } | CoreError::NoNodeFits(..) | CoreError::Unavailable(..) => {
                S::SERVICE_UNAVAILABLE
            }
            CoreError::Unauthenticated(..) => S::UNAUTHORIZED,
            CoreError::Forbidden(..) => S::FORBIDDEN,
            CoreError::Internal(..) | CoreError::Store(..) => S::INTERNAL_SERVER_ERROR,
            CoreError::Unreachable { .. } => S::BAD_GATEWAY,
            CoreError::Guest { source, .. } => match source.code() {
                Some(ErrorCode::NotFound) => S::NOT_FOUND,
                Some(ErrorCode::AlreadyExists) => S::CONFLICT,
                Some(ErrorCode::InvalidArgument | ErrorCode::NotADirectory | ErrorCode::IsADirectory) => S::BAD_REQUEST,
                Some(ErrorCode::PermissionDenied) => S::UNAUTHORIZED,
                Some(ErrorCode::Internal) | None => S::INTERNAL_SERVER_ERROR,
            },
            CoreError::Node(node) => match node {
                NodeError::UnknownTemplate(..) | NodeError::UnknownSandbox(..) | NodeError::UnknownImage(..) => {
                    S::NOT_FOUND
                }
                NodeError::InvalidSandboxId(..)
                | NodeError::InvalidResources(..)
                | NodeError::BadImage(..)
                | NodeError::InvalidVolume(..) => S::BAD_REQUEST,
                NodeError::UnknownVolume(..) => S::NOT_FOUND,
                NodeError::VolumeBusy(..) => S::CONFLICT,
                NodeError::SandboxIdTaken(..)
                | NodeError::NotRunning(..)
                | NodeError::StaleRun(..)
                | NodeError::Fenced(..) => S::CONFLICT,
                NodeError::Exhausted(..)
                | NodeError::Unreachable(..)
                | NodeError::Refused(..)
                | NodeError::Unsupported(..) => S::SERVICE_UNAVAILABLE,
                NodeError::BootFailed(..) | NodeError::Network(..) | NodeError::Failed(..) => S::INTERNAL_SERVER_ERROR,
            },
        };
        Self {
            retry_after: e.retry_after(),
            ..Self::new(status, e.to_string())
        }
    }
}

/// The body E2B's SDKs read.
#[derive(Serialize)]
struct Body<'a> {
    code: u16,
    message: &'a str,
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!("{}", self.message);
        }
        let body = Body {
            code: self.status.as_u16(),
            message: &self.message,
        };
        let mut r = (self.status, axum::Json(body)).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}
