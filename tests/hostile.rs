//! A real guest is the attacker (issue 9, "What it must show"). Root inside one sandbox writes its
//! console without end, floods its DNS resolver, fills its disk, fork-bombs, hogs memory, takes
//! over the agent's channel and floods it, and kills the agent; a neighbour sandbox on the same
//! server goes on working.
//!
//! For every case the suite measures and asserts:
//! - the server's RSS (`VmRSS` sampled every 50 ms, and `VmHWM`, the peak) stays under
//!   [`RSS_GROWTH_MAX_KIB`] over the baseline taken once the neighbour has booted and run a few
//!   commands;
//! - the neighbour answers commands during the attack within [`NEIGHBOUR_DEADLINE`]; its round
//!   trip (a `true` session: create + event stream to the exit) before and during is printed as a
//!   ratio, not asserted (machines are noisy);
//! - the attacked sandbox's state after the attack, as the case says (`running` or `failed`);
//! - the store lost nothing: every sandbox the suite made is listed with the state it must have.
//!
//! Cases run one at a time in this order (one attacked VM is reused until a case ends it; the
//! fork bomb gets its own); each prints a `hostile: ...` summary line. The server runs on a data dir of its own
//! (`$AIRLOCK_TEST_DATA_DIR-hostile-<pid>`, templates hard-linked from the shared one); every
//! sandbox is deleted at the end and no QEMU is left behind.

mod common;

use base64::Engine as _;
use common::*;
use serde_json::{json, Value};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How far the server's RSS may rise over its baseline during any attack: 64 MiB. What a guest can
/// make the host hold is bounded per sandbox: the agent client's HTTP/2 windows (8 MiB for the
/// connection), its largest reply (16 MiB, a listing), a 64 KiB watch line, a 256-byte hello line,
/// the console trimmer's 64 KiB tail. 64 MiB is that plus room for the allocator and the debug
/// build's tasks, and far below what an unbounded reader reaches: a flooding guest writes tens of
/// MiB per second.
const RSS_GROWTH_MAX_KIB: u64 = 64 << 10;

/// How long a neighbour's command may take during an attack: the agent client's call deadline.
const NEIGHBOUR_DEADLINE: Duration = Duration::from_secs(30);

/// The attacked VM's disk: small, so filling it is quick (the seed image is ~300 MB of it).
const ATTACKED_DISK_MIB: u64 = 512;
const ATTACKED_MEMORY_MIB: u64 = 512;

/// `crates/runtime/src/vmm/mod.rs`: `CONSOLE_CAP` and `CONSOLE_KEEP`.
const CONSOLE_CAP: u64 = 1 << 20;
const CONSOLE_KEEP: u64 = 64 << 10;

/// The guest side of the agent attacks (ptrace and pidfd_getfd against PID 1).
const HOSTILE_PY: &str = include_str!("guest/hostile.py");

struct Suite {
    s: Server,
    data: PathBuf,
    neighbour: String,
    baseline_rss_kib: u64,
    /// The VM the cases attack, until one of them ends it.
    attacked: Mutex<Option<String>>,
    /// Every sandbox the suite made, with the state it must be in.
    expected: Mutex<Vec<(String, &'static str)>>,
}

static SUITE: OnceLock<Suite> = OnceLock::new();
/// The server's pid and data dir, as soon as it runs (cleanup stops it even if the setup failed).
static STARTED: OnceLock<(u32, PathBuf)> = OnceLock::new();

fn suite() -> &'static Suite {
    SUITE.get_or_init(|| {
        let shared = test_data_dir();
        build_template(&shared, "seed");
        // A data dir per run (two runs at once must not share a store), and away with those of
        // runs that are gone.
        let prefix = format!("{}-hostile-", shared.display());
        let parent = shared.parent().unwrap();
        for entry in std::fs::read_dir(parent).unwrap().flatten() {
            let path = entry.path();
            let pid = path
                .to_str()
                .and_then(|p| p.strip_prefix(&prefix))
                .and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
                end_vms_left_in(&path);
                let _ = std::fs::remove_dir_all(&path);
            }
        }
        let data = data_dir_with_templates(&format!("hostile-{}", std::process::id()));
        let s = Server::start(&data);
        let _ = STARTED.set((s.child.id(), data.clone()));

        let neighbour = s.create(json!({
            "template": "seed", "timeout": "30m", "resources": { "memory_mib": 256 },
            "metadata": { "suite": "hostile", "role": "neighbour" },
        }));
        for _ in 0..3 {
            exec(&s, &neighbour, &["true"], "user", NEIGHBOUR_DEADLINE).expect("neighbour warms up");
        }
        let baseline_latency = latency(&s, &neighbour, 5);
        let pid = s.child.id();
        let baseline_rss_kib = status_kib(pid, "VmRSS");
        println!(
            "hostile: baseline server_rss={} MiB (peak so far {} MiB), bound = baseline + {} MiB; \
             neighbour exec round trip {:?}",
            baseline_rss_kib >> 10,
            status_kib(pid, "VmHWM") >> 10,
            RSS_GROWTH_MAX_KIB >> 10,
            baseline_latency
        );
        Suite {
            expected: Mutex::new(vec![(neighbour.clone(), "running")]),
            s,
            data,
            neighbour,
            baseline_rss_kib,
            attacked: Mutex::new(None),
        }
    })
}

