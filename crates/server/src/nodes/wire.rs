//! A node's HTTP face, stated once: its routes (under [`PREFIX`]), their messages, how a
//! `NodeError` travels, and how every call and its answer are signed.
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
//! Every request is signed, none carries a bearer token: HMAC-SHA256 of the cluster secret over
//! its method, path and query, body digest (SHA-256; [`UNSIGNED`] on the agent route, whose
//! bodies stream to the agent), the name of the node it is for, its time and a random nonce
//! ([`sign_request`], headers [`TARGET_HEADER`] and on). A node ([`verify_request`]) refuses 401
//! one signed for another node, one whose time is more than [`SKEW`] from its own either way,
//! one whose nonce it saw in that window (a replay; it remembers at most [`NONCES_MAX`] and
//! refuses 503 rather than forget one early), one signed before it started (a process before
//! it may have taken it), and any change of what was signed. A caller's
//! first call to a node is `GET /report` for [`ANY_NODE`], the only route that takes it.
//!
//! Every reply the node signs back ([`sign_reply`]: over the request's nonce, the node's name,
//! the status and the body's digest, [`UNSIGNED`] for the exit stream and the agent's answers),
//! and a caller takes no reply that does not verify: a node proves the secret on the first
//! report, before the caller sends it anything else, and names itself there; every later call
//! is signed for that name.
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
/// How far a request's time may be from the node's, either way (clock skew and transit): a
/// signed request is accepted only that long, and its nonce remembered as long.
pub const SKEW: Duration = Duration::from_secs(30);
const REQUEST_LABEL: &[u8] = b"airlock-node/v2 request";
const REPLY_LABEL: &[u8] = b"airlock-node/v2 reply";
/// A signed request's headers: the node it is for, its time (unix s), its nonce (16 random
/// bytes, hex), its body's digest (hex SHA-256, or [`UNSIGNED`]), its HMAC.
pub const TARGET_HEADER: &str = "airlock-node-target";
pub const TIME_HEADER: &str = "airlock-node-time";
pub const NONCE_HEADER: &str = "airlock-node-nonce";
pub const BODY_HEADER: &str = "airlock-node-body";
pub const SIGNATURE_HEADER: &str = "airlock-node-signature";
/// A signed reply's: the node's name (with [`BODY_HEADER`] and [`SIGNATURE_HEADER`]).
pub const NAME_HEADER: &str = "airlock-node-name";
/// The target of a caller's first report, before it knows the node's name: accepted on
/// `GET /report` only, whose signed reply names the node.
pub const ANY_NODE: &str = "*";
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

/// The digest a request or reply is signed with when its body streams (the agent
/// pass-through's requests, the exit stream and the agent's answers): its integrity is then the
/// channel's (TLS), not the signature's.
pub const UNSIGNED: &str = "UNSIGNED";

/// The body digest a signature covers: the hex SHA-256 of `body`.
pub fn body_digest(body: &[u8]) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(body))
}

/// One MAC over `label` and each field, every field length-prefixed (no field can run into
/// the next).
fn mac_of(secret: &[u8], label: &[u8], fields: &[&[u8]]) -> hmac::Hmac<sha2::Sha256> {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).expect("any key length");
    mac.update(label);
    for f in fields {
        mac.update(&(f.len() as u32).to_be_bytes());
        mac.update(f);
    }
    mac
}

/// The request's fields a signature binds, in order.
struct RequestFields<'a> {
    method: &'a str,
    path: &'a str,
    body: &'a str,
    target: &'a str,
    time: &'a str,
    nonce: &'a str,
}

impl RequestFields<'_> {
    fn mac(&self, secret: &[u8]) -> hmac::Hmac<sha2::Sha256> {
        let f = [self.method, self.path, self.body, self.target, self.time, self.nonce];
        mac_of(secret, REQUEST_LABEL, &f.map(str::as_bytes))
    }
}

