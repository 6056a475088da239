//! Starting from saved machines: creates restored from the base snapshot with identities of
//! their own, and sandboxes made from an image saved from a running one.

use crate::common::*;
use airlock_proto::ErrorCode;
use airlock_runtime::{CreateVm, Resources};
use std::time::Duration;

/// The shared sandbox's create asked for its shape's base snapshot; once built, creates restore
/// from it, each with an identity of its own (hostname, machine id, boot id, random state, clock)
/// and a disk of its own.
pub fn creates_restore_from_a_base_snapshot_with_an_identity_of_their_own() {
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
pub fn sandboxes_from_a_saved_image_have_its_processes_and_files_and_lives_of_their_own() {
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
                        volumes: Vec::new(),
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
