//! The `airlock` binary's other faces: the user CLI (and the Python example), `serve`'s TLS
//! flags and its first start's console password, the admin commands.

use super::*;

pub(crate) fn cli_run_exec_and_python_example() {
    let s = server();
    let env = [("AIRLOCK_URL", s.url.as_str()), ("AIRLOCK_API_KEY", s.key.as_str())];
    let out = Command::new(BIN)
        .args(["run", "--", "sh", "-c", "echo from-cli; exit 4"])
        .envs(env)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from-cli\n");
    assert_eq!(out.status.code(), Some(4));
    let out = Command::new(BIN)
        .args(["exec", shared(), "--user", "root", "--", "id", "-un"])
        .envs(env)
        .output()
        .unwrap();
    assert_eq!(
        (String::from_utf8_lossy(&out.stdout).as_ref(), out.status.code()),
        ("root\n", Some(0))
    );
    let out = Command::new(BIN)
        .args(["sandbox", "get", "0000000000000000dead"])
        .envs(env)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("HTTP 404"));
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/first_sandbox.py");
    let out = Command::new("python3").arg(example).envs(env).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("hello from airlock") && stdout.trim_end().ends_with("ok"),
        "{stdout}"
    );
}

/// `serve` with TLS files it cannot use stops at once, naming the files; half a flag set is a
/// usage error naming the missing flag.
pub(crate) fn serve_refuses_unusable_tls_files() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(
        &cert,
        "-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    std::fs::write(&key, "").unwrap();
    let data = test_data_dir();
    let run = |args: &[&str]| {
        let mut child = Command::new(BIN)
            .args(["--data-dir", data.to_str().unwrap(), "serve", "--listen"])
            .arg(format!("127.0.0.1:{}", free_port()))
            .args(args)
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("serve kept running with {args:?}");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let out = child.wait_with_output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let tls_listen = format!("127.0.0.1:{}", free_port());
    let (code, stderr) = run(&[
        "--tls-listen",
        &tls_listen,
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    assert_ne!(code, Some(0));
    assert!(stderr.contains(&format!("--tls-cert {}", cert.display())), "{stderr}");
    let (code, stderr) = run(&["--tls-listen", &tls_listen, "--tls-cert", cert.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--tls-key"), "{stderr}");
}

/// A first start without `AIRLOCK_CONSOLE_PASSWORD` and without a terminal (its output is a log
/// file) leaves a generated password in `<data-dir>/console-password` (0600) and names the file
/// in the log, never the password; it signs in (through the CLI), no usual default does, a
/// restart writes nothing, and the password is nowhere else in the data dir.
pub(crate) fn a_first_start_prints_a_generated_console_password_once() {
    use std::os::unix::fs::PermissionsExt;
    let data = own_data_dir("console");
    let mut first = Server::start_console(&data, &[], None);
    let log_of = |s: &Server| {
        std::fs::read_to_string(data.join(format!("serve-{}.log", s.url.rsplit(':').next().unwrap()))).unwrap()
    };
    let text = log_of(&first);
    let file = data.join("console-password");
    let password = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}; the log: {text}", file.display()))
        .trim()
        .to_string();
    assert!(password.len() >= 20, "{password}");
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
    assert!(!text.contains(&password), "the password is in the log: {text}");
    assert!(
        text.contains(&file.display().to_string()),
        "the log names the file: {text}"
    );
    let marker = "generated password";

    let login = |s: &Server, password: &str| {
        ureq::post(&format!("{}/v1/admin/login", s.url))
            .send_json(json!({"username": "root@local", "password": password}))
            .map(|r| r.status())
            .unwrap_or_else(|e| match e {
                ureq::Error::Status(code, _) => code,
                other => panic!("{other}"),
            })
    };
    for guess in ["", "admin", "password", "airlock"] {
        assert_eq!(login(&first, guess), 401, "{guess:?} signs in");
    }
    let cli_login = |s: &Server, password: &str| {
        Command::new(BIN)
            .arg("--data-dir")
            .arg(&data)
            .arg("login")
            .env("AIRLOCK_URL", &s.url)
            .env("AIRLOCK_CONSOLE_PASSWORD", password)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let out = cli_login(&first, &password);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The token `login` stored administers.
    let out = Command::new(BIN)
        .arg("--data-dir")
        .arg(&data)
        .args(["tenant", "ls"])
        .env("AIRLOCK_URL", &first.url)
        .env_remove("AIRLOCK_ADMIN_TOKEN")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("default"));
    first.stop();

    // A second start keeps the account and hands out no password.
    let written = std::fs::metadata(&file).unwrap().modified().unwrap();
    let mut second = Server::start_console(&data, &[], None);
    let again = log_of(&second);
    assert!(!again.contains(marker) && !again.contains(&password), "{again}");
    assert_eq!(
        std::fs::metadata(&file).unwrap().modified().unwrap(),
        written,
        "written once"
    );
    assert!(cli_login(&second, &password).status.success());
    second.stop();
    // Only its hash is kept: no file the server wrote holds the password (the logs, which were
    // just checked, and the file handed over aside; the templates are the shared dir's).
    for entry in walk(&data) {
        if entry.extension().is_some_and(|e| e == "log") || entry.starts_with(data.join("blobs")) || entry == file {
            continue;
        }
        let bytes = std::fs::read(&entry).unwrap_or_default();
        assert!(
            !bytes.windows(password.len()).any(|w| w == password.as_bytes()),
            "{} holds the password",
            entry.display()
        );
    }
    let _ = std::fs::remove_dir_all(&data);
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else if path.is_file() {
            files.push(path);
        }
    }
    files
}

/// The admin commands, through the API as `root@local`: tenants, keys (named, listed, revoked
/// with immediate effect), quotas, egress policies; a tenant key can't administer; the audit log
/// has a row for each action; no secret reaches the server's log.
pub(crate) fn admin_cli_manages_tenants_keys_quotas_and_policies() {
    let s = server();
    let tenant = format!("acme-{}", std::process::id());
    let created = s.cli_ok(&["tenant", "create", &tenant]);
    assert_eq!(created["name"], tenant.as_str(), "{created}");
    let again = s.cli(&["tenant", "create", &tenant]);
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("exists"));
    let listed = s.cli_ok(&["tenant", "ls"]);
    assert!(listed["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["name"] == tenant.as_str()));

    // A named key, shown once; it works, and `key ls` shows it without the secret.
    let key = s.cli_ok(&["key", "create", "--tenant", &tenant, "--name", "ci"]);
    let key = key.as_str().unwrap().to_string();
    assert!(key.starts_with("ak_"), "{key}");
    let (status, me) = s.call_with("GET", "/v1/tenant", None, Some(&key), &[]);
    assert_eq!((status, me["name"].as_str()), (200, Some(tenant.as_str())), "{me}");
    let keys = s.cli_ok(&["key", "ls", "--tenant", &tenant]);
    let k = &keys["keys"][0];
    assert_eq!(
        (k["name"].as_str(), k["prefix"].as_str()),
        (Some("ci"), Some(&key[..8])),
        "{keys}"
    );
    assert!(k["last_used_at"].is_string() && k["revoked_at"].is_null(), "{keys}");
    assert!(!keys.to_string().contains(&key), "a listing never shows the key");
    // A tenant key can't administer.
    let (status, body) = s.call_with("GET", "/v1/admin/tenants", None, Some(&key), &[]);
    assert_eq!((status, body["code"].as_str()), (403, Some("forbidden")), "{body}");
    let (status, _) = s.call_with(
        "POST",
        &format!("/v1/admin/tenants/{tenant}/keys"),
        Some(serde_json::json!({})),
        Some(&key),
        &[],
    );
    assert_eq!(status, 403);

    // Quotas: set, shown, a zero refused by name.
    let q = s.cli_ok(&[
        "tenant",
        "quota",
        "set",
        "--tenant",
        &tenant,
        "--sandboxes",
        "3",
        "--vcpu",
        "6",
    ]);
    assert_eq!(
        (q["sandboxes"].as_u64(), q["vcpu"].as_u64(), &q["memory_mib"]),
        (Some(3), Some(6), &Value::Null),
        "{q}"
    );
    let out = s.cli(&["tenant", "quota", "set", "--tenant", &tenant, "--vcpu", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("vcpu") && err.contains("at least 1"),
        "{err}"
    );
    assert_eq!(s.cli_ok(&["tenant", "quota", "show", "--tenant", &tenant])["vcpu"], 6);
    let info = s.cli_ok(&["tenant", "get", &tenant]);
    assert_eq!(
        (info["quota"]["sandboxes"].as_u64(), info["usage"]["sandboxes"].as_u64()),
        (Some(3), Some(0)),
        "{info}"
    );

    // The nodes: single-host mode has one, in the server, ready.
    let nodes = s.cli_ok(&["nodes"]);
    assert_eq!(
        (
            nodes[0]["name"].as_str(),
            nodes[0]["state"].as_str(),
            nodes.as_array().map(Vec::len)
        ),
        (Some(""), Some("ready"), Some(1)),
        "{nodes}"
    );
    assert!(nodes[0]["cpus"].as_u64() >= Some(1), "{nodes}");

    // Egress policy: normalized, wildcards and malformed entries refused by name.
    let set = s.cli_ok(&[
        "tenant",
        "policy",
        "set",
        "--tenant",
        &tenant,
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
    assert_eq!(set, want);
    for (flag, entry) in [
        ("--allow-domain", "*.pypi.org"),
        ("--deny-domain", ".evil.test"),
        ("--allow-cidr", "203.0.113.1/24"),
        ("--allow-cidr", "pypi.org"),
    ] {
        let out = s.cli(&["tenant", "policy", "set", "--tenant", &tenant, flag, entry]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(entry),
            "{flag} {entry}: {stderr}"
        );
    }
    assert_eq!(s.cli_ok(&["tenant", "policy", "show", "--tenant", &tenant]), want);
    let out = s.cli(&["tenant", "policy", "show", "--tenant", "nobody-here"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("nobody-here"));

    // Revoked: the very next call is refused.
    let id = k["id"].as_str().unwrap();
    s.cli_ok(&["key", "revoke", id, "--tenant", &tenant]);
    let (status, _) = s.call_with("GET", "/v1/tenant", None, Some(&key), &[]);
    assert_eq!(status, 401);
    let keys = s.cli_ok(&["key", "ls", "--tenant", &tenant]);
    assert!(keys["keys"][0]["revoked_at"].is_string(), "{keys}");

    // Removing the tenant revokes its other keys too; `default` stays.
    let second = s.cli_ok(&["key", "create", "--tenant", &tenant]);
    let second = second.as_str().unwrap().to_string();
    s.cli_ok(&["tenant", "rm", &tenant]);
    assert_eq!(s.call_with("GET", "/v1/tenant", None, Some(&second), &[]).0, 401);
    let out = s.cli(&["tenant", "rm", "default"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("bootstrap key"));

    // The audit log names each action (never a secret).
    let token = std::fs::read_to_string(s.data.join("admin-token")).unwrap();
    // Newest first, by tenant and by action (the shared data dir keeps every run's rows).
    let audit = |query: &str| {
        let (status, page) = s.call_with(
            "GET",
            &format!("/v1/admin/audit?{query}"),
            None,
            Some(token.trim()),
            &[],
        );
        assert_eq!(status, 200, "{page}");
        page
    };
    let ours = audit(&format!("tenant={tenant}&limit=1000"));
    let rows = ours["entries"].as_array().unwrap();
    for action in [
        "tenant.create",
        "key.create",
        "tenant.quota",
        "tenant.policy",
        "key.revoke",
        "tenant.delete",
    ] {
        assert!(
            rows.iter()
                .any(|r| r["action"] == action && r["tenant"] == tenant.as_str()),
            "no {action} row: {ours}"
        );
    }
    assert!(rows
        .iter()
        .any(|r| r["action"] == "tenant.quota" && r["result"] == "invalid_argument"));
    let seqs: Vec<i64> = rows.iter().map(|r| r["seq"].as_i64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[0] > w[1]), "newest first: {seqs:?}");
    let refused = audit("action=auth.key&limit=5");
    assert!(refused["entries"][0]["result"] == "unauthorized", "{refused}");
    let logins = audit("action=login&limit=1");
    assert_eq!(logins["entries"][0]["actor"], "root@local", "{logins}");
    let text = format!("{ours}{refused}{logins}");
    for secret in [key.as_str(), second.as_str(), CONSOLE_PASSWORD, token.trim()] {
        assert!(!text.contains(secret), "a secret in the audit log");
    }
    // Nor in any log the server wrote.
    for entry in std::fs::read_dir(&s.data).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if name.ends_with(".log") {
            let log = std::fs::read_to_string(entry.path()).unwrap_or_default();
            for secret in [key.as_str(), second.as_str(), CONSOLE_PASSWORD, token.trim()] {
                assert!(!log.contains(secret), "a secret in {name}");
            }
        }
    }
}
