//! Boot duties of PID 1: the initramfs stage (load virtio modules, mount the root disk, switch
//! root) and the root filesystem stage (mounts, hostname, loopback, growing the root fs).

use airlock_proto::net;
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

pub(crate) fn log(msg: &str) {
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
    let err = nix::unistd::execv(&prog, std::slice::from_ref(&prog)).unwrap_err();
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
    if Path::new(&format!("/sys/class/net/{}", net::GUEST_IF)).exists() {
        if let Err(e) = network_up() {
            log(&format!("network: {e}"));
        }
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
    let sock = Socket::inet()?;
    sock.set_up("lo")
}

/// The guest's side of the sandbox network, the same in every sandbox (`airlock_proto::net`):
/// IPv6 off on the NIC (the host drops it anyway; loopback keeps `::1`), the fixed address, a
/// default route through the gateway, and the gateway as the only resolver.
fn network_up() -> std::io::Result<()> {
    let nic = net::GUEST_IF;
    for conf in ["default", nic] {
        let p = format!("/proc/sys/net/ipv6/conf/{conf}/disable_ipv6");
        if Path::new(&p).exists() {
            fs::write(&p, "1")?;
        }
    }
    let sock = Socket::inet()?;
    sock.set_addr(nic, libc::SIOCSIFADDR, net::GUEST_ADDR)?;
    let mask = u32::MAX << (32 - u32::from(net::PREFIX_LEN));
    sock.set_addr(nic, SIOCSIFNETMASK, mask.to_be_bytes())?;
    sock.set_up(nic)?;
    sock.default_route(net::GATEWAY)?;
    let [a, b, c, d] = net::GATEWAY;
    // A symlink (systemd's, or a user's) must not redirect this write: replace it.
    let _ = fs::remove_file("/etc/resolv.conf");
    fs::write("/etc/resolv.conf", format!("nameserver {a}.{b}.{c}.{d}\n"))
}

const SIOCSIFNETMASK: libc::c_ulong = 0x891c;
const SIOCADDRT: libc::c_ulong = 0x890b;

/// `struct rtentry` (net/route.h) for SIOCADDRT.
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_tos: libc::c_uchar,
    rt_class: libc::c_uchar,
    rt_pad4: [libc::c_short; 3],
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

/// An AF_INET datagram socket for the interface ioctls.
struct Socket(std::os::fd::OwnedFd);

impl Socket {
    fn inet() -> std::io::Result<Self> {
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }))
    }

    fn ifreq(name: &str) -> libc::ifreq {
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes().take(libc::IFNAMSIZ - 1)) {
            *dst = src as libc::c_char;
        }
        req
    }

    fn ioctl<T>(&self, what: &str, request: libc::c_ulong, arg: &mut T) -> std::io::Result<()> {
        if unsafe { libc::ioctl(self.0.as_raw_fd(), request as _, arg as *mut T) } < 0 {
            let e = std::io::Error::last_os_error();
            return Err(std::io::Error::new(e.kind(), format!("{what}: {e}")));
        }
        Ok(())
    }

    fn set_up(&self, name: &str) -> std::io::Result<()> {
        let mut req = Self::ifreq(name);
        self.ioctl(&format!("get flags of {name}"), libc::SIOCGIFFLAGS as _, &mut req)?;
        unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
        self.ioctl(&format!("bring {name} up"), libc::SIOCSIFFLAGS as _, &mut req)
    }

    fn set_addr(&self, name: &str, request: libc::c_ulong, addr: [u8; 4]) -> std::io::Result<()> {
        let mut req = Self::ifreq(name);
        req.ifr_ifru.ifru_addr = sockaddr_in(addr);
        self.ioctl(&format!("set address {addr:?} on {name}"), request, &mut req)
    }

    fn default_route(&self, gateway: [u8; 4]) -> std::io::Result<()> {
        let mut rt: RtEntry = unsafe { std::mem::zeroed() };
        rt.rt_dst = sockaddr_in([0; 4]);
        rt.rt_genmask = sockaddr_in([0; 4]);
        rt.rt_gateway = sockaddr_in(gateway);
        rt.rt_flags = (libc::RTF_UP | libc::RTF_GATEWAY) as libc::c_ushort;
        match self.ioctl("add the default route", SIOCADDRT, &mut rt) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            r => r,
        }
    }
}

