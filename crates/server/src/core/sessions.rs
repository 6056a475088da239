//! Sessions: every process started through either door is a session with an id, recorded in the
//! store, so each door sees the others' processes. One signal table serves both.

use super::sandboxes::{check_env, check_timeout};
use super::Core;
use crate::error::{CoreError, CoreResult, Kind};
use crate::records::{now_ms, SandboxRecord, SessionRecord};
use crate::signals;
use crate::store::{SessionStart, Store};
use airlock_agent_client::AgentClient;
use airlock_proto::frame::{Event, EventKind};
use airlock_proto::{ProcessInfo, ProcessSpec, ProcessState, PtySize};
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

/// A request to start a process, from either door.
#[derive(Debug, Clone, Default)]
pub struct StartSession {
    pub argv: Vec<String>,
    /// Default: the user's home.
    pub cwd: Option<String>,
    /// Added to the sandbox's own environment.
    pub env: BTreeMap<String, String>,
    /// Default `user`.
    pub user: Option<String>,
    /// Kill the process after this long.
    pub timeout: Option<Duration>,
    /// Keep stdin open.
    pub stdin: bool,
    pub pty: Option<PtySize>,
    /// The caller's own label (E2B's process tag).
    pub tag: Option<String>,
}

/// How E2B addresses a process: its guest pid or its tag.
#[derive(Debug, Clone)]
pub enum Selector {
    Pid(u32),
    Tag(String),
}

/// A session's events as both doors stream them (see `Core::session_events`).
pub type SessionEvents = BoxStream<'static, CoreResult<SessionEvent>>;

/// What a session's stream carries.
#[derive(Debug, Clone)]
pub enum SessionEvent {
    /// Output or the exit, as the agent logged it.
    Event(Event),
    /// Events `first..=last` are gone: the agent keeps a bounded tail of each process's output
    /// (32 MiB) and dropped them before this reader got there.
    Truncated { first: u64, last: u64 },
}

/// A session with what the agent knows of its process right now.
#[derive(Debug, Clone)]
pub struct Running {
    pub session: SessionRecord,
    pub process: ProcessInfo,
}

/// `SIGTERM`, `TERM`, `term` or a number (`"15"`), by the one signal table (`crate::signals`).
pub fn parse_signal(s: &str) -> CoreResult<i32> {
    let s = s.trim();
    if let Ok(n) = s.parse::<i32>() {
        return if signals::NUMBERS.contains(&n) {
            Ok(n)
        } else {
            Err(CoreError::invalid("signal", format!("{n} is out of range (1 to 64)")))
        };
    }
    signals::by_name(s).ok_or_else(|| {
        CoreError::invalid(
            "signal",
            format!("unknown signal {s:?}; use a name like SIGTERM or a number"),
        )
    })
}

pub use crate::signals::{description as signal_description, name as signal_name};

fn check_start(req: &StartSession) -> CoreResult<()> {
    if req.argv.first().is_none_or(|a| a.is_empty()) {
        return Err(CoreError::invalid(
            "argv",
            "must name a program, e.g. [\"python3\", \"-c\", \"print(1)\"]",
        ));
    }
    if req.argv.iter().any(|a| a.contains('\0')) {
        return Err(CoreError::invalid("argv", "must not contain NUL bytes"));
    }
    if let Some(t) = req.timeout {
        check_timeout("timeout", t)?;
    }
    if let Some(p) = &req.pty {
        if p.cols == 0 || p.rows == 0 {
            return Err(CoreError::invalid("pty", "cols and rows must be at least 1"));
        }
    }
    check_env(&req.env)
}

fn guest(sandbox: &SandboxRecord) -> impl Fn(airlock_agent_client::AgentError) -> CoreError + '_ {
    move |e| CoreError::agent(Kind::Process, &sandbox.id, e)
}

/// Record a session's exit, then keep only the newest `keep` exited sessions of its sandbox:
/// what the store holds per sandbox stays bounded however many processes run.
async fn record_exit(store: &dyn Store, row: &SessionRecord, keep: u32) -> CoreResult<()> {
    store.finish_session(row).await?;
    if let Err(e) = store.prune_finished_sessions(&row.sandbox_id, keep).await {
        tracing::warn!(sandbox = %row.sandbox_id, "cannot prune exited sessions: {e}");
    }
    Ok(())
}

