//! Events and webhooks through the store (issue 28), on both stores: events paged both ways per
//! tenant and sandbox, the newest seq, pruning by age; webhooks per tenant, their progress and
//! delivery attempts, gone with their tenant.

use super::*;
use airlock_server::records::{DeliveryRecord, EventRecord, WebhookRecord};
use airlock_server::store::EventFilter;

fn event(id: &str, tenant: &str, sandbox: &str, kind: &str, at_ms: i64) -> EventRecord {
    EventRecord {
        seq: 0,
        id: id.into(),
        tenant_id: tenant.into(),
        sandbox_id: sandbox.into(),
        kind: kind.into(),
        at_ms,
        data: serde_json::json!({"template": "seed"}),
    }
}

on_both!(events_pages_and_webhooks);

async fn events_pages_and_webhooks(b: Backend) {
    let store = b.store().await;
    assert_eq!(store.last_event_seq().await.unwrap(), 0);
    let old = now_ms() - 8 * 24 * 3600 * 1000;
    let mut seqs = Vec::new();
    for (id, tenant, sandbox, kind, at) in [
        ("ev_0", "t1", "a", "sandbox.created", old),
        ("ev_1", "t1", "a", "sandbox.paused", now_ms()),
        ("ev_2", "t2", "x", "sandbox.created", now_ms()),
        ("ev_3", "t1", "b", "sandbox.created", now_ms()),
        ("ev_4", "t1", "a", "sandbox.killed", now_ms()),
    ] {
        seqs.push(store.insert_event(&event(id, tenant, sandbox, kind, at)).await.unwrap());
    }
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    assert_eq!(store.last_event_seq().await.unwrap(), seqs[4]);
    let ids = |v: Vec<EventRecord>| v.into_iter().map(|e| e.id).collect::<Vec<_>>();
    let t1 = EventFilter {
        tenant_id: "t1".into(),
        limit: 10,
        ..Default::default()
    };
    assert_eq!(ids(store.events(&t1).await.unwrap()), ["ev_4", "ev_3", "ev_1", "ev_0"]);
    let page = EventFilter {
        before_seq: Some(seqs[3]),
        limit: 1,
        ..t1.clone()
    };
    assert_eq!(ids(store.events(&page).await.unwrap()), ["ev_1"]);
    let after = EventFilter {
        after_seq: Some(seqs[0]),
        sandbox_id: Some("a".into()),
        ..t1.clone()
    };
    let got = store.events(&after).await.unwrap();
    assert_eq!(got[0].data["template"], "seed");
    assert_eq!(ids(got), ["ev_1", "ev_4"]);
    assert_eq!(store.prune_events(now_ms() - 7 * 24 * 3600 * 1000).await.unwrap(), 1);
    assert_eq!(ids(store.events(&t1).await.unwrap()), ["ev_4", "ev_3", "ev_1"]);

    let mut hook = WebhookRecord {
        id: "wh_1".into(),
        tenant_id: "t1".into(),
        name: "r".into(),
        url: "http://203.0.113.9/".into(),
        kinds: vec!["sandbox.created".into()],
        enabled: true,
        created_at_ms: now_ms(),
        cursor_seq: seqs[1],
        attempts: 0,
        next_at_ms: 0,
        last_status: None,
        last_error: None,
        last_attempt_at_ms: None,
    };
    store.insert_webhook(&hook).await.unwrap();
    assert_eq!(store.webhook("t1", "wh_1").await.unwrap().as_ref(), Some(&hook));
    assert!(
        store.webhook("t2", "wh_1").await.unwrap().is_none(),
        "another tenant's is missing"
    );
    hook.attempts = 2;
    hook.next_at_ms = 42;
    hook.last_status = Some(500);
    hook.last_error = Some("the receiver answered 500".into());
    hook.last_attempt_at_ms = Some(now_ms());
    store.set_webhook_progress(&hook).await.unwrap();
    hook.enabled = false;
    assert!(store.update_webhook(&hook).await.unwrap());
    assert_eq!(store.webhooks("t1").await.unwrap(), vec![hook.clone()]);
    assert!(store.enabled_webhooks().await.unwrap().is_empty());
    for attempt in 1..=2 {
        store
            .insert_delivery(&DeliveryRecord {
                webhook_id: "wh_1".into(),
                event_id: "ev_3".into(),
                attempt,
                at_ms: now_ms() + i64::from(attempt),
                status: Some(500),
                error: Some("no".into()),
                duration_ms: 3,
            })
            .await
            .unwrap();
    }
    let d = store.deliveries("wh_1", 10).await.unwrap();
    assert_eq!(d.iter().map(|d| d.attempt).collect::<Vec<_>>(), [2, 1]);
    store.delete_tenant_webhooks("t1").await.unwrap();
    assert!(store.webhooks("t1").await.unwrap().is_empty());
    assert!(store.deliveries("wh_1", 10).await.unwrap().is_empty());
    assert!(!store.delete_webhook("t1", "wh_1").await.unwrap());
}
