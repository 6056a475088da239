//! The platform's own account and what it administers: `root@local` (its password only as an
//! argon2 hash), short-lived admin tokens from signing in, tenants, their keys, and the audit
//! log. Tenant API keys never reach these: an admin route wants an admin token.

use super::{sign_in, Core};
use crate::error::{Conflict, CoreError, CoreResult, InternalError, Kind};
use crate::model::{AdminToken, AuditEntry, KeyView, NewKey, TenantSummary};
use crate::records::{now_ms, rfc3339, AuditRecord, KeyRecord};
use crate::store::{token_hash, AuditFilter, KeyFormat};
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;

/// The platform account.
pub const ROOT: &str = "root@local";
/// Where an operator chooses the console password; without it the first start makes one.
pub const PASSWORD_ENV: &str = "AIRLOCK_CONSOLE_PASSWORD";
/// How long an admin token from one sign-in lasts.
pub const ADMIN_TOKEN_TTL_MS: i64 = 60 * 60 * 1000;
/// Audit rows older than this are pruned.
pub const AUDIT_RETENTION_MS: i64 = 90 * 24 * 60 * 60 * 1000;

/// Who is acting, as audit rows name them (never a secret).
#[derive(Debug, Clone)]
pub struct Admin {
    pub account: String,
}

fn hash_password(password: &str) -> CoreResult<String> {
    let salt_bytes = hex::decode(airlock_runtime::datadir::random_hex(16)).expect("hex");
    let salt = SaltString::encode_b64(&salt_bytes).map_err(InternalError::PasswordHash)?;
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| InternalError::PasswordHash(e).into())
}

fn password_matches(password: &str, hash: &str) -> bool {
    PasswordHash::new(hash)
        .map(|h| Argon2::default().verify_password(password.as_bytes(), &h).is_ok())
        .unwrap_or(false)
}

/// 24 characters from 62: about 143 bits.
fn generate_password() -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789";
    let bytes = hex::decode(airlock_runtime::datadir::random_hex(48)).expect("hex");
    // Rejection-free enough: 256 % 57 skews by under 1%, far below what matters at this length.
    bytes
        .iter()
        .take(24)
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect()
}

/// A tenant name: what a URL path and a CLI argument carry without quoting.
pub fn check_tenant_name(name: &str) -> CoreResult<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(CoreError::invalid(
            "name",
            format!("{name:?}: 1 to 63 of a-z, 0-9 and '-', not starting with '-'"),
        ))
    }
}

fn key_view(k: KeyRecord) -> KeyView {
    KeyView {
        id: k.id,
        name: k.name,
        prefix: k.prefix,
        created_at: rfc3339(k.created_at_ms),
        last_used_at: k.last_used_at_ms.map(rfc3339),
        revoked_at: k.revoked_at_ms.map(rfc3339),
    }
}

impl Core {
    /// Make sure `root@local` has a password: the operator's (`AIRLOCK_CONSOLE_PASSWORD`, which
    /// also replaces a stored one), else one generated on the first start and returned (for the
    /// caller to print once; only its hash is kept).
    pub async fn ensure_console_account(&self, from_env: Option<&str>) -> CoreResult<Option<String>> {
        let stored = self.store.password_hash(ROOT).await?;
        match (from_env.filter(|p| !p.is_empty()), stored) {
            (Some(p), Some(h)) if password_matches(p, &h) => Ok(None),
            (Some(p), _) => {
                if p.len() < 12 {
                    return Err(CoreError::invalid(PASSWORD_ENV, "must be at least 12 characters"));
                }
                self.store.set_password_hash(ROOT, &hash_password(p)?).await?;
                Ok(None)
            }
            (None, Some(_)) => Ok(None),
            (None, None) => {
                let p = generate_password();
                self.store.set_password_hash(ROOT, &hash_password(&p)?).await?;
                Ok(Some(p))
            }
        }
    }

