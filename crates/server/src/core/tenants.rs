//! Tenants' quotas: the limits an operator set for a tenant over the server's defaults (a share
//! of the node's budgets, see `Config::default_quota`), and what its live sandboxes and
//! snapshots use of them. Admission itself is one atomic step in the store
//! (`insert_create_within`), so concurrent creates never overshoot.

use super::Core;
use crate::error::{CoreError, CoreResult, Kind};
use crate::model::{Quota, TenantInfo};
use crate::records::{now_ms, Tenant};

impl Core {
    /// A tenant by name, for the platform account's routes (a missing one is a 404).
    pub(crate) async fn tenant_named(&self, name: &str) -> CoreResult<Tenant> {
        self.store
            .tenant_by_name(name)
            .await?
            .ok_or_else(|| CoreError::not_found(Kind::Tenant, name))
    }

    /// The tenant's limits in force: its own, else the server's defaults.
    pub async fn quota(&self, tenant: &Tenant) -> CoreResult<Quota> {
        self.quota_of(&tenant.id).await
    }

    pub(crate) async fn quota_of(&self, tenant_id: &str) -> CoreResult<Quota> {
        let budget = self.config.budget(&self.nodes.capacity());
        Ok(self
            .store
            .quota(tenant_id)
            .await?
            .or(self.config.default_quota(&budget)))
    }

    /// `GET /v1/tenant`.
    pub async fn tenant_info(&self, tenant: &Tenant) -> CoreResult<TenantInfo> {
        Ok(TenantInfo {
            name: tenant.name.clone(),
            quota: self.quota(tenant).await?,
            usage: self.store.tenant_usage(&tenant.id, now_ms()).await?,
        })
    }

    /// The limits set for a tenant by name (`None`: the server's default).
    pub async fn tenant_quota(&self, tenant: &str) -> CoreResult<Quota> {
        let t = self.tenant_named(tenant).await?;
        Ok(self.store.quota(&t.id).await?)
    }

    /// Replace the limits set for a tenant by name.
    pub async fn set_tenant_quota(&self, tenant: &str, quota: Quota) -> CoreResult<()> {
        let t = self.tenant_named(tenant).await?;
        check_quota(&quota)?;
        Ok(self.store.set_quota(&t.id, &quota).await?)
    }
}

/// A zero is refused: it would lock the tenant out without saying why (revoke its keys instead).
pub fn check_quota(quota: &Quota) -> CoreResult<()> {
    for (name, v) in [
        ("sandboxes", quota.sandboxes.map(u64::from)),
        ("vcpu", quota.vcpu),
        ("memory_mib", quota.memory_mib),
        ("disk_mib", quota.disk_mib),
        ("sessions_per_sandbox", quota.sessions_per_sandbox.map(u64::from)),
        ("creates_per_minute", quota.creates_per_minute.map(u64::from)),
        ("volume_mib", quota.volume_mib),
    ] {
        if v == Some(0) {
            return Err(CoreError::invalid(
                name,
                "must be at least 1 (leave it out for no limit of the tenant's own)",
            ));
        }
    }
    Ok(())
}
