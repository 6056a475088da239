//! What only the SQLite store has: upgrading a database made before versioned migrations, the
//! legacy token table, its WAL beside other processes.

use super::*;
use std::path::Path;

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
