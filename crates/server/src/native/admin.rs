//! `/v1/admin`: the platform account's routes. Sign in with `POST /v1/admin/login`; every other
//! route wants the admin token it returns (a tenant's API key gets 403).

use super::{ApiErrors, ApiJson as Json, ApiQuery as Query, ApiResult};
use crate::core::accounts::Admin;
use crate::core::{Core, Credentials};
use crate::model::*;
use axum::extract::{ConnectInfo, Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;
use std::net::SocketAddr;

pub async fn require_admin(State(core): State<Core>, mut req: Request, next: axum::middleware::Next) -> Response {
    let creds = Credentials::from_headers(req.headers());
    match core.admin(creds.bearer.as_deref()).await {
        Ok(admin) => {
            req.extensions_mut().insert(admin);
            next.run(req).await
        }
        Err(e) => super::ApiError::from(e).into_response(),
    }
}

/// Sign in as `root@local` (throttled per client address; see `core::sign_in`).
#[utoipa::path(post, path = "/v1/admin/login", tag = "admin", request_body = LoginRequest,
    responses((status = 200, body = AdminToken), ApiErrors))]
pub async fn login(
    State(core): State<Core>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    Json(req): Json<LoginRequest>,
) -> ApiResult<axum::Json<AdminToken>> {
    let client = peer.map(|Extension(ConnectInfo(addr))| addr.ip());
    Ok(axum::Json(core.login(&req.username, &req.password, client).await?))
}

#[utoipa::path(post, path = "/v1/admin/tenants", tag = "admin", request_body = CreateTenantRequest,
    responses((status = 201, body = TenantSummary), ApiErrors), security(("bearer" = [])))]
pub async fn create_tenant(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Json(req): Json<CreateTenantRequest>,
) -> ApiResult<(StatusCode, axum::Json<TenantSummary>)> {
    Ok((
        StatusCode::CREATED,
        axum::Json(core.create_tenant(&admin, &req.name).await?),
    ))
}

#[utoipa::path(get, path = "/v1/admin/tenants", tag = "admin",
    responses((status = 200, body = TenantList), ApiErrors), security(("bearer" = [])))]
pub async fn list_tenants(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
) -> ApiResult<axum::Json<TenantList>> {
    Ok(axum::Json(TenantList {
        tenants: core.list_tenants(&admin).await?,
    }))
}

/// A tenant's limits in force and its usage.
#[utoipa::path(get, path = "/v1/admin/tenants/{name}", tag = "admin", params(("name" = String, Path)),
    responses((status = 200, body = TenantInfo), ApiErrors), security(("bearer" = [])))]
pub async fn get_tenant(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Path(name): Path<String>,
) -> ApiResult<axum::Json<TenantInfo>> {
    Ok(axum::Json(core.tenant_detail(&admin, &name).await?))
}

/// Revoke the tenant's keys, delete its sandboxes, remove it.
#[utoipa::path(delete, path = "/v1/admin/tenants/{name}", tag = "admin", params(("name" = String, Path)),
    responses((status = 202, body = TenantDeleted), ApiErrors), security(("bearer" = [])))]
pub async fn delete_tenant(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Path(name): Path<String>,
) -> ApiResult<(StatusCode, axum::Json<TenantDeleted>)> {
    let sandboxes_deleting = core.delete_tenant(&admin, &name).await?;
    Ok((
        StatusCode::ACCEPTED,
        axum::Json(TenantDeleted {
            name,
            sandboxes_deleting,
        }),
    ))
}

/// The limits set for the tenant (`null`: the server's default).
#[utoipa::path(get, path = "/v1/admin/tenants/{name}/quota", tag = "admin", params(("name" = String, Path)),
    responses((status = 200, body = Quota), ApiErrors), security(("bearer" = [])))]
pub async fn get_quota(
    State(core): State<Core>,
    Extension(_admin): Extension<Admin>,
    Path(name): Path<String>,
) -> ApiResult<axum::Json<Quota>> {
    Ok(axum::Json(core.tenant_quota(&name).await?))
}

/// Replace the limits set for the tenant.
#[utoipa::path(put, path = "/v1/admin/tenants/{name}/quota", tag = "admin", params(("name" = String, Path)),
    request_body = Quota, responses((status = 200, body = Quota), ApiErrors), security(("bearer" = [])))]
