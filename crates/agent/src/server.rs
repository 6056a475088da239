//! HTTP/2 routes the host calls (`airlock_proto::Route`, parsed here). One handler per route;
//! bodies are JSON except file content (raw bytes) and process events (binary frames, see
//! `airlock_proto::frame`).

use crate::error::AgentError;
use crate::files;
use crate::metrics::CpuSampler;
use crate::process::Processes;
use crate::users;
use airlock_proto::routes::WriteFile;
use airlock_proto::{
    Health, MkdirRequest, MkdirResponse, ProcessSpec, PtySize, RenameRequest, Route, RouteError, SignalRequest,
};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::{Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use serde::de::DeserializeOwned;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use tokio::io::AsyncWriteExt;

pub type Body = BoxBody<Bytes, std::io::Error>;

pub struct Agent {
    pub processes: Processes,
    pub cpu: CpuSampler,
    /// The kernel's boot id, until the host gives an identity: a restored VM's kernel still has
    /// its snapshot's, shared by every clone, so each identity brings a new one.
    pub boot_id: std::sync::Mutex<String>,
    pub started: Instant,
}

impl Agent {
    pub fn new() -> Self {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| format!("{:x}", crate::process::now_ms()));
        Self {
            processes: Processes::default(),
            cpu: CpuSampler::default(),
            boot_id: std::sync::Mutex::new(boot_id),
            started: Instant::now(),
        }
    }
}

fn full(status: StatusCode, body: Bytes, content_type: &str) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(body).map_err(|never: Infallible| match never {}).boxed())
        .expect("static response parts are valid")
}

fn json<T: serde::Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    full(
        status,
        Bytes::from(serde_json::to_vec(value).expect("serializable")),
        "application/json",
    )
}

fn error(e: AgentError) -> Response<Body> {
    let status = StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json(status, &e.body())
}

async fn read_json<T: DeserializeOwned>(req: Request<Incoming>) -> Result<T, AgentError> {
    let body = req
        .into_body()
        .collect()
        .await
        .map_err(|e| AgentError::invalid(format!("body: {e}")))?
        .to_bytes();
    serde_json::from_slice(&body).map_err(|e| AgentError::invalid(format!("bad JSON body: {e}")))
}

pub async fn handle(agent: Arc<Agent>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    Ok(route(agent, req).await.unwrap_or_else(error))
}

