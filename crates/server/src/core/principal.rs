//! Who is calling: credentials are read from a request in one place (`Credentials`), and the
//! core turns them into a `Principal` for what a route accepts. Secrets are compared as hashes
//! or in constant time, and never logged.

use super::federation::{Federation, Refused, SignedIn};
use super::Core;
use crate::error::{CoreError, CoreResult, Kind};
use crate::records::{SandboxRecord, Tenant};
use crate::store::{token_hash, AccessHashes, TokenKind};
use axum::http::HeaderMap;
use base64::Engine as _;
use subtle::ConstantTimeEq;

/// How long a console sign-in form's token is good for (its cookie lasts as long).
pub const SIGN_IN_FORM_TTL_S: i64 = 3600;

/// The secrets a request carries, as each door spells them.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    /// `Authorization: Bearer <key>`: the native door's API key (and a sandbox owner's on ports).
    pub bearer: Option<String>,
    /// `X-API-KEY: <key>`: the E2B control plane's API key.
    pub x_api_key: Option<String>,
    /// `X-Access-Token: <token>`: a sandbox's envd access token.
    pub envd_token: Option<String>,
    /// `E2B-Traffic-Access-Token: <token>`: a sandbox's traffic token (its ports only).
    pub traffic_token: Option<String>,
}

/// Every header a caller may carry an airlock credential in. None of them ever reaches a
/// sandbox (the port proxy strips them; see `Core::is_platform_credential` for `Authorization`).
pub const CREDENTIAL_HEADERS: [&str; 3] = ["x-api-key", "x-access-token", "e2b-traffic-access-token"];

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

impl Credentials {
    pub fn from_headers(h: &HeaderMap) -> Self {
        let bearer = header(h, "authorization").and_then(|v| {
            let (scheme, rest) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim().to_string())
        });
        Self {
            bearer,
            x_api_key: header(h, "x-api-key").map(String::from),
            envd_token: header(h, "x-access-token").map(String::from),
            traffic_token: header(h, "e2b-traffic-access-token").map(String::from),
        }
    }

    /// Whether the request carries any credential at all (a port request without one is told
    /// so, whatever exists behind it).
    pub fn any(&self) -> bool {
        self.bearer.is_some() || self.x_api_key.is_some() || self.envd_token.is_some() || self.traffic_token.is_some()
    }

    /// The sandbox tokens presented that `accept` lets count, with their kinds.
    fn sandbox_tokens(&self, accept: Accept) -> Vec<(TokenKind, &str)> {
        let mut out = Vec::new();
        if let Some(t) = &self.envd_token {
            out.push((TokenKind::Envd, t.as_str()));
        }
        if let (true, Some(t)) = (accept.traffic_token, &self.traffic_token) {
            out.push((TokenKind::Traffic, t.as_str()));
        }
        out
    }
}

/// How a caller proved it may use one sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The sandbox's envd access token (`X-Access-Token`).
    EnvdToken,
    /// The sandbox's traffic token (`E2B-Traffic-Access-Token`): its ports only.
    TrafficToken,
    /// An API key (`Authorization: Bearer`) of the tenant that owns the sandbox.
    OwnerKey,
    /// No token: the route proves access itself (a signed URL, checked by
    /// `Core::check_signed_url`).
    Unverified,
}

#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one per request, never stored in bulk
pub enum Principal {
    /// An API key of a tenant, by the key's public id.
    Key {
        tenant: Tenant,
        key_id: String,
    },
    /// A signed-in caller (a JWT from a configured issuer, see `federation`) of this tenant.
    Federated {
        tenant: Tenant,
        signed_in: SignedIn,
    },
    Sandbox {
        sandbox: SandboxRecord,
        via: Via,
    },
}

impl Principal {
    /// Whether the caller signed in (a JWT from a configured issuer) rather than presenting an
    /// API key or a sandbox token. Rules that only trust a signed-in caller (egress profiles
    /// chosen by `X-Airlock-Egress-Profiles`) ask this, and nothing else.
    pub fn federated(&self) -> bool {
        matches!(self, Principal::Federated { .. })
    }

