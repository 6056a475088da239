//! The node's budgets (memory, vCPU, disk at full size) and tenants' quotas and create rate,
//! refused by name on both doors and never overshot by concurrent creates.

use super::*;

// ---------------------------------------------------------------------------------------------
// 5. Node budgets

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_budget_admits_two_refuses_the_third_and_frees_on_delete() {
    let tmp = fresh();
    // 2048 MiB less a 1024 MiB reserve: room for two 512 MiB sandboxes (the tenant may have
    // the whole node).
    let config = Config {
        memory_reserve_mib: 1024,
        tenant_share: 1.0,
        ..Config::default()
    };
    let server = Server::start_sized(tmp.path(), 20, node(64, 2048, 1 << 30), config).await;
    let a = server.running_sandbox().await;
    let b = server.e2b_sandbox().await;

    let (status, body) = server
        .v1(Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
        .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["code"], "node_budget_exceeded", "{body}");
    let m = body["message"].as_str().unwrap();
    for part in [
        "memory budget",
        "asks for 512 MiB",
        "0 MiB of 1024 MiB are left",
        "--memory-reserve-mib",
    ] {
        assert!(m.contains(part), "{part:?} not in {m:?}");
    }
    let (status, body) = server
        .e2b(Method::POST, "/sandboxes", json!({ "templateID": "base" }))
        .await;
    assert_eq!((status, &body["code"]), (503, &json!(503)), "{body}");
    assert!(body["message"].as_str().unwrap().contains("memory budget"), "{body}");
    // Nothing was recorded for the refused creates.
    let (_, list) = server.v1(Method::GET, "/sandboxes", None).await;
    assert_eq!(list["sandboxes"].as_array().unwrap().len(), 2, "{list}");

    // More than the whole budget never fits: a bad request, not a wait.
    let (status, body) = server
        .v1(
            Method::POST,
            "/sandboxes",
            Some(json!({ "template": "seed", "resources": { "memory_mib": 1536 } })),
        )
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (422, Some("invalid_resources")),
        "{body}"
    );

    // A deleted sandbox gives its memory back.
    server.delete(&a).await;
    let c = server.running_sandbox().await;
    let (status, body) = server
        .v1(
            Method::POST,
            "/sandboxes",
            Some(json!({ "template": "seed", "resources": { "memory_mib": 128 } })),
        )
        .await;
    assert_eq!(status, 503, "full again: {body}");
    server.delete(&b.id).await;
    server.delete(&c).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_never_overshoot_the_vcpu_budget() {
    let tmp = fresh();
    // 3 CPUs, no overcommit: three 1-vCPU sandboxes, whoever asks.
    let config = Config {
        vcpu_overcommit: 1.0,
        tenant_share: 1.0,
        ..Config::default()
    };
    let server = Arc::new(Server::start_sized(tmp.path(), 20, node(3, 1 << 20, 1 << 30), config).await);
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let server = server.clone();
            tokio::spawn(async move {
                if i % 2 == 0 {
                    let (s, b) = server
                        .v1(Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
                        .await;
                    (s, b["sandbox_id"].as_str().map(String::from), b)
                } else {
                    let (s, b) = server
                        .e2b(Method::POST, "/sandboxes", json!({ "templateID": "base" }))
                        .await;
                    (s, b["sandboxID"].as_str().map(String::from), b)
                }
            })
        })
        .collect();
    let mut admitted = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            (202 | 201, Some(id), _) => admitted.push(id),
            (503, _, b) => {
                let m = b["message"].as_str().unwrap();
                assert!(m.contains("vcpu budget") && m.contains("of 3 vCPUs"), "{b}");
            }
            (s, _, b) => panic!("unexpected {s} {b}"),
        }
    }
    assert_eq!(admitted.len(), 3, "admitted {admitted:?}");
    for id in &admitted {
        server.await_state(id, "running", Duration::from_secs(10)).await;
        server.delete(id).await;
    }
    let server = Arc::into_inner(server).unwrap();
    server.stop().await;
    assert_no_vms(tmp.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_budget_counts_disks_at_full_size_and_keeps_the_reserve() {
    let tmp = fresh();
    let config = Config {
        disk_reserve_mib: 2048,
        tenant_share: 1.0,
        ..Config::default()
    };
    // 5000 MiB free less the reserve: one 2048 MiB disk fits, a second does not.
    let server = Server::start_sized(tmp.path(), 20, node(64, 1 << 20, 5000), config.clone()).await;
    let a = server.running_sandbox().await;
    let (status, body) = server
        .v1(Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("node_budget_exceeded")),
        "{body}"
    );
    let m = body["message"].as_str().unwrap();
    assert!(
        m.contains("disk budget") && m.contains("asks for 2048 MiB") && m.contains("904 MiB of 2952 MiB"),
        "{m}"
    );
    server.delete(&a).await;
    server.stop().await;
    assert_no_vms(tmp.path());

    // Free space below the reserve: nothing is admitted.
    let tmp = fresh();
    let server = Server::start_sized(tmp.path(), 20, node(64, 1 << 20, 1000), config).await;
    let (status, body) = server
        .v1(Method::POST, "/sandboxes", Some(json!({ "template": "seed" })))
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("node_budget_exceeded")),
        "{body}"
    );
    assert!(body["message"].as_str().unwrap().contains("0 MiB of 0 MiB"), "{body}");
    server.stop().await;
    assert_no_vms(tmp.path());
}

