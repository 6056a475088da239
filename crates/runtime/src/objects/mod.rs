//! Templates and saved images in object storage, so that many hosts share what one made: S3
//! (or an S3-compatible store), or a local dir on a single host. Content-addressed:
//!
//! ```text
//! templates/<hex>/{vmlinuz,initrd.img,rootfs.ext4}   a template's blobs, uploaded first
//! templates/<hex>/manifest.json                      `PushedTemplate`, uploaded after its blobs
//! names/<name>                                       `sha256:<hex>`: the name's current digest
//! files/<sha256>, images/<hex>/manifest.json,        an image's files, its manifest, its id's
//! image-ids/<id>                                     digest (`image.rs`)
//! ```
//!
//! Blobs and manifests are created only where absent (a HEAD first, then a conditional create),
//! so two hosts pushing one digest write the same bytes and neither fails. A pull streams each
//! file the local store lacks into a staging dir in the data dir's cache, checks its sha256
//! against the manifest (and the manifest's file digests against the template's digest), and
//! only then renames the dir into the store and writes the local manifest: a bad object leaves
//! nothing behind. No file is ever held whole in memory.

use crate::datadir::{random_hex, write_atomic};
use crate::digest::sha256_file;
use crate::error::RuntimeError;
use crate::template::{
    parse_reference, Template, TemplateManifest, TemplateStore, INITRD_FILE, KERNEL_FILE, ROOTFS_FILE,
};
use futures_util::StreamExt;
use object_store::aws::{AmazonS3Builder, S3ConditionalPut};
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload, WriteMultipart};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod image;
pub use image::{PulledImage, PushedImage};

/// Files larger than this go up in parts of this size (S3's smallest part is 5 MiB).
pub const PART_SIZE: usize = 5 << 20;
/// Parts of one file in flight at once: memory per upload is at most this many parts.
const UPLOAD_CONCURRENCY: usize = 4;
/// A manifest or name pointer larger than this is not one of ours.
const MAX_SMALL_OBJECT: u64 = 1 << 20;
/// In this order: a template's digest is the sha256 of their hex digests, concatenated.
const FILES: [&str; 3] = [KERNEL_FILE, INITRD_FILE, ROOTFS_FILE];

#[derive(Debug, thiserror::Error)]
pub enum ObjectsError {
    #[error("object storage: {op} {path}: {source}")]
    Store {
        op: &'static str,
        path: String,
        #[source]
        source: object_store::Error,
    },
    #[error("object storage setup: {0}")]
    Setup(#[source] object_store::Error),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("local template store: {0}")]
    Local(#[from] RuntimeError),
    #[error("no template or image {0:?} in object storage")]
    NotFound(String),
    #[error("invalid reference {0:?}: use a template name or image id, or sha256:<64 hex digits>")]
    BadReference(String),
    #[error("object {path} is not a manifest airlock wrote: {reason}")]
    BadManifest { path: String, reason: String },
    /// An image whose machine uses a file outside its dir (a link that could not be made at
    /// save): it would not run anywhere else.
    #[error("image {id} uses {path}, outside its dir: it cannot move to another host")]
    NotSelfContained { id: String, path: PathBuf },
    #[error("another image {0:?} is already on this host")]
    ImageIdTaken(String),
    /// Content that is not what its digest says: a corrupt or tampered object (or local blob).
    #[error("{digest}: {what} has digest {actual}, expected {expected}")]
    DigestMismatch {
        digest: String,
        what: String,
        expected: String,
        actual: String,
    },
}

type Result<T> = std::result::Result<T, ObjectsError>;

/// One file of a pushed template.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PushedFile {
    pub name: String,
    /// Hex, no prefix.
    pub sha256: String,
    pub size: u64,
}

/// `templates/<hex>/manifest.json`: the local manifest as it is, and each file's digest, so a
/// pull checks every file on its own and the set against the template's digest.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PushedTemplate {
    pub manifest: TemplateManifest,
    /// Kernel, initramfs, rootfs, in that order.
    pub files: Vec<PushedFile>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    /// `sha256:<hex>`.
    pub digest: String,
    /// Blob and manifest bytes this push uploaded (0: the store had them all).
    pub uploaded_bytes: u64,
}

#[derive(Debug, Clone)]
pub struct Pulled {
    pub template: Template,
    /// Blob bytes this pull downloaded (0: the local store had them all).
    pub fetched_bytes: u64,
}

