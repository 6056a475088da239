//! OCI images as templates: an image pulled from a registry (`oci-client`: manifest for
//! linux/amd64, each layer checked against its declared size and its digest), its layers
//! unpacked in order into a staging dir with their whiteouts applied, airlock's agent added, and
//! the tree written as an ext4 image (`mkfs.ext4 -d`, never mounted) beside `seed`'s kernel and
//! initramfs. The image's `User`, `WorkingDir` and `Env` become the template's defaults; its
//! `Cmd` is not a start command (a sandbox's processes are its sessions).
//!
//! Layers are a tenant's choice, so unpacking is strict: paths with `..` or that would land
//! outside the staging dir through a symlink are refused (the `tar` crate's `unpack_in`
//! canonicalizes each parent, and only this process writes the staging dir), device nodes and
//! extended attributes are skipped, and the whole is bounded in bytes and entries.

use super::command::{dir_bytes, install_file, run};
use super::initramfs::{check_static, locate_agent};
use super::store::{Built, Template, TemplateManifest, TemplateStore, INITRD_FILE, KERNEL_FILE, ROOTFS_FILE};
use super::SEED;
use crate::datadir::random_hex;
use crate::error::{Result, RuntimeError};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::pin::Pin;
use std::process::Command;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

/// The most an image's layers may weigh, compressed, as their manifest declares them.
pub const MAX_IMAGE_BYTES: u64 = 8 << 30;
/// The most its unpacked tree may hold.
pub const MAX_UNPACKED_BYTES: u64 = 24 << 30;
/// The most entries its layers may have, together.
const MAX_ENTRIES: u64 = 2_000_000;
/// A registry that stops answering for this long fails the pull.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
/// Where a pull stages its layers and tree; a restart removes what is left (the captures' prefix).
const STAGING_PREFIX: &str = "capture-oci-";
/// Template names of imported images start so (the core chooses the rest).
pub const IMAGE_KEY_PREFIX: &str = "oci ";

/// Which registries a pull may reach, and how.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Registries {
    /// Registry host -> the mirror to pull its images from (`host[:port]`, or `http://host:port`
    /// for one without TLS): `docker.io` -> a local pull-through cache.
    #[serde(default)]
    pub mirrors: BTreeMap<String, String>,
    /// The registries (`host`, `host:port`, or `*` for any) that may be pulled from directly;
    /// none by default: a pull is the server's own connection, and a tenant must not aim it at
    /// the operator's network. A mirrored registry is reached through its mirror.
    #[serde(default)]
    pub allow: Vec<String>,
}

impl Registries {
    /// Whether `image` can be pulled here: its registry is mirrored or allowed.
    pub fn reaches(&self, image: &str) -> bool {
        let Ok(r) = image.trim().parse::<Reference>() else {
            return false;
        };
        self.mirrors.contains_key(r.registry()) || self.allows(r.registry())
    }

    fn allows(&self, registry: &str) -> bool {
        self.allow
            .iter()
            .any(|a| a == "*" || a == registry || (!a.contains(':') && a == host_of(registry)))
    }
}

/// A registry account for one pull: a user name and a password or token (never logged, never
/// stored).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RegistryCredentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for RegistryCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RegistryCredentials({}, <hidden>)", self.username)
    }
}

/// One image to make a template of (see [`TemplateStore::import_image`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageImport {
    /// As the user wrote it: `python:3.12`, `ghcr.io/org/app@sha256:...`, `127.0.0.1:5000/x:1`.
    pub image: String,
    /// The template's name in this node's store.
    pub name: String,
    #[serde(default)]
    pub credentials: Option<RegistryCredentials>,
    #[serde(default)]
    pub registries: Registries,
}

/// Why an image could not be made a template: each names the image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image {image:?} is not a valid reference: {reason}")]
    Reference { image: String, reason: String },
    #[error("image {image:?}: registry {registry} is not one this server pulls from (the operator allows registries with --registry-allow and mirrors them with --registry-mirror)")]
    NotAllowed { image: String, registry: String },
    #[error("image {image:?} could not be pulled: {reason}")]
    Pull { image: String, reason: String },
    #[error("image {image:?} is too large: {what} over the limit of {limit} MiB")]
    TooLarge { image: String, what: String, limit: u64 },
    #[error("image {image:?}: {what} is not supported")]
    Unsupported { image: String, what: String },
    #[error("image {image:?}: layer {layer} could not be unpacked: {reason}")]
    Unpack {
        image: String,
        layer: String,
        reason: String,
    },
}

