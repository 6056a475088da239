//! A session's page in the console: its output replayed from the start, then live (an event
//! stream the page's script reads), as plain text.

use super::page::{self, Answer};
use super::sandboxes::tenant_of;
use super::{signed, Browser, ConsoleState};
use axum::extract::{Path, State};
use axum::response::IntoResponse;
use maud::html;

/// A session's page: its output as it comes (the page's script reads `output`, an event stream).
pub async fn session_page(
    State(state): State<ConsoleState>,
    headers: Browser,
    Path((id, sid)): Path<(String, String)>,
) -> Answer {
    let s = signed(&state, &headers, true).await?;
    let (_, tenant) = tenant_of(&s)?;
    let row = state.core.sandbox(&tenant, &id).await?;
    let session = state.core.session_record(&row, &sid).await?;
    let body = html! {
        h1 { "Session " code { (session.id) } }
        p { "In " a href={ "/console/sandboxes/" (row.id) } { (row.id) } ": " code { (session.argv.join(" ")) } }
        pre.output #output data-stream={ "/console/sandboxes/" (row.id) "/sessions/" (session.id) "/output" } {}
        p #exit {}
    };
    Ok(page::layout(&format!("Session {sid}"), Some(&s), body).into_response())
}

/// A session's output from its start, then live: `out` events (text) and one `exit`.
pub async fn session_output(
    State(state): State<ConsoleState>,
    headers: Browser,
    Path((id, sid)): Path<(String, String)>,
) -> Answer {
    use crate::core::sessions::SessionEvent;
    use airlock_proto::frame::EventKind;
    use axum::response::sse::{Event, KeepAlive, Sse};
    use futures_util::StreamExt;
    let s = signed(&state, &headers, false).await?;
    let (_, tenant) = tenant_of(&s)?;
    let row = state.core.sandbox(&tenant, &id).await?;
    let session = state.core.session_record(&row, &sid).await?;
    let events = state.core.session_events(&row, session, 0).await?;
    let stream = events.map(|ev| {
        let event = match ev {
            Ok(SessionEvent::Event(ev)) => match ev.kind {
                EventKind::Stdout(d) | EventKind::Stderr(d) => Event::default()
                    .event("out")
                    .data(plain_text(&String::from_utf8_lossy(&d))),
                EventKind::Exit(exit) => Event::default().event("exit").data(
                    exit.exit_code
                        .map(|c| format!("exited with {c}"))
                        .unwrap_or_else(|| "ended by a signal".into()),
                ),
            },
            Ok(SessionEvent::Truncated { first, last }) => Event::default()
                .event("out")
                .data(format!("[output {first} to {last} is no longer kept]\n")),
            Err(e) => Event::default().event("exit").data(e.to_string()),
        };
        Ok::<_, std::convert::Infallible>(event)
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(std::time::Duration::from_secs(15)))
        .into_response())
}

/// A terminal's output as plain text: escape sequences (colours, titles, modes) and carriage
/// returns left out. A sequence split across two chunks may show in part.
fn plain_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => match chars.next() {
                // CSI: parameters, then one final byte in @..~.
                Some('[') => {
                    for c in chars.by_ref() {
                        if ('@'..='~').contains(&c) {
                            break;
                        }
                    }
                }
                // OSC: up to BEL or ST (ESC \\).
                Some(']') => {
                    while let Some(c) = chars.next() {
                        if c == '\u{7}' || (c == '\u{1b}' && chars.next_if_eq(&'\\').is_some()) {
                            break;
                        }
                    }
                }
                _ => {}
            },
            '\r' => {}
            c if c.is_control() && c != '\n' && c != '\t' => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn terminal_output_as_plain_text() {
        let raw = "\u{1b}[?2004h\u{1b}]0;user@x: ~\u{7}\u{1b}[01;32muser@x\u{1b}[00m:~$ ls\r\n\u{1b}[?2004l42\r\n";
        assert_eq!(super::plain_text(raw), "user@x:~$ ls\n42\n");
        assert_eq!(super::plain_text("a\u{1b}]2;t\u{1b}\\b\tc"), "ab\tc");
    }
}
