//! The platform account's pages: tenants (create, their keys minted and revoked, quotas and
//! base egress policy set), the audit log with filters, and the system (nodes and their
//! budgets, warm pools resized here, templates). A tenant's webhooks are on its own pages.

use super::page::{self, csrf, Answer, Refused};
use super::{signed, Browser, ConsoleState, Signed};
use crate::core::accounts::Admin;
use crate::error::CoreError;
use crate::records::AuditFilter;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect};
use axum::Form;
use maud::html;
use serde::Deserialize;

async fn admin_of(state: &ConsoleState, headers: &Browser) -> Result<(Signed, Admin), Refused> {
    let s = signed(state, headers, true).await?;
    let admin = s.admin()?.clone();
    Ok((s, admin))
}

pub async fn tenants(State(state): State<ConsoleState>, headers: Browser) -> Answer {
    let (s, admin) = admin_of(&state, &headers).await?;
    let tenants = state.core.list_tenants(&admin).await?;
    let body = html! {
        h1 { "Tenants" }
        table #tenants {
            thead { tr { th { "Tenant" } th { "Created" } } }
            tbody { @for t in &tenants { tr { td { a href={ "/console/admin/tenants/" (t.name) } { (t.name) } } td { (t.created_at) } } } }
        }
        h2 { "New tenant" }
        form.card method="post" action="/console/admin" #create-tenant {
            (csrf(&s))
            label { "Name " input name="name" required; }
            button type="submit" { "Create tenant" }
        }
    };
    Ok(page::layout("Tenants", Some(&s), body).into_response())
}

#[derive(Deserialize)]
pub struct NameForm {
    csrf: Option<String>,
    name: String,
}

pub async fn create_tenant(State(state): State<ConsoleState>, headers: Browser, Form(f): Form<NameForm>) -> Answer {
    let (s, admin) = admin_of(&state, &headers).await?;
    s.check_csrf(f.csrf.as_deref())?;
    let t = state.core.create_tenant(&admin, f.name.trim()).await?;
    Ok(Redirect::to(&format!("/console/admin/tenants/{}", t.name)).into_response())
}

pub async fn tenant(State(state): State<ConsoleState>, headers: Browser, Path(name): Path<String>) -> Answer {
    let (s, admin) = admin_of(&state, &headers).await?;
    tenant_page(&state, &s, &admin, &name, None).await
}

