//! Lifecycle events: each change the engine carries out (and each the reaper sees) is recorded
//! as an event of its sandbox's tenant, after the change is. Recording is one insert and never
//! fails the change (an error is logged); webhooks deliver them later, off this path
//! (`core/webhooks.rs`).

use super::*;
use crate::model::EventKind;
use crate::records::EventRecord;

impl Engine {
    /// Record that `kind` happened to sandbox `id`, with `data` (an object) beside its template.
    pub(crate) async fn record_event(&self, id: &str, kind: EventKind, data: serde_json::Value) {
        let row = match self.store.sandbox_by_id(id).await {
            Ok(Some(row)) => row,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(sandbox = %id, "cannot record event {}: {e}", kind.as_str());
                return;
            }
        };
        let mut data = match data {
            serde_json::Value::Object(m) => m,
            _ => Default::default(),
        };
        data.insert("template".into(), row.template.clone().into());
        data.insert("state".into(), row.state.as_str().into());
        if kind == EventKind::Created {
            if let Some(start) = &row.start {
                data.insert("start".into(), serde_json::to_value(start).unwrap_or_default());
            }
        }
        let event = EventRecord {
            seq: 0,
            id: format!("ev_{}", airlock_runtime::datadir::random_hex(10)),
            tenant_id: row.tenant_id,
            sandbox_id: id.to_string(),
            kind: kind.as_str().to_string(),
            at_ms: now_ms(),
            data: serde_json::Value::Object(data),
        };
        match self.store.insert_event(&event).await {
            Ok(seq) => {
                self.events.send_replace(seq);
            }
            Err(e) => tracing::warn!(sandbox = %id, "cannot record event {}: {e}", kind.as_str()),
        }
    }

    /// The `seq` of the newest event this process recorded, as it changes (readers of the
    /// events, here and on other replicas, also look on their own every second).
    pub fn events_recorded(&self) -> tokio::sync::watch::Receiver<i64> {
        self.events.subscribe()
    }

    /// The event an operation's end makes, if any.
    pub(super) async fn record_end(&self, op: &Operation, error: Option<&ErrorBody>) {
        let kind = match (op.kind, error) {
            (OperationKind::Create, None) => EventKind::Created,
            (OperationKind::Create, Some(_)) => EventKind::Failed,
            (OperationKind::Delete, None) => EventKind::Killed,
            (OperationKind::Pause, None) => EventKind::Paused,
            (OperationKind::Suspend, None) => EventKind::Suspended,
            (OperationKind::Resume, None) => EventKind::Resumed,
            (OperationKind::Snapshot, None) => EventKind::Snapshotted,
            // A change that failed leaves the sandbox as it was.
            (_, Some(_)) => return,
        };
        let mut data = serde_json::json!({ "operation": op.id });
        if let Some(e) = error {
            data["error"] = serde_json::json!({ "code": e.code, "message": e.message });
        }
        self.record_event(&op.sandbox_id, kind, data).await;
    }
}
