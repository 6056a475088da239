//! `/console`: the web console, a door like `/v1` and E2B's. Pages are rendered on the server
//! (maud: every value escaped) from the same core services the API uses; the only script
//! library is xterm.js for the terminal, embedded in the binary with the console's own small
//! script (`assets.rs`), so nothing is fetched at run time. A browser signs in as `root@local`
//! (the admin's pages, `admin.rs`) or with a tenant's API key (that tenant's sandboxes,
//! `sandboxes.rs`, their terminal, `terminal.rs`, and sessions' output, `sessions.rs`); `logins.rs`
//! keeps the sign-ins.
//!
//! Every form carries the session's CSRF token (the sign-in form one the server signed, bound to
//! the browser's pre-sign-in cookie); the cookies are HttpOnly and SameSite=Strict, on the TLS
//! listener also `Secure` and `__Host-` named (no other host, such as a sandbox's port under the
//! same domain, can set or shadow them); the terminal's WebSocket must come from the console's
//! own origin.

mod admin;
mod assets;
mod logins;
mod page;
mod sandboxes;
mod sessions;
mod terminal;

pub use logins::ConsoleSettings;

use crate::core::accounts::Admin;
use crate::core::{Core, Principal};
use crate::error::CoreError;
use crate::records::Tenant;
use axum::extract::{ConnectInfo, Form, FromRequestParts, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use logins::{Credential, Logins, Session};
use maud::html;
use page::{Answer, Refused};
use serde::Deserialize;
use std::net::SocketAddr;
use std::sync::Arc;

/// The session cookie.
const COOKIE: &str = "airlock_console";
/// The sign-in form's nonce, before there is a session: the form's token is signed for it.
const LOGIN_COOKIE: &str = "airlock_console_login";
/// The prefix of every console cookie's name over TLS: the browser then takes it only `Secure`,
/// from this host itself, for the path `/`.
const HOST_PREFIX: &str = "__Host-";

/// A console request's headers, and whether it came over the TLS listener (which names its
/// cookies).
pub struct Browser {
    headers: HeaderMap,
    tls: bool,
}

impl std::ops::Deref for Browser {
    type Target = HeaderMap;
    fn deref(&self) -> &HeaderMap {
        &self.headers
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Browser {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Browser {
            headers: parts.headers.clone(),
            tls: parts.extensions.get::<crate::listen::OverTls>().is_some(),
        })
    }
}

impl Browser {
    /// The value of the console's cookie `name`: over TLS only its `__Host-` one (a plain one
    /// may have come from another host of the domain).
    fn cookie(&self, name: &str) -> Option<&str> {
        cookie(&self.headers, &cookie_name(name, self.tls))
    }

    /// A `Set-Cookie` of the console's cookie `name` (see [`set_cookie`]).
    fn set_cookie(&self, name: &str, value: &str, path: &str, max_age_s: i64) -> HeaderValue {
        set_cookie(name, value, path, max_age_s, self.tls)
    }
}

fn cookie_name(name: &str, tls: bool) -> String {
    match tls {
        true => format!("{HOST_PREFIX}{name}"),
        false => name.to_string(),
    }
}

/// The console's cookie `name` for `path`; over TLS `__Host-` named, `Secure` and for `/`, as
/// the prefix asks.
fn set_cookie(name: &str, value: &str, path: &str, max_age_s: i64, tls: bool) -> HeaderValue {
    let (path, secure) = match tls {
        true => ("/", "; Secure"),
        false => (path, ""),
    };
    HeaderValue::from_str(&format!(
        "{}={value}; Path={path}; HttpOnly; SameSite=Strict; Max-Age={max_age_s}{secure}",
        cookie_name(name, tls)
    ))
    .expect("a cookie of visible ASCII")
}

#[derive(Clone)]
pub struct ConsoleState {
    core: Core,
    logins: Arc<Logins>,
}

pub fn router(core: Core, settings: ConsoleSettings) -> Router {
    let state = ConsoleState {
        core,
        logins: Arc::new(Logins::new(settings)),
    };
    Router::new()
        .route("/console", get(home))
        .route("/console/", get(home))
        .route("/console/login", get(login_page).post(login))
        .route("/console/logout", post(logout))
        .route("/console/assets/{file}", get(assets::asset))
        .route("/console/sandboxes", get(sandboxes::list).post(sandboxes::create))
        .route("/console/sandboxes/{id}", get(sandboxes::show))
        .route("/console/sandboxes/{id}/action", post(sandboxes::act))
        .route("/console/sandboxes/{id}/terminal", get(terminal::open))
        .route("/console/sandboxes/{id}/sessions/{sid}", get(sessions::session_page))
        .route(
            "/console/sandboxes/{id}/sessions/{sid}/output",
            get(sessions::session_output),
        )
        .route(
            "/console/sandboxes/{id}/files",
            crate::upload_limits(post(sandboxes::upload)),
        )
        .route("/console/sandboxes/{id}/download", get(sandboxes::download))
        .route("/console/admin", get(admin::tenants).post(admin::create_tenant))
        .route("/console/admin/tenants/{name}", get(admin::tenant))
        .route("/console/admin/tenants/{name}/keys", post(admin::create_key))
        .route("/console/admin/tenants/{name}/revoke", post(admin::revoke_key))
        .route("/console/admin/tenants/{name}/quota", post(admin::set_quota))
        .route("/console/admin/tenants/{name}/policy", post(admin::set_policy))
        .route("/console/admin/audit", get(admin::audit))
        .route("/console/admin/system", get(admin::system))
        .route("/console/admin/pools", post(admin::set_pool))
        .layer(axum::middleware::map_response(page_headers))
        .with_state(state)
}

/// The console's Content-Security-Policy: never framed by another site (its buttons delete
/// things); scripts only the console's own files (no inline script, `javascript:` URL or
/// handler attribute runs, should a value ever slip past the escaping), no plugins, no `<base>`
/// to move where those files load from.
pub const CSP: &str = "frame-ancestors 'none'; script-src 'self'; object-src 'none'; base-uri 'none'";

/// On every console answer: its [`CSP`], no referrer beyond the console, and pages (a new key
/// is on one) kept by no cache; the assets set their own caching.
async fn page_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    r
}

