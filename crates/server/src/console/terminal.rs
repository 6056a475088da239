//! A sandbox's terminal: a login shell on a PTY in the guest, as a session of its own, joined to
//! the browser's xterm.js over a WebSocket. Binary messages are the terminal's bytes both ways;
//! a text message from the browser is a resize (`{"cols":..,"rows":..}`). The shell is killed
//! when the WebSocket closes, or at the first keystroke after its console session ended; its exit
//! closes the WebSocket.

use super::page::{Answer, Refused};
use super::{signed, Browser, ConsoleState};
use crate::core::sessions::{SessionEvent, StartSession};
use crate::records::{SandboxRecord, SessionRecord};
use airlock_proto::frame::EventKind;
use airlock_proto::PtySize;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::IntoResponse;
use futures_util::{SinkExt, StreamExt};
use serde::Deserialize;
use std::time::Duration;

/// The longest a terminal's shell lives, attached or not (the sandbox's own end comes first
/// usually).
const SHELL_TIMEOUT: Duration = Duration::from_secs(12 * 3600);
/// A browser's message: keystrokes or pastes, never more.
const MAX_MESSAGE: usize = 64 << 10;

/// The WebSocket must come from the console's own page: a cookie rides along with a
/// cross-site WebSocket too, so the origin is what tells them apart.
fn same_origin(headers: &HeaderMap) -> bool {
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let origin = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok());
    match (host, origin) {
        (Some(host), Some(origin)) => origin
            .split_once("://")
            .is_some_and(|(scheme, rest)| matches!(scheme, "http" | "https") && rest == host),
        _ => false,
    }
}

pub async fn open(
    State(state): State<ConsoleState>,
    headers: Browser,
    Path(id): Path<String>,
    ws: WebSocketUpgrade,
) -> Answer {
    let s = signed(&state, &headers, false).await?;
    if !same_origin(&headers) {
        return Err(Refused::Forbidden(
            "the terminal opens only from the console's own pages (Origin differs from Host)",
        ));
    }
    let tenant = s.tenant()?.1.clone();
    let row = state.core.sandbox(&tenant, &id).await?;
    let core = state.core.clone();
    let login = Login {
        logins: state.logins.clone(),
        cookie: headers.cookie(super::COOKIE).unwrap_or_default().to_string(),
    };
    Ok(ws
        .max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
        .on_upgrade(move |socket| run(core, row, login, socket))
        .into_response())
}

#[derive(Deserialize)]
struct Resize {
    cols: u16,
    rows: u16,
}

/// The console session a terminal belongs to: typing keeps it in use, and the terminal closes
/// once it has ended (signed out, idle, past its lifetime).
struct Login {
    logins: std::sync::Arc<super::logins::Logins>,
    cookie: String,
}

async fn run(core: crate::core::Core, sandbox: SandboxRecord, login: Login, socket: WebSocket) {
    let (mut to_browser, mut from_browser) = socket.split();
    let start = StartSession {
        argv: vec!["/bin/bash".into(), "-l".into()],
        cwd: None,
        env: [("TERM".to_string(), "xterm-256color".to_string())].into(),
        user: None,
        timeout: Some(SHELL_TIMEOUT),
        stdin: true,
        pty: Some(PtySize { cols: 80, rows: 24 }),
        tag: None,
    };
    let (session, events) = match core.start_session_events(&sandbox, start).await {
        Ok((row, Ok(events))) => (row, events),
        Ok((row, Err(e))) => {
            end_shell(&core, &sandbox, &row).await;
            let _ = to_browser
                .send(Message::Text(format!("\r\nairlock: {e}\r\n").into()))
                .await;
            return;
        }
        Err(e) => {
            let _ = to_browser
                .send(Message::Text(format!("\r\nairlock: {e}\r\n").into()))
                .await;
            return;
        }
    };
    let output = async {
        let mut events = events;
        while let Some(ev) = events.next().await {
            let msg = match ev {
                Ok(SessionEvent::Event(ev)) => match ev.kind {
                    EventKind::Stdout(d) | EventKind::Stderr(d) => Message::Binary(d),
                    EventKind::Exit(exit) => {
                        let code = exit.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into());
                        let _ = to_browser
                            .send(Message::Text(format!("\r\n[shell exited: {code}]\r\n").into()))
                            .await;
                        break;
                    }
                },
                Ok(SessionEvent::Truncated { .. }) => continue,
                Err(e) => Message::Text(format!("\r\nairlock: {e}\r\n").into()),
            };
            if to_browser.send(msg).await.is_err() {
                break;
            }
        }
        let _ = to_browser.close().await;
    };
    let input = async {
        while let Some(Ok(msg)) = from_browser.next().await {
            if login.logins.get(&login.cookie).is_none() {
                break;
            }
            let sent = match msg {
                Message::Binary(b) => core.session_stdin(&sandbox, &session, b.to_vec(), false).await,
                Message::Text(t) => match serde_json::from_str::<Resize>(&t) {
                    Ok(r) if r.cols > 0 && r.rows > 0 => {
                        core.session_resize(
                            &sandbox,
                            &session,
                            PtySize {
                                cols: r.cols,
                                rows: r.rows,
                            },
                        )
                        .await
                    }
                    _ => Ok(()),
                },
                Message::Close(_) => break,
                _ => Ok(()),
            };
            if sent.is_err() {
                break;
            }
        }
    };
    tokio::select! {
        _ = output => {}
        _ = input => {}
    }
    end_shell(&core, &sandbox, &session).await;
}

/// The shell goes with its terminal (hung up, then killed if it lingers).
async fn end_shell(core: &crate::core::Core, sandbox: &SandboxRecord, session: &SessionRecord) {
    use nix::sys::signal::Signal;
    let _ = core.session_signal(sandbox, session, Signal::SIGHUP as i32).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = core.session_signal(sandbox, session, Signal::SIGKILL as i32).await;
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_the_consoles_own_origin_opens_a_terminal() {
        let h = |origin: Option<&str>| {
            let mut h = axum::http::HeaderMap::new();
            h.insert("host", "127.0.0.1:7420".parse().unwrap());
            if let Some(o) = origin {
                h.insert("origin", o.parse().unwrap());
            }
            h
        };
        assert!(super::same_origin(&h(Some("http://127.0.0.1:7420"))));
        assert!(!super::same_origin(&h(Some("http://evil.test"))));
        assert!(!super::same_origin(&h(Some("http://127.0.0.1:7420.evil.test"))));
        assert!(!super::same_origin(&h(None)));
    }
}
