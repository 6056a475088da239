//! The console's sign-ins: a random cookie per browser, kept here hashed with what it signed in
//! with (the admin's token or the tenant's key: never in the cookie), its CSRF token and its
//! deadlines. Every request asks the core again with that credential, so a revoked key or an
//! ended admin token ends the console session too. Kept in this process: a restart signs
//! everyone out (a replica behind a load balancer needs sticky sessions; see the README).
//!
//! Bounded per owner, so no one's sign-ins end another's: a tenant (whichever of its keys) or
//! the admin keeps its newest [`MAX_LOGINS_PER_OWNER`]; tenants' together at most
//! [`MAX_LOGINS`], past which a tenant's new sign-in is refused, and the admin's are apart.

use sha2::{Digest, Sha256};
use std::collections::{HashMap, VecDeque};
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
    /// A tenant's API key (or signed-in token), and the tenant's id it named at sign-in.
    Key { key: String, tenant_id: String },
}

/// Whose sign-ins count together: the admin's, or one tenant's (whichever key it used).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Owner {
    Admin,
    Tenant(String),
}

impl Credential {
    fn owner(&self) -> Owner {
        match self {
            Credential::Admin { .. } => Owner::Admin,
            Credential::Key { tenant_id, .. } => Owner::Tenant(tenant_id.clone()),
        }
    }
}

struct Login {
    /// The cookie's hash.
    key: String,
    credential: Credential,
    csrf: String,
    ends_ms: i64,
    idle_ends_ms: i64,
}

impl Login {
    fn ended(&self, now: i64) -> bool {
        self.ends_ms <= now || self.idle_ends_ms <= now
    }
}

/// A signed-in browser, as a request sees it.
#[derive(Clone)]
pub struct Session {
    pub credential: Credential,
    /// Every form of the session carries it; a post without it is refused.
    pub csrf: String,
}

/// Sign-ins one tenant (or the admin) keeps; its next one ends its own oldest, never another's.
pub const MAX_LOGINS_PER_OWNER: usize = 50;
/// Tenants' sign-ins kept in all (the memory bound); past it a new one is refused until some
/// end. The admin's are outside it, so no number of tenants' sign-ins keeps the admin out.
pub const MAX_LOGINS: usize = 10_000;

/// The console keeps [`MAX_LOGINS`] tenants' sign-ins already.
#[derive(Debug)]
pub struct Full;

pub struct Logins {
    settings: ConsoleSettings,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Each owner's sign-ins, oldest first.
    by_owner: HashMap<Owner, VecDeque<Login>>,
    /// A cookie's hash -> its owner.
    owner_of: HashMap<String, Owner>,
}

impl Inner {
    /// Tenants' sign-ins kept (the admin's not counted).
    fn tenants_logins(&self) -> usize {
        self.owner_of.len() - self.by_owner.get(&Owner::Admin).map_or(0, VecDeque::len)
    }

    /// `owner`'s sign-ins that ended, forgotten.
    fn sweep(&mut self, owner: &Owner, now: i64) {
        let Some(list) = self.by_owner.get_mut(owner) else {
            return;
        };
        for gone in list.iter().filter(|l| l.ended(now)) {
            self.owner_of.remove(&gone.key);
        }
        list.retain(|l| !l.ended(now));
        if list.is_empty() {
            self.by_owner.remove(owner);
        }
    }

