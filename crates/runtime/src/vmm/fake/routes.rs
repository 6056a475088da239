//! The fake agent's answer to each `airlock_proto::Route`, over the fake guest's state.

use super::guest::Ctl;
use super::guest::{now_ms, user, Guest, Node, USERS};
use super::process::{event_stream, spawn};
use super::reply::{body_bytes, clean_path, full, json, ok_empty, read_json, ApiErr, Body};
use crate::error::Result;
use airlock_proto::{
    ErrorCode, FileKind, FileStat, Health, Metrics, MkdirRequest, MkdirResponse, ProcessInfo, ProcessSpec,
    ProcessState, PtySize, RenameRequest, SignalRequest,
};
use airlock_proto::{Route, RouteError};
use bytes::BytesMut;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use nix::sys::signal::Signal;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// What listens on port 8000 of a fake sandbox (nothing listens on the others): an HTTP/1 app that answers each request with
/// the headers it received (as JSON) and, as a hostile guest would, sets a cookie for the parent
/// domain; tests see what the port proxy lets through either way.
pub(super) fn port_app(req: Request<Incoming>) -> Response<Body> {
    let (app, host_end) = tokio::io::duplex(64 << 10);
    tokio::spawn(async move {
        let svc = hyper::service::service_fn(|r: Request<Incoming>| async move {
            let headers: BTreeMap<String, String> = r
                .headers()
                .iter()
                .map(|(k, v)| (k.to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
                .collect();
            let mut resp = json(StatusCode::OK, &serde_json::json!({ "headers": headers }));
            resp.headers_mut().insert(
                http::header::SET_COOKIE,
                http::HeaderValue::from_static("tossed=1; Domain=localhost; Path=/"),
            );
            Ok::<_, std::convert::Infallible>(resp)
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(hyper_util::rt::TokioIo::new(app), svc)
            .await;
    });
    let (rd, mut wr) = tokio::io::split(host_end);
    tokio::spawn(async move {
        let mut body = req.into_body();
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data() {
                if wr.write_all(&data).await.is_err() {
                    break;
                }
            }
        }
        let _ = wr.shutdown().await;
    });
    use futures_util::TryStreamExt;
    let out = tokio_util::io::ReaderStream::new(rd).map_ok(Frame::data);
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/octet-stream")
        .body(StreamBody::new(out).boxed_unsync())
        .expect("valid response")
}

pub(super) async fn route(guest: Arc<Guest>, req: Request<Incoming>) -> Result<Response<Body>, ApiErr> {
    let route = Route::parse(req.method().as_str(), req.uri().path(), req.uri().query()).map_err(|e| match e {
        RouteError::NotFound { .. } => ApiErr::not_found(e.to_string()),
        RouteError::Invalid(m) => ApiErr::invalid(m),
    })?;
    match route {
        Route::Tunnel { port: 8000 } => Ok(port_app(req)),
        Route::Health => Ok(json(
            StatusCode::OK,
            &Health {
                version: format!("{}-fake", env!("CARGO_PKG_VERSION")),
                protocol: airlock_proto::PROTOCOL_VERSION,
                boot_id: guest.boot_id.clone(),
                uptime_ms: guest.started.elapsed().as_millis() as u64,
            },
        )),
        Route::Metrics => {
            let used: u64 = guest.fs.lock().unwrap().values().map(|n| n.data.len() as u64).sum();
            Ok(json(
                StatusCode::OK,
                &Metrics {
                    cpu_count: guest.vcpu,
                    cpu_used_pct: 1.0,
                    mem_total_bytes: (guest.memory_mib as u64) << 20,
                    mem_used_bytes: 32 << 20,
                    disk_total_bytes: (guest.disk_mib as u64) << 20,
                    disk_used_bytes: used,
                },
            ))
        }
        Route::Identity => {
            // The real agent applies it to the guest; the fake only checks it is well formed.
            let identity: airlock_proto::Identity = read_json(req).await?;
            if identity.hostname.is_empty() || identity.machine_id.len() != 32 {
                return Err(ApiErr::invalid("bad identity".to_string()));
            }
            Ok(ok_empty())
        }
        Route::Sync => Ok(ok_empty()),
        Route::Shutdown => {
            let g = guest.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                g.power_off();
            });
            Ok(json(StatusCode::ACCEPTED, &serde_json::json!({})))
        }
        Route::Spawn => {
            let spec: ProcessSpec = read_json(req).await?;
            Ok(json(StatusCode::CREATED, &spawn(&guest, spec)?))
        }
        Route::Processes => {
            let procs = guest.procs.lock().unwrap();
            let list: Vec<ProcessInfo> = procs.table.values().map(|p| p.info()).collect();
            Ok(json(StatusCode::OK, &list))
        }
        Route::Process { id }
        | Route::Events { id, .. }
        | Route::Stdin { id }
        | Route::CloseStdin { id }
        | Route::Signal { id }
        | Route::Resize { id } => {
            let proc = guest.procs.lock().unwrap().table.get(&id).cloned();
            let proc = proc.ok_or_else(|| ApiErr::not_found(format!("no process with id {id}")))?;
            match route {
                Route::Events { after, .. } => Ok(event_stream(guest, proc, after)),
                Route::Stdin { .. } => {
                    let data = body_bytes(req).await?;
                    proc.stdin(Ctl::Stdin(data))?;
                    Ok(ok_empty())
                }
                Route::CloseStdin { .. } => {
                    if proc.info().stdin || proc.info().pty {
                        let _ = proc.stdin(Ctl::CloseStdin);
                    }
                    Ok(ok_empty())
                }
                Route::Signal { .. } => {
                    let r: SignalRequest = read_json(req).await?;
                    Signal::try_from(r.signal).map_err(|_| ApiErr::invalid(format!("unknown signal {}", r.signal)))?;
                    if proc.info().state == ProcessState::Exited {
                        return Err(ApiErr::invalid("process has already exited"));
                    }
                    let _ = proc.ctl.send(Ctl::Signal(r.signal));
                    Ok(ok_empty())
                }
                Route::Resize { .. } => {
                    let _size: PtySize = read_json(req).await?;
                    if !proc.info().pty {
                        return Err(ApiErr::invalid("process has no pty"));
                    }
                    Ok(ok_empty())
                }
                _ => Ok(json(StatusCode::OK, &proc.info())),
            }
        }
        Route::ReadFile { path } => {
            let p = clean_path(&path)?;
            let fs = guest.fs.lock().unwrap();
            let node = fs.get(&p).ok_or_else(|| no_such(&p))?;
            if node.dir {
                return Err(ApiErr(
                    ErrorCode::IsADirectory,
                    format!("{} is a directory", p.display()),
                ));
            }
            Ok(full(StatusCode::OK, node.data.clone(), "application/octet-stream"))
        }
        Route::WriteFile(w) => {
            let p = clean_path(&w.path)?;
            let owner = user(w.user.as_deref().unwrap_or("root"))?.0;
            let (mode, metadata_len) = (w.mode, w.metadata_len);
            // Read as it arrives, counted; what goes to `/dev/null` is dropped as the device
            // would (so a test can upload much without this process holding it).
            let sink = p == Path::new("/dev/null");
            let mut body = req.into_body();
            let mut data = BytesMut::new();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| ApiErr::invalid(format!("body: {e}")))?;
                if let Ok(chunk) = frame.into_data() {
                    guest.uploaded.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    if !sink || data.len() < metadata_len {
                        data.extend_from_slice(&chunk);
                    }
                }
            }
            let mut data = data.freeze();
            if sink {
                data.truncate(metadata_len);
            }
            if data.len() < metadata_len {
                return Err(ApiErr::invalid("upload ended within its metadata"));
            }
            let metadata: BTreeMap<String, String> = match metadata_len {
                0 => BTreeMap::new(),
                n => serde_json::from_slice(&data.split_to(n))
                    .map_err(|e| ApiErr::invalid(format!("bad metadata: {e}")))?,
            };
            airlock_proto::check_metadata(&metadata).map_err(ApiErr::invalid)?;
            let mut fs = guest.fs.lock().unwrap();
            if let Some(parent) = p.parent() {
                mkdir_all(&mut fs, parent, owner)?;
            }
            let existing = fs.get(&p).cloned();
            if existing.as_ref().is_some_and(|n| n.dir) {
                return Err(ApiErr(
                    ErrorCode::IsADirectory,
                    format!("{} is a directory", p.display()),
                ));
            }
            let node = Node {
                dir: false,
                data,
                mode: mode.or(existing.map(|n| n.mode)).unwrap_or(0o644),
                owner: owner.into(),
                modified_ms: now_ms(),
                metadata,
            };
            fs.insert(p.clone(), node);
            Ok(json(StatusCode::OK, &stat(&fs, &p)?))
        }
        Route::Remove { path } => {
            let p = clean_path(&path)?;
            if p == Path::new("/") {
                return Err(ApiErr::invalid("refusing to remove /"));
            }
            let mut fs = guest.fs.lock().unwrap();
            if fs.remove(&p).is_none() {
                return Err(no_such(&p));
            }
            fs.retain(|k, _| !k.starts_with(&p));
            Ok(ok_empty())
        }
        Route::Stat { path } => {
            let p = clean_path(&path)?;
            Ok(json(StatusCode::OK, &stat(&guest.fs.lock().unwrap(), &p)?))
        }
        Route::List { path, depth } => {
            let p = clean_path(&path)?;
            let depth = depth as usize;
            if depth == 0 {
                return Err(ApiErr::invalid("depth must be at least 1"));
            }
            let fs = guest.fs.lock().unwrap();
            if !fs.get(&p).ok_or_else(|| no_such(&p))?.dir {
                return Err(ApiErr(
                    ErrorCode::NotADirectory,
                    format!("{} is not a directory", p.display()),
                ));
            }
            let base = p.components().count();
            let list = fs
                .keys()
                .filter(|k| k.starts_with(&p) && **k != p && k.components().count() - base <= depth)
                .map(|k| stat(&fs, k))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(json(StatusCode::OK, &list))
        }
        Route::Mkdir => {
            let r: MkdirRequest = read_json(req).await?;
            let p = clean_path(&r.path)?;
            let owner = user(r.user.as_deref().unwrap_or("root"))?.0;
            let mut fs = guest.fs.lock().unwrap();
            let created = mkdir_all(&mut fs, &p, owner)?;
            let stat = stat(&fs, &p)?;
            Ok(json(StatusCode::OK, &MkdirResponse { created, stat }))
        }
        // The fake VMM attaches no disks (no `Hotplug`), so there is never one to mount.
        Route::MountVolume => Err(ApiErr::invalid("the fake guest has no disks to mount")),
        Route::Rename => {
            let r: RenameRequest = read_json(req).await?;
            let (from, to) = (clean_path(&r.from)?, clean_path(&r.to)?);
            let mut fs = guest.fs.lock().unwrap();
            if !fs.contains_key(&from) {
                return Err(no_such(&from));
            }
            if !to.parent().and_then(|d| fs.get(d)).is_some_and(|n| n.dir) || to.starts_with(&from) {
                return Err(ApiErr::invalid(format!(
                    "cannot rename {} to {}",
                    from.display(),
                    to.display()
                )));
            }
            let moved: Vec<PathBuf> = fs.keys().filter(|k| k.starts_with(&from)).cloned().collect();
            fs.retain(|k, _| !k.starts_with(&to));
            for old in moved {
                let node = fs.remove(&old).expect("listed");
                let rel = old.strip_prefix(&from).expect("under from");
                fs.insert(
                    if rel.as_os_str().is_empty() {
                        to.clone()
                    } else {
                        to.join(rel)
                    },
                    node,
                );
            }
            Ok(json(StatusCode::OK, &stat(&fs, &to)?))
        }
        Route::Tunnel { port } => Err(ApiErr::not_found(format!(
            "nothing listens on port {port} in the sandbox (fake agent)"
        ))),
        Route::Watch { .. } => Err(ApiErr(
            ErrorCode::Internal,
            "the fake agent does not support watches".into(),
        )),
    }
}

