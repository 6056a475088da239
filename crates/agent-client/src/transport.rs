//! One call to the agent, bounded: request bodies watched so a deadline runs only while the
//! agent holds the call up ([`super::Deadlines`]), replies read within a size limit, error bodies
//! turned into [`super::AgentError`].

use super::*;
use airlock_proto::routes::{self, Route};
use airlock_proto::ErrorBody;
use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Frame, Incoming};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// A request body of any call: bytes from any source.
pub type ReqBody = UnsyncBoxBody<Bytes, std::io::Error>;

pub(super) fn empty() -> ReqBody {
    Full::new(Bytes::new()).map_err(|n| match n {}).boxed_unsync()
}

pub(super) fn bytes_body(b: impl Into<Bytes>) -> ReqBody {
    Full::new(b.into()).map_err(|n| match n {}).boxed_unsync()
}

/// The HTTP method of a route.
pub(super) fn method(route: &Route) -> Method {
    match route.method() {
        routes::Method::Get => Method::GET,
        routes::Method::Post => Method::POST,
        routes::Method::Put => Method::PUT,
        routes::Method::Delete => Method::DELETE,
    }
}

/// How a call's deadline runs (see [`Deadlines`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Clock {
    /// While the agent holds the call up; the reply body is read by the same deadline.
    Agent(Duration),
    /// Response headers within this long of the start, whatever the request body does (a
    /// tunnel's request body is a long-lived byte stream; the agent answers once connected).
    Headers(Duration),
}

/// A request body that tells its call when the agent is the one holding it up: since when the
/// call has been waiting on the agent (`Some`), or that it waits on the body's source (`None`).
pub(super) struct Watched {
    inner: ReqBody,
    waiting_since: Arc<watch::Sender<Option<Instant>>>,
}

impl hyper::body::Body for Watched {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        // Pending: the source is slow, not the agent. Ready: hyper asks for the next chunk only
        // when the agent's flow-control window has room, and after the end the answer is due.
        this.waiting_since.send_replace(polled.is_ready().then(Instant::now));
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        // Sent (or abandoned by hyper): whatever comes now is up to the agent.
        self.waiting_since.send_if_modified(|w| {
            let was_waiting_on_source = w.is_none();
            if was_waiting_on_source {
                *w = Some(Instant::now());
            }
            was_waiting_on_source
        });
    }
}

/// When a call that got its response headers must have read its reply.
#[derive(Debug, Clone, Copy)]
pub(super) struct Due {
    at: Instant,
    limit: Duration,
}

/// An error with its causes, as one line (hyper's own text is terse: "http2 error", "client
/// error (Connect)" where the cause is a refused certificate).
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

pub(super) fn late(what: &str, limit: Duration) -> AgentError {
    AgentError::Transport(format!("{what}: the agent did not answer within {limit:?}"))
}

/// A reply body, read whole within `due`, at most `max` bytes.
pub(super) async fn collect_limited(body: Incoming, max: usize, what: &str, due: Due) -> Result<Bytes, AgentError> {
    let collected = tokio::time::timeout_at(due.at, Limited::new(body, max).collect())
        .await
        .map_err(|_| late(what, due.limit))?;
    match collected {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(AgentError::Protocol(format!(
            "{what}: reply body exceeds the limit of {max} bytes"
        ))),
        Err(e) => Err(AgentError::Transport(format!("{what}: {}", chain(e.as_ref())))),
    }
}

impl AgentClient {
    /// The request of `route` under this client's base, with its authorization.
    fn build(&self, route: &Route, body: ReqBody) -> Request<ReqBody> {
        let mut req = Request::builder()
            .method(method(route))
            .uri(format!("{}{}", self.base, route.uri()))
            .body(body)
            .expect("valid request");
        if let Some(auth) = &self.authorization {
            req.headers_mut().insert(http::header::AUTHORIZATION, auth.clone());
        }
        if let Some(sign) = &self.sign {
            for (name, value) in sign(req.method(), req.uri()) {
                req.headers_mut().insert(name, value);
            }
        }
        req
    }

    /// Pass one call of the agent's protocol through unchanged: whatever the agent answers
    /// (an error body too) comes back as it is, for a caller on another host that reads it with
    /// its own bounds. Only the response headers have a deadline here (`slow_call`: a `sync`
    /// answers once the guest's disk has its data); the body streams as the caller reads it.
    pub async fn forward(&self, route: &Route, body: ReqBody) -> Result<hyper::Response<Incoming>, AgentError> {
        let what = format!("{} {}", route.method(), route.uri());
        let limit = self.deadlines.slow_call;
        let req = self.build(route, body);
        let mut send = self.send.clone();
        let exchange = async move {
            send.ready().await?;
            send.send_request(req).await
        };
        let start = Instant::now();
        let resp = tokio::time::timeout(limit, exchange)
            .await
            .map_err(|_| late(&what, limit))
            .and_then(|r| r.map_err(|e| AgentError::Transport(format!("{what}: {}", chain(&e)))));
        let outcome = match &resp {
            Ok(r) if r.status().is_success() => crate::CallOutcome::Ok,
            Ok(_) => crate::CallOutcome::Refused,
            Err(_) => crate::CallOutcome::Failed,
        };
        crate::observed(route.name(), start.elapsed(), outcome);
        resp
    }