pub async fn put_quota(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Path(name): Path<String>,
    Json(quota): Json<Quota>,
) -> ApiResult<axum::Json<Quota>> {
    core.set_quota_as_admin(&admin, &name, quota).await?;
    Ok(axum::Json(core.tenant_quota(&name).await?))
}

/// The tenant's base egress policy.
#[utoipa::path(get, path = "/v1/admin/tenants/{name}/egress", tag = "admin", params(("name" = String, Path)),
    responses((status = 200, body = TenantEgressPolicy), ApiErrors), security(("bearer" = [])))]
pub async fn get_policy(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Path(name): Path<String>,
) -> ApiResult<axum::Json<TenantEgressPolicy>> {
    Ok(axum::Json(policy_view(&core.policy_as_admin(&admin, &name).await?)))
}

/// Replace the tenant's base egress policy (exact names, IPs and CIDRs; no wildcards). New
/// sandboxes get it; live ones keep theirs.
#[utoipa::path(put, path = "/v1/admin/tenants/{name}/egress", tag = "admin", params(("name" = String, Path)),
    request_body = TenantEgressPolicy, responses((status = 200, body = TenantEgressPolicy), ApiErrors),
    security(("bearer" = [])))]
pub async fn put_policy(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Path(name): Path<String>,
    Json(req): Json<TenantEgressPolicy>,
) -> ApiResult<axum::Json<TenantEgressPolicy>> {
    let policy = crate::core::egress::tenant_policy_from_rules(&req.allow, &req.deny)?;
    core.set_policy_as_admin(&admin, &name, policy).await?;
    Ok(axum::Json(policy_view(&core.policy_as_admin(&admin, &name).await?)))
}

fn policy_view(p: &airlock_egress::TenantPolicy) -> TenantEgressPolicy {
    use crate::core::egress::rules_view;
    TenantEgressPolicy {
        allow: rules_view(&p.allow),
        deny: rules_view(&p.deny),
    }
}

/// Mint a key for the tenant; the key is in this answer only.
#[utoipa::path(post, path = "/v1/admin/tenants/{name}/keys", tag = "admin", params(("name" = String, Path)),
    request_body = CreateKeyRequest, responses((status = 201, body = NewKey), ApiErrors), security(("bearer" = [])))]
pub async fn create_key(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Path(name): Path<String>,
    Json(req): Json<CreateKeyRequest>,
) -> ApiResult<(StatusCode, axum::Json<NewKey>)> {
    Ok((
        StatusCode::CREATED,
        axum::Json(core.mint_key(&admin, &name, &req.name, req.e2b).await?),
    ))
}

#[utoipa::path(get, path = "/v1/admin/tenants/{name}/keys", tag = "admin", params(("name" = String, Path)),
    responses((status = 200, body = KeyList), ApiErrors), security(("bearer" = [])))]
pub async fn list_keys(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Path(name): Path<String>,
) -> ApiResult<axum::Json<KeyList>> {
    Ok(axum::Json(KeyList {
        keys: core.list_keys(&admin, &name).await?,
    }))
}

/// Revoke a key: its next call gets 401.
#[utoipa::path(delete, path = "/v1/admin/tenants/{name}/keys/{key_id}", tag = "admin",
    params(("name" = String, Path), ("key_id" = String, Path)),
    responses((status = 204), ApiErrors), security(("bearer" = [])))]
pub async fn revoke_key(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Path((name, key_id)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    core.revoke_key(&admin, &name, &key_id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Rows older than this `seq` (the next page: the last `seq` of this one).
    pub before: Option<i64>,
    /// Only this tenant's rows.
    pub tenant: Option<String>,
    /// Only this action (`login`, `sandbox.create`, `key.revoke`, ...).
    pub action: Option<String>,
    /// At most this many rows (default 100, at most 1000).
    pub limit: Option<u32>,
}

/// The audit log, newest first: every admin action, sign-in and refused credential, and every
/// sandbox lifecycle request.
#[utoipa::path(get, path = "/v1/admin/audit", tag = "admin", params(AuditQuery),
    responses((status = 200, body = AuditPage), ApiErrors), security(("bearer" = [])))]
pub async fn audit(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Query(q): Query<AuditQuery>,
) -> ApiResult<axum::Json<AuditPage>> {
    Ok(axum::Json(AuditPage {
        entries: core
            .audit_log(
                &admin,
                &crate::records::AuditFilter {
                    before_seq: q.before,
                    tenant: q.tenant,
                    action: q.action,
                },
                q.limit.unwrap_or(100),
            )
            .await?,
    }))
}