    /// Sign in as the platform account: a token for the admin routes, valid for an hour.
    /// `client` is the connection's peer address, whose window throttles the attempt (see
    /// `sign_in`).
    pub async fn login(
        &self,
        username: &str,
        password: &str,
        client: Option<std::net::IpAddr>,
    ) -> CoreResult<AdminToken> {
        // Reserved before argon2 runs: a guesser gets a handful of tries a minute however many
        // it sends at once, and can't keep the blocking pool busy with hashes either.
        let attempt = match sign_in::reserve(&self.store, client, now_ms()).await? {
            Ok(a) => a,
            Err((scope, retry_after_s)) => {
                self.audit("anonymous", None, "login", None, "throttled").await;
                return Err(CoreError::SignInThrottled {
                    from: match scope {
                        sign_in::Scope::Client => "from this address",
                        sign_in::Scope::Remote => "from remote addresses (sign in on the server's own host meanwhile)",
                    },
                    window_s: (sign_in::WINDOW_MS / 1000) as u64,
                    retry_after_s,
                });
            }
        };
        let stored = self.store.password_hash(ROOT).await?;
        let (pw, hash) = (password.to_string(), stored.clone());
        // argon2 is slow on purpose: off the async threads.
        let good = username == ROOT
            && tokio::task::spawn_blocking(move || hash.is_some_and(|h| password_matches(&pw, &h)))
                .await
                .unwrap_or(false);
        if !good {
            // The attempt, dropped, is the failure.
            drop(attempt);
            self.audit(
                if username == ROOT { ROOT } else { "anonymous" },
                None,
                "login",
                None,
                "unauthorized",
            )
            .await;
            return Err(CoreError::Unauthenticated("wrong username or password".into()));
        }
        attempt.succeeded();
        let token = format!("adm_{}", airlock_runtime::datadir::random_hex(24));
        let expires = now_ms() + ADMIN_TOKEN_TTL_MS;
        self.store
            .insert_admin_session(&token_hash(&token), ROOT, expires)
            .await?;
        self.audit(ROOT, None, "login", None, "ok").await;
        Ok(AdminToken {
            token,
            expires_at: rfc3339(expires),
        })
    }

    /// The admin behind a bearer token. A tenant's API key is refused as such (403), anything
    /// else as unauthenticated.
    pub async fn admin(&self, bearer: Option<&str>) -> CoreResult<Admin> {
        let Some(token) = bearer else {
            return Err(CoreError::Unauthenticated(
                "missing admin token; sign in with `airlock login` (POST /v1/admin/login)".into(),
            ));
        };
        if let Some(account) = self.store.admin_session(&token_hash(token), now_ms()).await? {
            return Ok(Admin { account });
        }
        if self.store.tenant_by_key(token).await?.is_some() {
            self.audit("tenant key", None, "admin", None, "forbidden").await;
            return Err(CoreError::Forbidden(
                "a tenant's API key can't administer; sign in with `airlock login`".into(),
            ));
        }
        self.audit("anonymous", None, "admin", None, "unauthorized").await;
        Err(CoreError::Unauthenticated(
            "invalid or expired admin token; sign in again with `airlock login`".into(),
        ))
    }

    /// Record an audit row (a refusal's repeats within a minute are one row with a count, see
    /// `audit`); a failure to write it is logged, never the caller's failure.
    pub async fn audit(&self, actor: &str, tenant: Option<&str>, action: &str, object: Option<&str>, result: &str) {
        let record = AuditRecord {
            seq: 0,
            at_ms: now_ms(),
            actor: actor.into(),
            tenant: tenant.map(Into::into),
            action: action.into(),
            object: object.map(Into::into),
            result: result.into(),
            count: 1,
        };
        // Repeats of a refusal are counted into one row (see `audit`).
        if let Err(e) = self.audits.record(&*self.store, record).await {
            tracing::warn!("audit row {action} not written: {e}");
        }
    }

