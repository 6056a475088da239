//! The SQLite store on real files: the atomic quota, idempotency, and upgrading a database made
//! before versioned migrations.

use airlock_server::model::{Operation, OperationKind, OperationState, Quota, Resources, SandboxState};
use airlock_server::records::{now_ms, rfc3339, SandboxRecord, SessionRecord, Tenant};
use airlock_server::store::{
    new_key, token_hash, AccessHashes, CreateRecorded, E2bStore, KeyFormat, NodeBudget, OperationStore, SandboxStore,
    SqliteStore, StoreError, TenantStore, TokenKind,
};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

fn sandbox(id: &str, tenant: &str) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        tenant_id: tenant.into(),
        state: SandboxState::Creating,
        template: "seed".into(),
        template_digest: "sha256:abc".into(),
        runtime: "qemu".into(),
        accel: "tcg".into(),
        resources: Resources {
            vcpu: 1,
            memory_mib: 512,
            disk_mib: 1024,
        },
        env: BTreeMap::new(),
        metadata: BTreeMap::new(),
        created_at_ms: now_ms(),
        expires_at_ms: now_ms() + 60_000,
        egress: Default::default(),
        start: None,
        lifecycle: Default::default(),
        timeout_ms: 300_000,
        image_id: None,
    }
}

fn create_op(sandbox_id: &str) -> Operation {
    Operation {
        id: format!("op_{sandbox_id}"),
        kind: OperationKind::Create,
        state: OperationState::Pending,
        sandbox_id: sandbox_id.into(),
        error: None,
        created_at: rfc3339(now_ms()),
        finished_at: None,
    }
}

async fn fresh() -> (tempfile::TempDir, Arc<SqliteStore>) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&dir.path().join("airlock.db")).await.unwrap();
    (dir, Arc::new(store))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_never_overshoot_the_limit() {
    let (_dir, store) = fresh().await;
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let id = format!("sb{i}");
                store.insert_create(&sandbox(&id, "t1"), &create_op(&id), None, 2).await
            })
        })
        .collect();
    let (mut new, mut refused) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(CreateRecorded::New(_)) => new += 1,
            Err(StoreError::QuotaExceeded {
                quota: "sandboxes",
                used: 2,
                asked: 1,
                limit: 2,
            }) => refused += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((new, refused), (2, 8));
    assert_eq!(store.count_live_sandboxes("t1").await.unwrap(), 2);
    // Another tenant's limit is its own.
    assert_eq!(store.count_live_sandboxes("t2").await.unwrap(), 0);
    let r = store
        .insert_create(&sandbox("other", "t2"), &create_op("other"), None, 2)
        .await;
    assert!(matches!(r, Ok(CreateRecorded::New(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_with_one_idempotency_key_make_one_sandbox() {
    let (_dir, store) = fresh().await;
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let id = format!("sb{i}");
                store
                    .insert_create(&sandbox(&id, "t1"), &create_op(&id), Some("k"), 5)
                    .await
            })
        })
        .collect();
    let mut ops = Vec::new();
    let mut new = 0;
    for t in tasks {
        match t.await.unwrap().unwrap() {
            CreateRecorded::New(op) => {
                new += 1;
                ops.push(op.id)
            }
            CreateRecorded::Existing(op) => ops.push(op.id),
        }
    }
    assert_eq!(new, 1);
    ops.dedup();
    assert_eq!(ops.len(), 1, "every caller sees the one operation");
    assert_eq!(store.count_live_sandboxes("t1").await.unwrap(), 1);
}