    /// The tenant acting, for a tenant-wide credential (not a sandbox's own token).
    pub fn tenant(&self) -> Option<&Tenant> {
        match self {
            Principal::Key { tenant: t, .. } | Principal::Federated { tenant: t, .. } => Some(t),
            Principal::Sandbox { .. } => None,
        }
    }

    /// Who acts, as audit rows name them (never a secret).
    pub fn actor(&self) -> String {
        match self {
            Principal::Key { key_id, .. } => format!("key:{key_id}"),
            Principal::Federated { signed_in, .. } => format!("jwt:{}#{}", signed_in.issuer, signed_in.subject),
            Principal::Sandbox { sandbox, .. } => format!("sandbox:{}", sandbox.id),
        }
    }
}

/// What a sandbox-scoped route accepts besides the sandbox's own access token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accept {
    pub owner_key: bool,
    /// The sandbox's traffic token: only its ports accept it, never envd.
    pub traffic_token: bool,
    /// A request without any token (a signed URL, checked afterwards).
    pub no_token: bool,
}

impl Core {
    /// The tenant an API key belongs to; `header` names where the door expects the key.
    pub async fn tenant(&self, key: Option<&str>, header: &str) -> CoreResult<Tenant> {
        let Some(key) = key else {
            return Err(CoreError::Unauthenticated(format!(
                "missing API key; send `{header}` (see <data-dir>/credentials)"
            )));
        };
        match self.store.tenant_by_key(key).await? {
            Some(t) => Ok(t),
            None => {
                // A wrong or revoked key: recorded (never the key), refused.
                self.audit("anonymous", None, "auth.key", None, "unauthorized").await;
                Err(CoreError::Unauthenticated(
                    "invalid or revoked API key; `airlock key create` mints one".into(),
                ))
            }
        }
    }

    /// The caller behind `Authorization: Bearer`: a JWT from a configured issuer (signed in), or
    /// an API key.
    pub async fn bearer_principal(&self, bearer: Option<&str>) -> CoreResult<Principal> {
        if let Some(token) = bearer.filter(|b| !self.config.federation.is_empty() && Federation::looks_like_jwt(b)) {
            let signed_in = match self.config.federation.verify(token) {
                Ok(s) => s,
                Err(Refused::Token(why)) => {
                    self.audit("anonymous", None, "auth.jwt", None, "unauthorized").await;
                    return Err(CoreError::Unauthenticated(format!("{why}; sign in again")));
                }
                // A good token, but its issuer speaks for other tenants: recorded under the
                // tenant it named (when that is a tenant name at all).
                Err(Refused::Tenant(s)) => {
                    let named = super::accounts::check_tenant_name(&s.tenant)
                        .ok()
                        .map(|_| s.tenant.as_str());
                    self.audit(&s.actor(), named, "auth.jwt", None, "unauthorized").await;
                    return Err(CoreError::Unauthenticated(Refused::Tenant(s).to_string()));
                }
            };
            let Some(tenant) = self.store.tenant_by_name(&signed_in.tenant).await? else {
                self.audit("anonymous", None, "auth.jwt", None, "unauthorized").await;
                return Err(CoreError::Unauthenticated(
                    "the token's tenant is not known to this server".into(),
                ));
            };
            return Ok(Principal::Federated { tenant, signed_in });
        }
        self.key_principal(bearer, "Authorization: Bearer <key or signed-in token>")
            .await
    }

    /// The E2B control plane's caller: an API key in `X-API-KEY`, or (without one) a signed-in
    /// token as `Authorization: Bearer`, where the SDK puts an access token.
    pub async fn e2b_principal(&self, creds: &Credentials) -> CoreResult<Principal> {
        match (&creds.x_api_key, &creds.bearer) {
            (None, Some(bearer)) if !self.config.federation.is_empty() && Federation::looks_like_jwt(bearer) => {
                self.bearer_principal(Some(bearer)).await
            }
            _ => self.key_principal(creds.x_api_key.as_deref(), "X-API-KEY: <key>").await,
        }
    }

