//! The agent's API as `AgentClient` methods, one per `airlock_proto::Route`.

use super::transport::{bytes_body, collect_limited, empty, Clock};
use super::*;
use airlock_proto::frame::{Decoder, Event};
use airlock_proto::routes::{Route, WriteFile};
use airlock_proto::{
    FileStat, Health, Metrics, MkdirRequest, MkdirResponse, ProcessInfo, ProcessSpec, PtySize, RenameRequest,
    SignalRequest, WatchEvent,
};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;

impl AgentClient {
    pub async fn health(&self) -> Result<Health, AgentError> {
        self.call_record(Route::Health, empty()).await
    }

    pub async fn metrics(&self) -> Result<Metrics, AgentError> {
        self.call_record(Route::Metrics, empty()).await
    }

    /// Flush the guest's page cache to the disk.
    pub async fn sync(&self) -> Result<(), AgentError> {
        let (resp, due) = self
            .request(&Route::Sync, empty(), Clock::Agent(self.deadlines.slow_call))
            .await?;
        collect_limited(resp.into_body(), RECORD_MAX, "POST /system/sync", due)
            .await
            .map(drop)
    }

    /// Mount a disk the host attached (a volume); slow like a sync: the guest finds the new
    /// disk first, and grows its filesystem to the disk.
    pub async fn mount_volume(&self, mount: &airlock_proto::MountVolume) -> Result<(), AgentError> {
        let (resp, due) = self
            .request(
                &Route::MountVolume,
                Self::json_body(mount),
                Clock::Agent(self.deadlines.slow_call),
            )
            .await?;
        collect_limited(resp.into_body(), RECORD_MAX, "POST /volumes/mount", due)
            .await
            .map(drop)
    }

    /// Give the guest its identity (after every boot or restore; see `airlock_proto::Identity`).
    pub async fn set_identity(&self, identity: &airlock_proto::Identity) -> Result<(), AgentError> {
        self.call(Route::Identity, Self::json_body(identity)).await
    }

    /// Ask the guest to sync and power off.
    pub async fn shutdown(&self) -> Result<(), AgentError> {
        self.call(Route::Shutdown, empty()).await
    }

    pub async fn spawn(&self, spec: &ProcessSpec) -> Result<ProcessInfo, AgentError> {
        self.call_record(Route::Spawn, Self::json_body(spec)).await
    }

    pub async fn processes(&self) -> Result<Vec<ProcessInfo>, AgentError> {
        self.call_json(Route::Processes, empty(), LIST_MAX, self.deadlines.call)
            .await
    }

    pub async fn process(&self, id: u64) -> Result<ProcessInfo, AgentError> {
        self.call_record(Route::Process { id }, empty()).await
    }