    fn remove(&mut self, key: &str) {
        let Some(owner) = self.owner_of.remove(key) else {
            return;
        };
        if let Some(list) = self.by_owner.get_mut(&owner) {
            list.retain(|l| l.key != key);
            if list.is_empty() {
                self.by_owner.remove(&owner);
            }
        }
    }
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
            inner: Mutex::new(Inner::default()),
        }
    }

    /// A new sign-in: the cookie's value and the session. Past its owner's
    /// [`MAX_LOGINS_PER_OWNER`] the owner's own oldest ends; a tenant's past [`MAX_LOGINS`] in
    /// all is refused (nobody else's is ended for it).
    pub fn open(&self, credential: Credential) -> Result<(String, Session), Full> {
        let cookie = format!("cs_{}", airlock_runtime::datadir::random_hex(32));
        let csrf = airlock_runtime::datadir::random_hex(24);
        let now = now_ms();
        let mut ends_ms = now + self.settings.lifetime.as_millis() as i64;
        if let Credential::Admin { expires_ms, .. } = &credential {
            ends_ms = ends_ms.min(*expires_ms);
        }
        let owner = credential.owner();
        let mut inner = self.inner.lock().unwrap();
        inner.sweep(&owner, now);
        let own = inner.by_owner.get(&owner).map_or(0, VecDeque::len);
        if owner != Owner::Admin && own < MAX_LOGINS_PER_OWNER && inner.tenants_logins() >= MAX_LOGINS {
            // Full: forget every sign-in that ended (a scan, only now), then refuse if still full.
            let owners: Vec<Owner> = inner.by_owner.keys().cloned().collect();
            for o in &owners {
                inner.sweep(o, now);
            }
            if inner.tenants_logins() >= MAX_LOGINS {
                return Err(Full);
            }
        }
        let key = key_of(&cookie);
        let list = inner.by_owner.entry(owner.clone()).or_default();
        let evicted = match list.len() >= MAX_LOGINS_PER_OWNER {
            true => list.pop_front().map(|l| l.key),
            false => None,
        };
        list.push_back(Login {
            key: key.clone(),
            credential: credential.clone(),
            csrf: csrf.clone(),
            ends_ms,
            idle_ends_ms: now + self.settings.idle.as_millis() as i64,
        });
        if let Some(k) = evicted {
            inner.owner_of.remove(&k);
        }
        inner.owner_of.insert(key, owner);
        Ok((cookie, Session { credential, csrf }))
    }

    /// The session behind a cookie, if it has not ended; its idle deadline moves on.
    pub fn get(&self, cookie: &str) -> Option<Session> {
        let now = now_ms();
        let key = key_of(cookie);
        let mut inner = self.inner.lock().unwrap();
        let owner = inner.owner_of.get(&key)?.clone();
        let login = inner.by_owner.get_mut(&owner)?.iter_mut().find(|l| l.key == key)?;
        if login.ended(now) {
            inner.remove(&key);
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
        self.inner.lock().unwrap().remove(&key_of(cookie));
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
        let (cookie, s) = logins.open(key("t1")).unwrap();
        assert!(logins.get(&cookie).is_some_and(|g| g.csrf == s.csrf));
        assert!(logins.get("cs_other").is_none());
        std::thread::sleep(Duration::from_millis(80));
        assert!(logins.get(&cookie).is_none(), "idle past its deadline");
        let (cookie, _) = logins.open(key("t1")).unwrap();
        logins.close(&cookie);
        assert!(logins.get(&cookie).is_none(), "signed out");
    }

    #[test]
    fn an_admin_session_ends_with_its_token() {
        let logins = Logins::new(ConsoleSettings::default());
        let (cookie, _) = logins
            .open(Credential::Admin {
                token: "adm".into(),
                expires_ms: now_ms() - 1,
            })
            .unwrap();
        assert!(logins.get(&cookie).is_none());
        assert!(same_token("abc", "abc") && !same_token("abc", "abd"));
    }

    fn key(tenant: &str) -> Credential {
        Credential::Key {
            key: format!("ak_{tenant}"),
            tenant_id: tenant.into(),
        }
    }

    #[test]
    fn a_tenants_sign_ins_end_only_its_own() {
        let logins = Logins::new(ConsoleSettings::default());
        let (admin, _) = logins
            .open(Credential::Admin {
                token: "adm".into(),
                expires_ms: now_ms() + 3_600_000,
            })
            .unwrap();
        let (other, _) = logins.open(key("t2")).unwrap();
        let mut many = Vec::new();
        for _ in 0..MAX_LOGINS + 10 {
            many.push(logins.open(key("t1")).unwrap().0);
        }
        assert!(logins.get(&admin).is_some(), "the admin stays signed in");
        assert!(logins.get(&other).is_some(), "another tenant stays signed in");
        let kept: Vec<bool> = many.iter().map(|c| logins.get(c).is_some()).collect();
        assert_eq!(kept.iter().filter(|k| **k).count(), MAX_LOGINS_PER_OWNER);
        assert!(
            kept[kept.len() - MAX_LOGINS_PER_OWNER..].iter().all(|k| *k),
            "its newest are kept"
        );
    }

    #[test]
    fn a_full_console_refuses_new_tenants_and_ends_nobody() {
        let logins = Logins::new(ConsoleSettings::default());
        let mut first = Vec::new();
        for t in 0..MAX_LOGINS / MAX_LOGINS_PER_OWNER {
            for _ in 0..MAX_LOGINS_PER_OWNER {
                first.push(logins.open(key(&format!("t{t}"))).unwrap().0);
            }
        }
        assert!(logins.open(key("late")).is_err(), "full: refused");
        // A tenant at its own cap still signs in, in place of its own oldest.
        assert!(logins.open(key("t0")).is_ok());
        assert!(logins.get(&first[0]).is_none());
        assert!(
            first[1..].iter().all(|c| logins.get(c).is_some()),
            "nobody else's ended"
        );
        // The admin is outside the tenants' bound.
        let admin = Credential::Admin {
            token: "adm".into(),
            expires_ms: now_ms() + 3_600_000,
        };
        let (admin, _) = logins.open(admin).unwrap();
        assert!(logins.get(&admin).is_some());
        // Once some end, there is room again.
        logins.close(&first[1]);
        assert!(logins.open(key("late")).is_ok());
    }
}
