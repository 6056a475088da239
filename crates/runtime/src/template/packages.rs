//! Packages past debootstrap: the apt step in the chroot; Python wheels fetched with pip and
//! single binaries out of npm packages (checked by digest, cached), unpacked into the guest.

use super::command::{install_file, run, run_logged};
use super::error::TemplateError;
use super::progress::Progress;
use super::recipes::{NpmBinary, Wheel};
use super::store::TemplateStore;
use crate::datadir::random_hex;
use crate::digest::sha256_file;
use crate::error::{Result, RuntimeError};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Install `packages` with apt inside the fresh debootstrap at `root`, from the mirror debootstrap
/// wrote into its sources. The host's resolver is lent to the chroot for this step only
/// (`customize_base` empties it again). Retried as debootstrap is.
pub(super) fn apt_install(root: &Path, packages: &[String], log: &Path, progress: &Progress) -> Result<()> {
    let resolv = root.join("etc/resolv.conf");
    std::fs::copy("/etc/resolv.conf", &resolv).map_err(|e| RuntimeError::io(&resolv, e))?;
    // Check-Valid-Until: a host that builds from a frozen snapshot of the archive has Release
    // files past their validity date (debootstrap does not check it either).
    // /proc mounted for the packages' scripts (the JDK's runs java), in a mount and pid
    // namespace of the step's own: the mount and every process end with it, even if the build
    // is killed.
    let mut proc_at = std::ffi::OsString::from("--mount-proc=");
    proc_at.push(root.join("proc"));
    let apt = |args: &[&str]| {
        let mut cmd = Command::new("unshare");
        cmd.args(["--fork", "--pid"])
            .arg(&proc_at)
            .arg("chroot")
            .arg(root)
            .args(["apt-get", "-q", "-y", "-o", "Acquire::Check-Valid-Until=false"])
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    };
    const ATTEMPTS: u32 = 3;
    let what = format!("apt: installing {}", packages.join(" "));
    let mut attempt = 1;
    loop {
        progress.status(&what, &what, &what);
        let mut installed = 0usize;
        let ran = run_logged(&mut apt(&["update"]), log, "apt-get update", progress, |_| {}).and_then(|()| {
            let mut install = apt(&["--no-install-recommends", "install"]);
            install.args(packages);
            run_logged(&mut install, log, "apt-get install", progress, |line| {
                if line.starts_with("Setting up ") {
                    installed += 1;
                    progress.status(&what, &format!("{what}: {installed} set up"), &what);
                }
            })
        });
        match ran {
            Ok(()) => return Ok(()),
            Err(e) if attempt == ATTEMPTS => return Err(e),
            Err(_) => {
                progress.warn(&format!(
                    "apt failed (attempt {attempt} of {ATTEMPTS}); trying again in 10 s"
                ));
                attempt += 1;
                std::thread::sleep(std::time::Duration::from_secs(10));
            }
        }
    }
}

impl TemplateStore {
    /// A wheel from the cache (by digest), else downloaded and checked against its digest. pip
    /// (in a venv of the cache's own: the host's Python may have none) fetches exactly that
    /// file: no dependencies, binary only, for the guest's Python and platform.
    pub(super) fn fetch_wheel(&self, wheel: &Wheel) -> Result<PathBuf> {
        let dir = self.data.cache().join("wheels").join(wheel.sha256);
        let path = dir.join(wheel.file_name());
        if path.exists() && sha256_file(&path)? == wheel.sha256 {
            return Ok(path);
        }
        let venv = self.data.cache().join("pip-venv");
        if !venv.join("bin/pip").exists() {
            let _ = std::fs::remove_dir_all(&venv);
            run(
                Command::new("python3").args(["-m", "venv"]).arg(&venv),
                "python3 -m venv (for pip)",
            )?;
        }
        let tmp = dir.join(format!(".download-{}", random_hex(4)));
        let res = (|| {
            std::fs::create_dir_all(&tmp).map_err(|e| RuntimeError::io(&tmp, e))?;
            run(
                Command::new(venv.join("bin/pip"))
                    .args(["download", "--quiet", "--no-deps", "--only-binary=:all:"])
                    .args(["--platform", "manylinux2014_x86_64", "--python-version", "3.11"])
                    .args(["--implementation", "cp", "--abi", "cp311", "--dest"])
                    .arg(&tmp)
                    .arg(wheel.requirement()),
                &format!("downloading {}", wheel.file_name()),
            )?;
            let got_path = tmp.join(wheel.file_name());
            let got = sha256_file(&got_path)?;
            if got != wheel.sha256 {
                return Err(TemplateError::DigestMismatch {
                    file: wheel.file_name().to_string(),
                    got,
                    expected: wheel.sha256.to_string(),
                }
                .into());
            }
            std::fs::rename(&got_path, &path).map_err(|e| RuntimeError::io(&path, e))
        })();
        let _ = std::fs::remove_dir_all(&tmp);
        res.map(|_| path)
    }
}

