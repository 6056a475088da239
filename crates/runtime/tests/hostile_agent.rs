//! A hostile guest's agent against the host's client (`AgentClient`): endless reply bodies, a
//! 100 MiB watch line and event frame, calls never answered, garbage instead of HTTP/2. Each
//! call must fail with a clear error within its deadline, the host's memory must stay bounded,
//! and a well-behaved sandbox of the same runtime must keep answering meanwhile.
//!
//! The tests run one at a time (`SERIAL`) so that this process's RSS measures one abuse at once.
//! Run with `--nocapture` to see the numbers.
#![allow(clippy::await_holding_lock)] // SERIAL, below

use airlock_proto::ErrorCode;
use airlock_runtime::agent::{AgentError, Deadlines, ERROR_BODY_MAX, LIST_MAX, RECORD_MAX, WATCH_LINE_MAX};
use airlock_runtime::fake::{self, Hostile};
use airlock_runtime::{AgentClient, CreateVm, Resources, Runtime, Vm};
use futures_util::StreamExt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// Held across awaits on purpose: it only serializes the tests (each on its own runtime), so no
// task of the same runtime ever waits for it.
static SERIAL: Mutex<()> = Mutex::new(());

/// Short deadlines, so a silent agent costs a test about a second.
const DEADLINES: Deadlines = Deadlines {
    call: Duration::from_millis(1000),
    slow_call: Duration::from_millis(1500),
};

/// How much this process may grow while an agent misbehaves (the abuse is 100 MiB or endless).
const RSS_BOUND_KIB: u64 = 64 << 10;

/// A `/proc/self/status` field in KiB (`VmRSS`, `VmHWM`).
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(&format!("{field}:"))).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

struct Bench {
    _tmp: tempfile::TempDir,
    rt: Runtime,
    good: Arc<Vm>,
    bad: Arc<Vm>,
    good_agent: AgentClient,
    /// A session to the bad sandbox opened while its agent still behaved.
    bad_agent: AgentClient,
}

async fn bench() -> Bench {
    let tmp = tempfile::tempdir().unwrap();
    fake::install_template(tmp.path(), "seed").unwrap();
    let rt = Runtime::open(fake::options(tmp.path())).await.unwrap();
    let create = || CreateVm {
        id: None,
        template: "seed".into(),
        resources: Resources::default(),
        image: None,
        env: Default::default(),
        volumes: Vec::new(),
    };
    let good = rt.create(create()).await.unwrap();
    let bad = rt.create(create()).await.unwrap();
    let good_agent = good.agent().await.unwrap().with_deadlines(DEADLINES);
    let bad_agent = bad.agent().await.unwrap().with_deadlines(DEADLINES);
    Bench {
        _tmp: tmp,
        rt,
        good,
        bad,
        good_agent,
        bad_agent,
    }
}

impl Bench {
    async fn health_rtt(&self) -> Duration {
        let t = Instant::now();
        let h = tokio::time::timeout(Duration::from_secs(2), self.good_agent.health()).await;
        h.expect("the good sandbox answers health within 2 s")
            .expect("the good sandbox is healthy");
        t.elapsed()
    }

    /// Median health round-trip of the good sandbox, nothing else going on.
    async fn health_before(&self) -> Duration {
        let mut rtts = Vec::new();
        for _ in 0..9 {
            rtts.push(self.health_rtt().await);
        }
        rtts.sort();
        rtts[4]
    }

    /// Run `abuse` (calls to the bad sandbox) while the good sandbox is asked for its health
    /// every 10 ms. Returns the abuse's result, how long it took, and the health round-trips
    /// (each answered within 2 s, or the test fails).
    async fn during<T: Send + 'static>(
        &self,
        abuse: impl Future<Output = T> + Send + 'static,
    ) -> (T, Duration, Vec<Duration>) {
        let started = Instant::now();
        let task = tokio::spawn(async move {
            let out = abuse.await;
            (out, started.elapsed())
        });
        let mut rtts = Vec::new();
        loop {
            rtts.push(self.health_rtt().await);
            if task.is_finished() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (out, took) = task.await.unwrap();
        (out, took, rtts)
    }

    async fn delete(self) {
        self.rt.delete(self.good.id()).await.unwrap();
        self.rt.delete(self.bad.id()).await.unwrap();
    }
}

