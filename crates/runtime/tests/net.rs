//! Sandbox networks against real VMs: the guest's NIC, a sealed sandbox (no egress), spoofing,
//! UDP, IPv6, the egress hooks (a stand-in proxy and DNS responder on the sandbox's host
//! address), removal with the sandbox, and the start-up sweep of a crash's leftovers.
//!
//! The "internet" is a test host in a namespace this test makes (`altest<pid>`, 198.51.100.2,
//! TEST-NET-2); no sandbox traffic leaves the namespaces. A custom main (libtest-mimic) removes
//! the sandboxes and the test host when the run ends.

mod common;

use airlock_runtime::net::{self, EgressHook, EgressPorts, NetError, SandboxLink};
use airlock_runtime::{CreateVm, Runtime, RuntimeError, RuntimeOptions, Vm};
use async_trait::async_trait;
use common::{argv, block_on, build_seed, small, test_data_dir};
use libtest_mimic::Trial;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const TEST_HOST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
const TEST_HOST_GW: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const TEST_TCP_PORT: u16 = 8080;
const TEST_UDP_PORT: u16 = 9999;

// ---------------------------------------------------------------------------------------------
// The egress hook the tests plug in: per sandbox id, no egress, a stand-in proxy + DNS
// responder bound on the sandbox's host address, or a failure.

#[derive(Clone, Copy)]
enum Plan {
    Sealed,
    Wired,
    Fail,
}

struct Bound {
    proxy: TcpListener,
    dns: UdpSocket,
}

#[derive(Default)]
struct TestHook {
    plans: Mutex<HashMap<String, Plan>>,
    bound: Mutex<HashMap<String, Arc<Bound>>>,
    detached: Mutex<Vec<String>>,
}

#[async_trait]
impl EgressHook for TestHook {
    async fn attach(&self, link: &SandboxLink) -> Result<EgressPorts, Box<dyn std::error::Error + Send + Sync>> {
        let plan = self
            .plans
            .lock()
            .unwrap()
            .get(&link.id)
            .copied()
            .unwrap_or(Plan::Sealed);
        match plan {
            Plan::Sealed => Ok(EgressPorts::default()),
            Plan::Fail => Err("the test hook refuses this sandbox".into()),
            Plan::Wired => {
                // What the egress crate does: listen on the sandbox's own host address.
                let proxy = TcpListener::bind((link.host_addr, 0))?;
                let dns = UdpSocket::bind((link.host_addr, 0))?;
                let ports = EgressPorts {
                    proxy: Some(proxy.local_addr()?.port()),
                    dns: Some(dns.local_addr()?.port()),
                };
                self.bound
                    .lock()
                    .unwrap()
                    .insert(link.id.clone(), Arc::new(Bound { proxy, dns }));
                Ok(ports)
            }
        }
    }

    async fn detach(&self, link: &SandboxLink) {
        self.bound.lock().unwrap().remove(&link.id);
        self.detached.lock().unwrap().push(link.id.clone());
    }
}

