"""Unmodified e2b SDK calls against airlock (real server, real VMs)."""
import os
import time
import uuid

import inspect
import subprocess

import httpx

import pytest
from conftest import skip_unless_sdk_has
from e2b import CommandExitException, Sandbox, SandboxQuery
from e2b.exceptions import InvalidArgumentException, NotFoundException, SandboxException, TimeoutException


def test_create_kill_and_context_manager():
    with Sandbox.create(timeout=120) as s:
        assert s.is_running()
        info = s.get_info()
        assert info.sandbox_id == s.sandbox_id and info.template_id == "base"
        sid = s.sandbox_id
    assert not Sandbox.connect_if_exists(sid) if hasattr(Sandbox, "connect_if_exists") else True
    assert Sandbox.kill(sid) is False  # already gone


def test_commands_run_output_exit_codes_env_cwd_user(sbx):
    r = sbx.commands.run("echo out; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo partial; exit 7")
    assert e.value.exit_code == 7 and e.value.stdout == "partial\n"
    assert sbx.commands.run("echo $GREETING", envs={"GREETING": "hi there"}).stdout == "hi there\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("id -un").stdout == "user\n"
    assert sbx.commands.run("id -un", user="root").stdout == "root\n"
    assert sbx.commands.run("echo $HOME", user="root").stdout == "/root\n"


def test_command_timeout_kills_the_process(sbx):
    started = time.time()
    with pytest.raises((TimeoutException, CommandExitException)):
        sbx.commands.run("sleep 60", timeout=2)
    assert time.time() - started < 30
    assert not any(p.cmd == "/bin/bash" and "sleep 60" in " ".join(p.args) for p in sbx.commands.list())


def test_background_connect_list_stdin_kill(sbx):
    # `stdin=True` keeps stdin open on SDKs that have the option; older ones always did.
    keep_stdin = {"stdin": True} if "stdin" in inspect.signature(sbx.commands.run).parameters else {}
    h = sbx.commands.run("read line; echo got:$line; sleep 600", background=True, **keep_stdin)
    assert h.pid > 0
    assert any(p.pid == h.pid for p in sbx.commands.list())
    sbx.commands.send_stdin(h.pid, "hello\n")
    deadline = time.time() + 30
    again = sbx.commands.connect(h.pid)
    seen = ""
    for stdout, _stderr, _pty in again:
        seen += stdout or ""
        if "got:hello" in seen or time.time() > deadline:
            break
    assert "got:hello" in seen
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()
    assert sbx.commands.kill(h.pid) is False
    assert all(p.pid != h.pid for p in sbx.commands.list())


def test_pty_create_send_resize(sbx):
    import threading

    from e2b import PtySize

    out = bytearray()
    h = sbx.pty.create(PtySize(rows=24, cols=80), envs={"PS1": "READY> "})
    result = {}

    def wait():
        try:
            result["r"] = h.wait(on_pty=out.extend)
        except CommandExitException as e:
            result["r"] = e

    t = threading.Thread(target=wait)
    t.start()
    deadline = time.time() + 30
    while b"READY> " not in out and time.time() < deadline:
        time.sleep(0.1)
    sbx.pty.resize(h.pid, PtySize(rows=50, cols=132))
    sbx.pty.send_stdin(h.pid, b"stty size; exit 5\n")
    t.join(30)
    text = out.decode(errors="replace")
    assert "50 132" in text, text
    assert result["r"].exit_code == 5


def test_async_pty_disconnect_and_connect_again(sbx):
    """E2B's async `test_connect_to_pty`: a PTY left by one handle is taken up by another,
    which gets its output and its exit."""
    import asyncio

    from e2b import AsyncSandbox
    from e2b.sandbox.commands.command_handle import PtySize

    async def run():
        s = await AsyncSandbox.connect(sbx.sandbox_id)
        first, second = [], []
        terminal = await s.pty.create(PtySize(80, 24), on_data=lambda x: first.append(x.decode()),
                                      envs={"FOO": "bar"})
        await s.pty.send_stdin(terminal.pid, b"echo $FOO\n")
        await asyncio.sleep(0.3)
        await terminal.disconnect()
        again = await s.pty.connect(terminal.pid, on_data=lambda x: second.append(x.decode()))
        await s.pty.send_stdin(terminal.pid, b"echo $FOO\nexit\n")
        await again.wait()
        assert again.pid == terminal.pid and again.exit_code == 0
        assert "bar" in "".join(first) and "bar" in "".join(second), (first, second)

    asyncio.run(asyncio.wait_for(run(), 60))


