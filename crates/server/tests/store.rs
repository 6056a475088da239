//! The stores on real databases: the atomic quota, idempotency, every aggregate's round trips
//! (`store/records.rs`), each test body on SQLite (a file) and on Postgres (a real Postgres 15,
//! `pg_cluster`), and that both schemas agree; then what only SQLite has (`store/sqlite.rs`):
//! upgrading a database made before versioned migrations, its WAL.

mod pg_cluster;

use airlock_server::model::{Operation, OperationKind, OperationState, Quota, Resources, SandboxState};
use airlock_server::records::{now_ms, rfc3339, SandboxRecord, SessionRecord, Tenant};
use airlock_server::store::{
    new_key, token_hash, AccessHashes, CreateRecorded, E2bStore, KeyFormat, Lease, NodeBudget, OperationStore, PgStore,
    SandboxStore, SqliteStore, Store, StoreError, TenantStore, TokenKind,
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
        node: String::new(),
        run: String::new(),
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

/// Where a test's stores live: SQLite files in a temp dir, or databases of a Postgres cluster
/// of its own (stopped and removed when the test ends, passed or not).
enum Backend {
    Sqlite(tempfile::TempDir),
    Postgres(pg_cluster::PgCluster),
}

impl Backend {
    fn sqlite() -> Self {
        Backend::Sqlite(tempfile::tempdir().unwrap())
    }

    fn postgres() -> Self {
        let cluster = pg_cluster::PgCluster::start();
        eprintln!("Postgres started in {:?}", cluster.started_in);
        Backend::Postgres(cluster)
    }

    /// A new, empty store.
    async fn store(&self) -> Arc<dyn Store> {
        match self {
            Backend::Sqlite(dir) => {
                let path = dir
                    .path()
                    .join(format!("airlock-{}.db", airlock_runtime::datadir::random_hex(4)));
                Arc::new(SqliteStore::open(&path).await.unwrap())
            }
            Backend::Postgres(cluster) => Arc::new(PgStore::connect(&cluster.database().await).await.unwrap()),
        }
    }
}

impl Backend {
    /// Stores over one new database, one per lease (as replicas, or the lives of one server).
    async fn stores(&self, leases: &[Lease]) -> Vec<Arc<dyn Store>> {
        let mut stores: Vec<Arc<dyn Store>> = Vec::new();
        match self {
            Backend::Sqlite(dir) => {
                let path = dir
                    .path()
                    .join(format!("airlock-{}.db", airlock_runtime::datadir::random_hex(4)));
                for lease in leases {
                    stores.push(Arc::new(
                        SqliteStore::open(&path).await.unwrap().with_lease(lease.clone()),
                    ));
                }
            }
            Backend::Postgres(cluster) => {
                let url = cluster.database().await;
                for lease in leases {
                    stores.push(Arc::new(
                        PgStore::connect(&url).await.unwrap().with_lease(lease.clone()),
                    ));
                }
            }
        }
        stores
    }
}

/// `name::sqlite` and `name::postgres`: one test body (`async fn(Backend)`) on each store.
macro_rules! on_both {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                super::$name(super::Backend::sqlite()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                super::$name(super::Backend::postgres()).await
            }
        }
    };
}

on_both!(concurrent_creates_never_overshoot_the_limit);

