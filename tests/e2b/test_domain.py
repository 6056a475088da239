"""The E2B_DOMAIN path: the SDK gets only `E2B_DOMAIN` and `E2B_API_KEY`, resolves
`api.<domain>` and `<port>-<sandbox id>.<domain>` through (the suite's) wildcard DNS, and speaks
HTTPS to airlock's TLS listener, which routes by Host: envd, the code interpreter, and any other
port forwarded into the sandbox (plain HTTP and a WebSocket upgrade)."""
import base64
import hashlib
import os
import socket
import ssl
import time

import httpx
import pytest

import conftest
import wildcard_dns
from conftest import delete_sandbox, skip_unless_sdk_has

# A WebSocket echo server on 8765 inside the sandbox, standard library only (RFC 6455 handshake,
# one unfragmented masked client frame at a time, echoed back unmasked).
WS_ECHO = r"""
import base64, hashlib, socket, struct
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8765)); srv.listen()
while True:
    c, _ = srv.accept()
    f = c.makefile("rb")
    key = None
    while (line := f.readline().strip()):
        k, _, v = line.decode().partition(":")
        if k.lower() == "sec-websocket-key":
            key = v.strip().encode()
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest()).decode()
    c.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Accept: {accept}\r\n\r\n").encode())
    while True:
        head = f.read(2)
        if len(head) < 2: break
        n = head[1] & 0x7F
        if n == 126: n = struct.unpack(">H", f.read(2))[0]
        mask = f.read(4)
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(n)))
        if head[0] & 0x0F == 8: break
        c.sendall(bytes([head[0], len(data)]) + data)
    c.close()
"""


@pytest.fixture
def domain_env():
    with conftest.domain_env():
        yield


@pytest.fixture
def domain_sbx(airlock_server, domain_env):
    from e2b import Sandbox

    s = Sandbox.create(timeout=600)
    yield s
    s.kill()


def test_domain_resolves_to_the_tls_listener():
    # The SDKs below reach airlock only through this resolution; checked first for a clear failure.
    assert socket.gethostbyname("api." + wildcard_dns.DOMAIN) == wildcard_dns.TLS_ADDR
    assert socket.gethostbyname("49983-abcdef12." + wildcard_dns.DOMAIN) == wildcard_dns.TLS_ADDR


def test_sdk_with_only_domain_and_key(domain_sbx):
    from e2b import Sandbox

    assert domain_sbx.get_host(8000) == f"8000-{domain_sbx.sandbox_id}.{wildcard_dns.DOMAIN}"
    r = domain_sbx.commands.run("echo over-tls; id -un")
    assert r.stdout == "over-tls\nuser\n"
    domain_sbx.files.write("/tmp/tls.txt", "through the TLS listener")
    assert domain_sbx.files.read("/tmp/tls.txt") == "through the TLS listener"
    # A second client connecting by id finds the same sandbox through api.<domain>.
    again = Sandbox.connect(domain_sbx.sandbox_id)
    assert again.commands.run("cat /tmp/tls.txt").stdout == "through the TLS listener"
    assert domain_sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]


def test_port_forward_http_and_websocket(domain_sbx):
    domain_sbx.files.write("/home/user/www/hello.txt", "served from inside the sandbox")
    domain_sbx.commands.run("python3 -m http.server 8000 --directory /home/user/www", background=True)
    domain_sbx.files.write("/tmp/ws_echo.py", WS_ECHO)
    domain_sbx.commands.run("python3 /tmp/ws_echo.py", background=True)
    skip_unless_sdk_has(hasattr(domain_sbx, "traffic_access_token"), "Sandbox.traffic_access_token")
    token = domain_sbx.traffic_access_token
    assert token
    url = f"https://{domain_sbx.get_host(8000)}/hello.txt"
    client = httpx.Client(http2=True, timeout=30)  # HTTP/2 outside, HTTP/1.1 to the port inside
    for _ in range(100):  # the server inside takes a moment to listen
        r = client.get(url, headers={"e2b-traffic-access-token": token})
        if r.status_code != 502:
            break
        time.sleep(0.1)
    assert (r.status_code, r.text, r.http_version) == (200, "served from inside the sandbox", "HTTP/2")
    # Sandbox ports are never public: a caller without a credential is told it needs one (the
    # same for any sandbox id), one with a wrong token learns nothing (a missing sandbox's answer).
    denied = client.get(url)
    assert denied.status_code == 401 and "E2B-Traffic-Access-Token" in denied.json()["message"]
    wrong = client.get(url, headers={"e2b-traffic-access-token": "0" * 32})
    assert wrong.status_code == 502 and "is not running" in wrong.json()["message"]

    host = domain_sbx.get_host(8765)
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    key = base64.b64encode(os.urandom(16)).decode()
    for _ in range(100):
        raw = socket.create_connection((host, 443), timeout=30)
        conn = ctx.wrap_socket(raw, server_hostname=host)
        conn.sendall((f"GET /chat HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                      f"E2B-Traffic-Access-Token: {token}\r\n\r\n").encode())
        f = conn.makefile("rb")
        status = f.readline()
        if b" 502 " not in status:
            break
        conn.close()
        time.sleep(0.1)
    assert status.startswith(b"HTTP/1.1 101"), status
    headers = {}
    while (line := f.readline().strip()):
        k, _, v = line.decode().partition(":")
        headers[k.lower()] = v.strip()
    expected = base64.b64encode(hashlib.sha1(key.encode() + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    assert headers["sec-websocket-accept"] == expected.decode()
    for text in (b"ping through airlock", b"x" * 100):
        mask = os.urandom(4)
        conn.sendall(bytes([0x81, 0x80 | len(text)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(text)))
        assert f.read(2) == bytes([0x81, len(text)])
        assert f.read(len(text)) == text
    conn.close()


def test_code_interpreter_over_the_domain(airlock_server, domain_env):
    # No E2B_DEBUG and no localhost:49999 here: `49999-<id>.<domain>` is routed into the sandbox.
    from e2b_code_interpreter import Sandbox

    s = Sandbox.create(timeout=600)
    try:
        assert s.run_code("y = 20").error is None
        ex = s.run_code("print('tls'); y + 22")
        assert ex.error is None, ex.error
        assert (ex.logs.stdout, ex.text) == (["tls\n"], "42")
    finally:
        delete_sandbox(airlock_server, s.sandbox_id)
