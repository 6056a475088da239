//! A node's own enforcement of sandbox timeouts, at its face: the replicas end a sandbox when
//! its timeout passes, but while none is up (all restarting, cut off) a node would run it on
//! for ever. Each VM's deadline (set by the replica whenever its timeout moves) is kept here;
//! one that passed by more than the grace, with the VM still there, is acted on by the node:
//! suspended if its sandbox asked for that, else deleted. The grace lets a live replica act
//! first, so the two never race. Deadlines are kept on disk too (`<dir>/<id>.json`), so a node
//! restarted while no replica runs still ends what it must.

use super::{Deadline, Nodes, VmState};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// How often deadlines are looked at.
const TICK: Duration = Duration::from_millis(500);
/// A deadline's file is a few dozen bytes: anything larger is not one.
const MAX_FILE: u64 = 4096;

pub struct Expiry {
    grace: Duration,
    deadlines: Mutex<HashMap<String, Deadline>>,
    /// Where each deadline is kept across restarts (None: in memory only).
    dir: Option<PathBuf>,
}

/// Whether `id` can name a file of `dir` (a sandbox id: lowercase letters and digits).
fn file_name_ok(id: &str) -> bool {
    (1..=64).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// The deadlines kept in `dir`; a file that does not read as one is removed.
fn load(dir: &Path) -> HashMap<String, Deadline> {
    let mut found = HashMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let id = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_string();
        let deadline = (path.extension().is_some_and(|e| e == "json") && file_name_ok(&id))
            .then(|| std::fs::metadata(&path).ok())
            .flatten()
            .filter(|m| m.is_file() && m.len() <= MAX_FILE)
            .and_then(|_| std::fs::read(&path).ok())
            .and_then(|bytes| serde_json::from_slice::<Deadline>(&bytes).ok());
        match deadline {
            Some(d) => {
                found.insert(id, d);
            }
            None => {
                tracing::warn!(path = %path.display(), "not a deadline; removing it");
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    found
}

fn now_ms() -> i64 {
    crate::records::now_ms()
}

impl Expiry {
    /// Deadlines acted on `grace` after they pass, on `nodes`, checked for as long as the
    /// returned value lives; kept in `dir` (and those an earlier life kept there taken up).
    pub fn start(nodes: Arc<dyn Nodes>, grace: Duration, dir: Option<PathBuf>) -> std::io::Result<Arc<Expiry>> {
        let mut deadlines = HashMap::new();
        if let Some(dir) = &dir {
            std::fs::create_dir_all(dir)?;
            deadlines = load(dir);
            if !deadlines.is_empty() {
                tracing::info!("{} sandbox deadlines kept from before the restart", deadlines.len());
            }
        }
        let expiry = Arc::new(Expiry {
            grace,
            deadlines: Mutex::new(deadlines),
            dir,
        });
        tokio::spawn(tick(Arc::downgrade(&expiry), nodes));
        Ok(expiry)
    }

    /// Keep `id`'s deadline on disk as well (written whole, then renamed in), or remove it.
    fn keep(&self, id: &str, deadline: Option<&Deadline>) {
        let Some(dir) = self.dir.as_ref().filter(|_| file_name_ok(id)) else {
            return;
        };
        let path = dir.join(format!("{id}.json"));
        let done = match deadline {
            Some(d) => {
                let staged = dir.join(format!(".{id}.json.new"));
                serde_json::to_vec(d)
                    .map_err(std::io::Error::other)
                    .and_then(|bytes| std::fs::write(&staged, bytes))
                    .and_then(|()| std::fs::rename(&staged, &path))
            }
            None => match std::fs::remove_file(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                other => other,
            },
        };
        if let Err(e) = done {
            tracing::warn!(vm = %id, "cannot keep its deadline on disk: {e}");
        }
    }

    fn deadlines(&self) -> std::sync::MutexGuard<'_, HashMap<String, Deadline>> {
        self.deadlines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// VM `id` ends at `deadline` (None: it has none, e.g. it is suspended already).
    pub fn set(&self, id: &str, deadline: Option<Deadline>) {
        let mut deadlines = self.deadlines();
        match deadline {
            Some(d) => deadlines.insert(id.to_string(), d),
            None => deadlines.remove(id),
        };
        // Under the lock, so two calls for one VM land on disk in their order.
        self.keep(id, deadline.as_ref());
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
            self.keep(id, None);
        }
        due
    }
}

async fn tick(expiry: Weak<Expiry>, nodes: Arc<dyn Nodes>) {
    loop {
        tokio::time::sleep(TICK).await;
        let Some(expiry) = expiry.upgrade() else { return };
        for (id, deadline) in expiry.due() {
            // After a restart, a VM is known only once re-attached.
            nodes.settled(&id).await;
            if !matches!(nodes.vm_state(&id), VmState::Running | VmState::Paused) {
                continue;
            }
            let done = match deadline.suspend {
                true => nodes.suspend(&id).await.map(drop),
                false => nodes.delete(&id, None).await,
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
