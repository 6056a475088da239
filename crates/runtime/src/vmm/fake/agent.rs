//! The fake agents' registry (keyed by socket path, on a runtime of their own), the session
//! start (HELLO/READY), HTTP/2 serving, and the hostile modes.

use super::guest::Guest;
use super::reply::Body;
use super::routes::route;
use super::*;
use crate::vmm::wait_exit;
use airlock_proto::Route;
use bytes::{Bytes, BytesMut};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

pub(super) struct Registered {
    pub(super) guest: Arc<Guest>,
    pub(super) server: tokio::task::AbortHandle,
}

pub(super) static GUESTS: LazyLock<Mutex<HashMap<PathBuf, Registered>>> = LazyLock::new(Default::default);

/// Where the fake agents and their VM watchers run: not on the caller's tokio runtime, which a
/// test may shut down to simulate a restart.
pub(super) static AGENT_RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("airlock-fake-agent")
        .enable_all()
        .build()
        .expect("the fake agent runtime starts")
});

/// The fake guest whose agent serves `socket`, if this process runs one.
pub(super) fn registered(socket: &Path) -> Option<Arc<Guest>> {
    GUESTS.lock().unwrap().get(socket).map(|r| r.guest.clone())
}

/// Serve `guest` on `listener` until its VM process exits.
pub(super) fn register(socket: PathBuf, guest: Arc<Guest>, listener: std::os::unix::net::UnixListener) {
    let server = AGENT_RUNTIME.spawn(serve(guest.clone(), listener)).abort_handle();
    let pid = guest.pid;
    let old = GUESTS.lock().unwrap().insert(
        socket.clone(),
        Registered {
            guest: guest.clone(),
            server,
        },
    );
    if let Some(old) = old {
        old.server.abort();
    }
    AGENT_RUNTIME.spawn(async move {
        while !wait_exit(pid, Duration::from_secs(3600)).await {}
        let mut guests = GUESTS.lock().unwrap();
        if guests.get(&socket).is_some_and(|r| Arc::ptr_eq(&r.guest, &guest)) {
            if let Some(r) = guests.remove(&socket) {
                r.server.abort();
            }
        }
    });
}

pub(super) async fn serve(guest: Arc<Guest>, listener: std::os::unix::net::UnixListener) {
    let listener = match UnixListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!("fake agent listener: {e}");
            return;
        }
    };
    // Connections live in the set: aborting this task (the VM died) ends them all.
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    conns.spawn(serve_connection(guest.clone(), stream));
                }
                Err(e) => {
                    tracing::debug!("fake agent accept: {e}");
                    return;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

pub(super) async fn serve_connection(guest: Arc<Guest>, mut stream: UnixStream) {
    if handshake(&mut stream, guest.paused.subscribe()).await.is_err() {
        return;
    }
    if guest.hostile() == Some(Hostile::Garbage) {
        return garbage(stream).await;
    }
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let guest = guest.clone();
        async move {
            if let Some(mode) = guest.hostile() {
                let route = Route::parse(req.method().as_str(), req.uri().path(), req.uri().query()).ok();
                if let Some(resp) = hostile_reply(mode, route).await {
                    return Ok(resp);
                }
            }
            guest.wait_running().await;
            Ok::<_, std::convert::Infallible>(route(guest, req).await.unwrap_or_else(|e| e.response()))
        }
    });
    let conn = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
    if let Err(e) = conn.await {
        tracing::debug!("fake agent session ended: {e}");
    }
}

/// 64 KiB of what a hostile agent sends: not JSON, no newline.
pub(super) static JUNK: [u8; 64 << 10] = [b'x'; 64 << 10];

/// Up to 100 MiB of junk where HTTP/2 should be, then read until the host hangs up.
pub(super) async fn garbage(mut stream: UnixStream) {
    for _ in 0..1600 {
        if stream.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.is_err() || stream.write_all(&JUNK).await.is_err() {
            return;
        }
    }
    let mut sink = [0u8; 4096];
    while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
}

/// A body of `JUNK` chunks: `total` bytes, or without end.
pub(super) fn junk_body(total: Option<usize>, prefix: Bytes) -> Body {
    use futures_util::StreamExt;
    let chunks = futures_util::stream::repeat_with(|| Ok(Frame::data(Bytes::from_static(&JUNK))))
        .take(total.map_or(usize::MAX, |t| t.div_ceil(JUNK.len())));
    let stream = futures_util::stream::iter([Ok(Frame::data(prefix))]).chain(chunks);
    BodyExt::boxed_unsync(StreamBody::new(stream))
}

/// What a hostile agent answers to `req`; `None`: the call is served as usual.
pub(super) async fn hostile_reply(mode: Hostile, route: Option<Route>) -> Option<Response<Body>> {
    const HUGE: usize = 100 << 20;
    let stream = |body| {
        Response::builder()
            .status(StatusCode::OK)
            .body(body)
            .expect("valid response")
    };
    match mode {
        Hostile::EndlessBody { status } => Some(
            Response::builder()
                .status(StatusCode::from_u16(status).unwrap_or(StatusCode::OK))
                .header("content-type", "application/json")
                .body(junk_body(None, Bytes::from_static(b"[")))
                .expect("valid response"),
        ),
        Hostile::HugeLine => match route? {
            Route::Watch { .. } => Some(stream(junk_body(Some(HUGE), Bytes::new()))),
            Route::Events { .. } => {
                let mut header = BytesMut::new();
                header.extend_from_slice(&[1u8]); // stdout
                header.extend_from_slice(&1u64.to_be_bytes());
                header.extend_from_slice(&(HUGE as u32).to_be_bytes());
                Some(stream(junk_body(Some(HUGE), header.freeze())))
            }
            _ => None,
        },
        Hostile::Silent => std::future::pending().await,
        Hostile::Garbage => None,
    }
}

/// The agent's side of the session start: answer the latest `HELLO <nonce>` with
/// `READY <nonce>`, discarding anything before it; a paused VM answers once it resumes.
pub(super) async fn handshake(stream: &mut UnixStream, mut paused: watch::Receiver<bool>) -> std::io::Result<()> {
    let mut line = Vec::with_capacity(64);
    let mut nonce: Option<String> = None;
    loop {
        if let Some(n) = &nonce {
            if !*paused.borrow_and_update() {
                let ready = format!("{}{n}\n", airlock_proto::SESSION_READY);
                return stream.write_all(ready.as_bytes()).await;
            }
        }
        let mut b = [0u8; 1];
        tokio::select! {
            n = stream.read(&mut b) => {
                if n? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                if b[0] != b'\n' {
                    line.push(b[0]);
                    if line.len() > airlock_proto::SESSION_LINE_MAX {
                        line.clear();
                    }
                    continue;
                }
                let text = String::from_utf8_lossy(&line).to_string();
                line.clear();
                if let Some(pos) = text.find(airlock_proto::SESSION_HELLO) {
                    let n = &text[pos + airlock_proto::SESSION_HELLO.len()..];
                    if !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric()) {
                        nonce = Some(n.to_string());
                    }
                }
            }
            changed = paused.changed(), if nonce.is_some() => {
                if changed.is_err() {
                    return Err(std::io::ErrorKind::BrokenPipe.into());
                }
            }
        }
    }
}