/// `/v1/system` with what only the platform account sees: the node's counts and warm pools.
#[utoipa::path(get, path = "/v1/admin/system", tag = "admin",
    responses((status = 200, body = SystemInfo), ApiErrors), security(("bearer" = [])))]
pub async fn system(State(core): State<Core>, Extension(_admin): Extension<Admin>) -> axum::Json<SystemInfo> {
    axum::Json(core.system_info(true).await)
}

/// The warm pools: size, ready and starting VMs, hits and misses (as `/v1/admin/system` shows
/// them).
#[utoipa::path(get, path = "/v1/admin/pools", tag = "admin",
    responses((status = 200, body = Vec<PoolInfo>), ApiErrors), security(("bearer" = [])))]
pub async fn list_pools(State(core): State<Core>, Extension(_admin): Extension<Admin>) -> axum::Json<Vec<PoolInfo>> {
    axum::Json(core.pools())
}

/// The nodes as this replica sees them now: each one's state (ready, draining, refusing with
/// its reason, unreachable), machine and capacity.
#[utoipa::path(get, path = "/v1/admin/nodes", tag = "admin",
    responses((status = 200, body = Vec<NodeInfo>), ApiErrors), security(("bearer" = [])))]
pub async fn list_nodes(State(core): State<Core>, Extension(_admin): Extension<Admin>) -> axum::Json<Vec<NodeInfo>> {
    axum::Json(core.nodes_info())
}

/// Size a warm pool: `size` VMs of `template` (with `resources`) kept ready for creates to claim.
#[utoipa::path(put, path = "/v1/admin/pools", tag = "admin", request_body = PoolRequest,
    responses((status = 200, body = PoolInfo), ApiErrors), security(("bearer" = [])))]
pub async fn put_pool(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Json(req): Json<PoolRequest>,
) -> ApiResult<axum::Json<PoolInfo>> {
    Ok(axum::Json(core.set_pool(&admin, &req).await?))
}

/// Mint a scrape token for `GET /metrics` (shown once).
#[utoipa::path(post, path = "/v1/admin/scrape-tokens", tag = "admin", request_body = CreateScrapeTokenRequest,
    responses((status = 201, body = NewScrapeToken), ApiErrors), security(("bearer" = [])))]
pub async fn create_scrape_token(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Json(req): Json<CreateScrapeTokenRequest>,
) -> ApiResult<(StatusCode, axum::Json<NewScrapeToken>)> {
    Ok((
        StatusCode::CREATED,
        axum::Json(core.mint_scrape_token(&admin, &req.name).await?),
    ))
}

#[utoipa::path(get, path = "/v1/admin/scrape-tokens", tag = "admin",
    responses((status = 200, body = ScrapeTokenList), ApiErrors), security(("bearer" = [])))]
pub async fn list_scrape_tokens(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
) -> ApiResult<axum::Json<ScrapeTokenList>> {
    Ok(axum::Json(ScrapeTokenList {
        tokens: core.scrape_tokens(&admin).await?,
    }))
}

#[utoipa::path(delete, path = "/v1/admin/scrape-tokens/{id}", tag = "admin", params(("id" = String, Path)),
    responses((status = 204), ApiErrors), security(("bearer" = [])))]
pub async fn revoke_scrape_token(
    State(core): State<Core>,
    Extension(admin): Extension<Admin>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    core.revoke_scrape_token(&admin, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /metrics`: Prometheus' text format, for a scrape token or the admin's token.
pub async fn metrics(State(core): State<Core>, headers: axum::http::HeaderMap) -> Response {
    let creds = Credentials::from_headers(&headers);
    if let Err(e) = core.scrape_allowed(creds.bearer.as_deref()).await {
        return super::ApiError::from(e).into_response();
    }
    open_metrics(State(core)).await
}

/// `GET /metrics` on `serve --metrics-listen`: no credential (the operator keeps it private).
pub async fn open_metrics(State(core): State<Core>) -> Response {
    match core.metrics_text().await {
        Ok(text) => (
            [(axum::http::header::CONTENT_TYPE, crate::telemetry::CONTENT_TYPE)],
            text,
        )
            .into_response(),
        Err(e) => super::ApiError::from(e).into_response(),
    }
}