fn hook() -> Arc<TestHook> {
    static HOOK: OnceLock<Arc<TestHook>> = OnceLock::new();
    HOOK.get_or_init(Default::default).clone()
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

fn runtime() -> Runtime {
    RUNTIME
        .get_or_init(|| {
            block_on(async {
                build_seed().await;
                let mut opts = RuntimeOptions::new(test_data_dir());
                opts.network = Some(net::NetworkOptions {
                    pool: None,
                    egress: Some(hook() as Arc<dyn EgressHook>),
                });
                Runtime::open(opts).await.expect("runtime opens")
            })
        })
        .clone()
}

fn create(id: &str, plan: Plan) -> Result<Arc<Vm>, RuntimeError> {
    hook().plans.lock().unwrap().insert(id.into(), plan);
    block_on(runtime().create(CreateVm {
        id: Some(id.into()),
        template: "seed".into(),
        resources: small(),
        image: None,
        env: Default::default(),
        volumes: Vec::new(),
    }))
}

fn id(name: &str) -> String {
    format!("{name}{}", std::process::id())
}

/// The sandbox without egress the tests share.
fn sealed() -> Arc<Vm> {
    static SEALED: OnceLock<Arc<Vm>> = OnceLock::new();
    SEALED
        .get_or_init(|| create(&id("sealed"), Plan::Sealed).expect("sandbox boots"))
        .clone()
}

/// Run a Python script in the guest (as root); its stdout, trimmed.
fn py(sb: &Vm, script: &str) -> String {
    let out = block_on(sb.run(argv(&["python3", "-c", script]))).unwrap();
    assert_eq!(
        out.exit.exit_code,
        Some(0),
        "guest script failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn counters(sb: &Vm) -> HashMap<String, u64> {
    let link = sb.net.as_ref().expect("the sandbox has a network");
    block_on(runtime().network().unwrap().counters(link))
        .unwrap()
        .into_iter()
        .collect()
}

fn sh(cmd: &str) -> std::process::Output {
    Command::new("sh").arg("-c").arg(cmd).output().unwrap()
}

fn exists_netns(name: &str) -> bool {
    Path::new(net::NETNS_DIR).join(name).exists()
}

fn exists_link(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

fn exists_host_table(name: &str) -> bool {
    sh(&format!("nft list table inet {name}")).status.success()
}

// ---------------------------------------------------------------------------------------------
// The test host: a namespace holding 198.51.100.2 with a TCP listener and a UDP socket, reached
// from the host's namespace through a veth (so the host itself can connect to it: a sandbox that
// cannot is held back by its rules, not by a missing route).

struct TestHost {
    tcp: TcpListener,
    udp: UdpSocket,
}

fn test_host_ns() -> String {
    format!("altest{}", std::process::id())
}

fn test_host() -> &'static TestHost {
    static HOST: OnceLock<TestHost> = OnceLock::new();
    HOST.get_or_init(|| {
        let ns = test_host_ns();
        let veth = format!("altv{}", std::process::id());
        let script = format!(
            "set -e; ip netns add {ns}; ip link add {veth} type veth peer name eth0 netns {ns}; \
             ip addr add {TEST_HOST_GW}/30 dev {veth}; ip link set {veth} up; \
             ip -n {ns} link set lo up; ip -n {ns} addr add {TEST_HOST}/30 dev eth0; \
             ip -n {ns} link set eth0 up; ip -n {ns} route add default via {TEST_HOST_GW}"
        );
        let out = sh(&script);
        assert!(
            out.status.success(),
            "test host: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let path = Path::new(net::NETNS_DIR).join(&ns);
        // Sockets keep the namespace they were made in.
        let (tcp, udp) = std::thread::spawn(move || {
            let f = std::fs::File::open(path).unwrap();
            assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
            (
                TcpListener::bind((TEST_HOST, TEST_TCP_PORT)).unwrap(),
                UdpSocket::bind((TEST_HOST, TEST_UDP_PORT)).unwrap(),
            )
        })
        .join()
        .unwrap();
        tcp.set_nonblocking(true).unwrap();
        udp.set_nonblocking(true).unwrap();
        TestHost { tcp, udp }
    })
}

fn remove_test_host() {
    let _ = sh(&format!("ip netns delete {}", test_host_ns()));
}

impl TestHost {
    /// Everything that reached the test host since the last call: (TCP connections, UDP datagrams).
    fn drain(&self) -> (usize, usize) {
        let mut tcp = 0;
        while self.tcp.accept().is_ok() {
            tcp += 1;
        }
        let mut udp = 0;
        let mut buf = [0u8; 2048];
        while self.udp.recv_from(&mut buf).is_ok() {
            udp += 1;
        }
        (tcp, udp)
    }
}

// ---------------------------------------------------------------------------------------------
// Tests

fn guest_has_eth0_with_the_fixed_address() {
    let sb = sealed();
    let out = py(
        &sb,
        r#"
import socket, fcntl, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
req = struct.pack('256s', b'eth0')
addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x891b, req)[20:24])
mac = open('/sys/class/net/eth0/address').read().strip()
routes = [l.split() for l in open('/proc/net/route').read().splitlines()[1:]]
gw = [socket.inet_ntoa(struct.pack('<I', int(r[2], 16))) for r in routes if r[1] == '00000000']
print(addr, mask, mac, ','.join(gw), open('/etc/resolv.conf').read().strip())
"#,
    );
    assert_eq!(
        out,
        "100.96.0.2 255.255.255.252 02:a1:00:00:00:02 100.96.0.1 nameserver 100.96.0.1"
    );
    // Every sandbox's host side is its own, recorded with it.
    let link = sb.net.as_ref().unwrap();
    assert!(exists_netns(&link.netns) && exists_link(&link.host_if));
    assert_eq!(SandboxLink::load(&sb.handle.dir).as_ref(), Some(link));
    assert_eq!(link.ports, EgressPorts::default());
}

fn sealed_sandbox_reaches_nothing_but_the_gateways_dns_port() {
    let sb = sealed();
    let host = test_host();
    host.drain();
    // The host reaches the test host: only the sandbox's rules can keep it out.
    std::net::TcpStream::connect_timeout(&(TEST_HOST, TEST_TCP_PORT).into(), Duration::from_secs(5))
        .expect("the host reaches the test host");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(host.drain().0, 1);
    let link = sb.net.as_ref().unwrap().clone();
    let before = counters(&sb);
    let out = py(
        &sb,
        &format!(
            r#"
import socket
res = []
for host, port in [('{TEST_HOST}', {TEST_TCP_PORT}), ('203.0.113.7', 443), ('100.96.0.1', 22), ('{h}', 22), ('{n}', 22)]:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
        res.append('connected')
    except OSError as e:
        res.append(type(e).__name__)
# DNS to the gateway passes the rules; nothing answers it until the egress side is wired.
d = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
d.settimeout(2)
d.sendto(b'\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x04test\x00\x00\x01\x00\x01', ('100.96.0.1', 53))
try:
    d.recv(512)
    res.append('answered')
except OSError as e:
    res.append('dns:' + type(e).__name__)
print(' '.join(res))
"#,
            h = link.host_addr,
            n = link.peer_addr
        ),
    );
    assert!(!out.contains("connected") && !out.contains("answered"), "{out}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(host.drain(), (0, 0), "the test host got nothing");
    let after = counters(&sb);
    assert!(after["dropped"] >= before["dropped"] + 5, "{before:?} -> {after:?}");
    assert!(after["dns_queries"] > before["dns_queries"], "{before:?} -> {after:?}");
    assert_eq!(after["tcp_out"], 0, "{after:?}");
}

fn spoofed_sources_are_dropped() {
    let sb = sealed();
    let before = counters(&sb);
    // As root: raw IP packets with another source, to the gateway's DNS port (which the
    // guest's own address may use) and to the test host.
    let out = py(
        &sb,
        &format!(
            r#"
import socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
n = 0
for src in ['100.96.0.3', '198.51.100.77', '169.254.0.1']:
    for dst, port in [('100.96.0.1', 53), ('{TEST_HOST}', {TEST_UDP_PORT})]:
        for i in range(4):
            udp = struct.pack('!HHHH', 40000 + i, port, 12, 0) + b'spof'
            ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                             socket.inet_aton(src), socket.inet_aton(dst))
            s.sendto(ip + udp, (dst, 0))
            n += 1
print(n)
"#
        ),
    );
    assert_eq!(out, "24");
    std::thread::sleep(Duration::from_millis(300));
    let after = counters(&sb);
    assert!(after["spoofed"] >= before["spoofed"] + 24, "{before:?} -> {after:?}");
    assert_eq!(
        after["dns_queries"], before["dns_queries"],
        "no spoofed packet passed as DNS"
    );
    assert_eq!(test_host().drain(), (0, 0));
}

fn udp_other_than_dns_is_dropped() {
    let sb = sealed();
    let host = test_host();
    host.drain();
    let before = counters(&sb);
    let out = py(
        &sb,
        &format!(
            r#"
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for dst in [('{TEST_HOST}', {TEST_UDP_PORT}), ('203.0.113.9', 443), ('100.96.0.1', 5353), ('100.96.0.1', 123)]:
    for i in range(3):
        s.sendto(b'quic?', dst)
print('sent')
"#
        ),
    );
    assert_eq!(out, "sent");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(host.drain(), (0, 0), "the test host got nothing");
    let after = counters(&sb);
    assert!(
        after["udp_dropped"] >= before["udp_dropped"] + 12,
        "{before:?} -> {after:?}"
    );
}

fn ipv6_has_no_route() {
    let sb = sealed();
    let out = py(
        &sb,
        r#"
import socket
res = []
for dst in ['2001:db8::1', '64:ff9b::c633:6402']:
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s.connect((dst, 53))
        s.send(b'x')
        res.append('sent')
    except OSError as e:
        res.append(str(e.errno))
res.append(open('/proc/sys/net/ipv6/conf/eth0/disable_ipv6').read().strip())
res.append(str(sum(1 for l in open('/proc/net/if_inet6') if l.split()[-1] == 'eth0')))
print(' '.join(res))
"#,
    );
    // ENETUNREACH, IPv6 off on the NIC, no IPv6 address on it.
    assert_eq!(out, "101 101 1 0");
    // The sandbox's namespace has IPv6 off and no IPv6 route either.
    let link = sb.net.as_ref().unwrap();
    let routes = sh(&format!("ip -n {} -6 route show", link.netns));
    assert!(routes.status.success());
    assert_eq!(String::from_utf8_lossy(&routes.stdout).trim(), "");
    let conf = sh(&format!(
        "ip netns exec {} cat /proc/sys/net/ipv6/conf/all/disable_ipv6 /proc/sys/net/ipv6/conf/default/disable_ipv6",
        link.netns
    ));
    assert_eq!(String::from_utf8_lossy(&conf.stdout), "1\n1\n");
    assert_eq!(
        std::fs::read_to_string(format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", link.host_if))
            .unwrap()
            .trim(),
        "1"
    );
}

fn original_destination(sock: &std::net::TcpStream) -> SocketAddrV4 {
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            &mut addr as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    assert_eq!(rc, 0, "SO_ORIGINAL_DST: {}", std::io::Error::last_os_error());
    SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    )
}

/// The egress hooks: guest TCP to any address lands on the stand-in proxy on the sandbox's host
/// address, which recovers where the guest aimed; DNS to the gateway lands on the stand-in
/// responder; a spoofed SYN lands nowhere. Then the delete removes everything.
fn egress_hooks_get_all_guest_tcp_and_dns_then_delete_removes_everything() {
    let sb = create(&id("wired"), Plan::Wired).expect("sandbox boots");
    let link = sb.net.clone().unwrap();
    let bound = hook().bound.lock().unwrap()[sb.id()].clone();
    assert_eq!(
        link.proxy_target().unwrap(),
        bound.proxy.local_addr().unwrap().to_string().parse().unwrap()
    );
    let host = test_host();
    host.drain();

    // The stand-in proxy: answers each connection with where the guest aimed and who it is.
    let proxy = bound.clone();
    let served = std::thread::spawn(move || {
        proxy.proxy.set_nonblocking(true).unwrap();
        let mut seen = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(120);
        while seen.len() < 2 && Instant::now() < deadline {
            match proxy.proxy.accept() {
                Ok((mut s, peer)) => {
                    s.set_nonblocking(false).unwrap();
                    let orig = original_destination(&s);
                    let mut line = String::new();
                    BufReader::new(&s).read_line(&mut line).unwrap();
                    writeln!(s, "proxy saw {orig} from {}", peer.ip()).unwrap();
                    seen.push((orig, peer, line));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        // Anything more (the spoofed SYNs must not be).
        std::thread::sleep(Duration::from_millis(500));
        let extra = std::iter::from_fn(|| proxy.proxy.accept().ok()).count();
        (seen, extra)
    });
    let dns = bound.clone();
    let answered = std::thread::spawn(move || {
        dns.dns.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let mut buf = [0u8; 512];
        let (n, from) = dns.dns.recv_from(&mut buf).unwrap();
        dns.dns.send_to(b"stand-in answer", from).unwrap();
        (buf[..n].to_vec(), from)
    });

    let out = py(
        &sb,
        &format!(
            r#"
import socket, struct
# Spoofed SYNs first: they must reach no one.
r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
for i in range(5):
    tcp = struct.pack('!HHIIBBHHH', 41000 + i, 80, 1, 0, 5 << 4, 2, 1024, 0, 0)
    ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 40, 1, 0, 64, 6, 0,
                     socket.inet_aton('198.51.100.77'), socket.inet_aton('{TEST_HOST}'))
    r.sendto(ip + tcp, ('{TEST_HOST}', 0))
for host, port in [('{TEST_HOST}', {TEST_TCP_PORT}), ('203.0.113.9', 443)]:
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(b'hello\n')
    print(s.makefile().readline().strip())
d = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
d.settimeout(30)
d.sendto(b'query', ('100.96.0.1', 53))
print(d.recv(100).decode())
"#
        ),
    );
    let peer = link.peer_addr;
    assert_eq!(
        out,
        format!(
            "proxy saw {TEST_HOST}:{TEST_TCP_PORT} from {peer}\nproxy saw 203.0.113.9:443 from {peer}\nstand-in answer"
        )
    );
    let (seen, extra) = served.join().unwrap();
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|(_, _, line)| line == "hello\n"));
    assert_eq!(extra, 0, "a spoofed SYN reached the proxy");
    let (query, from) = answered.join().unwrap();
    assert_eq!(
        (query.as_slice(), from.ip()),
        (&b"query"[..], std::net::IpAddr::V4(peer))
    );
    assert_eq!(host.drain(), (0, 0), "nothing went to the test host directly");
    let c = counters(&sb);
    assert!(c["spoofed"] >= 5 && c["tcp_out"] >= 2 && c["dns_queries"] >= 1, "{c:?}");

    // Delete: the namespace, the veth, both tables and the hook's state are gone.
    drop(sb);
    drop(bound);
    block_on(runtime().delete(&link.id)).unwrap();
    assert!(!exists_netns(&link.netns), "namespace left");
    assert!(!exists_link(&link.host_if), "host veth left");
    assert!(!exists_host_table(&link.netns), "host table left");
    assert!(hook().detached.lock().unwrap().contains(&link.id));
    assert!(!hook().bound.lock().unwrap().contains_key(&link.id));
}

/// A VMM that dies on its own (kill -9) takes its sandbox's network with it.
fn a_vmm_that_dies_takes_its_network_with_it() {
    let sb = create(&id("killed"), Plan::Wired).expect("sandbox boots");
    let (pid, link, dir) = (sb.handle.pid, sb.net.clone().unwrap(), sb.handle.dir.clone());
    drop(sb);
    assert!(exists_netns(&link.netns) && exists_link(&link.host_if) && exists_host_table(&link.netns));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    // The dir goes last, after the network.
    while dir.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(runtime().get(&link.id).is_err(), "the sandbox is still listed");
    assert!(!exists_netns(&link.netns), "namespace left");
    assert!(!exists_link(&link.host_if), "host veth left");
    assert!(!exists_host_table(&link.netns), "host table left");
    assert!(hook().detached.lock().unwrap().contains(&link.id));
}

fn a_failing_hook_leaves_nothing_behind() {
    let id = id("refused");
    let err = create(&id, Plan::Fail).err().expect("the create fails");
    assert!(matches!(err, RuntimeError::Network(NetError::Hook { .. })), "{err}");
    assert!(err.to_string().contains("refuses this sandbox"), "{err}");
    let (netns, host_if) = net::names(&test_data_dir(), &id);
    assert!(!exists_netns(&netns));
    assert!(!exists_link(&host_if));
    assert!(!exists_host_table(&netns));
    assert!(!test_data_dir().join("sandboxes").join(&id).exists());
}

/// A crash's leftovers (namespace, veth, host table; no sandbox) go at start-up; another
/// runtime's (another data dir's tag) stay.
fn crash_leftovers_are_removed_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let (netns, host_if) = net::names(dir.path(), "crashed0001");
    let (other_ns, _) = net::names(other.path(), "crashed0001");
    let (lone_ns, lone_if) = net::names(dir.path(), "crashed0002");
    let made = sh(&format!(
        "set -e; ip netns add {netns}; ip link add {host_if} type veth peer name up0 netns {netns}; \
         nft add table inet {netns}; ip netns add {other_ns}; \
         ip link add {lone_if} type veth peer name altlone{pid}",
        pid = std::process::id() % 100_000
    ));
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let rt = block_on(Runtime::open(RuntimeOptions::new(dir.path()))).unwrap();
    let gone = !exists_netns(&netns) && !exists_link(&host_if) && !exists_host_table(&netns);
    let lone_gone = !exists_link(&lone_if) && !exists_netns(&lone_ns);
    let other_kept = exists_netns(&other_ns);
    drop(rt);
    // Whatever is left (on a failure), so the next run starts clean.
    let _ = sh(&format!(
        "ip netns delete {other_ns}; ip netns delete {netns}; ip link delete {host_if}; \
         nft delete table inet {netns}; ip link delete {lone_if}"
    ));
    assert!(gone, "the leftovers of {netns} are still there");
    assert!(lone_gone, "the lone veth {lone_if} is still there");
    assert!(other_kept, "another runtime's namespace was removed");
}

