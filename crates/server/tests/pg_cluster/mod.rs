//! A real Postgres 15 for tests: a copy of one `initdb` (made once, kept in the target dir's
//! tmp) in a temp dir, started on a free loopback port (never 5432, where Debian's own cluster
//! may listen) with its socket in that dir, stopped (`-m immediate`) and removed when the guard
//! drops, a failed test's too. As root the server runs as the `postgres` user (initdb refuses
//! root). Missing binaries fail the test, naming `scripts/install-host-deps`: CI installs them,
//! so a skip would hide a broken setup.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const BIN: &str = "/usr/lib/postgresql/15/bin";

pub struct PgCluster {
    dir: PathBuf,
    port: u16,
    databases: AtomicU32,
    /// How long the copy and the start took (and initdb, for the first cluster of a target dir).
    pub started_in: Duration,
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// `program` of Postgres' bin dir, run as `postgres` when we are root.
fn pg_command(program: &str) -> Command {
    let path = Path::new(BIN).join(program);
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(path);
        c
    } else {
        Command::new(path)
    }
}

fn run(mut c: Command, what: &str) -> Result<(), String> {
    let out = c.output().map_err(|e| format!("{what}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{what}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
    l.local_addr().unwrap().port()
}

/// A data dir fresh from `initdb`, made once into the target dir's tmp and reused by every
/// cluster (initdb takes a second or more, a copy a tenth of that). initdb runs in the system's
/// temp dir (the postgres user may not reach the target dir: a clone under /root), its result
/// is copied over and renamed into place, so a run stopped half way leaves no template.
fn template() -> PathBuf {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let dir = tmp.join("pg15-template");
    if dir.join("PG_VERSION").exists() {
        return dir;
    }
    let work = tempfile::Builder::new()
        .prefix("airlock-initdb-")
        .tempdir()
        .expect("a temp dir");
    if is_root() {
        let mut chown = Command::new("chown");
        chown.arg("postgres:postgres").arg(work.path());
        run(chown, "chown initdb's dir to postgres").unwrap();
    }
    let made = work.path().join("data");
    let mut initdb = pg_command("initdb");
    initdb
        .args([
            "-A",
            "trust",
            "-U",
            "airlock",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
            "-D",
        ])
        .arg(&made);
    run(initdb, "initdb").unwrap();
    let staged = tempfile::Builder::new()
        .prefix("pg15-template-")
        .tempdir_in(tmp)
        .expect("a temp dir in the target dir");
    let mut copy = Command::new("cp");
    copy.arg("-a").arg(&made).arg(staged.path().join("data"));
    run(copy, "copy initdb's data dir").unwrap();
    // Another test binary made it meanwhile: keep theirs (ours goes with `staged`).
    let _ = std::fs::rename(staged.path().join("data"), &dir);
    dir
}

impl PgCluster {
    pub fn start() -> PgCluster {
        let t0 = Instant::now();
        assert!(
            Path::new(BIN).join("initdb").exists(),
            "Postgres 15 is missing ({BIN}/initdb): run scripts/install-host-deps, which installs postgresql-15"
        );
        let dir = tempfile::Builder::new()
            .prefix("airlock-pg-")
            .tempdir()
            .expect("a temp dir")
            .keep();
        // From here the guard owns the dir: a failed start still removes it.
        let mut cluster = PgCluster {
            dir,
            port: 0,
            databases: AtomicU32::new(0),
            started_in: Duration::ZERO,
        };
        if is_root() {
            let mut chown = Command::new("chown");
            chown.arg("postgres:postgres").arg(&cluster.dir);
            run(chown, "chown the cluster's dir to postgres").unwrap();
        }
        // `cp -a` keeps the owner (postgres, when we are root) and the data dir's 0700.
        let mut copy = Command::new("cp");
        copy.arg("-a").arg(template()).arg(cluster.data());
        run(copy, "copy the initdb template").unwrap();
        // A port picked free can be taken before the server binds it: try another.
        let mut last = String::new();
        for _ in 0..3 {
            cluster.port = free_port();
            let mut start = pg_command("pg_ctl");
            start
                .arg("-D")
                .arg(cluster.data())
                .arg("-l")
                .arg(cluster.dir.join("log"))
                .arg("-o")
                .arg(format!(
                    "-c listen_addresses=127.0.0.1 -p {} -k {} -c fsync=off -c full_page_writes=off",
                    cluster.port,
                    cluster.dir.display()
                ))
                .args(["-w", "-t", "30", "start"]);
            match run(start, "pg_ctl start") {
                Ok(()) => {
                    cluster.started_in = t0.elapsed();
                    return cluster;
                }
                Err(e) => last = e,
            }
        }
        let log = std::fs::read_to_string(cluster.dir.join("log")).unwrap_or_default();
        panic!("Postgres did not start: {last}\n{log}");
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn url(&self, database: &str) -> String {
        format!("postgres://airlock@127.0.0.1:{}/{database}", self.port)
    }

    /// A new empty database of this cluster; its URL.
    pub async fn database(&self) -> String {
        use sqlx::Connection;
        let name = format!("t{}", self.databases.fetch_add(1, Ordering::SeqCst));
        let mut c = sqlx::PgConnection::connect(&self.url("postgres")).await.unwrap();
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut c)
            .await
            .unwrap();
        c.close().await.unwrap();
        self.url(&name)
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if self.port != 0 {
            let mut stop = pg_command("pg_ctl");
            stop.arg("-D").arg(self.data()).args(["-m", "immediate", "-w", "stop"]);
            if let Err(e) = run(stop, "pg_ctl stop") {
                eprintln!("{e}");
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
