//! Real-VM tests of the runtime: every test here boots or uses a QEMU microVM (TCG on hosts
//! without usable KVM) and talks to the guest agent over the real channel.
//!
//! A custom main (libtest-mimic, same CLI and output as libtest) so the sandboxes the tests
//! share are deleted when the run ends: VMs outlive the process that started them by design.

mod common;

use airlock_proto::frame::EventKind;
use airlock_proto::{ErrorCode, ProcessSpec, PtySize, WatchEventKind};
use airlock_runtime::vmm::pid_alive;
use airlock_runtime::{CreateVm, Resources, RuntimeError};
use common::*;
use futures_util::StreamExt;
use libtest_mimic::Trial;
use std::collections::BTreeMap;
use std::time::Duration;

fn echo_prints_and_exits_zero() {
    let sb = shared();
    let out = block_on(sb.run(argv(&["echo", "hello from airlock"]))).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from airlock\n");
    assert_eq!(out.exit.exit_code, Some(0));
    assert_eq!(out.exit.signal, None);
    assert!(out.stderr.is_empty());
}

fn nonzero_exit_codes_are_reported() {
    let sb = shared();
    for code in [1, 3, 42, 255] {
        let out = block_on(sb.run(sh(&format!("exit {code}")))).unwrap();
        assert_eq!(out.exit.exit_code, Some(code));
    }
}

fn stderr_is_separate_from_stdout() {
    let sb = shared();
    let out = block_on(sb.run(sh("echo out; echo err >&2; echo out2; echo err2 >&2"))).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\nout2\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "err\nerr2\n");
}

