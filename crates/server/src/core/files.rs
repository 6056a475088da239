//! Files inside a running sandbox. The agent does the work; this maps its answers onto
//! `CoreError` once, for both doors.

use super::Core;
use crate::error::{CoreError, CoreResult, Kind};
use crate::store::SandboxRow;
use airlock_proto::{FileStat, MkdirResponse, WatchEvent};
use airlock_runtime::agent::AgentError;
use airlock_runtime::AgentClient;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};

/// The file operations of one running sandbox.
#[derive(Clone)]
pub struct Files {
    agent: AgentClient,
    sandbox_id: String,
}

impl Core {
    pub async fn files(&self, sandbox: &SandboxRow) -> CoreResult<Files> {
        Ok(Files {
            agent: self.agent_for(sandbox).await?,
            sandbox_id: sandbox.id.clone(),
        })
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

    /// Write `data` to `path` (atomically: a broken stream leaves the old file), owned by `user`.
    pub async fn write<S>(&self, path: &str, user: &str, data: S) -> Result<FileStat, AgentError>
    where
        S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    {
        self.agent.write_file_stream(path, Some(user), data).await
    }

    /// Map an error of `write` (which callers inspect first: a broken upload is their fault).
    pub fn write_error(&self, e: AgentError) -> CoreError {
        self.err()(e)
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

    pub async fn watch(
        &self,
        path: &str,
        recursive: bool,
    ) -> CoreResult<impl Stream<Item = Result<WatchEvent, CoreError>> + Send + 'static> {
        let events = self.agent.watch(path, recursive).await.map_err(self.err())?;
        let id = self.sandbox_id.clone();
        Ok(events.map(move |r| r.map_err(|e| CoreError::agent(Kind::File, &id, e))))
    }
}