#[tokio::test]
async fn idempotency_key_returns_the_first_operation_and_only_live_states_count() {
    let (_dir, store) = fresh().await;
    let first = store
        .insert_create(&sandbox("a", "t1"), &create_op("a"), Some("key-1"), 1)
        .await
        .unwrap();
    let CreateRecorded::New(first) = first else {
        panic!("first create is new")
    };
    // Same key: the earlier operation, even though the tenant is now at its limit.
    match store
        .insert_create(&sandbox("b", "t1"), &create_op("b"), Some("key-1"), 1)
        .await
    {
        Ok(CreateRecorded::Existing(op)) => {
            assert_eq!(op.id, first.id);
            assert_eq!(op.sandbox_id, "a");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(store.sandbox_by_id("b").await.unwrap().is_none());
    // Another key: over the limit.
    match store
        .insert_create(&sandbox("c", "t1"), &create_op("c"), Some("key-2"), 1)
        .await
    {
        Err(StoreError::QuotaExceeded {
            quota: "sandboxes",
            used: 1,
            limit: 1,
            ..
        }) => {}
        other => panic!("unexpected {other:?}"),
    }
    // The same key is another tenant's own.
    let r = store
        .insert_create(&sandbox("d", "t2"), &create_op("d"), Some("key-1"), 1)
        .await;
    assert!(matches!(r, Ok(CreateRecorded::New(_))));

    // Every live state counts; deleted and failed ones do not.
    for state in [
        SandboxState::Running,
        SandboxState::Paused,
        SandboxState::Suspended,
        SandboxState::Resuming,
        SandboxState::Deleting,
    ] {
        store.set_sandbox_state("a", state).await.unwrap();
        assert_eq!(store.count_live_sandboxes("t1").await.unwrap(), 1, "{state:?}");
    }
    for state in [SandboxState::Deleted, SandboxState::Failed] {
        store.set_sandbox_state("a", state).await.unwrap();
        assert_eq!(store.count_live_sandboxes("t1").await.unwrap(), 0, "{state:?}");
    }
    let r = store
        .insert_create(&sandbox("e", "t1"), &create_op("e"), Some("key-3"), 1)
        .await;
    assert!(matches!(r, Ok(CreateRecorded::New(_))));
    assert_eq!(
        store
            .operation_by_idempotency_key("t1", "key-3")
            .await
            .unwrap()
            .unwrap()
            .sandbox_id,
        "e"
    );
    assert_eq!(store.operation_by_id(&first.id).await.unwrap().unwrap().sandbox_id, "a");
    assert!(store.get_operation("t2", &first.id).await.unwrap().is_none());
}

/// A suspended sandbox holds its disk only: it leaves its place, vcpu and memory to others, and
/// gets them back on resume only if they are free (the same atomic admission as a create).
#[tokio::test]
async fn suspended_sandboxes_hold_only_disk_and_resume_is_admitted() {
    let (_dir, store) = fresh().await;
    let quota = Quota {
        sandboxes: Some(1),
        disk_mib: Some(2048),
        ..Quota::default()
    };
    let budget = NodeBudget {
        vcpu: 8,
        memory_mib: 1024,
        disk_mib: 1 << 20,
    };
    let create = |id: &'static str| {
        let store = store.clone();
        async move {
            store
                .insert_create_within(&sandbox(id, "t1"), &create_op(id), None, &quota, &budget)
                .await
        }
    };
    assert!(matches!(create("a").await, Ok(CreateRecorded::New(_))));
    assert!(matches!(
        create("b").await,
        Err(StoreError::QuotaExceeded { quota: "sandboxes", .. })
    ));
    // Not suspended: nothing to admit.
    assert!(!store.admit_resume("a", &quota, &budget).await.unwrap());
    store.set_sandbox_state("a", SandboxState::Suspended).await.unwrap();
    assert_eq!(store.tenant_usage("t1", now_ms()).await.unwrap().sandboxes, 0);
    assert_eq!(store.tenant_usage("t1", now_ms()).await.unwrap().memory_mib, 0);
    assert_eq!(store.tenant_usage("t1", now_ms()).await.unwrap().disk_mib, 1024);
    assert!(matches!(create("b").await, Ok(CreateRecorded::New(_))));
    // Its disk still counts: a third 1 GiB disk is past the 2 GiB quota.
    store.set_sandbox_state("b", SandboxState::Suspended).await.unwrap();
    assert!(matches!(
        create("c").await,
        Err(StoreError::QuotaExceeded { quota: "disk_mib", .. })
    ));
    store.set_sandbox_state("b", SandboxState::Running).await.unwrap();
    // `b` runs in the tenant's one place: `a` cannot resume until it goes.
    assert!(matches!(
        store.admit_resume("a", &quota, &budget).await,
        Err(StoreError::QuotaExceeded { quota: "sandboxes", .. })
    ));
    assert_eq!(
        store.sandbox_by_id("a").await.unwrap().unwrap().state,
        SandboxState::Suspended
    );
    store.set_sandbox_state("b", SandboxState::Deleted).await.unwrap();
    // The node's memory budget applies the same way (another tenant fills it).
    let other = |id: &'static str| {
        let store = store.clone();
        async move {
            store
                .insert_create_within(&sandbox(id, "t2"), &create_op(id), None, &Quota::default(), &budget)
                .await
        }
    };
    assert!(matches!(other("x").await, Ok(CreateRecorded::New(_))));
    assert!(matches!(other("y").await, Ok(CreateRecorded::New(_))));
    assert!(matches!(
        store.admit_resume("a", &quota, &budget).await,
        Err(StoreError::NodeBudgetExceeded { budget: "memory", .. })
    ));
    store.set_sandbox_state("y", SandboxState::Failed).await.unwrap();
    assert!(store.admit_resume("a", &quota, &budget).await.unwrap());
    assert_eq!(
        store.sandbox_by_id("a").await.unwrap().unwrap().state,
        SandboxState::Resuming
    );
    assert_eq!(store.tenant_usage("t1", now_ms()).await.unwrap().sandboxes, 1);
}