fn five_mib_of_stdout_arrives_complete_and_in_order() {
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

fn stdin_round_trips_through_cat() {
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

fn timeout_kills_the_process_and_says_so() {
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

fn sigterm_and_sigkill_reach_the_process() {
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

fn cwd_env_and_user_are_honoured() {
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

fn host_written_binary_file_reads_back_exactly() {
    let sb = shared();
    block_on(async {
        let agent = sb.agent().await.unwrap();
        let data: Vec<u8> = (0..(10u32 << 20))
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let stat = agent
            .write_file("/home/user/data/blob.bin", Some("user"), data.clone())
            .await
            .unwrap();
        assert_eq!(stat.size, 10 << 20);
        assert_eq!(stat.owner, "user");
        let back = agent.read_file("/home/user/data/blob.bin").await.unwrap();
        assert!(back == data, "read back differs");
        // The guest sees the same bytes.
        use sha2::Digest;
        let want = hex::encode(sha2::Sha256::digest(&data));
        let out = sb.run(argv(&["sha256sum", "/home/user/data/blob.bin"])).await.unwrap();
        assert!(String::from_utf8_lossy(&out.stdout).starts_with(&want));
    });
}

fn guest_written_file_is_read_by_the_host() {
    let sb = shared();
    let out = block_on(sb.run(sh("printf 'line1\\nline2\\n' > /tmp/from-guest.txt; head -c 3000 /dev/urandom > /tmp/rand.bin; sha256sum /tmp/rand.bin"))).unwrap();
    assert_eq!(out.exit.exit_code, Some(0));
    let agent = block_on(sb.agent()).unwrap();
    assert_eq!(
        &block_on(agent.read_file("/tmp/from-guest.txt")).unwrap()[..],
        b"line1\nline2\n"
    );
    let rand = block_on(agent.read_file("/tmp/rand.bin")).unwrap();
    use sha2::Digest;
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(&hex::encode(sha2::Sha256::digest(&rand))));
}

fn file_operations_stat_list_mkdir_rename_remove() {
    let sb = shared();
    block_on(async {
        let a = sb.agent().await.unwrap();
        let made = a.mkdir("/srv/tree/a/b", None).await.unwrap();
        assert!(made.created);
        assert!(!a.mkdir("/srv/tree/a/b", None).await.unwrap().created);
        a.write_file("/srv/tree/a/one.txt", None, &b"1"[..]).await.unwrap();
        a.write_file("/srv/tree/a/b/two.txt", None, &b"22"[..]).await.unwrap();
        let names = |v: Vec<airlock_proto::FileStat>| v.into_iter().map(|s| s.path).collect::<Vec<_>>();
        assert_eq!(names(a.list("/srv/tree", 1).await.unwrap()), vec!["/srv/tree/a"]);
        assert_eq!(
            names(a.list("/srv/tree", 3).await.unwrap()),
            vec![
                "/srv/tree/a",
                "/srv/tree/a/b",
                "/srv/tree/a/b/two.txt",
                "/srv/tree/a/one.txt"
            ]
        );
        let st = a
            .rename("/srv/tree/a/one.txt", "/srv/tree/moved/one.txt")
            .await
            .unwrap();
        assert_eq!((st.size, st.kind), (1, airlock_proto::FileKind::File));
        assert_eq!(
            a.stat("/srv/tree/a/one.txt").await.unwrap_err().code(),
            Some(ErrorCode::NotFound)
        );
        a.remove("/srv/tree").await.unwrap();
        assert_eq!(a.stat("/srv/tree").await.unwrap_err().code(), Some(ErrorCode::NotFound));
        assert_eq!(
            a.read_file("/nope").await.unwrap_err().code(),
            Some(ErrorCode::NotFound)
        );
        assert_eq!(
            a.read_file("relative").await.unwrap_err().code(),
            Some(ErrorCode::InvalidArgument)
        );
        assert_eq!(
            a.list("/etc/hostname", 1).await.unwrap_err().code(),
            Some(ErrorCode::NotADirectory)
        );
    });
}

fn watch_reports_create_write_rename_remove_recursively() {
    let sb = shared();
    block_on(async {
        let a = sb.agent().await.unwrap();
        a.mkdir("/home/user/watched/sub", None).await.unwrap();
        let mut events = Box::pin(a.watch("/home/user/watched", true).await.unwrap());
        sb.run(sh("cd /home/user/watched && echo x > f.txt && echo more >> f.txt && mv f.txt g.txt && rm g.txt && echo y > sub/deep.txt"))
            .await
            .unwrap();
        let mut seen = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !seen
            .iter()
            .any(|(k, p): &(WatchEventKind, String)| *k == WatchEventKind::Create && p.ends_with("sub/deep.txt"))
        {
            let ev = tokio::time::timeout_at(deadline, events.next())
                .await
                .expect("watch events arrive")
                .unwrap()
                .unwrap();
            seen.push((ev.kind, ev.path));
        }
        let has = |k: WatchEventKind, suffix: &str| seen.iter().any(|(kk, p)| *kk == k && p.ends_with(suffix));
        assert!(has(WatchEventKind::Create, "/watched/f.txt"), "{seen:?}");
        assert!(has(WatchEventKind::Write, "/watched/f.txt"), "{seen:?}");
        assert!(
            has(WatchEventKind::Rename, "/watched/g.txt") || has(WatchEventKind::Rename, "/watched/f.txt"),
            "{seen:?}"
        );
        assert!(has(WatchEventKind::Remove, "/watched/g.txt"), "{seen:?}");
        assert_eq!(
            a.watch("/no/such/dir", false).await.err().unwrap().code(),
            Some(ErrorCode::NotFound)
        );
    });
}

fn pty_runs_a_shell_and_resizes() {
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

fn processes_can_be_listed_and_reconnected_by_id() {
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

/// The cgroups a process is in that airlock made (`/proc/<pid>/cgroup`), as directories:
/// one per v1 controller, or the one v2 cgroup.
fn airlock_cgroups(pid: u32) -> Vec<std::path::PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
            if !path.starts_with("/airlock/") {
                return None;
            }
            let root = std::path::Path::new("/sys/fs/cgroup");
            Some(if controllers.is_empty() {
                root.join(&path[1..])
            } else {
                root.join(controllers).join(&path[1..])
            })
        })
        .collect()
}

/// QEMU runs jailed (see the runtime's `jail.rs`): its own uid, no groups, `no_new_privs`, its
/// own seccomp filter (`-sandbox on,...`: mode 2), a mount namespace where every mount is
/// read-only, only the fds it was handed, and cgroups holding the VM's limits.
fn qemu_runs_jailed() {
    let sb = shared();
    let pid = sb.handle.pid;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap_or_else(|| panic!("no {name} in QEMU's status"))
            .split_whitespace()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let uid = field("Uid");
    assert!(
        uid.iter().all(|u| u == &uid[0]) && uid[0] != "0",
        "QEMU runs as uid {uid:?}"
    );
    assert!(
        field("Gid").iter().all(|g| g == &uid[0]),
        "QEMU's gids {:?}",
        field("Gid")
    );
    assert!(field("Groups").is_empty(), "QEMU keeps groups {:?}", field("Groups"));
    assert_eq!(field("Seccomp"), ["2"], "QEMU is not under its seccomp filter");
    assert_eq!(field("NoNewPrivs"), ["1"]);
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let want = format!("-sandbox\0{}\0", airlock_runtime::qemu::SANDBOX);
    assert!(cmdline.windows(want.len()).any(|w| w == want.as_bytes()));

    // Its own mount namespace, every mount read-only.
    let ns = |p: &str| std::fs::read_link(p).unwrap();
    assert_ne!(ns(&format!("/proc/{pid}/ns/mnt")), ns("/proc/self/ns/mnt"));
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    for line in mountinfo.lines() {
        let options = line.split(' ').nth(5).unwrap();
        assert!(
            options.split(',').any(|o| o == "ro"),
            "a writable mount in QEMU's view: {line}"
        );
    }

    // Only what it was handed: its sandbox's files, the template's blobs, a base snapshot's
    // files (read-only: every clone maps them), /dev/null (stdin), the tap of its NIC, sockets
    // and its own anonymous inodes.
    let data = test_data_dir();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let target = std::fs::read_link(fd.path()).unwrap();
        let t = target.display().to_string();
        if target.starts_with(data.join("snapshots")) {
            let info =
                std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.file_name().to_string_lossy())).unwrap();
            let flags = info.lines().find_map(|l| l.strip_prefix("flags:")).unwrap().trim();
            let flags = u32::from_str_radix(flags, 8).unwrap();
            assert_eq!(
                flags & libc::O_ACCMODE as u32,
                libc::O_RDONLY as u32,
                "{t} is open for writing"
            );
            continue;
        }
        let ok = target.starts_with(&sb.handle.dir)
            || target.starts_with(data.join("blobs"))
            || t == "/dev/null"
            || t == "/dev/net/tun"
            || t.starts_with("socket:")
            || t.starts_with("anon_inode:");
        assert!(ok, "QEMU holds fd {:?} -> {t}", fd.file_name());
    }

    // Its cgroups hold the VM's limits: memory = 256 MiB + the VMM's overhead, pids.
    let cgroups = airlock_cgroups(pid);
    assert!(!cgroups.is_empty(), "QEMU is in no airlock cgroup");
    let memory = (256 + airlock_runtime::jail::VMM_OVERHEAD_MIB) << 20;
    let pids = 1 + airlock_runtime::jail::VMM_EXTRA_PIDS;
    let read = |dir: &std::path::Path, f: &str| std::fs::read_to_string(dir.join(f)).ok().map(|s| s.trim().to_string());
    let mut seen = (false, false);
    for dir in &cgroups {
        assert!(
            dir.ends_with(sb.id()),
            "QEMU's cgroup {} is not its sandbox's",
            dir.display()
        );
        if let Some(m) = read(dir, "memory.max").or_else(|| read(dir, "memory.limit_in_bytes")) {
            assert_eq!(m, memory.to_string(), "memory limit in {}", dir.display());
            seen.0 = true;
        }
        if let Some(p) = read(dir, "pids.max") {
            assert_eq!(p, pids.to_string());
            seen.1 = true;
        }
    }
    assert_eq!(seen, (true, true), "no memory or pids limit in {cgroups:?}");

    // The guest still works in it.
    assert_eq!(block_on(sb.run(argv(&["true"]))).unwrap().exit.exit_code, Some(0));
}

