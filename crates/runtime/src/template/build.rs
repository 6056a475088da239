//! A template build: the recipe resolved from the host (agent, mirror, kernel package), then the
//! cached layers (kernel, debootstrap base, wheels) and the assembly of the images, committed to
//! the store. Uses every builder module of `template/` and the store.

use super::command::{dir_bytes, install_file, run};
use super::debootstrap::host_mirror;
use super::error::TemplateError;
use super::initramfs::{build_initramfs, check_static, locate_agent};
use super::kernel::{kernel_version_of, resolve_kernel_package, resolve_modules};
use super::packages::{install_npm_binary, install_wheels};
use super::progress::Progress;
use super::recipes::{definition, SeedRecipe, TemplateDef, BUILDER_VERSION, GUEST_MODULES, SEED};
use super::store::{short, Template, TemplateManifest, TemplateStore, INITRD_FILE, KERNEL_FILE, ROOTFS_FILE};
use crate::datadir::{random_hex, FileLock};
use crate::digest::sha256_file;
use crate::error::{Result, RuntimeError};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

#[derive(Debug, Clone, Default)]
pub struct BuildOptions {
    /// Debian mirror; default: the one in the host's apt sources.
    pub mirror: Option<String>,
    /// Statically linked guest agent; default: found next to the airlock binary.
    pub agent: Option<PathBuf>,
    /// Draw a progress display on the terminal.
    pub progress: bool,
    /// Rebuild even when the recipe is unchanged.
    pub force: bool,
}

impl TemplateStore {
    /// Build `seed` unless its recipe is unchanged. Returns the template and whether it was built.
    pub fn build_seed(&self, opts: &BuildOptions) -> Result<(Template, bool)> {
        self.build(SEED, opts)
    }

    /// Build a template from its definition unless its recipe is unchanged.
    pub fn build(&self, name: &str, opts: &BuildOptions) -> Result<(Template, bool)> {
        let def = definition(name).ok_or_else(|| TemplateError::NoRecipe { name: name.to_string() })?;
        let progress = Progress::new(opts.progress);
        let _lock = FileLock::acquire(&self.data.templates().join(".build.lock"))?;

        progress.step("resolving the recipe");
        let agent = match &opts.agent {
            Some(p) => p.clone(),
            None => locate_agent()?,
        };
        check_static(&agent)?;
        let mirror = match &opts.mirror {
            Some(m) => m.clone(),
            None => host_mirror()?,
        };
        let kernel_package = resolve_kernel_package()?;
        let mut files = Sha256::new();
        for (path, content, mode) in &def.files {
            files.update(format!("{path}:{mode:o}:").as_bytes());
            files.update(content.as_bytes());
        }
        let recipe = SeedRecipe {
            name: name.to_string(),
            suite: "bookworm".into(),
            variant: "minbase".into(),
            packages: def.packages.iter().map(|s| s.to_string()).collect(),
            mirror,
            kernel_package,
            modules: GUEST_MODULES.iter().map(|s| s.to_string()).collect(),
            agent_sha256: sha256_file(&agent)?,
            files_sha256: if def.files.is_empty() {
                String::new()
            } else {
                hex::encode(files.finalize())
            },
            wheels: def
                .wheels
                .iter()
                .map(|w| format!("{} sha256:{}", w.file_name(), w.sha256))
                .collect(),
            apt: def.apt.iter().map(|s| s.to_string()).collect(),
            npm: def
                .npm
                .iter()
                .map(|b| format!("{} {}", b.spec(), b.integrity))
                .collect(),
            start: def.start.clone(),
            memory_mib: def.memory_mib,
            builder_version: BUILDER_VERSION,
        };
        let recipe_digest = recipe.digest();
        if !opts.force {
            if let Some(t) = self.load(name).filter(|t| t.manifest.recipe_digest == recipe_digest) {
                progress.finish(&format!("{name} is up to date ({})", short(&t.manifest.digest)));
                return Ok((t, false));
            }
        }

        progress.step(&format!("fetching kernel package {}", recipe.kernel_package));
        let kernel_dir = self.fetch_kernel(&recipe.kernel_package)?;
        let kernel_version = kernel_version_of(&kernel_dir)?;

        progress.step("debootstrap base (cached by recipe)");
        let base = self.debootstrap_base(&recipe, &progress)?;

        let mut wheels = Vec::new();
        for w in def.wheels {
            progress.step(&format!("fetching {}", w.file_name()));
            wheels.push(self.fetch_wheel(w)?);
        }

        let mut npm = Vec::new();
        for b in def.npm {
            progress.step(&format!("fetching {} from npm", b.spec()));
            npm.push(self.fetch_npm(b)?);
        }

        let work = self.data.cache().join(format!("assemble-{}", random_hex(6)));
        let result = self.assemble(
            &def,
            &recipe,
            &recipe_digest,
            &agent,
            &kernel_dir,
            &kernel_version,
            &base,
            &wheels,
            &npm,
            &work,
            &progress,
        );
        let _ = std::fs::remove_dir_all(&work);
        let t = result?;
        progress.finish(&format!(
            "built {name} {} ({} MiB, kernel {})",
            short(&t.manifest.digest),
            t.manifest.size_bytes >> 20,
            t.manifest.kernel_version
        ));
        Ok((t, true))
    }

