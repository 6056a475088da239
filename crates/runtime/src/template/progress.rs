//! A build's progress output: a spinner on a terminal, log lines and heartbeats otherwise.

use std::time::Instant;

/// Step display for long builds. On a terminal: a spinner showing the step and what it is doing,
/// with a line per finished step. Otherwise (CI logs): a log line per step and per stage, and one
/// every `HEARTBEAT` while a step runs quietly, so the log never sits silent.
pub(super) struct Progress {
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    state: std::sync::Mutex<ProgressState>,
}

pub(super) struct ProgressState {
    step: String,
    step_started: Instant,
    /// The stage last logged (plain mode) and its latest count line for heartbeats.
    stage: String,
    count_line: String,
    last_line: Instant,
}

const HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(10);

impl Progress {
    pub(super) fn new(enabled: bool) -> Self {
        let bar = enabled.then(|| {
            let b = indicatif::ProgressBar::new_spinner();
            b.set_style(
                indicatif::ProgressStyle::with_template("{spinner} [{elapsed}] {prefix:.bold} {wide_msg}")
                    .expect("valid template"),
            );
            b.enable_steady_tick(std::time::Duration::from_millis(120));
            b
        });
        let now = Instant::now();
        Self {
            bar,
            started: now,
            state: std::sync::Mutex::new(ProgressState {
                step: String::new(),
                step_started: now,
                stage: String::new(),
                count_line: String::new(),
                last_line: now,
            }),
        }
    }

    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, ProgressState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new step of the build.
    pub(super) fn step(&self, what: &str) {
        let mut st = self.state();
        match &self.bar {
            Some(b) => {
                if !st.step.is_empty() {
                    b.println(format!(
                        "  {}: {:.1}s",
                        st.step,
                        st.step_started.elapsed().as_secs_f64()
                    ));
                }
                b.set_prefix(what.to_string());
                b.set_message("");
                tracing::debug!("template: {what}");
            }
            None => tracing::info!("template: {what}"),
        }
        let now = Instant::now();
        st.step = what.to_string();
        st.step_started = now;
        st.stage.clear();
        st.count_line.clear();
        st.last_line = now;
    }

    /// What the current step is doing: `stage` names it (a log line when it changes), `count_line`
    /// adds a count (heartbeat lines), `display` the current item too (the spinner).
    pub(super) fn status(&self, stage: &str, count_line: &str, display: &str) {
        if let Some(b) = &self.bar {
            b.set_message(display.to_string());
            return;
        }
        let mut st = self.state();
        if st.stage != stage {
            tracing::info!("template: {stage}");
            st.stage = stage.to_string();
            st.last_line = Instant::now();
        }
        st.count_line = count_line.to_string();
    }

    /// Plain mode: a line when nothing was said for `HEARTBEAT`.
    pub(super) fn heartbeat(&self) {
        if self.bar.is_some() {
            return;
        }
        let mut st = self.state();
        if st.last_line.elapsed() < HEARTBEAT {
            return;
        }
        let secs = st.step_started.elapsed().as_secs_f64();
        match st.count_line.as_str() {
            "" => tracing::info!("template: {}: still running, {secs:.0}s", st.step),
            c => tracing::info!("template: {c}, {secs:.0}s"),
        }
        st.last_line = Instant::now();
    }

    /// A log line that does not tear the spinner.
    pub(super) fn log(&self, msg: &str) {
        match &self.bar {
            Some(b) => b.suspend(|| tracing::info!("{msg}")),
            None => tracing::info!("{msg}"),
        }
    }

    pub(super) fn warn(&self, msg: &str) {
        match &self.bar {
            Some(b) => b.suspend(|| tracing::warn!("{msg}")),
            None => tracing::warn!("{msg}"),
        }
    }

    pub(super) fn finish(&self, msg: &str) {
        let msg = format!("{msg} in {:.1}s", self.started.elapsed().as_secs_f64());
        match &self.bar {
            Some(b) => {
                let st = self.state();
                if !st.step.is_empty() {
                    b.println(format!(
                        "  {}: {:.1}s",
                        st.step,
                        st.step_started.elapsed().as_secs_f64()
                    ));
                }
                b.finish_and_clear();
                eprintln!("{msg}");
            }
            None => tracing::info!("template: {msg}"),
        }
    }
}
