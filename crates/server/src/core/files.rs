//! Files inside a running sandbox. The agent does the work; this maps its answers onto
//! `CoreError` once, for both doors.

use super::uploads::Uploads;
use super::Core;
use crate::error::{CoreError, CoreResult, Kind};
use crate::nodes::{WatchSpec, WatchStart};
use crate::records::SandboxRecord;
use airlock_agent_client::AgentClient;
use airlock_agent_client::AgentError;
use airlock_proto::{FileStat, MkdirResponse, WatchEvent};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use std::sync::Arc;

/// A file's user metadata: keys and values of printable ASCII (see [`check_metadata`]).
pub type Metadata = std::collections::BTreeMap<String, String>;

/// The metadata an upload may set: keys lowercased (they travel as HTTP header names) and
/// non-empty, keys and values printable ASCII, all within what one file's xattrs hold.
pub fn check_metadata(pairs: impl IntoIterator<Item = (String, String)>) -> CoreResult<Metadata> {
    let metadata: Metadata = pairs.into_iter().map(|(k, v)| (k.to_ascii_lowercase(), v)).collect();
    airlock_proto::check_metadata(&metadata).map_err(|why| CoreError::invalid("metadata", why))?;
    Ok(metadata)
}

/// Where a symlink leads, as envd reports it: the target fully resolved (absolute, every link on
/// the way followed); for a dangling link (or an agent too old to resolve) the link's own path.
pub fn resolved_link(stat: &FileStat) -> Option<String> {
    stat.symlink_target.as_ref()?;
    Some(stat.symlink_resolved.clone().unwrap_or_else(|| stat.path.clone()))
}

/// The file operations of one running sandbox.
#[derive(Clone)]
pub struct Files {
    agent: AgentClient,
    sandbox_id: String,
    tenant_id: String,
    uploads: Arc<Uploads>,
}

impl Core {
    pub async fn files(&self, sandbox: &SandboxRecord) -> CoreResult<Files> {
        Ok(Files {
            agent: self.agent_for(sandbox).await?,
            sandbox_id: sandbox.id.clone(),
            tenant_id: sandbox.tenant_id.clone(),
            uploads: self.uploads.clone(),
        })
    }
}

/// Polling file watchers (E2B's `CreateWatcher`): kept on the sandbox's node, so a poll through
/// any replica finds the events (`nodes/watches.rs`).
impl Core {
    /// Watch `spec` in `sandbox` (running: the caller has its files); the watcher's id.
    pub async fn watch_start(&self, sandbox: &SandboxRecord, spec: &WatchSpec) -> CoreResult<String> {
        let started = self.nodes.watch_start(&sandbox.id, spec).await;
        match started.map_err(|e| CoreError::node(&sandbox.id, e))? {
            WatchStart::Started { watch } => Ok(watch),
            WatchStart::Full { limit } => Err(CoreError::WatcherLimit {
                sandbox: sandbox.id.clone(),
                limit,
            }),
            WatchStart::Refused { status, code, message } => Err(CoreError::agent(
                Kind::File,
                &sandbox.id,
                AgentError::Api { status, code, message },
            )),
        }
    }

    /// What watcher `watch` of `sandbox` saw since the last take.
    pub async fn watch_take(&self, sandbox: &SandboxRecord, watch: &str) -> CoreResult<super::WatchTaken> {
        self.nodes
            .watch_take(&sandbox.id, watch)
            .await
            .map_err(|e| CoreError::node(&sandbox.id, e))?
            .ok_or_else(|| CoreError::not_found(Kind::Watcher, watch))
    }

    /// Stop watcher `watch` of `sandbox`.
    pub async fn watch_stop(&self, sandbox: &SandboxRecord, watch: &str) -> CoreResult<()> {
        let stopped = self.nodes.watch_stop(&sandbox.id, watch).await;
        match stopped.map_err(|e| CoreError::node(&sandbox.id, e))? {
            true => Ok(()),
            false => Err(CoreError::not_found(Kind::Watcher, watch)),
        }
    }
}

impl Files {
    /// The agent's messages name the path; the kind makes a missing one `file_not_found`.
    fn err(&self) -> impl Fn(AgentError) -> CoreError + '_ {
        move |e| CoreError::agent(Kind::File, &self.sandbox_id, e)
    }

    pub async fn read(
        &self,
        path: &str,
    ) -> CoreResult<impl Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static> {
        let s = self.agent.read_file_stream(path).await.map_err(self.err())?;
        Ok(s.map(|r| r.map_err(std::io::Error::other)))
    }

    /// Write `data` to `path` (atomically: a broken stream leaves the old file), owned by `user`,
    /// without user metadata. Waits for room among the uploads under way (see [`Uploads`])
    /// before it reads `data`; a caller whose stream broke knows that was the cause.
    pub async fn write<S>(&self, path: &str, user: &str, data: S) -> CoreResult<FileStat>
    where
        S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    {
        self.write_with_metadata(path, user, &Metadata::new(), data).await
    }

    /// [`Self::write`]; the file's user metadata becomes `metadata` (checked first with
    /// [`check_metadata`]): an upload replaces the whole set, as envd's does.
    pub async fn write_with_metadata<S>(
        &self,
        path: &str,
        user: &str,
        metadata: &Metadata,
        data: S,
    ) -> CoreResult<FileStat>
    where
        S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    {
        let _slot = self.uploads.enter(&self.tenant_id, &self.sandbox_id).await?;
        self.agent
            .write_file_with_metadata(path, Some(user), metadata, data)
            .await
            .map_err(self.err())
    }

    pub async fn stat(&self, path: &str) -> CoreResult<FileStat> {
        self.agent.stat(path).await.map_err(self.err())
    }

    pub async fn list(&self, path: &str, depth: u32) -> CoreResult<Vec<FileStat>> {
        if !(1..=32).contains(&depth) {
            return Err(CoreError::invalid(
                "depth",
                format!("must be between 1 and 32, got {depth}"),
            ));
        }
        self.agent.list(path, depth).await.map_err(self.err())
    }

    pub async fn mkdir(&self, path: &str, user: &str) -> CoreResult<MkdirResponse> {
        self.agent.mkdir(path, Some(user)).await.map_err(self.err())
    }

    /// As envd (and `rm -rf`) do: a path that isn't there is already removed.
    pub async fn remove(&self, path: &str) -> CoreResult<()> {
        match self.agent.remove(path).await {
            Err(e) if e.code() == Some(airlock_proto::ErrorCode::NotFound) => Ok(()),
            r => r.map_err(self.err()),
        }
    }

    pub async fn rename(&self, from: &str, to: &str) -> CoreResult<FileStat> {
        self.agent.rename(from, to).await.map_err(self.err())
    }

    /// Changes under `path`; with `entries`, creates, writes and chmods carry the entry as it is
    /// when the event is handled (as envd's `include_entry`).
    pub async fn watch(
        &self,
        path: &str,
        recursive: bool,
        entries: bool,
    ) -> CoreResult<impl Stream<Item = Result<WatchEvent, CoreError>> + Send + 'static> {
        let events = self
            .agent
            .watch_with_entries(path, recursive, entries)
            .await
            .map_err(self.err())?;
        let id = self.sandbox_id.clone();
        Ok(events.map(move |r| r.map_err(|e| CoreError::agent(Kind::File, &id, e))))
    }
}
