//! Templates through object storage (`objects.rs`): pushed from one data dir, pulled into
//! another, verified, pulled again for nothing. Against a local dir, and against S3 as moto
//! serves it on loopback (a Python venv the test makes once under the target dir). No VM.

use airlock_runtime::datadir::DataDir;
use airlock_runtime::fake;
use airlock_runtime::objects::{Objects, ObjectsError, Pushed, PushedImage, PushedTemplate, PART_SIZE, S3};
use airlock_runtime::sandbox::image::{Image, ImageManifest};
use airlock_runtime::template::{TemplateManifest, TemplateStore};
use airlock_runtime::vmm::{Accel, ResumeSpec};
use airlock_runtime::Resources;
use airlock_testnet::s3::Moto;
use object_store::aws::AmazonS3Builder;
use object_store::{ObjectStore, PutMode, PutOptions};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::Instant;

const FILES: [&str; 3] = ["vmlinuz", "initrd.img", "rootfs.ext4"];

/// A fake template whose digest is its content's, as a build makes it (`fake::install_template`
/// names its blobs by the template's name), with `rootfs_bytes` of varied content.
fn template(dir: &Path, name: &str, rootfs_bytes: usize, seed: u8) -> TemplateManifest {
    let mut manifest = fake::install_template(dir, name).unwrap();
    let data = DataDir::open(dir).unwrap();
    let fake_dir = data.blobs().join(manifest.digest.trim_start_matches("sha256:"));
    let rootfs: Vec<u8> = (0..rootfs_bytes).map(|i| (i % 251) as u8 ^ seed).collect();
    std::fs::write(fake_dir.join("rootfs.ext4"), &rootfs).unwrap();
    let mut h = Sha256::new();
    let mut size = 0;
    for f in FILES {
        let bytes = std::fs::read(fake_dir.join(f)).unwrap();
        size += bytes.len() as u64;
        h.update(hex::encode(Sha256::digest(&bytes)).as_bytes());
    }
    let hex = hex::encode(h.finalize());
    std::fs::rename(&fake_dir, data.blobs().join(&hex)).unwrap();
    manifest.digest = format!("sha256:{hex}");
    manifest.size_bytes = size;
    manifest.rootfs_bytes = rootfs.len() as u64;
    std::fs::write(
        data.templates().join(format!("{name}.json")),
        serde_json::to_vec_pretty(&manifest).unwrap(),
    )
    .unwrap();
    manifest
}

fn store(dir: &Path) -> TemplateStore {
    TemplateStore::new(DataDir::open(dir).unwrap())
}

fn same_files(a: &Path, b: &Path) {
    for f in FILES {
        assert!(
            std::fs::read(a.join(f)).unwrap() == std::fs::read(b.join(f)).unwrap(),
            "{f} differs"
        );
    }
}

/// Nothing of a failed pull in the data dir: no manifest, no blobs, no staging dir.
fn nothing_pulled(dir: &Path) {
    let data = DataDir::open(dir).unwrap();
    for sub in [data.templates(), data.blobs(), data.cache()] {
        let left: Vec<_> = std::fs::read_dir(&sub).unwrap().flatten().map(|e| e.path()).collect();
        assert!(left.is_empty(), "left behind in {}: {left:?}", sub.display());
    }
}

/// Push from one data dir, pull into two fresh ones (by name, by digest), again for nothing.
async fn round_trip(objects: &Objects, rootfs_bytes: usize) -> TemplateManifest {
    let (src, dst, other) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let manifest = template(src.path(), "seed", rootfs_bytes, 7);
    let local = store(src.path()).resolve("seed").unwrap();

    let t = Instant::now();
    let pushed = objects.push_template(&local).await.unwrap();
    eprintln!("push of {} bytes: {:?}", manifest.size_bytes, t.elapsed());
    assert_eq!(pushed.digest, manifest.digest);
    assert!(
        pushed.uploaded_bytes > manifest.size_bytes,
        "blobs and manifest uploaded"
    );
    assert_eq!(
        objects.push_template(&local).await.unwrap().uploaded_bytes,
        0,
        "second push"
    );

    let target = store(dst.path());
    let t = Instant::now();
    let pulled = objects.pull_template("seed", &target).await.unwrap();
    eprintln!("pull of {} bytes: {:?}", manifest.size_bytes, t.elapsed());
    assert_eq!(pulled.fetched_bytes, manifest.size_bytes);
    assert_eq!(pulled.template.manifest, manifest);
    let resolved = target.resolve("seed").unwrap();
    assert_eq!(resolved.manifest, manifest);
    same_files(&local.dir, &resolved.dir);
    assert_eq!(
        objects
            .pull_template("seed:latest", &target)
            .await
            .unwrap()
            .fetched_bytes,
        0
    );
    assert_eq!(
        DataDir::open(dst.path()).unwrap().cache().read_dir().unwrap().count(),
        0
    );

    let by_digest = objects
        .pull_template(&manifest.digest, &store(other.path()))
        .await
        .unwrap();
    assert_eq!(by_digest.fetched_bytes, manifest.size_bytes);
    same_files(&local.dir, &by_digest.template.dir);

    let missing = objects.pull_template("nothing", &store(other.path())).await;
    assert!(matches!(missing, Err(ObjectsError::NotFound(_))), "{missing:?}");
    manifest
}