async fn concurrent_creates_never_overshoot_the_limit(b: Backend) {
    let store = b.store().await;
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

on_both!(an_operation_is_leased_to_one_replica_until_its_lease_lapses);

/// Operations are leased (issue 25): a replica takes over only what lapsed, concurrent
/// take-overs split it without overlap, renewing keeps a lease, and a restarted single-host
/// server takes its own at once.
async fn an_operation_is_leased_to_one_replica_until_its_lease_lapses(b: Backend) {
    let short = Lease {
        ms: 300,
        ..Lease::replica()
    };
    let stores = b.stores(&[short, Lease::replica(), Lease::replica()]).await;
    let (dying, r2, r3) = (&stores[0], &stores[1], &stores[2]);
    dying
        .insert_create(&sandbox("sb1", "t1"), &create_op("sb1"), None, 10)
        .await
        .unwrap();
    dying.insert_operation("t1", &create_op("sb2")).await.unwrap();
    // Leased: neither another replica nor its own-too take-over gets it.
    assert!(r2.claim_operations(false).await.unwrap().is_empty());
    assert!(r3.claim_operations(true).await.unwrap().is_empty());
    // Lapsed: claims racing from two replicas take each operation exactly once.
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let claims: Vec<_> = (0..8)
        .map(|i| {
            let store = stores[1 + i % 2].clone();
            tokio::spawn(async move { store.claim_operations(false).await.unwrap() })
        })
        .collect();
    let mut taken = Vec::new();
    for c in claims {
        for claimed in c.await.unwrap() {
            assert_eq!(claimed.epoch, 2, "a lease taken over is the operation's second");
            taken.push(claimed.op.id);
        }
    }
    taken.sort();
    assert_eq!(taken, vec!["op_sb1".to_string(), "op_sb2".to_string()]);
    // The replica that lapsed renews in vain: the leases stay with their new holders.
    dying.renew_leases(&taken).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    assert!(r2.claim_operations(false).await.unwrap().is_empty());
    assert!(r3.claim_operations(false).await.unwrap().is_empty());
    // Nor does the lapsed one's late end count: the new holder's stands.
    assert!(!dying
        .finish_operation("op_sb1", OperationState::Failed, None)
        .await
        .unwrap());
    let op = r2.operation_by_id("op_sb1").await.unwrap().unwrap();
    assert!(!op.state.is_final(), "{op:?}");
    // Its holder ends each (whichever replica took it); a finished operation is no one's.
    let mut ended = 0;
    for id in ["op_sb1", "op_sb2"] {
        for r in [r2, r3] {
            ended += r.finish_operation(id, OperationState::Succeeded, None).await.unwrap() as usize;
        }
    }
    assert_eq!(ended, 2, "each by its holder alone");

    // A single-host server's next life takes its own at once, whatever their lease says.
    let lives = b
        .stores(&[
            Lease {
                holder: Lease::LOCAL.into(),
                ms: 60_000,
            },
            Lease {
                holder: Lease::LOCAL.into(),
                ms: 60_000,
            },
        ])
        .await;
    lives[0].insert_operation("t1", &create_op("sb3")).await.unwrap();
    assert!(lives[1].claim_operations(false).await.unwrap().is_empty());
    let own: Vec<String> = lives[1]
        .claim_operations(true)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.op.id)
        .collect();
    assert_eq!(own, vec!["op_sb3".to_string()]);
}

on_both!(a_duty_is_held_by_one_replica_until_its_lease_lapses);

/// A duty (the reaper's) is one replica's at a time, renewed by it, taken over once it lapses.
async fn a_duty_is_held_by_one_replica_until_its_lease_lapses(b: Backend) {
    let short = Lease {
        ms: 300,
        ..Lease::replica()
    };
    let stores = b.stores(&[short, Lease::replica(), Lease::replica()]).await;
    assert!(stores[0].lead("reaper").await.unwrap());
    assert!(stores[0].lead("reaper").await.unwrap(), "its holder keeps it");
    assert!(!stores[1].lead("reaper").await.unwrap());
    assert!(stores[1].lead("other").await.unwrap(), "duties are apart");
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    // Lapsed: two replicas race for it, one gets it.
    let (x, y) = tokio::join!(stores[1].lead("reaper"), stores[2].lead("reaper"));
    assert!(x.unwrap() ^ y.unwrap());
    assert!(!stores[0].lead("reaper").await.unwrap(), "its old holder lost it");
}

on_both!(concurrent_creates_with_one_idempotency_key_make_one_sandbox);

