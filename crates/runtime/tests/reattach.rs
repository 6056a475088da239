//! A VM outlives the process that started it, and a new runtime re-attaches to it.
//!
//! The parent re-runs this test binary as a child that creates a sandbox and exits without
//! deleting it; the parent then opens the same data dir and finds the VM running and usable.
//! The child also suspends a third sandbox, which the parent resumes with its files and running
//! processes intact.

mod common;

use airlock_runtime::vmm::pid_alive;
use airlock_runtime::{CreateVm, Runtime, RuntimeOptions};
use common::*;

const CHILD_ENV: &str = "AIRLOCK_REATTACH_CHILD";

#[test]
fn child_creates_sandbox_and_exits() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return; // only meaningful when started by `vm_survives_its_creator_and_is_reattached`
    }
    block_on(async {
        // Booted VMs (the restored kind suspends in `vm.rs`), and no snapshot build to interrupt.
        let mut opts = RuntimeOptions::new(test_data_dir());
        opts.base_snapshots = false;
        let rt = Runtime::open(opts).await.unwrap();
        let seed = || CreateVm {
            id: None,
            template: "seed".into(),
            resources: small(),
            image: None,
            env: Default::default(),
            volumes: Vec::new(),
        };
        let sb = rt.create(seed()).await.unwrap();
        sb.agent()
            .await
            .unwrap()
            .write_file("/home/user/note.txt", None, &b"written before the restart"[..])
            .await
            .unwrap();
        println!("SANDBOX_ID={} PID={}", sb.id(), sb.handle.pid);
        // A second VM, as a crash between spawning the VMM and writing its record leaves it:
        // only the pid file its jailed child wrote before exec.
        let orphan = rt.create(seed()).await.unwrap();
        std::fs::remove_file(airlock_runtime::vmm::VmHandle::record_path(&orphan.handle.dir)).unwrap();
        println!(
            "ORPHAN_PID={} ORPHAN_DIR={}",
            orphan.handle.pid,
            orphan.handle.dir.display()
        );
        // Suspended with a file written and a process running that counts on.
        let held = rt.create(seed()).await.unwrap();
        let agent = held.agent().await.unwrap();
        agent
            .write_file("/home/user/kept.txt", None, &b"kept on disk"[..])
            .await
            .unwrap();
        let counter = agent
            // Written whole (a rename): a reader never sees the file half-written, empty.
            .spawn(&sh("i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.1; done"))
            .await
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let pid = held.handle.pid;
        let timing = rt.suspend(held.id()).await.unwrap();
        assert!(!pid_alive(pid), "the suspended VM's QEMU still runs");
        assert!(rt.is_suspended(held.id()) && rt.get(held.id()).is_err());
        println!(
            "SUSPENDED_ID={} COUNTER={} SAVE_MS={}",
            held.id(),
            counter.pid,
            timing.ms
        );
    });
}

