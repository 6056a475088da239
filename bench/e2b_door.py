"""E2B door benchmark: the real e2b SDK against a live airlock, over the plain listener
(E2B_API_URL) and over TLS + E2B_DOMAIN, next to the native /v1 API doing the same work in the same
run (the door's overhead is the ratio). Run as root from the repository root with a venv that has
e2b, trustme and dnslib (scripts/e2b-tests makes them), for example:

    target/venv-e2b-pinned/bin/python bench/e2b_door.py --passes 2

Raw samples go to bench/results/e2b-door-<time>.json."""
import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2b"))
import wildcard_dns  # noqa: E402  (must run before any thread starts)

args = argparse.ArgumentParser()
args.add_argument("--passes", type=int, default=2)
args.add_argument("--creates", type=int, default=3, help="sandboxes per route per pass")
args.add_argument("--runs", type=int, default=20, help="commands per sandbox")
args.add_argument("--data-dir", default="/var/lib/airlock-bench")
args.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "airlock"))
opts = args.parse_args()

workdir, ca, cert, key = wildcard_dns.setup()
dns = wildcard_dns.start_dns_server()
subprocess.run([opts.bin, "--data-dir", opts.data_dir, "template", "build", "seed"], check=True, stdout=subprocess.DEVNULL)
port = 7471
url = f"http://127.0.0.1:{port}"
os.environ.setdefault("AIRLOCK_CONSOLE_PASSWORD", "airlock-bench-console-password")
server = subprocess.Popen(
    [opts.bin, "--data-dir", opts.data_dir, "serve", "--listen", f"127.0.0.1:{port}", "--e2b-domain", wildcard_dns.DOMAIN,
     "--tls-listen", f"{wildcard_dns.TLS_ADDR}:443", "--tls-cert", cert, "--tls-key", key],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for _ in range(300):
    try:
        urllib.request.urlopen(url + "/openapi-m1.json", timeout=1)
        break
    except Exception:
        time.sleep(0.2)
admin_env = dict(os.environ, AIRLOCK_URL=url)
subprocess.run([opts.bin, "--data-dir", opts.data_dir, "login"], check=True, env=admin_env, stdin=subprocess.DEVNULL)
api_key = subprocess.run([opts.bin, "--data-dir", opts.data_dir, "key", "create", "--e2b"], check=True,
                         capture_output=True, text=True, env=admin_env).stdout.strip()
os.environ["E2B_API_KEY"] = api_key

from e2b import Sandbox  # noqa: E402


def native_exec(conn, sandbox_id):
    """POST a session running `true`, then read its SSE stream to `process_exited`."""
    headers = {"Authorization": "Bearer " + api_key, "Content-Type": "application/json"}
    conn.request("POST", f"/v1/sandboxes/{sandbox_id}/sessions", json.dumps({"argv": ["true"]}), headers)
    r = conn.getresponse()
    sid = json.loads(r.read())["id"]
    conn.request("GET", f"/v1/sandboxes/{sandbox_id}/sessions/{sid}/stream", headers=headers)
    r = conn.getresponse()
    while b"process_exited" not in r.readline():
        pass
    r.read()  # the stream ends after the exit event


def route_env(route):
    for n in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN"):
        os.environ.pop(n, None)
    if route == "tls-domain":
        os.environ["E2B_DOMAIN"] = wildcard_dns.DOMAIN
    else:
        os.environ["E2B_API_URL"] = os.environ["E2B_SANDBOX_URL"] = url


samples = {r: {"create_to_first_stdout_ms": [], "run_true_ms": []} for r in ("plain", "tls-domain")}
samples["native"] = {"exec_true_ms": []}
try:
    for _ in range(opts.passes):
        for route in ("plain", "tls-domain"):  # alternated so drift hits both
            route_env(route)
            for _ in range(opts.creates):
                t = time.perf_counter()
                sbx = Sandbox.create()
                assert sbx.commands.run("echo hi").stdout == "hi\n"
                samples[route]["create_to_first_stdout_ms"].append((time.perf_counter() - t) * 1000)
                conn = http.client.HTTPConnection("127.0.0.1", port)
                for _ in range(opts.runs):
                    t = time.perf_counter()
                    sbx.commands.run("true")
                    samples[route]["run_true_ms"].append((time.perf_counter() - t) * 1000)
                    t = time.perf_counter()
                    native_exec(conn, sbx.sandbox_id)
                    samples["native"]["exec_true_ms"].append((time.perf_counter() - t) * 1000)
                conn.close()
                sbx.kill()
finally:
    server.terminate()
    server.wait()
    for s in dns:
        s.stop()


def summary(xs):
    xs = sorted(xs)
    return {"n": len(xs), "p50": round(statistics.median(xs), 1), "p95": round(xs[max(0, int(len(xs) * 0.95) - 1)], 1)}


import importlib.metadata as md  # noqa: E402

result = {
    "bench": "e2b-door",
    "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "sdk": {"e2b": md.version("e2b")},
    "machine": {"cpus": os.cpu_count(), "host_kernel": platform.release(),
                "qemu": subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True).stdout.splitlines()[0]},
    "summary": {route: {k: summary(v) for k, v in s.items()} for route, s in samples.items()},
    "samples": samples,
}
native_p50 = result["summary"]["native"]["exec_true_ms"]["p50"]
for route in ("plain", "tls-domain"):
    result["summary"][route]["run_true_ratio_to_native_p50"] = round(result["summary"][route]["run_true_ms"]["p50"] / native_p50, 2)
out = os.path.join(ROOT, "bench", "results", f"e2b-door-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-e2b{md.version('e2b')}.json")
with open(out, "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps(result["summary"], indent=1))
print("raw samples:", out)
