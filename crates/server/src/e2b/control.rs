//! E2B control plane: `/sandboxes`, `/v2/sandboxes`, timeouts, metrics, connect.

use super::{template_alias, E2bError, ENVD_VERSION};
use crate::api::{AppState, MAX_SANDBOX_TIMEOUT};
use crate::error::ApiError;
use crate::model::{OperationKind, OperationState, SandboxState};
use crate::ops::new_operation;
use crate::store::{now_ms, rfc3339, token_hash, SandboxFilter, SandboxRow, Tenant};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};

type Result<T> = std::result::Result<T, E2bError>;

/// `X-API-KEY: <airlock key>` identifies the tenant.
pub async fn auth(State(state): State<AppState>, mut req: Request, next: axum::middleware::Next) -> Response {
    let key = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .unwrap_or("");
    match state.store.tenant_by_key(key).await {
        Ok(Some(t)) if !key.is_empty() => {
            req.extensions_mut().insert(t);
            next.run(req).await
        }
        Ok(_) => E2bError::new(
            StatusCode::UNAUTHORIZED,
            "invalid API key; use an airlock key (`airlock key create`)",
        )
        .into_response(),
        Err(e) => E2bError::from(e).into_response(),
    }
}

/// Request body of `POST /sandboxes` (`NewSandbox`). Unknown fields are kept to be refused loudly.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub timeout: Option<i64>,
    pub auto_pause: Option<bool>,
    /// v2 only: what an auto-pause keeps; irrelevant while auto-pause is refused.
    pub auto_pause_memory: Option<bool>,
    pub auto_resume: Option<Value>,
    pub env_vars: Option<BTreeMap<String, String>>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub secure: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    pub network: Option<Network>,
    pub mcp: Option<Value>,
    pub volume_mounts: Option<Value>,
    pub iam: Option<Value>,
    #[serde(flatten)]
    pub other: HashMap<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Network {
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub allow_public_traffic: Option<bool>,
    pub mask_request_host: Option<String>,
}

/// Options airlock cannot honour yet fail loudly, naming the option.
fn refuse_unsupported(req: &NewSandbox) -> Result<()> {
    if req.mcp.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(E2bError::bad_request("option `mcp` is not supported by airlock"));
    }
    if req
        .volume_mounts
        .as_ref()
        .is_some_and(|v| v.as_array().map(|a| !a.is_empty()).unwrap_or(!v.is_null()))
    {
        return Err(E2bError::bad_request(
            "option `volumeMounts` is not supported by airlock",
        ));
    }
    if req.iam.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(E2bError::bad_request("option `iam` is not supported by airlock"));
    }
    if req.auto_pause == Some(true) {
        return Err(E2bError::bad_request(
            "option `autoPause` (lifecycle on_timeout=pause) is not supported by airlock yet",
        ));
    }
    if let Some(n) = &req.network {
        if n.allow_out.as_ref().is_some_and(|v| !v.is_empty()) {
            return Err(E2bError::bad_request(
                "option `network.allowOut` is not supported yet: sandboxes have no egress until airlock's egress policy lands",
            ));
        }
        // Note: e2b 2.21.1 sends allowPublicTraffic=true with any `network=` unless told otherwise.
        if n.allow_public_traffic == Some(true) {
            return Err(E2bError::bad_request(
                "option `network.allowPublicTraffic=true` is not supported: airlock sandbox URLs always need the access token; pass allow_public_traffic=False",
            ));
        }
        if n.mask_request_host.is_some() {
            return Err(E2bError::bad_request(
                "option `network.maskRequestHost` is not supported by airlock",
            ));
        }
        // denyOut narrows what is already nothing: accepted.
        let _ = &n.deny_out;
    }
    if let Some(k) = req.other.keys().next() {
        return Err(E2bError::bad_request(format!(
            "option `{k}` is not supported by airlock"
        )));
    }
    Ok(())
}

