//! Saved images in object storage. An image is its dir's files (`state`, `disk.qcow2`, the
//! `held/` files its machine sits on) and its manifest with the machine's paths made relative to
//! the dir. Files go up by their own sha256 under `files/` (a template's rootfs that many images
//! hold goes up once); the manifest goes last, under the sha256 of its own bytes, which names
//! every file's digest: a pull checks the manifest against the digest it asked for, each file
//! against the manifest (and the image's content digest, if it has one, against the files),
//! and renames the whole dir into `images/` with the paths made this host's. The VMM build that saved it still has to match where it runs (`Images::find`).

use super::{io, is_hex64, store_err, Objects, ObjectsError, Pushed, PushedFile, Result, Staging};
use crate::datadir::{write_atomic, DataDir};
use crate::sandbox::image::{valid_image_id, Image, ImageManifest, MANIFEST};
use crate::sandbox::saved::Manifest;
use futures_util::StreamExt;
use object_store::path::Path as ObjectPath;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

/// `images/<hex>/manifest.json`, `<hex>` the sha256 of these bytes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PushedImage {
    /// The machine's paths relative to the image's dir.
    pub manifest: ImageManifest,
    /// Every file of the dir the image needs; names relative to it.
    pub files: Vec<PushedFile>,
}

#[derive(Debug, Clone)]
pub struct PulledImage {
    pub image: Image,
    /// File bytes this pull downloaded (0: this host had the image).
    pub fetched_bytes: u64,
}

impl Objects {
    /// Upload `image`'s files the store lacks, then its manifest, then point its id at it.
    pub async fn push_image(&self, image: &Image) -> Result<Pushed> {
        let manifest = relative(image)?;
        let names = file_names(&manifest);
        let files = super::describe_files(image.dir.clone(), names.into_iter().collect()).await?;
        let mut uploaded = 0;
        for file in &files {
            let path = ObjectPath::from(format!("files/{}", file.sha256));
            if !self.exists(&path).await? {
                uploaded += self.upload_file(&path, &image.dir.join(&file.name), file.size).await?;
            }
        }
        let json = serde_json::to_vec_pretty(&PushedImage { manifest, files }).expect("serializable");
        let hex = hex::encode(Sha256::digest(&json));
        let manifest_path = ObjectPath::from(format!("images/{hex}/manifest.json"));
        if !self.exists(&manifest_path).await? {
            uploaded += json.len() as u64;
            self.put_create(&manifest_path, json.into()).await?;
        }
        let digest = format!("sha256:{hex}");
        let id_path = ObjectPath::from(format!("image-ids/{}", image.manifest.id));
        self.store
            .put(&id_path, digest.clone().into_bytes().into())
            .await
            .map_err(store_err("put", &id_path))?;
        Ok(Pushed {
            digest,
            uploaded_bytes: uploaded,
        })
    }