/// The headers of one signed request (see the module doc): `(name, value)` pairs, and the
/// nonce its reply is signed over.
#[derive(Debug, Clone)]
pub struct Signed {
    pub headers: Vec<(&'static str, String)>,
    pub nonce: String,
}

/// Sign one request: `method` and `path` (with its query) as sent, `body` its [`body_digest`]
/// (or [`UNSIGNED`] on the agent route), `target` the name of the node it is for.
pub fn sign_request(secret: &[u8], method: &str, path: &str, body: &str, target: &str) -> Signed {
    let mut nonce = [0u8; 16];
    getrandom::getrandom(&mut nonce).expect("the kernel's CSPRNG is readable");
    sign_request_at(secret, method, path, body, target, unix_now(), &hex::encode(nonce))
}

fn sign_request_at(
    secret: &[u8],
    method: &str,
    path: &str,
    body: &str,
    target: &str,
    time: u64,
    nonce: &str,
) -> Signed {
    let time = time.to_string();
    let fields = RequestFields {
        method,
        path,
        body,
        target,
        time: &time,
        nonce,
    };
    let tag = hex::encode(fields.mac(secret).finalize().into_bytes());
    Signed {
        headers: vec![
            (TARGET_HEADER, target.to_string()),
            (TIME_HEADER, time),
            (NONCE_HEADER, nonce.to_string()),
            (BODY_HEADER, body.to_string()),
            (SIGNATURE_HEADER, tag),
        ],
        nonce: nonce.to_string(),
    }
}

/// Why a node refused a request's signature (401, but `Busy`: 503).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsigned {
    #[error("a signed node request is required (missing {0})")]
    Missing(&'static str),
    #[error("the request is signed for node {0:?}, not this one")]
    OtherNode(String),
    #[error("the request's time is more than {}s from this node's", SKEW.as_secs())]
    Stale,
    #[error("the request's body is not the one signed")]
    Body,
    #[error("the request's signature is not of the cluster secret")]
    Signature,
    #[error("the request was seen already (a replay)")]
    Replayed,
    #[error("the request was signed before this node started (it cannot tell it from a replay)")]
    BeforeStart,
    #[error("too many requests in the last {}s to remember their nonces", SKEW.as_secs())]
    Busy,
}

/// The nonces a node accepted in the last [`SKEW`] window and a bit: a request whose nonce is
/// here is a replay. Bounded: when full of live nonces, requests are refused (`Busy`) rather
/// than remembered without bound.
pub struct Nonces {
    seen: std::sync::Mutex<(std::collections::HashMap<[u8; 16], u64>, u64)>,
    cap: usize,
    /// When this set began (unix s): a request signed earlier may have been taken by an
    /// earlier process of this node, whose nonces are gone, so it is refused.
    since: u64,
}

/// The nonces a node holds at most: 131072 in a minute's window is over 2000 calls a second.
pub const NONCES_MAX: usize = 1 << 17;

impl Default for Nonces {
    fn default() -> Self {
        Nonces::with_capacity(NONCES_MAX)
    }
}

impl Nonces {
    /// A set beginning now, holding at most `cap` nonces.
    pub fn with_capacity(cap: usize) -> Self {
        Nonces::since(cap, unix_now())
    }

    fn since(cap: usize, since: u64) -> Self {
        Nonces {
            seen: Default::default(),
            cap,
            since,
        }
    }

