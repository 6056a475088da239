//! What each buildable template contains: `seed`, `base` and `code-interpreter-v1` as Debian
//! packages, apt steps, pinned wheels and added files, and the `SeedRecipe` that digests it all.
//! Pure data: uses nothing else of the runtime.

use crate::digest::sha256_hex;
use serde::{Deserialize, Serialize};

pub const SEED: &str = "seed";
/// `seed` plus what code written for E2B's `base` assumes: git, curl, a `python` command, pip and
/// venv, node and npm, and `ss` (iproute2: E2B's builder waits for a port with it). `seed`
/// itself stays minimal.
pub const BASE: &str = "base";
const BASE_EXTRA_PACKAGES: &[&str] = &[
    "git",
    "curl",
    "iproute2",
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
/// (`e2b-charts`), a bash kernel, R's, Deno's (JavaScript, TypeScript) and
/// our Java kernel over JShell, with airlock's code interpreter on port 49999: E2B's API
/// over a kernel per context (E2B's `code-interpreter-v1`).
pub const CODE_INTERPRETER: &str = "code-interpreter-v1";
/// Python, Deno and a JVM side by side: 512 MiB thrashes (E2B runs it with 2048).
const CODE_INTERPRETER_MEMORY_MIB: u32 = 1024;
/// Port the code interpreter listens on inside the sandbox (E2B's Jupyter port).
pub const CODE_INTERPRETER_PORT: u16 = 49999;
const CODE_INTERPRETER_PY: &str = include_str!("../../guest/code_interpreter.py");
const CODE_INTERPRETER_PATH: &str = "usr/lib/airlock/code_interpreter.py";
/// Run by every Python kernel at start (the server finds it next to itself).
const IPYTHON_STARTUP_PY: &str = include_str!("../../guest/ipython_startup.py");
const IPYTHON_STARTUP_PATH: &str = "usr/lib/airlock/ipython_startup.py";
/// The bash kernel's kernelspec (what `python3 -m bash_kernel.install` would write).
const BASH_KERNEL_JSON: &str = r#"{"argv": ["/usr/bin/python3", "-m", "bash_kernel", "-f", "{connection_file}"], "display_name": "Bash", "language": "bash", "env": {"PS1": "$"}}
"#;
const BASH_KERNEL_PATH: &str = "usr/local/share/jupyter/kernels/bash/kernel.json";
/// Java: our kernel (the registries package none) over JShell, the JDK's REPL engine.
const JAVA_KERNEL_PY: &str = include_str!("../../guest/java_kernel.py");
const JAVA_KERNEL_PY_PATH: &str = "usr/lib/airlock/java_kernel.py";
const JSHELL_BRIDGE: &str = include_str!("../../guest/JShellBridge.java");
const JSHELL_BRIDGE_PATH: &str = "usr/lib/airlock/JShellBridge.java";
const JAVA_KERNEL_JSON: &str = r#"{"argv": ["/usr/bin/python3", "/usr/lib/airlock/java_kernel.py", "-f", "{connection_file}"], "display_name": "Java", "language": "java"}
"#;
const JAVA_KERNEL_PATH: &str = "usr/local/share/jupyter/kernels/java/kernel.json";
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
/// R and its Jupyter kernel (Debian's IRkernel, kernelspec `ir`), and the JDK (JShell, for the
/// Java kernel): by apt, for webs of dependencies debootstrap does not configure.
const CODE_INTERPRETER_APT_PACKAGES: &[&str] = &["r-base-core", "r-cran-irkernel", "openjdk-17-jdk-headless"];
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
/// Deno (its own Jupyter kernel: JavaScript and TypeScript, ESM `import`, top-level `await`),
/// the platform binary the npm registry's `deno` package installs.
const CODE_INTERPRETER_NPM: &[NpmBinary] = &[NpmBinary {
    package: "@deno/linux-x64-glibc",
    version: "2.9.6",
    integrity: "sha512-3md4TKLCuzsLDmfOoC5KN7NAZaxSVkMgm64vg6foD00JBADCpYS2/5QqXfzgnP5ZQz3iLP9vBQJtEgc116OAoQ==",
    entry: "package/deno",
    dest: "usr/local/bin/deno",
}];
/// The `javascript` kernelspec (what `deno jupyter --install` would write), TypeScript too.
const DENO_KERNEL_JSON: &str = r#"{"argv": ["/usr/local/bin/deno", "jupyter", "--kernel", "--conn", "{connection_file}"], "display_name": "Deno", "language": "typescript", "env": {"NO_COLOR": "1", "DENO_NO_UPDATE_CHECK": "1"}}
"#;
const DENO_KERNEL_PATH: &str = "usr/local/share/jupyter/kernels/javascript/kernel.json";
/// Bumped when the assembly steps change in a way the recipe fields do not show.
pub(super) const BUILDER_VERSION: u32 = 1;
pub(super) const KERNEL_META_PACKAGE: &str = "linux-image-cloud-amd64";
/// Guest kernel modules the initramfs loads (Debian builds them as modules; ext4 is built in).
pub(super) const GUEST_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "virtio_rng",
    "virtio_net",
    "virtio_balloon",
    // Volumes: hot-plugged `scsi-hd` disks on the VM's virtio-scsi controller.
    "virtio_scsi",
    "sd_mod",
];
const SEED_PACKAGES: &[&str] = &["python3", "procps", "sudo", "ca-certificates", "less"];

