//! The content-addressed template store: manifests (`templates/<name>.json`) naming blobs
//! (`blobs/<digest>/{vmlinuz,initrd.img,rootfs.ext4}`), lookup by name or digest, and pruning of
//! blobs nothing names. Uses the data dir and the recipes' types; builds are in `build.rs`.

use super::recipes::{SeedRecipe, StartSpec};
use crate::datadir::{write_atomic, DataDir};
use crate::digest::sha256_file;
use crate::error::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

pub(crate) const KERNEL_FILE: &str = "vmlinuz";
pub(crate) const INITRD_FILE: &str = "initrd.img";
pub(crate) const ROOTFS_FILE: &str = "rootfs.ext4";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TemplateManifest {
    pub name: String,
    /// `sha256:<hex>` over the kernel, initramfs and rootfs digests.
    pub digest: String,
    pub kernel_version: String,
    /// RFC 3339.
    pub built_at: String,
    /// Bytes of kernel + initramfs + rootfs image.
    pub size_bytes: u64,
    /// Size of the root filesystem image; a sandbox disk may not be smaller.
    pub rootfs_bytes: u64,
    pub recipe_digest: String,
    pub recipe: SeedRecipe,
    /// Started after boot; the sandbox is ready once its port answers.
    #[serde(default)]
    pub start: Option<StartSpec>,
    /// Set for a template built from another in a VM (`Runtime::capture_template`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub built: Option<Built>,
}

/// What a built template keeps of its build: where it came from and what its sandboxes'
/// processes default to (the build's last USER, WORKDIR and ENV).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Built {
    /// The parent template's digest.
    pub parent: String,
    pub user: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub env: std::collections::BTreeMap<String, String>,
}

/// A resolved template on disk.
#[derive(Debug, Clone)]
pub struct Template {
    pub manifest: TemplateManifest,
    pub dir: PathBuf,
}

impl Template {
    pub fn kernel(&self) -> PathBuf {
        self.dir.join(KERNEL_FILE)
    }
    pub fn initrd(&self) -> PathBuf {
        self.dir.join(INITRD_FILE)
    }
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join(ROOTFS_FILE)
    }
}

pub struct TemplateStore {
    pub(super) data: DataDir,
}

/// Split `name[:tag]`; only the `latest` tag exists today.
pub fn parse_reference(reference: &str) -> Result<(String, Option<String>)> {
    let bad = || RuntimeError::UnknownTemplate(reference.to_string());
    if let Some(hex) = reference.strip_prefix("sha256:") {
        if hex.len() < 12 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(bad());
        }
        return Ok((String::new(), Some(hex.to_ascii_lowercase())));
    }
    let (name, tag) = reference.split_once(':').unwrap_or((reference, "latest"));
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_' || c == '.');
    if !valid || tag != "latest" {
        return Err(bad());
    }
    Ok((name.to_string(), None))
}

/// The manifest `reference` names among `manifests`, as [`TemplateStore::resolve`] finds it:
/// for a caller that holds a node's manifests but not its store.
pub fn find_manifest(manifests: &[TemplateManifest], reference: &str) -> Option<TemplateManifest> {
    let (name, digest) = parse_reference(reference).ok()?;
    manifests
        .iter()
        .find(|m| match &digest {
            None => m.name == name,
            Some(hex) => m.digest.trim_start_matches("sha256:").starts_with(hex.as_str()),
        })
        .cloned()
}

impl TemplateStore {
    pub fn new(data: DataDir) -> Self {
        Self { data }
    }

    /// The data dir the store lives in (object storage stages pulls in its cache).
    pub(crate) fn data(&self) -> &DataDir {
        &self.data
    }

    pub(crate) fn manifest_path(&self, name: &str) -> PathBuf {
        self.data.templates().join(format!("{name}.json"))
    }