/// How long a session start's reservation counts at most: past it, a start whose replica died
/// before ending it gives its place back. A start's agent calls end well within it.
const START_HOLD_MS: i64 = 60_000;

/// One admitted start: a reservation in the store, counted with the sandbox's running sessions
/// until its session is recorded (or it failed), by every replica alike.
struct Admitted {
    store: Arc<dyn Store>,
    id: Option<String>,
}

impl Admitted {
    async fn release(mut self) {
        if let Some(id) = self.id.take() {
            end_start(&*self.store, &id).await;
        }
    }
}

impl Drop for Admitted {
    /// A start dropped half-way (its request went away) still gives its place back.
    fn drop(&mut self) {
        // Without a runtime (it is shutting down) the reservation lapses at its hold.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if let Some(id) = self.id.take() {
            let store = self.store.clone();
            rt.spawn(async move { end_start(&*store, &id).await });
        }
    }
}

async fn end_start(store: &dyn Store, id: &str) {
    if let Err(e) = store.end_session_start(id).await {
        tracing::warn!(start = id, "cannot end a session start (it lapses on its own): {e}");
    }
}

impl Core {
    /// Admit one more session of `sandbox`, or refuse it with `SessionLimit`. Sessions the store
    /// still counts as running are checked against the agent first (their exits may not be
    /// recorded yet). The store reserves the start in one step per sandbox, so concurrent
    /// starts through any replica never overshoot the limit.
    async fn admit_session(&self, sandbox: &SandboxRecord, agent: &AgentClient) -> CoreResult<Admitted> {
        let limit = self
            .quota_of(&sandbox.tenant_id)
            .await?
            .sessions_per_sandbox
            .unwrap_or(u32::MAX);
        let id = format!("start_{}", airlock_runtime::datadir::random_hex(8));
        let reserve = || {
            let now_ms = now_ms();
            let start = SessionStart {
                id: &id,
                sandbox_id: &sandbox.id,
                limit,
                now_ms,
                until_ms: now_ms + START_HOLD_MS,
            };
            async move { self.store.reserve_session_start(&start).await }
        };
        let mut reserved = reserve().await?;
        if reserved.is_err() {
            self.record_exits(sandbox, agent).await?;
            reserved = reserve().await?;
        }
        match reserved {
            Ok(()) => Ok(Admitted {
                store: self.store.clone(),
                id: Some(id),
            }),
            Err(running) => Err(CoreError::SessionLimit {
                sandbox: sandbox.id.clone(),
                running,
                limit,
            }),
        }
    }

    /// Record the exit of every session the store thinks runs whose process the agent reports
    /// ended, or no longer knows.
    async fn record_exits(&self, sandbox: &SandboxRecord, agent: &AgentClient) -> CoreResult<()> {
        // The sessions first, then the agent's processes: a session is recorded only after its
        // process started, so each one read here is in the agent's answer unless it is long
        // over. Asked the other way round, a start recorded meanwhile (through any replica)
        // would look forgotten and be marked exited while it runs.
        let sessions = self.store.list_sessions(&sandbox.id).await?;
        let procs: HashMap<u64, ProcessInfo> = agent
            .processes()
            .await
            .map_err(guest(sandbox))?
            .into_iter()
            .map(|p| (p.id, p))
            .collect();
        for mut row in sessions {
            if row.exited {
                continue;
            }
            match procs.get(&row.process_id) {
                Some(p) if p.state == ProcessState::Running => continue,
                Some(p) => {
                    if let Some(exit) = &p.exit {
                        row.exit_code = exit.exit_code;
                        row.signal = exit.signal;
                        row.timed_out = exit.timed_out;
                    }
                    row.ended_at_ms = Some(p.ended_at_ms.map(|v| v as i64).unwrap_or_else(now_ms));
                }
                // Forgotten by the agent: long over (it remembers the newest exits).
                None => row.ended_at_ms = Some(now_ms()),
            }
            row.exited = true;
            record_exit(&*self.store, &row, self.config.max_finished_sessions_per_sandbox).await?;
        }
        Ok(())
    }