// ---------------------------------------------------------------------------------------------
// Egress (issue 10): profiles, the tenant's base policy, the E2B door's network options

/// Each tenant quota, exhausted, refuses the next create by name (both doors), creates nothing,
/// and `GET /v1/tenant` shows the limits in force and the usage against them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_quota_refuses_by_name_and_creates_nothing() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    let (status, info) = server.v1(Method::GET, "/tenant", None).await;
    assert_eq!(status, 200, "{info}");
    assert_eq!(info["name"], "default");
    // The server's defaults where the tenant has none of its own.
    assert_eq!(info["quota"]["sandboxes"], 20, "{info}");
    // Half the node's vCPU budget (1024 CPUs x 16), 60 creates a minute.
    assert_eq!(info["quota"]["vcpu"], 8192, "{info}");
    assert_eq!(info["quota"]["creates_per_minute"], 60, "{info}");

    for (quota, first, second, needle) in [
        (
            json!({"sandboxes": 1}),
            (1, 512, 2048),
            (1, 512, 2048),
            "has 1 live sandboxes, its quota of 1 (sandboxes)",
        ),
        (
            json!({"vcpu": 3}),
            (2, 512, 2048),
            (2, 512, 2048),
            "vcpu quota is 3: its live sandboxes hold 2 and this one asks for 2",
        ),
        (
            json!({"memory_mib": 1024}),
            (1, 768, 2048),
            (1, 512, 2048),
            "memory_mib quota is 1024: its live sandboxes hold 768 and this one asks for 512",
        ),
        (
            json!({"disk_mib": 5000}),
            (1, 512, 3000),
            (1, 512, 3000),
            "disk_mib quota is 5000: its live sandboxes and snapshots hold 3000 and this one asks for 3000",
        ),
    ] {
        set_quota(&server, quota.clone()).await;
        let (status, body) = create_sized(&server, first.0, first.1, first.2).await;
        assert_eq!(status, 202, "{quota}: {body}");
        server.wait_op(body["operation"]["id"].as_str().unwrap()).await;
        let before = live_count(&server).await;
        let (status, body) = create_sized(&server, second.0, second.1, second.2).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (429, Some("quota_exceeded")),
            "{quota}: {body}"
        );
        let m = body["message"].as_str().unwrap();
        assert!(m.contains(needle) && m.contains("tenant default"), "{quota}: {m}");
        // The E2B door (whose creates take the template's 1 vCPU, 512 MiB) refuses alike.
        if quota.get("sandboxes").is_some() || quota.get("memory_mib").is_some() {
            let (status, body) = server
                .e2b(Method::POST, "/sandboxes", json!({ "templateID": "base" }))
                .await;
            assert_eq!((status, body["code"].as_u64()), (429, Some(429)), "{quota}: {body}");
            assert!(body["message"].as_str().unwrap().contains(needle), "{body}");
        }
        assert_eq!(live_count(&server).await, before, "a refused create made nothing");
        let (_, info) = server.v1(Method::GET, "/tenant", None).await;
        let key = quota.as_object().unwrap().keys().next().unwrap().clone();
        assert_eq!(info["quota"][&key], quota[&key], "{info}");
        let used = info["usage"][&key].as_u64().unwrap();
        assert!(used > 0 && used <= quota[&key].as_u64().unwrap(), "{info}");
        delete_all(&server).await;
    }

    // Zero is refused by name, with the fix.
    let err = server
        .core()
        .set_tenant_quota(
            "default",
            airlock_server::model::Quota {
                vcpu: Some(0),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("vcpu") && err.to_string().contains("at least 1"),
        "{err}"
    );
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// `creates_per_minute`: past it, 429 `rate_limited` with `Retry-After` on both doors; failed
/// and deleted sandboxes still count (it limits creates, not live sandboxes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_per_minute_is_a_429_with_retry_after_on_both_doors() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    set_quota(&server, json!({"creates_per_minute": 2})).await;
    let a = server.running_sandbox().await;
    server.delete(&a).await;
    server.running_sandbox().await;
    let body = json!({ "template": "seed" }).to_string();
    let auth = format!("Bearer {}", server.key);
    let r = server
        .send(
            Method::POST,
            "/v1/sandboxes",
            &[("authorization", &auth), ("content-type", "application/json")],
            Body::from(body),
        )
        .await;
    let retry: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let (status, b) = r.json().await;
    assert_eq!((status, b["code"].as_str()), (429, Some("rate_limited")), "{b}");
    assert!(
        b["message"]
            .as_str()
            .unwrap()
            .contains("may create 2 sandboxes a minute"),
        "{b}"
    );
    let r = server
        .send(
            Method::POST,
            "/sandboxes",
            &[("x-api-key", &server.key), ("content-type", "application/json")],
            Body::from(json!({ "templateID": "base" }).to_string()),
        )
        .await;
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(r.json().await.0, 429);
    let (_, info) = server.v1(Method::GET, "/tenant", None).await;
    assert_eq!(info["usage"]["creates_last_minute"], 2, "{info}");
    // Raised: admitted at once.
    set_quota(&server, json!({"creates_per_minute": 3})).await;
    server.running_sandbox().await;
    delete_all(&server).await;
    server.stop().await;
    assert_no_vms(tmp.path());
}

/// Concurrent creates through both doors never overshoot a tenant's vcpu quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_never_overshoot_the_tenant_vcpu_quota() {
    let tmp = fresh();
    let server = Arc::new(Server::start(tmp.path(), 20, None).await);
    set_quota(&server, json!({"vcpu": 4})).await;
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let server = server.clone();
            tokio::spawn(async move {
                if i % 2 == 0 {
                    let (s, _) = create_sized(&server, 1, 512, 2048).await;
                    s == 202
                } else {
                    let (s, _) = server
                        .e2b(Method::POST, "/sandboxes", json!({ "templateID": "base" }))
                        .await;
                    s == 201
                }
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap() as usize;
    }
    assert_eq!(admitted, 4);
    let (_, info) = server.v1(Method::GET, "/tenant", None).await;
    assert_eq!(info["usage"]["vcpu"], 4, "{info}");
    delete_all(&server).await;
    Arc::try_unwrap(server).ok().unwrap().stop().await;
    assert_no_vms(tmp.path());
}
