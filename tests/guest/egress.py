"""Egress probes, run inside a real sandbox by tests/egress.rs. Each prints one JSON line.

    egress.py http HOST [--ip IP] [--port N]        GET / with Host: HOST (to IP when given)
    egress.py tls SNI [--ip IP] [--host H] [--ca F]  TLS with SNI (verified against F), then GET
    egress.py dns NAME [--type A|AAAA]               one query to the resolver in /etc/resolv.conf
    egress.py udp IP PORT                            one datagram (the test checks it never lands)
    egress.py ipv6                                   connect to an IPv6 TEST-NET address
    egress.py spoof IP PORT                          (root) connect from an address not ours
"""
import json
import random
import socket
import ssl
import struct
import subprocess
import sys

TIMEOUT = 5


def out(**kw):
    print(json.dumps(kw), flush=True)


def arg(name, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def address(host):
    ip = arg("--ip")
    if ip:
        return ip
    return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]


def read_all(sock):
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def request(sock, host):
    sock.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    data = read_all(sock).decode("utf-8", "replace")
    return data.split("\r\n\r\n", 1)[1] if "\r\n\r\n" in data else data


def http(host):
    port = int(arg("--port", "80"))
    try:
        ip = address(host)
        with socket.create_connection((ip, port), timeout=TIMEOUT) as s:
            out(ok=True, body=request(s, host).strip())
    except Exception as e:
        out(ok=False, error=f"{type(e).__name__}: {e}")


def tls(sni):
    host = arg("--host", sni)
    ca = arg("--ca")
    ctx = ssl.create_default_context(cafile=ca) if ca else ssl._create_unverified_context()
    try:
        ip = address(sni)
        with socket.create_connection((ip, 443), timeout=TIMEOUT) as raw:
            with ctx.wrap_socket(raw, server_hostname=sni) as s:
                out(ok=True, body=request(s, host).strip())
    except Exception as e:
        out(ok=False, error=f"{type(e).__name__}: {e}")


def dns(name):
    qtype = {"A": 1, "AAAA": 28}[arg("--type", "A")]
    server = next(line.split()[1] for line in open("/etc/resolv.conf") if line.startswith("nameserver"))
    ident = random.randrange(65536)
    q = struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    q += b"\x00" + struct.pack("!HH", qtype, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(TIMEOUT)
    try:
        s.sendto(q, (server, 53))
        data = s.recv(4096)
    except Exception as e:
        return out(answered=False, error=f"{type(e).__name__}: {e}")
    rcode = struct.unpack("!H", data[2:4])[0] & 0xF
    ancount = struct.unpack("!H", data[6:8])[0]
    # Answers follow the echoed question; A records' addresses are their last 4 bytes.
    addrs, i = [], len(q)
    for _ in range(ancount):
        i += 2 if data[i] & 0xC0 == 0xC0 else data.index(b"\x00", i) - i + 1
        rtype, _, _, rdlen = struct.unpack("!HHIH", data[i:i + 10])
        i += 10
        if rtype == 1:
            addrs.append(socket.inet_ntoa(data[i:i + rdlen]))
        i += rdlen
    rcodes = {0: "NOERROR", 2: "SERVFAIL", 3: "NXDOMAIN", 5: "REFUSED"}
    out(answered=True, rcode=rcodes.get(rcode, str(rcode)), addrs=addrs)


def udp(ip, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.sendto(b"airlock egress probe", (ip, int(port)))
        out(sent=True)
    except Exception as e:
        out(sent=False, error=f"{type(e).__name__}: {e}")


def ipv6():
    try:
        socket.create_connection(("2001:db8::1", 80), timeout=TIMEOUT).close()
        out(ok=True)
    except Exception as e:
        out(ok=False, error=f"{type(e).__name__}: {e}")


def spoof(ip, port):
    fake = "100.96.0.3"
    subprocess.run(["ip", "addr", "add", f"{fake}/32", "dev", "eth0"], check=True)
    try:
        s = socket.socket()
        s.settimeout(TIMEOUT)
        s.bind((fake, 0))
        s.connect((ip, int(port)))
        out(ok=True, body=request(s, "allowed.test").strip())
    except Exception as e:
        out(ok=False, error=f"{type(e).__name__}: {e}")
    finally:
        subprocess.run(["ip", "addr", "del", f"{fake}/32", "dev", "eth0"])


if __name__ == "__main__":
    cmd, rest = sys.argv[1], [a for a in sys.argv[2:]]
    {"http": http, "tls": tls, "dns": dns, "udp": udp, "ipv6": ipv6, "spoof": spoof}[cmd](*[
        a for i, a in enumerate(rest) if not a.startswith("--") and (i == 0 or not rest[i - 1].startswith("--"))
    ])
