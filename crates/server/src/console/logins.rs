//! The console's sign-ins: a random cookie per browser, kept here hashed with what it signed in
//! with (the admin's token or the tenant's key: never in the cookie), its CSRF token and its
//! deadlines. Every request asks the core again with that credential, so a revoked key or an
//! ended admin token ends the console session too. Kept in this process: a restart signs
//! everyone out (a replica behind a load balancer needs sticky sessions; see the README).

use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// How long a console sign-in lasts.
#[derive(Debug, Clone, Copy)]
pub struct ConsoleSettings {
    /// Ended after this long without a request.
    pub idle: Duration,
    /// Ended this long after signing in, however busy (an admin's also when its hour-long
    /// token ends).
    pub lifetime: Duration,
}

impl Default for ConsoleSettings {
    fn default() -> Self {
        ConsoleSettings {
            idle: Duration::from_secs(30 * 60),
            lifetime: Duration::from_secs(12 * 3600),
        }
    }
}

/// What a console session signed in with.
#[derive(Clone)]
pub enum Credential {
    /// `root@local`: the admin token its password got, and when that ends.
    Admin { token: String, expires_ms: i64 },
    /// A tenant's API key.
    Key(String),
}

struct Login {
    credential: Credential,
    csrf: String,
    ends_ms: i64,
    idle_ends_ms: i64,
}

/// A signed-in browser, as a request sees it.
#[derive(Clone)]
pub struct Session {
    pub credential: Credential,
    /// Every form of the session carries it; a post without it is refused.
    pub csrf: String,
}

/// At most this many sign-ins are kept; past it the one nearest its end goes first.
const MAX_LOGINS: usize = 10_000;

pub struct Logins {
    settings: ConsoleSettings,
    map: Mutex<HashMap<String, Login>>,
}

fn key_of(cookie: &str) -> String {
    hex::encode(Sha256::digest(cookie.as_bytes()))
}

fn now_ms() -> i64 {
    crate::records::now_ms()
}

impl Logins {
    pub fn new(settings: ConsoleSettings) -> Self {
        Logins {
            settings,
            map: Mutex::new(HashMap::new()),
        }
    }

    /// A new sign-in: the cookie's value and the session.
    pub fn open(&self, credential: Credential) -> (String, Session) {
        let cookie = format!("cs_{}", airlock_runtime::datadir::random_hex(32));
        let csrf = airlock_runtime::datadir::random_hex(24);
        let now = now_ms();
        let mut ends_ms = now + self.settings.lifetime.as_millis() as i64;
        if let Credential::Admin { expires_ms, .. } = &credential {
            ends_ms = ends_ms.min(*expires_ms);
        }
        let login = Login {
            credential: credential.clone(),
            csrf: csrf.clone(),
            ends_ms,
            idle_ends_ms: now + self.settings.idle.as_millis() as i64,
        };
        let mut map = self.map.lock().unwrap();
        map.retain(|_, l| l.ends_ms > now && l.idle_ends_ms > now);
        if map.len() >= MAX_LOGINS {
            if let Some(k) = map
                .iter()
                .min_by_key(|(_, l)| l.ends_ms.min(l.idle_ends_ms))
                .map(|(k, _)| k.clone())
            {
                map.remove(&k);
            }
        }
        map.insert(key_of(&cookie), login);
        (cookie, Session { credential, csrf })
    }

    /// The session behind a cookie, if it has not ended; its idle deadline moves on.
    pub fn get(&self, cookie: &str) -> Option<Session> {
        let now = now_ms();
        let key = key_of(cookie);
        let mut map = self.map.lock().unwrap();
        let login = map.get_mut(&key)?;
        if login.ends_ms <= now || login.idle_ends_ms <= now {
            map.remove(&key);
            return None;
        }
        login.idle_ends_ms = now + self.settings.idle.as_millis() as i64;
        Some(Session {
            credential: login.credential.clone(),
            csrf: login.csrf.clone(),
        })
    }

    /// Signing out: the cookie's session ends now.
    pub fn close(&self, cookie: &str) {
        self.map.lock().unwrap().remove(&key_of(cookie));
    }

    pub fn settings(&self) -> ConsoleSettings {
        self.settings
    }
}

/// Equal, without saying where two tokens differ first.
pub fn same_token(a: &str, b: &str) -> bool {
    Sha256::digest(a.as_bytes()) == Sha256::digest(b.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_ends_when_idle_or_signed_out() {
        let logins = Logins::new(ConsoleSettings {
            idle: Duration::from_millis(50),
            lifetime: Duration::from_secs(60),
        });
        let (cookie, s) = logins.open(Credential::Key("k".into()));
        assert!(logins.get(&cookie).is_some_and(|g| g.csrf == s.csrf));
        assert!(logins.get("cs_other").is_none());
        std::thread::sleep(Duration::from_millis(80));
        assert!(logins.get(&cookie).is_none(), "idle past its deadline");
        let (cookie, _) = logins.open(Credential::Key("k".into()));
        logins.close(&cookie);
        assert!(logins.get(&cookie).is_none(), "signed out");
    }

    #[test]
    fn an_admin_session_ends_with_its_token() {
        let logins = Logins::new(ConsoleSettings::default());
        let (cookie, _) = logins.open(Credential::Admin {
            token: "adm".into(),
            expires_ms: now_ms() - 1,
        });
        assert!(logins.get(&cookie).is_none());
        assert!(same_token("abc", "abc") && !same_token("abc", "abd"));
    }
}
