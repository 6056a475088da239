//! A node's own enforcement of sandbox timeouts, at its face: the replicas end a sandbox when
//! its timeout passes, but while none is up (all restarting, cut off) a node would run it on
//! for ever. Each VM's deadline (set by the replica whenever its timeout moves) is kept here;
//! one that passed by more than the grace, with the VM still there, is acted on by the node:
//! suspended if its sandbox asked for that, else deleted. The grace lets a live replica act
//! first, so the two never race.

use super::{Deadline, Nodes, VmState};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// How often deadlines are looked at.
const TICK: Duration = Duration::from_millis(500);

pub struct Expiry {
    grace: Duration,
    deadlines: Mutex<HashMap<String, Deadline>>,
}

fn now_ms() -> i64 {
    crate::records::now_ms()
}

impl Expiry {
    /// Deadlines acted on `grace` after they pass, on `nodes`, checked for as long as the
    /// returned value lives.
    pub fn start(nodes: Arc<dyn Nodes>, grace: Duration) -> Arc<Expiry> {
        let expiry = Arc::new(Expiry {
            grace,
            deadlines: Mutex::default(),
        });
        tokio::spawn(tick(Arc::downgrade(&expiry), nodes));
        expiry
    }

    fn deadlines(&self) -> std::sync::MutexGuard<'_, HashMap<String, Deadline>> {
        self.deadlines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// VM `id` ends at `deadline` (None: it has none, e.g. it is suspended already).
    pub fn set(&self, id: &str, deadline: Option<Deadline>) {
        match deadline {
            Some(d) => self.deadlines().insert(id.to_string(), d),
            None => self.deadlines().remove(id),
        };
    }

    /// The deadlines passed by more than the grace, taken out.
    fn due(&self) -> Vec<(String, Deadline)> {
        let cutoff = now_ms() - self.grace.as_millis() as i64;
        let mut deadlines = self.deadlines();
        let due: Vec<(String, Deadline)> = deadlines
            .iter()
            .filter(|(_, d)| d.at_ms <= cutoff)
            .map(|(id, d)| (id.clone(), *d))
            .collect();
        for (id, _) in &due {
            deadlines.remove(id);
        }
        due
    }
}

async fn tick(expiry: Weak<Expiry>, nodes: Arc<dyn Nodes>) {
    loop {
        tokio::time::sleep(TICK).await;
        let Some(expiry) = expiry.upgrade() else { return };
        for (id, deadline) in expiry.due() {
            if !matches!(nodes.vm_state(&id), VmState::Running | VmState::Paused) {
                continue;
            }
            let done = match deadline.suspend {
                true => nodes.suspend(&id).await.map(drop),
                false => nodes.delete(&id).await,
            };
            match done {
                Ok(()) => {
                    tracing::info!(vm = %id, suspend = deadline.suspend, "its timeout passed with no replica acting: ended by the node")
                }
                Err(e) => tracing::warn!(vm = %id, "its timeout passed; the node could not end it: {e}"),
            }
        }
    }
}
