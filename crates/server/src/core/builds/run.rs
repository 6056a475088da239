//! Running a build: its steps in its build sandbox (a microVM of the tenant's, admitted and
//! networked like any of its sandboxes), through the guest agent, each step's output kept as the
//! build's log; then the start command and its ready check, and the VM's disk captured as the
//! template (`Nodes::capture_template`). Whatever the outcome, the build sandbox goes.

use super::definition::{BuildStep, Definition, StepKind};
use crate::core::principal::Principal;
use crate::core::Core;
use crate::error::{CoreError, CoreResult};
use crate::model::Operation;
use crate::nodes::Capture;
use crate::records::{now_ms, BuildLogEntry, BuildRecord, BuildStatus};
use airlock_proto::frame::EventKind;
use airlock_proto::ProcessSpec;
use airlock_runtime::template::{Built, StartSpec, TemplateManifest};
use airlock_runtime::AgentClient;
use futures_util::StreamExt;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The longest a build runs, all steps told.
pub const BUILD_LIMIT: Duration = Duration::from_secs(3600);
/// Log lines a build keeps; later output is counted, not kept.
const MAX_LOG_LINES: usize = 20_000;
/// Bytes of one log line; longer ones are cut.
const MAX_LINE: usize = 4096;
/// How often a running build renews its heartbeat (a stalled one is failed after
/// [`super::STALLED_AFTER`]).
const BEAT: Duration = Duration::from_secs(3);
/// Where a COPY's context goes in the guest before it is unpacked.
const GUEST_STAGING: &str = "/tmp/.airlock-build";

/// What the steps so far made the build's processes run as.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct Context {
    pub user: String,
    pub workdir: Option<String>,
    pub env: BTreeMap<String, String>,
    /// The image has no `/bin/bash` (busybox, alpine): steps run with `/bin/sh`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_bash: bool,
}

impl Context {
    /// The image's shell: bash where there is one.
    fn shell(&self) -> &'static str {
        if self.no_bash {
            "/bin/sh"
        } else {
            "/bin/bash"
        }
    }

    /// `sh -c script` as this image runs it: bash as a login shell where there is one.
    fn shell_argv(&self, script: &str) -> Vec<String> {
        match self.no_bash {
            false => vec!["/bin/bash".into(), "-l".into(), "-c".into(), script.into()],
            true => vec!["/bin/sh".into(), "-c".into(), script.into()],
        }
    }
}

/// Where a build's steps start: after the deepest cached one (`from_step` steps done, `context`
/// as they left it), with the step cache's keys (`keys[i]`: after step i) and the build VM's
/// template and shape (what a cached step's saved VM is).
pub(super) struct Start {
    pub from_step: usize,
    pub context: Context,
    pub keys: Vec<String>,
    pub template: String,
    pub shape: crate::model::Resources,
}

/// The ids of cached steps' images.
pub const CACHED_STEP_PREFIX: &str = "step_";

/// Cached steps a tenant keeps; the least recently used go (their images with them).
const MAX_CACHED_STEPS: usize = 16;

/// A failed step: its place (`base`, `1`..`N`, `finalize`) and what went wrong.
#[derive(Debug)]
pub(super) struct StepError {
    pub step: String,
    pub message: String,
}

fn failed(step: &str, message: impl Into<String>) -> StepError {
    StepError {
        step: step.to_string(),
        message: message.into(),
    }
}

/// The build's log, flushed to the store as it grows.
pub(super) struct Log {
    core: Core,
    build: String,
    pending: Vec<BuildLogEntry>,
    kept: usize,
    dropped: usize,
}

impl Log {
    pub fn new(core: Core, build: &str) -> Self {
        Self {
            core,
            build: build.to_string(),
            pending: Vec::new(),
            kept: 0,
            dropped: 0,
        }
    }

    pub fn line(&mut self, level: &str, step: &str, message: &str) {
        if self.kept >= MAX_LOG_LINES {
            self.dropped += 1;
            return;
        }
        self.kept += 1;
        let mut message = message.trim_end_matches('\r').to_string();
        if message.len() > MAX_LINE {
            let mut cut = MAX_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str(" [cut]");
        }
        self.pending.push(BuildLogEntry {
            seq: 0,
            at_ms: now_ms(),
            level: level.into(),
            step: step.into(),
            message,
        });
    }

