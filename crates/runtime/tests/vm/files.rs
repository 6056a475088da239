//! Files in a real guest: bytes written by the host and by the guest, stat/list/mkdir/rename/
//! remove, and watches. All on the shared sandbox.

use crate::common::*;
use airlock_proto::{ErrorCode, WatchEventKind};
use futures_util::StreamExt;
use std::time::Duration;

pub fn host_written_binary_file_reads_back_exactly() {
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

pub fn guest_written_file_is_read_by_the_host() {
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

pub fn file_operations_stat_list_mkdir_rename_remove() {
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

pub fn watch_reports_create_write_rename_remove_recursively() {
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
