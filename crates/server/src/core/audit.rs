//! Audit rows of refusals, coalesced: the first of a kind (the same actor, tenant, action,
//! object and result) is written at once; its repeats within [`COALESCE_MS`] only count, and the
//! count is added to that row when its minute ends (at the next audit row after it) or when the
//! log is read. A flood of bad keys, tokens or passwords (anyone can send one) so writes about one
//! row a minute per kind, not one per request. Rows that succeeded (`ok`) are written one each:
//! they cost their caller real work, bounded by quotas.
//!
//! Kinds are tracked in memory, at most [`MAX_OPEN`] at once; past it a refusal is coalesced
//! without its object (what varies when one caller names many objects), and past twice that it is
//! written as its own row. A stop loses the counts not yet added (at most a minute's repeats).

use crate::records::AuditRecord;
use crate::store::{AccountStore, StoreError};
use std::collections::HashMap;
use std::sync::Mutex;

/// How long repeats of a refusal join its row.
pub const COALESCE_MS: i64 = 60 * 1000;
/// Kinds of refusal tracked at once (see the module doc).
pub const MAX_OPEN: usize = 1024;
/// How often ended windows are looked for.
const SWEEP_EVERY_MS: i64 = 1000;

#[derive(Debug, Clone, Hash, PartialEq, Eq)]
struct Kind {
    actor: String,
    tenant: Option<String>,
    action: String,
    object: Option<String>,
    result: String,
}

struct Open {
    /// The row's `seq`, once written.
    seq: Option<i64>,
    since_ms: i64,
    /// Repeats not yet added to the row.
    unwritten: u64,
}

#[derive(Default)]
struct State {
    open: HashMap<Kind, Open>,
    last_sweep_ms: i64,
}

impl State {
    /// Close the kinds whose window ended: their rows' counts still to add.
    fn sweep(&mut self, now: i64) -> Vec<(i64, u64)> {
        if now - self.last_sweep_ms < SWEEP_EVERY_MS {
            return Vec::new();
        }
        self.last_sweep_ms = now;
        let mut due = Vec::new();
        self.open.retain(|_, o| match o.seq {
            Some(seq) if now - o.since_ms >= COALESCE_MS => {
                if o.unwritten > 0 {
                    due.push((seq, o.unwritten));
                }
                false
            }
            _ => true,
        });
        due
    }
}

#[derive(Default)]
pub struct AuditCoalescer(Mutex<State>);

impl AuditCoalescer {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Record `r` (its `count` is ignored): written, or counted into an open row of its kind.
    pub async fn record<S: AccountStore + ?Sized>(&self, store: &S, mut r: AuditRecord) -> Result<(), StoreError> {
        r.count = 1;
        if r.result == "ok" {
            return store.insert_audit(&r).await.map(|_| ());
        }
        let mut kind = Kind {
            actor: r.actor.clone(),
            tenant: r.tenant.clone(),
            action: r.action.clone(),
            object: r.object.clone(),
            result: r.result.clone(),
        };
        let (due, tracked) = {
            let mut s = self.state();
            let due = s.sweep(r.at_ms);
            if s.open.len() >= MAX_OPEN && !s.open.contains_key(&kind) {
                kind.object = None;
                r.object = None;
            }
            let room = s.open.len() < 2 * MAX_OPEN;
            let tracked = match s.open.get_mut(&kind) {
                Some(o) => {
                    o.unwritten += 1;
                    None
                }
                None if room => {
                    s.open.insert(
                        kind.clone(),
                        Open {
                            seq: None,
                            since_ms: r.at_ms,
                            unwritten: 0,
                        },
                    );
                    Some(true)
                }
                None => Some(false),
            };
            (due, tracked)
        };
        for (seq, n) in due {
            store.add_audit_count(seq, n).await?;
        }
        match tracked {
            // A repeat: counted.
            None => Ok(()),
            Some(false) => store.insert_audit(&r).await.map(|_| ()),
            Some(true) => {
                let written = store.insert_audit(&r).await;
                let mut s = self.state();
                match written {
                    Ok(seq) => {
                        if let Some(o) = s.open.get_mut(&kind) {
                            o.seq = Some(seq);
                        }
                        Ok(())
                    }
                    Err(e) => {
                        s.open.remove(&kind);
                        Err(e)
                    }
                }
            }
        }
    }

