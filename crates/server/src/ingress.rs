//! Port exposure: `<port>-<sandbox id>.<domain>` reaches `<port>` inside that sandbox over the
//! agent's byte tunnel, as HTTP/1.1 (WebSocket and other upgrades included). Port 49983 is envd
//! itself, served by this server: the host only selects the sandbox. Sandbox ports are never
//! public: a request needs the sandbox's traffic token, its access token or its owner's API
//! key; none of airlock's credentials travels into the sandbox, and no cookie a sandbox sets
//! reaches beyond its own host.

use crate::core::{Accept, Core, CoreError, Credentials, Principal, CREDENTIAL_HEADERS};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

pub const ENVD_PORT: u16 = 49983;

/// `49999-abc123.example.com:443` -> (49999, "abc123").
pub fn parse_sandbox_host(host: &str) -> Option<(u16, String)> {
    let first = host.split('.').next()?;
    if first.len() == host.len() {
        return None; // a bare name is never a sandbox host
    }
    let (port, id) = first.split_once('-')?;
    let port: u16 = port.parse().ok()?;
    crate::core::valid_sandbox_id(id).then(|| (port, id.to_string()))
}

fn error(status: StatusCode, message: String) -> Response {
    (
        status,
        axum::Json(json!({ "code": status.as_u16(), "message": message })),
    )
        .into_response()
}

/// The one answer for a sandbox port that cannot be reached: missing, not running, or not the
/// caller's (sandbox ports need its traffic token, its access token or its owner's API key).
fn not_running(id: &str) -> Response {
    error(StatusCode::BAD_GATEWAY, format!("sandbox {id} is not running"))
}

/// A port request that carries no credential at all: told what it needs, the same whether the
/// sandbox exists or not.
fn credential_needed() -> Response {
    error(
        StatusCode::UNAUTHORIZED,
        "sandbox ports need the sandbox's traffic token (E2B-Traffic-Access-Token), its access token (X-Access-Token) or its owner's API key".into(),
    )
}

/// Route by Host before path routing: sandbox hosts go to envd or to the sandbox's port.
pub async fn host_routing(State(core): State<Core>, mut req: Request, next: Next) -> Response {
    // Owned copies: nothing borrowed from the request may live across an await.
    let (by_header, host) = {
        let header = |name: &str| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let port = header("e2b-sandbox-port").and_then(|p| p.parse::<u16>().ok());
        // HTTP/2 clients (E2B SDKs over TLS) send `:authority` instead of a Host header.
        let host = header("host").or_else(|| req.uri().authority().map(|a| a.to_string()));
        ((header("e2b-sandbox-id"), port), host.unwrap_or_default())
    };
    // E2B's header routing (used when the host is an IP or localhost, as with E2B_SANDBOX_URL):
    // `E2b-Sandbox-Id` + `E2b-Sandbox-Port` pick the sandbox and the port; 49983 is envd here.
    if let (Some(id), Some(port)) = by_header {
        if port != ENVD_PORT {
            return forward(core, id, port, req).await;
        }
    }
    let Some((port, id)) = parse_sandbox_host(&host) else {
        return next.run(req).await;
    };
    if port == ENVD_PORT {
        if let Ok(v) = HeaderValue::from_str(&id) {
            req.headers_mut().insert("e2b-sandbox-id", v);
        }
        return next.run(req).await;
    }
    forward(core, id, port, req).await
}

/// `localhost:49999` for `E2B_DEBUG=true` clients: every sandbox shares the host, so the
/// sandbox is the one whose access token the request carries.
pub async fn code_interpreter_by_token(State(core): State<Core>, req: Request) -> Response {
    let creds = Credentials::from_headers(req.headers());
    let accept = Accept {
        owner_key: false,
        traffic_token: true,
        no_token: false,
    };
    match core.sandbox_principal(&creds, None, accept).await {
        Ok(Principal::Sandbox { sandbox, .. }) if creds.envd_token.is_some() || creds.traffic_token.is_some() => {
            forward(core, sandbox.id, crate::core::CODE_INTERPRETER_PORT, req).await
        }
        _ => error(StatusCode::BAD_GATEWAY, "no sandbox has this X-Access-Token".into()),
    }
}

/// No airlock credential travels into a sandbox: the sandbox-token and API-key headers go
/// whatever opened the request, and `Authorization` goes when it carries an airlock key or
/// token (an app's own `Authorization` passes).
async fn strip_credentials(core: &Core, headers: &mut axum::http::HeaderMap) {
    for name in CREDENTIAL_HEADERS {
        headers.remove(name);
    }
    let mut platform = false;
    for v in headers.get_all(hyper::header::AUTHORIZATION) {
        platform |= match v.to_str() {
            Ok(v) => core.is_platform_credential(v).await,
            Err(_) => false,
        };
    }
    if platform {
        headers.remove(hyper::header::AUTHORIZATION);
    }
}