    /// The process's events after `after` (0 = from the start), ending with its exit. The
    /// stream is long-lived (as long as the process); each frame is at most
    /// `airlock_proto::frame::MAX_PAYLOAD` bytes, and a larger length prefix ends it with
    /// [`AgentError::Protocol`] before its payload is buffered.
    pub async fn events(
        &self,
        id: u64,
        after: u64,
    ) -> Result<impl Stream<Item = Result<Event, AgentError>> + Send + 'static, AgentError> {
        let body = self
            .open_stream(Route::Events { id, after }, self.deadlines.call)
            .await?;
        Ok(futures_util::stream::unfold(
            (body, Decoder::default(), false),
            |(mut body, mut dec, done)| async move {
                if done {
                    return None;
                }
                loop {
                    // The decoder holds at most one frame's header and payload plus one HTTP/2
                    // DATA frame (`max_frame_size`): a whole frame is taken out before more is
                    // pushed, and a length prefix over `MAX_PAYLOAD` is an error at once.
                    match dec.next_event() {
                        Ok(Some(ev)) => return Some((Ok(ev), (body, dec, false))),
                        Ok(None) => {}
                        Err(e) => return Some((Err(AgentError::Protocol(e.to_string())), (body, dec, true))),
                    }
                    match body.frame().await {
                        None if dec.pending() == 0 => return None,
                        None => {
                            let err = AgentError::Protocol("event stream ended mid-frame".into());
                            return Some((Err(err), (body, dec, true)));
                        }
                        Some(Err(e)) => return Some((Err(AgentError::Transport(e.to_string())), (body, dec, true))),
                        Some(Ok(frame)) => {
                            if let Ok(data) = frame.into_data() {
                                dec.push(&data);
                            }
                        }
                    }
                }
            },
        ))
    }

    pub async fn write_stdin(&self, id: u64, data: impl Into<Bytes>) -> Result<(), AgentError> {
        self.call(Route::Stdin { id }, bytes_body(data)).await
    }

    pub async fn close_stdin(&self, id: u64) -> Result<(), AgentError> {
        self.call(Route::CloseStdin { id }, empty()).await
    }

    pub async fn signal(&self, id: u64, signal: i32) -> Result<(), AgentError> {
        let body = Self::json_body(&SignalRequest { signal });
        self.call(Route::Signal { id }, body).await
    }

    pub async fn resize(&self, id: u64, size: PtySize) -> Result<(), AgentError> {
        self.call(Route::Resize { id }, Self::json_body(&size)).await
    }

    /// File content as a stream of chunks (each at most one HTTP/2 DATA frame). Long-lived by
    /// design: only the response headers have a deadline.
    pub async fn read_file_stream(
        &self,
        path: &str,
    ) -> Result<impl Stream<Item = Result<Bytes, AgentError>> + Send + 'static, AgentError> {
        let body = self
            .open_stream(Route::ReadFile { path: path.into() }, self.deadlines.call)
            .await?;
        Ok(body
            .into_data_stream()
            .map(|r| r.map_err(|e| AgentError::Transport(e.to_string()))))
    }

    /// A whole file, at most [`READ_FILE_MAX`] bytes, within the call deadline.
    pub async fn read_file(&self, path: &str) -> Result<Bytes, AgentError> {
        let route = Route::ReadFile { path: path.into() };
        let (resp, due) = self.request(&route, empty(), Clock::Agent(self.deadlines.call)).await?;
        collect_limited(resp.into_body(), READ_FILE_MAX, &format!("GET {}", route.uri()), due).await
    }

    /// Write a file from a stream of chunks, creating parent directories. No deadline runs
    /// while `data` is slow; the agent must take each chunk, and answer after the last, within
    /// the call deadline.
    pub async fn write_file_stream<S>(&self, path: &str, user: Option<&str>, data: S) -> Result<FileStat, AgentError>
    where
        S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    {
        self.write_file_with_metadata(path, user, &Default::default(), data)
            .await
    }

    /// [`Self::write_file_stream`], the file's user metadata (its `user.e2b.*` xattrs) replaced
    /// by `metadata` (none: cleared).
    pub async fn write_file_with_metadata<S>(
        &self,
        path: &str,
        user: Option<&str>,
        metadata: &std::collections::BTreeMap<String, String>,
        data: S,
    ) -> Result<FileStat, AgentError>
    where
        S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    {
        self.write_file_as(path, user, None, metadata, data).await
    }

    /// [`Self::write_file_with_metadata`] with the file's permission bits set to `mode` (an
    /// overwritten file keeps its own when `None`).
    pub async fn write_file_as<S>(
        &self,
        path: &str,
        user: Option<&str>,
        mode: Option<u32>,
        metadata: &std::collections::BTreeMap<String, String>,
        data: S,
    ) -> Result<FileStat, AgentError>
    where
        S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    {
        let mut route = WriteFile {
            path: path.into(),
            user: user.map(Into::into),
            mode,
            ..Default::default()
        };
        // The metadata (up to a few KiB, too much for a header) leads the body, its length in
        // the query.
        let lead = match metadata.is_empty() {
            true => None,
            false => {
                let m = Bytes::from(serde_json::to_vec(metadata).expect("a map of strings"));
                route.metadata_len = m.len();
                Some(Ok(m))
            }
        };
        let data = futures_util::stream::iter(lead).chain(data);
        let body = BodyExt::boxed_unsync(StreamBody::new(data.map(|r| r.map(Frame::data))));
        self.call_record(Route::WriteFile(route), body).await
    }

    pub async fn write_file(
        &self,
        path: &str,
        user: Option<&str>,
        data: impl Into<Bytes>,
    ) -> Result<FileStat, AgentError> {
        let data: Bytes = data.into();
        // Chunked so a large file does not sit in one HTTP/2 DATA frame buffer.
        let chunks: Vec<Result<Bytes, std::io::Error>> = (0..data.len())
            .step_by(256 << 10)
            .map(|i| Ok(data.slice(i..(i + (256 << 10)).min(data.len()))))
            .collect();
        self.write_file_stream(path, user, futures_util::stream::iter(chunks))
            .await
    }

    pub async fn stat(&self, path: &str) -> Result<FileStat, AgentError> {
        self.call_record(Route::Stat { path: path.into() }, empty()).await
    }

    pub async fn list(&self, path: &str, depth: u32) -> Result<Vec<FileStat>, AgentError> {
        self.call_json(
            Route::List {
                path: path.into(),
                depth,
            },
            empty(),
            LIST_MAX,
            self.deadlines.slow_call,
        )
        .await
    }

    pub async fn mkdir(&self, path: &str, user: Option<&str>) -> Result<MkdirResponse, AgentError> {
        let body = Self::json_body(&MkdirRequest {
            path: path.into(),
            user: user.map(Into::into),
        });
        self.call_record(Route::Mkdir, body).await
    }

    pub async fn remove(&self, path: &str) -> Result<(), AgentError> {
        self.call(Route::Remove { path: path.into() }, empty()).await
    }

    pub async fn rename(&self, from: &str, to: &str) -> Result<FileStat, AgentError> {
        let body = Self::json_body(&RenameRequest {
            from: from.into(),
            to: to.into(),
        });
        self.call_record(Route::Rename, body).await
    }

    /// A byte stream to `127.0.0.1:<port>` inside the guest (port forwarding). Closing the write
    /// side ends the guest socket's input; the read side ends when the guest closes. The agent
    /// must answer within the call deadline; the stream itself lives as long as its ends do.
    pub async fn tunnel(&self, port: u16) -> Result<tokio::io::DuplexStream, AgentError> {
        let (ours, theirs) = tokio::io::duplex(256 << 10);
        let (from_client, mut to_client) = tokio::io::split(theirs);
        // The client's EOF ends the request body: EOF in the guest.
        let upstream = tokio_util::io::ReaderStream::with_capacity(from_client, 64 << 10);
        let body = BodyExt::boxed_unsync(StreamBody::new(upstream.map(|r| r.map(Frame::data))));
        let (resp, _) = self
            .request(&Route::Tunnel { port }, body, Clock::Headers(self.deadlines.call))
            .await?;
        let downstream = resp
            .into_body()
            .into_data_stream()
            .map(|r| r.map_err(std::io::Error::other));
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let _ = tokio::io::copy(&mut tokio_util::io::StreamReader::new(downstream), &mut to_client).await;
            let _ = to_client.shutdown().await;
        });
        Ok(ours)
    }

    /// Watch a directory; the stream is armed when this returns. Dropping it stops the watch.
    /// Each event is one line of at most [`WATCH_LINE_MAX`] bytes: a longer one ends the stream
    /// with [`AgentError::Protocol`].
    pub async fn watch(
        &self,
        path: &str,
        recursive: bool,
    ) -> Result<impl Stream<Item = Result<WatchEvent, AgentError>> + Send + 'static, AgentError> {
        self.watch_with_entries(path, recursive, false).await
    }

    /// [`Self::watch`]; with `entries`, creates, writes and chmods carry the entry's stat.
    pub async fn watch_with_entries(
        &self,
        path: &str,
        recursive: bool,
        entries: bool,
    ) -> Result<impl Stream<Item = Result<WatchEvent, AgentError>> + Send + 'static, AgentError> {
        let route = Route::Watch {
            path: path.into(),
            recursive,
            entry: entries,
        };
        let body = self.open_stream(route, self.deadlines.slow_call).await?;
        Ok(futures_util::stream::unfold(
            (body, Vec::<u8>::new(), false),
            |(mut body, mut buf, done)| async move {
                if done {
                    return None;
                }
                loop {
                    if let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = buf.drain(..=nl).collect();
                        let ev = serde_json::from_slice(&line[..nl]).map_err(|e| AgentError::Protocol(e.to_string()));
                        return Some((ev, (body, buf, false)));
                    }
                    if buf.len() > WATCH_LINE_MAX {
                        let err = AgentError::Protocol(format!(
                            "watch event longer than the limit of {WATCH_LINE_MAX} bytes"
                        ));
                        return Some((Err(err), (body, Vec::new(), true)));
                    }
                    match body.frame().await? {
                        Err(e) => return Some((Err(AgentError::Transport(e.to_string())), (body, buf, true))),
                        Ok(frame) => {
                            if let Ok(data) = frame.into_data() {
                                buf.extend_from_slice(&data);
                            }
                        }
                    }
                }
            },
        ))
    }
}
