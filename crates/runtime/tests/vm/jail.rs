//! What QEMU runs in: its own uid, seccomp, read-only mounts, fds, cgroups, and an empty
//! network namespace of its own.

use crate::common::*;
use std::time::Duration;

/// The cgroups a process is in that airlock made (`/proc/<pid>/cgroup`), as directories:
/// one per v1 controller, or the one v2 cgroup.
pub fn airlock_cgroups(pid: u32) -> Vec<std::path::PathBuf> {
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
pub fn qemu_runs_jailed() {
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
pub fn qemu_has_an_empty_network_namespace_of_its_own() {
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