    pub async fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let entries = std::mem::take(&mut self.pending);
        if let Err(e) = self.core.store.append_build_logs(&self.build, &entries).await {
            tracing::warn!(build = %self.build, "build log lines lost: {e}");
        }
    }

    pub async fn finish(&mut self) {
        if self.dropped > 0 {
            let n = self.dropped;
            self.dropped = 0;
            self.kept = 0;
            self.line("warn", "finalize", &format!("{n} more log lines were not kept"));
        }
        self.flush().await;
    }
}

/// One build from its recorded start to its end; the record says how it ended.
pub(super) async fn run(
    core: Core,
    principal: Principal,
    mut build: BuildRecord,
    def: Definition,
    parent: TemplateManifest,
    start: Start,
    create: Operation,
) {
    let mut log = Log::new(core.clone(), &build.id);
    let beat = {
        let core = core.clone();
        let id = build.id.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(BEAT).await;
                let _ = core.store.beat_build(&id, now_ms()).await;
            }
        })
    };
    let outcome = tokio::time::timeout(
        BUILD_LIMIT,
        steps(&core, &mut build, &def, &parent, start, &create, &mut log),
    )
    .await;
    let outcome = outcome.unwrap_or_else(|_| {
        Err(failed(
            build.step.as_deref().unwrap_or("base"),
            format!("the build did not finish within {} s", BUILD_LIMIT.as_secs()),
        ))
    });
    beat.abort();
    if let Some(sandbox) = build.sandbox_id.clone() {
        if let Ok(tenant) = crate::core::sandboxes::acting_tenant(&principal) {
            // A capture already ended its VM; the record still goes through the engine. The
            // build ends once its sandbox is gone: an ended build leaves nothing running.
            match core.delete_sandbox_by("build", tenant, &sandbox).await {
                Ok(op) => {
                    if let Err(e) = core.wait_operation(&op).await {
                        tracing::warn!(build = %build.id, %sandbox, "the build sandbox's delete did not end: {e}");
                    }
                }
                Err(CoreError::NotFound { .. }) => {}
                Err(e) => tracing::warn!(build = %build.id, %sandbox, "the build sandbox was not deleted: {e}"),
            }
        }
    }
    build.finished_at_ms = Some(now_ms());
    build.heartbeat_ms = now_ms();
    match outcome {
        Ok(manifest) => {
            log.line(
                "info",
                "finalize",
                &format!("built {} ({} MiB)", manifest.digest, manifest.size_bytes >> 20),
            );
            build.status = BuildStatus::Ready;
            build.template = Some(manifest.name.clone());
            build.digest = Some(manifest.digest.clone());
            build.manifest = serde_json::to_string(&manifest).ok();
        }
        Err(e) => {
            log.line("error", &e.step, &e.message);
            build.status = BuildStatus::Error;
            build.error = Some(e.message);
            build.error_step = Some(e.step);
        }
    }
    log.finish().await;
    match core.store.update_build(&build).await {
        Ok(true) => {}
        // Its template was deleted while it built: the template it made goes too.
        Ok(false) => {
            if let Some(t) = &build.template {
                let _ = core.nodes.remove_template(t).await;
            }
        }
        Err(e) => tracing::warn!(build = %build.id, "the build's end was not recorded: {e}"),
    }
}

