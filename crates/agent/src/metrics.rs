//! Guest metrics: CPU busy share since the previous call, memory and root disk usage.

use airlock_proto::Metrics;
use std::sync::Mutex;

#[derive(Default)]
pub struct CpuSampler {
    prev: Mutex<Option<(u64, u64)>>,
}

/// (busy, total) jiffies from the first line of /proc/stat.
pub fn parse_proc_stat(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let vals: Vec<u64> = line.split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    if vals.len() < 4 {
        return None;
    }
    // user nice system idle iowait irq softirq steal ...; idle + iowait are not busy
    let total: u64 = vals.iter().take(8).sum();
    let idle = vals[3] + vals.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// (total, used) bytes from /proc/meminfo, used = MemTotal - MemAvailable.
pub fn parse_meminfo(text: &str) -> Option<(u64, u64)> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        line.split_whitespace()
            .nth(1)?
            .parse::<u64>()
            .ok()
            .map(|kib| kib * 1024)
    };
    let total = field("MemTotal:")?;
    let avail = field("MemAvailable:")?;
    Some((total, total.saturating_sub(avail)))
}

impl CpuSampler {
    pub fn sample(&self) -> Metrics {
        let cpu_count = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        let now = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|t| parse_proc_stat(&t));
        let mut prev = self.prev.lock().unwrap();
        let cpu_used_pct = match (*prev, now) {
            (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => (b1 - b0) as f64 * 100.0 / (t1 - t0) as f64,
            (None, Some((b, t))) if t > 0 => b as f64 * 100.0 / t as f64,
            _ => 0.0,
        };
        *prev = now.or(*prev);
        let (mem_total_bytes, mem_used_bytes) = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|t| parse_meminfo(&t))
            .unwrap_or((0, 0));
        let (disk_total_bytes, disk_used_bytes) = match nix::sys::statvfs::statvfs("/") {
            Ok(s) => {
                let frag = s.fragment_size();
                let total = s.blocks() * frag;
                (total, total.saturating_sub(s.blocks_free() * frag))
            }
            Err(_) => (0, 0),
        };
        Metrics {
            cpu_count,
            cpu_used_pct,
            mem_total_bytes,
            mem_used_bytes,
            disk_total_bytes,
            disk_used_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files() {
        let stat = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 100 0 50 800 50 0 0 0 0 0\n";
        assert_eq!(parse_proc_stat(stat), Some((150, 1000)));
        let mem = "MemTotal:        1000 kB\nMemFree:          100 kB\nMemAvailable:     400 kB\n";
        assert_eq!(parse_meminfo(mem), Some((1_024_000, 600 * 1024)));
    }
}
