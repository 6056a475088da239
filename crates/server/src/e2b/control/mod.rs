//! E2B control plane: `/sandboxes`, `/v2/sandboxes`, timeouts, metrics, connect; each a
//! translation onto the core's sandbox services.

mod events;
mod templates;
mod volumes;
mod wire;

use super::{E2bError, E2bState, ENVD_VERSION};
use crate::core::egress::EgressRequest;
use crate::core::sandboxes::{check_timeout, Change, CreateSandbox, Created, ListSandboxes, DEFAULT_TIMEOUT};
use crate::core::snapshots::ListSnapshots;
use crate::core::{CoreError, Credentials, Principal, SandboxTokens};
use crate::model::{Lifecycle, OnTimeout, OperationState, SandboxState};
use crate::records::{rfc3339, SandboxRecord, Tenant};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
pub use events::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Duration;
pub use templates::*;
pub use volumes::*;
pub use wire::*;

type Result<T> = std::result::Result<T, E2bError>;

/// The control plane accepts a tenant API key (`X-API-KEY`), and only that.
pub async fn require_tenant(State(state): State<E2bState>, mut req: Request, next: axum::middleware::Next) -> Response {
    let creds = Credentials::from_headers(req.headers());
    match state.core.e2b_principal(&creds).await {
        Ok(principal) => {
            let tenant = principal.tenant().cloned().expect("a key or token names a tenant");
            req.extensions_mut().insert(tenant);
            req.extensions_mut().insert(principal);
            next.run(req).await
        }
        Err(e) => E2bError::from(e).into_response(),
    }
}

/// E2B's `lifecycle={"on_timeout": "pause", "auto_resume": ..}`, sent as `autoPause` and
/// `autoResume: {"enabled": bool}`: its pause is airlock's suspend.
fn lifecycle(req: &NewSandbox) -> Lifecycle {
    let auto_resume = match &req.auto_resume {
        Some(Value::Bool(b)) => *b,
        Some(v) => v["enabled"].as_bool().unwrap_or(false),
        None => false,
    };
    Lifecycle {
        on_timeout: if req.auto_pause == Some(true) {
            OnTimeout::Suspend
        } else {
            OnTimeout::Delete
        },
        auto_resume,
    }
}

/// Options airlock cannot honour yet fail loudly, naming the option.
fn refuse_unsupported(req: &NewSandbox) -> std::result::Result<(), CoreError> {
    let no = |option: &str, why: &str| Err(CoreError::unsupported(option, why));
    if req.mcp.as_ref().is_some_and(|v| !v.is_null()) {
        return no("mcp", "");
    }
    if req.iam.as_ref().is_some_and(|v| !v.is_null()) {
        return no("iam", "");
    }
    if let Some(n) = &req.network {
        // allowOut/denyOut become the create's egress request (`egress_request`). Note: e2b 2.21.1 sends allowPublicTraffic=true with any `network=` unless told otherwise.
        if n.allow_public_traffic == Some(true) {
            return no(
                "network.allowPublicTraffic=true",
                "airlock sandbox URLs always need the access token; pass allow_public_traffic=False",
            );
        }
        if n.mask_request_host.is_some() {
            return no("network.maskRequestHost", "");
        }
    }
    if let Some(k) = req.other.keys().next() {
        return no(k, "");
    }
    Ok(())
}

