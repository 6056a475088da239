//! A tenant's pages: its sandboxes (list, create from a template or snapshot, lifecycle actions
//! with their operation's progress) and one sandbox's page (terminal, sessions, files, metrics,
//! egress, events).

use super::page::{self, age, csrf, time, Answer, Refused};
use super::{signed, Browser, ConsoleState, Signed};
use crate::core::sandboxes::{Change, CreateSandbox, ListSandboxes};
use crate::core::Principal;
use crate::error::CoreError;
use crate::model::{Lifecycle, OperationState, SandboxState};
use crate::records::{SandboxRecord, Tenant};
use axum::body::Body;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Redirect};
use axum::Form;
use maud::{html, Markup};
use serde::Deserialize;

/// States a sandbox passes through on its way somewhere: its page refreshes while in one.
fn settling(s: SandboxState) -> bool {
    matches!(
        s,
        SandboxState::Creating | SandboxState::Resuming | SandboxState::Deleting
    )
}

pub(super) fn tenant_of(s: &Signed) -> Result<(Principal, Tenant), Refused> {
    s.tenant().map(|(p, t)| (p.clone(), t.clone()))
}

#[derive(Deserialize, Default)]
pub struct ListQuery {
    op: Option<String>,
}

pub async fn list(State(state): State<ConsoleState>, headers: Browser, Query(q): Query<ListQuery>) -> Answer {
    let s = signed(&state, &headers, true).await?;
    let (_, tenant) = tenant_of(&s)?;
    let page_of = state
        .core
        .list_sandboxes(
            &tenant,
            ListSandboxes {
                limit: 100,
                newest_first: true,
                ..Default::default()
            },
        )
        .await?;
    let rows = page_of.sandboxes;
    let snapshots = state.core.list_snapshots(&tenant, None).await.unwrap_or_default();
    let (principal, _) = tenant_of(&s)?;
    let webhooks = state.core.webhooks(&principal).await.unwrap_or_default();
    let templates = state.core.template_names();
    let op = match q.op {
        Some(id) => state.core.operation(&tenant, &id).await.ok(),
        None => None,
    };
    let refresh = rows.iter().any(|r| settling(r.state))
        || op
            .as_ref()
            .is_some_and(|o| o.state == OperationState::Pending || o.state == OperationState::Running);
    let body = html! {
        h1 { "Sandboxes" }
        div #status data-refresh=[refresh.then_some("2")] {
            @if let Some(op) = &op { (operation(op)) }
            table #sandboxes {
                thead { tr { th { "Sandbox" } th { "State" } th { "Template" } th { "Age" } th { "vCPU" } th { "Memory" } th { "Started by" } } }
                tbody {
                    @for r in &rows {
                        tr data-id=(r.id) {
                            td { a href={ "/console/sandboxes/" (r.id) } { (r.id) } }
                            td.state { (r.state.as_str()) }
                            td { (r.template) }
                            td { (age(r.created_at_ms)) }
                            td { (r.resources.vcpu) }
                            td { (r.resources.memory_mib) " MiB" }
                            td { @if let Some(st) = &r.start { (st.from) " (" (st.ms) " ms)" } @else { "-" } }
                        }
                    }
                }
            }
            @if rows.is_empty() { p.note { "No sandboxes yet." } }
        }
        @if !snapshots.is_empty() {
            h2 { "Snapshots" }
            table #snapshots {
                thead { tr { th { "Snapshot" } th { "Name" } th { "From" } th { "Template" } th { "Size (MiB)" } th { "Saved" } } }
                tbody { @for sn in &snapshots { tr {
                    td { (sn.id) } td { (sn.name.as_deref().unwrap_or("-")) } td { (sn.sandbox_id) }
                    td { (sn.template) } td { (sn.bytes >> 20) } td { (age(sn.created_at_ms)) " ago" }
                } } }
            }
        }
        @if !webhooks.is_empty() {
            h2 { "Webhooks" }
            table #webhooks {
                thead { tr { th { "Webhook" } th { "URL" } th { "Events" } th { "Enabled" } th { "Last answer" } th { "Failed tries" } } }
                tbody { @for w in &webhooks { tr {
                    td { (w.name) } td { code { (w.url) } }
                    td { @if w.events.is_empty() { "all" } @else { (w.events.join(", ")) } }
                    td { (if w.enabled { "yes" } else { "no" }) }
                    td { (w.last_status.map(|c| c.to_string()).or(w.last_error.clone()).unwrap_or_else(|| "-".into())) }
                    td { (w.attempts) }
                } } }
            }
            p.note { "Managed with " code { "airlock webhook" } " or " code { "/v1/webhooks" } "." }
        }
        h2 { "New sandbox" }
        form.card method="post" action="/console/sandboxes" #create {
            (csrf(&s))
            label { "From " select name="template" {
                optgroup label="Templates" { @for t in &templates { option value=(t) selected[t == "seed"] { (t) } } }
                @if !snapshots.is_empty() {
                    optgroup label="Snapshots" { @for sn in &snapshots { option value=(sn.id) { (sn.name.as_deref().unwrap_or(&sn.id)) " (" (sn.template) ")" } } }
                }
            } }
            label { "vCPU " input type="number" name="vcpu" min="1" max="16" placeholder="default"; }
            label { "Memory (MiB) " input type="number" name="memory_mib" min="128" step="128" placeholder="default"; }
            label { "Timeout " input name="timeout" value="15m" size="6"; }
            button type="submit" { "Create" }
        }
    };
    Ok(page::layout("Sandboxes", Some(&s), body).into_response())
}

