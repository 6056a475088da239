//! The fake agent's processes: the programs it knows, their events and signals.

use super::guest::{now_ms, user, Ctl, FakeProc, Guest};
use super::reply::{ApiErr, Body};
use crate::error::Result;
use airlock_proto::{ExitStatus, ProcessInfo, ProcessSpec, ProcessState};
use bytes::BytesMut;
use http::{Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use nix::sys::signal::Signal;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// What a fake process does.
pub(super) enum Program {
    Done {
        stdout: Vec<u8>,
        stderr: Vec<u8>,
        code: i32,
    },
    Sleep(Option<Duration>),
    Cat,
    PowerOff,
}

pub(super) fn program(argv: &[String]) -> Program {
    let done = |stdout: String, stderr: String, code| Program::Done {
        stdout: stdout.into_bytes(),
        stderr: stderr.into_bytes(),
        code,
    };
    let name = argv[0].rsplit('/').next().unwrap_or_default();
    match (name, &argv[1..]) {
        ("echo", args) => done(format!("{}\n", args.join(" ")), String::new(), 0),
        ("true", _) => done(String::new(), String::new(), 0),
        ("false", _) => done(String::new(), String::new(), 1),
        ("cat", []) => Program::Cat,
        ("poweroff", _) => Program::PowerOff,
        ("sleep", [secs]) if secs == "infinity" => Program::Sleep(None),
        ("sleep", [secs]) => match secs.parse::<f64>() {
            Ok(s) if s >= 0.0 && s.is_finite() => Program::Sleep(Some(Duration::from_secs_f64(s))),
            _ => done(String::new(), format!("sleep: invalid time interval {secs:?}\n"), 1),
        },
        ("sh" | "bash", [c, script]) if c == "-c" => {
            let code = script.trim().strip_prefix("exit").map(|n| n.trim().parse::<i32>());
            match code {
                Some(Ok(code)) => done(String::new(), String::new(), code & 0xff),
                Some(Err(_)) if script.trim() == "exit" => done(String::new(), String::new(), 0),
                _ => done(
                    String::new(),
                    format!("{name}: the fake agent only runs `exit N` scripts, not {script:?}\n"),
                    127,
                ),
            }
        }
        _ => done(String::new(), format!("{name}: command not found\n"), 127),
    }
}

/// Signals whose default action does not end a process.
pub(super) fn ignored_by_default(sig: i32) -> bool {
    sig == 0
        || [Signal::SIGCHLD, Signal::SIGCONT, Signal::SIGURG, Signal::SIGWINCH]
            .iter()
            .any(|s| *s as i32 == sig)
}

pub(super) fn spawn(guest: &Arc<Guest>, spec: ProcessSpec) -> Result<ProcessInfo, ApiErr> {
    if spec.argv.is_empty() || spec.argv[0].is_empty() {
        return Err(ApiErr::invalid("argv must name a program"));
    }
    if spec.timeout_ms == Some(0) {
        return Err(ApiErr::invalid("timeout must be greater than zero"));
    }
    let (user_name, _, home) = user(spec.user.as_deref().unwrap_or("root"))?;
    let cwd = spec.cwd.clone().unwrap_or_else(|| home.to_string());
    if !guest.fs.lock().unwrap().get(Path::new(&cwd)).is_some_and(|n| n.dir) {
        return Err(ApiErr::invalid(format!("working directory {cwd:?} does not exist")));
    }
    let (ctl, rx) = mpsc::unbounded_channel();
    let proc = {
        let mut procs = guest.procs.lock().unwrap();
        procs.next_id += 1;
        let id = procs.next_id;
        let info = ProcessInfo {
            id,
            pid: 100 + id as u32,
            tag: spec.tag.clone(),
            argv: spec.argv.clone(),
            cwd,
            user: user_name.into(),
            pty: spec.pty.is_some(),
            stdin: spec.stdin,
            state: ProcessState::Running,
            exit: None,
            started_at_ms: now_ms(),
            ended_at_ms: None,
        };
        let proc = Arc::new(FakeProc {
            info: Mutex::new(info),
            log: Mutex::new((Vec::new(), false)),
            seq: watch::channel(0).0,
            ctl,
            merge_stderr: spec.pty.is_some(),
        });
        procs.table.insert(id, proc.clone());
        proc
    };
    let info = proc.info();
    tokio::spawn(run(
        guest.clone(),
        proc,
        program(&spec.argv),
        rx,
        spec.timeout_ms.map(Duration::from_millis),
    ));
    Ok(info)
}

pub(super) async fn run(
    guest: Arc<Guest>,
    proc: Arc<FakeProc>,
    program: Program,
    mut ctl: mpsc::UnboundedReceiver<Ctl>,
    timeout: Option<Duration>,
) {
    let code = |c| ExitStatus {
        exit_code: Some(c),
        signal: None,
        timed_out: false,
    };
    let signaled = |s| ExitStatus {
        exit_code: None,
        signal: Some(s),
        timed_out: false,
    };
    let timed_out = || ExitStatus {
        exit_code: None,
        signal: Some(Signal::SIGKILL as i32),
        timed_out: true,
    };
    let timer = async {
        match timeout {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(timer);
    let exit = match program {
        Program::Done {
            stdout,
            stderr,
            code: c,
        } => {
            proc.output(false, &stdout);
            proc.output(true, &stderr);
            code(c)
        }
        Program::PowerOff => {
            let g = guest.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                g.power_off();
            });
            code(0)
        }
        Program::Sleep(d) => {
            let sleep = async {
                match d {
                    Some(d) => tokio::time::sleep(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    _ = &mut sleep => break code(0),
                    _ = &mut timer => break timed_out(),
                    Some(c) = ctl.recv() => {
                        if let Ctl::Signal(s) = c {
                            if !ignored_by_default(s) {
                                break signaled(s);
                            }
                        }
                    }
                }
            }
        }
        Program::Cat => loop {
            tokio::select! {
                _ = &mut timer => break timed_out(),
                c = ctl.recv() => match c {
                    Some(Ctl::Stdin(b)) => proc.output(false, &b),
                    Some(Ctl::CloseStdin) | None => break code(0),
                    Some(Ctl::Signal(s)) if !ignored_by_default(s) => break signaled(s),
                    Some(Ctl::Signal(_)) => {}
                },
            }
        },
    };
    proc.finish(exit);
}

pub(super) fn event_stream(guest: Arc<Guest>, proc: Arc<FakeProc>, after: u64) -> Response<Body> {
    let stream = futures_util::stream::unfold((guest, proc, after), |(guest, proc, last)| async move {
        let events = proc.next_events(last).await?;
        guest.wait_running().await; // a frozen guest sends nothing
        let mut buf = BytesMut::new();
        let mut last = last;
        for e in &events {
            e.encode(&mut buf);
            last = e.seq;
        }
        Some((Ok::<_, std::io::Error>(Frame::data(buf.freeze())), (guest, proc, last)))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/x-airlock-events")
        .body(BodyExt::boxed_unsync(StreamBody::new(stream)))
        .expect("valid response")
}
