"""Unmodified e2b-code-interpreter calls against airlock's `code-interpreter-v1` template.

e2b-code-interpreter 2.6.2 reaches the interpreter only at localhost:49999 with E2B_DEBUG=true
(E2B_SANDBOX_URL does not apply to it): airlock serves that port and routes by access token.
Newer versions send it to E2B_SANDBOX_URL with `E2b-Sandbox-Id`/`E2b-Sandbox-Port: 49999` headers,
and there E2B_DEBUG would skip the API altogether, so it is set only for the old ones."""
import inspect
import base64
import os

import pytest

from conftest import delete_sandbox


@pytest.fixture(scope="module")
def ci(airlock_server):
    from e2b_code_interpreter import Sandbox

    header_routed = "get_sandbox_url" in inspect.getsource(Sandbox)
    if not header_routed:
        os.environ["E2B_DEBUG"] = "true"
    try:
        s = Sandbox.create(timeout=900)
        yield s
        delete_sandbox(airlock_server, s.sandbox_id)
    finally:
        os.environ.pop("E2B_DEBUG", None)


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
    ctx = ci.create_code_context()
    assert ctx.language == "python" and ctx.cwd == "/home/user"
    assert ci.run_code("y = 5", context=ctx).error is None
    assert ci.run_code("y", context=ctx).text == "5"
    ex = ci.run_code("y")
    assert ex.error is not None and ex.error.name == "NameError"
    assert any(c.id == ctx.id for c in ci.list_code_contexts())
    ci.remove_code_context(ctx)
    assert all(c.id != ctx.id for c in ci.list_code_contexts())
