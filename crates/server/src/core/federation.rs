//! Signed-in requests: `Authorization: Bearer <JWT>` from issuers the operator configured
//! (`--jwt-issuers FILE`). A token is accepted when an issuer's key (JWKS) verifies its signature
//! (RS256 or ES256 only), `iss` is that issuer, `aud` its audience, `exp` is ahead and `nbf` (if
//! any) behind, with a small clock skew; its tenant comes from the issuer's tenant claim, and must
//! be one of the tenants the issuer is bound to (`tenants`, required: an issuer speaks for those
//! alone, so one IdP can't name another's tenants or `default`, whose key bootstraps the server).
//! Such a caller is *federated* (`Principal::federated`): the only kind whose create may pick
//! egress profiles by header.
//!
//! The configuration file:
//! `{"leeway_seconds": 60, "issuers": [{"issuer": "https://idp.example", "audience": "airlock",
//!   "jwks_file": "/etc/airlock/idp-jwks.json", "tenant_claim": "tenant", "tenants": ["acme"]}]}`
//! An issuer names its keys by `jwks_file` or `jwks_url` (https; plain http only to a loopback
//! address, where nothing on the way can swap the keys). A fetch is bounded ([`FETCH_TIMEOUT`],
//! [`MAX_JWKS_BYTES`], no redirects). A bad file, or keys that can't be read, stop the server with
//! the entry named. Keys are read again every [`RELOAD_EVERY`], so a rotated key is picked up
//! without a restart.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

/// How often the issuers' key files are read again.
pub const RELOAD_EVERY: Duration = Duration::from_secs(300);
/// The longest a JWKS fetch may take, and the most of it read.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
pub const MAX_JWKS_BYTES: u64 = 1 << 20;
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
    #[serde(default)]
    jwks_file: Option<PathBuf>,
    #[serde(default)]
    jwks_url: Option<String>,
    tenant_claim: String,
    /// The tenants this issuer's tokens may name (required; see the module doc).
    #[serde(default)]
    tenants: Option<Vec<String>>,
}

/// Why the issuers file can't be used: the file itself, or an entry of it (named by `place`).
#[derive(Debug, thiserror::Error)]
pub enum FederationError {
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// `place` is `FILE: issuers[i]`.
    #[error("{place}: {source}")]
    Issuer {
        place: String,
        #[source]
        source: IssuerError,
    },
}

/// What is wrong with one issuer's entry.
#[derive(Debug, thiserror::Error)]
pub enum IssuerError {
    #[error("`{0}` is empty")]
    Empty(&'static str),
    #[error(
        "`tenants` is missing: list the tenants this issuer's tokens may name, \
         e.g. \"tenants\": [\"acme\"] (a token naming any other is refused)"
    )]
    TenantsMissing,
    #[error("`tenants`: {0}")]
    Tenant(#[source] Box<super::CoreError>),
    #[error("`jwks_url` {url:?}: {source}")]
    Url {
        url: String,
        #[source]
        source: url::ParseError,
    },
    #[error("`jwks_url` {0:?}: use https (plain http only to a loopback address)")]
    PlainHttp(String),
    #[error("give exactly one of `jwks_file` and `jwks_url`")]
    KeySource,
    #[error(transparent)]
    Keys(#[from] KeysError),
}

/// Why an issuer's keys can't be read (at start: the server stops; on reload: the old keys stay).
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("{}: {source}", path.display())]
    ReadFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{url}: {source}")]
    Fetch {
        url: String,
        #[source]
        source: Box<ureq::Error>,
    },
    #[error("{url}: {source}")]
    ReadBody {
        url: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}: larger than {MAX_JWKS_BYTES} bytes")]
    TooLarge(String),
    #[error("{name}: not a JWKS: {source}")]
    NotJwks {
        name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{name}: a key does not load: {source}")]
    BadKey {
        name: String,
        #[source]
        source: jsonwebtoken::errors::Error,
    },
    #[error("{0}: no RS256 or ES256 key in it")]
    NoKey(String),
}