def test_files_text_bytes_large_and_many(sbx):
    info = sbx.files.write("/home/user/e2b/hello.txt", "hello from e2b")
    assert (info.name, info.path) == ("hello.txt", "/home/user/e2b/hello.txt")
    assert sbx.files.read("/home/user/e2b/hello.txt") == "hello from e2b"
    blob = bytes(range(256)) * 4096 * 10  # 10 MiB
    sbx.files.write("/home/user/e2b/big.bin", blob)
    assert bytes(sbx.files.read("/home/user/e2b/big.bin", format="bytes")) == blob
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    sbx.files.write_files([WriteEntry(path="/home/user/e2b/m/a.txt", data="A"), WriteEntry(path="/home/user/e2b/m/b.txt", data=b"B")])
    assert sbx.files.read("/home/user/e2b/m/a.txt") == "A" and sbx.files.read("/home/user/e2b/m/b.txt") == "B"
    assert sbx.commands.run("stat -c %U /home/user/e2b/hello.txt").stdout == "user\n"
    with pytest.raises(NotFoundException):
        sbx.files.read("/home/user/e2b/missing.txt")


def test_files_gzip_uploads(sbx, airlock_server):
    skip_unless_sdk_has("gzip" in inspect.signature(sbx.files.write).parameters, "files.write(gzip=)")
    blob = os.urandom(1 << 20) + b"tail" * 100000  # 1.4 MiB, partly compressible
    sbx.files.write("/home/user/e2b/gz.bin", blob, gzip=True, use_octet_stream=True)
    assert bytes(sbx.files.read("/home/user/e2b/gz.bin", format="bytes")) == blob
    # What the SDK sent, by hand: a broken gzip stream and an unknown coding are 400s, never a
    # half-written success.
    import gzip
    import httpx

    url = airlock_server["url"] + "/files"
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token,
               "Content-Type": "application/octet-stream"}
    ok = httpx.post(url, params={"path": "/tmp/gz.txt"}, content=gzip.compress(b"plain"),
                    headers={**headers, "Content-Encoding": "gzip"})
    assert ok.status_code == 200 and sbx.files.read("/tmp/gz.txt") == "plain"
    # A gzip stream that breaks off midway: 400, and the file it was replacing is untouched.
    sbx.files.write("/tmp/keep.txt", "keep me")
    broken = httpx.post(url, params={"path": "/tmp/keep.txt"}, content=gzip.compress(os.urandom(300000))[:200000] + b"garbage!",
                        headers={**headers, "Content-Encoding": "gzip"})
    assert broken.status_code == 400, broken.text
    assert "upload body" in broken.json()["message"]
    assert sbx.files.read("/tmp/keep.txt") == "keep me"
    # The agent drops the partial upload once it sees the stream end (it may lag the 400 a little,
    # more on a loaded machine).
    for _ in range(200):
        leftovers = [e.name for e in sbx.files.list("/tmp") if "keep" in e.name]
        if leftovers == ["keep.txt"]:
            break
        time.sleep(0.1)
    assert leftovers == ["keep.txt"]
    br = httpx.post(url, params={"path": "/tmp/br.txt"}, content=b"x", headers={**headers, "Content-Encoding": "br"})
    assert br.status_code == 400 and '"br" is not supported' in br.json()["message"]


