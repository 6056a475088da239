//! The `airlock` binary's own checks, without a server or a VM: egress configuration at startup
//! and `airlock tenant policy` / `airlock tenant quota`.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn airlock(data_dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_airlock"));
    cmd.arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .env_remove("AIRLOCK_EGRESS_PROFILES")
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
fn tenant_policy_set_and_show() {
    let dir = tempfile::tempdir().unwrap();
    let ok = |args: &[&str]| {
        let out = airlock(dir.path(), args, &[]);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap_or(serde_json::Value::Null)
    };
    ok(&["key", "create", "--tenant", "acme"]);
    let empty = serde_json::json!({"domains": [], "ips": [], "cidrs": []});
    let shown = ok(&["tenant", "policy", "show", "--tenant", "acme"]);
    assert_eq!(shown["policy"]["allow"], empty, "{shown}");
    let set = ok(&[
        "tenant",
        "policy",
        "set",
        "--tenant",
        "acme",
        "--allow-domain",
        "PyPI.org.",
        "--allow-domain",
        "files.pythonhosted.org",
        "--allow-cidr",
        "203.0.113.0/24",
        "--allow-cidr",
        "198.51.100.7",
        "--deny-domain",
        "evil.test",
        "--deny-cidr",
        "203.0.113.64/26",
    ]);
    let want = serde_json::json!({
        "allow": {"domains": ["files.pythonhosted.org", "pypi.org"], "ips": ["198.51.100.7"], "cidrs": ["203.0.113.0/24"]},
        "deny": {"domains": ["evil.test"], "ips": [], "cidrs": ["203.0.113.64/26"]},
    });
    assert_eq!(set["policy"], want, "{set}");
    assert_eq!(ok(&["tenant", "policy", "show", "--tenant", "acme"])["policy"], want);

    // A wildcard (or a malformed entry) is refused by name and changes nothing.
    for (flag, entry) in [
        ("--allow-domain", "*.pypi.org"),
        ("--deny-domain", ".evil.test"),
        ("--allow-cidr", "203.0.113.1/24"),
        ("--allow-cidr", "pypi.org"),
    ] {
        let out = airlock(
            dir.path(),
            &["tenant", "policy", "set", "--tenant", "acme", flag, entry],
            &[],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(entry),
            "{flag} {entry}: {stderr}"
        );
    }
    assert_eq!(ok(&["tenant", "policy", "show", "--tenant", "acme"])["policy"], want);

    // An unknown tenant is named.
    let out = airlock(dir.path(), &["tenant", "policy", "show", "--tenant", "nobody"], &[]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("nobody"));
    // `set` with nothing allows nothing.
    let cleared = ok(&["tenant", "policy", "set", "--tenant", "acme"]);
    assert_eq!(cleared["policy"]["allow"], empty);
}

#[test]
fn tenant_quota_set_and_show() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| airlock(dir.path(), args, &[]);
    let json = |out: &Output| serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap_or_default();
    assert!(run(&["key", "create", "--tenant", "acme"]).status.success());
    // Nothing set: every limit is the server's default (null).
    let shown = run(&["tenant", "quota", "show", "--tenant", "acme"]);
    assert!(shown.status.success());
    assert_eq!(json(&shown)["quota"]["vcpu"], serde_json::Value::Null);
    let set = run(&[
        "tenant", "quota", "set", "--tenant", "acme", "--sandboxes", "3", "--vcpu", "6",
        "--creates-per-minute", "10",
    ]);
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    let q = &json(&run(&["tenant", "quota", "show", "--tenant", "acme"]))["quota"];
    assert_eq!((q["sandboxes"].as_u64(), q["vcpu"].as_u64()), (Some(3), Some(6)), "{q}");
    assert_eq!((q["creates_per_minute"].as_u64(), &q["memory_mib"]), (Some(10), &serde_json::Value::Null));
    // A zero is refused, naming the limit; what was set stays.
    let out = run(&["tenant", "quota", "set", "--tenant", "acme", "--vcpu", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("vcpu") && err.contains("at least 1"), "{err}");
    assert_eq!(json(&run(&["tenant", "quota", "show", "--tenant", "acme"]))["quota"]["vcpu"], 6);
    // An unknown tenant is named.
    let out = run(&["tenant", "quota", "show", "--tenant", "nobody"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("nobody"));
}
