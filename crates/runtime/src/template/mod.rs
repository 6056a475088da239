//! Templates: a kernel, an initramfs and an ext4 root filesystem, stored by content digest.
//!
//! `seed` is built here from Debian packages in layers, so a change costs what it should:
//! - the kernel package is fetched with `apt-get download` and unpacked once per version;
//! - the debootstrap base (tens of seconds) is cached by its recipe;
//! - the agent + image assembly (`mkfs.ext4 -d`, about a second) is redone when the agent changes.
//!
//! A rebuild happens only when the recipe digest changes.
//!
//! - `recipes`: what each buildable template contains, and the recipe that digests it
//! - `store`: the content-addressed store (manifests, blobs, lookup, prune)
//! - `build`: one build, layer by layer, committed to the store
//! - `kernel`, `debootstrap`, `packages` (apt, pip), `initramfs`: the builders
//! - `oci`: OCI images pulled from a registry and made templates; `pull_gate`: every dial a pull
//!   makes, judged
//! - `confine`: their layers applied (crates/unpack: with no symlink followed) by a process in
//!   namespaces of its own that sees only the staging dir
//! - `command`, `progress`: running a build's commands, and what it shows while it runs

mod build;
mod command;
mod confine;
mod debootstrap;
mod error;
mod initramfs;
mod kernel;
mod oci;
mod packages;
mod progress;
mod pull_gate;
mod recipes;
mod store;

pub use build::BuildOptions;
pub use confine::{child_main as unpack_child_main, UNPACK_ARG};
pub use debootstrap::{host_mirror, mirror_from_sources};
pub use error::TemplateError;
pub use initramfs::locate_agent;
pub use kernel::{module_depends, resolve_modules};
pub use oci::{ImageError, ImageImport, Registries, RegistryCredentials, IMAGE_KEY_PREFIX};
pub use recipes::{SeedRecipe, StartSpec, BASE, BUILDABLE, CODE_INTERPRETER, CODE_INTERPRETER_PORT, SEED};
pub use store::{find_manifest, parse_reference, Built, Template, TemplateManifest, TemplateStore};
pub(crate) use store::{INITRD_FILE, KERNEL_FILE, ROOTFS_FILE};
