//! envd's `filesystem.Filesystem` service: Stat, MakeDir, Move, ListDir, Remove, the WatchDir
//! stream and the polling watchers (CreateWatcher, GetWatcherEvents, RemoveWatcher), each
//! decoded into its request message and answered with its response message. A translation onto
//! the core's `Files` (and the door's `Watchers`); no file logic here.

use super::messages::{
    CreateWatcherRequest, CreateWatcherResponse, EntryInfo, EntryResponse, EventType, FileType, FilesystemEvent,
    GetWatcherEventsRequest, GetWatcherEventsResponse, ListDirRequest, ListDirResponse, MakeDirRequest, MoveRequest,
    RemoveRequest, RemoveResponse, RemoveWatcherRequest, RemoveWatcherResponse, StatRequest, WatchDirRequest,
    WatchDirResponse,
};
use super::{abs_path, async_stream, keepalive_every, rpc_request, sandbox_gone, stream_response, EnvdSandbox};
use crate::core::files::Files;
use crate::core::WatchSpec;
use crate::e2b::connect::{self, unary_response, RpcError};
use crate::e2b::E2bState;
use airlock_proto::{FileKind, FileStat, WatchEvent, WatchEventKind};
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::StreamExt;

/// The methods this service answers, by their path segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Stat,
    MakeDir,
    Move,
    ListDir,
    Remove,
    WatchDir,
    CreateWatcher,
    GetWatcherEvents,
    RemoveWatcher,
}

impl Method {
    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "Stat" => Method::Stat,
            "MakeDir" => Method::MakeDir,
            "Move" => Method::Move,
            "ListDir" => Method::ListDir,
            "Remove" => Method::Remove,
            "WatchDir" => Method::WatchDir,
            "CreateWatcher" => Method::CreateWatcher,
            "GetWatcherEvents" => Method::GetWatcherEvents,
            "RemoveWatcher" => Method::RemoveWatcher,
            _ => return None,
        })
    }
}

/// Go's `FileMode.String()` of the entry itself, which envd reports: a letter for each of
/// directory, symlink, setuid, setgid and sticky that applies (`-` for none), then `rwxrwxrwx`.
pub(super) fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::new();
    for (set, c) in [
        (kind == FileKind::Dir, 'd'),
        (kind == FileKind::Symlink, 'L'),
        (mode & 0o4000 != 0, 'u'),
        (mode & 0o2000 != 0, 'g'),
        (mode & 0o1000 != 0, 't'),
    ] {
        if set {
            s.push(c);
        }
    }
    if s.is_empty() {
        s.push('-');
    }
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// envd's `EntryInfo`. A symlink is described by what it resolves to (type and permission bits
/// of the target, unspecified when dangling), marked `isSymlink`, with `symlinkTarget` the
/// target fully resolved; its size, times, owner and `permissions` are the link's own. `mode`
/// is the permission bits only (Go's `FileMode.Perm()`).
pub(super) fn entry_info(s: &FileStat) -> EntryInfo {
    let file_type = |kind: FileKind| match kind {
        FileKind::Dir => FileType::Directory,
        FileKind::File => FileType::File,
        FileKind::Symlink | FileKind::Other => FileType::Unspecified,
    };
    let (file_type, mode) = match (s.kind, &s.link_target) {
        (FileKind::Symlink, Some(t)) => (file_type(t.kind), t.mode),
        (FileKind::Symlink, None) => (FileType::Unspecified, 0),
        (kind, _) => (file_type(kind), s.mode),
    };
    let symlink = s.kind == FileKind::Symlink;
    EntryInfo {
        name: s.name.clone(),
        file_type,
        path: s.path.clone(),
        size: s.size,
        mode: mode & 0o777,
        permissions: permissions(s.kind, s.mode),
        owner: s.owner.clone(),
        group: s.group.clone(),
        modified_time: crate::records::rfc3339(s.modified_ms as i64).replace(".000Z", "Z"),
        is_symlink: symlink.then_some(true),
        symlink_target: if symlink {
            crate::core::files::resolved_link(s)
        } else {
            None
        },
        metadata: s.metadata.clone(),
    }
}

