//! The web console (issue 28) over the fake VMM: signing in as root@local and with a tenant's
//! key, what is refused (a wrong password, a form without its CSRF token, a session that ended,
//! another tenant's sandbox on every page and call), and a sandbox made, its file uploaded and
//! downloaded from the console. The real browser runs the same against real VMs in
//! `tests/console/`.

use super::*;

/// A browser, as far as these pages need one: its cookies by name.
struct Browser<'a> {
    server: &'a Server,
    addr: std::net::SocketAddr,
    cookies: std::collections::BTreeMap<String, String>,
}

struct Page {
    status: u16,
    location: Option<String>,
    body: String,
}

impl<'a> Browser<'a> {
    fn new(server: &'a Server) -> Self {
        Browser {
            server,
            addr: server.addr,
            cookies: Default::default(),
        }
    }

    async fn send(&mut self, method: Method, path: &str, extra: &[(&str, &str)], body: Body) -> Page {
        let cookie = self
            .cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ");
        let host = self.addr.to_string();
        let mut headers = vec![("cookie", cookie.as_str()), ("host", host.as_str())];
        headers.extend_from_slice(extra);
        let resp = self.server.send_to(self.addr, method, path, &headers, body).await;
        for v in resp.headers.get_all("set-cookie") {
            let (kv, _) = v.to_str().unwrap().split_once(';').unwrap();
            let (k, v) = kv.split_once('=').unwrap();
            if v.is_empty() {
                self.cookies.remove(k);
            } else {
                self.cookies.insert(k.into(), v.into());
            }
        }
        let status = resp.status;
        let location = resp.headers.get("location").map(|v| v.to_str().unwrap().to_string());
        let html = resp
            .headers
            .get("content-type")
            .is_some_and(|v| v.to_str().unwrap().starts_with("text/html"));
        let csp = resp
            .headers
            .get("content-security-policy")
            .map(|v| v.to_str().unwrap().to_string());
        let bytes = axum::body::to_bytes(resp.body, 16 << 20).await.unwrap();
        let body = String::from_utf8_lossy(&bytes).into_owned();
        if path.starts_with("/console") {
            let csp = csp.unwrap_or_default();
            assert!(
                csp.split(';').any(|d| d.trim() == "script-src 'self'") && csp.contains("frame-ancestors 'none'"),
                "{path}: {csp:?}"
            );
        }
        if html {
            only_scripts_of_files(path, &body);
        }
        Page { status, location, body }
    }

    async fn get(&mut self, path: &str) -> Page {
        self.send(Method::GET, path, &[], Body::empty()).await
    }

    async fn post(&mut self, path: &str, form: &[(&str, &str)]) -> Page {
        let body: String = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(form)
            .finish();
        self.send(
            Method::POST,
            path,
            &[("content-type", "application/x-www-form-urlencoded")],
            Body::from(body),
        )
        .await
    }

    /// Sign in with the page's own form: `fields` are the password's or the key's.
    async fn sign_in(&mut self, fields: &[(&str, &str)]) -> Page {
        let page = self.get("/console/login").await;
        assert_eq!(page.status, 200);
        let token = csrf_of(&page.body);
        let mut form = vec![("csrf", token.as_str())];
        form.extend_from_slice(fields);
        self.post("/console/login", &form).await
    }
}

/// Every script of a page is one of the console's files: no inline one, no `javascript:` URL,
/// no handler attribute (the CSP's `script-src 'self'` would stop them in a browser).
fn only_scripts_of_files(path: &str, html: &str) {
    let lower = html.to_ascii_lowercase();
    for (at, _) in lower.match_indices("<script") {
        let tag = &lower[at..at + lower[at..].find('>').unwrap()];
        assert!(
            tag.contains(" src=\"/console/assets/"),
            "{path}: an inline script: {tag}"
        );
        assert!(
            lower[at..].starts_with(&format!("{tag}></script>")),
            "{path}: a script with a body"
        );
    }
    assert!(!lower.contains("javascript:"), "{path}: a javascript: URL");
    let handler = lower.split(|c: char| c.is_whitespace()).any(|w| {
        w.strip_prefix("on")
            .and_then(|rest| rest.split_once('='))
            .is_some_and(|(name, value)| {
                !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase()) && value.starts_with(['"', '\''])
            })
    });
    assert!(!handler, "{path}: a handler attribute");
}

/// The CSRF token a page's forms carry.
fn csrf_of(html: &str) -> String {
    let at = html.find("name=\"csrf\" value=\"").expect("a form with a CSRF token") + 19;
    html[at..].split('"').next().unwrap().to_string()
}

