//! The console's static files, all in the binary: its own script and style (`assets/`), and
//! xterm.js with its fit addon and style from `console/node_modules` (scripts/console-assets
//! fetches them at build). Nothing is fetched from elsewhere at run time.

use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

static FILES: &[(&str, &str, &[u8])] = &[
    ("console.js", "text/javascript", include_bytes!("assets/console.js")),
    ("console.css", "text/css", include_bytes!("assets/console.css")),
    (
        "xterm.js",
        "text/javascript",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../console/node_modules/@xterm/xterm/lib/xterm.js"
        )),
    ),
    (
        "xterm.css",
        "text/css",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../console/node_modules/@xterm/xterm/css/xterm.css"
        )),
    ),
    (
        "addon-fit.js",
        "text/javascript",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../console/node_modules/@xterm/addon-fit/lib/addon-fit.js"
        )),
    ),
];

pub async fn asset(Path(file): Path<String>) -> Response {
    match FILES.iter().find(|(name, _, _)| *name == file) {
        Some((_, mime, body)) => (
            [
                (header::CONTENT_TYPE, *mime),
                (header::CACHE_CONTROL, "public, max-age=3600"),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            *body,
        )
            .into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}