fn operation(op: &crate::model::Operation) -> Markup {
    html! {
        p.op #operation data-state=(format!("{:?}", op.state).to_lowercase()) {
            "Operation " code { (op.id) } " (" (format!("{:?}", op.kind).to_lowercase()) "): "
            strong { (format!("{:?}", op.state).to_lowercase()) }
            @if let Some(e) = &op.error { " — " span.error { (e.code) ": " (e.message) } }
        }
    }
}

#[derive(Deserialize)]
pub struct CreateForm {
    csrf: Option<String>,
    template: String,
    vcpu: Option<String>,
    memory_mib: Option<String>,
    timeout: Option<String>,
}

pub async fn create(State(state): State<ConsoleState>, headers: Browser, Form(f): Form<CreateForm>) -> Answer {
    let s = signed(&state, &headers, true).await?;
    s.check_csrf(f.csrf.as_deref())?;
    let (principal, _) = tenant_of(&s)?;
    let req = (|| -> Result<CreateSandbox, CoreError> {
        let timeout = match f.timeout.as_deref().map(str::trim).filter(|t| !t.is_empty()) {
            None => None,
            Some(t) => Some(
                humantime::parse_duration(t)
                    .map_err(|e| CoreError::invalid("timeout", format!("{t:?}: {e} (say 15m, 1h)")))?,
            ),
        };
        Ok(CreateSandbox {
            template: f.template.clone(),
            runtime: None,
            vcpu: page::form_number("vcpu", f.vcpu.as_deref())?,
            memory_mib: page::form_number("memory_mib", f.memory_mib.as_deref())?,
            disk_mib: None,
            timeout,
            env: Default::default(),
            metadata: [("created_by".to_string(), "console".to_string())].into(),
            idempotency_key: None,
            egress: Default::default(),
            lifecycle: Lifecycle::default(),
            inherit_egress: None,
            from_saved: None,
            parent: None,
            volumes: vec![],
        })
    })();
    let c = state.core.create_sandbox(&principal, req?).await?;
    Ok(Redirect::to(&format!("/console/sandboxes/{}?op={}", c.sandbox_id, c.operation.id)).into_response())
}

#[derive(Deserialize)]
pub struct ActionForm {
    csrf: Option<String>,
    action: String,
}

pub async fn act(
    State(state): State<ConsoleState>,
    headers: Browser,
    Path(id): Path<String>,
    Form(f): Form<ActionForm>,
) -> Answer {
    let s = signed(&state, &headers, true).await?;
    s.check_csrf(f.csrf.as_deref())?;
    let (principal, _) = tenant_of(&s)?;
    let core = &state.core;
    let page = |op: &str| format!("/console/sandboxes/{id}?op={op}");
    let done = match f.action.as_str() {
        "pause" => core
            .change_sandbox(&principal, &id, Change::Pause)
            .await
            .map(|o| page(&o.id)),
        "suspend" => core
            .change_sandbox(&principal, &id, Change::Suspend)
            .await
            .map(|o| page(&o.id)),
        "resume" => core
            .change_sandbox(&principal, &id, Change::Resume)
            .await
            .map(|o| page(&o.id)),
        "delete" => core
            .delete_sandbox(&principal, &id)
            .await
            .map(|o| format!("/console/sandboxes?op={}", o.id)),
        "snapshot" => core
            .create_snapshot(&principal, &id, None)
            .await
            .map(|_| format!("/console/sandboxes/{id}?saved=1")),
        "fork" => match core.fork_sandbox(&principal, &id, 1, None).await {
            Ok(mut children) => match children.pop() {
                Some(Ok(c)) => Ok(format!("/console/sandboxes/{}?op={}", c.sandbox_id, c.operation.id)),
                Some(Err(e)) => Err(e),
                None => Ok(format!("/console/sandboxes/{id}")),
            },
            Err(e) => Err(e),
        },
        other => Err(CoreError::invalid(
            "action",
            format!("{other:?}: one of pause, suspend, resume, snapshot, fork, delete"),
        )),
    };
    let to = done?;
    Ok(Redirect::to(&to).into_response())
}