#[test]
fn vm_survives_its_creator_and_is_reattached() {
    // Make sure the template exists (built or found up to date) before the child needs it.
    // Build (or find) the template without keeping a runtime open: the child needs the lock.
    block_on(build_seed());
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_creates_sandbox_and_exits",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout.split("SANDBOX_ID=").nth(1).expect("child printed the id");
    let mut parts = line.split_whitespace();
    let id = parts.next().unwrap().to_string();
    let pid: u32 = parts.next().unwrap().trim_start_matches("PID=").parse().unwrap();
    assert!(pid_alive(pid), "the VM died with the process that started it");
    let orphan = stdout.split("ORPHAN_PID=").nth(1).expect("child printed the orphan");
    let mut parts = orphan.split_whitespace();
    let orphan_pid: u32 = parts.next().unwrap().parse().unwrap();
    let orphan_dir = std::path::PathBuf::from(parts.next().unwrap().trim_start_matches("ORPHAN_DIR="));
    assert!(pid_alive(orphan_pid));

    block_on(async {
        let rt = Runtime::open(RuntimeOptions::new(test_data_dir())).await.unwrap();
        // The unrecorded VM was found by its pid file, stopped and removed with its cgroups.
        assert!(!pid_alive(orphan_pid), "the unrecorded VM {orphan_pid} still runs");
        assert!(!orphan_dir.exists());
        let orphan_id = orphan_dir.file_name().unwrap().to_string_lossy().into_owned();
        let cgroups = std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten().map(|c| c.path());
        for c in cgroups {
            let leftover = c
                .join("airlock")
                .read_dir()
                .into_iter()
                .flatten()
                .flatten()
                .any(|tag| tag.path().join(&orphan_id).exists());
            assert!(!leftover, "a cgroup of the unrecorded VM is left in {}", c.display());
        }
        let sb = rt.get(&id).expect("re-attached after restart");
        assert_eq!(sb.handle.pid, pid);
        let note = sb
            .agent()
            .await
            .unwrap()
            .read_file("/home/user/note.txt")
            .await
            .unwrap();
        assert_eq!(&note[..], b"written before the restart");
        let out = sb.run(sh("echo still here")).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "still here\n");
        // Its network came back with it (rules reloaded, nothing swept), and goes with it.
        let link = sb.net.clone().expect("the network is re-attached too");
        let netns = std::path::Path::new(airlock_runtime::net::NETNS_DIR).join(&link.netns);
        assert!(netns.exists());
        let counters = rt.network().unwrap().counters(&link).await.unwrap();
        assert!(counters.contains_key("spoofed"), "{counters:?}");
        let eth0 = sb.run(sh("cat /sys/class/net/eth0/operstate")).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&eth0.stdout), "up\n");
        let dir = sb.handle.dir.clone();
        drop(sb);
        rt.delete(&id).await.unwrap();
        assert!(!pid_alive(pid) && !dir.exists());
        assert!(!netns.exists(), "{} left", netns.display());

        // The suspended sandbox: found suspended (no VM, no network), resumed as it was.
        let held = stdout
            .split("SUSPENDED_ID=")
            .nth(1)
            .expect("child printed the suspended id");
        let mut parts = held.split_whitespace();
        let held_id = parts.next().unwrap().to_string();
        let counter_pid: u32 = parts.next().unwrap().trim_start_matches("COUNTER=").parse().unwrap();
        assert!(rt.is_suspended(&held_id), "found suspended after the restart");
        let held_dir = test_data_dir().join("sandboxes").join(&held_id);
        assert!(held_dir.join("suspend.state").is_file());
        let held_ns =
            std::path::Path::new(airlock_runtime::net::NETNS_DIR).join(rt.network().unwrap().netns_name(&held_id));
        assert!(!held_ns.exists(), "a suspended sandbox keeps no network");
        let started = std::time::Instant::now();
        rt.resume(&held_id).await.unwrap();
        eprintln!("resumed in {} ms", started.elapsed().as_millis());
        assert!(!rt.is_suspended(&held_id));
        assert!(
            !held_dir.join("suspend.state").exists(),
            "the saved state goes once resumed"
        );
        let sb = rt.get(&held_id).unwrap();
        let agent = sb.agent().await.unwrap();
        assert_eq!(
            &agent.read_file("/home/user/kept.txt").await.unwrap()[..],
            b"kept on disk"
        );
        let out = sb
            .run(sh(&format!(
                "kill -0 {counter_pid} && a=$(cat /tmp/count); sleep 1; b=$(cat /tmp/count); echo $a $b; hostname"
            )))
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert_eq!(out.exit.exit_code, Some(0), "the counting process is gone: {text}");
        let mut lines = text.lines();
        let counts: Vec<u64> = lines.next().unwrap().split(' ').map(|n| n.parse().unwrap()).collect();
        assert!(
            counts[0] >= 3 && counts[1] > counts[0],
            "it counts on from where it was: {counts:?}"
        );
        assert_eq!(lines.next(), Some(held_id.as_str()));
        let eth0 = sb.run(sh("cat /sys/class/net/eth0/operstate")).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&eth0.stdout), "up\n");
        assert!(held_ns.exists(), "its network is made again");
        // Suspend again, then delete while suspended: nothing is left.
        drop((sb, agent));
        rt.suspend(&held_id).await.unwrap();
        rt.delete(&held_id).await.unwrap();
        assert!(!held_dir.exists() && !held_ns.exists());
    });
}