async fn route(agent: Arc<Agent>, req: Request<Incoming>) -> Result<Response<Body>, AgentError> {
    let route = Route::parse(req.method().as_str(), req.uri().path(), req.uri().query()).map_err(|e| match e {
        RouteError::NotFound { .. } => AgentError::not_found(e.to_string()),
        RouteError::Invalid(m) => AgentError::invalid(m),
    })?;
    match route {
        Route::Health => Ok(json(
            StatusCode::OK,
            &Health {
                version: env!("CARGO_PKG_VERSION").into(),
                protocol: airlock_proto::PROTOCOL_VERSION,
                boot_id: agent.boot_id.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                uptime_ms: agent.started.elapsed().as_millis() as u64,
            },
        )),
        Route::Metrics => Ok(json(StatusCode::OK, &agent.cpu.sample())),
        Route::Shutdown => {
            tokio::spawn(async {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                unsafe { libc::sync() };
                let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
            });
            Ok(json(StatusCode::ACCEPTED, &serde_json::json!({})))
        }
        Route::Identity => {
            let identity: airlock_proto::Identity = read_json(req).await?;
            crate::boot::apply_identity(&identity)?;
            // A new boot id with the new machine id (as random, and public anyway).
            *agent.boot_id.lock().unwrap_or_else(|e| e.into_inner()) = identity.machine_id.clone();
            Ok(json(StatusCode::OK, &serde_json::json!({})))
        }
        Route::Sync => {
            tokio::task::spawn_blocking(|| unsafe { libc::sync() }).await.ok();
            Ok(json(StatusCode::OK, &serde_json::json!({})))
        }
        Route::Spawn => {
            let spec: ProcessSpec = read_json(req).await?;
            let info = agent.processes.spawn(spec)?;
            Ok(json(StatusCode::CREATED, &info))
        }
        Route::Processes => Ok(json(StatusCode::OK, &agent.processes.list())),
        Route::Process { id } => Ok(json(StatusCode::OK, &agent.processes.get(id)?.info())),
        Route::Events { id, after } => Ok(event_stream(agent.processes.get(id)?, after)),
        Route::Stdin { id } => {
            let proc = agent.processes.get(id)?;
            let mut body = req.into_body();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| AgentError::invalid(format!("body: {e}")))?;
                if let Ok(data) = frame.into_data() {
                    proc.write_stdin(&data).await?;
                }
            }
            Ok(json(StatusCode::OK, &serde_json::json!({})))
        }
        Route::CloseStdin { id } => {
            agent.processes.get(id)?.close_stdin().await?;
            Ok(json(StatusCode::OK, &serde_json::json!({})))
        }
        Route::Signal { id } => {
            let proc = agent.processes.get(id)?;
            let r: SignalRequest = read_json(req).await?;
            proc.signal(r.signal)?;
            Ok(json(StatusCode::OK, &serde_json::json!({})))
        }
        Route::Resize { id } => {
            let proc = agent.processes.get(id)?;
            let size: PtySize = read_json(req).await?;
            proc.resize(&size)?;
            Ok(json(StatusCode::OK, &serde_json::json!({})))
        }
        Route::ReadFile { path } => read_file(&files::clean_path(&path)?).await,
        Route::WriteFile(w) => write_file(w, req).await,
        Route::Remove { path } => {
            files::remove(&files::clean_path(&path)?)?;
            Ok(json(StatusCode::OK, &serde_json::json!({})))
        }
        Route::Stat { path } => Ok(json(StatusCode::OK, &files::stat(&files::clean_path(&path)?)?)),
        Route::List { path, depth } => Ok(json(StatusCode::OK, &files::list(&files::clean_path(&path)?, depth)?)),
        Route::Mkdir => {
            let r: MkdirRequest = read_json(req).await?;
            let p = files::clean_path(&r.path)?;
            let owner = user_or_err(r.user.as_deref())?;
            let created = files::mkdir_all(&p, owner.as_ref())?;
            Ok(json(
                StatusCode::OK,
                &MkdirResponse {
                    created,
                    stat: files::stat(&p)?,
                },
            ))
        }
        Route::Rename => {
            let r: RenameRequest = read_json(req).await?;
            let (from, to) = (files::clean_path(&r.from)?, files::clean_path(&r.to)?);
            files::rename(&from, &to)?;
            Ok(json(StatusCode::OK, &files::stat(&to)?))
        }
        Route::MountVolume => {
            let mount: airlock_proto::MountVolume = read_json(req).await?;
            tokio::task::spawn_blocking(move || crate::volumes::mount_volume(&mount))
                .await
                .map_err(|e| AgentError::internal(format!("mount task: {e}")))??;
            Ok(json(StatusCode::OK, &serde_json::json!({})))
        }
        Route::Tunnel { port } => tunnel(port, req).await,
        Route::Watch { path, recursive, entry } => watch(&files::clean_path(&path)?, recursive, entry),
    }
}

fn user_or_err(name: Option<&str>) -> Result<Option<users::User>, AgentError> {
    match name {
        None => Ok(None),
        Some(n) => users::lookup(n)
            .map(Some)
            .ok_or_else(|| AgentError::invalid(format!("no user named {n:?}"))),
    }
}

