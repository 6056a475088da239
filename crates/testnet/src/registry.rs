//! A container registry for tests: Debian's `docker-registry` (distribution 2.8) on a free
//! loopback port, storing in a temp dir, stopped by its PID on drop. [`busybox_image`] makes a
//! small two-layer image from the host's `busybox-static` (the second layer deletes a file of the
//! first through a whiteout, empties a directory through an opaque whiteout and adds a file);
//! [`Registry::push`] pushes layers with `oci-client`, as any registry client would.

use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::manifest::{
    OciImageManifest, IMAGE_CONFIG_MEDIA_TYPE, IMAGE_LAYER_GZIP_MEDIA_TYPE, IMAGE_LAYER_MEDIA_TYPE,
};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use sha2::{Digest, Sha256};
use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = "/usr/bin/docker-registry";
const BUSYBOX: &str = "/bin/busybox";

pub struct Registry {
    child: Child,
    pub addr: SocketAddr,
    /// The account it asks for, if any (`start_with_account`).
    account: Option<(String, String)>,
    _dir: tempfile::TempDir,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One layer to push: its tar, gzipped or not.
#[derive(Clone)]
pub struct Layer {
    pub tar: Vec<u8>,
    pub gzip: bool,
}

impl Registry {
    pub fn start() -> io::Result<Registry> {
        Self::start_inner(None)
    }

    /// A registry that answers only `user` with `password` (htpasswd, bcrypt by `htpasswd`
    /// of apache2-utils), for reads and pushes alike.
    pub fn start_with_account(user: &str, password: &str) -> io::Result<Registry> {
        Self::start_inner(Some((user.to_string(), password.to_string())))
    }

