//! Template builds through the store, on both stores: a build's record and log, the tag a create
//! resolves (the newest ready assignment), the cache's key, stalled builds, deletion.

use super::*;
use airlock_server::records::{BuildLogEntry, BuildRecord, BuildStatus};

fn build(id: &str, tenant: &str, name: &str, tag: &str, at: i64) -> BuildRecord {
    BuildRecord {
        id: id.into(),
        tenant_id: tenant.into(),
        name: name.into(),
        tag: tag.into(),
        status: BuildStatus::Waiting,
        definition: "{}".into(),
        cache_key: Some(format!("key-{id}")),
        template: None,
        digest: None,
        manifest: None,
        node: String::new(),
        sandbox_id: Some(format!("sb-{id}")),
        step: None,
        error: None,
        error_step: None,
        created_at_ms: at,
        finished_at_ms: None,
        heartbeat_ms: at,
    }
}

on_both!(builds_tags_logs_and_stalls);

async fn builds_tags_logs_and_stalls(b: Backend) {
    let store = b.store().await;
    let now = now_ms();
    let mut first = build("b1", "t1", "app", "v1", now - 10_000);
    store.insert_build(&first).await.unwrap();
    assert_eq!(store.get_build("t1", "b1").await.unwrap().unwrap(), first);
    assert!(
        store.get_build("t2", "b1").await.unwrap().is_none(),
        "another tenant's build is missing"
    );
    // Not ready yet: nothing serves app:v1.
    assert!(store.ready_build("t1", "app", "v1").await.unwrap().is_none());
    // A waiting build's definition arrives when it starts (E2B's builder): it is kept.
    first.definition = "{\"from\":\"busybox:1\"}".into();
    first.status = BuildStatus::Ready;
    first.template = Some("build-b1".into());
    first.digest = Some("sha256:d1".into());
    first.manifest = Some("{\"name\":\"build-b1\"}".into());
    first.finished_at_ms = Some(now - 9_000);
    assert!(store.update_build(&first).await.unwrap());
    assert_eq!(store.get_build("t1", "b1").await.unwrap().unwrap(), first);
    assert_eq!(store.ready_build("t1", "app", "v1").await.unwrap().unwrap().id, "b1");
    assert!(store.ready_build("t2", "app", "v1").await.unwrap().is_none());
    assert_eq!(store.build_by_key("t1", "key-b1").await.unwrap().unwrap().id, "b1");
    assert!(
        store.build_by_key("t2", "key-b1").await.unwrap().is_none(),
        "the cache is per tenant"
    );

    // A rebuild of v1 under way leaves b1 serving; once ready it serves.
    let mut second = build("b2", "t1", "app", "v1", now - 5_000);
    store.insert_build(&second).await.unwrap();
    assert_eq!(store.ready_build("t1", "app", "v1").await.unwrap().unwrap().id, "b1");
    second.status = BuildStatus::Ready;
    second.finished_at_ms = Some(now - 4_000);
    store.update_build(&second).await.unwrap();
    assert_eq!(store.ready_build("t1", "app", "v1").await.unwrap().unwrap().id, "b2");
    // Tags assigned later win; removing one leaves the others.
    store
        .assign_tag("t1", "app", "stable", "b1", now - 3_000)
        .await
        .unwrap();
    store.assign_tag("t1", "app", "v1", "b1", now - 2_000).await.unwrap();
    assert_eq!(store.ready_build("t1", "app", "v1").await.unwrap().unwrap().id, "b1");
    let tagged = store.tagged_builds("t1").await.unwrap();
    let mut seen: Vec<(String, String)> = tagged.iter().map(|(t, b)| (t.clone(), b.id.clone())).collect();
    seen.sort();
    assert_eq!(seen, vec![("stable".into(), "b1".into()), ("v1".into(), "b1".into())]);
    assert_eq!(store.tags_of("t1", "app").await.unwrap().len(), 3);
    assert!(store.remove_tag("t1", "app", "stable").await.unwrap());
    assert!(!store.remove_tag("t1", "app", "stable").await.unwrap());
    assert_eq!(
        store.list_builds("t1", Some("app")).await.unwrap()[0].id,
        "b2",
        "newest first"
    );

    // Logs in order, paged.
    let line = |m: &str| BuildLogEntry {
        seq: 0,
        at_ms: now,
        level: "info".into(),
        step: "1".into(),
        message: m.into(),
    };
    store.append_build_logs("b2", &[line("a"), line("b")]).await.unwrap();
    store.append_build_logs("b2", &[line("c")]).await.unwrap();
    let page = store.build_logs("b2", 1, 100).await.unwrap();
    assert_eq!(
        page.iter().map(|e| (e.seq, e.message.as_str())).collect::<Vec<_>>(),
        vec![(1, "b"), (2, "c")]
    );

    // A build whose heartbeat stopped is stalled; an ended one never is.
    let third = build("b3", "t1", "other", "default", now - 60_000);
    store.insert_build(&third).await.unwrap();
    let stalled: Vec<String> = store
        .stalled_builds(now - 30_000)
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.id)
        .collect();
    assert_eq!(stalled, vec!["b3".to_string()]);
    store.beat_build("b3", now).await.unwrap();
    assert!(store.stalled_builds(now - 30_000).await.unwrap().is_empty());

    // Deleting a template takes its builds, tags and logs.
    let gone = store.delete_builds("t1", "app").await.unwrap();
    assert_eq!(gone.len(), 2);
    assert!(store.ready_build("t1", "app", "v1").await.unwrap().is_none());
    assert!(store.build_logs("b2", 0, 100).await.unwrap().is_empty());
    assert!(store.tags_of("t1", "app").await.unwrap().is_empty());
    assert!(!store.update_build(&second).await.unwrap(), "its record is gone");

    // The step cache: per tenant, by key, its use recorded; every image claimed.
    let step = |key: &str, image: &str, at: i64| airlock_server::records::CachedStep {
        tenant_id: "t1".into(),
        cache_key: key.into(),
        image_id: image.into(),
        template: "seed".into(),
        resources: Resources {
            vcpu: 1,
            memory_mib: 512,
            disk_mib: 1400,
        },
        context: "{}".into(),
        node: String::new(),
        used_at_ms: at,
    };
    store.put_cached_step(&step("k1", "step_a", now - 100)).await.unwrap();
    store.put_cached_step(&step("k2", "step_b", now - 50)).await.unwrap();
    assert!(
        store.cached_step("t2", "k1", now).await.unwrap().is_none(),
        "per tenant"
    );
    let hit = store.cached_step("t1", "k1", now).await.unwrap().unwrap();
    assert_eq!(
        (hit.image_id.as_str(), hit.resources.disk_mib, hit.used_at_ms),
        ("step_a", 1400, now)
    );
    let order: Vec<String> = store
        .cached_steps("t1")
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.cache_key)
        .collect();
    assert_eq!(order, vec!["k1", "k2"], "most recently used first");
    let mut images = store.cached_step_images().await.unwrap();
    images.sort();
    assert_eq!(images, vec!["step_a", "step_b"]);
    store.put_cached_step(&step("k1", "step_c", now)).await.unwrap();
    assert_eq!(
        store.cached_step("t1", "k1", now).await.unwrap().unwrap().image_id,
        "step_c",
        "replaced"
    );
    store.drop_cached_step("t1", "k1").await.unwrap();
    assert!(store.cached_step("t1", "k1", now).await.unwrap().is_none());
}
