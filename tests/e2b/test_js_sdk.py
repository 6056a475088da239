"""E2B's JavaScript SDKs (`e2b` and `@e2b/code-interpreter`, unmodified from the npm registry at the
versions tests/e2b/js/package-lock.json pins) driven by Node against the same server: create,
commands, files, signed URLs, list, kill, runCode."""
import hashlib
import os
import subprocess

import wildcard_dns

JS = os.path.join(os.path.dirname(__file__), "js")


def _install():
    """`npm ci` from the lock, skipped when node_modules already matches it."""
    lock = open(os.path.join(JS, "package-lock.json"), "rb").read()
    want = hashlib.sha256(lock).hexdigest()
    stamp = os.path.join(JS, "node_modules", ".airlock-lock.sha256")
    if os.path.exists(stamp) and open(stamp).read() == want:
        return
    # The suite's own resolver answers only its wildcard domain (a fresh clone's `npm ci` failed
    # with ENOTFOUND for every package): npm asks the machine's, from the JS dir (nsenter's
    # working directory is this process's).
    wildcard_dns.run_with_host_resolver(
        ["sh", "-c", 'cd "$0" && exec npm ci --ignore-scripts --no-audit --no-fund --loglevel=error', JS],
        check=True, timeout=600)
    with open(stamp, "w") as f:
        f.write(want)


def test_the_javascript_sdks_basic_flows(airlock_server):
    _install()
    env = dict(os.environ)
    env.update({"E2B_API_URL": airlock_server["url"], "E2B_SANDBOX_URL": airlock_server["url"],
                "E2B_API_KEY": airlock_server["key"]})
    env.pop("E2B_DOMAIN", None)
    r = subprocess.run(["node", "basic.mjs"], cwd=JS, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.stdout.rstrip().endswith("all ok"), r.stdout