fn event_stream(proc: Arc<crate::process::Proc>, after: u64) -> Response<Body> {
    let stream = futures_util::stream::unfold((proc, after), |(proc, last)| async move {
        let events = proc.next_events(last).await?;
        let mut buf = BytesMut::new();
        let mut last = last;
        for e in &events {
            e.encode(&mut buf);
            last = e.seq;
        }
        Some((Ok::<_, std::io::Error>(Frame::data(buf.freeze())), (proc, last)))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/x-airlock-events")
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .expect("valid response")
}

async fn read_file(path: &std::path::Path) -> Result<Response<Body>, AgentError> {
    let shown = path.to_string_lossy().to_string();
    let file = tokio::fs::File::open(path)
        .await
        .map_err(|e| AgentError::io(&shown, e))?;
    let meta = file.metadata().await.map_err(|e| AgentError::io(&shown, e))?;
    if meta.is_dir() {
        return Err(AgentError::new(
            airlock_proto::ErrorCode::IsADirectory,
            format!("{shown} is a directory"),
        ));
    }
    // A regular file's size is what is sent (a file growing meanwhile is cut there, as the length
    // promised). Virtual files (`/proc`, `/sys`) say 0 and have content: read to the end, unsized.
    let sized = meta.is_file() && meta.len() > 0;
    let reader = tokio::io::AsyncReadExt::take(file, if sized { meta.len() } else { u64::MAX });
    let stream = tokio_util::io::ReaderStream::with_capacity(reader, 256 << 10).map(|r| r.map(Frame::data));
    let mut response = Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/octet-stream");
    if sized {
        response = response.header("content-length", meta.len());
    }
    Ok(response
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .expect("valid response"))
}

async fn write_file(w: WriteFile, req: Request<Incoming>) -> Result<Response<Body>, AgentError> {
    let path = files::clean_path(&w.path)?;
    let owner = user_or_err(w.user.as_deref())?;
    let shown = path.to_string_lossy().to_string();
    if let Some(parent) = path.parent() {
        files::mkdir_all(parent, owner.as_ref())?;
    }
    if path.is_dir() {
        return Err(AgentError::new(
            airlock_proto::ErrorCode::IsADirectory,
            format!("{shown} is a directory"),
        ));
    }
    // Write beside the target and rename over it at the end, so an upload that breaks off
    // (client gone, corrupt gzip) leaves the old file, not a truncated one. A symlink is written
    // through, as an in-place write would.
    let target = if path.is_symlink() {
        std::fs::canonicalize(&path).map_err(|e| AgentError::io(&shown, e))?
    } else {
        path.clone()
    };
    // User metadata (`user.e2b.*` xattrs; JSON leading the body, `metadata_len` bytes)
    // replaces whatever the file had, as envd does.
    if w.metadata_len > METADATA_JSON_MAX {
        return Err(AgentError::invalid(format!("bad metadata_len \"{}\"", w.metadata_len)));
    }
    let metadata_len = w.metadata_len;
    let staging = files::Staging::beside(&target);
    receive_upload(
        req.into_body(),
        staging.path(),
        &target,
        &shown,
        owner.as_ref(),
        w.mode,
        metadata_len,
    )
    .await?;
    Ok(json(StatusCode::OK, &files::stat(&path)?))
}

/// Longest metadata JSON leading an upload: [`airlock_proto::METADATA_TOTAL_MAX`] of printable
/// ASCII, every byte escaped, plus the quoting.
const METADATA_JSON_MAX: usize = 4 * airlock_proto::METADATA_TOTAL_MAX;

/// The body into `staging` (its first `metadata_len` bytes are the file's metadata as JSON),
/// owner, mode and metadata settled, then renamed onto `target`.
async fn receive_upload(
    mut body: Incoming,
    staging: &std::path::Path,
    target: &std::path::Path,
    shown: &str,
    owner: Option<&users::User>,
    mode: Option<u32>,
    metadata_len: usize,
) -> Result<(), AgentError> {
    use std::os::unix::fs::PermissionsExt;
    // Created before the first await: a request the host resets may be dropped at any await,
    // and the staging file's remover (`files::Staging`'s drop) must find it there. An async
    // create could still be running in the blocking pool when the drop came, and leave the
    // file behind.
    let file = std::fs::File::create(staging).map_err(|e| AgentError::io(shown, e))?;
    let mut file = tokio::fs::File::from_std(file);
    let mut lead = Vec::with_capacity(metadata_len);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| AgentError::invalid(format!("upload interrupted: {e}")))?;
        if let Ok(mut data) = frame.into_data() {
            if lead.len() < metadata_len {
                let take = (metadata_len - lead.len()).min(data.len());
                lead.extend_from_slice(&data.split_to(take));
            }
            file.write_all(&data).await.map_err(|e| AgentError::io(shown, e))?;
        }
    }
    if lead.len() < metadata_len {
        return Err(AgentError::invalid("upload ended within its metadata"));
    }
    let metadata: std::collections::BTreeMap<String, String> = match metadata_len {
        0 => Default::default(),
        _ => serde_json::from_slice(&lead).map_err(|e| AgentError::invalid(format!("bad metadata: {e}")))?,
    };
    airlock_proto::check_metadata(&metadata).map_err(AgentError::invalid)?;
    file.flush().await.map_err(|e| AgentError::io(shown, e))?;
    let file = file.into_std().await;
    files::write_metadata(&file, shown, &metadata)?;
    drop(file);
    if let Some(u) = owner {
        let _ = std::os::unix::fs::chown(staging, Some(u.uid), Some(u.gid));
    }
    let existing = std::fs::metadata(target).ok();
    // An explicit mode wins; otherwise an overwritten file keeps its mode (e.g. stays executable).
    let mode = match mode {
        Some(m) => Some(m),
        None => existing.as_ref().map(|m| m.permissions().mode() & 0o7777),
    };
    if let Some(mode) = mode {
        std::fs::set_permissions(staging, std::fs::Permissions::from_mode(mode))
            .map_err(|e| AgentError::io(shown, e))?;
    }
    let has_bytes = std::fs::metadata(staging).is_ok_and(|m| m.len() > 0);
    files::note_upload_landing(
        target,
        files::Landing {
            existed: existing.is_some(),
            has_bytes,
        },
    );
    std::fs::rename(staging, target).map_err(|e| AgentError::io(shown, e))
}

/// Longest watch line sent with its entry; past it (a path and metadata near their limits) the
/// event goes without. The host refuses lines over 64 KiB (`WATCH_LINE_MAX`).
const WATCH_LINE_WITH_ENTRY_MAX: usize = 48 << 10;