async fn concurrent_creates_with_one_idempotency_key_make_one_sandbox(b: Backend) {
    let store = b.store().await;
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

on_both!(idempotency_key_returns_the_first_operation_and_only_live_states_count);

async fn idempotency_key_returns_the_first_operation_and_only_live_states_count(b: Backend) {
    let store = b.store().await;
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

on_both!(suspended_sandboxes_hold_only_disk_and_resume_is_admitted);

/// A suspended sandbox holds its disk only: it leaves its place, vcpu and memory to others, and
/// gets them back on resume only if they are free (the same atomic admission as a create).
async fn suspended_sandboxes_hold_only_disk_and_resume_is_admitted(b: Backend) {
    let store = b.store().await;
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
    assert!(!store.admit_resume("a", "", &quota, &budget).await.unwrap());
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
        store.admit_resume("a", "", &quota, &budget).await,
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
        store.admit_resume("a", "", &quota, &budget).await,
        Err(StoreError::NodeBudgetExceeded { budget: "memory", .. })
    ));
    store.set_sandbox_state("y", SandboxState::Failed).await.unwrap();
    assert!(store.admit_resume("a", "", &quota, &budget).await.unwrap());
    assert_eq!(
        store.sandbox_by_id("a").await.unwrap().unwrap().state,
        SandboxState::Resuming
    );
    assert_eq!(store.tenant_usage("t1", now_ms()).await.unwrap().sandboxes, 1);
}

on_both!(a_nodes_budget_counts_only_the_sandboxes_placed_on_it);

/// Many hosts: each create names its node, and a node's budgets sum only what is on it, so a
/// full node refuses while another with room admits (placement then tries the next).
async fn a_nodes_budget_counts_only_the_sandboxes_placed_on_it(b: Backend) {
    let store = b.store().await;
    let budget = NodeBudget {
        vcpu: 64,
        memory_mib: 2 * 512,
        disk_mib: 1 << 20,
    };
    let on = |id: &str, node: &str| SandboxRecord {
        node: node.into(),
        ..sandbox(id, "t1")
    };
    for (id, node) in [("a1", "node-a"), ("a2", "node-a"), ("b1", "node-b")] {
        let r = store
            .insert_create_within(&on(id, node), &create_op(id), None, &Quota::default(), &budget)
            .await;
        assert!(matches!(r, Ok(CreateRecorded::New(_))), "{id}: {r:?}");
    }
    let r = store
        .insert_create_within(&on("a3", "node-a"), &create_op("a3"), None, &Quota::default(), &budget)
        .await;
    assert!(
        matches!(
            r,
            Err(StoreError::NodeBudgetExceeded {
                budget: "memory",
                used: 1024,
                ..
            })
        ),
        "{r:?}"
    );
    let r = store
        .insert_create_within(&on("b2", "node-b"), &create_op("b2"), None, &Quota::default(), &budget)
        .await;
    assert!(matches!(r, Ok(CreateRecorded::New(_))), "{r:?}");
    assert_eq!(store.sandbox_by_id("b2").await.unwrap().unwrap().node, "node-b");

    // A node refused a2 by its own admission: it moves only where the store's budgets take it.
    let r = store.move_starting("a2", "node-b", &budget).await;
    assert!(
        matches!(r, Err(StoreError::NodeBudgetExceeded { budget: "memory", .. })),
        "{r:?}"
    );
    assert!(store.move_starting("a2", "node-c", &budget).await.unwrap());
    assert_eq!(store.sandbox_by_id("a2").await.unwrap().unwrap().node, "node-c");
    // Node a's budget counts it no longer.
    let r = store
        .insert_create_within(&on("a3", "node-a"), &create_op("a3"), None, &Quota::default(), &budget)
        .await;
    assert!(matches!(r, Ok(CreateRecorded::New(_))), "{r:?}");
    // One no longer creating stays where it is.
    store.set_sandbox_state("a1", SandboxState::Running).await.unwrap();
    assert!(!store.move_starting("a1", "node-c", &budget).await.unwrap());
    assert_eq!(store.sandbox_by_id("a1").await.unwrap().unwrap().node, "node-a");

    // Parked in object storage by its draining node, b1's resume is admitted on whichever node
    // placement offers it.
    store.set_sandbox_state("b1", SandboxState::Suspended).await.unwrap();
    let parked = airlock_server::records::ParkedImage {
        image: "park-0123456789ab".into(),
        fingerprint: "tcg-0123456789abcdef".into(),
        resume: true,
    };
    store.set_sandbox_parked("b1", Some(&parked)).await.unwrap();
    assert_eq!(store.sandbox_parked("b1").await.unwrap(), Some(parked));
    assert_eq!(store.sandbox_parked("b2").await.unwrap(), None);
    let ids = |rows: Vec<SandboxRecord>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(ids(store.parked_to_resume().await.unwrap()), ["b1"]);
    let r = store.admit_resume("b1", "node-a", &Quota::default(), &budget).await;
    assert!(
        matches!(r, Err(StoreError::NodeBudgetExceeded { budget: "memory", .. })),
        "node a is full: {r:?}"
    );
    assert!(store
        .admit_resume("b1", "node-e", &Quota::default(), &budget)
        .await
        .unwrap());
    let row = store.sandbox_by_id("b1").await.unwrap().unwrap();
    assert_eq!((row.state, row.node.as_str()), (SandboxState::Resuming, "node-e"));
    assert!(store.parked_to_resume().await.unwrap().is_empty(), "resuming already");
    // Node e refused it by its own admission: a resuming sandbox moves like a creating one.
    assert!(store.move_starting("b1", "node-f", &budget).await.unwrap());
    store.set_sandbox_parked("b1", None).await.unwrap();
    assert_eq!(store.sandbox_parked("b1").await.unwrap(), None);
    assert_eq!(store.sandbox_by_id("b1").await.unwrap().unwrap().node, "node-f");
}