    /// The result column of an audit row for `r`.
    pub fn outcome<T>(r: &CoreResult<T>) -> &'static str {
        match r {
            Ok(_) => "ok",
            Err(e) => e.code().code,
        }
    }

    /// Audit rows newest first (see [`AuditFilter`]), at most 1000.
    pub async fn audit_log(&self, _admin: &Admin, filter: &AuditFilter, limit: u32) -> CoreResult<Vec<AuditEntry>> {
        // The repeats counted so far are in the rows read.
        self.audits.flush(&*self.store).await?;
        let rows = self.store.audit(filter, limit.clamp(1, 1000)).await?;
        Ok(rows.into_iter().map(AuditEntry::from).collect())
    }

    pub async fn create_tenant(&self, admin: &Admin, name: &str) -> CoreResult<TenantSummary> {
        let r = async {
            check_tenant_name(name)?;
            self.store
                .create_tenant(name)
                .await?
                .ok_or_else(|| Conflict::TenantExists(name.into()))?;
            Ok(TenantSummary {
                name: name.into(),
                created_at: rfc3339(now_ms()),
            })
        }
        .await;
        self.audit(
            &admin.account,
            Some(name),
            "tenant.create",
            Some(name),
            Self::outcome(&r),
        )
        .await;
        r
    }

    pub async fn list_tenants(&self, _admin: &Admin) -> CoreResult<Vec<TenantSummary>> {
        Ok(self
            .store
            .list_tenants()
            .await?
            .into_iter()
            .map(|(t, at)| TenantSummary {
                name: t.name,
                created_at: rfc3339(at),
            })
            .collect())
    }

    pub async fn tenant_detail(&self, _admin: &Admin, name: &str) -> CoreResult<crate::model::TenantInfo> {
        let t = self.tenant_named(name).await?;
        self.tenant_info(&t).await
    }

    /// Delete a tenant: its keys stop at once, its sandboxes are deleted (operations that run
    /// on), its snapshots (records and images: they hold its sandboxes' memory), its builds
    /// (`Core::purge_builds`), volumes (`Core::purge_volumes`), E2B state, quotas and policy go. Its id is never given again, so a later tenant of the same name
    /// starts with nothing. `default` stays: it holds the server's bootstrap key.
    pub async fn delete_tenant(&self, admin: &Admin, name: &str) -> CoreResult<u32> {
        let r = async {
            let t = self.tenant_named(name).await?;
            if t.name == "default" {
                return Err(Conflict::DefaultTenant.into());
            }
            // Keys first: nothing new starts while the sandboxes go.
            for k in self.store.list_keys(&t.id).await? {
                self.store.revoke_key(&t.id, &k.id).await?;
            }
            let mut deleted = 0;
            for sb in self.store.live_sandboxes().await? {
                if sb.tenant_id == t.id {
                    self.delete_sandbox_by(&admin.account, &t, &sb.id).await?;
                    deleted += 1;
                }
            }
            // Images first: one that can't be removed keeps its record (and the tenant), so a
            // retry finds it. A save still under way finds its record gone and removes its own.
            for s in self.store.tenant_snapshots(&t.id).await? {
                self.delete_image_everywhere(&s).await?;
                self.store.delete_snapshot(&t.id, &s.id).await?;
            }
            self.purge_builds(&t).await?;
            self.purge_volumes(&t).await?;
            self.store.delete_tenant_webhooks(&t.id).await?;
            self.store.delete_tenant(&t.id).await?;
            Ok(deleted)
        }
        .await;
        self.audit(
            &admin.account,
            Some(name),
            "tenant.delete",
            Some(name),
            Self::outcome(&r),
        )
        .await;
        r
    }

    pub async fn set_quota_as_admin(&self, admin: &Admin, name: &str, quota: crate::model::Quota) -> CoreResult<()> {
        let r = self.set_tenant_quota(name, quota).await;
        self.audit(
            &admin.account,
            Some(name),
            "tenant.quota",
            Some(name),
            Self::outcome(&r),
        )
        .await;
        r
    }

    pub async fn mint_key(&self, admin: &Admin, tenant: &str, name: &str, e2b: bool) -> CoreResult<NewKey> {
        let r = async {
            let t = self.tenant_named(tenant).await?;
            if name.len() > 128 || name.chars().any(char::is_control) {
                return Err(CoreError::invalid(
                    "name",
                    "at most 128 characters, no control characters",
                ));
            }
            let format = if e2b { KeyFormat::E2b } else { KeyFormat::Airlock };
            let (key, record) = self.store.mint_key(&t.id, format, name).await?;
            Ok(NewKey {
                key,
                info: key_view(record),
            })
        }
        .await;
        let object = r.as_ref().ok().map(|k| k.info.id.clone());
        self.audit(
            &admin.account,
            Some(tenant),
            "key.create",
            object.as_deref(),
            Self::outcome(&r),
        )
        .await;
        r
    }

    pub async fn list_keys(&self, _admin: &Admin, tenant: &str) -> CoreResult<Vec<KeyView>> {
        let t = self.tenant_named(tenant).await?;
        Ok(self.store.list_keys(&t.id).await?.into_iter().map(key_view).collect())
    }

    pub async fn revoke_key(&self, admin: &Admin, tenant: &str, key_id: &str) -> CoreResult<()> {
        let r = async {
            let t = self.tenant_named(tenant).await?;
            if !self.store.revoke_key(&t.id, key_id).await? {
                return Err(CoreError::not_found(Kind::Key, key_id));
            }
            Ok(())
        }
        .await;
        self.audit(
            &admin.account,
            Some(tenant),
            "key.revoke",
            Some(key_id),
            Self::outcome(&r),
        )
        .await;
        r
    }

    pub async fn set_policy_as_admin(
        &self,
        admin: &Admin,
        tenant: &str,
        policy: airlock_egress::TenantPolicy,
    ) -> CoreResult<()> {
        let r = async {
            let t = self.tenant_named(tenant).await?;
            Ok(self.store.set_egress_policy(&t.id, &policy).await?)
        }
        .await;
        self.audit(
            &admin.account,
            Some(tenant),
            "tenant.policy",
            Some(tenant),
            Self::outcome(&r),
        )
        .await;
        r
    }

    pub async fn policy_as_admin(&self, _admin: &Admin, tenant: &str) -> CoreResult<airlock_egress::TenantPolicy> {
        let t = self.tenant_named(tenant).await?;
        Ok(self.store.egress_policy(&t.id).await?)
    }

    pub async fn prune_audit(&self) -> CoreResult<u64> {
        Ok(self.store.prune_audit(now_ms() - AUDIT_RETENTION_MS).await?)
    }
}

