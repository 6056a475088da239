//! Shared fixtures for the real-VM tests: one tokio runtime, one airlock runtime on a test data
//! dir, the seed template built (or found up to date) once, and one booted sandbox that tests
//! share where their operations are independent of each other.

#![allow(dead_code)]

use airlock_proto::ProcessSpec;
use airlock_runtime::template::BuildOptions;
use airlock_runtime::{CreateVm, Resources, Runtime, RuntimeOptions, Vm};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

pub fn test_data_dir() -> PathBuf {
    std::env::var_os("AIRLOCK_TEST_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/var/lib/airlock-test".into())
}

/// All tests run on one tokio runtime: agent connections and VMM monitors live on it.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    let rt = RT.get_or_init(|| {
        // VMs whose launching process exited re-parent to us, so we can reap them.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        tracing_subscriber_init();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    });
    rt.block_on(f)
}

fn tracing_subscriber_init() {
    let filter = std::env::var("AIRLOCK_LOG").unwrap_or_else(|_| "airlock_runtime=info".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// Build the seed template in the test data dir, or find it up to date.
pub async fn build_seed() {
    let store = airlock_runtime::template::TemplateStore::new(
        airlock_runtime::datadir::DataDir::open(test_data_dir()).unwrap(),
    );
    tokio::task::spawn_blocking(move || store.build_seed(&BuildOptions::default()))
        .await
        .unwrap()
        .expect("seed template builds");
}

pub fn runtime() -> Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            block_on(async {
                build_seed().await;
                Runtime::open(RuntimeOptions::new(test_data_dir()))
                    .await
                    .expect("runtime opens")
            })
        })
        .clone()
}

pub fn small() -> Resources {
    Resources {
        vcpu: 1,
        memory_mib: 256,
        disk_mib: 1024,
    }
}

pub fn create() -> Arc<Vm> {
    let rt = runtime();
    block_on(rt.create(CreateVm {
        id: None,
        template: "seed".into(),
        resources: small(),
        image: None,
        env: Default::default(),
        volumes: Vec::new(),
    }))
    .expect("sandbox boots")
}

/// The sandbox tests share; it lives for the whole test process.
pub fn shared() -> Arc<Vm> {
    static SHARED: OnceLock<Arc<Vm>> = OnceLock::new();
    SHARED.get_or_init(create).clone()
}

pub fn argv(args: &[&str]) -> ProcessSpec {
    ProcessSpec {
        argv: args.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

pub fn sh(script: &str) -> ProcessSpec {
    argv(&["/bin/sh", "-c", script])
}