#[derive(Deserialize, Default)]
pub struct ShowQuery {
    op: Option<String>,
    /// The file browser's directory.
    dir: Option<String>,
    saved: Option<String>,
    uploaded: Option<String>,
}

pub async fn show(
    State(state): State<ConsoleState>,
    headers: Browser,
    Path(id): Path<String>,
    Query(q): Query<ShowQuery>,
) -> Answer {
    let s = signed(&state, &headers, true).await?;
    let (principal, tenant) = tenant_of(&s)?;
    let core = &state.core;
    let row = core.sandbox(&tenant, &id).await?;
    let op = match &q.op {
        Some(op) => core.operation(&tenant, op).await.ok(),
        None => None,
    };
    let running = row.state == SandboxState::Running;
    let dir = q.dir.clone().unwrap_or_else(|| "/home/user".into());
    let files = if running {
        Some(match core.files(&row).await {
            Ok(f) => f.list(&dir, 1).await,
            Err(e) => Err(e),
        })
    } else {
        None
    };
    let sessions = if running {
        core.sessions(&row).await.unwrap_or_default()
    } else {
        vec![]
    };
    let samples = core.sandbox_metrics(&row, None, None).await.unwrap_or_default();
    let egress = core.egress_report(&tenant, &id).await.ok();
    let events = core
        .events(&principal, Some(&id), None, Some(50))
        .await
        .map(|(e, _)| e)
        .unwrap_or_default();
    let refresh = settling(row.state)
        || op
            .as_ref()
            .is_some_and(|o| o.state == OperationState::Pending || o.state == OperationState::Running);
    let body = html! {
        h1 { "Sandbox " code #sandbox-id { (row.id) } }
        div #status data-refresh=[refresh.then_some("2")] {
            @if let Some(op) = &op { (operation(op)) }
            @if q.saved.is_some() { p.note { "Saved as a snapshot: it is offered under “From” on the sandboxes page." } }
            dl.facts {
                dt { "State" } dd #state { (row.state.as_str()) }
                dt { "Template" } dd { (row.template) }
                dt { "Resources" } dd { (row.resources.vcpu) " vCPU, " (row.resources.memory_mib) " MiB, " (row.resources.disk_mib) " MiB disk" }
                dt { "Started" } dd { @if let Some(st) = &row.start { (st.from) " in " (st.ms) " ms" } @else { "-" } }
                dt { "Created" } dd { (time(row.created_at_ms)) " (" (age(row.created_at_ms)) " ago)" }
                dt { "Ends" } dd { (time(row.expires_at_ms)) }
            }
        }
        div.actions {
            @for (action, label) in [("pause", "Pause"), ("suspend", "Suspend"), ("resume", "Resume"), ("snapshot", "Snapshot"), ("fork", "Fork"), ("delete", "Delete")] {
                form.inline method="post" action={ "/console/sandboxes/" (row.id) "/action" } {
                    (csrf(&s))
                    input type="hidden" name="action" value=(action);
                    button type="submit" #{ "do-" (action) } data-confirm=[(action == "delete").then_some("Delete this sandbox?")] { (label) }
                }
            }
        }
        @if running {
            h2 { "Terminal" }
            div #terminal data-ws={ "/console/sandboxes/" (row.id) "/terminal" } {}
        }
        h2 { "Metrics" }
        (charts(&samples))
        h2 { "Egress" }
        @if let Some(e) = &egress {
            p #egress-counters {
                "Connections allowed " strong { (e.counters.tcp_allowed) } ", denied " strong #tcp-denied { (e.counters.tcp_denied) }
                "; DNS answered " strong { (e.counters.dns_allowed) } ", refused " strong #dns-denied { (e.counters.dns_denied) }
                "; bytes sent " strong { (e.counters.bytes_sent) } ", received " strong { (e.counters.bytes_received) }
            }
            @let allowed = allowed_out(&e.policy);
            p { "Allowed out: " @if allowed.is_empty() { "nothing (no egress)" } @else { (allowed.join(", ")) } }
            table #denials {
                thead { tr { th { "When" } th { "Path" } th { "Destination" } th { "Rule" } } }
                tbody { @for d in e.recent_denials.iter().rev() { tr { td { (d.at) } td { (d.path) } td.dest { (d.destination) } td { (d.rule) } } } }
            }
        } @else { p.note { "No egress report." } }
        @if running {
            h2 { "Files" }
            p { "In " code #dir { (dir) } }
            @match &files {
                Some(Ok(list)) => {
                    table #files {
                        thead { tr { th { "Name" } th { "Size" } th { "Owner" } th {} } }
                        tbody {
                            @for f in list {
                                tr {
                                    @if matches!(f.kind, airlock_proto::FileKind::Dir) {
                                        td { a href={ "/console/sandboxes/" (row.id) "?dir=" (urlencode(&f.path)) } { (f.name) "/" } }
                                        td {} td { (f.owner) } td {}
                                    } @else {
                                        td { (f.name) }
                                        td { (f.size) }
                                        td { (f.owner) }
                                        td { a.download href={ "/console/sandboxes/" (row.id) "/download?path=" (urlencode(&f.path)) } { "Download" } }
                                    }
                                }
                            }
                        }
                    }
                }
                Some(Err(e)) => { p.error { (e.to_string()) } }
                None => {}
            }
            @if q.uploaded.is_some() { p.note #uploaded { "Uploaded." } }
            form.card method="post" enctype="multipart/form-data" action={ "/console/sandboxes/" (row.id) "/files" } #upload {
                (csrf(&s))
                input type="hidden" name="dir" value=(dir);
                input type="file" name="file" #upload-file;
                button type="submit" { "Upload" }
            }
            h2 { "Sessions" }
            table #sessions {
                thead { tr { th { "Session" } th { "Command" } th { "State" } th { "Exit" } th { "Started" } } }
                tbody {
                    @for se in &sessions {
                        tr { td { a href={ "/console/sandboxes/" (row.id) "/sessions/" (se.id) } { (se.id) } } td { code { (se.argv.join(" ")) } } td { @if se.exited { "exited" } @else { "running" } } td { (se.exit_code.map(|c| c.to_string()).unwrap_or_default()) } td { (age(se.started_at_ms)) " ago" } }
                    }
                }
            }
        }
        h2 { "Events" }
        table #events {
            thead { tr { th { "When" } th { "Event" } th { "Data" } } }
            tbody { @for e in &events { tr { td { (time(e.at_ms)) } td.kind { (e.kind) } td { code { (e.data.to_string()) } } } } }
        }
    };
    Ok(page::layout(&format!("Sandbox {}", row.id), Some(&s), body).into_response())
}