/// A process a template runs once the guest is up, and what says it is ready: its port
/// accepting connections, or a command exiting 0 (a built template's ready check). The added
/// fields are left out when unset, so the recipes (and digests) of the built-in templates stay.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StartSpec {
    pub argv: Vec<String>,
    pub user: String,
    /// 0: no port to wait for.
    pub ready_port: u16,
    /// A shell command run as `user` until it exits 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub env: std::collections::BTreeMap<String, String>,
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
    /// Binaries from the npm registry, `<package>@<version> <integrity>` each. Absent when there
    /// are none, as `wheels`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub npm: Vec<String>,
    #[serde(default)]
    pub start: Option<StartSpec>,
    /// The memory a sandbox of the template gets when its create names none, where the
    /// platform's default is too little for it. Absent for the others, as `wheels`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    pub builder_version: u32,
}

fn seed_name() -> String {
    SEED.into()
}

/// What a buildable template adds to the Debian base.
pub(super) struct TemplateDef {
    pub(super) packages: Vec<&'static str>,
    /// (path in the guest, content, mode)
    pub(super) files: Vec<(&'static str, &'static str, u32)>,
    /// Unpacked into the guest's Python site directory (`/usr/local/lib/python3.X/dist-packages`).
    pub(super) wheels: &'static [Wheel],
    /// Installed by apt in the chroot after debootstrap, for dependency webs debootstrap cannot
    /// configure.
    pub(super) apt: &'static [&'static str],
    /// Single binaries out of npm packages (no Node involved), put where each says.
    pub(super) npm: &'static [NpmBinary],
    pub(super) start: Option<StartSpec>,
    pub(super) memory_mib: Option<u32>,
}

/// One file out of a package of the npm registry, fetched on the host at build time (by `npm
/// pack`, so the machine's registry configuration applies) and checked against the registry's
/// integrity (`sha512-<base64>`).
pub(super) struct NpmBinary {
    pub(super) package: &'static str,
    pub(super) version: &'static str,
    pub(super) integrity: &'static str,
    /// The file's path in the package's tarball.
    pub(super) entry: &'static str,
    /// Where it goes in the guest.
    pub(super) dest: &'static str,
}

impl NpmBinary {
    pub(super) fn spec(&self) -> String {
        format!("{}@{}", self.package, self.version)
    }
}

/// A wheel from the Python package index, fetched on the host at build time (through pip, so
/// the machine's index configuration applies) and checked against its digest.
pub(super) struct Wheel {
    pub(super) file: &'static str,
    pub(super) sha256: &'static str,
}

