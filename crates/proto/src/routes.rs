//! The agent's routes, defined once: the agent parses a request into a [`Route`], the host's
//! client and the fake agent build and match the same values. Each variant's doc says what its
//! request body carries and what the agent answers (JSON unless it says otherwise); errors are
//! always an [`crate::ErrorBody`].

use std::collections::HashMap;

/// The HTTP methods the agent serves (this crate has no HTTP dependency; each side maps these
/// onto its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Post,
    Put,
    Delete,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Post => "POST",
            Method::Put => "PUT",
            Method::Delete => "DELETE",
        }
    }

    pub fn parse(method: &str) -> Option<Self> {
        Some(match method {
            "GET" => Method::Get,
            "POST" => Method::Post,
            "PUT" => Method::Put,
            "DELETE" => Method::Delete,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Every call the agent serves, with what its path and query carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// `GET /health` -> [`crate::Health`].
    Health,
    /// `GET /metrics` -> [`crate::Metrics`].
    Metrics,
    /// `POST /identity`, [`crate::Identity`] -> `{}`.
    Identity,
    /// `POST /system/sync` -> `{}` once the guest's page cache is on its disk.
    Sync,
    /// `POST /system/shutdown` -> 202 `{}`; the guest syncs and powers off.
    Shutdown,
    /// `POST /processes`, [`crate::ProcessSpec`] -> 201 [`crate::ProcessInfo`].
    Spawn,
    /// `GET /processes` -> `[`[`crate::ProcessInfo`]`]`.
    Processes,
    /// `GET /processes/{id}` -> [`crate::ProcessInfo`].
    Process { id: u64 },
    /// `GET /processes/{id}/events?after=N` -> a stream of [`crate::frame`]s.
    Events { id: u64, after: u64 },
    /// `POST /processes/{id}/stdin`, raw bytes -> `{}`.
    Stdin { id: u64 },
    /// `POST /processes/{id}/stdin/close` -> `{}`.
    CloseStdin { id: u64 },
    /// `POST /processes/{id}/signal`, [`crate::SignalRequest`] -> `{}`.
    Signal { id: u64 },
    /// `POST /processes/{id}/resize`, [`crate::PtySize`] -> `{}`.
    Resize { id: u64 },
    /// `GET /files?path=` -> the file's bytes, streamed.
    ReadFile { path: String },
    /// `PUT /files?path=[&user=][&mode=][&metadata_len=]`, the file's bytes (led by
    /// `metadata_len` bytes of JSON metadata) -> [`crate::FileStat`].
    WriteFile(WriteFile),
    /// `DELETE /files?path=` -> `{}`.
    Remove { path: String },
    /// `GET /files/stat?path=` -> [`crate::FileStat`].
    Stat { path: String },
    /// `GET /files/list?path=[&depth=]` (depth 1 unless given) -> `[`[`crate::FileStat`]`]`.
    List { path: String, depth: u32 },
    /// `POST /files/mkdir`, [`crate::MkdirRequest`] -> [`crate::MkdirResponse`].
    Mkdir,
    /// `POST /files/rename`, [`crate::RenameRequest`] -> [`crate::FileStat`].
    Rename,
    /// `GET /files/watch?path=[&recursive=true][&entry=true]` -> a stream of
    /// [`crate::WatchEvent`]s, one JSON line each.
    Watch { path: String, recursive: bool, entry: bool },
    /// `POST /volumes/mount`, [`crate::MountVolume`] -> `{}` once the disk the host attached
    /// is mounted where asked and under [`crate::VOLUME_ACCESS_DIR`].
    MountVolume,
    /// `POST /tcp/{port}`: the request body goes to `127.0.0.1:<port>` in the guest, the
    /// response body is what comes back.
    Tunnel { port: u16 },
}

/// What a file upload's query carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriteFile {
    pub path: String,
    /// Owner of the file and of the directories made for it; `root` unless given.
    pub user: Option<String>,
    /// Permission bits (octal in the query); an overwritten file keeps its own unless given.
    pub mode: Option<u32>,
    /// Bytes of JSON metadata leading the body (0: none, the file's metadata is cleared).
    pub metadata_len: usize,
}

/// Why a request names no route.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No route has this method and path.
    #[error("no route {method} {path}")]
    NotFound { method: String, path: String },
    /// The route exists but a part of its path or query is malformed or missing.
    #[error("{0}")]
    Invalid(String),
}