/// A tenant's page; `new_key` is a key just minted, shown this once.
async fn tenant_page(
    state: &ConsoleState,
    s: &Signed,
    admin: &Admin,
    name: &str,
    new_key: Option<&crate::model::NewKey>,
) -> Answer {
    let core = &state.core;
    let r = async {
        Ok::<_, CoreError>((
            core.tenant_detail(admin, name).await?,
            core.list_keys(admin, name).await?,
            core.policy_as_admin(admin, name).await?,
            core.tenant_quota(name).await?,
        ))
    };
    let (info, keys, policy, set) = r.await?;
    let allow = rules_lines(&crate::core::egress::rules_view(&policy.allow));
    let deny = rules_lines(&crate::core::egress::rules_view(&policy.deny));
    let q = &info.quota;
    let opt = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
    let body = html! {
        h1 { "Tenant " (info.name) }
        @if let Some(k) = new_key {
            div.card.secret #new-key {
                p { "New key " strong { (k.info.name) } ", shown only now: copy it." }
                code #new-key-value { (k.key) }
            }
        }
        h2 { "Quota and usage" }
        table #quota {
            thead { tr { th {} th { "Sandboxes" } th { "vCPU" } th { "Memory (MiB)" } th { "Disk (MiB)" } } }
            tbody {
                tr { td { "quota" } td { (opt(q.sandboxes.map(u64::from))) } td { (opt(q.vcpu)) } td { (opt(q.memory_mib)) } td { (opt(q.disk_mib)) } }
                tr { td { "used" } td { (info.usage.sandboxes) } td { (info.usage.vcpu) } td { (info.usage.memory_mib) } td { (info.usage.disk_mib) } }
            }
        }
        form.card method="post" action={ "/console/admin/tenants/" (info.name) "/quota" } #set-quota {
            (csrf(s))
            @for (field, label, v) in [
                ("sandboxes", "Sandboxes", set.sandboxes.map(u64::from)),
                ("vcpu", "vCPU", set.vcpu),
                ("memory_mib", "Memory (MiB)", set.memory_mib),
                ("disk_mib", "Disk (MiB)", set.disk_mib),
                ("sessions_per_sandbox", "Sessions a sandbox", set.sessions_per_sandbox.map(u64::from)),
                ("creates_per_minute", "Creates a minute", set.creates_per_minute.map(u64::from)),
                ("volume_mib", "Volumes (MiB)", set.volume_mib),
            ] {
                label { (label) " " input type="number" min="0" name=(field) value=[v] placeholder="default" size="8"; }
            }
            button type="submit" { "Set quota" }
        }
        p.note { "Empty: the server's default (the node's budgets always apply)." }
        h2 { "Base egress policy" }
        form.card method="post" action={ "/console/admin/tenants/" (info.name) "/policy" } #set-policy {
            (csrf(s))
            label { "Allowed out (a name, IP or CIDR a line)" br; textarea name="allow" rows="5" cols="40" { (allow) } }
            label { "Denied" br; textarea name="deny" rows="5" cols="40" { (deny) } }
            button type="submit" { "Set policy" }
        }
        p.note { "New sandboxes get it; running ones keep theirs." }
        h2 { "Keys" }
        table #keys {
            thead { tr { th { "Key" } th { "Name" } th { "Prefix" } th { "Created" } th { "Last used" } th {} } }
            tbody {
                @for k in &keys {
                    tr {
                        td { (k.id) } td { (k.name) } td { code { (k.prefix) } } td { (k.created_at) }
                        td { (k.last_used_at.as_deref().unwrap_or("-")) }
                        td {
                            @if let Some(at) = &k.revoked_at { "revoked " (at) } @else {
                                form.inline method="post" action={ "/console/admin/tenants/" (info.name) "/revoke" } {
                                    (csrf(s))
                                    input type="hidden" name="key" value=(k.id);
                                    button type="submit" { "Revoke" }
                                }
                            }
                        }
                    }
                }
            }
        }
        form.card method="post" action={ "/console/admin/tenants/" (info.name) "/keys" } #create-key {
            (csrf(s))
            label { "Key name " input name="name" value="console"; }
            label { input type="checkbox" name="e2b" value="1"; " spelled e2b_… (for E2B SDKs)" }
            button type="submit" { "Create key" }
        }
    };
    Ok(page::layout(&format!("Tenant {name}"), Some(s), body).into_response())
}

/// Rules as the policy form shows them: one a line.
fn rules_lines(r: &crate::model::EgressRules) -> String {
    r.domains
        .iter()
        .chain(&r.ips)
        .chain(&r.cidrs)
        .cloned()
        .collect::<Vec<_>>()
        .join("\n")
}

/// The policy form's lines as rules: a CIDR has a `/`, an IP parses as one, the rest are names.
fn rules_of(text: &str) -> crate::model::EgressRules {
    let mut r = crate::model::EgressRules::default();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains('/') {
            r.cidrs.push(line.to_string());
        } else if line.parse::<std::net::IpAddr>().is_ok() {
            r.ips.push(line.to_string());
        } else {
            r.domains.push(line.to_string());
        }
    }
    r
}

#[derive(Deserialize)]
pub struct QuotaForm {
    csrf: Option<String>,
    sandboxes: Option<String>,
    vcpu: Option<String>,
    memory_mib: Option<String>,
    disk_mib: Option<String>,
    sessions_per_sandbox: Option<String>,
    creates_per_minute: Option<String>,
    volume_mib: Option<String>,
}