    /// Remember `nonce`, signed at `time`, until that time's window has passed (then the time
    /// alone refuses it); false if it was seen, or if no room is left.
    fn admit(&self, nonce: [u8; 16], time: u64, now: u64) -> Result<(), Unsigned> {
        if time < self.since {
            return Err(Unsigned::BeforeStart);
        }
        let mut guard = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let (seen, swept) = &mut *guard;
        if now != *swept || seen.len() >= self.cap {
            seen.retain(|_, until| *until >= now);
            *swept = now;
        }
        if seen.contains_key(&nonce) {
            return Err(Unsigned::Replayed);
        }
        if seen.len() >= self.cap {
            return Err(Unsigned::Busy);
        }
        seen.insert(nonce, time + SKEW.as_secs() + 1);
        Ok(())
    }
}

/// Check one request at node `name`: its signature of `secret` over what it says (`method`,
/// `path` with its query, the `body` digest this node computed, or [`UNSIGNED`] on a route whose
/// body streams), its target (this node; [`ANY_NODE`] only where `any_node_ok`: a first report,
/// before the caller knows the name), its time within [`SKEW`], its nonce new. Returns the nonce
/// the reply is signed over.
#[allow(clippy::too_many_arguments)]
pub fn verify_request(
    secret: &[u8],
    name: &str,
    method: &str,
    path: &str,
    body: &str,
    any_node_ok: bool,
    headers: &hyper::HeaderMap,
    nonces: &Nonces,
) -> Result<String, Unsigned> {
    let (target, time, nonce, tag) = precheck(name, any_node_ok, headers)?;
    let (Ok(t), Ok(tag)) = (time.parse::<u64>(), hex::decode(tag)) else {
        return Err(Unsigned::Signature);
    };
    let now = unix_now();
    let Some(nonce_bytes) = hex::decode(nonce).ok().and_then(|n| <[u8; 16]>::try_from(n).ok()) else {
        return Err(Unsigned::Signature);
    };
    if headers.get(BODY_HEADER).and_then(|v| v.to_str().ok()) != Some(body) {
        return Err(Unsigned::Body);
    }
    let fields = RequestFields {
        method,
        path,
        body,
        target,
        time,
        nonce,
    };
    fields.mac(secret).verify_slice(&tag).map_err(|_| Unsigned::Signature)?;
    // Only once it is known to be of the secret: no stranger fills the set.
    nonces.admit(nonce_bytes, t, now)?;
    Ok(nonce.to_string())
}

/// What can be checked of a request before its body is read (no secret needed to pass it, so
/// it only spares the node reading the body of a request that would be refused anyway): its
/// signature's headers there, for this node, at a time within the window. Its target, time,
/// nonce and tag.
pub fn precheck<'h>(
    name: &str,
    any_node_ok: bool,
    headers: &'h hyper::HeaderMap,
) -> Result<(&'h str, &'h str, &'h str, &'h str), Unsigned> {
    let header = |h: &'static str| headers.get(h).and_then(|v| v.to_str().ok()).ok_or(Unsigned::Missing(h));
    let (target, time, nonce, tag) = (
        header(TARGET_HEADER)?,
        header(TIME_HEADER)?,
        header(NONCE_HEADER)?,
        header(SIGNATURE_HEADER)?,
    );
    header(BODY_HEADER)?;
    if target != name && !(any_node_ok && target == ANY_NODE) {
        return Err(Unsigned::OtherNode(target.chars().take(64).collect()));
    }
    let t = time.parse::<u64>().map_err(|_| Unsigned::Signature)?;
    let now = unix_now();
    if t + SKEW.as_secs() < now || t > now + SKEW.as_secs() {
        return Err(Unsigned::Stale);
    }
    Ok((target, time, nonce, tag))
}

/// The signature of node `name`'s reply to the request of `nonce`: its status and body digest.
pub fn sign_reply(secret: &[u8], nonce: &str, name: &str, status: u16, body: &str) -> String {
    let status = status.to_string();
    let f = [nonce, name, &status, body];
    hex::encode(
        mac_of(secret, REPLY_LABEL, &f.map(str::as_bytes))
            .finalize()
            .into_bytes(),
    )
}

