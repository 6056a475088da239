//! envd on the airlock listener, one file per service: the gate and what every route shares
//! (here), `process` (process.Process), `filesystem` (filesystem.Filesystem), `files` (`/files`),
//! and `messages` (each RPC's request and response message). Everything is a translation onto
//! the core's sessions and files; it may use the core, the door's `connect` framing and its
//! `Watchers`, nothing below the core.

mod files;
mod filesystem;
pub mod messages;
mod process;

pub use files::{files_get, files_post, FilesQuery};
pub use filesystem::filesystem_rpc;
pub use process::process_rpc;

use super::connect::{self, Code, RpcError};
use super::E2bState;
use crate::core::{Accept, CoreError, Credentials, Principal, Via};
use crate::records::SandboxRecord;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use std::time::Duration;

/// 502 the way E2B's proxy answers for a sandbox that is gone (the SDK maps it to "not running").
fn sandbox_gone(id: &str) -> Response {
    #[derive(serde::Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Gone<'a> {
        sandbox_id: &'a str,
        message: &'static str,
        code: u16,
    }
    let body = Gone {
        sandbox_id: id,
        message: "The sandbox was not found",
        code: 502,
    };
    (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
}
fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// The running sandbox a request is for (`E2b-Sandbox-Id`, else the one whose `X-Access-Token`
/// it carries) and the principal that may use it. envd accepts only the sandbox's access token;
/// `no_token` lets signed `/files` URLs through to their own check.
async fn resolve(state: &E2bState, h: &HeaderMap, no_token: bool) -> Result<SandboxRecord, Response> {
    let id = header(h, "e2b-sandbox-id");
    // Never the traffic token: it opens the sandbox's ports, not its processes and files.
    let accept = Accept {
        owner_key: false,
        traffic_token: false,
        no_token,
    };
    let sandbox = match state
        .core
        .sandbox_principal(&Credentials::from_headers(h), id, accept)
        .await
    {
        // A signed URL's sandbox is settled after its signature is checked (`files_target`).
        Ok(Principal::Sandbox {
            sandbox,
            via: Via::Unverified,
        }) if state.core.settling(&sandbox.id) => return Ok(sandbox),
        Ok(Principal::Sandbox { sandbox, .. }) => sandbox,
        // A caller that proved nothing about the sandbox (no token, a wrong one, a sandbox never
        // opened to tokens) learns nothing either: exactly the answer for a missing one.
        Ok(Principal::Key { .. } | Principal::Federated { .. })
        | Err(CoreError::NotFound { .. } | CoreError::Unauthenticated(_)) => {
            return Err(sandbox_gone(id.unwrap_or("")))
        }
        Err(e) => return Err(RpcError::from(e).into_response()),
    };
    if !sandbox.answers_requests() {
        return Err(sandbox_gone(&sandbox.id));
    }
    Ok(sandbox)
}

/// The sandbox an envd request is for, resolved by [`require_sandbox`] before any body is read.
#[derive(Clone)]
pub struct EnvdSandbox(pub SandboxRecord);

/// Every envd route's gate, run before the handler and so before the body is read: the request
/// must resolve to a running sandbox (see [`resolve`]), or it is answered as for a missing one.
/// Only signed `/files` URLs need no token here (the signature is checked next, by the handler,
/// against the sandbox found here, and a bad one gets the same missing-sandbox answer).
/// `/health` needs the token like every other route (the SDK always sends it): answering it
/// without one would tell anyone which sandbox ids exist.
pub async fn require_sandbox(
    State(state): State<E2bState>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let signed = match req.uri().path() {
        "/files" => Query::<FilesQuery>::try_from_uri(req.uri())
            .ok()
            .map(|q| q.0)
            .filter(|q| files::signed_url(req.headers(), q)),
        _ => None,
    };
    let resolved = match &signed {
        // Nothing names the sandbox (a signed URL used under `E2B_SANDBOX_URL`): the signature
        // does; `files_target` then checks it as for any signed URL.
        Some(q) if header(req.headers(), "e2b-sandbox-id").is_none() => {
            let op = if req.method() == axum::http::Method::POST {
                "write"
            } else {
                "read"
            };
            match state.core.sandbox_by_signed_url(&q.signed(), op).await {
                Ok(sandbox) if sandbox.answers_requests() => Ok(sandbox),
                Ok(sandbox) => Err(sandbox_gone(&sandbox.id)),
                Err(CoreError::NotFound { .. }) => Err(sandbox_gone("")),
                Err(e) => Err(RpcError::from(e).into_response()),
            }
        }
        _ => resolve(&state, req.headers(), signed.is_some()).await,
    };
    match resolved {
        Ok(sandbox) => {
            req.extensions_mut().insert(EnvdSandbox(sandbox));
            next.run(req).await
        }
        Err(r) => r,
    }
}

