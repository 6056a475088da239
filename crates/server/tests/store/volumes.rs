//! Volumes through the store, on both stores: the quota checked in the insert and the resize,
//! names per tenant, what each sandbox mounts and who holds a volume (live sandboxes only), the
//! node's share.

use super::*;
use airlock_server::records::{VolumeMountRecord, VolumeRecord};

fn volume(id: &str, tenant: &str, name: &str, size_mib: u64) -> VolumeRecord {
    VolumeRecord {
        id: id.into(),
        tenant_id: tenant.into(),
        name: name.into(),
        size_mib,
        node: "n1".into(),
        token_hash: token_hash(&format!("token-{id}")),
        created_at_ms: now_ms(),
    }
}

on_both!(volumes_quota_names_and_holders);

async fn volumes_quota_names_and_holders(b: Backend) {
    let store = b.store().await;
    assert!(store
        .insert_volume(&volume("vol-a", "t1", "work", 60), Some(100))
        .await
        .unwrap());
    // The name is the tenant's: taken in t1, free in t2.
    assert!(!store
        .insert_volume(&volume("vol-b", "t1", "work", 10), Some(100))
        .await
        .unwrap());
    assert!(store
        .insert_volume(&volume("vol-c", "t2", "work", 10), None)
        .await
        .unwrap());
    // Past the quota: refused with what is used.
    match store.insert_volume(&volume("vol-d", "t1", "more", 50), Some(100)).await {
        Err(StoreError::QuotaExceeded {
            quota,
            used,
            asked,
            limit,
        }) => {
            assert_eq!((quota, used, asked, limit), ("volume_mib", 60, 50, 100))
        }
        other => panic!("over the quota: {other:?}"),
    }
    assert!(store
        .insert_volume(&volume("vol-d", "t1", "more", 40), Some(100))
        .await
        .unwrap());
    assert_eq!(store.volume_mib_used("t1").await.unwrap(), 100);
    assert_eq!(store.node_volume_mib("n1").await.unwrap(), 110);
    // By id or name, only the tenant's; by id alone for a token.
    assert_eq!(store.get_volume("t1", "work").await.unwrap().unwrap().id, "vol-a");
    assert_eq!(store.get_volume("t1", "vol-a").await.unwrap().unwrap().name, "work");
    assert!(store.get_volume("t2", "vol-a").await.unwrap().is_none());
    assert_eq!(store.volume_by_id("vol-c").await.unwrap().unwrap().tenant_id, "t2");
    let listed: Vec<String> = store
        .list_volumes("t1")
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.id)
        .collect();
    assert_eq!(listed, ["vol-a", "vol-d"]);
    // A resize counts the other volumes, not its own old size.
    assert!(store.resize_volume("vol-a", 61, Some(100)).await.is_err());
    store.resize_volume("vol-a", 60, Some(100)).await.unwrap();
    store.resize_volume("vol-a", 70, None).await.unwrap();
    assert_eq!(store.get_volume("t1", "vol-a").await.unwrap().unwrap().size_mib, 70);

    // Mounts: recorded in order; a holder is a sandbox not ended.
    let mounts = vec![
        VolumeMountRecord {
            volume_id: "vol-a".into(),
            path: "/w".into(),
            read_only: false,
        },
        VolumeMountRecord {
            volume_id: "vol-d".into(),
            path: "/r".into(),
            read_only: true,
        },
    ];
    store.put_sandbox_volumes("sb1", &mounts).await.unwrap();
    assert_eq!(store.sandbox_volumes("sb1").await.unwrap(), mounts);
    assert!(
        store.volume_holders("vol-a").await.unwrap().is_empty(),
        "no sandbox record yet"
    );
    store
        .insert_create(&sandbox("sb1", "t1"), &create_op("sb1"), None, 10)
        .await
        .unwrap();
    let holders = store.volume_holders("vol-d").await.unwrap();
    assert_eq!(
        holders
            .iter()
            .map(|h| (h.sandbox_id.as_str(), h.read_only))
            .collect::<Vec<_>>(),
        [("sb1", true)]
    );
    store.set_sandbox_state("sb1", SandboxState::Deleted).await.unwrap();
    assert!(
        store.volume_holders("vol-a").await.unwrap().is_empty(),
        "an ended sandbox holds nothing"
    );
    assert!(store.delete_volume("vol-a").await.unwrap());
    assert!(!store.delete_volume("vol-a").await.unwrap());
    assert_eq!(store.volume_mib_used("t1").await.unwrap(), 40);
}
