//! Templates: a kernel, an initramfs and an ext4 root filesystem, stored by content digest.
//!
//! `seed` is built here from Debian packages in layers, so a change costs what it should:
//! - the kernel package is fetched with `apt-get download` and unpacked once per version;
//! - the debootstrap base (tens of seconds) is cached by its recipe;
//! - the agent + image assembly (`mkfs.ext4 -d`, about a second) is redone when the agent changes.
//!
//! A rebuild happens only when the recipe digest changes.

use crate::datadir::{random_hex, write_atomic, DataDir, FileLock};
use crate::error::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Instant, SystemTime};

pub const SEED: &str = "seed";
/// `seed` plus what code written for E2B's `base` assumes: git, curl, a `python` command, pip and
/// venv, node and npm. `seed` itself stays minimal.
pub const BASE: &str = "base";
const BASE_EXTRA_PACKAGES: &[&str] = &[
    "git",
    "curl",
    "python-is-python3",
    "python3-pip",
    "python3-venv",
    "nodejs",
];
/// Installed by apt in the chroot after debootstrap: npm's ~350 node-* dependencies (with
/// alternatives and virtual packages) leave dpkg with unconfigured packages under
/// `debootstrap --include`.
const BASE_APT_PACKAGES: &[&str] = &["npm"];
/// `seed` + Jupyter (ipykernel, jupyter_client), pandas, matplotlib, E2B's chart extraction
/// (`e2b-charts`) and a bash kernel, with airlock's code interpreter on port 49999: E2B's API
/// over a kernel per context (E2B's `code-interpreter-v1`).
pub const CODE_INTERPRETER: &str = "code-interpreter-v1";
/// Port the code interpreter listens on inside the sandbox (E2B's Jupyter port).
pub const CODE_INTERPRETER_PORT: u16 = 49999;
const CODE_INTERPRETER_PY: &str = include_str!("../guest/code_interpreter.py");
const CODE_INTERPRETER_PATH: &str = "usr/lib/airlock/code_interpreter.py";
/// Run by every Python kernel at start (the server finds it next to itself).
const IPYTHON_STARTUP_PY: &str = include_str!("../guest/ipython_startup.py");
const IPYTHON_STARTUP_PATH: &str = "usr/lib/airlock/ipython_startup.py";
/// The bash kernel's kernelspec (what `python3 -m bash_kernel.install` would write).
const BASH_KERNEL_JSON: &str = r#"{"argv": ["/usr/bin/python3", "-m", "bash_kernel", "-f", "{connection_file}"], "display_name": "Bash", "language": "bash", "env": {"PS1": "$"}}
"#;
const BASH_KERNEL_PATH: &str = "usr/local/share/jupyter/kernels/bash/kernel.json";
const CODE_INTERPRETER_PACKAGES: &[&str] = &[
    "python3-ipykernel",
    "python3-jupyter-client",
    "python3-pandas",
    "python3-numpy",
    "python3-matplotlib",
    "python3-pexpect",
    // Providers of virtual packages the ones above depend on, which debootstrap does not
    // resolve by itself (python3-cffi-backend-api-*, libboost-regex1.74.0-icu72).
    "python3-cffi-backend",
    "libboost-regex1.74.0",
];
/// What Debian lacks, from PyPI: `e2b-charts` (which needs pydantic 2; bookworm has 1.10) and
/// `bash_kernel`. Pinned by digest; unpacked into the guest's site directory.
const CODE_INTERPRETER_WHEELS: &[Wheel] = &[
    Wheel {
        file: "e2b_charts-1.0.0-py3-none-any.whl",
        sha256: "c5a9ae62bd33a3cba0f7efd0fe10938f2909bf948e54029bb7b67c0fd8ca782c",
    },
    Wheel {
        file: "pydantic-2.9.2-py3-none-any.whl",
        sha256: "f048cec7b26778210e28a0459867920654d48e5e62db0958433636cde4254f12",
    },
    Wheel {
        file: "pydantic_core-2.23.4-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        sha256: "216f9b2d7713eb98cb83c80b9c794de1f6b7e3145eef40400c62e86cee5f4e1e",
    },
    Wheel {
        file: "annotated_types-0.7.0-py3-none-any.whl",
        sha256: "1f02e8b43a8fbbc3f3e0d4f0f4bfc8131bcb4eebe8849b8e5c773f3a1c582a53",
    },
    Wheel {
        file: "typing_extensions-4.12.2-py3-none-any.whl",
        sha256: "04e5ca0351e0f3f85c6853954072df659d0d13fac324d0072316b67d7794700d",
    },
    Wheel {
        file: "bash_kernel-0.10.0-py2.py3-none-any.whl",
        sha256: "da28513230f5307c7a49e87352366304dc52b66faa207d6caed1b2bdec03c1fa",
    },
    Wheel {
        file: "filetype-1.2.0-py2.py3-none-any.whl",
        sha256: "7ce71b6880181241cf7ac8697a2f1eb6a8bd9b429f7ad6d27b8db9ba5f1c2d25",
    },
];
/// Bumped when the assembly steps change in a way the recipe fields do not show.
const BUILDER_VERSION: u32 = 1;
const KERNEL_META_PACKAGE: &str = "linux-image-cloud-amd64";
/// Guest kernel modules the initramfs loads (Debian builds them as modules; ext4 is built in).
const GUEST_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "virtio_rng",
    "virtio_net",
    "virtio_balloon",
];
const SEED_PACKAGES: &[&str] = &["python3", "procps", "sudo", "ca-certificates", "less"];
const KERNEL_FILE: &str = "vmlinuz";
const INITRD_FILE: &str = "initrd.img";
const ROOTFS_FILE: &str = "rootfs.ext4";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TemplateManifest {
    pub name: String,
    /// `sha256:<hex>` over the kernel, initramfs and rootfs digests.
    pub digest: String,
    pub kernel_version: String,
    /// RFC 3339.
    pub built_at: String,
    /// Bytes of kernel + initramfs + rootfs image.
    pub size_bytes: u64,
    /// Size of the root filesystem image; a sandbox disk may not be smaller.
    pub rootfs_bytes: u64,
    pub recipe_digest: String,
    pub recipe: SeedRecipe,
    /// Started after boot; the sandbox is ready once its port answers.
    #[serde(default)]
    pub start: Option<StartSpec>,
}

