//! A sandbox's life: metrics and health, isolation between sandboxes of one template, delete,
//! a killed VMM, and resources honoured and validated.

use crate::common::*;
use crate::jail::airlock_cgroups;
use airlock_proto::ErrorCode;
use airlock_runtime::vmm::pid_alive;
use airlock_runtime::{CreateVm, Resources, RuntimeError};
use std::time::Duration;

pub fn metrics_and_health_report_the_guest() {
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

pub fn sandboxes_from_one_template_are_isolated() {
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

pub fn delete_leaves_nothing_behind() {
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

pub fn killed_vmm_is_cleaned_up() {
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

pub fn resources_are_honoured_and_validated() {
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
        volumes: Vec::new(),
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
        volumes: Vec::new(),
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
        volumes: Vec::new(),
    })) {
        Err(e @ RuntimeError::UnknownTemplate(_)) => assert!(e.to_string().contains("airlock template ls")),
        other => panic!("expected unknown template, got {:?}", other.err()),
    }
}
