//! Hostile OCI images through the real build path: each of testnet's hostile set (symlinks,
//! hard links and `..` aimed at a host directory) pushed over busybox to the test registry and
//! built `FROM`; the host directory is checked after each. Those the unpacker refuses are 422s
//! naming the layer; the others import harmlessly, and where the harm was aimed through the files
//! airlock adds, the image's `/usr/sbin/airlock-agent` is in a real directory of the image
//! (read from its ext4 with `debugfs`, never mounted). The builds themselves are cancelled: what
//! is tested happens before their VM starts.

use super::templates::{pulled_templates, wait_build};
use super::*;

pub(crate) fn a_hostile_image_leaves_the_host_untouched() {
    use airlock_testnet::hostile::{hostile_images, Outside};
    use airlock_testnet::registry::{busybox_image, Layer, Registry};
    let s = server();
    let registry = Registry::start().expect("the test registry");
    let base = busybox_image().expect("busybox layers");
    let dir = tempfile::Builder::new()
        .prefix("airlock-hostile-host-")
        .tempdir()
        .unwrap();
    let outside = Outside::make(&dir.path().join("host")).unwrap();
    // The `..` entry's aim, were it followed from the staging dir.
    let planted = Path::new("/tmp/planted-by-layer");
    let _ = std::fs::remove_file(planted);
    for (i, case) in hostile_images(&outside.dir).into_iter().enumerate() {
        let mut layers: Vec<Layer> = base.clone();
        layers.extend(case.layers.iter().map(|t| Layer {
            tar: t.clone(),
            gzip: i % 2 == 0,
        }));
        let repo = format!("hostile/case{i}:{}", std::process::id());
        registry.push(&repo, &layers, json!({ "config": {} })).expect("push");
        let from = format!("{}/{repo}", registry.host());
        let name = format!("api-hostile-{i}-{}", std::process::id());
        let (status, body) = s.call(
            "POST",
            "/v1/templates",
            Some(json!({ "name": name, "from": from, "steps": [{"type": "RUN", "args": ["true"]}] })),
        );
        let what = case.what;
        if case.refused {
            assert_eq!(
                (status, body["code"].as_str()),
                (422, Some("invalid_argument")),
                "{what}: {body}"
            );
            let message = body["message"].as_str().unwrap();
            assert!(
                message.contains(&from) && message.contains("could not be unpacked"),
                "{what}: {message}"
            );
        } else {
            assert_eq!(status, 202, "{what}: {body}");
            let id = body["id"].as_str().unwrap();
            if case.via_added_files {
                let pulled = pulled_templates(&s.data, &from);
                assert_eq!(pulled.len(), 1, "{what}: {pulled:?}");
                let listing = image_listing(&s.data, &pulled[0], "/usr/sbin");
                assert!(listing.contains("airlock-agent"), "{what}: /usr/sbin holds {listing}");
                let etc = image_listing(&s.data, &pulled[0], "/etc");
                assert!(etc.contains("passwd"), "{what}: /etc holds {etc}");
            }
            let (status, _) = s.call("DELETE", &format!("/v1/builds/{id}"), None);
            assert_eq!(status, 200, "{what}");
            assert_eq!(wait_build(s, id)["status"], "error", "{what}");
        }
        assert_eq!(outside.changed(), None, "{what}");
        assert!(!planted.exists(), "{what}: {} was written", planted.display());
        let (status, _) = s.call("DELETE", &format!("/v1/templates/{name}"), None);
        assert!(status == 204 || status == 404, "{what}: {status}");
    }
}

/// `debugfs`'s listing of `dir` in the root filesystem of template `name` of `data`'s store.
fn image_listing(data: &Path, name: &str, dir: &str) -> String {
    let manifest: Value = serde_json::from_slice(&std::fs::read(data.join("templates").join(name)).unwrap()).unwrap();
    let digest = manifest["digest"].as_str().unwrap().trim_start_matches("sha256:");
    let rootfs = data.join("blobs/sha256").join(digest).join("rootfs.ext4");
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(format!("ls -l {dir}"))
        .arg(&rootfs)
        .output()
        .expect("debugfs (e2fsprogs)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    // A symlink there would list as one entry of mode 120777.
    assert!(
        !text.contains("120777") || dir != "/usr/sbin",
        "{dir} is a symlink: {text}"
    );
    text
}
