//! Tenants' own templates: builds from a definition (`definition.rs`: steps, a Dockerfile
//! subset), run in a microVM of the tenant's (`run.rs`), named `name:tag` per tenant. A create
//! names one like any template; the newest ready build of its tag serves it, so a rebuild under
//! way leaves the older one serving. Platform templates (what the nodes build from recipes) are
//! every tenant's and cannot be shadowed; another tenant's template answers like a missing one.
//!
//! A build is recorded `waiting` once its build sandbox is admitted (quota and node budget, as
//! any create), `building` while its steps run, then `ready` or `error` naming the step. Its
//! replica renews a heartbeat; a build whose replica stopped is failed by any replica
//! ([`Core::spawn_build_sweeper`]) and its build sandbox deleted.

pub mod definition;
mod run;
mod tags;

pub use tags::UploadLink;

pub use definition::{parse_dockerfile, BuildStep, Definition, StepKind};
pub use run::BUILD_LIMIT;

use super::principal::Principal;
use super::sandboxes::{acting_tenant, CreateSandbox};
use super::Core;
use crate::error::{Conflict, CoreError, CoreResult, Kind};
use crate::nodes::ImageImport;
use crate::records::{now_ms, BuildLogEntry, BuildRecord, BuildStatus, Tenant};
use airlock_runtime::template::TemplateManifest;
use futures_util::{Stream, StreamExt};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// A build whose heartbeat is older than this is failed: its replica stopped.
pub const STALLED_AFTER: Duration = Duration::from_secs(30);
/// The longest uploaded context.
pub const MAX_CONTEXT_BYTES: u64 = 1 << 30;
/// Log entries one read returns at most.
pub const MAX_LOG_PAGE: i64 = 100;
/// The prefix of built templates' names in the nodes' stores (`build-<build id>`): never a
/// platform template.
pub const BUILT_PREFIX: &str = "build-";

/// A build a door asks for: its definition now (the native door), or later
/// ([`Core::new_build`], then [`Core::start_build`]: E2B's builder).
#[derive(Debug, Clone)]
pub struct BuildRequest {
    /// `name[:tag]`; the tag is `default` when none is given.
    pub name: String,
    pub definition: Definition,
}

/// The prefix of templates made of OCI images in the nodes' stores (under [`BUILT_PREFIX`]).
pub const IMAGE_PREFIX: &str = "build-oci-";

/// The node template image `image` becomes for tenant `tenant_id`: the tenant's prefix (see
/// [`image_templates_of`]), then the image's.
fn image_template_name(tenant_id: &str, image: &str) -> String {
    let mut h = Sha256::new();
    h.update(tenant_id.as_bytes());
    h.update([0]);
    h.update(image.as_bytes());
    format!("{}{}", image_templates_of(tenant_id), &hex::encode(h.finalize())[..16])
}

/// The node template build `b` of tenant `tenant_id` pulled for its parent, were its parent an
/// image (for a template parent, a name no node has).
fn image_parent_of(tenant_id: &str, b: &BuildRecord) -> Option<String> {
    let def: Definition = serde_json::from_str(&b.definition).ok()?;
    Some(image_template_name(tenant_id, def.from.trim()))
}

/// What the names of tenant `tenant_id`'s image templates start with.
fn image_templates_of(tenant_id: &str) -> String {
    let tenant = hex::encode(Sha256::digest(tenant_id.as_bytes()));
    format!("{IMAGE_PREFIX}{}-", &tenant[..12])
}

/// What a build VM's disk has beyond its parent's image, unless the build asks for a size.
pub const BUILD_HEADROOM_MIB: u64 = 1024;

/// How long an untriggered build ([`Core::new_build`]) waits for its steps.
pub const UNTRIGGERED_FOR: Duration = Duration::from_secs(3600);

/// `name[:tag]` checked: lowercase, E2B's alphabet (`[a-z0-9-_]` names, `[a-z0-9-_.]` tags).
pub fn split_name(reference: &str) -> CoreResult<(String, String)> {
    let reference = reference.trim().to_ascii_lowercase();
    let (name, tag) = reference.split_once(':').unwrap_or((&reference, "default"));
    let name_ok = !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !name_ok {
        return Err(CoreError::invalid(
            "name",
            format!("Invalid name: {name:?} (lowercase letters, digits, - and _)"),
        ));
    }
    let tag_ok = !tag.is_empty()
        && tag.len() <= 128
        && tag
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_' || b == b'.');
    if !tag_ok {
        return Err(CoreError::invalid(
            "name",
            format!("Invalid tag: {tag:?} (lowercase letters, digits, -, _ and .)"),
        ));
    }
    Ok((name.to_string(), tag.to_string()))
}

