//! Starting from saved machines: snapshots and forks of a running sandbox, and creates restored
//! from a shape's base snapshot.

use super::*;

/// A snapshot saves a running sandbox (it runs on) under a content digest; sandboxes made from
/// it (by digest) and a fork's children start with its files and running processes, each
/// independent; deleting the snapshot leaves them be.
pub(crate) fn snapshots_and_forks_start_from_a_running_sandbox() {
    let s = server();
    let id = s.create(json!({ "template": "seed", "timeout": "10m" }));
    let counting = "i=0; while true; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.1; done";
    s.session(
        &id,
        json!({ "argv": ["sh", "-c", format!("echo parent > /home/user/p.txt; {counting}")] }),
    );
    std::thread::sleep(Duration::from_millis(700));
    let name = format!("warm-{id}");
    let (status, snap) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(json!({ "name": name })),
    );
    assert_eq!(status, 201, "{snap}");
    assert_eq!(
        (snap["sandbox_id"].as_str(), snap["template"].as_str()),
        (Some(id.as_str()), Some("seed"))
    );
    assert!(snap["bytes"].as_u64().unwrap() > 0, "{snap}");
    let snap_id = snap["id"].as_str().unwrap().to_string();
    // Content-addressed: the digest names it as its id and name do, and its image records it.
    let digest = snap["digest"].as_str().unwrap_or_default().to_string();
    assert!(
        digest.len() == 71 && digest.starts_with("sha256:") && digest[7..].bytes().all(|b| b.is_ascii_hexdigit()),
        "{snap}"
    );
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(s.data.join("images").join(&snap_id).join("image.json")).unwrap())
            .unwrap();
    assert_eq!(manifest["digest"], digest.as_str());
    for reference in [&digest, &name] {
        let (status, got) = s.call("GET", &format!("/v1/snapshots/{reference}"), None);
        assert_eq!(
            (status, got["id"].as_str()),
            (200, Some(snap_id.as_str())),
            "{reference}: {got}"
        );
    }
    // The sandbox runs on (its counter counts): saved again, it is another machine.
    let (status, later) = s.call("POST", &format!("/v1/sandboxes/{id}/snapshots"), None);
    assert_eq!(status, 201, "{later}");
    assert_ne!(later["digest"], digest.as_str(), "{later}");
    let (status, _) = s.call(
        "DELETE",
        &format!("/v1/snapshots/{}", later["id"].as_str().unwrap()),
        None,
    );
    assert_eq!(status, 204);
    let (status, again) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(json!({ "name": name })),
    );
    assert_eq!((status, again["code"].as_str()), (409, Some("conflict")), "{again}");
    let (_, listed) = s.call("GET", &format!("/v1/snapshots?sandbox_id={id}"), None);
    assert_eq!(listed["snapshots"][0]["id"], snap_id.as_str(), "{listed}");
    let (status, _) = s.call("GET", "/v1/snapshots/snap_0000000000000000000", None);
    assert_eq!(status, 404);
    let (status, err) = s.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({ "template": name, "resources": { "memory_mib": 1024 } })),
    );
    assert_eq!(
        (status, err["code"].as_str()),
        (422, Some("invalid_resources")),
        "{err}"
    );
    // Each of these has the parent's file, and its counter counting on.
    let still_counting = |sb: &str| {
        let sid = s.session(sb, json!({ "argv": ["sh", "-c", "cat /home/user/p.txt; a=$(cat /tmp/n); sleep 0.5; [ $(cat /tmp/n) -gt $a ] && echo counting"] }));
        decode(&s.events(sb, &sid, None, None), "stdout")
    };
    let from_snapshot = s.create(json!({ "template": digest }));
    let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{from_snapshot}"), None);
    assert_eq!(
        (sb["start"]["from"].as_str(), sb["template"].as_str()),
        (Some("snapshot"), Some("seed")),
        "{sb}"
    );
    assert_eq!(still_counting(&from_snapshot), "parent\ncounting\n");
    let (status, forked) = s.call("POST", &format!("/v1/sandboxes/{id}/fork"), Some(json!({ "count": 2 })));
    assert_eq!(status, 202, "{forked}");
    assert_eq!(forked["errors"], json!([]), "{forked}");
    let children: Vec<String> = forked["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert_eq!(s.wait_op(c["operation"]["id"].as_str().unwrap())["state"], "succeeded");
            c["sandbox_id"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(children.len(), 2);
    for (n, child) in children.iter().enumerate() {
        assert_eq!(still_counting(child), "parent\ncounting\n");
        let sid = s.session(
            child,
            json!({ "argv": ["sh", "-c", format!("echo {n} > /home/user/p.txt")] }),
        );
        s.events(child, &sid, None, None);
    }
    for (n, child) in children.iter().enumerate() {
        let (_, body) = s.call(
            "GET",
            &format!("/v1/sandboxes/{child}/files?path=/home/user/p.txt"),
            None,
        );
        assert_eq!(body, json!(n), "each child's disk is its own");
    }
    assert_eq!(
        still_counting(&id),
        "parent\ncounting\n",
        "the parent runs on undisturbed"
    );
    // A paused sandbox is not saved (resume it first); it can be saved again once it runs.
    assert_eq!(s.change(&id, "pause")["state"], "paused");
    let (status, err) = s.call("POST", &format!("/v1/sandboxes/{id}/fork"), None);
    assert_eq!((status, err["code"].as_str()), (409, Some("invalid_state")), "{err}");
    assert_eq!(s.change(&id, "resume")["state"], "running");
    // A fork's image goes once its children run; the snapshot's stays until deleted.
    let images = || -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(s.data.join("images"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            // Template builds' cached steps (`step_*`) are no sandbox's.
            .filter(|n| !n.starts_with("step_"))
            .filter(|n| {
                n == &snap_id || !n.starts_with("snap_") || {
                    // Another test's snapshot would not be this sandbox's.
                    let m: Value = serde_json::from_slice(
                        &std::fs::read(s.data.join("images").join(n).join("image.json")).unwrap_or_default(),
                    )
                    .unwrap_or(Value::Null);
                    m["source"] == id.as_str()
                }
            })
            .collect();
        v.sort();
        v
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while images() != vec![snap_id.clone()] {
        assert!(Instant::now() < deadline, "images left: {:?}", images());
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, _) = s.call("DELETE", &format!("/v1/snapshots/{snap_id}"), None);
    assert_eq!(status, 204);
    let (status, _) = s.call("GET", &format!("/v1/snapshots/{snap_id}"), None);
    assert_eq!(status, 404);
    assert!(images().is_empty(), "{:?}", images());
    assert_eq!(still_counting(&from_snapshot), "parent\ncounting\n");
    for sb in children.iter().chain([&from_snapshot, &id]) {
        s.delete(sb);
    }
}

/// Through the server: once the shape's base snapshot is built (the first create of it asks for
/// one), creates report `restore`, and each restored sandbox is itself: its id as hostname, its
/// own machine id, and none of another's files.
pub(crate) fn creates_restore_from_a_base_snapshot_through_the_api() {
    let s = server();
    let body =
        json!({ "template": "seed", "timeout": "10m", "resources": {"vcpu": 1, "memory_mib": 384, "disk_mib": 1536} });
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    let mut restored = Vec::new();
    while restored.len() < 2 {
        assert!(std::time::Instant::now() < deadline, "no create restored within 300 s");
        let id = s.create(body.clone());
        let (_, sb) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
        if sb["start"]["from"] == "restore" {
            restored.push(id);
        } else {
            assert_eq!(sb["start"]["from"], "boot", "{sb}");
            s.delete(&id);
            std::thread::sleep(Duration::from_secs(2));
        }
    }
    let mut machine_ids = Vec::new();
    for id in &restored {
        let sid = s.session(
            id,
            json!({ "argv": ["sh", "-c", "hostname; cat /etc/machine-id; ls /tmp"] }),
        );
        let out = decode(&s.events(id, &sid, None, None), "stdout");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.first().copied(), Some(id.as_str()), "{out}");
        assert!(
            !lines.iter().any(|l| l.starts_with("written-by-")),
            "another clone's file: {out}"
        );
        machine_ids.push(lines[1].to_string());
        put_file(s, id, &format!("/tmp/written-by-{id}"), b"mine");
    }
    assert_ne!(machine_ids[0], machine_ids[1]);
    for id in &restored {
        s.delete(id);
    }
}
