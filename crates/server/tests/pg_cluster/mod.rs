//! A real Postgres 15 for tests: `initdb` into a temp dir, started on a free loopback port
//! (never 5432, where Debian's own cluster may listen) with its socket in that dir, stopped
//! (`-m immediate`) and removed when the guard drops, a failed test's too. As root the server
//! runs as the `postgres` user (initdb refuses root). Missing binaries fail the test, naming
//! `scripts/install-host-deps`: CI installs them, so a skip would hide a broken setup.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const BIN: &str = "/usr/lib/postgresql/15/bin";

pub struct PgCluster {
    dir: PathBuf,
    port: u16,
    databases: AtomicU32,
    /// How long initdb and the start took.
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
            .arg(cluster.data());
        run(initdb, "initdb").unwrap();
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
