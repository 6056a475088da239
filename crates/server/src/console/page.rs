//! The console's page frame, its error page and small pieces every page uses.

use super::{Signed, Viewer};
use crate::error::CoreError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::{html, Markup, DOCTYPE};

/// A core error as the console shows it: the status, stable code and message `/v1` gives.
pub fn describe(e: &CoreError) -> (StatusCode, String, String) {
    let c = e.code();
    let status = StatusCode::from_u16(c.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, c.code.to_string(), e.to_string())
}

pub fn layout(title: &str, signed: Option<&Signed>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · airlock" }
                link rel="stylesheet" href="/console/assets/console.css";
                link rel="stylesheet" href="/console/assets/xterm.css";
            }
            body {
                header {
                    a.brand href="/console" { "airlock" }
                    @if let Some(s) = signed {
                        nav {
                            @match &s.viewer {
                                Viewer::Admin(_) => {
                                    a href="/console/admin" { "Tenants" }
                                    a href="/console/admin/audit" { "Audit log" }
                                    a href="/console/admin/system" { "System" }
                                    span.who #who { "root@local" }
                                }
                                Viewer::Tenant { tenant, .. } => {
                                    a href="/console/sandboxes" { "Sandboxes" }
                                    span.who #who { "tenant " (tenant.name) }
                                }
                            }
                            form.inline method="post" action="/console/logout" {
                                (csrf(s))
                                button #signout type="submit" { "Sign out" }
                            }
                        }
                    }
                }
                main { (body) }
                script src="/console/assets/xterm.js" {}
                script src="/console/assets/addon-fit.js" {}
                script src="/console/assets/console.js" {}
            }
        }
    }
}

/// The hidden field every form of a session carries.
pub fn csrf(s: &Signed) -> Markup {
    html! { input type="hidden" name="csrf" value=(s.session.csrf); }
}

pub fn error(signed: Option<&Signed>, status: StatusCode, code: &str, message: &str) -> Response {
    let body = html! {
        h1 { "Refused" }
        p.error #error { span.code { (code) } ": " (message) }
        // The script goes back a page (no `javascript:` URL: the CSP runs none); without it, home.
        p { a href="/console" data-back { "Back" } }
    };
    (status, layout("Refused", signed, body)).into_response()
}

/// Why a console request is refused; shown as an error page, or a way to the sign-in page.
pub enum Refused {
    /// Not signed in, or the session ended: a page goes to the sign-in page (saying `why`), a
    /// call (a download, the terminal, an upload) gets 401.
    SignIn {
        page: bool,
        why: &'static str,
    },
    /// Not this viewer's page: go there instead (a tenant on the admin's pages, and back).
    Elsewhere(&'static str),
    Forbidden(&'static str),
    /// A form without the session's CSRF token.
    Csrf,
    Core(Box<CoreError>),
    Bad(StatusCode, &'static str, String),
}

impl From<CoreError> for Refused {
    fn from(e: CoreError) -> Self {
        Refused::Core(Box::new(e))
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        match self {
            Refused::SignIn { page: true, why } => {
                axum::response::Redirect::to(&format!("/console/login?why={why}")).into_response()
            }
            Refused::SignIn { page: false, .. } => error(
                None,
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "not signed in to the console (or the session ended): sign in at /console/login",
            ),
            Refused::Elsewhere(to) => axum::response::Redirect::to(to).into_response(),
            Refused::Forbidden(why) => error(None, StatusCode::FORBIDDEN, "forbidden", why),
            Refused::Csrf => error(
                None,
                StatusCode::FORBIDDEN,
                "csrf",
                "this form was not sent from a console page of this session (its CSRF token is missing or wrong): open the page again",
            ),
            Refused::Core(e) => {
                let (status, code, message) = describe(&e);
                error(None, status, &code, &message)
            }
            Refused::Bad(status, code, message) => error(None, status, code, &message),
        }
    }
}

/// What a console handler answers.
pub type Answer = Result<Response, Refused>;

/// A duration since `ms` in words (`3m 12s`), for ages.
pub fn age(ms: i64) -> String {
    let s = ((crate::records::now_ms() - ms).max(0) / 1000) as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {}s", s / 60, s % 60),
        _ => format!("{}h {}m", s / 3600, (s % 3600) / 60),
    }
}

pub fn time(ms: i64) -> String {
    crate::records::rfc3339(ms)
}

/// An optional whole number from a form field (empty is none), refused by the field's name.
pub fn form_number<T: std::str::FromStr>(field: &str, v: Option<&str>) -> Result<Option<T>, CoreError> {
    match v.map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| CoreError::invalid(field, format!("{v:?} is not a whole number"))),
    }
}
