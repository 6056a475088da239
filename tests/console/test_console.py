"""The web console in a real browser against real VMs (issue 28), as a user would: root@local
makes a tenant and its key; the tenant signs in with it, makes a sandbox, runs a command in its
terminal, moves a file both ways, sees its metrics and an egress denial, deletes it; the admin
sees the audit rows. Another tenant sees none of it, and what must be refused is."""
import json
import os
import tempfile
import time
import urllib.request

import pytest
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from conftest import IDLE_SECONDS

# A wait polls: what fails while the page changes under it is "not yet". Besides a missing or
# stale element, a page reloading itself (its operation settled) makes Chromium answer a read with
# a bare WebDriverException. A real failure still ends at the timeout, with the page printed.
IGNORED = (WebDriverException,)


def wait(d, cond, timeout=60, what="the page"):
    try:
        return WebDriverWait(d, timeout, poll_frequency=0.2, ignored_exceptions=IGNORED).until(
            lambda d: cond(d), message=f"waiting for {what}")
    except Exception:
        try:
            print(f"while waiting for {what}: {d.current_url}\n{d.find_element(By.TAG_NAME, 'main').text[:3000]}")
        except WebDriverException as e:
            print(f"while waiting for {what}: the page could not be read: {e.msg}")
        raise


def text(d, id_):
    return d.find_element(By.ID, id_).text


def sign_in_root(d, url, password):
    d.get(url + "/console/login")
    form = d.find_element(By.ID, "signin-root")
    form.find_element(By.NAME, "password").send_keys(password)
    form.find_element(By.TAG_NAME, "button").click()


def sign_in_key(d, url, key):
    d.get(url + "/console/login")
    form = d.find_element(By.ID, "signin-key")
    form.find_element(By.NAME, "key").send_keys(key)
    form.find_element(By.TAG_NAME, "button").click()


def fetch_status(d, path, method="GET", body=None):
    """A request the page makes with its session (its cookie rides along): the status."""
    return d.execute_async_script(
        """const [path, method, body, done] = arguments;
        const init = {method, credentials: 'same-origin'};
        if (body !== null) { init.body = body; init.headers = {'content-type': 'application/x-www-form-urlencoded'}; }
        fetch(path, init).then(r => r.text().then(t => done([r.status, t]))).catch(e => done([0, String(e)]));""",
        path, method, body)


def terminal_lines(d):
    return d.execute_script(
        """const b = window.airlockTerminal.buffer.active; const out = [];
        for (let i = 0; i < b.length; i++) out.push(b.getLine(i).translateToString(true));
        return out;""")


def type_in_terminal(d, keys):
    d.find_element(By.CSS_SELECTOR, "#terminal .xterm-helper-textarea").send_keys(keys)


