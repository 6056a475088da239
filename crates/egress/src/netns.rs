//! Network namespaces, the two things this crate needs of them: moving a thread into one
//! ([`enter`]) and listing the addresses of the namespace a thread is in ([`local_addresses`]).
//! Plain libc calls; uses nothing else of the crate, so the sandbox wiring (`serve`), the uplink
//! and the test internet (`airlock-testnet`) can all build on it.

use std::io;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Moves the calling thread into the network namespace at `path` (only this thread).
pub fn enter(path: &Path) -> io::Result<()> {
    let f = std::fs::File::open(path)?;
    // SAFETY: a valid fd to a namespace file; setns affects only the calling thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Every IPv4 and IPv6 address on the calling thread's namespace's interfaces (`getifaddrs`).
pub fn local_addresses() -> io::Result<Vec<IpAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points to a sockaddr whose family says its real type.
            let family = unsafe { (*ifa.ifa_addr).sa_family } as libc::c_int;
            if family == libc::AF_INET {
                // SAFETY: AF_INET: a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                out.push(IpAddr::from(sin.sin_addr.s_addr.to_ne_bytes()));
            } else if family == libc::AF_INET6 {
                // SAFETY: AF_INET6: a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                out.push(IpAddr::from(sin6.sin6_addr.s6_addr));
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: the list from getifaddrs above, freed once.
    unsafe { libc::freeifaddrs(head) };
    out.sort();
    out.dedup();
    Ok(out)
}
