//! A create's egress: profiles by header (ignored for keys), the report, the system's digest,
//! and E2B network options that only narrow the tenant's policy.

use super::*;

/// An egress configuration as `AIRLOCK_EGRESS_PROFILES` would give it.
fn egress_config(profiles: &str) -> Config {
    Config {
        egress: airlock_egress::EgressConfig::new(
            airlock_egress::PlatformDenies::new(Vec::new()),
            airlock_egress::Profiles::from_json(profiles).unwrap(),
        ),
        ..Config::default()
    }
}

const PROFILES: &str = r#"{"pypi": {"domains": ["pypi.org", "files.pythonhosted.org"], "default": true},
                           "gh": {"domains": ["github.com"]}}"#;

/// Set tenant `default`'s base policy directly on the store (as `airlock tenant policy set`).
async fn set_tenant_policy(server: &Server, json: &str) {
    let policy = airlock_egress::TenantPolicy::from_json(json).unwrap();
    let tenant = server.tenant_id().await;
    server.core().store().set_egress_policy(&tenant, &policy).await.unwrap();
}

/// `POST /v1/sandboxes` with extra headers; the sandbox is running when this returns.
async fn create_native_with(server: &Server, headers: &[(&str, &str)]) -> String {
    let auth = format!("Bearer {}", server.key);
    let mut all = vec![("authorization", auth.as_str()), ("content-type", "application/json")];
    all.extend_from_slice(headers);
    let (status, body) = server
        .send(
            Method::POST,
            "/v1/sandboxes",
            &all,
            Body::from(json!({ "template": "seed" }).to_string()),
        )
        .await
        .json()
        .await;
    assert_eq!(status, 202, "{body}");
    let id = body["sandbox_id"].as_str().unwrap().to_string();
    let op = server.wait_op(body["operation"]["id"].as_str().unwrap()).await;
    assert_eq!(op["state"], "succeeded", "{op}");
    id
}

async fn egress_report(server: &Server, id: &str) -> Value {
    let (status, body) = server.v1(Method::GET, &format!("/sandboxes/{id}/egress"), None).await;
    assert_eq!(status, 200, "{body}");
    body
}

