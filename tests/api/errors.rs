//! What the API refuses and how it says so: bad input, unknown ids and keys, unsupported E2B
//! options, the same answer on every route and through both doors.

use super::*;

pub(crate) fn e2b_unsupported_create_options_are_refused_by_name() {
    let s = server();
    let key = [("X-API-KEY", s.key.as_str())];
    let cases = [
        (json!({ "templateID": "base", "iam": { "tokens": {} } }), "iam"),
        (json!({ "templateID": "base", "mcp": { "exa": {} } }), "mcp"),
        (
            json!({ "templateID": "base", "network": { "allowPublicTraffic": true } }),
            "allowPublicTraffic",
        ),
        (
            json!({ "templateID": "base", "network": { "allowOut": ["198.51.100.7"] } }),
            "allowOut",
        ),
        (json!({ "templateID": "base", "colour": "red" }), "colour"),
        (json!({ "templateID": "team/name" }), "team/name"),
    ];
    for (body, needle) in cases {
        let (status, err) = s.call_with("POST", "/sandboxes", Some(body.clone()), None, &key);
        assert_eq!((status, err["code"].as_i64()), (400, Some(400)), "{body} -> {err}");
        assert!(err["message"].as_str().unwrap().contains(needle), "{body} -> {err}");
    }
    // Volumes are supported: a mount of one the tenant lacks is a 404 naming it.
    let body = json!({ "templateID": "base", "volumeMounts": [{ "name": "no-such-volume", "path": "/mnt" }] });
    let (status, err) = s.call_with("POST", "/sandboxes", Some(body), None, &key);
    assert_eq!((status, err["code"].as_i64()), (404, Some(404)), "{err}");
    assert!(err["message"].as_str().unwrap().contains("no-such-volume"), "{err}");
    let (status, err) = s.call_with(
        "POST",
        "/sandboxes",
        Some(json!({ "templateID": "base" })),
        None,
        &[("X-API-KEY", "nope")],
    );
    assert_eq!((status, err["code"].as_i64()), (401, Some(401)), "{err}");
}

pub(crate) fn bad_input_gets_clear_4xx_errors() {
    let s = server();
    let cases: Vec<(Value, u16, &str, &str)> = vec![
        (json!({ "template": "nope" }), 404, "template_not_found", "nope"),
        (json!({ "template": 7 }), 422, "invalid_argument", "template"),
        (
            json!({ "template": "seed", "resources": { "vcpu": -1 } }),
            422,
            "invalid_argument",
            "vcpu",
        ),
        (
            json!({ "template": "seed", "resources": { "vcpu": 0 } }),
            422,
            "invalid_resources",
            "vcpu",
        ),
        (
            json!({ "template": "seed", "resources": { "memory_mib": 16 } }),
            422,
            "invalid_resources",
            "memory_mib",
        ),
        (
            json!({ "template": "seed", "resources": { "disk_mib": 1 } }),
            422,
            "invalid_resources",
            "disk_mib",
        ),
        (
            json!({ "template": "seed", "timeout": "soon" }),
            422,
            "invalid_argument",
            "timeout",
        ),
        (
            json!({ "template": "seed", "timeout": "48h" }),
            422,
            "invalid_argument",
            "timeout",
        ),
        (
            json!({ "template": "seed", "runtime": "fc" }),
            422,
            "invalid_argument",
            "fc",
        ),
        (
            json!({ "template": "seed", "colour": "red" }),
            422,
            "invalid_argument",
            "colour",
        ),
        (
            json!({ "template": "team/name" }),
            404,
            "template_not_found",
            "team/name",
        ),
    ];
    for (body, status, code, needle) in cases {
        let (got, err) = s.call("POST", "/v1/sandboxes", Some(body.clone()));
        assert_eq!((got, err["code"].as_str()), (status, Some(code)), "{body} -> {err}");
        assert!(err["message"].as_str().unwrap().contains(needle), "{body} -> {err}");
    }
    let (status, err) = s.raw_post("/v1/sandboxes", "{\"template\": ");
    assert_eq!((status, err["code"].as_str()), (400, Some("bad_request")));
    let (status, err) = s.raw_post("/v1/sandboxes", "[1, 2]");
    assert_eq!(status, 422, "{err}");
    let id = shared();
    let (status, err) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        Some(json!({ "argv": [] })),
    );
    assert_eq!((status, err["code"].as_str()), (422, Some("invalid_argument")));
    let (status, err) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        Some(json!({ "argv": ["/no/such/program"] })),
    );
    assert_eq!((status, err["code"].as_str()), (400, Some("invalid_argument")), "{err}");
    let (status, err) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        Some(json!({ "argv": ["true"], "user": "ghost" })),
    );
    assert_eq!(status, 400, "{err}");
}