async fn steps(
    core: &Core,
    build: &mut BuildRecord,
    def: &Definition,
    parent: &TemplateManifest,
    start: Start,
    create: &Operation,
    log: &mut Log,
) -> Result<TemplateManifest, StepError> {
    let started = Instant::now();
    build.step = Some("base".into());
    build.status = BuildStatus::Building;
    save(core, build).await;
    let sandbox = build
        .sandbox_id
        .clone()
        .ok_or_else(|| failed("base", "no build sandbox"))?;
    let agent = core
        .build_agent(&build.tenant_id, &sandbox, create)
        .await
        .map_err(|e| failed("base", format!("the build VM did not start: {e}")))?;
    log.line(
        "info",
        "base",
        &format!(
            "FROM {} ({}), build VM up in {} ms",
            def.from,
            parent.digest,
            started.elapsed().as_millis()
        ),
    );
    log.flush().await;
    let mut ctx = start.context.clone();
    ctx.no_bash = agent.stat("/bin/bash").await.is_err();
    if ctx.no_bash {
        log.line("info", "base", "the image has no /bin/bash: steps run with /bin/sh");
    }
    // An image's build goes on as `user`, made now, as E2B's does after provisioning one (a
    // build resuming from a cached step has it already).
    if parent.name.starts_with(super::IMAGE_PREFIX) && start.from_step == 0 {
        log.line("info", "base", "DEFAULT USER user");
        become_user(&agent, &mut ctx, "user", "base", log).await?;
    }
    for (i, step) in def.steps.iter().enumerate().take(start.from_step) {
        log.line("info", &(i + 1).to_string(), &format!("CACHED {}", describe(step)));
    }
    for (i, step) in def.steps.iter().enumerate().skip(start.from_step) {
        let n = (i + 1).to_string();
        build.step = Some(n.clone());
        if !save(core, build).await {
            return Err(failed(
                &n,
                "the build was cancelled, or its template deleted, while it ran",
            ));
        }
        log.line("info", &n, &describe(step));
        let at = Instant::now();
        let r = run_step(core, &agent, &mut ctx, step, &n, build, log).await;
        log.flush().await;
        r?;
        log.line("debug", &n, &format!("done in {} ms", at.elapsed().as_millis()));
        // What a RUN or COPY made is kept for a later build of the same steps.
        if matches!(step.kind, StepKind::Run | StepKind::Copy) && i + 1 < def.steps.len() {
            let at = Instant::now();
            match cache_step(core, build, &sandbox, &start, i + 1, &ctx).await {
                Ok(()) => log.line("debug", &n, &format!("cached in {} ms", at.elapsed().as_millis())),
                Err(e) => log.line("warn", &n, &format!("not cached: {e}")),
            }
        }
    }
    build.step = Some("finalize".into());
    save(core, build).await;
    let start = def.start_cmd.as_ref().map(|cmd| StartSpec {
        argv: ctx.shell_argv(cmd),
        user: ctx.user.clone(),
        ready_port: 0,
        ready_cmd: def.ready_cmd.clone(),
        cwd: ctx.workdir.clone(),
        env: ctx.env.clone(),
    });
    if let Some(start) = &start {
        log.line(
            "info",
            "finalize",
            &format!("start command: {}", def.start_cmd.as_deref().unwrap_or("")),
        );
        if let Some(ready) = &def.ready_cmd {
            log.line("info", "finalize", &format!("waiting for the ready command: {ready}"));
        }
        log.flush().await;
        airlock_runtime::start_template_process(&agent, start, Duration::from_secs(600))
            .await
            .map_err(|e| failed("finalize", e.to_string()))?;
    }
    log.line("info", "finalize", "saving the template");
    log.flush().await;
    let capture = Capture {
        name: format!("build-{}", build.id),
        key: build.cache_key.clone().unwrap_or_default(),
        start,
        built: Built {
            parent: parent.digest.clone(),
            user: ctx.user.clone(),
            workdir: ctx.workdir.clone(),
            env: ctx.env.clone(),
        },
    };
    core.nodes
        .capture_template(&sandbox, &capture)
        .await
        .map_err(|e| failed("finalize", format!("the template could not be saved: {e}")))
}