    /// Delete image `id` from the store once it has moved on: the files that are its own (the
    /// guest's memory and its disk; the machine's other files are a template's, which other
    /// images share), its manifest, then the pointer to it (last: a retry still finds the
    /// rest). What is missing is gone already. How many objects went.
    pub async fn delete_image(&self, id: &str) -> Result<usize> {
        if !valid_image_id(id) {
            return Err(ObjectsError::BadReference(id.to_string()));
        }
        let id_path = format!("image-ids/{id}");
        let hex = match self.pointer(&id_path, id).await {
            Ok(hex) => hex,
            Err(ObjectsError::NotFound(_)) => return Ok(0),
            Err(e) => return Err(e),
        };
        let manifest_path = format!("images/{hex}/manifest.json");
        let mut doomed = Vec::new();
        match self.get_small(&manifest_path, id).await {
            Ok(bytes) => {
                if let Ok(pushed) = serde_json::from_slice::<PushedImage>(&bytes) {
                    let own = [<ImageManifest as Manifest>::STATE, <ImageManifest as Manifest>::DISK];
                    // Files are content-addressed: one another image names too stays.
                    let kept = self.files_of_images_but(&hex).await?;
                    doomed.extend(
                        pushed
                            .files
                            .iter()
                            .filter(|f| own.contains(&f.name.as_str()) && is_hex64(&f.sha256))
                            .filter(|f| !kept.contains(&f.sha256))
                            .map(|f| format!("files/{}", f.sha256)),
                    );
                }
                doomed.push(manifest_path);
            }
            Err(ObjectsError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
        doomed.push(id_path);
        let mut gone = 0;
        for path in doomed {
            let path = ObjectPath::from(path);
            match self.store.delete(&path).await {
                Ok(()) => gone += 1,
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(store_err("delete", &path)(e)),
            }
        }
        Ok(gone)
    }

    /// The files every image in the store but `images/<except>` names (each manifest read: the
    /// images in the store are the few that are moving between nodes).
    async fn files_of_images_but(&self, except: &str) -> Result<BTreeSet<String>> {
        let prefix = ObjectPath::from("images");
        let mut listing = self.store.list(Some(&prefix));
        let mut files = BTreeSet::new();
        while let Some(meta) = listing.next().await {
            let meta = meta.map_err(store_err("list", &prefix))?;
            let path = meta.location.to_string();
            if !path.ends_with("/manifest.json") || path == format!("images/{except}/manifest.json") {
                continue;
            }
            let bytes = match self.get_small(&path, &path).await {
                Ok(bytes) => bytes,
                Err(ObjectsError::NotFound(_)) => continue,
                Err(e) => return Err(e),
            };
            if let Ok(pushed) = serde_json::from_slice::<PushedImage>(&bytes) {
                files.extend(pushed.files.into_iter().map(|f| f.sha256));
            }
        }
        Ok(files)
    }

    /// Make `reference` (an image id, or the `sha256:<hex>` a push returned) an image in
    /// `data`'s images dir, every file verified before the dir appears. An image of that id
    /// already here is kept: the same one costs nothing, another is [`ObjectsError::ImageIdTaken`].
    pub async fn pull_image(&self, reference: &str, data: &DataDir) -> Result<PulledImage> {
        let hex = match reference.strip_prefix("sha256:") {
            Some(hex) if is_hex64(hex) => hex.to_string(),
            Some(_) => return Err(ObjectsError::BadReference(reference.to_string())),
            None if valid_image_id(reference) => self.pointer(&format!("image-ids/{reference}"), reference).await?,
            None => return Err(ObjectsError::BadReference(reference.to_string())),
        };
        let manifest_path = format!("images/{hex}/manifest.json");
        let bytes = self.get_small(&manifest_path, reference).await?;
        let actual = hex::encode(Sha256::digest(&bytes));
        if actual != hex {
            return Err(ObjectsError::DigestMismatch {
                digest: format!("sha256:{hex}"),
                what: "the image's manifest".into(),
                expected: hex,
                actual,
            });
        }
        let pushed: PushedImage = serde_json::from_slice(&bytes).map_err(|e| ObjectsError::BadManifest {
            path: manifest_path.clone(),
            reason: e.to_string(),
        })?;
        check_image(&pushed, &manifest_path)?;
        let id = pushed.manifest.id.clone();
        let root = data.images();
        if let Some(have) = Image::find(&root, &id) {
            let same = relative(&have).is_ok_and(|m| without_digest(m) == without_digest(pushed.manifest.clone()));
            return match same {
                true => Ok(PulledImage {
                    image: have,
                    fetched_bytes: 0,
                }),
                false => Err(ObjectsError::ImageIdTaken(id)),
            };
        }
        let dir = root.join(&id);
        let staging = Staging::new(data)?;
        let mut fetched = 0;
        let have = local_template_files(&pushed, data);
        for file in &pushed.files {
            let to = staging.dir.join(&file.name);
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent).map_err(io(parent))?;
            }
            if let Some(local) = have.get(&file.name) {
                if std::fs::hard_link(local, &to).is_ok() {
                    continue;
                }
            }
            let path = ObjectPath::from(format!("files/{}", file.sha256));
            fetched += self
                .download(
                    &path,
                    file,
                    &to,
                    file_mode(&pushed.manifest, &file.name),
                    &format!("image {id}"),
                )
                .await?;
        }
        let manifest = ImageManifest {
            machine: rebased(&pushed.manifest, &dir),
            ..pushed.manifest
        };
        if let Some(expected) = manifest.digest.clone() {
            // The content address it was saved with must be what came: hashed where it lies.
            let staged = Image {
                dir: staging.dir.clone(),
                manifest: manifest.clone(),
            };
            let actual = tokio::task::spawn_blocking(move || staged.content_digest())
                .await
                .expect("hashing does not panic")?;
            if actual != expected {
                return Err(ObjectsError::DigestMismatch {
                    digest: format!("image {id}"),
                    what: "its content".into(),
                    expected,
                    actual,
                });
            }
        }
        write_atomic(
            &staging.dir.join(MANIFEST),
            &serde_json::to_vec_pretty(&manifest).expect("serializable"),
        )?;
        // The dir appears whole, its manifest in it; a dir of that id made meanwhile stays.
        staging.commit(&dir).map_err(|_| ObjectsError::ImageIdTaken(id))?;
        Ok(PulledImage {
            image: Image { dir, manifest },
            fetched_bytes: fetched,
        })
    }
}

