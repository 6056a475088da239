//! The console account's sign-in throttle. Every attempt is reserved (counted as in flight)
//! before its password is hashed, so a concurrent burst gets no more guesses evaluated than a
//! sequence would; an attempt that does not succeed becomes a failure in its window.
//!
//! - **Per client address** ([`FAILURES_PER_CLIENT`] in [`WINDOW_MS`]): an IPv4 address, or an
//!   IPv6 /64 (one host usually holds a whole /64), counted with the attempts in flight.
//! - **All remote clients together** ([`FAILURES_REMOTE`] in the window): a guesser with many
//!   addresses gets no more. Loopback clients (the CLI's `airlock login` on the server's own host)
//!   are never counted in it nor refused by it, so no burst from the network locks the owner out
//!   of signing in locally; each loopback address still has its own per-client window.
//!
//! The address is the connection's peer: behind a reverse proxy on the same host every client
//! is that proxy's loopback address (one shared window, outside the remote ceiling), so such a
//! setup should let the proxy throttle its clients. Forwarded-for headers are never trusted.
//! The windows are in the store (`AccountStore::reserve_sign_in`): every replica counts in the
//! same ones, so more replicas give a guesser no more tries.

use crate::store::{SignInAttempt, Store, StoreError};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

/// Failed sign-ins one client address may have in a window (attempts in flight included).
pub const FAILURES_PER_CLIENT: usize = 5;
/// Failed sign-ins all non-loopback clients together may have in a window.
pub const FAILURES_REMOTE: usize = 20;
pub const WINDOW_MS: i64 = 60 * 1000;

/// Whose window refused an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The client's own address.
    Client,
    /// Every remote address together.
    Remote,
}

/// A client of the throttle: its window's key, and whether the remote ceiling applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Client {
    key: IpAddr,
    remote: bool,
}

impl Client {
    /// `None`: a request without a peer address (not served by `listen`), treated as remote.
    fn of(addr: Option<IpAddr>) -> Self {
        let Some(ip) = addr.map(|ip| ip.to_canonical()) else {
            return Client {
                key: IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                remote: true,
            };
        };
        if ip.is_loopback() {
            return Client { key: ip, remote: false };
        }
        let key = match ip {
            IpAddr::V6(v6) => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(Ipv6Addr::from(bits))
            }
            v4 => v4,
        };
        Client { key, remote: true }
    }
}

/// A reserved sign-in attempt: counted as in flight until it ends. Dropped without
/// [`Attempt::succeeded`] it is a failure (also when the request goes away mid-hash).
pub struct Attempt {
    store: Arc<dyn Store>,
    id: String,
    succeeded: bool,
}

impl Attempt {
    pub fn succeeded(mut self) {
        self.succeeded = true;
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, id, failed) = (self.store.clone(), std::mem::take(&mut self.id), !self.succeeded);
        rt.spawn(async move {
            if let Err(e) = store.end_sign_in(&id, failed, crate::records::now_ms()).await {
                tracing::warn!("sign-in attempt {id}: cannot record its end: {e}");
            }
        });
    }
}

/// Reserve an attempt from `addr` at `now`, or the seconds to wait and which window is full.
pub async fn reserve(
    store: &Arc<dyn Store>,
    addr: Option<IpAddr>,
    now: i64,
) -> Result<Result<Attempt, (Scope, u64)>, StoreError> {
    let client = Client::of(addr);
    let id = crate::core::random_id("sia_", 12);
    let key = client.key.to_string();
    let attempt = SignInAttempt {
        id: &id,
        client: &key,
        remote: client.remote,
        now_ms: now,
        window_ms: WINDOW_MS,
        per_client: FAILURES_PER_CLIENT,
        remote_max: FAILURES_REMOTE,
    };
    Ok(match store.reserve_sign_in(&attempt).await? {
        Ok(()) => Ok(Attempt {
            store: store.clone(),
            id,
            succeeded: false,
        }),
        Err(full) => Err((
            if full.remote { Scope::Remote } else { Scope::Client },
            (full.wait_ms.max(0) as u64).div_ceil(1000).max(1),
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    async fn store() -> (tempfile::TempDir, Arc<dyn Store>) {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::SqliteStore::open(&dir.path().join("airlock.db"))
            .await
            .unwrap();
        (dir, Arc::new(store))
    }

    /// Until the dropped attempts' ends are recorded (they are spawned).
    async fn settle() {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    #[tokio::test]
    async fn attempts_in_flight_count_and_failures_fill_the_window() {
        let (_dir, t) = store().await;
        let now = crate::records::now_ms();
        let mut held = Vec::new();
        for _ in 0..FAILURES_PER_CLIENT {
            held.push(reserve(&t, ip("192.0.2.1"), now).await.unwrap().unwrap());
        }
        // Five in flight: the sixth waits, though nothing has failed yet.
        assert_eq!(
            reserve(&t, ip("192.0.2.1"), now).await.unwrap().err(),
            Some((Scope::Client, 1))
        );
        drop(held);
        settle().await;
        // A failure is recorded when its attempt ends, at the time it ends.
        let ended = crate::records::now_ms();
        let (scope, wait) = reserve(&t, ip("192.0.2.1"), ended + 1000).await.unwrap().err().unwrap();
        assert!(scope == Scope::Client && (58..=59).contains(&wait), "{wait}");
        assert!(
            reserve(&t, ip("192.0.2.1"), ended + WINDOW_MS).await.unwrap().is_ok(),
            "the window moved on"
        );
        // A success is no failure.
        let (_dir, t) = store().await;
        for _ in 0..10 {
            reserve(&t, ip("192.0.2.1"), now).await.unwrap().unwrap().succeeded();
            settle().await;
        }
    }

    #[tokio::test]
    async fn remote_addresses_share_a_ceiling_that_loopback_never_meets() {
        let (_dir, t) = store().await;
        let now = crate::records::now_ms();
        for i in 0..FAILURES_REMOTE {
            drop(reserve(&t, ip(&format!("203.0.113.{i}")), now).await.unwrap().unwrap());
        }
        settle().await;
        for remote in [ip("198.51.100.1"), ip("2001:db8::1"), None] {
            let refused = reserve(&t, remote, now).await.unwrap().err().map(|e| e.0);
            assert_eq!(refused, Some(Scope::Remote), "{remote:?}");
        }
        for local in ["127.0.0.1", "::1", "::ffff:127.0.0.1"] {
            assert!(reserve(&t, ip(local), now).await.unwrap().is_ok(), "{local}");
        }
    }

    #[test]
    fn an_ipv6_client_is_its_slash_64_and_an_ipv4_one_its_address() {
        let key = |s: &str| Client::of(ip(s));
        assert_eq!(key("2001:db8:0:1::1").key, key("2001:db8:0:1:ffff::1").key);
        assert_ne!(key("2001:db8:0:1::1").key, key("2001:db8:0:2::1").key);
        // An IPv4 client seen on a dual-stack listener is the same client.
        assert_eq!(key("::ffff:192.0.2.9"), key("192.0.2.9"));
        assert!(key("192.0.2.9").remote && !key("::1").remote && Client::of(None).remote);
    }
}
