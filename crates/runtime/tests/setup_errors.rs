//! Errors before any VM exists: missing QEMU, unwritable data dir, data dir in use.

use airlock_runtime::{Runtime, RuntimeError, RuntimeOptions};

#[tokio::test]
async fn missing_qemu_names_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let opts = RuntimeOptions {
        qemu: Some("/nonexistent/qemu-system-x86_64".into()),
        ..RuntimeOptions::new(dir.path())
    };
    let err = Runtime::open(opts).await.err().expect("must fail");
    assert!(matches!(err, RuntimeError::QemuMissing(_)), "{err}");
    assert!(err.to_string().contains("install-host-deps"), "{err}");
}

#[tokio::test]
async fn unwritable_data_dir_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plain-file");
    std::fs::write(&file, b"").unwrap();
    let err = Runtime::open(RuntimeOptions::new(file.join("data")))
        .await
        .err()
        .expect("must fail");
    assert!(matches!(err, RuntimeError::DataDirNotWritable { .. }), "{err}");
    assert!(err.to_string().contains("--data-dir"), "{err}");
}

#[tokio::test]
async fn one_runtime_per_data_dir() {
    let dir = tempfile::tempdir().unwrap();
    let first = Runtime::open(RuntimeOptions::new(dir.path())).await.unwrap();
    let err = Runtime::open(RuntimeOptions::new(dir.path()))
        .await
        .err()
        .expect("second must fail");
    assert!(matches!(err, RuntimeError::DataDirInUse(_)), "{err}");
    drop(first);
    Runtime::open(RuntimeOptions::new(dir.path()))
        .await
        .expect("free again after the first closes");
}
