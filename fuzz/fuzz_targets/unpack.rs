//! Any bytes as an image layer, applied twice (so its whiteouts meet its own entries) over a
//! tree that already holds symlinks to a host directory beside it, then airlock's own files:
//! whatever the unpacker accepts or refuses, that directory is as it was.
#![no_main]

use airlock_unpack::{apply_layer, prepare_root, Budget, Tree};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("a temp dir");
    let root = dir.path().join("root");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(outside.join("sub")).unwrap();
    std::fs::write(outside.join("victim"), b"v").unwrap();
    std::fs::create_dir(&root).unwrap();
    for (link, target) in [
        ("x", outside.to_str().unwrap()),
        ("up", "../outside"),
        ("usr", "../outside"),
    ] {
        std::os::unix::fs::symlink(target, root.join(link)).unwrap();
    }
    let tree = Tree::open(&root).unwrap();
    let limit = Budget {
        bytes: 1 << 20,
        entries: 10_000,
    };
    let mut budget = limit;
    for _ in 0..2 {
        let _ = apply_layer(&tree, || Ok(data), &mut budget, limit);
    }
    let agent = dir.path().join("agent");
    std::fs::write(&agent, b"agent").unwrap();
    let _ = prepare_root(&tree, &agent);
    let names: Vec<_> = std::fs::read_dir(&outside)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names.len(), 2, "the host dir changed: {names:?}");
    assert_eq!(std::fs::read(outside.join("victim")).unwrap(), b"v");
    assert_eq!(std::fs::read_dir(outside.join("sub")).unwrap().count(), 0);
    assert!(!Path::new("/tmp/airlock-fuzz-planted").exists());
});
