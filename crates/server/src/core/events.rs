//! A tenant's lifecycle events (recorded by the engine, `engine/events.rs`), read by the doors:
//! pages newest first, or a stream from a cursor that follows new ones as they are recorded
//! (woken by this process's events at once, and looking every second for other replicas').
//! Kept [`RETENTION`]; a foreign sandbox's events answer like a missing sandbox's.

use super::sandboxes::acting_tenant;
use super::{Core, Principal};
use crate::error::{CoreError, CoreResult};
use crate::model::{Event, EventKind};
use crate::records::{now_ms, rfc3339, EventRecord};
use crate::store::EventFilter;
use futures_util::Stream;
use std::time::Duration;

/// How long events are kept.
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Most events in a page.
pub const MAX_PAGE: u32 = 1000;
/// How often a stream looks for events other replicas recorded.
const POLL: Duration = Duration::from_secs(1);

/// The wire view of an event (both doors' shapes start from it).
pub fn event_view(e: EventRecord) -> Event {
    Event {
        id: e.id,
        seq: e.seq,
        kind: e.kind,
        sandbox_id: e.sandbox_id,
        at: rfc3339(e.at_ms),
        data: e.data,
    }
}

/// Event kinds named by a caller (a webhook's `events`, a filter): each must be one.
pub fn parse_kinds(names: &[String]) -> CoreResult<Vec<String>> {
    names
        .iter()
        .map(|n| {
            EventKind::parse(n.trim())
                .map(|k| k.as_str().to_string())
                .ok_or_else(|| {
                    let known: Vec<&str> = EventKind::ALL.iter().map(|k| k.as_str()).collect();
                    CoreError::invalid(
                        "events",
                        format!("unknown event type {n:?}; one of {}", known.join(", ")),
                    )
                })
        })
        .collect()
}

impl Core {
    /// The filter of `principal`'s tenant, of one of its sandboxes if `sandbox_id` is set.
    async fn event_filter(&self, principal: &Principal, sandbox_id: Option<&str>) -> CoreResult<EventFilter> {
        let tenant = acting_tenant(principal)?;
        let sandbox_id = match sandbox_id {
            // A sandbox that exists no more still has its events; a foreign one none.
            Some(id) => {
                let known = self.store.get_sandbox(&tenant.id, id).await?.is_some();
                if !known {
                    return Err(CoreError::not_found(crate::error::Kind::Sandbox, id));
                }
                Some(id.to_string())
            }
            None => None,
        };
        Ok(EventFilter {
            tenant_id: tenant.id.clone(),
            sandbox_id,
            ..Default::default()
        })
    }

    /// A page of events, newest first, before `before` (a `seq`) if set.
    pub async fn events(
        &self,
        principal: &Principal,
        sandbox_id: Option<&str>,
        before: Option<i64>,
        limit: Option<u32>,
    ) -> CoreResult<(Vec<EventRecord>, Option<i64>)> {
        let limit = limit.unwrap_or(100);
        if !(1..=MAX_PAGE).contains(&limit) {
            return Err(CoreError::invalid("limit", format!("must be between 1 and {MAX_PAGE}")));
        }
        let filter = EventFilter {
            before_seq: before,
            limit,
            ..self.event_filter(principal, sandbox_id).await?
        };
        let events = self.store.events(&filter).await?;
        let next = (events.len() == limit as usize)
            .then(|| events.last().map(|e| e.seq))
            .flatten();
        Ok((events, next))
    }

    /// A page of events by offset (E2B's paging): only `kinds` (all if empty), oldest first if
    /// `ascending`, else newest first.
    pub async fn events_by_offset(
        &self,
        principal: &Principal,
        sandbox_id: Option<&str>,
        kinds: Vec<String>,
        offset: u32,
        limit: u32,
        ascending: bool,
    ) -> CoreResult<Vec<EventRecord>> {
        if !(1..=MAX_PAGE).contains(&limit) {
            return Err(CoreError::invalid("limit", format!("must be between 1 and {MAX_PAGE}")));
        }
        let filter = EventFilter {
            limit,
            kinds,
            offset,
            ascending,
            ..self.event_filter(principal, sandbox_id).await?
        };
        Ok(self.store.events(&filter).await?)
    }

    /// Events after `after` (a `seq`; 0: from the oldest kept), oldest first, then each new one
    /// as it is recorded, for as long as the caller reads. A store error ends the stream with it.
    pub async fn event_stream(
        &self,
        principal: &Principal,
        sandbox_id: Option<&str>,
        after: i64,
    ) -> CoreResult<impl Stream<Item = CoreResult<EventRecord>> + Send + 'static> {
        let filter = self.event_filter(principal, sandbox_id).await?;
        let store = self.store.clone();
        let recorded = self.engine.events_recorded();
        Ok(async_stream_events(store, filter, after, move || {
            let mut recorded = recorded.clone();
            async move {
                let _ = tokio::time::timeout(POLL, recorded.changed()).await;
            }
        }))
    }

    /// Remove events past [`RETENTION`]; how many went.
    pub async fn prune_events(&self) -> CoreResult<u64> {
        Ok(self.store.prune_events(now_ms() - RETENTION.as_millis() as i64).await?)
    }
}

/// The stream of [`Core::event_stream`]: pages after the cursor, waiting with `wait` between.
fn async_stream_events<W, F>(
    store: std::sync::Arc<dyn crate::store::Store>,
    filter: EventFilter,
    after: i64,
    wait: W,
) -> impl Stream<Item = CoreResult<EventRecord>> + Send + 'static
where
    W: Fn() -> F + Send + 'static,
    F: std::future::Future<Output = ()> + Send,
{
    let state = (store, filter, after, std::collections::VecDeque::new(), wait, false);
    futures_util::stream::unfold(state, |(store, filter, mut after, mut queue, wait, ended)| async move {
        if ended {
            return None;
        }
        loop {
            if let Some(e) = queue.pop_front() {
                let e: EventRecord = e;
                after = e.seq;
                return Some((Ok(e), (store, filter, after, queue, wait, false)));
            }
            let page = EventFilter {
                after_seq: Some(after),
                limit: 100,
                ..filter.clone()
            };
            match store.events(&page).await {
                Ok(events) if !events.is_empty() => queue.extend(events),
                Ok(_) => wait().await,
                Err(e) => return Some((Err(e.into()), (store, filter, after, queue, wait, true))),
            }
        }
    })
}