/// The airlock template an OCI image reference stands for: the operator's `AIRLOCK_IMAGE_MAP`
/// (`image=template,...`) first; E2B's default base (the SDK's `Template()` with no parent) is
/// always `base`, which is built to be it, rather than a pull of a GiB; where the image cannot
/// be pulled (`reachable` false), the Debian images `base` is close to. None: pull the image.
pub fn image_fallback(image: &str, reachable: bool) -> Option<String> {
    let mut r = image.trim().to_ascii_lowercase();
    for prefix in ["docker.io/", "index.docker.io/", "registry-1.docker.io/"] {
        if let Some(rest) = r.strip_prefix(prefix) {
            r = rest.to_string();
        }
    }
    if let Some(rest) = r.strip_prefix("library/") {
        r = rest.to_string();
    }
    if !r.rsplit('/').next().unwrap_or("").contains(':') {
        r.push_str(":latest");
    }
    if let Ok(map) = std::env::var("AIRLOCK_IMAGE_MAP") {
        for pair in map.split(',') {
            if let Some((from, to)) = pair.split_once('=') {
                let from = from.trim().to_ascii_lowercase();
                if from == r || format!("{from}:latest") == r {
                    return Some(to.trim().to_string());
                }
            }
        }
    }
    if r == "e2bdev/base:latest" {
        return Some("base".into());
    }
    if reachable {
        return None;
    }
    const BASE: &[&str] = &[
        "debian:bookworm",
        "debian:bookworm-slim",
        "debian:12",
        "debian:12-slim",
        "python:3",
        "python:3.11",
        "python:3.11-slim",
        "python:3.11-bookworm",
        "python:3.11-slim-bookworm",
        "node:18",
        "node:18-bookworm",
        "node:18-slim",
        "node:18-bookworm-slim",
    ];
    BASE.contains(&r.as_str()).then(|| "base".to_string())
}

/// The user, workdir and env a build starts with on `parent`.
fn context_of(parent: &TemplateManifest) -> run::Context {
    match &parent.built {
        Some(b) => run::Context {
            user: b.user.clone(),
            workdir: b.workdir.clone(),
            env: b.env.clone(),
            no_bash: false,
        },
        None => run::Context {
            user: "user".into(),
            workdir: None,
            env: Default::default(),
            no_bash: false,
        },
    }
}