/// Where an S3 bucket is and who we are to it. No `Debug`: it holds the secret.
#[derive(Clone)]
pub struct S3 {
    /// `http://host:port` for an S3-compatible store; `None`: AWS, by region.
    pub endpoint: Option<String>,
    pub bucket: String,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
}

/// Object storage for templates.
#[derive(Debug, Clone)]
pub struct Objects {
    store: Arc<dyn ObjectStore>,
}

impl Objects {
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        Self { store }
    }

    /// An S3 bucket; conditional creates by `If-None-Match: *`.
    pub fn s3(s3: &S3) -> Result<Self> {
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&s3.bucket)
            .with_region(&s3.region)
            .with_access_key_id(&s3.access_key_id)
            .with_secret_access_key(&s3.secret_access_key)
            .with_conditional_put(S3ConditionalPut::ETagMatch);
        if let Some(endpoint) = &s3.endpoint {
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"));
        }
        Ok(Self::new(Arc::new(builder.build().map_err(ObjectsError::Setup)?)))
    }

    /// A dir on this host (made if missing): single-host mode, and tests.
    pub fn local(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let fs = LocalFileSystem::new_with_prefix(dir).map_err(ObjectsError::Setup)?;
        Ok(Self::new(Arc::new(fs)))
    }

    /// Upload `template`'s blobs the store lacks, then its manifest, then point its name at it.
    /// The local files are checked against the template's digest first: a corrupt local
    /// template is never published.
    pub async fn push_template(&self, template: &Template) -> Result<Pushed> {
        let digest = template.manifest.digest.clone();
        let names = FILES.iter().map(|f| f.to_string()).collect();
        let files = describe_files(template.dir.clone(), names).await?;
        let actual = content_digest(&files);
        if actual != digest {
            return Err(ObjectsError::DigestMismatch {
                digest: digest.clone(),
                what: format!("local template {}", template.manifest.name),
                expected: digest,
                actual,
            });
        }
        let hex = hex_of(&digest);
        let mut uploaded = 0;
        for file in &files {
            let path = ObjectPath::from(format!("templates/{hex}/{}", file.name));
            if !self.exists(&path).await? {
                uploaded += self
                    .upload_file(&path, &template.dir.join(&file.name), file.size)
                    .await?;
            }
        }
        let manifest_path = ObjectPath::from(format!("templates/{hex}/manifest.json"));
        if !self.exists(&manifest_path).await? {
            let pushed = PushedTemplate {
                manifest: template.manifest.clone(),
                files,
            };
            let json = serde_json::to_vec_pretty(&pushed).expect("serializable");
            uploaded += json.len() as u64;
            self.put_create(&manifest_path, json.into()).await?;
        }
        // A name is a tag: the last push wins, as a local rebuild replaces the local one.
        let name_path = ObjectPath::from(format!("names/{}", template.manifest.name));
        self.store
            .put(&name_path, digest.clone().into_bytes().into())
            .await
            .map_err(store_err("put", &name_path))?;
        Ok(Pushed {
            digest,
            uploaded_bytes: uploaded,
        })
    }

    /// Make `reference` (a name or `sha256:<hex>`) a template of `local`, downloading only what
    /// it lacks, every file verified before anything enters the store. A local template of
    /// that name and another digest is replaced, as a rebuild replaces it (its blobs stay
    /// until the runtime prunes unnamed ones).
    pub async fn pull_template(&self, reference: &str, local: &TemplateStore) -> Result<Pulled> {
        let hex = self.resolve(reference).await?;
        let manifest_path = format!("templates/{hex}/manifest.json");
        let bytes = self.get_small(&manifest_path, reference).await?;
        let pushed: PushedTemplate = serde_json::from_slice(&bytes).map_err(|e| ObjectsError::BadManifest {
            path: manifest_path.clone(),
            reason: e.to_string(),
        })?;
        check_manifest(&pushed, &hex, &manifest_path)?;
        let manifest = pushed.manifest;
        if let Some(have) = local.load(&manifest.name).filter(|t| t.manifest == manifest) {
            return Ok(Pulled {
                template: have,
                fetched_bytes: 0,
            });
        }
        let data = local.data();
        let dir = data.blobs().join(&hex);
        let mut fetched = 0;
        // The store renames whole blob dirs into place: one that exists is complete.
        if !dir.exists() {
            let staging = Staging::new(data)?;
            for file in &pushed.files {
                let path = ObjectPath::from(format!("templates/{hex}/{}", file.name));
                let to = staging.dir.join(&file.name);
                fetched += self.download(&path, file, &to, 0o644, &manifest.digest).await?;
            }
            // A racing pull that got there first made the same dir.
            if let Err(e) = staging.commit(&dir) {
                if !FILES.iter().all(|f| dir.join(f).exists()) {
                    return Err(io(&dir)(e));
                }
            }
        }
        write_atomic(
            &local.manifest_path(&manifest.name),
            &serde_json::to_vec_pretty(&manifest).expect("serializable"),
        )?;
        Ok(Pulled {
            template: Template { manifest, dir },
            fetched_bytes: fetched,
        })
    }

    /// The digest (`sha256:<hex>`) template `name` points at in the store; None: no such name.
    pub async fn template_digest(&self, name: &str) -> Result<Option<String>> {
        match self.resolve(name).await {
            Ok(hex) => Ok(Some(format!("sha256:{hex}"))),
            Err(ObjectsError::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The hex digest `reference` names in the store.
    async fn resolve(&self, reference: &str) -> Result<String> {
        if let Some(hex) = reference.strip_prefix("sha256:") {
            return is_hex64(hex)
                .then(|| hex.to_string())
                .ok_or_else(|| ObjectsError::BadReference(reference.to_string()));
        }
        let (name, _) = parse_reference(reference).map_err(|_| ObjectsError::BadReference(reference.to_string()))?;
        self.pointer(&format!("names/{name}"), reference).await
    }

    /// The hex digest the pointer object at `path` holds (`sha256:<hex>`).
    async fn pointer(&self, path: &str, reference: &str) -> Result<String> {
        let text = self.get_small(path, reference).await?;
        String::from_utf8(text)
            .ok()
            .and_then(|s| {
                s.trim()
                    .strip_prefix("sha256:")
                    .filter(|h| is_hex64(h))
                    .map(String::from)
            })
            .ok_or(ObjectsError::BadManifest {
                path: path.to_string(),
                reason: "not a sha256:<hex> digest".into(),
            })
    }

    async fn exists(&self, path: &ObjectPath) -> Result<bool> {
        match self.store.head(path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(store_err("head", path)(e)),
        }
    }

    /// Create `path` unless it exists: content-addressed, so an object another host created
    /// meanwhile holds these same bytes.
    async fn put_create(&self, path: &ObjectPath, payload: PutPayload) -> Result<()> {
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self.store.put_opts(path, payload, opts).await {
            Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => Ok(()),
            Err(e) => Err(store_err("put", path)(e)),
        }
    }

    /// One file: whole if at most a part, else streamed in parts (multipart uploads cannot be
    /// conditional; a racing host's upload of the same digest writes the same bytes).
    async fn upload_file(&self, path: &ObjectPath, file: &Path, size: u64) -> Result<u64> {
        if size <= PART_SIZE as u64 {
            let bytes = tokio::fs::read(file).await.map_err(io(file))?;
            let len = bytes.len() as u64;
            self.put_create(path, bytes.into()).await?;
            return Ok(len);
        }
        let upload = self
            .store
            .put_multipart(path)
            .await
            .map_err(store_err("start multipart upload", path))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
        match feed(&mut writer, path, file).await {
            Ok(sent) => {
                writer
                    .finish()
                    .await
                    .map_err(store_err("finish multipart upload", path))?;
                Ok(sent)
            }
            Err(e) => {
                // Best effort: a store also expires abandoned uploads by its own rules.
                let _ = writer.abort().await;
                Err(e)
            }
        }
    }

    /// Stream the object at `path` to a new file `to` of `mode`, hashing as it comes; more
    /// bytes than `file` says stop it. `digest` names what it belongs to in an error.
    async fn download(&self, path: &ObjectPath, file: &PushedFile, to: &Path, mode: u32, digest: &str) -> Result<u64> {
        let got = self.store.get(path).await.map_err(store_err("get", path))?;
        let mut stream = got.into_stream();
        let mut out = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(to)
            .await
            .map_err(io(to))?;
        let mut hasher = Sha256::new();
        let mut received = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(store_err("get", path))?;
            received += chunk.len() as u64;
            if received > file.size {
                break;
            }
            hasher.update(&chunk);
            out.write_all(&chunk).await.map_err(io(to))?;
        }
        out.sync_all().await.map_err(io(to))?;
        let actual = hex::encode(hasher.finalize());
        if received != file.size || actual != file.sha256 {
            return Err(ObjectsError::DigestMismatch {
                digest: digest.to_string(),
                what: format!("{} ({received} bytes, expected {})", file.name, file.size),
                expected: file.sha256.clone(),
                actual,
            });
        }
        Ok(received)
    }

    async fn get_small(&self, path: &str, reference: &str) -> Result<Vec<u8>> {
        let object = ObjectPath::from(path);
        let got = match self.store.get(&object).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Err(ObjectsError::NotFound(reference.to_string())),
            Err(e) => return Err(store_err("get", &object)(e)),
        };
        if got.meta.size > MAX_SMALL_OBJECT {
            return Err(ObjectsError::BadManifest {
                path: path.to_string(),
                reason: format!("{} bytes", got.meta.size),
            });
        }
        Ok(got.bytes().await.map_err(store_err("get", &object))?.to_vec())
    }
}