def test_the_traffic_token_opens_ports_only(sbx, airlock_server):
    """The traffic token (what preview URLs carry) never runs a command: envd refuses it in
    either header, as it refuses a missing sandbox, while the envd token starts the same RPC."""
    skip_unless_sdk_has(hasattr(sbx, "traffic_access_token"), "Sandbox.traffic_access_token")
    import json
    import struct

    import httpx

    traffic, envd = sbx.traffic_access_token, sbx._envd_access_token
    assert traffic and envd and traffic != envd
    msg = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", "id -u"]}}).encode()
    body = struct.pack(">BI", 0, len(msg)) + msg
    base = {"E2b-Sandbox-Id": sbx.sandbox_id, "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1", "Authorization": "Basic cm9vdDo="}  # root:
    url = airlock_server["url"] + "/process.Process/Start"
    for token in ({"E2B-Traffic-Access-Token": traffic}, {"X-Access-Token": traffic}):
        r = httpx.post(url, content=body, headers={**base, **token}, timeout=30)
        assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found", (token, r.text)
    ok = httpx.post(url, content=body, headers={**base, "X-Access-Token": envd}, timeout=30)
    assert ok.status_code == 200 and b'"start"' in ok.content, ok.text


def test_base_has_the_tools_e2b_code_assumes_and_git_clones_a_repository_the_test_made(sbx, tmp_path):
    """`base` is E2B's base: git, curl, a `python` command, pip and venv, node and npm. npm
    installs a package from a local directory (offline), and node loads it. The SDK's git helper
    clones a repository the test made on this host, handed over as a bundle file (no network),
    and reads its status."""
    for tool in ("git --version", "curl --version", "python --version", "pip --version", "python -m venv --help", "node --version", "npm --version"):
        assert sbx.commands.run(tool).exit_code == 0, tool
    npm = sbx.commands.run(
        "set -e; mkdir -p /home/user/npm-lib /home/user/npm-app; cd /home/user/npm-lib; npm init -y >/dev/null;"
        " echo 'module.exports = 6 * 7' > index.js; cd /home/user/npm-app; npm init -y >/dev/null;"
        " npm install --offline --no-audit --no-fund ../npm-lib >/dev/null; node -e 'console.log(require(\"npm-lib\"))'",
        timeout=180,
    )
    assert npm.stdout == "42\n"
    if not hasattr(sbx, "git"):
        pytest.skip("this e2b has no git helper")
    src = tmp_path / "src"
    git = ["git", "-c", "user.name=airlock test", "-c", "user.email=test@example.invalid", "-C", str(src)]
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run(git + ["checkout", "-q", "-b", "main"], check=True)
    (src / "README.md").write_text("made on the host\n")
    subprocess.run(git + ["add", "README.md"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "first"], check=True)
    subprocess.run(git + ["bundle", "create", "-q", str(tmp_path / "repo.bundle"), "--all"], check=True)
    sbx.files.write("/home/user/repo.bundle", (tmp_path / "repo.bundle").read_bytes())
    sbx.git.clone("/home/user/repo.bundle", path="/home/user/cloned", branch="main")
    assert sbx.files.read("/home/user/cloned/README.md") == "made on the host\n"
    status = sbx.git.status("/home/user/cloned")
    assert status.current_branch == "main"
    sbx.files.write("/home/user/cloned/new.txt", "x")
    sbx.git.add("/home/user/cloned", all=True)
    sbx.git.commit("/home/user/cloned", "second", author_name="agent", author_email="agent@example.invalid")
    assert sbx.commands.run("git -C /home/user/cloned log --format=%s").stdout == "second\nfirst\n"


def test_files_list_exists_info_mkdir_remove_rename(sbx):
    base = f"/home/user/fs-{uuid.uuid4().hex[:6]}"
    assert sbx.files.make_dir(base + "/sub") is True
    assert sbx.files.make_dir(base + "/sub") is False
    sbx.files.write(base + "/sub/f.txt", "x")
    names = sorted(e.name for e in sbx.files.list(base, depth=2))
    assert names == ["f.txt", "sub"]
    info = sbx.files.get_info(base + "/sub/f.txt")
    assert info.size == 1 and info.type.value == "file"
    assert sbx.files.exists(base + "/sub/f.txt") and not sbx.files.exists(base + "/nope")
    moved = sbx.files.rename(base + "/sub/f.txt", base + "/g.txt")
    assert moved.path == base + "/g.txt"
    sbx.files.remove(base)
    assert not sbx.files.exists(base)
    # envd's semantics: removing what isn't there is a no-op; a virtual file (stat size 0) reads
    # to its end.
    sbx.files.remove(base)
    assert sbx.files.read("/proc/version").startswith("Linux version")