/// The create's egress, as the core takes it: `allow_internet_access=False` is sealed (absent or
/// true: the tenant's default policy); `network.allowOut` narrows to its entries and
/// `network.denyOut` adds denies (the core checks that they only narrow); the profiles header
/// passes through (the core decides whether it counts).
fn egress_request(req: &NewSandbox, headers: &HeaderMap) -> EgressRequest {
    let network = req.network.as_ref();
    EgressRequest {
        profiles: headers
            .get(crate::core::egress::PROFILES_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(String::from),
        sealed: req.allow_internet_access == Some(false),
        allow_only: network.and_then(|n| n.allow_out.clone()).unwrap_or_default(),
        deny: network.and_then(|n| n.deny_out.clone()).unwrap_or_default(),
        allow_field: "network.allowOut",
        deny_field: "network.denyOut",
    }
}

/// E2B's team-scoped template names have no airlock equivalent.
fn check_template_id(template_id: &str) -> Result<()> {
    if template_id.contains('/') {
        return Err(E2bError::bad_request(format!(
            "template {template_id:?}: team-scoped names (`team/name`) are not supported; use a flat alias like `base`"
        )));
    }
    Ok(())
}

/// E2B timeouts are whole seconds; anything not positive fails the core's range check.
fn timeout_secs(seconds: Option<i64>) -> Duration {
    match seconds {
        None => DEFAULT_TIMEOUT,
        Some(s) => Duration::from_secs(s.max(0) as u64),
    }
}

fn sandbox_reply(state: &E2bState, row: &SandboxRecord, tokens: SandboxTokens, alias: &str) -> SandboxReply {
    SandboxReply {
        template_id: alias.to_string(),
        sandbox_id: row.id.clone(),
        client_id: CLIENT_ID,
        alias: alias.to_string(),
        envd_version: ENVD_VERSION,
        envd_access_token: tokens.envd,
        traffic_access_token: tokens.traffic,
        domain: state.domain.as_deref().map(String::from),
    }
}

/// The name the SDK created the sandbox with (or the alias of its template), for echoing back.
async fn e2b_alias(state: &E2bState, row: &SandboxRecord) -> Result<String> {
    Ok(state.core.template_name_of(row).await?)
}

async fn sandbox_detail(
    state: &E2bState,
    row: &SandboxRecord,
    tokens: Option<&SandboxTokens>,
) -> Result<SandboxDetail> {
    let alias = e2b_alias(state, row).await?;
    Ok(SandboxDetail {
        template_id: alias.clone(),
        alias,
        sandbox_id: row.id.clone(),
        client_id: CLIENT_ID,
        started_at: rfc3339(row.created_at_ms),
        end_at: rfc3339(row.expires_at_ms),
        cpu_count: row.resources.vcpu,
        memory_mb: row.resources.memory_mib,
        disk_size_mb: row.resources.disk_mib,
        state: if row.state == SandboxState::Running {
            "running"
        } else {
            "paused"
        },
        envd_version: ENVD_VERSION,
        metadata: row.metadata.clone(),
        domain: state.domain.as_deref().map(String::from),
        allow_internet_access: !row.egress.sealed,
        lifecycle: LifecycleReply {
            auto_resume: row.lifecycle.auto_resume,
            on_timeout: match row.lifecycle.on_timeout {
                OnTimeout::Delete => "kill",
                OnTimeout::Suspend => "pause",
            },
        },
        volume_mounts: state
            .core
            .mounts_of(row)
            .await?
            .into_iter()
            .map(|(name, path)| VolumeMountWire { name, path })
            .collect(),
        envd_access_token: tokens.map(|t| t.envd.clone()),
    })
}

/// A body the SDK may leave out: its type's default then.
fn parse_optional_body<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T> {
    if body.is_empty() {
        return Ok(T::default());
    }
    parse_body(body)
}

fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T> {
    serde_json::from_slice(body).map_err(|e| E2bError::bad_request(format!("invalid body: {e}")))
}

/// An operation that ended badly, as the SDK reports it.
fn failed(op: &crate::model::Operation, what: &str) -> E2bError {
    let msg = op
        .error
        .as_ref()
        .map(|e| e.message.clone())
        .unwrap_or_else(|| format!("the sandbox failed to {what}"));
    E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, msg)
}