#[tokio::test]
async fn local_dir_round_trip() {
    let remote = tempfile::tempdir().unwrap();
    let objects = Objects::local(remote.path()).unwrap();
    round_trip(&objects, 64 << 10).await;
    let hex_dirs: Vec<_> = std::fs::read_dir(remote.path().join("templates"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(hex_dirs.len(), 1);
    let mut stored: Vec<String> = std::fs::read_dir(hex_dirs[0].path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    stored.sort();
    assert_eq!(stored, ["initrd.img", "manifest.json", "rootfs.ext4", "vmlinuz"]);
    assert!(remote.path().join("names/seed").exists());
}

/// A blob whose bytes are not what the manifest says: the pull fails typed and leaves nothing.
#[tokio::test]
async fn corrupt_blob_is_refused() {
    let (remote, src, dst) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let objects = Objects::local(remote.path()).unwrap();
    let manifest = template(src.path(), "seed", 64 << 10, 1);
    objects
        .push_template(&store(src.path()).resolve("seed").unwrap())
        .await
        .unwrap();
    let hex = manifest.digest.trim_start_matches("sha256:");
    let blob = remote.path().join(format!("templates/{hex}/rootfs.ext4"));
    let mut bytes = std::fs::read(&blob).unwrap();
    bytes[1000] ^= 0xff;
    std::fs::write(&blob, &bytes).unwrap();

    let target = store(dst.path());
    let err = objects.pull_template("seed", &target).await.unwrap_err();
    assert!(
        matches!(&err, ObjectsError::DigestMismatch { what, .. } if what.starts_with("rootfs.ext4")),
        "{err:?}"
    );
    assert!(target.resolve("seed").is_err());
    nothing_pulled(dst.path());

    // A longer blob is cut off at the manifest's size, and refused the same way.
    bytes.extend_from_slice(&[0; 4096]);
    std::fs::write(&blob, &bytes).unwrap();
    let err = objects.pull_template("seed", &target).await.unwrap_err();
    assert!(matches!(err, ObjectsError::DigestMismatch { .. }), "{err:?}");
    nothing_pulled(dst.path());
}

/// A manifest whose file digests do not make its digest, or whose name is a path, is refused
/// before anything is downloaded.
#[tokio::test]
async fn forged_manifest_is_refused() {
    let (remote, src, dst) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let objects = Objects::local(remote.path()).unwrap();
    let manifest = template(src.path(), "seed", 4096, 2);
    objects
        .push_template(&store(src.path()).resolve("seed").unwrap())
        .await
        .unwrap();
    let hex = manifest.digest.trim_start_matches("sha256:");
    let path = remote.path().join(format!("templates/{hex}/manifest.json"));
    let original: PushedTemplate = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();

    let mut forged = original.clone();
    forged.files[2].sha256 = "0".repeat(64);
    std::fs::write(&path, serde_json::to_vec(&forged).unwrap()).unwrap();
    let err = objects.pull_template("seed", &store(dst.path())).await.unwrap_err();
    assert!(matches!(err, ObjectsError::DigestMismatch { .. }), "{err:?}");
    nothing_pulled(dst.path());

    let mut forged = original;
    forged.manifest.name = "../../etc".into();
    std::fs::write(&path, serde_json::to_vec(&forged).unwrap()).unwrap();
    let err = objects.pull_template("seed", &store(dst.path())).await.unwrap_err();
    assert!(matches!(err, ObjectsError::BadManifest { .. }), "{err:?}");
    nothing_pulled(dst.path());
}

/// A local template whose files are not its digest is never published.
#[tokio::test]
async fn corrupt_local_template_is_not_pushed() {
    let (remote, src) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let objects = Objects::local(remote.path()).unwrap();
    template(src.path(), "seed", 4096, 3);
    let local = store(src.path()).resolve("seed").unwrap();
    std::fs::write(local.kernel(), b"another kernel\n").unwrap();
    let err = objects.push_template(&local).await.unwrap_err();
    assert!(matches!(err, ObjectsError::DigestMismatch { .. }), "{err:?}");
    assert_eq!(std::fs::read_dir(remote.path()).unwrap().count(), 0);
}

/// Two hosts pushing one digest at once both succeed (conditional creates of the same bytes).
async fn concurrent_pushes(objects: &Objects) {
    let (a, b, dst) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let ma = template(a.path(), "twin", 256 << 10, 4);
    let mb = template(b.path(), "twin", 256 << 10, 4);
    assert_eq!(ma.digest, mb.digest);
    let (ta, tb) = (
        store(a.path()).resolve("twin").unwrap(),
        store(b.path()).resolve("twin").unwrap(),
    );
    let (ra, rb) = tokio::join!(objects.push_template(&ta), objects.push_template(&tb));
    assert_eq!(ra.unwrap().digest, rb.unwrap().digest);
    let pulled = objects.pull_template("twin", &store(dst.path())).await.unwrap();
    same_files(&ta.dir, &pulled.template.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_pushes_of_one_digest() {
    let remote = tempfile::tempdir().unwrap();
    concurrent_pushes(&Objects::local(remote.path()).unwrap()).await;
}

// ---- saved images ----

const IMAGE_FILES: [&str; 6] = [
    "state",
    "disk.qcow2",
    "held/layer-0.qcow2",
    "held/kernel",
    "held/initrd",
    "held/rootfs",
];

/// A saved image as `Images::save` lays it out (its machine on links in `held/`), with
/// `state_bytes` of varied memory and the rootfs `rootfs`.
fn image(data_dir: &Path, id: &str, state_bytes: usize, rootfs: &[u8]) -> Image {
    let root = DataDir::open(data_dir).unwrap().images();
    let dir = root.join(id);
    std::fs::create_dir_all(dir.join("held")).unwrap();
    let state: Vec<u8> = (0..state_bytes).map(|i| (i % 241) as u8).collect();
    for (file, content) in IMAGE_FILES
        .iter()
        .zip([&state[..], b"overlay", b"base layer", b"kernel", b"initrd", rootfs])
    {
        std::fs::write(dir.join(file), content).unwrap();
    }
    let manifest = ImageManifest {
        id: id.into(),
        source: "sb0123456789".into(),
        template: "seed".into(),
        template_digest: format!("sha256:{}", "a".repeat(64)),
        resources: Resources::default(),
        accel: Accel::Tcg,
        vmm: "fake".into(),
        machine: ResumeSpec {
            cmdline: "console=ttyS0".into(),
            memory_backend: true,
            layers: vec![dir.join("disk.qcow2"), dir.join("held/layer-0.qcow2")],
            kernel: dir.join("held/kernel"),
            initrd: dir.join("held/initrd"),
            rootfs: dir.join("held/rootfs"),
            volume_bus: true,
        },
        created_at: "2026-12-02T17:00:00Z".into(),
        state_bytes: state.len() as u64,
        disk_bytes: 7,
        save_ms: 3,
        digest: None,
    };
    std::fs::write(dir.join("image.json"), serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
    Image::find(&root, id).unwrap()
}

fn images_dir(dir: &Path) -> PathBuf {
    DataDir::open(dir).unwrap().images()
}

fn bytes_of(dir: &Path) -> u64 {
    IMAGE_FILES
        .iter()
        .map(|f| std::fs::metadata(dir.join(f)).unwrap().len())
        .sum()
}

async fn image_round_trip(objects: &Objects, state_bytes: usize) {
    let (src, dst, other) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let rootfs = vec![9u8; 256 << 10];
    let mut saved = image(src.path(), "snap_one", state_bytes, &rootfs);
    // As `Images::digest` records it after the save; the pull checks the files against it.
    saved.manifest.digest = Some(saved.content_digest().unwrap());
    std::fs::write(
        saved.dir.join("image.json"),
        serde_json::to_vec_pretty(&saved.manifest).unwrap(),
    )
    .unwrap();
    let size = bytes_of(&saved.dir);

    let t = Instant::now();
    let pushed = objects.push_image(&saved).await.unwrap();
    eprintln!("image push of {size} bytes: {:?}", t.elapsed());
    assert!(pushed.uploaded_bytes > size, "files and manifest uploaded");
    assert_eq!(
        objects.push_image(&saved).await.unwrap(),
        Pushed {
            uploaded_bytes: 0,
            ..pushed.clone()
        }
    );

    // Another image on the same rootfs: only what differs goes up.
    let sibling = image(src.path(), "snap_two", 1000, &rootfs);
    let second = objects.push_image(&sibling).await.unwrap();
    assert!(second.uploaded_bytes < rootfs.len() as u64, "{second:?}");

    let t = Instant::now();
    let pulled = objects
        .pull_image("snap_one", &DataDir::open(dst.path()).unwrap())
        .await
        .unwrap();
    eprintln!("image pull of {size} bytes: {:?}", t.elapsed());
    assert_eq!(pulled.fetched_bytes, size);
    let found = Image::find(&images_dir(dst.path()), "snap_one").expect("the pulled image loads");
    assert_eq!(found.dir, images_dir(dst.path()).join("snap_one"));
    for f in IMAGE_FILES {
        assert!(
            std::fs::read(saved.dir.join(f)).unwrap() == std::fs::read(found.dir.join(f)).unwrap(),
            "{f}"
        );
    }
    // The machine is this host's: every path inside the pulled dir.
    let m = &found.manifest.machine;
    for p in m.layers.iter().chain([&m.kernel, &m.initrd, &m.rootfs]) {
        assert!(p.starts_with(&found.dir) && p.exists(), "{}", p.display());
    }
    // The VMM's uid opens the template's files again by path (as a template's, 0644); the
    // guest's memory and disk stay the server's only.
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    for p in [&m.kernel, &m.initrd, &m.rootfs] {
        assert_eq!(mode(p), 0o644, "{}", p.display());
    }
    for p in [found.state(), found.disk()] {
        assert_eq!(mode(&p), 0o600, "{}", p.display());
    }
    assert_eq!(
        ImageManifest {
            machine: saved.manifest.machine.clone(),
            ..found.manifest.clone()
        },
        saved.manifest
    );
    let again = objects
        .pull_image("snap_one", &DataDir::open(dst.path()).unwrap())
        .await
        .unwrap();
    assert_eq!(again.fetched_bytes, 0);
    assert_eq!(
        DataDir::open(dst.path()).unwrap().cache().read_dir().unwrap().count(),
        0
    );

    let by_digest = objects
        .pull_image(&pushed.digest, &DataDir::open(other.path()).unwrap())
        .await
        .unwrap();
    assert_eq!(by_digest.image.manifest.id, "snap_one");
    let missing = objects
        .pull_image("snap_none", &DataDir::open(other.path()).unwrap())
        .await;
    assert!(matches!(missing, Err(ObjectsError::NotFound(_))), "{missing:?}");

    // Moved on: snap_one leaves the store (its memory, its pointer, its manifest). Its disk
    // holds the same bytes as snap_two's and stays, as do the template's files snap_two sits on.
    assert_eq!(objects.delete_image("snap_one").await.unwrap(), 3);
    assert_eq!(objects.delete_image("snap_one").await.unwrap(), 0, "gone already");
    let fresh = tempfile::tempdir().unwrap();
    let fresh = DataDir::open(fresh.path()).unwrap();
    for reference in ["snap_one", pushed.digest.as_str()] {
        let gone = objects.pull_image(reference, &fresh).await;
        assert!(matches!(gone, Err(ObjectsError::NotFound(_))), "{reference}: {gone:?}");
    }
    let kept = objects.pull_image("snap_two", &fresh).await.unwrap();
    assert_eq!(kept.image.manifest.id, "snap_two");
    assert_eq!(objects.delete_image("snap_two").await.unwrap(), 4);
    assert!(matches!(
        objects.delete_image("../x").await,
        Err(ObjectsError::BadReference(_))
    ));
}

#[tokio::test]
async fn image_local_dir_round_trip() {
    let remote = tempfile::tempdir().unwrap();
    image_round_trip(&Objects::local(remote.path()).unwrap(), 64 << 10).await;
}

/// A host that has the template an image sits on links its files rather than download them:
/// only the image's own (memory, disks) come down. One whose files do not make up the digest
/// the image names downloads them all.
#[tokio::test]
async fn an_image_pull_links_the_template_this_host_has() {
    use std::os::unix::fs::MetadataExt;
    let (remote, src, dst) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let objects = Objects::local(remote.path()).unwrap();
    let t = template(dst.path(), "seed", 512 << 10, 7);
    let blobs = DataDir::open(dst.path())
        .unwrap()
        .blobs()
        .join(t.digest.trim_start_matches("sha256:"));
    let on_template = |id: &str, digest: &str| {
        let mut saved = image(src.path(), id, 64 << 10, b"");
        for (held, file) in ["held/kernel", "held/initrd", "held/rootfs"].iter().zip(FILES) {
            std::fs::copy(blobs.join(file), saved.dir.join(held)).unwrap();
        }
        saved.manifest.template_digest = digest.to_string();
        std::fs::write(
            saved.dir.join("image.json"),
            serde_json::to_vec_pretty(&saved.manifest).unwrap(),
        )
        .unwrap();
        saved
    };
    let saved = on_template("snap_linked", &t.digest);
    let own: u64 = ["state", "disk.qcow2", "held/layer-0.qcow2"]
        .iter()
        .map(|f| std::fs::metadata(saved.dir.join(f)).unwrap().len())
        .sum();
    objects.push_image(&saved).await.unwrap();
    let pulled = objects
        .pull_image("snap_linked", &DataDir::open(dst.path()).unwrap())
        .await
        .unwrap();
    assert_eq!(pulled.fetched_bytes, own, "only the image's own files come down");
    let m = &pulled.image.manifest.machine;
    for (held, file) in [&m.kernel, &m.initrd, &m.rootfs].into_iter().zip(FILES) {
        let (a, b) = (
            std::fs::metadata(held).unwrap(),
            std::fs::metadata(blobs.join(file)).unwrap(),
        );
        assert_eq!(
            (a.dev(), a.ino()),
            (b.dev(), b.ino()),
            "{} is not the template's",
            held.display()
        );
    }

    // Named by another digest (its files are not that template's): all downloaded.
    let other = on_template("snap_unlinked", &format!("sha256:{}", "b".repeat(64)));
    objects.push_image(&other).await.unwrap();
    let pulled = objects
        .pull_image("snap_unlinked", &DataDir::open(dst.path()).unwrap())
        .await
        .unwrap();
    assert_eq!(pulled.fetched_bytes, bytes_of(&other.dir));
}

/// A changed file, a changed manifest, a forged one naming paths outside the dir: refused,
/// nothing left behind.
#[tokio::test]
async fn corrupt_image_is_refused() {
    let (remote, src, dst) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let objects = Objects::local(remote.path()).unwrap();
    let saved = image(src.path(), "snap_bad", 4096, b"rootfs");
    let pushed = objects.push_image(&saved).await.unwrap();
    let hex = pushed.digest.trim_start_matches("sha256:");
    let manifest_path = remote.path().join(format!("images/{hex}/manifest.json"));
    let original: PushedImage = serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    let data = DataDir::open(dst.path()).unwrap();
    let nothing = || {
        assert_eq!(images_dir(dst.path()).read_dir().unwrap().count(), 0);
        assert_eq!(data.cache().read_dir().unwrap().count(), 0);
    };

    let state = original.files.iter().find(|f| f.name == "state").unwrap();
    let blob = remote.path().join(format!("files/{}", state.sha256));
    let good = std::fs::read(&blob).unwrap();
    let mut bad = good.clone();
    bad[10] ^= 1;
    std::fs::write(&blob, &bad).unwrap();
    let err = objects.pull_image("snap_bad", &data).await.unwrap_err();
    assert!(
        matches!(&err, ObjectsError::DigestMismatch { what, .. } if what.starts_with("state")),
        "{err:?}"
    );
    nothing();
    std::fs::write(&blob, &good).unwrap();

    let mut changed = original.clone();
    changed.manifest.resources.memory_mib *= 2;
    std::fs::write(&manifest_path, serde_json::to_vec_pretty(&changed).unwrap()).unwrap();
    let err = objects.pull_image("snap_bad", &data).await.unwrap_err();
    assert!(matches!(err, ObjectsError::DigestMismatch { .. }), "{err:?}");
    nothing();

    // Manifests stored under their own digests: one naming a file outside the dir, one whose
    // content digest is not its files'.
    let forge = |pushed: &PushedImage| {
        let json = serde_json::to_vec_pretty(pushed).unwrap();
        let hex = hex::encode(Sha256::digest(&json));
        std::fs::create_dir_all(remote.path().join(format!("images/{hex}"))).unwrap();
        std::fs::write(remote.path().join(format!("images/{hex}/manifest.json")), &json).unwrap();
        format!("sha256:{hex}")
    };
    let mut escaping = original.clone();
    escaping.files[0].name = "../../escaped".into();
    let err = objects.pull_image(&forge(&escaping), &data).await.unwrap_err();
    assert!(matches!(err, ObjectsError::BadManifest { .. }), "{err:?}");
    nothing();
    let mut misdigested = original;
    misdigested.manifest.digest = Some(format!("sha256:{}", "0".repeat(64)));
    let err = objects.pull_image(&forge(&misdigested), &data).await.unwrap_err();
    assert!(
        matches!(&err, ObjectsError::DigestMismatch { what, .. } if what == "its content"),
        "{err:?}"
    );
    nothing();
}

/// An image on a file outside its dir cannot move; one whose id is taken here is not pulled
/// over it.
#[tokio::test]
async fn image_refusals() {
    let (remote, src, dst) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let objects = Objects::local(remote.path()).unwrap();
    let mut outside = image(src.path(), "snap_out", 100, b"rootfs");
    outside.manifest.machine.kernel = src.path().join("elsewhere");
    let err = objects.push_image(&outside).await.unwrap_err();
    assert!(matches!(err, ObjectsError::NotSelfContained { .. }), "{err:?}");

    let saved = image(src.path(), "snap_same", 100, b"rootfs");
    objects.push_image(&saved).await.unwrap();
    let here = image(dst.path(), "snap_same", 200, b"another rootfs");
    let err = objects
        .pull_image("snap_same", &DataDir::open(dst.path()).unwrap())
        .await
        .unwrap_err();
    assert!(matches!(err, ObjectsError::ImageIdTaken(_)), "{err:?}");
    assert_eq!(
        std::fs::read(here.state()).unwrap().len(),
        200,
        "the image here is kept"
    );
}

// ---- S3, as moto serves it ----

fn start_moto() -> Moto {
    let moto = Moto::start(Path::new(env!("CARGO_TARGET_TMPDIR")), [127, 0, 0, 1].into()).expect("moto");
    eprintln!("moto started in {:?}", moto.started_in);
    moto
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_round_trip() {
    let moto = start_moto();
    let objects = Objects::s3(&S3 {
        endpoint: Some(moto.endpoint.clone()),
        bucket: "airlock".into(),
        region: "us-east-1".into(),
        access_key_id: "test".into(),
        secret_access_key: "test".into(),
    })
    .unwrap();
    // Above one part: the rootfs goes up in three parts.
    let manifest = round_trip(&objects, 2 * PART_SIZE + (1 << 20)).await;

    // What the bucket holds, read beside the API: a multipart ETag ends in its part count, and
    // the store refuses a second create of an object (what lets two hosts push one digest).
    let raw = AmazonS3Builder::new()
        .with_endpoint(&moto.endpoint)
        .with_allow_http(true)
        .with_bucket_name("airlock")
        .with_region("us-east-1")
        .with_access_key_id("test")
        .with_secret_access_key("test")
        .build()
        .unwrap();
    let hex = manifest.digest.trim_start_matches("sha256:");
    let rootfs = raw.head(&format!("templates/{hex}/rootfs.ext4").into()).await.unwrap();
    assert!(
        rootfs.e_tag.as_deref().unwrap_or("").ends_with("-3\""),
        "{:?}",
        rootfs.e_tag
    );
    let create = PutOptions {
        mode: PutMode::Create,
        ..Default::default()
    };
    let again = raw
        .put_opts(
            &format!("templates/{hex}/manifest.json").into(),
            b"{}".to_vec().into(),
            create,
        )
        .await;
    assert!(
        matches!(again, Err(object_store::Error::AlreadyExists { .. })),
        "{again:?}"
    );

    concurrent_pushes(&objects).await;
    image_round_trip(&objects, PART_SIZE + 4096).await;
}