#[tokio::test]
async fn keys_access_tokens_sessions_and_aliases() {
    let (_dir, store) = fresh().await;
    assert!(store.needs_bootstrap().await.unwrap());
    let key = new_key(KeyFormat::Airlock);
    assert!(
        store.bootstrap(&key).await.unwrap(),
        "the first bootstrap takes the key"
    );
    assert!(!store.needs_bootstrap().await.unwrap());
    assert!(!store.bootstrap(&new_key(KeyFormat::Airlock)).await.unwrap());
    assert_eq!(store.tenant_by_key(&key).await.unwrap().unwrap().name, "default");
    let e2b = store.create_key("acme", KeyFormat::E2b).await.unwrap();
    assert!(e2b.starts_with("e2b_"));
    let acme = store.tenant_by_key(&e2b).await.unwrap().unwrap();
    // A new tenant's id is opaque: never its name, which a later tenant may take again.
    assert_eq!(acme.name, "acme");
    assert!(acme.id.starts_with("tn_") && acme.id.len() == 19, "{}", acme.id);
    assert!(store.tenant_by_key("ak_nope").await.unwrap().is_none());

    store
        .insert_create(&sandbox("s1", "acme"), &create_op("s1"), None, 10)
        .await
        .unwrap();
    assert!(store.access_hashes("s1").await.unwrap().is_none());
    let hashes = |envd: &str, traffic: &str| AccessHashes {
        envd: token_hash(envd),
        traffic: Some(token_hash(traffic)),
    };
    store.set_access_hashes("s1", &hashes("one", "t1")).await.unwrap();
    store.set_access_hashes("s1", &hashes("two", "t2")).await.unwrap();
    assert_eq!(store.access_hashes("s1").await.unwrap(), Some(hashes("two", "t2")));
    for (kind, gone) in [(TokenKind::Envd, "one"), (TokenKind::Traffic, "t1")] {
        assert!(store
            .sandbox_by_access_hash(kind, &token_hash(gone))
            .await
            .unwrap()
            .is_none());
    }
    for (kind, live) in [(TokenKind::Envd, "two"), (TokenKind::Traffic, "t2")] {
        let found = store.sandbox_by_access_hash(kind, &token_hash(live)).await.unwrap();
        assert_eq!(found.unwrap().id, "s1");
    }
    // Each token is looked up only as its own kind.
    assert!(store
        .sandbox_by_access_hash(TokenKind::Envd, &token_hash("t2"))
        .await
        .unwrap()
        .is_none());
    assert!(store
        .sandbox_by_access_hash(TokenKind::Traffic, &token_hash("two"))
        .await
        .unwrap()
        .is_none());

    store.set_e2b_alias("s1", "base").await.unwrap();
    assert_eq!(store.e2b_alias("s1").await.unwrap().as_deref(), Some("base"));
    assert!(store.e2b_alias("nope").await.unwrap().is_none());

    let mut s = SessionRecord {
        id: "ses1".into(),
        sandbox_id: "s1".into(),
        process_id: 7,
        argv: vec!["sleep".into(), "1".into()],
        cwd: "/".into(),
        user: "user".into(),
        pty: false,
        exit_code: None,
        signal: None,
        timed_out: false,
        exited: false,
        started_at_ms: now_ms(),
        ended_at_ms: None,
        tag: Some("my-tag".into()),
    };
    store.insert_session(&s).await.unwrap();
    let got = store.session_by_process("s1", 7).await.unwrap().unwrap();
    assert_eq!((got.id.as_str(), got.tag.as_deref()), ("ses1", Some("my-tag")));
    assert!(store.session_by_process("s1", 8).await.unwrap().is_none());
    s.exit_code = Some(0);
    s.ended_at_ms = Some(now_ms());
    store.finish_session(&s).await.unwrap();
    let got = store.get_session("s1", "ses1").await.unwrap().unwrap();
    assert!(got.exited);
    assert_eq!(got.exit_code, Some(0));
    assert_eq!(store.list_sessions("s1").await.unwrap().len(), 1);
}