/// The files of this host's template that an image's kernel, initramfs and root filesystem
/// are, by their names in the image: only when the pushed digests of those three make up the
/// template digest the image names, so they are the bytes of the local blob dir of that
/// digest (content-addressed, checked when it was built or pulled). A pull links them rather
/// than download them again.
fn local_template_files(pushed: &PushedImage, data: &DataDir) -> BTreeMap<String, PathBuf> {
    let m = &pushed.manifest.machine;
    let names = [&m.kernel, &m.initrd, &m.rootfs].map(|p| p.to_string_lossy().into_owned());
    let digests: Option<Vec<&str>> = names
        .iter()
        .map(|n| pushed.files.iter().find(|f| f.name == *n).map(|f| f.sha256.as_str()))
        .collect();
    let Some(digests) = digests else {
        return BTreeMap::new();
    };
    let hex = hex::encode(Sha256::digest(digests.concat().as_bytes()));
    if pushed.manifest.template_digest != format!("sha256:{hex}") {
        return BTreeMap::new();
    }
    let blobs = data.blobs().join(&hex);
    names
        .into_iter()
        .zip(super::FILES)
        .map(|(name, file)| (name, blobs.join(file)))
        .filter(|(_, path)| path.is_file())
        .collect()
}

/// The mode a pulled image's file gets: the template's kernel, initramfs and root filesystem
/// are readable by the VMM's own uid as the template's files are (it opens them again by
/// `/proc/self/fd`); the guest's memory and disks stay the server's only, as a save makes them.
fn file_mode(relative: &ImageManifest, name: &str) -> u32 {
    let m = &relative.machine;
    match [&m.kernel, &m.initrd, &m.rootfs].iter().any(|p| p.as_os_str() == name) {
        true => 0o644,
        false => 0o600,
    }
}

/// `image`'s manifest with its machine's paths relative to its dir; a path outside it is refused.
fn relative(image: &Image) -> Result<ImageManifest> {
    let m = &image.manifest;
    let rel = |p: &PathBuf| {
        p.strip_prefix(&image.dir)
            .map(Path::to_path_buf)
            .map_err(|_| ObjectsError::NotSelfContained {
                id: m.id.clone(),
                path: p.clone(),
            })
    };
    let mut manifest = m.clone();
    manifest.machine.layers = m.machine.layers.iter().map(rel).collect::<Result<_>>()?;
    manifest.machine.kernel = rel(&m.machine.kernel)?;
    manifest.machine.initrd = rel(&m.machine.initrd)?;
    manifest.machine.rootfs = rel(&m.machine.rootfs)?;
    Ok(manifest)
}

/// The machine of a pushed manifest with its paths under `dir`.
fn rebased(m: &ImageManifest, dir: &Path) -> crate::vmm::ResumeSpec {
    let mut machine = m.machine.clone();
    machine.layers = machine.layers.iter().map(|p| dir.join(p)).collect();
    machine.kernel = dir.join(&machine.kernel);
    machine.initrd = dir.join(&machine.initrd);
    machine.rootfs = dir.join(&machine.rootfs);
    machine
}

/// The digest is recorded once computed, after the save: the same image with or without it.
fn without_digest(m: ImageManifest) -> ImageManifest {
    ImageManifest { digest: None, ..m }
}

/// The files an image needs: its state and disk, and what its machine sits on.
fn file_names(m: &ImageManifest) -> BTreeSet<String> {
    let machine = &m.machine;
    [<ImageManifest as Manifest>::STATE, <ImageManifest as Manifest>::DISK]
        .into_iter()
        .map(String::from)
        .chain(
            machine
                .layers
                .iter()
                .chain([&machine.kernel, &machine.initrd, &machine.rootfs])
                .map(|p| p.to_string_lossy().into_owned()),
        )
        .collect()
}

/// What a pull takes from a manifest before trusting it: an id that is a plain name, file
/// names that stay inside the dir (once each, never the manifest), every file the machine
/// needs among them, digests that are digests.
fn check_image(pushed: &PushedImage, path: &str) -> Result<()> {
    let bad = |reason: &str| ObjectsError::BadManifest {
        path: path.to_string(),
        reason: reason.to_string(),
    };
    if !valid_image_id(&pushed.manifest.id) {
        return Err(bad("invalid image id"));
    }
    let mut names = BTreeSet::new();
    for f in &pushed.files {
        let inside = !f.name.is_empty()
            && f.name != MANIFEST
            && Path::new(&f.name)
                .components()
                .all(|c| matches!(c, Component::Normal(_)));
        if !inside || !is_hex64(&f.sha256) || !names.insert(f.name.clone()) {
            return Err(bad(
                "a file name outside the image's dir, repeated, or without a sha256 digest",
            ));
        }
    }
    if !file_names(&pushed.manifest).is_subset(&names) {
        return Err(bad("a file the image's machine needs is not among its files"));
    }
    Ok(())
}
