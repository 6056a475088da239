//! `GET /metrics`: who may read it, and what a scrape reads from the store and the nodes
//! (the families and what the process counts itself are `crate::telemetry`'s).
//!
//! A scrape is allowed to the platform account's admin token and to scrape tokens the admin
//! mints (`/v1/admin/scrape-tokens`, stored hashed); `serve --metrics-listen` serves the same
//! text without a credential on an address the operator keeps private.

use super::accounts::Admin;
use super::Core;
use crate::error::{CoreError, CoreResult, Kind};
use crate::model::{NewScrapeToken, NodeState, ScrapeTokenView};
use crate::records::{now_ms, rfc3339, ScrapeTokenRecord};
use crate::store::token_hash;
use crate::telemetry::{Amounts, NodeObserved, Observed, Telemetry};
use std::sync::Arc;
use std::time::Duration;

/// How long a scrape waits for one sandbox's egress counters (a remote node's answer).
const EGRESS_WITHIN: Duration = Duration::from_secs(2);
/// Sandboxes whose egress counters are asked for at once.
const EGRESS_AT_ONCE: usize = 16;

fn view(r: ScrapeTokenRecord) -> ScrapeTokenView {
    ScrapeTokenView {
        id: r.id,
        name: r.name,
        created_by: r.created_by,
        created_at: rfc3339(r.created_at_ms),
    }
}

impl Core {
    /// What this process counts.
    pub fn telemetry(&self) -> &Arc<Telemetry> {
        self.engine.telemetry()
    }

    /// Whether `bearer` may read `GET /metrics`: a scrape token, or the admin's token.
    pub async fn scrape_allowed(&self, bearer: Option<&str>) -> CoreResult<()> {
        if let Some(token) = bearer {
            if self.store.scrape_token(&token_hash(token)).await?.is_some() {
                return Ok(());
            }
        }
        self.admin(bearer).await.map(drop).map_err(|e| match e {
            CoreError::Unauthenticated(_) => CoreError::Unauthenticated(
                "missing or unknown scrape token: mint one with `airlock scrape-token create` \
                 (or present the admin's token)"
                    .into(),
            ),
            e => e,
        })
    }

    /// The metrics as Prometheus' text exposition format.
    pub async fn metrics_text(&self) -> CoreResult<String> {
        let observed = self.observe().await?;
        Ok(self.telemetry().encode(observed).await)
    }

    /// What a scrape reads: the store's sandboxes and sessions, each live sandbox's egress
    /// counters, the nodes' pools and budgets.
    async fn observe(&self) -> CoreResult<Observed> {
        let mut o = Observed {
            tenants: self
                .store
                .list_tenants()
                .await?
                .into_iter()
                .map(|(t, _)| (t.id, t.name))
                .collect(),
            pools: self.nodes.pools(),
            ..Default::default()
        };
        let live = self.store.live_sandboxes().await?;
        for row in &live {
            let template = match row.template.starts_with(super::builds::BUILT_PREFIX) {
                true => crate::telemetry::BUILT_TEMPLATES.to_string(),
                false => row.template.clone(),
            };
            *o.sandboxes
                .entry((row.state.as_str(), template, row.tenant_id.clone()))
                .or_default() += 1;
        }
        let tenant_of: std::collections::HashMap<&str, &str> =
            live.iter().map(|r| (r.id.as_str(), r.tenant_id.as_str())).collect();
        for (sandbox, n) in self.store.running_sessions().await? {
            if let Some(tenant) = tenant_of.get(sandbox.as_str()) {
                *o.sessions.entry(tenant.to_string()).or_default() += n;
            }
        }
        {
            use futures_util::StreamExt;
            // Owned, so the stream's futures borrow nothing of this call (they must be `Send`).
            let running: Vec<(String, String)> = live
                .iter()
                .filter(|r| r.state == crate::model::SandboxState::Running)
                .map(|r| (r.id.clone(), r.tenant_id.clone()))
                .collect();
            let nodes = self.nodes.clone();
            o.egress = futures_util::stream::iter(running)
                .map(move |(id, tenant)| {
                    let nodes = nodes.clone();
                    async move {
                        let snapshot = tokio::time::timeout(EGRESS_WITHIN, nodes.egress(&id))
                            .await
                            .ok()
                            .flatten()?;
                        Some((id, tenant, snapshot.counters))
                    }
                })
                .buffer_unordered(EGRESS_AT_ONCE)
                .filter_map(std::future::ready)
                .collect()
                .await;
        }
        o.nodes = self.node_usage(&live);
        Ok(o)
    }