on_both!(keys_access_tokens_sessions_and_aliases);

async fn keys_access_tokens_sessions_and_aliases(b: Backend) {
    let store = b.store().await;
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
        tag: Some("my-tag".into()),
        ..running_session("ses1", "s1", 7)
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

/// A session of `sandbox_id` whose process `process_id` runs.
fn running_session(id: &str, sandbox_id: &str, process_id: u64) -> SessionRecord {
    SessionRecord {
        id: id.into(),
        sandbox_id: sandbox_id.into(),
        process_id,
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
        tag: None,
    }
}

/// A `TenantStore` that checks, at the moment a key is committed, that the credentials file
/// already holds it.
struct FileFirst<'a> {
    inner: &'a dyn Store,
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

on_both!(the_admin_key_is_written_before_it_is_committed);

async fn the_admin_key_is_written_before_it_is_committed(b: Backend) {
    let listen = "127.0.0.1:7420".parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = b.store().await;
    let checked = FileFirst {
        inner: &*store,
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
    let store = b.store().await;
    let orphan = new_key(KeyFormat::Airlock);
    airlock_server::write_credentials(dir.path(), &orphan, &listen).unwrap();
    assert!(store.tenant_by_key(&orphan).await.unwrap().is_none());
    let got = airlock_server::bootstrap_admin_key(&*store, dir.path(), &listen)
        .await
        .unwrap();
    assert_eq!(got.as_deref(), Some(orphan.as_str()));
    assert_eq!(store.tenant_by_key(&orphan).await.unwrap().unwrap().id, "default");
    assert_eq!(
        airlock_server::read_credentials_key(dir.path()).unwrap().as_deref(),
        Some(orphan.as_str()),
        "the file is left as it was"
    );
    assert!(airlock_server::bootstrap_admin_key(&*store, dir.path(), &listen)
        .await
        .unwrap()
        .is_none());

    // A deleted credentials file with keys in the store: nothing new is minted or written.
    std::fs::remove_file(dir.path().join("credentials")).unwrap();
    assert!(airlock_server::bootstrap_admin_key(&*store, dir.path(), &listen)
        .await
        .unwrap()
        .is_none());
    assert!(!dir.path().join("credentials").exists());
}

on_both!(tenant_egress_policies_and_sandbox_egress_records_round_trip);

async fn tenant_egress_policies_and_sandbox_egress_records_round_trip(b: Backend) {
    use airlock_egress::TenantPolicy;
    use airlock_server::records::EgressSpec;
    let store = b.store().await;
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

/// The Postgres schema holds the SQLite chain's end state: the same tables with the same
/// columns (their types are each database's own).
#[tokio::test]
async fn both_schemas_hold_the_same_tables_and_columns() {
    use std::collections::BTreeSet;
    type Columns = BTreeMap<String, BTreeSet<String>>;
    let collect = |rows: Vec<(String, String)>| -> Columns {
        let mut t = Columns::new();
        for (table, column) in rows {
            t.entry(table).or_default().insert(column);
        }
        t
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("airlock.db");
    drop(SqliteStore::open(&path).await.unwrap());
    let sqlite = {
        use sqlx::Connection;
        let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
            .await
            .unwrap();
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT m.name, p.name FROM sqlite_master m JOIN pragma_table_info(m.name) p
             WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%'",
        )
        .fetch_all(&mut c)
        .await
        .unwrap();
        collect(rows)
    };
    let cluster = pg_cluster::PgCluster::start();
    let url = cluster.database().await;
    drop(PgStore::connect(&url).await.unwrap());
    let postgres = {
        use sqlx::Connection;
        let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT table_name::TEXT, column_name::TEXT FROM information_schema.columns WHERE table_schema = 'public'",
        )
        .fetch_all(&mut c)
        .await
        .unwrap();
        collect(rows)
    };
    assert!(
        sqlite.contains_key("sandboxes") && sqlite.contains_key("audit"),
        "{sqlite:?}"
    );
    assert_eq!(sqlite, postgres);
}

/// A bad URL and a server that is not there are errors that say what to fix.
#[tokio::test]
async fn a_bad_or_unreachable_postgres_url_says_what_to_fix() {
    let e = PgStore::connect("mysql://u@127.0.0.1/db")
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("postgres://USER"), "{e}");
    let e = PgStore::connect("postgres://u:secret@127.0.0.1:notaport/db")
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not a Postgres URL") && !e.contains("secret"), "{e}");
    // A port nothing listens on, as `serve --store` opens it: an error (not a panic) with its
    // cause, naming what to check. The port stays bound (never listening) until then, so a
    // Postgres another test starts meanwhile can't take it.
    let held = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    held.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    let port = held.local_addr().unwrap().as_socket().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("postgres://u:secret@127.0.0.1:{port}/db");
    let e = airlock_server::open_store(Some(&url), dir.path())
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.starts_with("--store: cannot reach") && !e.contains("secret"), "{e}");
    assert!(e.contains("refused") && e.contains("check that it runs"), "{e}");
    drop(held);
    // Without --store: SQLite in the data dir.
    drop(airlock_server::open_store(None, dir.path()).await.unwrap());
    assert!(dir.path().join("airlock.db").exists());
}