async fn feed(writer: &mut WriteMultipart, path: &ObjectPath, file: &Path) -> Result<u64> {
    let mut f = tokio::fs::File::open(file).await.map_err(io(file))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut sent = 0u64;
    loop {
        let n = f.read(&mut buf).await.map_err(io(file))?;
        if n == 0 {
            return Ok(sent);
        }
        writer
            .wait_for_capacity(UPLOAD_CONCURRENCY)
            .await
            .map_err(store_err("upload part", path))?;
        writer.write(&buf[..n]);
        sent += n as u64;
    }
}

/// The digest and size of each of `names` in `dir` (off the async threads: a rootfs is large).
async fn describe_files(dir: PathBuf, names: Vec<String>) -> Result<Vec<PushedFile>> {
    tokio::task::spawn_blocking(move || {
        names
            .into_iter()
            .map(|name| {
                let path = dir.join(&name);
                let size = std::fs::metadata(&path).map_err(io(&path))?.len();
                Ok(PushedFile {
                    name,
                    sha256: sha256_file(&path)?,
                    size,
                })
            })
            .collect()
    })
    .await
    .expect("hashing does not panic")
}

/// `sha256:<hex>` as the template store derives it from the files' digests.
fn content_digest(files: &[PushedFile]) -> String {
    let mut h = Sha256::new();
    for f in files {
        h.update(f.sha256.as_bytes());
    }
    format!("sha256:{}", hex::encode(h.finalize()))
}