/// A database as the code before versioned migrations left it.
async fn make_v0_database(path: &Path, key: &str, token: &str) {
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use std::str::FromStr;
    let schema = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/schema-v0.sql")).unwrap();
    let opts = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))
        .unwrap()
        .create_if_missing(true);
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(opts)
        .await
        .unwrap();
    sqlx::raw_sql(&schema).execute(&pool).await.unwrap();
    let now = now_ms();
    let rows = format!(
        r#"
INSERT INTO tenants (id, name, created_at_ms) VALUES ('default', 'default', {now});
INSERT INTO api_keys (hash, tenant_id, prefix, created_at_ms) VALUES ('{key_hash}', 'default', '{prefix}', {now});
INSERT INTO sandboxes (id, tenant_id, state, template, template_digest, runtime, accel, vcpu, memory_mib, disk_mib,
  env, metadata, created_at_ms, expires_at_ms)
  VALUES ('old1', 'default', 'running', 'seed', 'sha256:abc', 'qemu', 'tcg', 1, 512, 1024, '{{}}',
  '{{"_e2b_template":"base","team":"x"}}', {now}, {later});
INSERT INTO sandboxes (id, tenant_id, state, template, template_digest, runtime, accel, vcpu, memory_mib, disk_mib,
  env, metadata, created_at_ms, expires_at_ms)
  VALUES ('old2', 'default', 'running', 'seed', 'sha256:abc', 'qemu', 'tcg', 1, 512, 1024, '{{}}',
  '{{"team":"y"}}', {now}, {later});
INSERT INTO sandbox_tokens (sandbox_id, token) VALUES ('old1', '{token}');
INSERT INTO sessions (id, sandbox_id, process_id, argv, cwd, user, pty, exit_code, signal, timed_out, exited,
  started_at_ms, ended_at_ms) VALUES ('ses1', 'old1', 3, '["sh"]', '/', 'user', 0, NULL, NULL, 0, 0, {now}, NULL);
INSERT INTO operations (id, tenant_id, kind, state, sandbox_id, error_code, error_message, idempotency_key,
  created_at_ms, finished_at_ms) VALUES ('op_old', 'default', 'create', 'succeeded', 'old1', NULL, NULL, 'idem-old', {now}, {now});
"#,
        key_hash = token_hash(key),
        prefix = &key[..8],
        later = now + 60_000,
    );
    sqlx::raw_sql(&rows).execute(&pool).await.unwrap();
    pool.close().await;
}