fn template_name(template_id: &str) -> Result<String> {
    if template_id.contains('/') {
        return Err(E2bError::bad_request(format!(
            "template {template_id:?}: team-scoped names (`team/name`) are not supported; use a flat alias like `base`"
        )));
    }
    Ok(template_alias(template_id).to_string())
}

fn sandbox_json(state: &AppState, row: &SandboxRow, token: &str, alias: &str) -> Value {
    json!({
        "templateID": alias,
        "sandboxID": row.id,
        "clientID": "airlock",
        "alias": alias,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        // Sandbox ports are never public: the same token opens them (E2B-Traffic-Access-Token).
        "trafficAccessToken": token,
        "domain": state.e2b_domain.as_deref(),
    })
}

/// The name the SDK created the sandbox with, for echoing back.
async fn e2b_alias(state: &AppState, row: &SandboxRow) -> Result<String> {
    Ok(state.store.e2b_alias(&row.id).await?.unwrap_or_else(|| {
        if row.template == "seed" {
            "base".into()
        } else {
            row.template.clone()
        }
    }))
}

fn detail_json(state: &AppState, row: &SandboxRow, alias: &str, token: Option<&str>) -> Value {
    let metadata: BTreeMap<_, _> = row.metadata.iter().filter(|(k, _)| !k.starts_with("_e2b_")).collect();
    let mut v = json!({
        "templateID": alias,
        "alias": alias,
        "sandboxID": row.id,
        "clientID": "airlock",
        "startedAt": rfc3339(row.created_at_ms),
        "endAt": rfc3339(row.expires_at_ms),
        "cpuCount": row.resources.vcpu,
        "memoryMB": row.resources.memory_mib,
        "diskSizeMB": row.resources.disk_mib,
        "state": if row.state == SandboxState::Paused { "paused" } else { "running" },
        "envdVersion": ENVD_VERSION,
        "metadata": metadata,
        "domain": state.e2b_domain.as_deref(),
        "allowInternetAccess": false,
    });
    if let Some(t) = token {
        v["envdAccessToken"] = json!(t);
    }
    v
}

fn timeout_ms(seconds: Option<i64>) -> Result<i64> {
    let secs = seconds.unwrap_or(300);
    if secs <= 0 || secs as u64 > MAX_SANDBOX_TIMEOUT.as_secs() {
        return Err(E2bError::bad_request(format!(
            "timeout must be between 1 and {} seconds, got {secs}",
            MAX_SANDBOX_TIMEOUT.as_secs()
        )));
    }
    Ok(secs * 1000)
}

pub async fn create(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<Value>)> {
    let req: NewSandbox =
        serde_json::from_slice(&body).map_err(|e| E2bError::bad_request(format!("invalid body: {e}")))?;
    refuse_unsupported(&req)?;
    let name = template_name(&req.template_id)?;
    let template = state.runtime.templates().resolve(&name).map_err(|_| {
        E2bError::not_found(format!(
            "template {:?} not found; airlock has: {}",
            req.template_id,
            known_templates(&state)
        ))
    })?;
    let ttl = timeout_ms(req.timeout)?;
    // E2B defaults: 2 vCPU would double TCG cost here, so the node's default resources apply.
    let res = airlock_runtime::Resources::default();
    res.validate(&template).map_err(ApiError::from)?;
    let metadata = req.metadata.unwrap_or_default();
    let env = req.env_vars.unwrap_or_default();
    let ttl = std::time::Duration::from_millis(ttl as u64);
    let row = crate::api::new_sandbox_row(&state, &tenant, &template, res, ttl, env, metadata).await?;
    let id = row.id.clone();
    let token = airlock_runtime::datadir::random_hex(16);
    let op = new_operation(OperationKind::Create, &id);
    state
        .store
        .insert_create(&row, &op, None, state.max_sandboxes_per_tenant)
        .await?;
    state.store.set_e2b_alias(&id, &req.template_id).await?;
    state.store.set_access_hash(&id, &token_hash(&token)).await?;
    // The E2B API answers once the sandbox runs; the engine does the work, we wait for it.
    let _ = state.engine.start_create(op.clone(), row.clone()).await;
    let done = state
        .store
        .get_operation(&tenant.id, &op.id)
        .await?
        .ok_or_else(|| E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, "operation vanished"))?;
    if done.state != OperationState::Succeeded {
        let msg = done
            .error
            .map(|e| e.message)
            .unwrap_or_else(|| "sandbox failed to start".into());
        return Err(E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, msg));
    }
    let row = state.store.get_sandbox(&tenant.id, &id).await?.unwrap_or(row);
    Ok((
        StatusCode::CREATED,
        Json(sandbox_json(&state, &row, &token, &req.template_id)),
    ))
}

