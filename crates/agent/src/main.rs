//! airlock-agent: PID 1 of every sandbox VM.
//!
//! Stage 1 (in the initramfs): load the virtio modules, mount the root disk, switch root and
//! exec the copy of this binary that lives in the root filesystem.
//! Stage 2 (in the root fs): mounts, hostname, loopback, reaping, then serve the host over
//! HTTP/2 on the virtio-serial port, one session per host connection, for as long as the VM lives.

mod boot;
mod channel;
mod error;
mod files;
mod metrics;
mod process;
mod server;
mod users;
mod volumes;

use std::sync::Arc;
use std::time::Duration;

fn main() {
    let is_pid1 = std::process::id() == 1;
    if is_pid1 && std::path::Path::new(boot::INITRAMFS_MARKER).exists() {
        boot::initramfs_stage();
    }
    if is_pid1 {
        boot::rootfs_stage();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| boot::fatal(&format!("tokio runtime: {e}")));
    rt.block_on(serve());
    if is_pid1 {
        boot::fatal("agent stopped serving");
    }
}

async fn serve() {
    let agent = Arc::new(server::Agent::new());

    let reaper = agent.processes.clone();
    let mut sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())
        .unwrap_or_else(|e| boot::fatal(&format!("SIGCHLD handler: {e}")));
    tokio::spawn(async move {
        loop {
            // The timer catches a SIGCHLD coalesced with one we were already handling.
            let _ = tokio::time::timeout(Duration::from_secs(1), sigchld.recv()).await;
            reaper.reap();
        }
    });

    let port_path = std::env::var_os("AIRLOCK_AGENT_PORT").map(std::path::PathBuf::from);
    let path = loop {
        if let Some(p) = port_path
            .clone()
            .or_else(|| channel::find_port(airlock_proto::AGENT_PORT_NAME))
        {
            break p;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let port = channel::open(&path).unwrap_or_else(|e| boot::fatal(&format!("open {}: {e}", path.display())));
    eprintln!("airlock-agent: serving on {}", path.display());
    loop {
        while !channel::host_connected(&port) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut stream = match channel::PortStream::new(&port) {
            Ok(s) => s,
            Err(e) => boot::fatal(&format!("register the agent port: {e}")),
        };
        match channel::await_hello(&mut stream).await {
            Ok(()) => {}
            Err(e) => {
                if e.kind() != std::io::ErrorKind::UnexpectedEof {
                    eprintln!("airlock-agent: session start: {e}");
                }
                continue;
            }
        }
        let io = hyper_util::rt::TokioIo::new(stream);
        let agent = agent.clone();
        let svc = hyper::service::service_fn(move |req| server::handle(agent.clone(), req));
        let conn = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(4 << 20)
            .initial_connection_window_size(8 << 20)
            .max_frame_size(256 << 10)
            .serve_connection(io, svc);
        if let Err(e) = conn.await {
            eprintln!("airlock-agent: host session ended: {e:?}");
        }
    }
}