def test_watch_dir_reports_changes(sbx):
    d = f"/home/user/watch-{uuid.uuid4().hex[:6]}"
    sbx.files.make_dir(d)
    handle = sbx.files.watch_dir(d, recursive=True)
    sbx.files.write(d + "/new.txt", "1")
    sbx.commands.run(f"mkdir -p {d}/inner && echo 2 > {d}/inner/deep.txt && rm {d}/new.txt")
    events = []
    deadline = time.time() + 20
    while time.time() < deadline:
        events += handle.get_new_events()
        names = {(e.name, e.type.name) for e in events}
        if ("inner/deep.txt", "CREATE") in names and ("new.txt", "REMOVE") in names:
            break
        time.sleep(0.3)
    handle.stop()
    names = {(e.name, e.type.name) for e in events}
    assert ("new.txt", "CREATE") in names, names
    assert ("inner/deep.txt", "CREATE") in names, names
    assert ("new.txt", "REMOVE") in names, names


def test_lifecycle_timeout_info_list_connect(sbx, airlock_server):
    tag = uuid.uuid4().hex[:8]
    s = Sandbox.create(timeout=120, metadata={"run": tag})
    try:
        before = s.get_info().end_at
        s.set_timeout(600)
        assert s.get_info().end_at > before
        found = Sandbox.list(query=SandboxQuery(metadata={"run": tag})).next_items()
        assert [x.sandbox_id for x in found] == [s.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"run": "nobody"})).next_items() == []
        # E2B's v1 list (`GET /sandboxes`, still in its spec): running sandboxes, by metadata.
        v1 = httpx.get(airlock_server["url"] + "/sandboxes", params={"metadata": f"run={tag}"},
                       headers={"X-API-KEY": airlock_server["key"]})
        assert v1.status_code == 200, v1.text
        assert [(x["sandboxID"], x["metadata"]) for x in v1.json()] == [(s.sandbox_id, {"run": tag})]
        assert v1.json()[0]["state"] == "running"
        other = Sandbox.connect(s.sandbox_id)
        assert other.commands.run("echo connected").stdout == "connected\n"
        assert other.files.write("/tmp/c.txt", "via connect").path == "/tmp/c.txt"
        assert s.files.read("/tmp/c.txt") == "via connect"
        assert other.is_running()
        metrics = s.get_metrics()
        assert metrics and metrics[-1].mem_total > 0
    finally:
        s.kill()
    assert not s.is_running()


def test_unsupported_options_fail_loudly():
    cases = [
        (dict(template="team/name"), "team/name"),
        (dict(mcp={"exa": {"apiKey": "x"}}), "mcp"),
        (dict(network={"allow_public_traffic": True}), "allowPublicTraffic"),
        (dict(network={"allow_out": ["1.1.1.1"], "allow_public_traffic": False}), "allowOut"),
        # A 404 that names the missing template (and lists the ones there are).
        (dict(template="no-such-template"), "no-such-template"),
    ]
    # Older SDKs have no `mcp=` / `network=` to send; what they can send is still checked.
    accepted = inspect.signature(Sandbox.create).parameters
    for kwargs, needle in [(k, n) for k, n in cases if set(k) <= set(accepted)]:
        with pytest.raises(SandboxException) as e:
            Sandbox.create(timeout=60, **kwargs)
        assert needle in str(e.value), (kwargs, str(e.value))