fn catch(f: fn()) -> Result<(), libtest_mimic::Failed> {
    std::panic::catch_unwind(f).map_err(|e| {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into());
        msg.into()
    })
}

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let tests = vec![
        Trial::test("guest_has_eth0_with_the_fixed_address", || {
            catch(guest_has_eth0_with_the_fixed_address)
        }),
        Trial::test("sealed_sandbox_reaches_nothing_but_the_gateways_dns_port", || {
            catch(sealed_sandbox_reaches_nothing_but_the_gateways_dns_port)
        }),
        Trial::test("spoofed_sources_are_dropped", || catch(spoofed_sources_are_dropped)),
        Trial::test("udp_other_than_dns_is_dropped", || catch(udp_other_than_dns_is_dropped)),
        Trial::test("ipv6_has_no_route", || catch(ipv6_has_no_route)),
        Trial::test(
            "egress_hooks_get_all_guest_tcp_and_dns_then_delete_removes_everything",
            || catch(egress_hooks_get_all_guest_tcp_and_dns_then_delete_removes_everything),
        ),
        Trial::test("a_vmm_that_dies_takes_its_network_with_it", || {
            catch(a_vmm_that_dies_takes_its_network_with_it)
        }),
        Trial::test("a_failing_hook_leaves_nothing_behind", || {
            catch(a_failing_hook_leaves_nothing_behind)
        }),
        Trial::test("crash_leftovers_are_removed_at_start_up", || {
            catch(crash_leftovers_are_removed_at_start_up)
        }),
    ];
    let running = !args.list;
    let conclusion = libtest_mimic::run(&args, tests);
    if running {
        if let Some(rt) = RUNTIME.get() {
            for sb in rt.list() {
                let _ = block_on(rt.delete(sb.id()));
            }
        }
        remove_test_host();
    }
    conclusion.exit();
}