/// Unpack wheels into the guest's site directory for locally installed packages (what pip
/// would do for these: no scripts, no `.data`), then compile them, with the guest's own Python.
pub(super) fn install_wheels(rootfs: &Path, wheels: &[PathBuf]) -> Result<()> {
    const STAGE: &str = "tmp/airlock-wheels";
    let stage = rootfs.join(STAGE);
    std::fs::create_dir_all(&stage).map_err(|e| RuntimeError::io(&stage, e))?;
    let res = (|| {
        let mut inside = Vec::new();
        for w in wheels {
            let name = w.file_name().expect("a wheel has a file name");
            install_file(w, &stage.join(name), 0o644)?;
            inside.push(Path::new("/").join(STAGE).join(name));
        }
        const UNPACK: &str = r#"
import sys, sysconfig, zipfile
site = sysconfig.get_path("purelib")
for wheel in sys.argv[1:]:
    with zipfile.ZipFile(wheel) as z:
        if any(n.split("/")[0].endswith(".data") for n in z.namelist()):
            sys.exit(wheel + ": wheels with .data are not supported")
        z.extractall(site)
print(site)
"#;
        let out = Command::new("chroot")
            .arg(rootfs)
            .args(["python3", "-c", UNPACK])
            .args(&inside)
            .output()
            .map_err(|e| TemplateError::spawn("unpacking wheels", e))?;
        if !out.status.success() {
            return Err(TemplateError::Failed {
                what: "unpacking wheels".into(),
                status: out.status,
                tail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
                log: None,
            }
            .into());
        }
        let site = String::from_utf8_lossy(&out.stdout).trim().to_string();
        run(
            Command::new("chroot")
                .arg(rootfs)
                .args(["python3", "-m", "compileall", "-q", "-j", "0", &site]),
            "compiling wheels",
        )
    })();
    let _ = std::fs::remove_dir_all(&stage);
    res
}

impl TemplateStore {
    /// An npm package's tarball from the cache (by integrity), else fetched with `npm pack` and
    /// checked against the integrity the recipe pins. npm runs nothing of the package.
    pub(super) fn fetch_npm(&self, b: &NpmBinary) -> Result<PathBuf> {
        let key = &crate::digest::sha256_hex(b.integrity.as_bytes())[..16];
        let dir = self.data.cache().join("npm").join(key);
        let path = dir.join("package.tgz");
        if path.exists() && npm_integrity(&path)? == b.integrity {
            return Ok(path);
        }
        let tmp = dir.join(format!(".download-{}", random_hex(4)));
        let res = (|| {
            std::fs::create_dir_all(&tmp).map_err(|e| RuntimeError::io(&tmp, e))?;
            run(
                Command::new("npm")
                    .args(["pack", "--silent", "--ignore-scripts", "--pack-destination"])
                    .arg(&tmp)
                    .arg(b.spec())
                    .current_dir(&tmp),
                &format!("npm pack {}", b.spec()),
            )?;
            let got_path = std::fs::read_dir(&tmp)
                .map_err(|e| RuntimeError::io(&tmp, e))?
                .flatten()
                .map(|e| e.path())
                .find(|p| p.extension().is_some_and(|x| x == "tgz"))
                .ok_or_else(|| TemplateError::NoTarball { package: b.spec() })?;
            let got = npm_integrity(&got_path)?;
            if got != b.integrity {
                return Err(TemplateError::IntegrityMismatch {
                    package: b.spec(),
                    got,
                    expected: b.integrity.to_string(),
                }
                .into());
            }
            std::fs::rename(&got_path, &path).map_err(|e| RuntimeError::io(&path, e))
        })();
        let _ = std::fs::remove_dir_all(&tmp);
        res.map(|_| path)
    }
}

/// A file's integrity as the npm registry states it: `sha512-<base64>`.
fn npm_integrity(path: &Path) -> Result<String> {
    use base64::Engine;
    use sha2::{Digest, Sha512};
    let mut f = std::fs::File::open(path).map_err(|e| RuntimeError::io(path, e))?;
    let mut h = Sha512::new();
    std::io::copy(&mut f, &mut h).map_err(|e| RuntimeError::io(path, e))?;
    Ok(format!(
        "sha512-{}",
        base64::engine::general_purpose::STANDARD.encode(h.finalize())
    ))
}

/// Put `b.entry` of the package's `tarball` at `b.dest` in `rootfs`, executable.
pub(super) fn install_npm_binary(tarball: &Path, b: &NpmBinary, rootfs: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let f = std::fs::File::open(tarball).map_err(|e| RuntimeError::io(tarball, e))?;
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(f));
    let dest = rootfs.join(b.dest);
    let entries = archive.entries().map_err(|e| RuntimeError::io(tarball, e))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| RuntimeError::io(tarball, e))?;
        let is_it = entry.path().is_ok_and(|p| p == Path::new(b.entry));
        if !is_it || !entry.header().entry_type().is_file() {
            continue;
        }
        let parent = dest.parent().expect("a destination in the rootfs");
        std::fs::create_dir_all(parent).map_err(|e| RuntimeError::io(parent, e))?;
        let mut out = std::fs::File::create(&dest).map_err(|e| RuntimeError::io(&dest, e))?;
        std::io::copy(&mut entry, &mut out).map_err(|e| RuntimeError::io(&dest, e))?;
        std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| RuntimeError::io(&dest, e))?;
        return Ok(());
    }
    Err(TemplateError::NpmEntryMissing {
        package: b.spec(),
        entry: b.entry.to_string(),
    }
    .into())
}