/// Who a signed-in console request acts as.
#[derive(Clone)]
pub enum Viewer {
    Admin(Admin),
    Tenant { principal: Box<Principal>, tenant: Tenant },
}

/// A signed-in request: its session and who it acts as.
#[derive(Clone)]
pub struct Signed {
    pub session: Session,
    pub viewer: Viewer,
}

impl Signed {
    /// The tenant's pages: the admin is sent to its own.
    fn tenant(&self) -> Result<(&Principal, &Tenant), Refused> {
        match &self.viewer {
            Viewer::Tenant { principal, tenant } => Ok((principal, tenant)),
            Viewer::Admin(_) => Err(Refused::Elsewhere("/console/admin")),
        }
    }

    fn admin(&self) -> Result<&Admin, Refused> {
        match &self.viewer {
            Viewer::Admin(a) => Ok(a),
            Viewer::Tenant { .. } => Err(Refused::Forbidden(
                "these pages are the platform account's (root@local); sign in as it",
            )),
        }
    }

    /// A form's `csrf` field against the session's: a post without it changes nothing.
    fn check_csrf(&self, given: Option<&str>) -> Result<(), Refused> {
        match given {
            Some(t) if logins::same_token(t, &self.session.csrf) => Ok(()),
            _ => Err(Refused::Csrf),
        }
    }
}

fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The signed-in viewer of a request, asked of the core again with the session's credential.
/// A page (`page`) without one goes to the sign-in page; anything else gets 401.
async fn signed(state: &ConsoleState, headers: &Browser, page: bool) -> Result<Signed, Refused> {
    let Some(value) = headers.cookie(COOKIE) else {
        return Err(Refused::SignIn { page, why: "signin" });
    };
    let Some(session) = state.logins.get(value) else {
        return Err(Refused::SignIn { page, why: "ended" });
    };
    let viewer = match &session.credential {
        Credential::Admin { token, .. } => state.core.admin(Some(token)).await.map(Viewer::Admin),
        Credential::Key { key, .. } => state.core.bearer_principal(Some(key)).await.map(|principal| {
            let tenant = principal.tenant().cloned().expect("a key names a tenant");
            Viewer::Tenant {
                principal: Box::new(principal),
                tenant,
            }
        }),
    };
    match viewer {
        Ok(viewer) => Ok(Signed { session, viewer }),
        Err(_) => {
            state.logins.close(value);
            Err(Refused::SignIn { page, why: "ended" })
        }
    }
}