/// Whether a reply proves the cluster secret: its signature over the request's `nonce`, its
/// `status` and `body` digest (computed here, or [`UNSIGNED`] for a stream). The node's name
/// (as it signed it) if so.
pub fn verify_reply(secret: &[u8], nonce: &str, status: u16, body: &str, headers: &hyper::HeaderMap) -> Option<String> {
    let header = |h: &str| headers.get(h).and_then(|v| v.to_str().ok());
    let (name, claimed, tag) = (header(NAME_HEADER)?, header(BODY_HEADER)?, header(SIGNATURE_HEADER)?);
    if claimed != body {
        return None;
    }
    let tag = hex::decode(tag).ok()?;
    let status = status.to_string();
    let f = [nonce, name, &status, body];
    mac_of(secret, REPLY_LABEL, &f.map(str::as_bytes))
        .verify_slice(&tag)
        .ok()
        .map(|_| name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"cluster secret";

    /// `signed`'s headers as a request's.
    fn headers(signed: &Signed) -> hyper::HeaderMap {
        let mut h = hyper::HeaderMap::new();
        for (name, value) in &signed.headers {
            h.insert(*name, value.parse().unwrap());
        }
        h
    }

    fn check(
        h: &hyper::HeaderMap,
        name: &str,
        method: &str,
        path: &str,
        body: &str,
        n: &Nonces,
    ) -> Result<String, Unsigned> {
        verify_request(SECRET, name, method, path, body, false, h, n)
    }

    #[test]
    fn a_signed_request_passes_once_at_its_own_node() {
        let body = body_digest(b"{\"id\":\"sb1\"}");
        let s = sign_request(SECRET, "POST", "/node/v1/vms", &body, "node-a");
        let nonces = Nonces::default();
        let h = headers(&s);
        assert_eq!(
            check(&h, "node-a", "POST", "/node/v1/vms", &body, &nonces),
            Ok(s.nonce.clone())
        );
        // The same request again: a replay.
        assert_eq!(
            check(&h, "node-a", "POST", "/node/v1/vms", &body, &nonces),
            Err(Unsigned::Replayed)
        );
        // Another node, even one that never saw it: not its request.
        assert_eq!(
            check(&h, "node-b", "POST", "/node/v1/vms", &body, &Nonces::default()),
            Err(Unsigned::OtherNode("node-a".into()))
        );
    }

    #[test]
    fn a_changed_request_is_refused() {
        let body = body_digest(b"{}");
        let s = sign_request(SECRET, "POST", "/node/v1/vms/sb1/pause", &body, "node-a");
        let h = headers(&s);
        let fresh = Nonces::default;
        let path = "/node/v1/vms/sb1/pause";
        assert_eq!(
            check(&h, "node-a", "DELETE", path, &body, &fresh()),
            Err(Unsigned::Signature)
        );
        assert_eq!(
            check(&h, "node-a", "POST", "/node/v1/vms/sb2/pause", &body, &fresh()),
            Err(Unsigned::Signature)
        );
        assert_eq!(
            check(&h, "node-a", "POST", &format!("{path}?run=1"), &body, &fresh()),
            Err(Unsigned::Signature)
        );
        // The node computes the digest of the body it got: another body is not the one signed.
        assert_eq!(
            check(&h, "node-a", "POST", path, &body_digest(b"{ }"), &fresh()),
            Err(Unsigned::Body)
        );
        // A body claimed unsigned where it was signed (or the header rewritten to match).
        let mut forged = h.clone();
        forged.insert(BODY_HEADER, UNSIGNED.parse().unwrap());
        assert_eq!(
            check(&forged, "node-a", "POST", path, UNSIGNED, &fresh()),
            Err(Unsigned::Signature)
        );
        // Re-targeted: the target header rewritten to the node it is replayed at.
        let mut moved = h.clone();
        moved.insert(TARGET_HEADER, "node-b".parse().unwrap());
        assert_eq!(
            check(&moved, "node-b", "POST", path, &body, &fresh()),
            Err(Unsigned::Signature)
        );
        // A new nonce on a captured signature.
        let mut renonced = h.clone();
        renonced.insert(NONCE_HEADER, hex::encode([7u8; 16]).parse().unwrap());
        assert_eq!(
            check(&renonced, "node-a", "POST", path, &body, &fresh()),
            Err(Unsigned::Signature)
        );
        // Another secret.
        assert_eq!(
            verify_request(b"another secret", "node-a", "POST", path, &body, false, &h, &fresh()),
            Err(Unsigned::Signature)
        );
        let mut bare = h.clone();
        bare.remove(SIGNATURE_HEADER);
        assert_eq!(
            check(&bare, "node-a", "POST", path, &body, &fresh()),
            Err(Unsigned::Missing(SIGNATURE_HEADER))
        );
    }

    #[test]
    fn a_stale_or_future_request_is_refused_and_skew_within_the_window_is_not() {
        let body = body_digest(b"");
        let nonce = |i: u8| hex::encode([i; 16]);
        let path = "/node/v1/report";
        let now = unix_now();
        let skew = SKEW.as_secs();
        for (i, (time, ok)) in [
            (now - skew - 2, false),
            (now + skew + 2, false),
            (now - skew + 2, true),
            (now + skew - 2, true),
        ]
        .into_iter()
        .enumerate()
        {
            let s = sign_request_at(SECRET, "GET", path, &body, "node-a", time, &nonce(i as u8));
            let got = check(
                &headers(&s),
                "node-a",
                "GET",
                path,
                &body,
                &Nonces::since(NONCES_MAX, 0),
            );
            assert_eq!(got.is_ok(), ok, "{time} against {now}: {got:?}");
            if !ok {
                assert_eq!(got, Err(Unsigned::Stale));
            }
        }
    }

    #[test]
    fn a_request_signed_before_the_node_started_is_refused() {
        // The node restarted: its last process may have taken this request, and its nonces
        // went with it.
        let body = body_digest(b"");
        let now = unix_now();
        let s = sign_request_at(
            SECRET,
            "GET",
            "/node/v1/report",
            &body,
            "node-a",
            now - 1,
            &hex::encode([3u8; 16]),
        );
        let restarted = Nonces::since(NONCES_MAX, now);
        assert_eq!(
            check(&headers(&s), "node-a", "GET", "/node/v1/report", &body, &restarted),
            Err(Unsigned::BeforeStart)
        );
        let s = sign_request_at(
            SECRET,
            "GET",
            "/node/v1/report",
            &body,
            "node-a",
            now,
            &hex::encode([4u8; 16]),
        );
        assert!(check(&headers(&s), "node-a", "GET", "/node/v1/report", &body, &restarted).is_ok());
    }

    #[test]
    fn only_a_report_may_be_for_any_node() {
        let body = body_digest(b"");
        let s = sign_request(SECRET, "GET", "/node/v1/report", &body, ANY_NODE);
        let h = headers(&s);
        assert!(verify_request(
            SECRET,
            "node-a",
            "GET",
            "/node/v1/report",
            &body,
            true,
            &h,
            &Nonces::default()
        )
        .is_ok());
        assert_eq!(
            verify_request(
                SECRET,
                "node-a",
                "GET",
                "/node/v1/report",
                &body,
                false,
                &h,
                &Nonces::default()
            ),
            Err(Unsigned::OtherNode("*".into()))
        );
    }

    #[test]
    fn a_full_nonce_set_refuses_rather_than_forgets() {
        let nonces = Nonces::with_capacity(2);
        let body = body_digest(b"");
        let mut got = Vec::new();
        for _ in 0..3 {
            let s = sign_request(SECRET, "GET", "/node/v1/report", &body, "node-a");
            got.push(check(&headers(&s), "node-a", "GET", "/node/v1/report", &body, &nonces).err());
        }
        assert_eq!(got, [None, None, Some(Unsigned::Busy)]);
        // Once their window passed, they make room (the time check refuses them by then).
        let now = unix_now();
        assert!(nonces.admit([9; 16], now, now + SKEW.as_secs() + 2).is_ok());
    }

    #[test]
    fn a_reply_verifies_only_for_its_request_status_and_body() {
        let body = body_digest(b"{\"vms\":[]}");
        let tag = sign_reply(SECRET, "n1", "node-a", 200, &body);
        let mut h = hyper::HeaderMap::new();
        h.insert(NAME_HEADER, "node-a".parse().unwrap());
        h.insert(BODY_HEADER, body.parse().unwrap());
        h.insert(SIGNATURE_HEADER, tag.parse().unwrap());
        assert_eq!(verify_reply(SECRET, "n1", 200, &body, &h).as_deref(), Some("node-a"));
        assert_eq!(
            verify_reply(SECRET, "n2", 200, &body, &h),
            None,
            "another request's reply"
        );
        assert_eq!(verify_reply(SECRET, "n1", 500, &body, &h), None, "another status");
        assert_eq!(
            verify_reply(SECRET, "n1", 200, &body_digest(b"{}"), &h),
            None,
            "another body"
        );
        assert_eq!(verify_reply(b"another secret", "n1", 200, &body, &h), None);
        let mut renamed = h.clone();
        renamed.insert(NAME_HEADER, "node-b".parse().unwrap());
        assert_eq!(verify_reply(SECRET, "n1", 200, &body, &renamed), None, "another name");
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