pub async fn create(
    State(state): State<E2bState>,
    Extension(tenant): Extension<Tenant>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<SandboxReply>)> {
    let req: NewSandbox = parse_body(&body)?;
    refuse_unsupported(&req)?;
    check_template_id(&req.template_id)?;
    let egress = egress_request(&req, &headers);
    let created = state
        .core
        .create_sandbox(
            &principal,
            CreateSandbox {
                lifecycle: lifecycle(&req),
                template: req.template_id.clone(),
                // E2B defaults to 2 vCPU; that would double TCG cost here, so the node's default
                // resources apply.
                timeout: Some(timeout_secs(req.timeout)),
                env: req.env_vars.unwrap_or_default(),
                metadata: req.metadata.unwrap_or_default(),
                idempotency_key: headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .map(String::from),
                egress,
                volumes: volumes::mounts(&req.volume_mounts)?,
                ..Default::default()
            },
        )
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(started(&state, &tenant, created, &req.template_id).await?),
    ))
}

/// A create the E2B API answers once its sandbox runs (the engine does the work, we wait for
/// it): the sandbox as the SDK reads it, with its access token, under the name it was made by.
async fn started(state: &E2bState, tenant: &Tenant, created: Created, alias: &str) -> Result<SandboxReply> {
    let id = created.sandbox_id.clone();
    state.core.record_template_name(&id, alias).await?;
    let token = state.core.issue_access_token(&id).await?;
    let done = state.core.wait_operation(&created.operation).await?;
    if done.state != OperationState::Succeeded {
        return Err(failed(&done, "start"));
    }
    let row = state.core.sandbox(tenant, &id).await?;
    Ok(sandbox_reply(state, &row, token, alias))
}

/// `POST /sandboxes/{id}/fork` (newer SDKs' `fork`): the core's fork; each child is answered
/// once it runs, or with its own error, as E2B does.
pub async fn fork(
    State(state): State<E2bState>,
    Extension(tenant): Extension<Tenant>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<Vec<ForkResult>>)> {
    let b: ForkBody = parse_optional_body(&body)?;
    let timeout = b.timeout.map(|t| timeout_secs(Some(t)));
    let parent = state.core.live_sandbox(&tenant, &id).await?;
    let alias = e2b_alias(&state, &parent).await?;
    let children = state
        .core
        .fork_sandbox(&principal, &id, b.count.unwrap_or(1), timeout)
        .await?;
    let mut out = Vec::new();
    for child in children {
        let result = match child {
            Ok(created) => started(&state, &tenant, created, &alias).await,
            Err(e) => Err(E2bError::from(e)),
        };
        out.push(match result {
            Ok(sandbox) => ForkResult::Sandbox(sandbox),
            Err(e) => ForkResult::Error {
                code: e.status.as_u16(),
                message: e.message,
            },
        });
    }
    Ok((StatusCode::CREATED, Json(out)))
}