/// A guest's watch event as envd's `FilesystemEvent`: its name relative to the watched `root`.
fn watch_event(ev: &WatchEvent, root: &str) -> FilesystemEvent {
    let event_type = match ev.kind {
        WatchEventKind::Create => EventType::Create,
        WatchEventKind::Write => EventType::Write,
        WatchEventKind::Remove => EventType::Remove,
        WatchEventKind::Rename => EventType::Rename,
        WatchEventKind::Chmod => EventType::Chmod,
    };
    FilesystemEvent {
        name: ev
            .path
            .strip_prefix(root)
            .unwrap_or(&ev.path)
            .trim_start_matches('/')
            .into(),
        event_type,
        entry: ev.entry.as_ref().map(entry_info),
    }
}

pub async fn filesystem_rpc(
    State(state): State<E2bState>,
    Path(method): Path<String>,
    axum::Extension(EnvdSandbox(sandbox)): axum::Extension<EnvdSandbox>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let (m, body) = match super::rpc_method("filesystem.Filesystem", &method, Method::from_name, body) {
        Ok(started) => started,
        Err(answer) => return answer,
    };
    let call = super::Call {
        state: &state,
        sandbox: &sandbox,
        headers: &headers,
    };
    match m {
        Method::WatchDir => match call.decode(&body, true) {
            Ok((user, req)) => match call.files().await {
                Ok(files) => call.watch_dir(files, &user, req).await,
                Err(r) => r,
            },
            Err(r) => r,
        },
        Method::Stat => {
            call.unary_with_files(&body, |f, user, req| call.stat(f, user, req))
                .await
        }
        Method::MakeDir => {
            call.unary_with_files(&body, |f, user, req| call.make_dir(f, user, req))
                .await
        }
        Method::Move => {
            call.unary_with_files(&body, |f, user, req| call.rename(f, user, req))
                .await
        }
        Method::ListDir => {
            call.unary_with_files(&body, |f, user, req| call.list_dir(f, user, req))
                .await
        }
        Method::Remove => {
            call.unary_with_files(&body, |f, user, req| call.remove(f, user, req))
                .await
        }
        Method::CreateWatcher => {
            call.unary_with_files(&body, |f, user, req| call.create_watcher(f, user, req))
                .await
        }
        Method::GetWatcherEvents => call.unary_with_files(&body, |_, _, req| call.watcher_events(req)).await,
        Method::RemoveWatcher => call.unary_with_files(&body, |_, _, req| call.remove_watcher(req)).await,
    }
}