/// What the sandbox may reach: its tenant's allows and its profiles', by name.
fn allowed_out(p: &crate::model::EffectiveEgressPolicy) -> Vec<String> {
    let mut all = vec![];
    for rules in std::iter::once(&p.tenant_allow).chain(p.profiles.values()) {
        all.extend(rules.domains.iter().chain(&rules.ips).chain(&rules.cidrs).cloned());
    }
    all
}

fn urlencode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// CPU and memory over the sandbox's life as two small SVG line charts (drawn here: no chart
/// library, nothing for the browser to fetch).
fn charts(samples: &[crate::core::metrics::Sample]) -> Markup {
    let tail = &samples[samples.len().saturating_sub(120)..];
    let cpu: Vec<f64> = tail.iter().map(|s| s.metrics.cpu_used_pct).collect();
    let mem: Vec<f64> = tail
        .iter()
        .map(|s| s.metrics.mem_used_bytes as f64 / (1 << 20) as f64)
        .collect();
    let mem_max = tail
        .iter()
        .map(|s| s.metrics.mem_total_bytes as f64 / (1 << 20) as f64)
        .fold(1.0, f64::max);
    html! {
        div.charts #metrics data-samples=(tail.len()) {
            (chart("cpu", "CPU used (%)", &cpu, 100.0))
            (chart("memory", "Memory used (MiB)", &mem, mem_max))
        }
    }
}