/// QEMU runs in a network namespace of its own, neither the host's nor its sandbox's, with no
/// interface but a loopback that is down: a guest that breaks out into QEMU finds no route to
/// the host's loopback services, the metadata address or the LAN, and skips no egress rule. Its
/// IPC, UTS and cgroup namespaces are its own too. What QEMU needs still works: the agent's
/// channel and QMP (unix sockets by path, handed as fds), the NIC (a tap handed as an fd), a port
/// tunnel (through the agent's channel).
fn qemu_has_an_empty_network_namespace_of_its_own() {
    use std::os::unix::fs::MetadataExt;
    let sb = shared();
    let pid = sb.handle.pid;
    let ns = |p: &str| std::fs::read_link(p).unwrap().display().to_string();
    let qemu_net = ns(&format!("/proc/{pid}/ns/net"));
    assert_ne!(
        qemu_net,
        ns("/proc/self/ns/net"),
        "QEMU is in the host's network namespace"
    );
    let link = sb.net.as_ref().expect("the sandbox has a network");
    let sandbox_ns = std::path::Path::new(airlock_runtime::net::NETNS_DIR).join(&link.netns);
    let sandbox_net = format!("net:[{}]", std::fs::metadata(&sandbox_ns).unwrap().ino());
    assert_ne!(qemu_net, sandbox_net, "QEMU is in its sandbox's network namespace");
    for kind in ["ipc", "uts", "cgroup"] {
        assert_ne!(
            ns(&format!("/proc/{pid}/ns/{kind}")),
            ns(&format!("/proc/self/ns/{kind}")),
            "QEMU shares the host's {kind} namespace"
        );
    }

    // Nothing in it but a loopback, down.
    let out = std::process::Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-n", "ip", "-o", "link"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "nsenter: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let links = String::from_utf8(out.stdout).unwrap();
    let names: Vec<&str> = links.lines().filter_map(|l| l.split(": ").nth(1)).collect();
    assert_eq!(names, ["lo"], "QEMU's namespace has {links}");
    let flags = links.split(['<', '>']).nth(1).unwrap();
    assert!(!flags.split(',').any(|f| f == "UP"), "its loopback is up: {links}");

    // The guest still works in it: the agent's channel, its NIC up, a port tunnel.
    let eth0 = block_on(sb.run(argv(&["cat", "/sys/class/net/eth0/operstate"]))).unwrap();
    assert_eq!(String::from_utf8_lossy(&eth0.stdout).trim(), "up");
    block_on(async {
        let agent = sb.agent().await.unwrap();
        let echo = "import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
                    s.bind(('127.0.0.1', 7301)); s.listen(1); c, _ = s.accept(); c.sendall(c.recv(64))";
        let server = agent.spawn(&argv(&["python3", "-c", echo])).await.unwrap();
        let mut got = Vec::new();
        for _ in 0..100 {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            // Refused until the guest's server listens.
            let Ok(mut t) = agent.tunnel(7301).await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            t.write_all(b"through the channel").await.unwrap();
            got.clear();
            let _ = tokio::time::timeout(Duration::from_secs(5), t.read_to_end(&mut got)).await;
            if !got.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(String::from_utf8_lossy(&got), "through the channel");
        let _ = agent.signal(server.id, 9).await;
    });
}

fn metrics_and_health_report_the_guest() {
    let sb = shared();
    let a = block_on(sb.agent()).unwrap();
    let h = block_on(a.health()).unwrap();
    assert_eq!(h.protocol, airlock_proto::PROTOCOL_VERSION);
    let m = block_on(a.metrics()).unwrap();
    assert_eq!(m.cpu_count, 1);
    assert!(m.mem_total_bytes > 150 << 20 && m.mem_total_bytes <= 256 << 20, "{m:?}");
    assert!(m.mem_used_bytes > 0 && m.mem_used_bytes < m.mem_total_bytes);
    // The root fs was grown online to the 1024 MiB disk.
    assert!(m.disk_total_bytes > 900 << 20, "{m:?}");
    assert!(m.disk_used_bytes > 100 << 20);
    assert!((0.0..=100.0).contains(&m.cpu_used_pct));
}

fn sandboxes_from_one_template_are_isolated() {
    let (a, b) = (create(), shared());
    block_on(async {
        let aa = a.agent().await.unwrap();
        aa.write_file("/home/user/secret.txt", None, &b"only in a"[..])
            .await
            .unwrap();
        let out = a.run(sh("echo a-was-here > /etc/marker")).await.unwrap();
        assert_eq!(out.exit.exit_code, Some(0));
        let bb = b.agent().await.unwrap();
        assert_eq!(
            bb.stat("/home/user/secret.txt").await.unwrap_err().code(),
            Some(ErrorCode::NotFound)
        );
        assert_eq!(
            bb.stat("/etc/marker").await.unwrap_err().code(),
            Some(ErrorCode::NotFound)
        );
        assert_ne!(aa.health().await.unwrap().boot_id, bb.health().await.unwrap().boot_id);
        let host_a = a.run(argv(&["hostname"])).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&host_a.stdout).trim(), a.id());
        runtime().delete(a.id()).await.unwrap();
    });
}

