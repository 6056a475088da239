//! The machine a benchmark ran on, recorded next to its raw results.

/// CPU model and count, memory, host kernel.
pub fn machine() -> serde_json::Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("")
        .trim()
        .to_string();
    serde_json::json!({
        "cpu": cpu,
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "mem_gib": airlock_runtime::vmm::host_memory_mib().unwrap_or(0) / 1024,
        "host_kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
    })
}
