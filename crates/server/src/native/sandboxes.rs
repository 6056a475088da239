//! `/v1/sandboxes` and `/v1/operations`: create, list, get, delete, pause, suspend, resume, the
//! egress report and the tenant's own view, onto the core's sandbox services.

use super::*;

#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", request_body = CreateSandboxRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "retries with the same key return the same operation"),
        ("X-Airlock-Egress-Profiles" = Option<String>, Header, description = "egress profiles (`a,b`) instead of the server's defaults; honoured only for a signed-in caller (ignored for API keys)")),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn create_sandbox(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Extension(principal): Extension<crate::core::Principal>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CreateSandboxRequest>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    let timeout = req
        .timeout
        .as_deref()
        .map(|t| parse_duration("timeout", t))
        .transpose()?;
    let idempotency_key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| CoreError::invalid("Idempotency-Key", "must be visible ASCII"))?
                .to_string(),
        ),
    };
    let profiles = match headers.get(crate::core::egress::PROFILES_HEADER) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| CoreError::invalid("X-Airlock-Egress-Profiles", "must be visible ASCII"))?
                .to_string(),
        ),
    };
    let resources = req.resources.unwrap_or(ResourcesSpec {
        vcpu: None,
        memory_mib: None,
        disk_mib: None,
    });
    let created = core
        .create_sandbox(
            &principal,
            CreateSandbox {
                template: req.template,
                runtime: req.runtime,
                vcpu: resources.vcpu,
                memory_mib: resources.memory_mib,
                disk_mib: resources.disk_mib,
                timeout,
                env: req.env.unwrap_or_default(),
                metadata: req.metadata.unwrap_or_default(),
                idempotency_key,
                egress: EgressRequest {
                    profiles,
                    ..Default::default()
                },
                lifecycle: Lifecycle {
                    on_timeout: req.on_timeout.unwrap_or_default(),
                    auto_resume: req.auto_resume.unwrap_or(false),
                },
                inherit_egress: None,
                from_saved: None,
                parent: None,
                volumes: req
                    .volumes
                    .unwrap_or_default()
                    .into_iter()
                    .map(|m| crate::core::volumes::MountRequest {
                        volume: m.volume,
                        path: m.path,
                        read_only: m.read_only,
                    })
                    .collect(),
            },
        )
        .await?;
    // The record as it is now: a replayed create may have finished long ago.
    let operation = match core.operation(&tenant, &created.operation.id).await {
        Err(CoreError::NotFound { .. }) => created.operation,
        found => found?,
    };
    Ok(accepted(operation))
}

#[utoipa::path(get, path = "/v1/operations/{id}", tag = "operations",
    params(("id" = String, Path)),
    responses((status = 200, body = Operation), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_operation(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<Operation>> {
    Ok(Json(core.operation(&tenant, &id).await?))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only sandboxes in this state (default: creating, running, paused and deleting).
    pub state: Option<String>,
    /// Page size, 1..=100 (default 50).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    pub page_token: Option<String>,
    /// `metadata.<key>=<value>` filters are also accepted.
    #[serde(flatten)]
    #[param(ignore)]
    pub rest: HashMap<String, String>,
}

#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes", params(ListQuery),
    responses((status = 200, body = SandboxList), ApiErrors),
    security(("bearer" = [])))]
pub async fn list_sandboxes(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<Json<SandboxList>> {
    let states = match q.state.as_deref() {
        None => vec![],
        Some(s) => vec![SandboxState::parse(s).ok_or_else(|| {
            CoreError::invalid(
                "state",
                format!("unknown state {s:?}; one of creating, running, paused, suspended, resuming, deleting, deleted, failed"),
            )
        })?],
    };
    let mut metadata = BTreeMap::new();
    for (k, v) in &q.rest {
        match k.strip_prefix("metadata.") {
            Some(key) if !key.is_empty() => {
                metadata.insert(key.to_string(), v.clone());
            }
            _ => return Err(CoreError::invalid("query", format!("unknown query parameter {k:?}")).into()),
        }
    }
    let page = core
        .list_sandboxes(
            &tenant,
            ListSandboxes {
                states,
                metadata,
                page_token: q.page_token,
                limit: q.limit.unwrap_or(50),
                newest_first: false,
                created_from_ms: None,
                created_before_ms: None,
                template: None,
            },
        )
        .await?;
    Ok(Json(SandboxList {
        sandboxes: page.sandboxes.iter().map(SandboxRecord::view).collect(),
        next_page_token: page.next_page_token,
    }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_sandbox(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(core.sandbox(&tenant, &id).await?.view()))
}

/// What the sandbox may reach and why: the platform's denies, its tenant's denies and allows, its
/// profiles; and the decisions counted so far with the most recent denials.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/egress", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = EgressReport), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_egress(
    State(core): State<Core>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<EgressReport>> {
    Ok(Json(core.egress_report(&tenant, &id).await?))
}

/// The caller's tenant: its limits in force and what it uses of them.
#[utoipa::path(get, path = "/v1/tenant", tag = "tenant",
    responses((status = 200, body = TenantInfo), ApiErrors),
    security(("bearer" = [])))]
pub async fn get_tenant(State(core): State<Core>, Extension(tenant): Extension<Tenant>) -> ApiResult<Json<TenantInfo>> {
    Ok(Json(core.tenant_info(&tenant).await?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn delete_sandbox(
    State(core): State<Core>,
    Extension(principal): Extension<crate::core::Principal>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    Ok(accepted(core.delete_sandbox(&principal, &id).await?))
}

/// Freeze the sandbox in memory (processes, files and memory kept). Its timeout stops running
/// until resume, which restores the time that was left; a pause lasts at most 24 h.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn pause_sandbox(
    State(core): State<Core>,
    Extension(principal): Extension<crate::core::Principal>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    Ok(accepted(core.change_sandbox(&principal, &id, Change::Pause).await?))
}

/// Save the sandbox to disk (memory, running processes, files) and end its VM: it then holds
/// only disk space, not CPU or memory, and survives a server restart. Its timeout stops running
/// until resume, which starts it again as it was; a suspend lasts at most 30 days.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/suspend", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn suspend_sandbox(
    State(core): State<Core>,
    Extension(principal): Extension<crate::core::Principal>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    Ok(accepted(core.change_sandbox(&principal, &id, Change::Suspend).await?))
}

/// Run a paused sandbox again, or start a suspended one from its saved state (it must fit the
/// tenant's quota and the node again, like a create).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 202, body = OperationAccepted), ApiErrors),
    security(("bearer" = [])))]
pub async fn resume_sandbox(
    State(core): State<Core>,
    Extension(principal): Extension<crate::core::Principal>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<OperationAccepted>)> {
    Ok(accepted(core.change_sandbox(&principal, &id, Change::Resume).await?))
}