/// Where an issuer's keys are read from.
#[derive(Debug)]
enum KeySource {
    File(PathBuf),
    Url(String),
}

impl KeySource {
    fn of(c: &IssuerConfig) -> Result<Self, IssuerError> {
        match (&c.jwks_file, &c.jwks_url) {
            (Some(path), None) => Ok(KeySource::File(path.clone())),
            (None, Some(url)) => {
                let parsed = url::Url::parse(url).map_err(|source| IssuerError::Url {
                    url: url.clone(),
                    source,
                })?;
                let loopback = match parsed.host() {
                    Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
                    Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
                    Some(url::Host::Domain(d)) => d == "localhost",
                    None => false,
                };
                match parsed.scheme() {
                    "https" => Ok(KeySource::Url(url.clone())),
                    "http" if loopback => Ok(KeySource::Url(url.clone())),
                    _ => Err(IssuerError::PlainHttp(url.clone())),
                }
            }
            _ => Err(IssuerError::KeySource),
        }
    }

    fn read(&self) -> Result<String, KeysError> {
        match self {
            KeySource::File(path) => std::fs::read_to_string(path).map_err(|source| KeysError::ReadFile {
                path: path.clone(),
                source,
            }),
            KeySource::Url(url) => {
                use std::io::Read as _;
                let agent = ureq::AgentBuilder::new().timeout(FETCH_TIMEOUT).redirects(0).build();
                let response = agent.get(url).call().map_err(|e| KeysError::Fetch {
                    url: url.clone(),
                    source: Box::new(e),
                })?;
                let mut text = String::new();
                response
                    .into_reader()
                    .take(MAX_JWKS_BYTES + 1)
                    .read_to_string(&mut text)
                    .map_err(|source| KeysError::ReadBody {
                        url: url.clone(),
                        source,
                    })?;
                if text.len() as u64 > MAX_JWKS_BYTES {
                    return Err(KeysError::TooLarge(url.clone()));
                }
                Ok(text)
            }
        }
    }

    fn name(&self) -> String {
        match self {
            KeySource::File(path) => path.display().to_string(),
            KeySource::Url(url) => url.clone(),
        }
    }
}

struct Issuer {
    config: IssuerConfig,
    source: KeySource,
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

impl SignedIn {
    /// Who acts, as audit rows name them.
    pub fn actor(&self) -> String {
        format!("jwt:{}#{}", self.issuer, self.subject)
    }
}

/// Why a bearer JWT signs nobody in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The token does not verify: why, in terms that reveal nothing of the keys.
    Token(&'static str),
    /// A good token naming a tenant its issuer is not bound to.
    Tenant(SignedIn),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Token(why) => f.write_str(why),
            Refused::Tenant(s) => write!(f, "the token's issuer may not name tenant {:?}", s.tenant),
        }
    }
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

/// Keys of a JWKS that can verify RS256 or ES256.
fn load_keys(source: &KeySource) -> Result<Vec<(Option<String>, Algorithm, DecodingKey)>, KeysError> {
    let text = source.read()?;
    let name = source.name();
    let set: JwkSet = serde_json::from_str(&text).map_err(|source| KeysError::NotJwks {
        name: name.clone(),
        source,
    })?;
    let mut keys = Vec::new();
    for jwk in &set.keys {
        use jsonwebtoken::jwk::AlgorithmParameters as P;
        let alg = match &jwk.algorithm {
            P::RSA(_) => Algorithm::RS256,
            P::EllipticCurve(ec) if ec.curve == jsonwebtoken::jwk::EllipticCurve::P256 => Algorithm::ES256,
            // Other key types can't verify the algorithms accepted here.
            _ => continue,
        };
        let key = DecodingKey::from_jwk(jwk).map_err(|source| KeysError::BadKey {
            name: name.clone(),
            source,
        })?;
        keys.push((jwk.common.key_id.clone(), alg, key));
    }
    if keys.is_empty() {
        return Err(KeysError::NoKey(name));
    }
    Ok(keys)
}