pub(crate) fn unknown_ids_are_404_and_keys_are_checked() {
    let s = server();
    for (path, code) in [
        ("/v1/sandboxes/0000000000000000dead", "sandbox_not_found"),
        ("/v1/operations/op_nope", "operation_not_found"),
        ("/v1/templates/nope", "template_not_found"),
        ("/v1/nothing-here", "route_not_found"),
    ] {
        let (status, err) = s.call("GET", path, None);
        assert_eq!((status, err["code"].as_str()), (404, Some(code)), "{path}: {err}");
        assert!(err["message"].is_string());
    }
    let id = shared();
    let (status, err) = s.call("GET", &format!("/v1/sandboxes/{id}/sessions/ses_nope"), None);
    assert_eq!(
        (status, err["code"].as_str()),
        (404, Some("session_not_found")),
        "{err}"
    );
    let (status, err) = s.call_with("GET", "/v1/sandboxes", None, None, &[]);
    assert_eq!((status, err["code"].as_str()), (401, Some("unauthorized")));
    let (status, _) = s.call_with("GET", "/v1/sandboxes", None, Some("ak_wrong"), &[]);
    assert_eq!(status, 401);
    let (status, sys) = s.call("GET", "/v1/system", None);
    assert_eq!(status, 200);
    assert!(["kvm", "tcg"].contains(&sys["accel"].as_str().unwrap()));
    let (_, t) = s.call("GET", "/v1/templates/seed", None);
    assert!(t["digest"].as_str().unwrap().starts_with("sha256:"));
    let (_, doc) = s.call_with("GET", "/openapi-m1.json", None, None, &[]);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    assert!(doc["paths"]["/v1/sandboxes/{id}/sessions/{sid}/stream"].is_object());
}

/// Every `/v1/sandboxes/{id}...` route answers a well-formed but unknown id the same way.
pub(crate) fn missing_sandbox_has_one_code_on_every_route() {
    let s = server();
    let id = "00000000000000c0ffee";
    let sid = "ses_0000000000000000";
    let b = |p: &str| format!("/v1/sandboxes/{id}{p}");
    let routes: Vec<(&str, String, Option<Value>)> = vec![
        ("GET", b(""), None),
        ("DELETE", b(""), None),
        ("POST", b("/pause"), None),
        ("POST", b("/resume"), None),
        ("GET", b("/sessions"), None),
        ("POST", b("/sessions"), Some(json!({ "argv": ["true"] }))),
        ("GET", b(&format!("/sessions/{sid}")), None),
        ("GET", b(&format!("/sessions/{sid}/stream")), None),
        (
            "POST",
            b(&format!("/sessions/{sid}/stdin")),
            Some(json!({ "data": "", "eof": true })),
        ),
        (
            "POST",
            b(&format!("/sessions/{sid}/signal")),
            Some(json!({ "signal": "SIGTERM" })),
        ),
        (
            "POST",
            b(&format!("/sessions/{sid}/resize")),
            Some(json!({ "cols": 80, "rows": 24 })),
        ),
        ("GET", b("/files?path=/tmp/x"), None),
        ("PUT", b("/files?path=/tmp/x"), Some(json!("bytes"))),
        ("DELETE", b("/files?path=/tmp/x"), None),
        ("GET", b("/files/list?path=/tmp"), None),
    ];
    let mut wrong = Vec::new();
    for (method, path, body) in routes {
        let (status, err) = s.call(method, &path, body);
        if (status, err["code"].as_str()) != (404, Some("sandbox_not_found")) || !err["message"].is_string() {
            wrong.push(format!("{method} {path} -> {status} {err}"));
        }
    }
    assert!(wrong.is_empty(), "not 404 sandbox_not_found:\n{}", wrong.join("\n"));
}

/// One check of environment variable names behind both doors: same refusal, same reason.
pub(crate) fn env_names_are_refused_alike_by_both_doors() {
    let s = server();
    let (status, native) = s.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({ "template": "seed", "env": { "1BAD": "x" } })),
    );
    assert_eq!(
        (status, native["code"].as_str()),
        (422, Some("invalid_argument")),
        "{native}"
    );
    let message = native["message"].as_str().unwrap();
    let reason = message
        .strip_prefix("env: ")
        .unwrap_or_else(|| panic!("message is not `env: <reason>`: {message}"));
    assert!(reason.contains("1BAD"), "{message}");
    let (status, e2b) = s.call_with(
        "POST",
        "/sandboxes",
        Some(json!({ "templateID": "base", "envVars": { "1BAD": "x" } })),
        None,
        &[("X-API-KEY", &s.key)],
    );
    assert_eq!((status, e2b["code"].as_i64()), (400, Some(400)), "{e2b}");
    assert!(
        e2b["message"].as_str().unwrap().contains(reason),
        "E2B message {e2b} lacks the native reason {reason:?}"
    );
}
