//! A node's HTTP face, stated once: its routes (under [`PREFIX`]), their messages, how a
//! `NodeError` travels, and the short-lived tokens that every call carries.
//!
//! Routes (JSON bodies; an error is [`ErrorReply`] with a 4xx/5xx status):
//! - `GET  /report` -> [`NodeReport`]: what the node has now (a caller's cache of it)
//! - `POST /vms` [`VmRequest`] -> `Booted`, or 503 `refused` with its `reason` (the node's own
//!   admission); `DELETE /vms/{id}[?run=R]` (with `run`: 409 `stale_run` if its VM is another
//!   run)
//! - `PUT /vms/{id}/deadline` `Option<Deadline>` -> `{}`: when the node ends it if no replica does
//! - `POST /vms/{id}/pause|resume` -> `{}`; `POST /vms/{id}/suspend` -> [`Took`]
//! - `POST /vms/{id}/settled`, `POST /settled` -> `{}` once known (after a node restart)
//! - `POST /vms/{id}/park/{image}` -> `Parked`: saved to object storage, ended here
//! - `POST /vms/{id}/images/{image}` -> [`Saved`]; `DELETE /images/{image}`;
//!   `POST /images/{image}/share` -> `Parked`: put in object storage too (a snapshot's);
//!   `GET /images/{image}/digest` -> [`Digest`]
//! - `POST /claims` [`ClaimRequest`] -> [`Claimed`]; `DELETE /claims/{id}`; `PUT /pools` [`PoolSize`]
//! - `GET /vms/{id}/egress` -> `Option<EgressSnapshot>`: its egress counters and recent denials
//! - `POST /vms/{id}/watches` `WatchSpec` -> `WatchStart`; `POST /vms/{id}/watches/{w}/take` ->
//!   `Option<Taken>` (None: no such watch); `DELETE /vms/{id}/watches/{w}` -> `bool`
//! - `GET /exits` -> a stream of lines, one id each: VMs that exited on their own
//! - any method `/vms/{id}/agent/<agent route>` -> the agent's own answer, passed through
//!
//! A token is `<expiry unix s>.<hex HMAC-SHA256(cluster secret, "airlock-node/v1:" + expiry)>`
//! as `Authorization: Bearer`: minted per call by the caller, valid until its expiry and never
//! for longer than [`TOKEN_TTL`] from now, so a leaked one soon ends.
//!
//! A call made for an operation carries its id in [`OPERATION_HEADER`], and the node logs each
//! change with it: what a node did for which operation, read across hosts. Its lease's epoch in
//! [`EPOCH_HEADER`] fences it: a change with an epoch lower than the node has seen for that
//! operation is refused 409 `fenced`.

use super::{Capacity, NodeError, PoolInfo};
use airlock_runtime::template::TemplateManifest;
use airlock_runtime::Resources;
use hmac::Mac;
use serde::{Deserialize, Serialize};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use super::VmRequest;

/// Every route of the node's face is under it.
pub const PREFIX: &str = "/node/v1";
/// The longest a token may be valid for.
pub const TOKEN_TTL: Duration = Duration::from_secs(300);
const TOKEN_LABEL: &[u8] = b"airlock-node/v1:";
/// The operation a call is made for (its id), when it is made for one.
pub const OPERATION_HEADER: &str = "airlock-operation";
/// With [`OPERATION_HEADER`]: the epoch of the caller's lease of it (`store::Claimed`). A node
/// refuses a change whose epoch is lower than one it saw for the same operation: the caller
/// stalled past its lease, and another replica drives the operation now.
pub const EPOCH_HEADER: &str = "airlock-operation-epoch";

/// An operation a task carries out, as its calls to nodes name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carried {
    pub id: String,
    /// The epoch of the lease it runs under (1: the lease it was made with).
    pub epoch: i64,
}

tokio::task_local! {
    /// The operation the current task carries out: calls to nodes made in it name it.
    pub static OPERATION: Carried;
}

/// The operation the current task carries out, if it carries one out.
pub fn current_operation() -> Option<Carried> {
    OPERATION.try_with(|op| op.clone()).ok().filter(|op| !op.id.is_empty())
}

