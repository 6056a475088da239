"""A container registry for the suite: Debian's `docker-registry` on a free loopback port (the
suite's server mirrors `docker.io` to it), and a push of a small busybox image over the
registry's HTTP API, as a registry client would."""
import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.request

BIN = "/usr/bin/docker-registry"
BUSYBOX = "/bin/busybox"


def start(procs, cleanups):
    """Start a registry; returns `127.0.0.1:<port>`. Its process joins `procs` (the suite's
    `_stop` ends it), the removal of its storage `cleanups`."""
    work = tempfile.mkdtemp(prefix="airlock-e2b-registry-")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    host = f"127.0.0.1:{port}"
    config = os.path.join(work, "config.yml")
    with open(config, "w") as f:
        f.write(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {work}/data\n"
                f"http:\n  addr: {host}\n")
    log = open(os.path.join(work, "registry.log"), "w")
    proc = subprocess.Popen([BIN, "serve", config], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    log.close()
    procs.append(proc)
    cleanups.append(lambda: shutil.rmtree(work, ignore_errors=True))
    deadline = time.time() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return host
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"docker-registry did not listen; see {work}/registry.log")
            time.sleep(0.05)


def _busybox_layer():
    """A tar of busybox with every applet a symlink in /bin, and /etc/passwd with root."""
    buf = io.BytesIO()
    applets = subprocess.run([BUSYBOX, "--list"], check=True, capture_output=True, text=True).stdout.split()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        def add(name, data=None, mode=0o644, kind=tarfile.REGTYPE, link=""):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime, info.linkname = kind, mode, 1_700_000_000, link
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
        for d in ("bin", "etc", "root", "tmp"):
            add(d, kind=tarfile.DIRTYPE, mode=0o755)
        with open(BUSYBOX, "rb") as f:
            add("bin/busybox", f.read(), mode=0o755)
        for a in applets:
            if a != "busybox":
                add(f"bin/{a}", kind=tarfile.SYMTYPE, mode=0o777, link="busybox")
        add("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
        add("etc/group", b"root:x:0:\n")
    return buf.getvalue()


def _put_blob(host, repo, data):
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    req = urllib.request.Request(f"http://{host}/v2/{repo}/blobs/uploads/", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=30) as r:
        location = r.headers["Location"]
    if location.startswith("/"):
        location = f"http://{host}{location}"
    sep = "&" if "?" in location else "?"
    req = urllib.request.Request(f"{location}{sep}digest={digest}", method="PUT", data=data,
                                 headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(req, timeout=60).close()
    return {"digest": digest, "size": len(data)}


def push_busybox(host, repo, tag):
    """Push busybox as `<host>/<repo>:<tag>` (one gzipped layer, an OCI manifest)."""
    tar = _busybox_layer()
    layer = _put_blob(host, repo, gzip.compress(tar, compresslevel=1))
    layer["mediaType"] = "application/vnd.oci.image.layer.v1.tar+gzip"
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar).hexdigest()]},
    }).encode()
    cfg = _put_blob(host, repo, config)
    cfg["mediaType"] = "application/vnd.oci.image.config.v1+json"
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": cfg, "layers": [layer]}).encode()
    req = urllib.request.Request(f"http://{host}/v2/{repo}/manifests/{tag}", method="PUT", data=manifest,
                                 headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    urllib.request.urlopen(req, timeout=30).close()
