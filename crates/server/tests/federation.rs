//! Signed-in requests (`Authorization: Bearer <JWT>`): tokens from a configured issuer sign in
//! (RS256 and ES256, keys from a JWKS file), everything else about a token is a 401; only a
//! signed-in create may pick egress profiles by header. Keys are made by `openssl`, tokens signed
//! here with them.

mod common;

use airlock_server::core::federation::Federation;
use airlock_server::core::Config;
use axum::body::Body;
use axum::http::Method;
use base64::Engine as _;
use common::*;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const ISSUER: &str = "https://idp.test";
const AUDIENCE: &str = "airlock";
const PROFILES: &str = r#"{"pypi": {"domains": ["pypi.org"], "default": true}, "gh": {"domains": ["github.com"]}}"#;

fn openssl(args: &[&str]) -> Vec<u8> {
    let out = Command::new("openssl").args(args).output().expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

struct Keys {
    rsa_pem: Vec<u8>,
    ec_pem: Vec<u8>,
    /// An RSA key the issuer never published (a forger's).
    forger_pem: Vec<u8>,
}

/// Two keys in a JWKS file, an issuers file naming it, and a forger's key.
fn make_keys(dir: &Path) -> Keys {
    let rsa = dir.join("rsa.pem");
    let ec = dir.join("ec.pem");
    let forger = dir.join("forger.pem");
    for (path, args) in [
        (
            &rsa,
            vec!["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
        ),
        (
            &forger,
            vec!["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
        ),
        (
            &ec,
            vec!["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"],
        ),
    ] {
        let mut a = args.clone();
        a.extend(["-out", path.to_str().unwrap()]);
        openssl(&a);
    }
    let modulus = String::from_utf8(openssl(&["rsa", "-in", rsa.to_str().unwrap(), "-noout", "-modulus"])).unwrap();
    let n = hex::decode(modulus.trim().trim_start_matches("Modulus=")).unwrap();
    let ec_der = openssl(&["pkey", "-in", ec.to_str().unwrap(), "-pubout", "-outform", "DER"]);
    let point = &ec_der[ec_der.len() - 64..];
    let jwks = json!({"keys": [
        {"kty": "RSA", "kid": "rsa-1", "use": "sig", "alg": "RS256", "n": b64(&n), "e": "AQAB"},
        {"kty": "EC", "kid": "ec-1", "use": "sig", "alg": "ES256", "crv": "P-256", "x": b64(&point[..32]), "y": b64(&point[32..])},
    ]});
    std::fs::write(dir.join("jwks.json"), jwks.to_string()).unwrap();
    let issuers = json!({"leeway_seconds": 30, "issuers": [{
        "issuer": ISSUER, "audience": AUDIENCE, "jwks_file": dir.join("jwks.json"), "tenant_claim": "org",
        "tenants": ["acme", "ghost"]}]});
    std::fs::write(dir.join("issuers.json"), issuers.to_string()).unwrap();
    Keys {
        rsa_pem: std::fs::read(&rsa).unwrap(),
        ec_pem: std::fs::read(&ec).unwrap(),
        forger_pem: std::fs::read(&forger).unwrap(),
    }
}

fn now() -> i64 {
    airlock_server::records::now_ms() / 1000
}

fn claims() -> Value {
    json!({"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "org": "acme", "exp": now() + 600, "nbf": now() - 10})
}

fn sign_rsa(pem: &[u8], kid: &str, claims: &Value) -> String {
    let mut h = Header::new(Algorithm::RS256);
    h.kid = Some(kid.into());
    jsonwebtoken::encode(&h, claims, &EncodingKey::from_rsa_pem(pem).unwrap()).unwrap()
}

fn sign_ec(pem: &[u8], claims: &Value) -> String {
    let mut h = Header::new(Algorithm::ES256);
    h.kid = Some("ec-1".into());
    jsonwebtoken::encode(&h, claims, &EncodingKey::from_ec_pem(pem).unwrap()).unwrap()
}

fn with(mut base: Value, field: &str, value: Value) -> Value {
    base[field] = value;
    base
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_in_requests_verify_every_claim_and_only_they_pick_profiles() {
    let tmp = fresh();
    let keys_dir = tempfile::tempdir().unwrap();
    let keys = make_keys(keys_dir.path());
    let config = Config {
        federation: Federation::from_file(&keys_dir.path().join("issuers.json")).unwrap(),
        egress: airlock_egress::EgressConfig::new(
            airlock_egress::PlatformDenies::new(Vec::new()),
            airlock_egress::Profiles::from_json(PROFILES).unwrap(),
        ),
        ..Config::default()
    };
    let server = Server::start_full(tmp.path(), 20, None, Duration::ZERO, ROOMY, config).await;
    server.core().store.create_tenant("acme").await.unwrap();

    // Good tokens, both algorithms: signed in as tenant acme.
    for token in [
        sign_rsa(&keys.rsa_pem, "rsa-1", &claims()),
        sign_ec(&keys.ec_pem, &claims()),
    ] {
        let (status, me) = server.v1_as(&token, Method::GET, "/tenant", None).await;
        assert_eq!((status, me["name"].as_str()), (200, Some("acme")), "{me}");
    }

    // An issuer speaks only for the tenants it is bound to (`tenants`): a good token naming
    // another tenant, `default` included, is refused and audited.
    server.core().store.create_tenant("beta").await.unwrap();
    for other in ["default", "beta"] {
        let token = sign_rsa(&keys.rsa_pem, "rsa-1", &with(claims(), "org", json!(other)));
        let (status, body) = server.v1_as(&token, Method::GET, "/tenant", None).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (401, Some("unauthorized")),
            "{other}: {body}"
        );
        assert!(
            body["message"].as_str().unwrap().contains("may not name"),
            "{other}: {body}"
        );
        let (status, body) = server
            .json(
                Method::GET,
                "/v2/sandboxes",
                &[("authorization", &format!("Bearer {token}"))],
                Body::empty(),
            )
            .await;
        assert_eq!(status, 401, "{other} on the E2B door: {body}");
        let rows = server.core().store.audit(&Default::default(), 1000).await.unwrap();
        assert!(
            rows.iter().any(|r| r.action == "auth.jwt"
                && r.result == "unauthorized"
                && r.tenant.as_deref() == Some(other)
                && r.actor == "jwt:https://idp.test#alice"),
            "{other}: {rows:?}"
        );
    }

    // Everything else is a 401 saying why (and nothing about the keys).
    let cases = [
        (
            "expired",
            sign_rsa(&keys.rsa_pem, "rsa-1", &with(claims(), "exp", json!(now() - 3600))),
            "expired",
        ),
        (
            "not yet valid",
            sign_rsa(&keys.rsa_pem, "rsa-1", &with(claims(), "nbf", json!(now() + 3600))),
            "not valid yet",
        ),
        ("forged", sign_rsa(&keys.forger_pem, "rsa-1", &claims()), "signature"),
        (
            "wrong issuer",
            sign_rsa(
                &keys.rsa_pem,
                "rsa-1",
                &with(claims(), "iss", json!("https://evil.test")),
            ),
            "issuer",
        ),
        (
            "wrong audience",
            sign_rsa(&keys.rsa_pem, "rsa-1", &with(claims(), "aud", json!("someone-else"))),
            "audience",
        ),
        (
            "unknown tenant",
            sign_rsa(&keys.rsa_pem, "rsa-1", &with(claims(), "org", json!("ghost"))),
            "not known",
        ),
        (
            "unbound tenant",
            sign_rsa(&keys.rsa_pem, "rsa-1", &with(claims(), "org", json!("nobody"))),
            "may not name",
        ),
        (
            "no tenant",
            sign_rsa(&keys.rsa_pem, "rsa-1", &with(claims(), "org", Value::Null)),
            "tenant",
        ),
        (
            "no expiry",
            sign_rsa(&keys.rsa_pem, "rsa-1", &with(claims(), "exp", Value::Null)),
            "claim",
        ),
        (
            "hs256 with the public key as secret",
            jsonwebtoken::encode(
                &Header::new(Algorithm::HS256),
                &claims(),
                &EncodingKey::from_secret(b"AQAB"),
            )
            .unwrap(),
            "algorithm",
        ),
        ("garbage", "a.b.c".to_string(), "malformed"),
    ];
    for (what, token, why) in cases {
        let (status, body) = server.v1_as(&token, Method::GET, "/tenant", None).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (401, Some("unauthorized")),
            "{what}: {body}"
        );
        assert!(body["message"].as_str().unwrap().contains(why), "{what}: {body}");
    }

    // Only a signed-in create picks profiles by header; an API key's create gets the defaults.
    let token = sign_rsa(&keys.rsa_pem, "rsa-1", &claims());
    let auth = format!("Bearer {token}");
    let headers = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
        ("x-airlock-egress-profiles", "gh"),
    ];
    let body = Body::from(json!({"template": "seed"}).to_string());
    let (status, created) = server
        .send(Method::POST, "/v1/sandboxes", &headers, body)
        .await
        .json()
        .await;
    assert_eq!(status, 202, "{created}");
    let id = created["sandbox_id"].as_str().unwrap().to_string();
    let (_, sb) = server
        .v1_as(&token, Method::GET, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(sb["egress"]["profiles"], json!(["gh"]), "{sb}");
    // An unknown profile is a 400 naming it, for a signed-in caller.
    let headers = [headers[0], headers[1], ("x-airlock-egress-profiles", "nope")];
    let body = Body::from(json!({"template": "seed"}).to_string());
    let (status, err) = server
        .send(Method::POST, "/v1/sandboxes", &headers, body)
        .await
        .json()
        .await;
    assert_eq!(status, 400, "{err}");
    assert!(err["message"].as_str().unwrap().contains("nope"), "{err}");
    // The same header with an API key: ignored.
    let key_auth = format!("Bearer {}", server.key);
    let headers = [
        ("authorization", key_auth.as_str()),
        ("content-type", "application/json"),
        ("x-airlock-egress-profiles", "gh"),
    ];
    let body = Body::from(json!({"template": "seed"}).to_string());
    let (status, other) = server
        .send(Method::POST, "/v1/sandboxes", &headers, body)
        .await
        .json()
        .await;
    assert_eq!(status, 202, "{other}");
    let other_id = other["sandbox_id"].as_str().unwrap().to_string();
    let (_, sb) = server.v1(Method::GET, &format!("/sandboxes/{other_id}"), None).await;
    assert_eq!(sb["egress"]["profiles"], json!(["pypi"]), "{sb}");

    // The E2B control plane takes the same token as `Authorization: Bearer` (where the SDK puts
    // an access token): it lists the signed-in tenant's sandbox, and refuses a bad token alike.
    let e2b_list = |auth: String| {
        let server = &server;
        async move {
            let headers = [("authorization", auth.as_str())];
            server.json(Method::GET, "/v2/sandboxes", &headers, Body::empty()).await
        }
    };
    // Listed once running (E2B lists running and paused sandboxes).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while server
        .v1_as(&token, Method::GET, &format!("/sandboxes/{id}"), None)
        .await
        .1["state"]
        != "running"
    {
        assert!(std::time::Instant::now() < deadline, "{id} not running after 10 s");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let (status, listed) = e2b_list(format!("Bearer {token}")).await;
    assert_eq!(status, 200, "{listed}");
    let ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["sandboxID"].as_str())
        .collect();
    assert!(
        ids.contains(&id.as_str()) && !ids.contains(&other_id.as_str()),
        "{listed}"
    );
    let expired = sign_rsa(&keys.rsa_pem, "rsa-1", &with(claims(), "exp", json!(now() - 3600)));
    let (status, err) = e2b_list(format!("Bearer {expired}")).await;
    assert_eq!(status, 401, "{err}");
    assert!(err["message"].as_str().unwrap().contains("expired"), "{err}");

    // The audit log names the signed-in actor and the refused tokens, never a token.
    let rows = server.core().store.audit(&Default::default(), 1000).await.unwrap();
    assert!(rows
        .iter()
        .any(|r| r.action == "sandbox.create" && r.actor == "jwt:https://idp.test#alice"));
    // Refusals of one kind within a minute are one row with a count.
    let admin = airlock_server::core::accounts::Admin {
        account: "root@local".into(),
    };
    let entries = server
        .core()
        .audit_log(&admin, &Default::default(), 1000)
        .await
        .unwrap();
    let refused: u64 = entries.iter().filter(|r| r.action == "auth.jwt").map(|r| r.count).sum();
    assert!(refused >= 8, "{entries:?}");
    let text = format!("{rows:?}");
    assert!(!text.contains(&token));

    server.wait_op(other["operation"]["id"].as_str().unwrap()).await;
    server.delete(&other_id).await;
    // The signed-in tenant's own sandbox.
    let (status, _) = server
        .v1_as(&token, Method::DELETE, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(status, 202);
    server.stop().await;
}

#[test]
fn a_bad_issuers_file_is_refused_naming_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    let write = |v: Value| {
        let p = dir.path().join("issuers.json");
        std::fs::write(&p, v.to_string()).unwrap();
        Federation::from_file(&p).map(|_| ()).unwrap_err().to_string()
    };
    // An issuer must say which tenants it speaks for.
    let e = write(json!({"issuers": [{"issuer": "i", "audience": "a", "jwks_file": "/nope", "tenant_claim": "org"}]}));
    assert!(
        e.contains("issuers[0]") && e.contains("`tenants` is missing") && e.contains("\"tenants\": ["),
        "{e}"
    );
    let e = write(
        json!({"issuers": [{"issuer": "i", "audience": "a", "jwks_file": "/nope", "tenant_claim": "org", "tenants": []}]}),
    );
    assert!(e.contains("issuers[0]") && e.contains("`tenants` is empty"), "{e}");
    let e = write(
        json!({"issuers": [{"issuer": "i", "audience": "a", "jwks_file": "/nope", "tenant_claim": "org", "tenants": ["Acme Corp"]}]}),
    );
    assert!(e.contains("issuers[0]") && e.contains("Acme Corp"), "{e}");
    let e = write(
        json!({"issuers": [{"issuer": "", "audience": "a", "jwks_file": "/nope", "tenant_claim": "org", "tenants": ["acme"]}]}),
    );
    assert!(e.contains("issuers[0]") && e.contains("issuer"), "{e}");
    let e = write(
        json!({"issuers": [{"issuer": "i", "audience": "a", "jwks_file": "/no/such/jwks.json", "tenant_claim": "org", "tenants": ["acme"]}]}),
    );
    assert!(e.contains("issuers[0]") && e.contains("/no/such/jwks.json"), "{e}");
    let e = write(json!({"issuers": [], "extra": 1}));
    assert!(e.contains("extra"), "{e}");
    let e = write(json!({"issuers": [{"issuer": "i", "audience": "a", "tenant_claim": "org", "tenants": ["acme"]}]}));
    assert!(e.contains("issuers[0]") && e.contains("jwks_url"), "{e}");
    // Keys over plain http only from loopback, where nothing on the way can swap them.
    let e = write(
        json!({"issuers": [{"issuer": "i", "audience": "a", "jwks_url": "http://192.0.2.1/jwks", "tenant_claim": "org", "tenants": ["acme"]}]}),
    );
    assert!(e.contains("issuers[0]") && e.contains("https"), "{e}");
}

/// Serves `body` for every request on a loopback port; returns the port and how many were served.
async fn serve_jwks(body: Arc<Mutex<String>>) -> (u16, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let mut head = vec![0u8; 4096];
            let _ = conn.read(&mut head).await;
            let text = body.lock().unwrap().clone();
            let status = if text.is_empty() { "404 Not Found" } else { "200 OK" };
            let reply = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                text.len()
            );
            // Counted before the reply: the client may read it (and the test look) before this
            // task runs again.
            count.fetch_add(1, Ordering::SeqCst);
            let _ = conn.write_all(reply.as_bytes()).await;
        }
    });
    (port, served)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_come_from_an_issuers_url_and_are_fetched_again_on_reload() {
    let dir = tempfile::tempdir().unwrap();
    let keys = make_keys(dir.path());
    let jwks = std::fs::read_to_string(dir.path().join("jwks.json")).unwrap();
    let body = Arc::new(Mutex::new(jwks.clone()));
    let (port, served) = serve_jwks(body.clone()).await;
    let issuers = dir.path().join("url-issuers.json");
    let config = |url: String| {
        json!({"issuers": [{"issuer": ISSUER, "audience": AUDIENCE, "jwks_url": url, "tenant_claim": "org", "tenants": ["acme"]}]}).to_string()
    };
    std::fs::write(&issuers, config(format!("http://127.0.0.1:{port}/jwks.json"))).unwrap();
    let load = |p: std::path::PathBuf| tokio::task::spawn_blocking(move || Federation::from_file(&p));
    let federation = load(issuers.clone()).await.unwrap().unwrap();
    assert_eq!(served.load(Ordering::SeqCst), 1);
    let token = sign_ec(&keys.ec_pem, &claims());
    assert_eq!(federation.verify(&token).unwrap().tenant, "acme");

    // The issuer rotates to only its RSA key: a reload fetches again, the EC token stops verifying.
    let mut rotated: Value = serde_json::from_str(&jwks).unwrap();
    rotated["keys"].as_array_mut().unwrap().retain(|k| k["kty"] == "RSA");
    *body.lock().unwrap() = rotated.to_string();
    let f = federation.clone();
    tokio::task::spawn_blocking(move || f.reload()).await.unwrap();
    assert_eq!(served.load(Ordering::SeqCst), 2);
    assert!(federation.verify(&token).is_err());
    assert!(federation.verify(&sign_rsa(&keys.rsa_pem, "rsa-1", &claims())).is_ok());
    // A failing fetch keeps the keys it had.
    body.lock().unwrap().clear();
    let f = federation.clone();
    tokio::task::spawn_blocking(move || f.reload()).await.unwrap();
    assert!(federation.verify(&sign_rsa(&keys.rsa_pem, "rsa-1", &claims())).is_ok());

    // At start, keys that can't be fetched stop the server, naming the entry and the URL.
    let e = load(issuers.clone())
        .await
        .unwrap()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("issuers[0]") && e.contains("404"), "{e}");
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::fs::write(&issuers, config(format!("http://127.0.0.1:{closed}/jwks.json"))).unwrap();
    let e = load(issuers.clone())
        .await
        .unwrap()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("issuers[0]") && e.contains(&format!("127.0.0.1:{closed}")),
        "{e}"
    );
}
