//! Which accelerator VMs use ([`AccelProbe`]): forced (`AIRLOCK_ACCEL`, the options), a verdict
//! cached in the data dir for this kernel, seed template and VMM, or found once by booting a KVM
//! probe guest. Uses `launch.rs` only.

use super::launch::{Launcher, Purpose, Source};
use crate::datadir::{random_hex, write_atomic};
use crate::vmm::{Accel, Resources};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

pub struct AccelProbe {
    forced: Option<Accel>,
    found: tokio::sync::OnceCell<Accel>,
}

impl AccelProbe {
    /// `forced`, else `AIRLOCK_ACCEL=kvm|tcg`, else probed on first use.
    pub fn new(forced: Option<Accel>) -> Self {
        let forced = forced.or_else(|| match std::env::var("AIRLOCK_ACCEL").as_deref() {
            Ok("kvm") => Some(Accel::Kvm),
            Ok("tcg") => Some(Accel::Tcg),
            _ => None,
        });
        Self {
            forced,
            found: tokio::sync::OnceCell::new(),
        }
    }

    /// The accelerator: forced, cached, or found by booting a KVM probe guest once.
    pub async fn get(&self, launcher: &Launcher) -> Accel {
        if let Some(a) = self.forced {
            return a;
        }
        *self.found.get_or_init(|| detect(launcher)).await
    }
}

async fn detect(launcher: &Launcher) -> Accel {
    let kvm_usable = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    if !kvm_usable {
        tracing::info!("accel: tcg (no usable /dev/kvm)");
        return Accel::Tcg;
    }
    let Ok(template) = launcher.templates.resolve(crate::template::SEED) else {
        tracing::info!("accel: tcg for now (no seed template to probe KVM with)");
        return Accel::Tcg;
    };
    let key = format!(
        "{}|{}|{}",
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim(),
        template.manifest.kernel_version,
        launcher.vmm.name()
    );
    let cache = launcher.data.accel_cache();
    if let Some(cached) = std::fs::read(&cache)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .filter(|v| v["key"] == key)
        .and_then(|v| serde_json::from_value::<Accel>(v["accel"].clone()).ok())
    {
        tracing::info!("accel: {cached} (cached probe verdict)");
        return cached;
    }
    let started = Instant::now();
    let resources = Resources {
        vcpu: 1,
        memory_mib: 256,
        disk_mib: template.manifest.rootfs_bytes.div_ceil(1 << 20) as u32,
    };
    let verdict = match launcher
        .launch(
            random_hex(10),
            Source::Boot(&template, resources),
            Accel::Kvm,
            Duration::from_secs(10),
            Purpose::Probe,
            &BTreeMap::new(),
        )
        .await
    {
        Ok(vm) => {
            launcher.discard_unadopted(&vm).await;
            Accel::Kvm
        }
        Err(e) => {
            tracing::info!("KVM probe guest did not come up ({e})");
            Accel::Tcg
        }
    };
    tracing::info!("accel: {verdict} (probed in {:.1}s)", started.elapsed().as_secs_f64());
    let _ = write_atomic(
        &cache,
        serde_json::json!({ "key": key, "accel": verdict })
            .to_string()
            .as_bytes(),
    );
    verdict
}