async fn table_exists(path: &Path, name: &str) -> bool {
    use sqlx::Connection;
    let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let r: Option<(String,)> = sqlx::query_as("SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?")
        .bind(name)
        .fetch_optional(&mut c)
        .await
        .unwrap();
    r.is_some()
}

#[tokio::test]
async fn a_database_from_before_migrations_is_upgraded_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("airlock.db");
    let key = "ak_0123456789abcdef0123456789abcdef01234567";
    let token = "0123456789abcdef0123456789abcdef";
    make_v0_database(&path, key, token).await;
    assert!(table_exists(&path, "sandbox_tokens").await);

    for round in 0..2 {
        // The second open finds everything migrated and changes nothing.
        let store = SqliteStore::open(&path).await.unwrap();
        assert_eq!(
            store.tenant_by_key(key).await.unwrap().unwrap().id,
            "default",
            "round {round}"
        );
        assert!(
            !store.bootstrap(&new_key(KeyFormat::Airlock)).await.unwrap(),
            "the old key still counts"
        );

        let sb = store.sandbox_by_id("old1").await.unwrap().unwrap();
        assert_eq!(sb.metadata, BTreeMap::from([("team".to_string(), "x".to_string())]));
        // Sandboxes from before egress had no NIC: they read as sealed.
        assert_eq!(sb.egress, airlock_server::records::EgressSpec::default());
        assert!(sb.egress.sealed && sb.egress.profiles.is_empty());
        assert_eq!(store.e2b_alias("old1").await.unwrap().as_deref(), Some("base"));
        let other = store.sandbox_by_id("old2").await.unwrap().unwrap();
        assert_eq!(other.metadata, BTreeMap::from([("team".to_string(), "y".to_string())]));
        assert!(store.e2b_alias("old2").await.unwrap().is_none());

        // A token from before traffic tokens: envd's only, until handed out again.
        let legacy = AccessHashes {
            envd: token_hash(token),
            traffic: None,
        };
        assert_eq!(store.access_hashes("old1").await.unwrap(), Some(legacy));
        assert_eq!(
            store
                .sandbox_by_access_hash(TokenKind::Envd, &token_hash(token))
                .await
                .unwrap()
                .unwrap()
                .id,
            "old1"
        );
        assert!(
            store
                .sandbox_by_access_hash(TokenKind::Envd, token)
                .await
                .unwrap()
                .is_none(),
            "the plain token is gone"
        );

        let ses = store.get_session("old1", "ses1").await.unwrap().unwrap();
        assert_eq!((ses.process_id, ses.tag), (3, None));

        let op = store
            .operation_by_idempotency_key("default", "idem-old")
            .await
            .unwrap()
            .unwrap();
        assert_eq!((op.id.as_str(), op.state), ("op_old", OperationState::Succeeded));
        match store
            .insert_create(&sandbox("new", "default"), &create_op("new"), Some("idem-old"), 10)
            .await
        {
            Ok(CreateRecorded::Existing(op)) => assert_eq!(op.id, "op_old"),
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(store.count_live_sandboxes("default").await.unwrap(), 2);
        drop(store);
        assert!(!table_exists(&path, "sandbox_tokens").await);
    }
}

#[tokio::test]
async fn a_new_database_has_no_legacy_token_table() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("airlock.db");
    drop(SqliteStore::open(&path).await.unwrap());
    assert!(!table_exists(&path, "sandbox_tokens").await);
    assert!(table_exists(&path, "sandbox_access").await);
    assert!(table_exists(&path, "e2b_sandboxes").await);
    drop(SqliteStore::open(&path).await.unwrap());
}