/// Warm pools, as the admin sees and sizes them (`/v1/system` shows them to everyone).
impl Core {
    pub fn pools(&self) -> Vec<crate::model::PoolInfo> {
        self.nodes.pools()
    }

    /// Size a pool (0 empties it): its VMs start in the background and count against the
    /// node's memory budget from then on.
    pub async fn set_pool(&self, admin: &Admin, req: &crate::model::PoolRequest) -> CoreResult<crate::model::PoolInfo> {
        let r = async {
            if req.size > MAX_POOL {
                return Err(CoreError::invalid(
                    "size",
                    format!("at most {MAX_POOL}, got {}", req.size),
                ));
            }
            let template = self.resolve_template(&req.template)?;
            let defaults = airlock_runtime::Resources::for_template(&template);
            let spec = req.resources.as_ref();
            let resources = crate::model::Resources {
                vcpu: spec.and_then(|r| r.vcpu).unwrap_or(defaults.vcpu),
                memory_mib: spec.and_then(|r| r.memory_mib).unwrap_or(defaults.memory_mib),
                disk_mib: spec.and_then(|r| r.disk_mib).unwrap_or(defaults.disk_mib),
            };
            self.nodes.set_pool(&template.name, &resources, req.size).await?;
            self.pools()
                .into_iter()
                .find(|p| p.template == template.name && p.size == req.size)
                .ok_or_else(|| CoreError::not_found(Kind::Template, &req.template))
        }
        .await;
        self.audit(&admin.account, None, "pool.set", Some(&req.template), Self::outcome(&r))
            .await;
        r
    }
}

/// The most VMs one pool keeps.
pub const MAX_POOL: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_hash_and_verify_and_generated_ones_are_long() {
        let h = hash_password("correct horse battery").unwrap();
        assert!(h.starts_with("$argon2"), "{h}");
        assert!(password_matches("correct horse battery", &h));
        assert!(!password_matches("correct horse batterY", &h));
        let (a, b) = (generate_password(), generate_password());
        assert_eq!(a.len(), 24);
        assert_ne!(a, b);
    }

    #[test]
    fn tenant_names_are_plain() {
        for ok in ["acme", "a", "team-7"] {
            assert!(check_tenant_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "Acme", "-x", "a b", "a/b", &"x".repeat(64)] {
            assert!(check_tenant_name(bad).is_err(), "{bad}");
        }
    }
}
