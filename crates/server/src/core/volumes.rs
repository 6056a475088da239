//! Volumes: a tenant's named disks that outlive its sandboxes. Each lives on one node (the
//! sandboxes that mount it are placed there); its size counts against the tenant's
//! `volume_mib` quota and the node's disk budget at full size. A create mounts volumes by id
//! or name at absolute paths: one sandbox read-write, or any number read-only, never both.
//!
//! Files in a volume without a sandbox go through a guest that has it mounted (the writer's, a
//! reader's for reads, else the node's helper VM; see `runtime::sandbox::volumes`): the host
//! never mounts what a guest wrote. Paths are the volume's own (`/a/b`), `..` refused, and the
//! guest's view of the volume follows no symlink, so nothing outside it is reached.
//!
//! Another tenant's volume answers like a missing one; its token (E2B's content API) is derived
//! from the server's secret (its owner can read it again, as E2B's `GET /volumes/{id}` does)
//! and stored hashed.

use super::sandboxes::acting_tenant;
use super::{Core, CoreError, CoreResult, Kind, Principal};
use crate::error::Conflict;
use crate::nodes::VolumeAccess;
use crate::records::{now_ms, Tenant, VolumeMountRecord, VolumeRecord};
use airlock_proto::FileStat;
use bytes::Bytes;

/// A new volume's size unless asked (E2B's volumes have no size: this is theirs here).
pub const DEFAULT_VOLUME_MIB: u64 = 1024;
/// At most this many volumes per sandbox (SCSI targets on its controller).
pub const MAX_MOUNTS: usize = airlock_runtime::vmm::MAX_VOLUMES;

/// A volume a create asks to mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountRequest {
    /// The volume's id or name.
    pub volume: String,
    pub path: String,
    pub read_only: bool,
}

/// A volume with who mounts it now.
#[derive(Debug, Clone)]
pub struct VolumeInfo {
    pub record: VolumeRecord,
    /// Sandboxes not ended that mount it, with whether read-only.
    pub mounted_by: Vec<(String, bool)>,
    /// Bytes its disk takes on its node now (sparse: what was written), if the node answers.
    pub used_bytes: Option<u64>,
}

/// A volume name: like a snapshot's, and never an id.
fn check_name(name: &str) -> CoreResult<()> {
    let ok = (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && !name.starts_with("vol-");
    if ok {
        Ok(())
    } else {
        Err(CoreError::invalid(
            "name",
            "1 to 64 letters, digits, '-', '_' or '.', not starting with vol-",
        ))
    }
}

fn check_size(size_mib: u64) -> CoreResult<()> {
    use airlock_runtime::volume::{MAX_VOLUME_MIB, MIN_VOLUME_MIB};
    if (MIN_VOLUME_MIB..=MAX_VOLUME_MIB).contains(&size_mib) {
        Ok(())
    } else {
        Err(CoreError::invalid(
            "size_mib",
            format!("must be {MIN_VOLUME_MIB} to {MAX_VOLUME_MIB}, got {size_mib}"),
        ))
    }
}

/// A path inside a volume (`/a/b`, `a/b`, `/`) as its components: no `..`, no NUL.
pub fn volume_path(path: &str) -> CoreResult<Vec<String>> {
    if path.contains('\0') {
        return Err(CoreError::invalid("path", "contains a NUL byte"));
    }
    let mut parts = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(CoreError::invalid("path", "`..` leads out of the volume")),
            c => parts.push(c.to_string()),
        }
    }
    Ok(parts)
}

/// Where a sandbox may mount a volume: absolute, clean, not over the guest's own trees.
fn check_mount_path(path: &str) -> CoreResult<()> {
    let clean = path.starts_with('/')
        && path.len() <= 1024
        && path[1..].split('/').all(|c| !c.is_empty() && c != "." && c != "..")
        && !path.contains('\0');
    if !clean {
        return Err(CoreError::invalid(
            "volumes.path",
            format!("{path:?} is not an absolute path without `.`, `..` or empty parts"),
        ));
    }
    for reserved in ["/proc", "/sys", "/dev", "/run/airlock", "/usr/sbin"] {
        if path == reserved || path.starts_with(&format!("{reserved}/")) {
            return Err(CoreError::invalid(
                "volumes.path",
                format!("a volume cannot be mounted at {path} (under {reserved})"),
            ));
        }
    }
    Ok(())
}

