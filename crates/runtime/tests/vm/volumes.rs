//! Volumes in real guests: hot-plugged after the VM starts (a base snapshot's restore too),
//! mounted for the sandbox's user, kept across a suspend and resume, shared one writer or many
//! readers, reached by the host's file calls through the guest that has it (or a helper VM),
//! never through a symlink out of it, and grown.

use crate::common::*;
use airlock_runtime::sandbox::VolumeMount;
use airlock_runtime::{CreateVm, RuntimeError};

fn with_volume(volume: &str, path: &str, read_only: bool) -> CreateVm {
    CreateVm {
        id: None,
        template: "seed".into(),
        resources: small(),
        image: None,
        env: Default::default(),
        volumes: vec![VolumeMount {
            volume: volume.into(),
            path: path.into(),
            read_only,
            owner: Some("user".into()),
        }],
    }
}

fn run_as_user(vm: &airlock_runtime::Vm, script: &str) -> (i32, String) {
    let mut spec = sh(script);
    spec.user = Some("user".into());
    let out = block_on(vm.run(spec)).unwrap();
    (
        out.exit.exit_code.unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

pub fn a_volume_outlives_its_sandboxes_and_keeps_to_itself() {
    let rt = runtime();
    let vol = format!("vol-rt{}", airlock_runtime::datadir::random_hex(4));
    rt.volume_disks().create(&vol, 64).unwrap();

    // A writer: the sandbox's user owns the fresh volume's root.
    let a = block_on(rt.create(with_volume(&vol, "/data", false))).expect("a sandbox with a volume starts");
    let (code, out) = run_as_user(
        &a,
        "echo hi > /data/a.txt && mkdir /data/d && ln -s /etc /data/escape && ln -s /etc/hostname /data/host && sync && stat -c %U /data && df -m /data | tail -1",
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("user\n"), "{out}");

    // A second writer, or a reader beside the writer, is refused.
    for read_only in [false, true] {
        match block_on(rt.create(with_volume(&vol, "/data", read_only))) {
            Err(RuntimeError::VolumeBusy(m)) => assert!(m.contains(a.id()), "{m}"),
            other => panic!(
                "a second mount beside a writer: {:?}",
                other.map(|v| v.id().to_string())
            ),
        }
    }

    // The host's calls go through the writer's guest, and no symlink leads out.
    let access = block_on(rt.volume_access(&vol, true)).unwrap();
    assert_eq!(access.sandbox.as_deref(), Some(a.id()));
    let root = access.root.clone();
    assert_eq!(
        &block_on(access.agent.read_file(&format!("{root}/a.txt"))).unwrap()[..],
        b"hi\n"
    );
    for escape in ["escape/passwd", "host"] {
        assert!(
            block_on(access.agent.read_file(&format!("{root}/{escape}"))).is_err(),
            "{escape} was read through a symlink"
        );
    }
    assert!(block_on(
        access
            .agent
            .write_file(&format!("{root}/escape/x"), None, b"no".to_vec())
    )
    .is_err());
    assert!(block_on(access.agent.read_file(&format!("{root}/../../../etc/passwd"))).is_err());
    block_on(
        access
            .agent
            .write_file(&format!("{root}/b.txt"), Some("user"), b"from the host".to_vec()),
    )
    .unwrap();
    let (code, out) = run_as_user(&a, "cat /data/b.txt; test ! -e /etc/x");
    assert_eq!((code, out.as_str()), (0, "from the host"));

    // Suspended and resumed, it has its volume where it was.
    block_on(rt.suspend(a.id())).unwrap();
    assert!(
        block_on(rt.volume_access(&vol, false)).is_err(),
        "a suspended holder serves no calls"
    );
    block_on(rt.resume(a.id())).unwrap();
    let a = rt.get(a.id()).unwrap();
    let (code, out) = run_as_user(&a, "cat /data/a.txt && echo more >> /data/a.txt && sync");
    assert_eq!((code, out.as_str()), (0, "hi\n"));
    assert!(
        block_on(rt.delete_volume(&vol)).is_err(),
        "a volume in use is not deleted"
    );
    block_on(rt.delete(a.id())).unwrap();

    // No VM has it: a helper serves the calls.
    let access = block_on(rt.volume_access(&vol, true)).unwrap();
    assert_eq!(access.sandbox, None);
    let root = access.root.clone();
    assert_eq!(
        &block_on(access.agent.read_file(&format!("{root}/a.txt"))).unwrap()[..],
        b"hi\nmore\n"
    );
    assert!(block_on(access.agent.read_file(&format!("{root}/escape/passwd"))).is_err());
    block_on(
        access
            .agent
            .write_file(&format!("{root}/c.txt"), Some("user"), b"by the helper".to_vec()),
    )
    .unwrap();

    // Grown, then two readers at once (the helper steps aside), writes refused in the guest.
    rt.volume_disks().grow(&vol, 128).unwrap();
    let r1 = block_on(rt.create(with_volume(&vol, "/mnt/ro", true))).expect("a reader starts");
    let r2 = block_on(rt.create(with_volume(&vol, "/mnt/ro", true))).expect("a second reader starts");
    for r in [&r1, &r2] {
        let (code, out) = run_as_user(r, "cat /mnt/ro/c.txt; echo x > /mnt/ro/new 2>&1");
        assert_ne!(code, 0);
        assert!(
            out.starts_with("by the helper") && out.contains("Read-only file system"),
            "{out}"
        );
    }
    assert!(
        matches!(block_on(rt.volume_access(&vol, true)), Err(RuntimeError::VolumeBusy(_))),
        "writes wait for the readers"
    );
    for r in [r1, r2] {
        block_on(rt.delete(r.id())).unwrap();
    }
    // A writer again: its filesystem grew to the disk.
    let w = block_on(rt.create(with_volume(&vol, "/data", false))).unwrap();
    let (code, out) = run_as_user(&w, "cat /data/c.txt; echo; df -m --output=size /data | tail -1");
    assert_eq!(code, 0, "{out}");
    let size: u64 = out.lines().last().unwrap().trim().parse().unwrap();
    assert!(out.starts_with("by the helper") && (110..=128).contains(&size), "{out}");
    block_on(rt.delete(w.id())).unwrap();
    block_on(rt.delete_volume(&vol)).unwrap();
    assert!(!rt.volume_disks().exists(&vol));
}
