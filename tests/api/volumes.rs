//! Volumes through `/v1` and the CLI: a workspace two sandboxes share in turn, read-only mounts,
//! the content API (no path out of the volume), tenants kept apart, the quota, and a server
//! killed mid-write.

use super::*;

fn put(s: &Server, key: &str, volume: &str, path: &str, body: &[u8]) -> (u16, Value) {
    let r = ureq::put(&format!("{}/v1/volumes/{volume}/files?path={path}", s.url))
        .set("Authorization", &format!("Bearer {key}"))
        .timeout(Duration::from_secs(120))
        .send_bytes(body);
    let resp = match r {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("PUT {path}: {e}"),
    };
    let status = resp.status();
    (status, resp.into_json().unwrap_or(Value::Null))
}

fn get(s: &Server, key: &str, volume: &str, path: &str) -> (u16, Vec<u8>) {
    let r = ureq::get(&format!("{}/v1/volumes/{volume}/files?path={path}", s.url))
        .set("Authorization", &format!("Bearer {key}"))
        .timeout(Duration::from_secs(120))
        .call();
    let resp = match r {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("GET {path}: {e}"),
    };
    let status = resp.status();
    let mut body = Vec::new();
    std::io::Read::read_to_end(&mut resp.into_reader(), &mut body).unwrap();
    (status, body)
}

/// A tiny wheel, built in the guest (no index, no network): `pip install` of it into a venv on
/// the volume is what a workspace keeps.
const MAKE_WHEEL: &str = r#"python3 - <<'EOF'
import zipfile, hashlib, base64
files = {"volpkg/__init__.py": "ANSWER = 42\n",
         "volpkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: volpkg\nVersion: 1.0\n",
         "volpkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
record = []
with zipfile.ZipFile("/tmp/volpkg-1.0-py3-none-any.whl", "w") as z:
    for name, text in files.items():
        z.writestr(name, text)
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text)}")
    record.append("volpkg-1.0.dist-info/RECORD,,")
    z.writestr("volpkg-1.0.dist-info/RECORD", "\n".join(record) + "\n")
EOF"#;