impl Suite {
    fn rss_bound_kib(&self) -> u64 {
        self.baseline_rss_kib + RSS_GROWTH_MAX_KIB
    }

    /// The VM to attack: the one earlier cases left running, or a new one.
    fn attacked(&self) -> String {
        let mut slot = self.attacked.lock().unwrap();
        if let Some(id) = slot.as_ref() {
            return id.clone();
        }
        let id = self.s.create(json!({
            "template": "seed", "timeout": "30m",
            "resources": { "memory_mib": ATTACKED_MEMORY_MIB, "disk_mib": ATTACKED_DISK_MIB },
            "metadata": { "suite": "hostile", "role": "attacked" },
        }));
        self.expected.lock().unwrap().push((id.clone(), "running"));
        *slot = Some(id.clone());
        id
    }

    /// The attacked VM ended (`failed`): the next case boots another.
    fn attacked_ended(&self, id: &str, state: &'static str) {
        let mut slot = self.attacked.lock().unwrap();
        if slot.as_deref() == Some(id) {
            *slot = None;
        }
        for (x, s) in self.expected.lock().unwrap().iter_mut() {
            if x == id {
                *s = state;
            }
        }
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.data.join("sandboxes").join(id)
    }

    /// Nothing lost in the store: every sandbox made is there, in the state it must be in, and
    /// listed where that state is listed.
    fn check_store(&self) {
        let s = &self.s;
        let expected = self.expected.lock().unwrap().clone();
        let (_, live) = s.call("GET", "/v1/sandboxes?limit=100", None);
        let (_, failed) = s.call("GET", "/v1/sandboxes?state=failed&limit=100", None);
        let ids = |list: &Value| -> Vec<String> {
            list["sandboxes"]
                .as_array()
                .unwrap_or_else(|| panic!("a list: {list}"))
                .iter()
                .map(|x| x["id"].as_str().unwrap().to_string())
                .collect()
        };
        let (live, failed) = (ids(&live), ids(&failed));
        for (id, state) in &expected {
            let (status, sb) = s.call("GET", &format!("/v1/sandboxes/{id}"), None);
            assert_eq!((status, sb["state"].as_str()), (200, Some(*state)), "{id}: {sb}");
            let listed = match *state {
                "running" => live.contains(id),
                "failed" => failed.contains(id),
                _ => true,
            };
            assert!(
                listed,
                "{id} ({state}) missing from its list: live {live:?}, failed {failed:?}"
            );
        }
    }

    /// Before an attack: the neighbour's round trip, and the watch on the server starts.
    fn measure(&self) -> Measure {
        let before = latency(&self.s, &self.neighbour, 5);
        let pid = self.s.child.id();
        Measure {
            before,
            rss_at_start: status_kib(pid, "VmRSS"),
            rss: RssWatch::start(pid),
            cpu_at_start: cpu_ticks(pid),
            started: Instant::now(),
        }
    }

    /// Checks (a), (c) and (d) of a case, then its summary line (`detail`: the case's own numbers).
    fn report(&self, case: &str, attacked: &str, want: &'static str, m: Measure, during: Duration, detail: &str) {
        let pid = self.s.child.id();
        let max_rss = m.rss.finish();
        let (now, hwm) = (status_kib(pid, "VmRSS"), status_kib(pid, "VmHWM"));
        let cpu = (cpu_ticks(pid) - m.cpu_at_start) as f64 / clock_ticks() as f64;
        let (_, sb) = self.s.call("GET", &format!("/v1/sandboxes/{attacked}"), None);
        let ratio = during.as_secs_f64() / m.before.as_secs_f64();
        println!(
            "\nhostile: {case}: server RSS {} -> max {} -> {} MiB (VmHWM {} MiB, bound {} MiB), server CPU \
             {cpu:.1} s in {:.1} s | neighbour exec {:.0} ms before, {:.0} ms during, ratio {ratio:.2} | \
             attacked sandbox {}: {detail}",
            m.rss_at_start >> 10,
            max_rss >> 10,
            now >> 10,
            hwm >> 10,
            self.rss_bound_kib() >> 10,
            m.started.elapsed().as_secs_f64(),
            m.before.as_secs_f64() * 1000.0,
            during.as_secs_f64() * 1000.0,
            sb["state"].as_str().unwrap_or("?"),
        );
        assert!(
            max_rss <= self.rss_bound_kib() && hwm <= self.rss_bound_kib(),
            "{case}: server RSS {max_rss} KiB (peak {hwm} KiB) over its bound {} KiB",
            self.rss_bound_kib()
        );
        assert_eq!(sb["state"], want, "{case}: attacked sandbox {sb}");
        self.check_store();
    }
}

/// What [`Suite::measure`] took before an attack.
struct Measure {
    before: Duration,
    rss_at_start: u64,
    rss: RssWatch,
    cpu_at_start: u64,
    started: Instant,
}

/// User + system CPU time of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    // After the command: state is field 3, utime 14 and stime 15.
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    field(14) + field(15)
}