/// What a node has now: the caller answers `Nodes`' synchronous questions from it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeReport {
    /// The name the node was started with (`airlock node --name`): its identity in a cluster
    /// found by discovery, kept across restarts and new addresses.
    #[serde(default)]
    pub name: String,
    pub runtime_name: String,
    pub accel: String,
    pub capacity: Capacity,
    pub templates: Vec<TemplateManifest>,
    pub pools: Vec<PoolInfo>,
    /// Every VM the node has (live, paused, suspended), with its state and run.
    pub vms: Vec<super::VmReport>,
    pub images: Vec<String>,
    /// It is stopping: it starts nothing, and its sandboxes are to move elsewhere.
    #[serde(default)]
    pub draining: bool,
    /// Its machine: a VM parked elsewhere starts here only if it was saved on an equal one.
    #[serde(default)]
    pub fingerprint: String,
    /// It has object storage to park VMs in.
    #[serde(default)]
    pub parks: bool,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Took {
    pub ms: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Saved {
    pub bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Digest {
    pub digest: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ClaimRequest {
    pub template: String,
    pub resources: Resources,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Claimed {
    pub id: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct PoolSize {
    pub template: String,
    pub resources: Resources,
    pub size: usize,
}

/// A `NodeError` on the wire: `code` names the variant, `message` is its text; a refusal
/// (`refused`) carries its `reason`.
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorReply {
    pub code: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<super::Refusal>,
}

/// A failure a node reported, as its message (the node's own error stays there).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RemoteFailure(pub String);

impl ErrorReply {
    pub fn status(e: &NodeError) -> u16 {
        match e {
            NodeError::UnknownTemplate(_) | NodeError::UnknownSandbox(_) | NodeError::UnknownImage(_) => 404,
            NodeError::UnknownVolume(_) => 404,
            NodeError::InvalidResources(_)
            | NodeError::InvalidSandboxId(_)
            | NodeError::BadImage(_)
            | NodeError::InvalidVolume(_) => 422,
            NodeError::VolumeBusy(_) => 409,
            NodeError::SandboxIdTaken(_) | NodeError::NotRunning(_) | NodeError::StaleRun(_) | NodeError::Fenced(_) => {
                409
            }
            NodeError::Unsupported(_) => 501,
            NodeError::Exhausted(_) | NodeError::Unreachable(_) | NodeError::Refused(..) => 503,
            NodeError::BootFailed(_) | NodeError::Network(_) | NodeError::Failed(_) => 500,
        }
    }

    pub fn of(e: &NodeError) -> Self {
        let (code, arg) = match e {
            NodeError::UnknownTemplate(a) => ("unknown_template", a.clone()),
            NodeError::UnknownSandbox(a) => ("unknown_sandbox", a.clone()),
            NodeError::UnknownImage(a) => ("unknown_image", a.clone()),
            NodeError::InvalidResources(a) => ("invalid_resources", a.clone()),
            NodeError::InvalidSandboxId(a) => ("invalid_sandbox_id", a.clone()),
            NodeError::SandboxIdTaken(a) => ("sandbox_id_taken", a.clone()),
            NodeError::NotRunning(a) => ("not_running", a.clone()),
            NodeError::StaleRun(a) => ("stale_run", a.clone()),
            NodeError::Fenced(a) => ("fenced", a.clone()),
            NodeError::Unsupported(a) => ("unsupported", a.clone()),
            NodeError::BadImage(a) => ("bad_image", a.clone()),
            NodeError::InvalidVolume(a) => ("invalid_volume", a.clone()),
            NodeError::UnknownVolume(a) => ("unknown_volume", a.clone()),
            NodeError::VolumeBusy(a) => ("volume_busy", a.clone()),
            NodeError::BootFailed(c) => ("boot_failed", c.to_string()),
            NodeError::Exhausted(c) => ("exhausted", c.to_string()),
            NodeError::Network(c) => ("network", c.to_string()),
            NodeError::Unreachable(c) => ("unreachable", c.to_string()),
            NodeError::Failed(c) => ("failed", c.to_string()),
            NodeError::Refused(_, m) => ("refused", m.clone()),
        };
        ErrorReply {
            code: code.into(),
            message: arg,
            reason: match e {
                NodeError::Refused(reason, _) => Some(*reason),
                _ => None,
            },
        }
    }

    /// The variant back; an unknown code is a `Failed` with the message.
    pub fn into_error(self) -> NodeError {
        let cause = |m: String| -> super::error::Cause { Box::new(RemoteFailure(m)) };
        match self.code.as_str() {
            "unknown_template" => NodeError::UnknownTemplate(self.message),
            "unknown_sandbox" => NodeError::UnknownSandbox(self.message),
            "unknown_image" => NodeError::UnknownImage(self.message),
            "invalid_resources" => NodeError::InvalidResources(self.message),
            "invalid_sandbox_id" => NodeError::InvalidSandboxId(self.message),
            "sandbox_id_taken" => NodeError::SandboxIdTaken(self.message),
            "not_running" => NodeError::NotRunning(self.message),
            "stale_run" => NodeError::StaleRun(self.message),
            "fenced" => NodeError::Fenced(self.message),
            "unsupported" => NodeError::Unsupported(self.message),
            "bad_image" => NodeError::BadImage(self.message),
            "invalid_volume" => NodeError::InvalidVolume(self.message),
            "unknown_volume" => NodeError::UnknownVolume(self.message),
            "volume_busy" => NodeError::VolumeBusy(self.message),
            "boot_failed" => NodeError::BootFailed(cause(self.message)),
            "exhausted" => NodeError::Exhausted(cause(self.message)),
            "network" => NodeError::Network(cause(self.message)),
            "unreachable" => NodeError::Unreachable(cause(self.message)),
            "refused" => match self.reason {
                Some(reason) => NodeError::Refused(reason, self.message),
                None => NodeError::Failed(cause(self.message)),
            },
            _ => NodeError::Failed(cause(self.message)),
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn mac(secret: &[u8], expiry: u64) -> hmac::Hmac<sha2::Sha256> {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).expect("any key length");
    mac.update(TOKEN_LABEL);
    mac.update(expiry.to_string().as_bytes());
    mac
}

/// A token valid for `ttl` (at most [`TOKEN_TTL`]), as an `Authorization` value.
pub fn token(secret: &[u8], ttl: Duration) -> String {
    let expiry = unix_now() + ttl.min(TOKEN_TTL).as_secs();
    let tag = hex::encode(mac(secret, expiry).finalize().into_bytes());
    format!("Bearer {expiry}.{tag}")
}

/// Whether `authorization` carries a token of `secret` that is valid now.
pub fn token_valid(secret: &[u8], authorization: &str) -> bool {
    let Some((expiry, tag)) = authorization.strip_prefix("Bearer ").and_then(|t| t.split_once('.')) else {
        return false;
    };
    let (Ok(expiry), Ok(tag)) = (expiry.parse::<u64>(), hex::decode(tag)) else {
        return false;
    };
    let now = unix_now();
    expiry >= now && expiry <= now + TOKEN_TTL.as_secs() && mac(secret, expiry).verify_slice(&tag).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_by_secret_tag_and_expiry() {
        let t = token(b"cluster secret", Duration::from_secs(60));
        assert!(token_valid(b"cluster secret", &t));
        assert!(!token_valid(b"another secret", &t));
        let (expiry, tag) = t.strip_prefix("Bearer ").unwrap().split_once('.').unwrap();
        let later: u64 = expiry.parse::<u64>().unwrap() + 1;
        assert!(
            !token_valid(b"cluster secret", &format!("Bearer {later}.{tag}")),
            "a changed expiry"
        );
        // Expired, and one valid for longer than TOKEN_TTL, both refused though correctly signed.
        for expiry in [unix_now() - 1, unix_now() + TOKEN_TTL.as_secs() + 60] {
            let tag = hex::encode(mac(b"cluster secret", expiry).finalize().into_bytes());
            assert!(!token_valid(b"cluster secret", &format!("Bearer {expiry}.{tag}")));
        }
        assert!(!token_valid(b"cluster secret", "Bearer nonsense"));
    }

    #[test]
    fn node_errors_keep_their_variant_across_the_wire() {
        let e = NodeError::NotRunning("sb1".into());
        let back = ErrorReply::of(&e).into_error();
        assert!(matches!(back, NodeError::NotRunning(ref id) if id == "sb1"));
        let e = NodeError::Exhausted(Box::new(RemoteFailure("no link left".into())));
        assert_eq!(ErrorReply::status(&e), 503);
        let back = ErrorReply::of(&e).into_error();
        assert!(matches!(back, NodeError::Exhausted(_)));
        assert_eq!(back.to_string(), "no link left");
        let e = NodeError::Refused(super::super::Refusal::Capacity, "full".into());
        assert_eq!(ErrorReply::status(&e), 503);
        let back = ErrorReply::of(&e).into_error();
        assert!(matches!(back, NodeError::Refused(super::super::Refusal::Capacity, ref m) if m == "full"));
    }
}