    /// Start a process and record it as a session. Returns what the agent reported of the
    /// process at its start (so a door needs no second round trip for it). Past
    /// `Config::max_sessions_per_sandbox` running sessions it is refused (exits are recorded
    /// with `record_exit`, which keeps only the newest `max_finished_sessions_per_sandbox`
    /// exited ones).
    pub async fn start_session(&self, sandbox: &SandboxRecord, req: StartSession) -> CoreResult<Running> {
        let (agent, running, admitted) = self.spawn_session(sandbox, req).await?;
        let recorded = self.record_session(&agent, &running.session).await;
        admitted.release().await;
        recorded?;
        Ok(running)
    }

    /// Start a process and open its events at once (a command and its output in one call): the
    /// session's record is committed while the agent opens the stream, not before it. The
    /// stream is read only after both, so an exit it carries updates a committed row.
    pub async fn start_session_events(
        &self,
        sandbox: &SandboxRecord,
        req: StartSession,
    ) -> CoreResult<(SessionRecord, CoreResult<SessionEvents>)> {
        let (agent, running, admitted) = self.spawn_session(sandbox, req).await?;
        let row = running.session;
        let (recorded, events) = tokio::join!(self.record_session(&agent, &row), agent.events(row.process_id, 0));
        admitted.release().await;
        recorded?;
        let events = events
            .map_err(guest(sandbox))
            .map(|events| self.follow_events(sandbox, events.boxed(), row.clone(), 0));
        Ok((row, events))
    }

    /// Admit and spawn a process; not yet recorded (see `record_session`). Its admission is
    /// handed back to be released once the session is recorded: until then the store does not
    /// count it, and a start admitted meanwhile would take its place too.
    async fn spawn_session(
        &self,
        sandbox: &SandboxRecord,
        req: StartSession,
    ) -> CoreResult<(AgentClient, Running, Admitted)> {
        check_start(&req)?;
        let agent = self.agent_for(sandbox).await?;
        let admitted = self.admit_session(sandbox, &agent).await?;
        match self.spawn_process(sandbox, &agent, req).await {
            Ok(started) => Ok((agent, started, admitted)),
            Err(e) => {
                admitted.release().await;
                Err(e)
            }
        }
    }

    /// Store a started session; a process nobody can see must not run on.
    async fn record_session(&self, agent: &AgentClient, row: &SessionRecord) -> CoreResult<()> {
        if let Err(e) = self.store.insert_session(row).await {
            let _ = agent.signal(row.process_id, 9).await;
            return Err(e.into());
        }
        Ok(())
    }

    async fn spawn_process(
        &self,
        sandbox: &SandboxRecord,
        agent: &AgentClient,
        req: StartSession,
    ) -> CoreResult<Running> {
        let id = format!("ses_{}", airlock_runtime::datadir::random_hex(8));
        let mut env = sandbox.env.clone();
        env.extend(req.env);
        // A built template's last USER and WORKDIR are its processes' defaults, as in Docker.
        let built = match (&req.user, &req.cwd) {
            (Some(_), Some(_)) => None,
            _ => self.nodes.template(&sandbox.template).and_then(|m| m.built),
        };
        let spec = ProcessSpec {
            argv: req.argv,
            cwd: req.cwd.or_else(|| built.as_ref().and_then(|b| b.workdir.clone())),
            env,
            user: Some(
                req.user
                    .or_else(|| built.map(|b| b.user))
                    .unwrap_or_else(|| "user".into()),
            ),
            timeout_ms: req.timeout.map(|t| t.as_millis() as u64),
            stdin: req.stdin,
            pty: req.pty,
            // The agent's tag is the session id: it ties a process to its session.
            tag: Some(id.clone()),
        };
        let info = agent.spawn(&spec).await.map_err(guest(sandbox))?;
        let session = SessionRecord {
            id,
            sandbox_id: sandbox.id.clone(),
            process_id: info.id,
            argv: info.argv.clone(),
            cwd: info.cwd.clone(),
            user: info.user.clone(),
            pty: info.pty,
            tag: req.tag,
            exit_code: None,
            signal: None,
            timed_out: false,
            exited: false,
            started_at_ms: info.started_at_ms as i64,
            ended_at_ms: None,
        };
        Ok(Running { session, process: info })
    }

