#!/usr/bin/env python3
"""A test "internet" for the egress suites, built in network namespaces made here and nowhere else.

    uplink ns  up0 198.51.100.1/24  <-veth->  eth0 198.51.100.2/24  internet ns
               203.0.113.0/24 via .2                                 lo: the test hosts (203.0.113.x/32)

airlock is started with `--egress-uplink-netns <uplink>` and `--egress-dns 203.0.113.53:53`, so
every lookup and dial a sandbox causes is made in the uplink namespace, which routes only to this
internet: nothing can reach the machine's real network. Only TEST-NET addresses are used.

In the internet namespace:
- DNS (UDP and TCP) on 203.0.113.53:53, authoritative for ZONE; AAAA answers are empty, other
  names NXDOMAIN; every question is logged.
- HTTP on :80 and :8080 and HTTPS on :443 (a self-signed certificate for every name in ZONE),
  answering `served-by <local ip>:<port> host=<Host> sni=<SNI>`; for Host `pypi.test`, a PEP 503
  package index holding one wheel, `hello-airlock` (made here).
- UDP on :9999, which only logs.

Usage: internet.py WORKDIR. Prints one JSON line when ready (the namespaces, the DNS address, the
certificate's path, the log's path), then serves until stdin closes or SIGTERM, and removes both
namespaces. Log lines: `dns <name> <type>`, `tcp <local ip>:<port>`, `udp <local ip>:<port>`.
"""
import base64
import ctypes
import hashlib
import http.server
import json
import os
import signal
import socket
import socketserver
import ssl
import struct
import subprocess
import sys
import threading
import zipfile

HOSTS = {
    "allowed.test": "203.0.113.10",
    "other.test": "203.0.113.20",
    "pypi.test": "203.0.113.30",
    "profile.test": "203.0.113.40",
    "optin.test": "203.0.113.50",
    "denied.test": "203.0.113.60",
}
# A rebinding answer: a public-looking name that resolves to a private address.
ZONE = dict(HOSTS, **{"rebind.test": "10.0.0.5", "loopback.test": "127.0.0.1"})
DNS_ADDR = "203.0.113.53"
PACKAGE = "hello-airlock"
GREETING = "hello from the test index"

LOG_LOCK = threading.Lock()


def log(path, line):
    with LOG_LOCK, open(path, "a") as f:
        f.write(line + "\n")


def sh(*args):
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def sweep(prefix="altest-"):
    """Namespaces left by a test internet whose process is gone."""
    try:
        names = os.listdir("/run/netns")
    except FileNotFoundError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)


def build_namespaces(up, inet):
    sh("ip", "netns", "add", up)
    sh("ip", "netns", "add", inet)
    sh("ip", "-n", up, "link", "set", "lo", "up")
    sh("ip", "-n", inet, "link", "set", "lo", "up")
    sh("ip", "-n", up, "link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", inet)
    sh("ip", "-n", up, "addr", "add", "198.51.100.1/24", "dev", "up0")
    sh("ip", "-n", up, "link", "set", "up0", "up")
    sh("ip", "-n", up, "route", "add", "203.0.113.0/24", "via", "198.51.100.2")
    sh("ip", "-n", inet, "addr", "add", "198.51.100.2/24", "dev", "eth0")
    sh("ip", "-n", inet, "link", "set", "eth0", "up")
    for ip in sorted(set(HOSTS.values()) | {DNS_ADDR}):
        sh("ip", "-n", inet, "addr", "add", f"{ip}/32", "dev", "lo")


def enter(ns):
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), f"setns {ns}")
    os.close(fd)


def make_certificate(workdir):
    cert, key = os.path.join(workdir, "test-web.pem"), os.path.join(workdir, "test-web.key")
    san = ",".join(f"DNS:{n}" for n in HOSTS)
    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=allowed.test",
       "-addext", f"subjectAltName={san}", "-keyout", key, "-out", cert)
    return cert, key


