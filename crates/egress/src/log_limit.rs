//! How many INFO lines one sandbox's egress may write. A guest decides how many DNS queries and
//! connections it makes, so a line per decision would let it fill the host's log (2,000 queries
//! in 1.7 s wrote 2,000 lines). Per sandbox, the first [`LogLimit::per_window`] events of each
//! window get their own INFO line; the rest go to DEBUG, counted, and one summary line says how
//! many were held back once the window is over (or the sandbox ends). Every decision still goes
//! into the sandbox's counters and its bounded denial history.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What an event was, for the summary's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Allowed,
    Denied,
    /// A dial or an upstream lookup that failed.
    Failed,
}

/// Events held back from INFO in one window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Suppressed {
    pub allowed: u64,
    pub denied: u64,
    pub failed: u64,
}

impl Suppressed {
    pub fn total(&self) -> u64 {
        self.allowed + self.denied + self.failed
    }
}

/// The verdict on one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Admit {
    /// Log this event at INFO (else at DEBUG).
    pub info: bool,
    /// A window just ended with events held back: log this summary first.
    pub summary: Option<Suppressed>,
}

#[derive(Debug)]
pub(crate) struct LogLimit {
    per_window: u32,
    window: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    started: Option<Instant>,
    logged: u32,
    held: Suppressed,
}

impl LogLimit {
    pub fn new(per_window: u32, window: Duration) -> Self {
        LogLimit {
            per_window,
            window,
            state: Mutex::new(State::default()),
        }
    }

    pub fn admit(&self, now: Instant, kind: Kind) -> Admit {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut summary = None;
        if s.started
            .is_none_or(|t| now.saturating_duration_since(t) >= self.window)
        {
            let held = std::mem::take(&mut s.held);
            summary = (held.total() > 0).then_some(held);
            s.started = Some(now);
            s.logged = 0;
        }
        let info = s.logged < self.per_window;
        if info {
            s.logged += 1;
        } else {
            match kind {
                Kind::Allowed => s.held.allowed += 1,
                Kind::Denied => s.held.denied += 1,
                Kind::Failed => s.held.failed += 1,
            }
        }
        Admit { info, summary }
    }

    /// What the current window held back (when the sandbox ends).
    pub fn flush(&self) -> Option<Suppressed> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let held = std::mem::take(&mut s.held);
        (held.total() > 0).then_some(held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_thousand_events_give_a_bounded_number_of_lines() {
        let limit = LogLimit::new(10, Duration::from_secs(10));
        let t0 = Instant::now();
        let (mut info, mut summaries, mut held) = (0, 0, 0);
        // 10,000 events over 2 s: one window.
        for i in 0..10_000u64 {
            let kind = if i % 3 == 0 { Kind::Denied } else { Kind::Allowed };
            let a = limit.admit(t0 + Duration::from_micros(i * 200), kind);
            info += a.info as u32;
            summaries += a.summary.is_some() as u32;
        }
        if let Some(s) = limit.flush() {
            summaries += 1;
            held += s.total();
            assert_eq!((s.allowed, s.denied, s.failed), (6660, 3330, 0), "{s:?}");
        }
        assert_eq!((info, summaries, held), (10, 1, 9990));
        assert_eq!(limit.flush(), None);
    }

    #[test]
    fn each_window_logs_its_first_events_and_summarizes_the_last() {
        let limit = LogLimit::new(2, Duration::from_secs(10));
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let verdicts: Vec<Admit> = [0, 1, 2, 3].iter().map(|&s| limit.admit(at(s), Kind::Denied)).collect();
        assert_eq!(
            verdicts.iter().map(|a| a.info).collect::<Vec<_>>(),
            [true, true, false, false]
        );
        assert!(verdicts.iter().all(|a| a.summary.is_none()));
        // The next window: its first event carries the last one's summary.
        let a = limit.admit(at(12), Kind::Failed);
        assert!(a.info);
        assert_eq!(
            a.summary,
            Some(Suppressed {
                denied: 2,
                ..Default::default()
            })
        );
        // A quiet window holds nothing back: no summary.
        assert_eq!(limit.admit(at(30), Kind::Allowed).summary, None);
    }
}