    /// One session of a sandbox, brought up to date.
    pub async fn session(&self, sandbox: &SandboxRecord, id: &str) -> CoreResult<SessionRecord> {
        let row = self.session_record(sandbox, id).await?;
        self.refresh_session(sandbox, row).await
    }

    /// One session of a sandbox as the store has it, for a request that acts on its process
    /// (stream, stdin, signal, resize): the agent answers for the process itself, so asking it
    /// first whether the process exited would only add a round trip to every command.
    pub async fn session_record(&self, sandbox: &SandboxRecord, id: &str) -> CoreResult<SessionRecord> {
        self.store
            .get_session(&sandbox.id, id)
            .await?
            .ok_or_else(|| CoreError::not_found(Kind::Session, id))
    }

    pub async fn sessions(&self, sandbox: &SandboxRecord) -> CoreResult<Vec<SessionRecord>> {
        let mut out = Vec::new();
        for row in self.store.list_sessions(&sandbox.id).await? {
            out.push(self.refresh_session(sandbox, row).await?);
        }
        Ok(out)
    }

    /// Record an exit the agent knows of but the store does not yet.
    async fn refresh_session(&self, sandbox: &SandboxRecord, mut row: SessionRecord) -> CoreResult<SessionRecord> {
        if row.exited || sandbox.state != crate::model::SandboxState::Running {
            return Ok(row);
        }
        let Ok(agent) = self.agent_for(sandbox).await else {
            return Ok(row);
        };
        if let Ok(info) = agent.process(row.process_id).await {
            if let Some(exit) = info.exit {
                row.exited = true;
                row.exit_code = exit.exit_code;
                row.signal = exit.signal;
                row.timed_out = exit.timed_out;
                row.ended_at_ms = info.ended_at_ms.map(|v| v as i64);
                record_exit(&*self.store, &row, self.config.max_finished_sessions_per_sandbox).await?;
            }
        }
        Ok(row)
    }

    /// The running sessions with their processes (E2B's `List`).
    pub async fn running_sessions(&self, sandbox: &SandboxRecord) -> CoreResult<Vec<Running>> {
        let agent = self.agent_for(sandbox).await?;
        let mut out = Vec::new();
        for p in agent.processes().await.map_err(guest(sandbox))? {
            if p.state != ProcessState::Running {
                continue;
            }
            // Processes without a session (a template's own start process) are not listed.
            if let Some(session) = self.store.session_by_process(&sandbox.id, p.id).await? {
                out.push(Running { session, process: p });
            }
        }
        Ok(out)
    }

    /// The session of a process chosen by pid or tag; the newest wins when a pid was reused.
    pub async fn find_session(&self, sandbox: &SandboxRecord, sel: &Selector) -> CoreResult<Running> {
        let agent = self.agent_for(sandbox).await?;
        let missing = || {
            let id = match sel {
                Selector::Pid(p) => format!("pid {p}"),
                Selector::Tag(t) => format!("tag {t}"),
            };
            CoreError::not_found(Kind::Process, id)
        };
        match sel {
            Selector::Pid(pid) => {
                let mut procs: Vec<ProcessInfo> = agent
                    .processes()
                    .await
                    .map_err(guest(sandbox))?
                    .into_iter()
                    .filter(|p| p.pid == *pid)
                    .collect();
                procs.sort_by_key(|p| std::cmp::Reverse(p.id));
                // Only the newest process with that pid: an older one is a different process.
                let process = procs.into_iter().next().ok_or_else(missing)?;
                let session = self
                    .store
                    .session_by_process(&sandbox.id, process.id)
                    .await?
                    .ok_or_else(missing)?;
                Ok(Running { session, process })
            }
            Selector::Tag(tag) => {
                let session = self
                    .store
                    .list_sessions(&sandbox.id)
                    .await?
                    .into_iter()
                    .filter(|s| s.tag.as_deref() == Some(tag.as_str()) || s.id == *tag)
                    .max_by_key(|s| (s.started_at_ms, s.process_id))
                    .ok_or_else(missing)?;
                let process = agent.process(session.process_id).await.map_err(guest(sandbox))?;
                Ok(Running { session, process })
            }
        }
    }

