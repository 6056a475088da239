//! Connect RPC with the JSON codec, as the E2B SDK speaks it: unary calls are plain JSON;
//! server streams are 5-byte envelopes (`flags: u8`, `len: u32 BE`) closed by an end-stream
//! envelope (flags 0x02) that carries `{}` or `{"error": {...}}`. Nothing is ever compressed.
//! `RpcError` is the door's one Connect error: a [`Code`] made from a `CoreError` in one
//! exhaustive match, or from what the door itself refuses (a bad message, a missing method).

use crate::core::{CoreError, NodeError};

use airlock_proto::ErrorCode;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;

pub const END_STREAM: u8 = 0x02;

/// Connect's error codes (the SDK turns each into its exception: `e2b/envd/rpc.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    InvalidArgument,
    Unauthenticated,
    PermissionDenied,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    ResourceExhausted,
    DeadlineExceeded,
    Unimplemented,
    Unavailable,
    Internal,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::InvalidArgument => "invalid_argument",
            Code::Unauthenticated => "unauthenticated",
            Code::PermissionDenied => "permission_denied",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::FailedPrecondition => "failed_precondition",
            Code::ResourceExhausted => "resource_exhausted",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::Unimplemented => "unimplemented",
            Code::Unavailable => "unavailable",
            Code::Internal => "internal",
        }
    }

    /// The HTTP status of a unary error answer (Connect's table).
    fn http_status(self) -> StatusCode {
        match self {
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Connect error as the SDK parses it: `{"code": "<name>", "message": "..."}`.
#[derive(Debug, Clone, Serialize)]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    /// A request the door cannot read or that lacks what the method needs.
    pub fn invalid(m: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, m)
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(Code::NotFound, m)
    }
    pub fn unimplemented(m: impl Into<String>) -> Self {
        Self::new(Code::Unimplemented, m)
    }
}

/// The one mapping of core errors onto Connect codes. Every variant is named: a new one does not
/// compile until it is placed here. The message is the error's own text (the SDK shows it).
impl From<CoreError> for RpcError {
    fn from(e: CoreError) -> Self {
        let code = match &e {
            CoreError::NotFound { .. } => Code::NotFound,
            CoreError::InvalidField { .. }
            | CoreError::InvalidResources(..)
            | CoreError::Unsupported { .. }
            | CoreError::Egress(..)
            | CoreError::EgressNotAllowed { .. } => Code::InvalidArgument,
            CoreError::InvalidState { .. } | CoreError::Conflict(..) => Code::FailedPrecondition,
            CoreError::QuotaExceeded { .. }
            | CoreError::RateLimited { .. }
            | CoreError::SignInThrottled { .. }
            | CoreError::SessionLimit { .. }
            | CoreError::WatcherLimit { .. }
            | CoreError::TooManyUploads { .. } => Code::ResourceExhausted,
            // The node is full or not ready, or the sandbox does not answer: the SDK's "likely
            // due to sandbox timeout".
            CoreError::NodeBudgetExceeded { .. }
            | CoreError::NoNodeFits(..)
            | CoreError::Unreachable { .. }
            | CoreError::Unavailable(..) => Code::Unavailable,
            CoreError::Unauthenticated(..) => Code::Unauthenticated,
            CoreError::Forbidden(..) => Code::PermissionDenied,
            CoreError::Internal(..) | CoreError::Store(..) => Code::Internal,
            CoreError::Guest { source, .. } => match source.code() {
                Some(ErrorCode::NotFound) => Code::NotFound,
                Some(ErrorCode::AlreadyExists) => Code::AlreadyExists,
                Some(ErrorCode::InvalidArgument | ErrorCode::NotADirectory | ErrorCode::IsADirectory) => {
                    Code::InvalidArgument
                }
                Some(ErrorCode::PermissionDenied) => Code::PermissionDenied,
                Some(ErrorCode::Internal) | None => Code::Internal,
            },
            CoreError::Node(node) => match node {
                NodeError::InvalidSandboxId(..) => Code::InvalidArgument,
                NodeError::SandboxIdTaken(..)
                | NodeError::NotRunning(..)
                | NodeError::StaleRun(..)
                | NodeError::Fenced(..) => Code::FailedPrecondition,
                NodeError::Exhausted(..)
                | NodeError::Unreachable(..)
                | NodeError::Refused(..)
                | NodeError::Unsupported(..) => Code::Unavailable,
                NodeError::UnknownTemplate(..) | NodeError::UnknownSandbox(..) | NodeError::UnknownImage(..) => {
                    Code::NotFound
                }
                NodeError::InvalidResources(..) | NodeError::BadImage(..) | NodeError::InvalidVolume(..) => {
                    Code::InvalidArgument
                }
                NodeError::UnknownVolume(..) => Code::NotFound,
                NodeError::VolumeBusy(..) => Code::FailedPrecondition,
                NodeError::BootFailed(..) | NodeError::Network(..) | NodeError::Failed(..) => Code::Internal,
            },
        };
        RpcError::new(code, e.to_string())
    }
}

impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        (self.code.http_status(), axum::Json(self)).into_response()
    }
}

pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(flags);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

/// One message of a server stream.
pub fn message<T: Serialize>(m: &T) -> Bytes {
    envelope(0, &serde_json::to_vec(m).expect("serializable"))
}

/// The end-stream envelope: `{}`, or `{"error": {...}}`.
pub fn end_of_stream(error: Option<&RpcError>) -> Bytes {
    #[derive(Serialize)]
    struct End<'a> {
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<&'a RpcError>,
    }
    envelope(END_STREAM, &serde_json::to_vec(&End { error }).expect("serializable"))
}

fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, RpcError> {
    serde_json::from_slice(payload).map_err(|e| RpcError::invalid(format!("bad JSON message: {e}")))
}

/// The request message of a server-streaming call: the first envelope's JSON.
pub fn stream_request<T: DeserializeOwned>(body: &[u8]) -> Result<T, RpcError> {
    if body.len() < 5 {
        return Err(RpcError::invalid("stream request needs one enveloped message"));
    }
    let flags = body[0];
    if flags & 0x01 != 0 {
        return Err(RpcError::unimplemented("compressed messages are not supported"));
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    let payload = body
        .get(5..5 + len)
        .ok_or_else(|| RpcError::invalid("truncated envelope"))?;
    decode(payload)
}

/// The request message of a unary call; an empty body is the empty message.
pub fn unary_request<T: DeserializeOwned>(body: &[u8]) -> Result<T, RpcError> {
    decode(if body.is_empty() { b"{}" } else { body })
}

/// A unary call's answer: 200 with the response message, or the error.
pub fn unary_response<T: Serialize>(r: Result<T, RpcError>) -> Response {
    match r {
        Ok(m) => (
            StatusCode::OK,
            [("content-type", "application/json")],
            serde_json::to_vec(&m).expect("serializable"),
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    #[test]
    fn envelopes_and_requests() {
        let e = envelope(0, b"{}");
        assert_eq!(&e[..], &[0, 0, 0, 0, 2, b'{', b'}']);
        let req: Value = stream_request(&envelope(0, br#"{"process":{"cmd":"ls"}}"#)).unwrap();
        assert_eq!(req["process"]["cmd"], "ls");
        assert!(stream_request::<Value>(&[0, 0, 0, 0, 9, b'{']).is_err());
        assert_eq!(
            stream_request::<Value>(&envelope(1, b"{}")).unwrap_err().code,
            Code::Unimplemented
        );
        let end = end_of_stream(Some(&RpcError::not_found("x")));
        assert_eq!(end[0], END_STREAM);
        let body: Value = serde_json::from_slice(&end[5..]).unwrap();
        assert_eq!(body, json!({ "error": { "code": "not_found", "message": "x" } }));
        assert_eq!(&end_of_stream(None)[5..], b"{}");
        assert_eq!(unary_request::<Value>(b"").unwrap(), json!({}));
    }

    #[test]
    fn core_errors_map_to_connect_codes() {
        use crate::core::Kind;
        let code = |e: CoreError| RpcError::from(e).code;
        assert_eq!(code(CoreError::not_found(Kind::Process, "pid 7")), Code::NotFound);
        assert_eq!(code(CoreError::invalid("pty", "x")), Code::InvalidArgument);
        assert_eq!(
            code(CoreError::Conflict(crate::error::Conflict::DefaultTenant)),
            Code::FailedPrecondition
        );
        assert_eq!(code(CoreError::Unauthenticated("x".into())), Code::Unauthenticated);
        assert_eq!(code(CoreError::Unavailable("x".into())), Code::Unavailable);
        assert_eq!(
            code(CoreError::Internal(crate::error::InternalError::PasswordHash(
                argon2::password_hash::Error::Password,
            ))),
            Code::Internal
        );
        assert_eq!(
            code(CoreError::SessionLimit {
                sandbox: "s".into(),
                running: 1,
                limit: 1
            }),
            Code::ResourceExhausted
        );
        let e = RpcError::from(CoreError::not_found(Kind::Watcher, "w1"));
        assert_eq!(e.message, "watcher \"w1\" not found");
        assert_eq!(
            serde_json::to_value(&e).unwrap(),
            json!({ "code": "not_found", "message": "watcher \"w1\" not found" })
        );
    }
}