/// The shared sandbox's create asked for its shape's base snapshot; once built, creates restore
/// from it, each with an identity of its own (hostname, machine id, boot id, random state, clock)
/// and a disk of its own.
fn creates_restore_from_a_base_snapshot_with_an_identity_of_their_own() {
    let rt = runtime();
    shared();
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    while block_on(rt.base_snapshot("seed", small())).is_none() {
        assert!(std::time::Instant::now() < deadline, "no base snapshot built in 300 s");
        std::thread::sleep(Duration::from_millis(500));
    }
    let (a, b) = (create(), create());
    block_on(async {
        let mut seen = Vec::new();
        for sb in [&a, &b] {
            assert_eq!(sb.record.start, airlock_runtime::sandbox::StartKind::BaseSnapshot);
            eprintln!("restored {} in {} ms", sb.id(), sb.record.start_ms);
            let out = sb
                .run(sh("hostname; cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; date +%s"))
                .await
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            let lines: Vec<&str> = text.lines().collect();
            assert_eq!(lines.len(), 4, "{text}");
            assert_eq!(lines[0], sb.id());
            assert!(
                lines[1].len() == 32 && lines[1].chars().all(|c| c.is_ascii_hexdigit()),
                "{text}"
            );
            let guest_now: i64 = lines[3].parse().unwrap();
            let host_now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs() as i64;
            assert!(
                (guest_now - host_now).abs() <= 5,
                "guest clock {guest_now}, host {host_now}"
            );
            let boot_id = sb.agent().await.unwrap().health().await.unwrap().boot_id;
            seen.push((lines[1].to_string(), lines[2].to_string(), boot_id));
        }
        assert_ne!(seen[0].0, seen[1].0, "machine ids");
        assert_ne!(seen[0].1, seen[1].1, "random bytes");
        assert_ne!(seen[0].2, seen[1].2, "boot ids");
        // Two restores of one snapshot don't see each other's writes.
        let aa = a.agent().await.unwrap();
        aa.write_file("/home/user/only-a.txt", None, &b"a"[..]).await.unwrap();
        assert_eq!(a.run(sh("echo a > /etc/only-a")).await.unwrap().exit.exit_code, Some(0));
        let bb = b.agent().await.unwrap();
        for path in ["/home/user/only-a.txt", "/etc/only-a"] {
            assert_eq!(
                bb.stat(path).await.unwrap_err().code(),
                Some(ErrorCode::NotFound),
                "{path}"
            );
        }
        // A clone suspends and resumes too (its RAM was a private mapping of the snapshot's):
        // same machine id, its file and a process that counts on, its clock set again.
        let sleeper = aa.spawn(&sh("sleep 1000")).await.unwrap();
        let a_id = a.id().to_string();
        drop((a, aa));
        let saved = rt.suspend(&a_id).await.unwrap();
        assert!(rt.is_suspended(&a_id));
        let resumed_at = std::time::Instant::now();
        rt.resume(&a_id).await.unwrap();
        eprintln!(
            "clone suspended in {} ms, resumed in {} ms",
            saved.ms,
            resumed_at.elapsed().as_millis()
        );
        let a = rt.get(&a_id).unwrap();
        let out = a
            .run(sh(&format!(
                "cat /home/user/only-a.txt; echo; cat /etc/machine-id; kill -0 {} && echo alive; date +%s",
                sleeper.pid
            )))
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[..3], ["a", seen[0].0.as_str(), "alive"], "{text}");
        let host_now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        assert!((lines[3].parse::<i64>().unwrap() - host_now).abs() <= 5, "{text}");
        for sb in [&a, &b] {
            rt.delete(sb.id()).await.unwrap();
        }
    });
}

