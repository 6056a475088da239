//! The byte stream to the host: the virtio-serial port named `airlock.agent`.
//!
//! The port is opened once (it cannot be reopened) and each host connection gets a fresh HTTP/2
//! session on it. While no host is connected, reads see EOF / POLLHUP; the agent waits for the
//! host to come back (after a server restart or a snapshot restore) and serves again.

use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Find the port's device node by its name in sysfs (no udev in the guest).
pub fn find_port(name: &str) -> Option<std::path::PathBuf> {
    let dir = std::fs::read_dir("/sys/class/virtio-ports").ok()?;
    for entry in dir.flatten() {
        let port_name = std::fs::read_to_string(entry.path().join("name")).unwrap_or_default();
        if port_name.trim() == name {
            return Some(std::path::Path::new("/dev").join(entry.file_name()));
        }
    }
    None
}

pub fn open(path: &std::path::Path) -> std::io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    Ok(OwnedFd::from(f))
}

/// True while the host side of the port is connected.
pub fn host_connected(fd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN | libc::POLLOUT,
        revents: 0,
    };
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n >= 0 && p.revents & libc::POLLHUP == 0
}

/// Wait for the host's `HELLO <nonce>` line, discarding anything before it (bytes of an
/// earlier session), and answer `READY <nonce>`. The host says hello again every 100 ms until it
/// is answered, and while the guest boots its hellos queue up unread: so once one is in hand,
/// the lines already there are read too, and only the newest hello (the one the host waits for)
/// is answered. Answering an older one would leave the newer lines to the HTTP/2 session, which
/// would fail on them and cost the host another round.
pub async fn await_hello(io: &mut PortStream) -> std::io::Result<()> {
    use futures_util::FutureExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut line = Vec::with_capacity(64);
    let mut newest: Option<String> = None;
    loop {
        let mut b = [0u8; 1];
        let read = match newest {
            None => io.read(&mut b).await?,
            // With a hello in hand, only what has already arrived.
            Some(_) => match io.read(&mut b).now_or_never() {
                Some(read) => read?,
                None => break,
            },
        };
        if read == 0 {
            if newest.is_some() {
                break;
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if b[0] != b'\n' {
            line.push(b[0]);
            if line.len() > airlock_proto::SESSION_LINE_MAX {
                line.clear();
            }
            continue;
        }
        let text = String::from_utf8_lossy(&line).to_string();
        line.clear();
        let Some(pos) = text.find(airlock_proto::SESSION_HELLO) else {
            continue;
        };
        let nonce = &text[pos + airlock_proto::SESSION_HELLO.len()..];
        if !nonce.is_empty() && nonce.chars().all(|c| c.is_ascii_alphanumeric()) {
            newest = Some(nonce.to_string());
        }
    }
    let nonce = newest.expect("the loop ends with a hello in hand");
    io.write_all(format!("{}{nonce}\n", airlock_proto::SESSION_READY).as_bytes())
        .await?;
    Ok(())
}

/// One host session over the shared port.
///
/// Each session registers its own duplicate of the port fd: once the host hangs up, tokio keeps
/// the "closed" readiness of a registration forever, so a registration must not outlive its
/// session. A hang-up seen mid-session ends the session (EOF) instead of spinning on EAGAIN.
pub struct PortStream(Arc<AsyncFd<OwnedFd>>);

impl PortStream {
    pub fn new(port: &OwnedFd) -> std::io::Result<Self> {
        let dup = port.try_clone()?;
        // SAFETY: the AsyncFd owns the duplicate for its whole life.
        Ok(Self(Arc::new(unsafe { AsyncFd::register(dup) }?)))
    }
}

impl AsyncRead for PortStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        loop {
            let mut guard = ready!(self.0.poll_read_ready(cx))?;
            let hung_up = guard.ready().is_read_closed();
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|inner| {
                let n = unsafe {
                    libc::read(
                        inner.get_ref().as_raw_fd(),
                        unfilled.as_mut_ptr().cast(),
                        unfilled.len(),
                    )
                };
                if n < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            }) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) if hung_up => return Poll::Ready(Ok(())),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for PortStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        loop {
            let mut guard = ready!(self.0.poll_write_ready(cx))?;
            let hung_up = guard.ready().is_write_closed();
            match guard.try_io(|inner| {
                let n = unsafe { libc::write(inner.get_ref().as_raw_fd(), data.as_ptr().cast(), data.len()) };
                if n < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            }) {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) if hung_up => return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
                Err(_would_block) => continue,
            }
        }
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