async fn home(State(state): State<ConsoleState>, headers: Browser) -> Answer {
    Ok(match signed(&state, &headers, true).await?.viewer {
        Viewer::Admin(_) => Redirect::to("/console/admin").into_response(),
        Viewer::Tenant { .. } => Redirect::to("/console/sandboxes").into_response(),
    })
}

#[derive(Deserialize)]
struct LoginQuery {
    why: Option<String>,
}

fn session_cookie(headers: &Browser, value: &str, max_age_s: i64) -> HeaderValue {
    headers.set_cookie(COOKIE, value, "/console", max_age_s)
}

async fn login_page(
    State(state): State<ConsoleState>,
    headers: Browser,
    axum::extract::Query(q): axum::extract::Query<LoginQuery>,
) -> Response {
    if signed(&state, &headers, false).await.is_ok() {
        return Redirect::to("/console").into_response();
    }
    let note = match q.why.as_deref() {
        Some("ended") => Some("Your console session ended. Sign in again."),
        Some("out") => Some("Signed out."),
        _ => None,
    };
    login_form(&state, &headers, StatusCode::OK, note, None)
}

/// The sign-in page with a fresh nonce in a cookie of its own and, in its forms, the token the
/// server signed for it: a post must carry both, so another site cannot sign a browser in as
/// someone else (a value it made up is no token, and a cookie it planted is no nonce of it).
fn login_form(
    state: &ConsoleState,
    headers: &Browser,
    status: StatusCode,
    note: Option<&str>,
    error: Option<&str>,
) -> Response {
    let nonce = airlock_runtime::datadir::random_hex(24);
    let token = state.core.sign_in_form_token(&nonce);
    let body = html! {
        h1 { "Sign in" }
        @if let Some(n) = note { p.note { (n) } }
        @if let Some(e) = error { p.error #error { (e) } }
        div.cols {
            form.card method="post" action="/console/login" #signin-root {
                h2 { "Platform account" }
                input type="hidden" name="csrf" value=(token);
                label { "Username " input name="username" value="root@local" autocomplete="username"; }
                label { "Password " input type="password" name="password" autocomplete="current-password"; }
                button type="submit" { "Sign in" }
            }
            form.card method="post" action="/console/login" #signin-key {
                h2 { "Tenant" }
                input type="hidden" name="csrf" value=(token);
                label { "API key " input type="password" name="key" autocomplete="off"; }
                button type="submit" { "Sign in with key" }
            }
        }
    };
    let mut r = (status, page::layout("Sign in", None, body)).into_response();
    r.headers_mut().append(
        header::SET_COOKIE,
        headers.set_cookie(
            LOGIN_COOKIE,
            &nonce,
            "/console/login",
            crate::core::principal::SIGN_IN_FORM_TTL_S,
        ),
    );
    r
}

#[derive(Deserialize)]
struct LoginForm {
    csrf: Option<String>,
    username: Option<String>,
    password: Option<String>,
    key: Option<String>,
}

async fn login(
    State(state): State<ConsoleState>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: Browser,
    Form(form): Form<LoginForm>,
) -> Response {
    match (form.csrf.as_deref(), headers.cookie(LOGIN_COOKIE)) {
        (Some(token), Some(nonce)) if state.core.sign_in_form_token_valid(nonce, token) => {}
        _ => {
            return login_form(
                &state,
                &headers,
                StatusCode::FORBIDDEN,
                None,
                Some("This sign-in form was not sent from the console's own page: try again."),
            )
        }
    }
    let credential = if let Some(key) = form.key.filter(|k| !k.trim().is_empty()) {
        match state.core.bearer_principal(Some(key.trim())).await {
            Ok(p) => match p.tenant() {
                Some(t) => Credential::Key {
                    key: key.trim().to_string(),
                    tenant_id: t.id.clone(),
                },
                None => {
                    return login_refused(
                        &state,
                        &headers,
                        CoreError::Unauthenticated("not a tenant's key".into()),
                    )
                }
            },
            Err(e) => return login_refused(&state, &headers, e),
        }
    } else {
        let client = peer.map(|Extension(ConnectInfo(addr))| addr.ip());
        let username = form.username.unwrap_or_default();
        match state
            .core
            .login(&username, &form.password.unwrap_or_default(), client)
            .await
        {
            Ok(t) => Credential::Admin {
                token: t.token,
                // The token says so too (`expires_at`); the core refuses it after anyway.
                expires_ms: crate::records::now_ms() + crate::core::accounts::ADMIN_TOKEN_TTL_MS,
            },
            Err(e) => return login_refused(&state, &headers, e),
        }
    };
    let Ok((value, _)) = state.logins.open(credential) else {
        return login_form(
            &state,
            &headers,
            StatusCode::SERVICE_UNAVAILABLE,
            None,
            Some(&format!(
                "The console keeps {} tenants' sign-ins already: sign in again once some have ended \
                 (the API takes the key meanwhile).",
                logins::MAX_LOGINS
            )),
        );
    };
    let mut r = Redirect::to("/console").into_response();
    let max_age = state.logins.settings().lifetime.as_secs() as i64;
    r.headers_mut()
        .append(header::SET_COOKIE, session_cookie(&headers, &value, max_age));
    r
}

