//! The native `/v1` door: HTTP + SSE handlers that translate onto the core's services. No rule
//! lives here: only wire formats (JSON bodies, query strings, SSE events, base64).

pub mod admin;
pub mod error;
mod events;
mod files;
mod sandboxes;
mod sessions;
mod snapshots;
mod templates;
mod volumes;

pub use events::*;
pub use files::*;
pub use sandboxes::*;
pub use sessions::*;
pub use snapshots::*;
pub use templates::*;
pub use volumes::*;

use crate::core::egress::EgressRequest;
use crate::core::sandboxes::{Change, CreateSandbox, ListSandboxes};
use crate::core::sessions::{parse_signal, signal_name, SessionEvent, SessionEvents, StartSession};
use crate::core::{Core, CoreError, Credentials, Kind};
use crate::model::*;
use crate::records::{rfc3339, SandboxRecord, SessionRecord, Tenant};
use airlock_proto::frame::EventKind;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine as _;
use error::{ApiError, ApiResult};
use futures_util::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::time::Duration;

/// JSON body whose rejections use the API's error format (400 malformed, 422 wrong shape).
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(JsonRejection::JsonDataError(e)) => Err(CoreError::invalid("body", e.body_text()).into()),
            Err(JsonRejection::JsonSyntaxError(e)) => {
                Err(ApiError::Malformed(format!("malformed JSON: {}", e.body_text())))
            }
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError::Malformed(
                "send the body as JSON with `Content-Type: application/json`".into(),
            )),
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError::TooLarge(format!(
                "the body is larger than {} bytes",
                crate::MAX_JSON_BODY
            ))),
            Err(e) => Err(ApiError::Malformed(e.body_text())),
        }
    }
}

/// Query string with the API's error format.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(q) => Ok(ApiQuery(q.0)),
            Err(QueryRejection::FailedToDeserializeQueryString(e)) => {
                Err(CoreError::invalid("query", e.body_text()).into())
            }
            Err(e) => Err(ApiError::Malformed(e.body_text())),
        }
    }
}

/// Every `/v1` route accepts a tenant API key, and only that; checked before a body is read.
pub async fn require_tenant(State(core): State<Core>, mut req: Request, next: axum::middleware::Next) -> Response {
    let creds = Credentials::from_headers(req.headers());
    match core.bearer_principal(creds.bearer.as_deref()).await {
        Ok(principal) => {
            let tenant = principal.tenant().cloned().expect("a bearer names a tenant");
            req.extensions_mut().insert(tenant);
            req.extensions_mut().insert(principal);
            next.run(req).await
        }
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// The error responses every route may give, each with an `ErrorBody`.
pub struct ApiErrors;

impl utoipa::IntoResponses for ApiErrors {
    fn responses() -> std::collections::BTreeMap<String, utoipa::openapi::RefOr<utoipa::openapi::response::Response>> {
        use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
        [
            (
                "400",
                "malformed request, a path the guest rejects, or a refused egress entry",
            ),
            ("401", "missing or wrong API key"),
            ("403", "the guest refused (permissions)"),
            ("404", "no such sandbox, session, operation, template or file"),
            ("409", "the sandbox is not running"),
            ("413", "the body is larger than the route reads"),
            ("422", "a field has an invalid value"),
            ("429", "quota exceeded, rate limited, or too many failed sign-ins"),
            ("500", "internal error"),
            ("502", "the sandbox's agent is unreachable"),
            ("503", "temporarily unavailable"),
        ]
        .into_iter()
        .map(|(code, desc)| {
            let content = ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build();
            (
                code.to_string(),
                RefOr::T(
                    ResponseBuilder::new()
                        .description(desc)
                        .content("application/json", content)
                        .build(),
                ),
            )
        })
        .collect()
    }
}

/// `"30s"`, `"10m"`, `"2h"` as a duration.
fn parse_duration(field: &str, v: &str) -> ApiResult<Duration> {
    humantime::parse_duration(v.trim()).map_err(|_| {
        CoreError::invalid(
            field,
            format!("{v:?} is not a duration; use forms like \"30s\", \"10m\", \"2h\""),
        )
        .into()
    })
}

fn accepted(operation: Operation) -> (StatusCode, Json<OperationAccepted>) {
    let sandbox_id = operation.sandbox_id.clone();
    (StatusCode::ACCEPTED, Json(OperationAccepted { operation, sandbox_id }))
}

/// What a tenant may know of the server: version, accelerator, runtimes, egress configuration.
/// The node's counts and warm pools are every tenant's business together, so the platform
/// account's `GET /v1/admin/system` alone shows them.
#[utoipa::path(get, path = "/v1/system", tag = "system",
    responses((status = 200, body = SystemInfo), ApiErrors), security(("bearer" = [])))]
pub async fn system(State(core): State<Core>) -> Json<SystemInfo> {
    Json(core.system_info(false).await)
}

/// `GET /readyz` (no credentials; for a load balancer's or Kubernetes' readiness probe): 200
/// with the node counts while the store answers, else 503 `unavailable`.
pub async fn readyz(State(core): State<Core>) -> ApiResult<Json<crate::core::Readiness>> {
    Ok(Json(core.readiness().await?))
}

pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    CoreError::not_found(Kind::Route, uri.path()).into()
}

/// A JSON body that may be left out (`{}` then).
fn optional_body<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, CoreError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| CoreError::invalid("body", e.to_string()))
}
