//! The `airlock` binary's own checks, without a server or a VM: egress configuration and the
//! store's URL at startup.
//! (The admin commands go through the API: `tests/api/cli.rs` runs them on the api suite's server.)

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn airlock(data_dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_airlock"));
    cmd.arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .env_remove("AIRLOCK_EGRESS_PROFILES")
        .env_remove("AIRLOCK_STORE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("run airlock");
    // A command that should stop at once must not hang the suite.
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("airlock {args:?} still runs after 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn a_wildcard_or_malformed_egress_profile_stops_serve_naming_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    for (profiles, entry) in [
        (
            r#"{"web": {"domains": ["pypi.org", "*.example.com"]}}"#,
            "*.example.com",
        ),
        (r#"{"web": {"domains": [".example.com"]}}"#, ".example.com"),
        (r#"{"web": {"cidrs": ["10.0.0.1/8"]}}"#, "10.0.0.1/8"),
        (r#"{"web": {"ips": ["1.2.3"]}}"#, "1.2.3"),
        (r#"{"web": {"domain": ["a.test"]}}"#, "domain"),
        (r#"not json"#, "AIRLOCK_EGRESS_PROFILES"),
    ] {
        let out = airlock(
            dir.path(),
            &["serve", "--listen", "127.0.0.1:0"],
            &[("AIRLOCK_EGRESS_PROFILES", profiles)],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{profiles}: serve started");
        assert!(stderr.contains(entry), "{profiles}: {stderr}");
        assert!(stderr.contains("AIRLOCK_EGRESS_PROFILES"), "{profiles}: {stderr}");
    }
    // It stopped before building or opening anything.
    assert!(!dir.path().join("airlock.db").exists());
}

#[test]
fn a_store_url_that_is_not_postgres_stops_serve_naming_the_form() {
    let dir = tempfile::tempdir().unwrap();
    for url in ["mysql://u@127.0.0.1/db", "postgres://u:secret@127.0.0.1:notaport/db"] {
        let out = airlock(dir.path(), &["serve", "--listen", "127.0.0.1:0", "--store", url], &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{url}: serve started");
        assert!(
            stderr.contains("postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE"),
            "{url}: {stderr}"
        );
        assert!(
            stderr.contains("--store") && !stderr.contains("secret"),
            "{url}: {stderr}"
        );
    }
    // It stopped before building or opening anything.
    assert!(!dir.path().join("airlock.db").exists());
}
