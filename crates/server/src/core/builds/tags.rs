//! A tenant's template tags (E2B's `assign_tags`, `remove_tags`, `get_tags`, `exists`) and the
//! signed links a build's contexts are uploaded through (E2B's file upload URLs, which carry
//! their own authority: the newest SDK sends no API key with them).

use super::{split_name, Core, BUILT_PREFIX};
use crate::core::principal::Principal;
use crate::core::sandboxes::acting_tenant;
use crate::error::{CoreError, CoreResult, Kind};
use crate::records::{now_ms, BuildRecord};
use hmac::Mac;
use std::time::Duration;

/// How long an upload link is good for.
pub const UPLOAD_LINK_FOR: Duration = Duration::from_secs(30 * 60);

/// What a signed upload link says: whose context `hash` it may put, until when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadLink {
    pub tenant_id: String,
    pub hash: String,
    /// Unix seconds.
    pub expires: i64,
    pub signature: String,
}

impl Core {
    /// A link for the caller to upload context `hash` through, without its key.
    pub fn upload_link(&self, principal: &Principal, hash: &str) -> CoreResult<UploadLink> {
        let tenant = acting_tenant(principal)?;
        self.build_context_path(&tenant.id, hash)?;
        let expires = now_ms() / 1000 + UPLOAD_LINK_FOR.as_secs() as i64;
        Ok(UploadLink {
            tenant_id: tenant.id.clone(),
            hash: hash.to_string(),
            expires,
            signature: self.upload_signature(&tenant.id, hash, expires),
        })
    }

    /// Put the context a link names, once its signature and time check out; returns its hash.
    pub async fn upload_through_link<S, E>(&self, link: &UploadLink, body: S) -> CoreResult<String>
    where
        S: futures_util::Stream<Item = Result<bytes::Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let good = self.upload_signature(&link.tenant_id, &link.hash, link.expires);
        let same: bool = subtle::ConstantTimeEq::ct_eq(good.as_bytes(), link.signature.as_bytes()).into();
        if !same {
            return Err(CoreError::Unauthenticated(
                "the upload link's signature does not match".into(),
            ));
        }
        if link.expires < now_ms() / 1000 {
            return Err(CoreError::Unauthenticated("signature is already expired".into()));
        }
        self.put_build_context_of(&link.tenant_id, Some(&link.hash), body).await
    }

    fn upload_signature(&self, tenant_id: &str, hash: &str, expires: i64) -> String {
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&self.secret).expect("any key length");
        mac.update(b"build-context-upload:");
        mac.update(format!("{tenant_id}\n{hash}\n{expires}").as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    /// Whether the caller has a template `name` (any tag, any build state): E2B's `exists`.
    pub async fn has_tenant_template(&self, principal: &Principal, name: &str) -> CoreResult<bool> {
        let tenant = acting_tenant(principal)?;
        let Ok((name, _)) = split_name(name) else {
            return Ok(false);
        };
        Ok(!self.store.list_builds(&tenant.id, Some(&name)).await?.is_empty())
    }

    /// Point `tags` of the caller's template at the build `target` (`name[:tag]`) serves now.
    pub async fn assign_tags(&self, principal: &Principal, target: &str, tags: &[String]) -> CoreResult<BuildRecord> {
        let tenant = acting_tenant(principal)?;
        let (name, tag) = split_name(target)?;
        let build = self
            .store
            .ready_build(&tenant.id, &name, &tag)
            .await?
            .ok_or_else(|| CoreError::NotFound {
                kind: Kind::Template,
                id: target.to_string(),
                hint: String::new(),
            })?;
        if tags.is_empty() {
            return Err(CoreError::invalid("tags", "name at least one tag"));
        }
        let mut checked = Vec::new();
        for t in tags {
            let (_, t) = split_name(&format!("{name}:{t}"))?;
            checked.push(t);
        }
        let now = now_ms();
        for t in &checked {
            self.store.assign_tag(&tenant.id, &name, t, &build.id, now).await?;
        }
        Ok(build)
    }

    /// Remove `tags` from the caller's template `name` (a bare name: no tag of its own).
    pub async fn remove_tags(&self, principal: &Principal, name: &str, tags: &[String]) -> CoreResult<()> {
        let tenant = acting_tenant(principal)?;
        if name.contains(':') {
            return Err(CoreError::invalid("name", "name the template without a tag"));
        }
        let (name, _) = split_name(name)?;
        for t in tags {
            if t == "default" {
                return Err(CoreError::invalid("tags", "the tag default cannot be removed"));
            }
            let (_, t) = split_name(&format!("{name}:{t}"))?;
            if !self.store.remove_tag(&tenant.id, &name, &t).await? {
                return Err(CoreError::NotFound {
                    kind: Kind::Template,
                    id: format!("{name}:{t}"),
                    hint: String::new(),
                });
            }
        }
        Ok(())
    }

    /// The tags of the caller's template `name`: (tag, build id, assigned at ms), newest first.
    pub async fn template_tags(&self, principal: &Principal, name: &str) -> CoreResult<Vec<(String, String, i64)>> {
        let tenant = acting_tenant(principal)?;
        let (name, _) = split_name(name)?;
        if name.starts_with(BUILT_PREFIX) {
            return Ok(Vec::new());
        }
        let tags = self.store.tags_of(&tenant.id, &name).await?;
        if tags.is_empty() {
            return Err(CoreError::NotFound {
                kind: Kind::Template,
                id: name,
                hint: String::new(),
            });
        }
        Ok(tags)
    }
}