    /// The caller behind an API key; `header` names where the door expects it.
    pub async fn key_principal(&self, key: Option<&str>, header: &str) -> CoreResult<Principal> {
        let tenant = self.tenant(key, header).await?;
        Ok(Principal::Key {
            tenant,
            key_id: crate::store::key_id_of(key.unwrap_or_default()),
        })
    }

    /// A caller of one sandbox: by `sandbox_id`, or (without one) the sandbox whose access token
    /// the request carries. Missing and foreign sandboxes answer alike.
    pub async fn sandbox_principal(
        &self,
        creds: &Credentials,
        sandbox_id: Option<&str>,
        accept: Accept,
    ) -> CoreResult<Principal> {
        let presented: Vec<(TokenKind, String)> = creds
            .sandbox_tokens(accept)
            .into_iter()
            .map(|(kind, t)| (kind, token_hash(t)))
            .collect();
        let row = match sandbox_id {
            Some(id) => self.store.sandbox_by_id(id).await?,
            None => {
                let mut found = None;
                for (kind, hash) in &presented {
                    found = self.store.sandbox_by_access_hash(*kind, hash).await?;
                    if found.is_some() {
                        break;
                    }
                }
                found
            }
        };
        let Some(sandbox) = row else {
            return Err(CoreError::not_found(Kind::Sandbox, sandbox_id.unwrap_or("")));
        };
        let issued = self.store.access_hashes(&sandbox.id).await?;
        if let Some(want) = &issued {
            for (kind, got) in &presented {
                if want
                    .get(*kind)
                    .is_some_and(|w| bool::from(w.as_bytes().ct_eq(got.as_bytes())))
                {
                    let via = match kind {
                        TokenKind::Envd => Via::EnvdToken,
                        TokenKind::Traffic => Via::TrafficToken,
                    };
                    return Ok(Principal::Sandbox {
                        sandbox: self.current(sandbox).await?,
                        via,
                    });
                }
            }
        }
        if accept.owner_key {
            if let Some(key) = creds.bearer.as_deref() {
                if let Ok(Some(t)) = self.store.tenant_by_key(key).await {
                    if t.id == sandbox.tenant_id {
                        return Ok(Principal::Sandbox {
                            sandbox: self.current(sandbox).await?,
                            via: Via::OwnerKey,
                        });
                    }
                }
            }
        }
        // Not settled by a restart's recovery yet (`Core::current`): that waits for the proof.
        if presented.is_empty() && issued.is_some() && accept.no_token {
            return Ok(Principal::Sandbox {
                sandbox,
                via: Via::Unverified,
            });
        }
        let need = if accept.owner_key {
            "its traffic token (E2B-Traffic-Access-Token), its access token or its owner's API key"
        } else {
            "its access token (X-Access-Token)"
        };
        Err(CoreError::Unauthenticated(match (issued, presented.is_empty()) {
            // A sandbox without a token never came through the E2B door: envd is closed to it.
            (None, _) if !accept.owner_key => {
                "this sandbox has no access token; connect to it through the E2B API first".into()
            }
            (_, false) => format!("the access token does not match the sandbox; it needs {need}"),
            _ => format!("this sandbox needs {need}"),
        }))
    }

    /// The envd access token of a sandbox: derived from the server's secret, so it can be
    /// handed out again on connect while the store keeps only its hash.
    pub fn access_token(&self, sandbox_id: &str) -> String {
        self.derive_token(b"sandbox-access-token:", sandbox_id)
    }

    /// The traffic token of a sandbox (its ports only), derived apart from its access token:
    /// a preview URL pasted into a chat must not run commands.
    pub fn traffic_token(&self, sandbox_id: &str) -> String {
        self.derive_token(b"sandbox-traffic-token:", sandbox_id)
    }

    /// A volume's own token (E2B's content API), derived like a sandbox's so `GET /volumes/{id}`
    /// can answer it again; stored hashed.
    pub fn volume_token(&self, volume_id: &str) -> String {
        format!("vt_{}", self.derive_token(b"volume-token:", volume_id))
    }