#[path = "store/builds.rs"]
mod builds;
#[path = "store/events.rs"]
mod events;
#[path = "store/metrics.rs"]
mod metrics;
#[path = "store/records.rs"]
mod records;
#[path = "store/sqlite.rs"]
mod sqlite;
#[path = "store/volumes.rs"]
mod volumes;

on_both!(each_replica_records_its_own_view_of_each_node);

/// What each replica sees of a node is its own row: a silence keeps the time it began until
/// an answer clears it, and only views asked lately are read.
async fn each_replica_records_its_own_view_of_each_node(b: Backend) {
    use airlock_server::store::NodeSeen;
    let stores = b.stores(&[Lease::replica(), Lease::replica()]).await;
    let (r1, r2) = (&stores[0], &stores[1]);
    let view = |replica: &Arc<dyn Store>, since: Option<i64>| NodeSeen {
        node: "n1".into(),
        replica: replica.lease().holder.clone(),
        unanswered_since_ms: since,
    };
    r1.observe_node("n1", false, 1_000).await.unwrap();
    r1.observe_node("n1", false, 3_000).await.unwrap();
    r2.observe_node("n1", true, 3_000).await.unwrap();
    r2.observe_node("n2", true, 500).await.unwrap();
    let mut seen = r1.node_observations(1_000).await.unwrap();
    seen.sort_by(|a, b| a.replica.cmp(&b.replica));
    let mut want = vec![view(r1, Some(1_000)), view(r2, None)];
    want.sort_by(|a, b| a.replica.cmp(&b.replica));
    assert_eq!(seen, want, "n2 was asked before 1000 ms");
    // An answer clears the silence; a new one starts from then.
    r1.observe_node("n1", true, 4_000).await.unwrap();
    r1.observe_node("n1", false, 5_000).await.unwrap();
    let seen = r2.node_observations(5_000).await.unwrap();
    assert_eq!(seen, vec![view(r1, Some(5_000))]);
    // Views whose replica last asked long ago are forgotten; the rest stay.
    assert_eq!(r2.forget_node_observations(4_000).await.unwrap(), 2, "r2's two views");
    assert_eq!(r1.node_observations(0).await.unwrap(), vec![view(r1, Some(5_000))]);
}