fn known_templates(state: &AppState) -> String {
    let mut names: Vec<String> = state.runtime.templates().list().into_iter().map(|m| m.name).collect();
    if names.iter().any(|n| n == "seed") {
        names.push("base (= seed)".into());
    }
    names.join(", ")
}

/// A sandbox the E2B door can see: running or paused.
async fn live_row(state: &AppState, tenant: &Tenant, id: &str) -> Result<SandboxRow> {
    match state.store.get_sandbox(&tenant.id, id).await? {
        Some(row) if matches!(row.state, SandboxState::Running | SandboxState::Paused) => Ok(row),
        _ => Err(E2bError::not_found(format!("sandbox {id:?} not found"))),
    }
}

/// `POST /sandboxes/{id}/pause`: airlock pauses in memory (no suspend to disk yet).
pub async fn pause(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<StatusCode> {
    let row = live_row(&state, &tenant, &id).await?;
    if row.state == SandboxState::Paused {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    let op = state.engine.pause_or_resume(&row, true).await?;
    match op.error {
        None => Ok(StatusCode::NO_CONTENT),
        Some(e) => Err(E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.message)),
    }
}

/// `POST /sandboxes/{id}/snapshots`: snapshots need suspend-to-disk, which airlock does not have
/// yet; say so (501) instead of a 404 the SDK would report as a missing sandbox.
pub async fn create_snapshot(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<StatusCode> {
    live_row(&state, &tenant, &id).await?;
    Err(E2bError::new(
        StatusCode::NOT_IMPLEMENTED,
        "snapshots are not supported by airlock yet (no suspend-to-disk); pause() keeps a sandbox in memory",
    ))
}

/// `GET /snapshots`: there are none (see `create_snapshot`).
pub async fn list_snapshots() -> Json<Value> {
    Json(json!([]))
}

pub async fn get(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<Value>> {
    let row = live_row(&state, &tenant, &id).await?;
    // Only the token's hash is kept: the detail cannot repeat it (create and connect hand it out).
    let alias = e2b_alias(&state, &row).await?;
    Ok(Json(detail_json(&state, &row, &alias, None)))
}

pub async fn kill(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<StatusCode> {
    let row = live_row(&state, &tenant, &id).await?;
    state.engine.delete_and_wait(&row).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
pub struct TimeoutBody {
    pub timeout: Option<i64>,
}

pub async fn set_timeout(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<StatusCode> {
    let b: TimeoutBody =
        serde_json::from_slice(&body).map_err(|e| E2bError::bad_request(format!("invalid body: {e}")))?;
    let row = live_row(&state, &tenant, &id).await?;
    let timeout = timeout_ms(b.timeout)?;
    if row.state == SandboxState::Paused {
        // Its clock is stopped: the new timeout is what it will have once resumed.
        state.store.set_paused_remaining(&row.id, Some(timeout)).await?;
    } else {
        state.store.set_sandbox_expiry(&row.id, now_ms() + timeout).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

pub async fn connect(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<Value>)> {
    let b: TimeoutBody = if body.is_empty() {
        TimeoutBody { timeout: None }
    } else {
        serde_json::from_slice(&body).map_err(|e| E2bError::bad_request(format!("invalid body: {e}")))?
    };
    let mut row = live_row(&state, &tenant, &id).await?;
    // Connecting to a paused sandbox resumes it (201), as E2B does.
    let resumed = row.state == SandboxState::Paused;
    if resumed {
        let op = state.engine.pause_or_resume(&row, false).await?;
        if let Some(e) = op.error {
            return Err(E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, e.message));
        }
        // Resuming restored the lifetime left at pause; the extension below starts from there.
        row = live_row(&state, &tenant, &id).await?;
    }
    // Connecting extends the life to at least `timeout` from now, as E2B does.
    let want = now_ms() + timeout_ms(b.timeout)?;
    if want > row.expires_at_ms {
        state.store.set_sandbox_expiry(&row.id, want).await?;
    }
    // Only the token's hash is kept, so connecting mints a new token (rotating any earlier one).
    let token = airlock_runtime::datadir::random_hex(16);
    state.store.set_access_hash(&id, &token_hash(&token)).await?;
    let status = if resumed { StatusCode::CREATED } else { StatusCode::OK };
    let alias = e2b_alias(&state, &row).await?;
    Ok((status, Json(sandbox_json(&state, &row, &token, &alias))))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    pub metadata: Option<String>,
    pub state: Option<String>,
    pub limit: Option<u32>,
    pub next_token: Option<String>,
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
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Query(q): Query<ListQuery>,
) -> Result<Response> {
    let states: Vec<String> = q
        .state
        .as_deref()
        .unwrap_or("running,paused")
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    for s in &states {
        if s != "running" && s != "paused" {
            return Err(E2bError::bad_request(format!(
                "unknown state {s:?}; use running or paused"
            )));
        }
    }
    let limit = q.limit.unwrap_or(100);
    if !(1..=100).contains(&limit) {
        return Err(E2bError::bad_request(format!(
            "limit must be between 1 and 100, got {limit}"
        )));
    }
    let after = match &q.next_token {
        None => None,
        Some(t) => Some(crate::store::parse_page_token(t).ok_or_else(|| E2bError::bad_request("bad nextToken"))?),
    };
    let metadata = q.metadata.as_deref().map(parse_metadata_filter).unwrap_or_default();
    let states = states
        .iter()
        .map(|s| SandboxState::parse(s).expect("checked above"))
        .collect();
    let filter = SandboxFilter {
        states,
        metadata,
        after,
        limit,
    };
    let rows = state.store.list_sandboxes(&tenant.id, &filter).await?;
    let next = crate::store::next_page_token(&rows, limit);
    let mut items: Vec<Value> = Vec::with_capacity(rows.len().min(limit as usize));
    for r in rows.iter().take(limit as usize) {
        items.push(detail_json(&state, r, &e2b_alias(&state, r).await?, None));
    }
    let mut resp = Json(items).into_response();
    if let Some(n) = next {
        resp.headers_mut()
            .insert("x-next-token", n.parse().expect("ascii token"));
    }
    Ok(resp)
}

pub async fn metrics(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<Value>> {
    live_row(&state, &tenant, &id).await?;
    let sb = state
        .runtime
        .get(&id)
        .map_err(|_| E2bError::not_found(format!("sandbox {id:?} not found")))?;
    let m = sb
        .agent()
        .await
        .map_err(crate::error::ApiError::from)?
        .metrics()
        .await
        .map_err(crate::error::ApiError::from)?;
    let now = std::time::SystemTime::now();
    let unix = now
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Json(json!([{
        "timestamp": humantime::format_rfc3339_seconds(now).to_string(),
        "timestampUnix": unix,
        "cpuCount": m.cpu_count,
        "cpuUsedPct": m.cpu_used_pct,
        "memUsed": m.mem_used_bytes,
        "memTotal": m.mem_total_bytes,
        "memCache": 0,
        "diskUsed": m.disk_used_bytes,
        "diskTotal": m.disk_total_bytes,
    }])))
}

pub async fn not_supported(headers: HeaderMap) -> E2bError {
    let _ = headers;
    E2bError::new(
        StatusCode::NOT_IMPLEMENTED,
        "this E2B endpoint is not supported by airlock yet",
    )
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
