//! How many uploads may be under way at once. An upload streams to its guest with a little
//! buffered on the way (more while the guest or the client is slow), so their number is what
//! bounds the memory uploads take. Bounded per sandbox, per tenant (so one tenant's uploads,
//! however stalled, leave room for others') and on the whole server; past a bound an upload waits
//! a little for room, its body unread, then is refused with `too_many_uploads`.

use crate::error::{CoreError, CoreResult, InternalError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The bounds (`Config::uploads`).
#[derive(Debug, Clone)]
pub struct UploadLimits {
    pub per_sandbox: usize,
    pub per_tenant: usize,
    pub server: usize,
    /// How long an upload waits for room past a bound.
    pub wait: Duration,
}

impl Default for UploadLimits {
    /// Four 300 MB uploads at once took 5 MiB together (in one process with the fake agent and
    /// the client; `tests/uploads.rs`), so the server's 128 hold some 160 MiB.
    fn default() -> Self {
        Self {
            per_sandbox: 8,
            per_tenant: 32,
            server: 128,
            wait: Duration::from_secs(10),
        }
    }
}

/// The uploads under way.
pub struct Uploads {
    limits: UploadLimits,
    sandboxes: Keyed,
    tenants: Keyed,
    server: Arc<Semaphore>,
}

/// A semaphore per key (a sandbox, a tenant), kept while an upload holds or awaits it.
struct Keyed {
    limit: usize,
    map: Mutex<HashMap<String, Arc<Semaphore>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Keyed {
    fn new(limit: usize) -> Self {
        Self {
            limit,
            map: Default::default(),
        }
    }

    fn get(&self, key: &str) -> Arc<Semaphore> {
        lock(&self.map)
            .entry(key.to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(self.limit)))
            .clone()
    }

    /// Give back what [`Self::get`] gave (its permits already dropped); the key's entry goes
    /// once nothing else holds it (clones are only made under the same lock).
    fn put(&self, key: &str, semaphore: Arc<Semaphore>) {
        let mut map = lock(&self.map);
        drop(semaphore);
        if map.get(key).is_some_and(|s| Arc::strong_count(s) == 1) {
            map.remove(key);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.map).len()
    }
}

/// One upload's room, given back when dropped.
pub struct UploadSlot<'a> {
    uploads: &'a Uploads,
    tenant: (&'a str, Option<Arc<Semaphore>>),
    sandbox: (&'a str, Option<Arc<Semaphore>>),
    permits: Vec<OwnedSemaphorePermit>,
}

impl Drop for UploadSlot<'_> {
    fn drop(&mut self) {
        self.permits.clear();
        if let Some(s) = self.sandbox.1.take() {
            self.uploads.sandboxes.put(self.sandbox.0, s);
        }
        if let Some(s) = self.tenant.1.take() {
            self.uploads.tenants.put(self.tenant.0, s);
        }
    }
}

impl Uploads {
    pub fn new(limits: UploadLimits) -> Self {
        Self {
            sandboxes: Keyed::new(limits.per_sandbox),
            tenants: Keyed::new(limits.per_tenant),
            server: Arc::new(Semaphore::new(limits.server)),
            limits,
        }
    }

    /// Room for one upload to `sandbox_id` of `tenant_id`, awaited up to the limits' `wait`.
    pub async fn enter<'a>(&'a self, tenant_id: &'a str, sandbox_id: &'a str) -> CoreResult<UploadSlot<'a>> {
        let deadline = tokio::time::Instant::now() + self.limits.wait;
        let sandbox = self.sandboxes.get(sandbox_id);
        let tenant = self.tenants.get(tenant_id);
        let mut slot = UploadSlot {
            uploads: self,
            tenant: (tenant_id, Some(tenant.clone())),
            sandbox: (sandbox_id, Some(sandbox.clone())),
            permits: Vec::with_capacity(3),
        };
        // Narrowest first: an upload waiting on its own sandbox holds nothing others need.
        for (semaphore, scope, limit) in [
            (sandbox, "to this sandbox", self.limits.per_sandbox),
            (tenant, "for this tenant", self.limits.per_tenant),
            (self.server.clone(), "on this server", self.limits.server),
        ] {
            let permit = tokio::time::timeout_at(deadline, semaphore.acquire_owned())
                .await
                .map_err(|_| CoreError::TooManyUploads {
                    scope,
                    limit,
                    retry_after_s: self.limits.wait.as_secs().max(1),
                })?
                .map_err(InternalError::UploadSlotsClosed)?;
            slot.permits.push(permit);
        }
        Ok(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn slots_are_bounded_at_each_scope_and_their_entries_go_with_the_last() {
        let uploads = Uploads::new(UploadLimits {
            per_sandbox: 2,
            per_tenant: 3,
            server: 4,
            wait: Duration::from_millis(50),
        });
        let scope = |e: CoreError| match e {
            CoreError::TooManyUploads { scope, limit, .. } => (scope, limit),
            e => panic!("{e}"),
        };
        let a1 = uploads.enter("t1", "a").await.unwrap();
        let a2 = uploads.enter("t1", "a").await.unwrap();
        let err = uploads.enter("t1", "a").await.err().unwrap();
        assert_eq!(err.code().status, 429);
        assert_eq!(scope(err), ("to this sandbox", 2));
        let b1 = uploads.enter("t1", "b").await.unwrap();
        assert_eq!(
            scope(uploads.enter("t1", "c").await.err().unwrap()),
            ("for this tenant", 3)
        );
        let d1 = uploads.enter("t2", "d").await.unwrap();
        assert_eq!(
            scope(uploads.enter("t3", "e").await.err().unwrap()),
            ("on this server", 4)
        );
        // Refused uploads leave no entry behind; a key's last slot takes its entry.
        assert_eq!((uploads.sandboxes.len(), uploads.tenants.len()), (3, 2));
        drop(a1);
        assert_eq!((uploads.sandboxes.len(), uploads.tenants.len()), (3, 2));
        drop((a2, b1, d1));
        assert_eq!((uploads.sandboxes.len(), uploads.tenants.len()), (0, 0));
        assert_eq!(uploads.server.available_permits(), 4);
    }
}