async fn sandbox_egress(server: &Server, id: &str) -> Value {
    let (status, body) = server.v1(Method::GET, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, 200, "{body}");
    body["egress"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_profiles_header_is_ignored_on_every_create_and_the_defaults_are_fixed_for_life() {
    let tmp = fresh();
    let server = Server::start_full(tmp.path(), 20, None, Duration::ZERO, ROOMY, egress_config(PROFILES)).await;
    // No caller signs in yet: the header, naming a real profile or not, changes nothing.
    let a = create_native_with(&server, &[("x-airlock-egress-profiles", "gh")]).await;
    let b = create_native_with(&server, &[("x-airlock-egress-profiles", "nope")]).await;
    assert_eq!(
        sandbox_egress(&server, &a).await,
        json!({"profiles": ["pypi"], "sealed": false})
    );
    assert_eq!(
        sandbox_egress(&server, &b).await,
        json!({"profiles": ["pypi"], "sealed": false})
    );
    // The same on the E2B door.
    let headers = [
        ("x-api-key", server.key.as_str()),
        ("content-type", "application/json"),
        ("x-airlock-egress-profiles", "gh"),
    ];
    let (status, body) = server
        .send(
            Method::POST,
            "/sandboxes",
            &headers,
            Body::from(json!({"templateID": "base"}).to_string()),
        )
        .await
        .json()
        .await;
    assert_eq!(status, 201, "{body}");
    let c = body["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(sandbox_egress(&server, &c).await["profiles"], json!(["pypi"]));
    let report = egress_report(&server, &a).await;
    assert_eq!(
        report["policy"]["profiles"],
        json!({"pypi": {"domains": ["files.pythonhosted.org", "pypi.org"], "ips": [], "cidrs": []}})
    );

    // A restart with other defaults: live sandboxes keep theirs, new ones get the new ones.
    let key = server.key.clone();
    server.stop().await;
    let other = r#"{"pypi": {"domains": ["pypi.org"]}, "gh": {"domains": ["github.com"], "default": true}}"#;
    let server = Server::start_full(tmp.path(), 20, Some(&key), Duration::ZERO, ROOMY, egress_config(other)).await;
    assert_eq!(sandbox_egress(&server, &a).await["profiles"], json!(["pypi"]));
    let report = egress_report(&server, &a).await;
    assert_eq!(
        report["policy"]["profiles"],
        json!({"pypi": {"domains": ["pypi.org"], "ips": [], "cidrs": []}})
    );
    let d = create_native_with(&server, &[]).await;
    assert_eq!(sandbox_egress(&server, &d).await["profiles"], json!(["gh"]));
    for id in [&a, &b, &c, &d] {
        server.delete(id).await;
    }
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_report_shows_the_effective_policy_and_is_404_for_foreign_sandboxes() {
    let tmp = fresh();
    let server = Server::start_full(tmp.path(), 20, None, Duration::ZERO, ROOMY, egress_config(PROFILES)).await;
    set_tenant_policy(
        &server,
        r#"{"allow": {"domains": ["api.example.com"], "cidrs": ["203.0.113.0/24"]}, "deny": {"domains": ["pypi.org"]}}"#,
    )
    .await;
    let id = server.running_sandbox().await;
    // Carried to the node with the create: the node holds it (what its egress side serves),
    // kept beside its VMs for a restart.
    assert!(server.node_egress().report(&id).is_some());
    let spec = server.dir.join("egress").join(format!("{id}.json"));
    let kept: Value = serde_json::from_slice(&std::fs::read(&spec).unwrap()).unwrap();
    assert_eq!(kept["tenant"]["allow"]["domains"], json!(["api.example.com"]), "{kept}");
    let r = egress_report(&server, &id).await;
    assert_eq!(r["sandbox_id"], json!(id));
    let p = &r["policy"];
    assert_eq!(p["sealed"], json!(false));
    assert_eq!(
        p["tenant_allow"],
        json!({"domains": ["api.example.com"], "ips": [], "cidrs": ["203.0.113.0/24"]})
    );
    assert_eq!(
        p["tenant_deny"],
        json!({"domains": ["pypi.org"], "ips": [], "cidrs": []})
    );
    let platform: Vec<&str> = p["platform_deny"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(platform.contains(&"127.0.0.0/8 (loopback)"), "{platform:?}");
    assert!(
        platform.contains(&"169.254.0.0/16 (link-local/metadata)"),
        "{platform:?}"
    );
    assert!(p["profiles"].get("pypi").is_some(), "{p}");
    // Nothing proxied yet: zero counters, no denials.
    assert_eq!(
        r["counters"],
        json!({"tcp_allowed": 0, "tcp_denied": 0, "dns_allowed": 0, "dns_denied": 0, "bytes_sent": 0, "bytes_received": 0, "by_rule": {}})
    );
    assert_eq!(r["recent_denials"], json!([]));
    // The tenant's policy changing later does not reach a live sandbox.
    set_tenant_policy(&server, r#"{"allow": {"domains": ["other.example.com"]}}"#).await;
    assert_eq!(egress_report(&server, &id).await["policy"], r["policy"]);

    // Another tenant's sandbox answers exactly like a missing one.
    let other = server
        .core()
        .store()
        .create_key("other", KeyFormat::Airlock)
        .await
        .unwrap();
    let (s1, foreign) = server
        .v1_as(&other, Method::GET, &format!("/sandboxes/{id}/egress"), None)
        .await;
    let (s2, missing) = server.v1(Method::GET, "/sandboxes/nosuchsandbox/egress", None).await;
    assert_eq!((s1, s2), (404, 404), "{foreign} {missing}");
    assert_eq!(foreign["code"], missing["code"]);
    assert_eq!(
        foreign["message"].as_str().unwrap().replace(&id, "X"),
        missing["message"].as_str().unwrap().replace("nosuchsandbox", "X")
    );

    // Gone from the node with its VM; the recorded policy still shows.
    server.delete(&id).await;
    assert!(
        server.node_egress().report(&id).is_none(),
        "the sandbox's egress outlived it"
    );
    assert!(!spec.exists());
    let after = egress_report(&server, &id).await;
    assert_eq!(after["policy"]["tenant_allow"], r["policy"]["tenant_allow"]);
    assert!(
        server.node_egress().report(&id).is_none(),
        "a report does not bring it back"
    );
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_shows_the_egress_digest_and_profiles() {
    let tmp = fresh();
    let config = egress_config(PROFILES);
    let digest = config.egress.digest();
    let server = Server::start_full(tmp.path(), 20, None, Duration::ZERO, ROOMY, config).await;
    let (status, body) = server.v1(Method::GET, "/system", None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["egress"]["digest"], json!(digest));
    assert_eq!(digest.len(), 64);
    assert_eq!(
        body["egress"]["profiles"],
        json!([{"name": "gh", "default": false}, {"name": "pypi", "default": true}])
    );
    // A replica with the same profiles written differently shows the same digest.
    let same = egress_config(
        r#"{"gh": {"domains": ["GitHub.com."]}, "pypi": {"default": true, "domains": ["files.pythonhosted.org", "pypi.org"]}}"#,
    );
    assert_eq!(same.egress.digest(), digest);
    assert_ne!(
        egress_config(r#"{"gh": {"domains": ["github.com"]}}"#).egress.digest(),
        digest
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_network_options_only_narrow_the_tenant_policy() {
    let tmp = fresh();
    let server = Server::start_full(tmp.path(), 20, None, Duration::ZERO, ROOMY, egress_config(PROFILES)).await;
    set_tenant_policy(
        &server,
        r#"{"allow": {"domains": ["a.test", "b.test"], "ips": ["198.51.100.7"], "cidrs": ["203.0.113.0/24"]},
            "deny": {"domains": ["c.test"], "ips": ["203.0.113.66"]}}"#,
    )
    .await;
    let create = |body: Value| {
        let server = &server;
        async move {
            let (status, b) = server.e2b(Method::POST, "/sandboxes", body).await;
            (status, b)
        }
    };
    let id_of = |b: &Value| b["sandboxID"].as_str().unwrap().to_string();
    let mut made = Vec::new();

    // Absent or true: the tenant's default policy (base + default profiles).
    for body in [
        json!({"templateID": "base"}),
        json!({"templateID": "base", "allow_internet_access": true}),
    ] {
        let (status, b) = create(body).await;
        assert_eq!(status, 201, "{b}");
        let id = id_of(&b);
        let r = egress_report(&server, &id).await;
        assert_eq!(r["policy"]["sealed"], json!(false));
        assert_eq!(r["policy"]["tenant_allow"]["domains"], json!(["a.test", "b.test"]));
        assert_eq!(sandbox_egress(&server, &id).await["profiles"], json!(["pypi"]));
        let (_, info) = server.e2b(Method::GET, &format!("/sandboxes/{id}"), json!({})).await;
        assert_eq!(info["allowInternetAccess"], json!(true), "{info}");
        made.push(id);
    }

    // False: sealed, recorded on the sandbox.
    let (status, b) = create(json!({"templateID": "base", "allow_internet_access": false})).await;
    assert_eq!(status, 201, "{b}");
    let sealed = id_of(&b);
    assert_eq!(
        sandbox_egress(&server, &sealed).await,
        json!({"profiles": [], "sealed": true})
    );
    let r = egress_report(&server, &sealed).await;
    assert_eq!(r["policy"]["sealed"], json!(true));
    assert_eq!(
        r["policy"]["tenant_allow"],
        json!({"domains": [], "ips": [], "cidrs": []})
    );
    assert_eq!(r["policy"]["profiles"], json!({}));
    let (_, info) = server
        .e2b(Method::GET, &format!("/sandboxes/{sealed}"), json!({}))
        .await;
    assert_eq!(info["allowInternetAccess"], json!(false), "{info}");
    made.push(sealed);

    // allowOut inside the tenant's policy: exactly those entries (the common E2B form, with a
    // denyOut of everything, works: allowOut takes precedence as in E2B).
    let (status, b) = create(json!({"templateID": "base", "network": {
        "allowOut": ["a.test", "198.51.100.7", "203.0.113.0/28", "pypi.org"],
        "denyOut": ["0.0.0.0/0"], "allowPublicTraffic": false}}))
    .await;
    assert_eq!(status, 201, "{b}");
    let narrowed = id_of(&b);
    let r = egress_report(&server, &narrowed).await;
    assert_eq!(
        r["policy"]["tenant_allow"],
        json!({"domains": ["a.test", "pypi.org"], "ips": ["198.51.100.7"], "cidrs": ["203.0.113.0/28"]})
    );
    assert_eq!(
        r["policy"]["tenant_deny"]["domains"],
        json!(["c.test"]),
        "the tenant's denies stay"
    );
    assert_eq!(r["policy"]["profiles"], json!({}));
    made.push(narrowed);

    // denyOut alone adds denies to the tenant's.
    let (status, b) =
        create(json!({"templateID": "base", "network": {"denyOut": ["b.test", "198.51.100.0/24"]}})).await;
    assert_eq!(status, 201, "{b}");
    let denied = id_of(&b);
    let r = egress_report(&server, &denied).await;
    assert_eq!(r["policy"]["tenant_deny"]["domains"], json!(["b.test", "c.test"]));
    assert_eq!(r["policy"]["tenant_deny"]["cidrs"], json!(["198.51.100.0/24"]));
    assert_eq!(r["policy"]["tenant_allow"]["domains"], json!(["a.test", "b.test"]));
    made.push(denied);

    // Widening, wildcards and public traffic are 400s naming the entry; nothing is created.
    let (_, before) = server.v1(Method::GET, "/sandboxes", None).await;
    for (network, needle) in [
        (json!({"allowOut": ["other.test"]}), "other.test"),
        (json!({"allowOut": ["c.test"]}), "c.test"),
        (json!({"allowOut": ["github.com"]}), "github.com"),
        (json!({"allowOut": ["1.1.1.1"]}), "1.1.1.1"),
        (json!({"allowOut": ["203.0.112.0/23"]}), "203.0.112.0/23"),
        (json!({"allowOut": ["203.0.113.64/28"]}), "203.0.113.64/28"),
        (json!({"allowOut": ["*.a.test"]}), "*.a.test"),
        (json!({"denyOut": ["*.b.test"]}), "*.b.test"),
        (json!({"allowOut": ["10.0.0.1/8"]}), "10.0.0.1/8"),
        (json!({"allowPublicTraffic": true}), "allowPublicTraffic"),
    ] {
        let (status, b) = create(json!({"templateID": "base", "network": network})).await;
        assert_eq!(status, 400, "{network}: {b}");
        assert_eq!(b["code"], json!(400), "{b}");
        let m = b["message"].as_str().unwrap();
        assert!(m.contains(needle), "{network}: {b}");
        let field = network.as_object().unwrap().keys().next().unwrap().clone();
        assert!(m.contains(&field), "the message names the option as E2B spells it: {b}");
    }
    // A sealed create still refuses a wildcard by name.
    let (status, b) = create(json!({"templateID": "base", "allow_internet_access": false,
        "network": {"allowOut": ["*.a.test"]}}))
    .await;
    assert_eq!(status, 400, "{b}");
    let (_, after) = server.v1(Method::GET, "/sandboxes", None).await;
    assert_eq!(
        before["sandboxes"].as_array().unwrap().len(),
        after["sandboxes"].as_array().unwrap().len()
    );
    assert_eq!(
        server.node_egress().held(),
        made.len(),
        "refused creates leave no egress state"
    );

    for id in &made {
        server.delete(id).await;
    }
    server.stop().await;
    assert_no_vms(tmp.path());
}