impl From<ImageError> for RuntimeError {
    fn from(e: ImageError) -> Self {
        RuntimeError::Image(e)
    }
}

/// What an image's config says its processes default to (the parts a template keeps).
#[derive(Debug, Default, Deserialize)]
struct ImageConfig {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    config: Option<ProcessConfig>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ProcessConfig {
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    env: Option<Vec<String>>,
}

impl TemplateStore {
    /// Make template `req.name` of image `req.image`, unless it is already the image's current
    /// content (same manifest digest). Kernel and initramfs are `seed`'s.
    pub async fn import_image(&self, req: &ImageImport) -> Result<TemplateManifest> {
        let image = req.image.clone();
        let (client, reference) = client_for(req)?;
        let auth = match &req.credentials {
            Some(c) => RegistryAuth::Basic(c.username.clone(), c.password.clone()),
            None => RegistryAuth::Anonymous,
        };
        let pull = |e: oci_client::errors::OciDistributionError| ImageError::Pull {
            image: image.clone(),
            reason: e.to_string(),
        };
        let (manifest, digest, config) = client.pull_manifest_and_config(&reference, &auth).await.map_err(pull)?;
        let key = format!("{IMAGE_KEY_PREFIX}{image}@{digest}");
        if let Some(t) = self.load(&req.name).filter(|t| t.manifest.recipe_digest == key) {
            return Ok(t.manifest);
        }
        let config: ImageConfig = serde_json::from_str(&config).map_err(|e| ImageError::Pull {
            image: image.clone(),
            reason: format!("its config is not an image config: {e}"),
        })?;
        if !config.architecture.is_empty() && config.architecture != "amd64" {
            return Err(ImageError::Unsupported {
                image,
                what: format!("architecture {}", config.architecture),
            }
            .into());
        }
        let declared: u64 = manifest.layers.iter().map(|l| l.size.max(0) as u64).sum();
        if declared > MAX_IMAGE_BYTES {
            return Err(ImageError::TooLarge {
                image,
                what: format!("{} MiB of layers", declared >> 20),
                limit: MAX_IMAGE_BYTES >> 20,
            }
            .into());
        }
        for l in &manifest.layers {
            layer_compression(&image, l)?;
        }
        let seed = self
            .load(SEED)
            .ok_or_else(|| RuntimeError::UnknownTemplate(SEED.into()))?;
        let staging = self.data.cache().join(format!("{STAGING_PREFIX}{}", random_hex(6)));
        let result = async {
            let layers = staging.join("layers");
            std::fs::create_dir_all(&layers).map_err(|e| RuntimeError::io(&layers, e))?;
            let started = std::time::Instant::now();
            let mut files = Vec::new();
            for (i, l) in manifest.layers.iter().enumerate() {
                let path = layers.join(i.to_string());
                let file = tokio::fs::File::create(&path)
                    .await
                    .map_err(|e| RuntimeError::io(&path, e))?;
                let out = Bounded {
                    inner: file,
                    left: l.size.max(0) as u64,
                };
                // `pull_blob` checks the content against the descriptor's digest.
                client.pull_blob(&reference, l, out).await.map_err(pull)?;
                files.push((path, l.clone()));
            }
            tracing::info!(image = %image, %digest, "pulled {} layers ({} MiB) in {} ms",
                files.len(), declared >> 20, started.elapsed().as_millis());
            let store = TemplateStore::new(self.data.clone());
            let (stage, name, image, key) = (staging.clone(), req.name.clone(), image.clone(), key.clone());
            let built = built_of(&config, &digest);
            tokio::task::spawn_blocking(move || store.assemble_image(&stage, &files, &seed, &name, &image, &key, built))
                .await
                .map_err(|e| RuntimeError::io(&staging, std::io::Error::other(e.to_string())))?
        }
        .await;
        let _ = std::fs::remove_dir_all(&staging);
        result.map(|t| t.manifest)
    }

