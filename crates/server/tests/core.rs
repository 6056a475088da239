//! The whole server in-process over the fake VMM: both doors, the engine's crash recovery, VMs
//! that die on their own, admission. No VM boots; every test takes a second or two.
//!
//! The harness (`Server`, one per server life, restartable) is `common/`, shared with `limits.rs`.
//! The tests are in `core/` by concern (recovery, doors, budgets, egress, console, quotas); this
//! file holds what several share.

mod common;
// Disk held by snapshots and saved memory, tenants' ids, default quotas (issue 23).
#[path = "core/budgets.rs"]
mod budgets;
// Many nodes behind many replicas (issue 25).
#[path = "core/cluster.rs"]
mod cluster;
#[path = "core/console.rs"]
mod console;
#[path = "core/doors.rs"]
mod doors;
#[path = "core/egress.rs"]
mod egress;
// The web console's pages and refusals, over the fake VMM (issue 28).
#[path = "core/web_console.rs"]
mod web_console;
// Lifecycle events and webhooks (issue 28).
#[path = "core/events.rs"]
mod events;
#[path = "core/kube.rs"]
mod kube;
// `GET /metrics` (issue 28).
#[path = "core/metrics.rs"]
mod metrics;
#[path = "core/quotas.rs"]
mod quotas;
#[path = "core/recovery.rs"]
mod recovery;
// The core over a node's HTTP face (issue 25).
#[path = "core/remote.rs"]
mod remote;
// Runs of a sandbox's VM, and deletes that name one (issue 25).
#[path = "core/runs.rs"]
mod runs;
// Templates and snapshots nodes share through object storage (issue 25).
#[path = "core/shared.rs"]
mod shared;

use airlock_runtime::fake;
use airlock_runtime::vmm::pid_alive;
use airlock_server::core::Config;
use airlock_server::model::{Operation, OperationKind, OperationState, Resources, SandboxState};
use airlock_server::nodes::Capacity;
use airlock_server::records::{now_ms, rfc3339, SandboxRecord};
use airlock_server::store::KeyFormat;
use axum::body::Body;
use axum::http::Method;
use common::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A sandbox record as `Core::create_sandbox` makes it.
fn sandbox_row(id: &str, tenant_id: &str) -> SandboxRecord {
    let r = airlock_runtime::Resources::default();
    SandboxRecord {
        id: id.into(),
        tenant_id: tenant_id.into(),
        state: SandboxState::Creating,
        template: "seed".into(),
        template_digest: String::new(),
        runtime: fake::NAME.into(),
        accel: "tcg".into(),
        resources: Resources {
            vcpu: r.vcpu,
            memory_mib: r.memory_mib,
            disk_mib: r.disk_mib,
        },
        env: BTreeMap::new(),
        metadata: BTreeMap::new(),
        created_at_ms: now_ms(),
        expires_at_ms: now_ms() + 300_000,
        egress: Default::default(),
        start: None,
        lifecycle: Default::default(),
        timeout_ms: 300_000,
        image_id: None,
        node: String::new(),
        run: String::new(),
    }
}

fn operation(kind: OperationKind, sandbox_id: &str) -> Operation {
    Operation {
        id: format!("op_{}_{sandbox_id}", kind.as_str()),
        kind,
        state: OperationState::Pending,
        sandbox_id: sandbox_id.into(),
        error: None,
        created_at: rfc3339(now_ms()),
        finished_at: None,
    }
}

/// What a server that crashed in the middle of `kind` leaves in the store: the operation,
/// recorded and marked running, never finished.
async fn unfinished(server: &Server, kind: OperationKind, sandbox_id: &str) -> String {
    let store = &server.core().store();
    let op = operation(kind, sandbox_id);
    store.insert_operation(&server.tenant_id().await, &op).await.unwrap();
    store
        .set_operation_state(&op.id, OperationState::Running)
        .await
        .unwrap();
    op.id
}

/// A sandbox and its create operation recorded, the operation running, as a crash mid-create
/// leaves them.
async fn crashed_create(server: &Server, id: &str) -> String {
    let store = &server.core().store();
    let row = sandbox_row(id, &server.tenant_id().await);
    let op = operation(OperationKind::Create, id);
    store.insert_create(&row, &op, None, server.max).await.unwrap();
    store
        .set_operation_state(&op.id, OperationState::Running)
        .await
        .unwrap();
    op.id
}

async fn set_quota(server: &Server, quota: Value) {
    let q: airlock_server::model::Quota = serde_json::from_value(quota).unwrap();
    server.core().set_tenant_quota("default", q).await.unwrap();
}

async fn create_sized(server: &Server, vcpu: u32, memory_mib: u32, disk_mib: u32) -> (u16, Value) {
    let body =
        json!({ "template": "seed", "resources": { "vcpu": vcpu, "memory_mib": memory_mib, "disk_mib": disk_mib } });
    server.v1(Method::POST, "/sandboxes", Some(body)).await
}

async fn live_count(server: &Server) -> usize {
    let (_, list) = server.v1(Method::GET, "/sandboxes", None).await;
    list["sandboxes"].as_array().unwrap().len()
}

async fn delete_all(server: &Server) {
    let (_, list) = server.v1(Method::GET, "/sandboxes", None).await;
    for sb in list["sandboxes"].as_array().unwrap() {
        server.delete(sb["id"].as_str().unwrap()).await;
    }
}

/// A node of `cpus`, `memory_mib` and free disk, nothing held yet.
fn node(cpus: u32, memory_mib: u64, disk_free_mib: u64) -> Capacity {
    Capacity {
        cpus,
        memory_mib,
        sandboxes_running: 0,
        disk_free_mib,
        ..Capacity::default()
    }
}