/// Save the build VM after step `done` (1-based) as the step cache's entry `start.keys[done]`:
/// recorded first (an image is claimed before it exists), then saved while it runs on; the
/// tenant's least recently used entries past [`MAX_CACHED_STEPS`] go.
async fn cache_step(
    core: &Core,
    build: &BuildRecord,
    sandbox: &str,
    start: &Start,
    done: usize,
    ctx: &Context,
) -> CoreResult<()> {
    let entry = crate::records::CachedStep {
        tenant_id: build.tenant_id.clone(),
        cache_key: start.keys[done].clone(),
        image_id: format!("{CACHED_STEP_PREFIX}{}", airlock_runtime::random::random_hex(10)),
        template: start.template.clone(),
        resources: start.shape,
        context: serde_json::to_string(ctx).expect("serializable"),
        node: String::new(),
        used_at_ms: now_ms(),
    };
    core.store.put_cached_step(&entry).await?;
    if let Err(e) = core.nodes.save_image(sandbox, &entry.image_id).await {
        let _ = core.store.drop_cached_step(&entry.tenant_id, &entry.cache_key).await;
        let _ = core.nodes.delete_image(&entry.image_id).await;
        return Err(CoreError::Node(e));
    }
    let all = core.store.cached_steps(&build.tenant_id).await?;
    for old in all.iter().skip(MAX_CACHED_STEPS) {
        core.store.drop_cached_step(&old.tenant_id, &old.cache_key).await?;
        let _ = core.nodes.delete_image(&old.image_id).await;
    }
    Ok(())
}

/// The build sandbox's egress denials since `since_ms` (its own host name's lookups aside), as
/// `path destination (rule)`, at most 5.
async fn denials_since(core: &Core, sandbox: &str, since_ms: i64) -> Vec<String> {
    let Some(snapshot) = core.nodes.egress(sandbox).await else {
        return Vec::new();
    };
    let mut out: Vec<String> = Vec::new();
    for d in snapshot.recent_denials {
        if (d.at_unix_ms as i64) < since_ms || d.destination.starts_with(sandbox) {
            continue;
        }
        let path = match d.path {
            airlock_egress::Path::Dns => "dns",
            airlock_egress::Path::Tcp => "tcp",
        };
        let line = format!("{path} {} ({})", d.destination, d.rule);
        if !out.contains(&line) && out.len() < 5 {
            out.push(line);
        }
    }
    out
}

/// Record where `build` is (its heartbeat renewed with it); false when its record is gone.
async fn save(core: &Core, build: &mut BuildRecord) -> bool {
    build.heartbeat_ms = now_ms();
    core.store.update_build(build).await.unwrap_or(true)
}

fn describe(step: &BuildStep) -> String {
    match step.kind {
        StepKind::Copy => format!("COPY {} {}", step.args[0], step.args[1]),
        kind => format!("{} {}", kind.name(), step.args.join(" ")),
    }
}

async fn run_step(
    core: &Core,
    agent: &AgentClient,
    ctx: &mut Context,
    step: &BuildStep,
    n: &str,
    build: &BuildRecord,
    log: &mut Log,
) -> Result<(), StepError> {
    match step.kind {
        StepKind::Run => {
            let cmd = &step.args[0];
            let user = step.args.get(1).filter(|u| !u.is_empty()).unwrap_or(&ctx.user).clone();
            let ctx = Context { user, ..ctx.clone() };
            let since = now_ms();
            let Err(e) = shell(agent, &ctx, cmd, &[], n, log).await else {
                return Ok(());
            };
            let why = match e {
                Shell::Exit(code) => format!("exit status {code}"),
                Shell::Spawn(e) if e.contains("user") => {
                    format!("unauthenticated: invalid username: '{}'", ctx.user)
                }
                Shell::Spawn(e) => e,
            };
            let mut message = format!("failed to run command '{cmd}': command failed: {why}");
            // What the tenant's egress policy refused meanwhile: the likely cause, named.
            let denied = denials_since(core, build.sandbox_id.as_deref().unwrap_or_default(), since).await;
            for d in &denied {
                log.line("warn", n, &format!("egress denied: {d}"));
            }
            if !denied.is_empty() {
                message.push_str(&format!(
                    " (egress denied by the tenant's policy: {})",
                    denied.join(", ")
                ));
            }
            Err(failed(n, message))
        }
        StepKind::Env => {
            for pair in step.args.chunks(2) {
                let value = expand(&pair[1], &ctx.env);
                ctx.env.insert(pair[0].clone(), value);
            }
            Ok(())
        }
        StepKind::Workdir => {
            let path = join_path(ctx.workdir.as_deref().unwrap_or(&home_of(&ctx.user)), &step.args[0]);
            let root = Context {
                user: "root".into(),
                ..ctx.clone()
            };
            let script = r#"mkdir -p -- "$1" && chown -- "$2:" "$1" 2>/dev/null || mkdir -p -- "$1""#;
            shell(agent, &root, script, &[path.clone(), ctx.user.clone()], n, log)
                .await
                .map_err(|e| {
                    failed(
                        n,
                        format!("failed to create the working directory {path}: {}", e.reason()),
                    )
                })?;
            ctx.workdir = Some(path);
            Ok(())
        }
        StepKind::User => become_user(agent, ctx, &step.args[0], n, log).await,
        StepKind::Copy => copy(core, agent, ctx, step, n, build, log).await,
    }
}

