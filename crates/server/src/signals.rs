//! The one signal table: names and numbers are nix's `Signal`; the descriptions are those Go and
//! `strsignal` print (E2B's SDKs show them). The core's sessions and the CLI (an exec's shell-style
//! `128 + n` exit code) both read signals here. Uses nothing else of the server.

use nix::sys::signal::Signal;
use std::str::FromStr;

/// The numbers a signal may have on Linux (the real-time ones above `SIGSYS` have no name).
pub const NUMBERS: std::ops::RangeInclusive<i32> = 1..=64;

/// The number of a signal named `SIGTERM`, `TERM` or `term`; `None` for a name Linux lacks.
pub fn by_name(name: &str) -> Option<i32> {
    let upper = name.trim().to_ascii_uppercase();
    let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
    Signal::from_str(&format!("SIG{bare}")).ok().map(|s| s as i32)
}

/// The number of a signal as [`name`] writes it: `SIGKILL` (or any name [`by_name`] takes) or
/// `SIG40` (or `40`) for one without a name.
pub fn number(name: &str) -> Option<i32> {
    by_name(name).or_else(|| {
        let n: i32 = name.trim().trim_start_matches("SIG").parse().ok()?;
        NUMBERS.contains(&n).then_some(n)
    })
}

/// `SIGKILL` for 9; `SIG<n>` for a number without a name.
pub fn name(n: i32) -> String {
    Signal::try_from(n)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("SIG{n}"))
}

/// `killed` for 9, as Go and `strsignal` describe it; `signal <n>` for a number without a name.
pub fn description(n: i32) -> String {
    Signal::try_from(n)
        .ok()
        .and_then(describe)
        .map(str::to_string)
        .unwrap_or_else(|| format!("signal {n}"))
}

fn describe(s: Signal) -> Option<&'static str> {
    use Signal::*;
    Some(match s {
        SIGHUP => "hangup",
        SIGINT => "interrupt",
        SIGQUIT => "quit",
        SIGILL => "illegal instruction",
        SIGTRAP => "trace/breakpoint trap",
        SIGABRT => "aborted",
        SIGBUS => "bus error",
        SIGFPE => "floating point exception",
        SIGKILL => "killed",
        SIGUSR1 => "user defined signal 1",
        SIGSEGV => "segmentation fault",
        SIGUSR2 => "user defined signal 2",
        SIGPIPE => "broken pipe",
        SIGALRM => "alarm clock",
        SIGTERM => "terminated",
        SIGSTKFLT => "stack fault",
        SIGCHLD => "child exited",
        SIGCONT => "continued",
        SIGSTOP => "stopped (signal)",
        SIGTSTP => "stopped",
        SIGTTIN => "stopped (tty input)",
        SIGTTOU => "stopped (tty output)",
        SIGURG => "urgent I/O condition",
        SIGXCPU => "CPU time limit exceeded",
        SIGXFSZ => "file size limit exceeded",
        SIGVTALRM => "virtual timer expired",
        SIGPROF => "profiling timer expired",
        SIGWINCH => "window changed",
        SIGIO => "I/O possible",
        SIGPWR => "power failure",
        SIGSYS => "bad system call",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_numbers_and_descriptions() {
        assert_eq!(by_name("SIGTERM"), Some(15));
        assert_eq!(by_name("kill"), Some(9));
        assert_eq!(by_name("winch"), Some(28));
        assert_eq!(by_name("SIGNOPE"), None);
        assert_eq!(name(9), "SIGKILL");
        assert_eq!(name(40), "SIG40");
        assert_eq!(description(15), "terminated");
        assert_eq!(description(40), "signal 40");
        for n in NUMBERS {
            assert_eq!(number(&name(n)), Some(n), "{n}");
        }
        assert_eq!(number("SIG0"), None);
        assert_eq!(number("SIGNOPE"), None);
    }
}