const PASSWORD: &str = "web-console-test-password";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_console_signs_in_refuses_and_keeps_tenants_apart() {
    let tmp = fresh();
    let server = Server::start(tmp.path(), 20, None).await;
    server.core().ensure_console_account(Some(PASSWORD)).await.unwrap();
    let mut admin = Browser::new(&server);

    // Not signed in: pages go to the sign-in page, calls are refused.
    let page = admin.get("/console/sandboxes").await;
    assert_eq!(
        (page.status, page.location.as_deref()),
        (303, Some("/console/login?why=signin"))
    );
    let page = admin.get("/console/sandboxes/sb_x/download?path=/etc/hostname").await;
    assert_eq!(page.status, 401);

    // A wrong password, and a sign-in form without its token.
    let page = admin
        .sign_in(&[("username", "root@local"), ("password", "wrong")])
        .await;
    assert_eq!(page.status, 401, "{}", page.body);
    assert!(page.body.contains("Wrong username, password or key."));
    assert!(!admin.cookies.contains_key("airlock_console"));
    let page = admin
        .post("/console/login", &[("username", "root@local"), ("password", PASSWORD)])
        .await;
    assert_eq!(page.status, 403, "no token: {}", page.body);
    assert!(!admin.cookies.contains_key("airlock_console"));
    // A value made up for both the cookie and the form (the double submit another host of the
    // domain could plant) is no token; nor is a real token with another nonce, or its time
    // changed.
    let credentials = [("username", "root@local"), ("password", PASSWORD)];
    let mut forger = Browser::new(&server);
    forger.cookies.insert("airlock_console_login".into(), "abc123".into());
    let mut form = vec![("csrf", "abc123")];
    form.extend_from_slice(&credentials);
    let page = forger.post("/console/login", &form).await;
    assert_eq!(page.status, 403, "a made-up token: {}", page.body);
    let page = forger.get("/console/login").await;
    let token = csrf_of(&page.body);
    let (at, mac) = token.split_once('.').expect("<time>.<mac>");
    let earlier = format!("{}.{mac}", at.parse::<i64>().unwrap() - 1);
    for (nonce, token) in [("abc123", token.as_str()), ("", token.as_str())] {
        let mut other = Browser::new(&server);
        other.cookies.insert("airlock_console_login".into(), nonce.into());
        let mut form = vec![("csrf", token)];
        form.extend_from_slice(&credentials);
        let page = other.post("/console/login", &form).await;
        assert_eq!(page.status, 403, "another nonce {nonce:?}: {}", page.body);
    }
    let mut form = vec![("csrf", earlier.as_str())];
    form.extend_from_slice(&credentials);
    let page = forger.post("/console/login", &form).await;
    assert_eq!(page.status, 403, "its time changed: {}", page.body);
    assert!(!forger.cookies.contains_key("airlock_console"));

    let page = admin
        .sign_in(&[("username", "root@local"), ("password", PASSWORD)])
        .await;
    assert_eq!(
        (page.status, page.location.as_deref()),
        (303, Some("/console")),
        "{}",
        page.body
    );
    let resp = server.send(Method::GET, "/console/login", &[], Body::empty()).await;
    assert_eq!(resp.headers["x-frame-options"], "DENY");
    assert_eq!(resp.headers["cache-control"], "no-store");
    let page = admin.get("/console/admin").await;
    assert_eq!(page.status, 200);
    assert!(page.body.contains("root@local"));
    let csrf = csrf_of(&page.body);

    // A form without the session's token changes nothing.
    let page = admin.post("/console/admin", &[("name", "acme")]).await;
    assert_eq!(page.status, 403, "{}", page.body);
    let page = admin
        .post("/console/admin", &[("name", "acme"), ("csrf", "wrong")])
        .await;
    assert_eq!(page.status, 403);
    let admin_token = server.admin_token(PASSWORD).await;
    let (_, tenants) = server.admin_json(&admin_token, Method::GET, "/tenants", None).await;
    assert!(!tenants.to_string().contains("acme"), "{tenants}");

    let page = admin.post("/console/admin", &[("name", "acme"), ("csrf", &csrf)]).await;
    assert_eq!(
        (page.status, page.location.as_deref()),
        (303, Some("/console/admin/tenants/acme"))
    );
    let page = admin
        .post("/console/admin/tenants/acme/keys", &[("name", "web"), ("csrf", &csrf)])
        .await;
    assert_eq!(page.status, 200, "{}", page.body);
    let at = page.body.find("id=\"new-key-value\">").unwrap() + 19;
    let acme_key = page.body[at..].split('<').next().unwrap().to_string();
    assert!(acme_key.starts_with("ak_"), "{acme_key}");
    let page = admin.get("/console/admin/tenants/acme").await;
    assert!(!page.body.contains(&acme_key), "a key is shown once");

    // Its quota and base egress policy, set from the console.
    let quota = [("sandboxes", "3"), ("vcpu", ""), ("memory_mib", "4096")];
    let page = admin.post("/console/admin/tenants/acme/quota", &quota).await;
    assert_eq!(page.status, 403, "no token");
    let mut with = quota.to_vec();
    with.push(("csrf", &csrf));
    let page = admin.post("/console/admin/tenants/acme/quota", &with).await;
    assert_eq!(page.status, 303, "{}", page.body);
    let (_, q) = server
        .admin_json(&admin_token, Method::GET, "/tenants/acme/quota", None)
        .await;
    assert_eq!(
        (q["sandboxes"].as_u64(), q["memory_mib"].as_u64()),
        (Some(3), Some(4096)),
        "{q}"
    );
    assert!(q["vcpu"].is_null(), "{q}");
    let policy = [
        ("allow", "allowed.test\n192.0.2.7\n198.51.100.0/24\n"),
        ("deny", "evil.test"),
        ("csrf", csrf.as_str()),
    ];
    let page = admin.post("/console/admin/tenants/acme/policy", &policy).await;
    assert_eq!(page.status, 303, "{}", page.body);
    let (_, p) = server
        .admin_json(&admin_token, Method::GET, "/tenants/acme/egress", None)
        .await;
    assert_eq!(p["allow"]["domains"], json!(["allowed.test"]), "{p}");
    assert_eq!(p["allow"]["ips"], json!(["192.0.2.7"]), "{p}");
    assert_eq!(p["allow"]["cidrs"], json!(["198.51.100.0/24"]), "{p}");
    assert_eq!(p["deny"]["domains"], json!(["evil.test"]), "{p}");
    let page = admin
        .post(
            "/console/admin/tenants/acme/policy",
            &[("allow", "*.wild.test"), ("deny", ""), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(page.status, 400, "a wildcard is refused: {}", page.body);
    assert!(page.body.contains("invalid_egress") && page.body.contains("list each exact name"));
    let page = admin.get("/console/admin/tenants/acme").await;
    assert!(page.body.contains("allowed.test") && page.body.contains("value=\"4096\""));

    // Signing out ends the session: its cookie opens nothing afterwards.
    let old = admin.cookies.clone();
    let page = admin.post("/console/logout", &[("csrf", &csrf)]).await;
    assert_eq!(page.location.as_deref(), Some("/console/login?why=out"));
    admin.cookies = old;
    let page = admin.get("/console/admin").await;
    assert_eq!(
        (page.status, page.location.as_deref()),
        (303, Some("/console/login?why=ended"))
    );

    // acme signs in with its key and makes a sandbox.
    let mut acme = Browser::new(&server);
    let page = acme.sign_in(&[("key", "ak_wrong")]).await;
    assert_eq!(page.status, 401);
    let page = acme.sign_in(&[("key", &acme_key)]).await;
    assert_eq!(page.status, 303);
    let page = acme.get("/console/admin").await;
    assert_eq!(page.status, 403, "a tenant is no admin");
    let page = acme.get("/console/sandboxes").await;
    assert_eq!(page.status, 200);
    let csrf = csrf_of(&page.body);
    let page = acme
        .post("/console/sandboxes", &[("template", "seed"), ("timeout", "10m")])
        .await;
    assert_eq!(page.status, 403, "a create without its token");
    let page = acme
        .post(
            "/console/sandboxes",
            &[("template", "seed"), ("timeout", "10m"), ("vcpu", ""), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(page.status, 303, "{}", page.body);
    let to = page.location.unwrap();
    let id = to["/console/sandboxes/".len()..].split('?').next().unwrap().to_string();
    let op = to.split("op=").nth(1).unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let page = acme.get(&to).await;
        assert_eq!(page.status, 200);
        if page.body.contains("data-state=\"succeeded\"") {
            assert!(page.body.contains(&op));
            break;
        }
        assert!(Instant::now() < deadline, "{}", page.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let page = acme.get("/console/sandboxes").await;
    assert!(page.body.contains(&id));
    let bad = acme
        .post(
            "/console/sandboxes",
            &[("template", "seed"), ("vcpu", "two"), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(bad.status, 422, "{}", bad.body);
    assert!(bad.body.contains("is not a whole number"));

    // A file up and down again.
    let boundary = "xBOUNDARYx";
    let multipart = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"csrf\"\r\n\r\n{csrf}\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"dir\"\r\n\r\n/home/user\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"notes.txt\"\r\nContent-Type: text/plain\r\n\r\nhello from the console\r\n\
         --{boundary}--\r\n"
    );
    let ctype = format!("multipart/form-data; boundary={boundary}");
    let page = acme
        .send(
            Method::POST,
            &format!("/console/sandboxes/{id}/files"),
            &[("content-type", &ctype)],
            Body::from(multipart.clone()),
        )
        .await;
    assert_eq!(page.status, 303, "{}", page.body);
    let page = acme
        .get(&format!("/console/sandboxes/{id}/download?path=/home/user/notes.txt"))
        .await;
    assert_eq!((page.status, page.body.as_str()), (200, "hello from the console"));
    let forged = multipart.replace(&csrf, "forged");
    let page = acme
        .send(
            Method::POST,
            &format!("/console/sandboxes/{id}/files"),
            &[("content-type", &ctype)],
            Body::from(forged),
        )
        .await;
    assert_eq!(page.status, 403, "an upload without its token");

    // Another tenant's key sees none of it: pages, downloads, the terminal, actions.
    let mut other = Browser::new(&server);
    assert_eq!(other.sign_in(&[("key", &server.key)]).await.status, 303);
    let page = other.get("/console/sandboxes").await;
    assert!(!page.body.contains(&id));
    let other_csrf = csrf_of(&page.body);
    assert_eq!(other.get(&format!("/console/sandboxes/{id}")).await.status, 404);
    let page = other
        .get(&format!("/console/sandboxes/{id}/download?path=/home/user/notes.txt"))
        .await;
    assert_eq!(page.status, 404);
    assert!(!page.body.contains("hello from the console"));
    let page = other
        .post(
            &format!("/console/sandboxes/{id}/action"),
            &[("action", "delete"), ("csrf", &other_csrf)],
        )
        .await;
    assert_eq!(page.status, 404);
    let origin = format!("http://{}", server.addr);
    let upgrade = [
        ("connection", "upgrade"),
        ("upgrade", "websocket"),
        ("sec-websocket-version", "13"),
        ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ("origin", origin.as_str()),
    ];
    let page = other
        .send(
            Method::GET,
            &format!("/console/sandboxes/{id}/terminal"),
            &upgrade,
            Body::empty(),
        )
        .await;
    assert_eq!(page.status, 404, "{}", page.body);
    // Its owner from another site's page: refused too.
    let mut cross = upgrade;
    cross[4] = ("origin", "http://evil.test");
    let page = acme
        .send(
            Method::GET,
            &format!("/console/sandboxes/{id}/terminal"),
            &cross,
            Body::empty(),
        )
        .await;
    assert_eq!(page.status, 403);

    // Deleting from the console.
    let page = acme
        .post(
            &format!("/console/sandboxes/{id}/action"),
            &[("action", "delete"), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(page.status, 303);
    assert!(page.location.unwrap().starts_with("/console/sandboxes?op="));
    let (_, audit) = server
        .admin_json(&admin_token, Method::GET, "/audit?tenant=acme", None)
        .await;
    let actions: Vec<&str> = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert!(
        actions.contains(&"sandbox.create") && actions.contains(&"sandbox.delete"),
        "{actions:?}"
    );
}

/// A session ends after its idle time: the next page goes to the sign-in page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_console_session_ends() {
    let tmp = fresh();
    let mut server = Server::start(tmp.path(), 20, None).await;
    let core = server.core().clone();
    let addr = server
        .on_server(async move {
            let app = airlock_server::router(airlock_server::AppState {
                core,
                e2b_domain: None,
                console: airlock_server::console::ConsoleSettings {
                    idle: Duration::from_millis(700),
                    lifetime: Duration::from_secs(60),
                },
            });
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(async move { axum::serve(listener, app).await });
            addr
        })
        .await;
    let key = server.key.clone();
    server.addr = addr;
    let mut b = Browser::new(&server);
    assert_eq!(b.sign_in(&[("key", &key)]).await.status, 303);
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(b.get("/console/sandboxes").await.status, 200, "in use, it lasts");
    }
    tokio::time::sleep(Duration::from_millis(900)).await;
    let page = b.get("/console/sandboxes").await;
    assert_eq!(
        (page.status, page.location.as_deref()),
        (303, Some("/console/login?why=ended"))
    );
    assert!(b.get("/console/login?why=ended").await.body.contains("session ended"));
}