pub(super) fn no_such(p: &Path) -> ApiErr {
    ApiErr::not_found(format!("{}: No such file or directory (os error 2)", p.display()))
}

pub(super) fn stat(fs: &BTreeMap<PathBuf, Node>, p: &Path) -> Result<FileStat, ApiErr> {
    let node = fs.get(p).ok_or_else(|| no_such(p))?;
    let uid = USERS.iter().find(|u| u.0 == node.owner).map(|u| u.1).unwrap_or(0);
    Ok(FileStat {
        path: p.display().to_string(),
        name: p
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "/".into()),
        kind: if node.dir { FileKind::Dir } else { FileKind::File },
        size: if node.dir { 4096 } else { node.data.len() as u64 },
        mode: node.mode,
        uid,
        gid: uid,
        owner: node.owner.clone(),
        group: node.owner.clone(),
        modified_ms: node.modified_ms,
        symlink_target: None,
        symlink_resolved: None,
        link_target: None,
        metadata: node.metadata.clone(),
    })
}

/// Create `p` and its missing parents; false when it already was a directory.
pub(super) fn mkdir_all(fs: &mut BTreeMap<PathBuf, Node>, p: &Path, owner: &str) -> Result<bool, ApiErr> {
    if let Some(n) = fs.get(p) {
        return match n.dir {
            true => Ok(false),
            false => Err(ApiErr(
                ErrorCode::AlreadyExists,
                format!("{} exists and is not a directory", p.display()),
            )),
        };
    }
    if let Some(parent) = p.parent() {
        mkdir_all(fs, parent, owner)?;
    }
    fs.insert(p.to_path_buf(), Node::dir(owner));
    Ok(true)
}