    /// The token the console's sign-in form carries: `<unix seconds>.<MAC>` of the browser's
    /// pre-sign-in cookie `nonce` and the time, under the server secret. A post must bring a
    /// token this server made for the cookie it brings, within [`SIGN_IN_FORM_TTL_S`]: a value
    /// another site made up (and planted as the cookie) is no such token.
    pub fn sign_in_form_token(&self, nonce: &str) -> String {
        self.sign_in_form_token_at(nonce, crate::records::now_ms() / 1000)
    }

    fn sign_in_form_token_at(&self, nonce: &str, at_s: i64) -> String {
        let mac = self.derive_token(b"console-sign-in-form:", &format!("{nonce}\n{at_s}"));
        format!("{at_s}.{mac}")
    }

    /// Whether `token` is one [`Core::sign_in_form_token`] made for `nonce` and has not ended.
    pub fn sign_in_form_token_valid(&self, nonce: &str, token: &str) -> bool {
        let Some(at_s) = token.split_once('.').and_then(|(at, _)| at.parse::<i64>().ok()) else {
            return false;
        };
        let now_s = crate::records::now_ms() / 1000;
        // A minute of grace for another replica's clock.
        if nonce.is_empty() || nonce.contains('\n') || at_s > now_s + 60 || now_s - at_s > SIGN_IN_FORM_TTL_S {
            return false;
        }
        let want = self.sign_in_form_token_at(nonce, at_s);
        want.as_bytes().ct_eq(token.as_bytes()).into()
    }

    pub(super) fn derive_token(&self, label: &[u8], sandbox_id: &str) -> String {
        use hmac::Mac;
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&self.secret).expect("any key length");
        mac.update(label);
        mac.update(sandbox_id.as_bytes());
        hex::encode(&mac.finalize().into_bytes()[..16])
    }

    /// Issue (or re-issue) a sandbox's access and traffic tokens; returns them.
    pub async fn issue_access_token(&self, sandbox_id: &str) -> CoreResult<SandboxTokens> {
        let tokens = SandboxTokens {
            envd: self.access_token(sandbox_id),
            traffic: self.traffic_token(sandbox_id),
        };
        let hashes = AccessHashes {
            envd: token_hash(&tokens.envd),
            traffic: Some(token_hash(&tokens.traffic)),
        };
        if self.store.access_hashes(sandbox_id).await?.as_ref() != Some(&hashes) {
            self.store.set_access_hashes(sandbox_id, &hashes).await?;
        }
        Ok(tokens)
    }

    /// Whether the sandbox was opened to access tokens (created or connected through E2B).
    pub async fn has_access_token(&self, sandbox_id: &str) -> CoreResult<bool> {
        Ok(self.store.access_hashes(sandbox_id).await?.is_some())
    }

    /// Whether an `Authorization` value carries an airlock credential (an API key, a signed-in
    /// token of a configured issuer, an admin token): the port proxy never forwards those into
    /// a sandbox, while an app's own `Authorization` passes.
    pub async fn is_platform_credential(&self, authorization: &str) -> bool {
        let Some((_, value)) = authorization.split_once(' ') else {
            return false;
        };
        let value = value.trim();
        if !self.config.federation.is_empty() && Federation::looks_like_jwt(value) {
            return self.config.federation.verify(value).is_ok();
        }
        matches!(self.store.tenant_by_key(value).await, Ok(Some(_)))
            || matches!(
                self.store
                    .admin_session(&token_hash(value), crate::records::now_ms())
                    .await,
                Ok(Some(_))
            )
    }

    /// Check a signed URL (`/files?signature=...`) for `op` (`read`/`write`) on `sandbox`.
    pub fn check_signed_url(&self, sandbox: &SandboxRecord, url: &SignedUrl<'_>, op: &str) -> CoreResult<()> {
        let token = self.access_token(&sandbox.id);
        let want = signature(url.path, op, url.user, &token, url.expiration);
        let got = url.signature.trim_end_matches('=');
        if !bool::from(want.as_bytes().ct_eq(got.as_bytes())) {
            // A wrong signature proves nothing about the sandbox: it answers as a missing one
            // (an expired but genuine one was made with the token, so it may say so).
            return Err(CoreError::not_found(Kind::Sandbox, &sandbox.id));
        }
        if url.expiration.is_some_and(|e| e < crate::records::now_ms() / 1000) {
            return Err(CoreError::Unauthenticated("signature is already expired".into()));
        }
        Ok(())
    }
}

