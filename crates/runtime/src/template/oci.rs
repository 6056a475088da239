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

use super::confine::{self, Answer, Job, JobLayer};
use super::error::TemplateError;
use super::initramfs::{check_static, locate_agent};
use super::pull_gate::PullGate;
use super::store::{Built, Template, TemplateManifest, TemplateStore, INITRD_FILE, KERNEL_FILE};
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
    /// Where a pull may not go but to the registry itself (a realm, a redirect): the node's
    /// platform denies, filled in by the node that pulls. Empty: nowhere but the registry.
    #[serde(default)]
    pub denied: Vec<ipnet::IpNet>,
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
        let (reference, plain) = route_for(req)?;
        let gate = PullGate::start(&authority_of(&reference, plain), plain, req.registries.denied.clone())
            .await
            .map_err(|e| RuntimeError::io("the pull's gate", e))?;
        let client = client_through(&reference, plain, &gate);
        let auth = match &req.credentials {
            Some(c) => RegistryAuth::Basic(c.username.clone(), c.password.clone()),
            None => RegistryAuth::Anonymous,
        };
        let pull = |e: oci_client::errors::OciDistributionError| {
            ImageError::Pull {
            image: image.clone(),
            reason: match gate.refused().as_slice() {
                [] => pull_reason(&e),
                hosts => format!(
                    "the registry sent the pull to {}, which this server does not dial (only the registry itself, and other hosts over TLS outside the platform's denied ranges)",
                    hosts.join(", ")
                ),
            },
        }
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
        let declared = declared_bytes(&image, &manifest.layers)?;
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
                // `pull_blob` checks the content against the descriptor's digest. A layer's
                // `urls` (a "foreign" layer) would be fetched from anywhere it names when the
                // registry has no such blob: only the registry serves a layer here.
                let l = OciDescriptor {
                    urls: None,
                    ..l.clone()
                };
                client.pull_blob(&reference, &l, out).await.map_err(pull)?;
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
        let agent = locate_agent()?;
        check_static(&agent)?;
        let staged_agent = stage.join("agent");
        std::fs::copy(&agent, &staged_agent).map_err(|e| RuntimeError::io(&agent, e))?;
        let job = Job {
            layers: layers
                .iter()
                .map(|(path, desc)| {
                    Ok(JobLayer {
                        file: path.file_name().unwrap_or_default().to_string_lossy().into_owned(),
                        gzip: matches!(layer_compression(image, desc)?, Compression::Gzip),
                        digest: desc.digest.clone(),
                    })
                })
                .collect::<Result<_>>()?,
            budget_bytes: MAX_UNPACKED_BYTES,
            budget_entries: MAX_ENTRIES,
        };
        let answer = if confine::available() {
            confine::run(stage, &job).map_err(TemplateError::from)?
        } else {
            // Not root (no uid map, no chown) or not the airlock binary (a test's harness):
            // the tree's own rules still hold, without the namespaces around them.
            tracing::warn!(image, "unpacking in the server's own process: it cannot confine it");
            confine::work(stage, &job)
        };
        let fail = |layer: String, reason: String| ImageError::Unpack {
            image: image.to_string(),
            layer,
            reason,
        };
        match answer {
            Answer::Done => {}
            Answer::Refused { layer, reason } => return Err(fail(layer, reason).into()),
            Answer::Failed { what, reason } => return Err(fail(format!("({what})"), reason).into()),
            Answer::TooLarge { limit } => {
                return Err(ImageError::TooLarge {
                    image: image.to_string(),
                    what: "its unpacked files".into(),
                    limit: limit >> 20,
                }
                .into())
            }
        }
        let out = stage.join("out");
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

/// Where `req` is pulled from: the reference at its registry (or that registry's mirror), and
/// whether that one speaks plain HTTP.
fn route_for(req: &ImageImport) -> Result<(Reference, bool)> {
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
    let mut plain = false;
    let target = match req.registries.mirrors.get(&registry) {
        Some(mirror) => {
            let host = match mirror.strip_prefix("http://") {
                Some(h) => {
                    plain = true;
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
        plain = true;
    }
    let reference = match (parsed.digest(), parsed.tag()) {
        (Some(d), _) => Reference::with_digest(target, parsed.repository().to_string(), d.to_string()),
        (None, tag) => Reference::with_tag(
            target,
            parsed.repository().to_string(),
            tag.unwrap_or("latest").to_string(),
        ),
    };
    Ok((reference, plain))
}

/// `host:port` of a reference's registry (the default port of its scheme added).
fn authority_of(reference: &Reference, plain: bool) -> String {
    let r = reference.registry();
    if r.rsplit_once(':')
        .is_some_and(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
    {
        r.to_string()
    } else {
        format!("{r}:{}", if plain { 80 } else { 443 })
    }
}

/// The pull's client: every connection through `gate` (see `pull_gate.rs`).
fn client_through(reference: &Reference, plain: bool, gate: &PullGate) -> Client {
    let insecure = if plain {
        vec![reference.registry().to_string()]
    } else {
        vec![]
    };
    // reqwest's TLS needs a process-wide crypto provider; the first caller installs ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    Client::new(ClientConfig {
        protocol: ClientProtocol::HttpsExcept(insecure),
        platform_resolver: Some(Box::new(oci_client::client::linux_amd64_resolver)),
        read_timeout: Some(READ_TIMEOUT),
        connect_timeout: Some(Duration::from_secs(15)),
        user_agent: "airlock",
        https_proxy: Some(gate.url()),
        http_proxy: Some(gate.url()),
        ..Default::default()
    })
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

/// The layers' sizes as the manifest declares them, summed without wrapping; a negative one is
/// no image.
fn declared_bytes(image: &str, layers: &[OciDescriptor]) -> Result<u64> {
    let mut total: u64 = 0;
    for l in layers {
        let size = u64::try_from(l.size).map_err(|_| ImageError::Pull {
            image: image.to_string(),
            reason: format!("layer {} declares a negative size", l.digest),
        })?;
        total = total.saturating_add(size);
    }
    Ok(total)
}

/// What a tenant is told of a failed pull: the registry's answer, but of content that did not
/// match its digest only that (what was received would be an oracle of whatever answered).
fn pull_reason(e: &oci_client::errors::OciDistributionError) -> String {
    use oci_client::errors::{DigestError, OciDistributionError as E};
    match e {
        E::DigestError(DigestError::VerificationError { expected, .. }) => {
            format!("digest mismatch: the content is not {expected}")
        }
        e => e.to_string(),
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
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn declared_sizes_neither_wrap_nor_go_negative() {
        let layer = |size: i64| OciDescriptor {
            size,
            digest: "sha256:x".into(),
            ..Default::default()
        };
        assert_eq!(declared_bytes("i", &[layer(1), layer(2)]).unwrap(), 3);
        // Summed as plain u64 these wrap to 1 in release: under every limit.
        let huge = [layer(i64::MAX), layer(i64::MAX), layer(3)];
        assert!(declared_bytes("i", &huge).unwrap() > MAX_IMAGE_BYTES);
        assert!(matches!(
            declared_bytes("i", &[layer(5), layer(-1)]),
            Err(RuntimeError::Image(ImageError::Pull { .. }))
        ));
        let mismatch =
            oci_client::errors::OciDistributionError::DigestError(oci_client::errors::DigestError::VerificationError {
                expected: "sha256:aaaa".into(),
                actual: "sha256:bbbb".into(),
            });
        let said = pull_reason(&mismatch);
        assert!(said.contains("digest mismatch") && !said.contains("bbbb"), "{said}");
    }

    /// A hostile registry's answer to every request, given the canary's port.
    type Answer = fn(u16) -> String;

    /// A registry on loopback that sends every request elsewhere (`answer`), and a canary that
    /// counts who reached it: the operator's network as a pull's realm or redirect would see it.
    fn hostile_registry(answer: impl Fn(u16) -> String + Send + 'static) -> (u16, Arc<AtomicUsize>) {
        let canary = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let canary_port = canary.local_addr().unwrap().port();
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        std::thread::spawn(move || {
            for c in canary.incoming().flatten() {
                h.fetch_add(1, Ordering::SeqCst);
                drop(c);
            }
        });
        let registry = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = registry.local_addr().unwrap().port();
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            for mut c in registry.incoming().flatten() {
                let mut buf = [0u8; 4096];
                let _ = c.read(&mut buf);
                let _ = c.write_all(answer(canary_port).as_bytes());
            }
        });
        (port, hits)
    }

    #[tokio::test]
    async fn a_pull_goes_nowhere_but_the_registry_and_public_tls_hosts() {
        let dir = tempfile::tempdir().unwrap();
        let store = TemplateStore::new(crate::datadir::DataDir::open(dir.path()).unwrap());
        let answers: [(&str, Answer); 3] = [
            ("a token realm on the host's loopback", |p| {
                format!("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer realm=\"http://127.0.0.1:{p}/token\",service=\"r\"\r\nContent-Length: 0\r\n\r\n")
            }),
            ("a redirect to plain HTTP elsewhere", |p| {
                format!("HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:{p}/v2/x/manifests/1\r\nContent-Length: 0\r\n\r\n")
            }),
            ("a redirect to TLS on a denied address", |p| {
                format!("HTTP/1.1 307 Temporary Redirect\r\nLocation: https://localhost:{p}/v2/x/manifests/1\r\nContent-Length: 0\r\n\r\n")
            }),
        ];
        for (what, answer) in answers {
            let (port, hits) = hostile_registry(answer);
            let req = ImageImport {
                image: format!("127.0.0.1:{port}/x:1"),
                name: "x".into(),
                credentials: None,
                registries: Registries {
                    allow: vec!["127.0.0.1".into()],
                    denied: vec!["127.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()],
                    ..Default::default()
                },
            };
            let e = store.import_image(&req).await.unwrap_err();
            assert_eq!(hits.load(Ordering::SeqCst), 0, "{what}: the canary was reached ({e})");
            let said = e.to_string();
            assert!(
                said.contains("does not dial") && (said.contains("127.0.0.1") || said.contains("localhost")),
                "{what}: {said}"
            );
        }
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
            ..Default::default()
        };
        assert!(only_local.reaches("python:3.12"));
        assert!(only_local.reaches("127.0.0.1:5001/x"));
        assert!(!only_local.reaches("ghcr.io/org/app"));
        assert!(!Registries::default().reaches("127.0.0.1:5001/x"));
        let (r, plain) = route_for(&req("python:3.12", only_local.clone())).unwrap();
        assert!(plain);
        assert_eq!(r.registry(), "127.0.0.1:5000");
        assert_eq!(r.repository(), "library/python");
        let (r, _) = route_for(&req("127.0.0.1:5001/team/app:1", only_local.clone())).unwrap();
        assert_eq!(r.registry(), "127.0.0.1:5001");
        assert!(matches!(
            route_for(&req("ghcr.io/org/app", only_local)),
            Err(RuntimeError::Image(ImageError::NotAllowed { .. }))
        ));
        assert!(matches!(
            route_for(&req("Not A Reference", Registries::default())),
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
