//! Snapshots (a running sandbox saved with its memory, processes and files; new sandboxes start
//! from one by naming it as their template) and forks (N sandboxes from one sandbox as it is
//! now). Both are owned by a tenant: another tenant's snapshot answers like a missing one.

use super::sandboxes::{acting_tenant, CreateSandbox, Created};
use super::{Core, CoreError, CoreResult, Kind, Principal};
use crate::engine::Action;
use crate::error::Conflict;
use crate::model::{SandboxState, Snapshot};
use crate::records::{now_ms, SnapshotKind, SnapshotRecord, Tenant};
use crate::store::parse_page_token;
use std::time::Duration;

/// The most sandboxes one fork makes (E2B's limit too).
pub const MAX_FORK: u32 = 20;

/// A page of a tenant's snapshots, newest first (E2B's `GET /snapshots`).
#[derive(Debug, Clone, Default)]
pub struct ListSnapshots {
    /// Only snapshots of this sandbox.
    pub sandbox_id: Option<String>,
    /// Only the snapshot of this name.
    pub name: Option<String>,
    /// 1 to 100.
    pub limit: u32,
    /// The previous page's `next_page_token`.
    pub page_token: Option<String>,
}

pub struct SnapshotPage {
    pub snapshots: Vec<SnapshotRecord>,
    /// Set when there is a page after this one.
    pub next_page_token: Option<String>,
}

