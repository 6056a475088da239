//! A tenant's webhooks: lifecycle events POSTed to a URL it registers, signed, in order, retried
//! with backoff, each attempt recorded; never on a lifecycle change's path (the engine only
//! records the event; [`Core::spawn_webhooks`] delivers, on one replica at a time).
//!
//! - **Signature**: `Airlock-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`
//!   under the webhook's secret (derived from the server secret and the webhook's id, shown at
//!   its creation, never stored). A receiver recomputes it and refuses a `t` outside its replay
//!   window (5 minutes is usual).
//! - **Order**: one event at a time per webhook, oldest first: the next waits until this one is
//!   delivered (a 2xx) or given up on after [`MAX_ATTEMPTS`].
//! - **Where**: http or https; a URL whose host resolves to the platform's denied ranges
//!   (loopback, private, link-local, CGNAT, metadata), this host's own addresses
//!   (`Config::webhook_host_addrs`) or ranges no receiver lives in ([`NO_RECEIVER`]:
//!   documentation, benchmarking) is refused at creation and at every delivery, where only the
//!   addresses just checked are dialed (a name that changes its answer gains nothing), unless
//!   the operator allows it (`Config::webhook_allow_private`). No redirects are followed.

use super::events::{event_view, parse_kinds};
use super::sandboxes::acting_tenant;
use super::{Core, Principal};
use crate::error::{CoreError, CoreResult, Kind};
use crate::model::{CreateWebhookRequest, DeliveryView, NewWebhook, UpdateWebhookRequest, WebhookView};
use crate::records::{now_ms, rfc3339, DeliveryRecord, EventRecord, WebhookRecord};
use crate::store::EventFilter;
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Tries of one event before it is given up on.
pub const MAX_ATTEMPTS: u32 = 8;
/// How long a receiver has to answer.
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest wait between tries.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// How often the delivery loop looks (besides being woken by a new event).
const LOOK_EVERY: Duration = Duration::from_millis(500);
/// Webhooks one tenant may have.
pub const MAX_WEBHOOKS: usize = 20;
/// The duty one replica holds while it delivers.
const DUTY: &str = "webhooks";
pub const SIGNATURE_HEADER: &str = "Airlock-Signature";

/// Ranges webhooks never go to besides the platform's: no real receiver lives in them (RFC 5737
/// documentation, RFC 2544 benchmarking, RFC 3849), and a test network or lab does.
pub const NO_RECEIVER: [(&str, &str); 5] = [
    ("192.0.2.0/24", "documentation"),
    ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"),
    ("198.18.0.0/15", "benchmarking"),
    ("2001:db8::/32", "documentation"),
];

/// Why webhooks never go to `ip` under `config`, if they never do.
fn denied(config: &super::Config, ip: IpAddr) -> Option<String> {
    if config.webhook_allow_private {
        return None;
    }
    if let Some(d) = config.egress.platform.check(ip) {
        return Some(d.rule);
    }
    if config.webhook_host_addrs.contains(&ip) {
        return Some("this host's own address".into());
    }
    NO_RECEIVER.iter().find_map(|(net, why)| {
        let net: ipnet::IpNet = net.parse().expect("built-in range parses");
        net.contains(&ip).then(|| format!("{net} ({why})"))
    })
}

/// The wait after a webhook's `failures`-th failed try of an event: 1 s, 2 s, 4 s, ... 60 s.
pub fn backoff(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(6)).min(MAX_BACKOFF)
}

/// Why a receiver's answer `status` is no delivery, if it is none: only a 2xx is one. A 3xx
/// (never followed: the agent takes no redirects) is a failed attempt like any other.
fn answered(status: u16) -> Option<String> {
    match status {
        200..=299 => None,
        300..=399 => Some(format!(
            "the receiver answered {status}, a redirect (not followed: only a 2xx delivers)"
        )),
        _ => Some(format!("the receiver answered {status}")),
    }
}

/// `t=<at>,v1=<hex>`: the signature of `body` sent at `at` (Unix seconds) under `secret`.
pub fn sign(secret: &str, at: i64, body: &[u8]) -> String {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).expect("any key length");
    mac.update(at.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("t={at},v1={}", hex::encode(mac.finalize().into_bytes()))
}

fn check_name(name: &str) -> CoreResult<()> {
    if name.len() > 128 || name.chars().any(char::is_control) {
        return Err(CoreError::invalid(
            "name",
            "at most 128 characters, no control characters",
        ));
    }
    Ok(())
}

fn view(w: &WebhookRecord) -> WebhookView {
    WebhookView {
        id: w.id.clone(),
        name: w.name.clone(),
        url: w.url.clone(),
        events: w.kinds.clone(),
        enabled: w.enabled,
        created_at: rfc3339(w.created_at_ms),
        last_attempt_at: w.last_attempt_at_ms.map(rfc3339),
        last_status: w.last_status,
        last_error: w.last_error.clone(),
        attempts: w.attempts,
    }
}