fn chart(id: &str, title: &str, values: &[f64], max: f64) -> Markup {
    let (w, h) = (360.0, 100.0);
    let step = if values.len() > 1 {
        w / (values.len() - 1) as f64
    } else {
        0.0
    };
    let points: Vec<String> = values
        .iter()
        .enumerate()
        .map(|(i, v)| format!("{:.1},{:.1}", i as f64 * step, h - (v / max).clamp(0.0, 1.0) * h))
        .collect();
    let last = values.last().copied().unwrap_or(0.0);
    html! {
        figure.chart {
            svg #{ "chart-" (id) } viewBox="0 0 360 100" width="360" height="100" role="img" aria-label=(title) {
                rect x="0" y="0" width="360" height="100" fill="none" stroke="#ccc" {}
                polyline fill="none" stroke="#2563eb" stroke-width="2" points=(points.join(" ")) {}
                @for p in &points {
                    @let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                    circle.sample cx=(x) cy=(y) r="2.5" fill="#2563eb" {}
                }
                text x="4" y="12" font-size="10" fill="#667085" { (format!("{max:.0}")) }
            }
            figcaption { (title) ": " (format!("{last:.1}")) " (" (values.len()) " samples)" }
        }
    }
}

/// Upload into the sandbox: the form's fields in order, `csrf` first (nothing is read or written
/// before it checks), then `dir`, then the file, streamed to the guest.
pub async fn upload(
    State(state): State<ConsoleState>,
    headers: Browser,
    Path(id): Path<String>,
    mut form: Multipart,
) -> Answer {
    let s = signed(&state, &headers, false).await?;
    let (_, tenant) = tenant_of(&s)?;
    let bad = |m: &str| Err(Refused::Bad(StatusCode::BAD_REQUEST, "bad_request", m.to_string()));
    let mut csrf_ok = false;
    let mut dir = String::from("/home/user");
    loop {
        let field = match form.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => return bad("the form had no file"),
            Err(e) => return bad(&format!("the upload could not be read: {e}")),
        };
        match field.name() {
            Some("csrf") => {
                let v = field.text().await.unwrap_or_default();
                s.check_csrf(Some(&v))?;
                csrf_ok = true;
            }
            _ if !csrf_ok => return Err(Refused::Csrf),
            Some("dir") => dir = field.text().await.unwrap_or_default(),
            Some("file") => {
                let name = field.file_name().unwrap_or("").to_string();
                let name = name.rsplit(['/', '\\']).next().unwrap_or("").to_string();
                if name.is_empty() || name == "." || name == ".." {
                    return bad("choose a file to upload");
                }
                let path = format!("{}/{name}", dir.trim_end_matches('/'));
                let row = state.core.sandbox(&tenant, &id).await?;
                let files = state.core.files(&row).await?;
                // The field borrows the form; its chunks go to the write through a channel.
                let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(4);
                let pump = async move {
                    let mut field = field;
                    loop {
                        let chunk = match field.chunk().await {
                            Ok(Some(c)) => Ok(c),
                            Ok(None) => break,
                            Err(e) => Err(std::io::Error::other(e.to_string())),
                        };
                        let failed = chunk.is_err();
                        if tx.send(chunk).await.is_err() || failed {
                            break;
                        }
                    }
                };
                let data = tokio_stream::wrappers::ReceiverStream::new(rx);
                let (written, ()) = tokio::join!(files.write(&path, "user", data), pump);
                written?;
                let to = format!("/console/sandboxes/{id}?dir={}&uploaded=1", urlencode(&dir));
                return Ok(Redirect::to(&to).into_response());
            }
            _ => {}
        }
    }
}

#[derive(Deserialize)]
pub struct DownloadQuery {
    path: String,
}

pub async fn download(
    State(state): State<ConsoleState>,
    headers: Browser,
    Path(id): Path<String>,
    Query(q): Query<DownloadQuery>,
) -> Answer {
    let s = signed(&state, &headers, false).await?;
    let (_, tenant) = tenant_of(&s)?;
    let read = async {
        let row: SandboxRecord = state.core.sandbox(&tenant, &id).await?;
        state.core.files(&row).await?.read(&q.path).await
    };
    let stream = read.await?;
    {
        {
            let name = q.path.rsplit('/').next().unwrap_or("file");
            let safe: String = name
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || ".-_".contains(c) {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            Ok((
                [
                    (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                    (header::CONTENT_DISPOSITION, format!("attachment; filename=\"{safe}\"")),
                ],
                Body::from_stream(stream),
            )
                .into_response())
        }
    }
}