impl Core {
    /// A new volume of `size_mib` (default [`DEFAULT_VOLUME_MIB`]) named `name`, on the node
    /// with the most disk left; with its token.
    pub async fn create_volume(
        &self,
        principal: &Principal,
        name: &str,
        size_mib: Option<u64>,
    ) -> CoreResult<(VolumeRecord, String)> {
        let tenant = acting_tenant(principal)?;
        let r = self.create_volume_unaudited(tenant, name, size_mib).await;
        let id = r.as_ref().ok().map(|(v, _)| v.id.clone());
        self.audit(
            &principal.actor(),
            Some(&tenant.name),
            "volume.create",
            id.as_deref().or(Some(name)),
            Self::outcome(&r),
        )
        .await;
        r
    }

    async fn create_volume_unaudited(
        &self,
        tenant: &Tenant,
        name: &str,
        size_mib: Option<u64>,
    ) -> CoreResult<(VolumeRecord, String)> {
        check_name(name)?;
        let size_mib = size_mib.unwrap_or(DEFAULT_VOLUME_MIB);
        check_size(size_mib)?;
        if self.store.get_volume(&tenant.id, name).await?.is_some() {
            return Err(Conflict::VolumeNameTaken(name.into()).into());
        }
        self.volume_fits(tenant, size_mib, size_mib).await?;
        let node = self.volume_node(size_mib).await?;
        let id = format!("vol-{}", airlock_runtime::datadir::random_hex(8));
        let token = self.volume_token(&id);
        let record = VolumeRecord {
            id,
            tenant_id: tenant.id.clone(),
            name: name.into(),
            size_mib,
            node,
            token_hash: crate::store::token_hash(&token),
            created_at_ms: now_ms(),
        };
        let quota = self.quota(tenant).await?;
        let inserted = self
            .store
            .insert_volume(&record, quota.volume_mib)
            .await
            .map_err(|e| CoreError::from(e).for_tenant(&tenant.name))?;
        if !inserted {
            return Err(Conflict::VolumeNameTaken(name.into()).into());
        }
        if let Err(e) = self.nodes.create_volume(&record.node, &record.id, size_mib).await {
            let _ = self.store.delete_volume(&record.id).await;
            return Err(e.into());
        }
        Ok((record, token))
    }

    /// A volume of `size_mib`, `more` of it new to the tenant: not larger than any node's disk
    /// (422: it never fits), then within the tenant's `volume_mib` quota (429): the tenant's
    /// limit is said before a full node is (503). The store checks the quota again atomically.
    async fn volume_fits(&self, tenant: &Tenant, size_mib: u64, more: u64) -> CoreResult<()> {
        let largest = self.largest_budget().disk_mib;
        if size_mib > largest {
            return Err(CoreError::invalid(
                "size_mib",
                format!("must be at most {largest} MiB on these nodes (their free disk less --disk-reserve-mib), got {size_mib}"),
            ));
        }
        let quota = self.quota(tenant).await?;
        let used = self.store.volume_mib_used(&tenant.id).await?;
        if let Some(limit) = quota.volume_mib.filter(|l| used.saturating_add(more) > *l) {
            return Err(CoreError::from(crate::store::StoreError::QuotaExceeded {
                quota: "volume_mib",
                used,
                asked: more,
                limit,
            })
            .for_tenant(&tenant.name));
        }
        Ok(())
    }