    pub(crate) fn load(&self, name: &str) -> Option<Template> {
        let text = std::fs::read(self.manifest_path(name)).ok()?;
        let manifest: TemplateManifest = serde_json::from_slice(&text).ok()?;
        let dir = self.data.blobs().join(manifest.digest.trim_start_matches("sha256:"));
        let t = Template { manifest, dir };
        (t.kernel().exists() && t.initrd().exists() && t.rootfs().exists()).then_some(t)
    }

    pub fn list(&self) -> Vec<TemplateManifest> {
        let mut out: Vec<TemplateManifest> = std::fs::read_dir(self.data.templates())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_suffix(".json").map(String::from))
            .filter_map(|name| self.load(&name).map(|t| t.manifest))
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// `seed`, `seed:latest` or `sha256:<hex prefix>`.
    pub fn resolve(&self, reference: &str) -> Result<Template> {
        let (name, digest) = parse_reference(reference)?;
        let found = match digest {
            None => self.load(&name),
            Some(hex) => self
                .list()
                .into_iter()
                .find(|m| m.digest.trim_start_matches("sha256:").starts_with(&hex))
                .and_then(|m| self.load(&m.name)),
        };
        found.ok_or_else(|| RuntimeError::UnknownTemplate(reference.to_string()))
    }

    pub fn exists(&self, name: &str) -> bool {
        self.load(name).is_some()
    }

    /// Put a finished build's `out` dir (kernel, initramfs, rootfs) in the store under its
    /// content digest and name it with the manifest `manifest(digest, size_bytes, rootfs_bytes)`
    /// makes. Returns the template and the one of that name it replaced, if that was another
    /// image: the previous image stays while sandboxes may use it; the runtime prunes
    /// unreferenced ones when it opens (see `prune_blobs`).
    pub(crate) fn commit(
        &self,
        out: &Path,
        manifest: impl FnOnce(String, u64, u64) -> TemplateManifest,
    ) -> Result<(Template, Option<Template>)> {
        let mut h = Sha256::new();
        let mut size = 0;
        for f in [KERNEL_FILE, INITRD_FILE, ROOTFS_FILE] {
            let p = out.join(f);
            h.update(sha256_file(&p)?.as_bytes());
            size += std::fs::metadata(&p).map_err(|e| RuntimeError::io(&p, e))?.len();
        }
        let hex = hex::encode(h.finalize());
        let dir = self.data.blobs().join(&hex);
        if !dir.exists() {
            std::fs::rename(out, &dir).map_err(|e| RuntimeError::io(&dir, e))?;
        }
        let rootfs_bytes = std::fs::metadata(dir.join(ROOTFS_FILE)).map(|m| m.len()).unwrap_or(0);
        let manifest = manifest(format!("sha256:{hex}"), size, rootfs_bytes);
        let old = self.load(&manifest.name);
        write_atomic(
            &self.manifest_path(&manifest.name),
            &serde_json::to_vec_pretty(&manifest).expect("serializable"),
        )?;
        let old = old.filter(|o| o.dir != dir);
        Ok((Template { manifest, dir }, old))
    }

    /// Remove template blobs that no manifest names and no sandbox uses.
    pub fn prune_blobs(&self, in_use: &BTreeSet<String>) {
        let named: BTreeSet<String> = self
            .list()
            .into_iter()
            .map(|m| m.digest.trim_start_matches("sha256:").to_string())
            .collect();
        for entry in std::fs::read_dir(self.data.blobs()).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if !named.contains(&name) && !in_use.contains(&name) {
                tracing::info!("removing template image {name}: no template names it and nothing was made from it");
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

pub(super) fn short(digest: &str) -> String {
    digest.chars().take(19).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_references() {
        assert_eq!(parse_reference("seed").unwrap(), ("seed".into(), None));
        assert_eq!(parse_reference("seed:latest").unwrap(), ("seed".into(), None));
        assert_eq!(
            parse_reference("sha256:ABCDEF012345").unwrap(),
            (String::new(), Some("abcdef012345".into()))
        );
        for bad in ["", "seed:v2", "team/name", "sha256:xyz", "Seed", "../etc"] {
            assert!(parse_reference(bad).is_err(), "{bad}");
        }
    }
}
