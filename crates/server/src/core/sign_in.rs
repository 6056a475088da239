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
//! In memory: a restart forgives. The map holds only addresses with failures or attempts in the
//! window: at most the remote ceiling's worth of remote ones, and as many loopback ones as
//! argon2 can evaluate in a window.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};

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

#[derive(Default)]
struct Window {
    failures: VecDeque<i64>,
    in_flight: usize,
}

impl Window {
    fn expire(&mut self, now: i64) {
        while self.failures.front().is_some_and(|t| now - t >= WINDOW_MS) {
            self.failures.pop_front();
        }
    }

    /// Seconds until the window has room again, if it is full (`allowed` attempts).
    fn full(&mut self, now: i64, allowed: usize) -> Option<u64> {
        self.expire(now);
        if self.failures.len() + self.in_flight < allowed {
            return None;
        }
        // Full of attempts in flight alone: they end within a hash's time.
        let wait = match self.failures.front() {
            Some(oldest) if self.failures.len() >= allowed => oldest + WINDOW_MS - now,
            _ => 1000,
        };
        Some((wait.max(0) as u64).div_ceil(1000).max(1))
    }

    fn is_empty(&self) -> bool {
        self.failures.is_empty() && self.in_flight == 0
    }
}

#[derive(Default)]
struct State {
    clients: HashMap<IpAddr, Window>,
    remote: Window,
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

/// The console account's sign-in windows.
#[derive(Default)]
pub struct SignInThrottle(Mutex<State>);

/// A reserved sign-in attempt: counted as in flight until it ends. Dropped without
/// [`Attempt::succeeded`] it is a failure (also when the request goes away mid-hash).
pub struct Attempt {
    throttle: Arc<SignInThrottle>,
    client: Client,
    succeeded: bool,
}

impl Attempt {
    pub fn succeeded(mut self) {
        self.succeeded = true;
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        let now = crate::records::now_ms();
        let mut s = self.throttle.0.lock().unwrap_or_else(|e| e.into_inner());
        let end = |w: &mut Window| {
            w.in_flight = w.in_flight.saturating_sub(1);
            if !self.succeeded {
                w.failures.push_back(now);
            }
        };
        if let Some(w) = s.clients.get_mut(&self.client.key) {
            end(w);
        }
        if self.client.remote {
            end(&mut s.remote);
        }
    }
}

impl SignInThrottle {
    /// Reserve an attempt from `addr`, or the seconds to wait and which window is full.
    pub fn reserve(self: &Arc<Self>, addr: Option<IpAddr>, now: i64) -> Result<Attempt, (Scope, u64)> {
        let client = Client::of(addr);
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // Forget clients whose window emptied, so the map holds only recent ones.
        if s.clients.len() > 64 {
            s.clients.retain(|_, w| {
                w.expire(now);
                !w.is_empty()
            });
        }
        if let Some(wait) = s
            .clients
            .get_mut(&client.key)
            .and_then(|w| w.full(now, FAILURES_PER_CLIENT))
        {
            return Err((Scope::Client, wait));
        }
        if client.remote {
            if let Some(wait) = s.remote.full(now, FAILURES_REMOTE) {
                return Err((Scope::Remote, wait));
            }
            s.remote.in_flight += 1;
        }
        s.clients.entry(client.key).or_default().in_flight += 1;
        Ok(Attempt {
            throttle: self.clone(),
            client,
            succeeded: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn attempts_in_flight_count_and_failures_fill_the_window() {
        let t = Arc::new(SignInThrottle::default());
        // A failure is recorded when its attempt ends, at the time it ends.
        let now = crate::records::now_ms();
        let held: Vec<Attempt> = (0..FAILURES_PER_CLIENT)
            .map(|_| t.reserve(ip("192.0.2.1"), now).unwrap())
            .collect();
        // Five in flight: the sixth waits, though nothing has failed yet.
        assert_eq!(t.reserve(ip("192.0.2.1"), now).err(), Some((Scope::Client, 1)));
        drop(held);
        // The failures carry the wall time of the drop, which a busy machine puts past `now`.
        let ended = crate::records::now_ms();
        let (scope, wait) = t.reserve(ip("192.0.2.1"), ended + 1000).err().unwrap();
        assert!(scope == Scope::Client && (58..=59).contains(&wait), "{wait}");
        assert!(
            t.reserve(ip("192.0.2.1"), ended + WINDOW_MS).is_ok(),
            "the window moved on"
        );
        // A success is no failure.
        let t = Arc::new(SignInThrottle::default());
        for _ in 0..10 {
            t.reserve(ip("192.0.2.1"), now).unwrap().succeeded();
        }
    }

    #[test]
    fn remote_addresses_share_a_ceiling_that_loopback_never_meets() {
        let t = Arc::new(SignInThrottle::default());
        let now = crate::records::now_ms();
        for i in 0..FAILURES_REMOTE {
            drop(t.reserve(ip(&format!("203.0.113.{i}")), now).unwrap());
        }
        assert_eq!(
            t.reserve(ip("198.51.100.1"), now).err().map(|e| e.0),
            Some(Scope::Remote)
        );
        assert_eq!(
            t.reserve(ip("2001:db8::1"), now).err().map(|e| e.0),
            Some(Scope::Remote)
        );
        assert_eq!(t.reserve(None, now).err().map(|e| e.0), Some(Scope::Remote));
        assert!(t.reserve(ip("127.0.0.1"), now).is_ok());
        assert!(t.reserve(ip("::1"), now).is_ok());
        assert!(t.reserve(ip("::ffff:127.0.0.1"), now).is_ok());
    }

    #[test]
    fn an_ipv6_client_is_its_slash_64() {
        let t = Arc::new(SignInThrottle::default());
        let now = crate::records::now_ms();
        for i in 0..FAILURES_PER_CLIENT {
            drop(t.reserve(ip(&format!("2001:db8:0:1::{i:x}")), now).unwrap());
        }
        assert_eq!(
            t.reserve(ip("2001:db8:0:1:ffff::1"), now).err().map(|e| e.0),
            Some(Scope::Client)
        );
        assert!(t.reserve(ip("2001:db8:0:2::1"), now).is_ok());
        // An IPv4 client seen on a dual-stack listener is the same client.
        for _ in 0..FAILURES_PER_CLIENT {
            drop(t.reserve(ip("192.0.2.9"), now).unwrap());
        }
        assert_eq!(
            t.reserve(ip("::ffff:192.0.2.9"), now).err().map(|e| e.0),
            Some(Scope::Client)
        );
    }
}