    // Each argument is one layer the build already made; a struct would only name them again.
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        &self,
        def: &TemplateDef,
        recipe: &SeedRecipe,
        recipe_digest: &str,
        agent: &Path,
        kernel_dir: &Path,
        kernel_version: &str,
        base: &Path,
        wheels: &[PathBuf],
        npm: &[PathBuf],
        work: &Path,
        progress: &Progress,
    ) -> Result<Template> {
        progress.step("assembling the root filesystem");
        let out = work.join("out");
        let rootfs = work.join("rootfs");
        std::fs::create_dir_all(&out).map_err(|e| RuntimeError::io(&out, e))?;
        run(Command::new("cp").arg("-a").arg(base).arg(&rootfs), "cp -a base")?;
        let _ = std::fs::remove_file(rootfs.join(".complete"));
        install_file(agent, &rootfs.join("usr/sbin/airlock-agent"), 0o755)?;
        for (path, content, mode) in &def.files {
            use std::os::unix::fs::PermissionsExt;
            let dst = rootfs.join(path);
            std::fs::create_dir_all(dst.parent().expect("has parent")).map_err(|e| RuntimeError::io(&dst, e))?;
            std::fs::write(&dst, content).map_err(|e| RuntimeError::io(&dst, e))?;
            std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(*mode))
                .map_err(|e| RuntimeError::io(&dst, e))?;
        }
        if !wheels.is_empty() {
            progress.step("unpacking Python wheels");
            install_wheels(&rootfs, wheels)?;
        }
        for (b, tarball) in def.npm.iter().zip(npm) {
            progress.step(&format!("unpacking {} from {}", b.dest, b.spec()));
            install_npm_binary(tarball, b, &rootfs)?;
        }
        std::fs::write(
            rootfs.join("etc/airlock-template"),
            format!("{} {recipe_digest}\n", recipe.name),
        )
        .map_err(|e| RuntimeError::io(&rootfs, e))?;

        progress.step("writing the ext4 image");
        let used = dir_bytes(&rootfs)?;
        // Headroom for ext4 metadata and a little free space; sandboxes grow it to disk_mib.
        let image_mib = ((used * 13 / 10) >> 20) + 64;
        let image = out.join(ROOTFS_FILE);
        run(
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-L", "airlock-root", "-m", "0", "-b", "4096", "-d"])
                .arg(&rootfs)
                .arg(&image)
                .arg(format!("{image_mib}M")),
            "mkfs.ext4",
        )?;

        progress.step("building the initramfs");
        let modules_root = kernel_dir.join("lib/modules").join(kernel_version);
        let modules = resolve_modules(&modules_root, &recipe.modules)?;
        build_initramfs(agent, &modules, &work.join("initramfs"), &out.join(INITRD_FILE))?;
        let vmlinuz = kernel_dir.join("boot").join(format!("vmlinuz-{kernel_version}"));
        install_file(&vmlinuz, &out.join(KERNEL_FILE), 0o644)?;

        progress.step("computing the digest");
        let (t, old) = self.commit(&out, |digest, size_bytes, rootfs_bytes| TemplateManifest {
            name: recipe.name.clone(),
            digest,
            kernel_version: kernel_version.into(),
            built_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            size_bytes,
            rootfs_bytes,
            recipe_digest: recipe_digest.into(),
            recipe: recipe.clone(),
            start: def.start.clone(),
            built: None,
        })?;
        if let Some(old) = old {
            progress.log(&format!(
                "{} replaced {} -> {}",
                recipe.name,
                short(&old.manifest.digest),
                short(&t.manifest.digest)
            ));
        }
        Ok(t)
    }
}
