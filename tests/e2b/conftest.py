"""Fixtures for the E2B SDK suite: one real `airlock serve` with real VMs, and the SDK's two
environment variables pointing at it. Nothing of airlock is mocked; the SDK is the PyPI package."""
import contextlib
import glob
import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

import registry
import wildcard_dns

# Before pytest or an SDK starts a thread: this process's own resolv.conf and trust store.
DNS_WORKDIR, TEST_CA, TLS_CERT, TLS_KEY = wildcard_dns.setup()

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("AIRLOCK_BIN", os.path.join(ROOT, "target", "release", "airlock"))
DATA = os.environ.get("AIRLOCK_TEST_DATA_DIR", "/var/lib/airlock-test")
# What the E2B door's egress tests may reach: the tenant's base policy while the suite runs.
TENANT_ALLOWS = ("allowed.test", "other.test")
# root@local's password on the suite's server; the admin commands (`key create`, `tenant
# policy`) sign in with it.
os.environ["AIRLOCK_CONSOLE_PASSWORD"] = "airlock-e2b-suite-console"


def _start_internet():
    """The test internet (tests/net/internet.py): sandboxes' lookups and dials go only there."""
    workdir = tempfile.mkdtemp(prefix="airlock-e2b-internet-")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "net", "internet.py"), workdir],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("the test internet did not start")
    return proc, workdir, json.loads(line)