fn encode(value: &str) -> String {
    url::form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

impl Route {
    /// The route's name without its parameters: a bounded label (the host's call metrics).
    pub fn name(&self) -> &'static str {
        match self {
            Route::Health => "health",
            Route::Metrics => "metrics",
            Route::Identity => "identity",
            Route::Sync => "sync",
            Route::Shutdown => "shutdown",
            Route::Spawn => "spawn",
            Route::Processes => "processes",
            Route::Process { .. } => "process",
            Route::Events { .. } => "events",
            Route::Stdin { .. } => "stdin",
            Route::CloseStdin { .. } => "close_stdin",
            Route::Signal { .. } => "signal",
            Route::Resize { .. } => "resize",
            Route::ReadFile { .. } => "read_file",
            Route::WriteFile(_) => "write_file",
            Route::Remove { .. } => "remove",
            Route::Stat { .. } => "stat",
            Route::List { .. } => "list",
            Route::Mkdir => "mkdir",
            Route::Rename => "rename",
            Route::Watch { .. } => "watch",
            Route::MountVolume => "mount_volume",
            Route::Tunnel { .. } => "tunnel",
        }
    }

    pub fn method(&self) -> Method {
        match self {
            Route::Health
            | Route::Metrics
            | Route::Processes
            | Route::Process { .. }
            | Route::Events { .. }
            | Route::ReadFile { .. }
            | Route::Stat { .. }
            | Route::List { .. }
            | Route::Watch { .. } => Method::Get,
            Route::Identity
            | Route::Sync
            | Route::Shutdown
            | Route::Spawn
            | Route::Stdin { .. }
            | Route::CloseStdin { .. }
            | Route::Signal { .. }
            | Route::Resize { .. }
            | Route::Mkdir
            | Route::Rename
            | Route::MountVolume
            | Route::Tunnel { .. } => Method::Post,
            Route::WriteFile(_) => Method::Put,
            Route::Remove { .. } => Method::Delete,
        }
    }

    /// The path and query of the request, values percent-encoded.
    pub fn uri(&self) -> String {
        match self {
            Route::Health => "/health".into(),
            Route::Metrics => "/metrics".into(),
            Route::Identity => "/identity".into(),
            Route::Sync => "/system/sync".into(),
            Route::Shutdown => "/system/shutdown".into(),
            Route::Spawn | Route::Processes => "/processes".into(),
            Route::Process { id } => format!("/processes/{id}"),
            Route::Events { id, after } => format!("/processes/{id}/events?after={after}"),
            Route::Stdin { id } => format!("/processes/{id}/stdin"),
            Route::CloseStdin { id } => format!("/processes/{id}/stdin/close"),
            Route::Signal { id } => format!("/processes/{id}/signal"),
            Route::Resize { id } => format!("/processes/{id}/resize"),
            Route::ReadFile { path } | Route::Remove { path } => format!("/files?path={}", encode(path)),
            Route::WriteFile(w) => {
                let mut uri = format!("/files?path={}", encode(&w.path));
                if let Some(u) = &w.user {
                    uri.push_str(&format!("&user={}", encode(u)));
                }
                if let Some(m) = w.mode {
                    uri.push_str(&format!("&mode={m:o}"));
                }
                if w.metadata_len > 0 {
                    uri.push_str(&format!("&metadata_len={}", w.metadata_len));
                }
                uri
            }
            Route::Stat { path } => format!("/files/stat?path={}", encode(path)),
            Route::List { path, depth } => format!("/files/list?path={}&depth={depth}", encode(path)),
            Route::Mkdir => "/files/mkdir".into(),
            Route::Rename => "/files/rename".into(),
            Route::Watch { path, recursive, entry } => {
                let mut uri = format!("/files/watch?path={}&recursive={recursive}", encode(path));
                if *entry {
                    uri.push_str("&entry=true");
                }
                uri
            }
            Route::MountVolume => "/volumes/mount".into(),
            Route::Tunnel { port } => format!("/tcp/{port}"),
        }
    }

    /// The route a request names: its method, path and query (without the `?`).
    pub fn parse(method: &str, path: &str, query: Option<&str>) -> Result<Route, RouteError> {
        let not_found = || RouteError::NotFound {
            method: method.to_string(),
            path: path.to_string(),
        };
        let m = Method::parse(method).ok_or_else(not_found)?;
        let q: HashMap<String, String> = query
            .map(|q| url::form_urlencoded::parse(q.as_bytes()).into_owned().collect())
            .unwrap_or_default();
        let required = |key: &str| {
            q.get(key)
                .cloned()
                .ok_or_else(|| RouteError::Invalid(format!("query parameter {key:?} is required")))
        };
        let flag = |k: &str| q.get(k).is_some_and(|v| v == "true" || v == "1");
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        use Method::*;
        Ok(match (m, segs.as_slice()) {
            (Get, ["health"]) => Route::Health,
            (Get, ["metrics"]) => Route::Metrics,
            (Post, ["identity"]) => Route::Identity,
            (Post, ["system", "sync"]) => Route::Sync,
            (Post, ["system", "shutdown"]) => Route::Shutdown,
            (Post, ["processes"]) => Route::Spawn,
            (Get, ["processes"]) => Route::Processes,
            (_, ["processes", id, rest @ ..]) => {
                let id: u64 = id
                    .parse()
                    .map_err(|_| RouteError::Invalid(format!("bad process id {id:?}")))?;
                match (m, rest) {
                    (Get, []) => Route::Process { id },
                    (Get, ["events"]) => Route::Events {
                        id,
                        after: q.get("after").and_then(|v| v.parse().ok()).unwrap_or(0),
                    },
                    (Post, ["stdin"]) => Route::Stdin { id },
                    (Post, ["stdin", "close"]) => Route::CloseStdin { id },
                    (Post, ["signal"]) => Route::Signal { id },
                    (Post, ["resize"]) => Route::Resize { id },
                    _ => return Err(not_found()),
                }
            }
            (Get, ["files"]) => Route::ReadFile {
                path: required("path")?,
            },
            (Put, ["files"]) => Route::WriteFile(WriteFile {
                path: required("path")?,
                user: q.get("user").cloned(),
                mode: match q.get("mode") {
                    None => None,
                    Some(m) => Some(
                        u32::from_str_radix(m, 8).map_err(|_| RouteError::Invalid(format!("bad octal mode {m:?}")))?,
                    ),
                },
                metadata_len: match q.get("metadata_len") {
                    None => 0,
                    Some(n) => n
                        .parse()
                        .map_err(|_| RouteError::Invalid(format!("bad metadata_len {n:?}")))?,
                },
            }),
            (Delete, ["files"]) => Route::Remove {
                path: required("path")?,
            },
            (Get, ["files", "stat"]) => Route::Stat {
                path: required("path")?,
            },
            (Get, ["files", "list"]) => Route::List {
                path: required("path")?,
                depth: match q.get("depth") {
                    None => 1,
                    Some(d) => d.parse().map_err(|_| RouteError::Invalid(format!("bad depth {d:?}")))?,
                },
            },
            (Post, ["files", "mkdir"]) => Route::Mkdir,
            (Post, ["files", "rename"]) => Route::Rename,
            (Get, ["files", "watch"]) => Route::Watch {
                path: required("path")?,
                recursive: flag("recursive"),
                entry: flag("entry"),
            },
            (Post, ["volumes", "mount"]) => Route::MountVolume,
            (Post, ["tcp", port]) => Route::Tunnel {
                port: port
                    .parse()
                    .map_err(|_| RouteError::Invalid(format!("bad port {port:?}")))?,
            },
            _ => return Err(not_found()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every route survives its own URI, and the URIs are the ones the agent always served.
    #[test]
    fn routes_round_trip() {
        let path = "/home/user/a b&c=d?.txt".to_string();
        let routes = [
            (Route::Health, "/health"),
            (Route::Metrics, "/metrics"),
            (Route::Identity, "/identity"),
            (Route::Sync, "/system/sync"),
            (Route::Shutdown, "/system/shutdown"),
            (Route::Spawn, "/processes"),
            (Route::Processes, "/processes"),
            (Route::Process { id: 7 }, "/processes/7"),
            (Route::Events { id: 7, after: 3 }, "/processes/7/events?after=3"),
            (Route::Stdin { id: 7 }, "/processes/7/stdin"),
            (Route::CloseStdin { id: 7 }, "/processes/7/stdin/close"),
            (Route::Signal { id: 7 }, "/processes/7/signal"),
            (Route::Resize { id: 7 }, "/processes/7/resize"),
            (
                Route::ReadFile { path: path.clone() },
                "/files?path=%2Fhome%2Fuser%2Fa+b%26c%3Dd%3F.txt",
            ),
            (
                Route::WriteFile(WriteFile {
                    path: "/x".into(),
                    user: Some("user".into()),
                    mode: Some(0o755),
                    metadata_len: 12,
                }),
                "/files?path=%2Fx&user=user&mode=755&metadata_len=12",
            ),
            (
                Route::WriteFile(WriteFile {
                    path: "/x".into(),
                    ..Default::default()
                }),
                "/files?path=%2Fx",
            ),
            (Route::Remove { path: "/x".into() }, "/files?path=%2Fx"),
            (Route::Stat { path: "/x".into() }, "/files/stat?path=%2Fx"),
            (
                Route::List {
                    path: "/x".into(),
                    depth: 2,
                },
                "/files/list?path=%2Fx&depth=2",
            ),
            (Route::Mkdir, "/files/mkdir"),
            (Route::MountVolume, "/volumes/mount"),
            (Route::Rename, "/files/rename"),
            (
                Route::Watch {
                    path: "/x".into(),
                    recursive: true,
                    entry: true,
                },
                "/files/watch?path=%2Fx&recursive=true&entry=true",
            ),
            (
                Route::Watch {
                    path: "/x".into(),
                    recursive: false,
                    entry: false,
                },
                "/files/watch?path=%2Fx&recursive=false",
            ),
            (Route::Tunnel { port: 8000 }, "/tcp/8000"),
        ];
        for (route, uri) in routes {
            assert_eq!(route.uri(), uri, "{route:?}");
            let (p, q) = match uri.split_once('?') {
                Some((p, q)) => (p, Some(q)),
                None => (uri, None),
            };
            assert_eq!(Route::parse(route.method().as_str(), p, q), Ok(route.clone()));
        }
    }

    #[test]
    fn malformed_requests() {
        assert!(matches!(
            Route::parse("GET", "/nope", None),
            Err(RouteError::NotFound { .. })
        ));
        assert!(matches!(
            Route::parse("PATCH", "/health", None),
            Err(RouteError::NotFound { .. })
        ));
        assert!(matches!(
            Route::parse("GET", "/processes/7/nope", None),
            Err(RouteError::NotFound { .. })
        ));
        assert_eq!(
            Route::parse("GET", "/processes/x", None),
            Err(RouteError::Invalid("bad process id \"x\"".into()))
        );
        assert_eq!(
            Route::parse("GET", "/files/stat", None),
            Err(RouteError::Invalid("query parameter \"path\" is required".into()))
        );
        assert!(matches!(
            Route::parse("GET", "/files/list", Some("path=/&depth=x")),
            Err(RouteError::Invalid(_))
        ));
        assert!(matches!(
            Route::parse("POST", "/tcp/99999", None),
            Err(RouteError::Invalid(_))
        ));
        // No `after`: from the start.
        assert_eq!(
            Route::parse("GET", "/processes/1/events", None),
            Ok(Route::Events { id: 1, after: 0 })
        );
    }
}