    /// The layers unpacked into `stage/rootfs`, the agent added, the image written and
    /// committed with `seed`'s kernel and initramfs.
    // Each argument is one part of the template; a struct would only name them again.
    #[allow(clippy::too_many_arguments)]
    fn assemble_image(
        &self,
        stage: &Path,
        layers: &[(std::path::PathBuf, OciDescriptor)],
        seed: &Template,
        name: &str,
        image: &str,
        key: &str,
        built: Built,
    ) -> Result<Template> {
        let root = stage.join("rootfs");
        std::fs::create_dir_all(&root).map_err(|e| RuntimeError::io(&root, e))?;
        let mut budget = Budget {
            bytes: MAX_UNPACKED_BYTES,
            entries: MAX_ENTRIES,
        };
        for (path, desc) in layers {
            unpack_layer(image, path, desc, &root, &mut budget)?;
            let _ = std::fs::remove_file(path);
        }
        prepare_root(&root)?;
        let agent = locate_agent()?;
        check_static(&agent)?;
        install_file(&agent, &root.join("usr/sbin/airlock-agent"), 0o755)?;
        let out = stage.join("out");
        std::fs::create_dir_all(&out).map_err(|e| RuntimeError::io(&out, e))?;
        let used = dir_bytes(&root)?;
        let image_mib = ((used * 13 / 10) >> 20) + 64;
        run(
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-L", "airlock-root", "-m", "0", "-b", "4096", "-d"])
                .arg(&root)
                .arg(out.join(ROOTFS_FILE))
                .arg(format!("{image_mib}M")),
            "mkfs.ext4",
        )?;
        let _ = std::fs::remove_dir_all(&root);
        for file in [KERNEL_FILE, INITRD_FILE] {
            let (from, to) = (seed.dir.join(file), out.join(file));
            if std::fs::hard_link(&from, &to).is_err() {
                std::fs::copy(&from, &to).map_err(|e| RuntimeError::io(&from, e))?;
            }
        }
        let (t, _) = self.commit(&out, |digest, size_bytes, rootfs_bytes| {
            let mut recipe = seed.manifest.recipe.clone();
            recipe.name = name.to_string();
            TemplateManifest {
                name: name.to_string(),
                digest,
                kernel_version: seed.manifest.kernel_version.clone(),
                built_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
                size_bytes,
                rootfs_bytes,
                recipe_digest: key.to_string(),
                recipe,
                start: None,
                built: Some(built),
            }
        })?;
        Ok(t)
    }
}

/// The client for `req`'s registry (or its mirror) and the reference to pull there.
fn client_for(req: &ImageImport) -> Result<(Client, Reference)> {
    let image = &req.image;
    let bad = |reason: String| ImageError::Reference {
        image: image.clone(),
        reason,
    };
    let parsed: Reference = image
        .trim()
        .parse()
        .map_err(|e: oci_client::ParseError| bad(e.to_string()))?;
    let registry = parsed.registry().to_string();
    let mut insecure = Vec::new();
    let target = match req.registries.mirrors.get(&registry) {
        Some(mirror) => {
            let host = match mirror.strip_prefix("http://") {
                Some(h) => {
                    insecure.push(h.trim_end_matches('/').to_string());
                    h
                }
                None => mirror.strip_prefix("https://").unwrap_or(mirror),
            };
            host.trim_end_matches('/').to_string()
        }
        None => {
            if !req.registries.allows(&registry) {
                return Err(ImageError::NotAllowed {
                    image: image.clone(),
                    registry,
                }
                .into());
            }
            registry.clone()
        }
    };
    // A registry on this machine's loopback speaks plain HTTP (a test's, or a local cache).
    if matches!(host_of(&target), "127.0.0.1" | "localhost" | "[::1]") {
        insecure.push(target.clone());
    }
    let reference = match (parsed.digest(), parsed.tag()) {
        (Some(d), _) => Reference::with_digest(target, parsed.repository().to_string(), d.to_string()),
        (None, tag) => Reference::with_tag(
            target,
            parsed.repository().to_string(),
            tag.unwrap_or("latest").to_string(),
        ),
    };
    // reqwest's TLS needs a process-wide crypto provider; the first caller installs ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = Client::new(ClientConfig {
        protocol: ClientProtocol::HttpsExcept(insecure),
        platform_resolver: Some(Box::new(oci_client::client::linux_amd64_resolver)),
        read_timeout: Some(READ_TIMEOUT),
        connect_timeout: Some(Duration::from_secs(15)),
        user_agent: "airlock",
        ..Default::default()
    });
    Ok((client, reference))
}