    /// The node a new volume of `size_mib` goes to: among those taking sandboxes, the one
    /// with the most of its disk budget left once its sandboxes, snapshots and volumes count.
    async fn volume_node(&self, size_mib: u64) -> CoreResult<String> {
        let (open, refused) = self.candidates(None);
        let mut best: Option<(String, u64)> = None;
        let mut reasons = refused;
        for m in open {
            let budget = self.config.budget(&m.capacity).disk_mib;
            let held = m.capacity.disk_held_mib + self.store.node_volume_mib(&m.name).await?;
            let left = budget.saturating_sub(held);
            if left < size_mib {
                reasons.push((m.name.clone(), format!("disk: {left} MiB left, {size_mib} asked")));
                continue;
            }
            if best.as_ref().is_none_or(|(_, l)| left > *l) {
                best = Some((m.name, left));
            }
        }
        best.map(|(name, _)| name).ok_or_else(|| {
            CoreError::NoNodeFits(
                reasons
                    .iter()
                    .map(|(n, why)| format!("{}: {why}", if n.is_empty() { "this node" } else { n }))
                    .collect::<Vec<_>>()
                    .join("; "),
            )
        })
    }

    /// The tenant's volume by id or name; another tenant's answers like a missing one.
    pub async fn volume(&self, principal: &Principal, key: &str) -> CoreResult<VolumeRecord> {
        let tenant = acting_tenant(principal)?;
        self.store
            .get_volume(&tenant.id, key)
            .await?
            .ok_or_else(|| CoreError::not_found(Kind::Volume, key))
    }

    /// The volume `id` its token names; a wrong token answers like a missing volume.
    pub async fn volume_by_token(&self, id: &str, token: &str) -> CoreResult<VolumeRecord> {
        use subtle::ConstantTimeEq;
        let missing = || CoreError::not_found(Kind::Volume, id);
        let v = self.store.volume_by_id(id).await?.ok_or_else(missing)?;
        let got = crate::store::token_hash(token);
        if v.token_hash.is_empty() || !bool::from(v.token_hash.as_bytes().ct_eq(got.as_bytes())) {
            return Err(missing());
        }
        Ok(v)
    }

    /// A volume with its holders and the bytes it takes.
    pub async fn volume_info(&self, v: VolumeRecord) -> CoreResult<VolumeInfo> {
        let mounted_by = self
            .store
            .volume_holders(&v.id)
            .await?
            .into_iter()
            .map(|h| (h.sandbox_id, h.read_only))
            .collect();
        let used_bytes = self.nodes.volume_bytes(&v.node, &v.id).await;
        Ok(VolumeInfo {
            record: v,
            mounted_by,
            used_bytes,
        })
    }

    pub async fn volumes(&self, principal: &Principal) -> CoreResult<Vec<VolumeRecord>> {
        let tenant = acting_tenant(principal)?;
        Ok(self.store.list_volumes(&tenant.id).await?)
    }

    /// Grow the tenant's volume to `size_mib` (a volume never shrinks: its filesystem is the
    /// guest's). The next guest that mounts it read-write grows the filesystem.
    pub async fn resize_volume(&self, principal: &Principal, key: &str, size_mib: u64) -> CoreResult<VolumeRecord> {
        let tenant = acting_tenant(principal)?;
        let r = async {
            let v = self.volume(principal, key).await?;
            check_size(size_mib)?;
            if size_mib < v.size_mib {
                return Err(CoreError::invalid(
                    "size_mib",
                    format!("a volume only grows: it has {} MiB", v.size_mib),
                ));
            }
            // What it grows by must fit its node's disk, next to everything else held there.
            let more = size_mib - v.size_mib;
            self.volume_fits(tenant, size_mib, more).await?;
            if let Some(m) = self.nodes.members().into_iter().find(|m| m.name == v.node) {
                let budget = self.config.budget(&m.capacity).disk_mib;
                let held = m.capacity.disk_held_mib + self.store.node_volume_mib(&m.name).await?;
                if held.saturating_add(more) > budget {
                    return Err(CoreError::node_budget("disk", more, held, budget));
                }
            }
            let quota = self.quota(tenant).await?;
            self.store
                .resize_volume(&v.id, size_mib, quota.volume_mib)
                .await
                .map_err(|e| CoreError::from(e).for_tenant(&tenant.name))?;
            self.nodes
                .resize_volume(&v.node, &v.id, size_mib)
                .await
                .map_err(CoreError::from)?;
            Ok(VolumeRecord { size_mib, ..v })
        }
        .await;
        self.audit(
            &principal.actor(),
            Some(&tenant.name),
            "volume.resize",
            Some(key),
            Self::outcome(&r),
        )
        .await;
        r
    }

