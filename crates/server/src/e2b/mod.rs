//! The E2B door: the E2B control-plane API and envd (Connect RPC, `/files`, `/health`) on the
//! same listener as `/v1`, translated onto the core's services (the wire as E2B's Python SDK and
//! e2b-dev/infra's `spec/openapi.yml` and `packages/envd/spec/` have it). Errors: `E2bError`
//! (control plane and `/files`: `{"code": <int>, "message"}`) and `connect::RpcError` (Connect),
//! each made from a `CoreError` in one place. It may use the core only: no store, engine, node or
//! runtime handle.

pub mod connect;
pub mod control;
pub mod envd;
mod error;

pub use error::E2bError;

use crate::core::Core;
use std::sync::Arc;

/// envd version we report; the SDK gates features on it (octet-stream uploads need >= 0.5.7).
pub const ENVD_VERSION: &str = "0.6.13";

/// What the E2B door's handlers share.
#[derive(Clone)]
pub struct E2bState {
    pub core: Core,
    /// The E2B domain (`api.<domain>`, `<port>-<id>.<domain>`) returned to SDKs, if configured.
    pub domain: Option<Arc<str>>,
}
