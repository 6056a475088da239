//! Running a build's commands (short ones, and long ones logged line by line into progress) and
//! copying files into a tree under construction.

use super::error::TemplateError;
use super::progress::Progress;
use crate::error::{Result, RuntimeError};
use std::path::Path;
use std::process::Command;

pub(super) fn install_file(src: &Path, dst: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(parent) = dst.parent() {
        std::fs::create_dir_all(parent).map_err(|e| RuntimeError::io(parent, e))?;
    }
    let _ = std::fs::remove_file(dst); // never write through a hard link into a cached layer
    std::fs::copy(src, dst).map_err(|e| RuntimeError::io(src, e))?;
    std::fs::set_permissions(dst, std::fs::Permissions::from_mode(mode)).map_err(|e| RuntimeError::io(dst, e))
}

pub(super) fn dir_bytes(dir: &Path) -> Result<u64> {
    let out = Command::new("du")
        .arg("-sb")
        .arg(dir)
        .output()
        .map_err(|e| RuntimeError::io("du", e))?;
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| TemplateError::DiskUsage(dir.to_path_buf()).into())
}

pub(super) fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.output().map_err(|e| TemplateError::spawn(what, e))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(8).collect();
        return Err(TemplateError::Failed {
            what: what.to_string(),
            status: out.status,
            tail: tail.into_iter().rev().collect::<Vec<_>>().join(" | "),
            log: None,
        }
        .into());
    }
    Ok(())
}

/// Run a long step, reading its stdout and stderr line by line while it runs: every line goes to
/// `log` and to `on_line` (which turns it into progress); a failure reports the last lines.
pub(super) fn run_logged(
    cmd: &mut Command,
    log: &Path,
    what: &str,
    progress: &Progress,
    mut on_line: impl FnMut(&str),
) -> Result<()> {
    use std::io::{BufRead, Write};
    use std::sync::mpsc::{channel, RecvTimeoutError};
    const TAIL: usize = 6;
    let mut file = std::fs::File::create(log).map_err(|e| RuntimeError::io(log, e))?;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| TemplateError::spawn(what, e))?;
    let (tx, rx) = channel::<String>();
    let outputs: [Box<dyn std::io::Read + Send>; 2] = [
        Box::new(child.stdout.take().expect("piped")),
        Box::new(child.stderr.take().expect("piped")),
    ];
    let readers: Vec<_> = outputs
        .into_iter()
        .map(|out| {
            let tx = tx.clone();
            std::thread::spawn(move || {
                // Bytes, not `lines()`: a line that is not UTF-8 must not stop the draining.
                let mut out = std::io::BufReader::new(out);
                let mut buf = Vec::new();
                while matches!(out.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
                    let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                    buf.clear();
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            })
        })
        .collect();
    drop(tx);
    let mut tail = std::collections::VecDeque::with_capacity(TAIL);
    loop {
        match rx.recv_timeout(std::time::Duration::from_secs(1)) {
            Ok(line) => {
                let _ = writeln!(file, "{line}");
                on_line(&line);
                if tail.len() == TAIL {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        progress.heartbeat();
    }
    for r in readers {
        let _ = r.join();
    }
    let status = child.wait().map_err(|source| TemplateError::Spawn {
        what: what.to_string(),
        source,
    })?;
    if !status.success() {
        let tail = Vec::from(tail).join(" | ");
        return Err(TemplateError::Failed {
            what: what.to_string(),
            status,
            tail,
            log: Some(log.to_path_buf()),
        }
        .into());
    }
    Ok(())
}