fn sockaddr_in(addr: [u8; 4]) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(addr),
        },
        sin_zero: [0; 8],
    };
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
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

/// Take the identity the host gives (see `airlock_proto::Identity`): after a snapshot restore
/// the hostname, machine id, clock and random state are the snapshot's, shared by every clone.
pub fn apply_identity(id: &airlock_proto::Identity) -> Result<(), crate::error::AgentError> {
    use crate::error::AgentError;
    let valid_host = !id.hostname.is_empty()
        && id.hostname.len() <= 63
        && id
            .hostname
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !valid_host {
        return Err(AgentError::invalid(format!("bad hostname {:?}", id.hostname)));
    }
    if id.machine_id.len() != 32 || !id.machine_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(AgentError::invalid("machine_id must be 32 hex digits".to_string()));
    }
    let entropy = decode_hex(&id.entropy_hex)
        .filter(|e| (16..=512).contains(&e.len()))
        .ok_or_else(|| AgentError::invalid("entropy_hex must be 16 to 512 bytes of hex".to_string()))?;
    let internal = |what: &str, e: std::io::Error| AgentError::internal(format!("{what}: {e}"));
    // The random state first: everything after may draw on it.
    add_entropy(&entropy).map_err(|e| internal("entropy", e))?;
    let ts = libc::timespec {
        tv_sec: (id.unix_time_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (id.unix_time_ns % 1_000_000_000) as libc::c_long,
    };
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        return Err(internal("clock", std::io::Error::last_os_error()));
    }
    nix::unistd::sethostname(&id.hostname).map_err(|e| internal("hostname", e.into()))?;
    fs::write("/etc/hostname", format!("{}\n", id.hostname)).map_err(|e| internal("/etc/hostname", e))?;
    fs::write("/etc/machine-id", format!("{}\n", id.machine_id)).map_err(|e| internal("/etc/machine-id", e))?;
    if let Some(env) = &id.env {
        write_sandbox_env(std::path::Path::new(airlock_proto::SANDBOX_ENV_PATH), env)
            .map_err(|e| internal(airlock_proto::SANDBOX_ENV_PATH, e))?;
    }
    Ok(())
}

/// The sandbox's environment as a JSON object at `path`, replaced whole (a reader never sees
/// half of it), readable by every user.
fn write_sandbox_env(path: &std::path::Path, env: &std::collections::BTreeMap<String, String>) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = path.parent().unwrap_or(std::path::Path::new("/"));
    fs::create_dir_all(dir)?;
    let tmp = dir.join(".env.json.tmp");
    fs::write(&tmp, serde_json::to_vec(env).map_err(std::io::Error::other)?)?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644))?;
    fs::rename(&tmp, path)
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Mix `bytes` into the kernel's pool, credited, then reseed the CRNG from it.
fn add_entropy(bytes: &[u8]) -> std::io::Result<()> {
    // RNDADDENTROPY = _IOW('R', 0x03, int[2]); RNDRESEEDCRNG = _IO('R', 0x07).
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    let f = fs::OpenOptions::new().write(true).open("/dev/random")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len());
    info.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(bytes);
    info.resize(8 + bytes.len().next_multiple_of(4), 0);
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG as _) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_sandbox_env_is_replaced_whole_and_readable_by_all() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/airlock/env.json");
        let env = std::collections::BTreeMap::from([("A".to_string(), "1".to_string()), ("B".into(), "x y".into())]);
        super::write_sandbox_env(&path, &env).unwrap();
        let back: std::collections::BTreeMap<String, String> =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, env);
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o644);
        super::write_sandbox_env(&path, &Default::default()).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{}");
    }

    #[test]
    fn reads_cmdline_values() {
        let c = "console=ttyS0 airlock.hostname=sbx-1 quiet";
        assert_eq!(super::cmdline_value(c, "airlock.hostname"), Some("sbx-1"));
        assert_eq!(super::cmdline_value(c, "console"), Some("ttyS0"));
        assert_eq!(super::cmdline_value(c, "missing"), None);
    }
}