    /// Send a request; the response once its headers are in, and when its body is due.
    pub(super) async fn request(
        &self,
        route: &Route,
        body: ReqBody,
        clock: Clock,
    ) -> Result<(hyper::Response<Incoming>, Due), AgentError> {
        let start = Instant::now();
        let answer = self.exchange(route, body, clock).await;
        let outcome = match &answer {
            Ok(_) => crate::CallOutcome::Ok,
            Err(AgentError::Api { .. }) => crate::CallOutcome::Refused,
            Err(_) => crate::CallOutcome::Failed,
        };
        crate::observed(route.name(), start.elapsed(), outcome);
        answer
    }

    async fn exchange(
        &self,
        route: &Route,
        body: ReqBody,
        clock: Clock,
    ) -> Result<(hyper::Response<Incoming>, Due), AgentError> {
        let uri = route.uri();
        let what = format!("{} {uri}", route.method());
        let start = Instant::now();
        let (limit, waiting_since, body) = match clock {
            Clock::Agent(limit) => {
                let waiting_since = Arc::new(watch::Sender::new(Some(start)));
                let body = Watched {
                    inner: body,
                    waiting_since: waiting_since.clone(),
                };
                (limit, Some(waiting_since), BodyExt::boxed_unsync(body))
            }
            Clock::Headers(limit) => (limit, None, body),
        };
        let req = self.build(route, body);
        let mut send = self.send.clone();
        let exchange = async move {
            send.ready().await?;
            send.send_request(req).await
        };
        let resp = match waiting_since {
            None => tokio::time::timeout_at(start + limit, exchange)
                .await
                .map_err(|_| late(&what, limit))?
                .map(|r| (r, start + limit)),
            Some(waiting_since) => {
                let mut rx = waiting_since.subscribe();
                let mut exchange = std::pin::pin!(exchange);
                loop {
                    let since = *rx.borrow_and_update();
                    let expired = async {
                        match since {
                            Some(t) => tokio::time::sleep_until(t + limit).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        r = &mut exchange => break r.map(|r| (r, since.unwrap_or_else(Instant::now) + limit)),
                        _ = rx.changed() => {} // `waiting_since` lives here too: never closed
                        _ = expired => return Err(late(&what, limit)),
                    }
                }
            }
        };
        let (resp, at) = resp.map_err(|e| AgentError::Transport(format!("{what}: {}", chain(&e))))?;
        let due = Due { at, limit };
        if resp.status().is_success() {
            return Ok((resp, due));
        }
        let status = resp.status();
        let body = collect_limited(resp.into_body(), ERROR_BODY_MAX, &what, due).await?;
        Err(match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(e) => AgentError::Api {
                status: status.as_u16(),
                code: e.code,
                message: e.message,
            },
            Err(_) => AgentError::Protocol(format!("{status}: {}", String::from_utf8_lossy(&body))),
        })
    }

    /// A call whose answer is only its status (the body, `{}`, is read and dropped).
    pub(super) async fn call(&self, route: Route, body: ReqBody) -> Result<(), AgentError> {
        let what = format!("{} {}", route.method(), route.uri());
        let (resp, due) = self.request(&route, body, Clock::Agent(self.deadlines.call)).await?;
        collect_limited(resp.into_body(), RECORD_MAX, &what, due)
            .await
            .map(drop)
    }

    /// The response headers of a stream (events, file reads): the body is the caller's.
    pub(super) async fn open_stream(&self, route: Route, limit: Duration) -> Result<Incoming, AgentError> {
        let (resp, _) = self.request(&route, empty(), Clock::Agent(limit)).await?;
        Ok(resp.into_body())
    }

    pub(super) async fn call_json<T: serde::de::DeserializeOwned>(
        &self,
        route: Route,
        body: ReqBody,
        max: usize,
        limit: Duration,
    ) -> Result<T, AgentError> {
        let what = format!("{} {}", route.method(), route.uri());
        let (resp, due) = self.request(&route, body, Clock::Agent(limit)).await?;
        let bytes = collect_limited(resp.into_body(), max, &what, due).await?;
        serde_json::from_slice(&bytes).map_err(|e| AgentError::Protocol(format!("{what}: {e}")))
    }

    /// A call answered by one record.
    pub(super) async fn call_record<T: serde::de::DeserializeOwned>(
        &self,
        route: Route,
        body: ReqBody,
    ) -> Result<T, AgentError> {
        self.call_json(route, body, RECORD_MAX, self.deadlines.call).await
    }

    pub(super) fn json_body<T: serde::Serialize>(v: &T) -> ReqBody {
        bytes_body(serde_json::to_vec(v).expect("serializable"))
    }
}
