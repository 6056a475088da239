"""Fixtures for the web console's browser test: one real `airlock serve` with real VMs, and a
headless Chromium (Debian's `chromium` and `chromium-driver`) driven by Selenium from PyPI.
Screenshots of each page go to target/console-screenshots/ (test artifacts, not committed)."""
import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("AIRLOCK_BIN", os.path.join(ROOT, "target", "release", "airlock"))
DATA = os.environ.get("AIRLOCK_TEST_DATA_DIR", "/var/lib/airlock-test")
SHOTS = os.path.join(ROOT, "target", "console-screenshots")
PASSWORD = "airlock-console-suite-password"
# A console session ends after this long without a request; the suite checks that it does.
IDLE_SECONDS = 20


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _wait_up(url, proc, log):
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        if time.time() > deadline or proc.poll() is not None:
            raise RuntimeError(f"airlock did not come up at {url}; see {log}")
        time.sleep(0.2)


def _native(url, key, method, path):
    req = urllib.request.Request(url + path, method=method, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read()
        return json.loads(raw) if raw else None


@pytest.fixture(scope="session")
def server():
    os.makedirs(DATA, exist_ok=True)
    subprocess.run([BIN, "--data-dir", DATA, "template", "build", "seed"], check=True, stdout=subprocess.DEVNULL)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(DATA, f"console-serve-{port}.log")
    log = open(log_path, "w")
    env = dict(os.environ, AIRLOCK_CONSOLE_PASSWORD=PASSWORD)
    proc = subprocess.Popen([BIN, "--data-dir", DATA, "serve", "--listen", f"127.0.0.1:{port}",
                             "--tenant-share", "1", "--console-idle", f"{IDLE_SECONDS}s"],
                            stdout=log, stderr=log, env=env)
    made = {"keys": []}
    try:
        _wait_up(url, proc, log_path)
        yield {"url": url, "password": PASSWORD, "made": made}
        # VMs outlive the server by design: delete what the test left (by the keys it made).
        for key in made["keys"]:
            try:
                for sb in _native(url, key, "GET", "/v1/sandboxes?limit=100")["sandboxes"]:
                    _native(url, key, "DELETE", f"/v1/sandboxes/{sb['id']}")
                deadline = time.time() + 60
                while _native(url, key, "GET", "/v1/sandboxes?limit=100")["sandboxes"] and time.time() < deadline:
                    time.sleep(0.2)
            except Exception as e:  # a revoked key, a removed tenant: nothing of it is left
                print(f"cleanup with a key: {e}")
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _chromium():
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1400",
                 # Nothing but the test server: no update checks, sync, metrics or field trials.
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-default-apps", "--no-first-run", "--disable-domain-reliability",
                 "--metrics-recording-only", "--no-pings", "--disable-client-side-phishing-detection",
                 "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication"):
        opts.add_argument(flag)
    # The driver Debian ships next to the browser: Selenium Manager downloads nothing.
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


@pytest.fixture
def browser():
    """A browser of its own per call (separate cookies): `browser()` opens one more."""
    opened = []

    def open_one():
        d = _chromium()
        d.set_page_load_timeout(60)
        opened.append(d)
        return d

    yield open_one
    for d in opened:
        d.quit()


@pytest.fixture(scope="session")
def shot():
    os.makedirs(SHOTS, exist_ok=True)
    for old in os.listdir(SHOTS):
        os.remove(os.path.join(SHOTS, old))
    n = [0]

    def save(driver, name):
        n[0] += 1
        driver.save_screenshot(os.path.join(SHOTS, f"{n[0]:02d}-{name}.png"))

    return save
