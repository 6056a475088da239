"""One core under two doors: processes the E2B SDK starts are native sessions, and native
sessions are processes the SDK sees. The native API (/v1, Bearer key) shares the server's URL."""
import base64
import json
import time
import urllib.error
import urllib.request
import uuid

import pytest
from e2b import CommandExitException


def _v1(server, method, path, body=None):
    """(status, JSON body or None) of a native API call."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": "Bearer " + server["key"]}
    if data is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(server["url"] + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, (json.loads(raw) if raw else None)


def _sessions(server, sandbox_id):
    status, sessions = _v1(server, "GET", f"/v1/sandboxes/{sandbox_id}/sessions")
    assert status == 200, sessions
    return sessions


def _session_running(server, sandbox_id, command):
    """The session of the SDK's `commands.run(command)`: bash -l -c <command>."""
    found = [s for s in _sessions(server, sandbox_id) if s["argv"] and s["argv"][-1] == command]
    assert len(found) == 1, (command, _sessions(server, sandbox_id))
    assert found[0]["state"] == "running", found[0]
    return found[0]


def _wait_exited(server, sandbox_id, session_id, within=15):
    deadline = time.time() + within
    while True:
        status, s = _v1(server, "GET", f"/v1/sandboxes/{sandbox_id}/sessions/{session_id}")
        assert status == 200, s
        if s["state"] == "exited":
            return s
        assert time.time() < deadline, f"session still running {within} s later: {s}"
        time.sleep(0.2)


def _stream_stdout_until(server, sandbox_id, session_id, needle, within=60):
    """Read the session's SSE stream until its stdout contains `needle`; the stdout seen."""
    req = urllib.request.Request(
        f"{server['url']}/v1/sandboxes/{sandbox_id}/sessions/{session_id}/stream",
        headers={"Authorization": "Bearer " + server["key"]},
    )
    deadline = time.time() + within
    seen, event, data = "", None, ""
    with urllib.request.urlopen(req, timeout=within) as r:
        assert r.headers["content-type"] == "text/event-stream"
        while time.time() < deadline:
            line = r.readline()
            if not line:
                break
            line = line.decode().rstrip("\r\n")
            if line.startswith("event:"):
                event = line[len("event:"):].strip()
            elif line.startswith("data:"):
                data += line[len("data:"):].strip()
            elif line == "":
                if event == "stdout":
                    seen += base64.b64decode(json.loads(data)["data"]).decode()
                    if needle in seen:
                        return seen
                assert event != "process_exited", f"exited before {needle!r}: {seen!r}"
                event, data = None, ""
    raise AssertionError(f"no {needle!r} on the stream within {within} s: {seen!r}")


def _ended(handle):
    """What the SDK's handle reports when its process ends: (exit_code, error)."""
    try:
        r = handle.wait()
        return r.exit_code, r.error
    except CommandExitException as e:
        return e.exit_code, e.error


def test_sdk_background_processes_are_native_sessions(sbx, airlock_server):
    marker = uuid.uuid4().hex[:8]
    quiet_cmd = f"sleep 600; : {marker}"
    loud_cmd = f"sh -c 'for i in 1 2 3; do echo line$i; sleep 1; done; sleep 600'; : {marker}"
    quiet = sbx.commands.run(quiet_cmd, background=True)
    loud = sbx.commands.run(loud_cmd, background=True)
    processes = {p.pid: p for p in sbx.commands.list()}
    sid = {}
    for handle, cmd in ((quiet, quiet_cmd), (loud, loud_cmd)):
        session = _session_running(airlock_server, sbx.sandbox_id, cmd)
        # No tag from the SDK: E2B lists the process under its session id.
        assert "tag" not in session, session
        assert processes[handle.pid].tag == session["id"], (processes[handle.pid], session)
        sid[handle.pid] = session["id"]

    seen = _stream_stdout_until(airlock_server, sbx.sandbox_id, sid[loud.pid], "line3")
    assert seen.startswith("line1\nline2\nline3"), seen

    for handle in (quiet, loud):
        status, body = _v1(airlock_server, "POST", f"/v1/sandboxes/{sbx.sandbox_id}/sessions/{sid[handle.pid]}/signal",
                           {"signal": "SIGKILL"})
        assert status == 204, body
    for handle in (quiet, loud):
        exit_code, error = _ended(handle)
        assert exit_code != 0 or error, (exit_code, error)
        s = _wait_exited(airlock_server, sbx.sandbox_id, sid[handle.pid])
        assert s.get("signal") == "SIGKILL", s
    pids = {p.pid for p in sbx.commands.list()}
    assert quiet.pid not in pids and loud.pid not in pids


def test_native_sessions_are_sdk_processes(sbx, airlock_server):
    status, session = _v1(airlock_server, "POST", f"/v1/sandboxes/{sbx.sandbox_id}/sessions", {"argv": ["sleep", "600"]})
    assert status == 201, session
    sid = session["id"]
    try:
        found = [p for p in sbx.commands.list() if p.tag == sid]
        assert len(found) == 1, (sid, sbx.commands.list())
        p = found[0]
        assert (p.cmd, p.args) == ("sleep", ["600"]), p
        assert sbx.commands.kill(p.pid) is True
        s = _wait_exited(airlock_server, sbx.sandbox_id, sid)
        assert s.get("signal") == "SIGKILL", s
        assert all(q.tag != sid for q in sbx.commands.list())
    finally:
        _v1(airlock_server, "POST", f"/v1/sandboxes/{sbx.sandbox_id}/sessions/{sid}/signal", {"signal": "SIGKILL"})