/// An RPC body axum could not read: past [`crate::MAX_JSON_BODY`] a 413 (`resource_exhausted`),
/// else a 400, in Connect's error shape.
fn body_rejected(e: axum::extract::rejection::BytesRejection) -> Response {
    let status = e.status();
    let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
        Code::ResourceExhausted
    } else {
        Code::InvalidArgument
    };
    (status, axum::Json(RpcError::new(code, e.body_text()))).into_response()
}

/// One RPC's context, shared by the services: each service's file adds its own methods.
struct Call<'a> {
    state: &'a E2bState,
    sandbox: &'a SandboxRecord,
    headers: &'a HeaderMap,
}

/// The start every RPC of a `service` shares: its method known (else `unimplemented`), its body
/// read (else the rejection's answer).
// The error is the handler's finished answer, made at most once per request.
#[allow(clippy::result_large_err)]
fn rpc_method<M>(
    service: &str,
    method: &str,
    from_name: impl Fn(&str) -> Option<M>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<(M, Bytes), Response> {
    let Some(m) = from_name(method) else {
        return Err(RpcError::unimplemented(format!("{service}/{method} is not supported")).into_response());
    };
    Ok((m, body.map_err(body_rejected)?))
}

/// What every RPC needs besides its sandbox: the calling user and its request message.
// The error is the handler's finished answer, made at most once per request.
#[allow(clippy::result_large_err)]
fn rpc_request<T: serde::de::DeserializeOwned>(
    headers: &HeaderMap,
    body: &[u8],
    streaming: bool,
) -> Result<(String, T), Response> {
    let req = if streaming {
        connect::stream_request(body)
    } else {
        connect::unary_request(body)
    };
    let req = req.map_err(IntoResponse::into_response)?;
    Ok((rpc_user(headers), req))
}

/// `Authorization: Basic base64("<user>:")`; the default user is `user`.
fn rpc_user(h: &HeaderMap) -> String {
    header(h, "authorization")
        .and_then(|v| v.strip_prefix("Basic ").or_else(|| v.strip_prefix("basic ")))
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b.trim()).ok())
        .and_then(|raw| String::from_utf8(raw).ok())
        .map(|s| s.split(':').next().unwrap_or("").to_string())
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "user".into())
}

fn home_of(user: &str) -> String {
    if user == "root" {
        "/root".into()
    } else {
        format!("/home/{user}")
    }
}

/// Relative paths resolve against the user's home, as envd does.
fn abs_path(path: &str, user: &str) -> String {
    if path.starts_with('/') {
        path.to_string()
    } else if path.is_empty() || path == "~" {
        home_of(user)
    } else {
        format!("{}/{}", home_of(user), path.trim_start_matches("~/"))
    }
}

fn stream_response(s: impl Stream<Item = Bytes> + Send + 'static) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/connect+json")
        .body(Body::from_stream(s.map(Ok::<_, std::io::Error>)))
        .expect("valid response")
}

/// Keepalive period from `Keepalive-Ping-Interval` (seconds), as envd reads it.
fn keepalive_every(h: &HeaderMap) -> Duration {
    let secs = header(h, "keepalive-ping-interval")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .unwrap_or(50);
    Duration::from_secs(secs.min(3600))
}

/// A stream fed by a task through a small channel (backpressure from the HTTP body).
fn async_stream<F, Fut>(f: F) -> impl Stream<Item = Bytes> + Send + 'static
where
    F: FnOnce(tokio::sync::mpsc::Sender<Bytes>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// `require_sandbox` found the sandbox running.
pub async fn health() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_against_the_users_home() {
        assert_eq!(abs_path("a.txt", "user"), "/home/user/a.txt");
        assert_eq!(abs_path("/etc/x", "root"), "/etc/x");
        assert_eq!(abs_path("", "root"), "/root");
        assert_eq!(abs_path("~/b", "user"), "/home/user/b");
    }
}
