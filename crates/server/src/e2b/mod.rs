//! The E2B door: the E2B control-plane API and envd (Connect RPC, `/files`, `/health`) on the
//! same listener as `/v1`, translated onto the core's services. Wire details:
//! shared/reference/e2b-wire.md. Errors: `E2bError` (control plane and `/files`: `{"code": <int>,
//! "message"}`) and `connect::RpcError` (Connect), each made from a `CoreError` in one place.

pub mod connect;
pub mod control;
pub mod envd;

use crate::core::{Core, CoreError};
use airlock_proto::ErrorCode;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// envd version we report; the SDK gates features on it (octet-stream uploads need >= 0.5.7).
pub const ENVD_VERSION: &str = "0.6.13";

/// What the E2B door's handlers share.
#[derive(Clone)]
pub struct E2bState {
    pub core: Core,
    /// The polling file watchers of envd's `CreateWatcher`.
    pub watchers: Arc<Watchers>,
    /// The E2B domain (`api.<domain>`, `<port>-<id>.<domain>`) returned to SDKs, if configured.
    pub domain: Option<Arc<str>>,
}

/// Polling watchers (`CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher`).
#[derive(Default)]
pub struct Watchers {
    pub(crate) map: Mutex<HashMap<String, Watcher>>,
}

pub(crate) struct Watcher {
    pub(crate) sandbox_id: String,
    pub(crate) events: Arc<Mutex<Vec<serde_json::Value>>>,
    pub(crate) task: tokio::task::JoinHandle<()>,
}

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