/// `host` of `host:port` (an IPv6 literal keeps its brackets).
fn host_of(registry: &str) -> &str {
    match registry.rsplit_once(':') {
        Some((h, port)) if !port.contains(']') && port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => registry,
    }
}

enum Compression {
    None,
    Gzip,
}

fn layer_compression(image: &str, l: &OciDescriptor) -> Result<Compression> {
    let t = l.media_type.as_str();
    if t.ends_with("tar") || t.ends_with(".tar") || t.ends_with("rootfs.diff.tar") {
        return Ok(Compression::None);
    }
    if t.ends_with("+gzip") || t.ends_with(".tar.gzip") {
        return Ok(Compression::Gzip);
    }
    Err(ImageError::Unsupported {
        image: image.to_string(),
        what: format!("layer media type {t}"),
    }
    .into())
}

/// What the unpacking may still use.
struct Budget {
    bytes: u64,
    entries: u64,
}

/// One layer over `root`: its whiteouts first (they apply to the layers below), then the rest.
fn unpack_layer(image: &str, path: &Path, desc: &OciDescriptor, root: &Path, budget: &mut Budget) -> Result<()> {
    let fail = |reason: String| ImageError::Unpack {
        image: image.to_string(),
        layer: desc.digest.clone(),
        reason,
    };
    let open = || -> Result<tar::Archive<Box<dyn std::io::Read>>> {
        let f = std::fs::File::open(path).map_err(|e| RuntimeError::io(path, e))?;
        let f = std::io::BufReader::new(f);
        let r: Box<dyn std::io::Read> = match layer_compression(image, desc)? {
            Compression::None => Box::new(f),
            Compression::Gzip => Box::new(flate2::read::GzDecoder::new(f)),
        };
        let mut a = tar::Archive::new(r);
        a.set_preserve_permissions(true);
        a.set_preserve_ownerships(true);
        a.set_preserve_mtime(true);
        a.set_unpack_xattrs(false);
        a.set_overwrite(true);
        Ok(a)
    };
    // Pass 1: whiteouts.
    let mut a = open()?;
    for entry in a.entries().map_err(|e| fail(e.to_string()))? {
        let entry = entry.map_err(|e| fail(e.to_string()))?;
        let rel = clean_path(&entry.path().map_err(|e| fail(e.to_string()))?).map_err(&fail)?;
        let Some(file) = rel.file_name().and_then(|f| f.to_str()) else {
            continue;
        };
        let parent = rel.parent().unwrap_or(Path::new(""));
        if file == ".wh..wh..opq" {
            let dir = inside(root, parent).map_err(&fail)?;
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                remove_any(&e.path());
            }
        } else if let Some(hidden) = file.strip_prefix(".wh.") {
            let target = inside(root, &parent.join(hidden)).map_err(&fail)?;
            remove_any(&target);
        }
    }
    // Pass 2: everything else.
    let mut a = open()?;
    for entry in a.entries().map_err(|e| fail(e.to_string()))? {
        let mut entry = entry.map_err(|e| fail(e.to_string()))?;
        let rel = clean_path(&entry.path().map_err(|e| fail(e.to_string()))?).map_err(&fail)?;
        let name = rel.file_name().and_then(|f| f.to_str()).unwrap_or("");
        if name.starts_with(".wh.") || rel.as_os_str().is_empty() {
            continue;
        }
        budget.entries = budget
            .entries
            .checked_sub(1)
            .ok_or_else(|| fail(format!("more than {MAX_ENTRIES} entries")))?;
        let size = entry.header().size().unwrap_or(0);
        budget.bytes = budget.bytes.checked_sub(size).ok_or_else(|| ImageError::TooLarge {
            image: image.to_string(),
            what: "its unpacked files".into(),
            limit: MAX_UNPACKED_BYTES >> 20,
        })?;
        let kind = entry.header().entry_type();
        if kind.is_block_special() || kind.is_character_special() {
            continue;
        }
        // A directory replaced by a file (or the other way) in a later layer: the old one goes.
        if let Ok(dst) = inside(root, &rel) {
            if let Ok(meta) = std::fs::symlink_metadata(&dst) {
                if !(kind.is_dir() && meta.is_dir()) {
                    remove_any(&dst);
                }
            }
        }
        entry
            .unpack_in(root)
            .map_err(|e| fail(format!("{}: {}", rel.display(), chain(&e))))?;
    }
    Ok(())
}

