//! The kernel calls behind sandbox networks: `ip`/`nft` commands (bounded by
//! `COMMAND_TIMEOUT`), entering a namespace, opening a tap, sysctls, the host's addresses.

use super::*;
use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// IPv4 addresses on the host's interfaces.
pub(super) async fn host_addresses() -> Result<HashSet<Ipv4Addr>> {
    let out = run("ip", &["-j", "-4", "addr", "show"], None, None).await?;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .flat_map(|link| link["addr_info"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a["local"].as_str()?.parse().ok())
        .collect())
}

pub(super) fn write_sysctl(path: &str, value: &str) -> Result<()> {
    std::fs::write(path, value).map_err(|source| NetError::Sysctl {
        path: path.into(),
        source,
    })
}

/// Run `f` on a new thread that has entered the namespace at `ns_path` (the thread ends with
/// it, so no pooled thread is ever left in a sandbox's namespace).
pub(super) async fn in_netns<T: Send + 'static>(
    ns_path: PathBuf,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<T> {
    tokio::task::spawn_blocking(move || {
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&ns_path)?;
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(f())
        })
        .join()
        .map_err(|_| std::io::Error::other("the namespace thread panicked"))?
    })
    .await
    .map_err(std::io::Error::other)?
}

/// Create tap `name` in this thread's namespace and return it open (not persistent: it goes
/// when the last holder, the VMM, closes it). With a virtio-net header, so QEMU can offload.
pub(super) fn open_tap(name: &str) -> std::io::Result<OwnedFd> {
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes().take(libc::IFNAMSIZ - 1)) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF as _, &mut req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

/// Run `program args` (in the namespace at `netns`, if given) with `input` on stdin, bounded by
/// [`COMMAND_TIMEOUT`]; its stdout, or a typed error naming the command and what it said.
pub(super) async fn run(
    program: &'static str,
    args: &[&str],
    netns: Option<&Path>,
    input: Option<String>,
) -> Result<String> {
    use tokio::io::AsyncWriteExt;
    let command = {
        let mut c = format!("{program} {}", args.join(" "));
        if let Some(ns) = netns {
            c = format!("{c} (in {})", ns.display());
        }
        c
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .stdin(if input.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    // Held until the spawn: the child enters the namespace before it execs (the fd is
    // close-on-exec, so the program never sees it).
    let ns_file = match netns {
        Some(p) => Some(std::fs::File::open(p).map_err(|source| NetError::Netns {
            netns: p.display().to_string(),
            source,
        })?),
        None => None,
    };
    if let Some(f) = &ns_file {
        let fd = f.as_raw_fd();
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let work = async {
        let mut child = cmd
            .spawn()
            .map_err(|source| NetError::ToolMissing { program, source })?;
        drop(ns_file);
        if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
            // A program that exits early closes its stdin: its stderr says why.
            let _ = stdin.write_all(text.as_bytes()).await;
        }
        child
            .wait_with_output()
            .await
            .map_err(|source| NetError::ToolMissing { program, source })
    };
    let out = tokio::time::timeout(COMMAND_TIMEOUT, work)
        .await
        .map_err(|_| NetError::Timeout {
            command: command.clone(),
        })??;
    if !out.status.success() {
        return Err(NetError::Command {
            command,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().chars().take(2000).collect(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
