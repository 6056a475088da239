"""Unmodified e2b-code-interpreter calls against airlock's `code-interpreter-v1` template.

Newer e2b-code-interpreter versions send `/execute` to E2B_SANDBOX_URL with
`E2b-Sandbox-Id`/`E2b-Sandbox-Port: 49999` headers. Older ones (2.6.2 among them) only know
`https://49999-<id>.<domain>`, so with them these tests take the E2B_DOMAIN route; their
`E2B_DEBUG=true` route to localhost:49999 (airlock's `--e2b-debug-listen`) has its own test."""
import base64
import contextlib
import inspect
import os

import pytest

from conftest import delete_sandbox, domain_env, skip_unless_sdk_has


def header_routed():
    from e2b_code_interpreter import Sandbox

    return "get_sandbox_url" in inspect.getsource(Sandbox)


@pytest.fixture(scope="module")
def ci(airlock_server):
    from e2b_code_interpreter import Sandbox

    # The sandbox keeps the connection settings it was created with.
    with contextlib.nullcontext() if header_routed() else domain_env():
        s = Sandbox.create(timeout=900)
    yield s
    delete_sandbox(airlock_server, s.sandbox_id)


def test_debug_listener_for_old_interpreters(airlock_server):
    from e2b_code_interpreter import Sandbox

    if header_routed():
        pytest.skip("this e2b-code-interpreter routes by header; --e2b-debug-listen is for older ones")
    # The debug listener belongs to E2B_API_URL setups: the API is airlock's plain listener.
    saved = {n: os.environ.get(n) for n in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN")}
    os.environ.pop("E2B_DOMAIN", None)
    os.environ.update(E2B_DEBUG="true", E2B_API_URL=airlock_server["url"], E2B_SANDBOX_URL=airlock_server["url"])
    try:
        from e2b import ConnectionConfig

        if ConnectionConfig().api_url != airlock_server["url"]:
            pytest.skip(f"this e2b in debug mode calls {ConnectionConfig().api_url}, not E2B_API_URL")
        s = Sandbox.create(timeout=300)
    finally:
        os.environ.pop("E2B_DEBUG", None)
        for n, v in saved.items():
            os.environ.pop(n, None)
            if v is not None:
                os.environ[n] = v
    if s.sandbox_id == "debug_sandbox_id":
        pytest.skip("this e2b skips the API in debug mode (no sandbox is created): use E2B_DOMAIN with it")
    try:
        ex = s.run_code("print('via localhost:49999'); 6 * 7")
        assert ex.error is None, ex.error
        assert (ex.logs.stdout, ex.text) == (["via localhost:49999\n"], "42")
    finally:
        delete_sandbox(airlock_server, s.sandbox_id)


def test_state_persists_across_calls(ci):
    ex = ci.run_code("x = 41\nprint('hello')\nx + 1")
    assert ex.error is None
    assert ex.logs.stdout == ["hello\n"]
    assert ex.text == "42"
    assert ci.run_code("x * 2").text == "82"


def test_errors_are_data_with_traceback(ci):
    ex = ci.run_code("def f():\n    return 1 / 0\nf()")
    assert ex.error is not None
    assert (ex.error.name, ex.error.value) == ("ZeroDivisionError", "division by zero")
    assert "line 2, in f" in ex.error.traceback
    assert ci.run_code("'still alive'").text == "'still alive'"


def test_stdout_and_stderr_callbacks(ci):
    out, err = [], []
    ex = ci.run_code(
        "import sys\nfor i in range(3): print(i)\nprint('oops', file=sys.stderr)",
        on_stdout=lambda m: out.append(m.line),
        on_stderr=lambda m: err.append(m.line),
    )
    assert out == ["0\n", "1\n", "2\n"] and err == ["oops\n"]
    assert ex.logs.stderr == ["oops\n"]


def test_matplotlib_png(ci):
    ex = ci.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()", timeout=300)
    assert ex.error is None, ex.error
    pngs = [r.png for r in ex.results if r.png]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")


def test_contexts_are_isolated(ci):
    skip_unless_sdk_has(hasattr(ci, "list_code_contexts"), "Sandbox.list_code_contexts")
    ctx = ci.create_code_context()
    assert ctx.language == "python" and ctx.cwd == "/home/user"
    assert ci.run_code("y = 5", context=ctx).error is None
    assert ci.run_code("y", context=ctx).text == "5"
    ex = ci.run_code("y")
    assert ex.error is not None and ex.error.name == "NameError"
    assert any(c.id == ctx.id for c in ci.list_code_contexts())
    ci.remove_code_context(ctx)
    assert all(c.id != ctx.id for c in ci.list_code_contexts())


def test_interpreters_restored_from_one_snapshot_draw_their_own_random_numbers(airlock_server):
    """Interpreters restored from one base snapshot resume its very process: each must still
    draw random numbers of its own (the interpreter reseeds when the sandbox's identity changes)."""
    import time

    from conftest import _native
    from e2b_code_interpreter import Sandbox

    restored, deadline = [], time.time() + 300
    with contextlib.nullcontext() if header_routed() else domain_env():
        while len(restored) < 2:
            assert time.time() < deadline, "no code interpreter restored within 300 s"
            s = Sandbox.create(timeout=300)
            info = _native(airlock_server["url"], airlock_server["key"], "GET", f"/v1/sandboxes/{s.sandbox_id}")
            if info["start"]["from"] == "restore":
                restored.append(s)
            else:
                delete_sandbox(airlock_server, s.sandbox_id)
                time.sleep(2)
        try:
            draws = [s.run_code("import random; random.random()").text for s in restored]
            ids = [s.run_code("open('/etc/machine-id').read().strip()").text for s in restored]
        finally:
            for s in restored:
                delete_sandbox(airlock_server, s.sandbox_id)
    assert all(draws) and draws[0] != draws[1], draws
    assert ids[0] != ids[1], ids