/// Everything a pull takes from a manifest before trusting it: the digest it was found under,
/// a name that is a plain name (it becomes a file name), the three files, their digests.
fn check_manifest(pushed: &PushedTemplate, hex: &str, path: &str) -> Result<()> {
    let bad = |reason: &str| ObjectsError::BadManifest {
        path: path.to_string(),
        reason: reason.to_string(),
    };
    let m = &pushed.manifest;
    if m.digest != format!("sha256:{hex}") {
        return Err(bad("its digest is not the one it is stored under"));
    }
    if !matches!(parse_reference(&m.name), Ok((name, None)) if name == m.name) {
        return Err(bad("invalid template name"));
    }
    let names: Vec<&str> = pushed.files.iter().map(|f| f.name.as_str()).collect();
    if names != FILES || !pushed.files.iter().all(|f| is_hex64(&f.sha256)) {
        return Err(bad(
            "its files are not kernel, initramfs and rootfs with sha256 digests",
        ));
    }
    let actual = content_digest(&pushed.files);
    if actual != m.digest {
        return Err(ObjectsError::DigestMismatch {
            digest: m.digest.clone(),
            what: "the manifest's file digests".into(),
            expected: m.digest.clone(),
            actual,
        });
    }
    Ok(())
}

fn is_hex64(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn hex_of(digest: &str) -> &str {
    digest.trim_start_matches("sha256:")
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ObjectsError + '_ {
    move |source| ObjectsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn store_err(op: &'static str, path: &ObjectPath) -> impl FnOnce(object_store::Error) -> ObjectsError {
    let path = path.to_string();
    move |source| ObjectsError::Store { op, path, source }
}

/// A pull's dir in the cache, removed unless committed: a failed pull leaves nothing.
struct Staging {
    dir: PathBuf,
    committed: bool,
}

impl Staging {
    fn new(data: &crate::datadir::DataDir) -> Result<Self> {
        let dir = data.cache().join(format!("objects-pull-{}", random_hex(8)));
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        Ok(Self { dir, committed: false })
    }

    /// Rename into `to` (which must not exist); dropped, not renamed, on an error.
    fn commit(mut self, to: &Path) -> std::io::Result<()> {
        std::fs::rename(&self.dir, to)?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
