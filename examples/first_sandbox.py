#!/usr/bin/env python3
"""Your first airlock sandbox, with the Python standard library only.

Creates a sandbox from `seed`, waits for it, runs a command in it while streaming the output
over server-sent events, and deletes it. Succeeds only when the command exits 0 with no error
events. Reads the server URL and key from AIRLOCK_URL / AIRLOCK_API_KEY, or from the
`credentials` file `airlock serve` writes into its data dir (AIRLOCK_DATA_DIR, default
/var/lib/airlock).
"""
import base64
import json
import os
import sys
import time
import urllib.error
import urllib.request


def settings():
    creds = {}
    path = os.path.join(os.environ.get("AIRLOCK_DATA_DIR", "/var/lib/airlock"), "credentials")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if "=" in line and not line.startswith("#"):
                    k, v = line.strip().split("=", 1)
                    creds[k] = v
    url = os.environ.get("AIRLOCK_URL", creds.get("AIRLOCK_URL", "http://127.0.0.1:7420"))
    key = os.environ.get("AIRLOCK_API_KEY", creds.get("AIRLOCK_API_KEY"))
    if not key:
        sys.exit(f"no API key: set AIRLOCK_API_KEY or start `airlock serve` (it writes {path})")
    return url.rstrip("/"), key


URL, KEY = settings()


def call(method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(URL + path, data=data, method=method)
    req.add_header("Authorization", "Bearer " + KEY)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
            return json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        err = json.loads(e.read() or b"{}")
        sys.exit(f"{method} {path}: HTTP {e.code} {err.get('code')}: {err.get('message')}")


def wait(operation):
    deadline = time.time() + 300
    while time.time() < deadline:
        op = call("GET", f"/v1/operations/{operation['id']}")
        if op["state"] == "succeeded":
            return op
        if op["state"] == "failed":
            sys.exit(f"{op['kind']} failed: {op['error']['message']}")
        time.sleep(0.2)
    sys.exit(f"operation {operation['id']} did not finish")


def stream(sandbox_id, session_id):
    """Attach to the session's SSE stream; returns (exit_code, error_frames)."""
    req = urllib.request.Request(f"{URL}/v1/sandboxes/{sandbox_id}/sessions/{session_id}/stream")
    req.add_header("Authorization", "Bearer " + KEY)
    req.add_header("Accept", "text/event-stream")
    errors, event, data = [], None, []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
            elif line == "" and event:
                payload = json.loads("\n".join(data)) if data else {}
                if event in ("stdout", "stderr"):
                    out = sys.stdout if event == "stdout" else sys.stderr
                    out.write(base64.b64decode(payload["data"]).decode(errors="replace"))
                    out.flush()
                elif event == "error":
                    errors.append(payload)
                elif event == "process_exited":
                    return payload.get("exit_code"), errors
                event, data = None, []
    return None, errors


def main():
    created = call("POST", "/v1/sandboxes", {"template": "seed", "timeout": "10m"})
    sandbox_id = created["sandbox_id"]
    print(f"sandbox {sandbox_id}: creating (operation {created['operation']['id']})")
    try:
        wait(created["operation"])
        print(f"sandbox {sandbox_id}: running")
        session = call("POST", f"/v1/sandboxes/{sandbox_id}/sessions", {
            "argv": ["python3", "-c", "print('hello from airlock')"],
            "cwd": "/home/user",
            "timeout": "30s",
        })
        exit_code, errors = stream(sandbox_id, session["id"])
    finally:
        wait(call("DELETE", f"/v1/sandboxes/{sandbox_id}")["operation"])
        print(f"sandbox {sandbox_id}: deleted")
    if errors or exit_code != 0:
        sys.exit(f"command failed: exit_code={exit_code} errors={errors}")
    print("ok")


if __name__ == "__main__":
    main()