/// A cookie a sandbox sets stays on its own host: a `Domain` attribute (which would let
/// `<port>-<id>.<domain>` set cookies for the parent domain, and so for every other sandbox
/// and the API) is dropped, leaving a host-only cookie.
fn host_only_cookies(headers: &mut axum::http::HeaderMap) {
    let cookies: Vec<HeaderValue> = headers.get_all(hyper::header::SET_COOKIE).iter().cloned().collect();
    if cookies.is_empty() {
        return;
    }
    headers.remove(hyper::header::SET_COOKIE);
    for c in cookies {
        // A value that is not text can't be inspected: it is dropped, not passed.
        let Ok(text) = c.to_str() else { continue };
        let kept: Vec<&str> = text
            .split(';')
            .filter(|attr| {
                let name = attr.split('=').next().unwrap_or("").trim();
                !name.eq_ignore_ascii_case("domain")
            })
            .collect();
        if let Ok(v) = HeaderValue::from_str(&kept.join(";")) {
            headers.append(hyper::header::SET_COOKIE, v);
        }
    }
}

pub async fn forward(core: Core, id: String, port: u16, mut req: Request) -> Response {
    let creds = Credentials::from_headers(req.headers());
    if !creds.any() {
        return credential_needed();
    }
    let accept = Accept {
        owner_key: true,
        traffic_token: true,
        no_token: false,
    };
    let sandbox = match core.sandbox_principal(&creds, Some(&id), accept).await {
        Ok(Principal::Sandbox { sandbox, .. }) if sandbox.answers_requests() => sandbox,
        // A caller without the sandbox's token or its owner's key gets the answer for a missing
        // sandbox: it learns nothing of what exists.
        Ok(_) | Err(CoreError::NotFound { .. } | CoreError::Unauthenticated(_)) => return not_running(&id),
        Err(e) => {
            let status = StatusCode::from_u16(e.code().status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return error(status, e.to_string());
        }
    };
    strip_credentials(&core, req.headers_mut()).await;
    let agent = match core.agent_for(&sandbox).await {
        Ok(a) => a,
        Err(e) => return error(StatusCode::BAD_GATEWAY, e.to_string()),
    };
    let tunnel = match agent.tunnel(port).await {
        Ok(t) => t,
        Err(e) => return error(StatusCode::BAD_GATEWAY, e.to_string()),
    };
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tunnel)).await {
        Ok(x) => x,
        Err(e) => return error(StatusCode::BAD_GATEWAY, format!("port {port}: {e}")),
    };
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    let client_upgrade = hyper::upgrade::on(&mut req);
    let (parts, body) = req.into_parts();
    let mut out = hyper::Request::from_parts(parts, body);
    // Only the path goes upstream; the Host stays as the client sent it.
    let pq = out
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    // An HTTP/2 client's request leaves as HTTP/1.1: its `:authority` becomes the Host header.
    if !out.headers().contains_key(hyper::header::HOST) {
        if let Some(v) = out
            .uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        {
            out.headers_mut().insert(hyper::header::HOST, v);
        }
    }
    *out.version_mut() = hyper::Version::HTTP_11;
    *out.uri_mut() = pq.parse().unwrap_or_else(|_| "/".parse().expect("valid"));
    let mut resp = match sender.send_request(out).await {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_GATEWAY, format!("port {port}: {e}")),
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let server_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            if let (Ok(client), Ok(server)) = (client_upgrade.await, server_upgrade.await) {
                let mut client = hyper_util::rt::TokioIo::new(client);
                let mut server = hyper_util::rt::TokioIo::new(server);
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            }
        });
    }
    let (mut parts, body) = resp.into_parts();
    host_only_cookies(&mut parts.headers);
    Response::from_parts(parts, Body::new(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_sets_cookies_for_its_own_host_only() {
        let mut h = axum::http::HeaderMap::new();
        for v in [
            "sid=1; Domain=.sbx.example; Path=/; HttpOnly",
            "a=2; domain=sbx.example",
            "b=3; Path=/",
        ] {
            h.append(hyper::header::SET_COOKIE, v.parse().unwrap());
        }
        host_only_cookies(&mut h);
        let got: Vec<&str> = h
            .get_all(hyper::header::SET_COOKIE)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(got, ["sid=1; Path=/; HttpOnly", "a=2", "b=3; Path=/"]);
    }

    #[test]
    fn parses_sandbox_hosts() {
        assert_eq!(
            parse_sandbox_host("8000-0123456789abcdef0123.sbx.example:443"),
            Some((8000, "0123456789abcdef0123".into()))
        );
        assert_eq!(
            parse_sandbox_host("49983-abcdef12.localhost"),
            Some((49983, "abcdef12".into()))
        );
        assert_eq!(parse_sandbox_host("api.example.com"), None);
        assert_eq!(parse_sandbox_host("127.0.0.1:7420"), None);
        assert_eq!(parse_sandbox_host("8000-abcdef12"), None);
        assert_eq!(parse_sandbox_host("99999-abcdef12.x"), None);
        assert_eq!(parse_sandbox_host("8000-ABC.x"), None);
    }
}
