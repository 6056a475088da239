//! E2B's lifecycle events API: `GET /events/sandboxes` (the team's) and
//! `GET /events/sandboxes/{id}` (one sandbox's), in E2B's shape and names, over the core's
//! events. Query: `offset` (0..), `limit` (1..=100, default 10), `orderAsc` (default newest
//! first), `types` (repeatable). Only changes E2B has a name for are shown: airlock's pause and
//! suspend are both E2B's `paused`, a snapshot is `checkpointed`; forks, failures and timeouts
//! (the kill or pause a timeout does is shown) are airlock's own.

use super::*;
use crate::records::EventRecord;
use serde::Serialize;

/// E2B's event types and the airlock kinds each shows.
const TYPES: &[(&str, &[&str])] = &[
    ("sandbox.lifecycle.created", &["sandbox.created"]),
    ("sandbox.lifecycle.updated", &["sandbox.updated"]),
    ("sandbox.lifecycle.paused", &["sandbox.paused", "sandbox.suspended"]),
    ("sandbox.lifecycle.resumed", &["sandbox.resumed"]),
    ("sandbox.lifecycle.checkpointed", &["sandbox.snapshotted"]),
    ("sandbox.lifecycle.killed", &["sandbox.killed"]),
];

fn e2b_type(kind: &str) -> Option<&'static str> {
    TYPES.iter().find(|(_, kinds)| kinds.contains(&kind)).map(|(t, _)| *t)
}

/// An event as E2B's API shows it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxEvent {
    version: &'static str,
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    event_data: Option<Value>,
    sandbox_build_id: String,
    sandbox_execution_id: String,
    sandbox_id: String,
    sandbox_team_id: String,
    sandbox_template_id: String,
    timestamp: String,
}

fn view(e: EventRecord) -> Option<SandboxEvent> {
    let kind = e2b_type(&e.kind)?;
    let template = e
        .data
        .get("template")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let data = match &e.data {
        Value::Object(m) if m.is_empty() => None,
        Value::Null => None,
        d => Some(d.clone()),
    };
    Some(SandboxEvent {
        version: "v1",
        id: e.id,
        kind,
        event_data: data,
        sandbox_build_id: String::new(),
        sandbox_execution_id: e.sandbox_id.clone(),
        sandbox_id: e.sandbox_id,
        sandbox_team_id: e.tenant_id,
        sandbox_template_id: template,
        timestamp: rfc3339(e.at_ms),
    })
}

/// The query, read by hand: `types` repeats, which serde's urlencoded form cannot hold.
struct EventsQuery {
    offset: u32,
    limit: u32,
    ascending: bool,
    kinds: Vec<String>,
}

fn parse_query(raw: Option<&str>) -> Result<EventsQuery> {
    let mut q = EventsQuery {
        offset: 0,
        limit: 10,
        ascending: false,
        kinds: vec![],
    };
    let mut types = vec![];
    for (k, v) in url::form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        let number = |max: u32| {
            v.parse::<u32>()
                .ok()
                .filter(|n| *n <= max)
                .ok_or_else(|| E2bError::bad_request(format!("{k}: {v:?} is not a number between 0 and {max}")))
        };
        match k.as_ref() {
            "offset" => q.offset = number(u32::MAX)?,
            "limit" => q.limit = number(100)?.max(1),
            "orderAsc" => {
                q.ascending = match v.as_ref() {
                    "true" => true,
                    "false" => false,
                    _ => return Err(E2bError::bad_request(format!("orderAsc: {v:?} is not true or false"))),
                }
            }
            "types" => types.push(v.into_owned()),
            _ => {}
        }
    }
    for t in &types {
        let Some((_, kinds)) = TYPES.iter().find(|(name, _)| name == t) else {
            let known: Vec<&str> = TYPES.iter().map(|(n, _)| *n).collect();
            return Err(E2bError::bad_request(format!(
                "types: unknown event type {t:?}; one of {}",
                known.join(", ")
            )));
        };
        q.kinds.extend(kinds.iter().map(|k| k.to_string()));
    }
    if types.is_empty() {
        q.kinds = TYPES
            .iter()
            .flat_map(|(_, kinds)| kinds.iter().map(|k| k.to_string()))
            .collect();
    }
    Ok(q)
}

async fn page(
    state: &E2bState,
    principal: &Principal,
    sandbox: Option<&str>,
    raw: Option<&str>,
) -> Result<Json<Vec<SandboxEvent>>> {
    let q = parse_query(raw)?;
    let events = state
        .core
        .events_by_offset(principal, sandbox, q.kinds, q.offset, q.limit, q.ascending)
        .await?;
    Ok(Json(events.into_iter().filter_map(view).collect()))
}

/// `GET /events/sandboxes`: the team's newest events.
pub async fn team_events(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    uri: axum::http::Uri,
) -> Result<Json<Vec<SandboxEvent>>> {
    page(&state, &principal, None, uri.query()).await
}

/// `GET /events/sandboxes/{id}`: one sandbox's (also after it ended, for the 7 days kept).
pub async fn sandbox_events(
    State(state): State<E2bState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    uri: axum::http::Uri,
) -> Result<Json<Vec<SandboxEvent>>> {
    page(&state, &principal, Some(&id), uri.query()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_and_names_are_e2bs() {
        let q = parse_query(Some("limit=3&offset=2&orderAsc=true&types=sandbox.lifecycle.paused")).unwrap();
        assert_eq!((q.limit, q.offset, q.ascending), (3, 2, true));
        assert_eq!(q.kinds, ["sandbox.paused", "sandbox.suspended"]);
        let q = parse_query(None).unwrap();
        assert_eq!((q.limit, q.offset, q.ascending), (10, 0, false));
        assert!(q.kinds.contains(&"sandbox.killed".to_string()) && !q.kinds.contains(&"sandbox.failed".to_string()));
        for bad in [
            "limit=101",
            "offset=-1",
            "orderAsc=yes",
            "types=sandbox.lifecycle.exploded",
        ] {
            assert!(parse_query(Some(bad)).is_err(), "{bad}");
        }
        assert_eq!(e2b_type("sandbox.snapshotted"), Some("sandbox.lifecycle.checkpointed"));
        assert_eq!(e2b_type("sandbox.forked"), None);
    }
}
