//! What `GET /metrics` keeps and reads in the store (issue 28), on both stores: scrape tokens
//! (by hash, listed without it, revoked) and the sessions running in live sandboxes.

use super::*;
use airlock_server::records::ScrapeTokenRecord;

on_both!(scrape_tokens_and_running_sessions);

async fn scrape_tokens_and_running_sessions(b: Backend) {
    let store = b.store().await;
    let record = ScrapeTokenRecord {
        id: "st_1".into(),
        name: "prometheus".into(),
        created_by: "root@local".into(),
        created_at_ms: now_ms(),
    };
    store
        .insert_scrape_token(&record, &token_hash("ast_one"))
        .await
        .unwrap();
    assert_eq!(
        store.scrape_token(&token_hash("ast_one")).await.unwrap().as_deref(),
        Some("st_1")
    );
    assert!(store.scrape_token(&token_hash("ast_two")).await.unwrap().is_none());
    assert_eq!(store.scrape_tokens().await.unwrap(), vec![record]);
    assert!(store.delete_scrape_token("st_1").await.unwrap());
    assert!(!store.delete_scrape_token("st_1").await.unwrap());
    assert!(store.scrape_token(&token_hash("ast_one")).await.unwrap().is_none());

    for id in ["live", "gone"] {
        store
            .insert_create(&sandbox(id, "t1"), &create_op(id), None, 10)
            .await
            .unwrap();
    }
    for (session, sandbox, pid) in [("a", "live", 1), ("b", "live", 2), ("c", "gone", 3)] {
        store
            .insert_session(&running_session(session, sandbox, pid))
            .await
            .unwrap();
    }
    let mut done = running_session("d", "live", 4);
    store.insert_session(&done).await.unwrap();
    done.exit_code = Some(0);
    done.ended_at_ms = Some(now_ms());
    store.finish_session(&done).await.unwrap();
    store.set_sandbox_state("gone", SandboxState::Deleted).await.unwrap();
    assert_eq!(store.running_sessions().await.unwrap(), vec![("live".to_string(), 2)]);
}