pub async fn set_quota(
    State(state): State<ConsoleState>,
    headers: Browser,
    Path(name): Path<String>,
    Form(f): Form<QuotaForm>,
) -> Answer {
    let (s, admin) = admin_of(&state, &headers).await?;
    s.check_csrf(f.csrf.as_deref())?;
    let quota = crate::model::Quota {
        sandboxes: page::form_number("sandboxes", f.sandboxes.as_deref())?,
        vcpu: page::form_number("vcpu", f.vcpu.as_deref())?,
        memory_mib: page::form_number("memory_mib", f.memory_mib.as_deref())?,
        disk_mib: page::form_number("disk_mib", f.disk_mib.as_deref())?,
        sessions_per_sandbox: page::form_number("sessions_per_sandbox", f.sessions_per_sandbox.as_deref())?,
        creates_per_minute: page::form_number("creates_per_minute", f.creates_per_minute.as_deref())?,
        volume_mib: page::form_number("volume_mib", f.volume_mib.as_deref())?,
    };
    state.core.set_quota_as_admin(&admin, &name, quota).await?;
    Ok(Redirect::to(&format!("/console/admin/tenants/{name}")).into_response())
}

#[derive(Deserialize)]
pub struct PolicyForm {
    csrf: Option<String>,
    allow: String,
    deny: String,
}

pub async fn set_policy(
    State(state): State<ConsoleState>,
    headers: Browser,
    Path(name): Path<String>,
    Form(f): Form<PolicyForm>,
) -> Answer {
    let (s, admin) = admin_of(&state, &headers).await?;
    s.check_csrf(f.csrf.as_deref())?;
    let policy = crate::core::egress::tenant_policy_from_rules(&rules_of(&f.allow), &rules_of(&f.deny))?;
    state.core.set_policy_as_admin(&admin, &name, policy).await?;
    Ok(Redirect::to(&format!("/console/admin/tenants/{name}")).into_response())
}

#[derive(Deserialize)]
pub struct KeyForm {
    csrf: Option<String>,
    name: Option<String>,
    e2b: Option<String>,
    key: Option<String>,
}

pub async fn create_key(
    State(state): State<ConsoleState>,
    headers: Browser,
    Path(name): Path<String>,
    Form(f): Form<KeyForm>,
) -> Answer {
    let (s, admin) = admin_of(&state, &headers).await?;
    s.check_csrf(f.csrf.as_deref())?;
    let key_name = f
        .name
        .as_deref()
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .unwrap_or("console");
    // The key is on this response only (never in a URL or a redirect).
    let key = state.core.mint_key(&admin, &name, key_name, f.e2b.is_some()).await?;
    tenant_page(&state, &s, &admin, &name, Some(&key)).await
}

pub async fn revoke_key(
    State(state): State<ConsoleState>,
    headers: Browser,
    Path(name): Path<String>,
    Form(f): Form<KeyForm>,
) -> Answer {
    let (s, admin) = admin_of(&state, &headers).await?;
    s.check_csrf(f.csrf.as_deref())?;
    state
        .core
        .revoke_key(&admin, &name, f.key.as_deref().unwrap_or(""))
        .await?;
    Ok(Redirect::to(&format!("/console/admin/tenants/{name}")).into_response())
}

#[derive(Deserialize)]
pub struct AuditQuery {
    tenant: Option<String>,
    action: Option<String>,
    before: Option<i64>,
}

pub async fn audit(State(state): State<ConsoleState>, headers: Browser, Query(q): Query<AuditQuery>) -> Answer {
    let (s, admin) = admin_of(&state, &headers).await?;
    let some = |v: Option<String>| v.map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    let filter = AuditFilter {
        before_seq: q.before,
        tenant: some(q.tenant.clone()),
        action: some(q.action.clone()),
    };
    let rows = state.core.audit_log(&admin, &filter, 100).await?;
    let next = (rows.len() == 100).then(|| rows.last().map(|r| r.seq)).flatten();
    let body = html! {
        h1 { "Audit log" }
        form.card method="get" action="/console/admin/audit" #audit-filter {
            label { "Tenant " input name="tenant" value=(filter.tenant.as_deref().unwrap_or("")); }
            label { "Action " input name="action" value=(filter.action.as_deref().unwrap_or("")) placeholder="sandbox.create"; }
            button type="submit" { "Filter" }
        }
        table #audit {
            thead { tr { th { "When" } th { "Actor" } th { "Tenant" } th { "Action" } th { "Object" } th { "Result" } th { "Count" } } }
            tbody {
                @for r in &rows {
                    tr { td { (r.at) } td.actor { (r.actor) } td { (r.tenant.as_deref().unwrap_or("-")) } td.action { (r.action) } td { (r.object.as_deref().unwrap_or("-")) } td.result { (r.result) } td { (r.count) } }
                }
            }
        }
        @if let Some(n) = next {
            p { a href={ "/console/admin/audit?before=" (n) "&tenant=" (filter.tenant.as_deref().unwrap_or("")) "&action=" (filter.action.as_deref().unwrap_or("")) } { "Older" } }
        }
    };
    Ok(page::layout("Audit log", Some(&s), body).into_response())
}

