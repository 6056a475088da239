//! The console account (`root@local`) and the admin routes.

use super::*;

async fn login(server: &Server, username: &str, password: &str) -> (u16, Value) {
    login_response(server, username, password).await.json().await
}

async fn login_response(server: &Server, username: &str, password: &str) -> Resp {
    server
        .send(
            Method::POST,
            "/v1/admin/login",
            &[("content-type", "application/json")],
            Body::from(json!({"username": username, "password": password}).to_string()),
        )
        .await
}

/// `root@local`: a generated password on a first start without one (returned once, stored only
/// hashed), no default password anywhere, short-lived admin tokens that a new password ends; the
/// admin routes refuse tenant keys; deleting a tenant revokes its keys and deletes its sandboxes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_account_and_admin_routes() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    let generated = server
        .core()
        .ensure_console_account(None)
        .await
        .unwrap()
        .expect("a generated password");
    let core = server.core().clone();
    assert!(generated.len() >= 20);
    assert!(
        core.ensure_console_account(None).await.unwrap().is_none(),
        "only the first start makes one"
    );
    let db = std::fs::read(tmp.path().join("airlock.db")).unwrap();
    assert!(
        !db.windows(generated.len()).any(|w| w == generated.as_bytes()),
        "only its hash is stored"
    );
    for (user, pw) in [
        ("root@local", ""),
        ("root@local", "admin"),
        ("root@local", "password"),
        ("root@local", "root"),
        ("admin", "admin"),
    ] {
        let (status, body) = login(&server, user, pw).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (401, Some("unauthorized")),
            "{user}/{pw}: {body}"
        );
    }
    // Five failures fill the minute's window: the next sign-in, even with the right password,
    // is refused before any password is checked, saying when to retry.
    let resp = login_response(&server, "root@local", &generated).await;
    let retry_after: u64 = resp.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    let (status, body) = resp.json().await;
    assert_eq!((status, body["code"].as_str()), (429, Some("rate_limited")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("failed sign-ins"), "{body}");
    let rows = core.store().audit(&Default::default(), 100).await.unwrap();
    assert!(rows.iter().any(|r| r.action == "login" && r.result == "throttled"));
    drop(core);
    // The window is in the store, which every replica shares: a restart does not forgive it.
    let server = server.restart().await;
    let core = server.core().clone();
    let (status, body) = login(&server, "root@local", &generated).await;
    assert_eq!((status, body["code"].as_str()), (429, Some("rate_limited")), "{body}");
    // The minute passes (its failures leave the window, as they would by then).
    {
        use sqlx::Connection;
        let url = format!("sqlite://{}", tmp.path().join("airlock.db").display());
        let mut db = sqlx::SqliteConnection::connect(&url).await.unwrap();
        sqlx::query("UPDATE sign_in_attempts SET at_ms = at_ms - 60000")
            .execute(&mut db)
            .await
            .unwrap();
    }
    let (status, body) = login(&server, "root", &generated).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("unauthorized")),
        "only root@local: {body}"
    );
    let (status, t) = login(&server, "root@local", &generated).await;
    assert_eq!(status, 200, "{t}");
    let token = t["token"].as_str().unwrap().to_string();
    assert!(t["expires_at"].is_string());

    // The admin token administers; a tenant key gets 403, nothing 401; the token is no tenant key.
    assert_eq!(server.v1_as(&token, Method::GET, "/admin/tenants", None).await.0, 200);
    // The node's counts and pools: the platform account's view of `/v1/system`.
    let (status, sys) = server.v1_as(&token, Method::GET, "/admin/system", None).await;
    assert_eq!(status, 200, "{sys}");
    assert!(sys["capacity"]["cpus"].is_u64() && sys["pools"].is_array(), "{sys}");
    let (status, body) = server.v1(Method::GET, "/admin/tenants", None).await;
    assert_eq!((status, body["code"].as_str()), (403, Some("forbidden")), "{body}");
    assert_eq!(
        server
            .json(Method::GET, "/v1/admin/tenants", &[], Body::empty())
            .await
            .0,
        401
    );
    assert_eq!(server.v1_as(&token, Method::GET, "/sandboxes", None).await.0, 401);

    // A second tenant with a key and a sandbox; deleting the tenant takes both.
    let (status, _) = server
        .v1_as(&token, Method::POST, "/admin/tenants", Some(json!({"name": "two"})))
        .await;
    assert_eq!(status, 201);
    let (status, bad) = server
        .v1_as(
            &token,
            Method::POST,
            "/admin/tenants",
            Some(json!({"name": "Two Words"})),
        )
        .await;
    assert_eq!((status, bad["code"].as_str()), (422, Some("invalid_argument")), "{bad}");
    let (status, k) = server
        .v1_as(
            &token,
            Method::POST,
            "/admin/tenants/two/keys",
            Some(json!({"name": "ci", "e2b": true})),
        )
        .await;
    assert_eq!(status, 201, "{k}");
    let key = k["key"].as_str().unwrap().to_string();
    assert!(
        key.starts_with("e2b_") && k["id"].as_str().unwrap().starts_with("key_"),
        "{k}"
    );
    let (status, created) = server
        .v1_as(&key, Method::POST, "/sandboxes", Some(json!({"template": "seed"})))
        .await;
    assert_eq!(status, 202, "{created}");
    let id = created["sandbox_id"].as_str().unwrap().to_string();
    let op_path = format!("/operations/{}", created["operation"]["id"].as_str().unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.v1_as(&key, Method::GET, &op_path, None).await.1["state"] != "succeeded" {
        assert!(Instant::now() < deadline, "the create did not finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The default tenant never sees it.
    assert_eq!(server.v1(Method::GET, &format!("/sandboxes/{id}"), None).await.0, 404);
    let (status, gone) = server.v1_as(&token, Method::DELETE, "/admin/tenants/two", None).await;
    assert_eq!((status, gone["sandboxes_deleting"].as_u64()), (202, Some(1)), "{gone}");
    assert_eq!(server.v1_as(&key, Method::GET, "/tenant", None).await.0, 401);
    let deadline = Instant::now() + Duration::from_secs(30);
    while core.store().sandbox_by_id(&id).await.unwrap().unwrap().state != SandboxState::Deleted {
        assert!(Instant::now() < deadline, "the tenant's sandbox was not deleted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, _) = server.v1_as(&token, Method::GET, "/admin/tenants/two", None).await;
    assert_eq!(status, 404);
    let (status, _) = server
        .v1_as(&token, Method::DELETE, "/admin/tenants/default", None)
        .await;
    assert_eq!(status, 409);

    // The audit log has each step, with no secret in it.
    let (_, audit) = server.v1_as(&token, Method::GET, "/admin/audit?limit=1000", None).await;
    let text = audit.to_string();
    for action in [
        "login",
        "tenant.create",
        "key.create",
        "sandbox.create",
        "tenant.delete",
        "sandbox.delete",
    ] {
        assert!(text.contains(&format!("\"{action}\"")), "no {action} in {audit}");
    }
    for secret in [generated.as_str(), token.as_str(), key.as_str()] {
        assert!(!text.contains(secret));
    }
    // Who: the key by its public id, the platform account for what it did.
    let key_actor = format!("key:{}", k["id"].as_str().unwrap());
    let rows = audit["entries"].as_array().unwrap();
    assert!(
        rows.iter()
            .any(|r| r["action"] == "sandbox.create" && r["actor"] == key_actor.as_str()),
        "{audit}"
    );
    assert!(
        rows.iter()
            .any(|r| r["action"] == "sandbox.delete" && r["actor"] == "root@local"),
        "{audit}"
    );

    // A password chosen later replaces the generated one and ends its sign-ins.
    assert!(core
        .ensure_console_account(Some("chosen-password-42"))
        .await
        .unwrap()
        .is_none());
    assert_eq!(server.v1_as(&token, Method::GET, "/admin/tenants", None).await.0, 401);
    assert_eq!(login(&server, "root@local", &generated).await.0, 401);
    assert_eq!(login(&server, "root@local", "chosen-password-42").await.0, 200);
    let short = core.ensure_console_account(Some("short")).await.unwrap_err();
    assert!(short.to_string().contains("at least 12"), "{short}");
    server.stop().await;
    assert_no_vms(tmp.path());
}