/// A process a template runs once the guest is up, and the port that says it is ready.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StartSpec {
    pub argv: Vec<String>,
    pub user: String,
    pub ready_port: u16,
}

/// Everything that decides what a template image contains.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SeedRecipe {
    /// Template name (`seed`, `code-interpreter-v1`).
    #[serde(default = "seed_name")]
    pub name: String,
    pub suite: String,
    pub variant: String,
    pub packages: Vec<String>,
    pub mirror: String,
    pub kernel_package: String,
    pub modules: Vec<String>,
    pub agent_sha256: String,
    /// Digest of the extra files the template adds (e.g. the code interpreter).
    #[serde(default)]
    pub files_sha256: String,
    /// Python wheels unpacked into the guest, `<file name> sha256:<hex>` each. Absent when there
    /// are none, so the recipes (and digests) of templates without wheels stay as they were.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub wheels: Vec<String>,
    /// Debian packages apt installs in the chroot after debootstrap. Absent when there are none,
    /// as `wheels`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub apt: Vec<String>,
    #[serde(default)]
    pub start: Option<StartSpec>,
    pub builder_version: u32,
}

fn seed_name() -> String {
    SEED.into()
}

/// What a buildable template adds to the Debian base.
struct TemplateDef {
    packages: Vec<&'static str>,
    /// (path in the guest, content, mode)
    files: Vec<(&'static str, &'static str, u32)>,
    /// Unpacked into the guest's Python site directory (`/usr/local/lib/python3.X/dist-packages`).
    wheels: &'static [Wheel],
    /// Installed by apt in the chroot after debootstrap, for dependency webs debootstrap cannot
    /// configure.
    apt: &'static [&'static str],
    start: Option<StartSpec>,
}

/// A wheel from the Python package index, fetched on the host at build time (through pip, so
/// the machine's index configuration applies) and checked against its digest.
struct Wheel {
    file: &'static str,
    sha256: &'static str,
}

impl Wheel {
    fn file_name(&self) -> &'static str {
        self.file
    }

    /// `name==version`, from the wheel's file name (`name-version-...whl`).
    fn requirement(&self) -> String {
        let mut parts = self.file.splitn(3, '-');
        let (name, version) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        format!("{name}=={version}")
    }
}

fn definition(name: &str) -> Option<TemplateDef> {
    match name {
        SEED => Some(TemplateDef {
            packages: SEED_PACKAGES.to_vec(),
            files: Vec::new(),
            wheels: &[],
            apt: &[],
            start: None,
        }),
        BASE => Some(TemplateDef {
            packages: SEED_PACKAGES.iter().chain(BASE_EXTRA_PACKAGES).copied().collect(),
            files: Vec::new(),
            wheels: &[],
            apt: BASE_APT_PACKAGES,
            start: None,
        }),
        CODE_INTERPRETER => Some(TemplateDef {
            packages: SEED_PACKAGES.iter().chain(CODE_INTERPRETER_PACKAGES).copied().collect(),
            files: vec![
                (CODE_INTERPRETER_PATH, CODE_INTERPRETER_PY, 0o755),
                (IPYTHON_STARTUP_PATH, IPYTHON_STARTUP_PY, 0o644),
                (BASH_KERNEL_PATH, BASH_KERNEL_JSON, 0o644),
            ],
            wheels: CODE_INTERPRETER_WHEELS,
            apt: &[],
            start: Some(StartSpec {
                argv: vec![
                    "python3".into(),
                    format!("/{CODE_INTERPRETER_PATH}"),
                    "--port".into(),
                    CODE_INTERPRETER_PORT.to_string(),
                ],
                user: "user".into(),
                ready_port: CODE_INTERPRETER_PORT,
            }),
        }),
        _ => None,
    }
}

/// Templates `airlock template build` knows how to make.
pub const BUILDABLE: &[&str] = &[SEED, BASE, CODE_INTERPRETER];

impl SeedRecipe {
    fn digest(&self) -> String {
        sha256_hex(&serde_json::to_vec(self).expect("serializable"))
    }
    /// The debootstrap layer (with its apt step) depends only on these fields.
    fn base_key(&self) -> String {
        let mut key = serde_json::json!([self.suite, self.variant, self.packages, self.mirror, BUILDER_VERSION]);
        if !self.apt.is_empty() {
            // Only then: the cached bases of templates without an apt step keep their keys.
            key.as_array_mut().expect("an array").push(serde_json::json!(self.apt));
        }
        sha256_hex(key.to_string().as_bytes())[..16].to_string()
    }
}

/// A resolved template on disk.
#[derive(Debug, Clone)]
pub struct Template {
    pub manifest: TemplateManifest,
    pub dir: PathBuf,
}

impl Template {
    pub fn kernel(&self) -> PathBuf {
        self.dir.join(KERNEL_FILE)
    }
    pub fn initrd(&self) -> PathBuf {
        self.dir.join(INITRD_FILE)
    }
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join(ROOTFS_FILE)
    }
}

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

pub struct TemplateStore {
    data: DataDir,
}

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