/// The entry an event of `kind` at `path` carries, on watches that ask (as envd: creates,
/// writes and chmods only; none when the path is gone already).
fn event_entry(ev: &mut airlock_proto::WatchEvent) {
    use airlock_proto::WatchEventKind as K;
    if matches!(ev.kind, K::Create | K::Write | K::Chmod) {
        ev.entry = files::stat(std::path::Path::new(&ev.path)).ok();
    }
}

fn watch(path: &std::path::Path, recursive: bool, entries: bool) -> Result<Response<Body>, AgentError> {
    use notify::Watcher;
    let shown = path.to_string_lossy().to_string();
    if !path.is_dir() {
        return Err(if path.exists() {
            AgentError::new(
                airlock_proto::ErrorCode::NotADirectory,
                format!("{shown} is not a directory"),
            )
        } else {
            AgentError::not_found(format!("{shown}: no such directory"))
        });
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    // Recursive watches rescan each new directory once notify has armed its watch (see
    // RecursiveCatchUp): a helper thread does that, and ends when the watcher is dropped.
    let catch_up = Arc::new(std::sync::Mutex::new(files::RecursiveCatchUp::default()));
    let (rescan_tx, rescan_rx) = std::sync::mpsc::channel::<(std::path::PathBuf, Instant)>();
    if recursive {
        let (catch_up, tx) = (catch_up.clone(), tx.clone());
        std::thread::spawn(move || {
            while let Ok((dir, seen_at)) = rescan_rx.recv() {
                std::thread::sleep(files::RESCAN_AFTER.saturating_sub(seen_at.elapsed()));
                let mut catch_up = catch_up.lock().unwrap_or_else(|e| e.into_inner());
                catch_up.scan(&dir, &mut |w| {
                    let _ = tx.send(w);
                });
            }
        });
    }
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if let Ok(ev) = res {
            for w in files::translate(&ev) {
                if recursive {
                    let mut catch_up = catch_up.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(dir) = catch_up.process(w, &mut |w| {
                        let _ = tx.send(w);
                    }) {
                        let _ = rescan_tx.send((dir, Instant::now()));
                    }
                } else {
                    let _ = tx.send(w);
                }
            }
        }
    })
    .map_err(|e| AgentError::internal(format!("watch: {e}")))?;
    let mode = if recursive {
        notify::RecursiveMode::Recursive
    } else {
        notify::RecursiveMode::NonRecursive
    };
    watcher
        .watch(path, mode)
        .map_err(|e| AgentError::internal(format!("watch {shown}: {e}")))?;
    // The watcher lives in the stream's state: it stops when the host drops the response.
    let stream = futures_util::stream::unfold((rx, watcher), move |(mut rx, watcher)| async move {
        let mut ev: airlock_proto::WatchEvent = rx.recv().await?;
        if entries {
            // Stat'ed as the event is sent, as envd does: the entry is what is there now.
            ev = tokio::task::spawn_blocking(move || {
                event_entry(&mut ev);
                ev
            })
            .await
            .ok()?;
        }
        let mut line = serde_json::to_vec(&ev).expect("serializable");
        if line.len() > WATCH_LINE_WITH_ENTRY_MAX {
            ev.entry = None;
            line = serde_json::to_vec(&ev).expect("serializable");
        }
        line.push(b'\n');
        Some((Ok::<_, std::io::Error>(Frame::data(Bytes::from(line))), (rx, watcher)))
    });
    // The response headers only leave once the watch is armed: the host may write right after.
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/x-ndjson")
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .expect("valid response"))
}

/// A byte tunnel to `127.0.0.1:<port>` inside the guest: the request body flows to the socket,
/// the socket's output is the response body (HTTP/2 carries both directions at once).
async fn tunnel(port: u16, req: Request<Incoming>) -> Result<Response<Body>, AgentError> {
    let sock = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.map_err(|e| {
        AgentError::new(
            airlock_proto::ErrorCode::NotFound,
            format!("nothing listens on port {port} in the sandbox: {e}"),
        )
    })?;
    let (rd, wr) = sock.into_split();
    tokio::spawn(body_into_writer(req.into_body(), wr));
    let out = tokio_util::io::ReaderStream::with_capacity(rd, 64 << 10).map(|r| r.map(Frame::data));
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/octet-stream")
        .body(BodyExt::boxed(StreamBody::new(out)))
        .expect("valid response"))
}

/// Copy an HTTP body into `w`, then shut `w` down (EOF for the reader on the other side).
async fn body_into_writer(body: Incoming, mut w: impl tokio::io::AsyncWrite + Unpin) {
    let data = body.into_data_stream().map(|r| r.map_err(std::io::Error::other));
    let _ = tokio::io::copy(&mut tokio_util::io::StreamReader::new(data), &mut w).await;
    let _ = w.shutdown().await;
}