impl Federation {
    /// Read the configuration and every issuer's keys; an error names the file and the entry.
    /// It may fetch keys over the network: call it off the async runtime's threads.
    pub fn from_file(path: &Path) -> Result<Self, FederationError> {
        let text = std::fs::read_to_string(path).map_err(|source| FederationError::Read {
            path: path.into(),
            source,
        })?;
        let cfg: FileConfig = serde_json::from_str(&text).map_err(|source| FederationError::Parse {
            path: path.into(),
            source,
        })?;
        let mut issuers = Vec::new();
        for (i, c) in cfg.issuers.into_iter().enumerate() {
            let issuer = Self::issuer(c).map_err(|source| FederationError::Issuer {
                place: format!("{}: issuers[{i}]", path.display()),
                source,
            })?;
            issuers.push(Arc::new(issuer));
        }
        Ok(Federation {
            issuers,
            leeway_s: cfg.leeway_seconds.unwrap_or(DEFAULT_LEEWAY_S),
        })
    }

    /// One entry of the file, checked, with its keys read.
    fn issuer(c: IssuerConfig) -> Result<Issuer, IssuerError> {
        for (field, v) in [
            ("issuer", &c.issuer),
            ("audience", &c.audience),
            ("tenant_claim", &c.tenant_claim),
        ] {
            if v.trim().is_empty() {
                return Err(IssuerError::Empty(field));
            }
        }
        match &c.tenants {
            None => return Err(IssuerError::TenantsMissing),
            Some(t) if t.is_empty() => return Err(IssuerError::Empty("tenants")),
            Some(t) => {
                for name in t {
                    super::accounts::check_tenant_name(name).map_err(|e| IssuerError::Tenant(Box::new(e)))?;
                }
            }
        }
        let source = KeySource::of(&c)?;
        let keys = load_keys(&source)?;
        Ok(Issuer {
            config: c,
            source,
            keys: RwLock::new(keys),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.issuers.is_empty()
    }

    /// Read every issuer's keys again (one that fails keeps the keys it had). It may fetch over
    /// the network: call it off the async runtime's threads.
    pub fn reload(&self) {
        for i in &self.issuers {
            match load_keys(&i.source) {
                Ok(keys) => *i.keys.write().unwrap_or_else(|e| e.into_inner()) = keys,
                Err(e) => tracing::warn!("signed-in requests: keeping the old keys of {}: {e}", i.config.issuer),
            }
        }
    }

    /// Whether a bearer credential is a JWT (three dot-separated parts) rather than an API key.
    pub fn looks_like_jwt(bearer: &str) -> bool {
        bearer.split('.').count() == 3 && !bearer.starts_with("ak_") && !bearer.starts_with("e2b_")
    }

    /// Verify `token` against the configured issuers, and that its issuer may name its tenant.
    pub fn verify(&self, token: &str) -> Result<SignedIn, Refused> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| Refused::Token("malformed token"))?;
        if !ALGORITHMS.contains(&header.alg) {
            return Err(Refused::Token("token algorithm not accepted (RS256 or ES256 only)"));
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
                            .ok_or(Refused::Token("the token names no tenant"))?;
                        let signed_in = SignedIn {
                            issuer: c.issuer.clone(),
                            subject: claims.get("sub").and_then(|s| s.as_str()).unwrap_or_default().into(),
                            tenant: tenant.into(),
                        };
                        if !c.tenants.as_ref().is_some_and(|t| t.contains(&signed_in.tenant)) {
                            return Err(Refused::Tenant(signed_in));
                        }
                        return Ok(signed_in);
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
        Err(Refused::Token(last))
    }
}