    /// A session's events after `after` (its stdout, stderr and exit); the exit is recorded.
    /// Output the agent no longer kept is announced where it is missing ([`SessionEvent::Truncated`]).
    pub async fn session_events(
        &self,
        sandbox: &SandboxRecord,
        row: SessionRecord,
        after: u64,
    ) -> CoreResult<SessionEvents> {
        let agent = self.agent_for(sandbox).await?;
        let events = agent.events(row.process_id, after).await.map_err(guest(sandbox))?;
        Ok(self.follow_events(sandbox, events.boxed(), row, after))
    }

    /// The agent's events of a session's process as the doors stream them: its exit recorded
    /// (off the stream's path) and a gap in the sequence reported as `Truncated`.
    fn follow_events(
        &self,
        sandbox: &SandboxRecord,
        events: BoxStream<'static, Result<Event, airlock_agent_client::AgentError>>,
        row: SessionRecord,
        after: u64,
    ) -> SessionEvents {
        let store = self.store.clone();
        let keep = self.config.max_finished_sessions_per_sandbox;
        let sandbox_id = sandbox.id.clone();
        let mut row = row;
        events
            .map(move |ev| {
                let finished = match &ev {
                    Ok(Event {
                        kind: EventKind::Exit(exit),
                        ..
                    }) if !row.exited => {
                        row.exited = true;
                        row.exit_code = exit.exit_code;
                        row.signal = exit.signal;
                        row.timed_out = exit.timed_out;
                        row.ended_at_ms = Some(now_ms());
                        Some(row.clone())
                    }
                    _ => None,
                };
                if let Some(row) = finished {
                    // Off the stream's path: the exit reaches the client without waiting for
                    // the store's commits, and a lookup meanwhile learns it from the agent.
                    let store = store.clone();
                    tokio::spawn(async move {
                        let _ = record_exit(&*store, &row, keep).await;
                    });
                }
                ev.map_err(|e| CoreError::agent(Kind::Process, &sandbox_id, e))
            })
            .scan(after, |last, ev| {
                let out = match ev {
                    Ok(ev) => {
                        let mut out = Vec::with_capacity(2);
                        if ev.seq > *last + 1 {
                            out.push(Ok(SessionEvent::Truncated {
                                first: *last + 1,
                                last: ev.seq - 1,
                            }));
                        }
                        *last = (*last).max(ev.seq);
                        out.push(Ok(SessionEvent::Event(ev)));
                        out
                    }
                    Err(e) => vec![Err(e)],
                };
                futures_util::future::ready(Some(futures_util::stream::iter(out)))
            })
            .flatten()
            .boxed()
    }

    pub async fn session_stdin(
        &self,
        sandbox: &SandboxRecord,
        row: &SessionRecord,
        data: Vec<u8>,
        eof: bool,
    ) -> CoreResult<()> {
        let agent = self.agent_for(sandbox).await?;
        if !data.is_empty() {
            agent.write_stdin(row.process_id, data).await.map_err(guest(sandbox))?;
        }
        if eof {
            agent.close_stdin(row.process_id).await.map_err(guest(sandbox))?;
        }
        Ok(())
    }

    pub async fn session_signal(&self, sandbox: &SandboxRecord, row: &SessionRecord, signal: i32) -> CoreResult<()> {
        let agent = self.agent_for(sandbox).await?;
        agent.signal(row.process_id, signal).await.map_err(guest(sandbox))
    }

    pub async fn session_resize(&self, sandbox: &SandboxRecord, row: &SessionRecord, size: PtySize) -> CoreResult<()> {
        if size.cols == 0 || size.rows == 0 {
            return Err(CoreError::invalid("pty", "cols and rows must be at least 1"));
        }
        let agent = self.agent_for(sandbox).await?;
        agent.resize(row.process_id, size).await.map_err(guest(sandbox))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_signal_table() {
        assert_eq!(parse_signal("SIGTERM").unwrap(), 15);
        assert_eq!(parse_signal("kill").unwrap(), 9);
        assert_eq!(parse_signal(" 2 ").unwrap(), 2);
        assert_eq!(parse_signal("winch").unwrap(), 28);
        assert!(parse_signal("0").is_err() && parse_signal("SIGNOPE").is_err());
        assert_eq!(signal_name(9), "SIGKILL");
        assert_eq!(signal_name(40), "SIG40");
        assert_eq!(signal_description(15), "terminated");
    }
}
