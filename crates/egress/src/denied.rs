//! What a sandbox's denied names resolve to, for decisions made by address
//! ([`Policy::decide_address`]): a connection that names nothing (or a name no rule mentions) and
//! goes to an address an IP/CIDR rule allows is still refused when a name the tenant denies
//! resolves to that address. Looked up through the proxy's own resolver when a decision needs it,
//! kept for the answer's TTL (clamped to [`MIN_TTL`, `MAX_TTL`]); a failed lookup is kept for
//! [`MIN_TTL`] and fails closed.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::error::ResolveError;
use crate::policy::DeniedNameAddrs;
use crate::resolve::Resolver;

const MIN_TTL: Duration = Duration::from_secs(5);
const MAX_TTL: Duration = Duration::from_secs(300);

#[derive(Debug, Default)]
pub(crate) struct DeniedNames {
    /// Held across a refresh, so concurrent decisions wait for one round of lookups.
    cache: Mutex<HashMap<String, Entry>>,
}

#[derive(Debug)]
struct Entry {
    addrs: Option<Vec<IpAddr>>,
    expires: Instant,
}

impl DeniedNames {
    /// The addresses of `names` now, looking up (concurrently) those not known or expired.
    pub async fn current(&self, names: &BTreeSet<String>, resolver: &Arc<Resolver>) -> DeniedNameAddrs {
        if names.is_empty() {
            return DeniedNameAddrs::new();
        }
        let mut cache = self.cache.lock().await;
        let now = Instant::now();
        let mut lookups = JoinSet::new();
        for name in names {
            if cache.get(name).is_none_or(|e| e.expires <= now) {
                let (name, resolver) = (name.clone(), resolver.clone());
                lookups.spawn(async move {
                    let r = resolver.lookup_a(&name).await;
                    (name, r)
                });
            }
        }
        while let Some(done) = lookups.join_next().await {
            let Ok((name, result)) = done else { continue };
            let (addrs, ttl) = match result {
                Ok(l) => (
                    Some(l.addrs.into_iter().map(IpAddr::from).collect()),
                    Duration::from_secs(l.ttl.into()).clamp(MIN_TTL, MAX_TTL),
                ),
                Err(ResolveError::NxDomain) => (Some(Vec::new()), MIN_TTL),
                Err(e) => {
                    tracing::debug!(name, error = %e, "looking up a denied name failed");
                    (None, MIN_TTL)
                }
            };
            cache.insert(
                name,
                Entry {
                    addrs,
                    expires: Instant::now() + ttl,
                },
            );
        }
        names
            .iter()
            // A lookup task that panicked left no entry: unknown, so closed.
            .map(|n| (n.clone(), cache.get(n).and_then(|e| e.addrs.clone())))
            .collect()
    }
}