def admin_api(url, password, method, path):
    """The admin API as the CLI would call it (cleanup only)."""
    req = urllib.request.Request(url + "/v1/admin/login", method="POST",
                                 data=json.dumps({"username": "root@local", "password": password}).encode(),
                                 headers={"content-type": "application/json"})
    token = json.load(urllib.request.urlopen(req, timeout=30))["token"]
    req = urllib.request.Request(url + "/v1/admin" + path, method=method, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read()
        return json.loads(raw) if raw else None


def test_console_as_a_user(server, browser, shot):
    url, password = server["url"], server["password"]
    run = str(int(time.time()) % 1_000_000)
    acme, other_name = f"acme-{run}", f"other-{run}"
    admin = browser()

    # A wrong password is refused, and says so.
    sign_in_root(admin, url, "not-the-password")
    assert "Wrong username, password or key." in text(admin, "error")
    shot(admin, "wrong-password")

    # root@local: two tenants, a key each (shown once).
    sign_in_root(admin, url, password)
    wait(admin, lambda d: d.find_element(By.ID, "tenants"), what="the tenants page")
    assert text(admin, "who") == "root@local"
    keys = {}
    try:
        for name in (acme, other_name):
            admin.get(url + "/console/admin")
            form = admin.find_element(By.ID, "create-tenant")
            form.find_element(By.NAME, "name").send_keys(name)
            form.find_element(By.TAG_NAME, "button").click()
            wait(admin, lambda d: d.find_element(By.ID, "create-key"), what="the tenant's page")
            admin.find_element(By.CSS_SELECTOR, "#create-key button").click()
            keys[name] = wait(admin, lambda d: text(d, "new-key-value"), what="the new key")
            server["made"]["keys"].append(keys[name])
        shot(admin, "tenant-key-shown-once")
        admin.get(url + f"/console/admin/tenants/{other_name}")
        assert keys[other_name] not in admin.page_source, "a key is shown once"
        admin.find_element(By.ID, "signout").click()
        wait(admin, lambda d: "/console/login" in d.current_url, what="the sign-in page")
        admin.get(url + "/console/admin")
        assert "/console/login" in admin.current_url, "signed out, the admin's pages are closed"

        # A session of acme that then sits idle: it must have ended when the test looks again.
        idle = browser()
        sign_in_key(idle, url, keys[acme])
        wait(idle, lambda d: d.find_element(By.ID, "sandboxes"), what="the idle session's page")
        idle_since = time.time()

        # acme: a sandbox from the console.
        d = browser()
        sign_in_key(d, url, keys[acme])
        wait(d, lambda d: d.find_element(By.ID, "create"), what="the sandboxes page")
        assert text(d, "who") == f"tenant {acme}"
        before = fetch_status(d, "/console/sandboxes")[1].count('data-id="')
        # A form post without its CSRF token changes nothing.
        status, body = fetch_status(d, "/console/sandboxes", "POST", "template=seed&timeout=10m")
        assert status == 403 and "CSRF" in body, (status, body[:300])
        assert fetch_status(d, "/console/sandboxes")[1].count('data-id="') == before
        form = d.find_element(By.ID, "create")
        form.find_element(By.CSS_SELECTOR, "button").click()
        wait(d, lambda d: "/console/sandboxes/" in d.current_url and "?op=" in d.current_url,
             what="the sandbox's page")
        sandbox_id = d.current_url.split("/console/sandboxes/")[1].split("?")[0]
        sandbox_url = url + f"/console/sandboxes/{sandbox_id}"
        wait(d, lambda d: text(d, "state") == "running", timeout=180, what="the sandbox running")
        wait(d, lambda d: d.find_element(By.ID, "terminal").get_attribute("data-state") == "open",
             timeout=60, what="the terminal open")
        shot(d, "sandbox-running")

        # Its terminal: a command and its answer.
        type_in_terminal(d, "python3 -c 'print(6*7)'\n")
        wait(d, lambda d: "42" in [line.strip() for line in terminal_lines(d)], timeout=60,
             what="42 in the terminal")
        # A request egress refuses (no name is allowed out by default).
        type_in_terminal(d, "getent hosts blocked.test; echo lookup-done-$?\n")
        wait(d, lambda d: any(line.strip().startswith("lookup-done-") and line.strip() != "lookup-done-0"
                              for line in terminal_lines(d)), timeout=60, what="the refused lookup")
        shot(d, "terminal")

        # The egress report and the metrics chart on the sandbox's page.
        d.get(sandbox_url)
        wait(d, lambda d: "blocked.test" in text(d, "denials"), timeout=30, what="the denial listed")
        assert int(text(d, "dns-denied")) >= 1
        # The charts: a line once the sampler has a second sample (reloaded until then).
        def samples(d):
            d.get(sandbox_url)
            return int(d.find_element(By.ID, "metrics").get_attribute("data-samples")) >= 2
        wait(d, samples, timeout=60, what="two metrics samples")
        points = d.find_element(By.CSS_SELECTOR, "#chart-memory polyline").get_attribute("points").split()
        assert len(points) >= 2, points
        assert len(d.find_elements(By.CSS_SELECTOR, "#chart-cpu circle.sample")) == len(points)
        shot(d, "metrics-and-egress")

        # The terminal's shell is a session: its page replays its output, live.
        d.find_element(By.XPATH, "//table[@id='sessions']//tr[td/code[contains(text(), 'bash')]]//a").click()
        wait(d, lambda d: "42" in text(d, "output").split(), timeout=30,
             what=f"the session's output ({d.current_url})")
        shot(d, "session-output")
        d.get(sandbox_url)

        # A file up, listed, and down again.
        content = f"console upload {run}\n"
        with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="console-", delete=False) as f:
            f.write(content)
        name = os.path.basename(f.name)
        try:
            d.find_element(By.ID, "upload-file").send_keys(f.name)
            d.find_element(By.CSS_SELECTOR, "#upload button").click()
            wait(d, lambda d: d.find_element(By.ID, "uploaded"), what="the upload done")
        finally:
            os.unlink(f.name)
        assert name in text(d, "files")
        link = d.find_element(By.XPATH, f"//table[@id='files']//tr[td[text()='{name}']]//a[@class='download']")
        href = link.get_attribute("href")
        status, body = fetch_status(d, href)
        assert (status, body) == (200, content)
        shot(d, "files")

        # Another tenant sees none of it: not in its list, not its page, not its calls.
        o = browser()
        sign_in_key(o, url, keys[other_name])
        wait(o, lambda d: d.find_element(By.ID, "sandboxes"), what="the other tenant's page")
        assert sandbox_id not in o.page_source
        o.get(sandbox_url)
        assert "Refused" in o.title and sandbox_id in text(o, "error")
        shot(o, "other-tenant-refused")
        assert fetch_status(o, href)[0] == 404
        o.get(url + "/console/sandboxes")
        csrf = o.find_element(By.NAME, "csrf").get_attribute("value")
        status, _ = fetch_status(o, f"/console/sandboxes/{sandbox_id}/action", "POST",
                                 f"action=delete&csrf={csrf}")
        assert status == 404
        opened = o.execute_async_script(
            """const done = arguments[arguments.length - 1];
            const ws = new WebSocket('ws://' + location.host + '/console/sandboxes/' + arguments[0] + '/terminal');
            ws.onopen = () => done('open'); ws.onerror = () => done('refused');""", sandbox_id)
        assert opened == "refused"

        # Deleted from the console (confirmed), gone from the list.
        d.get(sandbox_url)
        d.find_element(By.ID, "do-delete").click()
        d.switch_to.alert.accept()
        wait(d, lambda d: "/console/sandboxes?op=" in d.current_url, what="the list after delete")
        wait(d, lambda d: sandbox_id not in text(d, "sandboxes"), timeout=120, what="the sandbox gone")
        shot(d, "deleted")

        # The admin sees the tenant's rows in the audit log.
        sign_in_root(admin, url, password)
        wait(admin, lambda d: d.find_element(By.ID, "tenants"), what="the admin's pages")
        admin.get(url + f"/console/admin/audit?tenant={acme}")
        rows = [(r.find_element(By.CLASS_NAME, "action").text, r.find_element(By.CLASS_NAME, "result").text)
                for r in admin.find_elements(By.CSS_SELECTOR, "#audit tbody tr")]
        assert ("sandbox.create", "ok") in rows and ("sandbox.delete", "ok") in rows, rows
        shot(admin, "audit")
        admin.get(url + "/console/admin/system")
        assert admin.find_element(By.ID, "budgets").text
        shot(admin, "system")

        # The idle session has ended by now.
        time.sleep(max(0.0, idle_since + IDLE_SECONDS + 1 - time.time()))
        idle.get(url + "/console/sandboxes")
        assert "/console/login?why=ended" in idle.current_url
        assert "session ended" in idle.page_source
        shot(idle, "session-ended")
    finally:
        for name in keys:
            try:
                admin_api(url, password, "DELETE", f"/tenants/{name}")
            except Exception as e:
                print(f"removing tenant {name}: {e}")