/// A running sandbox saved as an image runs on, undisturbed; sandboxes made from the image start
/// with its memory (a process that counts on from where it was), its files, and identities of
/// their own, and are independent of it and of each other. Deleting the image leaves them be.
fn sandboxes_from_a_saved_image_have_its_processes_and_files_and_lives_of_their_own() {
    let rt = runtime();
    let parent = create();
    block_on(async {
        let agent = parent.agent().await.unwrap();
        agent
            .write_file("/home/user/before.txt", None, &b"before"[..])
            .await
            .unwrap();
        let counter = agent
            // Written whole (a rename): a reader never sees the file half-written, empty.
            .spawn(&sh("i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.1; done"))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let image_id = format!("img-{}", parent.id());
        let image = rt.save_image(parent.id(), &image_id).await.unwrap();
        eprintln!(
            "image saved in {} ms: {} MiB state, {} MiB disk",
            image.manifest.save_ms,
            image.manifest.state_bytes >> 20,
            image.manifest.disk_bytes >> 20
        );
        // The parent runs on, with its session.
        let out = agent.read_file("/home/user/before.txt").await.unwrap();
        assert_eq!(&out[..], b"before");
        let fork = |n: usize| {
            let rt = rt.clone();
            let image_id = image_id.clone();
            async move {
                let started = std::time::Instant::now();
                let sb = rt
                    .create(CreateVm {
                        id: None,
                        template: String::new(),
                        resources: Resources::default(),
                        image: Some(image_id),
                        env: Default::default(),
                    })
                    .await
                    .unwrap();
                eprintln!("child {n} from the image in {} ms", started.elapsed().as_millis());
                sb
            }
        };
        let children = [fork(0).await, fork(1).await];
        let mut machine_ids = vec![parent.run(sh("cat /etc/machine-id")).await.unwrap().stdout];
        for (n, child) in children.iter().enumerate() {
            assert_eq!(child.record.start, airlock_runtime::sandbox::StartKind::Image);
            assert_eq!(child.record.resources, parent.record.resources);
            let out = child
                .run(sh(&format!(
                    "cat /home/user/before.txt; echo; kill -0 {} && echo alive; a=$(cat /tmp/count); sleep 0.5; echo $a $(cat /tmp/count); hostname; cat /etc/machine-id",
                    counter.pid
                )))
                .await
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            let lines: Vec<&str> = text.lines().collect();
            assert_eq!(lines[..2], ["before", "alive"], "{text}");
            let counts: Vec<u64> = lines[2].split(' ').map(|c| c.parse().unwrap()).collect();
            assert!(
                counts[0] >= 3 && counts[1] > counts[0],
                "the counter runs on in child {n}: {text}"
            );
            assert_eq!(lines[3], child.id());
            machine_ids.push(lines[4].as_bytes().to_vec());
            // Its own disk from here on.
            let mine = format!("/home/user/child-{n}.txt");
            child
                .agent()
                .await
                .unwrap()
                .write_file(&mine, None, &b"mine"[..])
                .await
                .unwrap();
        }
        machine_ids.sort();
        machine_ids.dedup();
        assert_eq!(
            machine_ids.len(),
            3,
            "parent and children have machine ids of their own"
        );
        for (n, child) in children.iter().enumerate() {
            let other = format!("/home/user/child-{}.txt", 1 - n);
            assert_eq!(
                child.agent().await.unwrap().stat(&other).await.unwrap_err().code(),
                Some(ErrorCode::NotFound)
            );
        }
        assert_eq!(
            agent.stat("/home/user/child-0.txt").await.unwrap_err().code(),
            Some(ErrorCode::NotFound)
        );
        // The image goes; the children run on (and can still suspend and resume).
        rt.delete_image(&image_id).unwrap();
        assert!(rt.image(&image_id).is_none());
        let child = &children[0];
        rt.suspend(child.id()).await.unwrap();
        rt.resume(child.id()).await.unwrap();
        let again = rt.get(child.id()).unwrap();
        let out = again.run(sh("cat /home/user/child-0.txt")).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "mine");
        for sb in children
            .iter()
            .map(|c| c.id().to_string())
            .chain([parent.id().to_string()])
        {
            rt.delete(&sb).await.unwrap();
        }
    });
}