    fn start_inner(account: Option<(String, String)>) -> io::Result<Registry> {
        if !std::path::Path::new(BIN).exists() {
            return Err(io::Error::other(format!(
                "{BIN} not found: scripts/install-host-deps installs docker-registry"
            )));
        }
        let dir = tempfile::tempdir()?;
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            l.local_addr()?.port()
        };
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("address");
        let config = dir.path().join("config.yml");
        let mut yaml = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
            dir.path().join("data").display()
        );
        if let Some((user, password)) = &account {
            let out = Command::new("htpasswd")
                .args(["-Bbn", user, password])
                .output()
                .map_err(|e| {
                    io::Error::other(format!(
                        "htpasswd: {e}; scripts/install-host-deps installs apache2-utils"
                    ))
                })?;
            let file = dir.path().join("htpasswd");
            std::fs::write(&file, &out.stdout)?;
            yaml.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: test\n    path: {}\n",
                file.display()
            ));
        }
        std::fs::write(&config, yaml)?;
        let child = Command::new(BIN)
            .arg("serve")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("registry.log"))?)
            .spawn()?;
        let registry = Registry {
            child,
            addr,
            account,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if Instant::now() > deadline {
                return Err(io::Error::other("docker-registry did not listen within 20 s"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(registry)
    }

    /// `127.0.0.1:<port>`: what an image reference names it by.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// Push `layers` with `config` (an image config: `Env`, `WorkingDir`...; its `rootfs` is
    /// filled in) as `<host>/<repo_tag>`; returns the manifest's digest.
    pub fn push(&self, repo_tag: &str, layers: &[Layer], config: serde_json::Value) -> io::Result<String> {
        let reference: Reference = format!("{}/{repo_tag}", self.host())
            .parse()
            .map_err(|e| io::Error::other(format!("{e}")))?;
        let mut config = config;
        config["architecture"] = "amd64".into();
        config["os"] = "linux".into();
        config["rootfs"] = serde_json::json!({
            "type": "layers",
            "diff_ids": layers.iter().map(|l| format!("sha256:{}", hex(&Sha256::digest(&l.tar)))).collect::<Vec<_>>(),
        });
        let mut pushed = Vec::new();
        for l in layers {
            let (data, media) = match l.gzip {
                true => {
                    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                    gz.write_all(&l.tar)?;
                    (gz.finish()?, IMAGE_LAYER_GZIP_MEDIA_TYPE)
                }
                false => (l.tar.clone(), IMAGE_LAYER_MEDIA_TYPE),
            };
            pushed.push(ImageLayer::new(data, media.to_string(), None));
        }
        let config = Config::new(
            serde_json::to_vec(&config).expect("json"),
            IMAGE_CONFIG_MEDIA_TYPE.to_string(),
            None,
        );
        let manifest = OciImageManifest::build(&pushed, &config, None);
        let auth = match &self.account {
            Some((user, password)) => RegistryAuth::Basic(user.clone(), password.clone()),
            None => RegistryAuth::Anonymous,
        };
        // Its own thread and runtime: callers may be inside one.
        std::thread::scope(|s| {
            s.spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                rt.block_on(async {
                    // reqwest builds its TLS even for plain HTTP: it needs a provider.
                    let _ = rustls::crypto::ring::default_provider().install_default();
                    let client = Client::new(ClientConfig {
                        protocol: ClientProtocol::Http,
                        ..Default::default()
                    });
                    let r = client
                        .push(&reference, &pushed, config, &auth, Some(manifest))
                        .await
                        .map_err(|e| io::Error::other(format!("push {reference}: {e}")))?;
                    let digest = r
                        .manifest_url
                        .rsplit('/')
                        .next()
                        .filter(|d| d.starts_with("sha256:"))
                        .map(String::from);
                    match digest {
                        Some(d) => Ok(d),
                        None => client
                            .fetch_manifest_digest(&reference, &auth)
                            .await
                            .map_err(|e| io::Error::other(format!("digest of {reference}: {e}"))),
                    }
                })
            })
            .join()
            .map_err(|_| io::Error::other("the push thread panicked"))?
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A tar of `entries`: `(path, Some(content))` a file, `(path, None)` a directory; `links`:
/// `(path, target)` symlinks. Owned by root, files 0644 (0755 with `exec`).
pub fn tar_layer(entries: &[(&str, Option<&[u8]>)], links: &[(&str, &str)], exec: &[&str]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let header = |kind: tar::EntryType, size: u64, mode: u32| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h
    };
    for (path, data) in entries {
        match data {
            Some(d) => {
                let mode = if exec.contains(path) { 0o755 } else { 0o644 };
                let mut h = header(tar::EntryType::Regular, d.len() as u64, mode);
                b.append_data(&mut h, path, *d).expect("tar");
            }
            None => {
                let mut h = header(tar::EntryType::Directory, 0, 0o755);
                b.append_data(&mut h, path, &[][..]).expect("tar");
            }
        }
    }
    for (path, target) in links {
        let mut h = header(tar::EntryType::Symlink, 0, 0o777);
        b.append_link(&mut h, path, target).expect("tar");
    }
    b.into_inner().expect("tar")
}

/// The layers of a small image: busybox (every applet a symlink in `/bin`), `/etc/passwd` and
/// marker files; then a layer that removes `/etc/removed-by-layer-2`, empties `/opt/emptied` and
/// adds `/etc/added-by-layer-2`.
pub fn busybox_image() -> io::Result<Vec<Layer>> {
    let busybox = std::fs::read(BUSYBOX).map_err(|e| {
        io::Error::other(format!(
            "{BUSYBOX}: {e}; scripts/install-host-deps installs busybox-static"
        ))
    })?;
    let out = Command::new(BUSYBOX).arg("--list").output()?;
    let applets: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|a| !a.is_empty() && *a != "busybox")
        .map(|a| format!("bin/{a}"))
        .collect();
    let links: Vec<(&str, &str)> = applets.iter().map(|a| (a.as_str(), "busybox")).collect();
    let one = tar_layer(
        &[
            ("bin/", None),
            ("bin/busybox", Some(&busybox)),
            ("etc/", None),
            ("etc/passwd", Some(b"root:x:0:0:root:/root:/bin/sh\n")),
            ("etc/group", Some(b"root:x:0:\n")),
            ("etc/removed-by-layer-2", Some(b"1\n")),
            ("opt/", None),
            ("opt/emptied/", None),
            ("opt/emptied/old", Some(b"1\n")),
            ("root/", None),
            ("tmp/", None),
        ],
        &links,
        &["bin/busybox"],
    );
    let two = tar_layer(
        &[
            ("etc/.wh.removed-by-layer-2", Some(b"")),
            ("opt/emptied/.wh..wh..opq", Some(b"")),
            ("etc/added-by-layer-2", Some(b"2\n")),
        ],
        &[],
        &[],
    );
    Ok(vec![Layer { tar: one, gzip: true }, Layer { tar: two, gzip: false }])
}
