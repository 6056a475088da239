//! Boot duties of PID 1: the initramfs stage (load virtio modules, mount the root disk, switch
//! root) and the root filesystem stage (mounts, hostname, loopback, growing the root fs).

use nix::mount::{mount, MsFlags};
use std::ffi::CString;
use std::fs;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

/// Marker file present only in the initramfs built by the host.
pub const INITRAMFS_MARKER: &str = "/airlock-initramfs";
/// Module load order written by the host at template build time, one .ko path per line.
const MODULE_LIST: &str = "/modules.list";
const ROOT_DEVICE: &str = "/dev/vda";
const AGENT_IN_ROOTFS: &str = "/usr/sbin/airlock-agent";

fn log(msg: &str) {
    // PID 1's stderr is the console; the host keeps it in console.log.
    eprintln!("airlock-agent: {msg}");
}

/// A boot failure leaves the VM powered off, so the host sees the VMM exit and reads the console.
pub fn fatal(msg: &str) -> ! {
    log(&format!("fatal: {msg}"));
    unsafe { libc::sync() };
    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn mount_fs(src: &str, target: &str, fstype: &str, flags: MsFlags, data: Option<&str>) {
    let _ = fs::create_dir_all(target);
    if let Err(e) = mount(Some(src), target, Some(fstype), flags, data) {
        if e != nix::errno::Errno::EBUSY {
            log(&format!("mount {fstype} on {target}: {e}"));
        }
    }
}

pub fn initramfs_stage() -> ! {
    mount_fs("devtmpfs", "/dev", "devtmpfs", MsFlags::MS_NOSUID, None);
    mount_fs(
        "proc",
        "/proc",
        "proc",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    );
    mount_fs(
        "sysfs",
        "/sys",
        "sysfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    );

    let list = fs::read_to_string(MODULE_LIST).unwrap_or_default();
    for module in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        load_module(module);
    }

    let deadline = Instant::now() + Duration::from_secs(20);
    while !Path::new(ROOT_DEVICE).exists() {
        if Instant::now() > deadline {
            fatal(&format!("{ROOT_DEVICE} did not appear"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if let Err(e) = mount(
        Some(ROOT_DEVICE),
        "/newroot",
        Some("ext4"),
        MsFlags::empty(),
        None::<&str>,
    ) {
        let _ = fs::create_dir_all("/newroot");
        if let Err(e2) = mount(
            Some(ROOT_DEVICE),
            "/newroot",
            Some("ext4"),
            MsFlags::empty(),
            None::<&str>,
        ) {
            fatal(&format!("mount root: {e} / {e2}"));
        }
    }
    for dir in ["/dev", "/proc", "/sys"] {
        let target = format!("/newroot{dir}");
        let _ = fs::create_dir_all(&target);
        if let Err(e) = mount(Some(dir), target.as_str(), None::<&str>, MsFlags::MS_MOVE, None::<&str>) {
            fatal(&format!("move {dir}: {e}"));
        }
    }
    // Free the initramfs' memory: nothing in it is needed after the switch.
    for entry in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let _ = fs::remove_file(entry);
    }
    let _ = fs::remove_file("/init");
    if let Err(e) = std::env::set_current_dir("/newroot") {
        fatal(&format!("chdir /newroot: {e}"));
    }
    if let Err(e) = mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>) {
        fatal(&format!("move root: {e}"));
    }
    if let Err(e) = nix::unistd::chroot(".") {
        fatal(&format!("chroot: {e}"));
    }
    let _ = std::env::set_current_dir("/");
    let prog = CString::new(AGENT_IN_ROOTFS).unwrap();
    let err = nix::unistd::execv(&prog, &[prog.clone()]).unwrap_err();
    fatal(&format!("exec {AGENT_IN_ROOTFS}: {err}"))
}

fn load_module(path: &str) {
    let file = match fs::File::open(path) {
        Ok(f) => f,
        Err(e) => return log(&format!("module {path}: {e}")),
    };
    let params = CString::new("").unwrap();
    let rc = unsafe { libc::syscall(libc::SYS_finit_module, file.as_raw_fd(), params.as_ptr(), 0) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EEXIST) {
            log(&format!("load {path}: {err}"));
        }
    }
}

/// Root filesystem stage: everything a normal userland expects before the agent serves.
pub fn rootfs_stage() {
    let nosuid_nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount_fs("devtmpfs", "/dev", "devtmpfs", MsFlags::MS_NOSUID, None);
    mount_fs("proc", "/proc", "proc", nosuid_nodev | MsFlags::MS_NOEXEC, None);
    mount_fs("sysfs", "/sys", "sysfs", nosuid_nodev | MsFlags::MS_NOEXEC, None);
    mount_fs(
        "devpts",
        "/dev/pts",
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("gid=5,mode=620,ptmxmode=666"),
    );
    mount_fs("tmpfs", "/dev/shm", "tmpfs", nosuid_nodev, Some("mode=1777"));
    mount_fs("tmpfs", "/run", "tmpfs", nosuid_nodev, Some("mode=755"));
    let _ = fs::create_dir_all("/run/lock");
    let _ = fs::set_permissions("/tmp", std::os::unix::fs::PermissionsExt::from_mode(0o1777));

    let cmdline = fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let hostname = cmdline_value(&cmdline, "airlock.hostname").unwrap_or("airlock");
    let _ = nix::unistd::sethostname(hostname);
    let _ = fs::write("/etc/hostname", format!("{hostname}\n"));
    if let Err(e) = loopback_up() {
        log(&format!("loopback: {e}"));
    }
    if let Err(e) = grow_root_fs() {
        log(&format!("grow root fs: {e}"));
    }
}

pub fn cmdline_value<'a>(cmdline: &'a str, key: &str) -> Option<&'a str> {
    cmdline
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn loopback_up() -> std::io::Result<()> {
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    let rc = unsafe {
        if libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req) < 0 {
            -1
        } else {
            req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            libc::ioctl(sock, libc::SIOCSIFFLAGS, &req)
        }
    };
    let err = std::io::Error::last_os_error();
    unsafe { libc::close(sock) };
    if rc < 0 {
        Err(err)
    } else {
        Ok(())
    }
}

/// The per-sandbox overlay may be larger than the template image (`disk_mib`): grow ext4 online.
fn grow_root_fs() -> std::io::Result<()> {
    let sectors: u64 = fs::read_to_string("/sys/block/vda/size")?.trim().parse().unwrap_or(0);
    let st = nix::sys::statvfs::statvfs("/").map_err(std::io::Error::from)?;
    let block = st.fragment_size() as u64;
    if block == 0 {
        return Ok(());
    }
    let want = sectors * 512 / block;
    let root = fs::File::open("/")?;
    // EXT4_IOC_RESIZE_FS = _IOW('f', 16, __u64)
    const EXT4_IOC_RESIZE_FS: libc::c_ulong = 0x4008_6610;
    let rc = unsafe { libc::ioctl(root.as_raw_fd(), EXT4_IOC_RESIZE_FS, &want) };
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        // EINVAL/ENOSPC-like answers mean "already that size": not worth a log line.
        if !matches!(err.raw_os_error(), Some(libc::EINVAL)) {
            return Err(err);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_cmdline_values() {
        let c = "console=ttyS0 airlock.hostname=sbx-1 quiet";
        assert_eq!(super::cmdline_value(c, "airlock.hostname"), Some("sbx-1"));
        assert_eq!(super::cmdline_value(c, "console"), Some("ttyS0"));
        assert_eq!(super::cmdline_value(c, "missing"), None);
    }
}