fn delete_leaves_nothing_behind() {
    let rt = runtime();
    let sb = create();
    let (pid, dir) = (sb.handle.pid, sb.handle.dir.clone());
    assert!(pid_alive(pid) && dir.join("disk.qcow2").exists() && sb.handle.agent_socket.exists());
    let cgroups = airlock_cgroups(pid);
    assert!(!cgroups.is_empty());
    block_on(rt.delete(sb.id())).unwrap();
    assert!(!pid_alive(pid), "QEMU {pid} still runs");
    assert!(!dir.exists(), "{} still exists", dir.display());
    for c in cgroups {
        assert!(!c.exists(), "cgroup {} still exists", c.display());
    }
    assert!(matches!(rt.get(sb.id()), Err(RuntimeError::UnknownSandbox(_))));
    assert!(matches!(
        block_on(rt.delete(sb.id())),
        Err(RuntimeError::UnknownSandbox(_))
    ));
}

fn killed_vmm_is_cleaned_up() {
    let rt = runtime();
    let sb = create();
    let (pid, dir, id) = (sb.handle.pid, sb.handle.dir.clone(), sb.id().to_string());
    let cgroups = airlock_cgroups(pid);
    drop(sb);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let gone = block_on(async {
        for _ in 0..100 {
            if !dir.exists() && rt.get(&id).is_err() && !pid_alive(pid) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    });
    assert!(
        gone,
        "after kill -9: dir exists={} pid alive={}",
        dir.exists(),
        pid_alive(pid)
    );
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "QEMU {pid} left as a zombie"
    );
    for c in cgroups {
        assert!(!c.exists(), "cgroup {} still exists", c.display());
    }
}