def _admin(url, *args):
    """An admin command (`airlock login` first) against the suite's server."""
    env = dict(os.environ, AIRLOCK_URL=url)
    subprocess.run([BIN, "--data-dir", DATA, "login"], check=True, env=env, stdin=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    r = subprocess.run([BIN, "--data-dir", DATA, *args], check=True, env=env, capture_output=True, text=True)
    return r.stdout.strip()


def _set_tenant_policy(url, domains):
    args = ["tenant", "policy", "set"]
    for d in domains:
        args += ["--allow-domain", d]
    _admin(url, *args)


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _wait_up(url, proc, log, path="/openapi-m1.json", ready=lambda body: True):
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if ready(r.read()):
                    return
        except Exception:
            pass
        if time.time() > deadline or proc.poll() is not None:
            raise RuntimeError(f"airlock did not come up at {url}; see {log}")
        time.sleep(0.2)


def _stop(procs, cleanups):
    """SIGTERM to each process, the last started first, then the cleanups in turn."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for cleanup in cleanups:
        cleanup()


PG_BIN = "/usr/lib/postgresql/15/bin"


def _start_postgres(cleanups):
    """A throwaway Postgres (the store the replicas share); its URL. Stopped by a cleanup."""
    work = tempfile.mkdtemp(prefix="airlock-e2b-pg-")
    cleanups.append(lambda: shutil.rmtree(work, ignore_errors=True))
    as_pg = []
    if os.geteuid() == 0:
        shutil.chown(work, "postgres", "postgres")
        as_pg = ["runuser", "-u", "postgres", "--"]
    data = os.path.join(work, "data")
    subprocess.run([*as_pg, f"{PG_BIN}/initdb", "-A", "trust", "-U", "airlock", "-E", "UTF8", "--locale=C.UTF-8",
                    "--no-sync", "-D", data], check=True, stdout=subprocess.DEVNULL)
    port = _free_port()
    subprocess.run([*as_pg, f"{PG_BIN}/pg_ctl", "-D", data, "-l", os.path.join(work, "log"), "-o",
                    f"-c listen_addresses=127.0.0.1 -p {port} -k {work} -c fsync=off", "-w", "-t", "30", "start"],
                   check=True, stdout=subprocess.DEVNULL)
    cleanups.insert(0, lambda: subprocess.run([*as_pg, f"{PG_BIN}/pg_ctl", "-D", data, "-m", "immediate", "-w",
                                               "stop"], stdout=subprocess.DEVNULL))
    return f"postgres://airlock@127.0.0.1:{port}/postgres"


def _start_replicas(port, e2b, egress, log, procs, cleanups, mirror):
    """Many hosts (issue 25): the suite's sandboxes on an `airlock node` process (the suite's
    data dir, its templates), placed by two `serve --store postgres://...` replicas; the SDK
    talks to the second only, which holds no VM: every call crosses to the node."""
    store = _start_postgres(cleanups)
    work = tempfile.mkdtemp(prefix="airlock-e2b-replicas-")
    cleanups.append(lambda: shutil.rmtree(work, ignore_errors=True))
    secret = os.path.join(work, "cluster.secret")
    with open(secret, "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    node = f"127.0.0.1:{_free_port()}"
    procs.append(subprocess.Popen([BIN, "--data-dir", DATA, "node", "--listen", node, "--secret-file", secret,
                                   "--drain-seconds", "10", *egress], stdout=log, stderr=log))
    deadline = time.time() + 120
    while True:
        try:
            host, node_port = node.split(":")
            socket.create_connection((host, int(node_port)), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline or procs[-1].poll() is not None:
                raise RuntimeError(f"airlock node did not listen; see {log.name}")
            time.sleep(0.2)
    dirs = [os.path.join(work, r) for r in ("a", "b")]
    for i, (d, p) in enumerate(zip(dirs, (_free_port(), port))):
        os.makedirs(d)
        if i > 0:
            # Every replica has the same server secret and key (a Kubernetes Secret's).
            for f in ("server.secret", "credentials"):
                shutil.copy(os.path.join(dirs[0], f), os.path.join(d, f))
        serve = [BIN, "--data-dir", d, "serve", "--listen", f"127.0.0.1:{p}", "--tenant-share", "1",
                 "--store", store, "--node", node, "--node-secret-file", secret, *mirror]
        procs.append(subprocess.Popen(serve + (e2b if i > 0 else []), stdout=log, stderr=log))
        _wait_up(f"http://127.0.0.1:{p}", procs[-1], log.name, "/readyz",
                 lambda body: json.loads(body or b"{}").get("nodes_ready", 0) >= 1)


def _native(url, key, method, path):
    req = urllib.request.Request(url + path, method=method, headers={"Authorization": "Bearer " + key})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read()
        return json.loads(raw) if raw else None


@pytest.fixture(scope="session", autouse=True)
def airlock_server():
    os.makedirs(DATA, exist_ok=True)
    for template in ("seed", "base", "code-interpreter-v1"):
        # Builds fetch from the machine's package mirrors: the machine's resolver, not the suite's.
        wildcard_dns.run_with_host_resolver([BIN, "--data-dir", DATA, "template", "build", template], check=True,
                                            stdout=subprocess.DEVNULL)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # The newest servers' logs stay for a look after a run; older ones go.
    logs = sorted(glob.glob(os.path.join(DATA, "e2b-serve-*.log")), key=os.path.getmtime)
    for old in logs[:-20]:
        os.remove(old)
    log = open(os.path.join(DATA, f"e2b-serve-{port}.log"), "w")
    # E2B_DEBUG clients reach the code interpreter at localhost:49999: airlock serves that port too.
    e2b = ["--e2b-debug-listen", "127.0.0.1:49999",
           # E2B_DOMAIN clients: HTTPS on :443 of the address the suite's wildcard DNS answers.
           "--e2b-domain", wildcard_dns.DOMAIN, "--tls-listen", f"{wildcard_dns.TLS_ADDR}:443",
           "--tls-cert", TLS_CERT, "--tls-key", TLS_KEY]
    internet, internet_dir, net = _start_internet()
    egress = ["--egress-uplink-netns", net["uplink_netns"], "--egress-dns", net["dns"]]
    dns = wildcard_dns.start_dns_server()
    # Stopped last first, whatever happens below.
    procs = []
    cleanups = []
    try:
        # The operator's mirror of docker.io: a registry of the suite's own on loopback.
        mirror_host = registry.start(procs, cleanups)
        mirror = ["--registry-mirror", f"docker.io=http://{mirror_host}"]
        if os.environ.get("E2B_SUITE_ROUTE") == "replica":
            _start_replicas(port, e2b, egress, log, procs, cleanups, mirror)
        else:
            # A single-tenant node: the suite may use the whole node, not half of what disk is free.
            serve = [BIN, "--data-dir", DATA, "serve", "--listen", f"127.0.0.1:{port}", "--tenant-share", "1",
                     *e2b, *egress, *mirror]
            procs.append(subprocess.Popen(serve, stdout=log, stderr=log))
            _wait_up(url, procs[-1], log.name)
        # `--e2b`: the `e2b_<hex>` shape, which e2b 2.26 to 2.5x insist on; the others take any key.
        key = _admin(url, "key", "create", "--e2b", "--name", "e2b-suite")
        _set_tenant_policy(url, TENANT_ALLOWS)
        os.environ["E2B_API_KEY"] = key
        if os.environ.get("E2B_SUITE_ROUTE") == "domain":
            # The whole suite over E2B_DOMAIN + TLS (SDKs older than E2B_SANDBOX_URL need this).
            os.environ["E2B_DOMAIN"] = wildcard_dns.DOMAIN
        else:
            # The settings the README tells E2B users to set (API and envd share one port).
            os.environ["E2B_API_URL"] = url
            os.environ["E2B_SANDBOX_URL"] = url
            # The volume content API (e2b's Volume) is on the same port.
            os.environ["E2B_VOLUME_API_URL"] = url
        yield {"url": url, "key": key, "internet": net, "mirror": mirror_host}
        _set_tenant_policy(url, ())
        # VMs outlive the server by design: delete what the tests left, then stop it.
        for sb in _native(url, key, "GET", "/v1/sandboxes?limit=100")["sandboxes"]:
            _native(url, key, "DELETE", f"/v1/sandboxes/{sb['id']}")
        deadline = time.time() + 60
        while _native(url, key, "GET", "/v1/sandboxes?limit=100")["sandboxes"] and time.time() < deadline:
            time.sleep(0.2)
    finally:
        # Even when the cleanup above fails, the server stops (the next one would find the
        # data dir locked); VMs it leaves are removed by the next server's start.
        _stop(procs, cleanups)
        for server in dns:
            server.stop()
        internet.stdin.close()  # it removes its namespaces
        internet.wait(timeout=30)
        shutil.rmtree(internet_dir, ignore_errors=True)


@contextlib.contextmanager
def domain_env():
    """What a user of a wildcard-DNS deployment sets: the domain and the key, nothing else."""
    names = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG", "E2B_DOMAIN")
    saved = {n: os.environ.pop(n, None) for n in names}
    os.environ["E2B_DOMAIN"] = wildcard_dns.DOMAIN
    try:
        yield
    finally:
        for n, v in saved.items():
            os.environ.pop(n, None)
            if v is not None:
                os.environ[n] = v


def skip_unless_sdk_has(present, what):
    """Older SDKs lack some calls; the matrix in the README says which version has what."""
    if not present:
        pytest.skip(f"e2b {importlib.metadata.version('e2b')} has no {what}")


def delete_sandbox(server, sandbox_id):
    """Through the native API: in E2B_DEBUG mode the SDK's kill() sends nothing."""
    _native(server["url"], server["key"], "DELETE", f"/v1/sandboxes/{sandbox_id}")


@pytest.fixture(scope="session")
def sbx(airlock_server):
    from e2b import Sandbox

    s = Sandbox.create(timeout=1800, metadata={"suite": "e2b-shared"})
    yield s
    s.kill()
