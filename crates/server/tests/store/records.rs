//! Each aggregate's records through the store, on both stores: accounts and the audit log,
//! snapshots, sandboxes with their operations and sessions.

use super::*;

on_both!(accounts_keys_sign_ins_and_the_audit_log);

async fn accounts_keys_sign_ins_and_the_audit_log(b: Backend) {
    use airlock_server::records::{AuditFilter, AuditRecord};
    let store = b.store().await;
    let acme = store.create_tenant("acme").await.unwrap().unwrap();
    assert!(
        store.create_tenant("acme").await.unwrap().is_none(),
        "the name is taken"
    );
    store.create_tenant("Zed").await.unwrap().unwrap();
    store.create_tenant("_x").await.unwrap().unwrap();
    let names: Vec<String> = store
        .list_tenants()
        .await
        .unwrap()
        .into_iter()
        .map(|(t, _)| t.name)
        .collect();
    assert_eq!(names, ["Zed", "_x", "acme"], "byte order, as SQLite's");

    let (k1, r1) = store.mint_key(&acme.id, KeyFormat::Airlock, "ci").await.unwrap();
    let (k2, _) = store.mint_key(&acme.id, KeyFormat::E2b, "").await.unwrap();
    assert_eq!(r1.id, airlock_server::store::key_id_of(&k1));
    let keys = store.list_keys(&acme.id).await.unwrap();
    assert_eq!(keys.len(), 2);
    let ci = keys.iter().find(|k| k.id == r1.id).unwrap();
    assert_eq!((ci.name.as_str(), ci.prefix.as_str()), ("ci", &k1[..8]));
    assert!(keys
        .iter()
        .all(|k| k.revoked_at_ms.is_none() && k.last_used_at_ms.is_none()));
    assert_eq!(store.tenant_by_key(&k2).await.unwrap().unwrap().id, acme.id);
    let used = store.list_keys(&acme.id).await.unwrap();
    assert!(used.iter().any(|k| k.last_used_at_ms.is_some()), "a use is recorded");
    assert!(store.revoke_key(&acme.id, &r1.id).await.unwrap());
    assert!(!store.revoke_key("someone-else", &r1.id).await.unwrap());
    assert!(store.tenant_by_key(&k1).await.unwrap().is_none(), "revoked");
    assert!(store.tenant_by_key(&k2).await.unwrap().is_some());

    assert!(store.password_hash("root@local").await.unwrap().is_none());
    store.set_password_hash("root@local", "h1").await.unwrap();
    let now = now_ms();
    store
        .insert_admin_session("tok1", "root@local", now + 60_000)
        .await
        .unwrap();
    store.insert_admin_session("old", "root@local", now - 1).await.unwrap();
    assert_eq!(
        store.admin_session("tok1", now).await.unwrap().as_deref(),
        Some("root@local")
    );
    assert!(store.admin_session("old", now).await.unwrap().is_none(), "expired");
    store.set_password_hash("root@local", "h2").await.unwrap();
    assert_eq!(store.password_hash("root@local").await.unwrap().as_deref(), Some("h2"));
    assert!(
        store.admin_session("tok1", now).await.unwrap().is_none(),
        "a new password ends sign-ins"
    );

    let row = |at_ms: i64, tenant: Option<&str>, action: &str| AuditRecord {
        seq: 0,
        at_ms,
        actor: "root@local".into(),
        tenant: tenant.map(Into::into),
        action: action.into(),
        object: Some("obj".into()),
        result: "ok".into(),
        count: 1,
    };
    let s1 = store
        .insert_audit(&row(now - 10_000, Some("acme"), "key.create"))
        .await
        .unwrap();
    let s2 = store.insert_audit(&row(now, None, "auth")).await.unwrap();
    let s3 = store.insert_audit(&row(now, Some("acme"), "auth")).await.unwrap();
    assert!(s1 < s2 && s2 < s3);
    store.add_audit_count(s2, 4).await.unwrap();
    let all = store.audit(&AuditFilter::default(), 10).await.unwrap();
    assert_eq!(all.iter().map(|r| r.seq).collect::<Vec<_>>(), [s3, s2, s1]);
    assert_eq!(all[1].count, 5);
    assert_eq!(all[1].tenant, None);
    assert_eq!(all[2].object.as_deref(), Some("obj"));
    let acme_only = AuditFilter {
        tenant: Some("acme".into()),
        ..Default::default()
    };
    assert_eq!(store.audit(&acme_only, 10).await.unwrap().len(), 2);
    let auth_before = AuditFilter {
        action: Some("auth".into()),
        before_seq: Some(s3),
        ..Default::default()
    };
    let got = store.audit(&auth_before, 10).await.unwrap();
    assert_eq!(got.iter().map(|r| r.seq).collect::<Vec<_>>(), [s2]);
    assert_eq!(store.audit(&AuditFilter::default(), 1).await.unwrap().len(), 1);
    assert_eq!(store.prune_audit(now - 5_000).await.unwrap(), 1);

    store
        .set_quota(
            &acme.id,
            &Quota {
                vcpu: Some(4),
                creates_per_minute: Some(2),
                ..Quota::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(store.quota(&acme.id).await.unwrap().vcpu, Some(4));
    store.delete_tenant(&acme.id).await.unwrap();
    assert!(store.tenant_by_key(&k2).await.unwrap().is_none());
    assert!(store.list_keys(&acme.id).await.unwrap().is_empty());
    assert_eq!(store.quota(&acme.id).await.unwrap(), Quota::default());
    assert!(store.tenant_by_name("acme").await.unwrap().is_none());
}

on_both!(snapshots_are_admitted_saved_found_and_counted);

async fn snapshots_are_admitted_saved_found_and_counted(b: Backend) {
    use airlock_server::records::{SnapshotKind, SnapshotRecord};
    use airlock_server::store::SnapshotAdmission;
    let store = b.store().await;
    let t = store.create_tenant("acme").await.unwrap().unwrap();
    let snap = |id: &str, name: Option<&str>, kind: SnapshotKind| SnapshotRecord {
        id: id.into(),
        tenant_id: t.id.clone(),
        name: name.map(Into::into),
        kind,
        sandbox_id: "sb1".into(),
        template: "seed".into(),
        resources: Resources {
            vcpu: 1,
            memory_mib: 512,
            disk_mib: 1024,
        },
        bytes: 0,
        digest: None,
        created_at_ms: now_ms() - 1000,
        shared: None,
    };
    let quota = Quota {
        disk_mib: Some(4000),
        ..Quota::default()
    };
    let budget = NodeBudget::UNLIMITED;
    let a = snap("snap_a", Some("first"), SnapshotKind::Snapshot);
    assert_eq!(
        store.admit_snapshot(&a, 1536, &quota, &budget).await.unwrap(),
        SnapshotAdmission::Admitted
    );
    assert!(
        store.get_snapshot(&t.id, "snap_a").await.unwrap().is_none(),
        "being saved"
    );
    assert_eq!(
        store.tenant_usage(&t.id, now_ms()).await.unwrap().snapshot_disk_mib,
        1536
    );
    assert_eq!(
        store
            .admit_snapshot(
                &snap("snap_b", Some("first"), SnapshotKind::Snapshot),
                1,
                &quota,
                &budget
            )
            .await
            .unwrap(),
        SnapshotAdmission::NameTaken
    );
    let mut orphan = snap("snap_c", None, SnapshotKind::Snapshot);
    orphan.tenant_id = "gone".into();
    assert_eq!(
        store.admit_snapshot(&orphan, 1, &quota, &budget).await.unwrap(),
        SnapshotAdmission::NoTenant
    );
    match store
        .admit_snapshot(&snap("snap_d", None, SnapshotKind::Fork), 3000, &quota, &budget)
        .await
    {
        Err(StoreError::QuotaExceeded {
            quota: "disk_mib",
            used: 1536,
            asked: 3000,
            limit: 4000,
        }) => {}
        other => panic!("unexpected {other:?}"),
    }
    let small = NodeBudget {
        disk_mib: 2000,
        ..NodeBudget::UNLIMITED
    };
    assert!(matches!(
        store
            .admit_snapshot(&snap("snap_d", None, SnapshotKind::Fork), 1000, &quota, &small)
            .await,
        Err(StoreError::NodeBudgetExceeded { budget: "disk", .. })
    ));
    let saved = SnapshotRecord {
        bytes: (3 << 20) + 1,
        digest: Some("sha256:aa".into()),
        shared: Some("machine-x".into()),
        ..a.clone()
    };
    assert!(store.snapshot_saved(&saved).await.unwrap());
    let got = store.get_snapshot(&t.id, "snap_a").await.unwrap().unwrap();
    assert_eq!(
        got.shared.as_deref(),
        Some("machine-x"),
        "shared, and where it was saved"
    );
    let usage = store.tenant_usage(&t.id, now_ms()).await.unwrap();
    assert_eq!((usage.snapshots, usage.snapshot_disk_mib, usage.disk_mib), (1, 4, 4));
    for by in ["snap_a", "first", "sha256:aa"] {
        let got = store.get_snapshot(&t.id, by).await.unwrap().unwrap();
        assert_eq!(
            (got.id.as_str(), got.bytes, got.kind),
            ("snap_a", (3 << 20) + 1, SnapshotKind::Snapshot)
        );
    }
    assert!(store.get_snapshot("other", "snap_a").await.unwrap().is_none());
    let fork = snap("snap_f", None, SnapshotKind::Fork);
    store.admit_snapshot(&fork, 10, &quota, &budget).await.unwrap();
    store.snapshot_saved(&fork).await.unwrap();
    assert_eq!(
        store.list_snapshots(&t.id, None).await.unwrap().len(),
        1,
        "forks' images are not listed"
    );
    assert_eq!(store.list_snapshots(&t.id, Some("sb1")).await.unwrap().len(), 1);
    assert!(store.list_snapshots(&t.id, Some("sb2")).await.unwrap().is_empty());
    assert_eq!(store.tenant_snapshots(&t.id).await.unwrap().len(), 2);
    let mut ids = store.snapshot_ids().await.unwrap();
    ids.sort();
    assert_eq!(ids, ["snap_a", "snap_f"]);
    let interrupted = store.interrupted_images(now_ms()).await.unwrap();
    assert_eq!(
        interrupted.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        ["snap_f"]
    );
    assert!(store.interrupted_images(0).await.unwrap().is_empty());
    assert!(store.delete_snapshot(&t.id, "snap_f").await.unwrap());
    assert!(!store.delete_snapshot(&t.id, "snap_f").await.unwrap());
}

on_both!(sandboxes_list_page_expire_and_keep_their_records);

async fn sandboxes_list_page_expire_and_keep_their_records(b: Backend) {
    use airlock_server::model::{Booted, ErrorBody, OnTimeout, SandboxStart};
    let store = b.store().await;
    let base = now_ms();
    for (i, id) in ["sb_a", "sb_B", "sb_c", "sb_d"].iter().enumerate() {
        let mut sb = sandbox(id, "t1");
        sb.created_at_ms = base + (i as i64 / 2) * 10;
        sb.metadata = BTreeMap::from([("n".to_string(), i.to_string())]);
        sb.env = BTreeMap::from([("K".to_string(), "v \"q\"".to_string())]);
        store.insert_create(&sb, &create_op(id), None, 10).await.unwrap();
    }
    let page = |after: Option<(i64, String)>, newest_first: bool| airlock_server::store::SandboxFilter {
        after,
        limit: 2,
        newest_first,
        ..Default::default()
    };
    let ids = |rows: &[SandboxRecord]| rows.iter().map(|s| s.id.clone()).collect::<Vec<_>>();
    let first = store.list_sandboxes("t1", &page(None, false)).await.unwrap();
    assert_eq!(
        ids(&first),
        ["sb_B", "sb_a", "sb_c"],
        "limit + 1, by time then id bytes"
    );
    let token = airlock_server::store::next_page_token(&first, 2).unwrap();
    let after = airlock_server::store::parse_page_token(&token);
    assert_eq!(
        ids(&store.list_sandboxes("t1", &page(after, false)).await.unwrap()),
        ["sb_c", "sb_d"]
    );
    let newest = store.list_sandboxes("t1", &page(None, true)).await.unwrap();
    assert_eq!(ids(&newest), ["sb_d", "sb_c", "sb_a"]);
    let filtered = airlock_server::store::SandboxFilter {
        metadata: BTreeMap::from([("n".to_string(), "2".to_string())]),
        limit: 10,
        ..Default::default()
    };
    let got = store.list_sandboxes("t1", &filtered).await.unwrap();
    assert_eq!(ids(&got), ["sb_c"]);
    assert_eq!(got[0].env["K"], "v \"q\"");

    assert!(store
        .transition_sandbox("sb_a", &[SandboxState::Creating], SandboxState::Running)
        .await
        .unwrap());
    assert!(!store
        .transition_sandbox(
            "sb_a",
            &[SandboxState::Creating, SandboxState::Paused],
            SandboxState::Deleted
        )
        .await
        .unwrap());
    store.set_sandbox_state("sb_B", SandboxState::Paused).await.unwrap();
    store.set_sandbox_state("sb_d", SandboxState::Deleted).await.unwrap();
    assert_eq!(store.live_sandboxes().await.unwrap().len(), 3);
    store.set_sandbox_expiry("sb_a", base - 1).await.unwrap();
    store.set_sandbox_expiry("sb_B", base - 1).await.unwrap();
    store.set_sandbox_expiry("sb_c", base - 1).await.unwrap();
    let mut expired = ids(&store.expired_sandboxes(base).await.unwrap());
    expired.sort();
    assert_eq!(expired, ["sb_B", "sb_a"], "creating and deleted ones never expire");

    assert_eq!(store.paused_remaining("sb_B").await.unwrap(), None);
    store.set_paused_remaining("sb_B", Some(5)).await.unwrap();
    store.set_paused_remaining("sb_B", Some(7)).await.unwrap();
    assert_eq!(store.paused_remaining("sb_B").await.unwrap(), Some(7));
    store.set_paused_remaining("sb_B", None).await.unwrap();
    assert_eq!(store.paused_remaining("sb_B").await.unwrap(), None);

    let booted = Booted {
        template_digest: "sha256:def".into(),
        accel: "kvm".into(),
        start: SandboxStart {
            from: "restore".into(),
            ms: 42,
        },
        run: "0123456789abcdef".into(),
    };
    store.set_sandbox_boot("sb_a", &booted).await.unwrap();
    let a = store.get_sandbox("t1", "sb_a").await.unwrap().unwrap();
    assert_eq!((a.template_digest.as_str(), a.accel.as_str()), ("sha256:def", "kvm"));
    assert_eq!(a.run, "0123456789abcdef", "the run its node started");
    assert_eq!(a.start.map(|s| (s.from, s.ms)), Some(("restore".to_string(), 42)));
    assert!(store.get_sandbox("t2", "sb_a").await.unwrap().is_none());

    // A suspend is charged its memory once; a timeout that suspends holds it from the create.
    let quota = Quota {
        disk_mib: Some(1024 * 3 + 512),
        ..Quota::default()
    };
    assert!(store
        .admit_suspend("sb_a", &quota, &NodeBudget::UNLIMITED)
        .await
        .unwrap());
    assert!(store
        .admit_suspend("sb_a", &quota, &NodeBudget::UNLIMITED)
        .await
        .unwrap());
    assert!(
        !store
            .admit_suspend("sb_c", &quota, &NodeBudget::UNLIMITED)
            .await
            .unwrap(),
        "creating"
    );
    assert!(matches!(
        store.admit_suspend("sb_B", &quota, &NodeBudget::UNLIMITED).await,
        Err(StoreError::QuotaExceeded { quota: "disk_mib", .. })
    ));
    let mut sus = sandbox("sb_s", "t2");
    sus.lifecycle.on_timeout = OnTimeout::Suspend;
    sus.lifecycle.auto_resume = true;
    store.insert_create(&sus, &create_op("sb_s"), None, 10).await.unwrap();
    let got = store.sandbox_by_id("sb_s").await.unwrap().unwrap();
    assert_eq!(got.lifecycle.on_timeout, OnTimeout::Suspend);
    assert!(got.lifecycle.auto_resume);
    assert_eq!(store.tenant_usage("t2", now_ms()).await.unwrap().disk_mib, 1024 + 512);

    // The rate limit counts the tenant's creates in the last minute.
    let rate = Quota {
        creates_per_minute: Some(4),
        ..Quota::default()
    };
    match store
        .insert_create_within(
            &sandbox("sb_e", "t1"),
            &create_op("sb_e"),
            None,
            &rate,
            &NodeBudget::UNLIMITED,
        )
        .await
    {
        Err(StoreError::RateLimited {
            limit: 4,
            retry_after_s,
        }) => assert!((1..=60).contains(&retry_after_s)),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(store.tenant_usage("t1", now_ms()).await.unwrap().creates_last_minute, 4);

    // Operations.
    let mut del = create_op("sb_a");
    del.id = "op_del".into();
    del.kind = OperationKind::Delete;
    store.insert_operation("t1", &del).await.unwrap();
    assert_eq!(store.open_delete_operation("sb_a").await.unwrap().unwrap().id, "op_del");
    assert!(store.open_delete_operation("sb_c").await.unwrap().is_none());
    store
        .set_operation_state("op_sb_a", OperationState::Running)
        .await
        .unwrap();
    store
        .finish_operation(
            "op_sb_B",
            OperationState::Failed,
            Some(&ErrorBody {
                code: "boot_failed".into(),
                message: "no".into(),
            }),
        )
        .await
        .unwrap();
    let failed = store.get_operation("t1", "op_sb_B").await.unwrap().unwrap();
    assert_eq!(failed.state, OperationState::Failed);
    assert_eq!(failed.error.map(|e| e.code), Some("boot_failed".into()));
    assert!(failed.finished_at.is_some());
    let unfinished = store.unfinished_operations().await.unwrap();
    assert_eq!(unfinished.len(), 5, "{unfinished:?}");
    assert!(unfinished.iter().all(|o| o.id != "op_sb_B"));

    // Sessions: the running count and pruning exited ones but the newest.
    for i in 0..4 {
        let s = SessionRecord {
            id: format!("ses{i}"),
            sandbox_id: "sb_a".into(),
            process_id: 100 + i,
            argv: vec!["sh".into(), "-c".into(), "echo 'x'".into()],
            cwd: "/tmp".into(),
            user: "root".into(),
            pty: i == 0,
            exit_code: None,
            signal: None,
            timed_out: false,
            exited: false,
            started_at_ms: base + i as i64,
            ended_at_ms: None,
            tag: None,
        };
        store.insert_session(&s).await.unwrap();
        if i < 3 {
            let ended = SessionRecord {
                exit_code: None,
                signal: Some(9),
                timed_out: true,
                ended_at_ms: Some(base + 100 + i as i64),
                ..s
            };
            store.finish_session(&ended).await.unwrap();
        }
    }
    let running = store.list_sessions("sb_a").await.unwrap();
    assert_eq!(running.iter().filter(|s| !s.exited).count(), 1);
    assert_eq!(store.prune_finished_sessions("sb_a", 1).await.unwrap(), 2);
    let left = store.list_sessions("sb_a").await.unwrap();
    assert_eq!(left.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["ses2", "ses3"]);
    assert_eq!(
        (left[0].signal, left[0].timed_out, left[0].exited),
        (Some(9), true, true)
    );
    assert_eq!(left[1].argv, ["sh", "-c", "echo 'x'"]);
    assert!(store.session_by_process("sb_a", 100).await.unwrap().is_none());
}