/// One abuse, measured: fails as `check` expects, within `within`, the process grows less than
/// `RSS_BOUND_KIB`, and the good sandbox answers throughout.
async fn abuse<T, F>(b: &Bench, name: &str, within: Duration, call: F, check: impl FnOnce(&T))
where
    T: Send + std::fmt::Debug + 'static,
    F: Future<Output = T> + Send + 'static,
{
    let before = b.health_before().await;
    let (rss0, hwm0) = (status_kib("VmRSS"), status_kib("VmHWM"));
    let (out, took, rtts) = b.during(call).await;
    let (rss1, hwm1) = (status_kib("VmRSS"), status_kib("VmHWM"));
    let worst = rtts.iter().max().copied().unwrap_or_default();
    eprintln!(
        "{name}: failed after {took:?} with {out:?}\n  RSS {rss0} -> {rss1} KiB (+{} KiB), peak {hwm0} -> {hwm1} KiB; \
         good health {before:?} before, {} checks during, worst {worst:?}",
        rss1.saturating_sub(rss0),
        rtts.len()
    );
    check(&out);
    assert!(took < within, "{name}: took {took:?}, over {within:?}");
    assert!(
        rss1.saturating_sub(rss0) < RSS_BOUND_KIB,
        "{name}: RSS grew by {} KiB",
        rss1 - rss0
    );
    assert!(
        hwm1.saturating_sub(rss0) < RSS_BOUND_KIB,
        "{name}: peak RSS {hwm1} KiB, {} KiB over the start",
        hwm1 - rss0
    );
    assert!(!rtts.is_empty());
}

fn protocol_error_naming(limit: usize) -> impl Fn(&Result<String, AgentError>) {
    move |r| match r {
        Err(AgentError::Protocol(m)) => {
            assert!(m.contains(&format!("limit of {limit} bytes")), "{m}")
        }
        other => panic!("want a protocol error naming {limit}, got {other:?}"),
    }
}

fn transport_error_containing(needle: &'static str) -> impl Fn(&Result<String, AgentError>) {
    move |r| match r {
        Err(AgentError::Transport(m)) => assert!(m.contains(needle), "{m}"),
        other => panic!("want a transport error with {needle:?}, got {other:?}"),
    }
}