/// A random UUID (version 4), as E2B's build ids are.
fn new_build_id() -> String {
    let mut b = hex::decode(airlock_runtime::random::random_hex(16)).expect("hex");
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// A build's parent and content key, checked.
struct Prepared {
    parent: TemplateManifest,
    key: String,
}

fn new_record(tenant: &Tenant, name: String, tag: String, def: &Definition) -> BuildRecord {
    let now = now_ms();
    BuildRecord {
        id: new_build_id(),
        tenant_id: tenant.id.clone(),
        name,
        tag,
        status: BuildStatus::Waiting,
        definition: serde_json::to_string(def).expect("serializable"),
        cache_key: None,
        template: None,
        digest: None,
        manifest: None,
        node: String::new(),
        sandbox_id: None,
        step: None,
        error: None,
        error_step: None,
        created_at_ms: now,
        finished_at_ms: None,
        heartbeat_ms: now,
    }
}

fn missing_build(id: &str) -> CoreError {
    CoreError::NotFound {
        kind: Kind::Template,
        id: format!("build {id}"),
        hint: String::new(),
    }
}

impl Core {
    /// Start a build of the caller's template `req.name`: its build sandbox is admitted now (a
    /// quota or budget refusal is this call's error), its steps run in the background.
    pub async fn build_template(&self, principal: &Principal, req: BuildRequest) -> CoreResult<BuildRecord> {
        let tenant = acting_tenant(principal)?.clone();
        let r = async {
            let (name, tag) = self.check_build_name(&req.name)?;
            let mut build = new_record(&tenant, name, tag, &req.definition);
            let prepared = self.prepare_build(&tenant, &req.definition).await?;
            self.launch_build(principal, &tenant, &mut build, req.definition, prepared, true)
                .await?;
            Ok(build)
        }
        .await;
        self.audit_build(principal, &tenant, &r).await;
        r
    }

    /// Record a build of the caller's template `name` (`name[:tag]`, and `tags` too) that waits
    /// for its definition ([`Core::start_build`]), for [`UNTRIGGERED_FOR`].
    pub async fn new_build(
        &self,
        principal: &Principal,
        name: &str,
        tags: &[String],
        definition: Definition,
    ) -> CoreResult<BuildRecord> {
        let tenant = acting_tenant(principal)?;
        let (name, tag) = self.check_build_name(name)?;
        let mut extra = Vec::new();
        for t in tags {
            let (_, t) = split_name(&format!("{name}:{t}"))?;
            if t != tag && !extra.contains(&t) {
                extra.push(t);
            }
        }
        let build = new_record(tenant, name, tag, &definition);
        self.store.insert_build(&build).await?;
        for t in extra {
            self.store
                .assign_tag(&tenant.id, &build.name, &t, &build.id, build.created_at_ms)
                .await?;
        }
        Ok(build)
    }

    /// Give waiting build `id` of the caller its definition and start it, as
    /// [`Core::build_template`] does. A definition that cannot build (a parent nobody has, a
    /// COPY of a context not uploaded) is this call's error, and the build's.
    pub async fn start_build(
        &self,
        principal: &Principal,
        id: &str,
        definition: Definition,
    ) -> CoreResult<BuildRecord> {
        let tenant = acting_tenant(principal)?.clone();
        let mut build = self.template_build(principal, id).await?;
        if build.status != BuildStatus::Waiting || build.sandbox_id.is_some() {
            return Err(CoreError::invalid(
                "build",
                format!("build {id} is {}, not waiting for its steps", build.status.as_str()),
            ));
        }
        build.definition = serde_json::to_string(&definition).expect("serializable");
        let r = async {
            let prepared = self.prepare_build(&tenant, &definition).await?;
            self.launch_build(principal, &tenant, &mut build, definition, prepared, false)
                .await
        }
        .await;
        if let Err(e) = &r {
            build.status = BuildStatus::Error;
            build.error = Some(e.to_string());
            build.error_step = Some("base".into());
            build.finished_at_ms = Some(now_ms());
            self.store.update_build(&build).await?;
        }
        self.audit_build(
            principal,
            &tenant,
            &r.as_ref().map(|_| build.clone()).map_err(|e| e.to_string()),
        )
        .await;
        r.map(|_| build)
    }

    async fn audit_build<E>(&self, principal: &Principal, tenant: &Tenant, r: &Result<BuildRecord, E>) {
        let object = r.as_ref().ok().map(|b| format!("{}:{}", b.name, b.tag));
        let outcome = if r.is_ok() { "ok" } else { "error" };
        self.audit(
            &principal.actor(),
            Some(&tenant.name),
            "template.build",
            object.as_deref(),
            outcome,
        )
        .await;
    }

    fn check_build_name(&self, reference: &str) -> CoreResult<(String, String)> {
        let (name, tag) = split_name(reference)?;
        if self.platform_template(&name).is_some() || name.starts_with(BUILT_PREFIX) {
            return Err(Conflict::NameTaken(name).into());
        }
        Ok((name, tag))
    }

    /// What a definition builds on, checked: its steps, its contexts, its parent.
    async fn prepare_build(&self, tenant: &Tenant, def: &Definition) -> CoreResult<Prepared> {
        def.validate()?;
        for hash in def.contexts() {
            if !self.build_context_path(&tenant.id, hash)?.exists() {
                return Err(CoreError::invalid(
                    "steps",
                    format!("the context {hash} a COPY names was not uploaded"),
                ));
            }
        }
        let parent = self.build_parent(tenant, def).await?;
        let key = def.cache_key(&parent.digest);
        Ok(Prepared { parent, key })
    }

    /// The template `def.from` names: a template (a platform one, then the tenant's), else an
    /// OCI image made a template on a node, per tenant (no tenant starts from what another
    /// pulled with its credentials), again only when the image's manifest changed.
    async fn build_parent(&self, tenant: &Tenant, def: &Definition) -> CoreResult<TemplateManifest> {
        let hint = match self.resolve_template_for(tenant, &def.from).await {
            Ok(m) => return Ok(m),
            Err(CoreError::NotFound { hint, .. }) => hint,
            Err(e) => return Err(e),
        };
        if let Some(t) = image_fallback(&def.from, self.config.registries.reaches(&def.from)) {
            tracing::info!(image = %def.from, template = %t, "FROM {} -> airlock {t}", def.from);
            return self.resolve_template_for(tenant, &t).await;
        }
        let import = ImageImport {
            image: def.from.trim().to_string(),
            name: image_template_name(&tenant.id, def.from.trim()),
            credentials: def.registry_auth.clone(),
            registries: self.config.registries.clone(),
        };
        let started = std::time::Instant::now();
        match self.nodes.import_image(&import).await {
            Ok(m) => {
                tracing::info!(image = %import.image, template = %m.name, "image parent ready in {} ms", started.elapsed().as_millis());
                Ok(m)
            }
            // A bare name is more likely a template the caller misspelled than an image.
            Err(crate::nodes::NodeError::BadImage(why)) if !def.from.contains(['/', '.', '@']) => {
                Err(CoreError::invalid(
                    "from",
                    format!("template {:?} not found{hint}; as an image: {why}", def.from),
                ))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Run `build` (recorded already unless `insert`): the same content built before is taken
    /// at once; otherwise its build sandbox is admitted and its steps start.
    async fn launch_build(
        &self,
        principal: &Principal,
        tenant: &Tenant,
        build: &mut BuildRecord,
        def: Definition,
        prepared: Prepared,
        insert: bool,
    ) -> CoreResult<()> {
        let Prepared { parent, key } = prepared;
        build.cache_key = Some(key.clone());
        let forced = def.force || def.steps.iter().any(|s| s.force);
        let cached = match forced {
            true => None,
            false => self.store.build_by_key(&tenant.id, &key).await?,
        };
        if let Some(done) = cached {
            build.status = BuildStatus::Ready;
            build.template = done.template;
            build.digest = done.digest;
            build.manifest = done.manifest;
            build.node = done.node;
            build.finished_at_ms = Some(now_ms());
            build.step = Some("finalize".into());
            match insert {
                true => self.store.insert_build(build).await?,
                false => {
                    self.store.update_build(build).await?;
                }
            }
            let line = BuildLogEntry {
                seq: 0,
                at_ms: now_ms(),
                level: "info".into(),
                step: "base".into(),
                message: format!("cached: build {} made this content ({key})", done.id),
            };
            self.store.append_build_logs(&build.id, &[line]).await?;
            return Ok(());
        }
        // The build VM's shape: as asked; its disk its parent's image and a GiB to grow in.
        let defaults = airlock_runtime::Resources::default();
        let shape = crate::model::Resources {
            vcpu: def.vcpu.unwrap_or(defaults.vcpu),
            memory_mib: def.memory_mib.unwrap_or(defaults.memory_mib),
            disk_mib: def
                .disk_mib
                .unwrap_or((parent.rootfs_bytes.div_ceil(1 << 20) + BUILD_HEADROOM_MIB) as u32),
        };
        let start_context = context_of(&parent);
        let keys = definition::step_keys(
            &def,
            &parent.digest,
            &serde_json::to_string(&start_context).expect("serializable"),
            &serde_json::to_string(&shape).expect("serializable"),
        );
        // The deepest step whose result is cached, no step up to it forced: the build resumes
        // from its saved VM.
        let mut resume = None;
        if !def.force {
            let last_unforced = def.steps.iter().position(|s| s.force).unwrap_or(def.steps.len());
            let images = self.nodes.image_ids();
            for i in (1..=last_unforced).rev() {
                if let Some(hit) = self.store.cached_step(&tenant.id, &keys[i], now_ms()).await? {
                    // Its image went (a node lost it): the entry goes, a shallower one may do.
                    if !images.contains(&hit.image_id) {
                        tracing::warn!(image = %hit.image_id, "a cached step's image is gone; dropping the entry");
                        self.store.drop_cached_step(&tenant.id, &hit.cache_key).await?;
                        continue;
                    }
                    if let Ok(context) = serde_json::from_str::<run::Context>(&hit.context) {
                        resume = Some((i, hit, context));
                        break;
                    }
                }
            }
        }
        let from_saved = resume.as_ref().map(|(_, hit, _)| crate::records::SnapshotRecord {
            id: hit.image_id.clone(),
            tenant_id: tenant.id.clone(),
            name: None,
            kind: crate::records::SnapshotKind::Snapshot,
            sandbox_id: String::new(),
            template: hit.template.clone(),
            resources: hit.resources,
            bytes: 0,
            digest: None,
            created_at_ms: hit.used_at_ms,
            shared: None,
        });
        let created = self
            .create_sandbox_unaudited(
                principal,
                tenant,
                CreateSandbox {
                    template: def.from.clone(),
                    runtime: None,
                    vcpu: Some(shape.vcpu),
                    memory_mib: Some(shape.memory_mib),
                    disk_mib: Some(shape.disk_mib),
                    timeout: Some(BUILD_LIMIT + Duration::from_secs(300)),
                    env: Default::default(),
                    metadata: [("airlock.build".to_string(), build.id.clone())].into(),
                    idempotency_key: None,
                    egress: Default::default(),
                    lifecycle: Default::default(),
                    inherit_egress: None,
                    from_saved,
                    parent: parent.name.starts_with(IMAGE_PREFIX).then(|| parent.clone()),
                    volumes: Vec::new(),
                },
            )
            .await?;
        let start = run::Start {
            from_step: resume.as_ref().map_or(0, |(i, _, _)| *i),
            context: resume.map_or(start_context, |(_, _, c)| c),
            keys,
            template: parent.name.clone(),
            shape,
        };
        build.sandbox_id = Some(created.sandbox_id.clone());
        build.status = BuildStatus::Building;
        build.heartbeat_ms = now_ms();
        match insert {
            true => self.store.insert_build(build).await?,
            false => {
                self.store.update_build(build).await?;
            }
        }
        tokio::spawn(run::run(
            self.clone(),
            principal.clone(),
            build.clone(),
            def,
            parent,
            start,
            created.operation,
        ));
        Ok(())
    }

    /// The caller's build `id`.
    pub async fn template_build(&self, principal: &Principal, id: &str) -> CoreResult<BuildRecord> {
        let tenant = acting_tenant(principal)?;
        self.store
            .get_build(&tenant.id, id)
            .await?
            .ok_or_else(|| missing_build(id))
    }

    /// Up to [`MAX_LOG_PAGE`] (or `limit`) entries of the caller's build `id`'s log from `offset`.
    pub async fn template_build_logs(
        &self,
        principal: &Principal,
        id: &str,
        offset: i64,
        limit: Option<i64>,
    ) -> CoreResult<(BuildRecord, Vec<BuildLogEntry>)> {
        let build = self.template_build(principal, id).await?;
        let limit = limit.unwrap_or(MAX_LOG_PAGE).clamp(0, MAX_LOG_PAGE);
        let logs = self.store.build_logs(id, offset.max(0), limit).await?;
        Ok((build, logs))
    }

    /// The caller's builds, newest first (of template `name` only, if given).
    pub async fn template_builds(&self, principal: &Principal, name: Option<&str>) -> CoreResult<Vec<BuildRecord>> {
        let tenant = acting_tenant(principal)?;
        Ok(self.store.list_builds(&tenant.id, name).await?)
    }

    /// The caller's templates: per name and tag, the build that serves it (its `tag` the one
    /// it serves under).
    pub async fn tenant_templates(&self, principal: &Principal) -> CoreResult<Vec<BuildRecord>> {
        let tenant = acting_tenant(principal)?;
        let tagged = self.store.tagged_builds(&tenant.id).await?;
        Ok(tagged
            .into_iter()
            .map(|(tag, mut b)| {
                b.tag = tag;
                b
            })
            .collect())
    }

    /// Delete the caller's template `name` (every tag and build), and the images pulled for its
    /// parents that no other build of the caller was made of. Sandboxes made from it run on; a
    /// build under way ends with an error.
    pub async fn delete_tenant_template(&self, principal: &Principal, name: &str) -> CoreResult<()> {
        let tenant = acting_tenant(principal)?;
        let (name, _) = split_name(name)?;
        if self.platform_template(&name).is_some() {
            return Err(CoreError::Forbidden(format!(
                "{name} is a platform template; it cannot be deleted through this API"
            )));
        }
        let gone = self.store.delete_builds(&tenant.id, &name).await?;
        if gone.is_empty() {
            return Err(CoreError::NotFound {
                kind: Kind::Template,
                id: name,
                hint: String::new(),
            });
        }
        // An image another of the tenant's builds still names (a cached build's) stays; so does
        // an image pulled for a parent while a build of it is left (a rebuild pulls no more).
        let kept = self.store.list_builds(&tenant.id, None).await?;
        let still_pulled: BTreeSet<String> = kept.iter().filter_map(|b| image_parent_of(&tenant.id, b)).collect();
        let pulled: BTreeSet<String> = gone
            .iter()
            .filter_map(|b| image_parent_of(&tenant.id, b))
            .filter(|t| !still_pulled.contains(t) && self.nodes.template(t).is_some())
            .collect();
        let built = gone
            .iter()
            .filter_map(|b| b.template.clone())
            .filter(|t| !kept.iter().any(|k| k.template.as_deref() == Some(t.as_str())));
        for t in built.chain(pulled) {
            if let Err(e) = self.nodes.remove_template(&t).await {
                tracing::warn!(template = %t, "the template stays on a node for now: {e}");
            }
        }
        self.audit(
            &principal.actor(),
            Some(&tenant.name),
            "template.delete",
            Some(&name),
            "ok",
        )
        .await;
        Ok(())
    }

    /// Keep an uploaded build context (a tar, gzip-compressed or not) for the caller's builds.
    /// Its name is its sha256, or `expected` (E2B's client-chosen hash). Returns the name.
    pub async fn put_build_context<S, E>(
        &self,
        principal: &Principal,
        expected: Option<&str>,
        body: S,
    ) -> CoreResult<String>
    where
        S: Stream<Item = Result<bytes::Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let tenant = acting_tenant(principal)?;
        self.put_build_context_of(&tenant.id, expected, body).await
    }

    /// [`Core::put_build_context`] for tenant `tenant_id` (a signed upload link names it).
    pub(crate) async fn put_build_context_of<S, E>(
        &self,
        tenant_id: &str,
        expected: Option<&str>,
        body: S,
    ) -> CoreResult<String>
    where
        S: Stream<Item = Result<bytes::Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        if let Some(e) = expected {
            if !definition::is_sha256_hex(e) {
                return Err(CoreError::invalid("hash", "must be 64 lowercase hex digits"));
            }
        }
        let dir = self.build_contexts_dir(tenant_id)?;
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(|e| CoreError::Unavailable(format!("build contexts: {e}")))?;
        let tmp = dir.join(format!(".upload-{}", airlock_runtime::datadir::random_hex(6)));
        let written = async {
            let mut file = tokio::fs::File::create(&tmp)
                .await
                .map_err(|e| CoreError::Unavailable(format!("build contexts: {e}")))?;
            let mut hash = Sha256::new();
            let mut size = 0u64;
            let mut head = Vec::new();
            let mut body = std::pin::pin!(body);
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| CoreError::invalid("body", format!("the upload broke off: {e}")))?;
                size += chunk.len() as u64;
                if size > MAX_CONTEXT_BYTES {
                    return Err(CoreError::invalid(
                        "body",
                        format!("a build context may hold at most {} MiB", MAX_CONTEXT_BYTES >> 20),
                    ));
                }
                if head.len() < 512 {
                    head.extend_from_slice(&chunk[..chunk.len().min(512 - head.len())]);
                }
                hash.update(&chunk);
                file.write_all(&chunk)
                    .await
                    .map_err(|e| CoreError::Unavailable(format!("build contexts: {e}")))?;
            }
            file.sync_all()
                .await
                .map_err(|e| CoreError::Unavailable(format!("build contexts: {e}")))?;
            let gzip = head.starts_with(&[0x1f, 0x8b]);
            let tar = head.len() >= 262 && &head[257..262] == b"ustar";
            if !gzip && !tar {
                return Err(CoreError::invalid(
                    "body",
                    "a build context is a tar archive, gzip-compressed or not",
                ));
            }
            Ok(hex::encode(hash.finalize()))
        }
        .await;
        let computed = match written {
            Ok(h) => h,
            Err(e) => {
                let _ = tokio::fs::remove_file(&tmp).await;
                return Err(e);
            }
        };
        let name = expected.map(str::to_string).unwrap_or(computed);
        // Renamed once whole: a context that exists is complete.
        tokio::fs::rename(&tmp, dir.join(&name))
            .await
            .map_err(|e| CoreError::Unavailable(format!("build contexts: {e}")))?;
        Ok(name)
    }

    /// Whether the caller has uploaded context `hash`.
    pub fn has_build_context(&self, principal: &Principal, hash: &str) -> CoreResult<bool> {
        let tenant = acting_tenant(principal)?;
        Ok(self.build_context_path(&tenant.id, hash)?.exists())
    }

    fn build_contexts_dir(&self, tenant_id: &str) -> CoreResult<PathBuf> {
        let root = self
            .config
            .build_contexts
            .clone()
            .ok_or_else(|| CoreError::Unavailable("this server keeps no build contexts".into()))?;
        Ok(root.join(tenant_id))
    }

    pub(crate) fn build_context_path(&self, tenant_id: &str, hash: &str) -> CoreResult<PathBuf> {
        if !definition::is_sha256_hex(hash) {
            return Err(CoreError::invalid("filesHash", "must be 64 lowercase hex digits"));
        }
        Ok(self.build_contexts_dir(tenant_id)?.join(hash))
    }

    /// A platform template `name` names (a recipe's, or an alias), never a tenant's build.
    pub(crate) fn platform_template(&self, name: &str) -> Option<TemplateManifest> {
        if name.starts_with(BUILT_PREFIX) {
            return None;
        }
        self.nodes
            .template(name)
            .or_else(|| self.nodes.template(super::templates::canonical(name)))
            .filter(|m| !m.name.starts_with(BUILT_PREFIX))
    }

    /// The template `reference` names for `tenant`: a platform template, else the tenant's own
    /// `name[:tag]` (its newest ready build).
    pub(crate) async fn resolve_template_for(&self, tenant: &Tenant, reference: &str) -> CoreResult<TemplateManifest> {
        if let Some(m) = self.platform_template(reference) {
            return Ok(m);
        }
        if let Ok((name, tag)) = split_name(reference) {
            if let Some(b) = self.store.ready_build(&tenant.id, &name, &tag).await? {
                if let Some(m) = b.manifest.as_deref().and_then(|m| serde_json::from_str(m).ok()) {
                    return Ok(m);
                }
            }
        }
        self.resolve_template(reference)
    }

    /// Fail every build whose replica stopped, and delete its build sandbox, for as long as the
    /// core lives (any replica may: an ended build is not failed again).
    pub fn spawn_build_sweeper(&self) {
        let core = self.clone();
        tokio::spawn(async move {
            loop {
                core.fail_stalled_builds().await;
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        });
    }

    /// Everything a deleted tenant's builds left: builds under way ended (their sandboxes
    /// deleted), the step cache's images, the templates built and images pulled, the build
    /// records, logs and tags, the uploaded contexts.
    pub(crate) async fn purge_builds(&self, tenant: &Tenant) -> CoreResult<()> {
        let builds = self.store.list_builds(&tenant.id, None).await?;
        for b in builds
            .iter()
            .filter(|b| matches!(b.status, BuildStatus::Waiting | BuildStatus::Building))
        {
            let step = b.step.clone().unwrap_or_else(|| "base".into());
            self.end_build(tenant, b, i64::MAX, "the tenant was deleted".into(), step)
                .await?;
        }
        for c in self.store.cached_steps(&tenant.id).await? {
            self.store.drop_cached_step(&tenant.id, &c.cache_key).await?;
            if let Err(e) = self.nodes.delete_image(&c.image_id).await {
                tracing::warn!(image = %c.image_id, "a cached step's image stays on a node for now: {e}");
            }
        }
        let names: BTreeSet<&str> = builds.iter().map(|b| b.name.as_str()).collect();
        for name in names {
            self.store.delete_builds(&tenant.id, name).await?;
        }
        let pulled = image_templates_of(&tenant.id);
        let templates = builds.iter().filter_map(|b| b.template.clone()).chain(
            self.nodes
                .templates()
                .into_iter()
                .map(|m| m.name)
                .filter(|n| n.starts_with(&pulled)),
        );
        for t in templates {
            if let Err(e) = self.nodes.remove_template(&t).await {
                tracing::warn!(template = %t, "a deleted tenant's template stays on a node for now: {e}");
            }
        }
        if let Ok(dir) = self.build_contexts_dir(&tenant.id) {
            let _ = tokio::fs::remove_dir_all(dir).await;
        }
        Ok(())
    }

    /// Cancel the caller's build `id`: unless it ended, it ends `error` ("cancelled"), its build
    /// sandbox is deleted, and what its run still makes (a captured template) is removed when
    /// the run sees the end. An ended build is answered as it is.
    pub async fn cancel_build(&self, principal: &Principal, id: &str) -> CoreResult<BuildRecord> {
        let tenant = acting_tenant(principal)?.clone();
        let b = self.template_build(principal, id).await?;
        let step = b.step.clone().unwrap_or_else(|| "base".into());
        let error = format!("cancelled by {}", principal.actor());
        // Whatever its heartbeat: only if it has not ended.
        if self.end_build(&tenant, &b, i64::MAX, error, step).await? {
            self.audit(
                &principal.actor(),
                Some(&tenant.name),
                "template.cancel",
                Some(id),
                "ok",
            )
            .await;
        }
        self.template_build(principal, id).await
    }

    pub async fn fail_stalled_builds(&self) {
        let before = now_ms() - STALLED_AFTER.as_millis() as i64;
        let Ok(stalled) = self.store.stalled_builds(before).await else {
            return;
        };
        if stalled.is_empty() {
            return;
        }
        let tenants = self.store.list_tenants().await.unwrap_or_default();
        let untriggered_before = now_ms() - UNTRIGGERED_FOR.as_millis() as i64;
        for b in stalled {
            let untriggered = b.status == BuildStatus::Waiting && b.sandbox_id.is_none();
            if untriggered && b.heartbeat_ms >= untriggered_before {
                continue;
            }
            let error = match untriggered {
                true => format!(
                    "the build was never started (no steps within {} s)",
                    UNTRIGGERED_FOR.as_secs()
                ),
                false => "the build was interrupted: the server running it stopped".into(),
            };
            let step = b.step.clone().unwrap_or_else(|| "base".into());
            let Some(tenant) = tenants.iter().find(|(t, _)| t.id == b.tenant_id).map(|(t, _)| t) else {
                continue;
            };
            // Only if it did not end or beat since it was read.
            if let Ok(true) = self.end_build(tenant, &b, before, error.clone(), step).await {
                tracing::warn!(build = %b.id, "{error}: failed it");
            }
        }
    }

    /// End build `b` `error` with `error` at `step` unless it ended or beat since `before_ms`:
    /// the end logged, its build sandbox deleted. True when this call ended it.
    async fn end_build(
        &self,
        tenant: &Tenant,
        b: &BuildRecord,
        before_ms: i64,
        error: String,
        step: String,
    ) -> CoreResult<bool> {
        if !self
            .store
            .fail_stalled_build(&b.id, before_ms, &error, &step, now_ms())
            .await?
        {
            return Ok(false);
        }
        let line = BuildLogEntry {
            seq: 0,
            at_ms: now_ms(),
            level: "error".into(),
            step,
            message: error,
        };
        self.store.append_build_logs(&b.id, &[line]).await?;
        if let Some(sandbox) = &b.sandbox_id {
            match self.delete_sandbox_by("build", tenant, sandbox).await {
                Ok(_) | Err(CoreError::NotFound { .. }) => {}
                Err(e) => tracing::warn!(build = %b.id, %sandbox, "the build sandbox was not deleted: {e}"),
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::image_fallback;

    #[test]
    fn images_stand_as_templates_only_where_they_must() {
        // E2B's default base is `base` wherever it could be pulled from.
        for reachable in [false, true] {
            assert_eq!(image_fallback("e2bdev/base", reachable).as_deref(), Some("base"));
            assert_eq!(
                image_fallback("docker.io/e2bdev/base:latest", reachable).as_deref(),
                Some("base")
            );
        }
        // Debian's images: `base` only where they can't be pulled.
        assert_eq!(image_fallback("debian:bookworm", false).as_deref(), Some("base"));
        assert_eq!(
            image_fallback("docker.io/library/python:3.11", false).as_deref(),
            Some("base")
        );
        assert_eq!(image_fallback("debian:bookworm", true), None);
        assert_eq!(image_fallback("ubuntu:22.04", false), None);
    }
}