/// An error and its causes, as one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut at = e.source();
    while let Some(c) = at {
        s.push_str(&format!(": {c}"));
        at = c.source();
    }
    s
}

/// A layer's path without `./` or a leading `/`; one with `..` is refused.
fn clean_path(p: &Path) -> std::result::Result<std::path::PathBuf, String> {
    let mut out = std::path::PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::Normal(n) => out.push(n),
            std::path::Component::CurDir | std::path::Component::RootDir => {}
            _ => return Err(format!("{}: a path with `..`", p.display())),
        }
    }
    Ok(out)
}

/// `root/rel`, when no directory on the way is a symlink (a whiteout or replacement must not
/// act through one).
fn inside(root: &Path, rel: &Path) -> std::result::Result<std::path::PathBuf, String> {
    let mut at = root.to_path_buf();
    let parts: Vec<_> = rel.components().collect();
    for (i, c) in parts.iter().enumerate() {
        at.push(c);
        if i + 1 < parts.len() {
            if let Ok(m) = std::fs::symlink_metadata(&at) {
                if m.file_type().is_symlink() {
                    return Err(format!("{}: a path through a symlink", rel.display()));
                }
            }
        }
    }
    Ok(at)
}

fn remove_any(p: &Path) {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => {
            let _ = std::fs::remove_dir_all(p);
        }
        Ok(_) => {
            let _ = std::fs::remove_file(p);
        }
        Err(_) => {}
    }
}