def test_snapshot_a_running_sandbox_and_create_from_it():
    skip_unless_sdk_has(hasattr(Sandbox, "create_snapshot"), "Sandbox.create_snapshot")
    s = Sandbox.create(timeout=300)
    child = None
    try:
        s.files.write("/home/user/snap.txt", "from the snapshot")
        h = s.commands.run("sleep 600", background=True)
        snap = s.create_snapshot()
        assert snap.snapshot_id.startswith("snap_")
        # The source runs on, its process too.
        assert s.commands.run("echo still").stdout == "still\n"
        listed = [x.snapshot_id for x in Sandbox.list_snapshots().next_items()]
        assert snap.snapshot_id in listed
        child = Sandbox.create(snap.snapshot_id, timeout=120)
        assert child.sandbox_id != s.sandbox_id
        assert child.files.read("/home/user/snap.txt") == "from the snapshot"
        assert h.pid in [p.pid for p in child.commands.list()], "its processes come with it"
        child.files.write("/home/user/snap.txt", "changed in the child")
        assert s.files.read("/home/user/snap.txt") == "from the snapshot"
        assert Sandbox.delete_snapshot(snap.snapshot_id)
        assert snap.snapshot_id not in [x.snapshot_id for x in Sandbox.list_snapshots().next_items()]
        assert not Sandbox.delete_snapshot(snap.snapshot_id)
        # Its sandboxes run on without it.
        assert child.commands.run("cat /home/user/snap.txt").stdout == "changed in the child"
    finally:
        Sandbox.kill(s.sandbox_id)
        if child is not None:
            Sandbox.kill(child.sandbox_id)


def test_fork_gives_independent_children():
    skip_unless_sdk_has(hasattr(Sandbox, "fork"), "Sandbox.fork")
    s = Sandbox.create(timeout=300)
    children = []
    try:
        s.files.write("/home/user/f.txt", "parent")
        h = s.commands.run("sleep 600", background=True)
        children = s.fork(count=2)
        assert len(children) == 2 and all(isinstance(c, Sandbox) for c in children), children
        ids = {s.sandbox_id} | {c.sandbox_id for c in children}
        assert len(ids) == 3
        for n, c in enumerate(children):
            assert c.files.read("/home/user/f.txt") == "parent"
            assert h.pid in [p.pid for p in c.commands.list()]
            c.files.write("/home/user/f.txt", f"child {n}")
        assert [c.files.read("/home/user/f.txt") for c in children] == ["child 0", "child 1"]
        assert s.files.read("/home/user/f.txt") == "parent"
    finally:
        Sandbox.kill(s.sandbox_id)
        for c in children:
            if isinstance(c, Sandbox):
                Sandbox.kill(c.sandbox_id)


def test_network_deny_out_alone():
    """denyOut only adds denies to the tenant's policy. Older SDKs (2.21.1) add allowPublicTraffic=true
    to any `network=`, which airlock refuses loudly; newer ones leave it unset and the create works."""
    try:
        from e2b.api.client.models.sandbox_network_config import SandboxNetworkConfig
    except ImportError:
        skip_unless_sdk_has(False, "network= option on create")

    if SandboxNetworkConfig().allow_public_traffic is True:
        with pytest.raises(SandboxException) as e:
            Sandbox.create(timeout=60, network={"deny_out": ["0.0.0.0/0"]})
        assert "allowPublicTraffic" in str(e.value)
    else:
        s = Sandbox.create(timeout=60, network={"deny_out": ["0.0.0.0/0"]})
        try:
            assert s.commands.run("echo ok").stdout == "ok\n"
        finally:
            s.kill()


def test_pause_suspends_to_disk_and_connect_resumes(airlock_server):
    from e2b import SandboxState

    from conftest import _native

    skip_unless_sdk_has(hasattr(Sandbox, "pause"), "Sandbox.pause")
    s = Sandbox.create(timeout=300)
    try:
        s.files.write("/home/user/keep.txt", "still here")
        h = s.commands.run("sleep 600", background=True)
        counter = s.commands.run("i=0; while true; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.1; done", background=True)
        # Paused once it has counted a few (under TCG on a loaded machine, 0.5 s was once 1 count).
        for _ in range(300):
            if s.files.exists("/tmp/n") and int(s.files.read("/tmp/n") or 0) >= 3:
                break
            time.sleep(0.1)
        s.pause()
        assert s.get_info().state == SandboxState.PAUSED
        # E2B's pause is airlock's suspend: the VM is gone, its state is on disk.
        native = _native(airlock_server["url"], airlock_server["key"], "GET", f"/v1/sandboxes/{s.sandbox_id}")
        assert native["state"] == "suspended", native
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert s.sandbox_id in [x.sandbox_id for x in paused]
        assert not s.is_running()
        back = Sandbox.connect(s.sandbox_id)
        assert back.get_info().state == SandboxState.RUNNING
        assert back.files.read("/home/user/keep.txt") == "still here"
        pids = [p.pid for p in back.commands.list()]
        assert h.pid in pids and counter.pid in pids, "processes survive a suspend"
        first = int(back.files.read("/tmp/n"))
        time.sleep(0.5)
        assert int(back.files.read("/tmp/n")) > first >= 3, "the counter runs on from where it was"
        assert back.commands.run("echo resumed").stdout == "resumed\n"
    finally:
        Sandbox.kill(s.sandbox_id)