impl super::Call<'_> {
    // The error is the handler's finished answer, made at most once per request.
    #[allow(clippy::result_large_err)]
    fn decode<T: serde::de::DeserializeOwned>(&self, body: &[u8], streaming: bool) -> Result<(String, T), Response> {
        rpc_request(self.headers, body, streaming)
    }

    /// The sandbox's files; a sandbox whose agent cannot be reached answers as a missing one.
    // The error is the handler's finished answer, as for `decode`.
    #[allow(clippy::result_large_err)]
    async fn files(&self) -> Result<Files, Response> {
        self.state
            .core
            .files(self.sandbox)
            .await
            .map_err(|_| sandbox_gone(&self.sandbox.id))
    }

    /// Decode a unary request, run `f` on it with the sandbox's files, answer its response
    /// message or its error.
    async fn unary_with_files<T, R, F, Fut>(&self, body: &[u8], f: F) -> Response
    where
        T: serde::de::DeserializeOwned,
        R: serde::Serialize,
        F: FnOnce(Files, String, T) -> Fut,
        Fut: std::future::Future<Output = Result<R, RpcError>>,
    {
        let (user, req) = match self.decode::<T>(body, false) {
            Ok(x) => x,
            Err(r) => return r,
        };
        match self.files().await {
            Ok(files) => unary_response(f(files, user, req).await),
            Err(r) => r,
        }
    }

    async fn stat(&self, files: Files, user: String, req: StatRequest) -> Result<EntryResponse, RpcError> {
        let entry = files.stat(&abs_path(&req.path, &user)).await?;
        Ok(EntryResponse {
            entry: entry_info(&entry),
        })
    }

    async fn make_dir(&self, files: Files, user: String, req: MakeDirRequest) -> Result<EntryResponse, RpcError> {
        let path = abs_path(&req.path, &user);
        let made = files.mkdir(&path, &user).await?;
        if !made.created {
            return Err(RpcError::new(
                connect::Code::AlreadyExists,
                format!("{path} already exists"),
            ));
        }
        Ok(EntryResponse {
            entry: entry_info(&made.stat),
        })
    }

    async fn rename(&self, files: Files, user: String, req: MoveRequest) -> Result<EntryResponse, RpcError> {
        let moved = files
            .rename(&abs_path(&req.source, &user), &abs_path(&req.destination, &user))
            .await?;
        Ok(EntryResponse {
            entry: entry_info(&moved),
        })
    }

    async fn list_dir(&self, files: Files, user: String, req: ListDirRequest) -> Result<ListDirResponse, RpcError> {
        // An unset depth (0) lists one level, as envd.
        let depth = req.depth.unwrap_or(1).clamp(1, 32) as u32;
        let entries = files.list(&abs_path(&req.path, &user), depth).await?;
        Ok(ListDirResponse {
            entries: entries.iter().map(entry_info).collect(),
        })
    }

    async fn remove(&self, files: Files, user: String, req: RemoveRequest) -> Result<RemoveResponse, RpcError> {
        files.remove(&abs_path(&req.path, &user)).await?;
        Ok(RemoveResponse {})
    }

    /// The `WatchDir` stream: `start`, then events, keepalives while idle, and the end.
    async fn watch_dir(&self, files: Files, user: &str, req: WatchDirRequest) -> Response {
        let root = abs_path(&req.path, user);
        let events = match files.watch(&root, req.recursive, req.include_entry).await {
            Ok(e) => e,
            Err(e) => return RpcError::from(e).into_response(),
        };
        let keepalive = keepalive_every(self.headers);
        let body = async_stream(move |tx| async move {
            if tx.send(connect::message(&WatchDirResponse::Start {})).await.is_err() {
                return;
            }
            let mut events = Box::pin(events);
            loop {
                let msg = match tokio::time::timeout(keepalive, events.next()).await {
                    Err(_) => WatchDirResponse::Keepalive {},
                    Ok(Some(Ok(ev))) => WatchDirResponse::Filesystem(watch_event(&ev, &root)),
                    Ok(Some(Err(e))) => {
                        let _ = tx.send(connect::end_of_stream(Some(&RpcError::from(e)))).await;
                        return;
                    }
                    Ok(None) => break,
                };
                if tx.send(connect::message(&msg)).await.is_err() {
                    return;
                }
            }
            let _ = tx.send(connect::end_of_stream(None)).await;
        });
        stream_response(body)
    }

    async fn create_watcher(
        &self,
        _files: Files,
        user: String,
        req: CreateWatcherRequest,
    ) -> Result<CreateWatcherResponse, RpcError> {
        let spec = WatchSpec {
            path: abs_path(&req.path, &user),
            recursive: req.recursive,
            entries: req.include_entry,
        };
        let watcher_id = self.state.core.watch_start(self.sandbox, &spec).await?;
        Ok(CreateWatcherResponse { watcher_id })
    }

    async fn watcher_events(&self, req: GetWatcherEventsRequest) -> Result<GetWatcherEventsResponse, RpcError> {
        let taken = self.state.core.watch_take(self.sandbox, &req.watcher_id).await?;
        let events = taken.events.iter().map(|ev| watch_event(ev, &taken.path)).collect();
        Ok(GetWatcherEventsResponse { events })
    }

    async fn remove_watcher(&self, req: RemoveWatcherRequest) -> Result<RemoveWatcherResponse, RpcError> {
        self.state.core.watch_stop(self.sandbox, &req.watcher_id).await?;
        Ok(RemoveWatcherResponse {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permissions_read_as_gos_file_mode() {
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::File, 0o640), "-rw-r-----");
        assert_eq!(permissions(FileKind::File, 0o4755), "urwxr-xr-x");
        assert_eq!(Method::from_name("StreamInput"), None);
        assert_eq!(Method::from_name("ListDir"), Some(Method::ListDir));
    }
}
