"""The E2B_DOMAIN setup of a real deployment, on loopback: wildcard DNS for the test domain and
a test CA the SDKs trust. Nothing in the SDKs is patched: this process gets its own mount
namespace whose /etc/resolv.conf names a DNS server that this module runs, so both glibc (httpx in
older SDKs) and hickory (pyqwest in newer ones) resolve `*.airlock.test` to airlock's TLS listener
on port 443 of a private loopback address, exactly as wildcard DNS would in production."""
import atexit
import ctypes
import os
import shutil
import subprocess
import tempfile
import threading

DOMAIN = "airlock.test"
# Loopback addresses only this suite uses: the DNS server and airlock's HTTPS listener (:443).
DNS_ADDR = "127.0.83.1"
TLS_ADDR = "127.0.83.2"
CLONE_NEWNS = 0x00020000
# The mount namespace this process started in (the machine's resolv.conf), kept open by
# enter_private_resolv_conf for the commands that need the real resolver (template builds).
_HOST_MOUNT_NS = None


def enter_private_resolv_conf(workdir):
    """Give this process a private /etc/resolv.conf naming DNS_ADDR. Must run while the process
    is single-threaded: unshare(CLONE_NEWNS) of a threaded process moves only the calling thread."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise RuntimeError(f"wildcard DNS must be set up before any thread starts ({threads} running)")
    global _HOST_MOUNT_NS
    _HOST_MOUNT_NS = os.open("/proc/self/ns/mnt", os.O_RDONLY)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS): the E2B suite runs as root")
    # Private propagation first, so the bind mount below never reaches the host's namespace.
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    conf = os.path.join(workdir, "resolv.conf")
    with open(conf, "w") as f:
        f.write(f"nameserver {DNS_ADDR}\noptions timeout:2 attempts:2\n")
    subprocess.run(["mount", "--bind", conf, "/etc/resolv.conf"], check=True)


def run_with_host_resolver(argv, **kwargs):
    """subprocess.run(argv) in the machine's own mount namespace, so it resolves names with the
    machine's resolver, not the suite's wildcard DNS (a template build fetches Debian packages and
    wheels; on a fresh machine it would fail here otherwise)."""
    if _HOST_MOUNT_NS is None:
        return subprocess.run(argv, **kwargs)
    enter = ["nsenter", f"--mount=/proc/self/fd/{_HOST_MOUNT_NS}", f"--wd={os.getcwd()}", "--"]
    return subprocess.run(enter + list(argv), pass_fds=(_HOST_MOUNT_NS,), **kwargs)


def start_dns_server():
    """Answer A queries for the domain and its subdomains with TLS_ADDR, nothing else."""
    from dnslib import QTYPE, RCODE, RR, A
    from dnslib.server import BaseResolver, DNSLogger, DNSServer

    class Wildcard(BaseResolver):
        def resolve(self, request, handler):
            reply = request.reply()
            name = str(request.q.qname).rstrip(".").lower()
            if name != DOMAIN and not name.endswith("." + DOMAIN):
                reply.header.rcode = RCODE.NXDOMAIN
            elif request.q.qtype == QTYPE.A:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(TLS_ADDR), ttl=60))
            # AAAA and the rest: NOERROR with no answer (the name exists, IPv4 only).
            return reply

    quiet = DNSLogger("-request,-reply,-truncated,-recv,-send,-data")  # errors only
    servers = [DNSServer(Wildcard(), address=DNS_ADDR, port=53, tcp=tcp, logger=quiet) for tcp in (False, True)]
    for s in servers:
        s.start_thread()
    return servers


def make_test_ca(workdir):
    """A throwaway CA and a certificate for `<domain>` + `*.<domain>`; returns (ca, cert, key) paths."""
    import trustme

    ca = trustme.CA()
    leaf = ca.issue_cert(DOMAIN, "*." + DOMAIN)
    paths = [os.path.join(workdir, n) for n in ("ca.pem", "cert.pem", "key.pem")]
    ca.cert_pem.write_to_path(paths[0])
    leaf.cert_chain_pems[0].write_to_path(paths[1])
    leaf.private_key_pem.write_to_path(paths[2])
    return paths


def setup():
    """Everything above, in order; returns the CA, certificate and key paths."""
    workdir = tempfile.mkdtemp(prefix="airlock-e2b-dns-")
    # Removed however the process ends (also when pytest stops before any fixture ran).
    atexit.register(shutil.rmtree, workdir, True)
    enter_private_resolv_conf(workdir)
    ca, cert, key = make_test_ca(workdir)
    # Both SDK transports read the trust store from here (httpx's and pyqwest's); only the test CA
    # is trusted, so nothing in this run can reach a real TLS server either.
    os.environ["SSL_CERT_FILE"] = ca
    return workdir, ca, cert, key