pub(crate) fn sha256_file(path: &Path) -> Result<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| RuntimeError::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| RuntimeError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// Split `name[:tag]`; only the `latest` tag exists today.
pub fn parse_reference(reference: &str) -> Result<(String, Option<String>)> {
    let bad = || RuntimeError::UnknownTemplate(reference.to_string());
    if let Some(hex) = reference.strip_prefix("sha256:") {
        if hex.len() < 12 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(bad());
        }
        return Ok((String::new(), Some(hex.to_ascii_lowercase())));
    }
    let (name, tag) = reference.split_once(':').unwrap_or((reference, "latest"));
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_' || c == '.');
    if !valid || tag != "latest" {
        return Err(bad());
    }
    Ok((name.to_string(), None))
}

impl TemplateStore {
    pub fn new(data: DataDir) -> Self {
        Self { data }
    }

    fn manifest_path(&self, name: &str) -> PathBuf {
        self.data.templates().join(format!("{name}.json"))
    }

    fn load(&self, name: &str) -> Option<Template> {
        let text = std::fs::read(self.manifest_path(name)).ok()?;
        let manifest: TemplateManifest = serde_json::from_slice(&text).ok()?;
        let dir = self.data.blobs().join(manifest.digest.trim_start_matches("sha256:"));
        let t = Template { manifest, dir };
        (t.kernel().exists() && t.initrd().exists() && t.rootfs().exists()).then_some(t)
    }

    pub fn list(&self) -> Vec<TemplateManifest> {
        let mut out: Vec<TemplateManifest> = std::fs::read_dir(self.data.templates())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_suffix(".json").map(String::from))
            .filter_map(|name| self.load(&name).map(|t| t.manifest))
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// `seed`, `seed:latest` or `sha256:<hex prefix>`.
    pub fn resolve(&self, reference: &str) -> Result<Template> {
        let (name, digest) = parse_reference(reference)?;
        let found = match digest {
            None => self.load(&name),
            Some(hex) => self
                .list()
                .into_iter()
                .find(|m| m.digest.trim_start_matches("sha256:").starts_with(&hex))
                .and_then(|m| self.load(&m.name)),
        };
        found.ok_or_else(|| RuntimeError::UnknownTemplate(reference.to_string()))
    }

    pub fn exists(&self, name: &str) -> bool {
        self.load(name).is_some()
    }

    /// Build `seed` unless its recipe is unchanged. Returns the template and whether it was built.
    pub fn build_seed(&self, opts: &BuildOptions) -> Result<(Template, bool)> {
        self.build(SEED, opts)
    }