on_both!(replicas_share_the_sign_in_windows);

/// The console's sign-in throttle counts in the store: attempts reserved at once through two
/// replicas never pass a window's limit, and failures through one fill the window for both.
async fn replicas_share_the_sign_in_windows(b: Backend) {
    use airlock_server::store::{SignInAttempt, SignInFull};
    let stores = b.stores(&[Lease::replica(), Lease::replica()]).await;
    let now = 1_000_000;
    let ids: Vec<String> = (0..12).map(|i| format!("sia_{i}")).collect();
    let tasks: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let (store, id) = (stores[i % 2].clone(), id.clone());
            tokio::spawn(async move {
                let attempt = SignInAttempt {
                    id: &id,
                    client: "192.0.2.1",
                    remote: true,
                    now_ms: now,
                    window_ms: 60_000,
                    per_client: 5,
                    remote_max: 20,
                };
                store.reserve_sign_in(&attempt).await.unwrap().is_ok()
            })
        })
        .collect();
    let mut reserved = Vec::new();
    for (id, t) in ids.iter().zip(tasks) {
        if t.await.unwrap() {
            reserved.push(id.clone());
        }
    }
    assert_eq!(reserved.len(), 5, "{reserved:?}");
    // They fail: the window is full of failures, through either replica, until the oldest
    // leaves it.
    for (i, id) in reserved.iter().enumerate() {
        stores[i % 2].end_sign_in(id, true, now + 10 + i as i64).await.unwrap();
    }
    let attempt = |id: &'static str, at: i64| SignInAttempt {
        id,
        client: "192.0.2.1",
        remote: true,
        now_ms: at,
        window_ms: 60_000,
        per_client: 5,
        remote_max: 20,
    };
    for store in &stores {
        assert_eq!(
            store.reserve_sign_in(&attempt("late", now + 1_000)).await.unwrap(),
            Err(SignInFull {
                remote: false,
                wait_ms: 60_000 + 10 - 1_000
            })
        );
    }
    assert_eq!(
        stores[1]
            .reserve_sign_in(&attempt("later", now + 60_011))
            .await
            .unwrap(),
        Ok(())
    );
    // A success leaves no trace in the window.
    stores[1].end_sign_in("later", false, now + 60_012).await.unwrap();
    assert_eq!(
        stores[0].reserve_sign_in(&attempt("next", now + 60_013)).await.unwrap(),
        Ok(())
    );
}