/// `POST /sandboxes/{id}/pause`: a suspend, as E2B's pause is (memory and processes saved to
/// disk, the VM ended; `connect` resumes it).
pub async fn pause(
    State(state): State<E2bState>,
    Extension(tenant): Extension<Tenant>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode> {
    let row = state.core.live_sandbox(&tenant, &id).await?;
    if row.state != SandboxState::Running {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    let op = state.core.change_sandbox(&principal, &id, Change::Suspend).await?;
    match op.error {
        None => Ok(StatusCode::NO_CONTENT),
        Some(_) => Err(failed(&op, "pause")),
    }
}

/// `POST /sandboxes/{id}/snapshots` (`create_snapshot`): the core's snapshot, running processes
/// and memory included; `Sandbox.create(<snapshot id>)` starts from it.
pub async fn create_snapshot(
    State(state): State<E2bState>,
    Extension(tenant): Extension<Tenant>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<SnapshotReply>)> {
    let b: SnapshotBody = parse_optional_body(&body)?;
    state.core.live_sandbox(&tenant, &id).await?;
    let made = state.core.create_snapshot(&principal, &id, b.name).await?;
    Ok((StatusCode::CREATED, Json(SnapshotReply::from(&made))))
}

/// `GET /snapshots` (`list_snapshots`): a page of the tenant's snapshots, newest first; the
/// next page's token in `X-Next-Token`, as E2B answers (the SDK's `has_next` reads it).
pub async fn list_snapshots(
    State(state): State<E2bState>,
    Extension(tenant): Extension<Tenant>,
    q: std::result::Result<Query<SnapshotsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response> {
    let Query(q) = q.map_err(|e| E2bError::bad_request(format!("bad snapshots query: {}", e.body_text())))?;
    let page = state
        .core
        .list_snapshots_page(
            &tenant,
            ListSnapshots {
                sandbox_id: q.sandbox_id,
                name: q.name,
                limit: q.limit.unwrap_or(100),
                page_token: q.next_token,
            },
        )
        .await?;
    let items: Vec<SnapshotReply> = page.snapshots.iter().map(|s| SnapshotReply::from(&s.view())).collect();
    let mut resp = Json(items).into_response();
    if let Some(n) = page.next_page_token {
        resp.headers_mut()
            .insert("x-next-token", n.parse().expect("ascii token"));
    }
    Ok(resp)
}

/// `DELETE /templates/{id}`: the tenant's template of that name (every tag and build), else its
/// snapshot (`delete_snapshot`). Platform templates are not deleted through the E2B door.
pub async fn delete_template(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode> {
    if state.core.has_tenant_template(&principal, &id).await? {
        state.core.delete_tenant_template(&principal, &id).await?;
    } else {
        state.core.delete_snapshot(&principal, &id).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /templates/aliases/{alias}` (`Template.exists`): a platform template under that name or
/// alias (public), or one of the tenant's own.
pub async fn template_alias(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    Path(alias): Path<String>,
) -> Result<Json<TemplateAlias>> {
    if state.core.has_tenant_template(&principal, &alias).await? {
        let (name, _) = crate::core::builds::split_name(&alias)?;
        return Ok(Json(TemplateAlias {
            template_id: name,
            public: false,
        }));
    }
    let name = state.core.template_name(&alias)?;
    Ok(Json(TemplateAlias {
        template_id: name,
        public: true,
    }))
}

pub async fn get(
    State(state): State<E2bState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<SandboxDetail>> {
    let row = state.core.live_sandbox(&tenant, &id).await?;
    // Re-issued, not just derived: a sandbox from before tokens were derived gets its new one.
    let token = if state.core.has_access_token(&id).await? {
        Some(state.core.issue_access_token(&id).await?)
    } else {
        None
    };
    Ok(Json(sandbox_detail(&state, &row, token.as_ref()).await?))
}

pub async fn kill(
    State(state): State<E2bState>,
    Extension(tenant): Extension<Tenant>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<StatusCode> {
    state.core.live_sandbox(&tenant, &id).await?;
    let op = state.core.delete_sandbox(&principal, &id).await?;
    let done = state.core.wait_operation(&op).await?;
    match done.error {
        None => Ok(StatusCode::NO_CONTENT),
        Some(_) => Err(failed(&done, "stop")),
    }
}

pub async fn set_timeout(
    State(state): State<E2bState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<StatusCode> {
    let b: TimeoutBody = parse_body(&body)?;
    let row = state.core.live_sandbox(&tenant, &id).await?;
    state.core.set_sandbox_timeout(&row, timeout_secs(b.timeout)).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn connect(
    State(state): State<E2bState>,
    Extension(tenant): Extension<Tenant>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<SandboxReply>)> {
    let b: TimeoutBody = parse_optional_body(&body)?;
    // Checked before anything changes: a bad timeout must not resume the sandbox.
    let timeout = check_timeout("timeout", timeout_secs(b.timeout))?;
    let mut row = state.core.live_sandbox(&tenant, &id).await?;
    // Connecting to a paused sandbox resumes it (201), as E2B does.
    let resumed = matches!(row.state, SandboxState::Paused | SandboxState::Suspended);
    if resumed {
        let op = state.core.change_sandbox(&principal, &id, Change::Resume).await?;
        if op.error.is_some() {
            return Err(failed(&op, "resume"));
        }
        // Resuming restored the lifetime left at pause; the extension below starts from there.
        row = state.core.live_sandbox(&tenant, &id).await?;
    }
    // Connecting extends the life to at least `timeout` from now, as E2B does.
    state.core.extend_sandbox_timeout(&row, timeout).await?;
    let token = state.core.issue_access_token(&id).await?;
    let status = if resumed { StatusCode::CREATED } else { StatusCode::OK };
    let alias = e2b_alias(&state, &row).await?;
    Ok((status, Json(sandbox_reply(&state, &row, token, &alias))))
}

/// An E2B list's time bound (ms since the epoch): RFC 3339 with `Z` or a `±HH:MM` offset, or
/// none (a naive Python `isoformat()`), read as UTC.
fn list_time(field: &str, v: &str) -> Result<i64> {
    let bad = || E2bError::bad_request(format!("{field} {v:?} is not an RFC 3339 time"));
    let (local, offset_s) = match v.len().checked_sub(6).and_then(|i| v.get(i..).map(|tail| (i, tail))) {
        Some((i, tail)) if (tail.starts_with('+') || tail.starts_with('-')) && tail.as_bytes()[3] == b':' => {
            let hours: i64 = tail[1..3].parse().map_err(|_| bad())?;
            let minutes: i64 = tail[4..6].parse().map_err(|_| bad())?;
            let sign = if tail.starts_with('-') { -1 } else { 1 };
            (&v[..i], sign * (hours * 3600 + minutes * 60))
        }
        _ => (v.trim_end_matches('Z'), 0),
    };
    let t = humantime::parse_rfc3339_weak(local).map_err(|_| bad())?;
    let ms = t.duration_since(std::time::UNIX_EPOCH).map_err(|_| bad())?.as_millis() as i64;
    Ok(ms - offset_s * 1000)
}

/// `metadata=k%3Dv%26k2%3Dv2` after the framework's decoding: unescape, split, unescape parts.
pub fn parse_metadata_filter(raw: &str) -> BTreeMap<String, String> {
    let unescape = |s: &str| url_unescape(s);
    let whole = unescape(raw);
    whole
        .split('&')
        .filter(|p| !p.is_empty())
        .filter_map(|pair| pair.split_once('=').map(|(k, v)| (unescape(k), unescape(v))))
        .collect()
}

fn url_unescape(s: &str) -> String {
    percent_encoding::percent_decode_str(&s.replace('+', " "))
        .decode_utf8_lossy()
        .into_owned()
}

pub async fn list_v2(
    State(state): State<E2bState>,
    Extension(tenant): Extension<Tenant>,
    Query(q): Query<ListQuery>,
) -> Result<Response> {
    let mut states = Vec::new();
    for s in q.state.as_deref().unwrap_or("running,paused").split(',').map(str::trim) {
        match s {
            "running" => states.push(SandboxState::Running),
            "paused" => states.extend([SandboxState::Paused, SandboxState::Suspended, SandboxState::Resuming]),
            other => {
                return Err(E2bError::bad_request(format!(
                    "unknown state {other:?}; use running or paused"
                )))
            }
        }
    }
    let page = state
        .core
        .list_sandboxes(
            &tenant,
            ListSandboxes {
                states,
                metadata: q.metadata.as_deref().map(parse_metadata_filter).unwrap_or_default(),
                page_token: q.next_token,
                limit: q.limit.unwrap_or(100),
                newest_first: match q.order.as_deref() {
                    None | Some("desc") => true,
                    Some("asc") => false,
                    Some(other) => {
                        return Err(E2bError::bad_request(format!(
                            "unknown order {other:?}; use asc or desc"
                        )))
                    }
                },
                created_from_ms: q
                    .started_after
                    .as_deref()
                    .map(|v| list_time("startedAfter", v))
                    .transpose()?,
                created_before_ms: q
                    .started_before
                    .as_deref()
                    .map(|v| list_time("startedBefore", v))
                    .transpose()?,
                template: q.template.filter(|t| !t.is_empty()),
            },
        )
        .await?;
    let mut resp = Json(sandbox_details(&state, &page.sandboxes).await?).into_response();
    if let Some(n) = page.next_page_token {
        resp.headers_mut()
            .insert("x-next-token", n.parse().expect("ascii token"));
    }
    Ok(resp)
}

/// A page of sandboxes as E2B's list answers each (`/v2/sandboxes`, `/sandboxes`).
async fn sandbox_details(state: &E2bState, rows: &[SandboxRecord]) -> Result<Vec<SandboxDetail>> {
    let mut items = Vec::with_capacity(rows.len());
    for row in rows {
        items.push(sandbox_detail(state, row, None).await?);
    }
    Ok(items)
}

/// `GET /sandboxes` (E2B's v1 list, still in its spec): every running sandbox of the team, a
/// `metadata` filter, no paging; the same answer items as `/v2/sandboxes`.
pub async fn list_v1(
    State(state): State<E2bState>,
    Extension(tenant): Extension<Tenant>,
    Query(q): Query<MetadataQuery>,
) -> Result<Response> {
    let metadata = q.metadata.as_deref().map(parse_metadata_filter).unwrap_or_default();
    let mut items = Vec::new();
    let mut page_token = None;
    loop {
        let page = state
            .core
            .list_sandboxes(
                &tenant,
                ListSandboxes {
                    states: vec![SandboxState::Running],
                    metadata: metadata.clone(),
                    page_token,
                    limit: 100,
                    newest_first: true,
                    ..Default::default()
                },
            )
            .await?;
        items.extend(sandbox_details(&state, &page.sandboxes).await?);
        match page.next_page_token {
            Some(next) => page_token = Some(next),
            None => return Ok(Json(items).into_response()),
        }
    }
}

/// `GET /sandboxes/{id}/metrics?start=&end=` (Unix seconds, both optional: the sandbox's life
/// so far by default), from the core's sampled history.
pub async fn metrics(
    State(state): State<E2bState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    q: std::result::Result<Query<MetricsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<MetricsSample>>> {
    let Query(q) = q.map_err(|e| E2bError::bad_request(format!("bad metrics query: {}", e.body_text())))?;
    let row = state.core.live_sandbox(&tenant, &id).await?;
    let samples = state.core.sandbox_metrics(&row, q.start, q.end).await?;
    let items: Vec<MetricsSample> = samples
        .iter()
        .map(|s| {
            let m = &s.metrics;
            MetricsSample {
                timestamp: rfc3339(s.at_ms),
                timestamp_unix: s.at_ms.div_euclid(1000),
                cpu_count: m.cpu_count,
                cpu_used_pct: m.cpu_used_pct,
                mem_used: m.mem_used_bytes,
                mem_total: m.mem_total_bytes,
                mem_cache: 0,
                disk_used: m.disk_used_bytes,
                disk_total: m.disk_total_bytes,
            }
        })
        .collect();
    Ok(Json(items))
}

#[cfg(test)]
mod list_time_tests {
    #[test]
    fn list_times_read_every_shape_the_sdks_send() {
        let t = |v: &str| super::list_time("startedAfter", v).unwrap();
        let utc = t("2026-11-30T19:40:00Z");
        assert_eq!(t("2026-11-30T19:40:00"), utc);
        assert_eq!(t("2026-11-30T19:40:00+00:00"), utc);
        assert_eq!(t("2026-11-30T21:40:00+02:00"), utc);
        assert_eq!(t("2026-11-30T19:40:00.250000"), utc + 250);
        assert!(super::list_time("startedAfter", "yesterday").is_err());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filter_decodes_the_sdks_triple_encoding() {
        // What arrives after the framework's own query decoding of
        // `?metadata=user%3Da%252520b%26app%3Dx%252Fy`:
        let m = parse_metadata_filter("user=a%2520b&app=x%2Fy");
        assert_eq!(m.get("user").map(String::as_str), Some("a b"));
        assert_eq!(m.get("app").map(String::as_str), Some("x/y"));
        assert!(parse_metadata_filter("").is_empty());
    }
}