/// A `TenantStore` that checks, at the moment a key is committed, that the credentials file
/// already holds it.
struct FileFirst<'a> {
    inner: &'a SqliteStore,
    dir: &'a Path,
    commits: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl TenantStore for FileFirst<'_> {
    async fn needs_bootstrap(&self) -> Result<bool, StoreError> {
        self.inner.needs_bootstrap().await
    }
    async fn bootstrap(&self, key: &str) -> Result<bool, StoreError> {
        let on_disk = airlock_server::read_credentials_key(self.dir).unwrap();
        assert_eq!(
            on_disk.as_deref(),
            Some(key),
            "the file holds the key before it is committed"
        );
        self.commits.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.bootstrap(key).await
    }
    async fn create_key(&self, tenant: &str, format: KeyFormat) -> Result<String, StoreError> {
        self.inner.create_key(tenant, format).await
    }
    async fn tenant_by_key(&self, key: &str) -> Result<Option<Tenant>, StoreError> {
        self.inner.tenant_by_key(key).await
    }
    async fn tenant_by_name(&self, name: &str) -> Result<Option<Tenant>, StoreError> {
        self.inner.tenant_by_name(name).await
    }
    async fn egress_policy(&self, tenant_id: &str) -> Result<airlock_egress::TenantPolicy, StoreError> {
        self.inner.egress_policy(tenant_id).await
    }
    async fn set_egress_policy(
        &self,
        tenant_id: &str,
        policy: &airlock_egress::TenantPolicy,
    ) -> Result<(), StoreError> {
        self.inner.set_egress_policy(tenant_id, policy).await
    }
    async fn quota(&self, tenant_id: &str) -> Result<airlock_server::model::Quota, StoreError> {
        self.inner.quota(tenant_id).await
    }
    async fn set_quota(&self, tenant_id: &str, quota: &airlock_server::model::Quota) -> Result<(), StoreError> {
        self.inner.set_quota(tenant_id, quota).await
    }
}

#[tokio::test]
async fn the_admin_key_is_written_before_it_is_committed() {
    let listen = "127.0.0.1:7420".parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&dir.path().join("airlock.db")).await.unwrap();
    let checked = FileFirst {
        inner: &store,
        dir: dir.path(),
        commits: Default::default(),
    };
    let key = airlock_server::bootstrap_admin_key(&checked, dir.path(), &listen)
        .await
        .unwrap()
        .expect("a new store gets a key");
    assert_eq!(checked.commits.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(store.tenant_by_key(&key).await.unwrap().unwrap().id, "default");
    let file = std::fs::read_to_string(dir.path().join("credentials")).unwrap();
    // A restart changes nothing.
    assert!(airlock_server::bootstrap_admin_key(&checked, dir.path(), &listen)
        .await
        .unwrap()
        .is_none());
    assert_eq!(std::fs::read_to_string(dir.path().join("credentials")).unwrap(), file);

    // A crash after the file was written and before the commit: the next start commits the
    // file's key instead of minting another.
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&dir.path().join("airlock.db")).await.unwrap();
    let orphan = new_key(KeyFormat::Airlock);
    airlock_server::write_credentials(dir.path(), &orphan, &listen).unwrap();
    assert!(store.tenant_by_key(&orphan).await.unwrap().is_none());
    let got = airlock_server::bootstrap_admin_key(&store, dir.path(), &listen)
        .await
        .unwrap();
    assert_eq!(got.as_deref(), Some(orphan.as_str()));
    assert_eq!(store.tenant_by_key(&orphan).await.unwrap().unwrap().id, "default");
    assert_eq!(
        airlock_server::read_credentials_key(dir.path()).unwrap().as_deref(),
        Some(orphan.as_str()),
        "the file is left as it was"
    );
    assert!(airlock_server::bootstrap_admin_key(&store, dir.path(), &listen)
        .await
        .unwrap()
        .is_none());

    // A deleted credentials file with keys in the store: nothing new is minted or written.
    std::fs::remove_file(dir.path().join("credentials")).unwrap();
    assert!(airlock_server::bootstrap_admin_key(&store, dir.path(), &listen)
        .await
        .unwrap()
        .is_none());
    assert!(!dir.path().join("credentials").exists());
}