impl Wheel {
    pub(super) fn file_name(&self) -> &'static str {
        self.file
    }

    /// `name==version`, from the wheel's file name (`name-version-...whl`).
    pub(super) fn requirement(&self) -> String {
        let mut parts = self.file.splitn(3, '-');
        let (name, version) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        format!("{name}=={version}")
    }
}

pub(super) fn definition(name: &str) -> Option<TemplateDef> {
    match name {
        SEED => Some(TemplateDef {
            packages: SEED_PACKAGES.to_vec(),
            files: Vec::new(),
            wheels: &[],
            apt: &[],
            npm: &[],
            start: None,
            memory_mib: None,
        }),
        BASE => Some(TemplateDef {
            packages: SEED_PACKAGES.iter().chain(BASE_EXTRA_PACKAGES).copied().collect(),
            files: Vec::new(),
            wheels: &[],
            apt: BASE_APT_PACKAGES,
            npm: &[],
            start: None,
            memory_mib: None,
        }),
        CODE_INTERPRETER => Some(TemplateDef {
            packages: SEED_PACKAGES.iter().chain(CODE_INTERPRETER_PACKAGES).copied().collect(),
            files: vec![
                (CODE_INTERPRETER_PATH, CODE_INTERPRETER_PY, 0o755),
                (IPYTHON_STARTUP_PATH, IPYTHON_STARTUP_PY, 0o644),
                (BASH_KERNEL_PATH, BASH_KERNEL_JSON, 0o644),
                (DENO_KERNEL_PATH, DENO_KERNEL_JSON, 0o644),
                (JAVA_KERNEL_PY_PATH, JAVA_KERNEL_PY, 0o644),
                (JSHELL_BRIDGE_PATH, JSHELL_BRIDGE, 0o644),
                (JAVA_KERNEL_PATH, JAVA_KERNEL_JSON, 0o644),
            ],
            wheels: CODE_INTERPRETER_WHEELS,
            apt: CODE_INTERPRETER_APT_PACKAGES,
            npm: CODE_INTERPRETER_NPM,
            start: Some(StartSpec {
                argv: vec![
                    "python3".into(),
                    format!("/{CODE_INTERPRETER_PATH}"),
                    "--port".into(),
                    CODE_INTERPRETER_PORT.to_string(),
                ],
                // Root, as E2B's: a context may start in any directory (`cwd="/root"`).
                user: "root".into(),
                ready_port: CODE_INTERPRETER_PORT,
                ready_cmd: None,
                cwd: None,
                env: Default::default(),
            }),
            memory_mib: Some(CODE_INTERPRETER_MEMORY_MIB),
        }),
        _ => None,
    }
}

/// Templates `airlock template build` knows how to make.
pub const BUILDABLE: &[&str] = &[SEED, BASE, CODE_INTERPRETER];

impl SeedRecipe {
    pub(super) fn digest(&self) -> String {
        sha256_hex(&serde_json::to_vec(self).expect("serializable"))
    }
    /// The debootstrap layer (with its apt step) depends only on these fields.
    pub(super) fn base_key(&self) -> String {
        let mut key = serde_json::json!([self.suite, self.variant, self.packages, self.mirror, BUILDER_VERSION]);
        if !self.apt.is_empty() {
            // Only then: the cached bases of templates without an apt step keep their keys.
            key.as_array_mut().expect("an array").push(serde_json::json!(self.apt));
        }
        sha256_hex(key.to_string().as_bytes())[..16].to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            npm: Vec::new(),
            start: None,
            memory_mib: None,
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
            npm: Vec::new(),
            start: None,
            memory_mib: None,
            builder_version: BUILDER_VERSION,
        };
        assert!(serde_json::to_value(&plain).unwrap().get("apt").is_none());
        assert!(serde_json::to_value(&plain).unwrap().get("npm").is_none());
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
        assert!(definition(SEED).unwrap().apt.is_empty());
        assert_eq!(
            definition(CODE_INTERPRETER).unwrap().apt,
            ["r-base-core", "r-cran-irkernel", "openjdk-17-jdk-headless"]
        );
    }
}