fn resources_are_honoured_and_validated() {
    let rt = runtime();
    let sb = block_on(rt.create(CreateVm {
        id: None,
        template: "seed".into(),
        resources: Resources {
            vcpu: 2,
            memory_mib: 384,
            disk_mib: 3000,
        },
        image: None,
        env: Default::default(),
    }))
    .unwrap();
    let out = block_on(sb.run(sh(
        "nproc; awk '/MemTotal/ {print $2}' /proc/meminfo; df -m / | awk 'NR==2 {print $2}'",
    )))
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let v: Vec<u64> = text.lines().map(|l| l.trim().parse().unwrap()).collect();
    assert_eq!(v[0], 2, "{text}");
    assert!(v[1] > 300 * 1024 && v[1] <= 384 * 1024, "{text}");
    assert!(v[2] > 2700 && v[2] <= 3000, "{text}");
    block_on(rt.delete(sb.id())).unwrap();

    let bad = |r: Resources| match block_on(rt.create(CreateVm {
        id: None,
        template: "seed".into(),
        resources: r,
        image: None,
        env: Default::default(),
    })) {
        Err(RuntimeError::InvalidResources(m)) => m,
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("accepted {r:?}"),
    };
    assert!(bad(Resources { vcpu: 0, ..small() }).contains("vcpu must be between 1"));
    assert!(bad(Resources { vcpu: 4096, ..small() }).contains("vcpu"));
    assert!(bad(Resources {
        memory_mib: 32,
        ..small()
    })
    .contains("memory_mib must be at least 128"));
    assert!(bad(Resources {
        disk_mib: 16,
        ..small()
    })
    .contains("disk_mib must be at least"));
    match block_on(rt.create(CreateVm {
        id: None,
        template: "nonexistent".into(),
        resources: small(),
        image: None,
        env: Default::default(),
    })) {
        Err(e @ RuntimeError::UnknownTemplate(_)) => assert!(e.to_string().contains("airlock template ls")),
        other => panic!("expected unknown template, got {:?}", other.err()),
    }
}