    /// Build a template from its definition unless its recipe is unchanged.
    pub fn build(&self, name: &str, opts: &BuildOptions) -> Result<(Template, bool)> {
        let def = definition(name).ok_or_else(|| {
            RuntimeError::TemplateBuild(format!(
                "no recipe for template {name:?}; buildable: {}",
                BUILDABLE.join(", ")
            ))
        })?;
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
            start: def.start.clone(),
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

    fn fetch_kernel(&self, package: &str) -> Result<PathBuf> {
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
                .ok_or_else(|| RuntimeError::TemplateBuild(format!("apt-get download {package} produced no .deb")))?;
            let unpack = dl.join("x");
            run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpack), "dpkg-deb -x")?;
            std::fs::create_dir_all(dir.parent().expect("has parent")).map_err(|e| RuntimeError::io(&dir, e))?;
            std::fs::rename(&unpack, &dir).map_err(|e| RuntimeError::io(&dir, e))
        })();
        let _ = std::fs::remove_dir_all(&dl);
        res.map(|_| dir)
    }

    /// A wheel from the cache (by digest), else downloaded and checked against its digest. pip
    /// (in a venv of the cache's own: the host's Python may have none) fetches exactly that
    /// file: no dependencies, binary only, for the guest's Python and platform.
    fn fetch_wheel(&self, wheel: &Wheel) -> Result<PathBuf> {
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
                return Err(RuntimeError::TemplateBuild(format!(
                    "{}: sha256 {got}, expected {}",
                    wheel.file_name(),
                    wheel.sha256
                )));
            }
            std::fs::rename(&got_path, &path).map_err(|e| RuntimeError::io(&path, e))
        })();
        let _ = std::fs::remove_dir_all(&tmp);
        res.map(|_| path)
    }

    fn debootstrap_base(&self, recipe: &SeedRecipe, progress: &Progress) -> Result<PathBuf> {
        let base = self.data.cache().join(format!("base-{}", recipe.base_key()));
        if base.join(".complete").exists() {
            return Ok(base);
        }
        let _ = std::fs::remove_dir_all(&base);
        let tmp = self.data.cache().join(format!("base-tmp-{}", random_hex(4)));
        let log = self.data.cache().join("debootstrap.log");
        let res = (|| {
            let started = Instant::now();
            // A mirror that fails a request now and then (a release file once, in CI) costs a
            // retry, not the build.
            const ATTEMPTS: u32 = 3;
            let mut attempt = 1;
            let ran = loop {
                let _ = std::fs::remove_dir_all(&tmp);
                let mut cmd = Command::new("debootstrap");
                cmd.arg(format!("--variant={}", recipe.variant))
                    .arg(format!("--include={}", recipe.packages.join(",")))
                    .arg(&recipe.suite)
                    .arg(&tmp)
                    .arg(&recipe.mirror);
                let mut status = DebootstrapStatus::default();
                let ran = run_logged(&mut cmd, &log, "debootstrap", progress, |line| {
                    if line.starts_with("W: ") || line.starts_with("E: ") {
                        progress.warn(&format!("debootstrap: {line}"));
                    }
                    if status.feed(line) {
                        progress.status(&status.stage_line(), &status.count_line(), &status.display());
                    }
                });
                if ran.is_err() {
                    // debootstrap's own full log is inside the target, which is about to be removed.
                    if let Ok(inner) = std::fs::read(tmp.join("debootstrap/debootstrap.log")) {
                        use std::io::Write;
                        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(&log) {
                            let _ = f.write_all(b"--- debootstrap/debootstrap.log ---\n");
                            let _ = f.write_all(&inner);
                        }
                    }
                }
                if ran.is_ok() || attempt == ATTEMPTS {
                    break ran;
                }
                progress.warn(&format!(
                    "debootstrap failed (attempt {attempt} of {ATTEMPTS}); trying again in 10 s"
                ));
                attempt += 1;
                std::thread::sleep(std::time::Duration::from_secs(10));
            };
            ran?;
            tracing::debug!("debootstrap took {:.1}s", started.elapsed().as_secs_f64());
            if !recipe.apt.is_empty() {
                apt_install(&tmp, &recipe.apt, &log, progress)?;
            }
            progress.status("customizing the base", "customizing the base", "customizing the base");
            customize_base(&tmp)?;
            if recipe.packages.iter().any(|p| p == "python3-matplotlib") {
                let what = "building matplotlib's font cache";
                progress.status(what, what, what);
                // Build matplotlib's font cache now, not on a user's first plot under TCG.
                run(
                    Command::new("chroot").arg(&tmp).args([
                        "runuser",
                        "-u",
                        "user",
                        "--",
                        "env",
                        "HOME=/home/user",
                        "MPLBACKEND=Agg",
                        "python3",
                        "-c",
                        "import matplotlib.pyplot",
                    ]),
                    "matplotlib font cache",
                )?;
            }
            std::fs::write(tmp.join(".complete"), b"").map_err(|e| RuntimeError::io(&tmp, e))?;
            std::fs::rename(&tmp, &base).map_err(|e| RuntimeError::io(&base, e))
        })();
        if res.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        res.map(|_| base)
    }

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
        let mut h = Sha256::new();
        let mut size = 0;
        for f in [KERNEL_FILE, INITRD_FILE, ROOTFS_FILE] {
            let p = out.join(f);
            h.update(sha256_file(&p)?.as_bytes());
            size += std::fs::metadata(&p).map_err(|e| RuntimeError::io(&p, e))?.len();
        }
        let hex = hex::encode(h.finalize());
        let dir = self.data.blobs().join(&hex);
        if !dir.exists() {
            std::fs::rename(&out, &dir).map_err(|e| RuntimeError::io(&dir, e))?;
        }
        let manifest = TemplateManifest {
            name: recipe.name.clone(),
            digest: format!("sha256:{hex}"),
            kernel_version: kernel_version.into(),
            built_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            size_bytes: size,
            rootfs_bytes: std::fs::metadata(dir.join(ROOTFS_FILE)).map(|m| m.len()).unwrap_or(0),
            recipe_digest: recipe_digest.into(),
            recipe: recipe.clone(),
            start: def.start.clone(),
        };
        let old = self.load(&recipe.name);
        write_atomic(
            &self.manifest_path(&recipe.name),
            &serde_json::to_vec_pretty(&manifest).expect("serializable"),
        )?;
        // The previous image stays while sandboxes may use it; the runtime prunes unreferenced
        // ones when it opens (see `prune_blobs`).
        if let Some(old) = old.filter(|o| o.dir != dir) {
            progress.log(&format!(
                "{} replaced {} -> {}",
                recipe.name,
                short(&old.manifest.digest),
                short(&manifest.digest)
            ));
        }
        Ok(Template { manifest, dir })
    }

    /// Remove template blobs that no manifest names and no sandbox uses.
    pub fn prune_blobs(&self, in_use: &BTreeSet<String>) {
        let named: BTreeSet<String> = self
            .list()
            .into_iter()
            .map(|m| m.digest.trim_start_matches("sha256:").to_string())
            .collect();
        for entry in std::fs::read_dir(self.data.blobs()).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if !named.contains(&name) && !in_use.contains(&name) {
                tracing::info!("removing template image {name}: no template names it and nothing was made from it");
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

fn short(digest: &str) -> String {
    digest.chars().take(19).collect()
}

/// Install `packages` with apt inside the fresh debootstrap at `root`, from the mirror debootstrap
/// wrote into its sources. The host's resolver is lent to the chroot for this step only
/// (`customize_base` empties it again). Retried as debootstrap is.
fn apt_install(root: &Path, packages: &[String], log: &Path, progress: &Progress) -> Result<()> {
    let resolv = root.join("etc/resolv.conf");
    std::fs::copy("/etc/resolv.conf", &resolv).map_err(|e| RuntimeError::io(&resolv, e))?;
    // Check-Valid-Until: a host that builds from a frozen snapshot of the archive has Release
    // files past their validity date (debootstrap does not check it either).
    let apt = |args: &[&str]| {
        let mut cmd = Command::new("chroot");
        cmd.arg(root)
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

/// Extra steps on the fresh debootstrap: the `user` account, hosts, and slimming.
fn customize_base(root: &Path) -> Result<()> {
    run(
        Command::new("chroot")
            .arg(root)
            .args(["useradd", "-m", "-s", "/bin/bash", "-G", "sudo", "user"]),
        "useradd user",
    )?;
    let w = |rel: &str, text: &str| {
        let p = root.join(rel);
        std::fs::write(&p, text).map_err(|e| RuntimeError::io(&p, e))
    };
    w("etc/sudoers.d/user", "user ALL=(ALL) NOPASSWD:ALL\n")?;
    w(
        "etc/hosts",
        "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n",
    )?;
    w("etc/resolv.conf", "")?;
    for dir in [
        "usr/share/doc",
        "usr/share/man",
        "usr/share/info",
        "var/cache/apt/archives",
        "var/lib/apt/lists",
    ] {
        let p = root.join(dir);
        for e in std::fs::read_dir(&p).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                let _ = std::fs::remove_dir_all(e.path());
            } else {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let _ = std::fs::create_dir_all(root.join("var/lib/apt/lists/partial"));
    let _ = std::fs::create_dir_all(root.join("var/cache/apt/archives/partial"));
    Ok(())
}

/// Unpack wheels into the guest's site directory for locally installed packages (what pip
/// would do for these: no scripts, no `.data`), then compile them, with the guest's own Python.
fn install_wheels(rootfs: &Path, wheels: &[PathBuf]) -> Result<()> {
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
            .map_err(|e| RuntimeError::TemplateBuild(format!("unpacking wheels: {e}")))?;
        if !out.status.success() {
            return Err(RuntimeError::TemplateBuild(format!(
                "unpacking wheels failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
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

fn install_file(src: &Path, dst: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(parent) = dst.parent() {
        std::fs::create_dir_all(parent).map_err(|e| RuntimeError::io(parent, e))?;
    }
    let _ = std::fs::remove_file(dst); // never write through a hard link into a cached layer
    std::fs::copy(src, dst).map_err(|e| RuntimeError::io(src, e))?;
    std::fs::set_permissions(dst, std::fs::Permissions::from_mode(mode)).map_err(|e| RuntimeError::io(dst, e))
}

fn dir_bytes(dir: &Path) -> Result<u64> {
    let out = Command::new("du")
        .arg("-sb")
        .arg(dir)
        .output()
        .map_err(|e| RuntimeError::io("du", e))?;
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| RuntimeError::TemplateBuild(format!("du -sb {} failed", dir.display())))
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.output().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => RuntimeError::TemplateBuild(format!(
            "{what}: command not found; run scripts/install-host-deps as root"
        )),
        _ => RuntimeError::TemplateBuild(format!("{what}: {e}")),
    })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(8).collect();
        return Err(RuntimeError::TemplateBuild(format!(
            "{what} failed ({}): {}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        )));
    }
    Ok(())
}

/// Run a long step, reading its stdout and stderr line by line while it runs: every line goes to
/// `log` and to `on_line` (which turns it into progress); a failure reports the last lines.
fn run_logged(
    cmd: &mut Command,
    log: &Path,
    what: &str,
    progress: &Progress,
    mut on_line: impl FnMut(&str),
) -> Result<()> {
    use std::io::{BufRead, Write};
    use std::sync::mpsc::{channel, RecvTimeoutError};
    const TAIL: usize = 6;
    let mut file = std::fs::File::create(log).map_err(|e| RuntimeError::io(log, e))?;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| RuntimeError::TemplateBuild(format!("{what}: {e}; run scripts/install-host-deps as root")))?;
    let (tx, rx) = channel::<String>();
    let outputs: [Box<dyn std::io::Read + Send>; 2] = [
        Box::new(child.stdout.take().expect("piped")),
        Box::new(child.stderr.take().expect("piped")),
    ];
    let readers: Vec<_> = outputs
        .into_iter()
        .map(|out| {
            let tx = tx.clone();
            std::thread::spawn(move || {
                // Bytes, not `lines()`: a line that is not UTF-8 must not stop the draining.
                let mut out = std::io::BufReader::new(out);
                let mut buf = Vec::new();
                while matches!(out.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
                    let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                    buf.clear();
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            })
        })
        .collect();
    drop(tx);
    let mut tail = std::collections::VecDeque::with_capacity(TAIL);
    loop {
        match rx.recv_timeout(std::time::Duration::from_secs(1)) {
            Ok(line) => {
                let _ = writeln!(file, "{line}");
                on_line(&line);
                if tail.len() == TAIL {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        progress.heartbeat();
    }
    for r in readers {
        let _ = r.join();
    }
    let status = child
        .wait()
        .map_err(|e| RuntimeError::TemplateBuild(format!("{what}: {e}")))?;
    if !status.success() {
        let tail = Vec::from(tail).join(" | ");
        return Err(RuntimeError::TemplateBuild(format!(
            "{what} failed ({status}): {tail} (log: {})",
            log.display()
        )));
    }
    Ok(())
}

/// What debootstrap is doing, from its `I:` lines (`I: Retrieving libc6 2.36-9`, `I: Extracting
/// bash...`, `I: Configuring apt...`): a stage, how many packages it has passed, and the current one.
#[derive(Debug, Default)]
struct DebootstrapStatus {
    stage: &'static str,
    count: usize,
    item: String,
}

impl DebootstrapStatus {
    /// Take one line of output; true when the stage, count or item changed.
    fn feed(&mut self, line: &str) -> bool {
        let Some(msg) = line.trim().strip_prefix("I: ") else {
            return false;
        };
        let msg = msg.trim().trim_end_matches("...");
        let (verb, rest) = msg.split_once(' ').unwrap_or((msg, ""));
        let rest = rest.trim();
        // Release and Packages indexes are one word; packages come as `<name> <version>`.
        let index = !rest.contains(' ');
        let (stage, counted) = match verb {
            "Retrieving" | "Validating" if index => ("fetching the package index", false),
            "Checking" | "Valid" if rest.starts_with("Release") => ("fetching the package index", false),
            "Resolving" | "Found" | "Checking" => ("resolving dependencies", false),
            "Retrieving" => ("retrieving packages", true),
            "Extracting" => ("extracting packages", true),
            "Installing" => ("installing core packages", false),
            "Unpacking" | "Configuring" => {
                let stage = if verb == "Unpacking" {
                    "unpacking packages"
                } else {
                    "configuring packages"
                };
                // `Unpacking required packages`, `Configuring the base system` open a round.
                let round = rest.ends_with(" packages") || rest.ends_with(" system");
                (stage, !round)
            }
            "Base" if rest.starts_with("system installed") => ("base system installed", false),
            // `Validating <pkg>` follows each download; `Chosen extractor`, `Keyring`, ...
            _ => return false,
        };
        if stage != self.stage {
            self.stage = stage;
            self.count = 0;
            self.item.clear();
        }
        if counted {
            self.count += 1;
            self.item = rest.to_string();
        }
        true
    }

    /// `debootstrap: retrieving packages`
    fn stage_line(&self) -> String {
        format!("debootstrap: {}", self.stage)
    }

    /// `debootstrap: retrieving packages (37)`
    fn count_line(&self) -> String {
        match self.count {
            0 => self.stage_line(),
            n => format!("debootstrap: {} ({n})", self.stage),
        }
    }

    /// `retrieving packages (37) libc6 2.36-9`, for the spinner (its step already says debootstrap)
    fn display(&self) -> String {
        let line = self.count_line();
        let line = line.trim_start_matches("debootstrap: ");
        match self.item.as_str() {
            "" => line.to_string(),
            item => format!("{line} {item}"),
        }
    }
}

/// The Debian mirror configured on this host (deb822 sources first, then sources.list).
pub fn host_mirror() -> Result<String> {
    if let Ok(m) = std::env::var("AIRLOCK_DEBIAN_MIRROR") {
        return Ok(m);
    }
    let deb822 = std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources").unwrap_or_default();
    let legacy = std::fs::read_to_string("/etc/apt/sources.list").unwrap_or_default();
    mirror_from_sources(&deb822, &legacy).ok_or_else(|| {
        RuntimeError::TemplateBuild(
            "no Debian mirror in /etc/apt/sources.list.d/debian.sources; pass --mirror or set AIRLOCK_DEBIAN_MIRROR"
                .into(),
        )
    })
}

pub fn mirror_from_sources(deb822: &str, legacy: &str) -> Option<String> {
    let from_deb822 = deb822
        .lines()
        .filter_map(|l| l.strip_prefix("URIs:"))
        .flat_map(str::split_whitespace)
        .find(|u| !u.contains("security"));
    let from_legacy = || {
        legacy.lines().map(str::split_whitespace).find_map(|mut f| {
            (f.next() == Some("deb"))
                .then(|| f.find(|w| w.contains("://")))
                .flatten()
                .filter(|u| !u.contains("security"))
        })
    };
    from_deb822.or_else(from_legacy).map(String::from)
}

/// The concrete kernel package behind the cloud meta-package, as `name=version`.
fn resolve_kernel_package() -> Result<String> {
    let out = Command::new("apt-cache")
        .args(["depends", KERNEL_META_PACKAGE])
        .output()
        .map_err(|e| RuntimeError::TemplateBuild(format!("apt-cache: {e}")))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let name = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Depends: "))
        .map(str::trim)
        .filter(|n| n.starts_with("linux-image-"))
        .ok_or_else(|| {
            RuntimeError::TemplateBuild(format!(
                "apt knows no {KERNEL_META_PACKAGE}; run `apt-get update` (scripts/install-host-deps does)"
            ))
        })?;
    let policy = Command::new("apt-cache")
        .args(["policy", name])
        .output()
        .map_err(|e| RuntimeError::io("apt-cache", e))?;
    let version = String::from_utf8_lossy(&policy.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Candidate: ").map(str::to_string))
        .filter(|v| v != "(none)")
        .ok_or_else(|| RuntimeError::TemplateBuild(format!("no candidate version of {name}")))?;
    Ok(format!("{name}={version}"))
}

fn kernel_version_of(kernel_dir: &Path) -> Result<String> {
    let modules = kernel_dir.join("lib/modules");
    std::fs::read_dir(&modules)
        .map_err(|e| RuntimeError::io(&modules, e))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .next()
        .ok_or_else(|| RuntimeError::TemplateBuild(format!("no modules in {}", modules.display())))
}

fn check_static(agent: &Path) -> Result<()> {
    let bytes = std::fs::read(agent).map_err(|e| {
        RuntimeError::TemplateBuild(format!(
            "guest agent {}: {e}; build it with scripts/build",
            agent.display()
        ))
    })?;
    let head = &bytes[..bytes.len().min(4096)];
    if head.windows(14).any(|w| w == b"/lib64/ld-linu") {
        return Err(RuntimeError::TemplateBuild(format!(
            "guest agent {} is dynamically linked; build it with scripts/build (static)",
            agent.display()
        )));
    }
    Ok(())
}

/// The statically linked guest agent: `AIRLOCK_AGENT_BIN`, or next to this binary, or in the
/// cargo target dir the binary was built in.
pub fn locate_agent() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("AIRLOCK_AGENT_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| RuntimeError::io("current_exe", e))?;
    let mut candidates = Vec::new();
    for dir in exe.ancestors().skip(1).take(4) {
        candidates.push(dir.join("airlock-agent"));
        candidates.push(dir.join("x86_64-unknown-linux-gnu/release/airlock-agent"));
    }
    candidates.push(PathBuf::from("/usr/lib/airlock/airlock-agent"));
    candidates
        .into_iter()
        .find(|p| p.is_file() && check_static(p).is_ok())
        .ok_or_else(|| {
            RuntimeError::TemplateBuild(
                "guest agent binary not found; build it with scripts/build or set AIRLOCK_AGENT_BIN".into(),
            )
        })
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
            return Err(RuntimeError::TemplateBuild(format!("kernel module {name} not found")));
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

fn build_initramfs(agent: &Path, modules: &[PathBuf], staging: &Path, out: &Path) -> Result<()> {
    for d in ["dev", "proc", "sys", "newroot", "lib/modules"] {
        std::fs::create_dir_all(staging.join(d)).map_err(|e| RuntimeError::io(staging, e))?;
    }
    install_file(agent, &staging.join("init"), 0o755)?;
    std::fs::write(staging.join("airlock-initramfs"), b"").map_err(|e| RuntimeError::io(staging, e))?;
    let mut list = String::new();
    for m in modules {
        let name = m.file_name().expect("module file").to_string_lossy().to_string();
        install_file(m, &staging.join("lib/modules").join(&name), 0o644)?;
        list.push_str(&format!("/lib/modules/{name}\n"));
    }
    std::fs::write(staging.join("modules.list"), list).map_err(|e| RuntimeError::io(staging, e))?;
    // Uncompressed: under TCG, decompressing costs more boot time than reading a few MB.
    let script = format!(
        "cd '{}' && find . | LC_ALL=C sort | cpio -o -H newc --quiet > '{}'",
        staging.display(),
        out.display()
    );
    run(Command::new("sh").arg("-c").arg(script), "cpio")
}

/// Step display for long builds. On a terminal: a spinner showing the step and what it is doing,
/// with a line per finished step. Otherwise (CI logs): a log line per step and per stage, and one
/// every `HEARTBEAT` while a step runs quietly, so the log never sits silent.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    state: std::sync::Mutex<ProgressState>,
}

struct ProgressState {
    step: String,
    step_started: Instant,
    /// The stage last logged (plain mode) and its latest count line for heartbeats.
    stage: String,
    count_line: String,
    last_line: Instant,
}

const HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(10);

impl Progress {
    fn new(enabled: bool) -> Self {
        let bar = enabled.then(|| {
            let b = indicatif::ProgressBar::new_spinner();
            b.set_style(
                indicatif::ProgressStyle::with_template("{spinner} [{elapsed}] {prefix:.bold} {wide_msg}")
                    .expect("valid template"),
            );
            b.enable_steady_tick(std::time::Duration::from_millis(120));
            b
        });
        let now = Instant::now();
        Self {
            bar,
            started: now,
            state: std::sync::Mutex::new(ProgressState {
                step: String::new(),
                step_started: now,
                stage: String::new(),
                count_line: String::new(),
                last_line: now,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ProgressState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new step of the build.
    fn step(&self, what: &str) {
        let mut st = self.state();
        match &self.bar {
            Some(b) => {
                if !st.step.is_empty() {
                    b.println(format!(
                        "  {}: {:.1}s",
                        st.step,
                        st.step_started.elapsed().as_secs_f64()
                    ));
                }
                b.set_prefix(what.to_string());
                b.set_message("");
                tracing::debug!("template: {what}");
            }
            None => tracing::info!("template: {what}"),
        }
        let now = Instant::now();
        st.step = what.to_string();
        st.step_started = now;
        st.stage.clear();
        st.count_line.clear();
        st.last_line = now;
    }

    /// What the current step is doing: `stage` names it (a log line when it changes), `count_line`
    /// adds a count (heartbeat lines), `display` the current item too (the spinner).
    fn status(&self, stage: &str, count_line: &str, display: &str) {
        if let Some(b) = &self.bar {
            b.set_message(display.to_string());
            return;
        }
        let mut st = self.state();
        if st.stage != stage {
            tracing::info!("template: {stage}");
            st.stage = stage.to_string();
            st.last_line = Instant::now();
        }
        st.count_line = count_line.to_string();
    }

    /// Plain mode: a line when nothing was said for `HEARTBEAT`.
    fn heartbeat(&self) {
        if self.bar.is_some() {
            return;
        }
        let mut st = self.state();
        if st.last_line.elapsed() < HEARTBEAT {
            return;
        }
        let secs = st.step_started.elapsed().as_secs_f64();
        match st.count_line.as_str() {
            "" => tracing::info!("template: {}: still running, {secs:.0}s", st.step),
            c => tracing::info!("template: {c}, {secs:.0}s"),
        }
        st.last_line = Instant::now();
    }

    /// A log line that does not tear the spinner.
    fn log(&self, msg: &str) {
        match &self.bar {
            Some(b) => b.suspend(|| tracing::info!("{msg}")),
            None => tracing::info!("{msg}"),
        }
    }

    fn warn(&self, msg: &str) {
        match &self.bar {
            Some(b) => b.suspend(|| tracing::warn!("{msg}")),
            None => tracing::warn!("{msg}"),
        }
    }

    fn finish(&self, msg: &str) {
        let msg = format!("{msg} in {:.1}s", self.started.elapsed().as_secs_f64());
        match &self.bar {
            Some(b) => {
                let st = self.state();
                if !st.step.is_empty() {
                    b.println(format!(
                        "  {}: {:.1}s",
                        st.step,
                        st.step_started.elapsed().as_secs_f64()
                    ));
                }
                b.finish_and_clear();
                eprintln!("{msg}");
            }
            None => tracing::info!("template: {msg}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_references() {
        assert_eq!(parse_reference("seed").unwrap(), ("seed".into(), None));
        assert_eq!(parse_reference("seed:latest").unwrap(), ("seed".into(), None));
        assert_eq!(
            parse_reference("sha256:ABCDEF012345").unwrap(),
            (String::new(), Some("abcdef012345".into()))
        );
        for bad in ["", "seed:v2", "team/name", "sha256:xyz", "Seed", "../etc"] {
            assert!(parse_reference(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn finds_mirror_in_sources() {
        let deb822 = "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n\nURIs: http://mirror.example/debian-security\n";
        assert_eq!(
            mirror_from_sources(deb822, "").as_deref(),
            Some("http://mirror.example/debian")
        );
        let legacy = "deb http://sec.example/debian-security bookworm-security main\ndeb [arch=amd64] http://m.example/debian bookworm main\n";
        assert_eq!(
            mirror_from_sources("", legacy).as_deref(),
            Some("http://m.example/debian")
        );
        assert_eq!(mirror_from_sources("", ""), None);
    }

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

    /// Lines from a real `debootstrap --variant=minbase bookworm` run (stdout, abridged).
    const DEBOOTSTRAP_LINES: &str = "\
I: Retrieving InRelease 
I: Checking Release signature
I: Valid Release signature (key id 4D64FEC119C2029067D6E791F8D2585B8783D481)
I: Retrieving Packages 
I: Validating Packages 
I: Resolving dependencies of required packages...
I: Resolving dependencies of base packages...
I: Checking component main on http://deb.debian.org/debian...
I: Retrieving adduser 3.134
I: Validating adduser 3.134
I: Retrieving apt 2.6.1
I: Validating apt 2.6.1
I: Retrieving base-files 12.4+deb12u15
I: Validating base-files 12.4+deb12u15
I: Chosen extractor for .deb packages: dpkg-deb
I: Extracting adduser...
I: Extracting apt...
I: Installing core packages...
I: Unpacking required packages...
I: Unpacking base-files...
I: Unpacking base-passwd...
I: Configuring required packages...
I: Configuring base-files...
I: Unpacking the base system...
I: Unpacking libproc2-0:amd64...
I: Configuring the base system...
I: Configuring libc-bin...
I: Configuring ca-certificates...
I: Base system installed successfully.
";

    #[test]
    fn follows_debootstrap_stages() {
        let mut status = DebootstrapStatus::default();
        let mut shown = Vec::new();
        for line in DEBOOTSTRAP_LINES.lines() {
            if status.feed(line) {
                shown.push(status.display());
            }
        }
        let mut deduped = shown.clone();
        deduped.dedup();
        assert_eq!(
            deduped,
            vec![
                "fetching the package index",
                "resolving dependencies",
                "retrieving packages (1) adduser 3.134",
                "retrieving packages (2) apt 2.6.1",
                "retrieving packages (3) base-files 12.4+deb12u15",
                "extracting packages (1) adduser",
                "extracting packages (2) apt",
                "installing core packages",
                "unpacking packages",
                "unpacking packages (1) base-files",
                "unpacking packages (2) base-passwd",
                "configuring packages",
                "configuring packages (1) base-files",
                "unpacking packages",
                "unpacking packages (1) libproc2-0:amd64",
                "configuring packages",
                "configuring packages (1) libc-bin",
                "configuring packages (2) ca-certificates",
                "base system installed",
            ]
        );
        assert_eq!(status.count_line(), "debootstrap: base system installed");
        // `Validating <pkg>` and other lines change nothing.
        let mut s = DebootstrapStatus::default();
        assert!(s.feed("I: Retrieving libc6 2.36-9+deb12u10"));
        assert!(!s.feed("I: Validating libc6 2.36-9+deb12u10"));
        assert!(!s.feed("W: Cannot check Release signature; keyring file not available"));
        assert!(!s.feed("dpkg: warning: something"));
        assert_eq!(s.count_line(), "debootstrap: retrieving packages (1)");
        assert_eq!(s.stage_line(), "debootstrap: retrieving packages");
    }

    #[test]
    fn wheels_change_only_the_recipes_that_have_them() {
        let recipe = |wheels: Vec<String>| SeedRecipe {
            name: SEED.into(),
            suite: "bookworm".into(),
            variant: "minbase".into(),
            packages: vec!["python3".into()],
            mirror: "http://deb.example/debian".into(),
            kernel_package: "linux-image-cloud-amd64".into(),
            modules: Vec::new(),
            agent_sha256: "00".into(),
            files_sha256: String::new(),
            wheels,
            apt: Vec::new(),
            start: None,
            builder_version: BUILDER_VERSION,
        };
        // A recipe without wheels serializes (and so digests) as it did before they existed.
        let plain = serde_json::to_value(recipe(Vec::new())).unwrap();
        assert!(plain.get("wheels").is_none());
        let back: SeedRecipe = serde_json::from_value(plain).unwrap();
        assert_eq!(back, recipe(Vec::new()));
        assert_ne!(
            recipe(Vec::new()).digest(),
            recipe(vec!["x.whl sha256:00".into()]).digest()
        );
        for w in definition(CODE_INTERPRETER).unwrap().wheels {
            assert!(w.file_name().ends_with(".whl"), "{}", w.file);
            let req = w.requirement();
            let (name, version) = req.split_once("==").unwrap();
            assert!(
                !name.is_empty() && version.starts_with(|c: char| c.is_ascii_digit()),
                "{req}"
            );
            assert!(w.sha256.len() == 64 && w.sha256.chars().all(|c| c.is_ascii_hexdigit()));
        }
        assert!(definition(SEED).unwrap().wheels.is_empty() && definition(BASE).unwrap().wheels.is_empty());
    }

    #[test]
    fn an_apt_step_changes_only_the_recipes_and_debootstrap_caches_that_have_one() {
        let plain = SeedRecipe {
            name: BASE.into(),
            suite: "bookworm".into(),
            variant: "minbase".into(),
            packages: vec!["nodejs".into()],
            mirror: "http://deb.example/debian".into(),
            kernel_package: "linux-image-cloud-amd64".into(),
            modules: Vec::new(),
            agent_sha256: "00".into(),
            files_sha256: String::new(),
            wheels: Vec::new(),
            apt: Vec::new(),
            start: None,
            builder_version: BUILDER_VERSION,
        };
        assert!(serde_json::to_value(&plain).unwrap().get("apt").is_none());
        // The debootstrap cache key of a recipe without an apt step is what it always was.
        let old_key = serde_json::json!([
            plain.suite,
            plain.variant,
            plain.packages,
            plain.mirror,
            BUILDER_VERSION
        ]);
        assert_eq!(plain.base_key(), sha256_hex(old_key.to_string().as_bytes())[..16]);
        let with_npm = SeedRecipe {
            apt: vec!["npm".into()],
            ..plain.clone()
        };
        assert_ne!(with_npm.base_key(), plain.base_key());
        assert_ne!(with_npm.digest(), plain.digest());
        assert_eq!(definition(BASE).unwrap().apt, ["npm"]);
        assert!(definition(SEED).unwrap().apt.is_empty() && definition(CODE_INTERPRETER).unwrap().apt.is_empty());
    }
}
