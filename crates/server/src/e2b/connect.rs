//! Connect RPC with the JSON codec, as the E2B SDK speaks it: unary calls are plain JSON;
//! server streams are 5-byte envelopes (`flags: u8`, `len: u32 BE`) closed by an end-stream
//! envelope (flags 0x02) that carries `{}` or `{"error": {...}}`. Nothing is ever compressed.

use crate::core::CoreError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use serde_json::{json, Value};

pub const END_STREAM: u8 = 0x02;

#[derive(Debug, Clone)]
pub struct RpcError {
    /// Connect code name (`not_found`, `invalid_argument`, ...).
    pub code: &'static str,
    pub message: String,
}

impl RpcError {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    pub fn invalid(m: impl Into<String>) -> Self {
        Self::new("invalid_argument", m)
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new("not_found", m)
    }
    fn http_status(&self) -> StatusCode {
        match self.code {
            "invalid_argument" | "failed_precondition" => StatusCode::BAD_REQUEST,
            "unauthenticated" => StatusCode::UNAUTHORIZED,
            "permission_denied" => StatusCode::FORBIDDEN,
            "not_found" => StatusCode::NOT_FOUND,
            "already_exists" => StatusCode::CONFLICT,
            "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
            "unimplemented" => StatusCode::NOT_IMPLEMENTED,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
    pub fn json(&self) -> Value {
        json!({ "code": self.code, "message": self.message })
    }
}

/// The one mapping of core errors onto Connect codes (the SDK turns each into its exception).
impl From<CoreError> for RpcError {
    fn from(e: CoreError) -> Self {
        let c = e.code();
        let code = match c.status {
            400 | 422 => "invalid_argument",
            401 => "unauthenticated",
            403 => "permission_denied",
            404 => "not_found",
            409 if c.code == "already_exists" => "already_exists",
            409 => "failed_precondition",
            429 => "resource_exhausted",
            502 | 503 => "unavailable",
            _ => "internal",
        };
        RpcError::new(code, e.to_string())
    }
}

impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        (self.http_status(), axum::Json(self.json())).into_response()
    }
}

pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(flags);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

pub fn message(v: &Value) -> Bytes {
    envelope(0, &serde_json::to_vec(v).expect("serializable"))
}

pub fn end_of_stream(error: Option<&RpcError>) -> Bytes {
    let body = match error {
        None => json!({}),
        Some(e) => json!({ "error": e.json() }),
    };
    envelope(END_STREAM, &serde_json::to_vec(&body).expect("serializable"))
}

/// The request message of a server-streaming call: the first envelope's JSON.
pub fn stream_request(body: &[u8]) -> Result<Value, RpcError> {
    if body.len() < 5 {
        return Err(RpcError::invalid("stream request needs one enveloped message"));
    }
    let flags = body[0];
    if flags & 0x01 != 0 {
        return Err(RpcError::new("unimplemented", "compressed messages are not supported"));
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    let payload = body
        .get(5..5 + len)
        .ok_or_else(|| RpcError::invalid("truncated envelope"))?;
    serde_json::from_slice(payload).map_err(|e| RpcError::invalid(format!("bad JSON message: {e}")))
}

pub fn unary_request(body: &[u8]) -> Result<Value, RpcError> {
    if body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(body).map_err(|e| RpcError::invalid(format!("bad JSON message: {e}")))
}

/// A field by its JSON (camelCase) or proto (snake_case) name.
pub fn field<'a>(v: &'a Value, camel: &str, snake: &str) -> Option<&'a Value> {
    v.get(camel).or_else(|| v.get(snake)).filter(|x| !x.is_null())
}

/// int64/uint32 fields may arrive as numbers or strings.
pub fn as_u64(v: Option<&Value>) -> Option<u64> {
    match v? {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// Bytes fields are base64, standard or URL-safe.
pub fn as_bytes(v: Option<&Value>) -> Result<Vec<u8>, RpcError> {
    use base64::Engine as _;
    let Some(s) = v.and_then(Value::as_str) else {
        return Ok(Vec::new());
    };
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .or_else(|_| base64::engine::general_purpose::URL_SAFE.decode(s))
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(s.trim_end_matches('=')))
        .map_err(|e| RpcError::invalid(format!("bad base64: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_and_requests() {
        let e = envelope(0, b"{}");
        assert_eq!(&e[..], &[0, 0, 0, 0, 2, b'{', b'}']);
        let req = stream_request(&envelope(0, br#"{"process":{"cmd":"ls"}}"#)).unwrap();
        assert_eq!(req["process"]["cmd"], "ls");
        assert!(stream_request(&[0, 0, 0, 0, 9, b'{']).is_err());
        assert!(stream_request(&envelope(1, b"{}")).is_err());
        let end = end_of_stream(Some(&RpcError::not_found("x")));
        assert_eq!(end[0], END_STREAM);
        assert!(String::from_utf8_lossy(&end[5..]).contains("not_found"));
    }

    #[test]
    fn fields_accept_both_spellings_and_int64_strings() {
        let v = json!({"watcherId": "w1", "exit_code": "7"});
        assert_eq!(field(&v, "watcherId", "watcher_id").unwrap(), "w1");
        assert_eq!(as_u64(field(&v, "exitCode", "exit_code")), Some(7));
        assert_eq!(as_bytes(Some(&json!("aGVsbG8K"))).unwrap(), b"hello\n");
    }
}