def make_index(workdir):
    """A PEP 503 simple index with one pure-Python wheel."""
    root = os.path.join(workdir, "index")
    dist = PACKAGE.replace("-", "_")
    wheel_name = f"{dist}-1.0-py3-none-any.whl"
    files = {
        f"{dist}/__init__.py": f"GREETING = {GREETING!r}\n",
        f"{dist}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 1.0\n",
        f"{dist}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: airlock-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record_name = f"{dist}-1.0.dist-info/RECORD"
    record.append(f"{record_name},,")
    files[record_name] = "\n".join(record) + "\n"
    os.makedirs(os.path.join(root, "packages"), exist_ok=True)
    wheel_path = os.path.join(root, "packages", wheel_name)
    with zipfile.ZipFile(wheel_path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    sha = hashlib.sha256(open(wheel_path, "rb").read()).hexdigest()
    project = os.path.join(root, "simple", PACKAGE)
    os.makedirs(project, exist_ok=True)
    with open(os.path.join(root, "simple", "index.html"), "w") as f:
        f.write(f'<html><body><a href="{PACKAGE}/">{PACKAGE}</a></body></html>\n')
    with open(os.path.join(project, "index.html"), "w") as f:
        f.write(f'<html><body><a href="../../packages/{wheel_name}#sha256={sha}">{wheel_name}</a></body></html>\n')
    return root


def dns_answer(query, logpath):
    if len(query) < 12:
        return None
    ident, flags, qd = struct.unpack("!HHH", query[:6])
    if qd != 1:
        return None
    labels, i = [], 12
    while i < len(query) and query[i] != 0:
        n = query[i]
        labels.append(query[i + 1:i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    qtype = struct.unpack("!H", query[i + 1:i + 3])[0]
    question = query[12:i + 5]
    name = ".".join(labels).lower()
    log(logpath, f"dns {name} {qtype}")
    rd = flags & 0x0100
    if name in ZONE:
        if qtype == 1:
            answer = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton(ZONE[name])
            return struct.pack("!HHHHHH", ident, 0x8400 | rd, 1, 1, 0, 0) + question + answer
        return struct.pack("!HHHHHH", ident, 0x8400 | rd, 1, 0, 0, 0) + question
    return struct.pack("!HHHHHH", ident, 0x8403 | rd, 1, 0, 0, 0) + question


def serve_dns(logpath):
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((DNS_ADDR, 53))
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((DNS_ADDR, 53))
    tcp.listen(16)

    def udp_loop():
        while True:
            data, peer = udp.recvfrom(4096)
            reply = dns_answer(data, logpath)
            if reply:
                udp.sendto(reply, peer)

    def tcp_one(conn):
        with conn:
            conn.settimeout(5)
            try:
                (n,) = struct.unpack("!H", conn.recv(2))
                reply = dns_answer(conn.recv(n), logpath)
                if reply:
                    conn.sendall(struct.pack("!H", len(reply)) + reply)
            except (OSError, struct.error):
                pass

    def tcp_loop():
        while True:
            conn, _ = tcp.accept()
            threading.Thread(target=tcp_one, args=(conn,), daemon=True).start()

    threading.Thread(target=udp_loop, daemon=True).start()
    threading.Thread(target=tcp_loop, daemon=True).start()


def web_handler(index_root, logpath):
    class Handler(http.server.SimpleHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def __init__(self, *a, **kw):
            super().__init__(*a, directory=index_root, **kw)

        def setup(self):
            super().setup()
            local = self.connection.getsockname()
            log(logpath, f"tcp {local[0]}:{local[1]}")

        def log_message(self, *args):
            pass

        def do_GET(self):
            host = (self.headers.get("Host") or "").split(":")[0]
            if host == "pypi.test" and (self.path.startswith("/simple") or self.path.startswith("/packages")):
                return super().do_GET()
            local = self.connection.getsockname()
            sni = getattr(self.connection, "airlock_sni", None)
            body = f"served-by {local[0]}:{local[1]} host={host} sni={sni}\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class TlsServer(Server):
    def __init__(self, addr, handler, context):
        super().__init__(addr, handler)
        self.context = context

    def get_request(self):
        sock, addr = super().get_request()
        tls = self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return tls, addr

    def finish_request(self, request, client_address):
        # The handshake in the connection's own thread: a slow client holds up only itself.
        request.settimeout(10)
        try:
            request.do_handshake()
        except (OSError, ssl.SSLError):
            return
        super().finish_request(request, client_address)


def serve_web(index_root, cert, key, logpath):
    handler = web_handler(index_root, logpath)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)

    def remember_sni(sock, name, _ctx):
        sock.airlock_sni = name

    context.sni_callback = remember_sni
    servers = [Server(("0.0.0.0", 80), handler), Server(("0.0.0.0", 8080), handler),
               TlsServer(("0.0.0.0", 443), handler, context)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()


def serve_udp(logpath):
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", 9999))

    def loop():
        while True:
            _, _ = udp.recvfrom(4096)
            log(logpath, "udp 0.0.0.0:9999")

    threading.Thread(target=loop, daemon=True).start()


def main():
    workdir = sys.argv[1]
    os.makedirs(workdir, exist_ok=True)
    sweep()
    up, inet = f"altest-{os.getpid()}-up", f"altest-{os.getpid()}-inet"
    logpath = os.path.join(workdir, "internet.log")
    open(logpath, "w").close()
    try:
        build_namespaces(up, inet)
        cert, key = make_certificate(workdir)
        index_root = make_index(workdir)
        enter(inet)
        serve_dns(logpath)
        serve_web(index_root, cert, key, logpath)
        serve_udp(logpath)
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        print(json.dumps({"uplink_netns": up, "internet_netns": inet, "dns": f"{DNS_ADDR}:53", "hosts": ZONE,
                          "cert": cert, "log": logpath, "package": PACKAGE, "greeting": GREETING}), flush=True)
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
        done.wait()
    finally:
        for ns in (up, inet):
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