fn catch(f: fn()) -> Result<(), libtest_mimic::Failed> {
    f();
    Ok(())
}

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let tests = vec![
        Trial::test("echo_prints_and_exits_zero", || catch(echo_prints_and_exits_zero)),
        Trial::test(
            "creates_restore_from_a_base_snapshot_with_an_identity_of_their_own",
            || catch(creates_restore_from_a_base_snapshot_with_an_identity_of_their_own),
        ),
        Trial::test("nonzero_exit_codes_are_reported", || {
            catch(nonzero_exit_codes_are_reported)
        }),
        Trial::test("stderr_is_separate_from_stdout", || {
            catch(stderr_is_separate_from_stdout)
        }),
        Trial::test("five_mib_of_stdout_arrives_complete_and_in_order", || {
            catch(five_mib_of_stdout_arrives_complete_and_in_order)
        }),
        Trial::test("stdin_round_trips_through_cat", || catch(stdin_round_trips_through_cat)),
        Trial::test("timeout_kills_the_process_and_says_so", || {
            catch(timeout_kills_the_process_and_says_so)
        }),
        Trial::test("sigterm_and_sigkill_reach_the_process", || {
            catch(sigterm_and_sigkill_reach_the_process)
        }),
        Trial::test("cwd_env_and_user_are_honoured", || catch(cwd_env_and_user_are_honoured)),
        Trial::test("host_written_binary_file_reads_back_exactly", || {
            catch(host_written_binary_file_reads_back_exactly)
        }),
        Trial::test("guest_written_file_is_read_by_the_host", || {
            catch(guest_written_file_is_read_by_the_host)
        }),
        Trial::test("file_operations_stat_list_mkdir_rename_remove", || {
            catch(file_operations_stat_list_mkdir_rename_remove)
        }),
        Trial::test("watch_reports_create_write_rename_remove_recursively", || {
            catch(watch_reports_create_write_rename_remove_recursively)
        }),
        Trial::test("pty_runs_a_shell_and_resizes", || catch(pty_runs_a_shell_and_resizes)),
        Trial::test("processes_can_be_listed_and_reconnected_by_id", || {
            catch(processes_can_be_listed_and_reconnected_by_id)
        }),
        Trial::test("qemu_runs_jailed", || catch(qemu_runs_jailed)),
        Trial::test("qemu_has_an_empty_network_namespace_of_its_own", || {
            catch(qemu_has_an_empty_network_namespace_of_its_own)
        }),
        Trial::test("metrics_and_health_report_the_guest", || {
            catch(metrics_and_health_report_the_guest)
        }),
        Trial::test("sandboxes_from_one_template_are_isolated", || {
            catch(sandboxes_from_one_template_are_isolated)
        }),
        Trial::test("delete_leaves_nothing_behind", || catch(delete_leaves_nothing_behind)),
        Trial::test(
            "sandboxes_from_a_saved_image_have_its_processes_and_files_and_lives_of_their_own",
            || catch(sandboxes_from_a_saved_image_have_its_processes_and_files_and_lives_of_their_own),
        ),
        Trial::test("killed_vmm_is_cleaned_up", || catch(killed_vmm_is_cleaned_up)),
        Trial::test("resources_are_honoured_and_validated", || {
            catch(resources_are_honoured_and_validated)
        }),
    ];
    let booting = !args.list
        && tests
            .iter()
            .any(|t| args.skip.iter().all(|s| !t.name().contains(s.as_str())));
    if booting {
        // Sandboxes a crashed earlier run left behind are adopted by the runtime: remove them.
        remove_all_sandboxes();
    }
    let conclusion = libtest_mimic::run(&args, tests);
    if booting {
        remove_all_sandboxes();
    }
    conclusion.exit();
}

fn remove_all_sandboxes() {
    let rt = runtime();
    for sb in rt.list() {
        let _ = block_on(rt.delete(sb.id()));
    }
    // A base snapshot build still running would leave its network behind with the process.
    block_on(rt.stop_base_snapshot_builds());
}