pub(crate) fn volumes_keep_a_workspace_across_sandboxes_and_to_their_tenant() {
    let s = server();
    build_template(&s.data, "base");
    let name = format!("ws-{}", std::process::id());
    let (status, vol) = s.call("POST", "/v1/volumes", Some(json!({ "name": name, "size_mib": 512 })));
    assert_eq!(status, 201, "{vol}");
    let id = vol["id"].as_str().unwrap().to_string();
    assert!(vol["token"].as_str().is_some_and(|t| t.starts_with("vt_")), "{vol}");
    let (status, again) = s.call("POST", "/v1/volumes", Some(json!({ "name": name })));
    assert_eq!((status, again["code"].as_str()), (409, Some("conflict")), "{again}");

    // The content API writes before any sandbox has it (a helper VM mounts it).
    let (status, stat) = put(s, &s.key, &name, "/notes/hello.txt", b"written by the API\n");
    assert_eq!(status, 200, "{stat}");
    assert_eq!(stat["path"], "/notes/hello.txt", "{stat}");

    // The first sandbox: a venv on the volume, a package installed into it.
    let mount = json!([{ "volume": name, "path": "/workspace" }]);
    let a = s.create(json!({ "template": "base", "timeout": "10m", "volumes": mount }));
    let (out, code) = sh(
        s,
        &a,
        &format!(
            "set -e\n{MAKE_WHEEL}\npython3 -m venv /workspace/venv && /workspace/venv/bin/pip install -q --no-index /tmp/volpkg-1.0-py3-none-any.whl && cat /workspace/notes/hello.txt && echo from-a > /workspace/a.txt && stat -c %U /workspace"
        ),
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("written by the API") && out.trim_end().ends_with("user"),
        "{out}"
    );
    // Mounted read-write by `a`: a second writer or a reader is refused, naming it.
    let (status, refused) = s.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({ "template": "seed", "volumes": [{ "volume": id, "path": "/w", "read_only": true }] })),
    );
    assert_eq!((status, refused["code"].as_str()), (409, Some("conflict")), "{refused}");
    assert!(refused["message"].as_str().unwrap().contains(&a), "{refused}");
    let (status, busy) = s.call("DELETE", &format!("/v1/volumes/{name}"), None);
    assert_eq!(status, 409, "{busy}");
    assert!(busy["message"].as_str().unwrap().contains(&a), "{busy}");
    let (status, listed) = s.call("GET", &format!("/v1/volumes/{id}"), None);
    assert_eq!(status, 200);
    assert_eq!(
        listed["mounted_by"],
        json!([{ "sandbox_id": a, "read_only": false }]),
        "{listed}"
    );
    // A snapshot of it is refused, not taken without its volume.
    let (status, snap) = s.call("POST", &format!("/v1/sandboxes/{a}/snapshots"), None);
    assert_eq!(status, 409, "{snap}");
    // While `a` runs, the content API goes through it: it sees what `a` wrote.
    let (status, body) = get(s, &s.key, &id, "/a.txt");
    assert_eq!((status, &body[..]), (200, &b"from-a\n"[..]));
    s.delete(&a);

    // The second sandbox imports what the first installed, and writes what the API reads.
    let b = s.create(json!({ "template": "base", "timeout": "10m", "volumes": mount }));
    let (out, code) = sh(
        s,
        &b,
        "/workspace/venv/bin/python -c 'import volpkg; print(volpkg.ANSWER)' && echo from-b > /workspace/b.txt && ln -s /etc /workspace/etc-link && ln -s /etc/hostname /workspace/host-link && sync",
    );
    assert_eq!((out.trim(), code), ("42", 0));
    s.delete(&b);
    let (status, body) = get(s, &s.key, &id, "/b.txt");
    assert_eq!((status, &body[..]), (200, &b"from-b\n"[..]));
    // Nothing outside the volume through `..` or a symlink the guest planted.
    for escape in ["/../../etc/passwd", "/etc-link/passwd", "/host-link"] {
        let (status, body) = get(s, &s.key, &id, escape);
        assert!(
            (400..500).contains(&status) && !String::from_utf8_lossy(&body).contains("root:"),
            "{escape}: {status} {}",
            String::from_utf8_lossy(&body)
        );
    }
    let (status, _) = put(s, &s.key, &id, "/etc-link/planted", b"x");
    assert!((400..500).contains(&status), "a write through a symlink: {status}");
    let (status, list) = s.call("GET", &format!("/v1/volumes/{id}/files/list?path=/"), None);
    assert_eq!(status, 200, "{list}");
    let names: Vec<&str> = list["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for want in ["a.txt", "b.txt", "notes", "venv", "etc-link"] {
        assert!(names.contains(&want), "{want} not in {names:?}");
    }
    assert!(!names.contains(&"lost+found"), "{names:?}");

    // Read-only: two readers at once, writes refused inside the guest.
    let ro = json!([{ "volume": name, "path": "/data", "read_only": true }]);
    let r1 = s.create(json!({ "template": "seed", "timeout": "10m", "volumes": ro }));
    let r2 = s.create(json!({ "template": "seed", "timeout": "10m", "volumes": ro }));
    // Restored from the base snapshot (or claimed from a pool), the volume attached after.
    for r in [&r1, &r2] {
        let (_, got) = s.call("GET", &format!("/v1/sandboxes/{r}"), None);
        assert_ne!(got["start"]["from"], "boot", "{got}");
    }
    for r in [&r1, &r2] {
        let (out, code) = sh(s, r, "cat /data/b.txt; echo x > /data/new.txt");
        assert_ne!(code, 0, "{out}");
        assert!(
            out.starts_with("from-b") && out.contains("Read-only file system"),
            "{out}"
        );
    }
    let (status, _) = put(s, &s.key, &id, "/c.txt", b"while read-only");
    assert_eq!(status, 409, "writes wait for the readers");
    s.delete(&r1);
    s.delete(&r2);

    // Another tenant sees nothing of it: every call answers like a missing volume.
    let tenant = format!("vt{}", std::process::id());
    let (status, _) = s.admin_call("POST", "/v1/admin/tenants", Some(json!({ "name": tenant })));
    assert_eq!(status, 201);
    let (status, k) = s.admin_call("POST", &format!("/v1/admin/tenants/{tenant}/keys"), Some(json!({})));
    assert_eq!(status, 201, "{k}");
    let other = k["key"].as_str().unwrap().to_string();
    let missing = |status: u16, body: &Value| {
        assert_eq!(
            (status, body["code"].as_str()),
            (404, Some("volume_not_found")),
            "{body}"
        )
    };
    for key in [id.as_str(), name.as_str()] {
        let (status, body) = s.call_with("GET", &format!("/v1/volumes/{key}"), None, Some(&other), &[]);
        missing(status, &body);
        let (status, body) = s.call_with("DELETE", &format!("/v1/volumes/{key}"), None, Some(&other), &[]);
        missing(status, &body);
        let (status, body) = s.call_with(
            "POST",
            "/v1/sandboxes",
            Some(json!({ "template": "seed", "volumes": [{ "volume": key, "path": "/x" }] })),
            Some(&other),
            &[],
        );
        missing(status, &body);
    }
    let (status, body) = get(s, &other, &id, "/b.txt");
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&body));
    let (status, list) = s.call_with("GET", "/v1/volumes", None, Some(&other), &[]);
    assert_eq!((status, list["volumes"].as_array().map(Vec::len)), (200, Some(0)));

    // The quota: a volume past volume_mib is refused by name.
    let (status, q) = s.admin_call(
        "PUT",
        &format!("/v1/admin/tenants/{tenant}/quota"),
        Some(json!({ "volume_mib": 100 })),
    );
    assert_eq!(status, 200, "{q}");
    let (status, ok) = s.call_with(
        "POST",
        "/v1/volumes",
        Some(json!({ "name": "small", "size_mib": 64 })),
        Some(&other),
        &[],
    );
    assert_eq!(status, 201, "{ok}");
    let (status, over) = s.call_with(
        "POST",
        "/v1/volumes",
        Some(json!({ "name": "big", "size_mib": 64 })),
        Some(&other),
        &[],
    );
    assert_eq!((status, over["code"].as_str()), (429, Some("quota_exceeded")), "{over}");
    assert!(over["message"].as_str().unwrap().contains("volume_mib"), "{over}");
    let (status, grown) = s.call_with(
        "PATCH",
        "/v1/volumes/small",
        Some(json!({ "size_mib": 200 })),
        Some(&other),
        &[],
    );
    assert_eq!(status, 429, "{grown}");
    let (status, _) = s.call_with("DELETE", "/v1/volumes/small", None, Some(&other), &[]);
    assert_eq!(status, 204);

    // Grown, and through the CLI: listed with its size, then deleted.
    let (status, grown) = s.call("PATCH", &format!("/v1/volumes/{id}"), Some(json!({ "size_mib": 768 })));
    assert_eq!((status, grown["size_mib"].as_u64()), (200, Some(768)), "{grown}");
    let out = s.cli(&["volume", "ls"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&name) && text.contains("768M"), "{text}");
    let out = s.cli(&["volume", "rm", &name]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (status, body) = s.call("GET", &format!("/v1/volumes/{id}"), None);
    assert_eq!(status, 404, "{body}");
    assert!(!s.data.join("volumes").join(format!("{id}.ext4")).exists());
}

