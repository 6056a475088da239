//! Signed-in requests: `Authorization: Bearer <JWT>` from issuers the operator configured
//! (`--jwt-issuers FILE`). A token is accepted when an issuer's key (JWKS) verifies its signature
//! (RS256 or ES256 only), `iss` is that issuer, `aud` its audience, `exp` is ahead and `nbf` (if
//! any) behind, with a small clock skew; its tenant comes from the issuer's tenant claim. Such a
//! caller is *federated* (`Principal::federated`): the only kind whose create may pick egress
//! profiles by header.
//!
//! The configuration file:
//! `{"leeway_seconds": 60, "issuers": [{"issuer": "https://idp.example", "audience": "airlock",
//!   "jwks_file": "/etc/airlock/idp-jwks.json", "tenant_claim": "tenant"}]}`
//! A bad file stops the server with the entry named. Key files are read again every
//! [`RELOAD_EVERY`], so a rotated key is picked up without a restart.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

/// How often the issuers' key files are read again.
pub const RELOAD_EVERY: Duration = Duration::from_secs(300);
/// The clock skew allowed on `exp` and `nbf` when the file sets none.
pub const DEFAULT_LEEWAY_S: u64 = 60;
/// The only algorithms accepted (never `none`, never a shared secret).
const ALGORITHMS: [Algorithm; 2] = [Algorithm::RS256, Algorithm::ES256];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    leeway_seconds: Option<u64>,
    issuers: Vec<IssuerConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct IssuerConfig {
    issuer: String,
    audience: String,
    jwks_file: PathBuf,
    tenant_claim: String,
}

struct Issuer {
    config: IssuerConfig,
    keys: RwLock<Vec<(Option<String>, Algorithm, DecodingKey)>>,
}

/// Who signed in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedIn {
    pub issuer: String,
    pub subject: String,
    /// The tenant the issuer's claim names.
    pub tenant: String,
}

/// The configured issuers (none: no request signs in).
#[derive(Clone, Default)]
pub struct Federation {
    issuers: Vec<Arc<Issuer>>,
    leeway_s: u64,
}

impl std::fmt::Debug for Federation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.issuers.iter().map(|i| i.config.issuer.as_str()).collect();
        write!(f, "Federation({names:?})")
    }
}

/// Keys of a JWKS file that can verify RS256 or ES256.
fn load_keys(path: &Path) -> Result<Vec<(Option<String>, Algorithm, DecodingKey)>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let set: JwkSet = serde_json::from_str(&text).map_err(|e| format!("{}: not a JWKS: {e}", path.display()))?;
    let mut keys = Vec::new();
    for jwk in &set.keys {
        use jsonwebtoken::jwk::AlgorithmParameters as P;
        let alg = match &jwk.algorithm {
            P::RSA(_) => Algorithm::RS256,
            P::EllipticCurve(ec) if ec.curve == jsonwebtoken::jwk::EllipticCurve::P256 => Algorithm::ES256,
            // Other key types can't verify the algorithms accepted here.
            _ => continue,
        };
        let key = DecodingKey::from_jwk(jwk).map_err(|e| format!("{}: a key does not load: {e}", path.display()))?;
        keys.push((jwk.common.key_id.clone(), alg, key));
    }
    if keys.is_empty() {
        return Err(format!("{}: no RS256 or ES256 key in it", path.display()));
    }
    Ok(keys)
}

impl Federation {
    /// Read the configuration and every issuer's keys; an error names the file and the entry.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let cfg: FileConfig = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut issuers = Vec::new();
        for (i, c) in cfg.issuers.into_iter().enumerate() {
            let place = format!("{}: issuers[{i}]", path.display());
            for (field, v) in [("issuer", &c.issuer), ("audience", &c.audience), ("tenant_claim", &c.tenant_claim)] {
                if v.trim().is_empty() {
                    return Err(format!("{place}: `{field}` is empty"));
                }
            }
            let keys = load_keys(&c.jwks_file).map_err(|e| format!("{place}: {e}"))?;
            issuers.push(Arc::new(Issuer {
                config: c,
                keys: RwLock::new(keys),
            }));
        }
        Ok(Federation {
            issuers,
            leeway_s: cfg.leeway_seconds.unwrap_or(DEFAULT_LEEWAY_S),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.issuers.is_empty()
    }

    /// Read every issuer's key file again (a file that fails keeps the keys it had).
    pub fn reload(&self) {
        for i in &self.issuers {
            match load_keys(&i.config.jwks_file) {
                Ok(keys) => *i.keys.write().unwrap_or_else(|e| e.into_inner()) = keys,
                Err(e) => tracing::warn!("signed-in requests: keeping the old keys of {}: {e}", i.config.issuer),
            }
        }
    }

    /// Whether a bearer credential is a JWT (three dot-separated parts) rather than an API key.
    pub fn looks_like_jwt(bearer: &str) -> bool {
        bearer.split('.').count() == 3 && !bearer.starts_with("ak_") && !bearer.starts_with("e2b_")
    }

    /// Verify `token` against the configured issuers. The error says why in terms that reveal
    /// nothing of the keys.
    pub fn verify(&self, token: &str) -> Result<SignedIn, &'static str> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| "malformed token")?;
        if !ALGORITHMS.contains(&header.alg) {
            return Err("token algorithm not accepted (RS256 or ES256 only)");
        }
        let mut last = "no configured issuer verifies this token";
        for issuer in &self.issuers {
            let c = &issuer.config;
            let mut v = Validation::new(header.alg);
            v.set_issuer(&[c.issuer.as_str()]);
            v.set_audience(&[c.audience.as_str()]);
            v.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
            v.validate_nbf = true;
            v.leeway = self.leeway_s;
            let keys = issuer.keys.read().unwrap_or_else(|e| e.into_inner());
            for (kid, alg, key) in keys.iter() {
                if *alg != header.alg || (header.kid.is_some() && kid.is_some() && header.kid != *kid) {
                    continue;
                }
                match jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(token, key, &v) {
                    Ok(data) => {
                        let claims = data.claims;
                        let tenant = claims
                            .get(&c.tenant_claim)
                            .and_then(|t| t.as_str())
                            .filter(|t| !t.is_empty())
                            .ok_or("the token names no tenant")?;
                        return Ok(SignedIn {
                            issuer: c.issuer.clone(),
                            subject: claims.get("sub").and_then(|s| s.as_str()).unwrap_or_default().into(),
                            tenant: tenant.into(),
                        });
                    }
                    Err(e) => {
                        use jsonwebtoken::errors::ErrorKind as K;
                        last = match e.kind() {
                            K::ExpiredSignature => "token expired",
                            K::ImmatureSignature => "token not valid yet",
                            K::InvalidAudience => "token audience not accepted",
                            K::InvalidIssuer => "token issuer not accepted",
                            K::InvalidSignature => "token signature does not verify",
                            K::MissingRequiredClaim(_) => "token lacks a required claim (exp, iss, aud, sub)",
                            _ => "token rejected",
                        };
                    }
                }
            }
        }
        Err(last)
    }
}
