//! Where sandbox traffic leaves the host: the network namespace the proxy's dials and the
//! resolver's queries are made in. In production that is the process's own (the host's network);
//! a test points it at a namespace holding its own "internet", so nothing a sandbox asks for can
//! reach the machine's real uplink even if a rule were wrong.
//!
//! A socket keeps the namespace it was created in, whatever thread later uses it. So for a
//! namespace uplink one thread lives in that namespace and only creates sockets; connecting,
//! reading and writing happen on the caller's runtime as usual.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpSocket, UdpSocket};

use crate::netns;

/// A socket the namespace thread is asked for.
enum Request {
    Tcp { v6: bool },
    Udp { bind: SocketAddr },
    Addresses,
}

enum Reply {
    Socket(io::Result<OwnedFd>),
    Addresses(io::Result<Vec<IpAddr>>),
}

type Job = (Request, mpsc::Sender<Reply>);

/// The namespace dials and lookups leave from. Cheap to clone.
#[derive(Clone, Default)]
pub struct Uplink {
    netns: Option<Arc<NetnsThread>>,
}

struct NetnsThread {
    path: PathBuf,
    jobs: Mutex<mpsc::Sender<Job>>,
}

impl std::fmt::Debug for Uplink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.netns {
            None => f.write_str("Uplink(host)"),
            Some(t) => write!(f, "Uplink({})", t.path.display()),
        }
    }
}

impl Uplink {
    /// The process's own network namespace.
    pub fn host() -> Self {
        Uplink::default()
    }

    /// The namespace at `path` (e.g. `/run/netns/<name>`): fails now if it can't be entered.
    pub fn netns(path: &Path) -> io::Result<Self> {
        let (jobs, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let ns = path.to_path_buf();
        std::thread::Builder::new()
            .name("egress-uplink".into())
            .spawn(move || {
                if let Err(e) = netns::enter(&ns) {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
                let _ = ready_tx.send(Ok(()));
                // Ends when every `Uplink` clone is gone (the sender drops).
                while let Ok((req, reply)) = rx.recv() {
                    let _ = reply.send(match req {
                        Request::Tcp { v6 } => Reply::Socket(new_tcp(v6)),
                        Request::Udp { bind } => Reply::Socket(std::net::UdpSocket::bind(bind).map(OwnedFd::from)),
                        Request::Addresses => Reply::Addresses(netns::local_addresses()),
                    });
                }
            })?;
        ready_rx
            .recv()
            .map_err(|_| io::Error::other("uplink thread ended"))?
            .map_err(|e| io::Error::new(e.kind(), format!("enter {}: {e}", path.display())))?;
        Ok(Uplink {
            netns: Some(Arc::new(NetnsThread {
                path: path.to_path_buf(),
                jobs: Mutex::new(jobs),
            })),
        })
    }

    fn ask(&self, t: &NetnsThread, req: Request) -> io::Result<Reply> {
        let (tx, rx) = mpsc::channel();
        t.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send((req, tx))
            .map_err(|_| io::Error::other("uplink thread ended"))?;
        rx.recv().map_err(|_| io::Error::other("uplink thread ended"))
    }

    /// An unconnected TCP socket in the uplink's namespace.
    pub fn tcp_socket(&self, v6: bool) -> io::Result<TcpSocket> {
        let fd = match &self.netns {
            None => new_tcp(v6)?,
            Some(t) => match self.ask(t, Request::Tcp { v6 })? {
                Reply::Socket(r) => r?,
                Reply::Addresses(_) => unreachable!("asked for a socket"),
            },
        };
        let std = std::net::TcpStream::from(fd);
        std.set_nonblocking(true)?;
        Ok(TcpSocket::from_std_stream(std))
    }

    /// A UDP socket bound to `bind` in the uplink's namespace.
    pub fn udp_socket(&self, bind: SocketAddr) -> io::Result<UdpSocket> {
        let std = match &self.netns {
            None => std::net::UdpSocket::bind(bind)?,
            Some(t) => match self.ask(t, Request::Udp { bind })? {
                Reply::Socket(r) => std::net::UdpSocket::from(r?),
                Reply::Addresses(_) => unreachable!("asked for a socket"),
            },
        };
        std.set_nonblocking(true)?;
        UdpSocket::from_std(std)
    }

    /// The addresses of the uplink namespace's own interfaces (what a dial must never reach:
    /// they are the host's, or the test uplink's).
    pub fn addresses(&self) -> io::Result<Vec<IpAddr>> {
        match &self.netns {
            None => netns::local_addresses(),
            Some(t) => match self.ask(t, Request::Addresses)? {
                Reply::Addresses(r) => r,
                Reply::Socket(_) => unreachable!("asked for addresses"),
            },
        }
    }
}

fn new_tcp(v6: bool) -> io::Result<OwnedFd> {
    let domain = if v6 { libc::AF_INET6 } else { libc::AF_INET };
    // SAFETY: plain socket(2); the fd is owned at once.
    let fd = unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_uplink_lists_loopback() {
        let addrs = Uplink::host().addresses().unwrap();
        assert!(addrs.contains(&IpAddr::from([127, 0, 0, 1])), "{addrs:?}");
    }

    #[test]
    fn a_missing_namespace_is_an_error_naming_it() {
        let e = Uplink::netns(Path::new("/run/netns/airlock-no-such-ns")).unwrap_err();
        assert!(e.to_string().contains("airlock-no-such-ns"), "{e}");
    }
}