impl Core {
    /// The live sandbox a signed URL was made for, when the request names none (a signed URL
    /// used under `E2B_SANDBOX_URL` has no Host naming its sandbox, and no headers): the one
    /// whose access token makes the signature (one hash per live sandbox). The URL itself is
    /// still to be checked ([`Core::check_signed_url`]: its expiry). A signature no sandbox
    /// makes answers as a missing sandbox.
    pub async fn sandbox_by_signed_url(&self, url: &SignedUrl<'_>, op: &str) -> CoreResult<SandboxRecord> {
        let got = url.signature.trim_end_matches('=');
        let missing = || CoreError::not_found(Kind::Sandbox, "");
        if !got.starts_with("v1_") {
            return Err(missing());
        }
        for row in self.store.live_sandboxes().await? {
            let token = self.access_token(&row.id);
            let want = signature(url.path, op, url.user, &token, url.expiration);
            if !bool::from(want.as_bytes().ct_eq(got.as_bytes())) {
                continue;
            }
            // Its token must have been handed out (created or connected through E2B).
            let issued = self.store.access_hashes(&row.id).await?;
            if !issued.is_some_and(|h| bool::from(h.envd.as_bytes().ct_eq(token_hash(&token).as_bytes()))) {
                return Err(missing());
            }
            return self.current(row).await;
        }
        Err(missing())
    }
}

/// A sandbox's tokens as the E2B door hands them out.
#[derive(Debug, Clone)]
pub struct SandboxTokens {
    /// `envdAccessToken`: processes, files and signed URLs.
    pub envd: String,
    /// `trafficAccessToken`: the sandbox's ports, nothing else.
    pub traffic: String,
}

/// The parts of a signed URL, as the E2B SDK signs them.
pub struct SignedUrl<'a> {
    pub path: &'a str,
    pub user: &'a str,
    pub signature: &'a str,
    pub expiration: Option<i64>,
}

/// `v1_` + unpadded base64 of sha256(`path:op:user:token[:exp]`), as the SDK signs URLs.
pub fn signature(path: &str, op: &str, user: &str, token: &str, exp: Option<i64>) -> String {
    use sha2::Digest;
    let mut s = format!("{path}:{op}:{user}:{token}");
    if let Some(e) = exp {
        s.push_str(&format!(":{e}"));
    }
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(sha2::Sha256::digest(s.as_bytes()))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_read_every_spelling() {
        let mut h = HeaderMap::new();
        h.insert("authorization", "bearer  ak_1 ".parse().unwrap());
        h.insert("e2b-traffic-access-token", "tok".parse().unwrap());
        let c = Credentials::from_headers(&h);
        assert_eq!(c.bearer.as_deref(), Some("ak_1"));
        assert_eq!((c.traffic_token.as_deref(), c.envd_token), (Some("tok"), None));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", "e2b_2".parse().unwrap());
        h.insert("authorization", "Basic dXNlcjo=".parse().unwrap());
        h.insert("x-access-token", "t1".parse().unwrap());
        let c = Credentials::from_headers(&h);
        assert_eq!((c.bearer, c.x_api_key.as_deref()), (None, Some("e2b_2")));
        assert_eq!((c.envd_token.as_deref(), c.traffic_token), (Some("t1"), None));
    }

    #[test]
    fn signatures_differ_by_operation() {
        let s = signature("/home/user/a", "read", "user", "tok", None);
        assert!(s.starts_with("v1_") && !s.ends_with('='));
        assert_ne!(s, signature("/home/user/a", "write", "user", "tok", None));
    }
}