/// Webhooks being delivered to now (by this process).
#[derive(Default)]
pub struct InFlight(Mutex<HashSet<String>>);

impl Core {
    /// The signing secret of webhook `id`.
    fn webhook_secret(&self, id: &str) -> String {
        format!("whsec_{}", self.derive_token(b"webhook-secret:", id))
    }

    /// The addresses `url` may be delivered to: http(s), a host that resolves, and (unless the
    /// operator allows it) none of them in the platform's denied ranges.
    pub(crate) async fn webhook_addrs(&self, url: &str) -> CoreResult<(url::Url, Vec<SocketAddr>)> {
        let bad = |why: String| CoreError::invalid("url", why);
        let parsed = url::Url::parse(url).map_err(|e| bad(format!("{url:?} is not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(bad(format!("must be http or https, got {}", parsed.scheme())));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(bad(
                "must not carry credentials (sign with the webhook's secret instead)".into(),
            ));
        }
        let host = parsed.host_str().ok_or_else(|| bad("has no host".into()))?.to_string();
        let port = parsed.port_or_known_default().unwrap_or(80);
        let host_for_lookup = host.trim_start_matches('[').trim_end_matches(']').to_string();
        let addrs: Vec<SocketAddr> = match tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::lookup_host((host_for_lookup, port)),
        )
        .await
        {
            Ok(Ok(a)) => a.collect(),
            Ok(Err(e)) => return Err(bad(format!("{host} does not resolve: {e}"))),
            Err(_) => return Err(bad(format!("{host} did not resolve within 5 s"))),
        };
        if addrs.is_empty() {
            return Err(bad(format!("{host} resolves to no address")));
        }
        if let Some((a, why)) = addrs.iter().find_map(|a| Some((a.ip(), denied(&self.config, a.ip())?))) {
            return Err(bad(format!(
                "{host} resolves to {a}, in the denied ranges webhooks never reach ({why}; loopback, \
                 private, link-local, metadata, documentation, this host's own addresses)"
            )));
        }
        Ok((parsed, addrs))
    }

    pub async fn create_webhook(&self, principal: &Principal, req: CreateWebhookRequest) -> CoreResult<NewWebhook> {
        let tenant = acting_tenant(principal)?;
        let r = async {
            check_name(&req.name)?;
            let kinds = parse_kinds(&req.events)?;
            self.webhook_addrs(&req.url).await?;
            if self.store.webhooks(&tenant.id).await?.len() >= MAX_WEBHOOKS {
                return Err(CoreError::invalid(
                    "url",
                    format!("a tenant has at most {MAX_WEBHOOKS} webhooks"),
                ));
            }
            let record = WebhookRecord {
                id: format!("wh_{}", airlock_runtime::datadir::random_hex(8)),
                tenant_id: tenant.id.clone(),
                name: req.name.clone(),
                url: req.url.clone(),
                kinds,
                enabled: true,
                created_at_ms: now_ms(),
                // Events from now on.
                cursor_seq: self.store.last_event_seq().await?,
                attempts: 0,
                next_at_ms: 0,
                last_status: None,
                last_error: None,
                last_attempt_at_ms: None,
            };
            self.store.insert_webhook(&record).await?;
            Ok(NewWebhook {
                secret: self.webhook_secret(&record.id),
                info: view(&record),
            })
        }
        .await;
        let object = r.as_ref().ok().map(|w| w.info.id.clone());
        self.audit(
            &principal.actor(),
            Some(&tenant.name),
            "webhook.create",
            object.as_deref(),
            Self::outcome(&r),
        )
        .await;
        r
    }

    async fn webhook_of(&self, principal: &Principal, id: &str) -> CoreResult<WebhookRecord> {
        let tenant = acting_tenant(principal)?;
        self.store
            .webhook(&tenant.id, id)
            .await?
            .ok_or_else(|| CoreError::not_found(Kind::Webhook, id))
    }

    pub async fn webhooks(&self, principal: &Principal) -> CoreResult<Vec<WebhookView>> {
        let tenant = acting_tenant(principal)?;
        Ok(self.store.webhooks(&tenant.id).await?.iter().map(view).collect())
    }

    pub async fn webhook(&self, principal: &Principal, id: &str) -> CoreResult<WebhookView> {
        Ok(view(&self.webhook_of(principal, id).await?))
    }

    pub async fn update_webhook(
        &self,
        principal: &Principal,
        id: &str,
        req: UpdateWebhookRequest,
    ) -> CoreResult<WebhookView> {
        let mut w = self.webhook_of(principal, id).await?;
        if let Some(url) = req.url {
            self.webhook_addrs(&url).await?;
            w.url = url;
        }
        if let Some(events) = req.events {
            w.kinds = parse_kinds(&events)?;
        }
        if let Some(name) = req.name {
            check_name(&name)?;
            w.name = name;
        }
        if let Some(enabled) = req.enabled {
            w.enabled = enabled;
        }
        if !self.store.update_webhook(&w).await? {
            return Err(CoreError::not_found(Kind::Webhook, id));
        }
        Ok(view(&w))
    }

    pub async fn delete_webhook(&self, principal: &Principal, id: &str) -> CoreResult<()> {
        let tenant = acting_tenant(principal)?;
        let r = async {
            if !self.store.delete_webhook(&tenant.id, id).await? {
                return Err(CoreError::not_found(Kind::Webhook, id));
            }
            Ok(())
        }
        .await;
        self.audit(
            &principal.actor(),
            Some(&tenant.name),
            "webhook.delete",
            Some(id),
            Self::outcome(&r),
        )
        .await;
        r
    }

    /// A webhook's delivery attempts, newest first.
    pub async fn webhook_deliveries(&self, principal: &Principal, id: &str) -> CoreResult<Vec<DeliveryView>> {
        let w = self.webhook_of(principal, id).await?;
        Ok(self
            .store
            .deliveries(&w.id, 100)
            .await?
            .into_iter()
            .map(|d| DeliveryView {
                event_id: d.event_id,
                attempt: d.attempt,
                at: rfc3339(d.at_ms),
                status: d.status,
                error: d.error,
                duration_ms: d.duration_ms,
            })
            .collect())
    }

    /// Deliver every tenant's events to its webhooks for as long as the process runs (while
    /// this replica holds the duty; the next event wakes it at once).
    pub fn spawn_webhooks(&self) {
        let core = self.clone();
        let in_flight = Arc::new(InFlight::default());
        tokio::spawn(async move {
            let mut recorded = core.engine.events_recorded();
            loop {
                if let Err(e) = core.webhook_round(&in_flight).await {
                    tracing::warn!("webhooks: {e}");
                }
                let _ = tokio::time::timeout(LOOK_EVERY, recorded.changed()).await;
            }
        });
    }

    async fn webhook_round(&self, in_flight: &Arc<InFlight>) -> CoreResult<()> {
        // A read first: with no webhook, no replica writes the duty's lease twice a second.
        let webhooks = self.store.enabled_webhooks().await?;
        if webhooks.is_empty() || !self.store.lead(DUTY).await? {
            return Ok(());
        }
        let now = now_ms();
        for w in webhooks {
            if w.next_at_ms > now
                || !in_flight
                    .0
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(w.id.clone())
            {
                continue;
            }
            let (core, in_flight) = (self.clone(), in_flight.clone());
            tokio::spawn(async move {
                let id = w.id.clone();
                if let Err(e) = core.deliver_fresh(w).await {
                    tracing::warn!(webhook = %id, "webhook: {e}");
                }
                in_flight.0.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            });
        }
        Ok(())
    }

    /// Read `w` again now that this task holds it: the round's list may predate the progress
    /// the previous task saved (its attempt count and backoff), and a stale copy would try the
    /// same event again as the same attempt.
    async fn deliver_fresh(&self, w: WebhookRecord) -> CoreResult<()> {
        match self.store.webhook(&w.tenant_id, &w.id).await? {
            Some(w) if w.enabled && w.next_at_ms <= now_ms() => self.deliver_pending(w).await,
            _ => Ok(()),
        }
    }

    /// Deliver `w`'s pending events in order until none is left or one fails (tried again after
    /// its backoff).
    async fn deliver_pending(&self, mut w: WebhookRecord) -> CoreResult<()> {
        loop {
            let page = self
                .store
                .events(&EventFilter {
                    tenant_id: w.tenant_id.clone(),
                    after_seq: Some(w.cursor_seq),
                    limit: 100,
                    ..Default::default()
                })
                .await?;
            let Some(last) = page.last().map(|e| e.seq) else {
                return Ok(());
            };
            let Some(event) = page
                .into_iter()
                .find(|e| w.kinds.is_empty() || w.kinds.contains(&e.kind))
            else {
                // Nothing in this page is the webhook's: past it.
                w.cursor_seq = last;
                self.store.set_webhook_progress(&w).await?;
                continue;
            };
            let attempt = w.attempts + 1;
            let (status, error, took) = self.deliver(&w, &event, attempt).await;
            let at = now_ms();
            self.store
                .insert_delivery(&DeliveryRecord {
                    webhook_id: w.id.clone(),
                    event_id: event.id.clone(),
                    attempt,
                    at_ms: at,
                    status,
                    error: error.clone(),
                    duration_ms: took.as_millis() as u64,
                })
                .await?;
            w.last_status = status;
            w.last_attempt_at_ms = Some(at);
            let ok = error.is_none();
            if ok || attempt >= MAX_ATTEMPTS {
                w.cursor_seq = event.seq;
                w.attempts = 0;
                w.next_at_ms = 0;
                w.last_error = error.map(|e| format!("gave up on {} after {attempt} attempts: {e}", event.id));
            } else {
                w.attempts = attempt;
                w.next_at_ms = at + backoff(attempt).as_millis() as i64;
                w.last_error = error;
            }
            self.store.set_webhook_progress(&w).await?;
            if !ok {
                return Ok(());
            }
        }
    }

    /// One try: (the receiver's status, the error if it was no 2xx, how long it took).
    async fn deliver(
        &self,
        w: &WebhookRecord,
        event: &EventRecord,
        attempt: u32,
    ) -> (Option<u16>, Option<String>, Duration) {
        let started = Instant::now();
        let addrs = match self.webhook_addrs(&w.url).await {
            Ok((_, addrs)) => addrs,
            Err(e) => return (None, Some(e.to_string()), started.elapsed()),
        };
        let body = serde_json::to_vec(&event_view(event.clone())).expect("serializable");
        let at = now_ms() / 1000;
        let signature = sign(&self.webhook_secret(&w.id), at, &body);
        let (url, webhook, event_id) = (w.url.clone(), w.id.clone(), event.id.clone());
        let sent = tokio::task::spawn_blocking(move || {
            let agent = ureq::AgentBuilder::new()
                .timeout(DELIVERY_TIMEOUT)
                .redirects(0)
                // Only the addresses just checked: a second lookup could answer others.
                .resolver(move |_: &str| Ok(addrs.clone()))
                .build();
            let sent = agent
                .post(&url)
                .set("Content-Type", "application/json")
                .set("User-Agent", "airlock-webhooks")
                .set(SIGNATURE_HEADER, &signature)
                .set("Airlock-Webhook-Id", &webhook)
                .set("Airlock-Event-Id", &event_id)
                .set("Airlock-Delivery-Attempt", &attempt.to_string())
                .send_bytes(&body);
            // Only what is kept of the answer: its status, or the error as text.
            match sent {
                Ok(r) => (Some(r.status()), answered(r.status())),
                Err(ureq::Error::Status(code, _)) => (Some(code), answered(code)),
                Err(e) => (None, Some(e.to_string())),
            }
        })
        .await;
        let (status, error) = sent.unwrap_or_else(|e| (None, Some(format!("delivery task: {e}"))));
        (status, error, started.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_minute() {
        let secs: Vec<u64> = (1..=9).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
    }

    #[test]
    fn webhooks_never_reach_the_host_or_ranges_without_receivers() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut config = super::super::Config {
            webhook_host_addrs: vec![ip("8.8.4.4")],
            ..Default::default()
        };
        for (addr, says) in [
            ("127.0.0.1", "loopback"),
            ("10.1.2.3", "private"),
            ("8.8.4.4", "own address"),
            ("192.0.2.10", "documentation"),
            ("198.51.100.1", "documentation"),
            ("203.0.113.9", "documentation"),
            ("198.19.255.1", "benchmarking"),
            ("2001:db8::1", "documentation"),
        ] {
            let why = denied(&config, ip(addr));
            assert!(why.as_deref().is_some_and(|w| w.contains(says)), "{addr}: {why:?}");
        }
        for public in ["8.8.8.8", "198.20.0.1", "2001:db9::1"] {
            assert_eq!(denied(&config, ip(public)), None, "{public}");
        }
        // The operator's opt-out lifts every deny (the tests' receivers on loopback).
        config.webhook_allow_private = true;
        assert_eq!(denied(&config, ip("127.0.0.1")), None);
        assert_eq!(denied(&config, ip("8.8.4.4")), None);
    }

    #[test]
    fn only_a_2xx_delivers() {
        for ok in [200, 202, 204, 299] {
            assert_eq!(answered(ok), None, "{ok}");
        }
        for failed in [100, 301, 302, 307, 308, 399, 400, 500] {
            assert!(
                answered(failed).is_some_and(|e| e.contains(&failed.to_string())),
                "{failed}"
            );
        }
    }

    #[test]
    fn a_signature_covers_time_and_body() {
        let s = sign("whsec_x", 1700000000, b"{}");
        assert!(s.starts_with("t=1700000000,v1="));
        assert_ne!(s, sign("whsec_x", 1700000001, b"{}"));
        assert_ne!(s, sign("whsec_x", 1700000000, b"{ }"));
        assert_ne!(s, sign("whsec_y", 1700000000, b"{}"));
    }
}