/// Make `user` the current user, creating it if the image lacks it: useradd where there is
/// one (Debian), else busybox's adduser (alpine), else the account written into /etc/passwd
/// and /etc/group by hand (a minimal image).
async fn become_user(
    agent: &AgentClient,
    ctx: &mut Context,
    user: &str,
    n: &str,
    log: &mut Log,
) -> Result<(), StepError> {
    let root = Context {
        user: "root".into(),
        ..ctx.clone()
    };
    let script = r#"id -u "$1" >/dev/null 2>&1 && exit 0
if command -v useradd >/dev/null 2>&1; then exec useradd -m -s "$2" -- "$1"; fi
if command -v adduser >/dev/null 2>&1; then exec adduser -D -s "$2" "$1"; fi
uid=1000
while cut -d: -f3 /etc/passwd | grep -qx "$uid" || cut -d: -f3 /etc/group | grep -qx "$uid"; do uid=$((uid + 1)); done
echo "$1:x:$uid:$uid::/home/$1:$2" >> /etc/passwd
echo "$1:x:$uid:" >> /etc/group
mkdir -p "/home/$1" && chown "$uid:$uid" "/home/$1""#;
    shell(agent, &root, script, &[user.to_string(), ctx.shell().into()], n, log)
        .await
        .map_err(|e| failed(n, format!("failed to create user {user}: {}", e.reason())))?;
    ctx.user = user.to_string();
    Ok(())
}

/// Copy from an uploaded context: the tar goes into the guest, where it is unpacked and copied
/// (the host never unpacks what a tenant uploaded).
async fn copy(
    core: &Core,
    agent: &AgentClient,
    ctx: &Context,
    step: &BuildStep,
    n: &str,
    build: &BuildRecord,
    log: &mut Log,
) -> Result<(), StepError> {
    let hash = step.files_hash.as_deref().unwrap_or_default();
    let path = core
        .build_context_path(&build.tenant_id, hash)
        .map_err(|e| failed(n, e.to_string()))?;
    let bytes = tokio::fs::read(&path)
        .await
        .map_err(|_| failed(n, format!("the context {hash} of this COPY was not uploaded")))?;
    let in_guest = format!("{GUEST_STAGING}/{hash}.tar");
    agent
        .write_file(&in_guest, Some("root"), bytes::Bytes::from(bytes))
        .await
        .map_err(|e| failed(n, format!("failed to copy the context into the build VM: {e}")))?;
    let dest = match step.args[1].starts_with('/') {
        true => step.args[1].clone(),
        false => {
            let base = ctx.workdir.clone().unwrap_or_else(|| home_of(&ctx.user));
            let joined = join_path(&base, &step.args[1]);
            if step.args[1].ends_with('/') {
                format!("{joined}/")
            } else {
                joined
            }
        }
    };
    let owner = step.args.get(2).filter(|u| !u.is_empty()).unwrap_or(&ctx.user).clone();
    let mode = step.args.get(3).cloned().unwrap_or_default();
    let root = Context {
        user: "root".into(),
        ..ctx.clone()
    };
    let args = [in_guest, step.args[0].clone(), dest, owner, mode];
    shell(agent, &root, COPY_SCRIPT, &args, n, log).await.map_err(|e| {
        failed(
            n,
            format!("failed to copy {} to {}: {}", step.args[0], step.args[1], e.reason()),
        )
    })
}