    /// Each node's budgets and what the live sandboxes hold of them (the console's system page).
    pub async fn node_budgets(&self, _admin: &Admin) -> CoreResult<Vec<NodeObserved>> {
        Ok(self.node_usage(&self.store.live_sandboxes().await?))
    }

    /// Each node's budgets (vcpu, memory, disk) and what `live` holds of them: suspended
    /// sandboxes hold only disk.
    fn node_usage(&self, live: &[crate::records::SandboxRecord]) -> Vec<NodeObserved> {
        let mut used: std::collections::HashMap<&str, Amounts> = Default::default();
        for row in live {
            let u = used.entry(row.node.as_str()).or_default();
            if row.state != crate::model::SandboxState::Suspended {
                u.vcpu += u64::from(row.resources.vcpu);
                u.memory_mib += u64::from(row.resources.memory_mib);
            }
            u.disk_mib += u64::from(row.resources.disk_mib);
        }
        let members = self.nodes.members();
        self.nodes_info()
            .into_iter()
            .filter_map(|info| {
                let member = members.iter().find(|m| m.name == info.name)?;
                let budget = self.config.budget(&member.capacity);
                Some(NodeObserved {
                    ready: info.state == NodeState::Ready,
                    used: used.get(info.name.as_str()).copied().unwrap_or_default(),
                    budget: Amounts {
                        vcpu: budget.vcpu,
                        memory_mib: budget.memory_mib,
                        disk_mib: budget.disk_mib,
                    },
                    name: if info.name.is_empty() {
                        "local".into()
                    } else {
                        info.name
                    },
                })
            })
            .collect()
    }

    /// Mint a scrape token named `name`; the token is shown this once.
    pub async fn mint_scrape_token(&self, admin: &Admin, name: &str) -> CoreResult<NewScrapeToken> {
        let r = async {
            if name.len() > 128 || name.chars().any(char::is_control) {
                return Err(CoreError::invalid(
                    "name",
                    "at most 128 characters, no control characters",
                ));
            }
            let token = format!("ast_{}", airlock_runtime::datadir::random_hex(24));
            let record = ScrapeTokenRecord {
                id: format!("st_{}", airlock_runtime::datadir::random_hex(8)),
                name: name.to_string(),
                created_by: admin.account.clone(),
                created_at_ms: now_ms(),
            };
            self.store.insert_scrape_token(&record, &token_hash(&token)).await?;
            Ok(NewScrapeToken {
                token,
                info: view(record),
            })
        }
        .await;
        let object = r.as_ref().ok().map(|t| t.info.id.clone());
        self.audit(
            &admin.account,
            None,
            "scrape_token.create",
            object.as_deref(),
            Self::outcome(&r),
        )
        .await;
        r
    }

    pub async fn scrape_tokens(&self, _admin: &Admin) -> CoreResult<Vec<ScrapeTokenView>> {
        Ok(self.store.scrape_tokens().await?.into_iter().map(view).collect())
    }

    /// Revoke scrape token `id` (its next scrape is refused).
    pub async fn revoke_scrape_token(&self, admin: &Admin, id: &str) -> CoreResult<()> {
        let r = async {
            if !self.store.delete_scrape_token(id).await? {
                return Err(CoreError::not_found(Kind::ScrapeToken, id));
            }
            Ok(())
        }
        .await;
        self.audit(&admin.account, None, "scrape_token.revoke", Some(id), Self::outcome(&r))
            .await;
        r
    }
}