/// A snapshot name: what a create names as its template, so nothing a template could be called.
fn check_name(name: &str) -> CoreResult<()> {
    let ok = (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && !name.starts_with("snap_");
    if ok {
        Ok(())
    } else {
        Err(CoreError::invalid(
            "name",
            "1 to 64 letters, digits, '-', '_' or '.', not starting with snap_",
        ))
    }
}

impl Core {
    /// Save the tenant's running (or paused) sandbox as a snapshot while it runs on.
    async fn snapshot_unaudited(
        &self,
        tenant: &Tenant,
        sandbox_id: &str,
        name: Option<String>,
        kind: SnapshotKind,
    ) -> CoreResult<SnapshotRecord> {
        if let Some(n) = &name {
            check_name(n)?;
            // A snapshot of that name the store refuses with its admission (atomically).
            if self.resolve_template(n).is_ok() {
                return Err(Conflict::NameTaken(n.clone()).into());
            }
        }
        let row = self.sandbox(tenant, sandbox_id).await?;
        self.refuse_if_mounting(&row.id).await?;
        // Not a paused one: QEMU leaves a saved VM that was not running in its after-migration
        // state, which no later save can start from.
        if row.state != SandboxState::Running {
            return Err(CoreError::InvalidState {
                id: sandbox_id.into(),
                state: row.state,
                need: "only a running sandbox can be saved; resume it first".into(),
            });
        }
        let snapshot = SnapshotRecord {
            id: format!("snap_{}", airlock_runtime::datadir::random_hex(10)),
            tenant_id: tenant.id.clone(),
            name,
            kind,
            sandbox_id: sandbox_id.into(),
            template: row.template.clone(),
            resources: row.resources,
            bytes: 0,
            digest: None,
            created_at_ms: now_ms(),
            shared: None,
        };
        // Its size is known only once saved; until then it holds the most a save writes (the
        // sandbox's disk copied whole and its memory), so a burst of saves can't overshoot.
        let reserve_mib = row.resources.disk_mib as u64 + row.resources.memory_mib as u64;
        let budget = self.budget_of(&row.node);
        let op = self
            .engine
            .submit(Action::Snapshot {
                sandbox: row,
                snapshot: snapshot.clone(),
                reserve_mib,
                quota: self.quota(tenant).await?,
                budget,
            })
            .await
            .map_err(|e| e.for_tenant(&tenant.name))?
            .operation;
        let op = self.engine.wait(&op).await?;
        if let Some(e) = op.error {
            return Err(CoreError::Unreachable {
                id: sandbox_id.into(),
                reason: crate::error::Unreachable::NotSaved(e.message),
            });
        }
        self.store
            .get_snapshot(&tenant.id, &snapshot.id)
            .await?
            .ok_or_else(|| CoreError::not_found(Kind::Snapshot, &snapshot.id))
    }

    /// `POST /v1/sandboxes/{id}/snapshots`, E2B `create_snapshot`.
    pub async fn create_snapshot(
        &self,
        principal: &Principal,
        sandbox_id: &str,
        name: Option<String>,
    ) -> CoreResult<Snapshot> {
        let tenant = acting_tenant(principal)?;
        let r = self
            .snapshot_unaudited(tenant, sandbox_id, name, SnapshotKind::Snapshot)
            .await;
        let object = r
            .as_ref()
            .map(|s| s.id.clone())
            .unwrap_or_else(|_| sandbox_id.to_string());
        self.audit(
            &principal.actor(),
            Some(&tenant.name),
            "snapshot.create",
            Some(&object),
            Self::outcome(&r),
        )
        .await;
        r.map(|s| s.view())
    }

    /// The tenant's snapshot by id, name or content digest.
    pub async fn snapshot(&self, tenant: &Tenant, id: &str) -> CoreResult<SnapshotRecord> {
        match self.store.get_snapshot(&tenant.id, id).await? {
            Some(s) if s.kind == SnapshotKind::Snapshot => Ok(s),
            _ => Err(CoreError::not_found(Kind::Snapshot, id)),
        }
    }

    /// The tenant's snapshots, oldest first (of one sandbox if given).
    pub async fn list_snapshots(&self, tenant: &Tenant, sandbox_id: Option<&str>) -> CoreResult<Vec<SnapshotRecord>> {
        Ok(self.store.list_snapshots(&tenant.id, sandbox_id).await?)
    }

    /// One page of the tenant's snapshots, newest first; the token resumes after the page's last
    /// (its creation time and id), so snapshots made or deleted meanwhile shift nothing.
    pub async fn list_snapshots_page(&self, tenant: &Tenant, q: ListSnapshots) -> CoreResult<SnapshotPage> {
        if !(1..=100).contains(&q.limit) {
            return Err(CoreError::invalid(
                "limit",
                format!("must be between 1 and 100, got {}", q.limit),
            ));
        }
        let after = match q.page_token.as_deref().filter(|t| !t.is_empty()) {
            None => None,
            Some(t) => Some(
                parse_page_token(t).ok_or_else(|| CoreError::invalid("nextToken", "not a token this server issued"))?,
            ),
        };
        let mut rows = self.store.list_snapshots(&tenant.id, q.sandbox_id.as_deref()).await?;
        rows.retain(|s| q.name.as_ref().is_none_or(|n| s.name.as_ref() == Some(n)));
        rows.sort_by(|a, b| (b.created_at_ms, &b.id).cmp(&(a.created_at_ms, &a.id)));
        if let Some((ms, id)) = &after {
            rows.retain(|s| (s.created_at_ms, &s.id) < (*ms, id));
        }
        let limit = q.limit as usize;
        let next_page_token = (rows.len() > limit).then(|| {
            let last = &rows[limit - 1];
            format!("{}.{}", last.created_at_ms, last.id)
        });
        rows.truncate(limit);
        Ok(SnapshotPage {
            snapshots: rows,
            next_page_token,
        })
    }

    /// Delete a snapshot; sandboxes made from it run on (they hold their own links to its disk).
    pub async fn delete_snapshot(&self, principal: &Principal, id: &str) -> CoreResult<()> {
        let tenant = acting_tenant(principal)?;
        let r = async {
            let s = self.snapshot(tenant, id).await?;
            self.remove_image(&s).await
        }
        .await;
        self.audit(
            &principal.actor(),
            Some(&tenant.name),
            "snapshot.delete",
            Some(id),
            Self::outcome(&r),
        )
        .await;
        r
    }

    async fn remove_image(&self, s: &SnapshotRecord) -> CoreResult<()> {
        self.store.delete_snapshot(&s.tenant_id, &s.id).await?;
        self.delete_image_everywhere(s).await
    }

    /// Snapshot `s`'s image off every node that has it and, shared, out of object storage.
    pub(crate) async fn delete_image_everywhere(&self, s: &SnapshotRecord) -> CoreResult<()> {
        self.nodes.delete_image(&s.id).await?;
        if s.shared.is_some() {
            match self.nodes.delete_parked(&s.id).await {
                Ok(()) | Err(crate::nodes::NodeError::Unsupported(_)) => {}
                Err(e) => tracing::warn!(snapshot = %s.id, "its image stays in object storage: {e}"),
            }
        }
        Ok(())
    }

    /// `count` new sandboxes, each with the memory, processes and files `sandbox_id` has now
    /// (saved once while it runs on), then independent. Each child is a create of its own
    /// (admitted under the tenant's quota, with the parent's egress); the image they start from
    /// goes once every child has started (or failed to).
    pub async fn fork_sandbox(
        &self,
        principal: &Principal,
        sandbox_id: &str,
        count: u32,
        timeout: Option<Duration>,
    ) -> CoreResult<Vec<CoreResult<Created>>> {
        let tenant = acting_tenant(principal)?;
        let r = self.fork_unaudited(principal, tenant, sandbox_id, count, timeout).await;
        self.audit(
            &principal.actor(),
            Some(&tenant.name),
            "sandbox.fork",
            Some(sandbox_id),
            Self::outcome(&r),
        )
        .await;
        r
    }

    async fn fork_unaudited(
        &self,
        principal: &Principal,
        tenant: &Tenant,
        sandbox_id: &str,
        count: u32,
        timeout: Option<Duration>,
    ) -> CoreResult<Vec<CoreResult<Created>>> {
        if !(1..=MAX_FORK).contains(&count) {
            return Err(CoreError::invalid(
                "count",
                format!("must be between 1 and {MAX_FORK}, got {count}"),
            ));
        }
        let parent = self.sandbox(tenant, sandbox_id).await?;
        let image = self
            .snapshot_unaudited(tenant, sandbox_id, None, SnapshotKind::Fork)
            .await?;
        let mut children = Vec::new();
        for _ in 0..count {
            let req = CreateSandbox {
                template: image.id.clone(),
                timeout,
                env: parent.env.clone(),
                metadata: parent.metadata.clone(),
                lifecycle: parent.lifecycle,
                inherit_egress: Some(parent.egress.clone()),
                ..Default::default()
            };
            children.push(self.create_sandbox(principal, req).await);
        }
        let made: Vec<&str> = children.iter().flatten().map(|c| c.sandbox_id.as_str()).collect();
        self.engine
            .record_event(
                sandbox_id,
                crate::model::EventKind::Forked,
                serde_json::json!({ "children": made }),
            )
            .await;
        // The image goes once every child is past its restore.
        let core = self.clone();
        let ops: Vec<_> = children.iter().flatten().map(|c| c.operation.clone()).collect();
        tokio::spawn(async move {
            for op in ops {
                let _ = core.engine.wait(&op).await;
            }
            if let Err(e) = core.remove_image(&image).await {
                tracing::warn!(image = %image.id, "cannot remove a fork's image: {e}");
            }
        });
        Ok(children)
    }
}