fn login_refused(state: &ConsoleState, headers: &Browser, e: CoreError) -> Response {
    let (status, _, message) = page::describe(&e);
    let status = if status == StatusCode::TOO_MANY_REQUESTS {
        status
    } else {
        StatusCode::UNAUTHORIZED
    };
    let message = if status == StatusCode::UNAUTHORIZED {
        "Wrong username, password or key.".to_string()
    } else {
        message
    };
    login_form(state, headers, status, None, Some(&message))
}

#[derive(Deserialize)]
struct CsrfForm {
    csrf: Option<String>,
}

async fn logout(State(state): State<ConsoleState>, headers: Browser, Form(form): Form<CsrfForm>) -> Answer {
    let signed = signed(&state, &headers, true).await?;
    signed.check_csrf(form.csrf.as_deref())?;
    if let Some(value) = headers.cookie(COOKIE) {
        state.logins.close(value);
    }
    let mut r = Redirect::to("/console/login?why=out").into_response();
    r.headers_mut()
        .append(header::SET_COOKIE, session_cookie(&headers, "", 0));
    Ok(r)
}

#[cfg(test)]
mod tests {
    #[test]
    fn cookies_are_found_by_name() {
        let mut h = axum::http::HeaderMap::new();
        h.append("cookie", "a=1; airlock_console=cs_x; b=2".parse().unwrap());
        assert_eq!(super::cookie(&h, super::COOKIE), Some("cs_x"));
        assert_eq!(super::cookie(&h, "c"), None);
    }

    #[test]
    fn over_tls_the_cookies_are_host_only_and_secure() {
        use super::{set_cookie, Browser, COOKIE};
        let plain = set_cookie(COOKIE, "cs_x", "/console", 60, false);
        assert_eq!(
            plain.to_str().unwrap(),
            "airlock_console=cs_x; Path=/console; HttpOnly; SameSite=Strict; Max-Age=60"
        );
        let tls = set_cookie(COOKIE, "cs_x", "/console", 60, true);
        assert_eq!(
            tls.to_str().unwrap(),
            "__Host-airlock_console=cs_x; Path=/; HttpOnly; SameSite=Strict; Max-Age=60; Secure"
        );
        // Over TLS only the prefixed cookie counts: a plain one may come from another host.
        let mut h = axum::http::HeaderMap::new();
        h.append(
            "cookie",
            "airlock_console=planted; __Host-airlock_console=cs_y".parse().unwrap(),
        );
        let over_tls = Browser {
            headers: h.clone(),
            tls: true,
        };
        assert_eq!(over_tls.cookie(COOKIE), Some("cs_y"));
        let plain = Browser { headers: h, tls: false };
        assert_eq!(plain.cookie(COOKIE), Some("planted"));
        let mut h = axum::http::HeaderMap::new();
        h.append("cookie", "airlock_console=planted".parse().unwrap());
        assert_eq!(Browser { headers: h, tls: true }.cookie(COOKIE), None);
    }

    #[tokio::test]
    async fn a_request_of_the_tls_listener_is_known_as_one() {
        use axum::extract::FromRequestParts;
        let tls_of = |over_tls: bool| async move {
            let mut req = axum::http::Request::new(());
            if over_tls {
                req.extensions_mut().insert(crate::listen::OverTls);
            }
            let (mut parts, _) = req.into_parts();
            super::Browser::from_request_parts(&mut parts, &()).await.unwrap().tls
        };
        assert!(tls_of(true).await);
        assert!(!tls_of(false).await);
    }
}