def test_auto_pause_at_timeout_and_auto_resume_on_traffic(airlock_server):
    from e2b import SandboxState

    from conftest import _native

    s = Sandbox.create(timeout=4, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        lifecycle = getattr(s.get_info(), "lifecycle", None)  # newer SDKs read it back
        if lifecycle is not None:
            assert (lifecycle["on_timeout"], lifecycle["auto_resume"]) == ("pause", True), lifecycle
        s.files.write("/home/user/kept.txt", "kept")
        deadline = time.time() + 60
        while s.get_info().state != SandboxState.PAUSED:
            assert time.time() < deadline, "not paused at its timeout"
            time.sleep(0.3)
        native = _native(airlock_server["url"], airlock_server["key"], "GET", f"/v1/sandboxes/{s.sandbox_id}")
        assert native["state"] == "suspended", native
        # Traffic to the paused sandbox resumes it; its files are as they were.
        assert s.files.read("/home/user/kept.txt") == "kept"
        assert s.commands.run("echo awake").stdout == "awake\n"
        assert s.get_info().state == SandboxState.RUNNING
    finally:
        Sandbox.kill(s.sandbox_id)


def test_template_exists_by_name_and_alias(airlock_server):
    import e2b

    template = getattr(e2b, "Template", None)
    skip_unless_sdk_has(template is not None and hasattr(template, "exists"), "Template.exists")
    assert template.exists("base")
    assert template.exists("code-interpreter-v1")
    assert not template.exists("no-such-template")


def test_list_is_newest_first_with_order_time_and_template_filters(airlock_server):
    import dataclasses
    from datetime import datetime, timezone

    tag = uuid.uuid4().hex[:8]
    first = Sandbox.create(timeout=300, metadata={"list": tag})
    time.sleep(1.1)
    between = datetime.now(timezone.utc)
    time.sleep(0.1)
    second = Sandbox.create(timeout=300, metadata={"list": tag})
    try:
        ids = lambda **kw: [x.sandbox_id for x in Sandbox.list(**kw).next_items()]  # noqa: E731
        mine = SandboxQuery(metadata={"list": tag})
        # E2B's order: newest first, on every SDK (2.21.1 sends no order at all).
        assert ids(query=mine) == [second.sandbox_id, first.sandbox_id]
        # Pages walk newest to oldest too.
        page = Sandbox.list(query=mine, limit=1)
        assert [x.sandbox_id for x in page.next_items()] == [second.sandbox_id]
        assert [x.sandbox_id for x in page.next_items()] == [first.sandbox_id]
        if "order" in inspect.signature(Sandbox.list).parameters:
            assert ids(query=mine, order="asc") == [first.sandbox_id, second.sandbox_id]
        fields = {f.name for f in dataclasses.fields(SandboxQuery)}
        if "started_after" in fields:
            assert ids(query=SandboxQuery(metadata={"list": tag}, started_after=between)) == [second.sandbox_id]
        if "template" in fields:
            assert ids(query=SandboxQuery(metadata={"list": tag}, template="base")) == [second.sandbox_id, first.sandbox_id]
            assert ids(query=SandboxQuery(metadata={"list": tag}, template="code-interpreter-v1")) == []
    finally:
        first.kill()
        second.kill()