fn clock_ticks() -> u64 {
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) as u64 }
}

/// A field of /proc/<pid>/status, in KiB.
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The most a process's RSS reached while watched (sampled every 50 ms).
struct RssWatch {
    stop: Arc<AtomicBool>,
    max: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<()>,
}

impl RssWatch {
    fn start(pid: u32) -> RssWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let max = Arc::new(AtomicU64::new(status_kib(pid, "VmRSS")));
        let thread = std::thread::spawn({
            let (stop, max) = (stop.clone(), max.clone());
            move || {
                while !stop.load(Ordering::Relaxed) {
                    max.fetch_max(status_kib(pid, "VmRSS"), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        });
        RssWatch { stop, max, thread }
    }

    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap();
        self.max.load(Ordering::Relaxed)
    }
}

/// What a finished command left.
#[derive(Debug)]
struct Exec {
    stdout: String,
    stderr: String,
    exit: Value,
    took: Duration,
}

/// Start a command in `id`; its session id, or the answer that refused it.
fn start(s: &Server, id: &str, argv: &[&str], user: &str, timeout: &str, within: Duration) -> Result<String, String> {
    let res = ureq::post(&format!("{}/v1/sandboxes/{id}/sessions", s.url))
        .set("Authorization", &format!("Bearer {}", s.key))
        .timeout(within)
        .send_json(json!({ "argv": argv, "user": user, "timeout": timeout }));
    match res {
        Ok(r) => Ok(r.into_json::<Value>().unwrap()["id"].as_str().unwrap().to_string()),
        Err(ureq::Error::Status(status, r)) => Err(format!("{status} {}", r.into_string().unwrap_or_default())),
        Err(e) => Err(format!("no answer: {e}")),
    }
}

/// Read a session's events to its exit, all within `within`.
fn wait(s: &Server, id: &str, sid: &str, within: Duration) -> Result<Exec, String> {
    let started = Instant::now();
    let resp = ureq::get(&format!("{}/v1/sandboxes/{id}/sessions/{sid}/stream", s.url))
        .set("Authorization", &format!("Bearer {}", s.key))
        .timeout(within)
        .call()
        .map_err(|e| format!("stream: {e}"))?;
    let (mut stdout, mut stderr, mut event, mut data) = (Vec::new(), Vec::new(), String::new(), String::new());
    for line in std::io::BufReader::new(resp.into_reader()).lines() {
        let line = line.map_err(|e| format!("stream: {e}"))?;
        if let Some(v) = line.strip_prefix("event:") {
            event = v.trim().into();
        } else if let Some(v) = line.strip_prefix("data:") {
            data.push_str(v.trim_start());
        } else if line.is_empty() && !event.is_empty() {
            let d: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
            let bytes = || {
                base64::engine::general_purpose::STANDARD
                    .decode(d["data"].as_str().unwrap_or(""))
                    .unwrap_or_default()
            };
            match event.as_str() {
                "stdout" => stdout.extend(bytes()),
                "stderr" => stderr.extend(bytes()),
                "process_exited" => {
                    return Ok(Exec {
                        stdout: String::from_utf8_lossy(&stdout).into(),
                        stderr: String::from_utf8_lossy(&stderr).into(),
                        exit: d,
                        took: started.elapsed(),
                    })
                }
                "error" => return Err(format!("error event: {d}")),
                _ => {}
            }
            event.clear();
            data.clear();
        }
    }
    Err("the stream ended before the process did".into())
}

/// Run a command to its end, all within `within`.
fn exec(s: &Server, id: &str, argv: &[&str], user: &str, within: Duration) -> Result<Exec, String> {
    let started = Instant::now();
    let timeout = format!("{}s", within.as_secs().max(1));
    let sid = start(s, id, argv, user, &timeout, within)?;
    let mut done = wait(
        s,
        id,
        &sid,
        within.saturating_sub(started.elapsed()).max(Duration::from_secs(1)),
    )?;
    done.took = started.elapsed();
    Ok(done)
}

/// Median round trip of `n` `true` commands in `id`; each must succeed within the deadline.
fn latency(s: &Server, id: &str, n: usize) -> Duration {
    let mut took: Vec<Duration> = (0..n)
        .map(|_| {
            let e = exec(s, id, &["true"], "user", NEIGHBOUR_DEADLINE)
                .unwrap_or_else(|e| panic!("neighbour {id} did not answer: {e}"));
            assert_eq!(e.exit["exit_code"], 0, "neighbour: {e:?}");
            assert!(e.took < NEIGHBOUR_DEADLINE, "neighbour took {:?}", e.took);
            e.took
        })
        .collect();
    took.sort();
    took[n / 2]
}

/// Root in `id` runs `script` with sh; it must exit 0. Its stdout.
fn root_sh(s: &Server, id: &str, script: &str) -> String {
    let e =
        exec(s, id, &["sh", "-c", script], "root", Duration::from_secs(60)).unwrap_or_else(|e| panic!("{script}: {e}"));
    assert_eq!(e.exit["exit_code"], 0, "{script}: {e:?}");
    e.stdout
}

/// Poll until `id` runs a command again (after an attack); how long that took.
fn answers_again(s: &Server, id: &str, within: Duration) -> Result<Duration, String> {
    let started = Instant::now();
    let mut last = String::new();
    while started.elapsed() < within {
        match exec(s, id, &["true"], "user", Duration::from_secs(30)) {
            Ok(e) if e.exit["exit_code"] == 0 => return Ok(started.elapsed()),
            Ok(e) => last = format!("{e:?}"),
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Err(last)
}

/// Wait for a line holding `needle` in a sandbox's console log (the guest writes /dev/ttyS0).
fn wait_console(dir: &Path, needle: &str, within: Duration) -> String {
    let started = Instant::now();
    loop {
        for log in ["console.log", "console.log.1"] {
            let text = std::fs::read(dir.join(log)).unwrap_or_default();
            if let Some(line) = String::from_utf8_lossy(&text).lines().find(|l| l.contains(needle)) {
                return line.to_string();
            }
        }
        assert!(started.elapsed() < within, "no {needle:?} on the console in {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn signal(s: &Server, id: &str, sid: &str, sig: &str) {
    let (status, r) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions/{sid}/signal"),
        Some(json!({ "signal": sig })),
    );
    assert!(status == 204 || status == 409, "signal {sig}: {status} {r}");
}

/// Allocated bytes of a file (sparse holes hold none).
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// Case 1: root writes /dev/ttyS0 (the guest console) without end. The host's console.log stays
/// under its cap (the runtime trims it every 250 ms), the sandbox keeps running and answering.
fn console_flood() {
    let suite = suite();
    let s = &suite.s;
    let id = suite.attacked();
    let log = suite.sandbox_dir(&id).join("console.log");
    let kept = suite.sandbox_dir(&id).join("console.log.1");
    let m = suite.measure();
    let line = "A".repeat(100);
    let flood = start(
        s,
        &id,
        &["sh", "-c", &format!("exec yes {line} > /dev/ttyS0")],
        "root",
        "300s",
        Duration::from_secs(60),
    )
    .unwrap();

    // Watch the log while the guest floods it (20 s, and until it was trimmed at least once).
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = std::thread::spawn({
        let (stop, log, kept) = (stop.clone(), log.clone(), kept.clone());
        move || {
            let (mut max_len, mut max_alloc, mut max_kept, mut written, mut trims, mut prev) = (0, 0, 0, 0, 0, 0);
            while !stop.load(Ordering::Relaxed) {
                let len = file_len(&log);
                max_len = max_len.max(len);
                max_alloc = max_alloc.max(allocated(&log));
                max_kept = max_kept.max(file_len(&kept));
                if len < prev {
                    trims += 1;
                    written += len;
                } else {
                    written += len - prev;
                }
                prev = len;
                std::thread::sleep(Duration::from_millis(20));
            }
            (max_len, max_alloc, max_kept, written, trims)
        }
    });
    let flood_start = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    let during = latency(s, &suite.neighbour, 5);
    let own = exec(s, &id, &["true"], "user", Duration::from_secs(60));
    while flood_start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(200));
    }
    // The trimmer may run late on a loaded machine: give it up to 60 s to have trimmed once.
    while flood_start.elapsed() < Duration::from_secs(60) && file_len(&kept) == 0 {
        std::thread::sleep(Duration::from_millis(200));
    }
    let flooded_for = flood_start.elapsed();
    signal(s, &id, &flood, "SIGKILL");
    let stopped = wait(s, &id, &flood, Duration::from_secs(60));
    std::thread::sleep(Duration::from_secs(1)); // one more trim
    stop.store(true, Ordering::Relaxed);
    let (max_len, max_alloc, max_kept, written, trims) = watcher.join().unwrap();
    let own = own.unwrap_or_else(|e| panic!("the flooding sandbox stopped answering: {e}"));
    let detail = format!(
        "flooded its console for {:.1} s, >= {} KiB written; console.log peaked at {} KiB ({} KiB \
         allocated, cap {} KiB), trimmed {trims} times, console.log.1 at most {} KiB, now {} KiB; a \
         command in it took {:.0} ms during the flood",
        flooded_for.as_secs_f64(),
        written >> 10,
        max_len >> 10,
        max_alloc >> 10,
        CONSOLE_CAP >> 10,
        max_kept >> 10,
        file_len(&log) >> 10,
        own.took.as_secs_f64() * 1000.0,
    );
    println!("console flood: the flood ended: {:?}", stopped.map(|e| e.exit));
    assert!(
        written > CONSOLE_CAP && trims >= 1,
        "the flood never passed the cap: {written} bytes"
    );
    // Between two trims (250 ms apart, later on a loaded machine) the guest adds what it
    // writes in that time: well under 8 MiB at the serial port's speed.
    assert!(
        max_len <= CONSOLE_CAP + (8 << 20),
        "console.log reached {max_len} bytes"
    );
    assert!(
        max_alloc <= CONSOLE_CAP + (8 << 20),
        "console.log held {max_alloc} bytes"
    );
    assert!(max_kept <= CONSOLE_KEEP, "console.log.1 reached {max_kept} bytes");
    assert!(file_len(&log) <= CONSOLE_CAP);
    answers_again(s, &id, Duration::from_secs(60)).expect("answers after the flood");
    suite.report("console_flood", &id, "running", m, during, &detail);
}

/// Case 7: root sends 10,000 DNS queries for names nobody allowed, one after another (each waits
/// for its REFUSED). Every one is judged and counted in the sandbox's egress report, while the
/// server's log gets a bounded number of lines for them (a few decisions per window, then one
/// summary), and the neighbour goes on answering.
fn dns_flood() {
    let suite = suite();
    let s = &suite.s;
    let id = suite.attacked();
    let counted = |s: &Server| {
        let (_, e) = s.call("GET", &format!("/v1/sandboxes/{id}/egress"), None);
        e["counters"]["dns_denied"].as_u64().unwrap_or(0)
    };
    let denied_before = counted(s);
    let log_before = std::fs::read_to_string(&s.log).unwrap_or_default().len();
    let m = suite.measure();
    let script = "import socket, struct\n\
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)\n\
        answered = 0\n\
        for i in range(10000):\n\
        \x20   name = b''.join(bytes([len(l)]) + l for l in [b'q%d' % i, b'flood', b'test']) + b'\\0'\n\
        \x20   s.sendto(struct.pack('>HHHHHH', i & 0xffff, 0x0100, 1, 0, 0, 0) + name + struct.pack('>HH', 1, 1), ('100.96.0.1', 53))\n\
        \x20   try:\n\
        \x20       s.recv(512); answered += 1\n\
        \x20   except OSError:\n\
        \x20       pass\n\
        print(answered)\n";
    let flood = start(
        s,
        &id,
        &["python3", "-c", script],
        "root",
        "600s",
        Duration::from_secs(60),
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let during = latency(s, &suite.neighbour, 5);
    let done = wait(s, &id, &flood, Duration::from_secs(600)).expect("the queries end");
    let answered: u64 = done.stdout.trim().parse().unwrap_or(0);
    let judged = counted(s) - denied_before;
    // Past the window the summary of the last one is written with the sandbox's next decision or
    // at its end; what the flood wrote is what the log holds now.
    let log = std::fs::read_to_string(&s.log).unwrap_or_default();
    let lines = log[log_before.min(log.len())..]
        .lines()
        .filter(|l| l.contains(&id) && l.contains("egress"))
        .count();
    let detail = format!(
        "sent 10000 DNS queries for names not allowed, {answered} answered, {judged} judged and \
         counted as denied; {lines} server log lines about its egress in {:.1} s",
        m.started.elapsed().as_secs_f64()
    );
    assert!(judged >= 9000, "{detail}");
    assert!(lines <= 200, "{detail}");
    suite.report("dns_flood", &id, "running", m, during, &detail);
}

/// Case 2: root allocates past the VM's memory. The guest's OOM killer ends the hog; QEMU's RSS
/// stays at the VM's memory plus its own overhead; the sandbox keeps running.
fn memory_hog() {
    let suite = suite();
    let s = &suite.s;
    let id = suite.attacked();
    let qemu = qemu_pid(s, &id) as u32;
    let qemu_before = status_kib(qemu, "VmRSS");
    let m = suite.measure();
    // Hogs, one after another for 20 s: each grows by 16 MiB until the guest's OOM killer ends it.
    let hog = "l = []\nwhile True:\n    l.append(b'x' * (16 << 20))\n";
    let script = format!(
        "end=$(($(date +%s) + 20)); while [ $(date +%s) -lt $end ]; do python3 -c \"{hog}\"; echo exit=$?; done"
    );
    let sid = start(s, &id, &["sh", "-c", &script], "root", "240s", Duration::from_secs(60)).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let during = latency(s, &suite.neighbour, 5);
    let done = wait(s, &id, &sid, Duration::from_secs(240)).expect("the hogs end");
    let oom = root_sh(s, &id, "dmesg | grep -c -i 'out of memory' || true");
    let (qemu_rss, qemu_peak) = (status_kib(qemu, "VmRSS"), status_kib(qemu, "VmHWM"));
    let killed = done.stdout.lines().filter(|l| *l == "exit=137").count();
    let detail = format!(
        "{} hogs in {:.1} s, {killed} ended by SIGKILL ({:?}), {} OOM kills in the guest's log; QEMU \
         RSS {} MiB before, {} MiB after, peak {} MiB (VM memory {} MiB)",
        done.stdout.lines().count(),
        done.took.as_secs_f64(),
        done.stdout.lines().collect::<Vec<_>>(),
        oom.trim(),
        qemu_before >> 10,
        qemu_rss >> 10,
        qemu_peak >> 10,
        ATTACKED_MEMORY_MIB
    );
    assert!(killed >= 1, "the guest's OOM killer ends the hogs: {done:?}");
    assert!(oom.trim().parse::<u32>().unwrap_or(0) >= 1, "no OOM in the guest's log");
    // QEMU holds the guest's RAM plus its own: TCG's code buffer, device state, a few threads.
    assert!(
        qemu_peak <= (ATTACKED_MEMORY_MIB + 384) << 10,
        "QEMU's RSS peaked at {qemu_peak} KiB for a {ATTACKED_MEMORY_MIB} MiB VM"
    );
    answers_again(s, &id, Duration::from_secs(60)).expect("answers after the OOM");
    suite.report("memory_hog", &id, "running", m, during, &detail);
}

/// Case 3: root fills the root disk (`dd` to ENOSPC). The host's overlay stays under the disk's
/// size (plus qcow2 metadata), the sandbox answers afterwards and frees the space again.
fn disk_fill() {
    let suite = suite();
    let s = &suite.s;
    let id = suite.attacked();
    let overlay = suite.sandbox_dir(&id).join("disk.qcow2");
    let overlay_before = allocated(&overlay);
    let m = suite.measure();
    let sid = start(
        s,
        &id,
        &["sh", "-c", "dd if=/dev/zero of=/fill bs=1M; sync; df -m / | tail -1"],
        "root",
        "600s",
        Duration::from_secs(60),
    )
    .unwrap();
    let during = latency(s, &suite.neighbour, 5); // dd takes seconds under TCG: measure at once
    let done = wait(s, &id, &sid, Duration::from_secs(600)).expect("dd ends");
    let (len, alloc) = (file_len(&overlay), allocated(&overlay));
    println!("disk fill: dd: {} {}", done.stderr.trim(), done.exit);
    let mut detail = format!(
        "dd hit ENOSPC after {:.1} s (guest df: {}); host overlay {} MiB allocated before, {} MiB \
         allocated and {} MiB long when full (disk {} MiB, bound {} MiB)",
        done.took.as_secs_f64(),
        done.stdout.split_whitespace().collect::<Vec<_>>().join(" "),
        overlay_before >> 20,
        alloc >> 20,
        len >> 20,
        ATTACKED_DISK_MIB,
        ATTACKED_DISK_MIB + 32,
    );
    assert!(
        done.stderr.contains("No space left on device"),
        "dd did not fill the disk: {done:?}"
    );
    // qcow2 metadata for a 512 MiB disk is well under a MiB (8-byte L2 and 2-byte refcount
    // entries per 64 KiB cluster); 32 MiB of slack is generous.
    let bound = (ATTACKED_DISK_MIB + 32) << 20;
    assert!(
        len <= bound && alloc <= bound,
        "overlay {len} bytes long, {alloc} allocated"
    );
    answers_again(s, &id, Duration::from_secs(60)).expect("answers with a full disk");
    let freed = root_sh(s, &id, "rm /fill && (fstrim -v / 2>&1 || true) && df -m / | tail -1");
    println!("disk fill: after rm: {}", freed.trim());
    detail.push_str(&format!(
        "; answers with a full disk, then removed the file (overlay then {} MiB allocated)",
        allocated(&overlay) >> 20
    ));
    suite.report("disk_fill", &id, "running", m, during, &detail);
}

/// Case 4: root runs a fork bomb (each process forks until a deadline 15 s on; the session's
/// timeout kills the process group at 20 s, if the agent gets to run). The neighbour keeps
/// answering and the bombed sandbox keeps running (state `running`: the VM stays up, the agent
/// is PID 1, which the OOM killer never picks). Whether it answers again is measured, not
/// asserted: nothing in the guest protects the agent from its own root (no pids or memory limit
/// for sessions), and a bomb that exhausts the guest's memory can starve the agent for minutes
/// (seen: recovered after 25-55 s in most runs, 242 s in one, not within 400 s in one with an
/// unbounded bomb). So the bomb gets a VM of its own, deleted after the case.
fn fork_bomb() {
    let suite = suite();
    let s = &suite.s;
    let id = s.create(json!({
        "template": "seed", "timeout": "30m",
        "resources": { "memory_mib": ATTACKED_MEMORY_MIB, "disk_mib": ATTACKED_DISK_MIB },
        "metadata": { "suite": "hostile", "role": "bombed" },
    }));
    suite.expected.lock().unwrap().push((id.clone(), "running"));
    let m = suite.measure();
    // Bounded twice: each process forks only until the deadline (bash's EPOCHSECONDS costs no
    // fork), and the session's timeout kills the process group, if the agent gets to run.
    let bomb = start(
        s,
        &id,
        &[
            "bash",
            "-c",
            "end=$((EPOCHSECONDS + 15)); b() { while [ $EPOCHSECONDS -lt $end ]; do b & done; }; b",
        ],
        "root",
        "20s",
        Duration::from_secs(60),
    )
    .unwrap();
    let bombed = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    let during = latency(s, &suite.neighbour, 5);
    let own = exec(s, &id, &["true"], "user", Duration::from_secs(60));
    println!("fork bomb: a command in the bombed sandbox: {own:?}");
    let done = wait(s, &id, &bomb, Duration::from_secs(180));
    println!("fork bomb: the bomb's session ended: {done:?}");
    let back = answers_again(s, &id, Duration::from_secs(120));
    let answered = bombed.elapsed();
    let console = std::fs::read(suite.sandbox_dir(&id).join("console.log")).unwrap_or_default();
    let console = String::from_utf8_lossy(&console);
    // Its last lines, less the earlier console flood's.
    let tail: Vec<&str> = console
        .lines()
        .filter(|l| !l.starts_with("AAAA"))
        .rev()
        .take(10)
        .collect();
    println!(
        "fork bomb: answers again: {back:?} ({answered:?} after the bomb started); the guest's console ends: {:?}",
        tail.iter().rev().collect::<Vec<_>>()
    );
    let left = match &back {
        Ok(_) => root_sh(s, &id, "ps -e --no-headers | wc -l").trim().to_string(),
        Err(_) => "?".into(),
    };
    let detail = format!(
        "a command in it during the bomb: {}; the bomb's session: {}; {} {:.1} s after the bomb started; \
         {} processes left in the guest",
        match &own {
            Ok(e) => format!("exit {} in {:.1} s", e.exit, e.took.as_secs_f64()),
            Err(e) => format!("failed: {e}"),
        },
        match &done {
            Ok(e) => format!("ended {}", e.exit),
            Err(e) => format!("no end seen: {e}"),
        },
        if back.is_ok() {
            "it answers again"
        } else {
            "STILL NOT ANSWERING"
        },
        answered.as_secs_f64(),
        left
    );
    suite.report("fork_bomb", &id, "running", m, during, &detail);
    s.delete(&id);
    suite.attacked_ended(&id, "deleted");
}

/// Case 5: root freezes the agent (ptrace on every thread of PID 1), takes a copy of its port's
/// fd (pidfd_getfd) and for 30 s writes garbage into the channel and swallows what the host
/// sends. The server's RSS stays bounded, the attacked sandbox's calls fail with a clear error
/// (502 sandbox_unreachable) in bounded time, and once the agent is let go it answers again.
fn agent_channel_takeover() {
    let suite = suite();
    let s = &suite.s;
    let id = suite.attacked();
    put_file(s, &id, "/tmp/hostile.py", HOSTILE_PY.as_bytes());
    let m = suite.measure();
    const FLOOD_SECS: u64 = 30;
    root_sh(
        s,
        &id,
        &format!("setsid python3 /tmp/hostile.py takeover {FLOOD_SECS} > /tmp/takeover.log 2>&1 < /dev/null &"),
    );
    // The attacker says on the console when the agent is frozen and the flood starts.
    let frozen = wait_console(&suite.sandbox_dir(&id), "frozen_threads", Duration::from_secs(60));
    let flood_start = Instant::now();
    println!("takeover: {}", frozen.trim());
    let (refusals, during) = std::thread::scope(|scope| {
        let neighbour = scope.spawn(|| latency(s, &suite.neighbour, 5));
        let mut refusals = Vec::new();
        while flood_start.elapsed() < Duration::from_secs(FLOOD_SECS - 12) {
            let t = Instant::now();
            let r = exec(s, &id, &["true"], "user", Duration::from_secs(60));
            println!(
                "takeover: a call to the attacked sandbox: {:?} after {:?}",
                r.as_ref().map(|e| &e.exit),
                t.elapsed()
            );
            refusals.push((r, t.elapsed()));
        }
        (refusals, neighbour.join().unwrap())
    });
    while flood_start.elapsed() < Duration::from_secs(FLOOD_SECS + 2) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let back = answers_again(s, &id, Duration::from_secs(90));
    println!("takeover: the agent answers again {back:?} after the flood ended");
    let log = back
        .as_ref()
        .ok()
        .map(|_| root_sh(s, &id, "cat /tmp/takeover.log"))
        .unwrap_or_default();
    println!("takeover: the attacker's log: {}", log.trim());
    for (r, took) in &refusals {
        let err = r
            .as_ref()
            .err()
            .unwrap_or_else(|| panic!("a call succeeded through a hijacked channel: {r:?}"));
        assert!(
            err.starts_with("502") && err.contains("sandbox_unreachable"),
            "not a clear error: {err}"
        );
        assert!(*took < Duration::from_secs(45), "the refusal took {took:?}");
    }
    assert!(!refusals.is_empty());
    assert!(
        log.contains("\"frozen_threads\"") && log.contains("\"sent\""),
        "the attack did not run: {log}"
    );
    let back = back.expect("the agent answers once let go");
    let detail = format!(
        "the attacker (agent frozen, its port's fd taken) wrote and read {}; {} calls to the sandbox \
         meanwhile all failed 502 sandbox_unreachable after {:?}; it answers again {:.1} s after the flood",
        log.lines().last().unwrap_or(""),
        refusals.len(),
        refusals
            .iter()
            .map(|(_, t)| format!("{:.1} s", t.as_secs_f64()))
            .collect::<Vec<_>>(),
        back.as_secs_f64()
    );
    suite.report("agent_channel_takeover", &id, "running", m, during, &detail);
}

/// Case 6: root kills the agent. `kill -KILL 1` does nothing (the kernel drops signals to init
/// that it has no handler for); making PID 1 call exit_group (ptrace) panics the guest kernel and
/// the VM stops: the sandbox ends `failed`, and nothing else is touched. (The attack is over in a
/// moment: the neighbour's "during" is measured right after the VM died.)
fn agent_killed() {
    let suite = suite();
    let s = &suite.s;
    let id = suite.attacked();
    let qemu = qemu_pid(s, &id);
    let r = root_sh(s, &id, "kill -KILL 1; echo kill=$?");
    let still = exec(s, &id, &["true"], "user", Duration::from_secs(30));
    println!(
        "agent kill: `kill -KILL 1`: {} -> then a command: {:?}",
        r.trim(),
        still.as_ref().map(|e| &e.exit)
    );
    assert_eq!(still.expect("the agent survives kill -KILL 1").exit["exit_code"], 0);

    put_file(s, &id, "/tmp/hostile.py", HOSTILE_PY.as_bytes());
    // Opened now, readable after the runtime removes the dead VM's dir.
    let mut console = std::fs::File::open(suite.sandbox_dir(&id).join("console.log")).unwrap();
    let m = suite.measure();
    let killed_at = Instant::now();
    // The VM may die before the agent reports the session's end: any answer will do.
    let r = exec(
        s,
        &id,
        &["python3", "/tmp/hostile.py", "kill"],
        "root",
        Duration::from_secs(30),
    );
    println!("agent kill: the killing command: {r:?}");
    wait_state(s, &id, "failed", Duration::from_secs(60))
        .unwrap_or_else(|sb| panic!("not failed 60 s after its agent was killed: {sb}"));
    let failed_after = killed_at.elapsed();
    suite.attacked_ended(&id, "failed");
    let during = latency(s, &suite.neighbour, 5);
    assert!(
        !Path::new(&format!("/proc/{qemu}")).exists()
            || std::fs::read_to_string(format!("/proc/{qemu}/stat")).is_ok_and(|st| st.contains(") Z")),
        "QEMU {qemu} still runs"
    );
    let mut text = String::new();
    let _ = std::io::Read::read_to_string(&mut console, &mut text);
    let panic = text
        .lines()
        .find(|l| l.contains("Kernel panic"))
        .unwrap_or("")
        .to_string();
    println!("agent kill: the guest's console: {panic}");
    assert!(!suite.sandbox_dir(&id).exists(), "the dead VM's dir is removed");
    let (status, err) = s.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        Some(json!({ "argv": ["true"] })),
    );
    assert_eq!((status, err["code"].as_str()), (409, Some("invalid_state")), "{err}");
    assert!(!listed_by_default(s, &id), "a failed sandbox is not live");
    let detail = format!(
        "`kill -KILL 1` is ignored (a command answers after it); exit_group injected into PID 1: \
         `{}`, failed {:.1} s after the attack started, QEMU gone, its dir removed, new sessions 409",
        panic.trim(),
        failed_after.as_secs_f64(),
    );
    suite.report("agent_killed", &id, "failed", m, during, &detail);
}

fn main() {
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let mut args = libtest_mimic::Arguments::from_args();
    // One attack at a time: the cases share the attacked VM and measure the neighbour's latency.
    args.test_threads = Some(1);
    let t = trial;
    let tests = vec![
        t("console_flood", console_flood),
        t("dns_flood", dns_flood),
        t("memory_hog", memory_hog),
        t("disk_fill", disk_fill),
        t("fork_bomb", fork_bomb),
        t("agent_channel_takeover", agent_channel_takeover),
        t("agent_killed", agent_killed),
    ];
    let started = Instant::now();
    let conclusion = libtest_mimic::run(&args, tests);
    cleanup(conclusion.has_failed());
    reap_orphans();
    if SUITE.get().is_some() {
        println!("hostile: suite took {:?}", started.elapsed());
    }
    conclusion.exit();
}

/// Delete every sandbox the suite made, stop the server, check no QEMU of its data dir is left
/// (killing any by PID: they are this suite's own), remove the data dir. After a failure, the
/// end of the server's log is shown first (it goes with the data dir).
fn cleanup(failed: bool) {
    let Some((server, data)) = STARTED.get() else { return };
    if failed {
        for entry in std::fs::read_dir(data).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with("serve-") {
                let log = std::fs::read_to_string(entry.path()).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(60).collect();
                println!("hostile: the server's log ends:");
                for line in tail.iter().rev() {
                    println!("  {line}");
                }
            }
        }
    }
    if let Some(suite) = SUITE.get() {
        let s = &suite.s;
        for q in ["limit=100", "state=failed&limit=100"] {
            let (_, list) = s.call("GET", &format!("/v1/sandboxes?{q}"), None);
            for sb in list["sandboxes"].as_array().into_iter().flatten() {
                let id = sb["id"].as_str().unwrap_or_default();
                let (_, r) = s.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
                let done = r["operation"]["id"].as_str().map(|op| s.wait_op(op));
                if done.as_ref().is_none_or(|op| op["state"] != "succeeded") {
                    println!("cleanup: deleting {id}: {r} {done:?}");
                }
            }
        }
    }
    unsafe { libc::kill(*server as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{server}")).exists() && Instant::now() < deadline {
        unsafe { libc::waitpid(*server as i32, std::ptr::null_mut(), libc::WNOHANG) };
        std::thread::sleep(Duration::from_millis(100));
    }
    let needle = data.join("sandboxes").display().to_string();
    let mut leaked = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&needle) {
            leaked.push(pid);
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    reap_orphans();
    let _ = std::fs::remove_dir_all(data);
    assert!(leaked.is_empty(), "QEMUs left running after cleanup: {leaked:?}");
}