/// `$1` the context's tar, `$2` the source (a path or glob in it), `$3` the destination (a
/// trailing `/`: into it), `$4` the owner, `$5` a mode. What a glob matches is copied under the
/// glob's fixed prefix (`folder/*` copies `folder`'s matches into the destination); a directory's
/// contents are copied into the destination, merging.
/// POSIX sh (bash, dash, busybox): images without bash copy too; bash also globs dotfiles.
const COPY_SCRIPT: &str = r#"set -eu
[ -z "${BASH_VERSION:-}" ] || shopt -s dotglob nullglob
tar_file=$1 src=$2 dest=$3 owner=$4 mode=$5
tmp=$(mktemp -d /tmp/.airlock-copy.XXXXXX)
trap 'rm -rf "$tmp" "$tar_file"' EXIT
mkdir "$tmp/ctx" "$tmp/sel"
tar -x -o -f "$tar_file" -C "$tmp/ctx"
src=${src#./}
case "$src" in
  *[\*\?\[]*)
    prefix=${src%%[\*\?\[]*}
    prefix=${prefix%/*}
    [ "$prefix" = "${src%%[\*\?\[]*}" ] && prefix=""
    cd "$tmp/ctx"
    found=
    for m in $src; do
      [ -e "$m" ] || [ -L "$m" ] || continue
      found=1
      mkdir -p "$tmp/sel/$(dirname "$m")"
      cp -a "$m" "$tmp/sel/$m"
    done
    [ -n "$found" ] || { echo "no file matches $src" >&2; exit 1; }
    from="$tmp/sel/$prefix"
    ;;
  *) from="$tmp/ctx/$src" ;;
esac
[ -e "$from" ] || [ -L "$from" ] || { echo "$src is not in the context" >&2; exit 1; }
if [ -d "$from" ] && [ ! -L "$from" ]; then
  mkdir -p "$dest"
  (cd "$from" && find . ! -name . | sed 's|^\./||') > "$tmp/list"
  cp -a "$from/." "$dest/"
  target=$dest
elif [ "${dest%/}" != "$dest" ] || [ -d "$dest" ]; then
  mkdir -p "$dest"
  basename "$from" > "$tmp/list"
  cp -a "$from" "$dest/"
  target=$dest
else
  mkdir -p "$(dirname "$dest")"
  : > "$tmp/list"
  cp -a "$from" "$dest"
  chown -h "$owner:" "$dest" 2>/dev/null || chown -h "$owner" "$dest"
  [ -z "$mode" ] || chmod "$mode" "$dest"
  exit 0
fi
while IFS= read -r p; do
  chown -h "$owner:" "$target/$p" 2>/dev/null || chown -h "$owner" "$target/$p"
  if [ -n "$mode" ] && [ ! -L "$target/$p" ]; then chmod "$mode" "$target/$p"; fi
done < "$tmp/list"
"#;

enum Shell {
    Exit(i32),
    Spawn(String),
}

impl Shell {
    fn reason(&self) -> String {
        match self {
            Shell::Exit(code) => format!("exit status {code}"),
            Shell::Spawn(e) => e.clone(),
        }
    }
}

/// Run `script` with `bash -l -c` (its arguments `$1`...) as `ctx` says, its output into the
/// log line by line.
async fn shell(
    agent: &AgentClient,
    ctx: &Context,
    script: &str,
    args: &[String],
    step: &str,
    log: &mut Log,
) -> Result<(), Shell> {
    let mut argv = ctx.shell_argv(script);
    // `$0`, then the script's arguments.
    argv.push(ctx.shell().trim_start_matches("/bin/").into());
    argv.extend(args.iter().cloned());
    let spec = ProcessSpec {
        argv,
        cwd: ctx.workdir.clone(),
        env: ctx.env.clone(),
        user: Some(ctx.user.clone()),
        timeout_ms: Some(BUILD_LIMIT.as_millis() as u64),
        ..Default::default()
    };
    let info = agent.spawn(&spec).await.map_err(|e| Shell::Spawn(e.to_string()))?;
    let mut events = Box::pin(
        agent
            .events(info.id, 0)
            .await
            .map_err(|e| Shell::Spawn(e.to_string()))?,
    );
    let mut partial: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
    let mut last_flush = Instant::now();
    while let Some(ev) = events.next().await {
        let ev = ev.map_err(|e| Shell::Spawn(e.to_string()))?;
        let (i, chunk) = match ev.kind {
            EventKind::Stdout(b) => (0, b),
            EventKind::Stderr(b) => (1, b),
            EventKind::Exit(status) => {
                for (i, rest) in partial.iter().enumerate() {
                    if !rest.is_empty() {
                        log.line(
                            if i == 0 { "info" } else { "warn" },
                            step,
                            &String::from_utf8_lossy(rest),
                        );
                    }
                }
                return match status.exit_code {
                    Some(0) => Ok(()),
                    Some(code) => Err(Shell::Exit(code)),
                    None if status.timed_out => Err(Shell::Spawn("timed out".into())),
                    None => Err(Shell::Spawn(format!("killed by signal {}", status.signal.unwrap_or(0)))),
                };
            }
        };
        let buf = &mut partial[i];
        buf.extend_from_slice(&chunk);
        while let Some(at) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=at).collect();
            log.line(
                if i == 0 { "info" } else { "warn" },
                step,
                &String::from_utf8_lossy(&line[..line.len() - 1]),
            );
        }
        if buf.len() > MAX_LINE {
            let line: Vec<u8> = std::mem::take(buf);
            log.line(
                if i == 0 { "info" } else { "warn" },
                step,
                &String::from_utf8_lossy(&line),
            );
        }
        if last_flush.elapsed() > Duration::from_millis(500) {
            log.flush().await;
            last_flush = Instant::now();
        }
    }
    Err(Shell::Spawn("the build VM's agent stopped answering".into()))
}

/// `$NAME` and `${NAME}` of `env` in `value` (no command substitution: as E2B's ENV).
fn expand(value: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let (name, next) = if let Some(inner) = after.strip_prefix('{') {
            match inner.find('}') {
                Some(end) => (&inner[..end], &inner[end + 1..]),
                None => ("", after),
            }
        } else {
            let end = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            (&after[..end], &after[end..])
        };
        if name.is_empty() {
            out.push('$');
            rest = after;
        } else {
            out.push_str(env.get(name).map(String::as_str).unwrap_or(""));
            rest = next;
        }
    }
    out.push_str(rest);
    out
}

fn home_of(user: &str) -> String {
    match user {
        "root" => "/root".into(),
        u => format!("/home/{u}"),
    }
}

fn join_path(base: &str, path: &str) -> String {
    let joined = match path.starts_with('/') {
        true => path.to_string(),
        false => format!("{}/{path}", base.trim_end_matches('/')),
    };
    let mut parts: Vec<&str> = Vec::new();
    for c in joined.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

impl Core {
    /// The agent of build sandbox `id` once its create has ended.
    async fn build_agent(&self, tenant_id: &str, id: &str, create: &Operation) -> CoreResult<AgentClient> {
        let op = self.wait_operation(create).await?;
        if let Some(e) = op.error {
            return Err(CoreError::Unavailable(e.message));
        }
        let row = self
            .store
            .get_sandbox(tenant_id, id)
            .await?
            .ok_or_else(|| CoreError::NotFound {
                kind: crate::error::Kind::Sandbox,
                id: id.into(),
                hint: String::new(),
            })?;
        self.agent_for(&row).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_like_env() {
        let env = BTreeMap::from([("A".to_string(), "1".to_string())]);
        assert_eq!(expand("x$A-${A}$B $(id) $", &env), "x1-1 $(id) $");
    }

    #[test]
    fn joins_paths() {
        assert_eq!(join_path("/home/user", "app/../lib"), "/home/user/lib");
        assert_eq!(join_path("/a", "/b/./c"), "/b/c");
    }
}