fn shown<T: std::fmt::Debug>(r: Result<T, AgentError>) -> Result<String, AgentError> {
    r.map(|v| format!("{v:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_reply_bodies_are_cut_at_their_limits() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let b = bench().await;
    assert!(fake::set_hostile(
        &b.bad.handle,
        Some(Hostile::EndlessBody { status: 200 })
    ));
    let agent = b.bad_agent.clone();
    let within = Duration::from_secs(10);
    abuse(
        &b,
        "endless list (processes)",
        within,
        async move { shown(agent.processes().await) },
        protocol_error_naming(LIST_MAX),
    )
    .await;
    let agent = b.bad_agent.clone();
    abuse(
        &b,
        "endless record (health)",
        within,
        async move { shown(agent.health().await) },
        protocol_error_naming(RECORD_MAX),
    )
    .await;
    assert!(fake::set_hostile(
        &b.bad.handle,
        Some(Hostile::EndlessBody { status: 500 })
    ));
    let agent = b.bad_agent.clone();
    abuse(
        &b,
        "endless error body (stat)",
        within,
        async move { shown(agent.stat("/tmp").await) },
        protocol_error_naming(ERROR_BODY_MAX),
    )
    .await;
    // The sandbox's agent behaves again: the same session answers.
    fake::set_hostile(&b.bad.handle, None);
    assert_eq!(b.bad_agent.stat("/tmp").await.unwrap().path, "/tmp");
    b.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mib_watch_line_or_event_frame_ends_its_stream() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let b = bench().await;
    let sleeper = b
        .bad_agent
        .spawn(&airlock_proto::ProcessSpec {
            argv: vec!["sleep".into(), "60".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(fake::set_hostile(&b.bad.handle, Some(Hostile::HugeLine)));
    let agent = b.bad_agent.clone();
    abuse(
        &b,
        "100 MiB watch line",
        Duration::from_secs(10),
        async move {
            let mut events = Box::pin(agent.watch("/tmp", true).await?);
            let first = events.next().await.expect("an item");
            assert!(events.next().await.is_none(), "the watch ended");
            shown(first)
        },
        protocol_error_naming(WATCH_LINE_MAX),
    )
    .await;
    let agent = b.bad_agent.clone();
    abuse(
        &b,
        "100 MiB event frame",
        Duration::from_secs(10),
        async move {
            let mut events = Box::pin(agent.events(sleeper.id, 0).await?);
            let first = events.next().await.expect("an item");
            assert!(events.next().await.is_none(), "the event stream ended");
            shown(first)
        },
        |r| match r {
            Err(AgentError::Protocol(m)) => assert!(m.contains("104857600 bytes exceeds the limit"), "{m}"),
            other => panic!("want a protocol error, got {other:?}"),
        },
    )
    .await;
    b.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_never_answered_fail_at_their_deadline() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let b = bench().await;
    assert!(fake::set_hostile(&b.bad.handle, Some(Hostile::Silent)));
    let margin = Duration::from_millis(800);
    let cases: Vec<(&str, Duration)> = vec![
        ("health", DEADLINES.call),
        ("write_file", DEADLINES.call),
        ("events", DEADLINES.call),
        ("list", DEADLINES.slow_call),
    ];
    for (call, deadline) in cases {
        let agent = b.bad_agent.clone();
        let fut = async move {
            match call {
                "health" => shown(agent.health().await),
                "write_file" => shown(agent.write_file("/tmp/x", None, vec![7u8; 1 << 20]).await),
                "events" => shown(agent.events(1, 0).await.map(|_| ())),
                _ => shown(agent.list("/", 1).await),
            }
        };
        let name = format!("silent agent: {call}");
        let before = Instant::now();
        abuse(
            &b,
            &name,
            deadline + margin,
            fut,
            transport_error_containing("did not answer within"),
        )
        .await;
        assert!(before.elapsed() >= deadline, "{name} failed before its deadline");
    }
    b.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_instead_of_http2_fails_the_session() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let b = bench().await;
    assert!(fake::set_hostile(&b.bad.handle, Some(Hostile::Garbage)));
    let socket = b.bad.handle.agent_socket.clone();
    abuse(
        &b,
        "garbage after READY",
        Duration::from_secs(5),
        async move {
            let agent = AgentClient::connect(&socket).await?.with_deadlines(DEADLINES);
            shown(agent.health().await)
        },
        |r| match r {
            Err(AgentError::Transport(m)) => eprintln!("  error: {m}"),
            other => panic!("want a transport error, got {other:?}"),
        },
    )
    .await;
    // The runtime's own session to that sandbox was opened before: it still works once the
    // agent behaves; the good one never noticed.
    fake::set_hostile(&b.bad.handle, None);
    assert!(b.bad_agent.health().await.is_ok());
    b.delete().await;
}

/// The other side of the deadline: an upload whose source pauses longer than the call deadline
/// between chunks is not cut, because the agent is not the one holding it up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upload_is_not_cut_by_the_deadline() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let b = bench().await;
    let chunks = futures_util::stream::iter(0..3u8).then(|i| async move {
        tokio::time::sleep(DEADLINES.call + Duration::from_millis(300)).await;
        Ok::<_, std::io::Error>(bytes::Bytes::from(vec![i; 1000]))
    });
    let t = Instant::now();
    let stat = b.good_agent.write_file_stream("/tmp/slow", None, chunks).await.unwrap();
    eprintln!("slow upload of 3 chunks took {:?}", t.elapsed());
    assert_eq!(stat.size, 3000);
    assert!(t.elapsed() > DEADLINES.call * 3);
    let err = b.good_agent.stat("/nope").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::NotFound));
    b.delete().await;
}