/// Another process (the CLI's `key create`, here Python's sqlite3) that opens and closes the
/// database while a server's store has it open must not take the server's WAL away: the store
/// keeps its POSIX locks, so the other process never believes it is the last connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_closing_the_database_leaves_the_store_working() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("airlock.db");
    let store = SqliteStore::open(&path).await.unwrap();
    let op = create_op("aaaaaaaaaaaaaaaaaaaa");
    store.insert_operation("t1", &op).await.unwrap();
    let script = "import sqlite3, sys\nc = sqlite3.connect(sys.argv[1])\nc.execute('select count(*) from operations').fetchall()\nc.close()\n";
    for round in 0..3 {
        let out = std::process::Command::new("python3")
            .args(["-c", script])
            .arg(&path)
            .output()
            .expect("python3 runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let wal = Path::new(&format!("{}-wal", path.display())).exists();
        assert!(wal, "round {round}: the -wal file was deleted under an open store");
        let op = create_op(&format!("aaaaaaaaaaaaaaaaaaa{round}"));
        store.insert_operation("t1", &op).await.unwrap();
        assert!(store.operation_by_id(&op.id).await.unwrap().is_some());
    }
}

#[tokio::test]
async fn tenant_egress_policies_and_sandbox_egress_records_round_trip() {
    use airlock_egress::TenantPolicy;
    use airlock_server::records::EgressSpec;
    let (_dir, store) = fresh().await;
    store.create_key("acme", KeyFormat::Airlock).await.unwrap();
    let acme = store.tenant_by_name("acme").await.unwrap().unwrap();
    assert_eq!(acme.name, "acme");
    assert!(store.tenant_by_name("nobody").await.unwrap().is_none());
    // A tenant that set nothing allows nothing.
    assert_eq!(store.egress_policy(&acme.id).await.unwrap(), TenantPolicy::sealed());
    let policy = TenantPolicy::from_json(
        r#"{"allow": {"domains": ["Pypi.org."], "ips": ["198.51.100.7"], "cidrs": ["203.0.113.0/24"]},
            "deny": {"domains": ["evil.test"]}}"#,
    )
    .unwrap();
    store.set_egress_policy(&acme.id, &policy).await.unwrap();
    assert_eq!(store.egress_policy(&acme.id).await.unwrap(), policy);
    let replaced = TenantPolicy::from_json(r#"{"allow": {"domains": ["a.test"]}}"#).unwrap();
    store.set_egress_policy(&acme.id, &replaced).await.unwrap();
    assert_eq!(store.egress_policy(&acme.id).await.unwrap(), replaced);
    // The egress parser refuses a wildcard before anything reaches the store.
    let e = TenantPolicy::from_json(r#"{"allow": {"domains": ["*.a.test"]}}"#).unwrap_err();
    assert!(e.to_string().contains("*.a.test"), "{e}");

    // A sandbox's egress is recorded with it.
    let mut sb = sandbox("eg1", &acme.id);
    sb.egress = EgressSpec {
        profiles: vec!["pypi".into(), "gh".into()],
        sealed: false,
        tenant: policy.clone(),
    };
    store.insert_create(&sb, &create_op("eg1"), None, 10).await.unwrap();
    assert_eq!(store.sandbox_by_id("eg1").await.unwrap().unwrap().egress, sb.egress);
    let mut sealed = sandbox("eg2", &acme.id);
    sealed.egress = EgressSpec::default();
    store.insert_create(&sealed, &create_op("eg2"), None, 10).await.unwrap();
    assert!(store.get_sandbox(&acme.id, "eg2").await.unwrap().unwrap().egress.sealed);
}