/// What the agent needs of a root it did not come with: the mount points and `/etc` files.
fn prepare_root(root: &Path) -> Result<()> {
    for dir in ["dev", "proc", "sys", "tmp", "run", "etc", "root", "home", "usr/sbin"] {
        let p = root.join(dir);
        if std::fs::symlink_metadata(&p).is_err() {
            std::fs::create_dir_all(&p).map_err(|e| RuntimeError::io(&p, e))?;
        }
    }
    let files = [
        ("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
        ("etc/group", "root:x:0:\n"),
        (
            "etc/hosts",
            "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n",
        ),
    ];
    for (rel, text) in files {
        let p = root.join(rel);
        if std::fs::symlink_metadata(&p).is_err() {
            std::fs::write(&p, text).map_err(|e| RuntimeError::io(&p, e))?;
        }
    }
    Ok(())
}

/// The template's defaults from the image's config: Docker's are root in `/`.
fn built_of(config: &ImageConfig, digest: &str) -> Built {
    let pc = config.config.as_ref();
    let user = pc
        .and_then(|c| c.user.clone())
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "root".into());
    let env = pc
        .and_then(|c| c.env.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Built {
        parent: digest.to_string(),
        user,
        workdir: pc.and_then(|c| c.working_dir.clone()).filter(|w| !w.is_empty()),
        env,
    }
}

/// A layer's file that refuses more bytes than its descriptor declared.
struct Bounded {
    inner: tokio::fs::File,
    left: u64,
}

impl tokio::io::AsyncWrite for Bounded {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        if buf.len() as u64 > self.left {
            return Poll::Ready(Err(std::io::Error::other(
                "the layer is larger than its manifest declares",
            )));
        }
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            self.left -= *n as u64;
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use airlock_testnet::registry::tar_layer;

    fn tar_of(entries: &[(&str, Option<&[u8]>)]) -> Vec<u8> {
        tar_layer(entries, &[], &[])
    }

    fn layer(dir: &Path, i: usize, bytes: Vec<u8>) -> (std::path::PathBuf, OciDescriptor) {
        let p = dir.join(format!("l{i}"));
        std::fs::write(&p, &bytes).unwrap();
        let d = OciDescriptor {
            media_type: "application/vnd.oci.image.layer.v1.tar".into(),
            digest: format!("sha256:{i}"),
            size: bytes.len() as i64,
            ..Default::default()
        };
        (p, d)
    }

    #[test]
    fn layers_apply_in_order_with_whiteouts() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let one = tar_of(&[
            ("etc/", None),
            ("etc/keep", Some(b"1")),
            ("etc/gone", Some(b"1")),
            ("opt/", None),
            ("opt/old", Some(b"1")),
        ]);
        let two = tar_of(&[
            ("etc/.wh.gone", Some(b"")),
            ("opt/.wh..wh..opq", Some(b"")),
            ("opt/new", Some(b"2")),
            ("etc/keep", Some(b"2")),
        ]);
        let mut budget = Budget {
            bytes: 1 << 20,
            entries: 100,
        };
        for (i, bytes) in [one, two].into_iter().enumerate() {
            let (p, d) = layer(dir.path(), i, bytes);
            unpack_layer("t", &p, &d, &root, &mut budget).unwrap();
        }
        assert_eq!(std::fs::read(root.join("etc/keep")).unwrap(), b"2");
        assert!(!root.join("etc/gone").exists());
        assert!(!root.join("opt/old").exists());
        assert_eq!(std::fs::read(root.join("opt/new")).unwrap(), b"2");
        assert!(!root.join("etc/.wh.gone").exists());
    }

    #[test]
    fn escapes_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        // A symlink to a directory outside, then a file written through it.
        let escape = tar_layer(&[], &[("esc", outside.to_str().unwrap())], &[]);
        let mut budget = Budget {
            bytes: 1 << 20,
            entries: 100,
        };
        let (p, d) = layer(dir.path(), 0, escape);
        unpack_layer("t", &p, &d, &root, &mut budget).unwrap();
        let (p, d) = layer(dir.path(), 3, tar_of(&[("esc/planted", Some(b"x"))]));
        assert!(unpack_layer("t", &p, &d, &root, &mut budget).is_err());
        assert!(!outside.join("planted").exists());
        // A whiteout through the symlink removes nothing outside.
        std::fs::write(outside.join("victim"), b"v").unwrap();
        let (p, d) = layer(dir.path(), 1, tar_of(&[("esc/.wh.victim", Some(b""))]));
        assert!(unpack_layer("t", &p, &d, &root, &mut budget).is_err());
        assert!(outside.join("victim").exists());
        assert!(clean_path(Path::new("a/../../etc")).is_err());
        // Too many bytes.
        let mut small = Budget { bytes: 1, entries: 100 };
        let (p, d) = layer(dir.path(), 2, tar_of(&[("big", Some(b"12345"))]));
        assert!(matches!(
            unpack_layer("t", &p, &d, &root, &mut small),
            Err(RuntimeError::Image(ImageError::TooLarge { .. }))
        ));
    }

    #[test]
    fn registries_are_chosen_by_policy() {
        let req = |image: &str, registries: Registries| ImageImport {
            image: image.into(),
            name: "x".into(),
            credentials: None,
            registries,
        };
        let only_local = Registries {
            mirrors: [("docker.io".to_string(), "http://127.0.0.1:5000".to_string())].into(),
            allow: vec!["127.0.0.1".into()],
        };
        assert!(only_local.reaches("python:3.12"));
        assert!(only_local.reaches("127.0.0.1:5001/x"));
        assert!(!only_local.reaches("ghcr.io/org/app"));
        assert!(!Registries::default().reaches("127.0.0.1:5001/x"));
        let (_, r) = client_for(&req("python:3.12", only_local.clone())).unwrap();
        assert_eq!(r.registry(), "127.0.0.1:5000");
        assert_eq!(r.repository(), "library/python");
        let (_, r) = client_for(&req("127.0.0.1:5001/team/app:1", only_local.clone())).unwrap();
        assert_eq!(r.registry(), "127.0.0.1:5001");
        assert!(matches!(
            client_for(&req("ghcr.io/org/app", only_local)),
            Err(RuntimeError::Image(ImageError::NotAllowed { .. }))
        ));
        assert!(matches!(
            client_for(&req("Not A Reference", Registries::default())),
            Err(RuntimeError::Image(ImageError::Reference { .. }))
        ));
        assert!(format!(
            "{:?}",
            RegistryCredentials {
                username: "u".into(),
                password: "s3cret".into()
            }
        )
        .contains("hidden"));
    }
}
