//! Processes in a real guest: output, exit codes, stdin, timeouts, signals, cwd/env/user, ptys,
//! listing and reattaching by id. All on the shared sandbox.

use crate::common::*;
use airlock_proto::frame::EventKind;
use airlock_proto::{ErrorCode, ProcessSpec, PtySize};
use futures_util::StreamExt;
use std::collections::BTreeMap;
use std::time::Duration;

pub fn echo_prints_and_exits_zero() {
    let sb = shared();
    let out = block_on(sb.run(argv(&["echo", "hello from airlock"]))).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from airlock\n");
    assert_eq!(out.exit.exit_code, Some(0));
    assert_eq!(out.exit.signal, None);
    assert!(out.stderr.is_empty());
}

pub fn nonzero_exit_codes_are_reported() {
    let sb = shared();
    for code in [1, 3, 42, 255] {
        let out = block_on(sb.run(sh(&format!("exit {code}")))).unwrap();
        assert_eq!(out.exit.exit_code, Some(code));
    }
}

pub fn stderr_is_separate_from_stdout() {
    let sb = shared();
    let out = block_on(sb.run(sh("echo out; echo err >&2; echo out2; echo err2 >&2"))).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\nout2\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "err\nerr2\n");
}

pub fn five_mib_of_stdout_arrives_complete_and_in_order() {
    let sb = shared();
    // 655360 lines of 7 digits + newline = exactly 5 MiB
    let out = block_on(sb.run(argv(&["seq", "-f", "%07g", "0", "655359"]))).unwrap();
    assert_eq!(out.exit.exit_code, Some(0));
    assert_eq!(out.stdout.len(), 5 << 20);
    let expected: String = (0..655360).map(|i| format!("{i:07}\n")).collect();
    assert!(
        out.stdout == expected.as_bytes(),
        "stream differs from the expected sequence"
    );
}

pub fn stdin_round_trips_through_cat() {
    let sb = shared();
    block_on(async {
        let agent = sb.agent().await.unwrap();
        let info = agent
            .spawn(&ProcessSpec {
                stdin: true,
                ..argv(&["cat"])
            })
            .await
            .unwrap();
        let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        agent.write_stdin(info.id, payload.clone()).await.unwrap();
        agent.write_stdin(info.id, &b"tail"[..]).await.unwrap();
        agent.close_stdin(info.id).await.unwrap();
        let mut events = Box::pin(agent.events(info.id, 0).await.unwrap());
        let mut got = Vec::new();
        let mut last_seq = 0;
        while let Some(ev) = events.next().await {
            let ev = ev.unwrap();
            assert!(ev.seq > last_seq, "sequence numbers increase");
            last_seq = ev.seq;
            match ev.kind {
                EventKind::Stdout(b) => got.extend_from_slice(&b),
                EventKind::Stderr(b) => panic!("unexpected stderr {b:?}"),
                EventKind::Exit(e) => assert_eq!(e.exit_code, Some(0)),
            }
        }
        let mut want = payload;
        want.extend_from_slice(b"tail");
        assert!(got == want, "cat echoed {} bytes, expected {}", got.len(), want.len());
    });
}

pub fn timeout_kills_the_process_and_says_so() {
    let sb = shared();
    let spec = ProcessSpec {
        timeout_ms: Some(1500),
        ..sh("echo started; sleep 60; echo never")
    };
    let out = block_on(sb.run(spec)).unwrap();
    assert!(out.exit.timed_out);
    assert_eq!(out.exit.signal, Some(9));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "started\n");
}

pub fn sigterm_and_sigkill_reach_the_process() {
    let sb = shared();
    block_on(async {
        let agent = sb.agent().await.unwrap();
        // A TERM handler proves the signal reached the program, not just its session.
        let trap = sh("trap 'echo got TERM; exit 7' TERM; echo ready; while :; do sleep 0.1; done");
        let info = agent.spawn(&trap).await.unwrap();
        let mut events = Box::pin(agent.events(info.id, 0).await.unwrap());
        let first = events.next().await.unwrap().unwrap();
        assert_eq!(first.kind, EventKind::Stdout(bytes::Bytes::from_static(b"ready\n")));
        agent.signal(info.id, 15).await.unwrap();
        let mut out = Vec::new();
        let mut exit = None;
        while let Some(ev) = events.next().await {
            match ev.unwrap().kind {
                EventKind::Stdout(b) => out.extend_from_slice(&b),
                EventKind::Exit(e) => exit = Some(e),
                _ => {}
            }
        }
        assert_eq!(String::from_utf8_lossy(&out), "got TERM\n");
        assert_eq!(exit.unwrap().exit_code, Some(7));

        let info = agent.spawn(&argv(&["sleep", "600"])).await.unwrap();
        agent.signal(info.id, 9).await.unwrap();
        let mut events = Box::pin(agent.events(info.id, 0).await.unwrap());
        let mut exit = None;
        while let Some(ev) = events.next().await {
            if let EventKind::Exit(e) = ev.unwrap().kind {
                exit = Some(e);
            }
        }
        let exit = exit.unwrap();
        assert_eq!((exit.signal, exit.exit_code, exit.timed_out), (Some(9), None, false));
        // Signalling a finished process is a clear client error.
        let err = agent.signal(info.id, 15).await.unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::InvalidArgument));
    });
}