    /// Delete the tenant's volume and its data; refused (409, naming them) while sandboxes
    /// not ended mount it.
    pub async fn delete_volume(&self, principal: &Principal, key: &str) -> CoreResult<()> {
        let tenant = acting_tenant(principal)?;
        let r = async {
            let v = self.volume(principal, key).await?;
            self.delete_volume_record(&v).await
        }
        .await;
        self.audit(
            &principal.actor(),
            Some(&tenant.name),
            "volume.delete",
            Some(key),
            Self::outcome(&r),
        )
        .await;
        r
    }

    pub(crate) async fn delete_volume_record(&self, v: &VolumeRecord) -> CoreResult<()> {
        let holders = self.store.volume_holders(&v.id).await?;
        if !holders.is_empty() {
            let names: Vec<&str> = holders.iter().map(|h| h.sandbox_id.as_str()).collect();
            return Err(Conflict::VolumeBusy(format!(
                "volume {} is mounted by sandbox{} {}; delete {} first",
                v.name,
                if names.len() > 1 { "es" } else { "" },
                names.join(", "),
                if names.len() > 1 { "them" } else { "it" },
            ))
            .into());
        }
        self.nodes
            .delete_volume(&v.node, &v.id)
            .await
            .map_err(CoreError::from)?;
        self.store.delete_volume(&v.id).await?;
        Ok(())
    }

    /// A create's mounts, checked: the tenant's volumes, clean distinct paths, at most
    /// [`MAX_MOUNTS`], all on one node (returned: the sandbox must go there), and no sharing
    /// past one writer or any readers.
    pub(crate) async fn resolve_mounts(
        &self,
        tenant: &Tenant,
        asked: &[MountRequest],
    ) -> CoreResult<(Vec<VolumeMountRecord>, Option<String>)> {
        if asked.is_empty() {
            return Ok((Vec::new(), None));
        }
        if asked.len() > MAX_MOUNTS {
            return Err(CoreError::invalid(
                "volumes",
                format!("a sandbox mounts at most {MAX_MOUNTS} volumes"),
            ));
        }
        let mut mounts: Vec<VolumeMountRecord> = Vec::new();
        let mut node: Option<String> = None;
        for m in asked {
            check_mount_path(&m.path)?;
            let v = self
                .store
                .get_volume(&tenant.id, &m.volume)
                .await?
                .ok_or_else(|| CoreError::not_found(Kind::Volume, &m.volume))?;
            if mounts.iter().any(|o| o.volume_id == v.id) {
                return Err(CoreError::invalid(
                    "volumes",
                    format!("volume {} is named twice", m.volume),
                ));
            }
            if let Some(o) = mounts.iter().find(|o| {
                o.path == m.path
                    || o.path.starts_with(&format!("{}/", m.path))
                    || m.path.starts_with(&format!("{}/", o.path))
            }) {
                return Err(CoreError::invalid(
                    "volumes",
                    format!("mount paths {} and {} overlap", o.path, m.path),
                ));
            }
            match &node {
                Some(n) if *n != v.node => {
                    return Err(CoreError::invalid(
                        "volumes",
                        format!("volumes {} and {} live on different nodes", mounts[0].volume_id, v.id),
                    ))
                }
                _ => node = Some(v.node.clone()),
            }
            let holders = self.store.volume_holders(&v.id).await?;
            if let Some(h) = holders.iter().find(|h| !m.read_only || !h.read_only) {
                return Err(Conflict::VolumeBusy(format!(
                    "volume {} is mounted {} by sandbox {}; a volume has one writer or any readers",
                    m.volume,
                    if h.read_only { "read-only" } else { "read-write" },
                    h.sandbox_id
                ))
                .into());
            }
            mounts.push(VolumeMountRecord {
                volume_id: v.id,
                path: m.path.clone(),
                read_only: m.read_only,
            });
        }
        Ok((mounts, node))
    }

