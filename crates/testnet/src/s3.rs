//! An S3 server for tests: moto's server mode, from a Python venv made once (under a dir the
//! caller names, e.g. its target dir) and reused while it holds the same packages. Started on a
//! free port of the address asked for, with the bucket [`BUCKET`]; stopped by its PID on drop.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What the venv holds; a change makes the venv anew.
const PACKAGES: [&str; 3] = ["moto[s3]==5.2.5", "flask==3.1.3", "flask-cors==6.0.5"];
/// The bucket the server starts with.
pub const BUCKET: &str = "airlock";

pub struct Moto {
    child: Child,
    pub addr: SocketAddr,
    /// `http://addr`
    pub endpoint: String,
    /// How long the start took (the venv's making included, when it was made).
    pub started_in: Duration,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn failed(what: &str, out: &std::process::Output) -> io::Error {
    io::Error::other(format!(
        "{what} failed ({}): {}{}\nfix: install python3 with its venv module and pip (scripts/install-host-deps installs python3-venv)",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

/// The venv with moto under `parent`, made once; one without the marker naming these packages
/// (older, or a run stopped while making it) is made anew.
fn venv(parent: &Path) -> io::Result<PathBuf> {
    let venv = parent.join("moto-venv");
    let done = venv.join(".airlock-wants");
    let wants = PACKAGES.join(" ");
    if std::fs::read_to_string(&done).is_ok_and(|have| have == wants) {
        return Ok(venv);
    }
    let _ = std::fs::remove_dir_all(&venv);
    let out = Command::new("python3").args(["-m", "venv"]).arg(&venv).output()?;
    if !out.status.success() {
        return Err(failed("python3 -m venv", &out));
    }
    let out = Command::new(venv.join("bin/pip"))
        .args(["install", "--quiet"])
        .args(PACKAGES)
        .output()?;
    if !out.status.success() {
        return Err(failed("pip install moto into the test venv", &out));
    }
    std::fs::write(&done, wants)?;
    Ok(venv)
}

impl Moto {
    /// moto on a free port of `host`, its venv under `venv_parent`, with the bucket [`BUCKET`].
    pub fn start(venv_parent: &Path, host: IpAddr) -> io::Result<Moto> {
        let t = Instant::now();
        let venv = venv(venv_parent)?;
        let addr = std::net::TcpListener::bind((host, 0))?.local_addr()?;
        let child = Command::new(venv.join("bin/moto_server"))
            .args(["-H", &host.to_string(), "-p", &addr.port().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let mut moto = Moto {
            child,
            addr,
            endpoint: format!("http://{addr}"),
            started_in: Duration::ZERO,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = moto.child.try_wait()? {
                return Err(io::Error::other(format!("moto_server exited at start: {status}")));
            }
            if TcpStream::connect(addr).is_ok() {
                break;
            }
            if Instant::now() > deadline {
                return Err(io::Error::other("moto_server did not listen within 30 s"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // moto takes an unsigned bucket create.
        let mut conn = TcpStream::connect(addr)?;
        write!(
            conn,
            "PUT /{BUCKET} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )?;
        let mut answer = String::new();
        conn.read_to_string(&mut answer)?;
        if !answer.starts_with("HTTP/1.1 200") {
            return Err(io::Error::other(format!("bucket create: {answer}")));
        }
        moto.started_in = t.elapsed();
        Ok(moto)
    }
}
