//! The guest kernel: the cloud kernel package fetched with `apt-get download` and unpacked once
//! per version, and the modules the initramfs loads, in dependency order.

use super::command::run;
use super::error::TemplateError;
use super::recipes::KERNEL_META_PACKAGE;
use super::store::TemplateStore;
use crate::datadir::random_hex;
use crate::error::{Result, RuntimeError};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

impl TemplateStore {
    pub(super) fn fetch_kernel(&self, package: &str) -> Result<PathBuf> {
        let dir = self.data.cache().join("kernel").join(package.replace('=', "_"));
        if dir.join("boot").is_dir() {
            return Ok(dir);
        }
        let dl = self.data.cache().join(format!("kernel-dl-{}", random_hex(4)));
        std::fs::create_dir_all(&dl).map_err(|e| RuntimeError::io(&dl, e))?;
        let res = (|| {
            run(
                Command::new("apt-get").arg("download").arg(package).current_dir(&dl),
                "apt-get download",
            )?;
            let deb = std::fs::read_dir(&dl)
                .map_err(|e| RuntimeError::io(&dl, e))?
                .flatten()
                .map(|e| e.path())
                .find(|p| p.extension().is_some_and(|x| x == "deb"))
                .ok_or_else(|| TemplateError::NoDeb {
                    package: package.to_string(),
                })?;
            let unpack = dl.join("x");
            run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpack), "dpkg-deb -x")?;
            std::fs::create_dir_all(dir.parent().expect("has parent")).map_err(|e| RuntimeError::io(&dir, e))?;
            std::fs::rename(&unpack, &dir).map_err(|e| RuntimeError::io(&dir, e))
        })();
        let _ = std::fs::remove_dir_all(&dl);
        res.map(|_| dir)
    }
}

/// The concrete kernel package behind the cloud meta-package, as `name=version`.
pub(super) fn resolve_kernel_package() -> Result<String> {
    let out = Command::new("apt-cache")
        .args(["depends", KERNEL_META_PACKAGE])
        .output()
        .map_err(|e| TemplateError::spawn("apt-cache", e))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let name = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Depends: "))
        .map(str::trim)
        .filter(|n| n.starts_with("linux-image-"))
        .ok_or(TemplateError::NoKernelPackage {
            meta_package: KERNEL_META_PACKAGE,
        })?;
    let policy = Command::new("apt-cache")
        .args(["policy", name])
        .output()
        .map_err(|e| RuntimeError::io("apt-cache", e))?;
    let version = String::from_utf8_lossy(&policy.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Candidate: ").map(str::to_string))
        .filter(|v| v != "(none)")
        .ok_or_else(|| TemplateError::NoKernelVersion {
            package: name.to_string(),
        })?;
    Ok(format!("{name}={version}"))
}

pub(super) fn kernel_version_of(kernel_dir: &Path) -> Result<String> {
    let modules = kernel_dir.join("lib/modules");
    std::fs::read_dir(&modules)
        .map_err(|e| RuntimeError::io(&modules, e))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .next()
        .ok_or_else(|| TemplateError::NoKernelModules(modules.clone()).into())
}

/// Module files for `wanted` and their dependencies, in load order (dependencies first).
pub fn resolve_modules(modules_root: &Path, wanted: &[String]) -> Result<Vec<PathBuf>> {
    let mut by_name: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut stack = vec![modules_root.join("kernel")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir)
            .map_err(|e| RuntimeError::io(&dir, e))?
            .flatten()
        {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Some(stem) = p
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".ko"))
            {
                by_name.insert(stem.replace('-', "_"), p);
            }
        }
    }
    let builtin = std::fs::read_to_string(modules_root.join("modules.builtin")).unwrap_or_default();
    let builtin: BTreeSet<String> = builtin
        .lines()
        .filter_map(|l| l.rsplit('/').next()?.strip_suffix(".ko").map(|n| n.replace('-', "_")))
        .collect();
    let deps_of = |name: &str| -> Result<Vec<String>> {
        let path = &by_name[name];
        let bytes = std::fs::read(path).map_err(|e| RuntimeError::io(path, e))?;
        Ok(module_depends(&bytes))
    };
    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    fn visit(
        name: &str,
        by_name: &BTreeMap<String, PathBuf>,
        builtin: &BTreeSet<String>,
        deps_of: &dyn Fn(&str) -> Result<Vec<String>>,
        seen: &mut BTreeSet<String>,
        order: &mut Vec<PathBuf>,
    ) -> Result<()> {
        let name = name.replace('-', "_");
        if builtin.contains(&name) || !seen.insert(name.clone()) {
            return Ok(());
        }
        if !by_name.contains_key(&name) {
            return Err(TemplateError::ModuleMissing(name).into());
        }
        for d in deps_of(&name)? {
            visit(&d, by_name, builtin, deps_of, seen, order)?;
        }
        order.push(by_name[&name].clone());
        Ok(())
    }
    for w in wanted {
        visit(w, &by_name, &builtin, &deps_of, &mut seen, &mut order)?;
    }
    Ok(order)
}

/// The `depends=` entry of a module's `.modinfo` section.
pub fn module_depends(ko: &[u8]) -> Vec<String> {
    let key = b"depends=";
    let Some(pos) = ko.windows(key.len()).position(|w| w == key) else {
        return Vec::new();
    };
    let rest = &ko[pos + key.len()..];
    let end = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
    String::from_utf8_lossy(&rest[..end])
        .split(',')
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_module_depends() {
        let ko = b"\x7fELF....\0license=GPL\0depends=virtio,virtio_ring\0retpoline=Y\0";
        assert_eq!(module_depends(ko), vec!["virtio", "virtio_ring"]);
        assert!(module_depends(b"\0depends=\0").is_empty());
    }

    #[test]
    fn orders_modules_dependencies_first() {
        let d = tempfile::tempdir().unwrap();
        let k = d.path().join("kernel/drivers");
        std::fs::create_dir_all(&k).unwrap();
        std::fs::write(k.join("virtio_ring.ko"), b"\0depends=\0").unwrap();
        std::fs::write(k.join("virtio.ko"), b"\0depends=virtio_ring\0").unwrap();
        std::fs::write(k.join("virtio_blk.ko"), b"\0depends=virtio,virtio_ring\0").unwrap();
        std::fs::write(k.join("virtio-rng.ko"), b"\0depends=virtio,virtio_ring,ext4\0").unwrap();
        std::fs::write(d.path().join("modules.builtin"), "kernel/fs/ext4/ext4.ko\n").unwrap();
        let order = resolve_modules(d.path(), &["virtio_blk".into(), "virtio_rng".into()]).unwrap();
        let names: Vec<_> = order
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().to_string())
            .collect();
        assert_eq!(
            names,
            vec!["virtio_ring.ko", "virtio.ko", "virtio_blk.ko", "virtio-rng.ko"]
        );
        assert!(resolve_modules(d.path(), &["nope".into()]).is_err());
    }
}