on_both!(replicas_share_a_sandboxs_session_starts);

/// A sandbox's session limit counts in the store: starts reserved at once through two replicas,
/// with one session already running, never pass it; an ended start gives its place back, and one
/// whose replica never ended it stops counting at its hold.
async fn replicas_share_a_sandboxs_session_starts(b: Backend) {
    use airlock_server::store::SessionStart;
    let stores = b.stores(&[Lease::replica(), Lease::replica()]).await;
    stores[0]
        .insert_create(&sandbox("s1", "t1"), &create_op("s1"), None, 10)
        .await
        .unwrap();
    stores[1]
        .insert_session(&running_session("ses1", "s1", 7))
        .await
        .unwrap();
    let now = 1_000_000;
    let start = |id: &'static str, at: i64| SessionStart {
        id,
        sandbox_id: "s1",
        limit: 4,
        now_ms: at,
        until_ms: at + 60_000,
    };
    let ids: Vec<&'static str> = vec!["st0", "st1", "st2", "st3", "st4", "st5", "st6", "st7"];
    let tasks: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let (store, id) = (stores[i % 2].clone(), *id);
            tokio::spawn(async move { store.reserve_session_start(&start(id, now)).await.unwrap().is_ok() })
        })
        .collect();
    let mut reserved = Vec::new();
    for (id, t) in ids.iter().zip(tasks) {
        if t.await.unwrap() {
            reserved.push(*id);
        }
    }
    assert_eq!(
        reserved.len(),
        3,
        "one running session and 3 starts fill 4: {reserved:?}"
    );
    for store in &stores {
        assert_eq!(
            store.reserve_session_start(&start("late", now + 1)).await.unwrap(),
            Err(4)
        );
    }
    // One ends (its session recorded elsewhere, or failed): its place is free for either.
    stores[1].end_session_start(reserved[0]).await.unwrap();
    assert_eq!(
        stores[0].reserve_session_start(&start("next", now + 2)).await.unwrap(),
        Ok(())
    );
    // The rest were never ended (their replica died): they stop counting at their hold.
    assert_eq!(
        stores[1]
            .reserve_session_start(&start("held", now + 59_999))
            .await
            .unwrap(),
        Err(4)
    );
    assert_eq!(
        stores[1]
            .reserve_session_start(&start("lapsed", now + 60_000))
            .await
            .unwrap(),
        Ok(())
    );
    // Other sandboxes are not counted with it.
    let other = SessionStart {
        sandbox_id: "s2",
        ..start("other", now + 60_000)
    };
    assert_eq!(stores[0].reserve_session_start(&other).await.unwrap(), Ok(()));
}

on_both!(news_reaches_the_other_replicas_only);

/// What a replica publishes reaches every other replica listening on the store (Postgres:
/// LISTEN/NOTIFY), in order, and not itself; SQLite, one process, has no one to tell.
async fn news_reaches_the_other_replicas_only(b: Backend) {
    use airlock_server::store::News;
    use futures_util::StreamExt;
    let stores = b.stores(&[Lease::replica(), Lease::replica()]).await;
    let Some(mut heard) = stores[1].listen().await.unwrap() else {
        assert!(matches!(b, Backend::Sqlite(_)), "Postgres listens");
        stores[0].publish(&News::SandboxEnded("s1".into())).await.unwrap();
        return;
    };
    let sent = [News::OperationFinished("op_1".into()), News::SandboxEnded("s1".into())];
    // Its own is not news to it.
    stores[1].publish(&News::SandboxEnded("own".into())).await.unwrap();
    for news in &sent {
        stores[0].publish(news).await.unwrap();
    }
    let mut got = Vec::new();
    while got.len() < sent.len() {
        let next = tokio::time::timeout(std::time::Duration::from_secs(10), heard.next()).await;
        got.push(next.expect("news within 10 s").expect("the stream goes on"));
    }
    assert_eq!(got, sent.to_vec());
}