    /// Delete every volume of a tenant being deleted, once the deletes of its sandboxes that
    /// mount them are through (waited for up to a minute; a volume still held then fails the
    /// tenant's delete, which a retry finishes).
    pub(crate) async fn purge_volumes(&self, tenant: &Tenant) -> CoreResult<()> {
        let until = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
        for v in self.store.list_volumes(&tenant.id).await? {
            loop {
                match self.delete_volume_record(&v).await {
                    Err(CoreError::Conflict(Conflict::VolumeBusy(_))) if tokio::time::Instant::now() < until => {
                        tokio::time::sleep(std::time::Duration::from_millis(250)).await
                    }
                    r => {
                        r?;
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    /// What sandbox `row` mounts: (volume name, path), in order (a volume deleted since is
    /// named by its id).
    pub async fn mounts_of(&self, row: &crate::records::SandboxRecord) -> CoreResult<Vec<(String, String)>> {
        let mut out = Vec::new();
        for m in self.store.sandbox_volumes(&row.id).await? {
            let name = match self.store.volume_by_id(&m.volume_id).await? {
                Some(v) if v.tenant_id == row.tenant_id => v.name,
                _ => m.volume_id,
            };
            out.push((name, m.path));
        }
        Ok(out)
    }

    /// A sandbox that mounts volumes: snapshots and forks are refused (their saved devices
    /// would name disks no restored VM has, and a silent copy would fork the data).
    pub(crate) async fn refuse_if_mounting(&self, sandbox_id: &str) -> CoreResult<()> {
        let mounts = self.store.sandbox_volumes(sandbox_id).await?;
        match mounts.first() {
            Some(m) => Err(Conflict::VolumeBusy(format!(
                "sandbox {sandbox_id} mounts volume {} at {}: a sandbox with volumes cannot be snapshotted or forked",
                m.volume_id, m.path
            ))
            .into()),
            None => Ok(()),
        }
    }
}

/// File calls on a volume, through whichever guest has it (see the module's docs).
pub struct VolumeFiles {
    access: VolumeAccess,
    id: String,
}

impl Core {
    /// File calls on volume `v`: `write` for calls that change it.
    pub async fn volume_files(&self, v: &VolumeRecord, write: bool) -> CoreResult<VolumeFiles> {
        let access = self
            .nodes
            .volume_access(&v.node, &v.id, write)
            .await
            .map_err(CoreError::from)?;
        Ok(VolumeFiles {
            access,
            id: v.id.clone(),
        })
    }
}

impl VolumeFiles {
    fn guest_path(&self, parts: &[String]) -> String {
        let mut p = self.access.root.clone();
        for c in parts {
            p.push('/');
            p.push_str(c);
        }
        p
    }

    /// The guest's answer, its paths the volume's own.
    fn err(&self) -> impl Fn(airlock_agent_client::AgentError) -> CoreError + '_ {
        move |e| {
            let e = match e {
                airlock_agent_client::AgentError::Api { status, code, message } => {
                    airlock_agent_client::AgentError::Api {
                        status,
                        code,
                        message: message.replace(&self.access.root, ""),
                    }
                }
                other => other,
            };
            CoreError::agent(Kind::File, self.access.sandbox.as_deref().unwrap_or(&self.id), e)
        }
    }

    /// A stat as the volume sees it: its path the volume's own.
    fn own(&self, mut s: FileStat) -> FileStat {
        let rel = s.path.strip_prefix(&self.access.root).unwrap_or(&s.path);
        s.path = if rel.is_empty() { "/".into() } else { rel.to_string() };
        if let Some(t) = s.symlink_resolved.take() {
            s.symlink_resolved = t.strip_prefix(&self.access.root).map(str::to_string);
        }
        s
    }

    pub async fn read(&self, path: &str) -> CoreResult<Bytes> {
        let p = self.guest_path(&volume_path(path)?);
        self.access.agent.read_file(&p).await.map_err(self.err())
    }

    /// Write `data` at `path` (parents made), owned like the volume's root unless `user` says,
    /// with permission bits `mode` if given.
    pub async fn write<S>(&self, path: &str, data: S, user: Option<&str>, mode: Option<u32>) -> CoreResult<FileStat>
    where
        S: futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    {
        let parts = volume_path(path)?;
        if parts.is_empty() {
            return Err(CoreError::invalid("path", "names the volume's root, not a file"));
        }
        let owner = match user {
            Some(u) => u.to_string(),
            None => self.root_owner().await?,
        };
        let p = self.guest_path(&parts);
        let stat = self
            .access
            .agent
            .write_file_as(&p, Some(&owner), mode, &Default::default(), data)
            .await
            .map_err(self.err())?;
        Ok(self.own(stat))
    }

    async fn root_owner(&self) -> CoreResult<String> {
        let root = self.access.agent.stat(&self.access.root).await.map_err(self.err())?;
        Ok(root.owner)
    }

    pub async fn stat(&self, path: &str) -> CoreResult<FileStat> {
        let p = self.guest_path(&volume_path(path)?);
        self.access
            .agent
            .stat(&p)
            .await
            .map(|s| self.own(s))
            .map_err(self.err())
    }

    /// A directory's entries to `depth` (the root's `lost+found` is the filesystem's, not shown).
    pub async fn list(&self, path: &str, depth: u32) -> CoreResult<Vec<FileStat>> {
        let p = self.guest_path(&volume_path(path)?);
        let entries = self.access.agent.list(&p, depth.max(1)).await.map_err(self.err())?;
        Ok(entries
            .into_iter()
            .map(|s| self.own(s))
            .filter(|s| s.path != "/lost+found" && !s.path.starts_with("/lost+found/"))
            .collect())
    }

    /// Make a directory and its parents, owned like the root unless `user` says; whether it
    /// was made.
    pub async fn mkdir(&self, path: &str, user: Option<&str>) -> CoreResult<(bool, FileStat)> {
        let parts = volume_path(path)?;
        let owner = match user {
            Some(u) => u.to_string(),
            None => self.root_owner().await?,
        };
        let made = self
            .access
            .agent
            .mkdir(&self.guest_path(&parts), Some(&owner))
            .await
            .map_err(self.err())?;
        Ok((made.created, self.own(made.stat)))
    }

    /// Remove a file or a directory with what it holds.
    pub async fn remove(&self, path: &str) -> CoreResult<()> {
        let parts = volume_path(path)?;
        if parts.is_empty() {
            return Err(CoreError::invalid("path", "the volume's root cannot be removed"));
        }
        self.access
            .agent
            .remove(&self.guest_path(&parts))
            .await
            .map_err(self.err())
    }

    /// The sandbox serving the calls (`None`: the node's helper).
    pub fn served_by(&self) -> Option<&str> {
        self.access.sandbox.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_paths_stay_inside() {
        assert_eq!(volume_path("/a/./b/").unwrap(), vec!["a", "b"]);
        assert!(volume_path("/").unwrap().is_empty());
        assert!(volume_path("a/../../etc").is_err());
        assert!(volume_path("a\0b").is_err());
        assert!(check_mount_path("/data").is_ok());
        for bad in ["data", "/", "/a/../b", "/a//b", "/proc/x", "/run/airlock/v", "/dev"] {
            assert!(check_mount_path(bad).is_err(), "{bad}");
        }
        assert!(check_name("work").is_ok());
        assert!(check_name("vol-1").is_err());
    }
}