/// `kill -9` of the server during a write through the content API: the next server finds the
/// volume usable and what was written and synced before it intact.
pub(crate) fn a_volume_survives_a_server_killed_mid_write() {
    let data = own_data_dir("volumes-kill");
    let mut s = Server::start(&data);
    let (status, vol) = s.call("POST", "/v1/volumes", Some(json!({ "name": "keep", "size_mib": 256 })));
    assert_eq!(status, 201, "{vol}");
    let id = vol["id"].as_str().unwrap().to_string();
    let kept: Vec<u8> = (0..(4u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
        .collect();
    let (status, _) = put(&s, &s.key, &id, "/kept.bin", &kept);
    assert_eq!(status, 200);
    // Synced: a sandbox mounted it (the helper synced and stepped aside) and ended.
    let sb = s.create(json!({ "template": "seed", "timeout": "5m", "volumes": [{ "volume": id, "path": "/v" }] }));
    let (out, code) = sh(&s, &sb, "sha256sum /v/kept.bin");
    assert_eq!(code, 0, "{out}");
    s.delete(&sb);
    // A big write, and the server killed while it streams.
    let url = format!("{}/v1/volumes/{id}/files?path=/torn.bin", s.url);
    let key = s.key.clone();
    let writer = std::thread::spawn(move || {
        let big = vec![7u8; 96 << 20];
        let _ = ureq::put(&url)
            .set("Authorization", &format!("Bearer {key}"))
            .timeout(Duration::from_secs(60))
            .send_bytes(&big);
    });
    // Killed once the helper that takes the write is up and the bytes flow.
    let helpers_up = |s: &Server| {
        std::fs::read_to_string(&s.log)
            .unwrap_or_default()
            .matches("volume helper up")
            .count()
    };
    let t = Instant::now();
    while helpers_up(&s) < 2 && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(helpers_up(&s), 2, "the write's helper never came up");
    std::thread::sleep(Duration::from_millis(700));
    assert!(!writer.is_finished(), "the write ended before the kill");
    s.kill9();
    let _ = writer.join();
    // A new server: the helper of the dead one is gone, and the volume mounts.
    let s = Server::start(&data);
    let (status, body) = get(&s, &s.key, &id, "/kept.bin");
    assert_eq!(status, 200);
    assert!(body == kept, "the synced file changed ({} bytes back)", body.len());
    let sb = s.create(json!({ "template": "seed", "timeout": "5m", "volumes": [{ "volume": id, "path": "/v" }] }));
    let (out, code) = sh(&s, &sb, "echo after > /v/after.txt && cat /v/after.txt && ls /v");
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("after\n") && out.contains("kept.bin"), "{out}");
    s.delete(&sb);
    let (status, _) = s.call("DELETE", &format!("/v1/volumes/{id}"), None);
    assert_eq!(status, 204);
}