    /// Add every open row's repeats so far to it (before the log is read).
    pub async fn flush<S: AccountStore + ?Sized>(&self, store: &S) -> Result<(), StoreError> {
        let due: Vec<(i64, u64)> = {
            let mut s = self.state();
            s.open
                .values_mut()
                .filter(|o| o.seq.is_some() && o.unwritten > 0)
                .map(|o| (o.seq.unwrap_or_default(), std::mem::take(&mut o.unwritten)))
                .collect()
        };
        for (seq, n) in due {
            store.add_audit_count(seq, n).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{AuditFilter, SqliteStore};

    fn refusal(at_ms: i64, object: Option<&str>) -> AuditRecord {
        AuditRecord {
            seq: 0,
            at_ms,
            actor: "anonymous".into(),
            tenant: None,
            action: "auth.key".into(),
            object: object.map(Into::into),
            result: "unauthorized".into(),
            count: 1,
        }
    }

    #[tokio::test]
    async fn repeats_within_a_minute_are_one_row_with_a_count() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("airlock.db")).await.unwrap();
        let c = AuditCoalescer::default();
        let t = 1_000_000;
        for i in 0..100 {
            c.record(&store, refusal(t + i * 100, None)).await.unwrap();
        }
        c.record(&store, refusal(t + 5000, Some("sb-1"))).await.unwrap();
        // A success is never coalesced.
        let mut ok = refusal(t + 5000, None);
        ok.result = "ok".into();
        c.record(&store, ok.clone()).await.unwrap();
        c.record(&store, ok).await.unwrap();
        // The minute ends: the next repeat opens a row, and the first row gets its count.
        c.record(&store, refusal(t + COALESCE_MS + 1, None)).await.unwrap();
        c.record(&store, refusal(t + COALESCE_MS + 2, None)).await.unwrap();
        let rows = store.audit(&AuditFilter::default(), 100).await.unwrap();
        let counts: Vec<(Option<&str>, &str, u64)> = rows
            .iter()
            .map(|r| (r.object.as_deref(), r.result.as_str(), r.count))
            .collect();
        let want = [
            (None, "unauthorized", 1),
            (None, "ok", 1),
            (None, "ok", 1),
            (Some("sb-1"), "unauthorized", 1),
            (None, "unauthorized", 100),
        ];
        assert_eq!(counts, want);
        // Reading flushes the open row's repeats.
        c.flush(&store).await.unwrap();
        let rows = store.audit(&AuditFilter::default(), 1).await.unwrap();
        assert_eq!(rows[0].count, 2);
    }

    #[tokio::test]
    async fn past_the_open_kinds_a_refusal_is_coalesced_without_its_object() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("airlock.db")).await.unwrap();
        let c = AuditCoalescer::default();
        for i in 0..MAX_OPEN + 500 {
            c.record(&store, refusal(1_000_000, Some(&format!("sb-{i}"))))
                .await
                .unwrap();
        }
        c.flush(&store).await.unwrap();
        let rows = store.audit(&AuditFilter::default(), 1000).await.unwrap();
        assert_eq!(rows[0].object, None);
        assert_eq!(rows[0].count, 500);
        let older = AuditFilter {
            before_seq: Some(rows[rows.len() - 1].seq),
            ..Default::default()
        };
        let total = rows.len() + store.audit(&older, 1000).await.unwrap().len();
        assert_eq!(total, MAX_OPEN + 1, "a row per object up to the cap, then one without");
    }
}