pub fn cwd_env_and_user_are_honoured() {
    let sb = shared();
    let as_user = block_on(sb.run(ProcessSpec {
        user: Some("user".into()),
        ..argv(&["id", "-un"])
    }))
    .unwrap();
    assert_eq!(String::from_utf8_lossy(&as_user.stdout), "user\n");
    let as_root = block_on(sb.run(ProcessSpec {
        user: Some("root".into()),
        ..argv(&["id", "-un"])
    }))
    .unwrap();
    assert_eq!(String::from_utf8_lossy(&as_root.stdout), "root\n");
    let home = block_on(sb.run(ProcessSpec {
        user: Some("user".into()),
        ..sh("pwd; echo $HOME")
    }))
    .unwrap();
    assert_eq!(String::from_utf8_lossy(&home.stdout), "/home/user\n/home/user\n");

    let mut env = BTreeMap::new();
    env.insert("GREETING".to_string(), "hi there".to_string());
    let spec = ProcessSpec {
        cwd: Some("/tmp".into()),
        env,
        ..sh("pwd; echo \"$GREETING\"")
    };
    let out = block_on(sb.run(spec)).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "/tmp\nhi there\n");

    // Bad input is a clear error, not a hang.
    let agent = block_on(sb.agent()).unwrap();
    for (spec, needle) in [
        (
            ProcessSpec {
                user: Some("nobody-here".into()),
                ..argv(&["true"])
            },
            "no user named",
        ),
        (
            ProcessSpec {
                cwd: Some("/does/not/exist".into()),
                ..argv(&["true"])
            },
            "does not exist",
        ),
        (argv(&["/no/such/program"]), "not found"),
        (argv(&[]), "argv"),
    ] {
        let err = block_on(agent.spawn(&spec)).unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::InvalidArgument), "{err}");
        assert!(err.to_string().contains(needle), "{err}");
    }
}

pub fn pty_runs_a_shell_and_resizes() {
    let sb = shared();
    block_on(async {
        let a = sb.agent().await.unwrap();
        let mut env = BTreeMap::new();
        env.insert("PS1".to_string(), "READY> ".to_string());
        let spec = ProcessSpec {
            pty: Some(PtySize { cols: 80, rows: 24 }),
            env,
            ..argv(&["/bin/bash", "--norc", "--noprofile", "-i"])
        };
        let info = a.spawn(&spec).await.unwrap();
        assert!(info.pty);
        let mut events = Box::pin(a.events(info.id, 0).await.unwrap());
        let mut out = Vec::new();
        let mut exit = None;
        // Type only at a prompt, the way a person would.
        let mut prompts_seen = 0;
        let script: [&[u8]; 2] = [b"stty size; echo tty=$(tty)\n", b"stty size; exit 3\n"];
        while let Some(ev) = tokio::time::timeout(Duration::from_secs(30), events.next())
            .await
            .unwrap()
        {
            match ev.unwrap().kind {
                EventKind::Stdout(b) => out.extend_from_slice(&b),
                EventKind::Stderr(_) => panic!("a pty merges stderr into stdout"),
                EventKind::Exit(e) => exit = Some(e),
            }
            let prompts = String::from_utf8_lossy(&out).matches("READY> ").count();
            if prompts > prompts_seen && prompts_seen < script.len() {
                if prompts_seen == 1 {
                    a.resize(info.id, PtySize { cols: 132, rows: 50 }).await.unwrap();
                }
                a.write_stdin(info.id, script[prompts_seen]).await.unwrap();
                prompts_seen = prompts;
            }
        }
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("24 80"), "{text}");
        assert!(text.contains("tty=/dev/pts/"), "{text}");
        assert!(text.contains("50 132"), "{text}");
        assert_eq!(exit.unwrap().exit_code, Some(3));
    });
}

pub fn processes_can_be_listed_and_reconnected_by_id() {
    let sb = shared();
    block_on(async {
        let a = sb.agent().await.unwrap();
        let info = a
            .spawn(&sh("for i in 1 2 3 4 5; do echo line$i; sleep 0.2; done"))
            .await
            .unwrap();
        assert!(a.processes().await.unwrap().iter().any(|p| p.id == info.id));
        // First reader takes two events and goes away.
        let mut first = Box::pin(a.events(info.id, 0).await.unwrap());
        let e1 = first.next().await.unwrap().unwrap();
        let e2 = first.next().await.unwrap().unwrap();
        drop(first);
        // A new reader resumes after the last seen seq, without loss or duplicates.
        let mut rest = Box::pin(a.events(info.id, e2.seq).await.unwrap());
        let mut out = Vec::new();
        for e in [&e1, &e2] {
            if let EventKind::Stdout(d) = &e.kind {
                out.extend_from_slice(d);
            }
        }
        while let Some(ev) = rest.next().await {
            if let EventKind::Stdout(d) = ev.unwrap().kind {
                out.extend_from_slice(&d);
            }
        }
        assert_eq!(String::from_utf8_lossy(&out), "line1\nline2\nline3\nline4\nline5\n");
        // Finished processes stay readable for a reconnect.
        let done = a.process(info.id).await.unwrap();
        assert_eq!(done.state, airlock_proto::ProcessState::Exited);
        assert_eq!(done.exit.unwrap().exit_code, Some(0));
        assert_eq!(a.process(999_999).await.unwrap_err().code(), Some(ErrorCode::NotFound));
    });
}