pub async fn system(State(state): State<ConsoleState>, headers: Browser) -> Answer {
    let (s, admin) = admin_of(&state, &headers).await?;
    let core = &state.core;
    let budgets = core.node_budgets(&admin).await?;
    let nodes = core.nodes_info();
    let pools = core.pools();
    let templates = core.templates();
    let body = html! {
        h1 { "System" }
        h2 { "Nodes" }
        table #nodes {
            thead { tr { th { "Node" } th { "State" } th { "CPUs" } th { "Memory (MiB)" } th { "Disk free (MiB)" } th { "Running" } } }
            tbody { @for n in &nodes { tr {
                td { @if n.name.is_empty() { "local" } @else { (n.name) } }
                td { (format!("{:?}", n.state).to_lowercase()) @if let Some(r) = &n.reason { " (" (r) ")" } }
                td { (n.cpus) } td { (n.memory_mib) } td { (n.disk_free_mib) } td { (n.sandboxes_running) }
            } } }
        }
        h2 { "Node budgets" }
        table #budgets {
            thead { tr { th { "Node" } th { "vCPU used / budget" } th { "Memory MiB used / budget" } th { "Disk MiB used / budget" } } }
            tbody { @for b in &budgets { tr {
                td { (b.name) }
                td { (b.used.vcpu) " / " (b.budget.vcpu) }
                td { (b.used.memory_mib) " / " (b.budget.memory_mib) }
                td { (b.used.disk_mib) " / " (b.budget.disk_mib) }
            } } }
        }
        h2 { "Warm pools" }
        table #pools {
            thead { tr { th { "Template" } th { "Shape" } th { "Size" } th { "Ready" } th { "Hits" } th { "Misses" } } }
            tbody { @for p in &pools { tr {
                td { (p.template) } td { (p.resources.vcpu) " vCPU, " (p.resources.memory_mib) " MiB" }
                td { (p.size) } td { (p.ready) } td { (p.hits) } td { (p.misses) }
            } } }
        }
        form.card method="post" action="/console/admin/pools" #set-pool {
            (csrf(&s))
            label { "Template " select name="template" { @for t in &templates { option value=(t.name) { (t.name) } } } }
            label { "Size " input type="number" name="size" min="0" max="64" value="1"; }
            button type="submit" { "Resize pool" }
        }
        h2 { "Templates" }
        table #templates {
            thead { tr { th { "Template" } th { "Digest" } th { "Kernel" } th { "Size (MiB)" } th { "Built" } } }
            tbody { @for t in &templates { tr {
                td { (t.name) } td { code { (t.digest.get(..19).unwrap_or(&t.digest)) } } td { (t.kernel_version) }
                td { (t.size_bytes >> 20) } td { (t.built_at) }
            } } }
        }
    };
    Ok(page::layout("System", Some(&s), body).into_response())
}

#[derive(Deserialize)]
pub struct PoolForm {
    csrf: Option<String>,
    template: String,
    size: String,
}

pub async fn set_pool(State(state): State<ConsoleState>, headers: Browser, Form(f): Form<PoolForm>) -> Answer {
    let (s, admin) = admin_of(&state, &headers).await?;
    s.check_csrf(f.csrf.as_deref())?;
    let Ok(size) = f.size.trim().parse::<usize>() else {
        return Err(Refused::Bad(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_field",
            "size: a whole number".into(),
        ));
    };
    let req = crate::model::PoolRequest {
        template: f.template,
        resources: None,
        size,
    };
    let _ = state.core.set_pool(&admin, &req).await?;
    Ok(Redirect::to("/console/admin/system").into_response())
}
